"""The scheduler as a state machine: add / step / cancel / snapshot / restore, checked after every
rule against a plain Python model of what each request must produce (an engine without the prefix
cache, alone); a state value a later step replaced is refused, and trying it changes nothing.
Prompts share prefixes, so the prefix cache hits, fills and evicts: no page is freed while a
request holds it, no cached page is written, and an idle engine's pages are all reclaimable. On a
target whose every layer is windowed, pages outside the window go back to the pool as requests
decode, in a pool too small to keep them all: the same holds, with the model decoded keeping
every page, and no request holds more than its reservation."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
import torch
from conftest import tiny_config
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import run_to_completion
from speculum.state import tree_equal
from speculum.state.kv import PADDING_PAGE, allocated_pages

MODEL = random_model(tiny_config(), seed=0, std=0.3)
#: Every layer windowed (2 keys): pages wholly before a request's window are freed.
WINDOWED = random_model(
    tiny_config(architecture="MistralForCausalLM", sliding_window=2), seed=0, std=0.3
)
LIMITS = {"page_size": 4, "max_context": 40, "prefill_budget": 6, "max_batch": 3}
#: Two prefixes of several pages (page size 4), whole and extended: prompts hit their pages.
PROMPTS = [
    (1, 2, 3),
    (7,) * 9,
    (5, 9, 11, 13, 2),
    tuple(range(20, 32)),
    tuple(range(20, 29)) + (3, 4),
    (7,) * 8 + (1, 2),
]
_alone_cache: dict = {}


def alone(
    prompt: tuple[int, ...],
    max_new: int,
    sampling: scheduler.Sampling,
    options: tuple = (),
    target=MODEL,
    page_size: int = 4,
) -> tuple[int, ...]:
    """What a request yields when it is the only one, on an engine over ``target`` without
    the prefix cache, keeping every page, built with ``options`` (``(name, value)`` pairs)
    and pages of ``page_size``: the model's ground truth."""
    key = (prompt, max_new, sampling, options, target, page_size)
    if key not in _alone_cache:
        limits = LIMITS | {"page_size": page_size}
        engine = engine_from_model(
            target, prefix_cache=False, free_window_pages=False, **limits, **dict(options)
        )
        state, _ = scheduler.add_request(
            engine, scheduler.new_state(engine), prompt, sampling=sampling, max_new_tokens=max_new
        )
        _, finished = run_to_completion(engine, state)
        (request,) = finished.values()
        _alone_cache[key] = request.output
    return _alone_cache[key]


@attrs.define
class Expected:
    """The Python model of one request."""

    tokens: tuple[int, ...]
    output: tuple[int, ...] = ()
    done: bool = False


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one engine and compares it with the model after every rule."""

    snapshots = Bundle("snapshots")
    #: The engine's pipeline, as ``engine_from_model``'s ``(name, value)`` pairs (plain here).
    options: tuple = ()
    target = MODEL
    page_size, num_pages = 4, 8

    def __init__(self) -> None:
        super().__init__()
        limits = LIMITS | {"page_size": self.page_size}
        self.engine = engine_from_model(
            self.target, num_pages=self.num_pages, **limits, **dict(self.options)
        )
        self.state = scheduler.new_state(self.engine)
        self.model: dict[int, Expected] = {}
        # The state value the last step replaced (its pages have been written since).
        self.replaced: scheduler.SchedulerState | None = None

    def live(self) -> list[int]:
        return [rid for rid, e in self.model.items() if not e.done]

    @rule(
        prompt=st.sampled_from(PROMPTS),
        max_new=st.integers(1, 6),
        temperature=st.sampled_from([0.0, 1.0]),
        seed=st.integers(0, 3),
    )
    def add(self, prompt, max_new, temperature, seed):
        sampling = scheduler.Sampling(
            temperature=temperature, top_k=16 if temperature else 0, seed=seed
        )
        self.state, rid = scheduler.add_request(
            self.engine, self.state, prompt, sampling=sampling, max_new_tokens=max_new
        )
        expected = alone(prompt, max_new, sampling, self.options, self.target, self.page_size)
        self.model[rid] = Expected(tokens=expected)

    def cached_contents(self):
        """Each cached page's registration and K/V (target and draft pools)."""
        pools = self.engine.resources.pools
        return {
            page: (
                entry.since,
                [(pool.k[:, page].clone(), pool.v[:, page].clone()) for pool in pools],
            )
            for page, entry in self.state.prefix.cached.items()
        }

    @rule()
    def step(self):
        self.replaced = self.state
        before = self.cached_contents()
        self.state, outputs = scheduler.step(self.engine, self.state)
        for page, (since, contents) in self.cached_contents().items():
            if page in before and before[page][0] == since:  # cached all along
                for (k, v), (k0, v0) in zip(contents, before[page][1]):
                    assert torch.equal(k, k0) and torch.equal(v, v0), f"cached page {page} written"
        for out in outputs:
            expected = self.model[out.rid]
            expected.output += out.new_token_ids
            assert out.request.output == expected.output
            assert expected.output == expected.tokens[: len(expected.output)]
            if out.finished:
                assert expected.output == expected.tokens
                expected.done = True

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(self.live()))
        self.state = scheduler.cancel(self.engine, self.state, rid)
        self.model[rid].done = True

    @rule(target=snapshots)
    def snapshot(self):
        model_copy = {rid: attrs.evolve(e) for rid, e in self.model.items()}
        return scheduler.take_snapshot(self.engine, self.state), model_copy

    @rule(saved=consumes(snapshots))
    def restore(self, saved):
        snap, model_copy = saved
        self.state = scheduler.restore(self.engine, snap)
        assert tree_equal(self.state, snap.state)
        self.model = {rid: attrs.evolve(e) for rid, e in model_copy.items()}
        # The snapshot may be of that very value: restoring makes it the owner again.
        self.replaced = None

    @precondition(lambda self: self.replaced is not None)
    @rule()
    def step_a_replaced_state(self):
        """Refused, and the engine unchanged: the next steps still match the model."""
        for use in (scheduler.step, scheduler.take_snapshot):
            with pytest.raises(ValueError, match="no longer owns the engine's KV pages"):
                use(self.engine, self.replaced)

    @invariant()
    def pages_are_neither_leaked_nor_shared(self):
        """A page is a live request's own, or cached (shared by the requests that hold it, as
        many as its count says), or free; none is freed while held."""
        live = self.state.prefilling + self.state.running
        cached = self.state.prefix.cached
        own = [p for r in live for p in r.pages if p not in cached and p != PADDING_PAGE]
        assert len(own) == len(set(own)), "a page not cached is held by two requests"
        assert set(own) | set(cached) == allocated_pages(self.state.allocator), "a page leaked"
        holders = Counter(p for r in live for p in r.pages if p in cached)
        assert holders == Counter({p: e.refs for p, e in cached.items() if e.refs})
        assert all(not r.pages for r in self.state.waiting)
        free = self.state.allocator.free_pages[: int(self.state.allocator.num_free)].tolist()
        assert len(free) == len(set(free)) and 0 not in free
        if scheduler.is_idle(self.state):
            assert all(e.refs == 0 for e in cached.values()), "idle, yet a page is held"

    @invariant()
    def live_requests_match_the_model(self):
        in_state = [r.rid for r in self.state.waiting + self.state.prefilling + self.state.running]
        assert sorted(in_state) == sorted(self.live())
        for request in self.state.waiting + self.state.prefilling + self.state.running:
            assert request.output == self.model[request.rid].output

    @invariant()
    def batch_rows_follow_the_running_requests(self):
        running = self.state.running
        if not running:
            assert self.state.batch is None
            return
        lengths = [len(r.prompt) + len(r.output) - 1 for r in running]
        assert self.state.batch.kv.seq_lens.tolist() == lengths
        assert self.state.batch.next_tokens.tolist() == [r.output[-1] for r in running]
        for row, request in enumerate(running):
            pages = self.state.batch.kv.page_table[row, : len(request.pages)]
            assert pages.tolist() == list(request.pages)


SchedulerMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None
)
test_scheduler_state_machine = SchedulerMachine.TestCase


class EagleMachine(SchedulerMachine):
    """The machine on an EAGLE chain, whose draft pool shares the target's page ids: a hit
    reuses the draft's cached entries too, and no cached page of either pool is written."""

    options = (
        ("algorithm", "eagle"),
        ("draft", random_draft(MODEL, "eagle", seed=7, std=0.3)),
        ("spec", SpecOptions(num_steps=2)),
    )

    @invariant()
    def batch_rows_follow_the_running_requests(self):
        """An EAGLE row's committed cache and its root (the last token emitted)."""
        running = self.state.running
        if not running:
            assert self.state.batch is None
            return
        lengths = [len(r.prompt) + len(r.output) - 1 for r in running]
        assert self.state.batch.kv.seq_lens.tolist() == lengths
        assert self.state.batch.root_tokens.tolist() == [r.output[-1] for r in running]


EagleMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
test_eagle_state_machine = EagleMachine.TestCase


class WindowMachine(SchedulerMachine):
    """The machine on a target whose every layer is windowed, with pages of 2: a request
    holds only the pages its window reads (4 of the pool's 11 at most, where keeping its whole
    budget would take up to 10), cached prompt pages outside a window lose their holder but
    stay cached."""

    target = WINDOWED
    page_size, num_pages = 2, 12

    @invariant()
    def requests_hold_only_their_window(self):
        assert self.engine.kv_window == 2
        for request in self.state.prefilling + self.state.running:
            held = [p for p in request.pages if p != PADDING_PAGE]
            reserved = scheduler.pages_reserved(
                self.engine, len(request.prompt), request.max_new_tokens
            )
            assert len(held) <= reserved <= 4


WindowMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
test_window_state_machine = WindowMachine.TestCase


def test_model_ground_truth_is_not_degenerate():
    """The machine's model is only informative if different requests yield different tokens."""
    greedy = {alone(p, 6, scheduler.Sampling()) for p in PROMPTS}
    sampled = {
        alone(PROMPTS[0], 6, scheduler.Sampling(temperature=1.0, top_k=16, seed=s))
        for s in range(4)
    }
    assert len(greedy) == len(PROMPTS) and len(sampled) > 1
