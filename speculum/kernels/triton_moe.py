"""The routed experts of a mixture-of-experts MLP for a handful of (row, expert) pairs: each
pair's two projections as matrix-vector products reading its expert's weights in place.

A decode step at batch 1 routes one row to ``top_k`` experts (DeepSeek-V2-Lite: 6 of 64). The
grouped GEMM (``kernels.grouped_moe``) spends most of such a step on its sort, its gathers and a
64-group launch whose groups are nearly all empty (141 us against a 38 us floor on an H200).
Here every pair is one column of programs, each program a block of output features: it loads
its pair's expert id, then streams that expert's weight rows against the pair's input, so a
step reads each selected expert's weights once and nothing else. A pair re-reads its expert's
weights even when another pair chose the same expert, so this path is for steps whose pairs are
few (``kernels.grouped_moe.moe_cuda`` chooses it when there are at most half as many pairs as
experts); no host sync, no shape that depends on the routing (capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from jaxtyping import Float, Int
from torch import Tensor

from speculum.kernels.grouped_moe import (
    SWIGLU,
    ExpertOptions,
    ascending_pairs,
    down_bias_added,
    expert_hidden,
    weighted_sum,
)

__all__ = ["pairwise_experts"]

#: Output features per program, and input features per step of its loop.
_BLOCK_N, _BLOCK_K = 32, 256


@triton.jit
def _expert_gemv(
    x_ptr,
    w_ptr,
    expert_ptr,
    out_ptr,
    n_out,
    n_in,
    x_row_stride,
    w_expert_stride,
    w_row_stride,
    out_row_stride,
    ROWS_PER_INPUT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[p, n] = sum_k w[e_p, n, k] * x[p // ROWS_PER_INPUT, k]`` over one block of ``n``,
    accumulated in float32, rounded once to ``out``'s dtype (as a matmul's output is)."""
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(expert_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // ROWS_PER_INPUT).to(tl.int64) * x_row_stride
    w_rows = w_ptr + expert * w_expert_stride + cols.to(tl.int64)[:, None] * w_row_stride
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_in, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < n_in, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < n_out) & (ks[None, :] < n_in))
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    out = out_ptr + pair.to(tl.int64) * out_row_stride + cols
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=cols < n_out)


def _gemv(
    x: Float[Tensor, "input in"],
    weights: Float[Tensor, "expert out in"],
    expert_of_pair: Int[Tensor, " pair"],
    rows_per_input: int,
) -> Float[Tensor, "pair out"]:
    """Each pair's ``weights[expert] @ x[pair // rows_per_input]``."""
    pairs, (n_out, n_in) = expert_of_pair.shape[0], weights.shape[1:]
    out = torch.empty(pairs, n_out, dtype=x.dtype, device=x.device)
    grid = (pairs, triton.cdiv(n_out, _BLOCK_N))
    _expert_gemv[grid](
        x,
        weights,
        expert_of_pair,
        out,
        n_out,
        n_in,
        x.stride(0),
        weights.stride(0),
        weights.stride(1),
        out.stride(0),
        ROWS_PER_INPUT=rows_per_input,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
    )
    return out


def pairwise_experts(
    rows: Float[Tensor, "row hidden"],
    top_weights: Float[Tensor, "row k"],
    top_index: Int[Tensor, "row k"],
    experts_gate_up: Float[Tensor, "expert two_inter hidden"],
    experts_down: Float[Tensor, "expert hidden inter"],
    options: ExpertOptions = SWIGLU,
) -> Float[Tensor, "row hidden"]:
    """What ``grouped_moe.grouped_experts`` computes (each row's selected experts' weighted
    sum, as ``grouped_moe.weighted_sum`` sums it; gpt-oss's experts with ``options``), one
    matrix-vector product per (row, expert) pair. Weights must be contiguous in their last
    axis."""
    num_rows, k = top_index.shape
    weights, expert_of_pair = ascending_pairs(top_weights, top_index)
    gate_up = _gemv(rows.contiguous(), experts_gate_up, expert_of_pair, k)
    hidden = expert_hidden(gate_up, expert_of_pair, options)
    pair_out = _gemv(hidden, experts_down, expert_of_pair, 1)
    pair_out = down_bias_added(pair_out, expert_of_pair, options)
    return weighted_sum(pair_out.view(num_rows, k, -1), weights, rows.dtype)
