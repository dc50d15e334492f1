"""FP8 (e4m3) linear layers: ``speculum::fp8_linear``.

A quantized weight is ``weight [out, in]`` in ``float8_e4m3fn`` and a float32 ``scale [ceil(out
/ b0), ceil(in / b1)]``: one scale per ``b0 x b1`` block of the weight, whose real value is
``weight * scale`` (DeepSeek-V3's ``weight_scale_inv`` is such a scale despite its name). One
layout covers every granularity: a per-tensor scale is the block ``(out, in)`` (a ``[1, 1]``
scale), a per-channel one the block ``(1, in)`` (``[out, 1]``), DeepSeek's ``(128, 128)``.

The op's default kernel is the reference: the weight dequantized to the activations' dtype and
the ordinary matmul (activations are not quantized). On CUDA, decode-sized inputs (at most
:data:`GEMV_ROWS` rows) of every scale layout run a Triton matrix-vector kernel that
dequantizes in registers (``kernels.triton_fp8``; activations not quantized either). Larger
inputs with per-tensor and per-channel weights (Hopper, bfloat16 activations, widths that are
multiples of 16) run ``torch._scaled_mm`` with the activations quantized to e4m3 per token
(dynamically, or with the checkpoint's static ``input_scale``); anything else the reference,
which dequantizes the whole weight on every call (docs/fp8.md).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

__all__ = [
    "FP8",
    "FP8_MAX",
    "GEMV_ROWS",
    "cuda_kernel",
    "dequantize",
    "expand_scale",
    "fp8_linear",
    "fp8_linear_cuda",
    "fp8_linear_reference",
    "gemv_fits",
    "quantize_rows",
    "quantize_weight",
    "register",
    "scaled_mm_supported",
]

#: Whether Triton can be imported (the matrix-vector kernel is Triton's):
#: looked up once, not in every layer of every eager step.
_TRITON = importlib.util.find_spec("triton") is not None

#: The most input rows (tokens) the Triton matrix-vector kernel takes (one tile of its rows);
#: more run ``torch._scaled_mm`` or dequantize the weight once and run the matmul.
GEMV_ROWS = 16

FP8 = torch.float8_e4m3fn
#: The largest finite e4m3 value (448).
FP8_MAX = torch.finfo(FP8).max


def expand_scale(
    scale: Float[Tensor, "row_blocks col_blocks"], block: tuple[int, int], shape: torch.Size
) -> Float[Tensor, "out in"]:
    """Each weight element's scale: ``scale``'s blocks of ``block`` elements repeated over a
    weight of ``shape`` (the last row and column blocks may be partial)."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequantize(
    weight: Float[Tensor, "out in"],
    scale: Float[Tensor, "row_blocks col_blocks"],
    block: tuple[int, int],
    dtype: torch.dtype,
) -> Float[Tensor, "out in"]:
    """``weight * scale`` blockwise, computed in float32 and rounded once to ``dtype``."""
    return (weight.float() * expand_scale(scale, block, weight.shape)).to(dtype)


def quantize_weight(
    weight: Float[Tensor, "out in"], block: tuple[int, int]
) -> tuple[Float[Tensor, "out in"], Float[Tensor, "row_blocks col_blocks"]]:
    """``(e4m3 weight, float32 scale)`` of ``weight``: each block's scale maps its largest
    magnitude to :data:`FP8_MAX` (round to nearest), as the hub's FP8 exporters do."""
    rows, cols = weight.shape
    row_blocks, col_blocks = -(-rows // block[0]), -(-cols // block[1])
    padded = F.pad(
        weight.float(), (0, col_blocks * block[1] - cols, 0, row_blocks * block[0] - rows)
    )
    tiles = padded.view(row_blocks, block[0], col_blocks, block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    scaled = weight.float() / expand_scale(scale, block, weight.shape)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(
    rows: Float[Tensor, "rows in"], input_scale: Tensor | None
) -> tuple[Float[Tensor, "rows in"], Float[Tensor, "rows 1"]]:
    """``(e4m3 rows, float32 scale per row)`` of activations: each row scaled so that its
    largest magnitude is :data:`FP8_MAX` (dynamic per-token quantization, the weights' rule
    with one block per row), or every row by the static ``input_scale``."""
    if input_scale is None:
        return quantize_weight(rows, (1, rows.shape[1]))
    row_scale = input_scale.reshape(1, 1).float().expand(rows.shape[0], 1).contiguous()
    return (rows.float() / row_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), row_scale


def fp8_linear_reference(
    x: Float[Tensor, "*rows in"],
    weight: Float[Tensor, "out in"],
    scale: Float[Tensor, "row_blocks col_blocks"],
    block: list[int],
    input_scale: Tensor | None,
    bias: Tensor | None,
) -> Float[Tensor, "*rows out"]:
    """``linear(x, dequantize(weight))`` in ``x``'s dtype; ``input_scale`` (a static
    activation scale) is not used: the reference keeps activations unquantized."""
    return F.linear(x, dequantize(weight, scale, (block[0], block[1]), x.dtype), bias)


@torch.library.custom_op("speculum::fp8_linear", mutates_args=())
def fp8_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    block: list[int],
    input_scale: Tensor | None,
    bias: Tensor | None,
) -> Tensor:
    """``x @ (weight * scale).T + bias`` for an e4m3 ``weight`` of ``block``-shaped scales
    (see :func:`fp8_linear_reference`; the CUDA kernel is :func:`fp8_linear_cuda`)."""
    return fp8_linear_reference(x, weight, scale, block, input_scale, bias).contiguous()


@fp8_linear.register_fake
def _(x, weight, scale, block, input_scale, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def scaled_mm_supported(x: Tensor, weight: Tensor, block: list[int]) -> bool:
    """Whether :func:`fp8_linear_cuda` runs ``torch._scaled_mm``: one scale per output row or
    for the whole weight (``block[1]`` spans the input width), bfloat16 activations on a CUDA
    device of compute capability 9.0 or newer (row-wise scaling's kernel), and both widths
    multiples of 16 (its alignment rule)."""
    rows, cols = weight.shape
    return (
        block[1] >= cols
        and rows % 16 == 0
        and cols % 16 == 0
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def gemv_fits(x: Tensor) -> bool:
    """Whether the Triton matrix-vector kernel (``kernels.triton_fp8``) takes ``x``: Triton is
    installed and ``x`` has at most :data:`GEMV_ROWS` rows (decode steps, small verifies)."""
    return _TRITON and x.numel() <= GEMV_ROWS * x.shape[-1]


def cuda_kernel(x: Tensor, weight: Tensor, block: list[int]) -> str:
    """Which kernel :func:`fp8_linear_cuda` runs for ``x``: ``"triton_gemv"`` (Triton is
    installed and ``x`` has at most :data:`GEMV_ROWS` rows, whatever the scales),
    ``"scaled_mm"`` (more rows, where :func:`scaled_mm_supported`) or ``"reference"``.
    Shapes, dtypes and the device alone decide, so a captured graph keeps the choice."""
    if gemv_fits(x):
        return "triton_gemv"
    return "scaled_mm" if scaled_mm_supported(x, weight, block) else "reference"


def fp8_linear_cuda(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    block: list[int],
    input_scale: Tensor | None,
    bias: Tensor | None,
) -> Tensor:
    """The CUDA kernel of ``speculum::fp8_linear``, as :func:`cuda_kernel` picks. At most
    :data:`GEMV_ROWS` rows (decode, small verifies): the Triton matrix-vector kernel, which
    dequantizes the weight in registers (any scales; activations not quantized, as the
    reference's). More rows, where :func:`scaled_mm_supported`: activations quantized to
    e4m3 per token (:func:`quantize_rows`, one Triton launch where Triton is installed), then
    ``torch._scaled_mm`` with row-wise scales (a per-tensor weight scale repeated per row),
    float32 accumulation and bfloat16 output. Else the reference."""
    kernel = cuda_kernel(x, weight, block)
    if kernel == "triton_gemv":
        from speculum.kernels.triton_fp8 import fp8_gemv

        return fp8_gemv(x, weight, scale, block, bias)
    if kernel == "reference":
        return fp8_linear_reference(x, weight, scale, block, input_scale, bias).contiguous()
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if _TRITON:  # one launch where torch's ops take about six
        from speculum.kernels.triton_fp8 import quantize_rows_triton as quantize
    else:
        quantize = quantize_rows
    quantized, row_scale = quantize(rows, input_scale)
    weight_scale = scale.float().expand(weight.shape[0], 1).reshape(1, -1).contiguous()
    out = torch._scaled_mm(
        quantized,
        weight.t(),
        scale_a=row_scale,
        scale_b=weight_scale,
        out_dtype=x.dtype,
    )
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def register() -> None:
    """Install :func:`fp8_linear_cuda` as the CUDA kernel of ``speculum::fp8_linear``."""
    fp8_linear.register_kernel("cuda")(fp8_linear_cuda)
