"""Multi-step plain decoding on the GPU: a round of K plain steps captured as one CUDA graph per
batch bucket emits exactly the tokens of eager single steps (float32 and bfloat16: each step
runs the kernels a single step runs, at the same shapes), greedy and seeded sampled, with stop
tokens inside launches, over several buckets, and frees every page."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from speculum.models.loading import random_model
from speculum.runtime import scheduler
from speculum.runtime.engine import GPU_DECODE_STEPS, SpecOptions, engine_from_model
from speculum.runtime.generate import run_to_completion
from speculum.runtime.graphs import GraphedDecode

pytestmark = pytest.mark.gpu

VOCAB = 96
# 11 prompts through max_batch 8: decoding runs at batch 8 (bucket 8), then 3 (bucket 4).
PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(1 + i % 6)] for i in range(11)]


def _target(dtype: torch.dtype):
    config = tiny_config(vocab_size=VOCAB, num_layers=4, hidden_size=64, head_dim=16)
    return random_model(config, seed=5, std=0.3).to("cuda", dtype)


def _decoded(target, steps: int, graphs: bool, sampled: bool) -> list[tuple]:
    """Each prompt's tokens and finish reason (every third stops at token 7, budgets differ so
    that requests finish at different steps of a launch); checks that no page leaked."""
    engine = engine_from_model(
        target,
        spec=SpecOptions(decode_steps=steps),
        cuda_graphs=graphs,
        page_size=4,
        max_context=96,
        max_batch=8,
        prefix_cache=False,
    )
    assert isinstance(engine.pipeline.decode, GraphedDecode) == graphs
    state, rids = scheduler.new_state(engine), []
    for index, prompt in enumerate(PROMPTS):
        sampling = scheduler.Sampling(temperature=1.0 if sampled else 0.0, seed=index)
        stops = (7,) if index % 3 == 0 else ()
        state, rid = scheduler.add_request(
            engine,
            state,
            prompt,
            sampling=sampling,
            max_new_tokens=13 + index,
            stop_token_ids=stops,
        )
        rids.append(rid)
    state, finished = run_to_completion(engine, state)
    assert int(state.allocator.num_free) == engine.config.num_pages - 1, "a page leaked"
    if graphs:  # one graph per bucket: the K steps are one capture
        assert sorted(c.inputs[0].shape[0] for *_, c in engine.pipeline.decode.graphs) == [4, 8]
    return [(finished[r].output, finished[r].finish_reason) for r in rids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampled", [False, True])
def test_captured_multi_step_rounds_equal_eager_single_steps(dtype, sampled):
    target = _target(dtype)
    single = _decoded(target, 1, graphs=False, sampled=sampled)
    for steps in (1, 3, GPU_DECODE_STEPS):
        assert _decoded(target, steps, graphs=True, sampled=sampled) == single, steps
    assert _decoded(target, 3, graphs=False, sampled=sampled) == single


def test_the_gpu_default_runs_several_steps_per_round():
    engine = engine_from_model(_target(torch.float32), page_size=4, max_context=96, max_batch=8)
    assert engine.pipeline.max_tokens_per_step == GPU_DECODE_STEPS
