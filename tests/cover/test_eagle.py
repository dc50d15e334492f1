"""EAGLE pipelines: greedy equality with plain decoding, exact acceptance on mock models, commit."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from heads import agreeing_head, markov_target
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    max_new_tokens,
    page_sizes,
    prefill_budgets,
    prompt_batches,
    stop_token_sets,
)

from speculum.models.draft import random_draft
from speculum.models.draft_loading import load_draft, save_random_draft
from speculum.pipelines import eagle
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.spec import draft as spec_draft
from speculum.spec.paged import extend_batch
from speculum.state import PagedKV
from speculum.state.kv import KVPool

VOCAB = 16


class NextTokenModel(torch.nn.Module):
    """A hand-computable model: whatever the context, token ``t`` is followed by ``t + shift``.

    Serves as a mock target (``forward(batch, pool, capture)``) and as a mock draft head
    (``forward(batch, pool, hidden)``); it writes nothing to its pool, so rounds of it check the
    pipeline's bookkeeping, not attention.
    """

    def __init__(self, config, shift: int) -> None:
        super().__init__()
        self.config = config
        self.shift = shift
        self.capture_layers = ()
        self.ahead = 0
        self.draft_vocab_size = config.vocab_size

    def new_pool(self, num_pages: int, page_size: int) -> KVPool:
        return KVPool.allocate(
            num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=1
        )

    def target_features(self, final_hidden, captured):
        return final_hidden

    def forward(self, batch, pool, extra=()):
        hidden = torch.nn.functional.one_hot(batch.input_ids, self.config.vocab_size).float()
        return hidden if isinstance(extra, torch.Tensor) else (hidden, ())

    def logits(self, hidden):
        # Runner-up choices t + shift + 1 and + 2 give top-k trees distinct, predictable siblings.
        return sum(w * hidden.roll(self.shift + i, dims=-1) for i, w in enumerate((8.0, 2.0, 1.0)))


def mock_engine(draft_shift: int, **spec):
    config = tiny_config(vocab_size=VOCAB)
    target = NextTokenModel(config, shift=1)
    draft = NextTokenModel(config, shift=draft_shift)
    return engine_from_model(
        target,
        algorithm="eagle",
        draft=draft,
        spec=SpecOptions(**spec),
        page_size=4,
        max_context=64,
    )


@pytest.mark.parametrize(
    ("num_steps", "topk", "num_draft_tokens"),
    [(1, 1, None), (3, 1, None), (5, 1, None), (3, 2, 6), (4, 3, 10)],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_agreeing_draft_is_accepted_to_full_depth(
    num_steps, topk, num_draft_tokens, temperature
):
    engine = mock_engine(1, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens)
    (result,) = generate(
        [[3]], engine=engine, max_new_tokens=1 + 4 * (num_steps + 1), temperature=temperature
    )
    # A temperature-1 target is still near one-hot (logit gap 8), so sampled rounds agree too
    # with overwhelming probability; the tokens are forced either way.
    assert list(result.token_ids) == [(4 + i) % VOCAB for i in range(len(result.token_ids))]
    if temperature == 0.0:
        assert result.stats["accept_length_histogram"][-1] == 4
        assert result.stats["accept_length_mean"] == num_steps + 1


@pytest.mark.parametrize(("num_steps", "topk", "num_draft_tokens"), [(3, 1, None), (3, 2, 5)])
def test_a_disagreeing_draft_emits_only_bonus_tokens(num_steps, topk, num_draft_tokens):
    engine = mock_engine(3, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens)
    (result,) = generate([[3]], engine=engine, max_new_tokens=9)
    assert list(result.token_ids) == [(4 + i) % VOCAB for i in range(9)]
    assert result.stats["accept_length_mean"] == 1.0
    assert result.stats["accept_rate_per_position"] == []


def test_stop_tokens_cut_a_round_short():
    engine = mock_engine(1, num_steps=5)
    (result,) = generate([[3]], engine=engine, max_new_tokens=30, stop_token_ids=(7,))
    assert list(result.token_ids) == [4, 5, 6, 7] and result.finish_reason == "stop"
    (result,) = generate([[3]], engine=engine, max_new_tokens=8)
    assert len(result.token_ids) == 8 and result.finish_reason == "length"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"num_steps": 0}, "num_steps"),
        ({"topk": VOCAB + 1, "num_draft_tokens": 8}, "topk"),
        ({"num_steps": 3, "topk": 1, "num_draft_tokens": 6}, "num_draft_tokens"),
        ({"num_steps": 2, "topk": 2, "num_draft_tokens": 9}, "num_draft_tokens"),
        ({"num_steps": 2, "topk": 2}, "num_draft_tokens"),
    ],
)
def test_impossible_round_shapes_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        mock_engine(1, **spec)


TARGET = markov_target(VOCAB)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """Agreeing EAGLE-1 and MTP heads, and a random EAGLE-3 head saved and loaded back."""
    path = save_random_draft(TARGET, "eagle3", tmp_path_factory.mktemp("eagle3"), seed=11, std=0.3)
    return {
        "eagle": agreeing_head(TARGET, "eagle"),
        "mtp": agreeing_head(TARGET, "mtp"),
        "eagle3": load_draft(path, TARGET, "eagle3"),
    }


def test_agreeing_heads_are_accepted_several_tokens_deep(heads):
    """The greedy-equality property below is only strong if rounds accept deep paths."""
    for algorithm in ("eagle", "mtp"):
        engine = engine_from_model(
            TARGET,
            algorithm=algorithm,
            draft=heads[algorithm],
            spec=SpecOptions(num_steps=4, topk=2, num_draft_tokens=8),
            page_size=4,
            max_context=64,
        )
        results = generate([[1, 2, 3], [9, 9, 9, 1]], engine=engine, max_new_tokens=40)
        assert all(r.stats["accept_length_mean"] > 2.0 for r in results)


def plain_greedy(prompts, max_new_tokens, stop_token_ids=(), **limits):
    engine = engine_from_model(TARGET, **limits)
    results = generate(
        prompts, engine=engine, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
    )
    return [r.token_ids for r in results]


round_shapes = st.integers(1, 6).flatmap(
    lambda steps: st.integers(1, 4).flatmap(
        lambda k: st.tuples(
            st.just(steps),
            st.just(k),
            st.just(steps + 1) if k == 1 else st.integers(2, min(12, 1 + k + (steps - 1) * k * k)),
        )
    )
)


@settings(max_examples=40)
@given(
    algorithm=st.sampled_from(["eagle", "eagle3", "mtp"]),
    shape=round_shapes,
    prompts=prompt_batches(VOCAB),
    max_new_tokens=max_new_tokens,
    stop_token_ids=stop_token_sets(VOCAB),
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
)
def test_greedy_speculative_decoding_equals_plain(
    heads, algorithm, shape, prompts, max_new_tokens, stop_token_ids, page_size, prefill_budget
):
    """Token for token, for every head, round shape, batch, page size, chunking, and stop
    tokens or token limits that fire in the middle of a round."""
    num_steps, topk, num_draft_tokens = shape
    limits = {"page_size": page_size, "max_context": 48, "prefill_budget": prefill_budget}
    engine = engine_from_model(
        TARGET,
        algorithm=algorithm,
        draft=heads[algorithm],
        spec=SpecOptions(num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens),
        **limits,
    )
    results = generate(
        prompts, engine=engine, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
    )
    expected = plain_greedy(prompts, max_new_tokens, stop_token_ids, **limits)
    assert [r.token_ids for r in results] == expected


def test_commit_leaves_the_target_cache_as_plain_prefill_would(heads):
    """After several rounds, the target K/V of every committed token equals a fresh prefill's."""
    engine = engine_from_model(
        TARGET,
        algorithm="eagle",
        draft=heads["eagle"],
        spec=SpecOptions(num_steps=4, topk=3, num_draft_tokens=9),
        page_size=4,
        max_context=48,
    )
    prompt = [1, 5, 9, 2, 7]
    state, rid = scheduler.add_request(
        engine, scheduler.new_state(engine), prompt, max_new_tokens=30
    )
    for _ in range(6):
        state, _ = scheduler.step(engine, state)
    (request,) = state.running
    kv = state.batch.kv
    committed = int(kv.seq_lens[0])
    tokens = (list(request.prompt) + list(request.output))[:committed]
    assert committed == len(request.prompt) + len(request.output) - 1
    assert (
        sum(request.round_lengths) > 0
        and max(k for k, n in enumerate(request.round_lengths) if n) > 1
    ), "the test needs rounds that accepted draft tokens"

    pool = TARGET.new_pool(engine.config.num_pages, 4)
    fresh = PagedKV(
        page_table=kv.page_table, seq_lens=torch.zeros(1, dtype=torch.int64), page_size=4
    )
    TARGET(extend_batch(fresh, torch.tensor([tokens]), torch.tensor([committed])), pool)
    pages = kv.page_table[0, : (committed + 3) // 4]
    ours = engine.resources.target_pool.k[:, pages].flatten(1, 2)[:, :committed]
    expected = pool.k[:, pages].flatten(1, 2)[:, :committed]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_snapshot_restore_replays_speculative_sampling(heads):
    engine = engine_from_model(
        TARGET,
        algorithm="eagle3",
        draft=heads["eagle3"],
        spec=SpecOptions(num_steps=3, topk=2, num_draft_tokens=6),
        page_size=4,
        max_context=48,
    )
    sampling = scheduler.Sampling(temperature=1.0, top_p=0.9, seed=77)
    state, rid = scheduler.add_request(
        engine, scheduler.new_state(engine), [4, 2, 8], sampling=sampling, max_new_tokens=20
    )
    for _ in range(3):
        state, _ = scheduler.step(engine, state)
    snap = scheduler.take_snapshot(engine, state)
    _, finished = run_to_completion(engine, state)
    first = finished[rid].output
    _, finished = run_to_completion(engine, scheduler.restore(engine, snap))
    assert finished[rid].output == first


def reference_children(head, pool, kv, hidden, path, topk):
    """The head's top-k after feeding ``path`` one token at a time, from scratch, into a copy
    of its cache: what the multi-step draft must compute for the node at the end of ``path``."""
    pool = KVPool(k=pool.k.clone(), v=pool.v.clone(), page_size=pool.page_size)
    for token in path:
        batch = extend_batch(kv, torch.tensor([[token]]), torch.tensor([1]))
        hidden = head(batch, pool, hidden[:, None])[:, 0]
        kv = PagedKV(page_table=kv.page_table, seq_lens=kv.seq_lens + 1, page_size=kv.page_size)
    top = torch.softmax(head.logits(hidden), dim=-1).topk(topk, dim=-1)
    return top.values[0], top.indices[0]


@pytest.mark.parametrize(("num_steps", "topk"), [(3, 1), (4, 2), (3, 3)])
def test_multi_step_draft_equals_the_head_run_from_scratch_along_each_path(heads, num_steps, topk):
    """Every expanded node's children are the head's top-k given exactly that node's ancestors
    (tree attention inside the draft sees a node's own path and nothing of its cousins)."""
    head = heads["eagle3"]
    engine = engine_from_model(
        TARGET,
        algorithm="eagle3",
        draft=head,
        spec=SpecOptions(num_steps=num_steps, topk=topk, num_draft_tokens=num_steps + 1),
        page_size=4,
        max_context=48,
    )
    state, _ = scheduler.add_request(
        engine, scheduler.new_state(engine), [3, 14, 15, 9, 2, 6], max_new_tokens=20
    )
    state, _ = scheduler.step(engine, state)  # prefill
    config = eagle.EagleConfig(num_steps=num_steps, topk=topk, num_draft_tokens=num_steps + 1)
    pool = engine.resources.draft_pool
    before = KVPool(k=pool.k.clone(), v=pool.v.clone(), page_size=pool.page_size)
    candidates = spec_draft.draft(engine.resources, state.batch, config)
    tokens, parents = candidates.tokens[0].tolist(), candidates.parents[0].tolist()
    scores = candidates.scores[0]
    expanded = sorted(set(parents) - {-1})
    assert len(expanded) == topk * (num_steps - 1) if topk > 1 else num_steps - 1
    for node in expanded:
        path, at = [], node
        while at >= 0:
            path.insert(0, tokens[at])
            at = parents[at]
        probs, ids = reference_children(
            head, before, state.batch.kv, state.batch.prediction.hidden, path, topk
        )
        children = [i for i, p in enumerate(parents) if p == node]
        assert [tokens[i] for i in children] == ids.tolist()
        torch.testing.assert_close(scores[children], scores[node] * probs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["eagle", "mtp"])
def test_draft_extend_leaves_the_draft_as_a_fresh_prefill_would(heads, algorithm):
    """After rounds of accept + draft-extend, the draft's carried prediction equals the one a
    fresh prefill of the committed tokens produces (so its cache and hidden state are right)."""

    def engine():
        return engine_from_model(
            TARGET,
            algorithm=algorithm,
            draft=heads[algorithm],
            spec=SpecOptions(num_steps=3, topk=2, num_draft_tokens=6),
            page_size=4,
            max_context=48,
        )

    spec = engine()
    state, _ = scheduler.add_request(spec, scheduler.new_state(spec), [5, 1, 12], max_new_tokens=30)
    for _ in range(5):
        state, _ = scheduler.step(spec, state)
    (request,) = state.running
    assert max(k for k, n in enumerate(request.round_lengths) if n) > 1

    fresh = engine()
    committed = [*request.prompt, *request.output[:-1]]
    replay, _ = scheduler.add_request(
        fresh, scheduler.new_state(fresh), committed, max_new_tokens=5
    )
    replay, _ = scheduler.step(fresh, replay)
    ours, theirs = state.batch, replay.batch
    assert torch.equal(ours.root_tokens, theirs.root_tokens)
    assert torch.equal(ours.kv.seq_lens, theirs.kv.seq_lens)
    torch.testing.assert_close(
        ours.prediction.hidden, theirs.prediction.hidden, rtol=1e-4, atol=1e-5
    )
    assert torch.equal(ours.prediction.top_tokens, theirs.prediction.top_tokens)


def test_topk_is_bounded_by_what_a_reduced_vocabulary_draft_can_propose():
    head = random_draft(TARGET, "eagle3", seed=1, draft_vocab_size=4)
    assert head.draft_vocab_size == 4
    with pytest.raises(ValueError, match="topk"):
        engine_from_model(
            TARGET,
            algorithm="eagle3",
            draft=head,
            spec=SpecOptions(num_steps=2, topk=5, num_draft_tokens=6),
        )
