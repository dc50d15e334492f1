"""DeepSeek-style routing (DeepSeek-V2's greedy and group-limited greedy, DeepSeek-V3's and
GLM-4.5's noaux_tc with its correction bias, routed scaling, shared experts) against
transformers' own MoE modules, and the routing fields a config.json is refused for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from test_models import relative_error
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from speculum.kernels import model_ops
from speculum.models.config import DecoderConfig, MoEConfig
from speculum.models.decoder import SparseMoE
from speculum.models.loading import load_model

HIDDEN = 16
EXPERT_WIDTH = 8


@st.composite
def routings(draw: st.DrawFn, topk_method: str) -> dict:
    """Routing fields transformers' DeepSeek configs take, consistent for ``topk_method``:
    experts in groups (two or more per group for noaux_tc, which ranks a group by its best
    two), a top-k the allowed groups can fill, and DeepSeek-V3's renormalisation switch."""
    experts = draw(st.sampled_from([4, 6, 8, 12]))
    least = 2 if topk_method == "noaux_tc" else 1
    n_group = 1
    if topk_method != "greedy":
        n_group = draw(st.sampled_from([g for g in range(1, experts + 1) if experts % g == 0]))
        n_group = n_group if experts // n_group >= least else experts // least
    topk_group = draw(st.integers(1, n_group))
    allowed = experts if topk_method == "greedy" else topk_group * (experts // n_group)
    return {
        "n_routed_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, allowed)),
        "n_group": n_group,
        "topk_group": topk_group,
        "n_shared_experts": draw(st.integers(1, 2)),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5, 16.0])),
        "norm_topk_prob": topk_method == "noaux_tc" and draw(st.booleans()),
    }


def transformers_moe(topk_method: str, routing: dict, seed: int) -> torch.nn.Module:
    """DeepSeek-V2's MoE block (greedy, group_limited_greedy) or DeepSeek-V3's (noaux_tc),
    every weight and the correction bias drawn at random."""
    fields = {
        "hidden_size": HIDDEN,
        "num_attention_heads": 2,
        "moe_intermediate_size": EXPERT_WIDTH,
        **routing,
    }
    if topk_method == "noaux_tc":
        module = DeepseekV3MoE(transformers.DeepseekV3Config(**fields))
    else:
        module = DeepseekV2Moe(transformers.DeepseekV2Config(topk_method=topk_method, **fields))
    module.config._experts_implementation = "eager"
    generator = torch.Generator().manual_seed(seed)
    tensors = [*module.named_parameters(), *module.named_buffers()]
    with torch.no_grad():
        for _, tensor in tensors:
            std = tensor.shape[-1] ** -0.5 if tensor.dim() >= 2 else 0.3
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)
    return module.eval()


def ours_like(theirs: torch.nn.Module, topk_method: str, routing: dict) -> SparseMoE:
    """speculum's MoE block with ``theirs``'s routing and weights."""
    moe = MoEConfig(
        num_experts=routing["n_routed_experts"],
        top_k=routing["num_experts_per_tok"],
        expert_intermediate_size=EXPERT_WIDTH,
        norm_topk_prob=routing["norm_topk_prob"],
        scoring_func="sigmoid" if topk_method == "noaux_tc" else "softmax",
        topk_method=topk_method,
        n_group=routing["n_group"],
        topk_group=routing["topk_group"],
        routed_scaling_factor=routing["routed_scaling_factor"],
        n_shared_experts=routing["n_shared_experts"],
        float32_router=True,
    )
    ours = SparseMoE(tiny_config(hidden_size=HIDDEN, moe=moe)).eval().requires_grad_(False)
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        if ours.gate.e_score_correction_bias is not None:
            ours.gate.e_score_correction_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.experts_gate_up.copy_(theirs.experts.gate_up_proj)
        ours.experts_down.copy_(theirs.experts.down_proj)
        ours.shared_experts.load_state_dict(theirs.shared_experts.state_dict())
    return ours


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy", "noaux_tc"])
@settings(max_examples=25)
@given(data=st.data(), rows=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_routing_matches_transformers_deepseek_moe(
    topk_method: str, data: st.DataObject, rows: int, seed: int
) -> None:
    """For any routing a DeepSeek config can hold and any tokens, the experts each token is
    sent to and their weights are transformers' (DeepSeek-V2's router for greedy and
    group_limited_greedy, DeepSeek-V3's for noaux_tc) bit for bit, and the block's output
    (routed experts plus shared experts) equals its output to float32 rounding (transformers
    runs each expert on its tokens alone, a matmul of other shape)."""
    routing = data.draw(routings(topk_method), label="routing")
    theirs = transformers_moe(topk_method, routing, seed)
    ours = ours_like(theirs, topk_method, routing)
    x = torch.randn(1, rows, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        _, their_weights, their_experts = theirs.gate(x)
        expected = theirs(x)
    moe = ours.moe
    weights = model_ops.moe_routing_weights(
        F.linear(x[0].float(), ours.gate.weight.float()),
        moe.top_k,
        moe.norm_topk_prob,
        moe.scoring_func,
        moe.topk_method,
        moe.n_group,
        moe.topk_group,
        moe.routed_scaling_factor,
        ours.gate.e_score_correction_bias,
        sorted_topk=False,
    )
    dense = torch.zeros_like(weights).scatter(-1, their_experts, their_weights)
    assert torch.equal(weights, dense)
    assert relative_error(ours(x), expected) < 1e-5


def test_the_moe_op_with_grouped_sigmoid_routing_passes_the_custom_op_checks() -> None:
    """``speculum::moe`` with noaux_tc routing (a correction bias, groups, scaling, float32
    router) passes torch's custom-op checks: schema, fake kernel, autograd registration (the
    compiled-autograd check, slow, runs on the default routing in test_moe)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    router = torch.randn(6, 8, generator=gen, requires_grad=True)
    gate_up = torch.randn(6, 12, 8, generator=gen, requires_grad=True)
    down = torch.randn(6, 8, 6, generator=gen)
    bias = torch.randn(6, generator=gen)
    routing = (3, True, "sigmoid", "noaux_tc", 3, 2, 2.5, bias, True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(model_ops.moe, (x, router, gate_up, down, *routing), test_utils=checks)


def glm_config(**changes: object) -> dict:
    """A tiny GLM-4.5 config.json: 6 experts in 3 groups, 2 groups per token, top 3."""
    config = transformers.Glm4MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=6,
        num_experts_per_tok=3,
        n_group=3,
        topk_group=2,
        moe_intermediate_size=8,
    )
    return {**config.to_dict(), "architectures": ["Glm4MoeForCausalLM"], **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"topk_group": 4}, r"topk_group 4 is more than n_group 3 .*fix topk_group in the file"),
        ({"n_routed_experts": 7}, r"n_group 3 does not divide the 7 routed experts"),
        ({"num_experts_per_tok": 7}, r"num_experts_per_tok 7 is more than the 6 experts"),
        ({"topk_group": 1}, r"num_experts_per_tok 3 is more than the 2 experts a token may use"),
        ({"n_group": 6}, r"n_group 6 leaves 1 expert per group; fix n_group"),
        ({"scoring_func": "tanh"}, r"scoring_func 'tanh' is not one of softmax, sigmoid"),
        ({"topk_method": "best"}, r"topk_method 'best' is not one of greedy, group_limited"),
        ({"routed_scaling_factor": 0}, r"routed_scaling_factor is 0; it must be a number above"),
        ({"n_routed_experts": None}, r"needs n_routed_experts \(the number of routed experts"),
        ({"norm_topk_prob": 1}, r"norm_topk_prob is 1; it must be true or false"),
        ({"rope_parameters": {"partial_rotary_factor": 0.1}}, r"partial_rotary_factor is 0.1;"),
    ],
    ids=[
        "topk_group above n_group",
        "groups uneven",
        "top-k above experts",
        "top-k above allowed groups",
        "one expert per group",
        "scoring",
        "method",
        "scale",
        "no count",
        "norm",
        "rotary",
    ],
)
def test_inconsistent_deepseek_routing_is_refused(changes: dict, message: str) -> None:
    """A GLM-4.5 config.json whose routing fields no model can route with fails at load,
    naming the file and the field."""
    with pytest.raises(ValueError, match=rf"config.json: .*{message}"):
        DecoderConfig.from_dict(glm_config(**changes), "config.json")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"topk_group": 4}, r"topk_group 4 is more than n_group 3"),
        ({"n_group": 0}, r"n_group 0 does not divide the 6 routed experts"),
        ({"topk_group": 0}, r"topk_group 0 must be at least 1"),
        ({"topk_group": 1, "top_k": 3}, r"num_experts_per_tok 3 is more than the 2 experts"),
        ({"scoring_func": "tanh"}, r"scoring_func 'tanh' is not one of softmax, sigmoid"),
    ],
)
def test_moe_config_refuses_impossible_group_routing(changes: dict, message: str) -> None:
    """Built directly (not from a file), group routing is checked too."""
    fields = {"top_k": 2, "n_group": 3, "topk_group": 2, **changes}
    with pytest.raises(ValueError, match=rf"MoEConfig: {message}"):
        MoEConfig(
            num_experts=6,
            expert_intermediate_size=8,
            norm_topk_prob=True,
            topk_method="noaux_tc",
            **fields,
        )


def test_glm_config_reads_transformers_defaults_and_dense_layers() -> None:
    """What the file leaves out is transformers' GLM-4.5 default (sigmoid noaux_tc routing,
    renormalised, one shared expert, layer 0 dense, half the head rotary); a
    ``first_k_dense_replace`` covering every layer makes a dense decoder, which reads back
    from the config.json it writes."""
    config = DecoderConfig.from_dict(glm_config())
    assert config.moe is not None
    assert (config.moe.scoring_func, config.moe.topk_method) == ("sigmoid", "noaux_tc")
    assert (config.moe.norm_topk_prob, config.moe.n_shared_experts) == (True, 1)
    assert config.moe.dense_layers == (0,) and config.rotary_dim == 8
    dense = DecoderConfig.from_dict(glm_config(first_k_dense_replace=2))
    assert dense.moe is None and dense == config.dense()
    assert DecoderConfig.from_dict(dense.to_dict()) == dense


def test_a_bfloat16_glm_model_keeps_its_routers_in_float32(tmp_path: Path) -> None:
    """Loaded (or cast) to bfloat16, a GLM-4.5 model keeps each router's weight and correction
    bias in float32 with the checkpoint's values, as transformers does: a bias rounded to
    bfloat16 would send tokens to other experts."""
    config = transformers.Glm4MoeConfig(**glm_config())
    hf = transformers.Glm4MoeForCausalLM(config)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    router = ours.model.layers[1].mlp.gate
    assert ours.model.layers[1].mlp.experts_down.dtype == torch.bfloat16
    assert (router.weight.dtype, router.e_score_correction_bias.dtype) == (torch.float32,) * 2
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(router.e_score_correction_bias, bias)
    assert ours.float().half().model.layers[1].mlp.gate.weight.dtype == torch.float32
