"""Multi-head latent attention targets on the GPU: the latent cache inside captured rounds.

- fp32: over a DeepSeek-V3-shaped target (low-rank query, interleaved rope, values narrower
  than keys), each pipeline's captured rounds emit exactly plain greedy decoding's tokens, and
  exactly what its eager rounds emit (the Triton latent-attention and commit kernels on the
  latent layout).
- bf16: captured MLA rounds run and emit every token asked for.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from test_graphs_cuda import CHAIN, PROMPTS, TREE, VOCAB, _tokens

from speculum.models.config import MLAConfig
from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.models.multi_layer_eagle import random_multi_layer

pytestmark = pytest.mark.gpu


def _mla_target(dtype: torch.dtype = torch.float32):
    mla = MLAConfig(
        q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12
    )
    config = tiny_config(
        vocab_size=VOCAB,
        num_layers=4,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        architecture="DeepseekV3ForCausalLM",
        mla=mla,
    )
    return random_model(config, seed=5, std=0.3).to("cuda", dtype)


def _drafts(target) -> dict:
    return {
        "eagle chain": ("eagle", random_draft(target, "eagle", seed=2, std=0.3), CHAIN),
        "eagle3 tree": ("eagle3", random_draft(target, "eagle3", seed=2, std=0.3), TREE),
        "mtp tree": ("mtp", random_draft(target, "mtp", seed=2, std=0.3), TREE),
        "multi_layer_eagle": (
            "multi_layer_eagle",
            random_multi_layer(target, 3, seed=2, std=0.3),
            CHAIN,
        ),
    }


@pytest.mark.parametrize("label", ["eagle chain", "eagle3 tree", "mtp tree", "multi_layer_eagle"])
def test_fp32_captured_rounds_on_an_mla_target_equal_plain_and_eager(label):
    target = _mla_target()
    algorithm, draft, spec = _drafts(target)[label]
    plain = _tokens(target, cuda_graphs=False)
    assert _tokens(target) == plain
    options = dict(algorithm=algorithm, draft=draft, spec=spec)
    assert _tokens(target, **options) == plain
    assert _tokens(target, cuda_graphs=False, **options) == plain


def test_bf16_captured_mla_rounds_run():
    target = _mla_target(torch.bfloat16)
    algorithm, draft, spec = _drafts(target)["eagle3 tree"]
    tokens = _tokens(target, algorithm=algorithm, draft=draft, spec=spec)
    assert [len(t) for t in tokens] == [24] * len(PROMPTS)
