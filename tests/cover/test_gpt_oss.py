"""gpt-oss (``GptOssForCausalLM``) as a target: loaded strictly from the folder transformers'
``save_pretrained`` writes, equal to transformers in float32 (logits, and greedy decoding far
past the 8-key window of its alternating windowed layers), with attention sinks, YaRN rope,
biased attention and its biased, clamped-GLU experts; speculative pipelines equal plain
decoding on it; a snapshot replays bit for bit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from heads import (
    agreeing_head,
    assert_sampled_snapshot_replays,
    pipeline_engine,
    transformers_greedy,
)
from safetensors.torch import load_file, save_file

from speculum import kernels
from speculum.models.config import CheckpointError, UnsupportedModel
from speculum.models.decoder import SparseMoE, dense_batch
from speculum.models.draft import random_draft
from speculum.models.loading import load_model, save_model
from speculum.models.standalone import StandaloneHead
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.paged import causal_mask, extend_batch
from speculum.state.kv import PagedKV

transformers.logging.disable_progress_bar()

VOCAB = 128
WINDOW = 8
PROMPTS = [[3, 17, 42, 5, 88, 1, 9, 60, 2, 11, 7], [1, 2]]
NEW_TOKENS = 40


def hf_gpt_oss() -> transformers.GptOssForCausalLM:
    """A float32 gpt-oss of 4 layers (windowed, full, windowed, full), 4 experts (top 2),
    YaRN rope, every parameter random and wide (std 2 / sqrt(fan_in); sinks and biases 0.5),
    with a clamp limit of 2 so that the experts' clamps bite."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        swiglu_limit=2.0,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    )
    model = transformers.GptOssForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" in key:
                continue
            fan_in = param.shape[1] if key.endswith("experts.gate_up_proj") else param.shape[-1]
            std = 2 * fan_in**-0.5 if param.dim() >= 2 else 0.5
            if key.endswith("experts.down_proj"):
                std = 2 * param.shape[1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> tuple[transformers.GptOssForCausalLM, Path]:
    """The transformers model and the folder its ``save_pretrained`` wrote."""
    model = hf_gpt_oss()
    folder = tmp_path_factory.mktemp("gpt-oss")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def target(hf_checkpoint):
    """The checkpoint loaded by speculum."""
    return load_model(hf_checkpoint[1])


def test_the_checkpoint_loads_into_windowed_sink_attention_and_biased_experts(
    hf_checkpoint, target
) -> None:
    """Alternating windows from ``layer_types``, sinks and the experts' interleaved gate/up
    columns land where transformers' own modules read them."""
    hf, _ = hf_checkpoint
    assert [layer.self_attn.window for layer in target.model.layers] == [WINDOW, 0, WINDOW, 0]
    ours, theirs = target.model.layers[1], hf.model.layers[1]
    assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks)
    assert isinstance(ours.mlp, SparseMoE)
    gate_up = theirs.mlp.experts.gate_up_proj[2]  # [hidden, 2 * inter], gate at even columns
    assert torch.equal(ours.mlp.experts_gate_up[2, :32], gate_up[:, 0::2].T)
    assert torch.equal(ours.mlp.experts_gate_up[2, 32:], gate_up[:, 1::2].T)
    assert torch.equal(ours.mlp.experts_down[2], theirs.mlp.experts.down_proj[2].T)
    assert torch.equal(ours.mlp.gate.bias, theirs.mlp.router.bias)


def test_logits_equal_transformers_cache_free_and_paged(hf_checkpoint, target) -> None:
    """Float32 logits over 20 tokens (past the window) agree with transformers' forward, from
    the cache-free (training) forward and from the paged one."""
    hf, _ = hf_checkpoint
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    kv = PagedKV(
        page_table=torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]),
        seq_lens=torch.tensor([0, 0]),
        page_size=4,
    )
    with torch.no_grad():
        expected = hf(tokens).logits
        dense = target.logits(target(dense_batch(tokens), None)[0])
        batch = extend_batch(kv, tokens, torch.tensor([20, 20]))
        paged = target.logits(target(batch, target.new_pool(11, 4))[0])
    torch.testing.assert_close(dense, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(paged, expected, rtol=1e-4, atol=1e-4)


def test_greedy_decoding_past_the_window_equals_transformers_generate(
    hf_checkpoint, target
) -> None:
    """40 greedy tokens (five windows) through the scheduler, chunked prefill and pages of 4,
    are transformers' ``generate`` tokens; the same weights without the windows, or without
    the sinks, give other tokens."""
    hf, _ = hf_checkpoint
    expected = transformers_greedy(hf, PROMPTS, NEW_TOKENS)

    def decode(model) -> list[list[int]]:
        engine = engine_from_model(model, page_size=4, max_context=64, prefill_budget=7)
        results = generate(PROMPTS, engine=engine, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        return [list(r.token_ids) for r in results]

    assert decode(target) == expected
    # The windows and the sinks are what match: without either, other tokens.
    for change in ("window", "sinks"):
        changed = copy.deepcopy(target)
        for layer in changed.model.layers:
            if change == "window":
                layer.self_attn.window = 0
            else:
                layer.self_attn.sinks.fill_(float("-inf"))
        assert decode(changed) != expected


def test_saved_folders_read_back_in_transformers(hf_checkpoint, target, tmp_path) -> None:
    """``save_model`` writes the hub's layout back: transformers loads every tensor unchanged,
    and speculum reads the same config and weights."""
    hf, _ = hf_checkpoint
    save_model(target, tmp_path)
    again = load_model(tmp_path)
    assert again.config == target.config
    ours, reloaded = target.state_dict(), again.state_dict()
    assert all(torch.equal(ours[k], reloaded[k]) for k in ours)
    back = transformers.GptOssForCausalLM.from_pretrained(tmp_path).state_dict()
    theirs = hf.state_dict()
    assert sorted(back) == sorted(theirs)
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)


def test_loading_is_strict_about_keys(hf_checkpoint, tmp_path) -> None:
    """A missing sink or an extra tensor is refused, naming the key."""
    _, folder = hf_checkpoint
    tensors = load_file(str(folder / "model.safetensors"))
    config = (folder / "config.json").read_text()
    (tmp_path / "config.json").write_text(config)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.2.self_attn.sinks"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing weights \['model.layers.2.self_attn.sinks"):
        load_model(tmp_path)
    save_file(
        {**tensors, "model.layers.0.mlp.experts.bias": torch.zeros(4)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(CheckpointError, match=r"unexpected weights \['model.layers.0.mlp.experts"):
        load_model(tmp_path)


def test_mxfp4_checkpoints_are_refused_with_the_fix(hf_checkpoint, tmp_path) -> None:
    """The released (MXFP4) checkpoints' config names the quantization; the error says to
    dequantize to bfloat16 first."""
    _, folder = hf_checkpoint
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModel, match=r"'mxfp4'.*dequantize to bfloat16 first"):
        load_model(tmp_path)


def test_the_attention_op_takes_sinks_and_passes_its_checks() -> None:
    """``speculum::paged_attention`` with sinks passes torch's custom-op checks, and a sink
    scales each query's output by the share its keys keep of the softmax."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 4, 4, 2, 8, generator=gen)
    q = torch.randn(2, 3, 4, 8, generator=gen)
    args = (torch.tensor([[1, 2], [3, 0]]), torch.tensor([4, 0]), torch.tensor([3, 2]))
    call = (q, k_cache, v_cache, *args, causal_mask(2, 3), 0.3, 3)
    sinks = torch.randn(4, generator=gen)
    torch.library.opcheck(kernels.paged_attention, (*call, sinks))
    plain, sunk = kernels.paged_attention(*call), kernels.paged_attention(*call, sinks)
    # Query 0 of request 0 sees its last 3 keys (window 3): prefix indices 2, 3 and itself, 4.
    keys = k_cache[1:].flatten(0, 1)[2:5].repeat_interleave(2, 1)
    logits = torch.einsum("hd,khd->hk", q[0, 0], keys) * 0.3
    keep = logits.exp().sum(-1) / (logits.exp().sum(-1) + sinks.exp())
    torch.testing.assert_close(sunk[0, 0], plain[0, 0] * keep[:, None])


@pytest.fixture(scope="module")
def pipelines(target) -> dict:
    """name -> (algorithm, draft, spec options) over the gpt-oss target: random EAGLE, EAGLE-3
    and MTP heads (the MTP layer of gpt-oss's own kind: sinks, biased experts), which rarely
    agree (rollback almost every round), and the target drafting for itself, which always
    agrees (the deepest path is committed)."""
    return {
        "plain": ("plain", None, {}),
        "eagle chain": ("eagle", agreeing_head(target, "eagle"), {"num_steps": 3}),
        "eagle tree": ("eagle", agreeing_head(target, "eagle"), "tree"),
        "eagle3 tree": ("eagle3", random_draft(target, "eagle3", seed=11, std=0.3), "tree"),
        "mtp tree": ("mtp", agreeing_head(target, "mtp"), "tree"),
        "standalone self": ("standalone", StandaloneHead(target, VOCAB), "tree"),
        "ngram": ("ngram", None, {"num_draft_tokens": 6}),
    }


@pytest.mark.parametrize(
    "name", ["eagle chain", "eagle tree", "eagle3 tree", "mtp tree", "standalone self", "ngram"]
)
def test_every_pipeline_equals_plain_greedy(pipelines, target, name) -> None:
    """Token for token, 30 tokens (past the window), a batch with chunked prefill: chain and
    tree verify, draft-extend and commit keep each windowed layer's window and every sink."""
    prompts = [[5, 1, 9, 60, 2, 2, 11, 7, 5, 1], [9, 9, 9], [4, 8]]
    limits = {"page_size": 4, "prefill_budget": 6, "max_context": 64}
    tree = (4, 2, 8)

    def run(pipe: str) -> list[list[int]]:
        engine = pipeline_engine(target, pipelines[pipe], tree, **limits)
        return [list(r.token_ids) for r in generate(prompts, engine=engine, max_new_tokens=30)]

    assert run(name) == run("plain")


def test_snapshot_restore_replays_exactly(pipelines, target) -> None:
    """A snapshot of a sampled batch on gpt-oss under EAGLE, taken past the window, restored,
    replays bit for bit."""
    engine = pipeline_engine(target, pipelines["eagle chain"], (0, 0, 0), page_size=4)
    assert_sampled_snapshot_replays(engine, steps=4, max_new_tokens=16)
