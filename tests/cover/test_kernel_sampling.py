"""Triton sampling kernels against their spec twins, on the CPU through Triton's interpreter.

Tiny ``block`` sizes make a vocabulary of a few dozen tokens span several chunks, and a small
``radix_bits`` several search passes, so every loop-carried path runs. Logits come from a grid of
a few integers, so ties at the top-k and top-p thresholds are frequent.

The kernels sum in another order than torch, so probabilities are compared to 1e-6 and a
kept/dropped decision may differ only where it sits on its threshold (a token whose preceding
mass is within ``FRAGILE`` of ``top_p``, or whose probability ratio to the top token is within
``FRAGILE`` of ``min_p``); a draw may differ only where ``u * total`` is within ``FRAGILE *
total`` of a CDF step. The checks name those tokens from a float64 replay of the spec and allow
exactly them.
"""

from __future__ import annotations

import math

import kernel_cases as kc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import ATOL, FRAGILE, f32

from speculum.kernels import triton_sampling
from speculum.kernels.triton_sampling import filtered_probs_triton, sample_from_probs_triton
from speculum.spec.sampling import (
    _filtered_probs_reference,
    _sample_from_probs_reference,
    counter_uniforms,
    filtered_probs,
    sample_from_probs,
)
from speculum.state.sampling import SamplingParams

NEG_INF = float("-inf")

# ---------------------------------------------------------------------------------- strategies

GRID = st.one_of(st.integers(-3, 3).map(float), st.just(NEG_INF))
SMOOTH = st.one_of(st.floats(-20, 20, width=32), st.just(NEG_INF))


@st.composite
def request(draw, vocab: int):
    """(temperature, top_k, top_p, min_p) of one request: off values, extremes and random ones."""
    temperature = draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(0.1, 4.0).map(f32)))
    top_k = draw(st.one_of(st.just(0), st.just(1), st.integers(0, vocab + 2)))
    top_p = draw(st.one_of(st.just(1.0), st.just(1e-6), st.floats(0.01, 1.0).map(f32)))
    min_p = draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0).map(f32)))
    return temperature, top_k, top_p, min_p


@st.composite
def cases(draw, max_vocab: int = 300, max_rows: int = 6):
    """Logits [batch, *rows, vocab], per-request settings, and a block and radix for the kernel.

    Vocabularies are mostly a few chunks of a tiny block; some reach ``max_vocab``.
    """
    extra = draw(st.sampled_from([(), (2,), (3, 2)]))
    batch = draw(st.integers(1, max(1, max_rows // math.prod(extra))))
    vocab = draw(st.one_of(st.integers(1, 40), st.integers(41, max_vocab)))
    block = draw(st.sampled_from([16, 32] if vocab <= 40 else [64, 128]))
    radix_bits = draw(st.sampled_from([2, 3, 4]))
    value = draw(st.sampled_from([GRID, SMOOTH]))
    rows = [
        draw(st.lists(value, min_size=vocab, max_size=vocab).filter(lambda r: max(r) > NEG_INF))
        for _ in range(batch * math.prod(extra))
    ]
    logits = torch.tensor(rows, dtype=torch.float32).reshape(batch, *extra, vocab)
    settings_ = [draw(request(vocab)) for _ in range(batch)]
    return logits, settings_, block, radix_bits


def make_params(settings_) -> SamplingParams:
    """Parameters of requests given as ``(temperature, top_k, top_p, min_p)`` tuples."""
    return kc.sampling_params(*zip(*settings_, strict=True))


def run_kernel(logits: torch.Tensor, params: SamplingParams, **options) -> torch.Tensor:
    return filtered_probs_triton(logits, *kc.filter_args(params), **options)


# ----------------------------------------------------------------------------------- checking


def fragile_tokens(row: np.ndarray, t: float, k: int, p: float, m: float) -> set[int]:
    """Tokens whose top-p or min-p decision lies within FRAGILE of its threshold, in float64.

    Ranks follow the spec: descending float32 ``row / t``, ties by index.
    """
    z = row / np.float32(t)
    probs = np.exp(z.astype(np.float64) - z.max())
    probs /= probs.sum()
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    candidates = order[:k] if k > 0 else order
    renorm = probs / probs[candidates].sum()
    fragile, mass = set(), 0.0
    for i in candidates if p < 1 else ():
        if abs(mass - p) <= FRAGILE:
            fragile.add(i)
        mass += renorm[i]
    top = order[0]
    if m > 0:
        fragile |= {i for i in order[1:] if abs(probs[i] / probs[top] - m) <= FRAGILE}
    return fragile


def assert_rows_match(logits, settings_, got, expected) -> None:
    """Kernel rows equal the spec's to ATOL, or differ only by threshold-fragile tokens."""
    vocab = logits.shape[-1]
    batch = logits.shape[0]
    rows = logits.reshape(batch, -1, vocab).numpy()
    got = got.reshape(rows.shape).numpy().astype(np.float64)
    expected = expected.reshape(rows.shape).numpy().astype(np.float64)
    for b, (t, k, p, m) in enumerate(settings_):
        for r in range(rows.shape[1]):
            g, e = got[b, r], expected[b, r]
            if t == 0:
                assert np.array_equal(g, e), (b, r)
                continue
            if np.abs(g - e).max() <= ATOL:
                continue
            differing = np.flatnonzero((g > 0) != (e > 0))
            fragile = fragile_tokens(rows[b, r], t, k, p, m)
            assert differing.size and set(differing.tolist()) <= fragile, (b, r, differing, fragile)
            # With its own kept set, the kernel's row is still the renormalised softmax.
            z = (rows[b, r] / np.float32(t)).astype(np.float64)
            own = np.where(g > 0, np.exp(z - z.max()), 0.0)
            np.testing.assert_allclose(g, own / own.sum(), rtol=0, atol=ATOL)


# ------------------------------------------------------------------------------ filtered_probs


@settings(max_examples=40, deadline=None)
@given(cases())
def test_filtered_probs_matches_spec(case):
    logits, settings_, block, radix_bits = case
    params = make_params(settings_)
    got = run_kernel(logits, params, block=block, radix_bits=radix_bits)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert_rows_match(logits, settings_, got, filtered_probs(logits, params))


@pytest.mark.parametrize("block", [16, 64])
def test_ties_at_the_thresholds_resolve_by_index(block):
    """Exact spec values where ties straddle the top-k, top-p and min-p thresholds."""
    tied = [1.0, 3.0, 3.0, 3.0, 0.0] * 6 + [3.0, 1.0]  # nineteen 3.0s across two chunks of 16
    quarter = [0.0] * 4 + [NEG_INF] * 28
    logits = torch.tensor([tied] * 5 + [quarter, [1.0, 0.0] * 16])
    settings_ = [
        (0.0, 0, 1.0, 0.0),  # greedy: the first 3.0
        (1.0, 2, 1.0, 0.0),  # exactly two of the tied, lowest index first
        (1.0, 30, 1.0, 0.0),  # the nineteen 3.0s, the seven 1.0s and the first four 0.0s
        (1.0, 0, 0.25, 0.0),  # each 3.0 has mass ~0.049: top-p stops at the seventh
        (0.5, 5, 0.5, 1.0),  # top-k 5 of the tie, top-p 0.5 three of those, min-p 1 all three
        (1.0, 0, 0.5, 0.0),  # four tokens of 1/4: the third's preceding mass is exactly 0.5
        (1.0, 0, 1.0, 1.0),  # min-p 1: the sixteen tokens tied with the maximum
    ]
    params = make_params(settings_)
    got = run_kernel(logits, params, block=block, radix_bits=2)
    torch.testing.assert_close(got, filtered_probs(logits, params), rtol=0, atol=ATOL)
    assert (got > 0).sum(-1).tolist() == [1, 2, 30, 6, 3, 2, 16]


def test_bf16_logits_and_all_filters_off_take_the_softmax():
    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(1)).bfloat16()
    params = make_params([(1.0, 0, 1.0, 0.0), (0.3, 60, 1.0, 0.0), (2.0, 50, 1.0, 0.0)])
    got = run_kernel(logits, params, block=16)
    torch.testing.assert_close(got, filtered_probs(logits, params), rtol=0, atol=ATOL)


def test_cpu_dispatch_stays_on_the_spec():
    """With the CUDA kernels registered, the op on CPU tensors still runs the reference math."""
    triton_sampling.register()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("speculum::filtered_probs", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("speculum::sample_from_probs", "CUDA")
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    params = make_params([(1.0, 2, 1.0, 0.0)])
    e = math.exp(-1.0)
    expected = torch.tensor([[1 / (1 + e), e / (1 + e), 0.0, 0.0]])
    torch.testing.assert_close(filtered_probs(logits, params), expected, rtol=0, atol=ATOL)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]])
    assert sample_from_probs(probs, torch.tensor([0.75])).tolist() == [3]
    logits = torch.randn(3, 2, 40, generator=torch.Generator().manual_seed(2))
    params = make_params([(0.0, 0, 1.0, 0.0), (0.8, 5, 0.9, 0.0), (1.3, 0, 0.7, 0.1)])
    reference = _filtered_probs_reference(logits, *kc.filter_args(params))
    assert torch.equal(filtered_probs(logits, params), reference)
    u = torch.rand(3, 2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sample_from_probs(reference, u), _sample_from_probs_reference(reference, u))


# --------------------------------------------------------------------------- sample_from_probs

UNIFORM = st.one_of(st.sampled_from([2**-24, 0.5, 1 - 2**-24]), st.floats(2**-24, 1 - 2**-24))
WEIGHT = st.one_of(st.just(0.0), st.sampled_from([1e-30, 1e-7]), st.floats(1e-6, 1e3))


@st.composite
def prob_rows(draw):
    """Unnormalised weights [batch, *rows, vocab] with zeros, their uniforms, and a block."""
    extra = draw(st.sampled_from([(), (3,)]))
    batch = draw(st.integers(1, 4))
    vocab = draw(st.one_of(st.integers(1, 40), st.integers(41, 300)))
    n = batch * math.prod(extra)
    rows = draw(st.lists(st.lists(WEIGHT, min_size=vocab, max_size=vocab), min_size=n, max_size=n))
    u = draw(st.lists(UNIFORM.map(f32), min_size=n, max_size=n))
    block = draw(st.sampled_from([16, 64]))
    return (
        torch.tensor(rows, dtype=torch.float32).reshape(batch, *extra, vocab),
        torch.tensor(u, dtype=torch.float32).reshape(batch, *extra),
        block,
    )


def assert_draws_match(probs, u, got, expected) -> None:
    """Equal tokens, except where every CDF step between them is within FRAGILE of u * total."""
    vocab = probs.shape[-1]
    p = probs.reshape(-1, vocab).numpy().astype(np.float64)
    for row, (a, b, uu) in enumerate(zip(got.flatten(), expected.flatten(), u.flatten())):
        a, b = int(a), int(b)
        total = p[row].sum()
        if total > 0:
            assert p[row, a] > 0, (row, a)
        if a != b:
            cdf = np.cumsum(p[row])
            steps = cdf[min(a, b) : max(a, b)]
            assert np.all(np.abs(steps - float(uu) * total) <= FRAGILE * total), (row, a, b)


@settings(max_examples=40, deadline=None)
@given(prob_rows())
def test_sample_from_probs_matches_spec(case):
    probs, u, block = case
    got = sample_from_probs_triton(probs, u, block=block)
    assert got.dtype == torch.int64 and got.shape == u.shape
    assert_draws_match(probs, u, got, sample_from_probs(probs, u))


@settings(max_examples=15, deadline=None)
@given(case=cases(max_vocab=120, max_rows=4), seed=st.integers(0, 2**32 - 1))
def test_draws_from_kernel_probs_match_spec(case, seed):
    """The two kernels chained: draws from filtered distributions, as ``sample`` makes them."""
    logits, settings_, block, radix_bits = case
    params = make_params(settings_)
    probs = run_kernel(logits, params, block=block, radix_bits=radix_bits)
    u = torch.rand(probs.shape[:-1], generator=torch.Generator().manual_seed(seed))
    u = u.clamp(2**-24, 1 - 2**-24)
    got = sample_from_probs_triton(probs, u, block=block)
    assert_draws_match(probs, u, got, sample_from_probs(probs, u))


def test_zero_rows_draw_token_zero_and_zeros_are_never_drawn():
    probs = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]], [[0.0, 0.0, 0.0], [0.0, 0.0, 2.0]]])
    u = torch.tensor([[0.9, 0.75], [0.5, 2**-24]])
    assert sample_from_probs_triton(probs, u, block=16).tolist() == [[1, 2], [0, 2]]


@settings(max_examples=20, deadline=None)
@given(
    seeds=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=3),
    rows=st.integers(1, 4),
    width=st.integers(1, 70),
    stream=st.sampled_from([0, 1, 2, 3, 2**32 - 1]),
    data=st.data(),
)
def test_uniforms_kernel_has_the_reference_bits(seeds, rows, width, stream, data):
    """The one-launch uniforms kernel hashes exactly as the reference: every bit equal, for
    any seed, counter (positions up to 2**40), stream and width."""
    seed = torch.tensor(seeds, dtype=torch.int64)
    counters = data.draw(
        st.lists(st.integers(0, 2**40), min_size=len(seeds) * rows, max_size=len(seeds) * rows)
    )
    counter = torch.tensor(counters, dtype=torch.int64).view(len(seeds), rows)
    want = counter_uniforms(seed, counter, stream, width)
    assert torch.equal(triton_sampling.counter_uniforms_triton(seed, counter, stream, width), want)
