"""Tensor parallelism: one rank's shard of a decoder or a draft head (the Megatron layout that
vLLM and SGLang use).

:func:`shard_` rewrites a module in place, before its weights are loaded (on the meta device)
or after (the slices are copied out). What each rank holds of a model sharded over ``tp``
ranks, and the one collective each sharded layer runs:

==========================  ==============================================  ===================
layer                       this rank holds                                 forward ends with
==========================  ==============================================  ===================
q / k / v projections       its query heads' and K/V heads' output rows     nothing (local
(column-parallel)                                                           heads)
attention                   ``num_heads / tp`` query heads; ``num_kv_heads  nothing
                            / tp`` K/V heads, or one replicated K/V head
                            when ``num_kv_heads < tp`` (each shared by
                            ``tp / num_kv_heads`` ranks, as vLLM does); the
                            KV pool holds only these heads
o_proj, down_proj           the input columns of its heads / of its         ``all_reduce`` of
(row-parallel)              intermediate slice; the bias whole              the partial sums,
                                                                            then the bias
gate / up projections       ``intermediate_size / tp`` output rows          nothing
embeddings                  ``ceil(vocab / tp)`` rows of the vocabulary     ``all_reduce`` of a
(vocabulary-parallel)                                                       masked lookup
LM heads                    the same rows                                   ``all_gather`` of
(vocabulary-parallel)                                                       the logit slices
norms, EAGLE ``fc``, MTP    everything (replicated)                         nothing
``eh_proj``, rotary tables
==========================  ==============================================  ===================

So every sharded module's forward returns the full (replicated) result, bit for bit the same on
every rank, and whatever consumes it (a draft head borrowing the target's embedding and
lm_head, the sampling and acceptance stages) runs unchanged. The vocabulary is padded to a
multiple of ``tp`` with zero rows, whose logits are dropped after the gather, so any vocabulary
size splits; query heads, K/V heads and the intermediate size must split evenly, and
:class:`UnsupportedSplit` names the one that does not. Mixture-of-experts models
(``decoder.SparseMoE``), latent attention (``decoder.LatentAttention``), Qwen3-Next's
gated DeltaNet and gated attention, Nemotron-H's Mamba-2 and FP8 layers (``decoder.Fp8Linear``)
are not split yet: sharding one raises :class:`UnsupportedSplit`.

Page tables do not change: every rank's pool has the same pages, holding its own heads, so one
allocator and one scheduler serve all ranks.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from speculum.models.config import UnsupportedModel
from speculum.models.decoder import (
    MLP,
    Attention,
    Fp8Linear,
    GatedAttention,
    GatedDeltaNet,
    LatentAttention,
    LMHead,
    Mamba2Mixer,
    SparseMoE,
    float32_logits,
)
from speculum.state.parallel import TensorParallel

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Sharded",
    "Split",
    "UnsupportedSplit",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "shard_",
    "splits_of",
]


class UnsupportedSplit(UnsupportedModel):
    """A model that cannot be split over the requested number of tensor-parallel ranks."""


@attrs.define(frozen=True, slots=True)
class Split:
    """The part of a full (checkpoint) tensor one rank holds: indices ``start .. stop - 1``
    along axis ``dim``, zero-padded to ``size`` entries along it."""

    dim: int
    start: int
    stop: int
    size: int

    def take(self, source: Any) -> Tensor:
        """This rank's part of ``source``: a tensor, or anything indexed like one with a
        ``shape`` (a safetensors slice, which then reads only this part from disk). The
        result is a fresh tensor, so the full one can be freed."""
        index = (slice(None),) * self.dim + (slice(self.start, self.stop),)
        part = source[index]
        missing = self.size - (self.stop - self.start)
        if missing:
            shape = list(part.shape)
            shape[self.dim] = missing
            return torch.cat([part, part.new_zeros(shape)], self.dim)
        return part.clone() if isinstance(source, Tensor) else part


def _share(total: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """``(first, count)`` of this rank's equal share of ``total`` items."""
    if total % tp.size:
        raise UnsupportedSplit(
            f"{what}={total} cannot be split over tp={tp.size} ranks: every rank needs an "
            f"equal share; use a tensor-parallel size that divides {total}"
        )
    count = total // tp.size
    return tp.rank * count, count


def _kv_share(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """``(first, count)`` of this rank's K/V heads: an equal share when ``tp`` divides them,
    else the one head that this rank's query heads read (``tp / num_kv_heads`` ranks hold a
    copy of each)."""
    if num_kv_heads >= tp.size:
        return _share(num_kv_heads, tp, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise UnsupportedSplit(
            f"num_key_value_heads={num_kv_heads} cannot be split over tp={tp.size} ranks: K/V "
            "heads are split when tp divides their number and replicated when their number "
            f"divides tp; use a tensor-parallel size that divides {num_kv_heads} or is a "
            "multiple of it"
        )
    return tp.rank // (tp.size // num_kv_heads), 1


def _vocab_split(vocab_size: int, tp: TensorParallel) -> Split:
    """This rank's rows of a vocabulary-parallel matrix: ``ceil(vocab / tp)`` rows per rank,
    the last rank's missing rows zeros."""
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return Split(dim=0, start=start, stop=min(start + per, vocab_size), size=per)


class Sharded:
    """A layer holding one rank's slices of its parameters: ``splits`` names, per parameter,
    the part of the full tensor it holds (parameters it does not name are whole)."""

    splits: dict[str, Split]


class ColumnParallelLinear(Sharded, nn.Linear):
    """A linear layer's output features ``splits["weight"]`` (its weight's and bias's rows):
    its output is this rank's slice of the full output, with no communication; the
    row-parallel layer that consumes it reduces."""


class RowParallelLinear(Sharded, nn.Linear):
    """A linear layer's input features ``splits["weight"]`` (its weight's columns): each rank
    multiplies its slice of the input, and the partial sums are all-reduced; the bias, whole on
    every rank, is added once after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: Float[Tensor, "*rows part"]) -> Float[Tensor, "*rows out"]:
        """The full output on every rank."""
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(Sharded, nn.Embedding):
    """Rows ``start .. start + num_embeddings - 1`` of an embedding table: each rank looks up
    the ids in its rows (zeros for the others) and the lookups are all-reduced, so every rank
    gets every id's embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, tp: TensorParallel):
        super().__init__(num_embeddings, embedding_dim)
        self.start = start
        self.tp = tp

    def forward(self, ids: Int[Tensor, "*rows"]) -> Float[Tensor, "*rows hidden"]:
        """The embeddings of ``ids`` (ids of the whole vocabulary), on every rank."""
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp.all_reduce(torch.where(inside[..., None], rows, 0))


class VocabParallelLMHead(Sharded, LMHead):
    """The LM-head rows of this rank's vocabulary slice: each rank computes its slice of the
    logits and the slices are all-gathered, so every rank holds the logits over the whole
    vocabulary (``vocab_size``; the padding rows' logits are dropped)."""

    def __init__(self, hidden_size: int, rows: int, vocab_size: int, tp: TensorParallel):
        super().__init__(hidden_size, rows)
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """Logits over the whole vocabulary in the weights' dtype, on every rank."""
        return self._whole(F.linear(hidden, self.weight))

    def logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """Float32 logits over the whole vocabulary, on every rank."""
        return self._whole(float32_logits(hidden, self.weight))

    def _whole(self, part: Float[Tensor, "*rows part"]) -> Float[Tensor, "*rows vocab"]:
        # Contiguous: the sampling kernels read rows of exactly vocab_size entries.
        return self.tp.all_gather(part)[..., : self.vocab_size].contiguous()


#: Parameter id and split -> the sharded parameter, so that tied weights stay tied.
_Cache = dict[tuple[int, Split], nn.Parameter]


def _adopt(layer: Sharded, full: nn.Module, splits: dict[str, Split], cache: _Cache) -> Any:
    """Give ``layer`` (built on the meta device) ``full``'s parameters, those named in
    ``splits`` cut to this rank's part; returns ``layer``."""
    for name, param in full.named_parameters(recurse=False):
        split = splits.get(name)
        if split is not None:
            key = (id(param), split)
            if key not in cache:
                part = split.take(param.detach())
                cache[key] = nn.Parameter(part, requires_grad=param.requires_grad)
            param = cache[key]
        setattr(layer, name, param)
    layer.splits = splits
    return layer


def _column(full: nn.Linear, rows: Split, cache: _Cache) -> ColumnParallelLinear:
    with torch.device("meta"):
        layer = ColumnParallelLinear(full.in_features, rows.size, bias=full.bias is not None)
    splits = {"weight": rows} | ({"bias": rows} if full.bias is not None else {})
    return _adopt(layer, full, splits, cache)


def _row(full: nn.Linear, columns: Split, tp: TensorParallel, cache: _Cache) -> RowParallelLinear:
    with torch.device("meta"):
        layer = RowParallelLinear(columns.size, full.out_features, full.bias is not None, tp)
    return _adopt(layer, full, {"weight": columns}, cache)


def _rows(first: int, count: int, width: int = 1, dim: int = 0) -> Split:
    """Entries ``first * width .. (first + count) * width - 1`` along ``dim``."""
    return Split(dim=dim, start=first * width, stop=(first + count) * width, size=count * width)


@attrs.define(frozen=True, slots=True)
class _AttentionPlan:
    """This rank's query rows, K/V rows and head counts of one attention block."""

    queries: Split
    keys: Split
    num_heads: int
    num_kv_heads: int


def _attention_plan(attn: Attention, tp: TensorParallel) -> _AttentionPlan:
    first, heads = _share(attn.num_heads, tp, "num_attention_heads")
    kv_first, kv_heads = _kv_share(attn.num_kv_heads, tp)
    return _AttentionPlan(
        queries=_rows(first, heads, attn.head_dim),
        keys=_rows(kv_first, kv_heads, attn.head_dim),
        num_heads=heads,
        num_kv_heads=kv_heads,
    )


def _mlp_plan(mlp: MLP, tp: TensorParallel) -> Split:
    return _rows(*_share(mlp.gate_proj.out_features, tp, "intermediate_size"))


def _shard_attention_(
    attn: Attention, plan: _AttentionPlan, tp: TensorParallel, cache: _Cache
) -> None:
    attn.q_proj = _column(attn.q_proj, plan.queries, cache)
    if hasattr(attn, "k_proj"):  # FROZEN_KV_MTP's attention reads the target's K/V instead
        attn.k_proj = _column(attn.k_proj, plan.keys, cache)
        attn.v_proj = _column(attn.v_proj, plan.keys, cache)
    attn.o_proj = _row(attn.o_proj, attrs.evolve(plan.queries, dim=1), tp, cache)
    attn.num_heads, attn.num_kv_heads = plan.num_heads, plan.num_kv_heads


def _shard_mlp_(mlp: MLP, rows: Split, tp: TensorParallel, cache: _Cache) -> None:
    mlp.gate_proj = _column(mlp.gate_proj, rows, cache)
    mlp.up_proj = _column(mlp.up_proj, rows, cache)
    mlp.down_proj = _row(mlp.down_proj, attrs.evolve(rows, dim=1), tp, cache)


def _vocab_parallel(full: nn.Module, tp: TensorParallel, cache: _Cache) -> Sharded:
    """The vocabulary-parallel twin of an embedding or an LM head."""
    vocab, width = full.weight.shape
    rows = _vocab_split(vocab, tp)
    with torch.device("meta"):
        if isinstance(full, nn.Embedding):
            layer: Sharded = VocabParallelEmbedding(rows.size, width, rows.start, tp)
        else:
            layer = VocabParallelLMHead(width, rows.size, vocab, tp)
    return _adopt(layer, full, {"weight": rows}, cache)


def shard_(module: nn.Module, tp: TensorParallel) -> nn.Module:
    """Make ``module`` (a decoder, a draft head, anything built of them) this rank's shard for
    ``tp``, in place; returns it, with ``module.tp = tp``.

    Every attention block and MLP inside gets column- and row-parallel projections, every
    embedding and :class:`~speculum.models.decoder.LMHead` becomes vocabulary-parallel (see
    the module docstring); other parameters stay whole. Shard on the meta device and load
    with :func:`splits_of` to read only this rank's part of a checkpoint, or shard a loaded
    module to copy its parts out. Fuse projections after sharding (the local q/k/v and
    gate/up fuse as usual). Raises :class:`UnsupportedSplit` for heads or an intermediate size
    that do not split over ``tp`` and for mixture-of-experts, latent attention, Qwen3-Next's
    and FP8 layers and Nemotron-H's recurrent layers (not split yet), and ``ValueError`` for a
    module already sharded or fused; either way the module is left unchanged.
    """
    if tp.size == 1:
        return module
    if any(isinstance(m, SparseMoE) for m in module.modules()):
        raise UnsupportedSplit(
            f"tp={tp.size}: mixture-of-experts layers cannot be split over tensor-parallel "
            "ranks yet; run this model with tp=1"
        )
    if any(isinstance(m, LatentAttention) for m in module.modules()):
        raise UnsupportedSplit(
            f"tp={tp.size}: multi-head latent attention layers cannot be split over "
            "tensor-parallel ranks yet (every rank would need the whole latent cache); run "
            "this model with tp=1"
        )
    if any(isinstance(m, Mamba2Mixer) for m in module.modules()):
        raise UnsupportedSplit(
            f"tp={tp.size}: Nemotron-H's Mamba-2 layers cannot be split over tensor-parallel "
            "ranks yet (their recurrent states are not sharded); run this model with tp=1"
        )
    if any(isinstance(m, (GatedDeltaNet, GatedAttention)) for m in module.modules()):
        raise UnsupportedSplit(
            f"tp={tp.size}: Qwen3-Next's gated DeltaNet and gated attention layers cannot be "
            "split over tensor-parallel ranks yet (their recurrent states are not sharded); "
            "run this model with tp=1"
        )
    if any(isinstance(m, Fp8Linear) for m in module.modules()):
        raise UnsupportedSplit(
            f"tp={tp.size}: FP8 linear layers cannot be split over tensor-parallel ranks yet "
            "(their scales are not sharded); run this model with tp=1 (docs/fp8.md)"
        )
    if any(isinstance(m, Sharded) for m in module.modules()):
        raise ValueError("the module is already sharded; shard a module once")
    blocks = [m for m in module.modules() if isinstance(m, (Attention, MLP))]
    if any((m.qkv if isinstance(m, Attention) else m.gate_up) is not None for m in blocks):
        raise ValueError(
            "the module's projections are fused: shard first, then fuse the shards "
            "(models.decoder.fuse_projections_)"
        )
    # Every split is planned (and checked) before any layer is rewritten.
    plans = {
        id(m): _attention_plan(m, tp) if isinstance(m, Attention) else _mlp_plan(m, tp)
        for m in blocks
    }
    cache: _Cache = {}
    for parent in list(module.modules()):
        if isinstance(parent, Attention):
            _shard_attention_(parent, plans[id(parent)], tp, cache)
        elif isinstance(parent, MLP):
            _shard_mlp_(parent, plans[id(parent)], tp, cache)
        for name, child in list(parent.named_children()):
            if type(child) in (nn.Embedding, LMHead):
                setattr(parent, name, _vocab_parallel(child, tp, cache))
    module.tp = tp
    return module


def splits_of(module: nn.Module) -> dict[str, Split]:
    """Parameter name (as ``named_parameters`` gives it) -> the part of the full tensor this
    rank holds, for every sharded parameter of ``module``; parameters not named are whole."""
    return {
        f"{prefix}.{name}" if prefix else name: split
        for prefix, sub in module.named_modules()
        if isinstance(sub, Sharded)
        for name, split in sub.splits.items()
    }
