"""Overlap scheduling: the overlapped and the synchronous scheduler run the same stages and emit
the same tokens, for every pipeline, greedy and sampled, with stop tokens, token and context
limits, admission that waits for pages or batch slots, cancellation and snapshot/restore; a
request that finished runs one extra round inside its own pages; host time is accounted."""

from __future__ import annotations

import json

import pytest
from conftest import ManualClock, tiny_config
from heads import agreeing_head
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant
from strategies import max_new_tokens, page_sizes, prefill_budgets, prompt_batches, stop_token_sets
from test_eagle import TARGET, VOCAB
from test_scheduler_machine import LIMITS, MODEL, SchedulerMachine

from speculum.models.block_draft import random_block_draft
from speculum.models.draft import random_draft
from speculum.models.frozen_kv import random_frozen_kv
from speculum.models.loading import random_model, save_model
from speculum.models.multi_layer_eagle import random_multi_layer
from speculum.models.standalone import StandaloneHead
from speculum.pipelines.adaptive import AdaptivePolicy
from speculum.runtime import cli, scheduler
from speculum.runtime.engine import NgramOptions, SpecOptions, engine_from_model
from speculum.runtime.generate import generate
from speculum.state.host import HostCopy

SMALL = random_model(tiny_config(vocab_size=VOCAB, num_layers=1, hidden_size=16), seed=8, std=0.3)
#: name -> (algorithm, draft, spec options, n-gram options, whether only greedy tokens are
#: reproducible: sampled tokens and the acceptance of rounds then depend on more than the
#: request itself)
PIPELINES = {
    "plain": ("plain", None, {}, None, False),
    "plain 3 steps": ("plain", None, {"decode_steps": 3}, None, False),
    "eagle chain": ("eagle", agreeing_head(TARGET, "eagle"), {"num_steps": 4}, None, False),
    "eagle tree": (
        "eagle",
        agreeing_head(TARGET, "eagle"),
        {"num_steps": 3, "topk": 2, "num_draft_tokens": 6},
        None,
        False,
    ),
    "eagle3 sampled drafts": (
        "eagle3",
        random_draft(TARGET, "eagle3", seed=11, std=0.3),
        {"num_steps": 2, "topk": 2, "sample_drafts": True},
        None,
        False,
    ),
    "mtp": ("mtp", agreeing_head(TARGET, "mtp"), {"num_steps": 3}, None, False),
    "standalone": ("standalone", StandaloneHead(SMALL, VOCAB), {"num_steps": 3}, None, False),
    "frozen_kv_mtp": (
        "frozen_kv_mtp",
        random_frozen_kv(TARGET, seed=4, std=0.3),
        {"num_steps": 3, "topk": 2, "num_draft_tokens": 5},
        None,
        False,
    ),
    "multi_layer_eagle": (
        "multi_layer_eagle",
        random_multi_layer(TARGET, 3, seed=5, std=0.3),
        {"num_steps": 3},
        None,
        False,
    ),
    # Without the shared store an n-gram request's tokens depend on itself alone; with it,
    # the extra round of a finished request inserts tokens the synchronous run never has, so
    # drafts (not greedy tokens) may differ.
    "ngram": ("ngram", None, {"num_draft_tokens": 6}, NgramOptions(store_tokens=0), False),
    # The device matcher: the whole round on the device, so overlap hides the host's work.
    "ngram device": (
        "ngram",
        None,
        {"num_draft_tokens": 6},
        NgramOptions(matcher="device", max_depth=5),
        False,
    ),
    "ngram shared store": (
        "ngram",
        None,
        {"num_draft_tokens": 6},
        NgramOptions(flush_tokens=2),
        True,
    ),
    "dflash": (
        "dflash",
        random_block_draft(TARGET, "dflash", seed=1, std=0.3, block_size=4),
        {},
        None,
        False,
    ),
    # A verify budget shared by the batch splits differently while a finished request still
    # runs its extra round: rounds (and sampled draws), not greedy tokens, may differ.
    "dspark ragged": (
        "dspark",
        random_block_draft(TARGET, "dspark", seed=2, std=0.3, block_size=4),
        {"verify_budget": 3},
        None,
        True,
    ),
    # The auto budget read on the host (a sync inside the launch) for a packed verify.
    "dspark auto": (
        "dspark",
        random_block_draft(TARGET, "dspark", seed=2, std=0.3, block_size=4),
        {"verify_budget": "auto", "cost_table": ((1, 1.0), (64, 20.0))},
        None,
        True,
    ),
    # Which variant runs depends on measured times, so only greedy tokens are reproducible.
    "adaptive": (
        "eagle",
        agreeing_head(TARGET, "eagle"),
        {
            "adaptive_steps": (0, 2, 4),
            "adaptive_policy": AdaptivePolicy(warmup=0, samples=1, refresh=1),
        },
        None,
        True,
    ),
}


def engine(name, overlap, target=TARGET, spec_options=None, **limits):
    """An engine of pipeline ``name`` over ``target`` (the Markov target of ``test_eagle`` by
    default), overlapped or not; ``spec_options`` add to (or replace) its ``SpecOptions``."""
    algorithm, draft, spec, ngram, _ = PIPELINES[name]
    return engine_from_model(
        target,
        algorithm=algorithm,
        draft=draft,
        spec=SpecOptions(**(spec | (spec_options or {}))),
        ngram=ngram,
        overlap=overlap,
        **({"page_size": 4, "max_context": 48} | limits),
    )


def outcome(results, rounds=True):
    """Each result's tokens and finish reason, and its acceptance histogram (``rounds``)."""
    return [
        (r.token_ids, r.finish_reason, r.stats["accept_length_histogram"] if rounds else None)
        for r in results
    ]


@pytest.mark.parametrize("name", sorted(PIPELINES))
@settings(max_examples=4)
@given(
    prompts=prompt_batches(VOCAB, max_batch=5),
    max_new_tokens=max_new_tokens,
    stop_token_ids=stop_token_sets(VOCAB),
    sampled=st.booleans(),
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
    max_batch=st.integers(1, 4),
)
def test_overlapped_and_synchronous_scheduling_emit_the_same_tokens(
    name, prompts, max_new_tokens, stop_token_ids, sampled, page_size, prefill_budget, max_batch
):
    """Token for token, with the same finish reasons and the same rounds per request; a batch
    limit below the number of prompts makes requests wait for the ones before them."""
    greedy_only = PIPELINES[name][4]
    sampled = sampled and not greedy_only
    limits = {"page_size": page_size, "prefill_budget": prefill_budget, "max_batch": max_batch}
    options = {"max_new_tokens": max_new_tokens, "stop_token_ids": stop_token_ids}
    if sampled:
        options |= {"temperature": 1.0, "top_k": 6, "seed": 11}
    synchronous = generate(prompts, engine=engine(name, False, **limits), **options)
    overlapped = generate(prompts, engine=engine(name, True, **limits), **options)
    assert outcome(overlapped, not greedy_only) == outcome(synchronous, not greedy_only)


def test_the_extra_round_of_a_finished_request_stays_inside_its_pages():
    """Chains of five tokens at the context limit: the round an overlapped request runs after
    its last token starts past its budget, so the overlapped engine reserves one more round per
    request (without it these prompts index past their page tables); the tokens are the
    synchronous ones."""
    limits = {"page_size": 1, "max_context": 24, "num_pages": None}
    prompts = [[10, 2, 6, 7, 7, 4, 14, 2, 2, 10, 15, 3, 9, 9, 3, 10, 6, 9, 14], [0, 0, 3, 6, 3, 6]]
    synchronous = engine("eagle chain", False, **limits)
    overlapped = engine("eagle chain", True, **limits)
    assert overlapped.kv_lookahead == synchronous.kv_lookahead + 5
    ours = generate(prompts, engine=overlapped, max_new_tokens=30)
    assert outcome(ours) == outcome(generate(prompts, engine=synchronous, max_new_tokens=30))
    assert [r.finish_reason for r in ours] == ["length", "length"]


class OverlapMachine(SchedulerMachine):
    """The scheduler machine on an overlapped engine, against the synchronous ground truth."""

    def __init__(self) -> None:
        super().__init__()
        self.engine = engine_from_model(MODEL, num_pages=8, overlap=True, **LIMITS)
        self.state = scheduler.new_state(self.engine)

    @invariant()
    def batch_rows_follow_the_running_requests(self):
        """Overlapped, the batch is one round ahead of what the requests record: a row's cache
        holds the prompt and every token collected, and its next token is the one the round in
        flight emitted (the placeholder the next round reads)."""
        running = self.state.running
        if not running:
            assert self.state.batch is None
            return
        batch = self.state.batch
        assert batch.kv.seq_lens.tolist() == [len(r.prompt) + len(r.output) for r in running]
        for row, request in enumerate(running):
            expected = self.model[request.rid].tokens
            if len(request.output) < len(expected):
                assert int(batch.next_tokens[row]) == expected[len(request.output)]
            pages = batch.kv.page_table[row, : len(request.pages)]
            assert pages.tolist() == list(request.pages)


OverlapMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30)
test_overlapped_scheduler_state_machine = OverlapMachine.TestCase


class SlowEvent:
    """A device event that fires 2 ms (on ``clock``) after the host first waits on it."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.clock.sleep(0.002)


def test_host_time_is_hidden_only_when_overlapped(monkeypatch):
    """With device results that take a while to arrive, the synchronous scheduler waits for
    each and hides nothing; the overlapped one does its host work while they are on their way
    and waits about as long as the device takes. The scheduler reads a manual clock that moves
    5 ms per launch (the host's work of a round) and 2 ms per wait, so a loaded machine cannot
    shift the figures."""
    clock = ManualClock()

    def slow_copy(x):
        clock.sleep(0.005)
        return HostCopy(x.cpu(), SlowEvent(clock))

    monkeypatch.setattr(scheduler, "time", clock)
    monkeypatch.setattr(scheduler, "to_host", slow_copy)
    stats = {}
    for overlap in (False, True):
        (result, _) = generate(
            [[1, 2, 3], [4, 5]], engine=engine("eagle chain", overlap), max_new_tokens=12
        )
        stats[overlap] = result.stats
    for s in stats.values():
        assert s["blocked_ms_per_step"] >= 1.0 and s["host_ms_per_step"] > 0
    assert stats[False]["hidden_host_ms_per_step"] < 0.05 * stats[False]["host_ms_per_step"]
    assert stats[True]["hidden_host_ms_per_step"] > 0.5 * stats[True]["host_ms_per_step"]


def test_a_snapshot_taken_with_work_in_flight_replays_it():
    """The launches in flight are part of the state value: restoring collects them again."""
    overlapped = engine("eagle chain", True)
    sampling = scheduler.Sampling(temperature=1.0, top_k=6, seed=2)
    state = scheduler.new_state(overlapped)
    for prompt in ([1, 2, 3], [7, 7]):
        state, _ = scheduler.add_request(
            overlapped, state, prompt, sampling=sampling, max_new_tokens=20
        )
    for _ in range(3):
        state, _ = scheduler.step(overlapped, state)
    assert state.in_flight
    snap = scheduler.take_snapshot(overlapped, state)

    def finish(state):
        tokens = {r.rid: list(r.output) for r in state.running}
        while not scheduler.is_idle(state):
            state, outputs = scheduler.step(overlapped, state)
            for out in outputs:
                tokens[out.rid] += out.new_token_ids
        return tokens

    first = finish(state)
    assert finish(scheduler.restore(overlapped, snap)) == first


def test_a_cancelled_request_in_flight_is_dropped():
    overlapped = engine("eagle chain", True)
    state = scheduler.new_state(overlapped)
    state, a = scheduler.add_request(overlapped, state, [1, 2, 3], max_new_tokens=20)
    state, b = scheduler.add_request(overlapped, state, [4, 5, 6], max_new_tokens=20)
    for _ in range(3):
        state, _ = scheduler.step(overlapped, state)
    state = scheduler.cancel(overlapped, state, a)
    seen = set()
    while not scheduler.is_idle(state):
        state, outputs = scheduler.step(overlapped, state)
        seen |= {out.rid for out in outputs}
    assert seen == {b}
    assert int(state.allocator.num_free) == overlapped.config.num_pages - 1


def test_the_command_line_overlaps_on_request(capsys, tmp_path):
    folder = save_model(TARGET, tmp_path / "target")
    args = ["generate", "--model", str(folder), "--prompt-ids", "1,2,3", "--json"]
    runs = []
    for extra in ([], ["--overlap"]):
        assert cli.main([*args, "--max-new-tokens", "12", *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["token_ids"] == runs[1]["token_ids"] and len(runs[1]["token_ids"]) == 12
    assert runs[1]["stats"]["host_ms_per_step"] > 0
