"""The Triton latent-attention (MLA) kernel against its spec twin on a CUDA device, at DeepSeek
sizes: 16 heads (V2-Lite) and 128 heads (V3) over rows of a 512-value latent and a 64-value
rotary key.

As in ``tests/cover/test_kernel_mla.py``: pages scattered at random, every slot no query sees
(and every padded query row) NaN, inf or huge, the output poisoned. float32 runs are compared
elementwise; bfloat16 runs against the float32 reference on upcast inputs, by relative error
``||out - ref|| / ||ref|| < 1e-2``.
"""

from __future__ import annotations

import kernel_cases as kc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernel_attention_gpu import make_inputs as grouped_query_inputs

from speculum.kernels.triton_mla import latent_attention_triton, register
from speculum.spec.attention import latent_attention
from speculum.spec.paged import causal_mask

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]
LATENT, ROPE = 512, 64
#: DeepSeek-V2-Lite's and DeepSeek-V3's query heads.
LITE, V3 = 16, 128


def make_inputs(*, heads: int = LITE, page_size: int = 16, **lengths) -> dict:
    """Float32 CUDA inputs over a latent cache (``test_kernel_attention_gpu.make_inputs``'s:
    pages shuffled, unseen slots and padded query rows garbage); ``lengths``: its
    ``prefix_lens``, ``q_lens``, ``new_mask``, ``spare_pages`` and ``seed``."""
    return grouped_query_inputs(
        heads=heads,
        kv_heads=1,
        head_dim=LATENT + ROPE,
        latent_dim=LATENT,
        page_size=page_size,
        **lengths,
    )


def check(inputs: dict, dtype: torch.dtype, num_splits: int | None = None) -> None:
    """Kernel (in ``dtype``, output poisoned) against the float32 reference."""
    got, want = kc.run_latent(inputs, LATENT, dtype, num_splits)
    assert got.dtype == dtype
    assert not got.isnan().any(), "unwritten or NaN output"
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        error, size = (got.float() - want).norm(), want.norm()
        assert error <= 1e-2 * size, f"relative error {error / size:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch", "heads"), [(1, LITE), (32, LITE), (1, V3), (8, V3)])
def test_decode(batch, heads, dtype):
    """One token per request over prefixes near 4096; batch 1 splits KV. (V3's heads at batch
    8: the reference expands the latent per head, 10 GB at batch 8.)"""
    prefix = [4096 - 37 * b for b in range(batch)]
    mask = causal_mask(batch, 1)
    check(make_inputs(prefix_lens=prefix, q_lens=[1] * batch, new_mask=mask, heads=heads), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [LITE, V3])
@pytest.mark.parametrize(("call", "q", "tail"), [("chain", 4, 4), ("tree", 8, 8), ("step", 4, 12)])
def test_verify(call, q, tail, heads, dtype):
    """A 4-token chain verify, an 8-node tree verify and a later multi-step draft step (tail
    wider than the queries), one request padded short, one with no prefix."""
    mask = causal_mask(4, q) if call == "chain" else kc.tree_mask(4, q, tail, seed=q)
    inputs = make_inputs(
        prefix_lens=[1500, 0, 333, 2048], q_lens=[q, q, q - 3, 1], new_mask=mask, heads=heads
    )
    check(inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunk(dtype):
    """A causal 512-token chunk after a cached prefix, and a first chunk padded short."""
    inputs = make_inputs(prefix_lens=[1000, 0], q_lens=[512, 300], new_mask=causal_mask(2, 512))
    check(inputs, dtype)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 7, 64])
def test_page_sizes_and_splits(page_size, num_splits):
    """Chains over pages of 1, 16 and 64 tokens, with more splits than key tiles (some splits
    have nothing to do)."""
    inputs = make_inputs(
        prefix_lens=[300, 5, 0],
        q_lens=[3, 3, 2],
        new_mask=causal_mask(3, 3),
        page_size=page_size,
    )
    check(inputs, torch.bfloat16, num_splits)


def test_cuda_graph_replay_reads_new_lengths():
    """Launch parameters depend on shapes only: a captured call follows new prefix lengths."""
    inputs = make_inputs(prefix_lens=[2000, 900], q_lens=[1, 1], new_mask=causal_mask(2, 1))
    args = [inputs[k] for k in ("q", "k_cache", "page_table", "prefix_lens", "q_lens")]
    rest = (inputs["new_mask"], inputs["scale"], LATENT)
    latent_attention_triton(*args, *rest)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = latent_attention_triton(*args, *rest)
    inputs["prefix_lens"].copy_(torch.tensor([1200, 500]))  # shorter: every slot stays finite
    graph.replay()
    torch.testing.assert_close(out, latent_attention(*args, *rest), rtol=1e-4, atol=1e-4)


def test_registered_as_the_cuda_kernel_of_the_op():
    from speculum import kernels

    register()
    inputs = make_inputs(prefix_lens=[50, 7], q_lens=[4, 2], new_mask=causal_mask(2, 4))
    args = [inputs[k] for k in ("q", "k_cache", "page_table", "prefix_lens", "q_lens")]
    rest = (inputs["new_mask"], inputs["scale"], LATENT)
    torch.testing.assert_close(
        kernels.latent_attention(*args, *rest),
        latent_attention(*args, *rest),
        rtol=1e-4,
        atol=1e-4,
    )


@st.composite
def chains(draw: st.DrawFn) -> dict:
    """Requests with a chain of ``t`` new tokens after prefixes that cross key tiles and split
    chunks, every token's latent already in the pool, in bfloat16."""
    batch, t = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    prefix_lens = draw(st.lists(st.integers(0, 2000), min_size=batch, max_size=batch))
    page_size = draw(st.sampled_from([1, 16]))
    # One page-table width for every draw, as an engine's is fixed by its context: the split
    # rule then sees one capacity, and fewer kernel variants are compiled.
    width = -(-(2000 + 8) // page_size) + 1
    inputs = make_inputs(
        prefix_lens=prefix_lens,
        q_lens=[t] * batch,
        new_mask=causal_mask(batch, t),
        heads=draw(st.sampled_from([LITE, V3])),
        page_size=page_size,
        spare_pages=width - max(1, *kc.pages_needed(prefix_lens, t, page_size)),
        seed=draw(st.integers(0, 2**16)),
    )
    return {
        "q": inputs["q"].bfloat16(),
        "cache": inputs["k_cache"].bfloat16(),
        "page_table": inputs["page_table"],
        "prefix_lens": inputs["prefix_lens"],
        "q_lens": inputs["q_lens"],
        "new_mask": inputs["new_mask"],
        "scale": inputs["scale"],
        "latent_dim": LATENT,
        "num_splits": draw(st.sampled_from([None, 1, 3])),
    }


@settings(max_examples=12)
@given(chains())
def test_chain_verify_equals_its_decode_steps_bit_for_bit(chain):
    """A verify over a chain gives each token exactly the bits its own decode step gives,
    whatever the prefix lengths, heads, page size and split count: greedy speculative decoding
    in bfloat16 then emits plain decoding's tokens (as the grouped-query kernel's test)."""
    kc.assert_verify_equals_decode_steps(latent_attention_triton, chain)
