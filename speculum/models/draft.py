"""Draft heads of the EAGLE family over the paged KV cache: EAGLE-1, EAGLE-3 and MTP/NEXTN.

Every head reads the target's features, embeds the draft tokens, runs one decoder layer (a
few for EAGLE-1) that writes its K/V into the draft's *own* pool at ``batch.slots`` and attends
through ``speculum.kernels.paged_attention`` exactly like the target's layers, and returns the
hidden state that feeds the next draft step. Logits are a separate call, over the *target*
vocabulary, so that pipelines compute them only where needed and verify against target ids.

One round, in the pipeline's terms (positions follow SGLang, which shares the target's page
table with the draft: the draft's cache index ``i`` holds the pair (target hidden of token
``i``, token ``i + 1``) at rotary position ``i``)::

    final, captured = target(batch, target_pool, capture_layers=head.capture_layers)
    h = head.target_features(final, captured)          # positions fed by the target
    h = head(draft_batch, draft_pool, h)               # input ids shifted left by one
    p = head.logits(h)                                 # over the target vocabulary
    h = head(next_batch, draft_pool, h[:, -1:])        # later steps feed the head's own output

What each algorithm feeds back (checked against SGLang's ``llama_eagle.py``,
``llama_eagle3.py`` and ``deepseek_nextn.py`` and the EAGLE reference ``cnets.py``):

========  ===========================================  ======================================
head      ``forward`` returns (= hidden fed back)      ``logits``
========  ===========================================  ======================================
EAGLE-1   the last layer's residual stream (the        the target's ``lm_head`` on it, no
          draft has no final norm)                     norm
EAGLE-3   the midlayer's residual stream, *pre-norm*   ``lm_head(norm(h))`` over the draft
                                                       vocabulary, scattered through ``d2t``
MTP       ``shared_head.norm`` of the layer output,    ``shared_head.head`` (or the target's
          *post-norm*                                  ``lm_head``) on it
========  ===========================================  ======================================
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import torch
from jaxtyping import Float
from torch import Tensor, nn

from speculum.models.config import DecoderConfig, UnsupportedModel
from speculum.models.decoder import (
    MLP,
    Attention,
    DecoderLayer,
    DecoderModel,
    LMHead,
    RMSNorm,
    decoder_layer,
    pool_for,
    rope_inv_freq,
)
from speculum.models.loading import randomize_
from speculum.state.forward import ForwardBatch
from speculum.state.kv import KVPool

__all__ = [
    "ALGORITHMS",
    "DraftConfig",
    "DraftHead",
    "EagleHead",
    "Eagle3Head",
    "MTPHead",
    "build_draft",
    "canonical_algorithm",
    "default_capture_layers",
    "draft_config",
    "mtp_layer_config",
    "mtp_layer_index",
    "pool_for",
    "random_draft",
]

#: Canonical algorithm names; EAGLE-2 runs EAGLE-1 heads, NEXTN is MTP.
ALGORITHMS = ("eagle", "eagle3", "mtp")
_ALIASES = {
    "eagle": "eagle",
    "eagle1": "eagle",
    "eagle2": "eagle",
    "eagle3": "eagle3",
    "mtp": "mtp",
    "nextn": "mtp",
}


def canonical_algorithm(name: str) -> str:
    """``eagle``, ``eagle3`` or ``mtp`` for any accepted spelling (EAGLE-2 and NEXTN too)."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in _ALIASES:
        raise ValueError(
            f"unknown draft algorithm {name!r}; use one of eagle (eagle2), eagle3, mtp (nextn)"
        )
    return _ALIASES[key]


def default_capture_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default target layers for an ``L``-layer target: ``(1, L//2 - 1, L - 4)``.

    These are the layers whose *outputs* SGLang and vLLM capture by default (the residual
    streams entering layers 2, L/2 and L-3), as ``DecoderModel.forward(capture_layers=...)``
    counts them.
    """
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= num_layers:
        raise UnsupportedModel(
            f"the target has {num_layers} layers, so EAGLE-3's default capture layers "
            f"(1, L//2-1, L-4) = {ids} are not three distinct layers; give the draft's config "
            "eagle_aux_hidden_state_layer_ids explicitly"
        )
    return ids


@attrs.define(frozen=True, slots=True, kw_only=True)
class DraftConfig:
    """Shapes and options of a draft head (all static).

    ``layer`` describes the draft's decoder layer(s): its ``vocab_size`` is the target's
    vocabulary, ``num_layers`` the number of draft layers (EAGLE-1 may have several; EAGLE-3
    and MTP have one). ``draft_vocab_size`` is EAGLE-3's reduced ``lm_head`` vocabulary
    (``0`` means the full target vocabulary).
    """

    algorithm: str
    layer: DecoderConfig
    target_hidden_size: int
    target_num_layers: int
    capture_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0
    fc_bias: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    own_embedding: bool = False
    own_head: bool = False

    def __attrs_post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm!r} is not one of {ALGORITHMS}")
        if self.layer.num_layers < 1:
            raise UnsupportedModel("a draft needs at least one decoder layer")
        if self.algorithm in ("eagle3", "mtp") and self.layer.num_layers != 1:
            raise UnsupportedModel(
                f"{self.algorithm} draft with {self.layer.num_layers} layers: speculum runs "
                "one-layer EAGLE-3 and MTP heads (as published checkpoints are)"
            )
        if self.algorithm == "eagle3" and not self.capture_layers:
            raise ValueError("an EAGLE-3 draft needs capture_layers")
        if self.algorithm != "eagle3" and self.capture_layers:
            raise ValueError(f"an {self.algorithm} draft captures no target layers")
        if not 0 <= self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} is outside 0 .. "
                f"{self.layer.vocab_size} (the target vocabulary)"
            )
        if self.algorithm != "eagle3" and self.draft_vocab_size not in (0, self.vocab_size):
            raise ValueError("only EAGLE-3 drafts have a reduced vocabulary")
        if self.own_embedding is False and self.hidden_size != self.target_hidden_size:
            raise UnsupportedModel(
                f"the draft's hidden size {self.hidden_size} differs from the target's "
                f"{self.target_hidden_size}, so it cannot share the target's embedding: it "
                "needs its own embed_tokens"
            )
        if self.algorithm != "eagle3" and self.hidden_size != self.target_hidden_size:
            raise UnsupportedModel(
                f"an {self.algorithm} draft reads the target's final hidden state directly, so "
                f"its hidden size ({self.hidden_size}) must equal the target's "
                f"({self.target_hidden_size})"
            )

    @property
    def hidden_size(self) -> int:
        """Width of the draft's hidden states."""
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        """The target vocabulary (input ids and logits)."""
        return self.layer.vocab_size

    @property
    def head_vocab_size(self) -> int:
        """Rows of the draft's own ``lm_head`` (EAGLE-3's reduced vocabulary, or all)."""
        return self.draft_vocab_size or self.layer.vocab_size


@runtime_checkable
class DraftHead(Protocol):
    """What pipelines need from a draft head; :class:`EagleHead`, :class:`Eagle3Head` and
    :class:`MTPHead` implement it (calling the head runs :meth:`forward`)."""

    config: DraftConfig

    @property
    def algorithm(self) -> str:
        """``eagle``, ``eagle3`` or ``mtp``."""
        ...

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs :meth:`target_features` consumes, ascending."""
        ...

    def target_features(
        self,
        final_hidden: Float[Tensor, "batch q target_hidden"],
        captured: tuple[Float[Tensor, "batch q target_hidden"], ...],
    ) -> Float[Tensor, "batch q hidden"]:
        """The draft's input hidden for positions whose features come from the target."""
        ...

    def forward(
        self, batch: ForwardBatch, pool: KVPool, hidden: Float[Tensor, "batch q hidden"]
    ) -> Float[Tensor, "batch q hidden"]:
        """One draft forward: writes K/V into ``pool`` and returns the hidden fed back."""
        ...

    def __call__(
        self, batch: ForwardBatch, pool: KVPool, hidden: Float[Tensor, "batch q hidden"]
    ) -> Float[Tensor, "batch q hidden"]:
        """Same as :meth:`forward`."""
        ...

    def logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """Float32 logits over the target vocabulary of hidden states :meth:`forward` gave."""
        ...

    def new_pool(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None) -> KVPool:
        """A zeroed KV pool shaped for the draft's own layers."""
        ...


class _DraftBase(nn.Module):
    """Shared parts: config, the target's embedding / lm_head (borrowed, not registered, so
    they are neither saved nor moved with the head), an optional own embedding, the rotary
    table and the draft's KV pool shape."""

    #: Cache entries the head holds beyond the target's committed tokens: none, since entry
    #: ``i`` pairs the target's hidden state of token ``i`` with token ``i + 1``.
    ahead = 0

    def __init__(self, config: DraftConfig, target: DecoderModel) -> None:
        super().__init__()
        if target.config.vocab_size != config.vocab_size:
            raise UnsupportedModel(
                f"draft vocabulary {config.vocab_size} vs target vocabulary "
                f"{target.config.vocab_size}: the draft belongs to a different target"
            )
        self.config = config
        # Tuples keep nn.Module from registering the target's modules as the head's own.
        self._target_embed = (target.model.embed_tokens,)
        self._target_head = (target.lm_head,)
        if config.own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.register_buffer("inv_freq", rope_inv_freq(config.layer), persistent=False)

    @property
    def algorithm(self) -> str:
        """``eagle``, ``eagle3`` or ``mtp``."""
        return self.config.algorithm

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs :meth:`target_features` consumes, ascending."""
        return self.config.capture_layers

    @property
    def draft_vocab_size(self) -> int:
        """How many distinct tokens the head can propose (EAGLE-3's reduced vocabulary)."""
        return self.config.head_vocab_size

    @property
    def embedding(self) -> nn.Embedding:
        """The embedding the draft reads token ids with (its own, or the target's)."""
        return self.embed_tokens if self.config.own_embedding else self._target_embed[0]

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after ``to_empty`` or a dtype cast): the rotary
        table stays float32."""
        device = next(self.parameters()).device
        self.inv_freq = rope_inv_freq(self.config.layer).to(device)

    def target_features(
        self,
        final_hidden: Float[Tensor, "batch q target_hidden"],
        captured: tuple[Float[Tensor, "batch q target_hidden"], ...],
    ) -> Float[Tensor, "batch q hidden"]:
        """The target's final-normed hidden state, as SGLang feeds EAGLE-1 and MTP."""
        return final_hidden

    def new_pool(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None) -> KVPool:
        """A zeroed KV pool shaped for the draft's own layers (page 0 is the padding sink)."""
        return pool_for(
            self, self.config.layer, self.config.layer.num_layers, num_pages, page_size, dtype
        )


class EagleHead(_DraftBase):
    """EAGLE-1 (EAGLE reference ``cnets.py``, SGLang ``LlamaForCausalLMEagle``).

    ``x = fc([embed(ids); hidden])`` (embedding first), then the decoder layers, the first
    one without its input norm; no final norm. The target's ``lm_head`` gives the logits.
    """

    def __init__(self, config: DraftConfig, target: DecoderModel) -> None:
        super().__init__(config, target)
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layers = nn.ModuleList(
            DecoderLayer(config.layer, i) for i in range(config.layer.num_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()

    def forward(
        self, batch: ForwardBatch, pool: KVPool, hidden: Float[Tensor, "batch q hidden"]
    ) -> Float[Tensor, "batch q hidden"]:
        """The last layer's residual stream (what SGLang feeds back and into the lm_head)."""
        embeds = self.embedding(batch.input_ids).to(hidden.dtype)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        for layer in self.layers:
            x = layer(x, batch, pool, self.inv_freq)
        return x

    def logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """The target's ``lm_head``, in float32."""
        return self._target_head[0](hidden).float()


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over ``[input_layernorm(embed); hidden_norm(hidden)]``
    (twice the hidden width), residual = ``hidden`` (or ``hidden_norm(hidden)`` with the
    speculators option ``norm_before_residual``), then the usual MLP block."""

    def __init__(self, config: DecoderConfig, norm_before_residual: bool) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.self_attn = Attention(config, 0, input_size=2 * h)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(
        self, embeds: Tensor, hidden: Tensor, batch: ForwardBatch, pool: KVPool, inv_freq: Tensor
    ) -> Tensor:
        """The residual stream leaving the layer (pre-norm)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds.to(hidden.dtype)), normed], dim=-1)
        x = residual + self.self_attn(x, batch, pool, inv_freq)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(_DraftBase):
    """EAGLE-3 (EAGLE reference, SGLang/SpecForge ``LlamaForCausalLMEagle3``, vLLM
    speculators ``Eagle3Speculator``).

    ``target_features`` is ``fc`` over the concatenated captured target layers (ascending
    layer order, as SGLang and vLLM concatenate them); the midlayer's pre-norm output is fed
    back; logits are ``lm_head(norm(h))`` over the reduced draft vocabulary, placed at target
    ids ``draft_id + d2t[draft_id]`` and ``-inf`` elsewhere.
    """

    def __init__(self, config: DraftConfig, target: DecoderModel) -> None:
        super().__init__(config, target)
        h, eps = config.hidden_size, config.layer.rms_norm_eps
        width = len(config.capture_layers) * config.target_hidden_size
        if config.norm_before_fc:
            self.input_norm = RMSNorm(width, eps)
        self.fc = nn.Linear(width, h, bias=config.fc_bias)
        self.midlayer = Eagle3Layer(config.layer, config.norm_before_residual)
        self.norm = RMSNorm(h, eps)
        self.lm_head = LMHead(h, config.head_vocab_size)
        self.register_buffer("target_ids", torch.arange(config.head_vocab_size), persistent=False)
        self.maps_identity = config.head_vocab_size == config.vocab_size

    def set_target_ids(self, target_ids: Tensor) -> None:
        """Map draft id ``i`` to target id ``target_ids[i]`` (``i + d2t[i]`` in checkpoints)."""
        if target_ids.shape != (self.config.head_vocab_size,):
            raise ValueError(
                f"target_ids has shape {tuple(target_ids.shape)}, the draft vocabulary has "
                f"{self.config.head_vocab_size} ids"
            )
        ids = target_ids.to(device=self.target_ids.device, dtype=torch.int64)
        self.target_ids = ids
        self.maps_identity = self.config.head_vocab_size == self.config.vocab_size and bool(
            torch.equal(ids.cpu(), torch.arange(ids.numel()))
        )

    def target_features(
        self,
        final_hidden: Float[Tensor, "batch q target_hidden"],
        captured: tuple[Float[Tensor, "batch q target_hidden"], ...],
    ) -> Float[Tensor, "batch q hidden"]:
        """``fc`` over the captured target layers, concatenated in ``capture_layers`` order."""
        if len(captured) != len(self.capture_layers):
            raise ValueError(
                f"EAGLE-3 needs the outputs of target layers {self.capture_layers}, got "
                f"{len(captured)} captured tensors: run the target with "
                "capture_layers=head.capture_layers"
            )
        x = torch.cat(captured, dim=-1)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        return self.fc(x)

    def forward(
        self, batch: ForwardBatch, pool: KVPool, hidden: Float[Tensor, "batch q hidden"]
    ) -> Float[Tensor, "batch q hidden"]:
        """The midlayer's residual stream, pre-norm (what SGLang and vLLM feed back)."""
        embeds = self.embedding(batch.input_ids)
        return self.midlayer(embeds, hidden, batch, pool, self.inv_freq)

    def draft_logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows dv"]:
        """Float32 logits over the reduced draft vocabulary (before the ``d2t`` scatter)."""
        return self.lm_head(self.norm(hidden)).float()

    def logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """Draft logits placed at their target ids; ``-inf`` outside the draft vocabulary."""
        small = self.draft_logits(hidden)
        if self.maps_identity:
            return small
        full = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.target_ids, small)


class _SharedHead(nn.Module):
    """DeepSeek-V3's ``shared_head``: a norm, and optionally its own copy of the lm_head."""

    def __init__(
        self, hidden: int, vocab: int, eps: float, own_head: bool, offset: float = 0.0
    ) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps, offset)
        if own_head:
            self.head = LMHead(hidden, vocab)


class MTPHead(_DraftBase):
    """DeepSeek-V3-style MTP / NEXTN layer (SGLang ``deepseek_nextn.py``):
    ``eh_proj([enorm(embed); hnorm(hidden)])`` (embedding first), one decoder layer of the
    target's kind, then ``shared_head.norm``; logits by ``shared_head.head`` when the
    checkpoint has one, else the target's ``lm_head``.

    The decoder layer is built as the target builds layer :func:`mtp_layer_index` (``decoder.
    decoder_layer``; ``depth`` counts the MTP layers): an MoE layer of the target's routing
    in an MoE model's sparse layers, the dense MLP elsewhere. Its K/V go to layer ``depth``
    of the draft's pool.

    Qwen3-Next's MTP layer (SGLang ``qwen3_next_mtp.py``, vLLM ``qwen3_next_mtp.py``) is the
    same computation under other names (``fc``, ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``norm``; ``draft_loading`` maps them): its norms are
    zero-centred like the target's (``DecoderConfig.norm_offset``), its layer a gated
    full-attention layer (:func:`mtp_layer_config`), and it always uses the target's
    ``lm_head``."""

    def __init__(self, config: DraftConfig, target: DecoderModel, depth: int = 0) -> None:
        super().__init__(config, target)
        layer = config.layer
        h, eps, offset = config.hidden_size, layer.rms_norm_eps, layer.norm_offset
        self.enorm = RMSNorm(h, eps, offset)
        self.hnorm = RMSNorm(h, eps, offset)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.decoder = decoder_layer(layer, mtp_layer_index(config, depth), depth)
        self.shared_head = _SharedHead(h, config.vocab_size, eps, config.own_head, offset)

    def forward(
        self, batch: ForwardBatch, pool: KVPool, hidden: Float[Tensor, "batch q hidden"]
    ) -> Float[Tensor, "batch q hidden"]:
        """``shared_head.norm`` of the layer output, post-norm (what SGLang feeds back)."""
        embeds = self.embedding(batch.input_ids).to(hidden.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x = self.decoder(x, batch, pool, self.inv_freq)
        return self.shared_head.norm(x)

    def logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """``shared_head.head`` (or the target's ``lm_head``) in float32; no further norm."""
        head = self.shared_head.head if self.config.own_head else self._target_head[0]
        return head(hidden).float()


#: Architectures whose MTP layers form a model of their own in the checkpoint (``mtp.fc``,
#: ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.layers.{k}``, ``mtp.norm``: Qwen3-Next), so
#: that MTP layer ``k`` is built as that model's layer ``k``; DeepSeek-style MTP layers are
#: stored after the target's (``model.layers.{L + k}``) and built as its layer ``L + k``.
OWN_MTP_MODEL = frozenset({"Qwen3NextForCausalLM"})


def mtp_layer_index(config: DraftConfig, depth: int) -> int:
    """The layer index MTP layer ``depth`` is built as (which decides its MLP kind): ``depth``
    where the MTP layers form a model of their own (:data:`OWN_MTP_MODEL`, as SGLang and vLLM
    build Qwen3-Next's), else ``target_num_layers + depth``."""
    if config.layer.architecture in OWN_MTP_MODEL:
        return depth
    return config.target_num_layers + depth


def mtp_layer_config(target: DecoderConfig) -> DecoderConfig:
    """The config an MTP layer of ``target`` is built from: one layer of the target's kind;
    in a gated-DeltaNet hybrid (Qwen3-Next) a gated full-attention layer, as SGLang
    (``full_attention_interval = 1``) and vLLM (``layer_type="full_attention"``) build it.

    Raises ``UnsupportedModel`` for a Mamba-2 hybrid (Nemotron-H), whose MTP layers are not
    built."""
    if target.mamba is not None:
        raise UnsupportedModel(
            f"MTP layers of {target.architecture} (Mamba-2 hybrid; mtp.* in its checkpoints) "
            "are not built: use eagle, eagle3, standalone, dflash, dspark or ngram drafts"
        )
    return attrs.evolve(target, num_layers=1, num_nextn_predict_layers=0, linear=None)


_HEADS: dict[str, type[_DraftBase]] = {"eagle": EagleHead, "eagle3": Eagle3Head, "mtp": MTPHead}


def build_draft(config: DraftConfig, target: DecoderModel) -> EagleHead | Eagle3Head | MTPHead:
    """An uninitialised head for ``config`` sharing ``target``'s embedding and lm_head."""
    return _HEADS[config.algorithm](config, target)


def draft_config(target: DecoderConfig, algorithm: str, **changes: object) -> DraftConfig:
    """The usual draft for ``target``: one layer shaped like the target's.

    EAGLE-1 gets an ``fc`` bias (the EAGLE reference default); EAGLE-3 a bias-free Llama
    layer, the full vocabulary and the default capture layers (for targets too shallow for
    those, fewer than 8 layers or so, the last three layers, or all of them); MTP the target's
    own layer kind, mixture of experts included (an MTP layer is a layer of the target stored
    after its own). ``changes`` override :class:`DraftConfig` fields (``layer=`` for the layer
    shape).
    """
    algorithm = canonical_algorithm(algorithm)
    # EAGLE-family layers built to the target's shape for training are dense, also over a
    # mixture-of-experts target; an MTP layer is the target's kind (MTPHead).
    if algorithm == "mtp":
        layer = mtp_layer_config(target)
    else:
        layer = attrs.evolve(target.dense(), num_layers=1, num_nextn_predict_layers=0)
    fields: dict[str, object] = {}
    if algorithm == "eagle":
        fields["fc_bias"] = True
    if algorithm == "eagle3":
        layer = attrs.evolve(
            layer,
            architecture="LlamaForCausalLM",
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            # The midlayer is a Llama layer, which has no sliding window in any layout.
            sliding_window=None,
            full_attention_layers=(),
        )
        if "capture_layers" not in changes:
            try:
                fields["capture_layers"] = default_capture_layers(target.num_layers)
            except UnsupportedModel:
                n = target.num_layers
                fields["capture_layers"] = tuple(range(max(0, n - 3), n))
    fields |= {
        "algorithm": algorithm,
        "layer": layer,
        "target_hidden_size": target.hidden_size,
        "target_num_layers": target.num_layers,
    }
    return DraftConfig(**{**fields, **changes})  # type: ignore[arg-type]


def random_draft(
    target: DecoderModel,
    algorithm: str,
    *,
    seed: int = 0,
    std: float = 0.02,
    **changes: object,
) -> EagleHead | Eagle3Head | MTPHead:
    """A head with normal(0, std) weights, unit norms and zero biases, in the target's dtype
    and on its device (EAGLE-3: draft id ``i`` is target id ``i``)."""
    config = draft_config(target.config, algorithm, **changes)
    head = randomize_(build_draft(config, target), seed=seed, std=std)
    weight = target.model.embed_tokens.weight
    head = head.to(device=weight.device, dtype=weight.dtype)
    head.reset_buffers()
    return head.eval().requires_grad_(False)
