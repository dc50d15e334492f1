"""The Triton paged-attention kernel against its spec twin on a CUDA device, at serving sizes.

As in ``tests/cover/test_kernel_attention.py``: pages are scattered at random, every slot no
query sees (and every padded query row) holds NaN, inf or huge values, and the output buffer is
poisoned. float32 runs are compared elementwise; bfloat16 runs against the float32 reference on
upcast inputs, by relative error ``||out - ref|| / ||ref|| < 1e-2``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.kernels.triton_attention import paged_attention_triton, register
from speculum.spec.attention import paged_attention, visible_keys
from speculum.spec.paged import causal_mask
from speculum.state.kv import PADDING_PAGE

pytestmark = pytest.mark.gpu

GARBAGE = [float("nan"), float("inf"), float("-inf"), 1e30]


def make_inputs(
    *,
    prefix_lens: list[int],
    q_lens: list[int],
    new_mask: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    spare_pages: int = 2,
    seed: int = 0,
) -> dict:
    """Float32 CUDA inputs: pages shuffled, unseen slots and padded query rows garbage."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch, q, tail = new_mask.shape
    new_mask = new_mask.to("cuda")
    counts = [math.ceil((p + tail) / page_size) for p in prefix_lens]
    max_pages = max(1, *counts) + spare_pages
    num_pages = 1 + sum(counts) + spare_pages
    order = (torch.randperm(num_pages - 1, generator=gen, device="cuda") + 1).tolist()
    rows, used = [], 0
    for c in counts:
        rows.append(order[used : used + c] + [PADDING_PAGE] * (max_pages - c))
        used += c
    page_table = torch.tensor(rows, dtype=torch.int64, device="cuda")
    prefix = torch.tensor(prefix_lens, device="cuda")
    lens = torch.tensor(q_lens, device="cuda")
    # The reference cannot gather from an empty tail; an all-False column sees nothing.
    ref_mask = new_mask if tail else torch.zeros(batch, q, 1, dtype=torch.bool, device="cuda")
    seq = max_pages * page_size
    seen = visible_keys(prefix, ref_mask, seq).any(1)  # what the reference reads
    s = torch.arange(seq, device="cuda")
    live = (page_table[:, s // page_size] * page_size + s % page_size)[seen]
    garbage = torch.tensor(GARBAGE, device="cuda")

    def pool() -> torch.Tensor:
        shape = (num_pages * page_size, kv_heads, head_dim)
        values = garbage[torch.randint(len(GARBAGE), shape, generator=gen, device="cuda")]
        values[live] = torch.randn(live.numel(), kv_heads, head_dim, generator=gen, device="cuda")
        return values.view(num_pages, page_size, kv_heads, head_dim)

    queries = torch.randn(batch, q, heads, head_dim, generator=gen, device="cuda")
    queries[torch.arange(q, device="cuda")[None, :] >= lens[:, None]] = float("nan")
    return {
        "q": queries,
        "k_cache": pool(),
        "v_cache": pool(),
        "page_table": page_table,
        "prefix_lens": prefix,
        "q_lens": lens,
        "new_mask": new_mask,
        "ref_mask": ref_mask,
        "scale": head_dim**-0.5,
    }


def check(inputs: dict, dtype: torch.dtype, num_splits: int | None = None) -> None:
    """Kernel (in ``dtype``, output poisoned) against the float32 reference."""
    args = {k: v for k, v in inputs.items() if k != "ref_mask"}
    want = paged_attention(**{**args, "new_mask": inputs["ref_mask"]})
    q, k, v = (args.pop(name).to(dtype) for name in ("q", "k_cache", "v_cache"))
    out = torch.full_like(q, float("nan"))
    got = paged_attention_triton(q, k, v, **args, num_splits=num_splits, out=out)
    assert got.dtype == dtype
    assert not got.isnan().any(), "unwritten or NaN output"
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        error, size = (got.float() - want).norm(), want.norm()
        assert error <= 1e-2 * size, f"relative error {error / size:.2e}"


@st.composite
def shapes(draw: st.DrawFn) -> dict:
    """Mid-sized batches: ragged rows, long prefixes, random or causal tails wider than q."""
    seed = draw(st.integers(0, 2**16))
    batch = draw(st.integers(1, 6))
    q = draw(st.sampled_from([1, 2, 7, 16, 40]))
    tail = draw(st.integers(0, q + 8))
    kv_heads, group = draw(st.sampled_from([(1, 1), (2, 4), (8, 4), (1, 8)]))
    if tail >= q and draw(st.booleans()):
        mask = torch.cat([causal_mask(batch, q), torch.zeros(batch, q, tail - q, dtype=bool)], 2)
    else:
        mask = torch.rand(batch, q, tail, generator=torch.Generator().manual_seed(seed)) < 0.5
    return {
        "prefix_lens": draw(st.lists(st.integers(0, 700), min_size=batch, max_size=batch)),
        "q_lens": draw(st.lists(st.integers(0, q), min_size=batch, max_size=batch)),
        "new_mask": mask,
        "heads": kv_heads * group,
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([64, 128])),
        "page_size": draw(st.sampled_from([1, 16])),
        "seed": seed,
    }


@settings(max_examples=30)
@given(shapes(), st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([None, 3]))
def test_drawn_shapes(inputs, dtype, num_splits):
    check(make_inputs(**inputs), dtype, num_splits)


def tree_mask(batch: int, q: int, tail: int, seed: int) -> torch.Tensor:
    """Random trees: query ``i`` sees itself and an ancestor chain of earlier tail columns."""
    gen = torch.Generator().manual_seed(seed)
    offset = tail - q  # earlier draft steps sit before this step's tokens
    mask = torch.zeros(batch, q, tail, dtype=torch.bool)
    parent = [
        [int(torch.randint(-1, i, (), generator=gen)) for i in range(q)] for _ in range(batch)
    ]
    for b in range(batch):
        mask[b, :, :offset] = torch.rand(q, offset, generator=gen) < 0.3
        for i in range(q):
            mask[b, i, offset + i] = True
            if parent[b][i] >= 0:
                mask[b, i, offset:] |= mask[b, parent[b][i], offset:]
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 64])
def test_decode(batch, dtype):
    """One token per request over a 4096-token prefix, Llama-3-8B heads; batch 1 splits KV."""
    prefix = [4096 - 37 * b for b in range(batch)]
    inputs = make_inputs(
        prefix_lens=prefix,
        q_lens=[1] * batch,
        new_mask=causal_mask(batch, 1),
        heads=32,
        kv_heads=8,
        head_dim=128,
        page_size=16,
    )
    check(inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q", "tail"), [(8, 8), (64, 64), (16, 48)])
def test_tree_verify(q, tail, dtype):
    """Tree verify (tail == q) and a later multi-step draft step (tail > q)."""
    batch = 4
    inputs = make_inputs(
        prefix_lens=[1500, 0, 333, 2048],
        q_lens=[q, q, q - 3, 1],
        new_mask=tree_mask(batch, q, tail, seed=q),
        heads=32,
        kv_heads=8,
        head_dim=128,
        page_size=16,
    )
    check(inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunk(dtype):
    """A causal 512-token chunk after a cached prefix, and a first chunk, one padded short."""
    inputs = make_inputs(
        prefix_lens=[1000, 0],
        q_lens=[512, 300],
        new_mask=causal_mask(2, 512),
        heads=32,
        kv_heads=8,
        head_dim=128,
        page_size=16,
    )
    check(inputs, dtype)


@pytest.mark.parametrize("num_splits", [2, 7, 64])
def test_forced_splits(num_splits):
    """Split-KV with more splits than key blocks, so some splits have nothing to do."""
    inputs = make_inputs(
        prefix_lens=[300, 5, 0],
        q_lens=[3, 3, 2],
        new_mask=tree_mask(3, 3, 5, seed=1),
        heads=8,
        kv_heads=2,
        head_dim=128,
        page_size=16,
    )
    check(inputs, torch.bfloat16, num_splits)


def test_cuda_graph_replay_reads_new_lengths():
    """Launch parameters depend on shapes only: a captured call follows new prefix lengths."""
    inputs = make_inputs(
        prefix_lens=[2000, 900],
        q_lens=[1, 1],
        new_mask=causal_mask(2, 1),
        heads=32,
        kv_heads=8,
        head_dim=128,
        page_size=16,
    )
    args = {k: v for k, v in inputs.items() if k != "ref_mask"}
    paged_attention_triton(**args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(**args)
    args["prefix_lens"].copy_(torch.tensor([1200, 500]))  # shorter: every slot stays finite
    graph.replay()
    want = paged_attention(**args)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_registered_as_the_cuda_kernel_of_the_op():
    from speculum import kernels

    register()
    inputs = make_inputs(
        prefix_lens=[50, 7],
        q_lens=[4, 2],
        new_mask=causal_mask(2, 4),
        heads=4,
        kv_heads=2,
        head_dim=64,
        page_size=16,
    )
    args = {k: v for k, v in inputs.items() if k != "ref_mask"}
    torch.testing.assert_close(
        kernels.paged_attention(**args), paged_attention(**args), rtol=1e-4, atol=1e-4
    )
