"""The Triton paged-attention kernel against its spec twin on a CUDA device, at serving sizes.

As in ``tests/cover/test_kernel_attention.py``: pages are scattered at random, every slot no
query sees (and every padded query row) holds NaN, inf or huge values, and the output buffer is
poisoned. float32 runs are compared elementwise; bfloat16 runs against the float32 reference on
upcast inputs, by relative error ``||out - ref|| / ||ref|| < 1e-2``.
"""

from __future__ import annotations

import kernel_cases as kc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.kernels.triton_attention import paged_attention_triton, register
from speculum.spec.attention import paged_attention
from speculum.spec.paged import causal_mask

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]


#: Llama-3-8B's attention (32 query heads, 8 KV heads of 128) over 16-token pages.
LLAMA_8B = {"heads": 32, "kv_heads": 8, "head_dim": 128, "page_size": 16}


def make_inputs(
    *, prefix_lens: list[int], q_lens: list[int], new_mask, spare_pages=2, seed=0, **sizes
) -> dict:
    """Float32 CUDA inputs: pages shuffled, unseen slots and padded query rows garbage.

    ``sizes`` (``heads``, ``kv_heads``, ``head_dim``, ``page_size``) override ``LLAMA_8B``'s.
    """
    sizes = {**LLAMA_8B, **sizes}
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = kc.pages_needed(prefix_lens, new_mask.shape[2], sizes["page_size"])
    num_pages = 1 + sum(counts) + spare_pages
    order = (torch.randperm(num_pages - 1, generator=gen, device="cuda") + 1).tolist()
    return kc.attention_inputs(
        gen,
        prefix_lens=prefix_lens,
        q_lens=q_lens,
        new_mask=new_mask,
        page_table=kc.page_table(order, counts, max(1, *counts) + spare_pages, device="cuda"),
        num_pages=num_pages,
        **sizes,
    )


def check(inputs: dict, dtype: torch.dtype, num_splits: int | None = None) -> None:
    """Kernel (in ``dtype``, output poisoned) against the float32 reference."""
    got, want = kc.run_attention(inputs, dtype, num_splits)
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
        mask = kc.causal_tail_mask(batch, q, tail)
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
        "window": draw(st.sampled_from([0, 0, 50, 300])),
        "seed": seed,
    }


@settings(max_examples=30)
@given(shapes(), st.sampled_from(DTYPES), st.sampled_from([None, 3]))
def test_drawn_shapes(inputs, dtype, num_splits):
    check(make_inputs(**inputs), dtype, num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 64])
def test_decode(batch, dtype):
    """One token per request over a 4096-token prefix, Llama-3-8B heads; batch 1 splits KV."""
    prefix = [4096 - 37 * b for b in range(batch)]
    inputs = make_inputs(prefix_lens=prefix, q_lens=[1] * batch, new_mask=causal_mask(batch, 1))
    check(inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q", "tail"), [(8, 8), (64, 64), (16, 48)])
def test_tree_verify(q, tail, dtype):
    """Tree verify (tail == q) and a later multi-step draft step (tail > q)."""
    lens, mask = [q, q, q - 3, 1], kc.tree_mask(4, q, tail, seed=q)
    check(make_inputs(prefix_lens=[1500, 0, 333, 2048], q_lens=lens, new_mask=mask), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [100, 1000])
@pytest.mark.parametrize("call", ["decode", "chain", "tree", "chunk"])
def test_sliding_window(call, window, dtype):
    """Mistral-style windows shorter than 4096-token prefixes: decode at batch 1 (split KV), a
    chain verify, a tree and a 512-token chunk; every key outside the window is poisoned."""
    shapes = {
        "decode": (1, 1, causal_mask(1, 1)),
        "chain": (4, 5, causal_mask(4, 5)),
        "tree": (4, 8, kc.tree_mask(4, 8, 8, seed=1)),
        "chunk": (2, 512, causal_mask(2, 512)),
    }
    batch, q, mask = shapes[call]
    prefix = [4096 - 301 * b for b in range(batch)]
    inputs = make_inputs(prefix_lens=prefix, q_lens=[q] * batch, new_mask=mask, window=window)
    check(inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunk(dtype):
    """A causal 512-token chunk after a cached prefix, and a first chunk, one padded short."""
    inputs = make_inputs(prefix_lens=[1000, 0], q_lens=[512, 300], new_mask=causal_mask(2, 512))
    check(inputs, dtype)


#: DeepSeek-V2-Lite's latent attention, absorbed: 16 query heads on one cache "head" of the
#: 512-value latent and the 64-value rotary key, the latent as the values. MLA layers run the
#: latent kernel (test_kernel_mla_gpu.py); the grouped-query op still accepts such calls.
MLA_LITE = {"heads": 16, "kv_heads": 1, "head_dim": 576, "latent_dim": 512, "page_size": 16}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch", "q"), [(1, 1), (32, 1), (4, 8)])
def test_latent_attention(batch, q, dtype):
    """Decode (batch 1 splits KV) and a chain verify over a latent cache."""
    prefix = [2048 - 37 * b for b in range(batch)]
    mask = causal_mask(batch, q)
    check(make_inputs(prefix_lens=prefix, q_lens=[q] * batch, new_mask=mask, **MLA_LITE), dtype)


@pytest.mark.parametrize("num_splits", [2, 7, 64])
def test_forced_splits(num_splits):
    """Split-KV with more splits than key blocks, so some splits have nothing to do."""
    inputs = make_inputs(
        prefix_lens=[300, 5, 0],
        q_lens=[3, 3, 2],
        new_mask=kc.tree_mask(3, 3, 5, seed=1),
        heads=8,
        kv_heads=2,
    )
    check(inputs, torch.bfloat16, num_splits)


def test_cuda_graph_replay_reads_new_lengths():
    """Launch parameters depend on shapes only: a captured call follows new prefix lengths."""
    inputs = make_inputs(prefix_lens=[2000, 900], q_lens=[1, 1], new_mask=causal_mask(2, 1))
    args = kc.kernel_args(inputs)
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
    )
    args = kc.kernel_args(inputs)
    torch.testing.assert_close(
        kernels.paged_attention(**args), paged_attention(**args), rtol=1e-4, atol=1e-4
    )


@st.composite
def chains(draw: st.DrawFn) -> dict:
    """Requests with a chain of ``t`` new tokens after prefixes that cross key tiles and split
    chunks, the K/V of every token already in the pool, in ``dtype``."""
    batch, t = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    kv_heads, group = draw(st.sampled_from([(8, 4), (2, 4), (1, 8)]))
    prefix_lens = draw(st.lists(st.integers(0, 2000), min_size=batch, max_size=batch))
    page_size = draw(st.sampled_from([1, 16]))
    # One page-table width for every draw, as an engine's is fixed by its context: the split
    # rule then sees one capacity, and far fewer kernel variants are compiled.
    width = -(-(2000 + 8) // page_size) + 1
    inputs = make_inputs(
        prefix_lens=prefix_lens,
        q_lens=[t] * batch,
        new_mask=causal_mask(batch, t),
        spare_pages=width - max(1, *kc.pages_needed(prefix_lens, t, page_size)),
        heads=kv_heads * group,
        kv_heads=kv_heads,
        page_size=page_size,
        seed=draw(st.integers(0, 2**16)),
        window=draw(st.sampled_from([0, 0, 64, 700])),
    )
    dtype = draw(st.sampled_from(DTYPES))
    for name in ("q", "k_cache", "v_cache"):
        inputs[name] = inputs[name].to(dtype)
    return {**kc.kernel_args(inputs), "num_splits": draw(st.sampled_from([None, 1, 3]))}


# Each drawn chain compiles its own kernel variants (tens of seconds each on the H200): 30
# draws did not finish in 130 s.
@settings(max_examples=12)
@given(chains())
def test_chain_verify_equals_its_decode_steps_bit_for_bit(chain):
    """A verify forward over a chain gives each token exactly the bits its own decode step
    gives, whatever the prefix lengths, page size and split count: greedy speculative decoding
    in bfloat16 then emits plain decoding's tokens. (Triton's interpreter cannot show this on
    the CPU: numpy's matmul rounds a row differently by its place in the tile.)"""
    kc.assert_verify_equals_decode_steps(paged_attention_triton, chain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_attention_sinks_decode_and_chain(dtype, num_splits):
    """gpt-oss's attention sinks (64 heads of 64 over 8 KV heads, a 128-key window) in a
    decode step and a 5-token chain past long prefixes, split and not."""
    inputs = make_inputs(
        prefix_lens=[700, 90],
        q_lens=[1, 5],
        new_mask=causal_mask(2, 5),
        heads=64,
        kv_heads=8,
        head_dim=64,
        window=128,
        sinks=True,
    )
    check(inputs, dtype, num_splits)
