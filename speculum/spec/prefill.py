"""Reference target prefill: one prompt chunk through the target, and the token after it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from speculum.spec.paged import extend_batch
from speculum.spec.sampling import guard_logits, sample, token_logprobs
from speculum.state.kv import KVPool, PagedKV
from speculum.state.record import make, record, replace
from speculum.state.sampling import SamplingParams, TokenLogprobs

__all__ = ["TargetPrefill", "prefill_target", "step_logprobs", "chunk_logprobs", "last_valid"]


@record
class TargetPrefill:
    """What a prompt chunk leaves behind: the target's features over the chunk, the cache
    extended by it, and the token sampled after each row's last chunk token with its fault
    status (``spec.sampling.Fault`` bits; both meaningful only for rows whose chunk ends their
    prompt), and that token's log-probabilities (``spec.sampling.token_logprobs``; empty
    unless the sampling settings ask for them). ``prompt_logprobs``, when asked for, are the
    chunk's prompt log-probabilities (:func:`chunk_logprobs`), else None."""

    hidden: Float[Tensor, "batch q hidden"]
    captured: tuple[Float[Tensor, "batch q hidden"], ...]
    kv: PagedKV
    first_tokens: Int[Tensor, " batch"]
    faults: Int[Tensor, " batch"]
    logprobs: TokenLogprobs
    prompt_logprobs: TokenLogprobs | None = None


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
    *,
    next_tokens: Int[Tensor, " batch"] | None = None,
    num_prompt_logprobs: int | None = None,
) -> TargetPrefill:
    """Write a prompt chunk's K/V through ``target`` and sample the token after it.

    The sample is keyed by the position it will occupy (the new sequence length), so it is the
    same whether the prompt arrived in one chunk or many. With ``num_prompt_logprobs`` (not
    None), the chunk's prompt log-probabilities with that many alternatives are computed too
    (:func:`chunk_logprobs`; ``next_tokens`` is the prompt token after each row's chunk, -1
    after the prompt's end, as ``PrefillChunk.next_tokens``).
    """
    batch = replace(extend_batch(kv, tokens, q_lens), prefill=True)
    hidden, captured = target(batch, pool, capture_layers)
    prompt_logprobs = None
    if num_prompt_logprobs is not None:
        targets = torch.where(
            torch.arange(tokens.shape[1], device=tokens.device) == (q_lens - 1)[:, None],
            next_tokens[:, None],
            F.pad(tokens[:, 1:], (0, 1), value=-1),
        )
        prompt_logprobs = chunk_logprobs(target.logits(hidden), targets, num_prompt_logprobs)
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
        prompt_logprobs=prompt_logprobs,
    )


def chunk_logprobs(
    logits: Float[Tensor, "batch q vocab"], targets: Int[Tensor, "batch q"], num_top: int
) -> TokenLogprobs:
    """Prompt log-probabilities (vLLM's ``prompt_logprobs``) over a chunk: entry ``[b, i]``
    is the log-probability of ``targets[b, i]``, the prompt token after chunk token ``i``,
    under the target's raw distribution at token ``i`` (``log_softmax`` of the float32
    logits: no temperature, bias, penalty or grammar, which belong to the sampled output),
    with the ``num_top`` most likely tokens there (at least one is computed: 0 asks for the
    token's own value alone). Entries whose target is -1 (after the prompt's end, padding) are
    meaningless."""
    greedy = torch.zeros(logits.shape[0], device=logits.device)  # the logits as they are
    return token_logprobs(logits, greedy, targets, max(num_top, 1))


def step_logprobs(
    logits: Float[Tensor, "batch vocab"], sampling: SamplingParams, tokens: Int[Tensor, " batch"]
) -> TokenLogprobs:
    """The log-probabilities of one sampled token per row (``spec.sampling.token_logprobs``
    over a round of one token), empty unless ``sampling.num_logprobs > 0``."""
    return token_logprobs(
        logits[:, None], sampling.temperature, tokens[:, None], sampling.num_logprobs
    )
