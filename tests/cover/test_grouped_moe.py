"""The grouped-GEMM kernel of ``speculum::moe`` (``kernels.grouped_moe``) against the dense
reference. ``torch._grouped_mm`` runs on the CPU in float32 too, so the sort/dispatch/sum-back
logic is checked here on any routing; the GPU test (tests/gpu/test_moe_cuda.py) checks the
bfloat16 CUDA path inside captured rounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.kernels.grouped_moe import (
    ExpertOptions,
    few_pairs,
    grouped_experts,
    grouped_mm_supported,
)
from speculum.kernels.model_ops import moe_reference, moe_row_weights


def assert_matches_reference(
    kernel,
    rows: int,
    experts: int,
    k: int,
    renormalize: bool,
    family: str,
    seed: int,
    hidden: int = 8,
    inter: int = 4,
    atol: float = 1e-5,
) -> None:
    """``kernel`` (``grouped_experts``'s signature) on random float32 experts and routing
    equals the dense reference: Qwen's softmax routing, DeepSeek-V3's (sigmoid scores, a
    correction bias choosing, a scaling factor, float32 weights), or gpt-oss's (a biased
    router's top-k logits softmaxed; biased experts with the clamped GLU, limit 1.5)."""
    deepseek = family == "deepseek"
    experts = max(experts, 2) if deepseek else experts  # noaux_tc ranks a group by its best 2
    k = min(k, experts)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen)
    router = torch.randn(experts, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen)
    routing, options, extra = (), ExpertOptions(), ()
    if deepseek:
        routing = ("sigmoid", "noaux_tc", 1, 1, 2.5, torch.randn(experts, generator=gen), True)
    if family == "gpt-oss":
        router_bias = torch.randn(experts, generator=gen)
        routing = ("softmax_topk", "greedy", 1, 1, 1.0, None, False, router_bias)
        biases = (
            torch.randn(experts, 2 * inter, generator=gen),
            torch.randn(experts, hidden, generator=gen),
        )
        options = ExpertOptions(*biases, 1.5, 1.702)
        extra = tuple(options)  # the op's arguments after the routing ones
    weights = moe_row_weights(x, router, k, renormalize, *routing)
    ours = kernel(x, *weights.topk(k), gate_up, down, options)
    expected = moe_reference(x, router, gate_up, down, k, renormalize, *routing, *extra)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=atol)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    experts=st.integers(1, 8),
    k=st.integers(1, 8),
    renormalize=st.booleans(),
    family=st.sampled_from(["qwen", "deepseek", "gpt-oss"]),
    seed=st.integers(0, 2**16),
)
def test_grouped_experts_equal_the_dense_reference_on_any_routing(
    rows: int, experts: int, k: int, renormalize: bool, family: str, seed: int
) -> None:
    """Every row's output is its selected experts' weighted sum, as the reference computes it
    (float32 rounding apart: the GEMMs differ), whatever the routing: experts chosen by many
    rows, by one, or by none; Qwen's softmax routing or DeepSeek-V3's (sigmoid scores, a
    correction bias choosing, a scaling factor, float32 weights), or gpt-oss's (biased
    router and experts, clamped GLU)."""
    assert_matches_reference(grouped_experts, rows, experts, k, renormalize, family, seed)


def test_the_grouped_kernel_is_only_chosen_for_bfloat16_on_hopper() -> None:
    """Elsewhere (the CPU, other dtypes, widths off its alignment) the op keeps its reference
    kernel."""
    down = torch.zeros(4, 16, 8, dtype=torch.bfloat16)
    assert not grouped_mm_supported(torch.zeros(2, 16, dtype=torch.bfloat16), down)
    assert not grouped_mm_supported(torch.zeros(2, 16), down.float())


triton = pytest.importorskip("triton")


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 3),
    experts=st.integers(2, 8),
    k=st.integers(1, 4),
    family=st.sampled_from(["qwen", "deepseek", "gpt-oss"]),
    seed=st.integers(0, 2**16),
)
def test_the_pairwise_kernel_equals_the_dense_reference(
    rows: int, experts: int, k: int, family: str, seed: int
) -> None:
    """The Triton kernel for few (row, expert) pairs (under Triton's interpreter here) computes
    each row's selected experts' weighted sum as the reference does, with widths that do not
    fill its blocks (hidden 40, expert width 12), for Qwen's, DeepSeek-V3's and gpt-oss's
    routing and experts."""
    from speculum.kernels.triton_moe import pairwise_experts

    assert_matches_reference(
        pairwise_experts, rows, experts, k, True, family, seed, hidden=40, inter=12, atol=1e-4
    )


def test_few_pairs_take_the_pairwise_kernel() -> None:
    """A decode step of DeepSeek-V2-Lite (1 row, top 6 of 64 experts) and a chain-3 verify at
    batch 1 (24 pairs) read experts pair by pair; 8 rows (48 pairs) take the grouped GEMM."""
    assert few_pairs(6, 64) and few_pairs(24, 64) and few_pairs(32, 64)
    assert not few_pairs(48, 64) and not few_pairs(2, 2)
