"""Per-request sampling settings, as a batch record, and the log-probabilities a round reports."""

from __future__ import annotations

from jaxtyping import Float, Int
from torch import Tensor

from speculum.state.record import record, static

__all__ = ["SamplingParams", "TokenLogprobs"]


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
    """

    temperature: Float[Tensor, " batch"]
    top_k: Int[Tensor, " batch"]
    top_p: Float[Tensor, " batch"]
    min_p: Float[Tensor, " batch"]
    seed: Int[Tensor, " batch"]
    num_logprobs: int = static(default=0)
    logit_bias: Float[Tensor, "batch bias_vocab"] | None = None


@record
class TokenLogprobs:
    """The target's log-probabilities of a round's emitted tokens (``spec.sampling
    .token_logprobs``): ``chosen[b, d]`` is token ``d``'s own, ``top_ids[b, d]`` and
    ``top_logprobs[b, d]`` the ``num_logprobs`` most likely tokens of the distribution that
    decided it, most likely first. Entries past a row's emitted tokens are meaningless."""

    chosen: Float[Tensor, "batch tokens"]
    top_ids: Int[Tensor, "batch tokens num_top"]
    top_logprobs: Float[Tensor, "batch tokens num_top"]
