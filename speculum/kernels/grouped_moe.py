"""The routed experts of a mixture-of-experts MLP as two grouped GEMMs over each row's selected
experts only: the CUDA kernel of ``speculum::moe``.

The reference (``model_ops.moe_reference``) runs every row through every expert, which costs
``num_experts / top_k`` times the FLOPs and, worse for decoding, reads every expert's weights
each step. Here the ``rows * top_k`` (row, expert) pairs are sorted by expert, each expert's
contiguous run of pairs goes through its own weights (``torch._grouped_mm``, whose group
boundaries are read on the device: no ``.item()``, no shape that depends on the routing, so a
captured round stays one CUDA graph, and experts no row selected are never read), and each
row's ``top_k`` outputs are summed back in ascending expert order, as the reference sums them
(a fixed order, not atomics racing: the same inputs give the same bits).
"""

from __future__ import annotations

import importlib.util
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from speculum.kernels import model_ops

#: Whether Triton can be imported (the pairwise kernel is Triton's): looked up once, not in
#: every MoE layer of every eager step.
_TRITON = importlib.util.find_spec("triton") is not None

__all__ = [
    "ExpertOptions",
    "SWIGLU",
    "ascending_pairs",
    "down_bias_added",
    "expert_hidden",
    "few_pairs",
    "grouped_experts",
    "grouped_mm_supported",
    "moe_cuda",
    "register",
    "weighted_sum",
]


def grouped_mm_supported(x: Tensor, experts_down: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for these activations and experts: bfloat16 on a CUDA
    device of compute capability 9.0 or newer (Hopper), where its CUTLASS kernel exists, with
    hidden and expert widths whose rows are multiples of 16 bytes (its alignment rule)."""
    aligned = all(width * x.element_size() % 16 == 0 for width in experts_down.shape[1:])
    return (
        aligned
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def _expert_offsets(
    expert_of_pair: Int[Tensor, " pairs"], num_experts: int
) -> Int[Tensor, " expert"]:
    """End offset of each expert's run in the expert-sorted pairs (int32, as ``_grouped_mm``
    wants). A scatter-add, not ``bincount``, which would sync to size its output."""
    counts = torch.zeros(num_experts, dtype=torch.int32, device=expert_of_pair.device)
    ones = torch.ones_like(expert_of_pair, dtype=torch.int32)
    return counts.scatter_add_(0, expert_of_pair, ones).cumsum(0, dtype=torch.int32)


def ascending_pairs(
    top_weights: Float[Tensor, "row k"], top_index: Int[Tensor, "row k"]
) -> tuple[Float[Tensor, "row k 1"], Int[Tensor, " pair"]]:
    """Each row's selected experts in ascending order (the order their terms are summed in,
    as the reference sums them): their weights, and the expert of each (row, j) pair, flat."""
    top_index, within = top_index.sort(dim=-1)
    return top_weights.gather(-1, within)[..., None], top_index.flatten().contiguous()


def weighted_sum(
    pair_out: Float[Tensor, "row k hidden"], weights: Float[Tensor, "row k 1"], dtype: torch.dtype
) -> Float[Tensor, "row hidden"]:
    """``sum_j round(pair_out[:, j] * weights[:, j])`` in ``dtype``, ``j`` ascending: each term
    is rounded as the reference rounds it (the product in the weight's dtype: float32 for the
    float32 routers of DeepSeek and GLM-4.5). A selected expert of weight 0 adds nothing even
    where its output overflows (the reference drops unselected experts by ``where``)."""
    scaled = torch.where(weights != 0, (pair_out * weights).to(dtype), 0)
    out = scaled[:, 0]
    for j in range(1, scaled.shape[1]):
        out = out + scaled[:, j]
    return out


class ExpertOptions(NamedTuple):
    """What gpt-oss's experts add to SwiGLU experts (``speculum::moe``'s last arguments): each
    projection's per-expert bias, and the clamped GLU when ``swiglu_limit`` is above 0
    (``model_ops.clamped_glu``)."""

    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702


def expert_hidden(
    gate_up: Float[Tensor, "pair two_inter"], experts: Int[Tensor, " pair"], options: ExpertOptions
) -> Float[Tensor, "pair inter"]:
    """Each (row, expert) pair's activation from its gate/up projection (computed without
    bias): the pair's expert's bias added, then SwiGLU or the clamped GLU, as the reference
    computes them."""
    if options.gate_up_bias is not None:
        gate_up = gate_up + options.gate_up_bias[experts]
    gate, up = gate_up.chunk(2, dim=-1)
    if options.swiglu_limit > 0:
        hidden = model_ops.clamped_glu(gate, up, options.swiglu_limit, options.swiglu_alpha)
    else:
        hidden = F.silu(gate) * up
    return hidden.contiguous()


def down_bias_added(
    out: Float[Tensor, "pair hidden"], experts: Int[Tensor, " pair"], options: ExpertOptions
) -> Float[Tensor, "pair hidden"]:
    """Each pair's down projection plus its expert's bias, where the experts have one."""
    return out if options.down_bias is None else out + options.down_bias[experts]


#: SwiGLU experts without biases (every family but gpt-oss).
SWIGLU = ExpertOptions()


def grouped_experts(
    rows: Float[Tensor, "row hidden"],
    top_weights: Float[Tensor, "row k"],
    top_index: Int[Tensor, "row k"],
    experts_gate_up: Float[Tensor, "expert two_inter hidden"],
    experts_down: Float[Tensor, "expert hidden inter"],
    options: ExpertOptions = SWIGLU,
) -> Float[Tensor, "row hidden"]:
    """``sum_j top_weights[r, j] * down_e(silu(gate_e(x_r)) * up_e(x_r))`` over each row's
    selected experts ``e = top_index[r, j]`` (gpt-oss's experts with ``options``), summed as
    :func:`weighted_sum` sums them. Needs ``grouped_mm_supported(rows, experts_down)``."""
    num_rows, k = top_index.shape
    weights, expert_of_pair = ascending_pairs(top_weights, top_index)
    order = expert_of_pair.argsort(stable=True)
    experts = expert_of_pair[order]
    offsets = _expert_offsets(expert_of_pair, experts_gate_up.shape[0])
    gate_up = torch._grouped_mm(rows[order // k], experts_gate_up.transpose(1, 2), offs=offsets)
    hidden = expert_hidden(gate_up, experts, options)
    pair_out = torch._grouped_mm(hidden, experts_down.transpose(1, 2), offs=offsets)
    pair_out = down_bias_added(pair_out, experts, options)
    # Back to (row, j) order.
    unsorted = torch.empty_like(pair_out).index_copy_(0, order, pair_out)
    return weighted_sum(unsorted.view(num_rows, k, -1), weights, rows.dtype)


def few_pairs(num_pairs: int, num_experts: int) -> bool:
    """Whether a step of ``num_pairs`` (row, expert) pairs takes the pairwise Triton kernel
    (``kernels.triton_moe``): at most half as many pairs as experts, so that pairs re-reading
    an expert another pair chose cost less than the grouped GEMM's dispatch."""
    return 2 * num_pairs <= num_experts


def moe_cuda(
    x: Tensor,
    router: Tensor,
    experts_gate_up: Tensor,
    experts_down: Tensor,
    top_k: int,
    renormalize: bool,
    *routing: Any,
) -> Tensor:
    """The CUDA kernel of ``speculum::moe``: the reference's routing
    (``model_ops.moe_row_weights``, the op's further routing arguments included), then the
    pairwise Triton kernel for :func:`few_pairs` (where Triton is installed), else
    :func:`grouped_experts`, where ``torch._grouped_mm`` runs (else the dense reference). The
    choice depends on shapes alone, so a captured graph keeps it. gpt-oss's experts (the
    arguments past the routing ones: :class:`ExpertOptions`) take the same paths."""
    if not grouped_mm_supported(x, experts_down):
        return model_ops.moe_reference(
            x, router, experts_gate_up, experts_down, top_k, renormalize, *routing
        ).contiguous()
    routing, options = routing[: model_ops.ROUTING_ARGS], routing[model_ops.ROUTING_ARGS :]
    rows = x.reshape(-1, x.shape[-1])
    weights = model_ops.moe_row_weights(rows, router, top_k, renormalize, *routing)
    routed_by = grouped_experts
    if few_pairs(rows.shape[0] * top_k, experts_down.shape[0]) and _TRITON:
        from speculum.kernels.triton_moe import pairwise_experts as routed_by
    routed = routed_by(
        rows, *weights.topk(top_k), experts_gate_up, experts_down, ExpertOptions(*options)
    )
    return routed.view(x.shape)


def register() -> None:
    """Install :func:`moe_cuda` as the CUDA kernel of ``speculum::moe``."""
    model_ops.moe.register_kernel("cuda")(moe_cuda)
