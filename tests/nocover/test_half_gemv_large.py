"""The half-precision matrix-vector kernel at wider shapes and under speculative decoding, on
Triton's interpreter, and ``speculum::half_linear`` inside a compiled round (slow: not part of
the covered suite; ``tests/cover/test_kernel_half.py`` has the fast cases,
``tests/gpu/test_half_gemv_cuda.py`` the device's)."""

from __future__ import annotations

import kernel_cases as kc
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.kernels import half
from speculum.models.decoder import GEMV_KINDS
from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.runtime.compiled import STAGES
from speculum.runtime.engine import SpecOptions

pytestmark = pytest.mark.slow

pytest.importorskip("triton")
from speculum.kernels.triton_fp8 import half_gemv  # noqa: E402


@settings(max_examples=40)
@given(
    st.integers(1, 16),
    st.integers(1, 300),
    st.integers(200, 1100),
    st.sampled_from([torch.float32, torch.float16]),
    st.booleans(),
    kc.seeds,
)
def test_wide_layers_are_within_float32_summation_and_row_independent(
    rows, n_out, n_in, dtype, bias, seed
) -> None:
    """Several programs of outputs and steps of inputs: within the summation bound of the
    exact product, and the last row alone equal to itself among the others."""
    gen = torch.Generator().manual_seed(seed)
    x, weight, b = kc.linear_operands(gen, rows, n_out, n_in, dtype, bias)
    ours = half_gemv(x, weight, b, dtype)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert ((ours.double() - exact).abs() <= kc.linear_bound(x, weight, b, dtype)).all()
    assert torch.equal(half_gemv(x[-1:], weight, b, dtype)[0], ours[-1])


def decoded(target, draft, kinds) -> list[list[int]]:
    """Greedy tokens of two prompts: plain decoding, or EAGLE-3 trees with ``draft``."""
    spec = None if draft is None else SpecOptions(num_steps=3, topk=2, num_draft_tokens=6)
    limits = {"max_batch": 2, "max_context": 64, "page_size": 4}
    prompts = ([1, 2, 3], [7, 8, 9, 10, 11])
    return kc.decoded_with_gemv(target, kinds, prompts, 12, draft, spec, **limits)


def test_eagle3_trees_over_the_triton_gemv_emit_plain_decodings_tokens(monkeypatch) -> None:
    """Verify runs several rows per request through the kernel, plain decoding one: each row
    computed as it is alone, so the tree's accepted tokens are plain decoding's (float32)."""
    target = random_model(tiny_config(), seed=0, std=0.3)
    draft = random_draft(target, "eagle3", seed=2, std=0.3)
    want = decoded(target, None, ())
    monkeypatch.setattr(half, "half_linear", half.half_linear_cuda)  # the Triton kernel on CPU
    assert decoded(target, draft, GEMV_KINDS) == want


def test_a_compiled_round_traces_the_op_and_emits_the_eager_tokens() -> None:
    """``torch.compile`` (every stage) traces the projections' routing and the op (opaque,
    through its fake kernel) without a graph break or a second graph: the same tokens."""
    from torch._dynamo.utils import counters

    target = random_model(tiny_config(num_layers=1), seed=2, std=0.3)
    limits = {"max_batch": 2, "max_context": 48, "page_size": 4, "graph_buckets": (2,)}
    want = kc.decoded_with_gemv(target, (), ([1, 2, 3], [7, 8, 9, 10, 11]), 6, **limits)
    torch._dynamo.reset()
    counters.clear()
    got = kc.decoded_with_gemv(
        target, GEMV_KINDS, ([1, 2, 3], [7, 8, 9, 10, 11]), 6, compile_stages=STAGES, **limits
    )
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert got == want
