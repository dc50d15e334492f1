"""What every pipeline shares: the resources it runs on, its inputs and outputs, its shape.

A pipeline is a value: a frozen record of stage functions and static config. The scheduler (ours
or a user's) drives any pipeline through the same two calls, :func:`prefill` for prompt chunks and
:func:`step` for one decoding round, and never looks inside the pipeline's state record beyond
its ``kv`` field.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch
from jaxtyping import Int
from torch import Tensor

from speculum.models.decoder import DecoderModel
from speculum.spec.sampling import count_emitted, first_fault, penalizing
from speculum.state.kv import KVPool, PagedKV
from speculum.state.record import make, record, replace, static
from speculum.state.sampling import SamplingParams, TokenLogprobs
from speculum.state.tree import Verified

__all__ = [
    "Cell",
    "Resources",
    "PrefillChunk",
    "StepOutput",
    "PrefillOutput",
    "Pipeline",
    "one_token_output",
    "prefill_output",
    "steps_output",
    "verified_output",
    "counting",
    "free_drafts",
    "prefill",
    "step",
]


@attrs.define(slots=True, eq=False)
class Cell:
    """A mutable slot holding an immutable value that decoding rounds read and replace (the
    n-gram store). The value is never written in place, so a snapshot keeps it by reference
    and restore puts it back."""

    value: Any


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class Resources:
    """The owned, in-place-written things a pipeline runs on: models and their KV pools.

    Weights never change during decoding; pools are written at the slots the records name.
    ``ngram_store`` is the n-gram store shared by all requests (``pipelines.ngram``) and
    ``goodput`` the adaptive pipeline's measurements (``pipelines.adaptive``), each in a
    :class:`Cell` whose value each round replaces.
    """

    target: DecoderModel
    target_pool: KVPool
    draft: Any = None
    draft_pool: KVPool | None = None
    ngram_store: Cell | None = None
    goodput: Cell | None = None

    @property
    def cells(self) -> tuple[Cell, ...]:
        """Every shared cell, in a fixed order (snapshots keep their values)."""
        return tuple(c for c in (self.ngram_store, self.goodput) if c is not None)

    @property
    def pools(self) -> tuple[KVPool, ...]:
        """Every KV pool, in a fixed order (snapshots copy pages out of each).

        A draft's pool is indexed by the same page ids as the target's: one allocator and one
        page table serve both.
        """
        extra = () if self.draft_pool is None else (self.draft_pool,)
        return (self.target_pool, *extra)


@record
class PrefillChunk:
    """The next ``q_lens[b]`` prompt tokens of each request, padded to ``q`` columns.

    ``kv.seq_lens`` counts the prompt tokens already in the cache; ``next_tokens[b]`` is the
    prompt token right after the chunk, -1 when the chunk ends the prompt (drafts that pair
    each position with the token after it need it). ``prefix_tokens[b, :kv.seq_lens[b]]``, when
    given (it may live on the host), are the prompt tokens already in the cache: drafters that
    match on token history (n-gram) need them; others ignore them. The pipeline's prefill
    returns its batch state and a one-token :class:`StepOutput` per row; only rows whose chunk
    ends their prompt use them (the scheduler knows which).
    """

    kv: PagedKV
    tokens: Int[Tensor, "batch q"]
    q_lens: Int[Tensor, " batch"]
    next_tokens: Int[Tensor, " batch"]
    sampling: SamplingParams
    prefix_tokens: Int[Tensor, "batch prefix"] | None = None
    prompt_logprobs: int | None = static(default=None)


@record
class StepOutput:
    """Tokens a decoding round emits per request: ``tokens[b, :num_tokens[b]]``, the rest -1.

    ``faults[b]`` is request ``b``'s fault status (``spec.sampling.Fault`` bits): nonzero when
    its logits could not be sampled (NaN, an overflow, nothing to draw). Its tokens are then
    meaningless, and a scheduler finishes that request alone with an error; every other row's
    tokens are exactly what they would be without it. ``plain_steps`` marks a round made of
    plain decoding steps, one target forward per token (plain decoding, adaptive
    speculation's depth 0): statistics count each of its tokens as a round of its own.
    ``logprobs`` are the target's log-probabilities of ``tokens`` and their top alternatives
    (``spec.sampling.token_logprobs``): every pipeline fills them, with
    ``SamplingParams.num_logprobs`` alternatives (none, and zeros, when that is 0); ``None``
    only in outputs built without.
    """

    tokens: Int[Tensor, "batch max_tokens"]
    num_tokens: Int[Tensor, " batch"]
    faults: Int[Tensor, " batch"]
    plain_steps: bool = static(default=False)
    logprobs: TokenLogprobs | None = None


@record
class PrefillOutput(StepOutput):
    """A prefill chunk's :class:`StepOutput` (each row's first token), with the chunk's
    ``prompt_logprobs`` when it asked for them (``PrefillChunk.prompt_logprobs``): entry
    ``[b, i]`` is the prompt token after chunk token ``i`` (``spec.prefill.chunk_logprobs``);
    otherwise None. A class of its own so that decoding rounds, whose outputs a CUDA graph
    captures, hold tensors alone."""

    prompt_logprobs: TokenLogprobs | None = None


@record
class Pipeline:
    """A decoding algorithm as a value.

    ``prefill(resources, chunk) -> (state, first_tokens)`` and
    ``decode(resources, state) -> (state, output)`` are its stage compositions;
    ``max_tokens_per_step`` bounds ``output.num_tokens`` and ``kv_lookahead`` is how many cache
    slots past the emitted tokens a round may write (the scheduler reserves them).
    ``host_work`` marks a decode that runs host code between device stages (n-gram lookups);
    such a round cannot be captured into one CUDA graph. Its part that runs on the device
    alone may be given as ``device_round(resources, inputs)``: ``decode`` then accepts a
    ``device_round`` keyword, through which the engine passes a captured version of it.
    """

    name: str = static()
    prefill: Callable[[Resources, PrefillChunk], tuple[Any, StepOutput]] = static()
    decode: Callable[[Resources, Any], tuple[Any, StepOutput]] = static()
    max_tokens_per_step: int = static()
    kv_lookahead: int = static()
    host_work: bool = static(default=False)
    device_round: Callable[[Resources, Any], Any] | None = static(default=None)


def one_token_output(
    tokens: Int[Tensor, " batch"],
    faults: Int[Tensor, " batch"],
    logprobs: TokenLogprobs | None = None,
) -> StepOutput:
    """The output of a step that samples one token per row (a prefill's first token, a plain
    decoding step), with the faults of the distributions they were drawn from (a faulty row
    emits nothing) and the tokens' log-probabilities."""
    return steps_output(tokens[:, None], faults[:, None], logprobs)


def steps_output(
    tokens: Int[Tensor, "batch num_steps"],
    faults: Int[Tensor, "batch num_steps"],
    logprobs: TokenLogprobs | None = None,
    *,
    plain_steps: bool = False,
) -> StepOutput:
    """The output of ``num_steps`` steps that sample one token per row each (``tokens[:, d]``
    drawn from a distribution whose faults are ``faults[:, d]``): every row emits all of them,
    cut before its first faulty step (``spec.sampling.first_fault``), whose faults it
    reports."""
    steps = torch.full_like(tokens[:, 0], tokens.shape[1])
    num_tokens, faults = first_fault(faults, steps)
    return make(
        StepOutput,
        tokens=tokens,
        num_tokens=num_tokens,
        faults=faults,
        plain_steps=plain_steps,
        logprobs=logprobs,
    )


def prefill_output(
    tokens: Int[Tensor, " batch"],
    faults: Int[Tensor, " batch"],
    logprobs: TokenLogprobs,
    prompt_logprobs: TokenLogprobs | None,
) -> PrefillOutput:
    """A prefill chunk's output: :func:`one_token_output` of its first tokens, with the
    chunk's prompt log-probabilities (None when not asked for)."""
    out = one_token_output(tokens, faults, logprobs)
    return make(
        PrefillOutput,
        tokens=out.tokens,
        num_tokens=out.num_tokens,
        faults=out.faults,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def verified_output(verified: Verified) -> StepOutput:
    """What a verified round emits: the accepted tokens and the bonus token, cut before the
    first one decided by a faulty distribution (``spec.sampling.first_fault``), whose faults
    it reports. Token ``d`` was decided by the distribution at the path's node of depth ``d``;
    faulty nodes off the path decided nothing emitted. The tokens' log-probabilities were read
    from those same path nodes (``spec.verify.path_logprobs``)."""
    acc = verified.accepted
    on_path = verified.faults.gather(1, acc.path.clamp(min=0))
    num_tokens, faults = first_fault(on_path, acc.num_accepted + 1)
    return make(
        StepOutput,
        tokens=acc.emitted,
        num_tokens=num_tokens,
        faults=faults,
        logprobs=verified.logprobs,
    )


def counting(pipeline: Pipeline) -> Pipeline:
    """``pipeline`` whose prefill and decoding rounds add the tokens they emit to the
    requests' penalty counts (``spec.sampling.count_emitted``), so that the next round's
    distributions penalize them (``SamplingParams.penalties``). Only emitted tokens are
    added, after the round: a rejected draft token never is, a state kept from before a round
    keeps its counts by value. Engines that apply penalties wrap their pipeline so
    (``runtime.engine``); a scheduler of its own wraps it likewise."""
    return _around(pipeline, _counted)


def _around(pipeline: Pipeline, wrapper: Callable[..., tuple[Any, StepOutput]]) -> Pipeline:
    """``pipeline`` whose prefill and decode each run inside ``wrapper(resources, inputs,
    run=the stage, **options)``."""
    return replace(
        pipeline,
        prefill=functools.partial(wrapper, run=pipeline.prefill),
        decode=functools.partial(wrapper, run=pipeline.decode),
    )


def _counted(
    resources: Resources,
    inputs: Any,
    *,
    run: Callable[..., tuple[Any, StepOutput]],
    **options: Any,
) -> tuple[Any, StepOutput]:
    """``run(resources, inputs, **options)``, with the tokens it emitted counted in its
    state's penalties (``options``: a host-work round's ``device_round``)."""
    state, output = run(resources, inputs, **options)
    sampling = state.sampling
    if not penalizing(sampling.penalties):
        return state, output
    penalties = count_emitted(sampling.penalties, output.tokens, output.num_tokens)
    return replace(state, sampling=replace(sampling, penalties=penalties)), output


def free_drafts(pipeline: Pipeline) -> Pipeline:
    """``pipeline`` whose drafts ignore the requests' grammars: inside its prefill and decoding
    rounds ``SamplingParams.masked_drafts`` is False, so only the target's distributions are
    masked (``spec.sampling.drafting``) and a round asks the grammar once, for the verified
    tree's nodes, instead of once per draft level too (``docs/request_controls.md``, "Masked
    or free drafts"). Exact either way. The flag is set on the way in and restored on the way
    out, so the states the scheduler keeps, joins and snapshots are those of any engine.
    Engines built with ``SpecOptions.grammar_drafts="free"`` wrap their pipeline so
    (``runtime.engine``)."""
    return _around(pipeline, _free)


def _free(
    resources: Resources,
    inputs: Any,
    *,
    run: Callable[..., tuple[Any, StepOutput]],
    **options: Any,
) -> tuple[Any, StepOutput]:
    """``run(resources, inputs, **options)`` with ``inputs.sampling.masked_drafts`` False
    while it runs (``options``: a host-work round's ``device_round``)."""
    sampling = inputs.sampling
    free = replace(inputs, sampling=replace(sampling, masked_drafts=False))
    state, output = run(resources, free, **options)
    kept = replace(state.sampling, masked_drafts=sampling.masked_drafts)
    return replace(state, sampling=kept), output


def prefill(
    pipeline: Pipeline, resources: Resources, chunk: PrefillChunk
) -> tuple[Any, StepOutput]:
    """Run one prefill chunk through ``pipeline``: its batch state and each row's next token."""
    return pipeline.prefill(resources, chunk)


def step(pipeline: Pipeline, resources: Resources, state: Any) -> tuple[Any, StepOutput]:
    """One decoding round of ``pipeline`` over the batch ``state``."""
    return pipeline.decode(resources, state)
