"""A checkpoint that loads but cannot run fails at load, naming the file, the key and the value.

Each case writes a tiny valid checkpoint (target or draft), corrupts one thing in it and loads
it: the error is a ``CheckpointError`` whose message names the file (``config.json``,
``generation_config.json`` or the safetensors file) and the key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_config
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from speculum.models.config import DecoderConfig
from speculum.models.draft_loading import load_draft, save_random_draft
from speculum.models.loading import CheckpointError, load_model, random_model, save_model

UP = "model.layers.0.mlp.up_proj.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A tiny valid Llama checkpoint (4 heads over 2 KV heads of 8 dims, 32 wide) to break."""
    return save_model(random_model(tiny_config(), seed=0), tmp_path / "target")


def edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the JSON object in ``path`` after ``edit`` changed it in place."""
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def edit_weight(path: Path, key: str, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Rewrite the safetensors file ``path`` with tensor ``key`` replaced by ``change`` of it."""
    tensors = load_file(str(path))
    tensors[key] = change(tensors[key])
    save_file(tensors, str(path), metadata={"format": "pt"})


def refused(load: Callable[[], object], *named: str) -> str:
    """The message of the ``CheckpointError`` ``load`` raises, checked to name each of
    ``named``."""
    with pytest.raises(CheckpointError) as info:
        load()
    message = str(info.value)
    for part in named:
        assert part in message, f"{part!r} not named in: {message}"
    return message


def set_keys(**changes: Any) -> Callable[[dict[str, Any]], None]:
    """A config edit setting ``changes``; a value of ``...`` removes the key."""

    def edit(raw: dict[str, Any]) -> None:
        for key, value in changes.items():
            if value is ...:
                raw.pop(key, None)
            else:
                raw[key] = value

    return edit


def rope_parameters_theta(theta: float) -> Callable[[dict[str, Any]], None]:
    """A config edit giving ``theta`` as transformers 5 writes it, in ``rope_parameters``."""

    def edit(raw: dict[str, Any]) -> None:
        raw.pop("rope_theta")
        raw["rope_parameters"]["rope_theta"] = theta

    return edit


@pytest.mark.parametrize(
    ("edit", "key", "value"),
    [
        (set_keys(num_key_value_heads=3), "num_key_value_heads", "3"),
        (set_keys(rope_theta=0, rope_parameters=...), "rope_theta", "0"),
        (set_keys(rope_theta=-10000.0, rope_parameters=...), "rope_theta", "-10000.0"),
        (rope_parameters_theta(0.0), "rope_parameters.rope_theta", "0.0"),
        (set_keys(rope_theta=500000.0), "rope_theta", "500000.0"),
        (set_keys(rms_norm_eps=0), "rms_norm_eps", "0"),
        (set_keys(rms_norm_eps=-1e-6), "rms_norm_eps", "-1e-06"),
        (set_keys(vocab_size=0), "vocab_size", "0"),
        (set_keys(hidden_size="32"), "hidden_size", "'32'"),
        (set_keys(intermediate_size=63.5), "intermediate_size", "63.5"),
        (set_keys(num_hidden_layers=True), "num_hidden_layers", "True"),
        (set_keys(num_attention_heads=-4), "num_attention_heads", "-4"),
        (set_keys(max_position_embeddings=0), "max_position_embeddings", "0"),
        (set_keys(head_dim=..., num_attention_heads=6, num_key_value_heads=2), "head_dim", "6"),
        (set_keys(head_dim=7), "head_dim", "7"),
        (set_keys(eos_token_id=64), "eos_token_id", "64"),
        (set_keys(eos_token_id=[1, "2"]), "eos_token_id", "'2'"),
    ],
    ids=[
        "heads not a multiple of kv heads",
        "rope_theta 0",
        "rope_theta negative",
        "rope_parameters.rope_theta 0",
        "rope_theta disagrees with rope_parameters",
        "rms_norm_eps 0",
        "rms_norm_eps negative",
        "vocab_size 0",
        "hidden_size a string",
        "intermediate_size fractional",
        "num_hidden_layers a bool",
        "num_attention_heads negative",
        "max_position_embeddings 0",
        "hidden_size not a multiple of heads and no head_dim",
        "head_dim odd",
        "eos outside the vocabulary",
        "eos not an integer",
    ],
)
def test_config_values_no_model_runs_with_are_refused(
    checkpoint: Path, edit: Callable, key: str, value: str
) -> None:
    """A config.json value the decoder cannot run with fails the load, naming the file, the
    key and the value given."""
    edit_json(checkpoint / "config.json", edit)
    refused(lambda: load_model(checkpoint), str(checkpoint / "config.json"), key, value)


def test_head_dim_inconsistent_with_the_weights_is_named(checkpoint: Path) -> None:
    """A head_dim the attention weights do not have is reported as such, with the value the
    weights imply, not as a generic shape mismatch."""
    edit_json(checkpoint / "config.json", set_keys(head_dim=16))
    message = refused(
        lambda: load_model(checkpoint), str(checkpoint / "model.safetensors"), Q, "head_dim 16"
    )
    assert "num_attention_heads 4 × head_dim 16 = 64" in message
    assert message.endswith("set head_dim to 8 in config.json")


def test_kv_heads_inconsistent_with_the_weights_are_named(checkpoint: Path) -> None:
    """K/V projections of other rows than num_key_value_heads × head_dim, q_proj being right,
    name num_key_value_heads and the value the weights imply (not head_dim)."""
    edit_json(checkpoint / "config.json", set_keys(num_key_value_heads=1))
    message = refused(
        lambda: load_model(checkpoint),
        str(checkpoint / "model.safetensors"),
        "model.layers.0.self_attn.k_proj.weight",
        "num_key_value_heads 1",
    )
    assert message.endswith("set num_key_value_heads to 2 in config.json")


def test_an_explicit_head_dim_the_weights_have_loads(tmp_path: Path) -> None:
    """Qwen3 sets a head_dim other than hidden_size / num_attention_heads: when the weights
    have it, the checkpoint loads."""
    config = tiny_config(architecture="Qwen3ForCausalLM", qk_norm=True, head_dim=16)
    folder = save_model(random_model(config, seed=0), tmp_path)
    loaded = load_model(folder)
    assert loaded.config.head_dim == 16
    assert loaded.model.layers[0].self_attn.q_proj.weight.shape == (64, 32)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool], ids=["int32", "bool"])
def test_integer_or_bool_weights_are_refused(checkpoint: Path, dtype: torch.dtype) -> None:
    """A non-float tensor where a float weight belongs fails the load (it was cast silently),
    naming the safetensors file, the key and its dtype."""
    edit_weight(checkpoint / "model.safetensors", UP, lambda t: (t * 100).to(dtype))
    name = {torch.int32: "I32", torch.bool: "BOOL"}[dtype]
    refused(lambda: load_model(checkpoint), str(checkpoint / "model.safetensors"), UP, name)


@pytest.mark.parametrize(
    "text", ['{"eos_token_id": [1, 2', "[1, 2]", "\udcff"], ids=["invalid", "list", "not utf-8"]
)
def test_unreadable_generation_config_is_named(checkpoint: Path, text: str) -> None:
    """A generation_config.json that is not a JSON object fails the load naming the file
    (it was a bare JSONDecodeError)."""
    path = checkpoint / "generation_config.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    refused(lambda: load_model(checkpoint), str(path))


def test_generation_config_eos_outside_the_vocabulary_is_named(checkpoint: Path) -> None:
    """generation_config.json's EOS ids must be token ids of the model's vocabulary."""
    path = checkpoint / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": [1, 99]}))
    refused(lambda: load_model(checkpoint), str(path), "eos_token_id", "99")


def test_a_valid_generation_config_adds_eos_ids(checkpoint: Path) -> None:
    """Valid EOS ids in generation_config.json join config.json's."""
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert load_model(checkpoint).config.eos_token_ids == (5, 7)


@pytest.fixture
def eagle3_draft(tmp_path: Path, tiny_model) -> Path:
    """A valid EAGLE-3 draft for the tiny target, in SGLang's layout."""
    return save_random_draft(tiny_model, "eagle3", tmp_path / "eagle3")


def test_draft_with_an_integer_weight_is_refused(eagle3_draft: Path, tiny_model) -> None:
    """Draft loaders go through the same checks: an int32 weight is named with its file."""
    edit_weight(eagle3_draft / "model.safetensors", "fc.weight", lambda t: t.to(torch.int32))
    refused(
        lambda: load_draft(eagle3_draft, tiny_model, "eagle3"),
        str(eagle3_draft / "model.safetensors"),
        "fc.weight",
        "I32",
    )


def test_reference_draft_with_a_bool_weight_is_refused(tmp_path: Path, tiny_model) -> None:
    """The EAGLE reference's pytorch_model.bin is checked too (its d2t and t2d, integer and
    bool by design, still load)."""
    folder = save_random_draft(tiny_model, "eagle3", tmp_path, layout="eagle3-reference")
    path = folder / "pytorch_model.bin"
    tensors = torch.load(path, weights_only=True)
    torch.save({**tensors, "norm.weight": tensors["norm.weight"].bool()}, path)
    refused(lambda: load_draft(folder, tiny_model, "eagle3"), str(folder), "norm.weight", "bool")


@pytest.mark.parametrize(
    ("edit", "file", "key"),
    [
        (set_keys(num_key_value_heads=3), "config.json", "num_key_value_heads"),
        (set_keys(rms_norm_eps=0.0), "config.json", "rms_norm_eps"),
        (set_keys(head_dim=16), "model.safetensors", "head_dim 16"),
    ],
    ids=["heads not a multiple of kv heads", "rms_norm_eps 0", "head_dim vs weights"],
)
def test_draft_config_values_are_refused(
    eagle3_draft: Path, tiny_model, edit: Callable, file: str, key: str
) -> None:
    """A draft's config.json is checked as a target's is, naming the draft's file."""
    edit_json(eagle3_draft / "config.json", edit)
    refused(lambda: load_draft(eagle3_draft, tiny_model, "eagle3"), str(eagle3_draft / file), key)


SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)
NOT_POSITIVE_INTEGERS = st.one_of(
    st.integers(max_value=0),
    st.booleans(),
    st.text(max_size=3),
    st.floats(allow_nan=True).filter(lambda x: not float(x).is_integer() or x <= 0),
    st.lists(st.integers(), max_size=2),
)


@given(key=st.sampled_from(SIZES), value=NOT_POSITIVE_INTEGERS)
def test_sizes_must_be_positive_integers(key: str, value: Any) -> None:
    """Every size in config.json is a positive integer, or the config is refused naming it."""
    raw = {**tiny_config().to_dict(), key: value}
    with pytest.raises(CheckpointError, match=f"^dir/config.json: {key} is "):
        DecoderConfig.from_dict(raw, "dir/config.json")


@given(heads=st.integers(1, 8), kv_heads=st.integers(1, 8))
def test_heads_must_group_over_kv_heads(heads: int, kv_heads: int) -> None:
    """A config loads exactly when its query heads split evenly over its KV heads."""
    changes = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 8}
    raw = {**tiny_config().to_dict(), **changes}
    if heads % kv_heads:
        with pytest.raises(CheckpointError, match="num_key_value_heads"):
            DecoderConfig.from_dict(raw)
    else:
        config = DecoderConfig.from_dict(raw)
        assert (config.num_heads, config.num_kv_heads) == (heads, kv_heads)


def test_integral_float_sizes_are_read_as_integers() -> None:
    """Exporters that write 4096.0 for 4096 are read as they mean it."""
    raw = {**tiny_config().to_dict(), "max_position_embeddings": 256.0}
    assert DecoderConfig.from_dict(raw) == tiny_config()
