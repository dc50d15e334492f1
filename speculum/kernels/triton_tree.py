"""Triton twins of the tree stages: acceptance walk, tree building and the KV commit.

A speculative round on the GPU is captured into a CUDA graph, and the reference versions of
these stages launch hundreds of tiny kernels (loops over depth and child rank, each a handful of
batched tensor ops); the launches cost more than the work. Here each stage is one launch:

- :func:`accept_tree` runs one program per request that walks the whole tree. Every pass over
  a distribution loops over the vocabulary (up to 152k entries) in blocks of ``block_v``; with
  sampled drafts the residual distribution lives in per-request scratch rows in global memory.
- :func:`build_tree_nodes` runs one program per request over its (at most a few hundred)
  candidates.
- :func:`commit_kv` runs one program per (layer, request, column block) that copies the path's
  entries in increasing depth order.

Each launcher takes the arguments of its ``speculum::`` op (declared in ``speculum.spec``, whose
default kernel is the reference) plus keyword-only tuning knobs, and :func:`register` installs
the launchers as the ops' CUDA kernels. Without a GPU the kernels run on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1`` before this module is imported), which is how the
parity tests check them against the reference.

Floating-point parity: the kernels do the reference's float32 operations in the reference's
order, with FMA contraction switched off, so one-hot (greedy) targets give bit-identical walks
and tokens. Sums over the vocabulary (the residual mass, the inverse-CDF's cumulative sums) are
reduced in a different order than torch's, and with one-hot drafts a rejection subtracts the
rejected entry from the mass where the reference sums the row again; so with general
distributions a decision can differ only where the reference's comparison sits within a
rounding error of its threshold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from jaxtyping import Float, Int
from torch import Tensor

from speculum.spec.accept import accept_tree
from speculum.spec.tree import build_tree_nodes
from speculum.spec.verify import commit_kv

__all__ = ["accept_tree_triton", "build_tree_triton", "commit_kv_triton", "register"]


# ---------------------------------------------------------------- accept


@triton.jit
def _row_sum(row, vocab, BLOCK_V: tl.constexpr):
    """Sum of ``row[0 .. vocab - 1]``, a float32 row in global memory."""
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        acc += tl.load(row + offs, mask=offs < vocab, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _residual_block(res, offs, vocab, removed, HAS_DRAFT: tl.constexpr):
    """The residual at ``offs``: the row, with the removed tokens zeroed for one-hot drafts."""
    r = tl.load(res + offs, mask=offs < vocab, other=0.0)
    if not HAS_DRAFT:
        gone = tl.sum((offs[:, None] == removed[None, :]).to(tl.int32), axis=1) > 0
        r = tl.where(gone, 0.0, r)
    return r


@triton.jit
def _accept_kernel(
    tokens_ptr,
    parents_ptr,
    target_ptr,
    draft_ptr,
    coins_ptr,
    bonus_ptr,
    scratch_ptr,
    path_ptr,
    emitted_ptr,
    num_ptr,
    num_nodes,
    vocab,
    max_depth,
    max_children,
    HAS_DRAFT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK_N)
    # Padding lanes get parent -1, which no walk position (always >= 0) matches.
    node_parents = tl.load(parents_ptr + b * num_nodes + nodes, mask=nodes < num_nodes, other=-1)
    width = max_depth + 1
    cols = tl.arange(0, BLOCK_E)
    # The outputs are built in registers and stored once at the end: stores to one address
    # from different threads of a program are not ordered without a barrier.
    path = tl.where(cols == 0, 0, -1).to(tl.int64)
    emitted = tl.full([BLOCK_E], -1, dtype=tl.int64)

    # The residual is kept unnormalised with its mass, as in spec.accept._try_child. With one-hot
    # drafts it is the current node's target row minus the rejected siblings' tokens (at most
    # max_children, kept in `removed`), so a rejection costs no pass over the vocabulary; the
    # reference re-sums the row instead of subtracting, which differs only in rounding. With
    # sampled drafts it is a target row until the first rejection at a node, then one of two
    # scratch rows: a rejection writes the other one, so the old residual survives where the
    # reference keeps it.
    res = target_ptr + b * num_nodes * vocab
    mass = _row_sum(res, vocab, BLOCK_V)
    slots = tl.arange(0, BLOCK_K)
    removed = tl.full([BLOCK_K], -1, dtype=tl.int64)
    buf = 0
    current = 0
    num = 0
    walking = 1
    for depth in range(0, max_depth):
        if walking != 0:
            moved = 0
            prev = -1
            for rank in range(0, max_children):
                # The rank-th child: the next node after the previous child whose parent is
                # the current node (children in node order, as spec.tree.children lists them).
                is_next = (node_parents == current) & (nodes > prev)
                child = tl.min(tl.where(is_next, nodes, BLOCK_N), axis=0)
                if (child < num_nodes) & (moved == 0):
                    child_row = b * num_nodes + child
                    token = tl.load(tokens_ptr + child_row)
                    u = tl.load(coins_ptr + (b * max_depth + depth) * max_children + rank)
                    r_x = tl.load(res + token)
                    if HAS_DRAFT:
                        q_row = draft_ptr + child_row * vocab
                        threshold = u * tl.load(q_row + token) * mass
                    else:
                        gone = tl.sum((removed == token).to(tl.int32), axis=0) > 0
                        r_x = tl.where(gone, 0.0, r_x)
                        threshold = u * mass
                    if threshold < r_x:
                        moved = 1
                        current = child
                    elif HAS_DRAFT:
                        out = scratch_ptr + (b * 2 + buf) * vocab
                        acc = tl.zeros([BLOCK_V], dtype=tl.float32)
                        for start in range(0, vocab, BLOCK_V):
                            offs = start + tl.arange(0, BLOCK_V)
                            inside = offs < vocab
                            r = tl.load(res + offs, mask=inside, other=0.0)
                            q = tl.load(q_row + offs, mask=inside, other=0.0)
                            new = tl.maximum(r - mass * q, 0.0)
                            tl.store(out + offs, new, mask=inside)
                            acc += new
                        # Later scalar loads read entries other threads wrote, and the next
                        # rejection overwrites the row this pass read.
                        tl.debug_barrier()
                        new_mass = tl.sum(acc, axis=0)
                        # A rejection whose residual rounds to all zeros keeps the old one, as
                        # the reference does.
                        if new_mass > 0:
                            res = out
                            mass = new_mass
                            buf = 1 - buf
                    else:
                        # A repeated sibling token is already out: record each token once, so
                        # the bonus draw subtracts its mass once.
                        removed = tl.where((slots == rank) & ~gone, token, removed)
                        mass = mass - r_x
                prev = child
            walking = moved
            if moved != 0:
                num += 1
                path = tl.where(cols == num, current, path)
                token = tl.load(tokens_ptr + b * num_nodes + current)
                emitted = tl.where(cols == num - 1, token, emitted)
                res = target_ptr + (b * num_nodes + current) * vocab
                mass = _row_sum(res, vocab, BLOCK_V)
                removed = tl.full([BLOCK_K], -1, dtype=tl.int64)

    # Bonus: inverse-CDF draw over the final residual (spec.sampling.sample_from_probs): the
    # first index whose cumulative sum exceeds u * mass, or, where rounding puts u * mass past
    # every cumulative sum, the last positive index. A scan costs far more than a sum, so whole
    # blocks are skipped by their sums first and only the block that crosses is scanned.
    threshold = tl.load(bonus_ptr + b * width + num) * mass
    if not HAS_DRAFT:
        removed_mass = tl.load(res + removed, mask=removed >= 0, other=0.0)
    carry = 0.0
    start = 0
    crossed = 0
    while (crossed == 0) & (start < vocab):
        offs = start + tl.arange(0, BLOCK_V)
        block_mass = tl.sum(tl.load(res + offs, mask=offs < vocab, other=0.0), axis=0)
        if not HAS_DRAFT:
            here = (removed >= start) & (removed < start + BLOCK_V)
            block_mass -= tl.sum(tl.where(here, removed_mass, 0.0), axis=0)
        if carry + block_mass > threshold:
            crossed = 1
        else:
            carry += block_mass
            start += BLOCK_V
    found = vocab
    while (found == vocab) & (start < vocab):
        offs = start + tl.arange(0, BLOCK_V)
        r = _residual_block(res, offs, vocab, removed, HAS_DRAFT)
        cdf = carry + tl.cumsum(r, axis=0)
        # r > 0 as well: a parallel scan's rounding can step up at a zero entry, which the
        # reference's sequential cumulative sums never do.
        hit = (offs < vocab) & (r > 0) & (cdf > threshold)
        found = tl.min(tl.where(hit, offs, vocab), axis=0)
        # The block's last cumulative sum is its largest (r >= 0; the scan rounds differently
        # at different entries, so take the maximum rather than trust the last lane).
        carry = tl.max(cdf, axis=0)
        start += BLOCK_V
    if found == vocab:
        found = 0
        for begin in range(0, vocab, BLOCK_V):
            offs = begin + tl.arange(0, BLOCK_V)
            r = _residual_block(res, offs, vocab, removed, HAS_DRAFT)
            found = tl.maximum(found, tl.max(tl.where(r > 0, offs, 0), axis=0))
    emitted = tl.where(cols == num, found, emitted)

    tl.store(path_ptr + b * width + cols, path, mask=cols < width)
    tl.store(emitted_ptr + b * width + cols, emitted, mask=cols < width)
    tl.store(num_ptr + b, num)


def accept_tree_triton(
    tokens: Int[Tensor, "batch num_nodes"],
    parents: Int[Tensor, "batch num_nodes"],
    target_probs: Float[Tensor, "batch num_nodes vocab"],
    draft_probs: Float[Tensor, "batch num_nodes vocab"] | None,
    coins: Float[Tensor, "batch max_depth max_children"],
    bonus_coins: Float[Tensor, "batch max_emit"],
    *,
    block_v: int = 4096,
    num_warps: int = 8,
) -> tuple[Int[Tensor, "batch max_emit"], Int[Tensor, "batch max_emit"], Int[Tensor, " batch"]]:
    """``speculum::accept_tree`` as one Triton program per request (see the op's docstring).

    ``block_v`` (a power of two) is how many vocabulary entries one step of a pass over the
    residual handles; tests set it small so the block loops run several times.
    """
    batch, num_nodes, vocab = target_probs.shape
    max_depth, max_children = coins.shape[1], coins.shape[2]
    device = target_probs.device
    path = torch.empty(batch, max_depth + 1, dtype=torch.int64, device=device)
    emitted = torch.empty_like(path)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return path, emitted, num_accepted
    target_probs = target_probs.contiguous()
    # Only sampled drafts materialise residuals (one-hot ones track removed tokens instead);
    # the kernel never touches the stand-ins passed for absent buffers.
    if draft_probs is None:
        draft_probs = scratch = target_probs
        has_draft = False
    else:
        draft_probs = draft_probs.contiguous()
        scratch = torch.empty(batch, 2, vocab, dtype=torch.float32, device=device)
        has_draft = True
    _accept_kernel[(batch,)](
        tokens.contiguous(),
        parents.contiguous(),
        target_probs,
        draft_probs,
        coins.contiguous(),
        bonus_coins.contiguous(),
        scratch,
        path,
        emitted,
        num_accepted,
        num_nodes,
        vocab,
        max_depth,
        max_children,
        HAS_DRAFT=has_draft,
        BLOCK_N=triton.next_power_of_2(num_nodes),
        BLOCK_E=triton.next_power_of_2(max_depth + 1),
        BLOCK_K=triton.next_power_of_2(max_children),
        BLOCK_V=block_v,
        num_warps=num_warps,
        # torch computes r - mass * q as a rounded product then a difference; a fused
        # multiply-add would round once and drift from the reference.
        enable_fp_fusion=False,
    )
    return path, emitted, num_accepted


# ---------------------------------------------------------------- build_tree


@triton.jit
def _build_tree_kernel(
    cand_tokens_ptr,
    cand_parents_ptr,
    scores_ptr,
    root_ptr,
    tokens_ptr,
    parents_ptr,
    depths_ptr,
    num_cand,
    num_nodes,
    BLOCK_C: tl.constexpr,
    BLOCK_J: tl.constexpr,
    ROUNDS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = b * num_cand
    idx = tl.arange(0, BLOCK_C)
    valid = idx < num_cand
    score = tl.load(scores_ptr + row + idx, mask=valid, other=0.0)

    # A candidate's place in the stable descending sort: the candidates scored above it plus the
    # equal ones with a lower index. Counted against blocks of BLOCK_J others at a time.
    place = tl.zeros([BLOCK_C], dtype=tl.int32)
    for start in range(0, num_cand, BLOCK_J):
        j = start + tl.arange(0, BLOCK_J)
        other = tl.load(scores_ptr + row + j, mask=j < num_cand, other=0.0)
        above = (other[None, :] > score[:, None]) | (
            (other[None, :] == score[:, None]) & (j[None, :] < idx[:, None])
        )
        place += tl.sum((above & (j[None, :] < num_cand)).to(tl.int32), axis=1)
    kept = valid & (place < num_nodes - 1)
    # Kept candidates in candidate (level) order become nodes 1 .. num_nodes - 1.
    node = tl.cumsum(kept.to(tl.int32), axis=0)
    node_of = tl.where(kept, node, 0)
    parent = tl.load(cand_parents_ptr + row + idx, mask=valid, other=-1).to(tl.int32)
    # Children of the root and of candidates not kept hang under node 0, as in the reference.
    parent_node = tl.where(parent >= 0, tl.gather(node_of, tl.maximum(parent, 0), 0), 0)

    # Depths by pointer doubling over the kept tree's edges (parents are kept candidates or the
    # root, -1 here): depth[i] counts the edges from i up to up[i]; every round doubles the
    # reach, and BLOCK_C >= the deepest chain, so log2(BLOCK_C) rounds end at the root.
    up = tl.where(parent_node > 0, parent, -1)
    depth = tl.full([BLOCK_C], 1, dtype=tl.int32)
    for _ in tl.static_range(ROUNDS):
        has_up = up >= 0
        safe = tl.maximum(up, 0)
        depth = depth + tl.where(has_up, tl.gather(depth, safe, 0), 0)
        up = tl.where(has_up, tl.gather(up, safe, 0), -1)

    out = b * num_nodes
    token = tl.load(cand_tokens_ptr + row + idx, mask=valid, other=0)
    tl.store(tokens_ptr + out + node, token.to(tl.int64), mask=kept)
    tl.store(parents_ptr + out + node, parent_node.to(tl.int64), mask=kept)
    tl.store(depths_ptr + out + node, depth.to(tl.int64), mask=kept)
    tl.store(tokens_ptr + out, tl.load(root_ptr + b).to(tl.int64))
    tl.store(parents_ptr + out, tl.full([], -1, dtype=tl.int64))
    tl.store(depths_ptr + out, tl.full([], 0, dtype=tl.int64))


def build_tree_triton(
    candidate_tokens: Int[Tensor, "batch num_candidates"],
    candidate_parents: Int[Tensor, "batch num_candidates"],
    scores: Float[Tensor, "batch num_candidates"],
    root_tokens: Int[Tensor, " batch"],
    num_draft_tokens: int,
    *,
    block_j: int = 16,
    num_warps: int = 4,
) -> tuple[
    Int[Tensor, "batch num_nodes"], Int[Tensor, "batch num_nodes"], Int[Tensor, "batch num_nodes"]
]:
    """``speculum::build_tree`` as one Triton program per request (see the op's docstring).

    ``block_j`` (a power of two) is how many candidates each candidate is compared with at a
    time while ranking; ``num_nodes == num_draft_tokens``.
    """
    batch, num_cand = candidate_tokens.shape
    device = candidate_tokens.device
    tokens = torch.empty(batch, num_draft_tokens, dtype=torch.int64, device=device)
    parents = torch.empty_like(tokens)
    depths = torch.empty_like(tokens)
    if batch == 0:
        return tokens, parents, depths
    block_c = triton.next_power_of_2(num_cand)
    _build_tree_kernel[(batch,)](
        candidate_tokens.contiguous(),
        candidate_parents.contiguous(),
        scores.contiguous(),
        root_tokens.contiguous(),
        tokens,
        parents,
        depths,
        num_cand,
        num_draft_tokens,
        BLOCK_C=block_c,
        BLOCK_J=min(block_j, block_c),
        ROUNDS=max(block_c.bit_length() - 1, 1),
        num_warps=num_warps,
    )
    return tokens, parents, depths


# ---------------------------------------------------------------- commit


@triton.jit
def _commit_kernel(
    k_ptr,
    v_ptr,
    source_ptr,
    destination_ptr,
    width,
    k_row_size,
    v_row_size,
    layer_slots,
    BLOCK: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    # A latent pool's v rows are empty (v_row_size 0): its loads and stores are all masked.
    in_k, in_v = cols < k_row_size, cols < v_row_size
    k_layer = k_ptr + layer * layer_slots * k_row_size
    v_layer = v_ptr + layer * layer_slots * v_row_size
    # In increasing depth order; why that reads every source before it is overwritten is
    # explained in commit_kv_triton.
    for d in range(0, width):
        source = tl.load(source_ptr + b * width + d)
        destination = tl.load(destination_ptr + b * width + d)
        # The root (d = 0) and padding entries (both at the padding sink) stay where they are.
        if source != destination:
            k = tl.load(k_layer + source * k_row_size + cols, mask=in_k)
            v = tl.load(v_layer + source * v_row_size + cols, mask=in_v)
            tl.store(k_layer + destination * k_row_size + cols, k, mask=in_k)
            tl.store(v_layer + destination * v_row_size + cols, v, mask=in_v)


def commit_kv_triton(
    k: Float[Tensor, "layer page page_size kv_head head_dim"],
    v: Float[Tensor, "layer page page_size kv_head head_dim"],
    source: Int[Tensor, "batch max_emit"],
    destination: Int[Tensor, "batch max_emit"],
    *,
    block: int = 1024,
    num_warps: int = 4,
) -> None:
    """``speculum::commit_kv`` as Triton programs over (layer, request, column block).

    Each program copies one request's path entries in increasing depth ``d`` within one layer
    and one block of the ``kv_head * head_dim`` columns. That order is safe without staging:
    the entry at depth ``d`` moves from cache index ``seq_len + path[d]`` to ``seq_len + d``,
    and the path's node indices strictly increase from ``path[0] = 0``, so ``path[e] > path[d]
    >= d`` for every later ``e > d``: no later source is an earlier destination (distinct cache
    indices of a request are distinct slots), and where an earlier source is a later
    destination, the same thread reads it before it writes it. Requests own disjoint pages, so
    programs never touch each other's slots (padding entries are skipped, see the kernel).
    ``block`` (a power of two) is the column block. ``v``'s rows may be narrower than ``k``'s
    (a latent pool's hold nothing).
    """
    if not (k.is_contiguous() and v.is_contiguous() and k.shape[:3] == v.shape[:3]):
        raise ValueError(
            "commit_kv: k and v must be contiguous pools of the same layers and pages (they "
            "are written in place)"
        )
    batch, width = source.shape
    layers = k.shape[0]
    k_row, v_row = k.shape[3] * k.shape[4], v.shape[3] * v.shape[4]
    row_size = max(k_row, v_row)
    if batch == 0 or layers == 0 or row_size == 0:
        return
    block = min(block, triton.next_power_of_2(row_size))
    _commit_kernel[(layers, batch, triton.cdiv(row_size, block))](
        k,
        v,
        source.contiguous(),
        destination.contiguous(),
        width,
        k_row,
        v_row,
        k.shape[1] * k.shape[2],
        BLOCK=block,
        num_warps=num_warps,
    )


# ---------------------------------------------------------------- registration


def register() -> None:
    """Install the Triton launchers as the CUDA kernels of the three ``speculum::`` tree ops.

    Not done at import: the reference kernels stay in charge on every device until a caller
    opts in. Registering again replaces the same kernels (idempotent).
    """
    accept_tree.register_kernel("cuda")(accept_tree_triton)
    build_tree_nodes.register_kernel("cuda")(build_tree_triton)
    commit_kv.register_kernel("cuda")(commit_kv_triton)
