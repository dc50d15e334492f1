"""FROZEN_KV_MTP draft heads: MTP-style layers that own no KV cache and read the target's.

SGLang's FROZEN_KV_MTP (``frozen_kv_mtp_worker.py``, the Gemma 4 "assistant" of
``models/gemma4_mtp.py``) drafts with layers whose attention is *KV-shared* with target layers:
a draft layer projects only queries and attends, read-only, to the K/V the target already wrote
for the committed tokens. Nothing the draft computes is ever cached, so a round's draft steps all
see the same keys, and they all sit at one rotary position, that of the last committed token
(SGLang's ``clamp(seq_lens - 1)``, "not advanced per draft step").

This module gives Llama-family targets such a head, laid out in the spirit of DeepSeek's MTP
layers (``speculum.models.draft.MTPHead``)::

    x = eh_proj([enorm(embed(token)); hnorm(hidden)])       # embedding first
    x = layers[i](x) for each draft layer i                 # q_proj / o_proj only; K/V read from
                                                            #   target layer source_layers[i]
    h = norm(x)                                             # fed back, and into the lm_head
    logits = (lm_head or the target's lm_head)(h)

The embedding is always the target's (as SGLang's assistant binds ``target_embed_weight``); the
lm_head is the target's unless the checkpoint carries its own.

A head's forward reads, of its :class:`~speculum.state.forward.ForwardBatch`, only
``input_ids``, ``page_table``, ``prefix_lens`` (the committed length) and ``q_lens``: every query
attends to cache indices ``0 .. prefix_lens - 1`` of its source layers' caches at rotary position
``prefix_lens - 1``, whatever ``positions`` and ``new_mask`` say, and ``slots`` are never
written. The ``pool`` argument is the *target's* pool.

Checkpoint layout (``save_frozen_kv`` writes it, ``load_frozen_kv`` reads it strictly), a
folder with ``config.json`` and ``model.safetensors``:

``config.json``::

    {"architectures": ["FrozenKVMTPForCausalLM"], "model_type": "frozen_kv_mtp",
     "frozen_kv_source_layers": [L - 1, ...],   # target layer whose K/V draft layer i reads
     "target_num_hidden_layers": L,             # the target it was built for
     "own_lm_head": false,
     "transformer_layer_config": {...},         # a Llama/Qwen2/Qwen3/Mistral config.json of the
                                                #   draft layers (num_hidden_layers = their count)
     "torch_dtype": "bfloat16"}

weights: ``enorm.weight``, ``hnorm.weight``, ``eh_proj.weight`` ``[hidden, 2 * hidden]``;
``layers.{i}.input_layernorm.weight``, ``layers.{i}.self_attn.q_proj.weight`` (and ``.bias``
for q/k/v-biased kinds), ``layers.{i}.self_attn.q_norm.weight`` (Qwen3),
``layers.{i}.self_attn.o_proj.weight`` (and ``.bias`` with ``attention_bias``),
``layers.{i}.post_attention_layernorm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``;
``norm.weight``; ``lm_head.weight`` only with ``own_lm_head``. There is no ``k_proj`` or
``v_proj``: the keys and values are the target's.

A draft layer reads target layer ``s``'s cache, so it must have the target's K/V heads, head
size and rotary settings, and the head the target's hidden size and vocabulary; loading checks
all of it (:class:`~speculum.models.draft_loading.DraftTargetMismatch` names what differs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch
from jaxtyping import Float
from torch import Tensor, nn

from speculum.models.config import DecoderConfig, UnsupportedModel, read_json_object
from speculum.models.decoder import (
    Attention,
    DecoderLayer,
    DecoderModel,
    LMHead,
    RMSNorm,
    rope_inv_freq,
)
from speculum.models.draft_loading import DraftTargetMismatch, materialize
from speculum.models.loading import (
    DTYPES,
    CheckpointError,
    check_keys,
    open_checkpoint,
    randomize_,
    write_checkpoint,
)
from speculum.models.parallel import UnsupportedSplit
from speculum.state.forward import ForwardBatch
from speculum.state.kv import KVPool
from speculum.state.parallel import SINGLE, TensorParallel
from speculum.state.record import replace

__all__ = [
    "ARCHITECTURE",
    "FrozenKVConfig",
    "FrozenKVAttention",
    "FrozenKVHead",
    "frozen_kv_config",
    "random_frozen_kv",
    "load_frozen_kv",
    "save_frozen_kv",
]

#: ``config.json`` ``architectures[0]`` of a frozen-KV draft checkpoint.
ARCHITECTURE = "FrozenKVMTPForCausalLM"


@attrs.define(frozen=True, slots=True, kw_only=True)
class FrozenKVConfig:
    """Shapes of a frozen-KV head (all static).

    ``layer`` describes the draft layers (``num_layers`` of them, of the target's kind);
    ``source_layers[i]`` is the target layer whose K/V draft layer ``i`` reads;
    ``target_num_layers`` is the depth of the target the head was built for; ``own_head``
    gives the head its own ``lm_head`` instead of the target's.
    """

    layer: DecoderConfig
    source_layers: tuple[int, ...]
    target_num_layers: int
    own_head: bool = False

    def __attrs_post_init__(self) -> None:
        if self.layer.num_layers < 1:
            raise UnsupportedModel("a frozen-KV draft needs at least one layer")
        if len(self.source_layers) != self.layer.num_layers:
            raise ValueError(
                f"frozen_kv_source_layers {list(self.source_layers)} names "
                f"{len(self.source_layers)} target layers for {self.layer.num_layers} draft "
                "layers: give exactly one source layer per draft layer"
            )
        if self.layer.num_heads % self.layer.num_kv_heads:
            raise UnsupportedModel(
                f"{self.layer.num_heads} query heads cannot share {self.layer.num_kv_heads} "
                "K/V heads evenly"
            )


def check_target(config: FrozenKVConfig, target: DecoderConfig, where: str) -> None:
    """Raise :class:`DraftTargetMismatch` naming every way ``config`` does not fit ``target``."""
    layer, problems = config.layer, []
    if layer.vocab_size != target.vocab_size:
        problems.append(f"vocabulary: draft {layer.vocab_size} ids vs target {target.vocab_size}")
    if layer.hidden_size != target.hidden_size:
        problems.append(
            f"hidden size: the draft reads target hidden states of width {layer.hidden_size}, "
            f"the target's are {target.hidden_size}"
        )
    if config.target_num_layers != target.num_layers:
        problems.append(
            f"depth: built for a {config.target_num_layers}-layer target, this one has "
            f"{target.num_layers}"
        )
    if target.mla is not None:
        problems.append(
            f"attention: the target ({target.architecture}) is multi-head latent attention, "
            "whose cache holds latents, not the per-head keys and values a frozen-KV draft "
            "attends to"
        )
    if target.mamba is not None:
        problems.append(
            f"attention: the target ({target.architecture}) caches keys without rotary "
            "embedding, which a frozen-KV draft's rotated queries do not read"
        )
    bad = [s for s in config.source_layers if not 0 <= s < target.num_layers]
    if bad:
        problems.append(
            f"frozen_kv_source_layers {list(config.source_layers)}: layers {bad} are out of range "
            f"for a target with layers 0 .. {target.num_layers - 1}"
        )
    recurrent = [s for s in config.source_layers if s not in bad and target.is_recurrent(s)]
    if recurrent:
        problems.append(
            f"frozen_kv_source_layers {list(config.source_layers)}: layers {recurrent} of the "
            f"hybrid target keep recurrent state, not K/V; name attention layers "
            f"{attention_layers(target)}"
        )
    for name in ("num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "partial_rotary_factor"):
        ours, theirs = getattr(layer, name), getattr(target, name)
        if ours != theirs:
            problems.append(
                f"{name}: draft {ours!r} vs target {theirs!r} (the draft attends to the "
                "target's cached keys, so it must match them)"
            )
    if problems:
        raise DraftTargetMismatch(
            f"{where}: the frozen-KV draft does not fit this target ({'; '.join(problems)}); "
            "load it with the target it was built for"
        )


def attention_layers(target: DecoderConfig) -> list[int]:
    """The target layers that cache K/V (every layer but a hybrid's recurrent ones)."""
    return [n for n in range(target.num_layers) if not target.is_recurrent(n)]


class FrozenKVAttention(Attention):
    """:class:`~speculum.models.decoder.Attention` without K/V projections or K/V writes: its
    queries attend to layer ``layer`` of the target's pool (the source layer's pool layer), as
    ``batch`` shows it (through :func:`frozen_batch`: the committed prefix only)."""

    def __init__(self, config: DecoderConfig, source: int) -> None:
        super().__init__(config, source)
        del self.k_proj, self.v_proj
        if config.qk_norm:
            del self.k_norm

    def forward(
        self, x: Tensor, batch: ForwardBatch, pool: KVPool, inv_freq: Tensor
    ) -> Float[Tensor, "batch q hidden"]:
        """Project queries, rotate them, attend to the source cache; writes nothing."""
        return self.attend(self.queries(x, batch, inv_freq), batch, pool)


def frozen_batch(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` as a frozen-KV head sees it: every query at rotary position
    ``prefix_lens - 1`` and no tail (an all-False one-column mask), so attention reads the
    committed prefix only."""
    b, q = batch.input_ids.shape
    last = (batch.prefix_lens - 1).clamp(min=0)
    return replace(
        batch,
        positions=last[:, None].expand(b, q),
        new_mask=torch.zeros(b, q, 1, dtype=torch.bool, device=last.device),
    )


class FrozenKVHead(nn.Module):
    """A draft head that owns no KV cache (see the module docstring).

    Duck-types the EAGLE pipeline's head interface: ``capture_layers`` (none: it reads the
    target's final hidden state, as MTP does), ``target_features``, ``forward(batch, pool,
    hidden)`` with ``pool`` the target's, ``logits`` and ``new_pool``, which returns ``None``.
    The target's embedding and lm_head are borrowed, not registered (neither saved nor moved).
    """

    algorithm = "frozen_kv_mtp"
    capture_layers: tuple[int, ...] = ()
    #: Cache entries the head holds beyond the target's committed tokens: it holds none at all.
    ahead = 0

    def __init__(self, config: FrozenKVConfig, target: DecoderModel) -> None:
        super().__init__()
        check_target(config, target.config, "frozen-KV draft")
        self.config = config
        h, eps = config.layer.hidden_size, config.layer.rms_norm_eps
        self._target_embed = (target.model.embed_tokens,)
        self._target_head = (target.lm_head,)
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList()
        for i, source in enumerate(config.source_layers):
            layer = DecoderLayer(config.layer, i)
            # A hybrid's pool holds its attention layers only, in order.
            layer.self_attn = FrozenKVAttention(config.layer, target.config.cache_layer(source))
            self.layers.append(layer)
        self.norm = RMSNorm(h, eps)
        if config.own_head:
            self.lm_head = LMHead(h, config.layer.vocab_size)
        self.register_buffer("inv_freq", rope_inv_freq(config.layer), persistent=False)

    @property
    def draft_vocab_size(self) -> int:
        """How many distinct tokens the head can propose: the whole target vocabulary."""
        return self.config.layer.vocab_size

    def reset_buffers(self) -> None:
        """Recompute the rotary table (float32) after ``to_empty`` or a dtype cast."""
        self.inv_freq = rope_inv_freq(self.config.layer).to(self.eh_proj.weight.device)

    def target_features(
        self,
        final_hidden: Float[Tensor, "batch q hidden"],
        captured: tuple[Float[Tensor, "batch q hidden"], ...],
    ) -> Float[Tensor, "batch q hidden"]:
        """The target's final-normed hidden state, as MTP heads read it."""
        return final_hidden

    def forward(
        self, batch: ForwardBatch, pool: KVPool, hidden: Float[Tensor, "batch q hidden"]
    ) -> Float[Tensor, "batch q hidden"]:
        """The final norm of the last layer's output (fed back, and into :meth:`logits`).

        ``pool`` is the target's KV pool, read at the source layers and never written.
        """
        batch = frozen_batch(batch)
        embeds = self._target_embed[0](batch.input_ids).to(hidden.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, batch, pool, self.inv_freq)
        return self.norm(x)

    def logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """The head's own ``lm_head`` or the target's, in float32."""
        head = self.lm_head if self.config.own_head else self._target_head[0]
        return head(hidden).float()

    def new_pool(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None) -> None:
        """No pool: the head owns no KV (its attention reads the target's pool)."""
        return None


def frozen_kv_config(
    target: DecoderConfig,
    *,
    num_layers: int = 1,
    source_layers: tuple[int, ...] | None = None,
    own_head: bool = False,
) -> FrozenKVConfig:
    """The usual head for ``target``: ``num_layers`` layers shaped like the target's, each
    reading the target's last attention layer (SGLang ties each assistant layer to the
    target's last layer of its attention type; a Llama-family target has one type, a hybrid's
    recurrent layers have no K/V)."""
    last = attention_layers(target)[-1]
    sources = source_layers if source_layers is not None else (last,) * num_layers
    layer = attrs.evolve(target.dense(), num_layers=len(sources), num_nextn_predict_layers=0)
    return FrozenKVConfig(
        layer=layer,
        source_layers=tuple(sources),
        target_num_layers=target.num_layers,
        own_head=own_head,
    )


def _finish(head: FrozenKVHead, target: DecoderModel, dtype: torch.dtype | None) -> FrozenKVHead:
    head = head.to(dtype or target.model.embed_tokens.weight.dtype)
    head.reset_buffers()
    return head.eval().requires_grad_(False)


def random_frozen_kv(
    target: DecoderModel,
    *,
    num_layers: int = 1,
    source_layers: tuple[int, ...] | None = None,
    own_head: bool = False,
    seed: int = 0,
    std: float = 0.02,
) -> FrozenKVHead:
    """A head with normal(0, std) weights, unit norms and zero biases, in the target's dtype
    and on its device."""
    config = frozen_kv_config(
        target.config, num_layers=num_layers, source_layers=source_layers, own_head=own_head
    )
    head = randomize_(FrozenKVHead(config, target), seed=seed, std=std)
    return _finish(head.to(target.model.embed_tokens.weight.device), target, None)


def _config_dict(head: FrozenKVHead) -> dict[str, Any]:
    config = head.config
    dtype = {v: k for k, v in DTYPES.items()}.get(head.eh_proj.weight.dtype, "float32")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "frozen_kv_mtp",
        "frozen_kv_source_layers": list(config.source_layers),
        "target_num_hidden_layers": config.target_num_layers,
        "own_lm_head": config.own_head,
        "transformer_layer_config": config.layer.to_dict(),
        "torch_dtype": dtype,
    }


def save_frozen_kv(head: FrozenKVHead, folder: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in the layout of the module docstring."""
    return write_checkpoint(folder, dict(head.named_parameters()), _config_dict(head))


def _parse(raw: dict[str, Any], where: str) -> FrozenKVConfig:
    archs = raw.get("architectures") or []
    if archs[:1] != [ARCHITECTURE]:
        raise CheckpointError(
            f"{where}: config.json architectures {archs} is not [{ARCHITECTURE!r}]: not a "
            "frozen-KV draft (see speculum.models.frozen_kv for the layout)"
        )
    missing = [
        k
        for k in ("frozen_kv_source_layers", "transformer_layer_config", "target_num_hidden_layers")
        if k not in raw
    ]
    if missing:
        raise CheckpointError(f"{where}: config.json lacks {missing}")
    sources = raw["frozen_kv_source_layers"]
    if not isinstance(sources, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in sources
    ):
        raise CheckpointError(
            f"{where}: frozen_kv_source_layers must be a list of target layer indices, "
            f"got {sources!r}"
        )
    section = f"{Path(where) / 'config.json'} transformer_layer_config"
    layer = DecoderConfig.from_dict(raw["transformer_layer_config"], section)
    try:
        return FrozenKVConfig(
            layer=layer,
            source_layers=tuple(sources),
            target_num_layers=int(raw["target_num_hidden_layers"]),
            own_head=bool(raw.get("own_lm_head", False)),
        )
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from err


def load_frozen_kv(
    folder: str | Path,
    target: DecoderModel,
    algorithm: str = "frozen_kv_mtp",
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    tp: TensorParallel = SINGLE,
) -> FrozenKVHead:
    """Load the frozen-KV draft in ``folder`` for ``target``, strictly.

    ``algorithm`` is accepted for a uniform signature with ``load_draft`` and must be
    ``frozen_kv_mtp``. ``dtype`` and ``device`` default to the target's. ``tp`` must be the
    target's tensor-parallel group (the head reads the target's sharded KV cache). Raises
    :class:`DraftTargetMismatch` when the draft does not fit ``target`` (vocabulary, hidden
    size, depth, a source layer out of range, K/V shape or rotary settings) and
    ``CheckpointError`` for a missing folder or config, another architecture, a layer config
    no model runs with, or missing, unexpected, non-float or mis-shaped tensors,
    ``UnsupportedModel`` for a layer config speculum does not implement, and
    :class:`~speculum.models.parallel.UnsupportedSplit` for a ``tp`` other than the target's.
    """
    if algorithm != "frozen_kv_mtp":
        raise ValueError(f"load_frozen_kv loads frozen_kv_mtp drafts, not {algorithm!r}")
    folder = Path(folder)
    where = str(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json; pass a frozen-KV draft folder")
    config = _parse(read_json_object(folder / "config.json"), where)
    check_target(config, target.config, where)
    if tp.size != target.tp.size:
        raise UnsupportedSplit(
            f"{where}: the target is sharded over {target.tp.size} tensor-parallel rank(s) and "
            f"the draft over {tp.size}; a frozen-KV draft reads the target's KV cache, which "
            "holds only this rank's K/V heads, so shard it with the target (draft_tp = tp, "
            "the default)"
        )
    found = open_checkpoint(folder)
    with torch.device("meta"):
        head = FrozenKVHead(config, target)
    expected = {name: p.shape for name, p in head.named_parameters()}
    tolerated = frozenset(k for k in found if k.endswith("rotary_emb.inv_freq"))
    check_keys(expected, found, where, tolerated, config.layer)
    names = {name: name for name in expected}
    head = materialize(head, names, found, target, dtype=dtype, device=device, tp=tp)
    return head.eval().requires_grad_(False)
