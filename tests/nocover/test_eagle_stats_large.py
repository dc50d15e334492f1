"""Large-sample end-to-end losslessness of the EAGLE pipelines (slow; not part of CI's gate).

The models, exact-law enumeration and checks of ``tests/cover/test_eagle_stats.py``, with the
joint law of the first *three* generated tokens (216 cells), 5x the seeds, and more round
shapes and filters: every fast case again, deeper chains, ``num_steps == 1``, ``topk == 4``
trees, more sampled-draft chains, and a mixed batch. Thresholds as there: false-alarm
probability ~1e-9 per check, draws fixed by their seeds.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _load_harness():
    # The harness lives with the fast tests; load it under its own name so pytest's import of
    # tests/cover/test_eagle_stats.py (if collected in the same run) is left alone.
    path = Path(__file__).parents[1] / "cover" / "test_eagle_stats.py"
    spec = importlib.util.spec_from_file_location("_eagle_stats_harness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


h = _load_harness()

SEEDS = 30_000

EXTRA = {
    "eagle3-tree3-random": dict(
        algorithm="eagle3",
        head="random",
        spec={"num_steps": 3, "topk": 3, "num_draft_tokens": 8},
        setting={},
        prompt=[1, 4, 2],
    ),
    "mtp-tree2-agree-topk": dict(
        algorithm="mtp",
        head="agree",
        spec={"num_steps": 4, "topk": 2, "num_draft_tokens": 7},
        setting={"temperature": 1.5, "top_k": 3},
        prompt=[4, 1],
    ),
    "eagle-chain5-agree-all-filters": dict(
        algorithm="eagle",
        head="agree",
        spec={"num_steps": 5, "topk": 1},
        setting={"temperature": 1.4, "top_k": 4, "top_p": 0.92, "min_p": 0.04},
        prompt=[5, 4, 3],
    ),
    "eagle3-chain1-agree": dict(
        algorithm="eagle3",
        head="agree",
        spec={"num_steps": 1, "topk": 1},
        setting={"temperature": 1.3},
        prompt=[0, 1, 2, 3, 4, 5],
    ),
    "eagle-tree4-agree-minp": dict(
        algorithm="eagle",
        head="agree",
        spec={"num_steps": 2, "topk": 4, "num_draft_tokens": 11},
        setting={"temperature": 1.5, "min_p": 0.1},
        prompt=[3, 3],
    ),
    "eagle3-tree2-reduced-vocab-topp": dict(
        algorithm="eagle3",
        head="reduced",
        spec={"num_steps": 3, "topk": 2, "num_draft_tokens": 6},
        setting={"temperature": 2.0, "top_p": 0.85},
        prompt=[0, 2, 3],
    ),
    "eagle-sampled-chains2-agree-topk": dict(
        algorithm="eagle",
        head="agree",
        spec={"num_steps": 3, "topk": 2, "sample_drafts": True},
        setting={"temperature": 2.0, "top_k": 4},
        prompt=[3, 0, 5, 1],
    ),
    "mtp-sampled-chain4-agree-topp": dict(
        algorithm="mtp",
        head="agree",
        spec={"num_steps": 4, "topk": 1, "sample_drafts": True},
        setting={"temperature": 2.0, "top_p": 0.95},
        prompt=[1, 4, 2],
    ),
}
ALL = {**h.CASES, **EXTRA}


@pytest.mark.parametrize("name", list(ALL))
def test_first_three_tokens_follow_the_target_law(name):
    case = ALL[name]
    if case["spec"].get("sample_drafts"):
        assert h.one_hot_draft_fraction(case) < 0.5, "the filter leaves the draft one token"
    (stats,) = h.run_case(case, num_tokens=3, num_seeds=SEEDS, salt=1)
    assert h.lossless(stats), stats
    if case["head"] == "agree":
        assert stats["accept_length_mean"] > 1.2, stats


def test_rows_of_a_mixed_batch_each_follow_their_own_three_token_law():
    results = h.run_case(h.MIXED, num_tokens=3, num_seeds=3 * SEEDS, salt=2)
    for stats in results:
        assert h.lossless(stats), results


@pytest.mark.parametrize("bug", list(h.WRONG))
def test_wrong_pipelines_fail_the_three_token_check(monkeypatch, bug):
    original, wrap, name = h.WRONG[bug]
    h._patch_everywhere(monkeypatch, original, wrap(original))
    (stats,) = h.run_case(h.CASES[name], num_tokens=3, num_seeds=5000, salt=3)
    assert not h.lossless(stats), (bug, stats)
