"""Failure isolation on the GPU, through captured rounds: a request whose embedding row is NaN
finishes alone with ``finish_reason == "error"``, the others decode exactly as they would alone,
and garbage in free pages changes no token.

The Triton attention kernel skips a key only where no real query row of its block sees it (the
CPU reference skips it per query: ``docs/gpu.md``), so here a NaN draft token may fail its
request one round earlier than plain decoding would: the property checked against plain
decoding is that every error comes with a prefix of plain decoding's tokens and every other
result equals plain decoding's.
"""

from __future__ import annotations

import pytest
import torch
from test_graphs_cuda import VOCAB, _drafts, _target

from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate

pytestmark = pytest.mark.gpu

POISON = 11
PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(1 + i % 6)] for i in range(11)] + [[1, POISON]]
LIMITS = {"page_size": 4, "max_context": 96, "max_batch": 8}


def _poisoned():
    target = _target()
    with torch.no_grad():
        target.model.embed_tokens.weight[POISON] = float("nan")
    return target


def _options(label: str, target) -> dict:
    """``engine_from_model`` options of pipeline ``label`` of ``test_graphs_cuda``."""
    if label == "plain":
        return {}
    algorithm, draft, spec = _drafts(target)[label]
    return {"algorithm": algorithm, "draft": draft, "spec": spec}


def _run(target, prompts, **options):
    engine = engine_from_model(target, **(LIMITS | options))
    return [
        (r.token_ids, r.finish_reason) for r in generate(prompts, engine=engine, max_new_tokens=24)
    ]


@pytest.mark.parametrize("label", ["plain", "eagle chain", "eagle3 tree", "mtp tree", "ngram"])
def test_captured_rounds_fail_only_the_poisoned_requests(label):
    target = _poisoned()
    options = _options(label, target)
    plain = _run(target, PROMPTS)
    assert plain[-1] == ((), "error")
    batch = _run(target, PROMPTS, **options)
    alone = [_run(target, [p], **options)[0] for p in PROMPTS]
    assert batch == alone
    for (tokens, reason), (plain_tokens, plain_reason) in zip(batch, plain):
        if reason == "error":
            assert tokens == plain_tokens[: len(tokens)]
        else:
            assert (tokens, reason) == (plain_tokens, plain_reason)
    overlapped = _run(target, PROMPTS, overlap=True, **options)
    assert overlapped == batch


@pytest.mark.parametrize("label", ["plain", "eagle3 tree", "ngram"])
def test_nan_in_free_pages_changes_no_token_on_the_gpu(label):
    target = _target()
    options = _options(label, target)
    clean = _run(target, PROMPTS[:-1], **options)
    engine = engine_from_model(target, **(LIMITS | options))
    for pool in engine.resources.pools:
        pool.k.fill_(float("nan"))
        pool.v.fill_(float("nan"))
    dirty = [
        (r.token_ids, r.finish_reason)
        for r in generate(PROMPTS[:-1], engine=engine, max_new_tokens=24)
    ]
    assert dirty == clean
