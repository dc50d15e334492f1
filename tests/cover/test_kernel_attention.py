"""The Triton paged-attention kernel against its spec twin, on the CPU under Triton's interpreter.

Each case scatters every request over random distinct pages, fills every pool slot that no
query can see (and the padded query rows) with NaN, inf and huge values, and poisons the output
buffer, so a page-table mix-up, a read of an invisible slot or an unwritten element all show up
as a mismatch. The split-KV path is forced with ``num_splits``.
"""

from __future__ import annotations

import attrs
import kernel_cases as kc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.kernels.triton_attention import paged_attention_triton
from speculum.spec.attention import paged_attention
from speculum.spec.paged import causal_mask, pack, packed_rows


@attrs.define(frozen=True)
class Case:
    """Shapes, lengths, pages and mask of one batch; tensors are drawn from ``seed``."""

    page_size: int
    kv_heads: int
    group: int
    head_dim: int
    prefix_lens: list[int]
    q_lens: list[int]
    page_table: torch.Tensor  # [batch, max_pages], distinct live pages, sink-padded
    num_pages: int
    new_mask: torch.Tensor  # [batch, q, tail] bool
    num_splits: int | None
    seed: int
    #: Values as the keys' first columns (latent attention), or their own pool (``None``).
    latent_dim: int | None = None
    #: Sliding window (keys each query sees at most; 0: full attention).
    window: int = 0
    #: Whether each head has an attention sink (gpt-oss).
    sinks: bool = False


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Tiny GQA batches with ragged rows, tails up to ``q + 3`` (or 24) wide, random or causal."""
    page_size = draw(st.integers(1, 8))
    batch = draw(st.integers(1, 3))
    q = draw(st.integers(1, 5))
    # Tails past 16 columns (one interpreter key tile) reach the kernel's dense-tile loop.
    tail = draw(st.integers(0, q + 3) | st.integers(16, 24))
    prefix_lens = draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
    q_lens = draw(st.lists(st.integers(0, q), min_size=batch, max_size=batch))
    if tail >= q and draw(st.booleans()):
        mask = kc.causal_tail_mask(batch, q, tail)
    else:
        bits = draw(st.lists(st.booleans(), min_size=batch * q * tail, max_size=batch * q * tail))
        mask = torch.tensor(bits, dtype=torch.bool).view(batch, q, tail)
    counts = kc.pages_needed(prefix_lens, tail, page_size)
    max_pages = max(1, *counts) + draw(st.integers(0, 2))
    num_pages = 1 + sum(counts) + draw(st.integers(0, 3))
    order = draw(st.permutations(range(1, num_pages)))
    return Case(
        page_size=page_size,
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 3, 4])),
        head_dim=draw(st.sampled_from([8, 16])),
        prefix_lens=prefix_lens,
        q_lens=q_lens,
        page_table=kc.page_table(order, counts, max_pages),
        num_pages=num_pages,
        new_mask=mask,
        num_splits=draw(st.sampled_from([None, 1, 2, 3])),
        seed=draw(st.integers(0, 2**16)),
        latent_dim=draw(st.sampled_from([None, None, 6])),
        window=draw(st.sampled_from([0, 0, 1, 3, 7, 20])),
        sinks=draw(st.booleans()),
    )


def case_inputs(case: Case) -> dict:
    """The inputs of one case (``kernel_cases.attention_inputs``), drawn from its seed."""
    return kc.attention_inputs(
        torch.Generator().manual_seed(case.seed),
        prefix_lens=case.prefix_lens,
        q_lens=case.q_lens,
        new_mask=case.new_mask,
        page_table=case.page_table,
        num_pages=case.num_pages,
        heads=case.kv_heads * case.group,
        kv_heads=case.kv_heads,
        head_dim=case.head_dim,
        page_size=case.page_size,
        latent_dim=case.latent_dim,
        window=case.window,
        sinks=case.sinks,
    )


def run_both(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, reference) outputs of one case, on inputs drawn from its seed."""
    return kc.run_attention(case_inputs(case), num_splits=case.num_splits)


@settings(max_examples=40)
@given(cases())
def test_triton_paged_attention_matches_spec(case):
    got, want = run_both(case)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_multi_block_tail_and_queries():
    """A tail and a query set wider than one 16-wide tile, causal, over an odd page size."""
    batch, q, kv_heads, group, page_size = 2, 20, 1, 2, 3
    prefix_lens = [35, 0]
    counts = kc.pages_needed(prefix_lens, q, page_size)
    case = Case(
        page_size=page_size,
        kv_heads=kv_heads,
        group=group,
        head_dim=16,
        prefix_lens=prefix_lens,
        q_lens=[20, 17],
        page_table=kc.page_table(
            (torch.randperm(sum(counts), generator=torch.Generator().manual_seed(0)) + 1).tolist(),
            counts,
            max(counts),
        ),
        num_pages=1 + sum(counts),
        new_mask=causal_mask(batch, q).clone(),
        num_splits=2,
        seed=7,
    )
    got, want = run_both(case)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_q", [1, 5, 20])
def test_sliding_window_skips_tiles_outside_it(num_q):
    """A decode step, a chain verify and a prefill chunk over prefixes several key tiles long
    with a window shorter than a tile: every key outside the window is NaN or inf (poisoned by
    ``attention_inputs``), so a tile the kernel wrongly loads shows up, split or not."""
    batch, kv_heads, group, page_size, window = 2, 1, 2, 3, 5
    prefix_lens = [70, 37]
    counts = kc.pages_needed(prefix_lens, num_q, page_size)
    for num_splits in (1, 3):
        case = Case(
            page_size=page_size,
            kv_heads=kv_heads,
            group=group,
            head_dim=16,
            prefix_lens=prefix_lens,
            q_lens=[num_q, max(1, num_q - 2)],
            page_table=kc.page_table(list(range(1, 1 + sum(counts))), counts, max(counts)),
            num_pages=1 + sum(counts),
            new_mask=causal_mask(batch, num_q).clone(),
            num_splits=num_splits,
            seed=3,
            window=window,
        )
        got, want = run_both(case)
        assert not want.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_latent_attention_shape():
    """Latent attention's call: many query heads on one KV head whose values are the first
    columns of its keys (a latent cache: latent then rotary key), values narrower than keys, a
    causal chunk over a prefix, split and not."""
    batch, q, page_size = 2, 5, 4
    prefix_lens = [9, 3]
    counts = kc.pages_needed(prefix_lens, q, page_size)
    for num_splits in (None, 2):
        case = Case(
            page_size=page_size,
            kv_heads=1,
            group=8,
            head_dim=24,
            prefix_lens=prefix_lens,
            q_lens=[5, 3],
            page_table=kc.page_table(list(range(1, 1 + sum(counts))), counts, max(counts)),
            num_pages=1 + sum(counts),
            new_mask=causal_mask(batch, q).clone(),
            num_splits=num_splits,
            seed=11,
            latent_dim=16,
        )
        got, want = run_both(case)
        assert got.shape == (batch, q, 8, 16)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_half_precision():
    """float16 queries and pool give a float16 result close to the float32 reference.

    float16 stands in for bfloat16 here: Triton's interpreter multiplies bfloat16 tiles as their
    raw uint16 bit patterns (triton 3.9), so bfloat16 parity is checked on the GPU only.
    """
    gen = torch.Generator().manual_seed(3)
    batch, q, heads, kv_heads, dim, page_size, pages = 2, 3, 4, 2, 16, 4, 6
    queries = torch.randn(batch, q, heads, dim, generator=gen).half()
    k_cache = torch.randn(pages, page_size, kv_heads, dim, generator=gen).half()
    v_cache = torch.randn(pages, page_size, kv_heads, dim, generator=gen).half()
    page_table = torch.tensor([[1, 2, 3], [4, 5, 0]])
    prefix_lens, q_lens = torch.tensor([6, 2]), torch.tensor([3, 2])
    args = (page_table, prefix_lens, q_lens, causal_mask(batch, q), 0.25)
    got = paged_attention_triton(queries, k_cache, v_cache, *args, num_splits=2)
    want = paged_attention(queries.float(), k_cache.float(), v_cache.float(), *args)
    assert got.dtype == torch.float16
    assert (got.float() - want).norm() / want.norm() < 1e-2


@settings(max_examples=20)
@given(cases(), st.integers(0, 4))
def test_packed_queries_match_padded(case, spare):
    """Packed queries (ragged verify: each request's real rows back to back, ``spare`` rows of
    padding after them) give the padded call's outputs, bit for bit in the kernel (the same
    launch, rows read from their offsets) and in the reference, and zeros in the spare rows;
    the padding rows' NaN never reaches a real row."""
    inputs = case_inputs(case)
    args = kc.kernel_args(inputs)
    batch, q = case.new_mask.shape[:2]
    lens = args["q_lens"]
    capacity = min(batch * q, max(1, int(lens.sum())) + spare)
    q_starts = torch.cumsum(lens, 0) - lens
    rows = packed_rows(q_starts, lens, q, capacity)
    packed_q = pack(args["q"], rows).clone()
    packed_q[:, int(lens.sum()) :] = float("nan")  # spare rows: nothing may read them
    padded = paged_attention_triton(**args, num_splits=case.num_splits)
    got = paged_attention_triton(
        **{**args, "q": packed_q}, q_starts=q_starts, num_splits=case.num_splits
    )
    assert torch.equal(got, pack(padded, rows))
    reference = {**args, "new_mask": inputs["ref_mask"]}
    want = paged_attention(**{**reference, "q": packed_q}, q_starts=q_starts)
    assert torch.equal(want, pack(paged_attention(**reference), rows))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
