"""Half-precision linear layers on the GPU (``speculum::half_linear``, ``EngineConfig.half_gemv``).

- The Triton matrix-vector kernel at Llama-3.1-8B's projection shapes in bfloat16 (float32 out
  for the logits): within the float32 summation bound of the exact product plus the output's
  rounding, and each of up to 16 rows bit for bit what it is alone (a decode step).
- The op's CUDA kernel: the Triton kernel up to ``GEMV_ROWS`` rows, cuBLAS above.
- Plain and EAGLE-3 decoding of a float32 target with every projection kind on the kernel,
  captured in CUDA graphs, emit the tokens of cuBLAS decoding.
"""

from __future__ import annotations

import kernel_cases as kc
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from speculum.kernels import fp8, half
from speculum.kernels.triton_fp8 import half_gemv
from speculum.models.decoder import GEMV_KINDS
from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.runtime.engine import SpecOptions

pytestmark = pytest.mark.gpu

#: Llama-3.1-8B's projections as the engine runs them (out, in), and whether out is float32.
SHAPES = {
    "qkv": ((6144, 4096), False),
    "o": ((4096, 4096), False),
    "gate_up": ((28672, 4096), False),
    "down": ((4096, 14336), False),
    "lm_head": ((128256, 4096), True),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_triton_gemv_at_the_8b_shapes_is_exact_to_rounding_and_row_independent(name):
    (n_out, n_in), float32_out = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(n_out, n_in, device="cuda", generator=gen) * 0.02).bfloat16()
    x = torch.randn(16, n_in, device="cuda", generator=gen).bfloat16()
    bias = None if float32_out else torch.randn(n_out, device="cuda", generator=gen).bfloat16()
    out_dtype = torch.float32 if float32_out else torch.bfloat16
    ours = half_gemv(x, weight, bias, out_dtype)
    assert ours.dtype == out_dtype
    # the bound checked in slices of rows: the float64 product of a 1 GB weight is large
    for rows in (slice(0, 1), slice(1, 16)):
        exact = F.linear(x[rows].double(), weight.double(), None if bias is None else bias.double())
        bound = kc.linear_bound(x[rows], weight, bias, out_dtype)
        assert ((ours[rows].double() - exact).abs() <= bound).all()
    for count in (1, 2, 4, 8, 16):
        for row in range(count):
            alone = half_gemv(x[row : row + 1], weight, bias, out_dtype)[0]
            assert torch.equal(half_gemv(x[:count], weight, bias, out_dtype)[row], alone)


@pytest.mark.parametrize("float32_out", [False, True])
def test_the_op_runs_the_triton_gemv_up_to_gemv_rows(float32_out):
    gen = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(512, 1024, device="cuda", generator=gen).bfloat16()
    out_dtype = torch.float32 if float32_out else torch.bfloat16
    for rows in (1, fp8.GEMV_ROWS, fp8.GEMV_ROWS + 1):
        x = torch.randn(rows, 1024, device="cuda", generator=gen).bfloat16()
        ours = half.half_linear(x, weight, None, float32_out)
        if rows <= fp8.GEMV_ROWS:
            assert torch.equal(ours, half_gemv(x, weight, None, out_dtype))
        else:
            wide = torch.mm(x, weight.t(), out_dtype=torch.float32)
            assert torch.equal(ours, wide if float32_out else F.linear(x, weight))


def decoded(target, draft, kinds) -> list[list[int]]:
    """Greedy tokens of three prompts (decoded together) over CUDA graphs, with
    ``half_gemv=kinds``: plain decoding, or EAGLE-3 chains of 3 with ``draft``."""
    spec = None if draft is None else SpecOptions(num_steps=3, topk=1, num_draft_tokens=4)
    prompts = ([1, 2, 3], [5, 9, 14, 7, 3, 30], [40])
    limits = {"max_batch": 4, "max_context": 96}
    return kc.decoded_with_gemv(target, kinds, prompts, 24, draft, spec, **limits)


@pytest.mark.parametrize("speculative", [False, True])
def test_decoding_on_the_triton_gemv_emits_the_cublas_tokens(speculative):
    """float32 (IEEE dots on both sides; the tiny target's logits are peaked enough that
    another summation order moves no argmax)."""
    target = random_model(tiny_config(), seed=0, std=0.3).cuda()
    draft = random_draft(target, "eagle3").cuda() if speculative else None
    want = decoded(target, draft, ())
    assert decoded(target, draft, GEMV_KINDS) == want
    if speculative:
        assert decoded(target, None, GEMV_KINDS) == want
