"""EAGLE-1's recipe: regress the target's next feature, and its next-token distribution.

As the EAGLE reference trains it (SafeAILab/EAGLE ``train/main.py``: ``v_w = 1.0``,
``p_w = 0.1``): entry ``i`` reads ``fc([embed(t_{i+1}); f_i])`` where ``f_i`` is the target's
final-normed hidden state of token ``i``, and its output ``h_i`` (the last layer's residual
stream, what inference feeds back) is trained to *be* ``f_{i+1}``::

    loss = SmoothL1(h_i, f_{i+1}) + 0.1 * KL(p_target(i + 1) || softmax(lm_head(h_i)))

The classification term uses the target's softmax as soft labels (forward KL, as the reference
does), through the target's own ``lm_head``, which stays frozen. The reference's uniform noise
on the input features is left out. Saved in SGLang's ``LlamaForCausalLMEagle`` layout
(``sglang-eagle``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor

from speculum.models.decoder import DecoderModel
from speculum.models.draft import EagleHead, random_draft
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

#: The EAGLE reference's weight of the token term against the feature term.
TOKEN_WEIGHT = 0.1


def build(target: DecoderModel, options: DraftOptions, split: Any) -> EagleHead:
    """A one-decoder-layer EAGLE-1 head (``fc`` with bias, the reference's default)."""
    return trainable(random_draft(target, "eagle", seed=options.seed), target)


def loss(
    head: EagleHead,
    target: DecoderModel,
    windows: Int[Tensor, "batch seq"],
    options: DraftOptions,
) -> tuple[Tensor, Metrics]:
    """Feature regression plus 0.1 x the token distillation (module docstring); in evaluation
    the metrics ``feature`` (the SmoothL1 term), ``kl`` and ``acc``."""
    out = run_target(target, windows)
    hidden = one_step(head, out, windows)
    feature = F.smooth_l1_loss(hidden.float(), out.final[:, 1:].float())
    batch, n = hidden.shape[:2]
    report = not head.training
    token, metrics = distill(
        head.logits(hidden),
        out.logits[:, 1:],
        valid_entries(batch, n, 0, windows.device),
        report=report,
    )
    if report:
        metrics["feature"] = float(feature)
    return feature + TOKEN_WEIGHT * token, metrics


def save(head: EagleHead, folder: Path) -> Path:
    """SGLang's EAGLE layout."""
    return save_draft(head, folder, "sglang-eagle")


def load(folder: Path, target: DecoderModel) -> EagleHead:
    """``load_draft(folder, target, "eagle")``."""
    return load_draft(folder, target, "eagle")


RECIPE = Recipe(name="eagle", build=build, loss=loss, save=save, load=load)
