"""The Triton model ops on a CUDA device, against their references at Llama-8B shapes.

Hidden 4096, 32 query heads and 8 KV heads of 128, MLP width 14336, Llama 3.1 rotary scaling,
1 to 512 rows, in bfloat16 and float32. Each test prints the largest ulp distance it measured
(``pytest -s`` shows them) and asserts the bound in ``MAX_ULPS``.
"""

from __future__ import annotations

import attrs
import kernel_cases as kc
import pytest
import torch
from conftest import tiny_config

from speculum.kernels import model_ops
from speculum.models.decoder import rope_inv_freq

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
from speculum.kernels import triton_model_ops as tk  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
ROWS = [1, 7, 64, 512]
DTYPES = [torch.bfloat16, torch.float32]

#: Largest ulp distance from the reference allowed. RMSNorm sums its squares in another order
#: than torch's reduction, which moves float32 outputs by a few ulp (up to 5 measured on an H200
#: at hidden 4096) and could, rarely, move a bfloat16 output by one (none measured); every other
#: op repeats torch's rounding steps and libdevice functions, and was bit-exact.
MAX_ULPS = {
    ("rms_norm", torch.bfloat16): 1,
    ("rms_norm", torch.float32): 8,
    ("add", torch.bfloat16): 0,
    ("add", torch.float32): 0,
    ("rope", torch.bfloat16): 0,
    ("rope", torch.float32): 0,
    ("silu_mul", torch.bfloat16): 0,
    ("silu_mul", torch.float32): 0,
}


@pytest.fixture(scope="module", autouse=True)
def _triton_kernels():
    tk.register()


def check(name: str, op: str, dtype: torch.dtype, actual, expected) -> None:
    """Print the measured distance and assert ``op``'s bound."""
    measured = kc.ulps(actual, expected)
    print(f"{name} {str(dtype).removeprefix('torch.')}: max {measured} ulp")
    assert measured <= MAX_ULPS[op, dtype], f"{name}: {measured} ulp"


def norm_weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Weights around 1, as trained RMSNorm weights are."""
    return (1 + 0.2 * torch.randn(n, device="cuda")).to(dtype)


def llama31_inv_freq() -> torch.Tensor:
    """Llama 3.1 8B's rotary frequencies (theta 500000, llama3 scaling), float32 on the GPU."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = attrs.evolve(
        tiny_config(), head_dim=HEAD_DIM, rope_theta=500000.0, rope_scaling=scaling
    )
    return rope_inv_freq(config).cuda()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(r, HIDDEN) for r in ROWS] + [(5, 1), (9, 37), (64, 3584)])
def test_rms_norm(rows, n, dtype):
    torch.manual_seed(rows)
    x, weight = kc.randn(rows, n, dtype=dtype, scale=3, device="cuda"), norm_weight(n, dtype)
    out = model_ops.rms_norm(x, weight, 1e-5)
    assert torch.equal(out, tk.rms_norm_triton(x, weight, 1e-5))  # the CUDA kernel is Triton's
    check(
        f"rms_norm rows={rows} n={n}",
        "rms_norm",
        dtype,
        out,
        model_ops.rms_norm_reference(x, weight, 1e-5),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_qk_rms_norm(rows, dtype):
    torch.manual_seed(rows)
    q = kc.randn(rows, 1, HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    weight = norm_weight(HEAD_DIM, dtype)
    check(
        f"qk rms_norm rows={rows}",
        "rms_norm",
        dtype,
        model_ops.rms_norm(q, weight, 1e-6),
        model_ops.rms_norm_reference(q, weight, 1e-6),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm(rows, dtype):
    torch.manual_seed(rows)
    x = kc.randn(rows, 1, HIDDEN, dtype=dtype, device="cuda")
    residual = kc.randn(rows, 1, HIDDEN, dtype=dtype, scale=4, device="cuda")
    weight = norm_weight(HIDDEN, dtype)
    normed, summed = model_ops.add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_summed = model_ops.add_rms_norm_reference(x, residual, weight, 1e-5)
    check(f"add_rms_norm sum rows={rows}", "add", dtype, summed, want_summed)
    check(f"add_rms_norm norm rows={rows}", "rms_norm", dtype, normed, want_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [HEADS, KV_HEADS, 5])
@pytest.mark.parametrize(("batch", "q"), [(r, 1) for r in ROWS] + [(4, 128), (1, 512)])
def test_rope(batch, q, heads, dtype):
    torch.manual_seed(batch * q)
    x, positions = kc.rope_inputs(batch, q, heads, HEAD_DIM, dtype, device="cuda")
    inv_freq = llama31_inv_freq()
    out = model_ops.rope(x, positions, inv_freq)
    check(
        f"rope batch={batch} q={q} heads={heads}",
        "rope",
        dtype,
        out,
        model_ops.rope_reference(x, positions, inv_freq),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch", "q"), [(1, 1), (64, 1), (8, 16), (1, 512)])
def test_rope_write_kv(batch, q, dtype):
    torch.manual_seed(batch * q)
    inputs = kc.rope_write_kv_inputs(batch, q, HEADS, KV_HEADS, HEAD_DIM, dtype, device="cuda")
    inputs["inv_freq"] = llama31_inv_freq()
    (out, k_cache, v_cache), (want, want_k, want_v) = kc.rope_write_kv_both(
        model_ops.rope_write_kv, model_ops.rope_write_kv_reference, inputs
    )
    name = f"rope_write_kv batch={batch} q={q}"
    check(name, "rope", dtype, out, want)
    check(name + " keys", "rope", dtype, k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fused", [False, True])
def test_silu_mul(rows, fused, dtype):
    torch.manual_seed(rows)
    if fused:  # halves of one [gate | up] projection
        gate, up = kc.randn(rows, 2 * INTER, dtype=dtype, scale=4, device="cuda").chunk(2, dim=-1)
    else:
        gate = kc.randn(rows, INTER, dtype=dtype, scale=4, device="cuda")
        up = kc.randn(rows, INTER, dtype=dtype, device="cuda")
    check(
        f"silu_mul rows={rows} fused={fused}",
        "silu_mul",
        dtype,
        model_ops.silu_mul(gate, up),
        model_ops.silu_mul_reference(gate, up),
    )


def test_ops_replay_in_a_cuda_graph():
    torch.manual_seed(0)
    dtype, rows = torch.bfloat16, 8
    x = kc.randn(rows, 1, HIDDEN, dtype=dtype, device="cuda")
    residual = torch.randn_like(x)
    weight = norm_weight(HIDDEN, dtype)
    q, positions = kc.rope_inputs(rows, 1, HEADS, HEAD_DIM, dtype, device="cuda", max_position=4096)
    inv_freq = llama31_inv_freq()
    gate, up = kc.randn(rows, 1, INTER, dtype=dtype, device="cuda").chunk(2, dim=-1)

    def run():
        return (
            model_ops.rms_norm(x, weight, 1e-5),
            *model_ops.add_rms_norm(x, residual, weight, 1e-5),
            model_ops.rope(q, positions, inv_freq),
            model_ops.silu_mul(gate, up),
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for t in (x, residual, q, gate, up):
        t.copy_(torch.randn_like(t))
    positions.copy_(torch.randint(0, 131072, positions.shape, device="cuda"))
    graph.replay()
    for got, want in zip(captured, run(), strict=True):
        assert torch.equal(got, want)


def test_ops_pass_torch_library_opcheck_on_cuda():
    x = torch.randn(3, 2, 64, device="cuda").to(torch.bfloat16)
    weight = norm_weight(64, torch.bfloat16)
    torch.library.opcheck(model_ops.rms_norm, (x, weight, 1e-5))
    torch.library.opcheck(model_ops.add_rms_norm, (x, torch.randn_like(x), weight, 1e-5))
    q, positions = torch.randn(3, 2, 4, 16, device="cuda"), torch.randint(0, 99, (3, 2)).cuda()
    torch.library.opcheck(model_ops.rope, (q, positions, torch.rand(8, device="cuda")))
    torch.library.opcheck(model_ops.silu_mul, (x, torch.randn_like(x)))
