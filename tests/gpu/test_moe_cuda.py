"""Mixture-of-experts targets on the GPU: the ``speculum::moe`` op inside captured rounds.

- fp32: over an MoE target (Qwen2-MoE-shaped: 8 experts, top 2, a gated shared expert and one
  dense layer), every pipeline's captured rounds emit exactly plain greedy decoding's tokens,
  and exactly what its eager rounds emit.
- bf16: captured MoE rounds run and emit every token asked for.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from test_graphs_cuda import (
    LABELS,
    PROMPTS,
    VOCAB,
    _drafts,
    _tokens,
    check_captured_rounds_equal_plain_and_eager,
)

from speculum.models.config import MoEConfig
from speculum.models.loading import random_model

pytestmark = pytest.mark.gpu


def _moe_target(dtype: torch.dtype = torch.float32):
    moe = MoEConfig(
        num_experts=8,
        top_k=2,
        expert_intermediate_size=32,
        norm_topk_prob=False,
        shared_expert_intermediate_size=48,
        dense_layers=(1,),
    )
    config = tiny_config(
        vocab_size=VOCAB,
        num_layers=4,
        hidden_size=64,
        head_dim=16,
        architecture="Qwen2MoeForCausalLM",
        qkv_bias=True,
        moe=moe,
    )
    return random_model(config, seed=5, std=0.3).to("cuda", dtype)


@pytest.mark.parametrize("label", LABELS)
def test_fp32_captured_rounds_on_an_moe_target_equal_plain_and_eager(label):
    check_captured_rounds_equal_plain_and_eager(_moe_target(), label)


def test_bf16_captured_moe_rounds_run():
    target = _moe_target(torch.bfloat16)
    algorithm, draft, spec = _drafts(target)["eagle3 tree"]
    tokens = _tokens(target, algorithm=algorithm, draft=draft, spec=spec)
    assert [len(t) for t in tokens] == [24] * len(PROMPTS)
