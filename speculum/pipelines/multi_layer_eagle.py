"""Multi-layer EAGLE: ``K = num_steps`` separate MTP layers, one per draft depth (a chain).

Notation (1-based layers): tokens ``t_0 .. t_N`` are known, ``t_N`` is the root (the last
verified token) and the target cache holds entries ``0 .. N - 1``; ``h_j`` is the target's
final-normed hidden state of token ``j``. Layer ``k``'s cache entry ``j`` (layer ``k - 1`` of
the draft pool, rotary position ``j``) pairs ``h^{k-1}_j`` with token ``t_{j+k}`` and predicts
``t_{j+k+1}``; ``h^0 = h`` and, with ``chain_hidden``, ``h^{k-1}_j`` is layer ``k - 1``'s output
at entry ``j`` (otherwise every layer reads ``h``). The next round's chain is
``d_k`` = layer ``k`` at entry ``N - 1`` with token ``d_{k-1}`` (``d_0 = t_N``): all of it comes
out of draft-extend, and :func:`draft` only arranges it under the root.

Entries of layer ``k`` with ``j + k > N`` hold *speculative* tokens (``t_{N+i} = d_i``), so
after a round that accepts ``A`` tokens (``N' = N + A + 1``) layer ``k`` re-runs entries
``N - k + 1 .. N' - 1`` (``A + k`` of them; entries below 0 do not exist and are skipped). In
every layer the re-run's column ``c`` reads token ``t_{N+1+c}``: the emitted tokens, then the
new chain ``d'_1 .. d'_{k-1}`` (already produced by the layers before it). Its input hidden at
column ``c`` (entry ``N - k + 1 + c``) is:

- layer 1: ``h`` of the accepted path nodes (entries ``N .. N'-1``);
- with ``chain_hidden``: layer ``k - 1``'s re-run output at column ``c - 1`` for ``c >= 1`` (the
  same entry) and, at ``c = 0``, the *carried* ``h^{k-1}_{N-k+1}`` (final since an earlier
  round: its token ``t_N`` was real);
- without: ``h`` at entries ``N - k + 1 .. N - 1`` carried, then the path nodes'.

The carry is ``[batch, K, hidden]``: with ``chain_hidden`` column ``k`` is
``h^k_{N-k}`` (column 0 unused); without, column ``i`` is ``h_{N-K+i}``.

Prefill of a chunk of target entries ``S .. P - 1`` runs every layer over the same entries with
tokens ``t_{j+k}``: the chunk, the token after it (the next prompt token or the first sampled
token), then ``d_1 .. d_{k-1}``. A chunk boundary is never revisited (the scheduler keeps no
state between chunks): the last ``k - 1`` entries of layer ``k`` before a boundary keep the
draft's own guesses of the next prompt tokens, and carried hidden states that would come from an
earlier chunk are zeros. That only lowers acceptance; the output is the target's either way.

Drafts are argmax chains; sampled requests verify them as one-hot drafts (lossless).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from speculum.pipelines import eagle
from speculum.pipelines.base import (
    Pipeline,
    PrefillChunk,
    Resources,
    StepOutput,
    prefill_output,
    verified_output,
)
from speculum.spec.draft import gather_nodes, last_valid
from speculum.spec.paged import extend_batch
from speculum.spec.prefill import prefill_target
from speculum.spec.sampling import (
    biased_logits,
    drafting,
    grammar_logits,
    penalized_logits,
    reads_path,
)
from speculum.spec.tree import chain_tree
from speculum.state.draft import EagleConfig
from speculum.state.kv import PagedKV
from speculum.state.record import make, record, replace
from speculum.state.sampling import SamplingParams
from speculum.state.tree import DraftTree, Verified

__all__ = [
    "MultiLayerState",
    "Carried",
    "prefill",
    "draft",
    "verify",
    "commit",
    "draft_extend",
    "decode",
    "pipeline",
]


@record
class Carried:
    """What draft-extend hands the next round: the chain ``d_1 .. d_K`` and the carried
    hidden states (see the module docstring for the carry's columns)."""

    chain: Int[Tensor, "batch num_steps"]
    hidden: Float[Tensor, "batch num_steps hidden"]


@record
class MultiLayerState:
    """Batch state between rounds: the target cache (``kv.seq_lens = N`` entries; the draft
    pool's layer ``k - 1`` holds layer ``k``'s entries ``0 .. N - 1``), the root ``t_N``, and
    the carried chain and hidden states."""

    kv: PagedKV
    root_tokens: Int[Tensor, " batch"]
    carried: Carried
    sampling: SamplingParams


def _run_layer(
    resources: Resources,
    k: int,
    kv: PagedKV,
    start: Int[Tensor, " batch"],
    tokens: Int[Tensor, "batch width"],
    hidden: Float[Tensor, "batch width hidden"],
    q_lens: Int[Tensor, " batch"],
) -> Float[Tensor, "batch width hidden"]:
    """Layer ``k`` (1-based) over entries ``start .. start + q_lens - 1``, column ``c`` at
    entry ``start + c``; entries below 0 (``start < 0``) are skipped. The output is aligned
    with the input columns (skipped and padding columns hold garbage)."""
    width = tokens.shape[1]
    skip = (-start).clamp(min=0)
    cols = torch.arange(width, device=tokens.device)[None, :]
    source = (cols + skip[:, None]).clamp(max=width - 1)
    batch = extend_batch(
        replace(kv, seq_lens=start + skip), tokens.gather(1, source), q_lens - skip
    )
    out = resources.draft.layer_forward(
        k - 1, batch, resources.draft_pool, gather_nodes(hidden, source)
    )
    return gather_nodes(out, (cols - skip[:, None]).clamp(min=0))


def _argmax(
    resources: Resources,
    k: int,
    hidden: Tensor,
    sampling: SamplingParams,
    path: Int[Tensor, "batch length"] | None,
) -> Int[Tensor, " batch"]:
    """Layer ``k``'s draft token: the argmax of its logits under the requests' bias,
    penalties and grammar, these counting (the grammar: masking after) ``path`` (tokens
    emitted or drafted since the counts were last updated and the round started; None without
    penalties or grammar) too; with free drafts (``spec.sampling.drafting``) no grammar."""
    logits = biased_logits(resources.draft.layer_logits(k - 1, hidden), sampling.logit_bias)
    logits = penalized_logits(logits, sampling.penalties, path)
    return grammar_logits(logits, drafting(sampling).grammar, path).argmax(-1)


def _chain_path(
    sampling: SamplingParams, uncounted: Int[Tensor, "batch n"], chain: list[Tensor]
) -> Int[Tensor, "batch length"] | None:
    """The tokens a chain's next draft follows beyond the counted output: ``uncounted``
    (padding -1) then the chain drafted so far; None without penalties or a grammar on the
    drafts (``spec.sampling.drafting``)."""
    if not reads_path(drafting(sampling)):
        return None
    return torch.cat([uncounted, *(d[:, None] for d in chain)], dim=1)


def _column(x: Float[Tensor, "batch n hidden"], index: Int[Tensor, " batch"]) -> Tensor:
    """``x[b, index[b]]``, zeros where ``index`` is outside ``0 .. n - 1``."""
    inside = (index >= 0) & (index < x.shape[1])
    picked = gather_nodes(x, index.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
    return torch.where(inside[:, None], picked, torch.zeros_like(picked))


def _check_head(resources: Resources, num_steps: int) -> None:
    layers = getattr(resources.draft, "num_layers", None)
    if layers != num_steps or not hasattr(resources.draft, "layer_forward"):
        raise ValueError(
            f"multi-layer EAGLE with num_steps={num_steps} needs a head of {num_steps} MTP "
            f"layers (speculum.models.multi_layer_eagle), got {type(resources.draft).__name__} "
            f"with {layers} layers"
        )


def prefill(
    resources: Resources, chunk: PrefillChunk, *, config: EagleConfig, chain_hidden: bool
) -> tuple[MultiLayerState, StepOutput]:
    """Target prefill of a prompt chunk, then each layer over the chunk's entries."""
    num_steps = config.num_steps
    _check_head(resources, num_steps)
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
    hidden, first, seq_lens = out.hidden, out.first_tokens, out.kv.seq_lens
    faults, logprobs, prompt_logprobs = out.faults, out.logprobs, out.prompt_logprobs
    q, width = chunk.q_lens, chunk.tokens.shape[1]
    following = torch.where(chunk.next_tokens >= 0, chunk.next_tokens, first)
    # stream[:, i] = t_{S + i}: the chunk, the token after it, then d_1, d_2, ...
    stream = F.pad(chunk.tokens, (0, num_steps + 1)).scatter(1, q[:, None], following[:, None])
    chain, carry = [], [torch.zeros_like(hidden[:, 0])]
    inputs = hidden
    for k in range(1, num_steps + 1):
        out = _run_layer(
            resources, k, chunk.kv, chunk.kv.seq_lens, stream[:, k : k + width], inputs, q
        )
        path = _chain_path(chunk.sampling, first[:, None], chain)  # first: not yet counted
        d = _argmax(resources, k, last_valid(out, q), chunk.sampling, path)
        chain.append(d)
        stream = stream.scatter(1, (q + k)[:, None], d[:, None])
        if chain_hidden:
            carry.append(_column(out, q - k))  # h^k at entry P - k
            inputs = out
    if not chain_hidden:
        carry = [_column(hidden, q - num_steps + i) for i in range(num_steps)]  # h_{P-K+i}
    carried = make(
        Carried, chain=torch.stack(chain, dim=1), hidden=torch.stack(carry[:num_steps], dim=1)
    )
    state = make(
        MultiLayerState,
        kv=replace(chunk.kv, seq_lens=seq_lens),
        root_tokens=first,
        carried=carried,
        sampling=chunk.sampling,
    )
    return state, prefill_output(first, faults, logprobs, prompt_logprobs)


def draft(state: MultiLayerState) -> DraftTree:
    """The carried chain under the root: node ``i`` is ``d_i``, child of node ``i - 1``."""
    return chain_tree(state.root_tokens, state.carried.chain)


def verify(
    resources: Resources, state: MultiLayerState, tree: DraftTree, config: EagleConfig
) -> Verified:
    """One target forward over the chain, then acceptance (one-hot drafts): EAGLE's verify
    (the head captures no target layers)."""
    return eagle.verify(resources, state, tree, config)


def commit(resources: Resources, state: MultiLayerState, verified: Verified) -> PagedKV:
    """The accepted path becomes the committed sequence of the target cache (EAGLE's commit;
    the draft pool is caught up by :func:`draft_extend`)."""
    return eagle.commit(resources, state, verified.accepted)


def draft_extend(
    resources: Resources, state: MultiLayerState, verified: Verified, *, chain_hidden: bool
) -> Carried:
    """The layered re-run: layer ``k`` over entries ``N - k + 1 .. N' - 1``, producing the
    next chain ``d'_1 .. d'_K`` and the next carry (module docstring)."""
    carry, num_steps = state.carried.hidden, state.carried.chain.shape[1]
    acc, n = verified.accepted, state.kv.seq_lens
    new_hidden = gather_nodes(verified.final_hidden, acc.path)  # h_{N + c}, c = 0 .. K
    # stream[:, c] = t_{N + 1 + c}: emitted tokens, then the new chain at A + 1, A + 2, ...
    stream = F.pad(acc.emitted.clamp(min=0), (0, num_steps))
    history = torch.cat([carry[:, 1:], new_hidden], dim=1)  # column i: h_{N - K + 1 + i}
    chain, next_carry = [], [torch.zeros_like(carry[:, 0])]
    # The round's emitted tokens are counted only after it.
    steps = torch.arange(acc.emitted.shape[1], device=acc.emitted.device)
    emitted = torch.where(steps <= acc.num_accepted[:, None], acc.emitted, -1)
    out = new_hidden
    for k in range(1, num_steps + 1):
        width = num_steps + k
        if k == 1:
            inputs = new_hidden
        elif chain_hidden:
            inputs = torch.cat([carry[:, k - 1 : k], out], dim=1)
        else:
            inputs = history[:, num_steps - k :]
        q = acc.num_accepted + k
        out = _run_layer(resources, k, state.kv, n - k + 1, stream[:, :width], inputs, q)
        path = _chain_path(state.sampling, emitted, chain)
        d = _argmax(resources, k, last_valid(out, q), state.sampling, path)
        chain.append(d)
        stream = stream.scatter(1, (acc.num_accepted + k)[:, None], d[:, None])
        next_carry.append(_column(out, acc.num_accepted))  # h^k at entry N' - k
    if not chain_hidden:
        next_carry = [_column(history, acc.num_accepted + i) for i in range(num_steps)]
    return make(
        Carried,
        chain=torch.stack(chain, dim=1),
        hidden=torch.stack(next_carry[:num_steps], dim=1),
    )


def decode(
    resources: Resources, state: MultiLayerState, *, config: EagleConfig, chain_hidden: bool
) -> tuple[MultiLayerState, StepOutput]:
    """One round: arrange the chain, verify, accept, commit, then the layered re-run."""
    verified = verify(resources, state, draft(state), config)
    kv = commit(resources, state, verified)
    carried = draft_extend(resources, state, verified, chain_hidden=chain_hidden)
    acc = verified.accepted
    bonus = acc.emitted.gather(1, acc.num_accepted[:, None])[:, 0]
    new_state = replace(state, kv=kv, root_tokens=bonus, carried=carried)
    return new_state, verified_output(verified)


def pipeline(
    *,
    num_steps: int = 3,
    vocab_size: int,
    chain_hidden: bool = True,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    sample_drafts: bool = False,
) -> Pipeline:
    """The multi-layer EAGLE pipeline value: a chain of ``num_steps`` draft tokens, one per
    MTP layer of the head (``topk`` must be 1, ``num_draft_tokens`` ``num_steps + 1``)."""
    if topk != 1 or sample_drafts:
        raise ValueError(
            "multi-layer EAGLE drafts one argmax chain (one MTP layer per depth): use topk=1 "
            "and sample_drafts=False"
        )
    if num_draft_tokens not in (None, num_steps + 1):
        raise ValueError(
            f"multi-layer EAGLE verifies the whole chain: num_draft_tokens must be "
            f"num_steps + 1 = {num_steps + 1}, not {num_draft_tokens}"
        )
    config = eagle.round_config(num_steps=num_steps, topk=1, vocab_size=vocab_size)
    # Verify writes entries N .. N + K; draft-extend's layers write entries below N' <= N + K + 1.
    return Pipeline(
        name="multi_layer_eagle",
        prefill=functools.partial(prefill, config=config, chain_hidden=chain_hidden),
        decode=functools.partial(decode, config=config, chain_hidden=chain_hidden),
        max_tokens_per_step=num_steps + 1,
        kv_lookahead=num_steps + 1,
    )
