"""Ragged verify, packed: a round whose rows verify different numbers of draft tokens runs its
target forward over the verified tokens alone, back to back (``spec.paged.pack_batch``), and
decides exactly what the padded forward decides, writing the same K/V."""

from __future__ import annotations

import attrs
import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.models.config import MLAConfig, MoEConfig
from speculum.models.decoder import dense_batch
from speculum.models.loading import random_model
from speculum.pipelines.dflash import round_config
from speculum.spec.block import budget_bound, verify_capacity
from speculum.spec.paged import extend_batch, pack, pack_batch, packed_rows, unpack
from speculum.spec.tree import chain_tree
from speculum.spec.verify import verify_tree
from speculum.state import PagedKV
from speculum.state.kv import PADDING_PAGE
from speculum.state.record import tree_equal
from speculum.state.sampling import SamplingParams

#: Attention and MLP kinds whose packed forward must equal the padded one: latent attention
#: (values narrower than keys) over mixture-of-experts layers, and a sliding window of 3 keys
#: with attention sinks (gpt-oss's kinds). The plain Llama kind is conftest's ``tiny_model``.
KINDS = {
    "mla-moe": random_model(
        tiny_config(
            num_kv_heads=4,
            mla=MLAConfig(
                q_lora_rank=12,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=8,
                v_head_dim=6,
            ),
            moe=MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=16, norm_topk_prob=True),
        ),
        seed=1,
        std=0.3,
    ),
    "window-sinks": random_model(
        tiny_config(sliding_window=3, attention_sinks=True), seed=2, std=0.3
    ),
}


@st.composite
def rounds(draw: st.DrawFn) -> dict:
    """A chain verify: rows with cached prefixes over random pages, per-row verify lengths,
    and packed capacity between the verified tokens and the padded ``batch * (drafts + 1)``."""
    batch = draw(st.integers(1, 4))
    drafts = draw(st.integers(1, 5))
    lens = draw(st.lists(st.integers(0, drafts), min_size=batch, max_size=batch))
    verified = sum(lens) + batch
    return {
        "page_size": draw(st.sampled_from([1, 2, 4])),
        "prefix_lens": draw(st.lists(st.integers(0, 12), min_size=batch, max_size=batch)),
        "drafts": drafts,
        "verify_lens": lens,
        "capacity": min(batch * (drafts + 1), verified + draw(st.integers(0, 3))),
        "temperature": draw(st.sampled_from([0.0, 1.0])),
        "seed": draw(st.integers(0, 2**16)),
    }


def kv_and_pool(model, case: dict, gen: torch.Generator):
    """Each row's pages, shuffled over a pool whose every slot holds random K/V (the cached
    prefixes, and stale entries past them)."""
    page_size, prefix_lens = case["page_size"], case["prefix_lens"]
    needed = [-(-(n + case["drafts"] + 1) // page_size) for n in prefix_lens]
    width, total = max(needed), sum(needed)
    order = (torch.randperm(total, generator=gen) + 1).tolist()  # page 0 is the padding sink
    table = torch.full((len(needed), width), PADDING_PAGE, dtype=torch.int64)
    for b, count in enumerate(needed):
        table[b, :count] = torch.tensor(order[:count])
        order = order[count:]
    pool = model.new_pool(total + 1, page_size)
    for cache in (pool.k, pool.v):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    kv = PagedKV(page_table=table, seq_lens=torch.tensor(prefix_lens), page_size=page_size)
    return kv, pool


def sampling(batch: int, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=torch.full((batch,), temperature),
        top_k=torch.zeros(batch, dtype=torch.int64),
        top_p=torch.ones(batch),
        min_p=torch.zeros(batch),
        seed=torch.full((batch,), seed, dtype=torch.int64),
        num_logprobs=2,
    )


@pytest.mark.parametrize("kind", ["llama", *KINDS])
@settings(max_examples=25)
@given(case=rounds())
def test_packed_verify_equals_padded_verify(tiny_model, kind, case):
    """Same accepted tokens and paths, the same log-probabilities, final and captured hidden
    states at the verified nodes, and the same pool afterwards (the padding sink aside), over
    random verify lengths, batches, page sizes, greedy and seeded sampling, and attention and
    MLP kinds."""
    model = KINDS.get(kind, tiny_model)
    gen = torch.Generator().manual_seed(case["seed"])
    kv, pool = kv_and_pool(model, case, gen)
    batch, drafts = len(case["prefix_lens"]), case["drafts"]
    vocab = model.config.vocab_size
    tokens = torch.randint(vocab, (batch, drafts + 1), generator=gen)
    tree = chain_tree(tokens[:, 0], tokens[:, 1:])
    lens = torch.tensor(case["verify_lens"])
    params = sampling(batch, case["temperature"], case["seed"])
    pools = [pool, attrs.evolve(pool, k=pool.k.clone(), v=pool.v.clone())]
    padded, packed = (
        verify_tree(
            model,
            p,
            kv,
            tree,
            params,
            max_depth=drafts,
            max_children=1,
            capture_layers=(0,),
            verify_lens=lens,
            capacity=capacity,
        )
        for p, capacity in zip(pools, (None, case["capacity"]))
    )
    assert tree_equal(padded.accepted, packed.accepted)
    for name in ("chosen", "top_ids", "top_logprobs"):
        want, got = getattr(padded.logprobs, name), getattr(packed.logprobs, name)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    real = torch.arange(drafts + 1)[None, :] <= lens[:, None]
    for want, got in zip(
        (padded.final_hidden, *padded.captured), (packed.final_hidden, *packed.captured)
    ):
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
        assert not got[~real].any()  # padding rows are zeros, never computed
    for want, got in zip((pools[0].k, pools[0].v), (pools[1].k, pools[1].v)):
        keep = torch.arange(want.shape[1]) != PADDING_PAGE
        torch.testing.assert_close(got[:, keep], want[:, keep], rtol=1e-5, atol=1e-5)


@settings(max_examples=40)
@given(
    lens=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    spare=st.integers(0, 3),
)
def test_pack_then_unpack_is_the_padded_layout(lens, spare):
    """Packing keeps each row's real entries in order, back to back; unpacking restores them
    and zeros the padding; the spare packed rows hold a padding row of the padded layout."""
    batch, q = len(lens), 4
    q_lens = torch.tensor(lens)
    total = int(q_lens.sum())
    capacity = min(batch * q, max(1, total) + spare)
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    rows = packed_rows(q_starts, q_lens, q, capacity)
    x = torch.arange(1, batch * q + 1).view(batch, q, 1)
    valid = torch.arange(q)[None, :] < q_lens[:, None]
    packed = pack(x, rows)
    assert packed[0, :total, 0].tolist() == x[valid][:, 0].tolist()
    assert (~valid.flatten()[rows[total:]]).all()
    assert torch.equal(unpack(packed, q_starts, q_lens, q), torch.where(valid[..., None], x, 0))


def test_pack_batch_refuses_a_capacity_that_cannot_hold_the_tokens():
    kv = PagedKV(page_table=torch.ones(2, 2, dtype=torch.int64), seq_lens=torch.zeros(2,
        dtype=torch.int64), page_size=4)  # fmt: skip
    batch = extend_batch(kv, torch.ones(2, 3, dtype=torch.int64), torch.tensor([1, 3]))
    for capacity in (0, 7, 3):  # 3: below the 4 real tokens
        with pytest.raises(ValueError, match="capacity"):
            pack_batch(batch, capacity)
    packed, _ = pack_batch(batch, 4)
    assert packed.packed and packed.input_ids.shape == (1, 4)
    with pytest.raises(ValueError, match="already packed"):
        pack_batch(packed, 4)


def test_a_packed_forward_needs_a_pool(tiny_model):
    batch = dense_batch(torch.ones(2, 3, dtype=torch.int64))
    packed, _ = pack_batch(batch, 6)
    with pytest.raises(ValueError, match="packed forward"):
        tiny_model(packed, None)


@pytest.mark.parametrize(
    ("options", "batch", "capacity"),
    [
        ({"budget": 3}, 2, 5),  # 2 roots and 3 draft tokens, below 2 * 5
        ({"budget": 3, "min_verify": 1}, 2, 7),  # and up to one more per row
        ({"budget": 8}, 2, None),  # the bound reaches the padded 10 rows: nothing saved
        ({"budget": "all"}, 2, None),
        ({"budget": 3, "packed_verify": False}, 2, None),
        ({"budget": "auto", "cost_table": ((1, 1.0), (9, 2.0))}, 2, None),
    ],
)
def test_the_packed_capacity_bounds_a_fixed_budget(options, batch, capacity):
    config = round_config(block_size=5, first_slot=1, **options)
    assert verify_capacity(config, batch) == capacity


AUTO = {"budget": "auto", "cost_table": ((1, 1.0), (9, 2.0))}


@pytest.mark.parametrize(
    ("options", "bound", "capacity"),
    [
        (AUTO, 4, 6),  # 2 roots and at most 4 draft tokens, below 2 * 5
        ({**AUTO, "min_verify": 1}, 4, 8),  # and up to one more per row
        (AUTO, 8, None),  # the bound reaches the padded 10 rows
        ({**AUTO, "packed_verify": False}, 4, None),
    ],
)
def test_an_auto_budget_bound_read_on_the_host_sizes_the_packed_verify(options, bound, capacity):
    config = round_config(block_size=5, first_slot=1, **options)
    assert verify_capacity(config, 2, bound) == capacity


def test_budget_bounds_are_the_next_power_of_two():
    assert [budget_bound(n) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [1, 1, 2, 4, 4, 8, 8, 16]
