"""flashinfer's MLA kernel planned on the host (``--mla-kernel flashinfer``) on a tiny random
DeepSeek-V3-shaped target in bfloat16 (16 heads, kv_lora_rank 512, qk_rope_head_dim 64, the
shapes flashinfer's kernel is built for):

- one target forward planned for a decode step and for a 4-token chain verify, over requests
  of several lengths and a batch padded to a bucket, equals the Triton latent kernel's within
  bfloat16 rounding (relative error of the hidden states);
- whole engines, synchronously scheduled: plain decoding (4 steps a round, captured) and an MTP
  chain round (captured) emit the Triton path's tokens, and the eagerly run rounds emit the
  captured ones, up to near-ties (the two kernels round differently, and flashinfer's split of
  the keys follows the batch, so a top-2 logit gap below 0.05 may flip; ``check_divergences``'
  bars: 99% of tokens matched, every divergence a near-tie). The planned wrappers ran.

Skipped without CUDA or without flashinfer.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from test_graphs_cuda import _logit_gap, check_divergences

from speculum.kernels.flashinfer_mla import RoundForward
from speculum.models.config import MLAConfig
from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate
from speculum.runtime.mla_kernel import with_latent_plans
from speculum.spec.paged import tail_batch
from speculum.state.kv import PagedKV

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer.mla")

VOCAB = 96
PAGE_SIZE = 4
#: 64 prompts through max_batch 8: batches of 8 (bucket 8), then fewer as requests end.
PROMPTS = [[(13 * i + 5 * j) % VOCAB for j in range(2 + i % 9)] for i in range(64)]
LIMITS = {"page_size": PAGE_SIZE, "max_context": 128, "max_batch": 8}


def _target():
    mla = MLAConfig(
        q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32
    )
    config = tiny_config(
        vocab_size=VOCAB,
        num_layers=3,
        hidden_size=128,
        intermediate_size=256,
        num_heads=16,
        num_kv_heads=16,
        head_dim=32,
        architecture="DeepseekV3ForCausalLM",
        mla=mla,
        max_position_embeddings=256,
    )
    return random_model(config, seed=5, std=0.3).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("width", [1, 4])
def test_a_planned_forward_equals_the_triton_kernels(width):
    """Three requests of 5, 37 and 90 cached tokens, padded to 4 rows (the fourth on the
    padding page), run ``width`` causal queries through every layer: planned flashinfer and
    the Triton kernel give the same hidden states within bfloat16 rounding."""
    target = _target()
    stride = 32
    pool = target.new_pool(3 * stride + 1, PAGE_SIZE)
    planned = with_latent_plans(pool, target, (RoundForward(width, 0),), stride=stride, max_rows=4)
    committed = [5, 37, 90]
    pages = torch.arange(1, 3 * stride + 1, device="cuda").view(3, stride)
    kv = PagedKV(
        page_table=torch.cat([pages, torch.zeros_like(pages[:1])]),
        seq_lens=torch.tensor([*committed, 0], device="cuda"),
        page_size=PAGE_SIZE,
    )
    # Fill the caches: one prompt forward per request (Triton, no plan is active).
    gen = torch.Generator(device="cuda").manual_seed(0)
    for row, length in enumerate(committed):
        prompt = torch.randint(0, VOCAB, (1, length), device="cuda", generator=gen)
        empty = PagedKV(
            page_table=pages[row : row + 1],
            seq_lens=torch.zeros(1, dtype=torch.int64, device="cuda"),
            page_size=PAGE_SIZE,
        )
        mask = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()[None]
        positions = torch.arange(length, device="cuda")[None]
        target(tail_batch(empty, prompt, positions, mask), pool)
    tokens = torch.randint(0, VOCAB, (4, width), device="cuda", generator=gen)
    positions = kv.seq_lens[:, None] + torch.arange(width, device="cuda")
    mask = torch.ones(width, width, dtype=torch.bool, device="cuda").tril().expand(4, -1, -1)
    batch = tail_batch(kv, tokens, positions, mask)
    expected, _ = target(batch, pool)
    with planned.latent_plans.planned(committed, rows=4):
        got, _ = target(batch, planned)
    error = (got.float() - expected.float()).norm() / expected.float().norm()
    assert error < 2e-2, error
    assert planned.latent_plans.wrappers  # the wrapper ran, not the Triton kernel


def _tokens(target, engine_options, prompts=PROMPTS, new_tokens=32):
    engine = engine_from_model(target, **LIMITS, **engine_options)
    results = generate(prompts, engine=engine, max_new_tokens=new_tokens)
    return [list(r.token_ids) for r in results], engine


ROUNDS = {
    "plain, 4 steps a round": lambda target: {},
    "mtp chain of 3": lambda target: {
        "algorithm": "mtp",
        "draft": random_draft(target, "mtp", seed=2, std=0.3),
        "spec": SpecOptions(num_steps=3, topk=1),
    },
}


@pytest.mark.parametrize("label", sorted(ROUNDS))
def test_planned_rounds_emit_the_triton_paths_tokens_captured_and_eager(label):
    target = _target()
    options = ROUNDS[label](target)
    triton, _ = _tokens(target, options)
    captured, engine = _tokens(target, {**options, "mla_kernel": "flashinfer"})
    eager, _ = _tokens(target, {**options, "mla_kernel": "flashinfer", "cuda_graphs": False})
    assert engine.resources.target_pool.latent_plans.wrappers  # planned and run
    rows, matched, total = [], 0, 0
    for name, ours, reference in (("captured", captured, triton), ("eager", eager, captured)):
        for prompt, a, b in zip(PROMPTS, reference, ours):
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            matched, total = matched + same, total + len(a)
            if same < len(a):
                gap = _logit_gap(target, prompt + a[:same])
                rows.append((name, PROMPTS.index(prompt), same, a[same], b[same], gap))
    check_divergences(
        "run | prompt | first mismatch at | reference | flashinfer", rows, matched, total
    )
