"""Slow: every pipeline on both hybrid targets (Qwen3-Next's gated DeltaNet, Nemotron-H's
Mamba-2) equal to plain greedy decoding over many more Hypothesis-drawn batches, page sizes,
chunked prefill budgets and tree shapes than ``tests/cover`` draws."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cover"))

import test_nemotron_h as nemotron_h  # noqa: E402
import test_qwen3_next as qwen3_next  # noqa: E402
from heads import assert_pipeline_equals_plain  # noqa: E402
from strategies import page_sizes, prefill_budgets, prompt_batches  # noqa: E402

CASES = [(qwen3_next, name) for name in sorted(set(qwen3_next.PIPELINES) - {"plain"})] + [
    (nemotron_h, name) for name in sorted(set(nemotron_h.PIPELINES) - {"plain"})
]


@pytest.mark.parametrize(
    ("module", "name"), CASES, ids=[f"{m.__name__}-{name}" for m, name in CASES]
)
@settings(max_examples=12, deadline=None)
@given(
    prompts=prompt_batches(qwen3_next.PIPE_VOCAB, max_batch=4),
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
    data=st.data(),
)
def test_every_pipeline_equals_plain_greedy_on_hybrid_targets(
    module, name, prompts, page_size, prefill_budget, data
) -> None:
    """Token for token: each draft node's candidate state follows its path, commit keeps the
    accepted one, and a rejected draft token leaves no trace, for every pipeline, draft that
    mostly agrees and draft that rarely agrees, on both recurrent kinds."""
    tree = data.draw(module.TREES)
    limits = {"page_size": page_size, "prefill_budget": prefill_budget}
    assert_pipeline_equals_plain(module.hybrid_engine, name, prompts, tree, **limits)
