"""Compiled rounds (``EngineConfig.compile_stages``, issue 24 item 3): ``torch.compile`` as the
fuser of a decoding round, with the hand kernels kept or replaced by inductor's code for their
reference math, emits exactly the eager round's tokens, and log-probabilities equal to float32
rounding (fused arithmetic may add in another order); unknown stage names are refused.

The compiled engines run on the CPU (inductor's C++ backend), over a one-layer target and one
batch bucket, so the test compiles one round; EAGLE and multi-step rounds and the command
line's are in ``tests/nocover/test_compiled_rounds.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from test_cli import run_cli
from torch._dynamo.utils import counters

from speculum.models.loading import random_model
from speculum.runtime import scheduler
from speculum.runtime.compiled import STAGES, check_stages
from speculum.runtime.engine import EngineConfig, engine_from_model
from speculum.runtime.generate import run_to_completion

MODEL = random_model(tiny_config(num_layers=1), seed=2, std=0.3)
#: Two prompts of different lengths and budgets: the batch shrinks from 2 rows to 1, padded
#: back to the one bucket, so the compiled round meets padding rows too.
REQUESTS = (([1, 2, 3], 9), ([7, 8, 9, 10, 11], 5))


def decoded(engine) -> list[scheduler.Request]:
    """The two requests, greedy with two log-probabilities per token, run to completion."""
    state, rids = scheduler.new_state(engine), []
    for prompt, budget in REQUESTS:
        sampling = scheduler.Sampling(logprobs=2)
        state, rid = scheduler.add_request(
            engine, state, prompt, sampling=sampling, max_new_tokens=budget
        )
        rids.append(rid)
    state, finished = run_to_completion(engine, state)
    return [finished[rid] for rid in rids]


def assert_same_requests(got: list[scheduler.Request], want: list[scheduler.Request]) -> None:
    """Same tokens, finish reasons and top alternatives; log-probabilities to float32
    rounding."""
    for g, w in zip(got, want, strict=True):
        assert (g.output, g.finish_reason) == (w.output, w.finish_reason)
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]
            assert a.logprob == pytest.approx(b.logprob, rel=1e-5, abs=1e-5)


def engine(**options):
    """A plain engine over :data:`MODEL` with one batch bucket of 2."""
    limits = {"max_batch": 2, **options}
    return engine_from_model(
        MODEL,
        max_context=48,
        page_size=4,
        graph_buckets=(2,),
        max_logprobs=2,
        prefix_cache=False,
        **limits,
    )


def test_a_compiled_round_with_every_stage_emits_the_eager_tokens():
    want = decoded(engine())
    torch._dynamo.reset()
    counters.clear()
    got = decoded(engine(compile_stages=STAGES))
    # One graph for the one bucket: the batch of 1 ran padded, nothing fell back to eager.
    assert counters["stats"]["unique_graphs"] == 1
    assert_same_requests(got, want)
    assert [len(r.output) for r in got] == [budget for _, budget in REQUESTS]


def test_compile_stages_are_checked():
    assert check_stages(("sampling",)) == ("round", "sampling")
    assert check_stages(()) == ()
    with pytest.raises(ValueError, match="unknown stages.*'fused'.*choose from round"):
        EngineConfig(compile_stages=("round", "fused"))
    with pytest.raises(ValueError, match="tuple of stage names"):
        EngineConfig(compile_stages="round")
    with pytest.raises(ValueError, match="max_batch=4 exceeds the largest batch bucket 2"):
        engine(max_batch=4, compile_stages=("round",))


def test_the_command_line_refuses_unknown_stages(capsys):
    status, _, err = run_cli(capsys, "--prompt-ids", "1", "--compile-stages", "round,fused")
    assert status == 2
    assert "--compile-stages: compile_stages names unknown stages ['fused']" in err
