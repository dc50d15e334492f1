"""Hybrid targets (Qwen3-Next's gated DeltaNet, Nemotron-H's Mamba-2) on the GPU: the Triton
recurrent kernels (``kernels.triton_recurrent``) and their state pool inside captured rounds.

- The recurrent layers run the Triton kernels on CUDA (their launches show in a profile).
- fp32: captured rounds on the Triton kernels emit the tokens the CPU reference
  (``spec.recurrent``, token by token) emits, plain and speculative, chains and trees.
- fp32: plain decoding and every pipeline a hybrid runs (Qwen3-Next's MTP layer, multi-layer
  EAGLE and frozen-KV drafts on Qwen3-Next only), as captured rounds over several batch
  buckets, emit exactly plain eager greedy decoding's tokens (the target drafting for itself
  too: both pools hold recurrent slots), and overlapped scheduling changes nothing.
- bf16: captured hybrid rounds run and emit every token asked for.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from test_graphs_cuda import CHAIN, PROMPTS, TREE, VOCAB, _tokens

from speculum import kernels
from speculum.models.block_draft import random_block_draft
from speculum.models.config import LinearAttentionConfig, MambaConfig, MoEConfig
from speculum.models.draft import random_draft
from speculum.models.frozen_kv import random_frozen_kv
from speculum.models.loading import random_model
from speculum.models.multi_layer_eagle import random_multi_layer
from speculum.models.standalone import StandaloneHead
from speculum.runtime.engine import SpecOptions

pytestmark = pytest.mark.gpu

HYBRID = {
    "architecture": "Qwen3NextForCausalLM",
    "qk_norm": True,
    "partial_rotary_factor": 0.25,
    "attention_output_gate": True,
    "norm_offset": 1.0,
    "linear": LinearAttentionConfig(
        layer_types=("linear_attention", "full_attention") * 2,
        num_k_heads=2,
        num_v_heads=4,
        k_dim=16,
        v_dim=16,
        conv_kernel=4,
    ),
    "moe": MoEConfig(
        num_experts=4,
        top_k=2,
        expert_intermediate_size=32,
        norm_topk_prob=True,
        shared_expert_intermediate_size=48,
    ),
}


#: Nemotron-H: Mamba-2, attention (no rotary), Mamba-2, squared-ReLU MLP.
NEMOTRON_H = {
    "architecture": "NemotronHForCausalLM",
    "mamba": MambaConfig(
        layer_types=("linear_attention", "full_attention", "linear_attention", "mlp"),
        num_heads=4,
        head_dim=16,
        state_size=16,
        n_groups=2,
        conv_kernel=4,
        conv_bias=True,
        proj_bias=False,
        time_step_limit=(0.0, float("inf")),
    ),
}
KINDS = {"qwen3_next": HYBRID, "nemotron_h": NEMOTRON_H}


def _hybrid_target(kind: str = "qwen3_next", dtype: torch.dtype = torch.float32, device="cuda"):
    changes = KINDS[kind]
    config = tiny_config(vocab_size=VOCAB, num_layers=4, hidden_size=64, head_dim=16, **changes)
    return random_model(config, seed=5, std=0.3).to(device, dtype)


def _drafts(target) -> dict:
    block = {"seed": 1, "std": 0.3, "block_size": 6}
    return {
        "eagle chain": ("eagle", random_draft(target, "eagle", seed=2, std=0.3), CHAIN),
        "eagle3 tree": ("eagle3", random_draft(target, "eagle3", seed=2, std=0.3), TREE),
        "standalone self tree": ("standalone", StandaloneHead(target, VOCAB), TREE),
        "ngram": ("ngram", None, SpecOptions(num_draft_tokens=6)),
        "dflash": ("dflash", random_block_draft(target, "dflash", **block), SpecOptions()),
        "dspark": ("dspark", random_block_draft(target, "dspark", **block), SpecOptions()),
    }


#: The state-update kernel each kind's layers launch (beside ``_conv_kernel``).
STATE_KERNELS = {"qwen3_next": "_delta_rule_kernel", "nemotron_h": "_mamba2_kernel"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_recurrent_layers_run_the_triton_kernels_on_cuda(kind):
    assert kernels.DEVICE_KERNELS == "triton"
    target = _hybrid_target(kind)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _tokens(target, prompts=PROMPTS[:2], new_tokens=4, cuda_graphs=False)
    names = " ".join(event.key for event in prof.key_averages())
    assert "_conv_kernel" in names and STATE_KERNELS[kind] in names


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("label", ["eagle chain", "standalone self tree"])
def test_fp32_captured_rounds_on_the_kernels_equal_the_cpu_reference(label, kind):
    reference = _hybrid_target(kind, device="cpu")
    algorithm, draft, spec = _drafts(reference)[label]
    options = dict(algorithm=algorithm, spec=spec)
    expected_plain = _tokens(reference, cuda_graphs=False)
    expected = _tokens(reference, cuda_graphs=False, draft=draft, **options)
    target = _hybrid_target(kind)
    _, draft, _ = _drafts(target)[label]
    assert _tokens(target) == expected_plain
    assert _tokens(target, draft=draft, **options) == expected


def _qwen3_next_drafts(target) -> dict:
    """The drafts only Qwen3-Next runs (its MTP layer, and K/V-reading frozen-KV layers)."""
    return {
        "mtp tree": ("mtp", random_draft(target, "mtp", seed=2, std=0.3), TREE),
        "multi-layer eagle": (
            "multi_layer_eagle",
            random_multi_layer(target, 3, seed=2, std=0.3),
            SpecOptions(num_steps=3),
        ),
        "frozen kv": ("frozen_kv_mtp", random_frozen_kv(target, seed=2, std=0.3), TREE),
    }


LABELS = ["eagle chain", "eagle3 tree", "standalone self tree", "ngram", "dflash", "dspark"]
CASES = [(label, kind) for kind in sorted(KINDS) for label in LABELS] + [
    (label, "qwen3_next") for label in ("mtp tree", "multi-layer eagle", "frozen kv")
]


@pytest.mark.parametrize(("label", "kind"), CASES)
def test_fp32_captured_rounds_on_a_hybrid_target_equal_plain(label, kind):
    target = _hybrid_target(kind)
    drafts = _drafts(target) | (_qwen3_next_drafts(target) if kind == "qwen3_next" else {})
    algorithm, draft, spec = drafts[label]
    plain = _tokens(target, cuda_graphs=False)
    assert _tokens(target) == plain
    options = dict(algorithm=algorithm, draft=draft, spec=spec)
    assert _tokens(target, **options) == plain
    assert _tokens(target, overlap=True, **options) == plain


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_bf16_captured_hybrid_rounds_run(kind):
    target = _hybrid_target(kind, torch.bfloat16)
    algorithm, draft, spec = _drafts(target)["standalone self tree"]
    tokens = _tokens(target, algorithm=algorithm, draft=draft, spec=spec)
    assert [len(t) for t in tokens] == [24] * len(PROMPTS)
