"""Pages outside every layer's sliding window go back to the pool (``Engine.kv_window``): a long
decode in a pool too small for its whole sequence completes and equals transformers; every
pipeline that frees pages emits what it emits keeping them, with the free pages and the
padding sink poisoned with NaN after every step (a query reading a freed entry would fail);
pages held stay bounded; snapshot/restore and cancel with freed pages; where freeing does not
apply, pages are kept."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from heads import agreeing_head, transformers_greedy
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import page_sizes, prefill_budgets
from test_sliding_window import hf_windowed

from speculum.models.draft import random_draft
from speculum.models.loading import load_model, random_model
from speculum.models.standalone import StandaloneHead
from speculum.runtime import scheduler
from speculum.runtime.engine import NgramOptions, SpecOptions, engine_from_model
from speculum.runtime.generate import run_to_completion
from speculum.spec import attention as spec_attention
from speculum.state.kv import PADDING_PAGE, KVPoolExhausted, allocated_pages

VOCAB = 64
#: Every layer windowed (3 keys): Mistral's shape.
WINDOWED = random_model(
    tiny_config(
        vocab_size=VOCAB, num_layers=3, architecture="MistralForCausalLM", sliding_window=3
    ),
    seed=5,
    std=0.5,
)
#: The same weights with a full-attention layer (gpt-oss's and Qwen's shape): nothing is freed.
MIXED = random_model(
    tiny_config(
        vocab_size=VOCAB,
        num_layers=3,
        architecture="Qwen2ForCausalLM",
        sliding_window=3,
        full_attention_layers=(1,),
    ),
    seed=5,
    std=0.5,
)

#: name -> engine_from_model options of the pipelines that free pages on ``WINDOWED``.
PIPELINES = {
    "plain": {},
    "plain 3 steps": {"spec": SpecOptions(num_steps=3)},
    "ngram": {
        "algorithm": "ngram",
        "spec": SpecOptions(num_draft_tokens=5),
        "ngram": NgramOptions(store_tokens=0),
    },
    # The target drafting for itself: every round commits the deepest path of its tree.
    "standalone self": {
        "algorithm": "standalone",
        "draft": StandaloneHead(WINDOWED, VOCAB),
        "spec": SpecOptions(num_steps=3, topk=2, num_draft_tokens=5),
    },
    # An EAGLE head whose layer is the target's kind (windowed), drafts that mostly agree.
    "eagle": {
        "algorithm": "eagle",
        "draft": agreeing_head(WINDOWED, "eagle"),
        "spec": SpecOptions(num_steps=3, topk=2, num_draft_tokens=6),
    },
    # An MTP layer of the target's own (windowed) kind: drafts that mostly miss (rollback).
    "mtp": {
        "algorithm": "mtp",
        "draft": agreeing_head(WINDOWED, "mtp"),
        "spec": SpecOptions(num_steps=3),
    },
}


@pytest.fixture(scope="module", autouse=True)
def freed_entries_unread():
    """In every test here, fails any attention call in which a real query sees a key whose
    page-table entry is the padding sink (a freed entry, or one never given a page): a
    draft's reads too, which the poisoned pages cannot show (a draft's distribution is
    guarded against NaN)."""
    reference = spec_attention.paged_attention

    def checked(q, k_cache, v_cache, page_table, prefix_lens, q_lens, new_mask, *rest):
        seq = page_table.shape[1] * k_cache.shape[1]
        window = rest[1] if len(rest) > 1 else 0
        visible = spec_attention.visible_keys(prefix_lens, new_mask, seq, window)
        real = torch.arange(q.shape[1])[None, :] < q_lens[:, None]
        unpaged = (page_table == PADDING_PAGE).repeat_interleave(k_cache.shape[1], dim=1)
        assert not (visible & real[:, :, None] & unpaged[:, None, :]).any()
        return reference(q, k_cache, v_cache, page_table, prefix_lens, q_lens, new_mask, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spec_attention, "paged_attention", checked)
        yield


def poison_unheld_pages(engine, state) -> None:
    """NaN into the padding sink and every free page of every pool: what the freed page-table
    entries point at, and what a freed page holds until it is taken again. A query that read
    any of it would see a NaN key or value and fail its request."""
    pages = sorted({PADDING_PAGE} | set(range(1, engine.config.num_pages)) - held(state))
    for pool in engine.resources.pools:
        pool.k[:, pages] = float("nan")
        pool.v[:, pages] = float("nan")


def held(state) -> set[int]:
    """The pages live requests or the prefix cache hold."""
    live = (*state.prefilling, *state.running)
    return {p for r in live for p in r.pages if p != PADDING_PAGE} | set(state.prefix.cached)


def check_bounded(engine, state) -> None:
    """Each live request holds at most its reservation (far less than its whole budget, so
    the entries before its window are let go of), and the allocator hands out exactly the
    pages held."""
    for request in (*state.prefilling, *state.running):
        pages = [p for p in request.pages if p != PADDING_PAGE]
        reserved = scheduler.pages_reserved(engine, len(request.prompt), request.max_new_tokens)
        assert len(pages) <= reserved
    assert allocated_pages(state.allocator) == held(state)


def decode_poisoned(engine, state, limit: int = 400) -> dict[int, scheduler.Request]:
    """Run ``state`` to completion on ``engine``, checking the bounds and poisoning every page
    no one holds after each step."""
    finished = {}
    for _ in range(limit):
        if scheduler.is_idle(state):
            return finished
        state, outputs = scheduler.step(engine, state)
        finished.update((o.rid, o.request) for o in outputs if o.finished)
        check_bounded(engine, state)
        poison_unheld_pages(engine, state)
    raise AssertionError("the requests did not finish")


def submit(engine, prompts, max_new_tokens, temperatures=None):
    """A fresh state on ``engine`` with ``prompts`` queued (sampled at ``temperatures``, seeded
    by their index; greedy by default), each decoding all ``max_new_tokens``."""
    state, rids = scheduler.new_state(engine), []
    for i, prompt in enumerate(prompts):
        temperature = 0.0 if temperatures is None else temperatures[i]
        sampling = scheduler.Sampling(temperature=temperature, top_k=8, seed=i)
        state, rid = scheduler.add_request(
            engine,
            state,
            prompt,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            ignore_eos=True,
        )
        rids.append(rid)
    return state, rids


def reservation(options: dict, prompts, max_new_tokens: int, **limits) -> int:
    """The pages the requests of ``prompts`` may hold at once on that engine."""
    engine = engine_from_model(WINDOWED, num_pages=2, **options, **limits)
    return sum(scheduler.pages_reserved(engine, len(p), max_new_tokens) for p in prompts)


def test_a_long_decode_in_a_pool_too_small_for_it_equals_transformers(tmp_path) -> None:
    """A Mistral written by transformers, windows of 5 keys: 100 greedy tokens for a batch of
    three prompts in a pool of 13 pages of 4, where one request alone would need 28 kept
    pages, equal transformers' ``generate`` in float32; keeping every page, the engine refuses
    the request as too big for the pool."""
    hf = hf_windowed("mistral")
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    prompts = [[3, 17, 42, 5, 88, 1, 9, 60, 2, 11, 7], [9] * 9, [1, 2]]
    expected = transformers_greedy(hf, prompts, 100)
    limits = {"page_size": 4, "max_context": 128, "prefill_budget": 7, "num_pages": 13}
    engine = engine_from_model(model, **limits)
    assert engine.kv_window == 5
    assert scheduler.pages_needed(engine, 11, 100) == 28
    state, rids = submit(engine, prompts, 100)
    finished = decode_poisoned(engine, state)
    assert [list(finished[rid].output) for rid in rids] == expected
    keeping = engine_from_model(model, free_window_pages=False, **limits)
    assert keeping.kv_window is None
    with pytest.raises(KVPoolExhausted, match="needs 28 KV pages but the pool has only 12"):
        scheduler.add_request(keeping, scheduler.new_state(keeping), prompts[0], max_new_tokens=100)


@pytest.mark.parametrize("name", sorted(PIPELINES))
@settings(max_examples=4, deadline=None)
@given(
    prompts=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), min_size=1, max_size=3
    ),
    temperatures=st.lists(st.sampled_from([0.0, 1.0]), min_size=4, max_size=4),
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
    overlap=st.booleans(),
    tight=st.booleans(),
)
def test_freeing_pages_changes_no_token(
    name, prompts, temperatures, page_size, prefill_budget, overlap, tight
) -> None:
    """A batch of greedy and seeded sampled requests, 40 tokens past a 3-key window, emits the
    same tokens whether pages are freed or kept, over drawn page sizes, chunked prefill and
    overlap; the pool (tight: room for a single request's reservation, so requests queue for
    each other; else for all of them) is poisoned with NaN wherever no one holds a page after
    every step, and each request holds at most its reservation; no query, the draft's
    included, sees a freed entry."""
    options = PIPELINES[name]
    limits = {
        "page_size": page_size,
        "prefill_budget": prefill_budget,
        "overlap": overlap,
        "max_context": 96,
    }
    prompts = prompts + [prompts[0] + [5, 6]]  # a shared prefix: the cache's pages are freed too
    sizes = [reservation(options, [p], 40, **limits) for p in prompts]
    num_pages = (max(sizes) if tight else sum(sizes)) + 1
    engine = engine_from_model(WINDOWED, num_pages=num_pages, **options, **limits)
    assert engine.kv_window == 3
    state, rids = submit(engine, prompts, 40, temperatures)
    finished = decode_poisoned(engine, state)
    keeping = engine_from_model(WINDOWED, free_window_pages=False, **options, **limits)
    state, kept_rids = submit(keeping, prompts, 40, temperatures)
    _, kept = run_to_completion(keeping, state)
    assert [finished[r].output for r in rids] == [kept[r].output for r in kept_rids]
    assert all(finished[r].finish_reason == "length" for r in rids)


def test_snapshot_restore_and_cancel_with_freed_pages() -> None:
    """A snapshot taken once the requests have freed pages (their tables hold padding entries)
    copies only the pages they hold; restored after the pool was poisoned and the requests
    ran on, it replays bit for bit (and an engine keeping every page refuses it); cancelling
    a request with freed entries returns exactly the pages it held, and the others decode on
    as they would have."""
    engine = engine_from_model(WINDOWED, page_size=2, max_context=96, prefill_budget=5)
    prompts = [[4, 2, 8, 1, 1, 3], [1] * 7, [15, 3, 3, 9]]
    state, rids = submit(engine, prompts, 30, [1.0, 0.0, 1.0])
    for _ in range(8):
        state, _ = scheduler.step(engine, state)
    assert all(PADDING_PAGE in r.pages for r in state.running)
    snap = scheduler.take_snapshot(engine, state)
    assert set(snap.pages.tolist()) == held(state)
    first = decode_poisoned(engine, state)
    keeping = engine_from_model(
        WINDOWED, page_size=2, max_context=96, prefill_budget=5, free_window_pages=False
    )
    with pytest.raises(ValueError, match="kv_window: snapshot 3, engine None"):
        scheduler.restore(keeping, snap)  # its requests would write their future pages to the sink
    replay = decode_poisoned(engine, scheduler.restore(engine, snap))
    assert [first[r].output for r in rids] == [replay[r].output for r in rids]

    restored = scheduler.restore(engine, snap)
    victim = restored.running[1]
    before = allocated_pages(restored.allocator)
    cancelled = scheduler.cancel(engine, restored, victim.rid)
    freed = before - allocated_pages(cancelled.allocator)
    assert freed == {p for p in victim.pages if p != PADDING_PAGE}
    rest = decode_poisoned(engine, cancelled)
    assert {r: rest[r].output for r in rest} == {
        r: first[r].output for r in rids if r != victim.rid
    }


def test_where_a_layer_reads_every_key_pages_are_kept() -> None:
    """A full-attention layer (gpt-oss's and Qwen's alternating shape), an EAGLE-3 head (its
    Llama midlayer has no window) or the adaptive pipeline keep every page: the engine frees
    nothing and reserves each request's whole budget, as before."""
    plain = engine_from_model(MIXED, page_size=4, max_context=64)
    eagle = engine_from_model(
        WINDOWED,
        algorithm="eagle3",
        draft=random_draft(WINDOWED, "eagle3", seed=1, std=0.3),
        page_size=4,
        max_context=64,
    )
    adaptive = engine_from_model(
        WINDOWED,
        algorithm="standalone",
        draft=StandaloneHead(WINDOWED, VOCAB),
        spec=SpecOptions(adaptive_steps=(0, 2)),
        page_size=4,
        max_context=64,
    )
    for engine in (plain, eagle, adaptive):
        assert engine.kv_window is None
        assert scheduler.pages_reserved(engine, 10, 40) == scheduler.pages_needed(engine, 10, 40)
        state, _ = submit(engine, [[1, 2, 3]], 30)
        while not state.running or len(state.running[0].output) < 12:
            state, _ = scheduler.step(engine, state)
        (request,) = state.running
        assert len(request.pages) == scheduler.pages_needed(engine, 3, 30)
        assert PADDING_PAGE not in request.pages
