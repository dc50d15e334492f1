"""Reference tree verification and commit, shared by every tree-verified pipeline.

Both stages need only the target (any callable ``target(batch, pool, capture_layers) ->
(hidden, captured)`` with a ``logits`` method) and its pool, so model-free drafters (n-gram)
and draft models of every kind verify and commit the same way.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from speculum.spec.accept import accept
from speculum.spec.paged import cache_slots, pack_batch, slots_at, tail_batch, unpack
from speculum.spec.recurrent import commit_states
from speculum.spec.sampling import (
    filtered_probs,
    guard_logits,
    no_logprobs,
    reads_path,
    token_logprobs,
)
from speculum.spec.tree import tree_mask, tree_path_tokens
from speculum.state.forward import ForwardBatch
from speculum.state.kv import KVPool, PagedKV
from speculum.state.record import make, replace
from speculum.state.sampling import SamplingParams, TokenLogprobs
from speculum.state.tree import AcceptResult, DraftTree, Verified

__all__ = ["verify_tree", "target_logits", "path_logprobs", "commit_path", "commit_kv"]


def verify_tree(
    target: Any,
    pool: KVPool,
    kv: PagedKV,
    tree: DraftTree,
    sampling: SamplingParams,
    *,
    max_depth: int,
    max_children: int,
    capture_layers: tuple[int, ...] = (),
    draft_probs: Float[Tensor, "batch num_nodes vocab"] | None = None,
    verify_lens: Int[Tensor, " batch"] | None = None,
    capacity: int | None = None,
    grammar_masks: Int[Tensor, "batch num_nodes words"] | None = None,
) -> Verified:
    """One target forward over the tree, then acceptance.

    Node ``i`` is written at cache index ``seq_lens + i`` and sits at rotary position
    ``seq_lens + depth``; it sees the prefix and its ancestors. The target's filtered
    distribution after each node decides acceptance (``spec.accept``); ``draft_probs`` is
    ``None`` for deterministically chosen drafts. ``verify_lens`` (chains only: node ``i`` at
    depth ``i``) verifies the first ``verify_lens[b]`` draft nodes of row ``b`` in the same
    forward: the rest are padding rows of the batch (ragged verify). With ``capacity`` too (a
    static bound on the verified tokens, roots included, below ``batch * num_nodes``) the
    target forward runs packed over ``capacity`` rows and no padding row costs compute or
    writes K/V (:func:`target_logits`); the result is the padded one's. A node whose target
    logits cannot be sampled is reported in ``faults`` (``spec.sampling.guard_logits``) rather
    than raised, so the rest of the batch, and the rest of the tree, decode on. Penalties
    (``sampling.penalties``) at each node count the draft tokens on its path
    (``spec.tree.tree_path_tokens``), as plain decoding counts the same prefix. With
    ``sampling.num_logprobs > 0``, each emitted token's log-probabilities are read from the
    target's distribution at the path node that decided it (:func:`path_logprobs`).
    ``grammar_masks`` (packed as ``SamplingParams.grammar`` returns them) are the grammar's
    masks at the nodes when they are known before the round (a host drafter's tree), used
    instead of asking ``sampling.grammar``.
    """
    grammar = sampling.grammar
    if grammar_masks is not None:
        grammar = lambda _paths: grammar_masks  # noqa: E731 (the masks need no path)
    positions = kv.seq_lens[:, None] + tree.depths
    q_lens = None if verify_lens is None else verify_lens + 1
    ancestors = tree_mask(tree)
    batch = tail_batch(kv, tree.tokens, positions, ancestors, q_lens=q_lens)
    hidden, captured, raw_logits = target_logits(target, pool, batch, capture_layers, capacity)
    logits, faults = guard_logits(
        raw_logits,
        sampling.temperature,
        sampling.logit_bias,
        sampling.penalties,
        tree_path_tokens(tree, ancestors) if reads_path(sampling) else None,
        grammar,
    )
    target_probs = filtered_probs(logits, sampling)
    accepted = accept(
        tree,
        target_probs,
        sampling.seed,
        kv.seq_lens,
        max_depth,
        draft_probs,
        max_children=max_children,
        verify_lens=verify_lens,
    )
    return make(
        Verified,
        accepted=accepted,
        final_hidden=hidden,
        captured=captured,
        faults=faults,
        logprobs=path_logprobs(logits, accepted, sampling),
    )


def target_logits(
    target: Any,
    pool: KVPool,
    batch: ForwardBatch,
    capture_layers: tuple[int, ...],
    capacity: int | None,
) -> tuple[
    Float[Tensor, "batch q hidden"],
    tuple[Float[Tensor, "batch q hidden"], ...],
    Float[Tensor, "batch q vocab"],
]:
    """The target's final hidden states, captured layers and logits of padded ``batch``.

    With ``capacity`` (``None``: padded) the forward and the vocabulary projection run on
    the packed batch (``spec.paged.pack_batch``), ``capacity`` rows instead of ``batch * q``,
    and their results are unpacked to the padded layout, padding rows zero."""
    if capacity is None:
        hidden, captured = target(batch, pool, capture_layers)
        return hidden, captured, target.logits(hidden)
    packed, _ = pack_batch(batch, capacity)
    hidden, captured = target(packed, pool, capture_layers)
    width = batch.input_ids.shape[1]
    padded = functools.partial(unpack, q_starts=packed.q_starts, q_lens=batch.q_lens, q=width)
    return (
        padded(hidden),
        tuple(padded(c) for c in captured),
        padded(target.logits(hidden)),
    )


def path_logprobs(
    logits: Float[Tensor, "batch num_nodes vocab"],
    accepted: AcceptResult,
    sampling: SamplingParams,
) -> TokenLogprobs:
    """The log-probabilities of a round's emitted tokens (``spec.sampling.token_logprobs``):
    token ``d`` was decided by the target's distribution at path node ``d``, so only those
    rows are gathered (padding entries read the root) before the softmax runs over them;
    nothing is gathered when ``sampling.num_logprobs`` is 0 (``spec.sampling.no_logprobs``)."""
    if sampling.num_logprobs == 0:
        return no_logprobs(accepted.emitted)
    index = accepted.path.clamp(min=0)[..., None].expand(-1, -1, logits.shape[-1])
    return token_logprobs(
        logits.gather(1, index), sampling.temperature, accepted.emitted, sampling.num_logprobs
    )


def commit_path(pool: KVPool, kv: PagedKV, accepted: AcceptResult) -> PagedKV:
    """Move the accepted path's K/V to consecutive cache slots and extend the sequence.

    The root is already at ``seq_lens``; the node at depth ``d`` of the path moves from cache
    index ``seq_lens + path[d]`` to ``seq_lens + d`` (the ``speculum::commit_kv`` op). All
    sources are read before any destination is written (a destination can be another node's
    source). The pool is written in place by contract; the returned record counts the root and
    the accepted nodes, and the rejected slots are simply never pointed at again. A hybrid
    model's recurrent state after the accepted path moves the same way
    (``spec.recurrent.commit_states``).
    """
    valid = accepted.path >= 0
    path_index = kv.seq_lens[:, None] + accepted.path.clamp(min=0)
    source = slots_at(kv.page_table, kv.page_size, path_index, valid)
    destination = cache_slots(kv.page_table, kv.page_size, kv.seq_lens, valid)
    commit_kv(pool.k, pool.v, source, destination)
    commit_states(pool, kv, accepted)
    return replace(kv, seq_lens=kv.seq_lens + accepted.num_accepted + 1)


@torch.library.custom_op("speculum::commit_kv", mutates_args=("k", "v"))
def commit_kv(k: Tensor, v: Tensor, source: Tensor, destination: Tensor) -> None:
    """The ``speculum::commit_kv`` op: ``flat[:, destination] = flat[:, source]`` for K and V.

    ``k`` and ``v`` are pools ``[layer, page, page_size, kv_head, head_dim]``, viewed as
    ``[layer, slot, kv_head, head_dim]``; ``source`` and ``destination`` are int64 flat slots
    ``[batch, max_depth + 1]`` of each request's path (padding entries point both at the padding
    sink). Every source is read before any destination is written. This default kernel is the
    reference; ``speculum.kernels.triton_tree`` registers a CUDA twin.
    """
    for cache in (k, v):
        # flatten, not view(..., -1, ...): a latent pool's v holds no values (head_dim 0).
        flat = cache.flatten(1, 2)
        # The right side is a copy, so all reads come before the writes.
        flat[:, destination.reshape(-1)] = flat[:, source.reshape(-1)]


@commit_kv.register_fake
def _(k, v, source, destination):
    return None
