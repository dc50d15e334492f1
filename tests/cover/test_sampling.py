"""Counter-based uniforms, filtered distributions and sampling, against plain-Python references.

Statistical checks use thresholds computed for a false-alarm probability of about 1e-12 (a
7-sigma chi-square quantile, a McDiarmid bound for total variation). The draws are fixed by their
seeds, so a failure is a real change in behaviour, never bad luck on a re-run.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from stats import assert_matches_distribution, chi2_stat, chi2_threshold

from speculum.spec.sampling import (
    Stream,
    _murmur3_32,
    filtered_probs,
    sample,
    sample_from_probs,
    uniforms,
)
from speculum.state.record import replace
from speculum.state.sampling import SamplingParams

M32 = 0xFFFFFFFF
INT64 = st.integers(-(2**63), 2**63 - 1)
NEG_INF = float("-inf")


# ---------------------------------------------------------------- references and statistics


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 of bytes, transcribed from Austin Appleby's reference (Python ints)."""
    c1, c2 = 0xCC9E2D51, 0x1B873593
    h = seed
    body = len(data) // 4 * 4
    for (k,) in struct.iter_unpack("<I", data[:body]):
        k = _rotl((k * c1) & M32, 15) * c2 & M32
        h = (_rotl(h ^ k, 13) * 5 + 0xE6546B64) & M32
    if tail := data[body:]:
        h ^= _rotl((int.from_bytes(tail, "little") * c1) & M32, 15) * c2 & M32
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def reference_uniform(seed: int, stream: int, counter: int, column: int) -> float:
    h = murmur3_32(struct.pack("<qIqI", seed, stream, counter, column))
    return ((h >> 9) + 0.5) / 2**23


def make_params(temperature, top_k=0, top_p=1.0, min_p=0.0, seed=0, batch=None) -> SamplingParams:
    """SamplingParams from per-request lists or scalars broadcast to ``batch``."""
    batch = batch or len(temperature)

    def column(values, dtype):
        values = values if isinstance(values, (list, tuple)) else [values] * batch
        return torch.tensor(values, dtype=dtype)

    return SamplingParams(
        temperature=column(temperature, torch.float32),
        top_k=column(top_k, torch.int64),
        top_p=column(top_p, torch.float32),
        min_p=column(min_p, torch.float32),
        seed=column(seed, torch.int64),
    )


def reference_filtered(logits: list[float], t: float, k: int, p: float, m: float):
    """Filtered distribution of one request in float64, per the spec, plus its decision margin.

    The margin is the closest any top-p or min-p comparison came to its threshold; where it is
    tiny, float32 and float64 may legitimately decide differently.
    """
    x = np.asarray(logits, dtype=np.float64)
    vocab = len(x)
    if t == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(x))] = 1.0
        return out, math.inf
    z = x / t
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = sorted(range(vocab), key=lambda i: (-z[i], i))
    candidates = order[: k if k > 0 else vocab]
    renorm = probs / probs[candidates].sum()
    margin = math.inf
    kept, mass = [], 0.0
    for i in candidates:
        if p < 1:
            margin = min(margin, abs(mass - p))
            if mass >= p:
                break
        kept.append(i)
        mass += renorm[i]
    top = order[0]
    final = []
    for i in kept:
        if m > 0 and z[i] != z[top]:
            margin = min(margin, abs(probs[i] / probs[top] - m))
        if probs[i] >= m * probs[top] or i == top:
            final.append(i)
    out = np.zeros(vocab)
    out[final] = probs[final]
    return out / out.sum(), margin


def f32(value: float) -> float:
    return float(np.float32(value))


# ------------------------------------------------------------------------------- strategies

GRID_LOGIT = st.one_of(st.integers(-12, 12).map(lambda i: i * 0.5), st.just(NEG_INF))


@st.composite
def request_settings(draw, vocab: int):
    """(temperature, top_k, top_p, min_p) for one request, float32-representable."""
    temperature = draw(st.one_of(st.just(0.0), st.floats(0.1, 4.0).map(f32)))
    top_k = draw(st.integers(0, vocab + 2))
    top_p = draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0).map(f32)))
    min_p = draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0).map(f32)))
    return temperature, top_k, top_p, min_p


@st.composite
def sampling_batches(draw, rows=((),)):
    """Logits [batch, *rows, vocab] on a 0.5 grid (ties, -inf, no near-ties) and parameters."""
    batch = draw(st.integers(1, 4))
    vocab = draw(st.integers(2, 20))
    extra = draw(st.sampled_from(rows))
    n_rows = math.prod(extra)
    logits = [
        draw(
            st.lists(GRID_LOGIT, min_size=vocab, max_size=vocab).filter(
                lambda row: max(row) > NEG_INF
            )
        )
        for _ in range(batch * n_rows)
    ]
    settings_ = [draw(request_settings(vocab)) for _ in range(batch)]
    seeds = draw(st.lists(INT64, min_size=batch, max_size=batch))
    t, k, p, m = (list(col) for col in zip(*settings_, strict=True))
    params = make_params(t, k, p, m, seeds)
    tensor = torch.tensor(logits, dtype=torch.float32).reshape(batch, *extra, vocab)
    return tensor, params, settings_


# --------------------------------------------------------------------------------- uniforms


def test_stream_values():
    assert [(s.name, int(s)) for s in Stream] == [
        ("SAMPLE", 0),
        ("DRAFT", 1),
        ("ACCEPT", 2),
        ("RESAMPLE", 3),
    ]


@pytest.mark.parametrize(
    ("data", "seed", "expected"),
    [
        (b"", 0, 0),
        (b"", 1, 0x514E28B7),
        (b"", 0xFFFFFFFF, 0x81F16F39),
        (b"\x00\x00\x00\x00", 0, 0x2362F9DE),
        (b"\xff\xff\xff\xff", 0, 0x76293B50),
        (b"\x21\x43\x65\x87", 0, 0xF55B516B),
        (b"\x21\x43\x65\x87", 0x5082EDEE, 0x2362F9DE),
        (b"\x21\x43\x65", 0, 0x7E4A8634),
        (b"\x21\x43", 0, 0xA0F7B07A),
        (b"\x21", 0, 0x72661CF4),
        (b"\x00", 0, 0x514E28B7),
    ],
)
def test_reference_murmur3_matches_published_vectors(data, seed, expected):
    assert murmur3_32(data, seed) == expected


@settings(max_examples=200, deadline=None)
@given(
    seeds=st.lists(INT64, min_size=1, max_size=3),
    stream=st.integers(0, M32),
    counter=INT64,
    width=st.integers(1, 4),
)
def test_uniforms_match_reference_bits(seeds, stream, counter, width):
    seed = torch.tensor(seeds)
    counters = torch.tensor([[counter, counter ^ 1]] * len(seeds))
    u = uniforms(seed, stream, counters, width)
    assert u.dtype == torch.float32
    assert u.shape == (len(seeds), 2, width)
    expected = [
        [[reference_uniform(s, stream, c, j) for j in range(width)] for c in (counter, counter ^ 1)]
        for s in seeds
    ]
    # Every value is exact in float32, so the comparison is bit-for-bit.
    assert u.tolist() == expected
    assert ((u > 0) & (u < 1)).all()
    assert torch.equal(u, uniforms(seed, stream, counters, width))


class Checked:
    """An int that asserts it stays in [0, 2**63): the hash must never leave non-negative int64."""

    def __init__(self, value: int):
        assert 0 <= value < 2**63, f"intermediate {value:#x} leaves non-negative int64"
        self.value = value


def _checked_op(fn):
    def op(self, other):
        return Checked(fn(self.value, getattr(other, "value", other)))

    def rop(self, other):
        return Checked(fn(getattr(other, "value", other), self.value))

    return op, rop


for _name, _fn in {
    "mul": int.__mul__,
    "add": int.__add__,
    "and": int.__and__,
    "or": int.__or__,
    "xor": int.__xor__,
    "lshift": int.__lshift__,
    "rshift": int.__rshift__,
}.items():
    _op, _rop = _checked_op(_fn)
    setattr(Checked, f"__{_name}__", _op)
    setattr(Checked, f"__r{_name}__", _rop)


@settings(max_examples=300, deadline=None)
@given(words=st.lists(st.integers(0, M32), min_size=6, max_size=6))
def test_hash_intermediates_never_overflow_int64(words):
    checked = _murmur3_32([Checked(w) for w in words]).value
    assert checked == murmur3_32(struct.pack("<6I", *words))
    on_tensors = _murmur3_32([torch.tensor(w) for w in words])
    assert int(on_tensors) == checked


@settings(max_examples=200, deadline=None)
@given(
    seed=INT64,
    stream=st.integers(0, 3),
    counter=st.integers(-(2**62), 2**62),
    change=st.sampled_from(["seed", "stream", "counter"]),
    delta=st.integers(1, 2**31),
)
def test_uniforms_differ_when_any_input_differs(seed, stream, counter, change, delta):
    width = 64
    base = uniforms(torch.tensor([seed]), stream, torch.tensor([counter]), width)
    moved = {"seed": seed, "stream": stream, "counter": counter}
    moved[change] = moved[change] + delta if change != "seed" else seed ^ delta
    other = uniforms(
        torch.tensor([moved["seed"]]), moved["stream"], torch.tensor([moved["counter"]]), width
    )
    # Single hash values differ always; 23-bit uniforms collide with probability 2**-23 each.
    assert (base != other).sum() >= width - 2
    assert len(set(base.flatten().tolist())) >= width - 2  # columns differ too


def test_uniforms_are_uniform():
    n_seeds, n_counters = 10, 10_000
    seed = torch.arange(n_seeds, dtype=torch.int64) * 7919
    counter = torch.arange(n_counters, dtype=torch.int64).expand(n_seeds, -1)
    for stream in Stream:
        u = uniforms(seed, stream, counter, 1).flatten()
        counts = torch.histc(u, bins=100, min=0.0, max=1.0).numpy()
        stat, dof = chi2_stat(counts, np.full(100, u.numel() / 100))
        assert stat < chi2_threshold(dof), (stream, stat)
        # The low bits of the 23 kept too: they would show a weak multiplier or a missing mix.
        low = (u * 2**23).long() & 255
        counts = torch.bincount(low, minlength=256).numpy()
        stat, dof = chi2_stat(counts, np.full(256, u.numel() / 256))
        assert stat < chi2_threshold(dof), (stream, stat)


def test_uniforms_pairs_are_independent():
    """Consecutive counters, neighbouring columns and different streams look independent."""
    counter = torch.arange(100_000, dtype=torch.int64)[None]
    seed = torch.tensor([12345])

    def cell(u):
        return (u * 10).long().clamp(max=9)

    pairs = {
        "counters": (uniforms(seed, 0, counter, 1), uniforms(seed, 0, counter + 1, 1)),
        "columns": uniforms(seed, 0, counter, 2).split(1, -1),
        "streams": (
            uniforms(seed, Stream.DRAFT, counter, 1),
            uniforms(seed, Stream.ACCEPT, counter, 1),
        ),
    }
    for name, (a, b) in pairs.items():
        joint = (cell(a) * 10 + cell(b)).flatten()
        counts = torch.bincount(joint, minlength=100).numpy()
        stat, dof = chi2_stat(counts, np.full(100, joint.numel() / 100))
        assert stat < chi2_threshold(dof), (name, stat)


def test_uniforms_extreme_values_stay_open():
    # Largest and smallest possible outputs are exact, and neither endpoint is reachable.
    assert reference_uniform(0, 0, 0, 0) > 0
    top = ((2**23 - 1) + 0.5) / 2**23
    assert np.float32(top) == top < 1.0
    assert np.float32(0.5 / 2**23) == 0.5 / 2**23 > 0.0


@settings(max_examples=50, deadline=None)
@given(
    seeds=st.lists(INT64, min_size=1, max_size=5),
    counters=st.lists(st.integers(0, 2**40), min_size=3, max_size=3),
    stream=st.integers(0, 3),
)
def test_uniforms_batch_invariant(seeds, counters, stream):
    seed = torch.tensor(seeds)
    counter = torch.tensor([[c + i for c in counters] for i in range(len(seeds))])
    batched = uniforms(seed, stream, counter, 3)
    for i in range(len(seeds)):
        alone = uniforms(seed[i : i + 1], stream, counter[i : i + 1], 3)
        assert torch.equal(batched[i : i + 1], alone)


def test_uniforms_reject_bad_inputs():
    with pytest.raises(TypeError, match="int64"):
        uniforms(torch.tensor([1], dtype=torch.int32), 0, torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="counter"):
        uniforms(torch.tensor([1, 2]), 0, torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="stream"):
        uniforms(torch.tensor([1]), -1, torch.tensor([0]), 1)


# --------------------------------------------------------------------------- filtered_probs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(sampling_batches(rows=((), (2,), (2, 3))))
def test_filtered_probs_matches_reference(case):
    logits, params, settings_ = case
    out = filtered_probs(logits, params)
    assert out.dtype == torch.float32
    assert out.shape == logits.shape
    flat_logits = logits.reshape(logits.shape[0], -1, logits.shape[-1])
    flat_out = out.reshape(flat_logits.shape).numpy()
    for b, (t, k, p, m) in enumerate(settings_):
        for r in range(flat_logits.shape[1]):
            expected, margin = reference_filtered(flat_logits[b, r].tolist(), t, k, p, m)
            assume(margin > 1e-4)
            got = flat_out[b, r]
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
            assert (got[expected == 0] == 0).all()
            assert abs(got.sum() - 1) < 1e-5


@settings(max_examples=100, deadline=None)
@given(sampling_batches(rows=((), (2,))))
def test_filter_marked_rounds_give_each_row_what_it_gets_unmarked(case):
    """``SamplingParams.filters`` only picks kernels: every row's distribution is the same
    with the mark (filtered rows through the sort, the others through the op with no filter)
    as without it, whatever the other rows' settings."""
    logits, params, _ = case
    marked = filtered_probs(logits, replace(params, filters=True))
    assert torch.equal(marked, filtered_probs(logits, params))


@settings(max_examples=100, deadline=None)
@given(sampling_batches())
def test_filtered_probs_greedy_rows_are_one_hot_argmax(case):
    logits, params, _ = case
    greedy = params.temperature == 0
    out = filtered_probs(logits, params)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    assert torch.equal(out[greedy], one_hot[greedy])


def test_ties_resolve_to_lowest_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]] * 3)
    params = make_params([0.0, 1.0, 1.0], top_k=[0, 2, 1])
    out = filtered_probs(logits, params)
    assert out[0].tolist() == [0, 1, 0, 0, 0]
    assert out[1].tolist() == [0, 0.5, 0.5, 0, 0]
    assert out[2].tolist() == [0, 1, 0, 0, 0]


def test_top_p_acts_on_renormalised_top_k():
    # probs ~ [0.5, 0.3, 0.2]; top-k 2 renormalises to [0.625, 0.375]: top-p 0.6 keeps one
    # token (0.625 >= 0.6), where the raw distribution would have needed two (0.5 < 0.6).
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]] * 2)
    out = filtered_probs(logits, make_params([1.0, 1.0], top_k=[2, 0], top_p=0.6))
    assert out[0].tolist() == [1, 0, 0]
    np.testing.assert_allclose(out[1].numpy(), [0.625, 0.375, 0], atol=1e-6)


def test_thresholds_at_exact_equality():
    # Four tied tokens have probability exactly 1/4 each. top-p 0.5: the third token's preceding
    # mass is exactly 0.5, which already reaches top_p, so it goes. min-p 1: a token tied with
    # the maximum is not below min_p * max, so it stays.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    out = filtered_probs(logits, make_params([1.0, 1.0], top_p=[0.5, 1.0], min_p=[0.0, 1.0]))
    assert out.tolist() == [[0.5, 0.5, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]]


@pytest.mark.parametrize(
    ("poison", "message"),
    [
        (float("nan"), "NaN"),
        (float("inf"), r"\+inf"),
        ("all -inf", "every logit -inf"),
    ],
)
def test_bad_logits_raise_naming_rows(poison, message):
    logits = torch.zeros(4, 2, 5)
    for b in (1, 3):
        if poison == "all -inf":
            logits[b, 0] = NEG_INF
        else:
            logits[b, 0, 2] = poison
    params = make_params([0.0, 1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=rf"{message}.* in batch rows \[1, 3\]"):
        filtered_probs(logits, params)
    with pytest.raises(ValueError, match=message):
        sample(logits[:, 0], params, torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -1.0, "temperature"),
        ("top_k", -1, "top_k"),
        ("top_p", 0.0, "top_p"),
        ("min_p", 1.5, "min_p"),
    ],
)
def test_bad_params_raise_naming_rows(field, value, message):
    values = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    columns = {name: [v] * 3 for name, v in values.items()}
    columns[field][2] = value
    params = make_params(**columns)
    with pytest.raises(ValueError, match=rf"{message}.* in batch rows \[2\]"):
        filtered_probs(torch.zeros(3, 4), params)


def test_params_batch_mismatch_raises():
    with pytest.raises(ValueError, match="per request"):
        filtered_probs(torch.zeros(3, 4), make_params([1.0, 1.0]))


def test_compiled_code_skips_eager_checks():
    """Under torch.compile the functions trace without graph breaks and give the eager values."""
    logits = torch.randn(3, 2, 6, generator=torch.Generator().manual_seed(0))
    params = make_params([0.0, 0.8, 1.5], top_k=[0, 3, 0], top_p=[1.0, 0.9, 0.7], seed=[1, 2, 3])
    counter = torch.tensor([5, 6, 7])
    compiled_probs = torch.compile(filtered_probs, fullgraph=True, backend="eager")
    compiled_sample = torch.compile(sample, fullgraph=True, backend="eager")
    assert torch.equal(compiled_probs(logits, params), filtered_probs(logits, params))
    expected = sample(logits[:, 0], params, counter)
    assert torch.equal(compiled_sample(logits[:, 0], params, counter), expected)


# ----------------------------------------------------------------------------------- sample


@settings(max_examples=100, deadline=None)
@given(case=sampling_batches(), counter=INT64)
def test_greedy_sample_is_argmax(case, counter):
    logits, params, _ = case
    greedy = make_params(
        [0.0] * logits.shape[0],
        top_k=params.top_k.tolist(),
        top_p=params.top_p.tolist(),
        min_p=params.min_p.tolist(),
        seed=params.seed.tolist(),
    )
    tokens = sample(logits, greedy, torch.full((logits.shape[0],), counter))
    assert torch.equal(tokens, logits.argmax(-1))


HEAVY = st.tuples(
    st.floats(0.05, 5.0).map(f32),
    st.integers(0, 3),
    st.one_of(st.just(1.0), st.floats(0.001, 0.3).map(f32)),
    st.one_of(st.just(0.0), st.floats(0.5, 1.0).map(f32)),
)


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(
        st.one_of(st.just(NEG_INF), st.floats(-30, 30, width=32)), min_size=2, max_size=20
    ).filter(lambda row: max(row) > NEG_INF),
    setting=HEAVY,
    seed=INT64,
    counters=st.lists(INT64, min_size=8, max_size=8),
    stream=st.sampled_from(list(Stream)),
)
def test_sample_never_returns_zero_probability_token(logits, setting, seed, counters, stream):
    t, k, p, m = setting
    batch = len(counters)
    x = torch.tensor([logits] * batch, dtype=torch.float32)
    params = make_params(t, k, p, m, seed, batch=batch)
    tokens = sample(x, params, torch.tensor(counters), stream)
    probs = filtered_probs(x, params)
    assert (probs.gather(-1, tokens[:, None]) > 0).all()


@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(
        st.one_of(
            st.just(0.0),
            st.sampled_from([1e-45, 1e-38, 1e-30, 1e-7]),
            st.floats(1e-6, 1e3).map(f32),
        ),
        min_size=1,
        max_size=20,
    ).filter(lambda w: max(w) > 0),
    u=st.one_of(
        st.sampled_from([2**-24, 1 - 2**-24, 0.5]),
        st.floats(2**-24, 1 - 2**-24, width=32),
    ),
)
def test_sample_from_probs_inverse_cdf(weights, u):
    """Unnormalised weights and extreme uniforms: a positive-weight token, the inverse CDF's."""
    probs = torch.tensor([weights], dtype=torch.float32)
    token = int(sample_from_probs(probs, torch.tensor([u], dtype=torch.float32))[0])
    assert weights[token] > 0
    w = np.asarray(weights, dtype=np.float64)
    cdf = np.cumsum(w) / w.sum()
    # Away from a step of the CDF, float32 and float64 pick the same token (given a total mass
    # in float32's normal range: u * total is computed in float32).
    assume(w.sum() > 1e-37 and np.min(np.abs(cdf - u)) > 1e-5)
    assert token == int(np.searchsorted(cdf, u, side="right"))


def test_sample_from_probs_rows_and_zero_mass():
    probs = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]], [[0.0, 0.0, 0.0], [0.0, 0.0, 2.0]]])
    u = torch.tensor([[0.9, 0.75], [0.5, 2**-24]])
    assert sample_from_probs(probs, u).tolist() == [[1, 2], [0, 2]]


@settings(max_examples=50, deadline=None)
@given(case=sampling_batches(), base=st.integers(0, 2**40), stream=st.sampled_from(list(Stream)))
def test_sample_batch_invariant(case, base, stream):
    logits, params, _ = case
    counter = base + torch.arange(logits.shape[0]) * 3
    batched = sample(logits, params, counter, stream)
    for i in range(logits.shape[0]):
        one = SamplingParams(
            temperature=params.temperature[i : i + 1],
            top_k=params.top_k[i : i + 1],
            top_p=params.top_p[i : i + 1],
            min_p=params.min_p[i : i + 1],
            seed=params.seed[i : i + 1],
        )
        assert int(sample(logits[i : i + 1], one, counter[i : i + 1], stream)[0]) == batched[i]


def test_sample_is_deterministic_and_streams_differ():
    logits = torch.zeros(1000, 16)
    params = make_params(1.0, seed=99, batch=1000)
    counter = torch.arange(1000)
    a = sample(logits, params, counter, Stream.SAMPLE)
    assert torch.equal(a, sample(logits, params, counter, Stream.SAMPLE))
    b = sample(logits, params, counter, Stream.DRAFT)
    assert (a == b).float().mean() < 0.15  # 1/16 expected for independent draws


SETTINGS = {
    "plain": dict(temperature=1.0),
    "hot": dict(temperature=2.0),
    "cold top-k": dict(temperature=0.6, top_k=3),
    "top-p": dict(temperature=1.0, top_p=0.8),
    "min-p": dict(temperature=1.0, min_p=0.15),
    "all filters": dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05),
    "ties and -inf": dict(temperature=1.3, top_k=4),
}
LOGITS_8 = [2.0, 1.5, 0.7, 0.7, 0.0, -0.5, -1.0, -3.0]
TIES_8 = [1.0, NEG_INF, 1.0, 0.5, 1.0, NEG_INF, 0.5, -1.0]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sample_distribution_matches_filtered_probs(name):
    n = 20_000
    row = TIES_8 if name == "ties and -inf" else LOGITS_8
    logits = torch.tensor([row], dtype=torch.float32).expand(n, -1)
    params = make_params(seed=2024, batch=n, **SETTINGS[name])
    tokens = sample(logits, params, torch.arange(n, dtype=torch.int64))
    p = filtered_probs(logits[:1], make_params(seed=2024, batch=1, **SETTINGS[name]))[0]
    assert_matches_distribution(tokens.numpy(), p.double().numpy())
