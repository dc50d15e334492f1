"""Half-precision linear layers (``speculum::half_linear``, issue 24 item 6): the Triton
matrix-vector kernel for unscaled weights (``kernels.triton_fp8.half_gemv``, run here by
Triton's interpreter) against the exact product, each row independent of the rows beside it,
and the decoder's projections routed through the op by ``EngineConfig.half_gemv`` emitting the
tokens of ``F.linear``.

The interpreter's dot cannot read bfloat16 (its float32-to-bfloat16 cast truncates, and
bfloat16 inputs come out garbled), so float32 and float16 are checked here;
``tests/gpu/test_half_gemv_cuda.py`` checks bfloat16 at the 8B shapes on the device.
"""

from __future__ import annotations

import kernel_cases as kc
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli import run_cli

from speculum.kernels import half
from speculum.models.decoder import GEMV_KINDS, gemv_projections_
from speculum.models.loading import random_model
from speculum.runtime.engine import EngineConfig, check_gemv

pytest.importorskip("triton")
from speculum.kernels.triton_fp8 import _BLOCK_M, TILES, half_gemv  # noqa: E402

DTYPES = [torch.float32, torch.float16]
#: Output features around one and two programs' blocks (32): masked last blocks.
outs = st.integers(1, 2 * TILES["half"].block_n + 5)
#: Input features around the loop's step (128 for float32, 256 for float16): masked last steps.
ins = st.integers(1, TILES["half"].block_k + 45)


@settings(max_examples=25)
@given(
    st.integers(1, _BLOCK_M + 3),
    outs,
    ins,
    st.sampled_from(DTYPES),
    st.booleans(),
    st.booleans(),
    kc.seeds,
)
def test_the_half_gemv_is_within_float32_summation_of_the_exact_product(
    rows, n_out, n_in, dtype, bias, float32_out, seed
) -> None:
    """Any row count (one tile, or a second partial one), out features not a multiple of the
    program's block, in features not a multiple of the loop's step, with or without a bias:
    each output is within the float32 summation bound of the exact product (the bound is
    ~1e-5 relative at these widths; ``kernel_cases.linear_bound``), in ``x``'s dtype or
    float32 as asked."""
    gen = torch.Generator().manual_seed(seed)
    x, weight, b = kc.linear_operands(gen, rows, n_out, n_in, dtype, bias)
    out_dtype = torch.float32 if float32_out else dtype
    ours = half_gemv(x, weight, b, out_dtype)
    assert ours.dtype == out_dtype and ours.shape == (rows, n_out)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert ((ours.double() - exact).abs() <= kc.linear_bound(x, weight, b, out_dtype)).all()


@settings(max_examples=20)
@given(st.integers(2, _BLOCK_M + 4), outs, ins, st.sampled_from(DTYPES), st.data())
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(rows, n_out, n_in, dtype, data):
    """Each row of a call of several rows (a verify; past one tile too) equals, bit for bit,
    that row computed alone (a decode step): the tile is fixed, whatever the row count."""
    row = data.draw(st.integers(0, rows - 1), label="row")
    seed = data.draw(kc.seeds, label="seed")
    gen = torch.Generator().manual_seed(seed)
    x, weight, b = kc.linear_operands(gen, rows, n_out, n_in, dtype, True)
    together = half_gemv(x, weight, b, dtype)
    assert torch.equal(half_gemv(x[row : row + 1], weight, b, dtype)[0], together[row])


def test_the_op_is_the_reference_off_cuda_and_checks_as_a_custom_op() -> None:
    """On the CPU ``speculum::half_linear`` is ``F.linear`` bit for bit (float32 out: over the
    widened operands); ``torch.library.opcheck`` checks its schema and fake kernel."""
    gen = torch.Generator().manual_seed(0)
    x, weight, b = kc.linear_operands(gen, 3, 20, 24, torch.float16, True)
    assert torch.equal(half.half_linear(x[None], weight, b, False)[0], F.linear(x, weight, b))
    widened = F.linear(x.float(), weight.float(), b.float())
    assert torch.equal(half.half_linear(x, weight, b, True), widened)
    for float32_out in (False, True):
        torch.library.opcheck(half.half_linear, (x, weight, b, float32_out))


def test_the_cuda_kernel_is_chosen_by_row_count_alone() -> None:
    """Up to ``GEMV_ROWS`` rows the Triton kernel, above cuBLAS, whatever the leading axes."""
    assert half.cuda_kernel(torch.zeros(2, 8, 64)) == "triton_gemv"
    assert half.cuda_kernel(torch.zeros(17, 64)) == "cublas"


def test_half_gemv_kinds_are_checked(capsys) -> None:
    assert check_gemv(["o", "qkv", "o"]) == ("o", "qkv")
    assert EngineConfig().half_gemv == ()
    with pytest.raises(ValueError, match=r"unknown projections \['mlp'\].*choose from qkv"):
        EngineConfig(half_gemv=("qkv", "mlp"))
    with pytest.raises(ValueError, match="tuple of projection kinds"):
        EngineConfig(half_gemv="qkv")
    status, _, err = run_cli(capsys, "--prompt-ids", "1", "--half-gemv", "qkv,mlp")
    assert status == 2
    assert "--half-gemv: half_gemv names unknown projections ['mlp']" in err


#: Two prompts decoded together: the prefill's and the decode steps' rows within GEMV_ROWS.
PROMPTS = ([1, 2, 3], [7, 8, 9, 10, 11])


def decoded(model, kinds: tuple[str, ...], fuse: bool) -> list[list[int]]:
    """Greedy tokens of :data:`PROMPTS` over ``model`` with ``half_gemv=kinds``, its
    projections fused (in place) or left separate."""
    limits = {"max_batch": 2, "max_context": 32, "page_size": 4, "prefix_cache": False}
    return kc.decoded_with_gemv(model, kinds, PROMPTS, 6, fuse_projections=fuse, **limits)


def projection_shapes(config, fused: bool) -> dict[str, set[tuple[tuple[int, ...], bool]]]:
    """Each projection kind -> the (weight shape, float32 out) of its calls of the op."""
    h, i = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    qkv = {(q_out + 2 * kv_out, h)} if fused else {(q_out, h), (kv_out, h)}
    gate_up = {(2 * i, h)} if fused else {(i, h)}
    shapes = {"qkv": qkv, "o": {(h, q_out)}, "gate_up": gate_up, "down": {(h, i)}}
    return {kind: {(s, False) for s in found} for kind, found in shapes.items()} | {
        "lm_head": {((config.vocab_size, h), True)}
    }


@pytest.mark.parametrize(
    ("kinds", "fuse"), [(GEMV_KINDS, True), (("o", "down"), True), (("qkv", "gate_up"), False)]
)
def test_decoding_through_the_triton_gemv_emits_the_tokens_of_f_linear(monkeypatch, kinds, fuse):
    """With ``half_gemv`` naming projection kinds, exactly those projections of the target
    (fused or separate) call ``speculum::half_linear`` (made here to run the Triton kernel, as
    CUDA does: the prefill's and the decode steps' rows are all within ``GEMV_ROWS``), and
    greedy decoding emits the tokens of ``F.linear`` (float32). Building an engine without the
    option puts every projection back on ``F.linear``; state-dict keys never change."""
    # head_dim 12: no two projections' weights share a shape
    model = random_model(tiny_config(head_dim=12), seed=3, std=0.3)
    calls: set[tuple[tuple[int, ...], bool]] = set()

    def on_triton(x, weight, bias, float32_out):
        calls.add((tuple(weight.shape), float32_out))
        return half.half_linear_cuda(x, weight, bias, float32_out)

    keys = list(model.state_dict())
    want = decoded(model, (), fuse)
    monkeypatch.setattr(half, "half_linear", on_triton)
    assert decoded(model, kinds, fuse) == want
    shapes = projection_shapes(model.config, fuse)
    assert calls == set().union(*(shapes[kind] for kind in kinds))
    calls.clear()
    assert decoded(model, (), fuse) == want and not calls
    assert list(model.state_dict()) == keys


def test_gradients_keep_f_linear(monkeypatch) -> None:
    """Training (gradients wanted) never calls the op, which has no backward: the separate
    differentiable projections run, whatever the setting."""
    model = gemv_projections_(random_model(tiny_config(num_layers=1), seed=0), GEMV_KINDS)
    model.requires_grad_(True)
    monkeypatch.setattr(half, "half_linear", lambda *a: pytest.fail("called with gradients"))
    mlp, attention = model.model.layers[0].mlp, model.model.layers[0].self_attn
    x = torch.randn(1, 2, model.config.hidden_size)
    mlp(x).sum().backward()
    attention.project_out(x).sum().backward()
    model.lm_head.logits(x).sum().backward()
    assert mlp.down_proj.weight.grad is not None and model.lm_head.weight.grad is not None
