"""The Triton latent-attention (MLA) kernel against its spec twin, on the CPU under Triton's
interpreter.

As for the grouped-query kernel: every request's pages are scattered at random, every pool slot
no query sees (and every padded query row) holds NaN, inf or 1e30, and the output buffer is
poisoned, so a page-table mix-up, a read of an unseen slot or an unwritten element shows up.
The interpreter runs 16-row, 16-key tiles, so a few heads and tokens already cross token
blocks, head blocks (above 16 heads), key tiles and split chunks.
"""

from __future__ import annotations

import kernel_cases as kc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum import kernels
from speculum.kernels.triton_mla import latent_attention_triton
from speculum.spec.attention import latent_attention
from speculum.spec.paged import causal_mask


def latent_inputs(
    *,
    prefix_lens: list[int],
    q_lens: list[int],
    new_mask: torch.Tensor,
    heads: int,
    latent_dim: int,
    rope_dim: int,
    page_size: int,
    seed: int,
    spare_pages: int = 1,
) -> dict:
    """Float32 inputs over a latent cache, pages in a seeded random order."""
    gen = torch.Generator().manual_seed(seed)
    counts = kc.pages_needed(prefix_lens, new_mask.shape[2], page_size)
    order = (torch.randperm(sum(counts) + spare_pages, generator=gen) + 1).tolist()
    return kc.attention_inputs(
        gen,
        prefix_lens=prefix_lens,
        q_lens=q_lens,
        new_mask=new_mask,
        page_table=kc.page_table(order, counts, max(1, *counts) + spare_pages),
        num_pages=1 + sum(counts) + spare_pages,
        heads=heads,
        kv_heads=1,
        head_dim=latent_dim + rope_dim,
        page_size=page_size,
        latent_dim=latent_dim,
    )


def check(inputs: dict, latent_dim: int, num_splits: int | None = None) -> None:
    """Kernel against the spec twin, elementwise, with every output element written."""
    got, want = kc.run_latent(inputs, latent_dim, num_splits=num_splits)
    assert got.shape == want.shape
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict, int, int | None]:
    """Ragged batches of decode steps, chains, trees and random tails (up to ``q + 3``, or past
    one key tile), heads within and across a 16-row block, latent widths not a power of 2."""
    batch, q = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    tail = draw(st.integers(0, q + 3) | st.integers(16, 20))
    shape = draw(st.sampled_from(["causal", "tree", "random"])) if tail >= q else "random"
    seed = draw(st.integers(0, 2**16))
    if shape == "causal":
        mask = kc.causal_tail_mask(batch, q, tail)
    elif shape == "tree":
        mask = kc.tree_mask(batch, q, tail, seed)
    else:
        mask = torch.rand(batch, q, tail, generator=torch.Generator().manual_seed(seed)) < 0.5
    latent_dim = draw(st.sampled_from([8, 12, 16]))
    inputs = latent_inputs(
        prefix_lens=draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch)),
        q_lens=draw(st.lists(st.integers(0, q), min_size=batch, max_size=batch)),
        new_mask=mask,
        heads=draw(st.sampled_from([1, 3, 4, 16, 20])),
        latent_dim=latent_dim,
        rope_dim=draw(st.sampled_from([2, 4, 8])),
        page_size=draw(st.integers(1, 8)),
        seed=seed,
        spare_pages=draw(st.integers(0, 2)),
    )
    return inputs, latent_dim, draw(st.sampled_from([None, 1, 2, 3]))


@settings(max_examples=15)
@given(cases())
def test_latent_kernel_matches_spec(case):
    inputs, latent_dim, num_splits = case
    got, want = kc.run_latent(inputs, latent_dim, num_splits=num_splits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("call", ["decode", "chain", "tree"])
def test_decode_chain_and_tree_verify(call, page_size):
    """A decode step, a 4-token chain verify and an 6-node tree verify over scattered pages
    of several sizes, prefixes crossing key tiles, split and not; one request padded short."""
    batch, heads = 2, 8
    q = {"decode": 1, "chain": 4, "tree": 6}[call]
    mask = kc.tree_mask(batch, q, q, seed=5) if call == "tree" else causal_mask(batch, q)
    inputs = latent_inputs(
        prefix_lens=[45, 17],
        q_lens=[q, max(1, q - 2)],
        new_mask=mask.clone(),
        heads=heads,
        latent_dim=16,
        rope_dim=8,
        page_size=page_size,
        seed=page_size,
    )
    for num_splits in (1, 3):
        check(inputs, 16, num_splits)


def test_multi_step_draft_tail_wider_than_queries():
    """A later multi-step draft step: 2 queries whose tail holds the earlier steps' tokens
    first (``tail > q``), with 32 heads (two 16-row head blocks)."""
    mask = kc.tree_mask(2, 2, 7, seed=3)
    inputs = latent_inputs(
        prefix_lens=[21, 0],
        q_lens=[2, 2],
        new_mask=mask,
        heads=32,
        latent_dim=12,
        rope_dim=4,
        page_size=4,
        seed=9,
    )
    check(inputs, 12, num_splits=2)


def test_prefill_chunk_wider_than_a_tile():
    """A causal 20-token chunk after a cached prefix and a first chunk padded short: many token
    blocks, tails wider than a key tile, tiles above the diagonal skipped."""
    inputs = latent_inputs(
        prefix_lens=[35, 0],
        q_lens=[20, 13],
        new_mask=causal_mask(2, 20).clone(),
        heads=4,
        latent_dim=16,
        rope_dim=8,
        page_size=3,
        seed=1,
    )
    check(inputs, 16)


def test_half_precision():
    """float16 queries and cache give a float16 result close to the float32 reference
    (bfloat16 is checked on the GPU: the interpreter multiplies its raw bits)."""
    inputs = latent_inputs(
        prefix_lens=[30, 9],
        q_lens=[3, 1],
        new_mask=causal_mask(2, 3).clone(),
        heads=4,
        latent_dim=16,
        rope_dim=8,
        page_size=4,
        seed=2,
    )
    got, want = kc.run_latent(inputs, 16, torch.float16, num_splits=2)
    assert got.dtype == torch.float16
    assert (got.float() - want).norm() / want.norm() < 1e-2


def test_op_runs_the_spec_twin_on_the_cpu():
    """``speculum::latent_attention`` on CPU tensors is the reference (the kernel is its CUDA
    implementation)."""
    inputs = latent_inputs(
        prefix_lens=[5],
        q_lens=[2],
        new_mask=causal_mask(1, 2).clone(),
        heads=2,
        latent_dim=8,
        rope_dim=4,
        page_size=2,
        seed=4,
    )
    args = [inputs[k] for k in ("q", "k_cache", "page_table", "prefix_lens", "q_lens")]
    got = kernels.latent_attention(*args, inputs["new_mask"], inputs["scale"], 8)
    want = latent_attention(*args, inputs["new_mask"], inputs["scale"], 8)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("q_width", "kv_heads", "latent_dim", "named"),
    [(12, 2, 8, "one cached head"), (10, 1, 8, "as wide"), (12, 1, 12, "latent_dim=12")],
)
def test_bad_shapes_are_refused(q_width, kv_heads, latent_dim, named):
    """A cache of several heads, queries not as wide as the cache rows, a latent width that
    leaves no rotary columns: a ValueError naming the problem, from the kernel and the spec."""
    q = torch.zeros(1, 1, 2, q_width)
    cache = torch.zeros(2, 4, kv_heads, 12)
    args = (torch.tensor([[1]]), torch.tensor([0]), torch.tensor([1]), causal_mask(1, 1), 1.0)
    for fn in (latent_attention, latent_attention_triton):
        with pytest.raises(ValueError, match=named):
            fn(q, cache, *args, latent_dim)
