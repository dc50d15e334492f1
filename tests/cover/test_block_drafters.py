"""DFLASH and DSPARK: exact acceptance on mock drafts, greedy equality with plain decoding over
block sizes, batches and ragged verify lengths, the draft cache of injected context, and the
verify-budget scheduler (top survivals, the auto budget, non-anticipation)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_config
from heads import agreeing_dspark
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import max_new_tokens, page_sizes, prefill_budgets, prompt_batches
from test_eagle import TARGET, VOCAB, NextTokenModel, plain_greedy

from speculum.models.block_draft import BlockDraftConfig, random_block_draft
from speculum.pipelines import dflash
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.spec import block as spec_block
from speculum.spec.paged import extend_batch
from speculum.state import PagedKV
from speculum.state.block import BlockConfig
from speculum.state.kv import KVPool
from speculum.state.record import replace

# ------------------------------------------------------------------------------ mock drafts


class CopyingBlockHead(torch.nn.Module):
    """A hand-computable block draft for :class:`NextTokenModel` targets (token ``t`` is
    followed by ``t + shift``): slot ``j`` of a block rooted at ``r`` predicts ``r + shift * (j
    + offset)``, i.e. the target's own continuation when ``offset`` fits the algorithm's slot
    convention (DFLASH 0, DSPARK 1). The DSPARK flavour draws sequentially, its Markov step
    adding a smaller vote for ``previous + shift``."""

    capture_layers = ()

    def __init__(self, algorithm: str, block_size: int, shift: int, offset: int) -> None:
        super().__init__()
        layer = tiny_config(vocab_size=VOCAB)
        self.config = BlockDraftConfig(
            algorithm=algorithm,
            layer=layer,
            target_hidden_size=layer.hidden_size,
            target_num_layers=layer.num_layers,
            target_layers=(0,),
            block_size=block_size,
            mask_token_id=0,
            markov_rank=1 if algorithm == "dspark" else 0,
        )
        self.shift, self.offset = shift, offset
        self.draft_vocab_size = VOCAB
        if algorithm == "dspark":
            self.step_logits = self._step_logits

    def new_pool(self, num_pages: int, page_size: int) -> KVPool:
        return KVPool.allocate(
            num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=1
        )

    def write_context(self, batch, pool, captured) -> None:
        return None

    def forward(self, batch, pool):
        slots = torch.arange(batch.input_ids.shape[1])
        tokens = batch.input_ids[:, :1] + self.shift * (slots + self.offset)
        return torch.nn.functional.one_hot(tokens % VOCAB, VOCAB).float()

    def logits(self, hidden):
        return 8.0 * hidden

    def initial_state(self, hidden):
        return hidden.new_zeros(hidden.shape[0], 1)

    def _step_logits(self, base, previous, hidden, state):
        # The Markov vote for previous + shift is outweighed by the block's own logits.
        nxt = torch.nn.functional.one_hot((previous + self.shift) % VOCAB, VOCAB).float()
        return base + 4.0 * nxt, state


def mock_engine(algorithm: str, block_size: int, draft_shift: int, **spec):
    target = NextTokenModel(tiny_config(vocab_size=VOCAB), shift=1)
    offset = 0 if algorithm == "dflash" else 1
    draft = CopyingBlockHead(algorithm, block_size, draft_shift, offset)
    return engine_from_model(
        target,
        algorithm=algorithm,
        draft=draft,
        spec=SpecOptions(**spec),
        page_size=4,
        max_context=64,
    )


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
@pytest.mark.parametrize("block_size", [2, 5])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_copying_the_target_accepts_the_whole_block(algorithm, block_size, temperature):
    engine = mock_engine(algorithm, block_size, 1, sample_drafts=temperature > 0)
    drafts = block_size - 1 if algorithm == "dflash" else block_size
    (result,) = generate(
        [[3]], engine=engine, max_new_tokens=1 + 3 * (drafts + 1), temperature=temperature
    )
    assert list(result.token_ids) == [(4 + i) % VOCAB for i in range(len(result.token_ids))]
    if temperature == 0.0:
        assert result.stats["accept_length_histogram"][-1] == 3
        assert result.stats["accept_length_mean"] == drafts + 1


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_a_draft_one_slot_off_accepts_nothing(algorithm):
    """A draft reading its slots with the other convention (DSPARK's slot k = anchor + k + 1 vs
    DFLASH's anchor + k) is one token off everywhere: only bonus tokens are emitted."""
    engine = mock_engine(algorithm, 4, 1)
    engine.resources.draft.offset = 1 - engine.resources.draft.offset
    (result,) = generate([[3]], engine=engine, max_new_tokens=9)
    assert list(result.token_ids) == [(4 + i) % VOCAB for i in range(9)]
    assert result.stats["accept_length_mean"] == 1.0


def test_a_fixed_budget_verifies_that_many_tokens_over_the_batch():
    """Two requests, a budget of 3 draft tokens per round: their survivals are equal, so ties
    go to the earlier position, then the earlier row: row 0 verifies 2, row 1 verifies 1. Once
    row 0 has finished, row 1 alone gets all 3."""
    engine = mock_engine("dflash", 5, 1, verify_budget=3)
    results = generate([[3], [9]], engine=engine, max_new_tokens=1 + 2 * 3)
    histograms = [r.stats["accept_length_histogram"] for r in results]
    assert histograms == [[0, 0, 0, 2], [0, 0, 2, 0, 1]]
    assert [list(r.token_ids) for r in results] == [
        [(s + 1 + i) % VOCAB for i in range(7)] for s in (3, 9)
    ]


def test_block_heads_refuse_the_other_pipeline():
    head = random_block_draft(TARGET, "dspark", block_size=3)
    engine = engine_from_model(TARGET, algorithm="dflash", draft=head, max_context=48)
    with pytest.raises(ValueError, match="--algorithm dspark"):
        generate([[1, 2]], engine=engine, max_new_tokens=2)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"block_size": 1}, "block_size"),
        ({"block_size": 4, "budget": "some"}, "verify budget"),
        ({"block_size": 4, "budget": -1}, "verify budget"),
        ({"block_size": 4, "budget": "auto"}, "cost table"),
        ({"block_size": 4, "budget": "auto", "cost_table": ((4, 1.0), (2, 2.0))}, "increasing"),
        ({"block_size": 4, "min_verify": -1}, "min_verify"),
    ],
)
def test_impossible_rounds_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        dflash.pipeline(**options)


# --------------------------------------------------------------------------- real drafts


HEADS = {
    "dflash": random_block_draft(TARGET, "dflash", seed=1, std=0.3, block_size=6, num_layers=2),
    "dspark": random_block_draft(TARGET, "dspark", seed=2, std=0.3, block_size=6, num_layers=1),
    "dspark-agree": agreeing_dspark(TARGET, block_size=6),
}


def test_an_agreeing_dspark_head_accepts_deep():
    """The greedy-equality property below is only strong if rounds accept deep paths."""
    engine = engine_from_model(
        TARGET, algorithm="dspark", draft=HEADS["dspark-agree"], page_size=4, max_context=64
    )
    results = generate([[1, 2, 3], [9, 9, 9, 1]], engine=engine, max_new_tokens=40)
    assert all(r.stats["accept_length_mean"] > 1.8 for r in results)


budgets = st.one_of(
    st.just("all"),
    st.integers(0, 40),
    st.tuples(st.floats(0.1, 4.0), st.floats(0.0, 0.5)).map(
        lambda ab: ("auto", ((1, ab[0]), (64, ab[0] + 63 * ab[1] + 1e-3)))
    ),
)


@settings(max_examples=30)
@given(
    name=st.sampled_from(list(HEADS)),
    block_size=st.integers(1, 6),
    budget=budgets,
    min_verify=st.integers(0, 3),
    sample_drafts=st.booleans(),
    prompts=prompt_batches(VOCAB, max_batch=6),
    max_new_tokens=max_new_tokens,
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
)
def test_greedy_block_decoding_equals_plain(
    name, block_size, budget, min_verify, sample_drafts, prompts, max_new_tokens, page_size,
    prefill_budget,
):  # fmt: skip
    """Token for token, for both drafters, every block size (run smaller or larger than the
    head was built for), batch, page size, chunking, and ragged verify lengths from fixed and
    cost-table budgets; sampled drafting of greedy requests is argmax drafting."""
    algorithm = name.split("-")[0]
    block_size = max(block_size, 2) if algorithm == "dflash" else block_size
    verify = budget if not isinstance(budget, tuple) else budget[0]
    spec = SpecOptions(
        block_size=block_size,
        verify_budget=verify,
        cost_table=budget[1] if isinstance(budget, tuple) else None,
        min_verify=min_verify,
        sample_drafts=sample_drafts,
    )
    limits = {"page_size": page_size, "max_context": 48, "prefill_budget": prefill_budget}
    engine = engine_from_model(TARGET, algorithm=algorithm, draft=HEADS[name], spec=spec, **limits)
    results = generate(prompts, engine=engine, max_new_tokens=max_new_tokens)
    assert [r.token_ids for r in results] == plain_greedy(prompts, max_new_tokens, **limits)


@pytest.mark.parametrize("name", ["dflash", "dspark-agree"])
def test_the_draft_cache_holds_the_context_a_fresh_prefill_writes(name):
    """After rounds of verify, accept and context writes, the draft cache's entries of every
    committed token equal those a fresh prefill of the committed tokens writes: it grows by
    exactly the accepted tokens, at their positions."""
    head = HEADS[name]

    def engine():
        return engine_from_model(
            TARGET, algorithm=name.split("-")[0], draft=head, page_size=4, max_context=48
        )

    spec = engine()
    state, _ = scheduler.add_request(
        spec, scheduler.new_state(spec), [5, 1, 12, 3], max_new_tokens=30
    )
    for _ in range(6):
        state, _ = scheduler.step(spec, state)
    (request,) = state.running
    kv = state.batch.kv
    committed = int(kv.seq_lens[0])
    assert committed == len(request.prompt) + len(request.output) - 1

    fresh = engine()
    replay, _ = scheduler.add_request(
        fresh, scheduler.new_state(fresh), [*request.prompt, *request.output[:-1]]
    )
    replay, _ = scheduler.step(fresh, replay)

    def entries(engine, kv):
        pool = engine.resources.draft_pool
        pages = kv.page_table[0, : math.ceil(committed / 4)]
        return [cache[:, pages].flatten(1, 2)[:, :committed] for cache in (pool.k, pool.v)]

    for ours, theirs in zip(entries(spec, kv), entries(fresh, replay.batch.kv)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_the_block_sees_every_context_entry_and_the_whole_block():
    """Bidirectional attention inside the block: a token at the last slot changes the first
    slot's output; and every slot reads the injected context."""
    head = HEADS["dflash"]
    pool = head.new_pool(8, 4)
    table = torch.tensor([[1, 2, 3, 4]])
    kv = PagedKV(page_table=table, seq_lens=torch.tensor([5]), page_size=4)
    empty = PagedKV(page_table=table, seq_lens=torch.tensor([0]), page_size=4)
    context = extend_batch(empty, torch.tensor([[1, 4, 2, 7, 3]]), torch.tensor([5]))
    _, captured = TARGET(context, TARGET.new_pool(8, 4), head.capture_layers)
    head.write_context(context, pool, captured)
    batch = spec_block.block_batch(kv, torch.tensor([6]), 4, head.config.mask_token_id)
    first = head(batch, pool)
    last_slot = batch.input_ids.clone()
    last_slot[0, 3] = 9
    assert (head(replace(batch, input_ids=last_slot), pool)[0, 0] - first[0, 0]).abs().max() > 1e-4
    head.write_context(context, pool, tuple(c.flip(1) for c in captured))
    assert (head(batch, pool) - first).abs().amax(-1).min() > 1e-4


# ---------------------------------------------------------------------------- the scheduler


def survivals(batch: int, width: int):
    confidence = st.lists(
        st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]), min_size=width, max_size=width),
        min_size=batch,
        max_size=batch,
    )
    return confidence.map(lambda c: spec_block.survival(torch.tensor(c)))


@settings(max_examples=60)
@given(
    data=st.data(), batch=st.integers(1, 5), width=st.integers(1, 6), min_verify=st.integers(0, 7)
)
def test_verify_lens_are_the_top_survivals_and_decided_before_the_tokens(
    data, batch, width, min_verify
):
    """The verified set is a prefix of every row, holds the ``budget`` largest survivals, and
    whether position ``k`` is verified does not change when anything at later positions of its
    row changes (those depend on token ``k``; the decision may not)."""
    current = data.draw(survivals(batch, width))
    budget = data.draw(st.integers(0, batch * width))
    lens = spec_block.select_verify_lens(current, torch.tensor(budget), min_verify)
    chosen = (torch.arange(width)[None, :] < lens[:, None]).float()
    taken = int(chosen.sum())
    assert int(lens.min()) >= min(min_verify, width) and int(lens.max()) <= width
    if min_verify == 0:
        assert taken == budget
        left = current[chosen == 0]
        if left.numel() and chosen.sum() > 0:
            assert float(current[chosen == 1].min()) >= float(left.max())
    row, k = data.draw(st.integers(0, batch - 1)), data.draw(st.integers(0, width - 1))
    changed = current.clone()
    later = data.draw(st.floats(0.0, 1.0))
    changed[row, k + 1 :] = torch.minimum(changed[row, k + 1 :], torch.tensor(later))
    again = spec_block.select_verify_lens(changed, torch.tensor(budget), min_verify)
    assert bool(lens[row] > k) == bool(again[row] > k)


@settings(max_examples=40)
@given(data=st.data(), batch=st.integers(1, 4), width=st.integers(1, 5))
def test_the_auto_budget_maximises_the_expected_rate(data, batch, width):
    previous = data.draw(survivals(batch, width))
    fixed = data.draw(st.floats(0.1, 5.0))
    per_token = data.draw(st.floats(0.0, 1.0))
    table = ((1, fixed + per_token), (8, fixed + 8 * per_token + 1e-6))
    config = dflash.round_config(
        block_size=width + 1, first_slot=1, budget="auto", cost_table=table
    )
    chosen = int(spec_block.choose_budget(previous, config))
    ordered = sorted(previous.flatten().tolist(), reverse=True)

    def rate(t: int) -> float:
        seconds = spec_block.round_seconds(torch.tensor(batch + t), config)
        return (batch + sum(ordered[:t])) / float(seconds)

    best = max(rate(t) for t in range(batch * width + 1))
    assert rate(chosen) == pytest.approx(best, rel=1e-9)
    assert all(rate(t) < best * (1 - 1e-9) for t in range(chosen))


def test_the_cost_table_is_linear_between_and_beyond_its_points():
    config = BlockConfig(
        block_size=3, num_drafts=2, first_slot=1, budget="auto", cost_tokens=(2, 4, 8),
        cost_seconds=(1.0, 2.0, 2.0),
    )  # fmt: skip
    got = spec_block.round_seconds(torch.tensor([0, 2, 3, 4, 6, 8, 12]), config)
    assert got.tolist() == [0.0, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize("name", ["dflash", "dspark-agree"])
def test_snapshot_restore_replays_sampled_block_decoding(name):
    engine = engine_from_model(
        TARGET,
        algorithm=name.split("-")[0],
        draft=HEADS[name],
        spec=SpecOptions(sample_drafts=True, verify_budget=5),
        page_size=4,
        max_context=48,
    )
    sampling = scheduler.Sampling(temperature=1.0, top_p=0.9, seed=77)
    state = scheduler.new_state(engine)
    for prompt in ([4, 2, 8], [1, 1]):
        state, _ = scheduler.add_request(
            engine, state, prompt, sampling=sampling, max_new_tokens=20
        )
    for _ in range(3):
        state, _ = scheduler.step(engine, state)
    snap = scheduler.take_snapshot(engine, state)
    _, finished = run_to_completion(engine, state)
    first = {rid: r.output for rid, r in finished.items()}
    _, finished = run_to_completion(engine, scheduler.restore(engine, snap))
    assert {rid: r.output for rid, r in finished.items()} == first


class PackedForwards(torch.nn.Module):
    """The target, counting the packed forwards it runs (ragged verify's)."""

    def __init__(self, target) -> None:
        super().__init__()
        self.target, self.config, self.packed = target, target.config, 0

    def new_pool(self, *args, **kwargs):
        return self.target.new_pool(*args, **kwargs)

    def forward(self, batch, pool, capture_layers=()):
        self.packed += batch.packed
        return self.target(batch, pool, capture_layers)

    def logits(self, hidden):
        return self.target.logits(hidden)


@pytest.mark.parametrize("packed_verify", [True, False])
@pytest.mark.parametrize(
    "budget",
    [
        {"verify_budget": 5, "min_verify": 1},
        # Seconds growing as fast as the tokens: every auto round verifies its roots alone.
        {"verify_budget": "auto", "cost_table": ((1, 1.0), (64, 64.0))},
    ],
)
def test_dspark_verifying_packed_equals_plain(budget, packed_verify):
    """A fixed budget below the batch's draft tokens, or an ``auto`` budget read on the host
    below them, verifies packed (only the verified tokens forwarded) by default, padded with
    ``packed_verify=False``; both decode plain's tokens."""
    prompts = [[1, 2, 3], [9, 9, 9, 1], [4], [7, 7]]
    target = PackedForwards(TARGET)
    spec = SpecOptions(**budget, packed_verify=packed_verify)
    engine = engine_from_model(
        target, algorithm="dspark", draft=HEADS["dspark-agree"], spec=spec, page_size=4,
        max_context=64,
    )  # fmt: skip
    results = generate(prompts, engine=engine, max_new_tokens=20)
    assert [r.token_ids for r in results] == plain_greedy(prompts, 20, page_size=4, max_context=64)
    assert (target.packed > 0) == packed_verify


@settings(max_examples=12)
@given(
    name=st.sampled_from(list(HEADS)),
    block_size=st.integers(2, 6),
    table=st.tuples(st.floats(0.1, 4.0), st.floats(0.0, 1.0)),
    min_verify=st.integers(0, 2),
    temperature=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 2**16),
    prompts=prompt_batches(VOCAB, max_batch=4),
)
def test_the_auto_budget_verifying_packed_equals_padded(
    name, block_size, table, min_verify, temperature, seed, prompts
):
    """The ``auto`` budget, read on the host and verified packed over the next power of two,
    emits exactly the tokens of the padded verify whose budget the device chooses: greedy
    and seeded sampling, both drafters, any cost table (its slope decides how many tokens a
    round verifies); greedy equals plain decoding."""
    algorithm = name.split("-")[0]
    cost = ((1, table[0]), (64, table[0] + 63 * table[1] + 1e-3))
    limits = {"page_size": 4, "max_context": 48}

    def tokens(packed_verify: bool) -> list[list[int]]:
        spec = SpecOptions(
            block_size=block_size, verify_budget="auto", cost_table=cost, min_verify=min_verify,
            sample_drafts=temperature > 0, packed_verify=packed_verify,
        )  # fmt: skip
        engine = engine_from_model(
            TARGET, algorithm=algorithm, draft=HEADS[name], spec=spec, **limits
        )
        results = generate(
            prompts, engine=engine, max_new_tokens=12, temperature=temperature, seed=seed
        )
        return [r.token_ids for r in results]

    packed = tokens(packed_verify=True)
    assert packed == tokens(packed_verify=False)
    if temperature == 0:
        assert packed == plain_greedy(prompts, 12, **limits)
