"""Triton sampling kernels against the spec on CUDA: real vocabularies, up to 256 rows, dispatch.

The reference is the spec's math called directly (``_filtered_probs_reference``,
``_sample_from_probs_reference``), so the comparison stays meaningful after :func:`register`
has routed the ops to the kernels. Tolerances are those of the CPU parity tests
(``tests/cover/test_kernel_sampling.py``): probabilities to 1e-6, and a kept/dropped decision or a
draw may differ only at its threshold, which a float64 replay of the spec names.
"""

from __future__ import annotations

import math

import kernel_cases as kc
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import ATOL, FRAGILE, f32

from speculum.kernels import triton_sampling
from speculum.kernels.triton_sampling import filtered_probs_triton, sample_from_probs_triton
from speculum.spec.sampling import (
    _filtered_probs_reference,
    _sample_from_probs_reference,
    filtered_probs,
    sample_from_probs,
)
from speculum.state.record import replace
from speculum.state.sampling import SamplingParams

pytestmark = pytest.mark.gpu

VOCABS = [1, 7, 300, 1000, 32000, 128256, 151936]


@st.composite
def cases(draw):
    """Shapes, a logit distribution and per-request parameters; :func:`build` makes the tensors."""
    extra = draw(st.sampled_from([(), (8,), (64,)]))
    batch = draw(st.integers(1, 4))
    vocab = draw(st.one_of(st.sampled_from(VOCABS), st.integers(1, 200_000)))
    k_values = st.one_of(st.sampled_from([0, 1, 50]), st.integers(0, vocab + 2))
    p_values = st.one_of(st.sampled_from([1.0, 0.9, 1e-6]), st.floats(0.01, 1.0).map(f32))
    m_values = st.one_of(st.sampled_from([0.0, 0.1]), st.floats(0.0, 1.0).map(f32))
    return dict(
        shape=(batch, *extra, vocab),
        kind=draw(st.sampled_from(["normal", "wide", "grid"])),
        holes=draw(st.sampled_from([0.0, 0.3])),
        seed=draw(st.integers(0, 2**32 - 1)),
        temperature=draw(
            st.lists(st.sampled_from([0.0, 1.0, 0.7, 1.9]), min_size=batch, max_size=batch)
        ),
        top_k=draw(st.lists(k_values, min_size=batch, max_size=batch)),
        top_p=draw(st.lists(p_values, min_size=batch, max_size=batch)),
        min_p=draw(st.lists(m_values, min_size=batch, max_size=batch)),
        block=draw(st.sampled_from([256, triton_sampling.DEFAULT_BLOCK])),
    )


def build(case: dict) -> tuple[torch.Tensor, SamplingParams]:
    """CUDA logits for a drawn case (grid logits tie everywhere; holes are -inf) and parameters."""
    shape = case["shape"]
    g = torch.Generator(device="cuda").manual_seed(case["seed"])
    if case["kind"] == "grid":
        logits = torch.randint(-3, 4, shape, generator=g, device="cuda").float()
    else:
        scale = 3.0 if case["kind"] == "normal" else 30.0
        logits = torch.randn(shape, generator=g, device="cuda") * scale
    holes = torch.rand(shape, generator=g, device="cuda") < case["holes"]
    logits = logits.masked_fill(holes, -math.inf)
    logits[..., 0] = logits[..., 0].clamp(min=-100.0)  # every row keeps a finite logit
    filters = (case[name] for name in ("temperature", "top_k", "top_p", "min_p"))
    return logits, kc.sampling_params(*filters, device="cuda")


def per_row(values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A ``[batch]`` parameter repeated for every row of ``logits`` flattened to [rows, vocab]."""
    return values.repeat_interleave(math.prod(logits.shape[1:-1]))[:, None]


def fragile_mask(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[rows, vocab]: tokens whose top-p or min-p decision is within FRAGILE of its threshold.

    A float64 replay of the spec's decisions, in the spec's rank order (float32 scaled logits,
    stable descending sort).
    """
    x = logits.reshape(-1, logits.shape[-1]).float()
    t = per_row(params.temperature.float(), logits)
    z = x / torch.where(t == 0, 1.0, t)
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices
    probs = torch.softmax(z.double(), dim=-1).gather(-1, order)
    rank = torch.arange(x.shape[-1], device=x.device)
    k = per_row(params.top_k, logits)
    in_k = (k <= 0) | (rank < k)
    renorm = probs * in_k / (probs * in_k).sum(-1, keepdim=True)
    before = F.pad(renorm.cumsum(-1)[:, :-1], (1, 0))
    p = per_row(params.top_p.double(), logits)
    m = per_row(params.min_p.double(), logits)
    fragile = ((p < 1) & in_k & ((before - p).abs() <= FRAGILE)) | (
        (m > 0) & ((probs / probs[:, :1] - m).abs() <= FRAGILE)
    )
    return torch.zeros_like(fragile).scatter(-1, order, fragile)


def assert_matches(logits, params, got) -> None:
    """Greedy rows exact; sampled rows to ATOL, or differing only in threshold-fragile tokens."""
    expected = _filtered_probs_reference(logits, *kc.filter_args(params))
    vocab = logits.shape[-1]
    got, expected = got.reshape(-1, vocab), expected.reshape(-1, vocab)
    greedy = per_row(params.temperature, logits)[:, 0] == 0
    assert torch.equal(got[greedy], expected[greedy])
    differing = ((got > 0) != (expected > 0)) & ~greedy[:, None]
    assert not (differing & ~fragile_mask(logits, params)).any()
    close = (got - expected).abs().amax(-1) <= ATOL
    # Rows whose kept set moved at a threshold are still the softmax renormalised over it.
    x = logits.reshape(-1, vocab).double()
    t = per_row(params.temperature.double(), logits)
    own = torch.where(got > 0, torch.softmax(x / torch.where(t == 0, 1.0, t), dim=-1), 0.0)
    own = own / own.sum(-1, keepdim=True)
    assert ((got.double() - own).abs().amax(-1) <= ATOL)[~close & ~greedy].all()


@settings(max_examples=40, deadline=None)
@given(cases())
def test_filtered_probs_matches_spec_on_cuda(case):
    logits, params = build(case)
    got = filtered_probs_triton(logits, *kc.filter_args(params), block=case["block"])
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert_matches(logits, params, got)


@settings(max_examples=40, deadline=None)
@given(case=cases(), seed=st.integers(0, 2**32 - 1))
def test_sample_from_probs_matches_spec_on_cuda(case, seed):
    logits, params = build(case)
    probs = _filtered_probs_reference(logits, *kc.filter_args(params))
    g = torch.Generator(device="cuda").manual_seed(seed)
    u = torch.rand(probs.shape[:-1], generator=g, device="cuda").clamp(2**-24, 1 - 2**-24)
    got = sample_from_probs_triton(probs, u, block=case["block"])
    expected = _sample_from_probs_reference(probs, u)
    assert (probs.gather(-1, got[..., None]) > 0).all()
    vocab = probs.shape[-1]
    got, expected, u = got.flatten(), expected.flatten(), u.flatten()
    for row in torch.nonzero(got != expected).flatten().tolist():
        # Every CDF step between the two draws lies within FRAGILE * total of u * total.
        p = probs.reshape(-1, vocab)[row].double()
        cdf, total = p.cumsum(0), p.sum()
        lo, hi = sorted((int(got[row]), int(expected[row])))
        assert ((cdf[lo:hi] - u[row].double() * total).abs() <= FRAGILE * total).all()


def test_register_routes_the_cuda_ops_to_triton():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(5, 64, 128256, generator=g, device="cuda") * 3
    params = kc.sampling_params(
        [0.0, 1.0, 0.7, 1.2, 0.9],
        [0, 50, 0, 20, 0],
        [1.0, 0.9, 0.95, 1.0, 1.0],
        [0.0, 0.0, 0.05, 0.0, 0.0],
        "cuda",
    )
    triton_sampling.register()
    probs = filtered_probs(logits, params)
    assert torch.equal(probs, filtered_probs_triton(logits, *kc.filter_args(params)))
    assert_matches(logits, params, probs)
    u = torch.rand(5, 64, generator=g, device="cuda")
    assert torch.equal(sample_from_probs(probs, u), sample_from_probs_triton(probs, u))
    # Compiled callers reach the kernel too (the op is opaque to dynamo).
    compiled = torch.compile(filtered_probs, fullgraph=True)
    assert torch.equal(compiled(logits, params), probs)
    # A round marked as filtering sends its filtered rows (1-3) through the sort and the rows
    # with no filter (greedy 0, sampled 4) through the kernel: each row as it would be alone.
    marked = filtered_probs(logits, replace(params, filters=True))
    reference = _filtered_probs_reference(logits, *kc.filter_args(params))
    assert torch.equal(marked[1:4], reference[1:4])
    assert torch.equal(marked[[0, 4]], probs[[0, 4]])
