"""Strict Hugging Face checkpoint I/O: ``config.json`` plus one or many safetensors files.

Every weight the decoder declares must be in the checkpoint, with the shape ``config.json``
gives it and a floating-point dtype (an integer or bool tensor would be cast silently), and
every tensor in the checkpoint must be one the decoder declares; otherwise loading fails naming
the keys. A q/k/v projection whose rows disagree with ``num_attention_heads`` (or
``num_key_value_heads``) times ``head_dim`` is reported as the ``head_dim`` (or
``num_key_value_heads``) mismatch it is, and a latent attention's ``kv_b_proj`` whose columns
disagree with ``kv_lora_rank`` as that mismatch.
The only tolerated extras are a tied ``lm_head.weight`` (some exporters write it), rotary
``inv_freq`` buffers (older exporters wrote them), neither of which carries information the
config does not, and the multi-token-prediction layers ``model.layers.{L} ..`` after the ``L``
decoder layers when ``config.json`` declares ``num_nextn_predict_layers`` (an MTP draft loads
those, see ``speculum.models.draft_loading``), and Qwen3-Next's and Nemotron-H's MTP weights
``mtp.*``, which transformers ignores too. Nemotron-H checkpoints name the backbone
``backbone.*`` (``backbone.embeddings``, ``backbone.layers.{n}.{norm,mixer}``,
``backbone.norm_f``); :func:`checkpoint_names` maps the decoder's names onto them.

Mixture-of-experts layers keep their experts stacked (``SparseMoE.experts_gate_up [E, 2I, H]``
and ``experts_down [E, H, I]``) where checkpoints hold one tensor per expert, in the hub's
layout: ``model.layers.{l}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`` (Qwen2-MoE,
Qwen3-MoE) or ``model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (Mixtral:
gate, up, down), the router at ``...mlp.gate.weight`` (``block_sparse_moe.gate.weight``). The
DeepSeek-style routers' ``...mlp.gate.e_score_correction_bias`` and shared experts
``...mlp.shared_experts.{gate,up,down}_proj.weight`` (GLM-4.5) keep the hub's names. gpt-oss
stores its experts stacked already, in another layout (:class:`Relaid`):
``mlp.experts.gate_up_proj [E, H, 2I]`` (gate and up columns interleaved: even, odd),
``gate_up_proj_bias [E, 2I]`` (interleaved alike), ``down_proj [E, I, H]`` and
``down_proj_bias [E, H]``, its router at ``mlp.router.{weight,bias}``.
:func:`checkpoint_names` maps each parameter to its checkpoint keys; loading stacks, saving
unstacks, and every per-expert key is checked as strictly as any other.

Tensors are opened lazily (:class:`CheckpointTensor`): the checks read only the files' headers,
and a tensor-parallel rank then reads only its slice of each sharded weight.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from speculum.models.config import (
    CheckpointError,
    DecoderConfig,
    UnsupportedModel,
    read_json_object,
)
from speculum.models.decoder import DecoderModel, SparseMoE, SquaredReluMoE
from speculum.models.fp8 import (
    check_fp8_weights,
    fp8_scheme,
    fp8_weight_keys,
    load_fp8_layers_,
    scale_keys,
    stored_scales,
    unquantized_cause,
)
from speculum.models.parallel import Split, shard_, splits_of
from speculum.state.parallel import SINGLE, TensorParallel

__all__ = [
    "CheckpointError",
    "CheckpointTensor",
    "Relaid",
    "Stacked",
    "checkpoint_names",
    "checkpoint_shapes",
    "checkpoint_tensors",
    "cast_weights",
    "load_model",
    "layer_checkpoint_names",
    "load_state_dict",
    "open_checkpoint",
    "read",
    "check_keys",
    "save_model",
    "write_checkpoint",
    "random_model",
    "randomize_",
    "DTYPES",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Why a checkpoint loaded unquantized (a draft's, say) may hold no FP8 tensor.
NOT_FP8 = (
    "speculum loads it unquantized (FP8 loads only a target's decoder linear layers under an "
    "FP8 quantization_config, docs/fp8.md)"
)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors weights in {folder}; save the model with safetensors "
            "(transformers: save_pretrained(..., safe_serialization=True))"
        )
    return files


@attrs.define(frozen=True, slots=True, eq=False)
class CheckpointTensor:
    """One tensor of a safetensors file, read only when asked for: whole (:meth:`read`) or in
    part (indexing reads just the indexed slice from disk, which is how a tensor-parallel rank
    loads its shard)."""

    path: Path
    key: str
    shape: torch.Size
    #: the safetensors dtype name (``F32``, ``BF16``, ``I64``, ``BOOL`` ...)
    dtype: str

    def is_floating_point(self) -> bool:
        """Whether the tensor holds floats (as ``torch.Tensor.is_floating_point``): every
        safetensors float dtype, and no other, is named ``F...`` or ``BF...``."""
        return self.dtype.startswith(("F", "BF"))

    def read(self) -> torch.Tensor:
        """The whole tensor."""
        return self._open(lambda handle: handle.get_tensor(self.key))

    def __getitem__(self, index: Any) -> torch.Tensor:
        """The slice ``index`` (slices per axis, as for a tensor), read alone."""
        return self._open(lambda handle: handle.get_slice(self.key)[index])

    def _open(self, get: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        try:
            with safe_open(str(self.path), framework="pt") as handle:
                return get(handle)
        except Exception as err:  # safetensors raises several unrelated types for bad files
            raise CheckpointError(f"cannot read {self.key!r} from {self.path}: {err}") from err


def open_checkpoint(folder: str | Path) -> dict[str, CheckpointTensor]:
    """Every tensor of a checkpoint folder (single file, sharded with an index, or many files)
    by name, with its shape; no tensor data is read yet."""
    folder = Path(folder)
    tensors: dict[str, CheckpointTensor] = {}
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if key in tensors:
                        raise CheckpointError(f"weight {key!r} appears in two files of {folder}")
                    part = handle.get_slice(key)
                    shape, dtype = torch.Size(part.get_shape()), part.get_dtype()
                    tensors[key] = CheckpointTensor(path=path, key=key, shape=shape, dtype=dtype)
        except CheckpointError:
            raise
        except Exception as err:  # safetensors raises several unrelated types for bad files
            raise CheckpointError(f"cannot read weights file {path}: {err}") from err
    return tensors


def load_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (single file, sharded with an index, or many files)."""
    return {key: tensor.read() for key, tensor in open_checkpoint(folder).items()}


def read(found: torch.Tensor | CheckpointTensor, split: Split | None = None) -> torch.Tensor:
    """A checkpoint tensor (read from disk, or already in memory): whole, or only the part
    ``split`` names (a tensor-parallel rank's shard)."""
    if split is not None:
        return split.take(found)
    return found.read() if isinstance(found, CheckpointTensor) else found


def check_keys(
    expected: dict[str, torch.Size],
    found: Mapping[str, torch.Tensor | CheckpointTensor],
    where: str,
    tolerated: frozenset[str] = frozenset(),
    layer: DecoderConfig | None = None,
    *,
    fp8: frozenset[str] = frozenset(),
    fp8_cause: str = NOT_FP8,
) -> None:
    """Raise :class:`CheckpointError` naming FP8, missing, unexpected, non-float or
    mis-shaped weights; ``layer``, the config the attention weights were shaped from, lets a
    projection of the wrong width be reported as the ``head_dim`` mismatch it is. Only the
    keys ``fp8`` may hold FP8 values (an FP8 target's quantized weights, ``models.fp8``);
    any other FP8 tensor raises, saying ``fp8_cause``, before keys are compared (a layer's
    stray scale is then not the first thing named)."""
    stray = sorted(k for k in expected if k not in fp8 and k in found and _is_fp8(found[k]))
    if stray:
        named = [f"{k} ({found[k].dtype})" for k in stray]
        raise CheckpointError(
            f"{where}: {named} hold FP8 values, but {fp8_cause}; loading them would misread "
            "them: fix quantization_config or re-export those weights unquantized"
        )
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - tolerated)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing weights {missing}")
        if unexpected:
            parts.append(f"unexpected weights {unexpected}")
        raise CheckpointError(
            f"{where}: {'; '.join(parts)}. The checkpoint does not match its config.json "
            "(wrong architecture, layer count or tying): fix the config or re-export the weights"
        )
    not_float = [k for k in expected if not found[k].is_floating_point()]
    if not_float:
        named = [f"{k} ({found[k].dtype})" for k in not_float]
        raise CheckpointError(
            f"{_file_of(found[not_float[0]], where)}: weights {named} hold integers or bools "
            "where floating-point weights belong (loading would cast them silently): re-export "
            "the checkpoint with float weights"
        )
    if layer is not None and layer.mla is not None:
        _check_latent_rank(expected, found, where, layer)
    elif layer is not None:
        _check_head_dim(expected, found, where, layer)
    wrong = [
        f"{k}: checkpoint {tuple(found[k].shape)} vs config {tuple(s)}"
        for k, s in expected.items()
        if found[k].shape != s
    ]
    if wrong:
        raise CheckpointError(f"{where}: weight shapes disagree with config.json: {wrong}")


def _is_fp8(found: torch.Tensor | CheckpointTensor) -> bool:
    """Whether a checkpoint tensor holds FP8 values (e4m3 or e5m2)."""
    if isinstance(found, CheckpointTensor):
        return found.dtype.startswith("F8")
    return found.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


#: attention projection -> the config field and JSON key of its head count
_HEAD_COUNTS = {
    "self_attn.q_proj.weight": ("num_heads", "num_attention_heads"),
    "self_attn.k_proj.weight": ("num_kv_heads", "num_key_value_heads"),
    "self_attn.v_proj.weight": ("num_kv_heads", "num_key_value_heads"),
}


def _file_of(found: torch.Tensor | CheckpointTensor, where: str) -> str:
    """The file a checkpoint tensor came from, or ``where`` for one already in memory."""
    return str(found.path) if isinstance(found, CheckpointTensor) else where


def _check_head_dim(
    expected: dict[str, torch.Size],
    found: Mapping[str, torch.Tensor | CheckpointTensor],
    where: str,
    layer: DecoderConfig,
) -> None:
    """Raise :class:`CheckpointError` for a q/k/v projection whose rows (heads × head_dim)
    alone disagree with ``layer``, naming the config value the weights contradict: the weights
    decide ``head_dim`` (Qwen3 sets one other than hidden_size / num_attention_heads), so a
    q_proj of other rows means ``head_dim``, and k_proj or v_proj of other rows (q_proj being
    right, as it is checked first) means ``num_key_value_heads``."""
    for key, shape in expected.items():
        suffix = next((s for s in _HEAD_COUNTS if key.endswith(s)), None)
        got = found[key].shape
        if suffix is None or got == shape or len(got) != len(shape) or got[1:] != shape[1:]:
            continue  # not a projection, right, or off on another axis too (a generic mismatch)
        field, json_key = _HEAD_COUNTS[suffix]
        rows, heads, head_dim = got[0], getattr(layer, field), layer.head_dim
        if field == "num_heads":
            culprit, value, (implied, rest) = "head_dim", head_dim, divmod(rows, heads)
        else:
            culprit, value, (implied, rest) = json_key, heads, divmod(rows, head_dim)
        fix = (
            f"set {culprit} to {implied} in config.json"
            if rest == 0
            else f"fix {json_key} or head_dim in config.json, or re-export the weights"
        )
        raise CheckpointError(
            f"{where}: {culprit} {value} in config.json disagrees with the weights: {key!r} in "
            f"{_file_of(found[key], where)} has {rows} rows, but {json_key} {heads} × head_dim "
            f"{head_dim} = {heads * head_dim}; {fix}"
        )


def _check_latent_rank(
    expected: dict[str, torch.Size],
    found: Mapping[str, torch.Tensor | CheckpointTensor],
    where: str,
    layer: DecoderConfig,
) -> None:
    """Raise :class:`CheckpointError` for a latent attention's ``kv_b_proj`` whose columns
    (the latent's width) disagree with ``kv_lora_rank``, naming the field and the rank the
    weights imply."""
    assert layer.mla is not None
    rank = layer.mla.kv_lora_rank
    for key in expected:
        got = found[key].shape
        if not key.endswith("self_attn.kv_b_proj.weight") or len(got) != 2 or got[1] == rank:
            continue
        raise CheckpointError(
            f"{where}: kv_lora_rank {rank} in config.json disagrees with the weights: {key!r} "
            f"in {_file_of(found[key], where)} expands a latent of {got[1]} values; set "
            f"kv_lora_rank to {got[1]} in config.json, or re-export the weights"
        )


@attrs.define(frozen=True, slots=True)
class Stacked:
    """A parameter the checkpoint stores one tensor per expert: ``keys[e]`` are expert ``e``'s
    tensors, whose rows, concatenated in order, are the parameter's slice ``[e]`` (gate then up
    for the experts' fused gate/up weights)."""

    keys: tuple[tuple[str, ...], ...]

    def shapes(self, stacked: torch.Size) -> dict[str, torch.Size]:
        """The shape of each per-expert tensor of a parameter shaped ``stacked``."""
        return {
            key: torch.Size((stacked[1] // len(parts), *stacked[2:]))
            for parts in self.keys
            for key in parts
        }

    def gather(self, found: Mapping[str, torch.Tensor | CheckpointTensor]) -> torch.Tensor:
        """The stacked parameter from the checkpoint's per-expert tensors."""
        return torch.stack([torch.cat([read(found[k]) for k in parts]) for parts in self.keys])

    def scatter(self, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-expert tensors (views of ``stacked``) by checkpoint key."""
        return {
            key: piece
            for parts, expert in zip(self.keys, stacked, strict=True)
            for key, piece in zip(parts, expert.chunk(len(parts)), strict=True)
        }


@attrs.define(frozen=True, slots=True)
class Relaid:
    """A stacked expert parameter the checkpoint stores as one tensor ``key`` in another
    layout (gpt-oss): ``[E, in, out]`` where ours is ``[E, out, in]`` (``transposed``), and
    gate and up interleaved along our axis 1 (``interleaved``: gate at even, up at odd
    indices) where ours holds the gate rows then the up rows."""

    key: str
    transposed: bool
    interleaved: bool

    def shapes(self, ours: torch.Size) -> dict[str, torch.Size]:
        """The checkpoint tensor's shape for a parameter shaped ``ours``."""
        return {self.key: torch.Size((ours[0], ours[2], ours[1])) if self.transposed else ours}

    def gather(self, found: Mapping[str, torch.Tensor | CheckpointTensor]) -> torch.Tensor:
        """The parameter in our layout from the checkpoint's tensor."""
        t = read(found[self.key])
        t = t.transpose(1, 2) if self.transposed else t
        return torch.cat([t[:, 0::2], t[:, 1::2]], 1) if self.interleaved else t

    def scatter(self, ours: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensor (a contiguous copy) by its key."""
        t = torch.stack(ours.chunk(2, 1), 2).flatten(1, 2) if self.interleaved else ours
        return {self.key: (t.transpose(1, 2) if self.transposed else t).contiguous()}


#: architecture -> (the MoE block's name in checkpoints, the expert's gate and up projections,
#: its down projection); Qwen's spelling for any other.
_EXPERT_NAMES = {"MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3"), "w2")}
_QWEN_EXPERT_NAMES = ("mlp", ("gate_proj", "up_proj"), "down_proj")


def checkpoint_names(model: DecoderModel) -> dict[str, str | Stacked | Relaid]:
    """Each parameter's name (as ``named_parameters`` gives it) -> its checkpoint key, or the
    per-expert keys a stacked expert weight is made of. The names are transformers' own
    except in mixture-of-experts layers (see the module docstring)."""
    # named_parameters drops the tied lm_head alias, which is what a tied checkpoint omits.
    names: dict[str, str | Stacked | Relaid] = {name: name for name, _ in model.named_parameters()}
    for n, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{n}."
        names |= layer_checkpoint_names(layer, model.config.architecture, prefix, prefix)
    names |= scale_keys(model)
    if model.config.mamba is not None:
        return {name: _nemotron_h_key(key) for name, key in names.items()}
    return names


#: Nemotron-H's names for the backbone's parts (``backbone.*``, as its hub checkpoints and
#: transformers' ``save_pretrained`` spell them).
_NEMOTRON_H_KEYS = (
    ("model.embed_tokens.", "backbone.embeddings."),
    ("model.norm.", "backbone.norm_f."),
    ("model.", "backbone."),
)


def _nemotron_h_key(key: str | Stacked) -> str | Stacked:
    """``key`` (each per-expert key of a stacked one) in Nemotron-H's spelling
    (``lm_head.weight`` stays)."""
    if isinstance(key, Stacked):
        return Stacked(tuple(tuple(map(_nemotron_h_key, parts)) for parts in key.keys))
    for ours, theirs in _NEMOTRON_H_KEYS:
        if key.startswith(ours):
            return theirs + key[len(ours) :]
    return key


def layer_checkpoint_names(
    layer: torch.nn.Module, architecture: str, ours: str, theirs: str
) -> dict[str, str | Stacked | Relaid]:
    """Each parameter of decoder layer ``layer``, named ``ours + name``, -> its checkpoint key
    under ``theirs`` (``model.layers.{n}.``) in ``architecture``'s spelling, or the per-expert
    keys of a stacked expert weight: the target's own layers and the MTP layers stored after
    them (``speculum.models.draft_loading``) map alike."""
    names: dict[str, str | Stacked | Relaid] = {
        ours + name: theirs + name for name, _ in layer.named_parameters()
    }
    mixer = getattr(layer, "mixer", None)
    if isinstance(mixer, SquaredReluMoE):  # Nemotron-H: one up and one down per expert
        mine, hub = f"{ours}mixer.experts.", f"{theirs}mixer.experts."
        for proj in ("up_proj", "down_proj"):
            experts = range(mixer.moe.num_experts)
            names[mine + proj] = Stacked(tuple((f"{hub}{e}.{proj}.weight",) for e in experts))
    if not isinstance(getattr(layer, "mlp", None), SparseMoE):
        return names
    if architecture == "GptOssForCausalLM":
        return names | _gpt_oss_expert_names(ours + "mlp.", theirs + "mlp.")
    block, gate_up, down = _EXPERT_NAMES.get(architecture, _QWEN_EXPERT_NAMES)
    mine, hub = f"{ours}mlp.", f"{theirs}{block}."
    names |= {mine + name: hub + name for name, _ in layer.mlp.named_parameters()}
    experts = [f"{hub}experts.{e}." for e in range(layer.mlp.num_experts)]
    names[mine + "experts_gate_up"] = Stacked(
        tuple(tuple(f"{e}{p}.weight" for p in gate_up) for e in experts)
    )
    names[mine + "experts_down"] = Stacked(tuple((f"{e}{down}.weight",) for e in experts))
    return names


def _gpt_oss_expert_names(mine: str, hub: str) -> dict[str, str | Relaid]:
    """gpt-oss's MoE block (``mine``) -> its checkpoint keys under ``hub``: the router and the
    experts' stacked tensors in the hub's layout (module docstring)."""
    experts = f"{hub}experts."
    return {
        mine + "gate.weight": hub + "router.weight",
        mine + "gate.bias": hub + "router.bias",
        mine + "experts_gate_up": Relaid(experts + "gate_up_proj", True, True),
        mine + "experts_gate_up_bias": Relaid(experts + "gate_up_proj_bias", False, True),
        mine + "experts_down": Relaid(experts + "down_proj", True, False),
        mine + "experts_down_bias": experts + "down_proj_bias",
    }


def checkpoint_tensors(
    module: torch.nn.Module, names: Mapping[str, str | Stacked | Relaid]
) -> dict[str, torch.Tensor]:
    """``module``'s weights by checkpoint key, experts one by one (views, not copies);
    ``names`` maps each parameter to its key(s) (:func:`checkpoint_names`)."""
    params = dict(module.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for name, key in names.items():
        if not isinstance(key, str):
            tensors |= key.scatter(params[name])
        else:
            tensors[key] = params[name]
    return tensors


def checkpoint_shapes(
    module: torch.nn.Module, names: Mapping[str, str | Stacked | Relaid]
) -> dict[str, torch.Size]:
    """The shape of each checkpoint tensor ``module``'s parameters are loaded from, by key;
    ``names`` maps each parameter to its key(s) (:func:`checkpoint_names`)."""
    params = dict(module.named_parameters())
    shapes: dict[str, torch.Size] = {}
    for name, key in names.items():
        if not isinstance(key, str):
            shapes |= key.shapes(params[name].shape)
        else:
            shapes[key] = params[name].shape
    return shapes


def load_model(
    folder: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tp: TensorParallel = SINGLE,
) -> DecoderModel:
    """Build the decoder a Hugging Face folder describes and load its weights strictly.

    ``dtype`` defaults to the checkpoint's ``torch_dtype`` (float32 when absent). With a
    tensor-parallel ``tp`` of several ranks the model is this rank's shard
    (``models.parallel.shard_``), and only this rank's part of each sharded weight is read.
    An FP8 checkpoint (``quantization_config``, ``models.fp8``) keeps its quantized layers'
    weights FP8 with their scales; ``dtype`` is then the compute dtype of everything else.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist or is not a folder")
    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder} has no config.json; pass a Hugging Face model folder")
    config = DecoderConfig.from_file(folder / "config.json")
    scheme = fp8_scheme(read_json_object(folder / "config.json"), str(folder / "config.json"))
    if scheme is not None and tp.size > 1:
        raise UnsupportedModel(
            f"{folder} holds FP8 weights, which do not load under tensor parallelism yet: "
            "load it on one device (tp=1), or use an unquantized checkpoint"
        )
    if dtype is None:
        dtype = DTYPES.get(config.dtype, torch.float32)
    with torch.device("meta"):
        model = DecoderModel(config)
    found = open_checkpoint(folder)
    tolerated = {k for k in found if k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        tolerated.add("lm_head.weight")
    nextn = range(config.num_layers, config.num_layers + config.num_nextn_predict_layers)
    prefixes = tuple(f"model.layers.{n}." for n in nextn)
    tolerated |= {k for k in found if k.startswith(prefixes)}
    if config.is_hybrid:  # Qwen3-Next's, Nemotron-H's MTP layers (not built: docs/hybrid.md)
        tolerated |= {k for k in found if k.startswith("mtp.")}
    scale_shapes = {} if scheme is None else load_fp8_layers_(model, scheme, found, str(folder))
    names = checkpoint_names(model)
    shapes = checkpoint_shapes(model, names) | scale_shapes
    fp8 = fp8_weight_keys(model, names)
    check_fp8_weights(fp8, found, str(folder))
    where, cause = str(folder), unquantized_cause(model)
    check_keys(shapes, found, where, frozenset(tolerated), config, fp8=fp8, fp8_cause=cause)
    shard_(model, tp)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    splits = splits_of(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = names[name]
            if not isinstance(key, str):
                param.copy_(key.gather(found))
            else:
                # reshaped: an FP8 scale is stored as a scalar or [out] (models.fp8)
                param.copy_(read(found[key], splits.get(name)).reshape(param.shape))
    model.reset_rope()
    return model.to(dtype).eval().requires_grad_(False)


def save_model(model: DecoderModel, folder: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors``, readable by transformers and
    :func:`load_model` (an FP8 model with its ``quantization_config``)."""
    if model.tp.size > 1:
        raise ValueError(
            f"the model is rank {model.tp.rank}'s shard of {model.tp.size}: save the unsharded "
            "model (load it without tp)"
        )
    tensors = checkpoint_tensors(model, checkpoint_names(model))
    config = model.config.to_dict()
    if model.quantization is not None:
        tensors = stored_scales(model, tensors)
        config["quantization_config"] = model.quantization.to_dict()
    return write_checkpoint(folder, tensors, config)


def write_checkpoint(
    folder: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> Path:
    """Write ``tensors`` as ``model.safetensors`` and ``config`` as ``config.json`` into
    ``folder`` (created if needed); returns the folder.

    Each tensor is copied to the CPU on its own storage: parameters may be views of one tensor
    (fused projections), which safetensors refuses to write as separate tensors.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {name: t.detach().cpu().clone() for name, t in tensors.items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def cast_weights(folder: str | Path, dtype: torch.dtype) -> None:
    """Rewrite every ``*.safetensors`` file in ``folder`` with its floating-point tensors in
    ``dtype`` (to ship smaller files); ``config.json`` is left alone, so loaders still compute
    in the dtype it names unless told otherwise."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors = load_file(str(path))
        cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        save_file(cast, str(path), metadata={"format": "pt"})


def randomize_(module: torch.nn.Module, *, seed: int, std: float) -> torch.nn.Module:
    """Fill ``module`` in place with normal(0, std) weights, unit norms and zero biases, drawn
    on the device the weights live on (the same values as before for CPU modules)."""
    generator = torch.Generator(next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
    return module.eval().requires_grad_(False)


def random_model(config: DecoderConfig, *, seed: int = 0, std: float = 0.02) -> DecoderModel:
    """A float32 decoder with normal(0, std) weights, unit norms and zero biases."""
    return randomize_(DecoderModel(config), seed=seed, std=std)
