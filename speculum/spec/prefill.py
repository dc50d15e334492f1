"""Reference target prefill: one prompt chunk through the target, and the token after it."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from speculum.spec.paged import extend_batch
from speculum.spec.sampling import guard_logits, sample, token_logprobs
from speculum.state.kv import KVPool, PagedKV
from speculum.state.record import make, record, replace
from speculum.state.sampling import SamplingParams, TokenLogprobs

__all__ = ["TargetPrefill", "prefill_target", "step_logprobs", "last_valid"]


@record
class TargetPrefill:
    """What a prompt chunk leaves behind: the target's features over the chunk, the cache
    extended by it, and the token sampled after each row's last chunk token with its fault
    status (``spec.sampling.Fault`` bits; both meaningful only for rows whose chunk ends their
    prompt), and that token's log-probabilities (``spec.sampling.token_logprobs``; empty
    unless the sampling settings ask for them)."""

    hidden: Float[Tensor, "batch q hidden"]
    captured: tuple[Float[Tensor, "batch q hidden"], ...]
    kv: PagedKV
    first_tokens: Int[Tensor, " batch"]
    faults: Int[Tensor, " batch"]
    logprobs: TokenLogprobs


def last_valid(x: Tensor, lengths: Int[Tensor, " batch"]) -> Tensor:
    """``x[b, lengths[b] - 1]`` for each row (rows of length 0 read index 0)."""
    rows = torch.arange(x.shape[0], device=x.device)
    return x[rows, (lengths - 1).clamp(min=0)]


def prefill_target(
    target: Any,
    pool: KVPool,
    kv: PagedKV,
    tokens: Int[Tensor, "batch q"],
    q_lens: Int[Tensor, " batch"],
    sampling: SamplingParams,
    capture_layers: tuple[int, ...] = (),
) -> TargetPrefill:
    """Write a prompt chunk's K/V through ``target`` and sample the token after it.

    The sample is keyed by the position it will occupy (the new sequence length), so it is the
    same whether the prompt arrived in one chunk or many.
    """
    hidden, captured = target(extend_batch(kv, tokens, q_lens), pool, capture_layers)
    seq_lens = kv.seq_lens + q_lens
    logits, faults = guard_logits(
        target.logits(last_valid(hidden, q_lens)),
        sampling.temperature,
        sampling.logit_bias,
        sampling.penalties,
        grammar=sampling.grammar,
    )
    first_tokens = sample(logits, sampling, seq_lens)
    return make(
        TargetPrefill,
        hidden=hidden,
        captured=captured,
        kv=replace(kv, seq_lens=seq_lens),
        first_tokens=first_tokens,
        faults=faults,
        logprobs=step_logprobs(logits, sampling, first_tokens),
    )


def step_logprobs(
    logits: Float[Tensor, "batch vocab"], sampling: SamplingParams, tokens: Int[Tensor, " batch"]
) -> TokenLogprobs:
    """The log-probabilities of one sampled token per row (``spec.sampling.token_logprobs``
    over a round of one token), empty unless ``sampling.num_logprobs > 0``."""
    return token_logprobs(
        logits[:, None], sampling.temperature, tokens[:, None], sampling.num_logprobs
    )
