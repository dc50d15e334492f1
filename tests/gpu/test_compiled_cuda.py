"""Compiled rounds on the GPU (``EngineConfig.compile_stages``): a round compiled by
``torch.compile`` (inductor's Triton code between the hand kernels, or in place of those a
stage names) and captured in our CUDA graphs, one per batch bucket, emits the tokens of the
hand-written eager round, greedy and seeded sampled, in float32: plain decoding (one step and
three per launch) and an EAGLE tree round, with requests finishing at different rounds so
that the batch passes through two buckets."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from heads import agreeing_head, markov_target
from torch._dynamo.utils import counters

from speculum.models.loading import random_model
from speculum.runtime import scheduler
from speculum.runtime.compiled import ROUND, STAGES
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import run_to_completion
from speculum.runtime.graphs import GraphedDecode

pytestmark = pytest.mark.gpu

VOCAB = 16
#: name -> (target, algorithm, draft, spec options), built on first use (on the GPU).
ROUNDS = ("plain", "plain 3 steps", "eagle tree")


def _setup(name: str):
    if name == "eagle tree":
        target = markov_target(VOCAB)
        head = agreeing_head(target, "eagle")
        spec = SpecOptions(num_steps=3, topk=2, num_draft_tokens=5)
        return target.cuda(), "eagle", head.cuda(), spec
    target = random_model(tiny_config(num_layers=2), seed=2, std=0.3).cuda()
    return target, "plain", None, SpecOptions(decode_steps=3 if "3" in name else 1)


def _decoded(setup, stages, sampled: bool) -> list[tuple]:
    """Five requests of different budgets through max_batch 4 (buckets 4, then 2 and 1)."""
    target, algorithm, draft, spec = setup
    engine = engine_from_model(
        target,
        algorithm=algorithm,
        draft=draft,
        spec=spec,
        cuda_graphs=bool(stages),
        max_batch=4,
        max_context=96,
        page_size=4,
        prefix_cache=False,
        compile_stages=stages,
    )
    assert isinstance(engine.pipeline.decode, GraphedDecode) == bool(stages)
    state, rids = scheduler.new_state(engine), []
    for index in range(5):
        sampling = scheduler.Sampling(temperature=1.0 if sampled else 0.0, seed=index)
        prompt = [(3 * index + j) % 16 for j in range(2 + index)]
        state, rid = scheduler.add_request(
            engine, state, prompt, sampling=sampling, max_new_tokens=9 + 3 * index
        )
        rids.append(rid)
    state, finished = run_to_completion(engine, state)
    assert int(state.allocator.num_free) == engine.config.num_pages - 1, "a page leaked"
    return [(finished[r].output, finished[r].finish_reason) for r in rids]


@pytest.mark.parametrize("stages", [(ROUND,), STAGES], ids=["round", "every stage"])
@pytest.mark.parametrize("name", ROUNDS)
def test_captured_compiled_rounds_emit_the_eager_hand_tokens(name, stages):
    setup = _setup(name)
    torch._dynamo.reset()
    counters.clear()
    for sampled in (False, True):
        want = _decoded(setup, (), sampled)
        assert _decoded(setup, stages, sampled) == want, sampled
    # Compiled once per bucket it met, never fallen back to eager code.
    assert counters["stats"]["unique_graphs"] >= 2
    assert not counters["graph_break"]
