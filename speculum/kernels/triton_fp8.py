"""FP8 linear layers of any scale blocks, for a few rows: matrix-vector products that read the
e4m3 weight once and dequantize it in registers; and the per-token activation quantizer of the
``torch._scaled_mm`` path, in one launch.

``torch._scaled_mm`` takes per-tensor and per-row scales only; DeepSeek-V3's 128 x 128 block
scales would otherwise go through the reference (``kernels.fp8``), which writes the whole
weight out in bfloat16 and reads it back: five bytes moved per weight where bfloat16 needs
two. Here each program is one row of the input and a block of output features; it streams its
weight rows in e4m3, multiplies each element by its block's scale, rounds to the activations'
dtype (as the reference's dequantized weight is) and accumulates in float32. Rows re-read the
weights (from L2 after the first), so this path is for decode-sized inputs
(``kernels.fp8.GEMV_ROWS`` rows at most); larger ones dequantize once and run the matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

__all__ = ["fp8_gemv", "quantize_rows_triton"]

#: Output features per program, and input features per step of its loop.
_BLOCK_N, _BLOCK_K = 32, 128
#: Features per step of the activation quantizer's loops.
_BLOCK_ROW = 1024
#: The largest finite e4m3 value (``kernels.fp8.FP8_MAX``).
_FP8_MAX = 448.0


@triton.jit
def _fp8_gemv(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    n_out,
    n_in,
    x_row_stride,
    w_row_stride,
    scale_row_stride,
    out_row_stride,
    block_rows,
    block_cols,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[m, n] = sum_k round(w[n, k] * scale[n // block_rows, k // block_cols]) * x[m, k]
    (+ bias[n])`` over one block of ``n``, the products rounded to ``x``'s dtype, accumulated
    in float32, the sum rounded once to ``out``'s dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = cols < n_out
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_row_stride
    scale_rows = scale_ptr + (cols // block_rows).to(tl.int64)[:, None] * scale_row_stride
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_in, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        inside = ks < n_in
        x = tl.load(x_ptr + row * x_row_stride + ks, mask=inside, other=0.0)
        mask = live[:, None] & inside[None, :]
        w = tl.load(w_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_rows + (ks // block_cols)[None, :], mask=mask, other=0.0)
        weight = (w * scale).to(x.dtype).to(tl.float32)
        acc += tl.sum(weight * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=live, other=0.0).to(tl.float32)
    out = out_ptr + row * out_row_stride + cols
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live)


def fp8_gemv(
    x: Float[Tensor, "*rows in"],
    weight: Float[Tensor, "out in"],
    scale: Float[Tensor, "row_blocks col_blocks"],
    block: list[int],
    bias: Tensor | None,
) -> Float[Tensor, "*rows out"]:
    """``linear(x, dequantize(weight, scale, block), bias)`` over the rows of ``x`` (a few:
    one program column each), in ``x``'s dtype, reading the e4m3 weight once per row."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    n_out, n_in = weight.shape
    out = torch.empty(rows.shape[0], n_out, dtype=x.dtype, device=x.device)
    scale = scale.float().contiguous()
    grid = (rows.shape[0], triton.cdiv(n_out, _BLOCK_N))
    _fp8_gemv[grid](
        rows,
        weight,
        scale,
        bias if bias is not None else out,
        out,
        n_out,
        n_in,
        rows.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        block[0],
        block[1],
        HAS_BIAS=bias is not None,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
    )
    return out.view(*x.shape[:-1], n_out)


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
