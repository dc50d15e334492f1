"""Multi-layer EAGLE: ``K`` separate MTP layers, one per draft depth (DeepSeek-V3's
``num_nextn_predict_layers > 1``, SGLang's multi-layer EAGLE).

Layer ``k`` (0-based here, ``k + 1`` in the pipeline's 1-based notation) is a whole
:class:`~speculum.models.draft.MTPHead` (``eh_proj([enorm(embed); hnorm(hidden)])``, one decoder
layer, ``shared_head``) whose attention reads and writes layer ``k`` of the head's draft pool, so
one pool of ``K`` layers, indexed by the target's page ids, holds every layer's cache.

Checkpoint layouts (both strict, both DeepSeek-style keys ``model.layers.{L + k}.*`` for
``k = 0 .. K - 1`` where ``L`` is the target's layer count, ``num_nextn_predict_layers: K`` in
``config.json``):

- ``in-target``: the target's own folder, its weights beside the MTP layers;
- ``separate``: a folder of only the MTP layers, with the target's ``config.json`` (plus
  ``num_nextn_predict_layers``).

Key names per layer are those of ``speculum.models.draft_loading``'s MTP layouts (its
``head_checkpoint_names``: an MoE target's MTP layers are MoE layers, experts one by one as the
target stores its own), so a one-layer folder of either form is also an ordinary MTP
checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch
from jaxtyping import Float
from torch import Tensor, nn

from speculum.models.config import read_json_object
from speculum.models.decoder import DecoderModel
from speculum.models.draft import DraftConfig, MTPHead, draft_config, mtp_layer_config, pool_for
from speculum.models.draft_loading import (
    DraftTargetMismatch,
    _base_layer_config,
    _check_target,
    _mtp_layers,
    _read_weights,
    _share_equal_embedding,
    head_checkpoint_names,
    materialize,
    target_checkpoint_keys,
)
from speculum.models.loading import (
    CheckpointError,
    Stacked,
    check_keys,
    checkpoint_shapes,
    checkpoint_tensors,
    randomize_,
    save_model,
    write_checkpoint,
)
from speculum.state.forward import ForwardBatch
from speculum.state.kv import KVPool
from speculum.state.parallel import SINGLE, TensorParallel

__all__ = [
    "MultiLayerEagleHead",
    "random_multi_layer",
    "load_multi_layer",
    "save_multi_layer",
]


class MultiLayerEagleHead(nn.Module):
    """``num_layers`` MTP layers; layer ``k`` owns layer ``k`` of the draft pool.

    ``config`` is one layer's :class:`DraftConfig` (every layer has the same shape).
    """

    #: EAGLE-style cache pairing (entry ``j`` holds a hidden state of token ``j``).
    ahead = 0
    capture_layers: tuple[int, ...] = ()

    def __init__(self, config: DraftConfig, target: DecoderModel, num_layers: int) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"a multi-layer EAGLE head needs at least one layer, not {num_layers}")
        self.config = config
        # Layer k is the target's layer L + k (its kind by the target's rule) on pool layer k.
        self.layers = nn.ModuleList(MTPHead(config, target, k) for k in range(num_layers))

    @property
    def draft_vocab_size(self) -> int:
        """How many distinct tokens the head can propose (the target vocabulary)."""
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        """``K``: one layer per draft depth."""
        return len(self.layers)

    def reset_buffers(self) -> None:
        """Recompute every layer's rotary table (after ``to_empty`` or a dtype cast)."""
        for layer in self.layers:
            layer.reset_buffers()

    def layer_forward(
        self, k: int, batch: ForwardBatch, pool: KVPool, hidden: Float[Tensor, "batch q hidden"]
    ) -> Float[Tensor, "batch q hidden"]:
        """Layer ``k`` (0-based) over ``batch``: writes pool layer ``k`` and returns its
        post-norm output (``shared_head.norm``), the hidden the next layer may chain on."""
        return self.layers[k](batch, pool, hidden)

    def layer_logits(self, k: int, hidden: Float[Tensor, "*rows hidden"]) -> Tensor:
        """Layer ``k``'s float32 logits over the target vocabulary."""
        return self.layers[k].logits(hidden)

    def new_pool(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None) -> KVPool:
        """A zeroed pool of ``num_layers`` layers (page 0 is the padding sink)."""
        return pool_for(self, self.config.layer, self.num_layers, num_pages, page_size, dtype)


def random_multi_layer(
    target: DecoderModel,
    num_layers: int,
    *,
    seed: int = 0,
    std: float = 0.02,
    **changes: object,
) -> MultiLayerEagleHead:
    """A head of ``num_layers`` MTP layers with normal(0, std) weights, unit norms and zero
    biases, in the target's dtype and on its device; ``changes`` override the layers'
    :class:`DraftConfig` (``own_head=True``, ``own_embedding=True``)."""
    config = draft_config(target.config, "mtp", **changes)
    head = randomize_(MultiLayerEagleHead(config, target, num_layers), seed=seed, std=std)
    weight = target.model.embed_tokens.weight
    head = head.to(device=weight.device, dtype=weight.dtype)
    head.reset_buffers()
    return head.eval().requires_grad_(False)


def _prefixes(num_target_layers: int, num_layers: int) -> list[str]:
    return [f"model.layers.{num_target_layers + k}." for k in range(num_layers)]


def _keys(head: MultiLayerEagleHead) -> dict[str, str | Stacked]:
    """Head parameter name -> checkpoint key (or an MoE layer's per-expert keys)."""
    out: dict[str, str | Stacked] = {}
    for k, prefix in enumerate(_prefixes(head.config.target_num_layers, head.num_layers)):
        names = head_checkpoint_names(head.layers[k], "mtp", prefix)
        out |= {f"layers.{k}.{name}": key for name, key in names.items()}
    return out


def load_multi_layer(
    folder: str | Path,
    target: DecoderModel,
    algorithm: str = "multi_layer_eagle",
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    tp: TensorParallel = SINGLE,
) -> MultiLayerEagleHead:
    """Load the ``num_nextn_predict_layers`` MTP layers in ``folder`` (either form), strictly.

    ``algorithm`` is there for the engine's loader signature and must be
    ``multi_layer_eagle``; ``dtype`` and ``device`` default to the target's; ``tp`` shards
    the layers (see ``draft_loading.load_draft``).

    Raises ``CheckpointError`` for a missing ``num_nextn_predict_layers``, MTP layers that are
    not ``L .. L + K - 1``, or missing, unexpected or mis-shaped tensors (the target's own
    weights are tolerated), and :class:`DraftTargetMismatch` for layers of another target.
    """
    if algorithm != "multi_layer_eagle":
        raise ValueError(f"load_multi_layer loads multi_layer_eagle heads, not {algorithm!r}")
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder} has no config.json; pass a multi-layer MTP folder")
    where = str(folder)
    raw = read_json_object(folder / "config.json")
    found, _ = _read_weights(folder)
    num_layers = int(raw.get("num_nextn_predict_layers") or 0)
    if num_layers < 1:
        raise CheckpointError(
            f"{where}: config.json has no num_nextn_predict_layers >= 1; a multi-layer EAGLE "
            "folder names how many MTP layers it holds"
        )
    base = target.config.num_layers
    if int(raw.get("num_hidden_layers", -1)) != base:
        raise DraftTargetMismatch(
            f"{where}: its MTP layers follow a {raw.get('num_hidden_layers')}-layer target, but "
            f"the target has {base} layers"
        )
    wanted = list(range(base, base + num_layers))
    if _mtp_layers(found) != wanted:
        raise CheckpointError(
            f"{where}: num_nextn_predict_layers={num_layers} needs MTP layers {wanted} "
            f"(model.layers.N.eh_proj.weight), found {_mtp_layers(found)}"
        )
    layer = _base_layer_config(raw, str(folder / "config.json"))
    layer = mtp_layer_config(layer)
    _check_target(layer.vocab_size, layer.hidden_size, target.config, where)
    prefixes = _prefixes(base, num_layers)
    own_head = {f"{p}shared_head.head.weight" in found for p in prefixes}
    own_embedding = {f"{p}embed_tokens.weight" in found for p in prefixes}
    if len(own_head) != 1 or len(own_embedding) != 1:
        raise CheckpointError(
            f"{where}: some MTP layers have their own shared_head.head / embed_tokens and "
            "some do not; every layer must have the same parts"
        )
    config = draft_config(
        target.config,
        "mtp",
        layer=layer,
        own_head=own_head.pop(),
        own_embedding=own_embedding.pop(),
    )
    with torch.device("meta"):
        head = MultiLayerEagleHead(config, target, num_layers)
    names = _keys(head)
    target_keys = target_checkpoint_keys(target)
    tolerated = {k for k in found if k.endswith("rotary_emb.inv_freq")}
    tolerated |= {k for k in found if k in target_keys and not k.startswith(tuple(prefixes))}
    check_keys(checkpoint_shapes(head, names), found, where, frozenset(tolerated), layer)
    weight = target.model.embed_tokens.weight
    head = materialize(head, names, found, target, dtype=dtype, device=device, tp=tp)
    for mtp in head.layers:
        _share_equal_embedding(mtp, weight)
    return head.eval().requires_grad_(False)


def save_multi_layer(
    head: MultiLayerEagleHead, folder: str | Path, *, target: DecoderModel | None = None
) -> Path:
    """Write ``head`` to ``folder``: inside the target's folder when ``target`` is given (its
    weights and config too, ``num_nextn_predict_layers = K``), else the separate form."""
    folder = Path(folder)
    tensors = checkpoint_tensors(head, _keys(head))
    shape = attrs.evolve(
        head.config.layer,
        num_layers=head.config.target_num_layers,
        num_nextn_predict_layers=head.num_layers,
    )
    if target is not None:
        if target.config.num_layers != head.config.target_num_layers:
            raise ValueError("this head belongs to a target with another layer count")
        save_model(target, folder)
        from safetensors.torch import load_file

        tensors = {**load_file(folder / "model.safetensors"), **tensors}
        shape = attrs.evolve(target.config, num_nextn_predict_layers=head.num_layers)
    return write_checkpoint(folder, tensors, shape.to_dict())
