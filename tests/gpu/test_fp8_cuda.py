"""FP8 weights on the GPU.

- The per-token activation quantizer (Triton, one launch) equals torch's bit for bit.
- ``speculum::fp8_linear``'s CUDA kernel: per-tensor and per-channel weights (dynamic per-token
  or static activation scales) run ``torch._scaled_mm`` and stay within FP8 activation rounding
  of the dequantized float32 product; block-scaled weights run the Triton matrix-vector kernel
  up to ``GEMV_ROWS`` rows (within bfloat16 rounding of the reference), the dequantizing
  reference above.
- An FP8 target in float32 compute (the dequantizing path, captured in CUDA graphs): every
  pipeline's captured rounds emit exactly plain greedy decoding's tokens over that target.
- An FP8 target in bfloat16 (``_scaled_mm``): captured EAGLE chains emit plain decoding's
  sequences (all but at most one of 11, for a near-tie; the count is printed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from test_graphs_cuda import LABELS, VOCAB, _tokens, check_captured_rounds_equal_plain_and_eager

from speculum.kernels import fp8
from speculum.models.draft import random_draft
from speculum.models.fp8 import Fp8Scheme, quantize_
from speculum.models.loading import random_model
from speculum.runtime.engine import SpecOptions

pytestmark = pytest.mark.gpu

#: label -> (block of one scale over a [256, 512] weight, static activation scale or not)
KERNEL_CASES = {
    "tensor": ((256, 512), False),
    "tensor-static": ((256, 512), True),
    "channel": ((1, 512), False),
    "block-128": ((128, 128), False),
}


@pytest.mark.parametrize("label", sorted(KERNEL_CASES))
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_scaled_mm_is_within_fp8_rounding_of_the_dequantized_product(label, rows) -> None:
    block, static = KERNEL_CASES[label]
    gen = torch.Generator(device="cuda").manual_seed(rows)
    weight = torch.randn(256, 512, device="cuda", generator=gen) * 0.05
    x = torch.randn(2, rows, 512, device="cuda", generator=gen).bfloat16()
    bias = torch.randn(256, device="cuda", generator=gen).bfloat16()
    q, scale = fp8.quantize_weight(weight, block)
    input_scale = (x.float().abs().amax() / fp8.FP8_MAX).reshape(1, 1) if static else None
    ours = fp8.fp8_linear(x, q, scale, list(block), input_scale, bias)
    reference = F.linear(x.float(), fp8.dequantize(q, scale, block, torch.float32), bias.float())
    assert ours.dtype == torch.bfloat16 and ours.shape == (2, rows, 256)
    if label == "block-128":
        assert not fp8.scaled_mm_supported(x, q, list(block))
        expected = fp8.fp8_linear_reference(x, q, scale, list(block), None, bias)
        if 2 * rows > fp8.GEMV_ROWS:  # the reference itself
            assert torch.equal(ours, expected)
            return
        # the Triton matrix-vector kernel: the same rounded weights, another summation order
        error = (ours.float() - expected.float()).norm() / expected.float().norm()
        assert error < 1e-2, error
        return
    assert fp8.scaled_mm_supported(x, q, list(block))
    # e4m3 activations carry 3 mantissa bits: ~3.6% rms relative rounding per element
    error = (ours.float() - reference).norm() / reference.norm()
    assert error < 0.06, error


@pytest.mark.parametrize("static", [False, True])
def test_the_triton_activation_quantizer_equals_torch_bit_for_bit(static: bool) -> None:
    from speculum.kernels.triton_fp8 import quantize_rows_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = (torch.randn(37, 4096, device="cuda", generator=gen) * 3).bfloat16()
    rows[2] = 0.0
    scale = torch.tensor([0.01], device="cuda") if static else None
    expected, expected_scale = fp8.quantize_rows(rows, scale)
    ours, ours_scale = quantize_rows_triton(rows, scale)
    assert torch.equal(ours_scale, expected_scale)
    assert torch.equal(ours.float(), expected.float())


def fp8_target(dtype: torch.dtype, scheme: Fp8Scheme) -> torch.nn.Module:
    """``test_graphs_cuda``'s target quantized by ``scheme``, computing in ``dtype``."""
    config = tiny_config(vocab_size=VOCAB, num_layers=4, hidden_size=64, head_dim=16)
    model = random_model(config, seed=5, std=0.3)
    return quantize_(model, scheme).to("cuda", dtype)


@pytest.mark.parametrize("label", LABELS)
def test_fp32_captured_rounds_over_an_fp8_target_equal_plain(label) -> None:
    target = fp8_target(torch.float32, Fp8Scheme(method="fp8", strategy="block", block=(16, 16)))
    check_captured_rounds_equal_plain_and_eager(target, label)


def test_bf16_rounds_over_a_scaled_mm_target_equal_plain_but_for_near_ties() -> None:
    target = fp8_target(torch.bfloat16, Fp8Scheme(method="compressed-tensors", strategy="channel"))
    assert fp8.scaled_mm_supported(
        torch.empty(1, device="cuda", dtype=torch.bfloat16),
        target.model.layers[0].mlp.down_proj.weight,
        list(target.model.layers[0].mlp.down_proj.block),
    )
    plain = _tokens(target)
    head = random_draft(target, "eagle", seed=2, std=0.3)
    spec = SpecOptions(num_steps=3, topk=1)
    ours = _tokens(target, algorithm="eagle", draft=head, spec=spec)
    same = sum(p == o for p, o in zip(plain, ours, strict=True))
    print(f"bf16 FP8 target: {same} of {len(plain)} sequences equal plain decoding's")
    assert same >= len(plain) - 1
