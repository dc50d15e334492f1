"""Draft-head checkpoints: the published layouts, read strictly and written back.

``load_draft(folder, target, algorithm)`` reads ``config.json`` and the weights (safetensors,
or the EAGLE reference's ``pytorch_model.bin`` through ``torch.load(weights_only=True)``),
recognises the layout from the config and the key names, checks that the draft belongs to
``target`` and loads every tensor strictly: a missing, unexpected or mis-shaped tensor raises
:class:`~speculum.models.loading.CheckpointError` naming it.

Layouts (``save_draft(head, folder, layout=...)`` writes each):

``eagle-reference``  EAGLE-1 as the EAGLE repository (SafeAILab/EAGLE, ``cnets1.py`` /
    ``ea_model.py``) publishes it: ``pytorch_model.bin`` holding ``embed_tokens.weight``,
    ``fc.weight``, ``fc.bias`` (unless config ``"bias": false``), ``layers.{i}.self_attn.
    {q,k,v,o}_proj.weight`` (q/k/v biases when config ``qkv_bias``), ``layers.{i}.mlp.
    {gate,up,down}_proj.weight``, ``layers.{i}.post_attention_layernorm.weight`` and, for
    ``i > 0`` only, ``layers.{i}.input_layernorm.weight`` (layer 0 has none). Config: a
    ``LlamaForCausalLM`` config with ``num_hidden_layers`` draft layers.
``sglang-eagle``  the same keys in safetensors, ``architectures: ["LlamaForCausalLMEagle"]``
    (SGLang prefixes ``model.`` itself; ``embed_tokens.weight`` optional).
``eagle3-reference``  EAGLE-3 as the EAGLE repository publishes it: ``pytorch_model.bin`` with
    ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v over twice the hidden width),
    ``midlayer.mlp.*``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.
    weight``, ``fc.weight`` (no bias), ``norm.weight``, ``lm_head.weight`` (``draft_vocab_size``
    rows), ``d2t`` (int64, ``draft_vocab_size``) and ``t2d`` (bool, target vocabulary);
    ``embed_tokens.weight`` optional (required when ``target_hidden_size`` differs).
    Config: ``LlamaForCausalLMEagle3`` with ``draft_vocab_size``.
``sglang-eagle3``  SGLang / SpecForge ``LlamaForCausalLMEagle3``: the same keys in
    safetensors; capture layers in ``eagle_config.eagle_aux_hidden_state_layer_ids``.
``speculators-eagle3``  vLLM speculators ``Eagle3Speculator``: ``speculators_model_type:
    "eagle3"``, the layer shape in ``transformer_layer_config``, top-level
    ``draft_vocab_size``, ``norm_before_residual`` (vLLM's default when absent: true),
    ``norm_before_fc``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``; keys as
    above with ``layers.0.`` for ``midlayer.``, plus ``fc.bias`` (older speculators) and
    ``input_norm.weight`` (``norm_before_fc``) when present.
``mtp-in-target``  DeepSeek-V3-style MTP layers inside the target checkpoint: config
    ``num_nextn_predict_layers: 1`` and, for an ``L``-layer target,
    ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm}.weight``, optional
    ``model.layers.{L}.shared_head.head.weight`` and ``model.layers.{L}.embed_tokens.weight``,
    and the decoder layer ``model.layers.{L}.{self_attn.*,mlp.*,input_layernorm.weight,
    post_attention_layernorm.weight}``, built as the target builds its layer ``L`` (in a
    mixture-of-experts target's sparse layers an MoE layer, its experts one by one under the
    target's key names, ``mlp.experts.{e}.gate_proj.weight`` ...; ``docs/moe.md``).
    ``load_model`` loads the same folder as the target.
``mtp``  the same keys in a folder of their own (SGLang's ``export_deepseek_nextn.py`` form,
    ``model.layers.0.*`` with ``num_hidden_layers: 1``, is read too).
``qwen3-next-mtp``  Qwen3-Next's MTP layer inside the target checkpoint, as the hub ships it
    (config ``mtp_num_hidden_layers``, or ``num_nextn_predict_layers`` as vLLM reads it: 1 when
    absent): ``mtp.fc.weight`` ``[hidden, 2 * hidden]`` over ``[embedding; hidden]``,
    ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight``
    (zero-centred norms, like the target's), and the decoder layer ``mtp.layers.0.*`` under the
    target's layer key names: a gated full-attention layer (``self_attn.{q,k,v,o}_proj``,
    ``self_attn.{q,k}_norm``) and the target's sparse MLP (``mlp.gate``, ``mlp.experts.{e}.
    {gate,up,down}_proj``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``), with
    ``input_layernorm`` and ``post_attention_layernorm``. There is no ``lm_head`` or embedding
    of its own (SGLang's ``qwen3_next_mtp.py`` and vLLM's load none and use the target's).
    SGLang loads it by renaming ``mtp.{fc,pre_fc_norm_*}`` to the model's top level and every
    other ``mtp.`` to ``model.``; the MTP layer is its model's layer 0, built full-attention.

EAGLE-3 capture layers count differently in the two ecosystems (checked in the sources):
SGLang (and SpecForge, which trains from SGLang's captures) read
``eagle_config.eagle_aux_hidden_state_layer_ids`` and capture the *output* of layer ``n``
(``layers_to_capture = [n + 1 ...]``, taken on entering layer ``n + 1``); vLLM (and the
speculators format it loads) reads the top-level ``eagle_aux_hidden_state_layer_ids`` and
captures the stream *entering* layer ``n``, i.e. the output of layer ``n - 1``. Both defaults
are the outputs of layers ``1, L//2 - 1, L - 4``. ``DraftConfig.capture_layers`` holds layer
outputs (``DecoderModel.forward(capture_layers=...)``'s convention).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import save_file
from torch import nn

from speculum.models.config import (
    SUPPORTED_ARCHITECTURES,
    DecoderConfig,
    UnsupportedModel,
    read_json_object,
)
from speculum.models.decoder import DecoderModel
from speculum.models.draft import (
    OWN_MTP_MODEL,
    DraftConfig,
    Eagle3Head,
    EagleHead,
    MTPHead,
    build_draft,
    canonical_algorithm,
    default_capture_layers,
    mtp_layer_config,
    random_draft,
)
from speculum.models.loading import (
    DTYPES,
    CheckpointError,
    CheckpointTensor,
    Stacked,
    check_keys,
    checkpoint_names,
    checkpoint_shapes,
    checkpoint_tensors,
    layer_checkpoint_names,
    open_checkpoint,
    read,
    save_model,
)
from speculum.models.parallel import shard_, splits_of
from speculum.state.parallel import SINGLE, TensorParallel

__all__ = [
    "LAYOUTS",
    "DraftTargetMismatch",
    "detect_layout",
    "head_checkpoint_names",
    "load_draft",
    "materialize",
    "save_draft",
    "save_random_draft",
    "target_checkpoint_keys",
]

#: layout -> algorithm it holds.
LAYOUTS: dict[str, str] = {
    "eagle-reference": "eagle",
    "sglang-eagle": "eagle",
    "eagle3-reference": "eagle3",
    "sglang-eagle3": "eagle3",
    "speculators-eagle3": "eagle3",
    "mtp": "mtp",
    "mtp-in-target": "mtp",
    "qwen3-next-mtp": "mtp",
}

#: Qwen3-Next's MTP weights outside its decoder layer: head parameter name -> key after
#: ``mtp.`` (``qwen3-next-mtp`` layout).
_QWEN3_NEXT_MTP_NAMES = {
    "enorm.weight": "pre_fc_norm_embedding.weight",
    "hnorm.weight": "pre_fc_norm_hidden.weight",
    "eh_proj.weight": "fc.weight",
    "shared_head.norm.weight": "norm.weight",
    "embed_tokens.weight": "embed_tokens.weight",
}
_QWEN3_NEXT_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\..*")

_EH_PROJ = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight")


class DraftTargetMismatch(CheckpointError):
    """A draft checkpoint trained for a different target model."""


# ----------------------------------------------------------------------------------------
# Reading


def _read_weights(folder: Path) -> tuple[dict[str, torch.Tensor | CheckpointTensor], str]:
    """All tensors of ``folder`` and the file kind (``safetensors``: read lazily, so that a
    tensor-parallel rank reads only its part; ``bin``: in memory)."""
    if (folder / "model.safetensors.index.json").exists() or any(folder.glob("*.safetensors")):
        return open_checkpoint(folder), "safetensors"
    index = folder / "pytorch_model.bin.index.json"
    if index.exists():
        names = sorted(set(read_json_object(index).get("weight_map", {}).values()))
        files = [folder / name for name in names]
    else:
        files = [folder / "pytorch_model.bin"]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(
            f"no weights in {folder}: expected *.safetensors or pytorch_model.bin "
            f"(missing {missing})"
        )
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch.load raises many types for bad or unsafe files
            raise CheckpointError(f"cannot read weights file {path}: {err}") from err
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
        ):
            raise CheckpointError(f"{path} does not hold a state dict of named tensors")
        for key, value in loaded.items():
            if key in tensors:
                raise CheckpointError(f"weight {key!r} appears in two files of {folder}")
            tensors[key] = value
    return tensors, "bin"


def _mtp_layers(found: dict[str, torch.Tensor]) -> list[int]:
    return sorted({int(m.group(1)) for k in found if (m := _EH_PROJ.fullmatch(k))})


def detect_layout(raw: dict[str, Any], found: dict[str, torch.Tensor], kind: str) -> str | None:
    """The layout a config and its tensors are in, or ``None`` when none matches."""
    if "speculators_model_type" in raw:
        model_type = raw["speculators_model_type"]
        if model_type != "eagle3":
            raise UnsupportedModel(
                f"speculators_model_type {model_type!r} is not supported; speculum reads "
                "speculators 'eagle3' checkpoints"
            )
        return "speculators-eagle3"
    if "mtp.fc.weight" in found:
        return "qwen3-next-mtp"
    mtp = _mtp_layers(found)
    if mtp:
        own = any(k.startswith(f"model.layers.{mtp[0]}.") for k in found)
        inside = own and "model.embed_tokens.weight" in found
        return "mtp-in-target" if inside else "mtp"
    if any(k.startswith("midlayer.") for k in found):
        return "eagle3-reference" if kind == "bin" else "sglang-eagle3"
    if "fc.weight" in found and any(k.startswith("layers.") for k in found):
        return "eagle-reference" if kind == "bin" else "sglang-eagle"
    return None


def _base_layer_config(raw: dict[str, Any], where: str) -> DecoderConfig:
    """The draft layer's :class:`DecoderConfig` (``where`` names the file in errors); draft
    architecture names map to their base. An MoE architecture's routing comes along (an MTP
    layer inside an MoE checkpoint is an MoE layer)."""
    d = dict(raw)
    archs = d.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is not None and arch not in SUPPORTED_ARCHITECTURES:
        base = arch
        for affix in ("Eagle3", "Eagle", "NextN"):
            base = base.removesuffix(affix).removeprefix(affix)
        if base in SUPPORTED_ARCHITECTURES:
            d["architectures"] = [base]
        else:
            d.pop("architectures")
            d.setdefault("model_type", "llama")
    layer = DecoderConfig.from_dict(d, where)
    if "qkv_bias" in raw:  # the EAGLE reference's switch for Qwen2-style q/k/v biases
        layer = attrs.evolve(layer, qkv_bias=bool(raw["qkv_bias"]))
    return attrs.evolve(layer, num_nextn_predict_layers=0)


def _capture_from(ids: Any, num_layers: int, where: str, *, entering: bool) -> tuple[int, ...]:
    """Capture layers (layer outputs, ascending) from a config's ids; ``entering`` for vLLM's
    count (the stream entering layer ``n`` is the output of layer ``n - 1``)."""
    if ids is None:
        return default_capture_layers(num_layers)
    try:
        values = [int(i) - (1 if entering else 0) for i in ids]
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids {ids!r}") from err
    out = tuple(sorted(values))
    if not out or len(set(out)) != len(out):
        raise UnsupportedModel(f"{where}: eagle_aux_hidden_state_layer_ids {ids!r} repeat ids")
    if out[0] < 0:
        raise UnsupportedModel(
            f"{where}: eagle_aux_hidden_state_layer_ids {ids!r} include the embedding output "
            "(vLLM's id 0), which speculum does not capture"
        )
    if out[-1] >= num_layers:
        raise DraftTargetMismatch(
            f"{where}: the draft reads the output of target layer {out[-1]} but the target has "
            f"{num_layers} layers: the draft belongs to a different target model"
        )
    return out


def _parse(
    layout: str,
    raw: dict[str, Any],
    found: dict[str, Any],
    target: DecoderConfig,
    where: str,
) -> tuple[DraftConfig, str]:
    """The draft config a layout's ``config.json`` and key set describe, and the key prefix
    (MTP) or ``""``."""
    algorithm = LAYOUTS[layout]
    prefix = ""
    config_file = str(Path(where) / "config.json")
    if algorithm == "eagle":
        layer = _base_layer_config(raw, config_file)
        fields: dict[str, Any] = {"fc_bias": bool(raw.get("bias", True))}
    elif layout == "speculators-eagle3":
        inner = raw.get("transformer_layer_config")
        if not isinstance(inner, dict):
            raise CheckpointError(f"{where}: speculators config lacks transformer_layer_config")
        layer = _base_layer_config(inner, f"{config_file} transformer_layer_config")
        fields = {
            "capture_layers": _capture_from(
                raw.get("eagle_aux_hidden_state_layer_ids"),
                target.num_layers,
                where,
                entering=True,
            ),
            "draft_vocab_size": int(raw.get("draft_vocab_size") or layer.vocab_size),
            "fc_bias": "fc.bias" in found,
            "norm_before_residual": bool(raw.get("norm_before_residual", True)),
            "norm_before_fc": bool(raw.get("norm_before_fc", False)),
        }
    elif algorithm == "eagle3":
        layer = _base_layer_config(raw, config_file)
        # SGLang builds the midlayer's q/k/v without bias whatever the config says.
        layer = attrs.evolve(layer, qkv_bias=False)
        eagle_config = raw.get("eagle_config") or {}
        if eagle_config.get("use_aux_hidden_state", True) is False:
            raise UnsupportedModel(f"{where}: EAGLE-3 without auxiliary hidden states")
        ids, entering = eagle_config.get("eagle_aux_hidden_state_layer_ids"), False
        if ids is None and raw.get("eagle_aux_hidden_state_layer_ids") is not None:
            ids, entering = raw["eagle_aux_hidden_state_layer_ids"], True
        fields = {
            "capture_layers": _capture_from(ids, target.num_layers, where, entering=entering),
            "draft_vocab_size": int(raw.get("draft_vocab_size") or layer.vocab_size),
            "fc_bias": bool(raw.get("bias", False)),
            "norm_before_residual": bool(raw.get("norm_before_residual", False)),
            "norm_before_fc": bool(raw.get("norm_before_fc", False)),
        }
    elif layout == "qwen3-next-mtp":
        layer, prefix = _qwen3_next_mtp_layer(raw, found, where), "mtp."
        fields = {"own_head": False}
    else:
        layers = _mtp_layers(found)
        if len(layers) != 1 or int(raw.get("num_nextn_predict_layers") or 1) != 1:
            raise UnsupportedModel(
                f"{where}: {max(len(layers), int(raw.get('num_nextn_predict_layers') or 1))} "
                "MTP layers; speculum's MTP head runs one (as SGLang's NEXTN does)"
            )
        prefix = f"model.layers.{layers[0]}."
        layer = _base_layer_config(raw, config_file)
        fields = {"own_head": f"{prefix}shared_head.head.weight" in found}
    layer = attrs.evolve(layer, num_layers=1) if algorithm == "mtp" else layer
    hidden = layer.hidden_size
    target_hidden = hidden
    if algorithm == "eagle3":
        target_hidden = int(raw.get("target_hidden_size") or hidden)
    _check_target(layer.vocab_size, target_hidden, target, where)
    embed_key = f"{prefix}embed_tokens.weight"
    if embed_key not in found and hidden != target_hidden:
        raise CheckpointError(
            f"{where}: missing weights ['{embed_key}']: the draft's hidden size {hidden} differs "
            f"from the target's {target_hidden}, so it cannot share the target's embedding"
        )
    config = DraftConfig(
        algorithm=algorithm,
        layer=layer,
        target_hidden_size=target_hidden,
        target_num_layers=target.num_layers,
        own_embedding=embed_key in found,
        **fields,
    )
    return config, prefix


def _qwen3_next_mtp_layer(raw: dict[str, Any], found: dict[str, Any], where: str) -> DecoderConfig:
    """The layer config of the one Qwen3-Next MTP layer a target folder's ``config.json`` and
    ``mtp.*`` keys describe (:func:`~speculum.models.draft.mtp_layer_config`)."""
    declared = raw.get("mtp_num_hidden_layers", raw.get("num_nextn_predict_layers"))
    stored = sorted({int(m.group(1)) for k in found if (m := _QWEN3_NEXT_MTP_LAYER.fullmatch(k))})
    if int(declared or 1) != 1 or stored != [0]:
        raise UnsupportedModel(
            f"{where}: Qwen3-Next MTP layers {stored} (config mtp_num_hidden_layers "
            f"{declared}); speculum's MTP head runs one layer, mtp.layers.0 (as SGLang does)"
        )
    target = _base_layer_config(raw, str(Path(where) / "config.json"))
    if target.architecture not in OWN_MTP_MODEL:
        raise CheckpointError(
            f"{where}: mtp.fc.weight is Qwen3-Next's MTP layout, but config.json describes "
            f"{target.architecture}"
        )
    return mtp_layer_config(target)


def _check_target(vocab: int, target_hidden: int, target: DecoderConfig, where: str) -> None:
    problems = []
    if vocab != target.vocab_size:
        problems.append(f"vocabulary: draft {vocab} ids vs target {target.vocab_size}")
    if target_hidden != target.hidden_size:
        problems.append(
            f"hidden size: the draft reads target hidden states of width {target_hidden}, the "
            f"target's are {target.hidden_size}"
        )
    if problems:
        raise DraftTargetMismatch(
            f"{where}: the draft belongs to a different target model ({'; '.join(problems)}); "
            "load it with the target it was trained for"
        )


def _key_map(layout: str, prefix: str) -> Callable[[str], str]:
    """Head parameter name -> checkpoint key (outside an MTP head's decoder layer)."""
    if layout == "speculators-eagle3":
        return lambda name: (
            "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name
        )
    if layout == "qwen3-next-mtp":
        return lambda name: prefix + _QWEN3_NEXT_MTP_NAMES[name]
    if LAYOUTS[layout] == "mtp":
        return lambda name: prefix + name
    return lambda name: name


def head_checkpoint_names(head: nn.Module, layout: str, prefix: str) -> dict[str, str | Stacked]:
    """Each parameter of ``head`` -> its checkpoint key in ``layout``, or the per-expert keys
    of a stacked expert weight. An MTP head's decoder layer maps as the target's layers do
    (``loading.layer_checkpoint_names``) under ``prefix`` (``model.layers.{L}.``; Qwen3-Next's
    ``mtp.``, its layer under ``mtp.layers.0.``)."""
    to_key = _key_map(layout, prefix)
    params = [name for name, _ in head.named_parameters()]
    if not isinstance(head, MTPHead):
        return {name: to_key(name) for name in params}
    names: dict[str, str | Stacked] = {
        name: to_key(name) for name in params if not name.startswith("decoder.")
    }
    architecture = head.config.layer.architecture
    if layout == "qwen3-next-mtp":
        prefix += "layers.0."
    return names | layer_checkpoint_names(head.decoder, architecture, "decoder.", prefix)


def target_checkpoint_keys(target: DecoderModel) -> set[str]:
    """The keys of ``target``'s own weights in its checkpoint (experts one by one), and a tied
    ``lm_head.weight``: what an MTP folder that is the target's may hold besides its layers."""
    return set(checkpoint_shapes(target, checkpoint_names(target))) | {"lm_head.weight"}


def _vocab_map(
    config: DraftConfig, found: dict[str, torch.Tensor | CheckpointTensor], where: str
) -> torch.Tensor | None:
    """Validated target ids of the draft vocabulary from ``d2t`` (and ``t2d``), or ``None``
    for the identity."""
    size, vocab = config.head_vocab_size, config.vocab_size
    d2t, t2d = (read(found[key]) if key in found else None for key in ("d2t", "t2d"))
    if d2t is None:
        if size != vocab:
            raise CheckpointError(
                f"{where}: missing weights ['d2t']: a draft vocabulary of {size} ids inside a "
                f"target vocabulary of {vocab} needs d2t (target id = draft id + d2t[draft id])"
            )
        if t2d is not None and not bool(t2d.bool().all()):
            raise CheckpointError(f"{where}: t2d marks a partial vocabulary but there is no d2t")
        return None
    if d2t.dim() != 1 or d2t.numel() != size:
        raise CheckpointError(
            f"{where}: d2t has shape {tuple(d2t.shape)} but the draft vocabulary "
            f"(draft_vocab_size, lm_head rows) has {size} ids: d2t needs one entry per draft id"
        )
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise CheckpointError(f"{where}: d2t must hold integers, not {d2t.dtype}")
    ids = torch.arange(size) + d2t.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != size:
        raise CheckpointError(
            f"{where}: d2t maps draft ids outside the target vocabulary 0 .. {vocab - 1} or onto "
            "the same target id twice"
        )
    if t2d is not None:
        if t2d.dim() != 1 or t2d.numel() != vocab:
            raise CheckpointError(
                f"{where}: t2d has shape {tuple(t2d.shape)} but the target vocabulary has "
                f"{vocab} ids: t2d needs one entry per target id"
            )
        mask = t2d.bool()
        if int(mask.sum()) != size or not bool(mask[ids].all()):
            raise CheckpointError(f"{where}: t2d and d2t disagree on the draft vocabulary")
    return ids


def load_draft(
    folder: str | Path,
    target: DecoderModel,
    algorithm: str,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    tp: TensorParallel = SINGLE,
) -> EagleHead | Eagle3Head | MTPHead:
    """Load the draft head in ``folder`` for ``target``, strictly.

    ``algorithm`` is ``eagle`` (``eagle2``), ``eagle3`` or ``mtp`` (``nextn``); the layout is
    recognised from the folder. ``dtype`` and ``device`` default to the target's. ``tp``
    shards the head (this rank's part, as ``models.parallel.shard_`` splits it); left at
    :data:`SINGLE` the head is whole (replicated on every rank of a sharded target, whose
    embedding and lm_head it borrows either way). Raises
    :class:`DraftTargetMismatch` for a draft of another target, ``CheckpointError`` for
    missing, unexpected or mis-shaped tensors, an unknown layout or a bad ``d2t``/``t2d``.
    """
    algorithm = canonical_algorithm(algorithm)
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"draft folder {folder} does not exist or is not a folder")
    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder} has no config.json; pass a draft checkpoint folder")
    raw = read_json_object(folder / "config.json")
    found, kind = _read_weights(folder)
    where = str(folder)
    layout = detect_layout(raw, found, kind)
    if layout is None:
        hint = (
            f"no MTP layers (model.layers.N.eh_proj.weight, or Qwen3-Next's mtp.fc.weight) in "
            f"{folder}"
            if algorithm == "mtp"
            else f"unknown draft layout in {folder}"
        )
        raise CheckpointError(
            f"{hint}; speculum reads {', '.join(LAYOUTS)} (see speculum.models.draft_loading). "
            f"The folder holds {sorted(found)[:8]}{' ...' if len(found) > 8 else ''}"
        )
    if LAYOUTS[layout] != algorithm:
        raise CheckpointError(
            f"{folder} holds a draft for algorithm {LAYOUTS[layout]!r} ({layout} layout), "
            f"not {algorithm!r}"
        )
    if algorithm == "eagle" and "layers.0.input_layernorm.weight" in found:
        raise CheckpointError(
            f"{where}: unexpected weights ['layers.0.input_layernorm.weight']: EAGLE-1 skips "
            "the first layer's input norm (as the EAGLE reference and SGLang do); a checkpoint "
            "trained with that norm is not this architecture"
        )
    config, prefix = _parse(layout, raw, found, target.config, where)
    vocab_ids = _vocab_map(config, found, where) if algorithm == "eagle3" else None

    with torch.device("meta"):
        head = build_draft(config, target)
    names = head_checkpoint_names(head, layout, prefix)
    tolerated: set[str] = {k for k in found if k.endswith("rotary_emb.inv_freq")}
    if algorithm == "eagle3":
        tolerated |= {"d2t", "t2d"}
    if algorithm == "mtp":
        # Outside the MTP layer, only the target's own weights may sit in the folder.
        target_keys = target_checkpoint_keys(target)
        tolerated |= {k for k in found if not k.startswith(prefix) and k in target_keys}
    expected = checkpoint_shapes(head, names)
    check_keys(expected, found, where, frozenset(tolerated), config.layer)

    weight = target.model.embed_tokens.weight
    head = materialize(head, names, found, target, dtype=dtype, device=device, tp=tp)
    if isinstance(head, Eagle3Head):
        head.set_target_ids(
            torch.arange(config.head_vocab_size) if vocab_ids is None else vocab_ids
        )
    _share_equal_embedding(head, weight)
    return head.eval().requires_grad_(False)


def materialize(
    head: nn.Module,
    names: Mapping[str, str | Stacked],
    found: Mapping[str, torch.Tensor | CheckpointTensor],
    target: DecoderModel,
    *,
    dtype: torch.dtype | None,
    device: str | torch.device | None,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    """Shard a meta-device head for ``tp`` (nothing to do for one rank), allocate it and copy
    checked weights into it, each sharded one's part only: ``names`` maps parameter names to
    checkpoint keys (or an MoE layer's per-expert keys, stacked here). ``dtype`` and
    ``device`` default to the target's."""
    weight = target.model.embed_tokens.weight
    shard_(head, tp)
    head.to_empty(device=weight.device if device is None else device)
    params, splits = dict(head.named_parameters()), splits_of(head)
    with torch.no_grad():
        for name, key in names.items():
            if not isinstance(key, str):
                params[name].copy_(key.gather(found))
            else:
                params[name].copy_(read(found[key], splits.get(name)))
    head = head.to(dtype or weight.dtype)
    head.reset_buffers()
    return head


def _share_equal_embedding(head: Any, target_weight: torch.Tensor) -> None:
    """Drop a checkpoint embedding identical to the target's (the EAGLE reference stores a
    frozen copy) so the two share one tensor; the head's outputs are unchanged."""
    if not head.config.own_embedding:
        return
    own = head.embed_tokens.weight
    if (own.shape, own.dtype, own.device) == (
        target_weight.shape,
        target_weight.dtype,
        target_weight.device,
    ) and bool(torch.equal(own, target_weight)):
        del head.embed_tokens
        head.config = attrs.evolve(head.config, own_embedding=False)


# ----------------------------------------------------------------------------------------
# Writing


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, "float32")


def _layer_dict(layer: DecoderConfig, num_layers: int | None = None) -> dict[str, Any]:
    d = attrs.evolve(layer, num_layers=num_layers or layer.num_layers).to_dict()
    # The EAGLE reference's q/k/v bias switch; transformers configs ignore the extra key.
    return {**d, "qkv_bias": layer.qkv_bias}


def _config_dict(head: Any, layout: str, target: DecoderModel | None) -> dict[str, Any]:
    config: DraftConfig = head.config
    layer, dtype = config.layer, _dtype_name(next(head.parameters()).dtype)
    if LAYOUTS[layout] == "eagle":
        d = _layer_dict(layer)
        if layout == "sglang-eagle":
            d["architectures"] = [layer.architecture + "Eagle"]
        return {**d, "bias": config.fc_bias, "torch_dtype": dtype}
    if layout == "mtp":
        d = _layer_dict(layer, config.target_num_layers)
        return {**d, "num_nextn_predict_layers": 1, "torch_dtype": dtype}
    eagle3 = {
        "draft_vocab_size": config.head_vocab_size,
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": config.norm_before_fc,
    }
    if config.target_hidden_size != config.hidden_size:
        eagle3["target_hidden_size"] = config.target_hidden_size
    if layout == "speculators-eagle3":
        inner = _layer_dict(layer)
        inner.pop("architectures")
        verifier: dict[str, Any] = {"name_or_path": None}
        if target is not None:
            verifier["architectures"] = [target.config.architecture]
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": inner,
            "eagle_aux_hidden_state_layer_ids": [n + 1 for n in config.capture_layers],
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": verifier,
            },
            "torch_dtype": dtype,
            **eagle3,
        }
    d = _layer_dict(layer)
    d["architectures"] = [layer.architecture + "Eagle3"]
    return {
        **d,
        **eagle3,
        "bias": config.fc_bias,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.capture_layers),
            "use_aux_hidden_state": True,
        },
        "torch_dtype": dtype,
    }


def _shape_fields(config: DraftConfig) -> tuple[Any, ...]:
    layer = config.layer
    return (
        config.algorithm,
        config.capture_layers,
        config.head_vocab_size,
        config.fc_bias,
        config.norm_before_residual,
        config.norm_before_fc,
        config.target_hidden_size,
        config.own_head,
        *(getattr(layer, f) for f in _LAYER_FIELDS),
    )


_LAYER_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "qk_norm",
    "moe",
)


#: Layouts that hold the MTP layer inside the target's folder -> the config key counting them.
_IN_TARGET = {
    "mtp-in-target": "num_nextn_predict_layers",
    "qwen3-next-mtp": "mtp_num_hidden_layers",
}


def save_draft(
    head: Any, folder: str | Path, layout: str, *, target: DecoderModel | None = None
) -> Path:
    """Write ``head`` to ``folder`` in ``layout`` (one of :data:`LAYOUTS`).

    ``mtp-in-target`` and ``qwen3-next-mtp`` write ``target`` (required) with the MTP layer
    added, which both ``load_model`` and ``load_draft`` read. Raises ``ValueError`` when the
    layout cannot express the head (say, q/k/v biases in an SGLang EAGLE-3 midlayer).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    config: DraftConfig = head.config
    if LAYOUTS[layout] != config.algorithm:
        raise ValueError(f"layout {layout!r} holds {LAYOUTS[layout]} drafts, not this head")
    in_target = layout in _IN_TARGET
    if (layout == "qwen3-next-mtp") != (config.layer.architecture in OWN_MTP_MODEL):
        raise ValueError(
            f"layout {layout!r} cannot express an MTP layer of {config.layer.architecture}: "
            "qwen3-next-mtp holds Qwen3-Next's MTP layer, whose MTP layers no other layout holds"
        )
    if in_target and target is None:
        raise ValueError(f"layout {layout!r} writes the target too: pass target=")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"model.layers.{config.target_num_layers}." if config.algorithm == "mtp" else ""
    if layout == "qwen3-next-mtp":
        prefix = "mtp."
    tensors = {
        key: p.detach().contiguous().cpu().clone()
        for key, p in checkpoint_tensors(head, head_checkpoint_names(head, layout, prefix)).items()
    }
    if layout == "eagle-reference" and not config.own_embedding:
        # The EAGLE reference loads strictly into a model that owns an embedding.
        tensors["embed_tokens.weight"] = head.embedding.weight.detach().cpu().clone()
    if isinstance(head, Eagle3Head):
        ids = head.target_ids.cpu()
        tensors["d2t"] = ids - torch.arange(ids.numel())
        tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill(0, ids, True)
    if in_target:
        assert target is not None
        raw = {**target.config.to_dict(), _IN_TARGET[layout]: 1}
    else:
        raw = _config_dict(head, layout, target)
    reread, _ = _parse(layout, raw, tensors, _target_shape(config), str(folder))
    if _shape_fields(reread) != _shape_fields(config):
        raise ValueError(
            f"layout {layout!r} cannot express this head's configuration "
            f"(it would read back as {reread})"
        )
    if in_target:
        assert target is not None
        save_model(target, folder)
        from safetensors.torch import load_file

        tensors = {**load_file(folder / "model.safetensors"), **tensors}
    if layout in ("eagle-reference", "eagle3-reference"):
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


#: The layout :func:`save_random_draft` writes per algorithm unless told otherwise.
DEFAULT_LAYOUTS = {"eagle": "sglang-eagle", "eagle3": "sglang-eagle3", "mtp": "mtp"}


def save_random_draft(
    target: DecoderModel,
    algorithm: str,
    folder: str | Path,
    *,
    seed: int = 0,
    std: float = 0.02,
    layout: str | None = None,
    **changes: object,
) -> Path:
    """Write a random head for ``target`` (see ``random_draft``) and return the folder.

    ``layout`` defaults to SGLang's for EAGLE and EAGLE-3 and a separate folder for MTP (for a
    Qwen3-Next target, the target's folder with the hub's ``mtp.*`` layer: ``qwen3-next-mtp``).
    """
    algorithm = canonical_algorithm(algorithm)
    head = random_draft(target, algorithm, seed=seed, std=std, **changes)
    if layout is None:
        own = algorithm == "mtp" and target.config.architecture in OWN_MTP_MODEL
        layout = "qwen3-next-mtp" if own else DEFAULT_LAYOUTS[algorithm]
    return save_draft(head, folder, layout, target=target)


def _target_shape(config: DraftConfig) -> DecoderConfig:
    """A stand-in target config with the shapes a draft config was built for."""
    return attrs.evolve(
        config.layer,
        hidden_size=config.target_hidden_size,
        num_layers=config.target_num_layers,
    )
