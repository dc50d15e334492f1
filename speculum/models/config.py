"""Decoder configuration, parsed from a Hugging Face ``config.json``.

One config covers the Llama family as transformers writes it: ``LlamaForCausalLM`` (with Llama
3.1 ``rope_scaling``), ``Qwen2ForCausalLM`` (q/k/v bias), ``Qwen3ForCausalLM`` (q/k RMSNorm) and
``MistralForCausalLM``. Both spellings of the rotary settings are read: ``rope_theta`` plus
``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

__all__ = ["DecoderConfig", "UnsupportedModel", "SUPPORTED_ARCHITECTURES", "ROPE_TYPES"]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


class UnsupportedModel(ValueError):
    """A checkpoint whose architecture or settings this decoder does not implement."""


@attrs.define(frozen=True, slots=True, kw_only=True)
class DecoderConfig:
    """Shapes and options of a Llama-family decoder (all static)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str
    #: DeepSeek-V3-style multi-token-prediction layers stored after the decoder's own layers
    #: (``model.layers.{num_layers} ...``); the target ignores them, an MTP draft loads them.
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DecoderConfig:
        """Parse a ``config.json`` dictionary, rejecting what this decoder cannot run."""
        if not isinstance(raw, dict):
            raise UnsupportedModel(f"config.json must hold a JSON object, not {type(raw).__name__}")
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise UnsupportedModel(f"config.json lacks required keys {missing}")
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(raw.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {arch!r} is not supported; speculum runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {raw['hidden_act']!r}: only 'silu' is supported")
        rope = _rope_settings(raw)
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        qwen2 = arch == "Qwen2ForCausalLM"
        qwen3 = arch == "Qwen3ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = raw.get("sliding_window")
        if (qwen2 or qwen3) and not raw.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope[0],
            rope_scaling=rope[1],
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=qwen3,
            sliding_window=None if window is None else int(window),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DecoderConfig:
        """Read ``config.json`` (and extra EOS ids from a sibling ``generation_config.json``)."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UnsupportedModel(f"cannot read model config {path}: {err}") from err
        config = cls.from_dict(raw)
        gen_path = path.with_name("generation_config.json")
        if gen_path.exists():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            extra = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
            config = attrs.evolve(config, eos_token_ids=merged)
        return config

    def to_dict(self) -> dict[str, Any]:
        """A ``config.json`` dictionary that transformers and :meth:`from_dict` both read."""
        model_type = {
            "LlamaForCausalLM": "llama",
            "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3",
            "MistralForCausalLM": "mistral",
        }[self.architecture]
        rope_parameters = {"rope_type": "default", **(self.rope_scaling or {})}
        rope_parameters["rope_theta"] = self.rope_theta
        eos = list(self.eos_token_ids)
        nextn = {"num_nextn_predict_layers": self.num_nextn_predict_layers}
        return {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_bias,
            "mlp_bias": self.mlp_bias,
            "sliding_window": self.sliding_window,
            "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
            "bos_token_id": self.bos_token_id,
            "torch_dtype": self.dtype,
            **(nextn if self.num_nextn_predict_layers else {}),
        }


def _arch_from_model_type(model_type: str | None) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
    }.get(model_type or "", f"<model_type {model_type!r}>")


def _rope_settings(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    source = dict(scaling or params)
    source.pop("rope_theta", None)
    rope_type = source.get("rope_type", source.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    source["rope_type"] = rope_type
    source.pop("type", None)
    return theta, source
