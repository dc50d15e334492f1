"""MTP's recipe: one DeepSeek-V3-style MTP layer distilled to predict the token after next.

Entry ``i`` reads ``eh_proj([enorm(embed(t_{i+1})); hnorm(f_i)])`` (``f_i`` the target's
final-normed hidden state of token ``i``) and predicts ``t_{i+2}``; the loss is the forward KL
from the target's distribution at position ``i + 1`` (soft labels) to the layer's, through the
target's frozen ``lm_head``. DeepSeek-V3 trains its MTP modules with the corpus's tokens as hard
labels while pre-training the model; a draft added to a finished target learns the target's own
predictions instead, which is what acceptance rewards. Saved as a separate MTP folder (``mtp``
layout: ``model.layers.{L}.*`` after an ``L``-layer target).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxtyping import Int
from torch import Tensor

from speculum.models.decoder import DecoderModel
from speculum.models.draft import MTPHead, random_draft
from speculum.models.draft_loading import load_draft, save_draft
from speculum.training.recipes import (
    DraftOptions,
    Metrics,
    Recipe,
    distill,
    one_step,
    run_target,
    trainable,
    valid_entries,
)

__all__ = ["RECIPE"]


def build(target: DecoderModel, options: DraftOptions, split: Any) -> MTPHead:
    """One MTP layer of the target's kind, reading the target's embedding and lm_head."""
    return trainable(random_draft(target, "mtp", seed=options.seed), target)


def loss(
    head: MTPHead,
    target: DecoderModel,
    windows: Int[Tensor, "batch seq"],
    options: DraftOptions,
) -> tuple[Tensor, Metrics]:
    """Forward KL to the target's next-token distribution one step further; in evaluation
    the metrics ``kl`` and ``acc``."""
    out = run_target(target, windows)
    hidden = one_step(head, out, windows)
    batch, n = hidden.shape[:2]
    return distill(
        head.logits(hidden),
        out.logits[:, 1:],
        valid_entries(batch, n, 0, windows.device),
        report=not head.training,
    )


def save(head: MTPHead, folder: Path) -> Path:
    """A separate MTP folder (``mtp`` layout)."""
    return save_draft(head, folder, "mtp")


def load(folder: Path, target: DecoderModel) -> MTPHead:
    """``load_draft(folder, target, "mtp")``."""
    return load_draft(folder, target, "mtp")


RECIPE = Recipe(name="mtp", build=build, loss=loss, save=save, load=load)
