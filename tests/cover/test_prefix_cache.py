"""Prefix caching: a request whose prompt starts with cached pages reuses them and emits exactly
the tokens (and, for drafters, the draft predictions and acceptance) of an engine without the
cache, for every pipeline; the cache outlives generate calls on one engine; a pool barely
larger than one request still completes everything. The scheduler state machine
(``test_scheduler_machine``) checks the page accounting under add / step / cancel / snapshot /
restore."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import max_new_tokens, page_sizes, prefill_budgets, shared_prefix_batches
from test_cli import run_cli
from test_eagle import TARGET, VOCAB
from test_overlap import PIPELINES, SMALL, engine, outcome

from speculum.models.draft import random_draft
from speculum.models.loading import random_model, save_model
from speculum.models.standalone import StandaloneHead
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.state.prefix import block_keys

#: Tokens past a page its cached contents depend on, per pipeline; None: not cached.
LOOKAHEAD = {
    "plain": 0,
    "plain 3 steps": 0,
    "eagle chain": 1,
    "eagle tree": 1,
    "eagle3 sampled drafts": 1,
    "mtp": 1,
    "standalone": 0,
    "frozen_kv_mtp": 0,
    "multi_layer_eagle": None,
    "ngram": 0,
    "ngram shared store": 0,
    "ngram device": 0,
    "dflash": 0,
    "dspark ragged": 0,
    "dspark auto": 0,
    "adaptive": 1,
}


def cacheable_tokens(prompt: list[int], page_size: int, lookahead: int | None) -> int:
    """The prompt tokens a later identical prompt finds cached: its full pages whose
    ``lookahead`` following tokens are in the prompt, leaving the last token to prefill."""
    if lookahead is None:
        return 0
    pages = min((len(prompt) - 1) // page_size, (len(prompt) - lookahead) // page_size)
    return max(pages, 0) * page_size


def test_every_pipeline_is_classified():
    assert set(LOOKAHEAD) == set(PIPELINES)
    for name, lookahead in LOOKAHEAD.items():
        assert engine(name, False).prefix_lookahead == lookahead, name
        assert engine(name, False, prefix_cache=False).prefix_lookahead is None


@pytest.mark.parametrize("name", sorted(PIPELINES))
@settings(max_examples=3)
@given(
    prompts=shared_prefix_batches(VOCAB),
    max_new_tokens=max_new_tokens,
    sampled=st.booleans(),
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
    max_batch=st.integers(1, 3),
)
def test_cached_prefixes_change_no_token(
    name, prompts, max_new_tokens, sampled, page_size, prefill_budget, max_batch
):
    """Token for token, with the same rounds per request where a request's rounds depend on
    itself alone; a second generate call on the same engine finds every full prompt page
    cached by the first."""
    greedy_only = PIPELINES[name][4]
    sampled = sampled and not greedy_only
    limits = {
        "page_size": page_size,
        "prefill_budget": prefill_budget,
        "max_batch": max_batch,
        "num_pages": 256,  # room for every prompt page and the live requests: no eviction
    }
    options = {"max_new_tokens": max_new_tokens}
    if sampled:
        options |= {"temperature": 1.0, "top_k": 6, "seed": 11}
    reference = generate(
        prompts, engine=engine(name, False, prefix_cache=False, **limits), **options
    )
    cached = engine(name, False, **limits)
    first = generate(prompts, engine=cached, **options)
    again = generate(prompts, engine=cached, **options)
    rounds = not greedy_only
    assert outcome(first, rounds) == outcome(reference, rounds)
    assert outcome(again, rounds) == outcome(reference, rounds)
    expected = [cacheable_tokens(p, page_size, LOOKAHEAD[name]) for p in prompts]
    assert [r.stats["cached_tokens"] for r in again] == expected
    assert all(r.stats["cached_tokens"] == 0 for r in reference)


#: Drafters whose own caches are reused: heads with random weights, so their predictions
#: depend on every entry of the draft cache.
DRAFTS = {
    "eagle chain": ("eagle", random_draft(TARGET, "eagle", seed=21, std=0.3), {"num_steps": 3}),
    "eagle tree": (
        "eagle",
        random_draft(TARGET, "eagle", seed=22, std=0.3),
        {"num_steps": 3, "topk": 2, "num_draft_tokens": 6},
    ),
    "eagle3": ("eagle3", random_draft(TARGET, "eagle3", seed=23, std=0.3), {"num_steps": 2}),
    "standalone": ("standalone", StandaloneHead(SMALL, VOCAB), {"num_steps": 3}),
}


def prefilled_row(draft_name, prefix_cache, earlier, prompt):
    """The batch state of ``prompt`` right after its prefill, on an engine that first decoded
    ``earlier`` to completion, and the request."""
    algorithm, draft, spec = DRAFTS[draft_name]
    eng = engine_from_model(
        TARGET,
        algorithm=algorithm,
        draft=draft,
        spec=SpecOptions(**spec),
        page_size=4,
        max_context=48,
        prefill_budget=5,
        prefix_cache=prefix_cache,
    )
    state = scheduler.new_state(eng)
    for tokens in earlier:
        state, _ = scheduler.add_request(eng, state, tokens, max_new_tokens=4)
    state, _ = run_to_completion(eng, state)
    state, rid = scheduler.add_request(eng, state, prompt, max_new_tokens=4)
    while not state.running:
        state, _ = scheduler.step(eng, state)
    return state.batch, state.running[0]


@pytest.mark.parametrize("name", sorted(DRAFTS))
@settings(max_examples=4)
@given(
    prefix=st.lists(st.integers(0, VOCAB - 1), min_size=9, max_size=14),
    own=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
    other=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=4),
)
def test_draft_predictions_after_a_hit_are_those_without(name, prefix, own, other):
    """The draft's carried prediction (top tokens and their probabilities) after a prefill that
    skipped the cached pages is the one computed from the whole prompt, though the cached pages
    were written by another prompt (sharing the prefix, then going on differently)."""
    prompt = prefix + own
    batch, request = prefilled_row(name, True, [prefix + other], prompt)
    alone, _ = prefilled_row(name, False, [], prompt)
    earlier = prefix + other
    common = next((i for i, (a, b) in enumerate(zip(earlier, prompt)) if a != b), len(prompt))
    common = min(common, len(earlier))
    lookahead = 0 if name == "standalone" else 1
    assert request.cached_tokens == (min(common - lookahead, len(prompt) - 1) // 4) * 4 > 0
    assert torch.equal(batch.prediction.top_tokens, alone.prediction.top_tokens)
    # Chunking a prefill differently moves float32 probabilities by ~1e-5 without any cache
    # (prefill_budget 5 against 64 does, for these heads): the tokens are what must agree.
    torch.testing.assert_close(
        batch.prediction.top_probs, alone.prediction.top_probs, rtol=1e-4, atol=1e-4
    )
    assert torch.equal(batch.root_tokens, alone.root_tokens)


@pytest.mark.parametrize("name", ["plain", "eagle chain", "standalone", "dflash"])
def test_a_pool_barely_larger_than_one_request_completes_everything(name):
    """With pages for one request and one more, requests sharing prefixes wait for each other,
    reuse and evict cached pages, and all finish with the tokens of an engine without cache."""
    prompts = [list(range(1, 14)), list(range(1, 14)) + [3, 5], list(range(1, 10)), [7, 7, 7]]
    prompts += [list(range(1, 14)) + [9], list(range(1, 6))]
    probe = engine(name, False, prefix_cache=False, page_size=4, max_context=32)
    need = scheduler.pages_needed(probe, max(map(len, prompts)), 8)
    limits = {"page_size": 4, "max_context": 32, "num_pages": need + 2, "prefill_budget": 6}
    reference = generate(
        prompts, engine=engine(name, False, prefix_cache=False, **limits), max_new_tokens=8
    )
    cached = engine(name, False, **limits)
    ours = generate(prompts, engine=cached, max_new_tokens=8)
    assert outcome(ours) == outcome(reference)
    assert sum(r.stats["cached_tokens"] for r in ours) > 0
    state = scheduler.new_state(cached)  # the cache it starts from: every page reclaimable
    assert len(state.prefix.cached) + int(state.allocator.num_free) == need + 1


def test_keys_name_the_whole_prefix():
    """A block's key depends on every token before it and, with lookahead, on the one after."""
    keys = block_keys((1, 2, 3, 4, 5, 6, 7, 8, 9), 4, 0)
    assert len(keys) == 2
    assert block_keys((0, 2, 3, 4, 5, 6, 7, 8), 4, 0)[1] != keys[1]
    ahead = block_keys((1, 2, 3, 4, 5, 6, 7, 8), 4, 1)
    assert len(ahead) == 1 and ahead == block_keys((1, 2, 3, 4, 5, 6, 7, 8, 9), 4, 1)[:1]
    assert block_keys((1, 2, 3, 4, 9), 4, 1) != block_keys((1, 2, 3, 4, 5), 4, 1)


def test_after_a_failed_step_a_new_state_trusts_no_cached_page(monkeypatch):
    """A step that fails after admission (which may have evicted cached pages for a request's
    own and written them) leaves the engine no cache for a new state to start from; retrying
    the step gives the tokens of an engine without the cache."""
    prompts = [list(range(1, 14)), list(range(1, 14)) + [2]]
    limits = {"page_size": 4, "max_context": 32}
    reference = generate(prompts, engine=engine("plain", False, prefix_cache=False, **limits))
    eng = engine("plain", False, **limits)
    state = scheduler.new_state(eng)
    state, _ = scheduler.add_request(eng, state, prompts[0])
    state, _ = run_to_completion(eng, state)
    state, rid = scheduler.add_request(eng, state, prompts[1])
    assert state.prefix.cached and eng.prefix_index.value.cached

    def failing(engine, state):
        raise RuntimeError("injected fault")

    with monkeypatch.context() as patch:
        patch.setattr(scheduler, "_launch_prefill", failing)
        with pytest.raises(RuntimeError, match="injected fault"):
            scheduler.step(eng, state)
    assert not eng.prefix_index.value.cached  # where a new state would start from
    _, finished = run_to_completion(eng, state)
    assert finished[rid].output == reference[1].token_ids
    assert finished[rid].cached_tokens == 12


def test_the_command_line_reports_cached_tokens_unless_told_not_to_cache(capsys, tmp_path):
    """``--prompts-file`` with one prompt twice, one at a time: the second reuses the first's
    full pages (``stats.cached_tokens``) and emits the same tokens; ``--no-prefix-cache``
    computes both afresh."""
    folder = save_model(random_model(tiny_config(), seed=1, std=0.3), tmp_path / "m")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": list(range(1, 12))}) + "\n" * 2)
    prompts.write_text(prompts.read_text() * 2)
    args = ["--model", str(folder), "--prompts-file", str(prompts), "--max-new-tokens", "4"]
    args += ["--page-size", "4", "--max-batch", "1"]
    rows = {}
    for flags in ((), ("--no-prefix-cache",)):
        status, out, _ = run_cli(capsys, *args, *flags)
        assert status == 0
        rows[flags] = [json.loads(line) for line in out.splitlines()]
    cached, fresh = rows[()], rows[("--no-prefix-cache",)]
    assert [r["stats"]["cached_tokens"] for r in cached] == [0, 8]
    assert [r["stats"]["cached_tokens"] for r in fresh] == [0, 0]
    assert [r["token_ids"] for r in cached] == [r["token_ids"] for r in fresh]
