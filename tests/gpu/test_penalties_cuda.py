"""Penalties and ``min_tokens`` through captured rounds on the GPU: the counts live in the
batch state as device tensors, read by every tree node and updated inside the captured round,
so every pipeline's captured rounds emit plain decoding's penalized tokens."""

from __future__ import annotations

import pytest
from test_graphs_cuda import PROMPTS, _drafts, _target, _tokens

from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate

pytestmark = pytest.mark.gpu

#: Strong enough to change the greedy output of the test target, and to matter inside rounds.
PENALTIES = {"repetition_penalty": 2.0, "frequency_penalty": 1.0, "presence_penalty": 0.5}


def _penalized(target, **options) -> list[tuple[int, ...]]:
    limits = {"page_size": 4, "max_context": 96, "max_batch": 8, "penalties": True}
    engine = engine_from_model(target, **(limits | options))
    results = generate(PROMPTS, engine=engine, max_new_tokens=24, min_tokens=4, **PENALTIES)
    return [r.token_ids for r in results]


@pytest.mark.parametrize("label", ["eagle chain", "eagle3 tree", "mtp tree", "ngram"])
def test_captured_rounds_under_penalties_equal_plain(label):
    target = _target()
    plain = _penalized(target, cuda_graphs=False)
    assert plain != [tuple(t) for t in _tokens(target)]  # the penalties change the output
    assert _penalized(target) == plain
    algorithm, draft, spec = _drafts(target)[label]
    assert _penalized(target, algorithm=algorithm, draft=draft, spec=spec) == plain
    overlapped = _penalized(target, algorithm=algorithm, draft=draft, spec=spec, overlap=True)
    assert overlapped == plain
