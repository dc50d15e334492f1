"""Triton kernel of ``speculum::paged_attention``: attention over a paged prefix and masked tail.

Same function as :func:`speculum.spec.attention.paged_attention` (read its docstring for the
semantics), computed flash-attention style so that nothing of size ``seq`` is materialised.

Design
------
* **Grid** ``(query_blocks, batch * kv_head, splits)``. One program owns one KV head of one
  request and a block of ``BLOCK_Q`` query tokens, *together with all ``group`` query heads that
  share that KV head*: its ``BLOCK_M = BLOCK_Q * group`` query rows (row ``r`` is token
  ``r // group``, head ``kv_head * group + r % group``) form the M dimension of ``tl.dot``. Each
  K/V tile is then read once for the whole group, and a decode step (one token) still fills
  ``group`` rows of the matrix unit. ``BLOCK_M`` is at least 16, the smallest ``tl.dot`` tile.
* **Keys** (the prefix, cache indices ``< prefix_lens[b]``, seen by every query; then the tail,
  ``prefix_lens[b] + j`` for ``j < t``, seen per ``new_mask``) are visited in tiles of
  ``BLOCK_N`` that start at multiples of ``BLOCK_N`` of the *cache index*, not of the prefix or
  tail. Each key row finds its pool slot through the page table (``page_table[b, s //
  page_size] * page_size + s % page_size``), so pages need not be contiguous and any
  ``page_size >= 1`` works. Online softmax in base 2 with float32 accumulators; the row sums
  too are a matrix product (``P @ ones``), whose bits do not depend on the block's layout.
* **Batch invariance**: the online softmax rounds each tile's probabilities to V's dtype
  against the running max, so its bits depend on the tiling. Because tiles (and split chunks)
  sit at fixed cache indices and every call of up to 8 query tokens per request (decode, draft
  steps, chain verify, small trees) of one batch takes the same tile width and split count, a
  token's output is the same bit for bit whether the tokens before it are prefix (a decode
  step) or tail (a chain verify); a tree node differs from its decode only in where its
  ancestors sit among the tail columns. Before this, bfloat16 speculative decoding diverged
  from plain decoding at logit gaps up to 0.13. Wider calls (trees, extend chunks) are tiled
  and split for speed alone.
* **Tail**: a first pass over this block's mask rows finds one past the last column any real
  row sees (``tail_end``), so a causal prefill chunk only visits the tiles on or below its
  diagonal (without special-casing causal masks: the kernel only reads the mask), and the first
  column no real row sees (``dense_end``). Tiles below ``dense_end`` load every key; tiles
  after it load a key only where some row of the block sees it, so stale NaN/inf in slots
  nobody sees never reaches ``P @ V`` (``0 * NaN`` would). That per-column check is a reduction
  over the tile's rows, which the dense tiles (all of a causal chunk's but the diagonal one)
  skip.
* **Split-KV** (flash-decoding): when ``batch * kv_head`` programs (times the query blocks,
  for calls of more than 8 tokens) would leave the GPU idle (decode at small batch), each
  request's cache indices are cut into ``splits`` fixed chunks of whole tiles covering the page
  table's capacity, each program writes a partial ``(max, sum, unnormalised accumulator)``
  (empty for a chunk past the request's keys), and a small combine kernel merges the partials.
  ``splits = min(2 * SMs // programs, ceil(capacity / 128), 64)`` where ``capacity = max_pages *
  page_size``; 1 (no partials, no combine) once the grid already fills two programs per SM.
* **Sliding window** (``window > 0``): the wrapper cuts the mask to each query's last
  ``window`` keys and computes each query's first visible prefix index
  (``spec.attention.window_limits``); the kernel masks prefix keys below a row's first index
  and starts its prefix tiles at the tile holding the block's smallest one, so tiles wholly
  outside every row's window are neither loaded nor visited. A skipped tile would have added
  nothing (probabilities 0, running max unchanged), so outputs keep their bits.
* **Attention sinks** (gpt-oss, ``sinks [head]``): a head's sink logit joins only the
  softmax's denominator, so it is one term added where the row sum is final, ``exp2(sink *
  log2(e) - m)`` (base-2 exponents, as for the scores), against the row's running max ``m`` at
  the normalisation (no split) or the largest partial max in the combine kernel (split). A row
  that saw no key keeps ``m = -inf``, so its sink term is ``inf`` and its output ``0 / inf =
  0``, as the reference gives.
* **CUDA graphs**: every launch parameter (grid, block sizes, splits) is a function of shapes and
  the device alone; lengths are read on the device, so a launch can be captured and replayed.

Without a GPU the same kernels run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported), which the parity tests use.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.spec.attention import window_limits

__all__ = ["paged_attention_triton", "register"]

#: Triton's interpreter runs kernels on CPU tensors; it is read once, when kernels are decorated.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: Keys per split: the split rule cuts a page table's capacity into chunks of about this many
#: (below two key blocks, the partial writes and the combine cost more than the parallelism
#: gains).
_MIN_KEYS_PER_SPLIT = 128
#: More splits only multiply combine traffic; 64 already covers a 1-request batch of 1 KV head.
_MAX_SPLITS = 64
#: Programs per SM the split rule aims for: two resident programs hide one's load latency.
_PROGRAMS_PER_SM = 2
#: Stand-in SM count under the interpreter, small so that CPU tests exercise the split path.
_INTERPRET_SMS = 4
#: Query rows (tokens x group) from which a call is a prefill chunk, tiled for the matrix units.
_PREFILL_ROWS = 1024
#: Calls of at most this many query tokens (decode, draft steps, chain verify, trees of up to 8
#: tokens) share one tiling and, per batch, one split count, so that their tokens' outputs agree
#: bit for bit; wider calls (trees, extend chunks) are tiled and split for speed alone.
_INVARIANT_TOKENS = 8
#: Shared-memory budget (bytes) for the software-pipelined K/V tiles on Hopper (228 KiB per SM,
#: leaving room for the Q tile and layout conversions).
_SMEM_BUDGET = 160 * 1024


@triton.jit
def _attend_block(
    q,
    s,
    key_ok,
    visible,
    page_row,
    stride_pp,
    k_base,
    stride_kp,
    stride_ks,
    v_base,
    stride_vp,
    stride_vs,
    d_ok,
    dv_ok,
    ones,
    m_i,
    l_acc,
    acc,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the keys at cache indices ``s [BLOCK_N]`` into the running softmax state.

    Only keys with ``key_ok`` are loaded (others read as 0: they may be stale garbage, and
    ``0 * NaN`` in ``P @ V`` would be NaN); ``visible [BLOCK_M, BLOCK_N]`` masks the scores. The
    state is (row max, row sums, unnormalised accumulator) with base-2 exponents. A row that has
    seen nothing yet keeps ``m = -inf``; its shift is taken as 0 so that ``exp2(-inf - shift)``
    gives 0 instead of ``exp2(-inf + inf) = NaN``.

    The row sums are ``P @ ones`` (``ones [BLOCK_N, 16]``; every column of ``l_acc`` holds the
    sum), on the matrix unit like ``P @ V``: a ``tl.sum`` over the tile's columns adds them in an
    order that follows the block's layout, so a decode step in 16 rows and a chain of 5 in 32
    rows differed in the last bit. A dot adds each element's products in the same order at any
    block size, and sums the probabilities as rounded for ``P @ V``.
    """
    page = tl.load(page_row + (s // PAGE_SIZE) * stride_pp, mask=key_ok, other=0)
    offset = (s % PAGE_SIZE).to(tl.int64)
    load_k, load_v = key_ok[:, None] & d_ok[None, :], key_ok[:, None] & dv_ok[None, :]
    k = tl.load(k_base + (page * stride_kp + offset * stride_ks)[:, None], mask=load_k, other=0.0)
    v = tl.load(v_base + (page * stride_vp + offset * stride_vs)[:, None], mask=load_v, other=0.0)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(qk - shift[:, None])
    v = v.to(q.dtype)
    weights = p.to(v.dtype)
    l_acc = tl.dot(weights, ones, l_acc * alpha[:, None], input_precision=DOT_PRECISION)
    acc = tl.dot(weights, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_acc, acc


@triton.jit
def _load_seen(mask_rows, j, stride_mj, row_ok, num_tail):
    """``new_mask`` bytes of this block's rows at tail columns ``j``; 0 for padding rows."""
    return tl.load(
        mask_rows + j[None, :] * stride_mj, mask=row_ok[:, None] & (j < num_tail)[None, :], other=0
    ).to(tl.int32)


@triton.jit
def _visible(mask_rows, j, stride_mj, row_ok, num_tail):
    """Which of this block's rows see the keys at tail columns ``j`` (negative: prefix keys,
    seen by every row; past the tail: by none)."""
    seen = _load_seen(mask_rows, tl.maximum(j, 0), stride_mj, row_ok, num_tail) != 0
    return (j < 0)[None, :] | seen


@triton.jit
def _write_rows(
    out_ptr,
    m_ptr,
    l_ptr,
    acc,
    m_i,
    l_i,
    row_in,
    row_ok,
    b,
    qi,
    head,
    d,
    d_ok,
    split,
    num_q,
    num_heads,
    stride_ob,
    stride_oi,
    stride_oh,
    stride_od,
    V_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Store a program's rows (query ``qi``, head ``head``; ``row_in``: rows of the output,
    ``row_ok``: real queries) at value columns ``d``: with ``SPLITS == 1`` the normalised
    output into ``out_ptr``; otherwise the unnormalised accumulator into the contiguous
    ``[batch, q, head, splits, V_DIM]`` float32 partials at ``out_ptr`` and the row max / row
    sum into ``m_ptr`` / ``l_ptr``. Padding rows, and rows that saw no key (``l == 0``, ``acc ==
    0``), come out as zeros."""
    acc = tl.where(row_ok[:, None], acc, 0.0)
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr
            + b * stride_ob
            + qi[:, None] * stride_oi
            + head[:, None] * stride_oh
            + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_in[:, None] & d_ok[None, :],
        )
    else:
        part = ((b * num_q + qi) * num_heads + head) * SPLITS + split
        tl.store(
            out_ptr + part[:, None] * V_DIM + d[None, :], acc, mask=row_in[:, None] & d_ok[None, :]
        )
        tl.store(m_ptr + part, tl.where(row_ok, m_i, float("-inf")), mask=row_in)
        tl.store(l_ptr + part, tl.where(row_ok, l_i, 0.0), mask=row_in)


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    prefix_lens_ptr,
    q_lens_ptr,
    mask_ptr,
    first_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    sinks_ptr,
    qk_scale,
    num_q,
    num_tail,
    num_kv_heads,
    chunk,
    stride_qb,
    stride_qi,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_pb,
    stride_pp,
    stride_mb,
    stride_mi,
    stride_mj,
    stride_fb,
    stride_fi,
    stride_ob,
    stride_oi,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TOKENS: tl.constexpr,
    SCAN_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One (query block, request x KV head, split) program; see the module docstring.

    With ``SPLITS == 1`` it writes the normalised output into ``out_ptr``; otherwise it writes
    its unnormalised accumulator to ``out_ptr`` (a contiguous ``[batch, q, head, splits,
    v_dim]`` float32 buffer) and its row max / row sum to ``m_ptr`` / ``l_ptr``. Keys are
    ``HEAD_DIM`` wide, values ``V_DIM`` (narrower for latent attention, whose values are the
    first columns of its keys).
    """
    q_block = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (bh // num_kv_heads).to(tl.int64)
    kv_head = bh % num_kv_heads

    rows = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < V_DIM
    keys = tl.arange(0, BLOCK_N)

    prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
    q_len = tl.load(q_lens_ptr + b).to(tl.int32)
    row_in = (rows < BLOCK_Q * GROUP) & (qi < num_q)  # rows of the output tensor
    row_ok = row_in & (qi < q_len)  # rows that are real queries
    # A block of padding rows does no work at all: its loops get empty ranges.
    block_live = q_block * BLOCK_Q < q_len
    # Each row's first visible cache index (0 without a window), and the block's smallest. A
    # padding row's is past every key, so that no key only it would see (outside every real
    # row's window: maybe stale) is loaded.
    first = tl.zeros([BLOCK_M], tl.int32)
    if WINDOWED:
        first = tl.load(first_ptr + b * stride_fb + qi * stride_fi, mask=row_ok, other=1 << 30)
        first = first.to(tl.int32)
    first_min = tl.min(tl.where(row_ok, first, prefix_len), axis=0)

    # A first pass over the block's mask rows (one per token, not per head, in wide tiles: this
    # loop has no matrix work to hide its latency) finds one past the last column a real row
    # sees (``tail_end``) and the first column no real row sees (``dense_end``); tiles below
    # ``dense_end`` then load every key unchecked.
    tail = tl.where(block_live, num_tail, 0)
    tokens = q_block * BLOCK_Q + tl.arange(0, TOKENS)
    token_ok = (tl.arange(0, TOKENS) < BLOCK_Q) & (tokens < num_q) & (tokens < q_len)
    token_rows = mask_ptr + b * stride_mb + tokens[:, None] * stride_mi
    tail_end = tl.zeros([], tl.int32)
    dense_end = tail
    for start in range(0, tail, SCAN_N):
        j = start + tl.arange(0, SCAN_N)
        col_seen = tl.max(_load_seen(token_rows, j, stride_mj, token_ok, num_tail), axis=0) > 0
        tail_end = tl.maximum(tail_end, tl.max(tl.where(col_seen, j + 1, 0)))
        dense_end = tl.minimum(dense_end, tl.min(tl.where(col_seen | (j >= num_tail), tail, j)))

    q = tl.load(
        q_ptr
        + b * stride_qb
        + qi[:, None] * stride_qi
        + head[:, None] * stride_qh
        + d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_acc = tl.zeros([BLOCK_M, 16], tl.float32)
    ones = tl.full([BLOCK_N, 16], 1.0, q.dtype)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    page_row = page_table_ptr + b * stride_pb
    k_base = k_ptr + kv_head * stride_kh + d[None, :] * stride_kd
    v_base = v_ptr + kv_head * stride_vh + dv[None, :] * stride_vd
    mask_rows = mask_ptr + b * stride_mb + qi[:, None] * stride_mi

    # Key tiles start at multiples of BLOCK_N of the cache index and this split owns the fixed
    # chunk [lo, lo + chunk), wherever the prefix ends: a query then meets the same keys in the
    # same tiles whether its predecessors are prefix (a decode step) or tail (a verify), and
    # both give the same bits (the online softmax rounds P to V's dtype against the running
    # max, so another tiling would round differently). Three runs of tiles: all prefix; prefix
    # then tail below ``dense_end`` (every key loaded); the rest, loading only seen columns.
    prefix = tl.where(block_live, prefix_len, 0)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix + tail_end)
    # Tiles below the one holding the block's first visible key are outside every row's
    # window (``lo`` and the tile starts are multiples of BLOCK_N, so tiling is unchanged).
    first_tile = tl.maximum(lo, tl.minimum(first_min, prefix) // BLOCK_N * BLOCK_N)
    prefix_tiles_end = tl.maximum(first_tile, tl.minimum(hi, prefix // BLOCK_N * BLOCK_N))
    dense_keys_end = (prefix + tl.minimum(dense_end, tail_end)) // BLOCK_N * BLOCK_N
    dense_tiles_end = tl.maximum(prefix_tiles_end, tl.minimum(hi, dense_keys_end))
    for start in range(first_tile, prefix_tiles_end, BLOCK_N):
        s = start + keys
        key_ok = (s < hi) & (s >= first_min)
        visible = key_ok[None, :] & (s[None, :] >= first[:, None])
        m_i, l_acc, acc = _attend_block(
            q, s, key_ok, visible, page_row, stride_pp, k_base, stride_kp, stride_ks,
            v_base, stride_vp, stride_vs, d_ok, dv_ok, ones, m_i, l_acc, acc, qk_scale,
            PAGE_SIZE, DOT_PRECISION,
        )  # fmt: skip
    for start in range(prefix_tiles_end, dense_tiles_end, BLOCK_N):
        s = start + keys
        visible = _visible(mask_rows, s - prefix, stride_mj, row_ok, num_tail)
        visible = visible & (s[None, :] >= first[:, None])
        m_i, l_acc, acc = _attend_block(
            q, s, (s < hi) & (s >= first_min), visible, page_row, stride_pp, k_base, stride_kp,
            stride_ks, v_base, stride_vp, stride_vs, d_ok, dv_ok, ones, m_i, l_acc, acc,
            qk_scale, PAGE_SIZE, DOT_PRECISION,
        )  # fmt: skip
    for start in range(dense_tiles_end, hi, BLOCK_N):
        s = start + keys
        visible = _visible(mask_rows, s - prefix, stride_mj, row_ok, num_tail)
        visible = visible & (s[None, :] >= first[:, None])
        m_i, l_acc, acc = _attend_block(
            q, s, tl.max(visible.to(tl.int32), axis=0) > 0, visible, page_row, stride_pp,
            k_base, stride_kp, stride_ks, v_base, stride_vp, stride_vs, d_ok, dv_ok, ones, m_i,
            l_acc, acc, qk_scale, PAGE_SIZE, DOT_PRECISION,
        )  # fmt: skip

    l_i = tl.max(l_acc, axis=1)  # its columns are equal: exact in any order
    if SPLITS == 1 and HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_in, other=0.0).to(tl.float32)
        l_i += tl.exp2(sink - m_i)
    _write_rows(
        out_ptr, m_ptr, l_ptr, acc, m_i, l_i, row_in, row_ok, b, qi, head, dv, dv_ok, split,
        num_q, num_kv_heads * GROUP, stride_ob, stride_oi, stride_oh, stride_od, V_DIM, SPLITS,
    )  # fmt: skip


@triton.jit
def _combine_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    sinks_ptr,
    out_ptr,
    num_q,
    num_heads,
    stride_ob,
    stride_oi,
    stride_oh,
    stride_od,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Merge the ``SPLITS`` partials of one (request, query, head) row into ``BLOCK_D`` columns
    of its output (``HEAD_DIM``: the values' width), the head's sink in the denominator when it
    has one."""
    row = tl.program_id(0).to(tl.int64)
    b = row // (num_q * num_heads)
    qi = (row // num_heads) % num_q
    head = row % num_heads
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < SPLITS
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.load(m_ptr + row * SPLITS + s, mask=s_ok, other=float("-inf"))
    l_s = tl.load(l_ptr + row * SPLITS + s, mask=s_ok, other=0.0)
    acc = tl.load(
        acc_ptr + (row * SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_max = tl.max(m, axis=0)
    # All splits empty (padding row, or a query that sees nothing): weights 0, output 0.
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(weight * l_s, axis=0)
    if HAS_SINKS:
        total += tl.exp2(tl.load(sinks_ptr + head) - m_max)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + qi * stride_oi + head * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


#: Output columns per combine program: all of a head of up to 128 values; wider values (a
#: latent of 512) in several programs, so that a program's [splits, columns] float32 partials
#: stay in registers.
_COMBINE_COLUMNS = 128


def combine_splits(
    acc: Float[Tensor, "batch q head splits v_dim"],
    m: Float[Tensor, "batch q head splits"],
    l_sum: Float[Tensor, "batch q head splits"],
    out: Float[Tensor, "batch q head v_dim"],
    sinks2: Float[Tensor, " head"] | None = None,
) -> None:
    """Merge split-KV partials (contiguous unnormalised accumulators, base-2 row maxima, row
    sums) into ``out``, with each head's base-2 sink logit ``sinks2`` in the denominator when
    given. Each output column's sum over the splits runs in one order whatever the call."""
    batch, num_q, heads, splits, v_dim = acc.shape
    block_d = min(max(16, triton.next_power_of_2(v_dim)), _COMBINE_COLUMNS)
    _combine_kernel[(batch * num_q * heads, triton.cdiv(v_dim, block_d))](
        acc,
        m,
        l_sum,
        m if sinks2 is None else sinks2,  # any pointer stands in when there are none
        out,
        num_q,
        heads,
        *out.stride(),
        SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits),
        HEAD_DIM=v_dim,
        BLOCK_D=block_d,
        HAS_SINKS=sinks2 is not None,
        num_warps=4,
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed stand-in under the interpreter)."""
    if device.type != "cuda":
        return _INTERPRET_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tiles(num_q: int, group: int, head_dim: int, v_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and launch options, from shapes alone (measured on an H200, bf16, d=128).

    Rows of one program are ``BLOCK_Q`` tokens times ``group`` heads: 128 rows with 64-key tiles
    and 8 warps for prefill chunks (matrix-unit bound); 4 warps for decode, verify and draft
    steps, which are memory bound and need more programs in flight: at most 32 rows (unless one
    token's group is wider) with 128-key tiles for calls of up to ``_INVARIANT_TOKENS`` tokens,
    up to 64 rows (then 64-key tiles) for wider trees and extend chunks.
    Under the interpreter tiles are 16 wide, so that tiny test shapes still cross key-tile and
    query-block boundaries.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(v_dim))
    item = torch.tensor([], dtype=dtype).element_size()
    rows = num_q * group
    if _INTERPRET:
        block_m, block_n = 16, 16
    elif rows >= _PREFILL_ROWS:
        block_m, block_n = 128, 64
    else:
        # 128-key tiles keep more bytes in flight (at 64 rows they would spill registers). Calls
        # of up to _INVARIANT_TOKENS tokens all take them, in blocks of at most 32 rows, so that
        # their outputs are bit-identical (see the kernel); wider ones take up to 64 rows, which
        # reads each key tile for more queries.
        widest = 32 if num_q <= _INVARIANT_TOKENS else 64
        block_m = min(max(16, triton.next_power_of_2(rows)), widest)
        block_n = 128 if block_m <= 32 else 64
    block_m = max(block_m, triton.next_power_of_2(group))  # at least one token per program
    if not _INTERPRET and item * block_d > 256:  # wide rows (float32, head_dim > 128)
        block_n //= 2
    if not _INTERPRET and block_d + block_dv > 512:
        # Latent attention's rows (576-wide keys, 512-wide values, padded to 1024 and 512):
        # small tiles, so that the Q tile and a stage of K and V tiles fit in shared memory
        # (for groups of up to 32 heads). A function of the widths alone, so that the calls of
        # one batch still tile alike. Not yet measured on a GPU.
        block_m = max(triton.next_power_of_2(group), min(block_m, 32))
        block_n = 32
        if item * block_d > 2048:
            # float32 latent rows: a 32-row Q tile and one 32-key stage (320 KB) overflowed an
            # H200's shared memory ("out of shared memory", tests/gpu latent float32 case);
            # 16-row and 16-key tiles need 160 KB. Not yet re-run on a GPU.
            block_m = max(triton.next_power_of_2(group), 16)
            block_n = 16
    # Pipeline depth: as many K/V stages as fit beside the Q tile.
    stage_bytes = block_n * (block_d + block_dv) * item
    stages = max(1, min(3, (_SMEM_BUDGET - block_m * block_d * item) // stage_bytes))
    tokens = triton.next_power_of_2(block_m // group)
    return {
        "BLOCK_Q": block_m // group,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        "BLOCK_DV": block_dv,
        # The mask scan reads ~8K bytes a step (1 per token and column), and no fewer than a tile.
        "TOKENS": tokens,
        "SCAN_N": block_n if _INTERPRET else max(block_n, min(1024, 8192 // tokens)),
        "num_warps": 8 if block_m >= 128 else 4,
        "num_stages": stages,
    }


def _num_splits(programs: int, capacity: int, device: torch.device) -> int:
    """How many programs share one request's keys (flash-decoding), from shapes alone."""
    spare = _PROGRAMS_PER_SM * _sm_count(device) // programs
    # Rounded up, so that chunks of _MIN_KEYS_PER_SPLIT cover the capacity: chunks sit at
    # fixed cache indices, and rounded down they would double, leaving a short sequence in a
    # long page table fewer splits to run on.
    return max(1, min(spare, triton.cdiv(capacity, _MIN_KEYS_PER_SPLIT), _MAX_SPLITS))


def _split_chunk(capacity: int, splits: int, block_n: int) -> int:
    """Cache indices per split: whole key tiles, ``splits`` of them covering ``capacity``.
    A function of shapes, not of the prefix lengths, so split boundaries sit at the same cache
    indices in every call over one page table."""
    return triton.cdiv(triton.cdiv(capacity, splits), block_n) * block_n


def paged_attention_triton(
    q: Float[Tensor, "batch q head head_dim"],
    k_cache: Float[Tensor, "page page_size kv_head head_dim"],
    v_cache: Float[Tensor, "page page_size kv_head head_dim"],
    page_table: Int[Tensor, "batch max_pages"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q tail"],
    scale: float,
    window: int = 0,
    sinks: Float[Tensor, " head"] | None = None,
    *,
    num_splits: int | None = None,
    out: Float[Tensor, "batch q head head_dim"] | None = None,
) -> Float[Tensor, "batch q head head_dim"]:
    """Attention of ``q`` over each request's paged prefix and masked tail, in Triton.

    Same arguments and result as :func:`speculum.spec.attention.paged_attention` (values may
    be narrower than keys, and ``v_cache`` a strided view such as a latent cache's first
    columns): float32
    accumulation, output in ``q.dtype``, zeros for padded rows (``i >= q_lens[b]``) and for
    queries that see no key. Tensors live on one CUDA device (or the CPU under
    ``TRITON_INTERPRET=1``). Reads no tensor value on the host, so the call can be captured in
    a CUDA graph.

    ``window`` above 0: each query sees its last ``window`` keys only (sliding-window
    attention, ``spec.attention.window_limits``).

    ``sinks``: each head's sink logit joins its softmax's denominator (gpt-oss).

    ``num_splits`` overrides the split-KV rule (tests force the split path with it); ``out``
    receives the result in place of a fresh tensor (tests poison it to prove every element is
    written).
    """
    batch, num_q, heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    v_dim = v_cache.shape[-1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split into {kv_heads} KV-head groups")
    group = heads // kv_heads
    if out is None:
        out = q.new_empty(batch, num_q, heads, v_dim)
    if q.numel() == 0:
        return out
    tiles = _tiles(num_q, group, head_dim, v_dim, q.dtype)
    q_blocks = triton.cdiv(num_q, tiles["BLOCK_Q"])
    capacity = page_table.shape[1] * page_size
    if num_splits is None:
        # Calls of up to _INVARIANT_TOKENS tokens of one batch split alike (whatever their
        # query blocks), so that their tokens' outputs agree bit for bit; wider calls count
        # their query blocks (every split writes a partial per query row, so splitting a wide
        # tree as finely as a decode step would cost more in partials than it gains).
        invariant = num_q <= _INVARIANT_TOKENS
        num_splits = _num_splits(
            batch * kv_heads * (1 if invariant else q_blocks), capacity, q.device
        )
    if num_splits > 1:
        part_shape = (batch, num_q, heads, num_splits)
        acc = torch.empty(*part_shape, v_dim, dtype=torch.float32, device=q.device)
        m = torch.empty(part_shape, dtype=torch.float32, device=q.device)
        l_sum = torch.empty(part_shape, dtype=torch.float32, device=q.device)
        target, target_strides = acc, (0, 0, 0, 0)  # partials are addressed as contiguous
    else:
        target, m, l_sum, target_strides = out, out, out, out.stride()
    # Each query's first visible cache index (read only with a window; prefix_lens stands in).
    first_key = prefix_lens[:, None]
    if window:
        first_key, new_mask = window_limits(prefix_lens, new_mask, window)
    # The kernels' exponentials are base 2, so the sinks are scaled by log2(e) like the scores.
    sinks2 = None if sinks is None else sinks.float() * math.log2(math.e)
    # Triton loads bytes; a bool tensor reinterpreted as uint8 keeps its (maybe 0) strides.
    mask = new_mask.view(torch.uint8)
    _attention_kernel[(q_blocks, batch * kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        prefix_lens.contiguous(),
        q_lens.contiguous(),
        mask,
        first_key,
        target,
        m,
        l_sum,
        q if sinks2 is None else sinks2,  # any pointer stands in when there are none
        scale * math.log2(math.e),
        num_q,
        mask.shape[2],
        kv_heads,
        _split_chunk(capacity, num_splits, tiles["BLOCK_N"]),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *page_table.stride(),
        *mask.stride(),
        *first_key.stride(),
        *target_strides,
        GROUP=group,
        BLOCK_Q=tiles["BLOCK_Q"],
        BLOCK_M=tiles["BLOCK_M"],
        BLOCK_N=tiles["BLOCK_N"],
        HEAD_DIM=head_dim,
        BLOCK_D=tiles["BLOCK_D"],
        V_DIM=v_dim,
        BLOCK_DV=tiles["BLOCK_DV"],
        PAGE_SIZE=page_size,
        SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        TOKENS=tiles["TOKENS"],
        SCAN_N=tiles["SCAN_N"],
        WINDOWED=window > 0,
        HAS_SINKS=sinks is not None,
        num_warps=tiles["num_warps"],
        num_stages=tiles["num_stages"],
    )
    if num_splits > 1:
        combine_splits(acc, m, l_sum, out, sinks2)
    return out


def register() -> None:
    """Make :func:`paged_attention_triton` the CUDA kernel of ``speculum::paged_attention``."""
    from speculum.kernels.attention import paged_attention

    paged_attention.register_kernel("cuda")(paged_attention_triton)
