"""Decoder configuration, parsed from a Hugging Face ``config.json``.

One config covers the Llama family as transformers writes it: ``LlamaForCausalLM`` (with Llama
3.1 ``rope_scaling``), ``Qwen2ForCausalLM`` (q/k/v bias), ``Qwen3ForCausalLM`` (q/k RMSNorm) and
``MistralForCausalLM``. Both spellings of the rotary settings are read: ``rope_theta`` plus
``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5).

Values no model can run with are refused here, naming the file, the key and the value: sizes
that are not positive integers, attention heads that do not group evenly over the KV heads, a
``head_dim`` the rotary embedding cannot rotate, ``rope_theta`` or ``rms_norm_eps`` not above
zero, EOS ids outside the vocabulary, and an unreadable ``generation_config.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "CheckpointError",
    "DecoderConfig",
    "UnsupportedModel",
    "SUPPORTED_ARCHITECTURES",
    "ROPE_TYPES",
    "read_json_object",
]

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


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: files or weights missing, extra, or of the
    wrong shape or dtype, or a config value no model can run with."""


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
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> DecoderConfig:
        """Parse a ``config.json`` dictionary, rejecting what this decoder cannot run.

        ``where`` names the file (and the section of it ``raw`` is) in error messages. Raises
        :class:`UnsupportedModel` for an architecture or setting speculum does not implement
        and :class:`CheckpointError` for a value no model can run with (see the module
        docstring)."""
        if not isinstance(raw, dict):
            raise UnsupportedModel(f"{where} must hold a JSON object, not {type(raw).__name__}")
        missing = [k for k in _REQUIRED if raw.get(k) is None]
        if missing:
            raise UnsupportedModel(f"{where} lacks required keys {missing}")
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(raw.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"{where}: architecture {arch!r} is not supported; speculum runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(
                f"{where}: hidden_act {raw['hidden_act']!r}: only 'silu' is supported"
            )
        rope = _rope_settings(raw, where)
        size = {key: _integer(raw, key, where, minimum=1) for key in _REQUIRED}
        heads, hidden = size["num_attention_heads"], size["hidden_size"]
        kv_heads = _integer(raw, "num_key_value_heads", where, minimum=1, default=heads)
        _check_head_groups(heads, kv_heads, where)
        qwen2 = arch == "Qwen2ForCausalLM"
        qwen3 = arch == "Qwen3ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        eos_ids = _token_ids(raw, "eos_token_id", where, size["vocab_size"])
        uses_window = not (qwen2 or qwen3) or raw.get("use_sliding_window", False)
        window = _integer(raw, "sliding_window", where, minimum=1) if uses_window else None
        return cls(
            architecture=arch,
            vocab_size=size["vocab_size"],
            hidden_size=hidden,
            intermediate_size=size["intermediate_size"],
            num_layers=size["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_head_dim(raw, hidden, heads, where),
            rms_norm_eps=_positive(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", where, "1e-6"),
            rope_theta=rope[0],
            rope_scaling=rope[1],
            max_position_embeddings=_integer(
                raw, "max_position_embeddings", where, minimum=1, default=2048
            ),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=qwen3,
            sliding_window=window,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            num_nextn_predict_layers=_integer(
                raw, "num_nextn_predict_layers", where, minimum=0, default=0
            ),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DecoderConfig:
        """Read ``config.json`` (and extra EOS ids from a sibling ``generation_config.json``).

        Raises :class:`CheckpointError` naming either file when it is unreadable or holds a
        value no model can run with, :class:`UnsupportedModel` for what speculum does not
        implement."""
        path = Path(path)
        config = cls.from_dict(read_json_object(path), str(path))
        gen_path = path.with_name("generation_config.json")
        if gen_path.exists():
            gen = read_json_object(gen_path)
            extra = _token_ids(gen, "eos_token_id", str(gen_path), config.vocab_size)
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
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


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or a :class:`CheckpointError` naming the file and why it
    cannot be read (missing, not UTF-8, not JSON, or JSON that is not an object)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))  # JSON is UTF-8 (RFC 8259)
    except (OSError, ValueError) as err:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(
            f"cannot read {path}: {err}; fix the file (it must hold one JSON object)"
        ) from err
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(raw).__name__}")
    return raw


def _integer(
    raw: dict[str, Any], key: str, where: str, *, minimum: int, default: int | None = None
) -> int | None:
    """``raw[key]`` as an ``int`` of at least ``minimum`` (``default`` when absent or null);
    an integral float such as ``4096.0`` counts as the integer it is."""
    value = raw.get(key)
    if value is None:
        return default
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value < minimum:
        raise CheckpointError(
            f"{where}: {key} is {value!r}; it must be an integer of at least {minimum}: fix "
            f"{key} in the file"
        )
    return int(value)


def _positive(value: Any, key: str, where: str, typical: str) -> float:
    """``value`` as a finite float above zero, else a :class:`CheckpointError` naming ``key``
    and a ``typical`` value."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise CheckpointError(
            f"{where}: {key} is {value!r}; it must be a number above zero, the value the model "
            f"was trained with (typically {typical}): fix {key} in the file"
        )
    return float(value)


def _check_head_groups(heads: int, kv_heads: int, where: str) -> None:
    """Grouped-query attention shares each KV head among ``heads / kv_heads`` query heads."""
    if heads % kv_heads:
        raise CheckpointError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv_heads}, so the query heads cannot share the KV heads evenly: fix "
            "num_key_value_heads (or num_attention_heads) in the file"
        )


def _head_dim(raw: dict[str, Any], hidden: int, heads: int, where: str) -> int:
    """``head_dim`` as given (Qwen3 sets one other than ``hidden / heads``; the weights then
    decide, see ``loading.check_keys``), else ``hidden / heads``; even, as RoPE rotates pairs."""
    head_dim = _integer(raw, "head_dim", where, minimum=1)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(
                f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads "
                f"{heads} and no head_dim is given: set head_dim in the file"
            )
        head_dim = hidden // heads
    if head_dim % 2:
        raise CheckpointError(
            f"{where}: head_dim {head_dim} (given, or hidden_size / num_attention_heads) is "
            "odd; the rotary embedding rotates pairs of dimensions: fix head_dim in the file"
        )
    return head_dim


def _token_ids(raw: dict[str, Any], key: str, where: str, vocab_size: int) -> tuple[int, ...]:
    """``raw[key]``, a token id or a list of them (none when absent), each in the vocabulary."""
    value = raw.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise CheckpointError(
            f"{where}: {key} is {value!r}; it must be a token id or a list of token ids in "
            f"0 .. {vocab_size - 1} (vocab_size {vocab_size}): fix {key} in the file"
        )
    return tuple(ids)


def _rope_theta(raw: dict[str, Any], params: dict[str, Any], where: str) -> float:
    """``rope_theta`` from ``rope_parameters`` (transformers 5) or the top level (transformers
    4), 10000 when neither has one; when both do they must agree, as each reader sees one."""
    given = {
        key: _positive(value, key, where, "10000.0 or more")
        for key, value in (
            ("rope_parameters.rope_theta", params.get("rope_theta")),
            ("rope_theta", raw.get("rope_theta")),
        )
        if value is not None
    }
    if len(set(given.values())) > 1:
        raise CheckpointError(
            f"{where}: rope_parameters.rope_theta {given['rope_parameters.rope_theta']} and "
            f"rope_theta {given['rope_theta']} disagree (transformers 5 reads the first, 4 the "
            "second): set both to the checkpoint's training value"
        )
    return next(iter(given.values()), 10000.0)


def _rope_settings(raw: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    theta = _rope_theta(raw, params, where)
    source = dict(scaling or params)
    source.pop("rope_theta", None)
    rope_type = source.get("rope_type", source.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(
            f"{where}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    source["rope_type"] = rope_type
    source.pop("type", None)
    return theta, source
