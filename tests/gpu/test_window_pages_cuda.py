"""Pages outside the sliding window go back to the pool on the GPU: a windowed target decodes
past many windows in a pool too small for whole sequences, through the Triton attention kernel
and CUDA-graphed rounds (whose page-table rows the scheduler replaces between rounds),
synchronous and overlapped, with every page no one holds poisoned with NaN after each step,
emitting exactly the tokens of the same engine keeping every page."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from speculum.models.loading import random_model
from speculum.models.standalone import StandaloneHead
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.state.kv import PADDING_PAGE

pytestmark = pytest.mark.gpu

VOCAB = 96
PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(3 + 5 * i)] for i in range(6)]
NEW_TOKENS = 80


def _target(dtype: torch.dtype):
    config = tiny_config(
        vocab_size=VOCAB,
        num_layers=4,
        hidden_size=64,
        head_dim=16,
        architecture="MistralForCausalLM",
        sliding_window=8,
        max_position_embeddings=256,
    )
    return random_model(config, seed=5, std=0.3).to("cuda", dtype)


def _decode(engine, poison: bool) -> list[tuple[int, ...]]:
    """Every prompt's output (greedy and seeded sampled alternately), poisoning the unheld
    pages after each step when asked."""
    state, rids = scheduler.new_state(engine), []
    for index, prompt in enumerate(PROMPTS):
        sampling = scheduler.Sampling(temperature=float(index % 2), top_k=16, seed=index)
        state, rid = scheduler.add_request(
            engine, state, prompt, sampling=sampling, max_new_tokens=NEW_TOKENS, ignore_eos=True
        )
        rids.append(rid)
    finished = {}
    while not scheduler.is_idle(state):
        state, outputs = scheduler.step(engine, state)
        finished.update((o.rid, o.request) for o in outputs if o.finished)
        if poison:
            live = (*state.prefilling, *state.running)
            held = {p for r in live for p in r.pages} | set(state.prefix.cached)
            unheld = sorted(set(range(engine.config.num_pages)) - (held - {PADDING_PAGE}))
            for pool in engine.resources.pools:
                pool.k[:, unheld] = float("nan")
                pool.v[:, unheld] = float("nan")
    assert all(finished[r].finish_reason == "length" for r in rids)
    return [finished[r].output for r in rids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("algorithm", ["plain", "standalone"])
def test_freeing_pages_on_the_gpu_changes_no_token(dtype, overlap, algorithm) -> None:
    target = _target(dtype)
    options = {
        "page_size": 4,
        "max_context": 192,
        "max_batch": 4,
        "prefill_budget": 16,
        "overlap": overlap,
    }
    if algorithm == "standalone":
        options |= {
            "algorithm": "standalone",
            "draft": StandaloneHead(target, VOCAB),
            "spec": SpecOptions(num_steps=3, topk=2, num_draft_tokens=6),
        }
    probe = engine_from_model(target, num_pages=2, **options)
    assert probe.kv_window == 8
    reserved = max(scheduler.pages_reserved(probe, len(p), NEW_TOKENS) for p in PROMPTS)
    assert reserved * 2 < scheduler.pages_needed(probe, len(PROMPTS[-1]), NEW_TOKENS)
    freeing = engine_from_model(target, num_pages=2 * reserved + 1, **options)
    keeping = engine_from_model(target, free_window_pages=False, **options)
    assert _decode(freeing, poison=True) == _decode(keeping, poison=False)
