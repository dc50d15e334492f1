"""Request controls through captured rounds on the GPU: a logit bias changes greedy output, and
every pipeline's captured rounds under it emit plain decoding's biased tokens."""

from __future__ import annotations

import pytest
from test_graphs_cuda import PROMPTS, _drafts, _target, _tokens

from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate

pytestmark = pytest.mark.gpu

#: Bans one token and favours another (both are in the test vocabulary of 96 ids).
BIAS = {5: -100.0, 17: 6.0}


def _biased(target, **options) -> list[tuple[int, ...]]:
    limits = {"page_size": 4, "max_context": 96, "max_batch": 8, "logit_bias": True}
    engine = engine_from_model(target, **(limits | options))
    results = generate(PROMPTS, engine=engine, max_new_tokens=24, logit_bias=BIAS)
    return [r.token_ids for r in results]


@pytest.mark.parametrize("label", ["eagle chain", "eagle3 tree", "ngram"])
def test_captured_rounds_under_a_logit_bias_equal_plain(label):
    target = _target()
    plain = _biased(target, cuda_graphs=False)
    assert plain != [tuple(t) for t in _tokens(target)]  # the bias changes the output
    assert all(5 not in tokens for tokens in plain)
    assert _biased(target) == plain
    algorithm, draft, spec = _drafts(target)[label]
    assert _biased(target, algorithm=algorithm, draft=draft, spec=spec) == plain
