"""Half-precision linear layers at decode sizes: ``speculum::half_linear``.

``half_linear(x, weight, bias, float32_out)`` is ``F.linear(x, weight, bias)`` for a weight in
``x``'s dtype, or, with ``float32_out``, the float32 product of the same operands (logits:
``models.decoder.float32_logits``). Its default kernel is that reference. On CUDA, inputs of
at most ``kernels.fp8.GEMV_ROWS`` rows run the Triton matrix-vector kernel the FP8 layers use
(``kernels.triton_fp8.half_gemv``: the weight streamed once, a fixed tile of rows, float32
sums), more rows cuBLAS. The decoder calls this op only for the projection kinds an engine
names (``EngineConfig.half_gemv``; ``models.decoder.gemv_projections_``): cuBLAS reads the
8B shape's MLP weights at 95-98% of the copy bandwidth but its q/k/v and o projections at
73-76%, so which kinds gain is measured, not assumed (docs/gpu.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from speculum.kernels import fp8

__all__ = ["cuda_kernel", "half_linear", "half_linear_cuda", "half_linear_reference", "register"]


def half_linear_reference(
    x: Float[Tensor, "*rows in"],
    weight: Float[Tensor, "out in"],
    bias: Tensor | None,
    float32_out: bool,
) -> Float[Tensor, "*rows out"]:
    """``F.linear(x, weight, bias)``; with ``float32_out`` over the operands widened to float32
    (each product exact for 16-bit operands, the sums and the result float32)."""
    if not float32_out:
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@torch.library.custom_op("speculum::half_linear", mutates_args=())
def half_linear(x: Tensor, weight: Tensor, bias: Tensor | None, float32_out: bool) -> Tensor:
    """``x @ weight.T + bias``, in ``x``'s dtype or float32 (:func:`half_linear_reference`;
    the CUDA kernel is :func:`half_linear_cuda`)."""
    return half_linear_reference(x, weight, bias, float32_out).contiguous()


@half_linear.register_fake
def _(x, weight, bias, float32_out):
    dtype = torch.float32 if float32_out else x.dtype
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=dtype)


def cuda_kernel(x: Tensor) -> str:
    """Which kernel :func:`half_linear_cuda` runs for ``x``: ``"triton_gemv"`` (Triton is
    installed and ``x`` has at most ``kernels.fp8.GEMV_ROWS`` rows) or ``"cublas"``. The row
    count alone decides, so a captured graph keeps the choice."""
    return "triton_gemv" if fp8.gemv_fits(x) else "cublas"


def half_linear_cuda(
    x: Tensor, weight: Tensor, bias: Tensor | None, float32_out: bool
) -> Float[Tensor, "*rows out"]:
    """The CUDA kernel of ``speculum::half_linear``, as :func:`cuda_kernel` picks: the Triton
    matrix-vector kernel up to ``GEMV_ROWS`` rows (its output float32 or ``x``'s dtype, as
    asked); above, ``F.linear``, or for float32 out a matmul writing float32 directly (the
    same bytes read, as ``models.decoder.float32_logits`` does)."""
    if cuda_kernel(x) == "triton_gemv":
        from speculum.kernels.triton_fp8 import half_gemv

        return half_gemv(x, weight, bias, torch.float32 if float32_out else x.dtype)
    if not float32_out or x.dtype == torch.float32:
        return half_linear_reference(x, weight, bias, float32_out).contiguous()
    rows = x.reshape(-1, x.shape[-1])
    out = torch.mm(rows, weight.t(), out_dtype=torch.float32)
    if bias is not None:
        out = out + bias.float()
    return out.view(*x.shape[:-1], weight.shape[0])


def register() -> None:
    """Install :func:`half_linear_cuda` as the CUDA kernel of ``speculum::half_linear``."""
    half_linear.register_kernel("cuda")(half_linear_cuda)
