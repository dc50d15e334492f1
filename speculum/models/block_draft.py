"""Block drafters: DFLASH and DSPARK draft heads over the paged KV cache.

Both draft a whole block in one forward. The head has no embedding or ``lm_head`` of its own
(it borrows the target's, frozen) and reads the target's hidden states through *injected
context*: the outputs of ``m`` target layers (``target_layers``) of every committed token are
concatenated, projected (``fc``) and normed (``hidden_norm``), and each draft layer turns that
context into keys and values (its own ``k_proj``/``v_proj``, ``k_norm`` and rotary embedding at
the token's position). Those K/V live in the draft's own pool at the token's cache index, the
same page table as the target's: the draft KV cache holds *only* injected context, and it grows
by exactly the tokens verify accepted (:meth:`DFlashHead.write_context`).

The block is ``[root, MASK, ..., MASK]`` at positions ``N .. N + B - 1`` (``N`` committed
tokens, ``root`` the last verified token). Its queries see every context entry ``0 .. N - 1``
and each other, bidirectionally; the block's own K/V go to the pool's tail slots, which later
context writes overwrite. After the last layer, ``norm`` gives the hidden states the target's
``lm_head`` reads::

    ctx   = hidden_norm(fc([target layer outputs]))          # per committed token, once
    x     = embed([root, MASK x (B - 1)])                     # the target's embedding
    x     = layers(x) attending to ctx K/V and to the block   # Qwen3 layers (q/k norms)
    h     = norm(x)
    logits = target.lm_head(h)

DFLASH (z-lab's DFlash) reads slot ``j >= 1`` as the token at ``N + j``: ``B - 1`` draft tokens,
drawn in parallel. DSPARK (DeepSeek's DSpark, DeepSpec convention) reads slot ``k >= 0`` as the
token at ``N + k + 1``: ``B`` draft tokens, drawn one after the other through a *Markov head*
that adds a bias from the previous token to each slot's logits,
``W2 W1[x_{k-1}]`` of rank ``r`` (``vanilla``; ``gated`` multiplies ``W1[x]`` by a sigmoid gate of
``[h_k; W1[x]]``, ``rnn`` runs a small gated recurrence), so every draft token has an exact draft
probability. Its *confidence head* ``sigmoid(proj([h_k; W1[x_{k-1}]]))`` predicts the chance
that token ``k`` is accepted given the earlier ones; it sees only what is known before token
``k`` is drawn (the DSPARK pipeline's verify-budget scheduler relies on that).

Checkpoint layouts (``load_block_draft`` reads them strictly, ``save_block_draft`` writes them):

``dflash`` (z-lab)  ``config.json``: a Qwen3 config of the draft layers
    (``num_hidden_layers`` = draft layers; ``architectures: ["DFlashDraftModel"]``) plus
    ``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id,
    target_layer_ids}`` (older releases put them at the top level; both are read). Weights:
    ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
    ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``layers.{i}.{input,post_attention}_layernorm.weight``, ``norm.weight``, ``fc.weight``
    ``[hidden, m * target_hidden]``, ``hidden_norm.weight`` (a ``model.`` prefix is accepted).
``dspark`` (SGLang / DeepSpec)  the same, ``architectures: ["DSparkDraftModel"]`` (or
    ``Qwen3DSparkModel``), plus ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``
    and ``confidence_head_with_markov``; weights ``markov_head.markov_w1.weight`` ``[vocab,
    r]``, ``markov_head.markov_w2.weight`` ``[vocab, r]`` (``gated``:
    ``markov_head.gate_proj.{weight,bias}``; ``rnn``: ``markov_head.joint_proj.{weight,bias}``)
    and ``confidence_head.proj.{weight,bias}``. DeepSeek's prefixed fields
    (``dspark_block_size``, ``dspark_markov_rank``, ``dspark_noise_token_id``,
    ``dspark_target_layer_ids``) are read too. Checkpoints trained by vLLM's speculators
    (``speculators_model_type: "dspark"``) put slot ``j``'s prediction at ``anchor + j``
    instead of ``anchor + j + 1``; read with this convention they would verify every token one
    position early and accept almost nothing, so loading them is refused with that explanation.

``target_layer_ids`` count layer *outputs* (transformers' ``hidden_states[i + 1]``), as
``DecoderModel.forward(capture_layers=...)`` does; without them, ``m`` layers evenly spaced in
``[1, L - 3]`` are read (:func:`default_target_layers`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from speculum import kernels
from speculum.models.config import DecoderConfig, UnsupportedModel, read_json_object
from speculum.models.decoder import DecoderLayer, DecoderModel, RMSNorm, rope_inv_freq
from speculum.models.draft import pool_for
from speculum.models.draft_loading import DraftTargetMismatch, materialize
from speculum.models.loading import (
    DTYPES,
    CheckpointError,
    check_keys,
    load_state_dict,
    randomize_,
    write_checkpoint,
)
from speculum.state.forward import ForwardBatch
from speculum.state.kv import KVPool
from speculum.state.parallel import SINGLE, TensorParallel

__all__ = [
    "ALGORITHMS",
    "MARKOV_KINDS",
    "BlockDraftConfig",
    "DFlashHead",
    "DSparkHead",
    "MarkovHead",
    "ConfidenceHead",
    "block_draft_config",
    "default_target_layers",
    "load_block_draft",
    "random_block_draft",
    "save_block_draft",
]

#: The block drafters and the ``architectures[0]`` their checkpoints are written with.
ALGORITHMS = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
#: Architecture names read as each algorithm.
_READ_AS = {
    "DFlashDraftModel": "dflash",
    "DSparkDraftModel": "dspark",
    "Qwen3DSparkModel": "dspark",
}
#: DSPARK's sequential heads.
MARKOV_KINDS = ("vanilla", "gated", "rnn")


def default_target_layers(target_layers: int, draft_layers: int) -> tuple[int, ...]:
    """DFlash's default target layers: ``draft_layers`` layer outputs evenly spaced in
    ``[1, L - 3]`` (the middle layer for a one-layer draft), as z-lab and SGLang choose them.
    Targets shallower than 4 layers clamp the range into ``0 .. L - 1``."""
    if draft_layers == 1:
        return (target_layers // 2,)
    start = min(1, target_layers - 1)
    end = max(start, target_layers - 3)
    span = end - start
    return tuple(int(round(start + i * span / (draft_layers - 1))) for i in range(draft_layers))


@attrs.define(frozen=True, slots=True, kw_only=True)
class BlockDraftConfig:
    """Shapes and options of a block draft (all static).

    ``layer`` describes the draft layers (``num_layers`` of them; Qwen3-style, hidden size and
    vocabulary the target's). ``target_layers`` are the target layer outputs the context is
    built from; ``block_size`` the block width ``B``; ``mask_token_id`` the id whose embedding
    fills the block after the root. DSPARK adds the Markov head (``markov_rank`` > 0, of kind
    ``markov_kind``) and, with ``confidence``, the confidence head (over ``[h; W1[x]]`` when
    ``confidence_with_markov``, else over ``h``).
    """

    algorithm: str
    layer: DecoderConfig
    target_hidden_size: int
    target_num_layers: int
    target_layers: tuple[int, ...]
    block_size: int
    mask_token_id: int
    markov_rank: int = 0
    markov_kind: str = "vanilla"
    confidence: bool = False
    confidence_with_markov: bool = True

    def __attrs_post_init__(self) -> None:
        problems = []
        if self.algorithm not in ALGORITHMS:
            problems.append(f"algorithm {self.algorithm!r} is not one of {tuple(ALGORITHMS)}")
        least = 2 if self.algorithm == "dflash" else 1
        if self.block_size < least:
            problems.append(
                f"block_size={self.block_size}: a {self.algorithm} block needs at least {least} "
                f"slot{'s' if least > 1 else ''} (the root"
                f"{' and one mask' if least > 1 else ''}) to draft anything"
            )
        if not 0 <= self.mask_token_id < self.layer.vocab_size:
            problems.append(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary 0 .. "
                f"{self.layer.vocab_size - 1}"
            )
        if not self.target_layers:
            problems.append("target_layer_ids is empty: the draft reads at least one layer")
        bad = [i for i in self.target_layers if not 0 <= i < self.target_num_layers]
        if bad:
            problems.append(
                f"target_layer_ids {list(self.target_layers)}: {bad} are not layers of a "
                f"{self.target_num_layers}-layer target"
            )
        if self.layer.num_layers < 1:
            problems.append("a block draft needs at least one decoder layer")
        if self.layer.hidden_size != self.target_hidden_size:
            problems.append(
                f"the draft's hidden size {self.layer.hidden_size} differs from the target's "
                f"{self.target_hidden_size}: it embeds with the target's embedding and predicts "
                "with its lm_head, so the two must match"
            )
        if self.algorithm == "dspark" and self.markov_rank < 1:
            problems.append(
                f"markov_rank={self.markov_rank}: a DSPARK draft needs its Markov head "
                "(markov_rank >= 1); a checkpoint without one is a DFLASH draft"
            )
        if self.algorithm == "dflash" and (self.markov_rank or self.confidence):
            problems.append("a DFLASH draft has no Markov or confidence head (that is DSPARK)")
        if self.markov_kind not in MARKOV_KINDS:
            problems.append(f"markov_head_type {self.markov_kind!r} is not one of {MARKOV_KINDS}")
        if problems:
            raise UnsupportedModel("invalid block draft: " + "; ".join(problems))

    @property
    def num_drafts(self) -> int:
        """Draft tokens one block gives: ``B - 1`` (DFLASH, slot 0 is the root) or ``B``
        (DSPARK, slot ``k`` predicts the token after slot ``k``'s)."""
        return self.block_size - 1 if self.algorithm == "dflash" else self.block_size

    @property
    def first_slot(self) -> int:
        """The block slot whose output predicts the first draft token."""
        return 1 if self.algorithm == "dflash" else 0


class MarkovHead(nn.Module):
    """DSPARK's sequential head: a rank-``r`` bias from the previous token to the next token's
    logits (``vanilla``: ``W2 W1[x]``; ``gated``: ``W2 (sigmoid(G [h; W1[x]]) * W1[x])``;
    ``rnn``: a gated recurrence over ``[state; W1[x]; h]`` whose output ``W2 tanh(o)`` is the
    bias), as SGLang's ``VanillaMarkov``, ``GatedMarkovHead`` and ``RNNHead`` compute it."""

    def __init__(self, kind: str, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        if kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def embed(self, tokens: Int[Tensor, "*rows"]) -> Float[Tensor, "*rows rank"]:
        """``W1[x]``: the previous token's low-rank embedding (also the confidence head's)."""
        return self.markov_w1(tokens)

    def step(
        self,
        previous: Int[Tensor, "*rows"],
        hidden: Float[Tensor, "*rows hidden"],
        state: Float[Tensor, "*rows rank"],
    ) -> tuple[Float[Tensor, "*rows vocab"], Float[Tensor, "*rows rank"]]:
        """The float32 bias added to a slot's logits given the previous token, and the
        recurrent state for the next slot (``rnn`` only; the others pass it through)."""
        e = self.embed(previous).to(hidden.dtype)
        if self.kind == "gated":
            e = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))) * e
        elif self.kind == "rnn":
            joint = self.joint_proj(torch.cat([state, e, hidden], dim=-1))
            gate, candidate, out = joint.chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1.0 - gate) * torch.tanh(candidate)
            e = torch.tanh(out)
        return self.markov_w2(e).float(), state


class ConfidenceHead(nn.Module):
    """DSPARK's confidence head: ``sigmoid(proj([h_k; W1[x_{k-1}]]))``, the predicted chance
    that slot ``k``'s draft token is accepted once the earlier ones were."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1)

    def forward(
        self, hidden: Float[Tensor, "*rows hidden"], markov: Float[Tensor, "*rows rank"] | None
    ) -> Float[Tensor, " *rows"]:
        """Float32 logits of the acceptance chance (``sigmoid`` gives the chance)."""
        x = hidden if markov is None else torch.cat([hidden, markov.to(hidden.dtype)], dim=-1)
        return self.proj(x)[..., 0].float()


class DFlashHead(nn.Module):
    """A DFLASH draft (module docstring): draft layers, ``fc``, ``hidden_norm`` and ``norm``,
    with the target's embedding and ``lm_head`` borrowed (neither registered nor saved)."""

    def __init__(self, config: BlockDraftConfig, target: DecoderModel) -> None:
        super().__init__()
        if target.config.vocab_size != config.layer.vocab_size:
            raise DraftTargetMismatch(
                f"draft vocabulary {config.layer.vocab_size} vs target vocabulary "
                f"{target.config.vocab_size}: the draft belongs to a different target"
            )
        self.config = config
        h, eps = config.layer.hidden_size, config.layer.rms_norm_eps
        self._target_embed = (target.model.embed_tokens,)
        self._target_head = (target.lm_head,)
        self.layers = nn.ModuleList(
            DecoderLayer(config.layer, i) for i in range(config.layer.num_layers)
        )
        self.norm = RMSNorm(h, eps)
        self.fc = nn.Linear(len(config.target_layers) * config.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)
        self.register_buffer("inv_freq", rope_inv_freq(config.layer), persistent=False)

    @property
    def algorithm(self) -> str:
        """``dflash`` or ``dspark``."""
        return self.config.algorithm

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the context is built from, in the checkpoint's order."""
        return self.config.target_layers

    @property
    def draft_vocab_size(self) -> int:
        """How many distinct tokens the head can propose: the whole target vocabulary."""
        return self.config.layer.vocab_size

    def reset_buffers(self) -> None:
        """Recompute the rotary table (float32) after ``to_empty`` or a dtype cast."""
        self.inv_freq = rope_inv_freq(self.config.layer).to(self.fc.weight.device)

    def new_pool(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None) -> KVPool:
        """A zeroed pool for the draft layers' K/V (injected context and the block's tail)."""
        layer = self.config.layer
        return pool_for(self, layer, layer.num_layers, num_pages, page_size, dtype)

    def context(
        self, captured: tuple[Float[Tensor, "batch q target_hidden"], ...]
    ) -> Float[Tensor, "batch q hidden"]:
        """``hidden_norm(fc([captured layer outputs]))``: the context each draft layer projects
        to keys and values."""
        if len(captured) != len(self.capture_layers):
            raise ValueError(
                f"the draft reads target layers {self.capture_layers}, got {len(captured)} "
                "captured tensors: run the target with capture_layers=head.capture_layers"
            )
        x = torch.cat(captured, dim=-1).to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(x))

    def write_context(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        captured: tuple[Float[Tensor, "batch q target_hidden"], ...],
    ) -> None:
        """Write the injected context of ``batch``'s tokens into ``pool`` at ``batch.slots``,
        at rotary positions ``batch.positions``, in every draft layer (K/V only: no query, no
        attention). Padding rows write to the padding sink."""
        ctx = self.context(captured)
        for layer in self.layers:
            attention = layer.self_attn
            keys, values = attention.keys_values(ctx, batch, self.inv_freq)
            kernels.write_kv(pool.k[attention.layer], batch.slots, keys)
            kernels.write_kv(pool.v[attention.layer], batch.slots, values)

    def embed(self, tokens: Int[Tensor, "batch q"]) -> Float[Tensor, "batch q hidden"]:
        """The target's embedding of ``tokens``, in the head's dtype."""
        return self._target_embed[0](tokens).to(self.fc.weight.dtype)

    def forward(self, batch: ForwardBatch, pool: KVPool) -> Float[Tensor, "batch q hidden"]:
        """The block forward: ``norm`` of the last layer's output at every slot.

        ``batch`` holds the block tokens, written at tail slots and seeing the context prefix
        and (by its ``new_mask``) each other.
        """
        x = self.embed(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch, pool, self.inv_freq)
        return self.norm(x)

    def logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """The target's ``lm_head``, in float32."""
        return self._target_head[0](hidden).float()


class DSparkHead(DFlashHead):
    """A DSPARK draft: the DFLASH backbone plus the Markov head and (optionally) the
    confidence head (module docstring)."""

    def __init__(self, config: BlockDraftConfig, target: DecoderModel) -> None:
        super().__init__(config, target)
        h, rank = config.layer.hidden_size, config.markov_rank
        self.markov_head = MarkovHead(config.markov_kind, config.layer.vocab_size, rank, h)
        if config.confidence:
            with_markov = rank if config.confidence_with_markov else 0
            self.confidence_head = ConfidenceHead(h, with_markov)

    def initial_state(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows rank"]:
        """The Markov head's recurrent state before the first slot (zeros)."""
        return hidden.new_zeros(*hidden.shape[:-1], self.config.markov_rank)

    def step_logits(
        self,
        base: Float[Tensor, "*rows vocab"],
        previous: Int[Tensor, " *rows"],
        hidden: Float[Tensor, "*rows hidden"],
        state: Float[Tensor, "*rows rank"],
    ) -> tuple[Float[Tensor, "*rows vocab"], Float[Tensor, "*rows rank"]]:
        """One slot's float32 logits given the previous token, and the next recurrent state."""
        bias, state = self.markov_head.step(previous, hidden, state)
        return base + bias, state

    def confidence(
        self, hidden: Float[Tensor, "*rows hidden"], previous: Int[Tensor, "*rows"]
    ) -> Float[Tensor, " *rows"]:
        """The predicted chance that the slot's draft token is accepted, from the slot's
        hidden state and the *previous* token only (known before the slot's token is drawn)."""
        return torch.sigmoid(self.confidence_logits(hidden, previous))

    def confidence_logits(
        self, hidden: Float[Tensor, "*rows hidden"], previous: Int[Tensor, "*rows"]
    ) -> Float[Tensor, " *rows"]:
        """:meth:`confidence` before the sigmoid (what training's BCE reads)."""
        markov = self.markov_head.embed(previous) if self.config.confidence_with_markov else None
        return self.confidence_head(hidden, markov)


def build_block_draft(config: BlockDraftConfig, target: DecoderModel) -> DFlashHead:
    """An uninitialised head for ``config`` sharing ``target``'s embedding and lm_head."""
    return (DSparkHead if config.algorithm == "dspark" else DFlashHead)(config, target)


def block_draft_config(
    target: DecoderConfig,
    algorithm: str,
    *,
    num_layers: int = 2,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    target_layers: tuple[int, ...] | None = None,
    markov_rank: int = 64,
    markov_kind: str = "vanilla",
    confidence: bool = True,
) -> BlockDraftConfig:
    """The usual block draft for ``target``: ``num_layers`` Qwen3-style layers shaped like the
    target's, reading the default target layers; blocks of 8 (DFLASH: 7 draft tokens) or 7
    (DSPARK: 7 draft tokens); the mask is the BOS token (or id 0), whose embedding only the
    draft reads at mask slots."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown block drafter {algorithm!r}; one of {', '.join(ALGORITHMS)}")
    layer = attrs.evolve(
        target.dense(),
        architecture="Qwen3ForCausalLM",
        num_layers=num_layers,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=True,
        num_nextn_predict_layers=0,
        mla=None,  # Qwen3 layers: grouped-query attention over the target's head shapes
    )
    dspark = algorithm == "dspark"
    mask = target.bos_token_id if mask_token_id is None else mask_token_id
    return BlockDraftConfig(
        algorithm=algorithm,
        layer=layer,
        target_hidden_size=target.hidden_size,
        target_num_layers=target.num_layers,
        target_layers=target_layers or default_target_layers(target.num_layers, num_layers),
        block_size=block_size or (7 if dspark else 8),
        mask_token_id=0 if mask is None else int(mask),
        markov_rank=markov_rank if dspark else 0,
        markov_kind=markov_kind,
        confidence=confidence and dspark,
    )


def _finish(head: DFlashHead, target: DecoderModel, dtype: torch.dtype | None) -> DFlashHead:
    head = head.to(dtype or target.model.embed_tokens.weight.dtype)
    head.reset_buffers()
    return head.eval().requires_grad_(False)


def random_block_draft(
    target: DecoderModel, algorithm: str, *, seed: int = 0, std: float = 0.02, **changes: Any
) -> DFlashHead:
    """A head with normal(0, std) weights, unit norms and zero biases, in the target's dtype
    and on its device; ``changes`` are :func:`block_draft_config`'s options."""
    config = block_draft_config(target.config, algorithm, **changes)
    head = randomize_(build_block_draft(config, target), seed=seed, std=std)
    return _finish(head.to(target.model.embed_tokens.weight.device), target, None)


# ----------------------------------------------------------------------------------------
# Checkpoints


def _field(raw: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` found in ``raw``'s ``dflash_config`` / ``dspark_config`` or at
    its top level."""
    for section in (raw.get("dflash_config") or {}, raw.get("dspark_config") or {}, raw):
        for name in names:
            if section.get(name) is not None:
                return section[name]
    return default


def _int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{where}: {name} must be an integer, got {value!r}")
    return value


def _parse(raw: dict[str, Any], algorithm: str, target: DecoderConfig, where: str):
    """The :class:`BlockDraftConfig` a block draft's ``config.json`` describes for ``target``."""
    if raw.get("speculators_model_type") is not None:
        kind = raw["speculators_model_type"]
        detail = (
            "speculators trains block slot j to predict anchor + j (slot 0 loss-masked) while "
            "the DeepSpec convention speculum's DSPARK reads has slot k predict anchor + k + 1, "
            "so every draft token would be verified one position early and acceptance would "
            "collapse to about 1 token per round without any error"
            if kind == "dspark"
            else "speculum reads the z-lab and SGLang layouts of block drafts"
        )
        raise UnsupportedModel(
            f"{where}: a vLLM speculators checkpoint (speculators_model_type {kind!r}) is not "
            f"supported: {detail}. Use a DeepSpec/SGLang- or z-lab-layout checkpoint, or one "
            "trained by `speculum train-draft`"
        )
    archs = raw.get("architectures") or []
    found = _READ_AS.get(archs[0]) if archs else None
    if found is None:
        raise CheckpointError(
            f"{where}: config.json architectures {archs} is not one of {sorted(_READ_AS)}: not a "
            "block draft (see speculum.models.block_draft for the layouts)"
        )
    if found != algorithm:
        raise CheckpointError(
            f"{where} holds a {found} draft ({archs[0]}), not a {algorithm} draft; pass "
            f"--algorithm {found}"
        )
    if raw.get("layer_types") and set(raw["layer_types"]) != {"full_attention"}:
        raise UnsupportedModel(
            f"{where}: layer_types {raw['layer_types']}: speculum's block drafts run full "
            "attention layers only"
        )
    layer_raw = {**raw, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    layer_raw["attention_bias"] = bool(raw.get("attention_bias", False))
    layer = DecoderConfig.from_dict(layer_raw, str(Path(where) / "config.json"))
    layer = attrs.evolve(layer, sliding_window=None, eos_token_ids=(), num_nextn_predict_layers=0)
    num_target = _int(
        _field(raw, "num_target_layers", default=target.num_layers), "num_target_layers", where
    )
    if num_target != target.num_layers:
        raise DraftTargetMismatch(
            f"{where}: the draft was built for a {num_target}-layer target, this one has "
            f"{target.num_layers} layers: load it with the target it was trained for"
        )
    ids = _field(raw, "dspark_target_layer_ids", "target_layer_ids")
    if ids is None:
        ids = default_target_layers(target.num_layers, layer.num_layers)
    if not isinstance(ids, (list, tuple)):
        raise CheckpointError(f"{where}: target_layer_ids must be a list, got {ids!r}")
    ids = tuple(_int(i, "target_layer_ids", where) for i in ids)
    block = _field(raw, "dspark_block_size", "block_size")
    mask = _field(raw, "dspark_noise_token_id", "mask_token_id")
    missing = [n for n, v in (("block_size", block), ("mask_token_id", mask)) if v is None]
    if missing:
        raise CheckpointError(f"{where}: config.json lacks {missing} (in dflash_config or on top)")
    markov = {}
    if algorithm == "dspark":
        kind = str(_field(raw, "dspark_markov_head_type", "markov_head_type", default="vanilla"))
        markov = {
            "markov_rank": _int(
                _field(raw, "dspark_markov_rank", "markov_rank", default=0), "markov_rank", where
            ),
            "markov_kind": kind.lower(),
            "confidence": bool(_field(raw, "enable_confidence_head", default=False)),
            "confidence_with_markov": bool(
                _field(raw, "confidence_head_with_markov", default=True)
            ),
        }
    if layer.vocab_size != target.vocab_size or layer.hidden_size != target.hidden_size:
        raise DraftTargetMismatch(
            f"{where}: the draft belongs to a different target model (vocabulary "
            f"{layer.vocab_size} vs {target.vocab_size}, hidden size {layer.hidden_size} vs "
            f"{target.hidden_size}); load it with the target it was trained for"
        )
    try:
        return BlockDraftConfig(
            algorithm=algorithm,
            layer=layer,
            target_hidden_size=target.hidden_size,
            target_num_layers=target.num_layers,
            target_layers=ids,
            block_size=_int(block, "block_size", where),
            mask_token_id=_int(mask, "mask_token_id", where),
            **markov,
        )
    except UnsupportedModel as err:
        raise UnsupportedModel(f"{where}: {err}") from err


def load_block_draft(
    folder: str | Path,
    target: DecoderModel,
    algorithm: str,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    tp: TensorParallel = SINGLE,
) -> DFlashHead:
    """Load the ``algorithm`` (``dflash`` or ``dspark``) draft in ``folder`` for ``target``,
    strictly: every tensor the head declares must be there and nothing else (rotary
    ``inv_freq`` buffers and the target's own ``embed_tokens`` / ``lm_head`` copies are
    tolerated). ``dtype`` and ``device`` default to the target's; ``tp`` shards the head
    (``SINGLE``: whole on every rank; see ``docs/tensor_parallel.md``). Raises
    :class:`DraftTargetMismatch` for a draft of another target, ``UnsupportedModel`` for a
    configuration speculum cannot run (a speculators DSPARK checkpoint among them, see the
    module docstring) and ``CheckpointError`` for missing, unexpected or mis-shaped tensors."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown block drafter {algorithm!r}; one of {', '.join(ALGORITHMS)}")
    folder = Path(folder)
    where = str(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json; pass a {algorithm} draft folder")
    config = _parse(read_json_object(folder / "config.json"), algorithm, target.config, where)
    found = load_state_dict(folder)
    # SGLang's loader accepts a "model." prefix on every key; so does this one.
    if found and all(k.startswith("model.") for k in found):
        found = {k.removeprefix("model."): v for k, v in found.items()}
    with torch.device("meta"):
        head = build_block_draft(config, target)
    expected = {name: p.shape for name, p in head.named_parameters()}
    tolerated = frozenset(
        k
        for k in found
        if k.endswith("rotary_emb.inv_freq") or k.split(".")[0] in ("embed_tokens", "lm_head")
    )
    check_keys(expected, found, where, tolerated, config.layer)
    names = {name: name for name in expected}
    head = materialize(head, names, found, target, dtype=dtype, device=device, tp=tp)
    return head.eval().requires_grad_(False)


def _config_dict(head: DFlashHead) -> dict[str, Any]:
    config = head.config
    dtype = {v: k for k, v in DTYPES.items()}.get(head.fc.weight.dtype, "float32")
    layer = {**config.layer.to_dict(), "attention_bias": False, "torch_dtype": dtype}
    layer.pop("eos_token_id", None)
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layers)}
    fields: dict[str, Any] = {
        **layer,
        "architectures": [ALGORITHMS[config.algorithm]],
        "block_size": config.block_size,
        "num_target_layers": config.target_num_layers,
        "dflash_config": dflash,
    }
    if config.algorithm == "dspark":
        fields |= {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layers),
            "markov_rank": config.markov_rank,
            "markov_head_type": config.markov_kind,
            "enable_confidence_head": config.confidence,
            "confidence_head_with_markov": config.confidence_with_markov,
        }
    return fields


def save_block_draft(head: DFlashHead, folder: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in the layout of the head's algorithm
    (z-lab DFlash, or SGLang's DSPARK), which :func:`load_block_draft` reads."""
    return write_checkpoint(folder, dict(head.named_parameters()), _config_dict(head))
