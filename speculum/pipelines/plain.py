"""Plain (non-speculative) decoding: one target forward per emitted token.

The baseline every speculative pipeline must match token for token under greedy decoding.
"""

from __future__ import annotations

import torch
from jaxtyping import Int
from torch import Tensor

from speculum.pipelines.base import (
    Pipeline,
    PrefillChunk,
    Resources,
    StepOutput,
    one_token_output,
    prefill_output,
)
from speculum.spec.paged import extend_batch
from speculum.spec.prefill import prefill_target, step_logprobs
from speculum.spec.sampling import guard_logits, sample
from speculum.state.kv import PagedKV
from speculum.state.record import make, record, replace
from speculum.state.sampling import SamplingParams

__all__ = ["PlainState", "prefill", "decode", "pipeline"]


@record
class PlainState:
    """Batch state of plain decoding: the cache and the sampled token not yet in it."""

    kv: PagedKV
    next_tokens: Int[Tensor, " batch"]
    sampling: SamplingParams


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


def decode(resources: Resources, state: PlainState) -> tuple[PlainState, StepOutput]:
    """Feed each request's pending token, write its K/V, and sample the next one."""
    ones = torch.ones_like(state.kv.seq_lens)
    batch = extend_batch(state.kv, state.next_tokens[:, None], ones)
    hidden, _ = resources.target(batch, resources.target_pool)
    seq_lens = state.kv.seq_lens + 1
    sampling = state.sampling
    logits, faults = guard_logits(
        resources.target.logits(hidden[:, 0]),
        sampling.temperature,
        sampling.logit_bias,
        sampling.penalties,
        grammar=sampling.grammar,
    )
    tokens = sample(logits, state.sampling, seq_lens)
    new_state = replace(state, kv=replace(state.kv, seq_lens=seq_lens), next_tokens=tokens)
    logprobs = step_logprobs(logits, state.sampling, tokens)
    return new_state, one_token_output(tokens, faults, logprobs)


def pipeline() -> Pipeline:
    """The plain decoding pipeline value."""
    return Pipeline(
        name="plain", prefill=prefill, decode=decode, max_tokens_per_step=1, kv_lookahead=1
    )
