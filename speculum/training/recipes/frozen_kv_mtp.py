"""FROZEN_KV_MTP's recipe: a head that attends to the target's own K/V, trained self-fed.

At inference (``speculum.pipelines.frozen_kv_mtp``) the head's query for a request with ``N``
committed tokens sits at rotary position ``N - 1`` and attends, read-only, to the target's
cached K/V of entries ``0 .. N - 1`` in each draft layer's source layer; the seed step reads the
bonus token ``t_N`` and the target's ``f_{N-1}``, and each later step the draft's own previous
token and output hidden, at the same position against the same keys. Over a window that is, for
entry ``i`` and step ``k``: token ``t_{i+k+1}``, hidden ``f_i`` (step 0) or the step ``k - 1``
output, position ``i``, keys of entries ``0 .. i``, label the target's distribution at
``i + k + 1``. Nothing is cached, so each step is one independent dense forward; the loss is
``sum_k 0.8**k`` of the steps' forward KLs (EAGLE-3's depth weights).

The head's attention reads a paged cache through a custom op that has no autograd, so
:func:`dense_forward` runs the same layers with :func:`~speculum.models.decoder.dense_attention`
against K/V recomputed from the target: the source layer's input (the captured output of the
layer before it, or the embedding) through its ``input_layernorm``, ``k_proj``/``v_proj`` and
rotary embedding, exactly what the target writes into its cache. Saved with
``save_frozen_kv`` (the ``FrozenKVMTPForCausalLM`` folder ``load_frozen_kv`` reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from speculum.models.decoder import DecoderModel, dense_attention, dense_batch
from speculum.models.frozen_kv import FrozenKVHead, load_frozen_kv, random_frozen_kv, save_frozen_kv
from speculum.training.recipes import (
    DraftOptions,
    Metrics,
    Recipe,
    TargetOutputs,
    depth_weights,
    distill,
    run_target,
    shifted,
    trainable,
    valid_entries,
    weighted_steps,
)

__all__ = ["RECIPE", "dense_forward", "target_kv"]

KV = tuple[Float[Tensor, "batch seq kv_head head_dim"], Float[Tensor, "batch seq kv_head head_dim"]]


def build(target: DecoderModel, options: DraftOptions, split: Any) -> FrozenKVHead:
    """One frozen-KV layer reading the target's last layer's K/V (``frozen_kv_config``)."""
    return trainable(random_frozen_kv(target, seed=options.seed), target)


def target_kv(
    target: DecoderModel,
    windows: Int[Tensor, "batch seq"],
    out: TargetOutputs,
    sources: tuple[int, ...],
) -> list[KV]:
    """The rotated keys and the values target layer ``s`` caches over ``windows``, for each
    ``s`` of ``sources``; ``out`` must hold the captured outputs of layers ``s - 1``."""
    captured = dict(zip(_captures(sources), out.captured))
    batch = dense_batch(windows)
    kv = []
    with torch.no_grad():
        for s in sources:
            x = captured[s - 1] if s > 0 else target.embed(windows)
            layer = target.model.layers[s]
            inv_freq = target.layer_inv_freq(s)
            kv.append(layer.self_attn.keys_values(layer.input_layernorm(x), batch, inv_freq))
    return kv


def dense_forward(
    head: FrozenKVHead,
    target: DecoderModel,
    kv: list[KV],
    tokens: Int[Tensor, "batch n"],
    hidden: Float[Tensor, "batch n hidden"],
) -> Float[Tensor, "batch n hidden"]:
    """``head.forward`` for entries ``i = 0 .. n - 1`` at positions ``i``, each attending to
    keys ``0 .. i`` of ``kv`` (one pair per draft layer), differentiably."""
    n = tokens.shape[1]
    batch = dense_batch(tokens)
    embeds = target.model.embed_tokens(tokens).to(hidden.dtype)
    x = head.eh_proj(torch.cat([head.enorm(embeds), head.hnorm(hidden)], dim=-1))
    for layer, (keys, values) in zip(head.layers, kv):
        attention = layer.self_attn
        queries = attention.queries(layer.input_layernorm(x), batch, head.inv_freq)
        attended = dense_attention(
            queries, keys[:, :n], values[:, :n], batch.new_mask, attention.scale, attention.sinks
        )
        x = x + attention.o_proj(attended.flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return head.norm(x)


def loss(
    head: FrozenKVHead,
    target: DecoderModel,
    windows: Int[Tensor, "batch seq"],
    options: DraftOptions,
) -> tuple[Tensor, Metrics]:
    """``num_steps`` self-fed steps against the target's K/V (module docstring); in
    evaluation the metrics ``kl_k`` and ``acc_k`` per step ``k``."""
    sources = head.config.source_layers
    out = run_target(target, windows, _captures(sources))
    kv = target_kv(target, windows, out, sources)
    batch, n = windows.shape[0], windows.shape[1] - 1
    hidden = out.final[:, :n]
    steps = []
    for k in range(options.num_steps):
        hidden = dense_forward(head, target, kv, shifted(windows, k + 1, n), hidden)
        valid = valid_entries(batch, n, k, windows.device)
        steps.append(
            distill(
                head.logits(hidden),
                shifted(out.logits, k + 1, n),
                valid,
                report=not head.training,
            )
        )
    return weighted_steps(steps, depth_weights(options.num_steps))


def _captures(sources: tuple[int, ...]) -> tuple[int, ...]:
    """Target layers whose outputs feed the source layers (layer 0 reads the embedding)."""
    return tuple(sorted({s - 1 for s in sources if s > 0}))


def save(head: FrozenKVHead, folder: Path) -> Path:
    """The ``FrozenKVMTPForCausalLM`` folder."""
    return save_frozen_kv(head, folder)


def load(folder: Path, target: DecoderModel) -> FrozenKVHead:
    """``load_frozen_kv(folder, target)``."""
    return load_frozen_kv(folder, target)


RECIPE = Recipe(name="frozen_kv_mtp", build=build, loss=loss, save=save, load=load)
