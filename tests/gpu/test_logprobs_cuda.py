"""Log-probabilities on the GPU: rounds captured as CUDA graphs (over two batch buckets,
synchronous and overlapped) report the same tokens and log-probabilities as eager rounds and as
plain decoding, for every pipeline, fp32, greedy and sampled."""

from __future__ import annotations

import pytest
from test_graphs_cuda import LABELS, PROMPTS, _drafts, _target

from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate
from speculum.runtime.graphs import GraphedDecode

pytestmark = pytest.mark.gpu

TOLERANCE = {"abs": 1e-4, "rel": 1e-4}


def _run(target, sampled: bool, **options):
    limits = {"page_size": 4, "max_context": 96, "max_batch": 8, "max_logprobs": 5}
    engine = engine_from_model(target, **(limits | options))
    setting = {"temperature": 0.8, "top_k": 7, "seed": 3} if sampled else {}
    results = generate(PROMPTS, engine=engine, max_new_tokens=16, logprobs=5, **setting)
    return engine, results


def _assert_same(got, want, tokens: bool = True):
    for g, w in zip(got, want):
        if tokens:
            assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs):
            if a["token_id"] != b["token_id"]:
                break  # sampled speculative tokens may part from plain's: compare up to there
            assert a["logprob"] == pytest.approx(b["logprob"], **TOLERANCE)
            got_top = [t["logprob"] for t in a["top_logprobs"]]
            assert got_top == pytest.approx([t["logprob"] for t in b["top_logprobs"]], **TOLERANCE)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("label", ["plain", *LABELS])
def test_captured_rounds_report_eager_and_plain_logprobs(label, sampled):
    target = _target()
    options = {}
    if label != "plain":
        algorithm, draft, spec = _drafts(target)[label]
        options = {"algorithm": algorithm, "draft": draft, "spec": spec}
    _, plain = _run(target, sampled, cuda_graphs=False)
    engine, captured = _run(target, sampled, **options)
    if label != "ngram":  # n-gram rounds run host code: never captured
        assert isinstance(engine.pipeline.decode, GraphedDecode)
    _, eager = _run(target, sampled, cuda_graphs=False, **options)
    _, overlapped = _run(target, sampled, overlap=True, **options)
    _assert_same(captured, eager)
    _assert_same(overlapped, captured)
    _assert_same(captured, plain, tokens=not sampled)
    assert all(len(r.logprobs) == len(r.token_ids) for r in captured)
