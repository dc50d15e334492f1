"""Slow statistical checks of the block drafters: the first three tokens (past the first
accepted draft token and into the next round) of DSPARK with ragged verify and of DFLASH with
sampled drafts, over more seeds than ``tests/cover/test_block_stats.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cover"))

from test_block_stats import CASES, TARGET, block_engine  # noqa: E402
from test_eagle_stats import exact_joint, joint_stats, lossless, sample_tokens  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(CASES))
def test_first_three_tokens_follow_the_target_law(name):
    case = CASES[name]
    engine = block_engine(case, case["head"]())
    groups = [(case["prompt"], case["setting"])]
    (tokens,), _ = sample_tokens(engine, groups, 15_000, 3, salt=1)
    stats = joint_stats(tokens, exact_joint(TARGET, case["prompt"], case["setting"], 3))
    assert lossless(stats), stats
