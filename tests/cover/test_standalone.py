"""STANDALONE: a separate small causal LM drafts; the target as its own draft accepts everything."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.models.loading import random_model, save_model
from speculum.models.standalone import StandaloneHead, VocabularyMismatch, load_standalone
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, build_engine, engine_from_model
from speculum.runtime.generate import generate, run_to_completion

VOCAB = 16
TARGET = random_model(tiny_config(vocab_size=VOCAB, num_layers=3), seed=7, std=0.3)
SMALL = random_model(tiny_config(vocab_size=VOCAB, num_layers=1, hidden_size=16), seed=8, std=0.3)
LIMITS = {"page_size": 4, "max_context": 64}


def engine(draft_model, num_steps=3, topk=1, num_draft_tokens=None, sample=False, **limits):
    spec = SpecOptions(
        num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens, sample_drafts=sample
    )
    return engine_from_model(
        TARGET,
        algorithm="standalone",
        draft=StandaloneHead(draft_model, VOCAB),
        spec=spec,
        **(LIMITS | limits),
    )


def plain(prompts, max_new_tokens, **limits):
    results = generate(
        prompts,
        engine=engine_from_model(TARGET, **(LIMITS | limits)),
        max_new_tokens=max_new_tokens,
    )
    return [r.token_ids for r in results]


@pytest.mark.parametrize(
    ("num_steps", "topk", "num_draft_tokens"), [(1, 1, None), (4, 1, None), (3, 3, 8)]
)
def test_the_target_as_its_own_draft_is_always_accepted(num_steps, topk, num_draft_tokens):
    prompts = [[1, 2, 3], [9, 4, 4, 4, 7, 0]]
    spec = engine(TARGET, num_steps, topk, num_draft_tokens)
    max_new = 1 + 5 * (num_steps + 1)
    results = generate(prompts, engine=spec, max_new_tokens=max_new)
    assert [r.token_ids for r in results] == plain(prompts, max_new)
    for result in results:
        histogram = result.stats["accept_length_histogram"]
        if topk == 1:  # a chain is the draft's greedy path: all of it is accepted
            assert histogram == [0] * (num_steps + 1) + [5]
            assert result.stats["accept_rate_per_position"] == [1.0] * num_steps
        else:  # a tree holds the greedy path as deep as its score budget reaches, at least 1
            assert histogram[:2] == [0, 0] and result.stats["accept_length_mean"] > 2


@settings(max_examples=25)
@given(
    shape=st.sampled_from(
        [(1, 1, None), (3, 1, None), (5, 1, None), (2, 2, 4), (3, 3, 9), (4, 2, 7)]
    ),
    prompts=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), min_size=1, max_size=8
    ),
    max_new_tokens=st.integers(1, 12),
    page_size=st.sampled_from([1, 4]),
    prefill_budget=st.sampled_from([3, 64]),
    sample=st.booleans(),
)
def test_greedy_standalone_equals_plain(
    shape, prompts, max_new_tokens, page_size, prefill_budget, sample
):
    """Top-k trees, and sampled chains (greedy requests sample one-hot drafts), alike."""
    limits = {"page_size": page_size, "prefill_budget": prefill_budget}
    num_steps, topk, num_draft_tokens = shape
    if sample:
        num_draft_tokens = topk * num_steps + 1
    spec = engine(SMALL, num_steps, topk, num_draft_tokens, sample, **limits)
    results = generate(prompts, engine=spec, max_new_tokens=max_new_tokens)
    assert [r.token_ids for r in results] == plain(prompts, max_new_tokens, **limits)


def test_snapshot_restore_replays_sampled_standalone_decoding():
    spec = engine(SMALL, 3, 2, 6)
    sampling = scheduler.Sampling(temperature=0.9, top_k=8, seed=5)
    state, rid = scheduler.add_request(
        spec, scheduler.new_state(spec), [3, 1, 4], sampling=sampling, max_new_tokens=16
    )
    for _ in range(3):
        state, _ = scheduler.step(spec, state)
    snap = scheduler.take_snapshot(spec, state)
    _, finished = run_to_completion(spec, state)
    first = finished[rid].output
    _, finished = run_to_completion(spec, scheduler.restore(spec, snap))
    assert finished[rid].output == first


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    other = random_model(tiny_config(vocab_size=VOCAB + 1, num_layers=1), seed=1)
    with pytest.raises(VocabularyMismatch, match="vocabulary of 17 tokens and the target 16"):
        StandaloneHead(other, VOCAB)
    save_model(other, tmp_path / "other")
    with pytest.raises(VocabularyMismatch, match="tokenizer"):
        load_standalone(tmp_path / "other", TARGET)


def test_build_engine_loads_a_standalone_draft_folder(tmp_path):
    save_model(TARGET, tmp_path / "target")
    save_model(SMALL, tmp_path / "draft")
    loaded = build_engine(
        tmp_path / "target",
        algorithm="standalone",
        draft=tmp_path / "draft",
        spec=SpecOptions(num_steps=2),
        **LIMITS,
    )
    results = generate([[5, 6, 7]], engine=loaded, max_new_tokens=10)
    assert [r.token_ids for r in results] == plain([[5, 6, 7]], 10)
    assert torch.equal(loaded.resources.draft.model.lm_head.weight, SMALL.lm_head.weight)


def test_sampled_drafts_must_verify_every_chain():
    with pytest.raises(ValueError, match="num_draft_tokens must be 7"):
        engine(SMALL, 3, 2, 5, sample=True)
    assert engine(SMALL, 3, 2, None, sample=True).pipeline.max_tokens_per_step == 4
