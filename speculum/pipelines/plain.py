"""Plain (non-speculative) decoding: one target forward per emitted token.

The baseline every speculative pipeline must match token for token under greedy decoding.

A round may run several plain steps (``pipeline(num_steps=K)``, the engine's
``decode_steps``): no host decision is needed between two plain steps, so K of them run in one
launch (one CUDA graph), and the scheduler applies stop conditions to the K tokens afterwards,
as it does to a speculative round's. :func:`run_steps` is the loop, shared with the EAGLE
family's round without draft tokens (``eagle.plain_round``, adaptive speculation's depth 0).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor

from speculum.pipelines.base import (
    Pipeline,
    PrefillChunk,
    Resources,
    StepOutput,
    prefill_output,
    steps_output,
)
from speculum.spec.paged import extend_batch
from speculum.spec.prefill import prefill_target
from speculum.spec.sampling import guard_logits, no_logprobs, reads_path, sample, token_logprobs
from speculum.state.kv import PagedKV
from speculum.state.record import make, record, replace
from speculum.state.sampling import SamplingParams, TokenLogprobs

__all__ = ["PlainState", "PlainSteps", "prefill", "decode", "run_steps", "pipeline"]


@record
class PlainState:
    """Batch state of plain decoding: the cache and the sampled token not yet in it."""

    kv: PagedKV
    next_tokens: Int[Tensor, " batch"]
    sampling: SamplingParams


class PlainSteps(NamedTuple):
    """What :func:`run_steps` computed: step ``d`` fed token ``d - 1`` (the pending token at
    step 0) and drew ``tokens[:, d]`` from a distribution whose faults are ``faults[:, d]``;
    ``hidden[d]`` (``[batch, 1, hidden]``) and ``captured[d]`` (the layers asked for) are the
    target's states over the token it fed."""

    tokens: Int[Tensor, "batch num_steps"]
    faults: Int[Tensor, "batch num_steps"]
    logprobs: TokenLogprobs
    hidden: list[Float[Tensor, "batch 1 hidden"]]
    captured: list[tuple[Tensor, ...]]


def prefill(resources: Resources, chunk: PrefillChunk) -> tuple[PlainState, StepOutput]:
    """Write a prompt chunk's K/V and sample the token after each row's last chunk token.

    The sample is keyed by the position it will occupy (the new sequence length), so it is the
    same whether the prompt arrived in one chunk or many.
    """
    out = prefill_target(
        resources.target,
        resources.target_pool,
        chunk.kv,
        chunk.tokens,
        chunk.q_lens,
        chunk.sampling,
        next_tokens=chunk.next_tokens,
        num_prompt_logprobs=chunk.prompt_logprobs,
    )
    state = make(PlainState, kv=out.kv, next_tokens=out.first_tokens, sampling=chunk.sampling)
    return state, prefill_output(out.first_tokens, out.faults, out.logprobs, out.prompt_logprobs)


def run_steps(
    resources: Resources,
    kv: PagedKV,
    token: Int[Tensor, " batch"],
    sampling: SamplingParams,
    num_steps: int,
    capture: tuple[int, ...] = (),
) -> PlainSteps:
    """``num_steps`` plain decoding steps after the cache ``kv``, whose pending token is
    ``token``: each step writes one token's K/V at its own position and samples the next
    exactly as a round of one step would, keyed by the position it will occupy (same stream,
    same counter, so the same token whatever ``num_steps`` is).

    The penalties, ``min_tokens`` and the grammar count the tokens drawn earlier in the same
    call, as they would count them once emitted (plain decoding's output would hold them
    already): with them, later steps see the same distributions as single steps do. Pure
    tensor code with no host sync, except a grammar's mask (its host callback runs per step).
    """
    ones = torch.ones_like(kv.seq_lens)
    tokens, hiddens, captures, faults, logits_seen = [], [], [], [], []
    follows_path = reads_path(sampling)
    for step in range(num_steps):
        step_kv = replace(kv, seq_lens=kv.seq_lens + step)
        hidden, captured = resources.target(
            extend_batch(step_kv, token[:, None], ones), resources.target_pool, capture
        )
        drawn = torch.stack(tokens, dim=1) if tokens and follows_path else None
        logits, fault = guard_logits(
            resources.target.logits(hidden[:, 0]),
            sampling.temperature,
            sampling.logit_bias,
            sampling.penalties,
            drawn,
            sampling.grammar,
        )
        token = sample(logits, sampling, step_kv.seq_lens + 1)
        tokens, hiddens, captures = [*tokens, token], [*hiddens, hidden], [*captures, captured]
        faults.append(fault)
        logits_seen.append(logits)
    stacked = torch.stack(tokens, dim=1)
    logprobs = (  # step d's distribution decided token d; nothing stacked when not asked
        token_logprobs(
            torch.stack(logits_seen, dim=1), sampling.temperature, stacked, sampling.num_logprobs
        )
        if sampling.num_logprobs
        else no_logprobs(stacked)
    )
    return PlainSteps(
        tokens=stacked,
        faults=torch.stack(faults, dim=1),
        logprobs=logprobs,
        hidden=hiddens,
        captured=captures,
    )


def decode(
    resources: Resources, state: PlainState, *, num_steps: int = 1
) -> tuple[PlainState, StepOutput]:
    """Feed each request's pending token and run ``num_steps`` plain steps (:func:`run_steps`);
    the last token drawn is the next pending one. Every row emits all ``num_steps`` tokens (up
    to a faulty step); the scheduler cuts them at a stop condition, and the K/V written past
    it lies in slots the request reserved ahead (``Pipeline.kv_lookahead``) and is never read."""
    steps = run_steps(resources, state.kv, state.next_tokens, state.sampling, num_steps)
    kv = replace(state.kv, seq_lens=state.kv.seq_lens + num_steps)
    new_state = replace(state, kv=kv, next_tokens=steps.tokens[:, -1])
    return new_state, steps_output(steps.tokens, steps.faults, steps.logprobs, plain_steps=True)


def pipeline(*, num_steps: int = 1) -> Pipeline:
    """The plain decoding pipeline value, ``num_steps`` plain steps per round (>= 1)."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(
            f"plain decoding runs num_steps >= 1 steps per round, got {num_steps!r}; "
            "1 is one step per launch"
        )
    return Pipeline(
        name="plain",
        prefill=prefill,
        decode=functools.partial(decode, num_steps=num_steps),
        max_tokens_per_step=num_steps,
        kv_lookahead=num_steps,
    )
