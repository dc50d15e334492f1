"""DSPARK's recipe: DFLASH's anchored blocks, the Markov head teacher-forced, and DeepSpec's
loss: ``0.1`` cross-entropy + ``0.9`` L1 distance + the confidence head's BCE.

The backbone runs as in :mod:`speculum.training.recipes.dflash` (blocks ``[t_a, MASK x (B -
1)]`` at random anchors, one dense forward under the block-sparse mask). Slot ``k`` predicts
the token at ``a + k + 1`` (DeepSpec's convention, every slot trained), its logits biased by the
Markov head from the previous token ``t_{a+k}`` (the root for slot 0): teacher forcing, the
tokens an accepted draft would have had. Per slot, against the target's distribution ``p`` of
that token and the draft's ``q``:

- ``0.1 * CE(p, q)`` (soft labels) + ``0.9 * sum |p - q|``: the L1 term is twice the total
  variation, and ``1 - TV`` is the chance that a draw from ``q`` is accepted, so it trains
  acceptance directly;
- the confidence head's binary cross-entropy against ``1 - TV`` (detached), so its output
  predicts the slot's acceptance chance from the slot's hidden state and the previous token;

each weighted by ``exp(-k / 4)`` (DeepSpec's ``loss_decay_gamma``). Saved in SGLang's DSPARK
layout (``save_block_draft``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor

from speculum.models.block_draft import (
    DSparkHead,
    load_block_draft,
    random_block_draft,
    save_block_draft,
)
from speculum.models.decoder import DecoderModel
from speculum.training.recipes import (
    DraftOptions,
    Metrics,
    Recipe,
    distill,
    run_target,
    trainable,
    weighted_steps,
)
from speculum.training.recipes.dflash import (
    ANCHORS,
    anchor_positions,
    decay_weights,
    dense_block_forward,
    slot_labels,
)

__all__ = ["RECIPE", "DEFAULT_BLOCK"]

#: Block width when none is asked for (7 draft tokens, as DeepSpec's Qwen3 drafts).
DEFAULT_BLOCK = 7
#: DeepSpec's weights of the loss terms and its position decay.
CE_ALPHA, L1_ALPHA, CONFIDENCE_ALPHA, GAMMA = 0.1, 0.9, 1.0, 4.0


def build(target: DecoderModel, options: DraftOptions, split: Any) -> DSparkHead:
    """Two Qwen3-style layers reading the default target layers, a rank-64 vanilla Markov
    head and a confidence head, blocks of ``options.block_size`` (default 7)."""
    head = random_block_draft(
        target, "dspark", seed=options.seed, block_size=options.block_size or DEFAULT_BLOCK
    )
    return trainable(head, target)


def _slot_loss(
    head: DSparkHead,
    logits: Tensor,
    labels: Tensor,
    confidence: Tensor,
    valid: Tensor,
    report: bool,
) -> tuple[Tensor, Metrics]:
    """One slot's weighted sum of the three terms, averaged over ``valid`` entries."""
    ce, metrics = distill(logits, labels, valid, report=report)
    l1 = (labels.float().softmax(-1) - logits.float().softmax(-1)).abs().sum(-1)
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(confidence, accept, reduction="none")
    weight = valid.float()
    count = weight.sum().clamp(min=1.0)
    total = CE_ALPHA * ce + ((L1_ALPHA * l1 + CONFIDENCE_ALPHA * bce) * weight).sum() / count
    if report:
        with torch.no_grad():
            error = (confidence.sigmoid() - accept).abs()
            metrics["tv"] = float((0.5 * l1 * weight).sum() / count)
            metrics["confidence_error"] = float((error * weight).sum() / count)
    return total, metrics


def loss(
    head: DSparkHead,
    target: DecoderModel,
    windows: Int[Tensor, "batch seq"],
    options: DraftOptions,
) -> tuple[Tensor, Metrics]:
    """The decayed DeepSpec loss of every slot (module docstring); in evaluation the metrics
    ``kl_k``, ``acc_k``, ``tv_k`` and ``confidence_error_k`` per slot ``k``."""
    out = run_target(target, windows, head.capture_layers)
    size = head.config.block_size
    anchors = anchor_positions(windows, ANCHORS, windows.shape[1] - 2)
    hidden = dense_block_forward(head, head.context(out.captured), windows, anchors)
    offsets = torch.arange(1, size + 1, device=windows.device)
    labels, valid = slot_labels(out, anchors, offsets)
    at = (anchors[:, :, None] + offsets - 1).clamp(max=windows.shape[1] - 1)
    previous = windows.gather(1, at.flatten(1)).unflatten(1, at.shape[1:])
    base = head.logits(hidden)
    state, steps = head.initial_state(hidden[:, :, 0]), []
    for k in range(size):
        logits, state = head.step_logits(base[:, :, k], previous[:, :, k], hidden[:, :, k], state)
        confidence = head.confidence_logits(hidden[:, :, k], previous[:, :, k])
        steps.append(
            _slot_loss(head, logits, labels[:, :, k], confidence, valid[:, :, k], not head.training)
        )
    return weighted_steps(steps, decay_weights(size, GAMMA))


def save(head: DSparkHead, folder: Path) -> Path:
    """SGLang's DSPARK layout."""
    return save_block_draft(head, folder)


def load(folder: Path, target: DecoderModel) -> DSparkHead:
    """``load_block_draft(folder, target, "dspark")``."""
    return load_block_draft(folder, target, "dspark")


RECIPE = Recipe(name="dspark", build=build, loss=loss, save=save, load=load, on_policy=True)
