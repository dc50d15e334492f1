"""FP8 weights on the GPU.

- The per-token activation quantizer (Triton, one launch) equals torch's bit for bit.
- ``speculum::fp8_linear``'s CUDA kernel: up to ``GEMV_ROWS`` rows every scale layout runs the
  Triton matrix-vector kernel (within bfloat16 rounding of the reference, each row bit for bit
  what it is alone); above, per-tensor and per-channel weights (dynamic per-token or static
  activation scales) run ``torch._scaled_mm`` and stay within FP8 activation rounding of the
  dequantized float32 product, block-scaled ones the dequantizing reference.
- An FP8 target in float32 compute (the dequantizing path, captured in CUDA graphs): every
  pipeline's captured rounds emit exactly plain greedy decoding's tokens over that target.
- A per-channel FP8 target in bfloat16 (the Triton kernel): captured EAGLE chains emit plain
  decoding's sequences (all but at most one of 11, for a near-tie; the count is printed).
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
def test_the_cuda_kernels_are_within_rounding_of_the_dequantized_product(label, rows) -> None:
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
    expected = fp8.fp8_linear_reference(x, q, scale, list(block), None, bias)
    kernel = fp8.cuda_kernel(x, q, list(block))
    # Past the GEMV's rows, block scales have no _scaled_mm: the reference runs.
    large = "reference" if label == "block-128" else "scaled_mm"
    assert kernel == ("triton_gemv" if 2 * rows <= fp8.GEMV_ROWS else large)
    if kernel == "triton_gemv" or label == "block-128":
        if kernel != "triton_gemv":  # the reference itself
            assert torch.equal(ours, expected)
            return
        # the Triton matrix-vector kernel: the same rounded weights, another summation order
        error = (ours.float() - expected.float()).norm() / expected.float().norm()
        assert error < 1e-2, error
        return
    # _scaled_mm: e4m3 activations carry 3 mantissa bits, ~3.6% rms relative rounding each
    error = (ours.float() - reference).norm() / reference.norm()
    assert error < 0.06, error


@pytest.mark.parametrize("block", [(4096, 4096), (1, 4096), (128, 128), (1, 300), (37, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_triton_gemv_computes_each_row_as_a_decode_step_would(block, dtype) -> None:
    """Per tensor, per channel and block scales (odd widths too), in each float dtype: within
    output rounding of the reference's rounded weights summed in float32, and each of 16 rows
    (a verify) bit for bit what it is alone (a decode step), so speculative decoding over the
    kernel equals plain decoding."""
    from speculum.kernels.triton_fp8 import fp8_gemv

    shape = (4096, 4096) if block[1] == 4096 or block == (128, 128) else (37, 300)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, scale = fp8.quantize_weight(torch.randn(shape, device="cuda", generator=gen), block)
    x = torch.randn(16, shape[1], device="cuda", generator=gen).to(dtype)
    ours = fp8_gemv(x, q, scale, list(block), None)
    rounded = fp8.dequantize(q, scale, block, dtype).float()
    expected = x.float() @ rounded.T
    error = (ours.float() - expected).norm() / expected.norm()
    # float32: another summation order over 4096 products, ~1e-6 relative
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error
    for row in range(16):
        assert torch.equal(fp8_gemv(x[row : row + 1], q, scale, list(block), None)[0], ours[row])


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


def test_bf16_rounds_over_a_per_channel_target_equal_plain_but_for_near_ties() -> None:
    """Batch 4, chains of 3: decode steps (4 rows) and verifies (16) both run the Triton
    matrix-vector kernel (the prefill ``_scaled_mm``)."""
    target = fp8_target(torch.bfloat16, Fp8Scheme(method="compressed-tensors", strategy="channel"))
    down = target.model.layers[0].mlp.down_proj
    verify = torch.empty(16, down.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    assert fp8.cuda_kernel(verify, down.weight, list(down.block)) == "triton_gemv"
    plain = _tokens(target, max_batch=4)
    head = random_draft(target, "eagle", seed=2, std=0.3)
    spec = SpecOptions(num_steps=3, topk=1)
    ours = _tokens(target, algorithm="eagle", draft=head, spec=spec, max_batch=4)
    same = sum(p == o for p, o in zip(plain, ours, strict=True))
    print(f"bf16 FP8 target: {same} of {len(plain)} sequences equal plain decoding's")
    assert same >= len(plain) - 1
