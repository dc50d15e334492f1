"""Parity of the Triton recurrent kernels with ``spec.recurrent`` on a CUDA device, at the
sizes of the hybrids speculum targets: Qwen3-Next's gated DeltaNet (16 key heads and 32 value
heads of 128, conv 4) and Nemotron-H-8B's Mamba-2 (128 heads of 64, 8 groups, state 128,
conv 4). Chains (decode, chain verify, a prefill chunk longer than the ring) and trees; the
launcher runs on the device, the reference (the op's default kernel) on CPU copies; outputs of
valid queries and every state slot but the padding sink agree to float32 rounding.
"""

from __future__ import annotations

import kernel_cases as kc
import pytest
import recurrent_cases as rc
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.kernels import triton_recurrent as tr

pytestmark = pytest.mark.gpu

DIMS = {"gated_delta_rule": (16, 128, 32, 128), "mamba2_scan": (128, 64, 8, 128)}
LAUNCHERS = {
    "gated_delta_rule": tr.gated_delta_rule_triton,
    "mamba2_scan": tr.mamba2_scan_triton,
}


@settings(max_examples=12)
@given(
    st.sampled_from(sorted(DIMS)),
    st.sampled_from([(True, 1), (True, 4), (True, 40), (False, 8)]),
    st.integers(1, 4),
    kc.seeds,
)
def test_recurrent_kernels_equal_the_reference_at_serving_sizes(kind, shape, batch, seed):
    chain, q = shape
    gen = torch.Generator().manual_seed(seed)
    # Ring 12: a chain of 40 wraps it three times; a tree of 8 nodes (plus a tail offset of
    # up to 2) fits without wrapping, as the engine sizes it.
    args = rc.INPUTS[kind](gen, batch, q, chain, DIMS[kind], ring=12)
    rc.compare(kind, LAUNCHERS[kind], args, "cuda", atol=1e-4, rtol=1e-4)
