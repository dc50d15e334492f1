"""Triton kernel of ``speculum::latent_attention``: multi-head latent attention (DeepSeek-V2/V3)
run absorbed over the latent paged cache.

Same function as :func:`speculum.spec.attention.latent_attention`: every query head attends to
one cached "KV head" per token, ``[latent (kv_lora_rank) | rotary key (qk_rope_head_dim)]``, with
the latent as the values. The grouped-query kernel (``triton_attention``) computes the same
thing, but it is shaped for heads of 128: it pads the 576-wide rows to 1024, loads the latent
twice (as keys and as values), and gives each program at most 32 query rows, so a 4-token
verify of 16 heads reads every latent page twice and a 128-head model's decode eight times.

Design
------
* **Grid** ``(token_blocks * head_blocks, splits, batch)``. One program serves ``BLOCK_M``
  query rows of one request, ``BLOCK_T`` tokens times ``BLOCK_H`` heads (row ``r`` is token
  ``r // BLOCK_H``, head ``r % BLOCK_H`` of its head block): a 16-head model's decode step, a
  4-token chain verify and every head of a token of a 64-head model fit one program of 64
  rows, so each latent tile is read from memory once for all of them; 128 heads take two
  programs per token, side by side in the grid so the second reads the tile from L2.
* **One latent load per key tile**, as keys and values: a tile is ``[BLOCK_N, kv_lora_rank]``
  latent columns and, separately, ``[BLOCK_N, qk_rope_head_dim]`` rotary columns, so 576-wide
  rows are never padded to 1024. Scores are ``q_latent @ latentᵀ`` then ``+= q_rope @ ropeᵀ``
  (two matrix products into one float32 accumulator); the output is ``P @ latent`` with the
  same tile. Triton splits the 512-wide contraction and the 512-wide output itself; cutting the
  latent into chunks by hand would need either a second load of each chunk for ``P @ V`` or
  one accumulator variable per chunk.
* **Keys** as in the grouped-query kernel: tiles of ``BLOCK_N`` at multiples of ``BLOCK_N`` of
  the cache index, each key's pool slot found through the page table (any page size, pages
  anywhere); prefix keys (``< prefix_lens[b]``) are seen by every query, tail key ``prefix_lens[b]
  + j`` by the rows whose ``new_mask[b, i, j]`` is set (chains, trees, multi-step drafts with
  ``tail > q``). A first pass over the block's mask rows finds one past the last tail column a
  real row sees, so a causal prefill chunk stops at its diagonal; in tiles that hold tail keys,
  a key no real row sees is not loaded (its slot may hold stale NaN, and ``0 * NaN`` in ``P @
  V`` is NaN). Online softmax in base 2, float32 accumulators, row sums as ``P @ ones``.
* **Split-KV** (flash-decoding), as in the grouped-query kernel and with its rule: when the
  grid's programs would leave SMs idle, each request's cache indices are cut into ``splits``
  fixed chunks of whole tiles over the page table's capacity, each program writes a partial
  (max, sum, unnormalised accumulator) and the grouped-query kernel's combine
  (``combine_splits``, 128 output columns a program) merges them. Split count and chunk come
  from shapes and the device alone.
* **Batch invariance** (bfloat16 speculative decoding emits plain decoding's tokens): every call
  of up to 8 query tokens of one batch (decode, draft steps, chain verify, small trees) runs
  the same ``BLOCK_M`` rows, the same key tiles at the same cache indices and the same split
  count, so a token's output has the same bits whether the tokens before it are prefix or
  tail; a token's place among the rows changes nothing (a product's rows are independent, the
  row sums are a product too).
* **CUDA graphs**: no tensor value is read on the host; lengths and masks are read on the device.

Without a GPU the kernel runs on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before this module is imported) in 16-row, 16-key tiles, which the parity tests use.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.kernels.triton_attention import (
    _INTERPRET,
    _INVARIANT_TOKENS,
    _load_seen,
    _num_splits,
    _query_rows,
    _split_chunk,
    _write_rows,
    combine_splits,
    output_rows,
)
from speculum.spec.attention import check_latent_shapes

__all__ = ["LatentTiles", "latent_attention_triton", "latent_tiles", "register"]


class LatentTiles(NamedTuple):
    """Launch shape of the latent-attention kernel: query rows (tokens x heads) and keys per
    program step, warps, and software-pipeline stages."""

    rows: int
    keys: int
    num_warps: int
    num_stages: int


#: Half-precision tiles on the GPU, by the model's heads (a per-model constant, so decode steps
#: and verifies tile alike and agree bit for bit), chosen by `benchmarks/mla_attention.py
#: --sweep` on the H200 (docs/benchmarks.md, fifteenth session). Up to 16 heads (DeepSeek-V2-Lite):
#: 32 rows (a decode's 16 heads fill half the tile, not a quarter) and 32-key tiles on 4 warps,
#: 1.2x faster at batch 1 and 1.5x at batch 32 than 64 rows, 9% slower on a 4-token verify.
#: More heads (DeepSeek-V3's 128): 64 rows, the smallest Hopper warpgroup product, and 64-key
#: tiles (72 KiB of bfloat16 latent and rope a stage) in 2 stages beside the 72 KiB query tile,
#: within the 228 KiB of shared memory; 64 x 512 float32 accumulators take 128 registers a
#: thread over 8 warps.
_FEW_HEAD_TILES = LatentTiles(rows=32, keys=32, num_warps=4, num_stages=2)
_MANY_HEAD_TILES = LatentTiles(rows=64, keys=64, num_warps=8, num_stages=2)
#: float32 (parity tests) multiplies on CUDA cores: smaller tiles keep its operands in shared
#: memory. The interpreter takes them too, so that tiny test shapes cross key-tile, split and
#: head-block boundaries.
_SMALL_TILES = LatentTiles(rows=16, keys=16, num_warps=4, num_stages=1)


@triton.jit
def _fold_keys(
    q_lat,
    q_pe,
    s,
    key_ok,
    visible,
    page_row,
    stride_pp,
    lat_base,
    pe_base,
    stride_cp,
    stride_cs,
    l_ok,
    r_ok,
    ones,
    m_i,
    l_acc,
    acc,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the keys at cache indices ``s [BLOCK_N]`` into the running softmax state.

    Keys with ``key_ok`` are loaded once, latent and rotary columns apart (others read as 0);
    the latent tile serves as keys and as values. ``visible [BLOCK_M, BLOCK_N]`` masks the
    scores. A row that has seen nothing keeps ``m = -inf``; its shift is taken as 0 so that
    ``exp2(-inf - shift)`` is 0, not NaN.
    """
    page = tl.load(page_row + (s // PAGE_SIZE) * stride_pp, mask=key_ok, other=0).to(tl.int64)
    slot = page * stride_cp + (s % PAGE_SIZE).to(tl.int64) * stride_cs
    lat = tl.load(lat_base + slot[:, None], mask=key_ok[:, None] & l_ok[None, :], other=0.0)
    pe = tl.load(pe_base + slot[:, None], mask=key_ok[:, None] & r_ok[None, :], other=0.0)
    lat, pe = lat.to(q_lat.dtype), pe.to(q_pe.dtype)
    qk = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
    qk = tl.dot(q_pe, tl.trans(pe), qk, input_precision=DOT_PRECISION)
    qk = tl.where(visible, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    weights = tl.exp2(qk - shift[:, None]).to(lat.dtype)
    l_acc = tl.dot(weights, ones, l_acc * alpha[:, None], input_precision=DOT_PRECISION)
    acc = tl.dot(weights, lat, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_acc, acc


@triton.jit
def _latent_kernel(
    q_ptr,
    cache_ptr,
    page_table_ptr,
    prefix_lens_ptr,
    q_lens_ptr,
    q_starts_ptr,
    mask_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    qk_scale,
    num_q,
    num_tail,
    num_heads,
    head_blocks,
    chunk,
    stride_qb,
    stride_qi,
    stride_qh,
    stride_qd,
    stride_cp,
    stride_cs,
    stride_cd,
    stride_pb,
    stride_pp,
    stride_mb,
    stride_mi,
    stride_mj,
    stride_ob,
    stride_oi,
    stride_oh,
    stride_od,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LATENT: tl.constexpr,
    BLOCK_L: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCAN_N: tl.constexpr,
    PACKED: tl.constexpr,
):
    """One (token block x head block, split, request) program; see the module docstring.

    With ``SPLITS == 1`` it writes the normalised output into ``out_ptr``; otherwise its
    unnormalised accumulator into ``out_ptr`` (a contiguous ``[batch, q, head, splits,
    LATENT]`` float32 buffer) and its row max / row sum into ``m_ptr`` / ``l_ptr``.
    """
    block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    t_block = block // head_blocks
    rows = tl.arange(0, BLOCK_M)
    qi = t_block * BLOCK_T + rows // BLOCK_H
    head = (block % head_blocks) * BLOCK_H + rows % BLOCK_H
    cols = tl.arange(0, BLOCK_L)
    l_ok = cols < LATENT
    rope_cols = tl.arange(0, BLOCK_R)
    r_ok = rope_cols < ROPE

    prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
    q_len = tl.load(q_lens_ptr + b).to(tl.int32)
    row_in = (qi < num_q) & (head < num_heads)  # rows of the output tensor
    row_ok = row_in & (qi < q_len)  # rows that are real queries
    # A block of padding tokens visits no key at all.
    block_live = t_block * BLOCK_T < q_len

    # One past the last tail column a real token of the block sees (mask rows are per token,
    # shared by its heads).
    tokens = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = (tokens < num_q) & (tokens < q_len)
    token_rows = mask_ptr + b * stride_mb + tokens[:, None] * stride_mi
    tail_end = tl.zeros([], tl.int32)
    for start in range(0, tl.where(block_live, num_tail, 0), SCAN_N):
        j = start + tl.arange(0, SCAN_N)
        col_seen = tl.max(_load_seen(token_rows, j, stride_mj, token_ok, num_tail), axis=0) > 0
        tail_end = tl.maximum(tail_end, tl.max(tl.where(col_seen, j + 1, 0)))

    # Packed (ragged verify), request b's queries sit at rows q_starts[b] .. of q and out.
    q_request, q_token = _query_rows(q_starts_ptr, b, qi, PACKED)
    q_rows = (
        q_ptr + q_request * stride_qb + q_token[:, None] * stride_qi + head[:, None] * stride_qh
    )
    q_lat = tl.load(
        q_rows + cols[None, :] * stride_qd, mask=row_ok[:, None] & l_ok[None, :], other=0.0
    )
    q_pe = tl.load(
        q_rows + (LATENT + rope_cols[None, :]) * stride_qd,
        mask=row_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_acc = tl.zeros([BLOCK_M, 16], tl.float32)
    ones = tl.full([BLOCK_N, 16], 1.0, q_lat.dtype)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)

    page_row = page_table_ptr + b * stride_pb
    lat_base = cache_ptr + cols[None, :] * stride_cd
    pe_base = cache_ptr + (LATENT + rope_cols[None, :]) * stride_cd
    mask_rows = mask_ptr + b * stride_mb + qi[:, None] * stride_mi
    keys = tl.arange(0, BLOCK_N)

    # This split owns the fixed chunk [lo, lo + chunk) of cache indices, wherever the prefix
    # ends (see "Batch invariance"). Tiles wholly inside the prefix are seen by every row; the
    # rest read the mask and load only the keys some real row sees.
    prefix = tl.where(block_live, prefix_len, 0)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix + tail_end)
    prefix_tiles_end = tl.maximum(lo, tl.minimum(hi, prefix // BLOCK_N * BLOCK_N))
    everyone = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)
    for start in range(lo, prefix_tiles_end, BLOCK_N):
        s = start + keys
        m_i, l_acc, acc = _fold_keys(
            q_lat, q_pe, s, s < hi, everyone, page_row, stride_pp, lat_base, pe_base,
            stride_cp, stride_cs, l_ok, r_ok, ones, m_i, l_acc, acc, qk_scale, PAGE_SIZE,
            DOT_PRECISION,
        )  # fmt: skip
    for start in range(prefix_tiles_end, hi, BLOCK_N):
        s = start + keys
        j = s - prefix
        seen = _load_seen(mask_rows, tl.maximum(j, 0), stride_mj, row_ok, num_tail) != 0
        visible = ((j < 0)[None, :] | seen) & (s < hi)[None, :]
        key_ok = tl.max(visible.to(tl.int32), axis=0) > 0
        m_i, l_acc, acc = _fold_keys(
            q_lat, q_pe, s, key_ok, visible, page_row, stride_pp, lat_base, pe_base,
            stride_cp, stride_cs, l_ok, r_ok, ones, m_i, l_acc, acc, qk_scale, PAGE_SIZE,
            DOT_PRECISION,
        )  # fmt: skip

    l_i = tl.max(l_acc, axis=1)  # its columns are equal: exact in any order
    _write_rows(
        out_ptr, m_ptr, l_ptr, acc, m_i, l_i, row_in, row_ok, b, qi, q_starts_ptr, head, cols,
        l_ok, split, num_q, num_heads, stride_ob, stride_oi, stride_oh, stride_od, LATENT,
        SPLITS, PACKED,
    )  # fmt: skip


def latent_tiles(dtype: torch.dtype, heads: int) -> LatentTiles:
    """The launch shape for queries of ``dtype`` over ``heads`` heads (a function of the model
    alone, not of the call's tokens, so every call of a batch tiles alike)."""
    if _INTERPRET or dtype == torch.float32:
        return _SMALL_TILES
    return _FEW_HEAD_TILES if heads <= 16 else _MANY_HEAD_TILES


def latent_attention_triton(
    q: Float[Tensor, "batch q head cache_dim"],
    cache: Float[Tensor, "page page_size 1 cache_dim"],
    page_table: Int[Tensor, "batch max_pages"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q tail"],
    scale: float,
    latent_dim: int,
    q_starts: Int[Tensor, " batch"] | None = None,
    *,
    num_splits: int | None = None,
    tiles: LatentTiles | None = None,
    out: Float[Tensor, "batch q head latent"] | None = None,
) -> Float[Tensor, "batch q head latent"]:
    """Absorbed multi-head latent attention of ``q`` over each request's paged latent prefix
    and masked tail, in Triton.

    Same arguments and result as :func:`speculum.spec.attention.latent_attention`: the cache's
    first ``latent_dim`` columns are the values, float32 accumulation, output in ``q.dtype``,
    zeros for padded rows (``i >= q_lens[b]``) and for queries that see no key. Tensors live on
    one CUDA device (or the CPU under ``TRITON_INTERPRET=1``). Reads no tensor value on the
    host, so the call can be captured in a CUDA graph.

    ``q_starts``: the queries are packed (ragged verify; ``q`` is ``[1, tokens, head,
    cache_dim]``, request ``b``'s at rows ``q_starts[b] ..``, ``new_mask`` padded to ``[batch,
    q, tail]``), as in ``paged_attention_triton``: the padded call's launch, each program
    reading and writing its request's rows from its offset, so a packed query's output has the
    padded one's bits; the rows after the last request's are zeroed.

    ``num_splits`` overrides the split-KV rule (tests force the split path with it), ``tiles``
    the launch shape (``benchmarks/mla_attention.py --sweep`` times alternatives with it);
    ``out`` receives the result in place of a fresh tensor (tests poison it to prove every
    element is written).
    """
    check_latent_shapes(q, cache, latent_dim)
    _, _, heads, cache_dim = q.shape
    batch, num_q = new_mask.shape[:2]
    page_size, rope = cache.shape[1], cache_dim - latent_dim
    out = output_rows(q, latent_dim, q_starts, out)
    if q.numel() == 0:
        return out
    tiles = latent_tiles(q.dtype, heads) if tiles is None else tiles
    block_h = min(triton.next_power_of_2(heads), tiles.rows)
    block_t = tiles.rows // block_h
    head_blocks = triton.cdiv(heads, block_h)
    token_blocks = triton.cdiv(num_q, block_t)
    capacity = page_table.shape[1] * page_size
    if num_splits is None:
        # Calls of up to _INVARIANT_TOKENS tokens of one batch split alike, whatever their
        # token blocks, so that their tokens' outputs agree bit for bit (module docstring).
        invariant = num_q <= _INVARIANT_TOKENS
        programs = batch * head_blocks * (1 if invariant else token_blocks)
        num_splits = _num_splits(programs, capacity, q.device)
    if num_splits > 1:
        part_shape = (batch, num_q, heads, num_splits)
        acc = torch.empty(*part_shape, latent_dim, dtype=torch.float32, device=q.device)
        m = torch.empty(part_shape, dtype=torch.float32, device=q.device)
        l_sum = torch.empty(part_shape, dtype=torch.float32, device=q.device)
        target, target_strides = acc, (0, 0, 0, 0)  # partials are addressed as contiguous
    else:
        target, m, l_sum, target_strides = out, out, out, out.stride()
    # Triton loads bytes; a bool tensor reinterpreted as uint8 keeps its (maybe 0) strides.
    mask = new_mask.view(torch.uint8)
    # 16 is the smallest product tile on the GPU; the interpreter takes any width.
    smallest = 1 if _INTERPRET else 16
    _latent_kernel[(token_blocks * head_blocks, num_splits, batch)](
        q,
        cache,
        page_table,
        prefix_lens.contiguous(),
        q_lens.contiguous(),
        q_lens if q_starts is None else q_starts.contiguous(),  # any pointer when padded
        mask,
        target,
        m,
        l_sum,
        scale * math.log2(math.e),  # the kernel's exponentials are base 2
        num_q,
        mask.shape[2],
        heads,
        head_blocks,
        _split_chunk(capacity, num_splits, tiles.keys),
        *q.stride(),
        cache.stride(0),
        cache.stride(1),
        cache.stride(3),
        *page_table.stride(),
        *mask.stride(),
        *target_strides,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_M=tiles.rows,
        BLOCK_N=tiles.keys,
        LATENT=latent_dim,
        BLOCK_L=max(smallest, triton.next_power_of_2(latent_dim)),
        ROPE=rope,
        BLOCK_R=max(smallest, triton.next_power_of_2(rope)),
        PAGE_SIZE=page_size,
        SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # The mask scan reads ~8K bytes a step (one per token and column), no fewer than a tile.
        SCAN_N=tiles.keys if _INTERPRET else max(tiles.keys, min(1024, 8192 // block_t)),
        PACKED=q_starts is not None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        combine_splits(acc, m, l_sum, out, q_lens=q_lens, q_starts=q_starts)
    return out


def register() -> None:
    """Make :func:`latent_attention_triton` the CUDA kernel of ``speculum::latent_attention``."""
    from speculum.kernels.attention import latent_attention

    latent_attention.register_kernel("cuda")(latent_attention_triton)
