"""Per-request sampling settings, as a batch record, and the log-probabilities a round reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.state.record import record, static

__all__ = ["HostGrammar", "Penalties", "SamplingParams", "TokenLogprobs"]


@record
class Penalties:
    """Each request's repetition, presence and frequency penalties and ``min_tokens``, with
    the token history they read (``spec.sampling.penalized_logits``), as device tensors.

    ``repetition`` (1 is off) divides the positive logits and multiplies the negative ones of
    every token of the prompt (``prompt[b, t]``) or of the output; ``presence`` is subtracted
    from the logit of every token of the output, ``frequency`` once per occurrence
    (``counts[b, t]``, how many times token ``t`` was emitted). ``stops[b, t]`` marks the tokens
    that end request ``b`` (EOS unless ignored, its stop token ids): they are banned while
    fewer than ``min_tokens[b]`` tokens have been generated (``num_output[b]`` so far).

    ``counts`` and ``num_output`` cover every token emitted so far, the one a round's root
    holds included: rounds read them as they start and add the tokens on a tree path to them
    for each node, and only the emitted tokens are added to them after the round
    (``pipelines.base.count_emitted``), so a rejected draft never enters them and a snapshot
    keeps them by value. With no columns (an engine built without penalties) nothing is
    stored and nothing applied.
    """

    repetition: Float[Tensor, " batch"]
    presence: Float[Tensor, " batch"]
    frequency: Float[Tensor, " batch"]
    min_tokens: Int[Tensor, " batch"]
    num_output: Int[Tensor, " batch"]
    prompt: Bool[Tensor, "batch penalty_vocab"]
    counts: Int[Tensor, "batch penalty_vocab"]
    stops: Bool[Tensor, "batch penalty_vocab"]


@record
class SamplingParams:
    """How each request turns logits into a token.

    ``temperature == 0`` is greedy (argmax); ``top_k == 0``, ``top_p == 1`` and ``min_p == 0``
    switch the corresponding filter off. ``seed`` keys the request's counter-based random
    streams: a request's draws depend only on its seed and on token positions, never on the
    batch it runs in, so snapshot/restore and re-batching replay bit-exactly.

    ``num_logprobs`` (static: the engine's ``max_logprobs``) is how many top alternatives every
    emitted token reports with its own log-probability (:class:`TokenLogprobs`); 0 computes no
    log-probabilities at all (the record is then zeros with no alternatives). It is the same
    for the whole batch, so a round's shapes never depend on which requests ask for them.

    ``logit_bias[b, t]`` is added to request ``b``'s target logit of token ``t`` before
    anything else reads it (temperature, filters, log-probabilities; ``spec.sampling
    .biased_logits``); zeros for a request without one. With no columns (the scheduler's rows
    for an engine built without ``logit_bias``), or ``None``, it adds nothing and costs
    nothing; captured rounds need the former, a tensor.

    ``penalties`` are the requests' repetition, presence and frequency penalties and
    ``min_tokens`` (:class:`Penalties`), applied after the bias; ``None``, or with no columns,
    applies none.

    ``grammar``, when a request of the batch has one (structured output), is a host function:
    given path tokens ``[batch, *rows, length]`` (padding -1; each row's tokens added to its
    request's output before the round, as ``spec.tree.tree_path_tokens`` gives them per tree
    node), it returns which tokens each row's grammar allows next, as int32 bitmasks
    ``[batch, *rows, ceil(vocab / 32)]`` packed as xgrammar packs them (token ``t`` is bit
    ``t % 32`` of word ``t // 32``; all ones for requests without one) on the device. Every
    target distribution and every draft distribution applies it before anything reads it
    (``spec.sampling.grammar_logits``); a static field, so a round with one is a round of its
    own kind: on CUDA, graphs cut at each call (``runtime.graphs.capture_cut``). A host
    drafter (n-gram) also calls its ``legal(row, path)`` (:class:`HostGrammar`) to prune its
    proposals, and computes its tree's masks before the round.

    ``masked_drafts`` (a static field) says whether the draft's distributions apply the
    grammar too (``runtime.engine.SpecOptions.grammar_drafts``: ``"masked"``, the default) or
    only the target's do (``"free"``: the draft proposes unconstrained, and a round asks the
    grammar once, at its verify); ``spec.sampling.drafting`` reads it. Both are exact.

    ``filters`` (static, set by the scheduler for each round) says that a row of the batch has a
    top-k, top-p or min-p filter. It only picks kernels (``spec.sampling
    ._filtered_probs_core``): False is always correct, and no row's distribution depends on
    the other rows' settings either way.
    """

    temperature: Float[Tensor, " batch"]
    top_k: Int[Tensor, " batch"]
    top_p: Float[Tensor, " batch"]
    min_p: Float[Tensor, " batch"]
    seed: Int[Tensor, " batch"]
    num_logprobs: int = static(default=0)
    logit_bias: Float[Tensor, "batch bias_vocab"] | None = None
    penalties: Penalties | None = None
    grammar: Callable[[Tensor], Tensor] | None = static(default=None)
    masked_drafts: bool = static(default=True)
    filters: bool = static(default=False)


class HostGrammar(Protocol):
    """What a host drafter reads of ``SamplingParams.grammar`` (the scheduler's callback is
    one): the packed masks after path tokens, and whether row ``row``'s grammar accepts the
    draft tokens ``path`` after the request's output."""

    def __call__(self, paths: Tensor) -> Tensor: ...

    def legal(self, row: int, path: tuple[int, ...]) -> bool: ...


@record
class TokenLogprobs:
    """The target's log-probabilities of a round's emitted tokens (``spec.sampling
    .token_logprobs``): ``chosen[b, d]`` is token ``d``'s own, ``top_ids[b, d]`` and
    ``top_logprobs[b, d]`` the ``num_logprobs`` most likely tokens of the distribution that
    decided it, most likely first. Entries past a row's emitted tokens are meaningless."""

    chosen: Float[Tensor, "batch tokens"]
    top_ids: Int[Tensor, "batch tokens num_top"]
    top_logprobs: Float[Tensor, "batch tokens num_top"]
