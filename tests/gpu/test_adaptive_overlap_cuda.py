"""Adaptive speculation and overlap scheduling on the GPU, with real CUDA graphs.

- Adaptive: every variant is captured in its own graphs, and a round of one variant leaves
  every other variant's graphs and static buffers bit for bit as they were; greedy output is
  plain decoding's (fp32).
- Overlap: every pipeline emits the synchronous scheduler's tokens (fp32, captured rounds), and
  with a device that is the bottleneck the overlapped scheduler hides most host time.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from graph_checks import changed, graph_buffers
from test_graphs_cuda import LABELS, PROMPTS, _drafts, _target, _tokens

from speculum.models.loading import random_model
from speculum.pipelines.adaptive import AdaptivePolicy, variants_of
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate
from speculum.runtime.graphs import GraphedDecode

pytestmark = pytest.mark.gpu

#: Each round runs the variant idle longest: every variant runs, switching every round.
ROUND_ROBIN = AdaptivePolicy(margin=1.0, refresh=0, warmup=0, samples=1)


def test_adaptive_variants_keep_their_own_graphs_untouched_by_switching():
    target = _target()
    _, draft, _ = _drafts(target)["eagle chain"]
    spec = SpecOptions(adaptive_steps=(0, 1, 3), adaptive_policy=ROUND_ROBIN)
    engine = engine_from_model(
        target, algorithm="eagle", draft=draft, spec=spec, page_size=4, max_context=96, max_batch=8
    )
    decodes = [v.decode for v in variants_of(engine.pipeline)]
    assert all(isinstance(d, GraphedDecode) for d in decodes) and len({id(d) for d in decodes}) == 3
    state = scheduler.new_state(engine)
    for prompt in PROMPTS:
        state, _ = scheduler.add_request(engine, state, prompt, max_new_tokens=24)
    tokens: dict[int, list[int]] = {}
    while not scheduler.is_idle(state):
        before = [graph_buffers(d) for d in decodes]
        state, outputs = scheduler.step(engine, state)
        torch.cuda.synchronize()
        for out in outputs:
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        touched = [v for v, (d, old) in enumerate(zip(decodes, before)) if changed(d, old)]
        assert len(touched) <= 1, f"one step changed the graphs of variants {touched}"
    assert all(d.graphs for d in decodes)
    assert len({id(d.pool) for d in decodes}) == 3
    assert [tokens[r] for r in range(len(PROMPTS))] == _tokens(target, cuda_graphs=False)


@pytest.mark.parametrize("label", ["plain", *LABELS, "adaptive"])
def test_fp32_overlapped_scheduling_emits_the_synchronous_tokens(label):
    target = _target()
    if label == "plain":
        options = {}
    elif label == "adaptive":
        _, draft, _ = _drafts(target)["eagle chain"]
        spec = SpecOptions(adaptive_steps=(0, 2, 4), adaptive_policy=ROUND_ROBIN)
        options = dict(algorithm="eagle", draft=draft, spec=spec)
    else:
        algorithm, draft, spec = _drafts(target)[label]
        options = dict(algorithm=algorithm, draft=draft, spec=spec)
    assert _tokens(target, overlap=True, **options) == _tokens(target, **options)


def test_overlap_hides_the_host_time_of_a_device_bound_step():
    """A target large enough (1B parameters, fp32) that a decoding round takes longer than the
    scheduler's host work: overlapped, at least 80% of the host time per step is hidden
    behind the round in flight, and decoding is faster than synchronously."""
    config = tiny_config(
        vocab_size=8192,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=512,
    )
    target = random_model(config, seed=0, std=0.02).to("cuda")
    stats = {}
    for overlap in (False, True):
        engine = engine_from_model(
            target, page_size=16, max_context=256, max_batch=8, overlap=overlap
        )
        generate([[1, 2, 3]] * 8, engine=engine, max_new_tokens=8)  # capture the graphs
        (result, *_) = generate([[1, 2, 3]] * 8, engine=engine, max_new_tokens=128)
        stats[overlap] = result.stats
    print(stats)
    hidden = stats[True]["hidden_host_ms_per_step"] / stats[True]["host_ms_per_step"]
    assert hidden >= 0.8, stats
    assert stats[True]["tokens_per_second"] > stats[False]["tokens_per_second"], stats
