"""Slow statistical checks of sampled structured output: the first three tokens under a regex
(past the first accepted draft token and into the next round) of plain decoding, an EAGLE chain
and an EAGLE tree (drafts masked by the grammar or free, sampled too), over more seeds than
``tests/cover/test_grammar_stats.py``, whose docstring says why the fixed seeds make the
assertion deterministic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cover"))

from test_eagle_stats import CHUNK, lossless  # noqa: E402
from test_grammar_stats import CHAIN3, FREE, SAMPLED_FREE, THREE, sampled_stats  # noqa: E402

from speculum.runtime.generate import acceptance_stats  # noqa: E402

pytestmark = pytest.mark.slow

TREE = {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}


@pytest.mark.parametrize(
    ("algorithm", "spec"),
    [("plain", {}), ("eagle", CHAIN3), ("eagle", TREE)]
    + [("eagle", TREE | FREE), ("eagle", SAMPLED_FREE | {"topk": 2})],
)
def test_three_constrained_tokens_follow_the_masked_renormalized_law(algorithm, spec):
    stats, histogram, _ = sampled_stats(algorithm, spec, THREE, 8 * CHUNK)
    assert lossless(stats), stats
    if algorithm == "eagle":
        assert acceptance_stats(histogram)["accept_length_mean"] > 1.2, histogram
