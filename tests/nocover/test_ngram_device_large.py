"""The device n-gram matcher's chain properties (``tests/cover/test_ngram_device.py``) over
long histories, deep matches and wide trees, and greedy equality with plain decoding over more
batches, overlapped and not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cover"))

from test_ngram import TARGET, VOCAB  # noqa: E402
from test_ngram_device import (  # noqa: E402
    assert_chains_follow_the_rule_and_the_host,
    chain_cases,
    device_engine,
)

from speculum.runtime.engine import engine_from_model  # noqa: E402
from speculum.runtime.generate import generate  # noqa: E402

pytestmark = pytest.mark.slow


@settings(max_examples=1500)
@given(case=chain_cases(deepest=18, largest=24, max_len=300))
def test_long_histories_follow_the_rule_and_prefix_the_host_chains(case):
    assert_chains_follow_the_rule_and_the_host(*case)


@settings(max_examples=150)
@given(
    num_draft_tokens=st.integers(2, 12),
    max_depth=st.integers(1, 10),
    prompts=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24), min_size=1, max_size=8
    ),
    max_new_tokens=st.integers(1, 30),
    page_size=st.sampled_from([1, 2, 4, 8]),
    prefill_budget=st.sampled_from([1, 5, 64]),
    max_batch=st.integers(1, 8),
    overlap=st.booleans(),
)
def test_greedy_device_matcher_decoding_equals_plain_at_length(
    num_draft_tokens,
    max_depth,
    prompts,
    max_new_tokens,
    page_size,
    prefill_budget,
    max_batch,
    overlap,
):
    limits = dict(
        page_size=page_size, max_context=80, prefill_budget=prefill_budget, max_batch=max_batch
    )
    engine = device_engine(num_draft_tokens, overlap, max_depth=max_depth, **limits)
    results = generate(prompts, engine=engine, max_new_tokens=max_new_tokens)
    expected = generate(
        prompts, engine=engine_from_model(TARGET, **limits), max_new_tokens=max_new_tokens
    )
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
