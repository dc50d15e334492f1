"""Paged addressing and attention (``speculum.spec``) against a plain dense reference.

Every case scatters each request's tokens over a random permutation of the pool's pages, so a
page-table or offset mix-up shows up as wrong values, and fills every slot nobody wrote with
garbage, so reading a slot that should be invisible shows up too.
"""

from __future__ import annotations

import math

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.spec.attention import paged_attention
from speculum.spec.paged import causal_mask, extend_batch, gather_kv, write_kv
from speculum.state.kv import PADDING_PAGE, PagedKV

GARBAGE = 1e3


@attrs.define(frozen=True)
class Case:
    """A batch of requests laid out in a paged pool, and its contiguous twin."""

    page_size: int
    prefix_lens: list[int]
    q: int
    q_lens: list[int]
    tail_lens: list[int]  # tail tokens after the prefix (>= q_lens; more for multi-step drafts)
    pages: list[list[int]]  # pages of each request, in sequence order
    max_pages: int
    num_pages: int
    kv_heads: int
    group: int
    head_dim: int
    new_mask: torch.Tensor  # [batch, q, tail] bool, False past each row's tail
    seed: int

    @property
    def batch(self) -> int:
        """Number of requests."""
        return len(self.prefix_lens)

    def page_table(self) -> torch.Tensor:
        """``pages`` padded to ``max_pages`` columns with the padding sink."""
        rows = [p + [PADDING_PAGE] * (self.max_pages - len(p)) for p in self.pages]
        return torch.tensor(rows, dtype=torch.int64)

    def where(self, b: int, s: int) -> tuple[int, int]:
        """(page, offset) of cache index ``s`` of request ``b``, computed the obvious way."""
        return self.pages[b][s // self.page_size], s % self.page_size


@st.composite
def cases(draw: st.DrawFn, tree: bool = True) -> Case:
    """Random page size, ragged rows, non-contiguous page tables, GQA shapes and a mask."""
    page_size = draw(st.integers(1, 8))
    batch = draw(st.integers(1, 3))
    q = draw(st.integers(1, 5))
    prefix_lens = draw(st.lists(st.integers(0, 12), min_size=batch, max_size=batch))
    q_lens = draw(st.lists(st.integers(0, q), min_size=batch, max_size=batch))
    extra = draw(st.integers(0, 3)) if tree else 0
    tail_lens = [n + draw(st.integers(0, extra)) for n in q_lens]
    counts = [math.ceil((p + n) / page_size) for p, n in zip(prefix_lens, tail_lens)]
    spare = draw(st.integers(0, 2))
    num_pages = 1 + sum(counts) + spare
    order = draw(st.permutations(range(1, num_pages)))
    starts = [sum(counts[:b]) for b in range(batch)]
    pages = [list(order[s : s + c]) for s, c in zip(starts, counts)]
    max_pages = max(1, *counts) + draw(st.integers(0, 2))
    tail = q + extra
    if tree and draw(st.booleans()):
        size = batch * q * tail
        bits = draw(st.lists(st.booleans(), min_size=size, max_size=size))
        new_mask = torch.tensor(bits, dtype=torch.bool).view(batch, q, tail)
        # The caller's contract: no query sees a tail column its request does not have.
        new_mask &= torch.arange(tail)[None, None, :] < torch.tensor(tail_lens)[:, None, None]
    else:
        new_mask = torch.cat(
            [causal_mask(batch, q), torch.zeros(batch, q, extra, dtype=torch.bool)], dim=2
        )
    return Case(
        page_size=page_size,
        prefix_lens=prefix_lens,
        q=q,
        q_lens=q_lens,
        tail_lens=tail_lens,
        pages=pages,
        max_pages=max_pages,
        num_pages=num_pages,
        kv_heads=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 3)),
        head_dim=draw(st.integers(1, 8)),
        new_mask=new_mask,
        seed=draw(st.integers(0, 2**16)),
    )


def garbage_cache(case: Case, gen: torch.Generator) -> torch.Tensor:
    """A ``[page, page_size, kv_head, head_dim]`` cache full of large values nobody should read."""
    shape = (case.num_pages, case.page_size, case.kv_heads, case.head_dim)
    return torch.randn(shape, generator=gen) * GARBAGE


def scatter_rows(case: Case, cache: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """A copy of ``cache`` with row ``b``'s contiguous tokens placed at their pages, one by one."""
    cache = cache.clone()
    for b, row in enumerate(rows):
        for s in range(row.shape[0]):
            cache[case.where(b, s)] = row[s]
    return cache


def dense_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    case: Case,
    scale: float,
) -> torch.Tensor:
    """Attention with contiguous per-request K/V (prefix then new tokens), one query at a time."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(case.batch):
        prefix = case.prefix_lens[b]
        for i in range(case.q_lens[b]):
            new = [prefix + j for j in range(case.tail_lens[b]) if case.new_mask[b, i, j]]
            visible = list(range(prefix)) + new
            for h in range(q.shape[2]):
                k = keys[b][visible, h // case.group].double()
                v = values[b][visible, h // case.group].double()
                weights = torch.softmax(k @ q[b, i, h].double() * scale, dim=0)
                out[b, i, h] = weights @ v
    return out


@settings(max_examples=300, deadline=None)
@given(case=cases())
def test_paged_attention_matches_dense_reference(case: Case) -> None:
    """Prefix + masked new tokens, any page layout, GQA; padded query rows are exactly zero."""
    gen = torch.Generator().manual_seed(case.seed)
    heads = case.kv_heads * case.group
    q = torch.randn(case.batch, case.q, heads, case.head_dim, generator=gen)
    lengths = [p + n for p, n in zip(case.prefix_lens, case.tail_lens)]
    kv_shape = (case.kv_heads, case.head_dim)
    keys = [torch.randn(n, *kv_shape, generator=gen) for n in lengths]
    values = [torch.randn(n, *kv_shape, generator=gen) for n in lengths]
    k_cache = scatter_rows(case, garbage_cache(case, gen), keys)
    v_cache = scatter_rows(case, garbage_cache(case, gen), values)
    scale = case.head_dim**-0.5
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        case.page_table(),
        torch.tensor(case.prefix_lens, dtype=torch.int64),
        torch.tensor(case.q_lens, dtype=torch.int64),
        case.new_mask,
        scale,
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, dense_attention(q, keys, values, case, scale).float())
    for b, length in enumerate(case.q_lens):
        assert torch.equal(out[b, length:], torch.zeros_like(out[b, length:]))


@settings(max_examples=300, deadline=None)
@given(case=cases(tree=False))
def test_extend_batch_writes_land_in_their_slots(case: Case) -> None:
    """Valid tokens go to (page_table[s // page_size], s % page_size); padding only to page 0."""
    gen = torch.Generator().manual_seed(case.seed)
    prefix_lens = torch.tensor(case.prefix_lens, dtype=torch.int64)
    q_lens = torch.tensor(case.q_lens, dtype=torch.int64)
    kv = PagedKV(page_table=case.page_table(), seq_lens=prefix_lens, page_size=case.page_size)
    ids = torch.randint(1, 100, (case.batch, case.q), generator=gen)
    fb = extend_batch(kv, ids, q_lens)
    new = torch.randn(case.batch, case.q, case.kv_heads, case.head_dim, generator=gen)
    before = garbage_cache(case, gen)
    after = before.clone()
    write_kv(after, fb.slots, new)

    expected = before.clone()
    for b in range(case.batch):
        for i in range(case.q_lens[b]):
            expected[case.where(b, case.prefix_lens[b] + i)] = new[b, i]
    # Page 0 is the sink: padded rows may leave anything there; every other page is exact.
    torch.testing.assert_close(after[1:], expected[1:], rtol=0, atol=0)
    padded = [(b, i) for b in range(case.batch) for i in range(case.q_lens[b], case.q)]
    assert all(int(fb.slots[b, i]) // case.page_size == PADDING_PAGE for b, i in padded)

    offsets = torch.arange(case.q)[None, :]
    valid = offsets < q_lens[:, None]
    assert torch.equal(fb.positions, prefix_lens[:, None] + offsets)
    assert torch.equal(fb.input_ids, torch.where(valid, ids, 0))
    assert torch.equal(fb.prefix_lens, prefix_lens) and torch.equal(fb.q_lens, q_lens)
    assert torch.equal(fb.new_mask, torch.ones(case.q, case.q).tril().bool().expand_as(fb.new_mask))


@settings(max_examples=200, deadline=None)
@given(case=cases(tree=False))
def test_gather_kv_returns_tokens_in_sequence_order(case: Case) -> None:
    """Gathering through the page table undoes the scatter: row ``b`` reads back its tokens."""
    gen = torch.Generator().manual_seed(case.seed)
    lengths = [p + n for p, n in zip(case.prefix_lens, case.q_lens)]
    rows = [torch.randn(n, case.kv_heads, case.head_dim, generator=gen) for n in lengths]
    cache = scatter_rows(case, garbage_cache(case, gen), rows)
    gathered = gather_kv(cache, case.page_table())
    assert gathered.shape == (case.batch, case.max_pages * case.page_size, *cache.shape[2:])
    for b, row in enumerate(rows):
        assert torch.equal(gathered[b, : row.shape[0]], row)
        # Columns past the request's pages are the padding sink's slots.
        sink_from = len(case.pages[b]) * case.page_size
        sink = cache[PADDING_PAGE].repeat(case.max_pages - len(case.pages[b]), 1, 1)
        assert torch.equal(gathered[b, sink_from:], sink)


@given(case=cases())
def test_an_empty_tail_is_the_same_as_an_unseen_one(case: Case) -> None:
    """Queries may attend to their prefix alone (a zero-width tail), as with a tail no query
    sees: the mask's width is a shape, not a reason to fail."""
    gen = torch.Generator().manual_seed(case.seed)
    heads = case.kv_heads * case.group
    q = torch.randn(case.batch, case.q, heads, case.head_dim, generator=gen)
    k_cache, v_cache = garbage_cache(case, gen), garbage_cache(case, gen)
    prefix = torch.tensor(case.prefix_lens, dtype=torch.int64)
    args = (q, k_cache, v_cache, case.page_table(), prefix, torch.tensor(case.q_lens))
    empty = torch.zeros(case.batch, case.q, 0, dtype=torch.bool)
    unseen = torch.zeros(case.batch, case.q, 1, dtype=torch.bool)
    scale = case.head_dim**-0.5
    assert torch.equal(paged_attention(*args, empty, scale), paged_attention(*args, unseen, scale))
