"""Multi-step plain decoding on the GPU: a round of K plain steps captured as one CUDA graph per
batch bucket emits exactly the tokens of single steps, greedy and seeded sampled: in float32
against eager single steps, with stop tokens inside launches and requests finishing at
different steps over two buckets; in bfloat16 bit for bit against captured single steps over
the same batch (each step runs the kernels a single step runs, at the same shapes). Every page
is free afterwards."""

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


def _decoded(target, steps: int, graphs: bool, sampled: bool, mixed: bool) -> list[tuple]:
    """Each prompt's tokens and finish reason; checks that no page leaked. ``mixed``: 11
    prompts through ``max_batch`` 8 (batch 8, bucket 8, then 3, bucket 4), every third
    stopping at token 7, budgets that differ, so that requests finish at different steps of a
    launch; else the first 8 prompts, decoding together to the same budget (one batch
    throughout)."""
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
    for index, prompt in enumerate(PROMPTS if mixed else PROMPTS[:8]):
        sampling = scheduler.Sampling(temperature=1.0 if sampled else 0.0, seed=index)
        state, rid = scheduler.add_request(
            engine,
            state,
            prompt,
            sampling=sampling,
            max_new_tokens=13 + index if mixed else 24,
            stop_token_ids=(7,) if mixed and index % 3 == 0 else (),
        )
        rids.append(rid)
    state, finished = run_to_completion(engine, state)
    assert int(state.allocator.num_free) == engine.config.num_pages - 1, "a page leaked"
    if graphs:  # one graph per bucket: the K steps are one capture
        buckets = {c.captured.inputs[0].shape[0] for *_, c in engine.pipeline.decode.graphs}
        # Mixed requests finish at different rounds: the batch passes through smaller buckets.
        assert 8 in buckets and buckets <= ({1, 2, 4, 8} if mixed else {8})
    return [(finished[r].output, finished[r].finish_reason) for r in rids]


@pytest.mark.parametrize("sampled", [False, True])
def test_fp32_captured_multi_step_rounds_equal_eager_single_steps(sampled):
    target = _target(torch.float32)
    single = _decoded(target, 1, graphs=False, sampled=sampled, mixed=True)
    for steps in (1, 3, GPU_DECODE_STEPS):
        assert _decoded(target, steps, graphs=True, sampled=sampled, mixed=True) == single, steps
    assert _decoded(target, 3, graphs=False, sampled=sampled, mixed=True) == single


@pytest.mark.parametrize("sampled", [False, True])
def test_bf16_captured_multi_step_rounds_equal_captured_single_steps(sampled):
    target = _target(torch.bfloat16)
    single = _decoded(target, 1, graphs=True, sampled=sampled, mixed=False)
    for steps in (3, GPU_DECODE_STEPS):
        assert _decoded(target, steps, graphs=True, sampled=sampled, mixed=False) == single


def test_the_gpu_default_runs_several_steps_per_round():
    engine = engine_from_model(_target(torch.float32), page_size=4, max_context=96, max_batch=8)
    assert engine.pipeline.max_tokens_per_step == GPU_DECODE_STEPS
