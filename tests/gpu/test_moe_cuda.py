"""Mixture-of-experts targets on the GPU: the ``speculum::moe`` op inside captured rounds.

- fp32: over an MoE target (Qwen2-MoE-shaped: 8 experts, top 2, a gated shared expert and one
  dense layer; GLM-4.5-shaped: partial rotary, grouped sigmoid routing with a correction bias,
  an ungated shared expert, layer 0 dense; gpt-oss-shaped: biased router and experts, the
  clamped GLU, attention sinks, YaRN, windows of 4 keys on alternate layers), every pipeline's
  captured rounds emit exactly
  plain greedy decoding's tokens, and exactly what its eager rounds emit.
- bf16: captured MoE rounds run and emit every token asked for (GLM's routers in float32).
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


#: family -> (architecture, config fields): Qwen2-MoE's gated shared expert; GLM-4.5's routing.
FAMILIES = {
    "qwen2-moe": (
        "Qwen2MoeForCausalLM",
        {"qkv_bias": True},
        MoEConfig(
            num_experts=8,
            top_k=2,
            expert_intermediate_size=32,
            norm_topk_prob=False,
            shared_expert_intermediate_size=48,
            dense_layers=(1,),
        ),
    ),
    "glm4-moe": (
        "Glm4MoeForCausalLM",
        {"qkv_bias": True, "qk_norm": True, "partial_rotary_factor": 0.5},
        MoEConfig(
            num_experts=8,
            top_k=3,
            expert_intermediate_size=32,
            norm_topk_prob=True,
            dense_layers=(0,),
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            float32_router=True,
        ),
    ),
    "gpt-oss": (
        "GptOssForCausalLM",
        {
            "qkv_bias": True,
            "o_bias": True,
            "attention_sinks": True,
            "sliding_window": 4,
            "full_attention_layers": (1, 3),
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
        MoEConfig(
            num_experts=8,
            top_k=2,
            expert_intermediate_size=32,
            norm_topk_prob=False,
            scoring_func="softmax_topk",
            biases=True,
            swiglu_limit=7.0,
        ),
    ),
}


def _moe_target(family: str = "qwen2-moe", dtype: torch.dtype = torch.float32):
    architecture, fields, moe = FAMILIES[family]
    config = tiny_config(
        vocab_size=VOCAB,
        num_layers=4,
        hidden_size=64,
        head_dim=16,
        architecture=architecture,
        moe=moe,
        **fields,
    )
    model = random_model(config, seed=5, std=0.3)
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # random_model zeroes biases: the correction biases and gpt-oss's router and
            # expert biases are drawn, so that they change the routing and the outputs.
            if name.endswith(("_bias", "gate.bias")):
                param.normal_(0.0, 0.3, generator=generator)
    return model.to("cuda", dtype)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("label", LABELS)
def test_fp32_captured_rounds_on_an_moe_target_equal_plain_and_eager(label, family):
    check_captured_rounds_equal_plain_and_eager(_moe_target(family), label)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_captured_moe_rounds_run(family):
    target = _moe_target(family, torch.bfloat16)
    algorithm, draft, spec = _drafts(target)["eagle3 tree"]
    tokens = _tokens(target, algorithm=algorithm, draft=draft, spec=spec)
    assert [len(t) for t in tokens] == [24] * len(PROMPTS)


@pytest.mark.parametrize("rows", [1, 4, 64])
@pytest.mark.parametrize("family", ["qwen", "deepseek", "gpt-oss"])
def test_bf16_moe_kernels_match_the_reference(rows: int, family: str) -> None:
    """The op's CUDA kernel (pairwise Triton at 1 and 4 rows of top 4 of 32 experts, the
    grouped GEMM at 64 rows) equals the dense reference to bfloat16 rounding (the GEMMs
    accumulate in other orders), for Qwen's, DeepSeek-V3's and gpt-oss's routing (gpt-oss:
    biased router and experts, clamped GLU)."""
    from speculum.kernels import model_ops
    from speculum.kernels.grouped_moe import few_pairs

    gen = torch.Generator(device="cuda").manual_seed(rows)
    experts, k, hidden, inter = 32, 4, 256, 128

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    x = randn(rows, hidden)
    router = randn(experts, hidden, scale=hidden**-0.5)
    gate_up = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    down = randn(experts, hidden, inter, scale=inter**-0.5)
    routing = ()
    if family == "deepseek":
        bias = torch.randn(experts, generator=gen, device="cuda")
        routing = ("sigmoid", "noaux_tc", 4, 2, 2.5, bias, True)
    if family == "gpt-oss":
        biases = (randn(experts), randn(experts, 2 * inter), randn(experts, hidden))
        routing = ("softmax_topk", "greedy", 1, 1, 1.0, None, False, *biases, 7.0, 1.702)
    assert few_pairs(rows * k, experts) == (rows < 8)
    ours = model_ops.moe(x, router, gate_up, down, k, True, *routing)
    expected = model_ops.moe_reference(x, router, gate_up, down, k, True, *routing)
    error = (ours.float() - expected.float()).norm() / expected.float().norm()
    assert error < 1e-2
