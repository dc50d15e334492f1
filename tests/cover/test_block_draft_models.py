"""Block-draft checkpoints: the z-lab DFlash and SGLang/DeepSpec DSpark layouts read strictly,
written back, and the errors a user meets (another target, a missing tensor, the speculators
slot convention)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_eagle import TARGET

from speculum.models.block_draft import (
    DSparkHead,
    default_target_layers,
    load_block_draft,
    random_block_draft,
    save_block_draft,
)
from speculum.models.config import UnsupportedModel
from speculum.models.draft_loading import DraftTargetMismatch
from speculum.models.loading import CheckpointError, save_model
from speculum.runtime.engine import SpecOptions, build_engine
from speculum.runtime.generate import generate
from speculum.spec import block as spec_block
from speculum.spec.paged import extend_batch
from speculum.state import PagedKV


def outputs(head, tokens=(3, 1, 4, 1, 5)):
    """The head's block hidden states and step logits after writing a context: what a loaded
    head must reproduce."""
    pool = head.new_pool(6, 4)
    table = torch.tensor([[1, 2, 3]])
    empty = PagedKV(page_table=table, seq_lens=torch.tensor([0]), page_size=4)
    context = extend_batch(empty, torch.tensor([list(tokens)]), torch.tensor([5]))
    _, captured = TARGET(context, TARGET.new_pool(6, 4), head.capture_layers)
    head.write_context(context, pool, captured)
    kv = PagedKV(page_table=table, seq_lens=torch.tensor([5]), page_size=4)
    batch = spec_block.block_batch(kv, torch.tensor([2]), 3, head.config.mask_token_id)
    hidden = head(batch, pool)
    out = [hidden]
    if isinstance(head, DSparkHead):
        state = head.initial_state(hidden[:, 0])
        logits, state = head.step_logits(
            head.logits(hidden[:, 0]), torch.tensor([7]), hidden[:, 0], state
        )
        out.append(logits)
        if head.config.confidence:
            out.append(head.confidence(hidden[:, 0], torch.tensor([7])))
    return out


def assert_same(a, b):
    for x, y in zip(outputs(a), outputs(b), strict=True):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize(
    "options",
    [
        {"algorithm": "dflash"},
        {"algorithm": "dflash", "num_layers": 3, "target_layers": (3, 0, 2)},
        {"algorithm": "dspark"},
        {"algorithm": "dspark", "markov_kind": "gated", "confidence": False},
        {"algorithm": "dspark", "markov_kind": "rnn", "markov_rank": 8},
    ],
)
def test_saved_drafts_load_back(tmp_path: Path, options: dict) -> None:
    head = random_block_draft(TARGET, seed=3, std=0.2, **options)
    loaded = load_block_draft(save_block_draft(head, tmp_path), TARGET, options["algorithm"])
    assert loaded.config == head.config
    assert_same(head, loaded)


def zlab_config(head, *, nested: bool = True) -> dict:
    """A config.json as z-lab publishes DFlash drafts (a Qwen3 config plus the DFlash fields)."""
    layer = head.config.layer
    fields = {"mask_token_id": head.config.mask_token_id, "target_layer_ids": [1, 1]}
    raw = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.num_heads,
        "num_key_value_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "num_hidden_layers": layer.num_layers,
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_theta": layer.rope_theta,
        "max_position_embeddings": 256,
        "vocab_size": layer.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "block_size": head.config.block_size,
        "num_target_layers": TARGET.config.num_layers,
    }
    return {**raw, "dflash_config": fields} if nested else {**raw, **fields}


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("prefix", ["", "model."])
def test_the_zlab_dflash_layout_loads(tmp_path: Path, nested: bool, prefix: str) -> None:
    head = random_block_draft(TARGET, "dflash", seed=4, std=0.2, block_size=16)
    tensors = {prefix + n: p.detach().clone() for n, p in head.named_parameters()}
    tensors[prefix + "layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # older exports
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(zlab_config(head, nested=nested)))
    loaded = load_block_draft(tmp_path, TARGET, "dflash")
    assert loaded.config.block_size == 16 and loaded.capture_layers == (1, 1)
    assert_same(head, loaded)


def test_deepseek_prefixed_dspark_fields_are_read(tmp_path: Path) -> None:
    head = random_block_draft(TARGET, "dspark", seed=5, std=0.2, block_size=5, markov_rank=4)
    save_block_draft(head, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for name in ("block_size", "markov_rank", "mask_token_id", "target_layer_ids", "dflash_config"):
        raw.pop(name)
    raw |= {
        "architectures": ["Qwen3DSparkModel"],
        "dspark_block_size": 5,
        "dspark_markov_rank": 4,
        "dspark_noise_token_id": head.config.mask_token_id,
        "dspark_target_layer_ids": list(head.capture_layers),
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert_same(head, load_block_draft(tmp_path, TARGET, "dspark"))


def test_speculators_dspark_checkpoints_are_refused_with_the_reason(tmp_path: Path) -> None:
    head = random_block_draft(TARGET, "dspark", seed=5, std=0.2)
    save_block_draft(head, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "speculators_model_type": "dspark"}))
    with pytest.raises(UnsupportedModel, match=r"anchor \+ j.*one position early"):
        load_block_draft(tmp_path, TARGET, "dspark")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    return {
        name: save_block_draft(
            random_block_draft(TARGET, name, seed=6, std=0.2), tmp_path_factory.mktemp(name)
        )
        for name in ("dflash", "dspark")
    }


def edited(folder: Path, tmp_path: Path, config=None, tensors=None) -> Path:
    from safetensors.torch import load_file

    raw = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    if config:
        config(raw)
    if tensors:
        tensors(weights)
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    ("name", "config", "tensors", "error", "match"),
    [
        ("dflash", None, lambda w: w.pop("fc.weight"), CheckpointError, "fc.weight"),
        ("dflash", None, lambda w: w.update(extra=torch.ones(1)), CheckpointError, "extra"),
        (
            "dspark",
            None,
            lambda w: w.pop("confidence_head.proj.weight"),
            CheckpointError,
            "confidence_head",
        ),
        (
            "dflash",
            lambda c: c.update(num_target_layers=9),
            None,
            DraftTargetMismatch,
            "9-layer target",
        ),
        ("dflash", lambda c: c.update(vocab_size=99), None, DraftTargetMismatch, "vocabulary"),
        (
            "dflash",
            lambda c: c["dflash_config"].update(target_layer_ids=[0, 7]),
            None,
            UnsupportedModel,
            "target_layer_ids",
        ),
        (
            "dflash",
            lambda c: c["dflash_config"].pop("mask_token_id"),
            None,
            CheckpointError,
            "mask",
        ),
        ("dspark", lambda c: c.update(markov_rank=0), None, UnsupportedModel, "markov_rank"),
        (
            "dspark",
            lambda c: c.update(markov_head_type="lstm"),
            None,
            UnsupportedModel,
            "markov_head_type",
        ),
        (
            "dflash",
            lambda c: c.update(layer_types=["sliding_attention"] * 2),
            None,
            UnsupportedModel,
            "full attention",
        ),
    ],
)
def test_loading_is_strict(saved, tmp_path, name, config, tensors, error, match) -> None:
    with pytest.raises(error, match=match):
        load_block_draft(edited(saved[name], tmp_path, config, tensors), TARGET, name)


def test_the_other_algorithm_is_named(saved) -> None:
    with pytest.raises(CheckpointError, match="--algorithm dspark"):
        load_block_draft(saved["dspark"], TARGET, "dflash")
    with pytest.raises(CheckpointError, match="--algorithm dflash"):
        load_block_draft(saved["dflash"], TARGET, "dspark")


def test_default_target_layers_are_evenly_spaced() -> None:
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)  # z-lab's Qwen3-8B draft
    assert default_target_layers(36, 1) == (18,)
    assert default_target_layers(8, 2) == (1, 5)
    assert default_target_layers(2, 2) == (1, 1)


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_engine_runs_a_draft_folder(tmp_path: Path, saved, name: str) -> None:
    save_model(TARGET, tmp_path / "target")
    engine = build_engine(
        tmp_path / "target",
        algorithm=name,
        draft=saved[name],
        spec=SpecOptions(block_size=3),
        max_context=64,
    )
    assert engine.pipeline.max_tokens_per_step == (3 if name == "dflash" else 4)
    (result,) = generate([[1, 2, 3]], engine=engine, max_new_tokens=6)
    plain = build_engine(tmp_path / "target", max_context=64)
    assert result.token_ids == generate([[1, 2, 3]], engine=plain, max_new_tokens=6)[0].token_ids
