"""The Triton paged-attention kernel against its spec twin, on the CPU under Triton's interpreter.

Each case scatters every request over random distinct pages, fills every pool slot that no
query can see (and the padded query rows) with NaN, inf and huge values, and poisons the output
buffer, so a page-table mix-up, a read of an invisible slot or an unwritten element all show up
as a mismatch. The split-KV path is forced with ``num_splits``.
"""

from __future__ import annotations

import math

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.kernels.triton_attention import paged_attention_triton
from speculum.spec.attention import paged_attention, visible_keys
from speculum.spec.paged import causal_mask
from speculum.state.kv import PADDING_PAGE

GARBAGE = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30])


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
        mask = torch.cat(
            [causal_mask(batch, q), torch.zeros(batch, q, tail - q, dtype=torch.bool)], dim=2
        )
    else:
        bits = draw(st.lists(st.booleans(), min_size=batch * q * tail, max_size=batch * q * tail))
        mask = torch.tensor(bits, dtype=torch.bool).view(batch, q, tail)
    counts = [math.ceil((p + tail) / page_size) for p in prefix_lens]
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
        page_table=page_table(order, counts, max_pages),
        num_pages=num_pages,
        new_mask=mask,
        num_splits=draw(st.sampled_from([None, 1, 2, 3])),
        seed=draw(st.integers(0, 2**16)),
    )


def page_table(order: list[int], counts: list[int], max_pages: int) -> torch.Tensor:
    """Request ``b`` gets the next ``counts[b]`` pages of ``order``, padded with the sink."""
    rows, used = [], 0
    for c in counts:
        rows.append(list(order[used : used + c]) + [PADDING_PAGE] * (max_pages - c))
        used += c
    return torch.tensor(rows, dtype=torch.int64)


def garbage_pool(case: Case, seen: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A pool of random values in every slot some query sees, garbage everywhere else."""
    shape = (case.num_pages * case.page_size, case.kv_heads, case.head_dim)
    pick = torch.randint(len(GARBAGE), shape, generator=gen)
    pool = GARBAGE[pick]
    seq = seen.shape[1]
    s = torch.arange(seq)
    slots = case.page_table[:, s // case.page_size] * case.page_size + s % case.page_size
    live = slots[seen]
    pool[live] = torch.randn(live.numel(), *shape[1:], generator=gen)
    return pool.view(case.num_pages, case.page_size, case.kv_heads, case.head_dim)


def run_both(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, reference) outputs of one case."""
    gen = torch.Generator().manual_seed(case.seed)
    batch, q, tail = case.new_mask.shape
    heads = case.kv_heads * case.group
    prefix_lens = torch.tensor(case.prefix_lens)
    q_lens = torch.tensor(case.q_lens)
    seq = case.page_table.shape[1] * case.page_size
    # The reference needs one tail column to gather from; an all-False one sees nothing.
    ref_mask = case.new_mask if tail else torch.zeros(batch, q, 1, dtype=torch.bool)
    # As the reference defines it: a slot is seen when any query row (padding too) sees it.
    seen = visible_keys(prefix_lens, ref_mask, seq).any(1)
    k_cache, v_cache = garbage_pool(case, seen, gen), garbage_pool(case, seen, gen)
    queries = torch.randn(batch, q, heads, case.head_dim, generator=gen)
    padded = torch.arange(q)[None, :] >= q_lens[:, None]
    queries[padded] = float("nan")
    out = torch.full_like(queries, float("nan"))
    scale = case.head_dim**-0.5
    args = (queries, k_cache, v_cache, case.page_table, prefix_lens, q_lens)
    got = paged_attention_triton(*args, case.new_mask, scale, num_splits=case.num_splits, out=out)
    return got, paged_attention(*args, ref_mask, scale)


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
    counts = [math.ceil((p + q) / page_size) for p in prefix_lens]
    case = Case(
        page_size=page_size,
        kv_heads=kv_heads,
        group=group,
        head_dim=16,
        prefix_lens=prefix_lens,
        q_lens=[20, 17],
        page_table=page_table(
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
