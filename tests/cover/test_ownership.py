"""A scheduler state owns its engine's KV pages: a state whose pages another state has since
rewritten (an earlier ``new_state``, a value older than the last step, one replaced by a
``restore``) is refused; a snapshot is restored only into an engine of its own shape, and a
refused restore changes nothing; a step that fails changes nothing either, so a retry decodes
what an unbroken run decodes."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import started, tiny_config

from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.pipelines.adaptive import AdaptivePolicy
from speculum.runtime import scheduler
from speculum.runtime.engine import NgramOptions, SpecOptions, engine_from_model
from speculum.runtime.generate import run_to_completion
from speculum.state import tree_equal

MODEL = random_model(tiny_config(), seed=0, std=0.3)
HEAD = random_draft(MODEL, "eagle3", seed=11, std=0.3)
LIMITS = {"page_size": 4, "max_context": 40, "num_pages": 24}
REFUSED = "no longer owns the engine's KV pages"
SAMPLED = scheduler.Sampling(temperature=1.0, top_k=8, seed=5)


def make_engine(**changes):
    """A plain engine over the tiny model (``changes``: engine_from_model's arguments)."""
    return engine_from_model(MODEL, **(LIMITS | changes))


def alone(prompt, max_new_tokens=10, sampling=SAMPLED):
    """The tokens ``prompt`` yields on a fresh engine of its own."""
    fresh = make_engine()
    state, rid = scheduler.add_request(
        fresh, scheduler.new_state(fresh), prompt, sampling=sampling, max_new_tokens=max_new_tokens
    )
    return run_to_completion(fresh, state)[1][rid].output


def test_a_new_state_claims_the_engine_and_the_earlier_state_is_refused():
    shared = make_engine()
    first, _ = started(shared, [1, 2, 3], 2, sampling=SAMPLED, max_new_tokens=10)
    second, rid = scheduler.add_request(
        shared, scheduler.new_state(shared), [4, 5, 6], sampling=SAMPLED, max_new_tokens=10
    )
    # The second state hands out the first's pages again: stepping the first would then read
    # the second's K/V.
    with pytest.raises(ValueError, match=REFUSED):
        scheduler.step(shared, first)
    with pytest.raises(ValueError, match=REFUSED):
        scheduler.take_snapshot(shared, first)
    assert run_to_completion(shared, second)[1][rid].output == alone([4, 5, 6])


def test_a_state_older_than_the_last_step_is_refused():
    shared = make_engine()
    state, rid = started(shared, [1, 2, 3], 1, sampling=SAMPLED, max_new_tokens=10)
    newer, _ = scheduler.step(shared, state)
    with pytest.raises(ValueError, match=REFUSED):
        scheduler.step(shared, state)
    assert run_to_completion(shared, newer)[1][rid].output == alone([1, 2, 3])


@pytest.mark.parametrize("stepped", ["before", "added", "cancelled"])
def test_add_request_and_cancel_keep_the_claim(stepped):
    """They do not touch the pool: the state before and after either may step, and once one
    of them has, the others are refused."""
    shared = make_engine()
    before, rid = started(shared, [1, 2, 3], 1, max_new_tokens=10)
    values = {
        "before": before,
        "added": scheduler.add_request(shared, before, [7, 8], max_new_tokens=4)[0],
        "cancelled": scheduler.cancel(shared, before, rid),
    }
    scheduler.step(shared, values.pop(stepped))
    for other in values.values():
        with pytest.raises(ValueError, match=REFUSED):
            scheduler.step(shared, other)


def test_restore_claims_the_engine_for_the_snapshots_state():
    shared = make_engine()
    state, rid = started(shared, [1, 2, 3], 1, sampling=SAMPLED, max_new_tokens=10)
    snap = scheduler.take_snapshot(shared, state)
    later, _ = scheduler.step(shared, state)
    restored = scheduler.restore(shared, snap)
    with pytest.raises(ValueError, match=REFUSED):
        scheduler.step(shared, later)
    assert run_to_completion(shared, restored)[1][rid].output == alone([1, 2, 3])


@pytest.mark.parametrize(
    ("made_with", "changes", "difference"),
    [
        ({}, {"page_size": 8}, "page_size: snapshot 4, engine 8"),
        ({}, {"num_pages": 32}, "num_pages: snapshot 24, engine 32"),
        ({}, {"algorithm": "ngram"}, "pipeline.name: snapshot 'plain', engine 'ngram'"),
        ({}, {"max_context": 32}, "max_context: snapshot 40, engine 32"),
        (
            {"algorithm": "eagle3", "draft": HEAD},
            {"algorithm": "eagle3", "draft": HEAD, "spec": SpecOptions(topk=2, num_draft_tokens=5)},
            "pipeline.decode.config.topk: snapshot 1, engine 2",
        ),
        ({}, {"overlap": True}, "overlap: snapshot False, engine True"),
        # A synchronous engine would never collect the round the snapshot holds in flight.
        ({"overlap": True}, {}, "overlap: snapshot True, engine False"),
        # Its rows carry penalty counts that this engine's rounds would not update.
        ({"penalties": True}, {}, "penalties: snapshot True, engine False"),
    ],
)
def test_a_snapshot_from_an_engine_of_another_shape_is_refused_and_changes_nothing(
    made_with, changes, difference
):
    source = make_engine(**made_with)
    state, _ = started(source, [1, 2, 3], 2, sampling=SAMPLED, max_new_tokens=10)
    snap = scheduler.take_snapshot(source, state)
    other = make_engine(**changes)
    running, rid = started(other, [9, 8, 7, 6], 1, sampling=SAMPLED, max_new_tokens=10)
    pools = [(pool.k.clone(), pool.v.clone()) for pool in other.resources.pools]
    cells = [cell.value for cell in other.resources.cells]
    with pytest.raises(ValueError, match=re.escape(difference)) as refused:
        scheduler.restore(other, snap)
    assert "another shape" in str(refused.value)
    for pool, (k, v) in zip(other.resources.pools, pools):
        assert torch.equal(pool.k, k) and torch.equal(pool.v, v)
    assert all(cell.value is value for cell, value in zip(other.resources.cells, cells))
    # The engine's own state still owns it and decodes what it would have without the attempt.
    fresh = make_engine(**changes)
    again, _ = started(fresh, [9, 8, 7, 6], 1, sampling=SAMPLED, max_new_tokens=10)
    ours = run_to_completion(other, running)[1][rid].output
    assert ours == run_to_completion(fresh, again)[1][rid].output


def ngram_engine():
    # Streams go into the store as soon as they grow by a token: most rounds replace it.
    options = NgramOptions(store_tokens=4096, flush_tokens=1)
    return make_engine(algorithm="ngram", ngram=options, num_pages=None)


def adaptive_engine():
    # Every variant runs in turn, whatever the clock reads: the run's rounds are deterministic.
    policy = AdaptivePolicy(margin=1.0, refresh=0, warmup=0, samples=1)
    spec = SpecOptions(adaptive_steps=(0, 1, 2), adaptive_policy=policy)
    return make_engine(algorithm="eagle3", draft=HEAD, spec=spec, num_pages=None)


PROMPTS = ([1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5])


def run(engine, cell, monkeypatch, fault):
    """Each request's greedy tokens, and how many failed steps had replaced ``cell``'s value
    before their fault. With ``fault``, every step first fails once, at the prefill launch
    that follows its decoding round, and is then retried."""
    state = scheduler.new_state(engine)
    for prompt in PROMPTS:
        state, _ = scheduler.add_request(engine, state, prompt, max_new_tokens=12)
    tokens, replaced = {}, 0
    while not scheduler.is_idle(state):
        before, seen = cell.value, []

        def failing(engine, state, before=before, seen=seen):
            seen.append(cell.value is not before)
            raise RuntimeError("injected fault")

        if fault:
            with monkeypatch.context() as patch:
                patch.setattr(scheduler, "_launch_prefill", failing)
                with pytest.raises(RuntimeError, match="injected fault"):
                    scheduler.step(engine, state)
            assert cell.value is before
            replaced += seen == [True]
        state, outputs = scheduler.step(engine, state)
        for out in outputs:
            tokens[out.rid] = tokens.get(out.rid, ()) + out.new_token_ids
    return tokens, replaced


def test_a_failed_step_leaves_the_ngram_store_as_it_was(monkeypatch):
    """Without the cell put back, the retried round would insert its streams a second time."""
    faulty, clean = ngram_engine(), ngram_engine()
    tokens, replaced = run(faulty, faulty.resources.ngram_store, monkeypatch, fault=True)
    assert replaced >= 3  # the faults came after the round had replaced the store
    assert (tokens, 0) == run(clean, clean.resources.ngram_store, monkeypatch, fault=False)
    assert tree_equal(faulty.resources.ngram_store.value, clean.resources.ngram_store.value)


def test_a_failed_step_leaves_the_adaptive_measurements_as_they_were(monkeypatch):
    faulty, clean = adaptive_engine(), adaptive_engine()
    tokens, replaced = run(faulty, faulty.resources.goodput, monkeypatch, fault=True)
    assert replaced >= 3
    assert (tokens, 0) == run(clean, clean.resources.goodput, monkeypatch, fault=False)
    # Each round was folded in once, and the round-robin choices went on in the same order.
    tables = [e.resources.goodput.value.goodput.table for e in (faulty, clean)]
    assert [[m.rounds for m in row] for row in tables[0]] == [
        [m.rounds for m in row] for row in tables[1]
    ]
