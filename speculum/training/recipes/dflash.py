"""DFLASH's recipe: blocks at random anchors of each window, one dense forward, decayed
cross-entropy per block position.

**Data.** A block's later slots are scored against the target's predictions *given the tokens
before them*, which the draft never sees: on corpus text those tokens need not be the ones the
target would have produced, and slot ``j >= 2`` would learn the corpus instead of the target's
own continuation. So, as DFlash (and DeepSpec for DSPARK) regenerate their training responses
with the target, ``train_draft`` trains these recipes on the target's greedy continuations of
corpus prompts (``Recipe.on_policy``, :func:`~speculum.training.draft.target_continuations`).

At inference (``speculum.pipelines.dflash``) a block rooted at position ``a`` sees the injected
context of tokens ``0 .. a - 1`` and fills slots ``1 .. B - 1`` with the tokens at ``a + 1 ..
a + B - 1``. Training does the same at ``anchors`` random positions of every window at once, as
DFlash and SpecForge train:

- the frozen target runs over the window (capturing the layers the draft reads), and the
  draft's context ``hidden_norm(fc(...))`` is computed for every token;
- every anchor's block ``[t_a, MASK x (B - 1)]`` at positions ``a .. a + B - 1`` joins one
  dense forward (:func:`dense_block_forward`) whose attention mask is block-sparse: a block's
  queries see the context keys of tokens ``< a`` and the keys of their own block, all of them
  (bidirectional), and nothing of other blocks;
- slot ``j`` is scored against the target's distribution of the token at ``a + j`` (the
  target's output at ``a + j - 1``): the soft-label cross-entropy, weighted by
  ``exp(-(j - 1) / gamma)`` (the DFlash paper's decay: ``gamma`` 7, 5 and 4 for blocks of 16,
  10 and 8), since an early slot's mistake ends the accepted prefix. Slots past the window are
  masked out.

:func:`dense_block_forward` is the head's paged forward written with dense attention (the
paged op has no autograd); ``tests/cover/test_training_block.py`` checks that the two agree.
Saved in z-lab's DFlash layout (``save_block_draft``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.models.block_draft import (
    DFlashHead,
    load_block_draft,
    random_block_draft,
    save_block_draft,
)
from speculum.models.decoder import DecoderModel, dense_attention, dense_batch
from speculum.training.recipes import (
    DraftOptions,
    Metrics,
    Recipe,
    TargetOutputs,
    distill,
    run_target,
    trainable,
    weighted_steps,
)

__all__ = [
    "RECIPE",
    "DEFAULT_BLOCK",
    "anchor_positions",
    "block_mask",
    "decay_weights",
    "dense_block_forward",
    "slot_labels",
]

#: Block width when none is asked for (7 draft tokens).
DEFAULT_BLOCK = 8
#: The DFlash paper's loss decay per block size; others use ``(B - 2) / 2``, at least 1.
_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
#: Anchors drawn per window (fewer when the window is short).
ANCHORS = 16


def decay_weights(count: int, gamma: float) -> list[float]:
    """``exp(-k / gamma)`` for the block's ``k = 0 .. count - 1``-th prediction."""
    return [math.exp(-k / gamma) for k in range(count)]


def anchor_positions(
    windows: Int[Tensor, "batch seq"], count: int, last: int
) -> Int[Tensor, "batch anchors"]:
    """``count`` distinct anchors per window in ``1 .. last`` (fewer when there are fewer),
    ascending, drawn from a generator seeded by the windows themselves, so a resumed run draws
    the anchors an uninterrupted one would."""
    batch = windows.shape[0]
    choices = max(0, last)
    count = min(count, choices)
    seed = int(windows[:, :8].sum()) * 7919 + windows.numel()
    generator = torch.Generator().manual_seed(seed % (2**62))
    draws = [torch.randperm(choices, generator=generator)[:count] + 1 for _ in range(batch)]
    return torch.stack(draws).sort(dim=1).values.to(windows.device)


def block_mask(
    anchors: Int[Tensor, "batch anchors"], seq: int, block_size: int
) -> Bool[Tensor, "batch queries keys"]:
    """Attention of ``anchors`` blocks of ``block_size`` queries over ``seq`` context keys then
    the blocks' own keys: block ``m`` sees context keys ``< anchors[m]`` and its own block."""
    batch, count = anchors.shape
    device = anchors.device
    block = torch.arange(count * block_size, device=device) // block_size
    context = (
        torch.arange(seq, device=device)[None, None, :]
        < anchors.repeat_interleave(block_size, dim=1)[:, :, None]
    )
    own = (block[:, None] == block[None, :]).expand(batch, -1, -1)
    return torch.cat([context, own], dim=2)


def dense_block_forward(
    head: DFlashHead,
    context: Float[Tensor, "batch seq hidden"],
    windows: Int[Tensor, "batch seq"],
    anchors: Int[Tensor, "batch anchors"],
) -> Float[Tensor, "batch anchors block hidden"]:
    """``head.forward`` for the blocks rooted at ``anchors`` of each window, densely and
    differentiably: the injected context's keys and values (each layer's ``k_proj`` /
    ``v_proj`` of ``context``, rotated at the tokens' positions) and the blocks' own, under
    :func:`block_mask`."""
    batch, seq = windows.shape
    count, size = anchors.shape[1], head.config.block_size
    slots = torch.arange(size, device=windows.device)
    positions = (anchors[:, :, None] + slots).flatten(1)
    roots = windows.gather(1, anchors)
    tokens = torch.full((batch, count, size), head.config.mask_token_id, device=windows.device)
    tokens[:, :, 0] = roots
    block = dense_batch(tokens.flatten(1), positions)
    around = dense_batch(windows)
    mask = block_mask(anchors, seq, size)
    x = head.embed(block.input_ids)
    for layer in head.layers:
        attention = layer.self_attn
        normed = layer.input_layernorm(x)
        queries = attention.queries(normed, block, head.inv_freq)
        keys, values = attention.keys_values(normed, block, head.inv_freq)
        context_keys, context_values = attention.keys_values(context, around, head.inv_freq)
        attended = dense_attention(
            queries,
            torch.cat([context_keys, keys], dim=1),
            torch.cat([context_values, values], dim=1),
            mask,
            attention.scale,
            attention.sinks,
        )
        x = x + attention.o_proj(attended.flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return head.norm(x).unflatten(1, (count, size))


def slot_labels(
    out: TargetOutputs, anchors: Int[Tensor, "batch anchors"], offsets: Int[Tensor, " k"]
) -> tuple[Float[Tensor, "batch anchors k vocab"], Bool[Tensor, "batch anchors k"]]:
    """The target's logits of the tokens at ``anchors + offsets`` (its outputs one position
    earlier) and which of them lie inside the window."""
    seq = out.logits.shape[1]
    at = anchors[:, :, None] + offsets - 1
    valid = at <= seq - 1
    index = at.clamp(max=seq - 1).flatten(1)
    labels = out.logits.gather(1, index[:, :, None].expand(-1, -1, out.logits.shape[-1]))
    return labels.unflatten(1, at.shape[1:]), valid


def block_gamma(block_size: int) -> float:
    """The loss decay of a block: the DFlash paper's for 16, 10 and 8 slots."""
    return _GAMMA.get(block_size, max(1.0, (block_size - 2) / 2))


def build(target: DecoderModel, options: DraftOptions, split: Any) -> DFlashHead:
    """Two Qwen3-style layers reading the default target layers, blocks of
    ``options.block_size`` (default 8)."""
    head = random_block_draft(
        target, "dflash", seed=options.seed, block_size=options.block_size or DEFAULT_BLOCK
    )
    return trainable(head, target)


def loss(
    head: DFlashHead,
    target: DecoderModel,
    windows: Int[Tensor, "batch seq"],
    options: DraftOptions,
) -> tuple[Tensor, Metrics]:
    """Decayed soft-label cross-entropy of every drafted slot (module docstring); in
    evaluation the metrics ``kl_k`` and ``acc_k`` per draft position ``k``."""
    out = run_target(target, windows, head.capture_layers)
    size = head.config.block_size
    anchors = anchor_positions(windows, ANCHORS, windows.shape[1] - 2)
    hidden = dense_block_forward(head, head.context(out.captured), windows, anchors)
    offsets = torch.arange(1, size, device=windows.device)
    labels, valid = slot_labels(out, anchors, offsets)
    logits = head.logits(hidden[:, :, 1:])
    steps = [
        distill(logits[:, :, k], labels[:, :, k], valid[:, :, k], report=not head.training)
        for k in range(size - 1)
    ]
    return weighted_steps(steps, decay_weights(size - 1, block_gamma(size)))


def save(head: DFlashHead, folder: Path) -> Path:
    """z-lab's DFlash layout."""
    return save_block_draft(head, folder)


def load(folder: Path, target: DecoderModel) -> DFlashHead:
    """``load_block_draft(folder, target, "dflash")``."""
    return load_block_draft(folder, target, "dflash")


RECIPE = Recipe(name="dflash", build=build, loss=loss, save=save, load=load, on_policy=True)
