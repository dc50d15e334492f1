"""The decoder's elementwise ops: references against the decoder, Triton kernels against them.

The reference ops must equal the decoder's own math bit for bit (``torch.equal``), so routing the
decoder through them changes nothing on the CPU. The Triton kernels run here under Triton's
interpreter (numpy), which differs from torch in two known ways: numpy's float32 ``cos``, ``sin``
and ``exp`` differ from torch's in the last bits for 10-40 % of values, and its float32-to-bfloat16
cast truncates instead of rounding to nearest. So the kernels are checked exactly only where neither
applies (RMSNorm on rows whose sums of squares are exact, in float32 and float16: every other
step is a correctly rounded op on both sides), and within a few ulp elsewhere. On the GPU
(``tests/gpu/test_kernel_model_ops_gpu.py``) the kernels are bit-exact but for RMSNorm's
summation order.
"""

from __future__ import annotations

import kernel_cases as kc
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.kernels import model_ops, write_kv
from speculum.models.decoder import MLP, RMSNorm, apply_rope
from speculum.runtime.default_model import TINY_CONFIG

triton = pytest.importorskip("triton")
from speculum.kernels import triton_model_ops as tk  # noqa: E402

#: The launcher tests below are the interpreter's (CPU tensors, numpy's rounding quirks); where a
#: GPU is present, kernels compile and tests/gpu/test_kernel_model_ops_gpu.py checks them.
interpreted = pytest.mark.skipif(
    not triton.knobs.runtime.interpret, reason="Triton compiles for the GPU here"
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
dtypes = st.sampled_from(DTYPES)
#: Hidden sizes around and between powers of two (the kernels mask a power-of-two block).
widths = st.integers(1, 70)
#: Leading shapes of 1 to 3 axes, up to 12 rows in all.
leading = st.lists(st.integers(1, 3), min_size=1, max_size=3).filter(
    lambda s: torch.Size(s).numel() <= 12
)
epsilons = st.sampled_from([1e-5, 1e-6])
#: (batch, q, heads, head_dim) of rotary inputs.
rope_shapes = (
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 5),
    st.sampled_from([2, 8, 16, 32]),
)
seeds = kc.seeds


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0):
    """Normal samples of ``shape`` in ``dtype``, from ``gen``."""
    return kc.randn(*shape, dtype=dtype, scale=scale, gen=gen)


def rope_inputs(gen: torch.Generator, batch: int, q: int, heads: int, head_dim: int, dtype):
    """Queries, positions up to Llama 3.1's context, and rotary frequencies of some theta."""
    x, positions = kc.rope_inputs(batch, q, heads, head_dim, dtype, gen=gen)
    theta = float(torch.randint(100, 1_000_000, (), generator=gen))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return x, positions, inv_freq


@settings(max_examples=30)
@given(leading, widths, dtypes, dtypes, epsilons, seeds)
def test_reference_norms_equal_the_decoders_rmsnorm(shape, n, dtype, weight_dtype, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    x, residual = randn(gen, *shape, n, dtype=dtype), randn(gen, *shape, n, dtype=dtype)
    norm = RMSNorm(n, eps).to(weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(gen, n, dtype=weight_dtype))
        weight = norm.weight.detach()
        assert torch.equal(model_ops.rms_norm(x, weight, eps), norm(x))
        normed, summed = model_ops.add_rms_norm(x, residual, weight, eps)
        assert torch.equal(summed, x + residual)
        assert torch.equal(normed, norm(x + residual))


@settings(max_examples=30)
@given(*rope_shapes, dtypes, st.booleans(), seeds)
def test_reference_rope_equals_apply_rope(batch, q, heads, head_dim, dtype, same_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, positions, inv_freq = rope_inputs(gen, batch, q, heads, head_dim, dtype)
    # model.to(dtype) casts the inv_freq buffer too.
    inv_freq = inv_freq.to(dtype) if same_dtype else inv_freq
    assert torch.equal(model_ops.rope(x, positions, inv_freq), apply_rope(x, positions, inv_freq))


@settings(max_examples=20)
@given(leading, dtypes, seeds)
def test_reference_silu_mul_equals_the_decoders_mlp(shape, dtype, seed):
    torch.manual_seed(seed)
    mlp = MLP(TINY_CONFIG).to(dtype)
    x = torch.randn(*shape, TINY_CONFIG.hidden_size).to(dtype)
    with torch.no_grad():
        fused = mlp.down_proj(model_ops.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        assert torch.equal(fused, mlp(x))
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        assert torch.equal(model_ops.silu_mul(gate, up), F.silu(gate) * up)


@interpreted
@settings(max_examples=40)
@given(
    leading,
    widths,
    st.sampled_from([torch.float32, torch.float16]),
    dtypes,
    epsilons,
    st.integers(-6, 6),
    seeds,
)
def test_rms_norm_kernels_are_exact_where_sums_are(shape, n, dtype, weight_dtype, eps, exp, seed):
    # x = k / 8 * 2^exp with |k| <= 64: every square and every partial sum is exact in float32,
    # so any summation order gives the reference's mean, and the rest is correctly rounded ops.
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randint(-64, 65, (*shape, n), generator=gen) / 8 * 2.0**exp).to(dtype)
    residual = (torch.randint(-64, 65, (*shape, n), generator=gen) / 8 * 2.0**exp).to(dtype)
    weight = randn(gen, n, dtype=weight_dtype)
    assert torch.equal(tk.rms_norm_triton(x, weight, eps), model_ops.rms_norm(x, weight, eps))
    # The sum of two such rows is again exact; halve it so its squares' sums stay exact.
    half = (residual / 2).to(dtype)
    normed, summed = tk.add_rms_norm_triton(x / 2, half, weight, eps)
    want_normed, want_summed = model_ops.add_rms_norm(x / 2, half, weight, eps)
    assert torch.equal(summed, want_summed) and torch.equal(normed, want_normed)


# Interpreter error budgets, in eps(dtype): float32 pays for summation order and numpy's
# transcendentals, float16 for one rounding flip, bfloat16 for a truncation per rounding step.
BUDGET = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 4}


def assert_near(actual, expected, *rounded_to: torch.dtype, scale: float = 0.0) -> None:
    """``actual`` within the budget of the coarsest dtype it was ``rounded_to`` on the way, of
    ``expected``, relative to ``expected`` plus ``scale`` (the size of terms that may cancel)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = max(BUDGET[d] * torch.finfo(d).eps for d in (*rounded_to, expected.dtype))
    atol = tol * scale + torch.finfo(expected.dtype).tiny
    torch.testing.assert_close(actual, expected, rtol=tol, atol=atol)


@interpreted
@settings(max_examples=40)
@given(leading, widths, dtypes, dtypes, epsilons, st.booleans(), seeds)
def test_norm_kernels_match_the_reference(shape, n, dtype, weight_dtype, eps, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, *shape, n + 3 * strided, dtype=dtype, scale=3.0)[..., :n]
    residual = randn(gen, *shape, n, dtype=dtype)
    weight = randn(gen, n, dtype=weight_dtype)
    out = tk.rms_norm_triton(x, weight, eps)
    want = model_ops.rms_norm(x, weight, eps)
    assert_near(out, want, dtype)
    normed, summed = tk.add_rms_norm_triton(x, residual, weight, eps)
    want_normed, want_summed = model_ops.add_rms_norm(x, residual, weight, eps)
    # The add is one correctly rounded op (the interpreter's bfloat16 truncation aside).
    assert kc.ulps(summed, want_summed) <= (1 if dtype == torch.bfloat16 else 0)
    assert_near(normed, want_normed, dtype)


@interpreted
@settings(max_examples=40)
@given(*rope_shapes, dtypes, st.booleans(), seeds)
def test_rope_kernel_matches_the_reference(batch, q, heads, head_dim, dtype, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    x, positions, inv_freq = rope_inputs(gen, batch, q, heads + 2 * strided, head_dim, dtype)
    # Strided: the heads of a fused projection, as q is of a [q | k | v] output.
    x = x[:, :, :heads]
    out = tk.rope_triton(x, positions, inv_freq)
    want = model_ops.rope(x, positions, inv_freq)
    assert_near(out, want, scale=float(x.abs().max()))


@settings(max_examples=20)
@given(*rope_shapes, st.integers(1, 3), dtypes, seeds)
def test_fused_rope_and_kv_write_equal_the_separate_ops(
    batch, q, heads, head_dim, kv_heads, dtype, seed
):
    """``rope_write_kv`` is rotary on queries and keys plus two ``write_kv`` calls, bit for
    bit: what the decoder ran before the four were fused."""
    gen = torch.Generator().manual_seed(seed)
    inputs = kc.rope_write_kv_inputs(batch, q, heads, kv_heads, head_dim, dtype, gen=gen)

    def separate(q, k, v, positions, inv_freq, k_cache, v_cache, slots):
        write_kv(k_cache, slots, apply_rope(k, positions, inv_freq))
        write_kv(v_cache, slots, v)
        return apply_rope(q, positions, inv_freq)

    fused, want = kc.rope_write_kv_both(model_ops.rope_write_kv, separate, inputs)
    assert all(torch.equal(a, b) for a, b in zip(fused, want))


@interpreted
@settings(max_examples=30)
@given(*rope_shapes, st.integers(1, 3), dtypes, seeds)
def test_rope_write_kv_kernel_matches_the_reference(
    batch, q, heads, head_dim, kv_heads, dtype, seed
):
    gen = torch.Generator().manual_seed(seed)
    inputs = kc.rope_write_kv_inputs(batch, q, heads, kv_heads, head_dim, dtype, gen=gen)
    (out, k_cache, v_cache), (want, want_k, want_v) = kc.rope_write_kv_both(
        tk.rope_write_kv_triton, model_ops.rope_write_kv_reference, inputs
    )
    scale = float(inputs["q"].abs().max())
    assert_near(out, want, scale=scale)
    assert_near(k_cache, want_k, scale=scale)
    assert torch.equal(v_cache, want_v)


@interpreted
@settings(max_examples=40)
@given(leading, st.integers(1, 2100), dtypes, st.booleans(), seeds)
def test_silu_mul_kernel_matches_the_reference(shape, n, dtype, fused, seed):
    gen = torch.Generator().manual_seed(seed)
    if fused:  # the halves of one [gate | up] projection: strided views, no copies
        gate, up = randn(gen, *shape, 2 * n, dtype=dtype, scale=4.0).chunk(2, dim=-1)
    else:
        gate, up = randn(gen, *shape, n, dtype=dtype, scale=4.0), randn(gen, *shape, n, dtype=dtype)
    assert_near(tk.silu_mul_triton(gate, up), model_ops.silu_mul(gate, up))


def test_kernels_return_empty_outputs_for_empty_inputs():
    x = torch.empty(0, 16)
    assert tk.rms_norm_triton(x, torch.ones(16), 1e-5).shape == (0, 16)
    assert all(t.shape == (0, 16) for t in tk.add_rms_norm_triton(x, x, torch.ones(16), 1e-5))
    empty_q = torch.empty(2, 0, 4, 8)
    assert tk.rope_triton(empty_q, torch.empty(2, 0).long(), torch.ones(4)).shape == (2, 0, 4, 8)
    assert tk.silu_mul_triton(x, x).shape == (0, 16)


def test_launchers_reject_what_they_cannot_compute_as_torch_does():
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match="float64"):
        tk.rms_norm_triton(x.double(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="differ"):
        tk.silu_mul_triton(x, x[:1])
    with pytest.raises(ValueError, match="differ"):
        tk.add_rms_norm_triton(x, x[:1], torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="power of two"):
        tk.rope_triton(torch.randn(1, 1, 2, 12), torch.zeros(1, 1).long(), torch.ones(6))
    with pytest.raises(ValueError, match="inv_freq"):
        tk.rope_triton(torch.randn(1, 1, 2, 8), torch.zeros(1, 1).long(), torch.ones(5))


def test_partial_rotary_runs_the_reference_and_turns_only_the_leading_dimensions():
    """An ``inv_freq`` of fewer than ``head_dim / 2`` pairs (GLM-4.5's partial rotary) turns the
    first ``2 * len(inv_freq)`` dimensions of each head and passes the rest through, in the
    launchers (which fall back to the reference) as in the reference; the cache write too."""
    x, positions = torch.randn(2, 3, 4, 8), torch.randint(1, 99, (2, 3))
    inv_freq = torch.rand(2)
    turned = model_ops.rope_reference(x, positions, inv_freq)
    assert torch.equal(turned[..., 4:], x[..., 4:])
    assert torch.equal(turned[..., :4], model_ops.rope_reference(x[..., :4], positions, inv_freq))
    assert torch.equal(tk.rope_triton(x, positions, inv_freq), turned)
    inputs = kc.rope_write_kv_inputs(2, 3, 4, 2, 8, torch.float32)
    inputs["inv_freq"] = inv_freq
    twin = {k: v.clone() for k, v in inputs.items()}
    out = tk.rope_write_kv_triton(**inputs)
    assert torch.equal(out, model_ops.rope_write_kv_reference(**twin))
    assert torch.equal(inputs["k_cache"], twin["k_cache"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_pass_torch_library_opcheck(dtype):
    # Schema, fake kernels (shapes, dtypes, strides) and aliasing against the CPU kernels.
    torch.manual_seed(0)  # inputs independent of the tests run before, so a failure replays
    x, residual = torch.randn(2, 3, 16).to(dtype), torch.randn(2, 3, 16).to(dtype)
    weight = torch.randn(16)
    torch.library.opcheck(model_ops.rms_norm, (x, weight, 1e-5))
    torch.library.opcheck(model_ops.add_rms_norm, (x, residual, weight, 1e-5))
    q, positions = torch.randn(2, 3, 4, 8).to(dtype), torch.randint(0, 99, (2, 3))
    torch.library.opcheck(model_ops.rope, (q, positions, torch.rand(4)))
    torch.library.opcheck(model_ops.silu_mul, (x, residual))
    inputs = kc.rope_write_kv_inputs(2, 3, 4, 2, 8, dtype)
    torch.library.opcheck(model_ops.rope_write_kv, tuple(inputs.values()))
