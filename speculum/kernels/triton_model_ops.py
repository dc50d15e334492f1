"""Fused Triton kernels for the decoder's elementwise ops: one launch each.

Each kernel repeats its reference's rounding steps (``speculum.kernels.model_ops``): arithmetic in
float32, with a cast to the reference's dtype wherever torch rounds an intermediate tensor (for
bfloat16 ``a * b`` torch computes ``float(a) * float(b)`` and rounds once, so the kernel does the
same). Kernels launch with ``enable_fp_fusion=False`` because torch runs each multiply and add
as its own rounded op: a fused multiply-add would round once where torch rounds twice.

On the GPU, ``tl.cos``, ``tl.sin`` and ``tl.math.rsqrt`` return exactly what torch's CUDA
``cos``, ``sin`` and ``rsqrt`` do (no difference in 4M values each on an H200), but ``tl.exp`` is
the approximate ``ex2.approx`` and ``/`` the approximate ``div.full`` (70 % and 29 % of values
differed), so silu takes libdevice's ``expf``, the function torch calls, and divisions are
``div_rn``. Triton's interpreter has no libdevice, so interpreted kernels (CPU tests) take numpy's
``exp``; its float32-to-bfloat16 cast also truncates where the GPU rounds to nearest, so
interpreted bfloat16 results can sit an ulp or so from the reference.

Launch parameters depend only on shapes and dtypes, and nothing reads device memory on the host,
so every launcher can be captured in a CUDA graph. :func:`register` makes these the ops' CUDA
kernels; importing this module registers nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from jaxtyping import Float, Int
from torch import Tensor
from triton.language.extra import libdevice

from speculum.kernels import model_ops

__all__ = [
    "add_rms_norm_triton",
    "register",
    "rms_norm_triton",
    "rope_triton",
    "rope_write_kv_triton",
    "silu_mul_triton",
]

# Whether kernels are compiled for a GPU (libdevice available) rather than interpreted.
_LIBDEVICE = tl.constexpr(not triton.knobs.runtime.interpret)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# silu_mul's column block: a row of Llama-8B's 14336-wide MLP is 14 programs.
_SILU_BLOCK = 1024


@triton.jit
def _round(v, dtype: tl.constexpr):
    """``v`` rounded to ``dtype`` and widened back to float32: one torch op's output rounding."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _exp(v):
    """``expf``, as torch's CUDA ``silu`` computes it (``tl.exp`` is the approximate
    ``ex2.approx``: 70 % of values differed on an H200)."""
    if _LIBDEVICE:
        return libdevice.exp(v)
    else:
        return tl.exp(v)


@triton.jit
def _normed(h, w_ptr, cols, mask, n, eps, x_dtype: tl.constexpr, out_dtype: tl.constexpr):
    """RMSNorm of one row ``h`` (float32, zero past ``n``) scaled by the weight, in
    ``out_dtype``."""
    # torch squares, then sums, then divides by n (CPU ``mean``; CUDA multiplies by 1/n, the
    # same for a power-of-two n): no fused square-add, a correctly rounded division.
    # tl.cast, not n.to: Triton passes n == 1 as a Python constant.
    mean = tl.math.div_rn(tl.sum(h * h, axis=0), tl.cast(n, tl.float32))
    normed = _round(h * tl.math.rsqrt(mean + eps), x_dtype)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    return (w * normed).to(out_dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, n, x_row_stride, x_col_stride, eps, BLOCK: tl.constexpr
):
    """One program per row: RMSNorm of ``x[row, :n]`` into the contiguous ``out``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask, other=0.0)
    out = _normed(
        x.to(tl.float32),
        w_ptr,
        cols,
        mask,
        n,
        eps,
        x_ptr.dtype.element_ty,
        out_ptr.dtype.element_ty,
    )
    tl.store(out_ptr + row * n + cols, out, mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n,
    x_row_stride,
    x_col_stride,
    r_row_stride,
    r_col_stride,
    eps,
    BLOCK: tl.constexpr,
):
    """One program per row: ``sum = x + r`` rounded to ``sum``'s dtype, and its RMSNorm."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * r_row_stride + cols * r_col_stride, mask=mask, other=0.0)
    sum_dtype = sum_ptr.dtype.element_ty
    h = _round(x.to(tl.float32) + r.to(tl.float32), sum_dtype)
    tl.store(sum_ptr + row * n + cols, h.to(sum_dtype), mask=mask)
    out = _normed(h, w_ptr, cols, mask, n, eps, sum_dtype, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n + cols, out, mask=mask)


@triton.jit
def _cos_sin(pos_ptr, inv_ptr, HALF: tl.constexpr, dtype: tl.constexpr):
    """The rotary cosines and sines of one token's position, rounded to ``dtype`` as the
    reference rounds them, as ``[1, HALF]`` rows."""
    d = tl.arange(0, HALF)
    angles = tl.load(pos_ptr).to(tl.float32) * tl.load(inv_ptr + d).to(tl.float32)
    return _round(tl.cos(angles), dtype)[None, :], _round(tl.sin(angles), dtype)[None, :]


@triton.jit
def _rotated(src, stride_d, mask, cos, sin, HALF: tl.constexpr, dtype: tl.constexpr):
    """The two rotated halves of the heads at ``src`` (``[heads, HALF]`` pointers to their
    first halves): ``x * cos + cat([-second, first]) * sin``, each product and the sum rounded
    as torch's are."""
    first = tl.load(src, mask=mask).to(tl.float32)
    second = tl.load(src + HALF * stride_d, mask=mask).to(tl.float32)
    out_first = _round(first * cos, dtype) + _round(-second * sin, dtype)
    out_second = _round(second * cos, dtype) + _round(first * sin, dtype)
    return out_first, out_second


@triton.jit
def _rope_heads(
    src, stride_h, stride_d, heads, dst, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr
):
    """Rotate ``heads`` heads at ``src`` (strided) into contiguous ``[heads, 2 * HALF]`` rows at
    ``dst``, rounded to the source's dtype (the reference's rotary output), then to ``dst``'s."""
    dtype = src.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < heads
    first, second = _rotated(
        src + h * stride_h + d * stride_d, stride_d, mask, cos, sin, HALF, dtype
    )
    out_dtype = dst.dtype.element_ty
    rows = dst + h * (2 * HALF) + d
    tl.store(rows, first.to(dtype).to(out_dtype), mask=mask)
    tl.store(rows + HALF, second.to(dtype).to(out_dtype), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr,
    pos_ptr,
    inv_ptr,
    out_ptr,
    q_len,
    heads,
    x_stride_b,
    x_stride_q,
    x_stride_h,
    x_stride_d,
    pos_stride_b,
    pos_stride_q,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program per token: rotate every head of ``x[b, t]`` by ``positions[b, t]``."""
    token = tl.program_id(0).to(tl.int64)
    b = token // q_len
    t = token % q_len
    dtype = x_ptr.dtype.element_ty
    cos, sin = _cos_sin(pos_ptr + b * pos_stride_b + t * pos_stride_q, inv_ptr, HALF, dtype)
    src = x_ptr + b * x_stride_b + t * x_stride_q
    dst = out_ptr + token * heads * (2 * HALF)
    _rope_heads(src, x_stride_h, x_stride_d, heads, dst, cos, sin, HALF, BLOCK_H)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    inv_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    out_ptr,
    q_len,
    q_heads,
    kv_heads,
    q_stride_b,
    q_stride_q,
    q_stride_h,
    q_stride_d,
    k_stride_b,
    k_stride_q,
    k_stride_h,
    k_stride_d,
    v_stride_b,
    v_stride_q,
    v_stride_h,
    v_stride_d,
    pos_stride_b,
    pos_stride_q,
    slot_stride_b,
    slot_stride_q,
    HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):
    """One program per token: rotate its query heads into ``out`` and its key heads into the
    key cache at the token's slot, and copy its value heads into the value cache there."""
    token = tl.program_id(0).to(tl.int64)
    b = token // q_len
    t = token % q_len
    dtype = q_ptr.dtype.element_ty
    cos, sin = _cos_sin(pos_ptr + b * pos_stride_b + t * pos_stride_q, inv_ptr, HALF, dtype)
    q_src = q_ptr + b * q_stride_b + t * q_stride_q
    q_dst = out_ptr + token * q_heads * (2 * HALF)
    _rope_heads(q_src, q_stride_h, q_stride_d, q_heads, q_dst, cos, sin, HALF, BLOCK_Q)
    # The slot's row of each cache holds kv_heads x head_dim values.
    slot = tl.load(slot_ptr + b * slot_stride_b + t * slot_stride_q).to(tl.int64)
    k_src = k_ptr + b * k_stride_b + t * k_stride_q
    k_dst = kc_ptr + slot * kv_heads * (2 * HALF)
    _rope_heads(k_src, k_stride_h, k_stride_d, kv_heads, k_dst, cos, sin, HALF, BLOCK_KV)
    h = tl.arange(0, BLOCK_KV)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < kv_heads
    row = slot * kv_heads * (2 * HALF) + h * (2 * HALF) + d
    src = v_ptr + b * v_stride_b + t * v_stride_q + h * v_stride_h + d * v_stride_d
    v_dtype = vc_ptr.dtype.element_ty
    tl.store(vc_ptr + row, tl.load(src, mask=mask).to(v_dtype), mask=mask)
    tl.store(
        vc_ptr + row + HALF, tl.load(src + HALF * v_stride_d, mask=mask).to(v_dtype), mask=mask
    )


@triton.jit
def _silu_mul_kernel(
    g_ptr,
    u_ptr,
    out_ptr,
    n,
    g_row_stride,
    g_col_stride,
    u_row_stride,
    u_col_stride,
    BLOCK: tl.constexpr,
):
    """Program ``(row, block)``: ``silu(g) * u`` over one block of one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(g_ptr + row * g_row_stride + cols * g_col_stride, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols * u_col_stride, mask=mask).to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) in float32, rounded once to gate's dtype.
    silu = _round(tl.math.div_rn(g, 1.0 + _exp(-g)), g_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def _check_floats(**tensors: Tensor) -> None:
    """Reject dtypes the kernels do not compute as torch does (float64 would need float64
    arithmetic throughout)."""
    for name, t in tensors.items():
        if t.dtype not in _FLOATS:
            raise TypeError(
                f"{name} is {t.dtype}; the Triton model ops take float32, float16 or bfloat16"
            )


def _row_warps(block: int) -> int:
    """Warps for a program over ``block`` elements: ~8 per thread, 1 to 16 warps."""
    return max(1, min(16, block // 256))


def rms_norm_triton(
    x: Float[Tensor, "*rows hidden"], weight: Float[Tensor, " hidden"], eps: float
) -> Float[Tensor, "*rows hidden"]:
    """Fused :func:`~speculum.kernels.model_ops.rms_norm`: one program per row."""
    _check_floats(x=x, weight=weight)
    n = x.shape[-1]
    out = x.new_empty(x.shape, dtype=torch.result_type(weight, x))
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, n)  # a view where x's strides allow one
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        weight.contiguous(),
        out,
        n,
        rows.stride(0),
        rows.stride(1),
        eps,
        BLOCK=block,
        num_warps=_row_warps(block),
        enable_fp_fusion=False,
    )
    return out


def add_rms_norm_triton(
    x: Float[Tensor, "*rows hidden"],
    residual: Float[Tensor, "*rows hidden"],
    weight: Float[Tensor, " hidden"],
    eps: float,
) -> tuple[Float[Tensor, "*rows hidden"], Float[Tensor, "*rows hidden"]]:
    """Fused :func:`~speculum.kernels.model_ops.add_rms_norm`: one program per row."""
    _check_floats(x=x, residual=residual, weight=weight)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    n = x.shape[-1]
    summed = x.new_empty(x.shape, dtype=torch.result_type(x, residual))
    out = x.new_empty(x.shape, dtype=torch.result_type(weight, summed))
    if out.numel() == 0:
        return out, summed
    xs, rs = x.reshape(-1, n), residual.reshape(-1, n)
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(xs.shape[0],)](
        xs,
        rs,
        weight.contiguous(),
        out,
        summed,
        n,
        xs.stride(0),
        xs.stride(1),
        rs.stride(0),
        rs.stride(1),
        eps,
        BLOCK=block,
        num_warps=_row_warps(block),
        enable_fp_fusion=False,
    )
    return out, summed


def rope_triton(
    x: Float[Tensor, "batch q head head_dim"],
    positions: Int[Tensor, "batch q"],
    inv_freq: Float[Tensor, " half"],
) -> Float[Tensor, "batch q head head_dim"]:
    """Fused :func:`~speculum.kernels.model_ops.rope`: one program per token, all heads.

    ``head_dim`` must be a power of two (every Llama-family model's is).
    """
    if 2 * inv_freq.shape[-1] < x.shape[-1]:  # partial rotary (GLM-4.5): no fused kernel yet
        return model_ops.rope_reference(x, positions, inv_freq).contiguous()
    _check_floats(x=x, inv_freq=inv_freq)
    batch, q_len, heads, head_dim = x.shape
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} is not a power of two")
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(
            f"inv_freq {tuple(inv_freq.shape)} is not [head_dim / 2 = {head_dim // 2}]"
        )
    out = x.new_empty(x.shape)
    if out.numel() == 0:
        return out
    block_h = triton.next_power_of_2(heads)
    _rope_kernel[(batch * q_len,)](
        x,
        positions,
        inv_freq.contiguous(),
        out,
        q_len,
        heads,
        *x.stride(),
        *positions.stride(),
        HALF=head_dim // 2,
        BLOCK_H=block_h,
        num_warps=_row_warps(block_h * head_dim),
        enable_fp_fusion=False,
    )
    return out


def rope_write_kv_triton(
    q: Float[Tensor, "batch q head head_dim"],
    k: Float[Tensor, "batch q kv_head head_dim"],
    v: Float[Tensor, "batch q kv_head head_dim"],
    positions: Int[Tensor, "batch q"],
    inv_freq: Float[Tensor, " half"],
    k_cache: Float[Tensor, "page page_size kv_head head_dim"],
    v_cache: Float[Tensor, "page page_size kv_head head_dim"],
    slots: Int[Tensor, "batch q"],
) -> Float[Tensor, "batch q head head_dim"]:
    """Fused :func:`~speculum.kernels.model_ops.rope_write_kv`: one program per token, all of
    its query, key and value heads (rotary twice and two K/V writes in one launch)."""
    if 2 * inv_freq.shape[-1] < q.shape[-1]:  # partial rotary (GLM-4.5): no fused kernel yet
        return model_ops.rope_write_kv_reference(
            q, k, v, positions, inv_freq, k_cache, v_cache, slots
        ).contiguous()
    _check_floats(q=q, k=k, v=v, inv_freq=inv_freq, k_cache=k_cache, v_cache=v_cache)
    batch, q_len, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} is not a power of two")
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if k.dtype != q.dtype:  # the kernel rounds one set of cosines and sines for both
        raise TypeError(f"q is {q.dtype} and k {k.dtype}: rotate queries and keys of one dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the K/V caches must be contiguous (a layer of a KV pool is)")
    out = q.new_empty(q.shape)
    if out.numel() == 0:
        return out
    block_q, block_kv = triton.next_power_of_2(heads), triton.next_power_of_2(kv_heads)
    _rope_write_kv_kernel[(batch * q_len,)](
        q,
        k,
        v,
        positions,
        inv_freq.contiguous(),
        k_cache,
        v_cache,
        slots,
        out,
        q_len,
        heads,
        kv_heads,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *positions.stride(),
        *slots.stride(),
        HALF=head_dim // 2,
        BLOCK_Q=block_q,
        BLOCK_KV=block_kv,
        num_warps=_row_warps(block_q * head_dim),
        enable_fp_fusion=False,
    )
    return out


def silu_mul_triton(
    gate: Float[Tensor, "*rows inter"], up: Float[Tensor, "*rows inter"]
) -> Float[Tensor, "*rows inter"]:
    """Fused :func:`~speculum.kernels.model_ops.silu_mul`: one program per row block."""
    _check_floats(gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    n = gate.shape[-1]
    out = gate.new_empty(gate.shape, dtype=torch.result_type(gate, up))
    if out.numel() == 0:
        return out
    # Views where strides allow: gate and up may be halves of one fused projection.
    gs, us = gate.reshape(-1, n), up.reshape(-1, n)
    block = min(_SILU_BLOCK, triton.next_power_of_2(n))
    _silu_mul_kernel[(gs.shape[0], triton.cdiv(n, block))](
        gs,
        us,
        out,
        n,
        gs.stride(0),
        gs.stride(1),
        us.stride(0),
        us.stride(1),
        BLOCK=block,
        num_warps=_row_warps(block),
        enable_fp_fusion=False,
    )
    return out


def register() -> None:
    """Make these launchers the CUDA kernels of the ``speculum`` model ops (idempotent)."""
    model_ops.rms_norm.register_kernel("cuda")(rms_norm_triton)
    model_ops.add_rms_norm.register_kernel("cuda")(add_rms_norm_triton)
    model_ops.rope.register_kernel("cuda")(rope_triton)
    model_ops.rope_write_kv.register_kernel("cuda")(rope_write_kv_triton)
    model_ops.silu_mul.register_kernel("cuda")(silu_mul_triton)
