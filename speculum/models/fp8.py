"""FP8 checkpoints: which layers are FP8, their scales, strict checks (docs/fp8.md).

``config.json``'s ``quantization_config`` names the layout, parsed into an :class:`Fp8Scheme`:

- ``quant_method: "fp8"`` (vLLM's and transformers' layout): with ``weight_block_size [b0,
  b1]`` (DeepSeek-V3's ``[128, 128]``) each weight has a ``weight_scale_inv`` of shape
  ``[ceil(out / b0), ceil(in / b1)]`` (a multiplier, despite its name); without it a
  ``weight_scale`` that is a scalar (``[]`` or ``[1]``: per tensor) or one per output row
  (``[out]`` or ``[out, 1]``: per channel). ``activation_scheme: "static"`` adds a scalar
  ``input_scale``. ``ignored_layers`` (or ``modules_to_not_convert``) lists layers kept
  unquantized.
- ``quant_method: "compressed-tensors"`` (llm-compressor's): one config group targeting
  ``Linear`` with ``weights: {num_bits: 8, type: float, strategy: tensor | channel | block}``
  (``block_structure`` for blocks), tensors ``weight`` and ``weight_scale`` (``[1]``, ``[out,
  1]`` or the blocks), ``input_scale`` for static (non-``dynamic``) input activations, and an
  ``ignore`` list (names, or ``re:`` regular expressions).

The layers quantized are every ``nn.Linear`` inside the decoder layers (``model.layers.*``)
that the ignore list does not name: embeddings, norms, routers and ``lm_head`` stay in the
compute dtype. Each becomes an :class:`~speculum.models.decoder.Fp8Linear` holding the FP8
weight and its scales. Loading is strict: an FP8 layer's weight must be ``F8_E4M3`` with its
scale present and of the shape its layout gives, no other tensor may be FP8, and a missing or
extra scale is a missing or unexpected key (``models.loading.check_keys``). Mixture-of-experts
layers (stacked experts) and tensor parallelism are refused for now.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import torch
from torch import nn

from speculum import kernels
from speculum.models.config import CheckpointError, UnsupportedModel, check_quantization_method
from speculum.models.decoder import MLP, Attention, DecoderModel, Fp8Linear, SparseMoE

__all__ = [
    "Fp8Scheme",
    "check_fp8_weights",
    "dequantize_",
    "fp8_layers",
    "fp8_scheme",
    "fp8_weight_keys",
    "load_fp8_layers_",
    "quantize_",
    "scale_keys",
    "stored_scales",
    "unquantized_cause",
]

STRATEGIES = ("tensor", "channel", "block")
#: The safetensors dtype of an e4m3 tensor.
E4M3 = "F8_E4M3"


@attrs.define(frozen=True, slots=True, kw_only=True)
class Fp8Scheme:
    """How a checkpoint's FP8 linear layers are stored (all static).

    ``strategy`` is the scale granularity; under ``quant_method "fp8"`` without a block size
    the scales' shapes decide per layer (per tensor or per channel), and ``strategy`` is only
    what :func:`quantize_` writes."""

    #: ``"fp8"`` or ``"compressed-tensors"``: the ``quant_method`` of ``quantization_config``.
    method: str
    strategy: str
    #: ``(b0, b1)`` rows x columns per scale for the ``"block"`` strategy, else ``None``.
    block: tuple[int, int] | None = None
    #: Whether each FP8 layer has a static activation scale ``input_scale``.
    static_input: bool = False
    #: Layer names (or ``re:`` patterns) kept unquantized.
    ignore: tuple[str, ...] = ()

    @property
    def scale_key(self) -> str:
        """The suffix of each layer's weight scale in the checkpoint."""
        return "weight_scale_inv" if self.method == "fp8" and self.block else "weight_scale"

    def layer_block(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The block one scale covers in a layer of these widths, by ``strategy``."""
        if self.strategy == "block":
            assert self.block is not None
            return self.block
        return (1, in_features) if self.strategy == "channel" else (out_features, in_features)

    def ignores(self, name: str) -> bool:
        """Whether layer ``name`` (``model.layers.0.mlp.down_proj``) is kept unquantized: an
        ignore entry equal to it or to a module containing it, or a ``re:`` pattern matching
        it."""
        return any(
            re.match(entry[3:], name) is not None
            if entry.startswith("re:")
            else name == entry or name.startswith(entry + ".")
            for entry in self.ignore
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` dictionary of this scheme."""
        if self.method == "fp8":
            raw: dict[str, Any] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "static" if self.static_input else "dynamic",
                "ignored_layers": list(self.ignore),
            }
            if self.block is not None:
                raw["weight_block_size"] = list(self.block)
            return raw
        weights: dict[str, Any] = {
            "num_bits": 8,
            "type": "float",
            "strategy": self.strategy,
            "symmetric": True,
            "dynamic": False,
        }
        if self.block is not None:
            weights["block_structure"] = list(self.block)
        activations = {"num_bits": 8, "type": "float", "symmetric": True}
        activations |= (
            {"strategy": "tensor", "dynamic": False}
            if self.static_input
            else {"strategy": "token", "dynamic": True}
        )
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": activations,
                }
            },
            "ignore": list(self.ignore),
        }


def fp8_scheme(raw: dict[str, Any], where: str) -> Fp8Scheme | None:
    """The FP8 scheme of a ``config.json`` dictionary, ``None`` without
    ``quantization_config``; :class:`UnsupportedModel` for another quantization method or an
    FP8 variant speculum does not load, :class:`CheckpointError` for malformed settings."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise CheckpointError(f"{where}: quantization_config must be a JSON object")
    check_quantization_method(raw, where)  # any other method is refused there, with its fix
    if quant["quant_method"] == "fp8":
        return _fp8_method(quant, where)
    return _compressed_tensors(quant, where)


def _block(value: Any, key: str, where: str) -> tuple[int, int]:
    """``value`` as a pair of positive integers, or a :class:`CheckpointError` naming ``key``."""
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise CheckpointError(
            f"{where}: quantization_config {key} is {value!r}; it must be two positive "
            "integers (rows, columns per scale), e.g. [128, 128]"
        )
    return value[0], value[1]


def _ignore_list(value: Any, key: str, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise CheckpointError(f"{where}: quantization_config {key} must be a list of names")
    return tuple(value)


def _fp8_method(quant: dict[str, Any], where: str) -> Fp8Scheme:
    if quant.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedModel(
            f"{where}: quantization_config fmt {quant['fmt']!r}: only e4m3 FP8 weights load"
        )
    activation = quant.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise CheckpointError(
            f"{where}: quantization_config activation_scheme {activation!r}; it must be "
            "'dynamic' or 'static'"
        )
    size = quant.get("weight_block_size")
    block = None if size is None else _block(size, "weight_block_size", where)
    ignore_key = "ignored_layers" if "ignored_layers" in quant else "modules_to_not_convert"
    return Fp8Scheme(
        method="fp8",
        strategy="tensor" if block is None else "block",
        block=block,
        static_input=activation == "static",
        ignore=_ignore_list(quant.get(ignore_key), ignore_key, where),
    )


def _compressed_tensors(quant: dict[str, Any], where: str) -> Fp8Scheme:
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise UnsupportedModel(
            f"{where}: compressed-tensors quantization_config needs exactly one config group "
            f"(found {len(groups) if isinstance(groups, dict) else groups!r}); speculum loads "
            "one FP8 scheme for every quantized layer"
        )
    (name, group), *_ = groups.items()
    weights = group.get("weights") or {}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise UnsupportedModel(
            f"{where}: config group {name!r} quantizes weights to {weights.get('num_bits')}-bit "
            f"{weights.get('type')}; speculum loads 8-bit float (FP8) weights only"
        )
    if "Linear" not in (group.get("targets") or []):
        raise UnsupportedModel(
            f"{where}: config group {name!r} targets {group.get('targets')!r}; speculum loads "
            "groups that target 'Linear'"
        )
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES:
        raise UnsupportedModel(
            f"{where}: config group {name!r} weight strategy {strategy!r}; speculum loads "
            f"{', '.join(STRATEGIES)}"
        )
    if quant.get("kv_cache_scheme") is not None:
        raise UnsupportedModel(f"{where}: an FP8 KV cache (kv_cache_scheme) is not supported")
    block = None
    if strategy == "block":
        block = _block(weights.get("block_structure"), "block_structure", where)
    activations = group.get("input_activations")
    static = isinstance(activations, dict) and not activations.get("dynamic", False)
    return Fp8Scheme(
        method="compressed-tensors",
        strategy=strategy,
        block=block,
        static_input=static,
        ignore=_ignore_list(quant.get("ignore"), "ignore", where),
    )


def fp8_layers(model: DecoderModel, scheme: Fp8Scheme) -> list[str]:
    """The names of ``model``'s float layers that ``scheme`` quantizes: every ``nn.Linear``
    inside the decoder layers the ignore list does not name (layers already FP8 are left as
    they are). Refuses a model with mixture-of-experts layers, whose stacked experts have no
    FP8 form yet, and a tensor-parallel shard."""
    if any(isinstance(m, SparseMoE) for m in model.modules()):
        raise UnsupportedModel(
            "FP8 MoE experts not supported yet: the stacked experts of mixture-of-experts "
            "layers load in bfloat16 or float32 only; use an unquantized checkpoint of this "
            "model"
        )
    if model.tp.size > 1:
        raise UnsupportedModel(
            f"the model is rank {model.tp.rank}'s shard of {model.tp.size}: FP8 layers are not "
            "tensor-parallel yet; quantize an unsharded model (tp=1)"
        )
    return [
        name
        for name, module in model.named_modules()
        if name.startswith("model.layers.")
        and isinstance(module, nn.Linear)
        and not scheme.ignores(name)
    ]


def _swap(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)


def _empty_fp8(linear: nn.Linear, block: tuple[int, int], scheme: Fp8Scheme) -> Fp8Linear:
    return Fp8Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        block=block,
        static_input=scheme.static_input,
    )


def _stored_shapes(scheme: Fp8Scheme, out: int, inp: int) -> dict[tuple[int, ...], str]:
    """The checkpoint shapes a layer's weight scale may have -> the granularity each means."""
    tensor = {(): "tensor", (1,): "tensor"}
    channel = {(out,): "channel", (out, 1): "channel"}
    if scheme.strategy == "block":
        assert scheme.block is not None
        return {(-(-out // scheme.block[0]), -(-inp // scheme.block[1])): "block"}
    if scheme.method == "fp8":
        return tensor | channel
    return tensor if scheme.strategy == "tensor" else channel


def _layout_name(scheme: Fp8Scheme) -> str:
    if scheme.strategy == "block":
        key = "weight_block_size" if scheme.method == "fp8" else "block_structure"
        return f"{key} {list(scheme.block or ())}"
    if scheme.method == "fp8":
        return "per-tensor or per-channel scales (quant_method fp8)"
    return f"strategy {scheme.strategy!r}"


def load_fp8_layers_(
    model: DecoderModel, scheme: Fp8Scheme, found: dict[str, Any], where: str
) -> dict[str, torch.Size]:
    """Replace ``model``'s quantized layers (on the meta device, before loading) with empty
    :class:`Fp8Linear` layers whose scale blocks follow the checkpoint ``found`` (its
    tensors by key, with shapes), and record ``scheme`` on the model. Returns the checkpoint
    shape of every weight and input scale present, for ``check_keys``; a scale whose shape is
    not one ``scheme`` allows raises :class:`CheckpointError` naming ``where`` (the folder),
    the key and the layout."""
    shapes: dict[str, torch.Size] = {}
    for name in fp8_layers(model, scheme):
        linear = model.get_submodule(name)
        out, inp = linear.out_features, linear.in_features
        block = scheme.layer_block(out, inp)
        key = f"{name}.{scheme.scale_key}"
        if key in found:
            stored = tuple(found[key].shape)
            allowed = _stored_shapes(scheme, out, inp)
            if stored not in allowed:
                raise CheckpointError(
                    f"{where}: {key!r} has shape {stored}, but {_layout_name(scheme)} in "
                    f"config.json gives a weight of shape ({out}, {inp}) scales of shape "
                    f"{' or '.join(str(s) for s in allowed)}: fix quantization_config in "
                    "config.json or re-export the weights"
                )
            granularity = allowed[stored]
            block = {"tensor": (out, inp), "channel": (1, inp)}.get(granularity, block)
            shapes[key] = torch.Size(stored)
        input_key = f"{name}.input_scale"
        if scheme.static_input and input_key in found:
            stored = tuple(found[input_key].shape)
            if stored not in ((), (1,)):
                raise CheckpointError(
                    f"{where}: {input_key!r} has shape {stored}; a static activation scale is "
                    "one value (shape () or (1,)): re-export the weights"
                )
            shapes[input_key] = torch.Size(stored)
        _swap(model, name, _empty_fp8(linear, block, scheme))
    model.quantization = scheme
    return shapes


def scale_keys(model: nn.Module) -> dict[str, str]:
    """Each FP8 layer's weight-scale parameter name -> its checkpoint key (``weight_scale``
    or DeepSeek's ``weight_scale_inv``, by the model's scheme)."""
    scheme = getattr(model, "quantization", None)
    if scheme is None:
        return {}
    return {
        f"{name}.weight_scale": f"{name}.{scheme.scale_key}"
        for name, module in model.named_modules()
        if isinstance(module, Fp8Linear)
    }


def stored_scales(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (checkpoint key -> tensor) with each FP8 weight scale and static input
    scale in the shape its layout stores: a per-tensor scale a scalar under ``quant_method
    fp8``, ``[1]`` under compressed-tensors; per-channel and block scales as held."""
    scheme = model.quantization
    scalar = torch.Size(()) if scheme.method == "fp8" else torch.Size((1,))
    stored = dict(tensors)
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Linear):
            continue
        shape = (module.out_features, module.in_features)
        per_tensor = scheme.strategy != "block" and module.block == shape
        for key in (f"{name}.{scheme.scale_key}", f"{name}.input_scale"):
            if key in stored and (per_tensor or key.endswith("input_scale")):
                stored[key] = stored[key].reshape(scalar)
    return stored


def fp8_weight_keys(model: nn.Module, names: dict[str, Any]) -> frozenset[str]:
    """The checkpoint keys of ``model``'s FP8 weights; ``names`` maps parameters to keys."""
    return frozenset(
        names[f"{name}.weight"]
        for name, module in model.named_modules()
        if isinstance(module, Fp8Linear)
    )


def check_fp8_weights(keys: frozenset[str], found: dict[str, Any], where: str) -> None:
    """Raise :class:`CheckpointError` naming the FP8 layers' weights (checkpoint ``keys``)
    that the checkpoint ``found`` holds in a dtype other than e4m3."""
    wrong = sorted(k for k in keys if k in found and found[k].dtype != E4M3)
    if wrong:
        named = [f"{k} ({found[k].dtype})" for k in wrong]
        raise CheckpointError(
            f"{where}: quantization_config makes {named} FP8 layers, but the checkpoint holds "
            f"them in another dtype ({E4M3} expected): list those layers in the ignore list of "
            "quantization_config, or re-export them in FP8"
        )


def unquantized_cause(model: nn.Module) -> str:
    """Why ``model`` (a target being loaded) reads no FP8 tensor but its FP8 layers'
    weights: ``check_keys`` names it for an FP8 tensor anywhere else."""
    if getattr(model, "quantization", None) is None:
        return "config.json has no quantization_config"
    return (
        "speculum keeps them in the compute dtype (FP8 loads only the decoder layers' linear "
        "layers that quantization_config does not ignore)"
    )


def quantize_(
    model: DecoderModel, scheme: Fp8Scheme, *, input_scale: float | None = None
) -> DecoderModel:
    """Quantize ``model``'s layers that ``scheme`` covers to FP8 in place (each becomes an
    :class:`Fp8Linear` whose scales map each block's largest magnitude to 448), recording
    ``scheme`` on the model so that ``save_model`` writes an FP8 checkpoint. A static scheme
    needs ``input_scale``, the activation scale every layer records. Projections an engine
    fused (``decoder.fuse_projections_``) are unfused, their float tensors dropped: engines
    built over the model before are stale. Returns ``model``."""
    if scheme.static_input and input_scale is None:
        raise ValueError("a static-activation FP8 scheme needs input_scale")
    for name in fp8_layers(model, scheme):
        linear = model.get_submodule(name)
        block = scheme.layer_block(linear.out_features, linear.in_features)
        with torch.device(linear.weight.device):
            layer = _empty_fp8(linear, block, scheme)
        weight, scale = kernels.fp8.quantize_weight(linear.weight.detach(), block)
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.weight_scale.copy_(scale)
            if layer.input_scale is not None:
                layer.input_scale.fill_(input_scale)
            if linear.bias is not None:  # in the model's dtype, as it was
                layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        _swap(model, name, layer)
    for module in model.modules():
        if isinstance(module, Attention):
            module.qkv = None
        elif isinstance(module, MLP):
            module.gate_up = None
    model.quantization = scheme
    return model


def dequantize_(model: DecoderModel, dtype: torch.dtype) -> DecoderModel:
    """Replace every :class:`Fp8Linear` of ``model`` by an ``nn.Linear`` holding its weight's
    real values in ``dtype`` (the reference an FP8 model is compared with, and the bfloat16
    baseline of the same weights); returns ``model``, no longer quantized."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, Fp8Linear):
            continue
        linear = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        linear.weight = nn.Parameter(module.dequantized(dtype), requires_grad=False)
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.to(dtype), requires_grad=False)
        _swap(model, name, linear)
    model.quantization = None
    return model
