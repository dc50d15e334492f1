"""Linear layers for a few rows: a matrix-vector kernel that reads the weight once, in e4m3
(dequantized in registers) or in half precision; and the per-token activation quantizer of the
``torch._scaled_mm`` path, in one launch.

At decode sizes (``kernels.fp8.GEMV_ROWS`` rows at most) a linear layer is a stream of its
weight: per-tensor, per-channel and DeepSeek-V3's 128 x 128 block scales all run this kernel
there (``torch._scaled_mm`` reached about half the bandwidth at 1-8 rows on the H200, and takes
no block scales at all), and so may unquantized bfloat16 or float16 weights
(``kernels.half``: cuBLAS reaches 73-76% of the copy bandwidth at the 8B shape's q/k/v and o
projections, and adds split-K reduction kernels). Each program is a block of ``block_n``
output features by up to :data:`_BLOCK_M` input rows: it streams its weight rows (16-byte
loads along the input features), multiplies e4m3 weights by their scale (one per output row
where the scale spans the input width, else its block's, gathered), rounds them to the
activations' dtype (as the reference's dequantized weight is) and accumulates the rows'
products in float32 on the tensor cores (exact products for bfloat16 and float16; IEEE
float32 otherwise). Activations are not quantized. The tile is fixed, whatever the row count,
so a row's output does not depend on how many rows share the call: a verify of k + 1 rows
computes each row as a decode step would.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

__all__ = ["TILES", "Tile", "fp8_gemv", "half_gemv", "quantize_rows_triton"]

#: Input rows per program: the tensor cores' smallest tile (fewer rows are masked), fixed so
#: that a row's output does not depend on the row count.
_BLOCK_M = 16
#: Features per step of the activation quantizer's loops.
_BLOCK_ROW = 1024
#: The largest finite e4m3 value (``kernels.fp8.FP8_MAX``).
_FP8_MAX = 448.0


class Tile(NamedTuple):
    """A launch shape of the matrix-vector kernel: output features per program (small, so
    that even a 4096-wide layer has a program per SM), input features per step of its loop,
    warps per program, and loads in flight per program (the loop's software pipeline)."""

    block_n: int
    block_k: int
    warps: int
    stages: int


#: The tile of each weight kind, each chosen by its sweep on the H200. ``"fp8"``: ``python
#: benchmarks/fp8_gemv.py --sweep`` (docs/fp8.md), the best at 6 of the 8B shape's 12 (layer,
#: rows) cases; 512 e4m3 weights a step are 32 loads of 16 bytes a row. ``"half"`` (bfloat16
#: and float16 weights): ``python benchmarks/half_gemv.py --sweep --rows 1,8`` (docs/gpu.md),
#: the tile nearest each case's best (1.05x of it, geometric mean), one stage short of the best
#: for o and down, where it beats cuBLAS. float32 activations (parity tests) take twice the
#: shared memory a step: they run half the step.
TILES = {"fp8": Tile(32, 512, 4, 3), "half": Tile(32, 512, 4, 3)}


@triton.jit(do_not_specialize=["n_rows"])
def _gemv(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    n_rows,
    n_out,
    n_in,
    x_row_stride,
    w_row_stride,
    scale_row_stride,
    out_row_stride,
    block_rows,
    block_cols,
    SCALED: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[m, n] = sum_k round(w[n, k] * scale[n // block_rows, k // block_cols]) * x[m, k]
    (+ bias[n])`` over one block of ``m`` and of ``n``, the weights rounded to ``x``'s dtype,
    accumulated in float32, the sum rounded once to ``out``'s dtype. Without ``SCALED`` the
    weights are taken as they are (``scale_ptr`` is not read); without ``SCALE_COLS`` the
    scale spans the input width (per channel or per tensor) and is loaded once.
    ``PRECISION`` is the dot's: ``"ieee"`` for float32 (not TF32's 10-bit mantissas)."""
    # row tiles vary fastest, so the programs reading one weight block run together (L2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live, live_rows = cols < n_out, rows < n_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_row_stride
    scale_rows = scale_ptr + (cols // block_rows).to(tl.int64)[:, None] * scale_row_stride
    if SCALED and not SCALE_COLS:
        row_scale = tl.load(scale_rows, mask=live[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_in, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        inside = ks < n_in
        x = tl.load(x_rows + ks[None, :], mask=live_rows[:, None] & inside[None, :], other=0.0)
        mask = live[:, None] & inside[None, :]
        w = tl.load(w_rows + ks[None, :], mask=mask, other=0.0)
        if SCALED:
            if SCALE_COLS:
                scale = tl.load(scale_rows + (ks // block_cols)[None, :], mask=mask, other=0.0)
            else:
                scale = row_scale
            weight = (w.to(tl.float32) * scale).to(x.dtype)
        else:
            weight = w.to(x.dtype)
        acc = tl.dot(x, tl.trans(weight), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=live, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * out_row_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live_rows[:, None] & live[None, :])


def _launch(
    x: Float[Tensor, "*rows in"],
    weight: Float[Tensor, "out in"],
    scale: Tensor | None,
    block: list[int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
    tile: Tile,
) -> Float[Tensor, "*rows out"]:
    """Run :func:`_gemv` over ``x``'s rows (``scale`` None: unscaled weights) into a new
    ``out_dtype`` tensor."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    weight = weight.contiguous()  # unit stride along rows: already so for layers, fused or not
    n_out, n_in = weight.shape
    out = torch.empty(rows.shape[0], n_out, dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(rows.shape[0], _BLOCK_M), triton.cdiv(n_out, tile.block_n))
    float32 = x.dtype == torch.float32
    _gemv[grid](
        rows,
        weight,
        weight if scale is None else scale,  # not read without scales
        bias if bias is not None else out,
        out,
        rows.shape[0],
        n_out,
        n_in,
        rows.stride(0),
        weight.stride(0),
        0 if scale is None else scale.stride(0),
        out.stride(0),
        block[0],
        block[1],
        SCALED=scale is not None,
        SCALE_COLS=block[1] < n_in,
        HAS_BIAS=bias is not None,
        PRECISION="ieee" if float32 else "tf32",  # 16-bit floats ignore it
        BLOCK_M=_BLOCK_M,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k // 2 if float32 else tile.block_k,
        num_warps=tile.warps,
        num_stages=tile.stages,
    )
    return out.view(*x.shape[:-1], n_out)


def fp8_gemv(
    x: Float[Tensor, "*rows in"],
    weight: Float[Tensor, "out in"],
    scale: Float[Tensor, "row_blocks col_blocks"],
    block: list[int],
    bias: Tensor | None,
) -> Float[Tensor, "*rows out"]:
    """``linear(x, dequantize(weight, scale, block), bias)`` in ``x``'s dtype, reading the e4m3
    weight once per :data:`_BLOCK_M` rows of ``x`` (meant for a few: ``kernels.fp8.GEMV_ROWS``).
    Any block shape: per tensor ``(out, in)``, per channel ``(1, in)``, DeepSeek's blocks."""
    scale = scale.float().contiguous()
    return _launch(x, weight, scale, block, bias, x.dtype, TILES["fp8"])


def half_gemv(
    x: Float[Tensor, "*rows in"],
    weight: Float[Tensor, "out in"],
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Float[Tensor, "*rows out"]:
    """``linear(x, weight, bias)`` for a weight in ``x``'s dtype (bfloat16 or float16; float32
    for tests), reading the weight once per :data:`_BLOCK_M` rows of ``x`` (meant for a few),
    the float32 sums rounded once to ``out_dtype`` (float32 for logits)."""
    return _launch(x, weight, None, [1, weight.shape[1]], bias, out_dtype, TILES["half"])


@triton.jit
def _quantize_rows(
    x_ptr,
    out_ptr,
    scale_ptr,
    static_ptr,
    n_in,
    x_row_stride,
    out_row_stride,
    STATIC: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row of ``x`` in e4m3: ``clamp(x / scale, -448, 448)`` rounded to nearest, the
    scale (``max(amax, 1e-12) / 448``, or the static one) stored for the matmul."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_in, BLOCK):
            ks = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + ks, mask=ks < n_in, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_in, BLOCK):
        ks = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + ks, mask=ks < n_in, other=0.0).to(tl.float32)
        quantized = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        out = out_ptr + row * out_row_stride + ks
        tl.store(out, quantized.to(out_ptr.dtype.element_ty), mask=ks < n_in)


def quantize_rows_triton(
    rows: Float[Tensor, "rows in"], input_scale: Tensor | None
) -> tuple[Float[Tensor, "rows in"], Float[Tensor, "rows 1"]]:
    """``kernels.fp8.quantize_rows`` in one launch (one program per row)."""
    out = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=rows.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    static = input_scale is not None
    _quantize_rows[(rows.shape[0],)](
        rows,
        out,
        scale,
        input_scale if static else scale,
        rows.shape[1],
        rows.stride(0),
        out.stride(0),
        STATIC=static,
        FP8_MAX=_FP8_MAX,
        BLOCK=_BLOCK_ROW,
    )
    return out, scale
