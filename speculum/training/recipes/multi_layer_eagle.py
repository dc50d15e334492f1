"""Multi-layer EAGLE's recipe: one MTP layer per draft depth, chained as at inference.

Layer ``k`` (0-based; ``k + 1`` in ``speculum.pipelines.multi_layer_eagle``'s notation) reads,
at entry ``i`` and rotary position ``i``, the token ``t_{i+k+1}`` and a hidden state: the
target's final-normed ``f_i`` for layer 0 and, with ``chain_hidden`` (the default, as the
pipeline's), layer ``k - 1``'s output at the same entry for the others (else ``f_i`` again). It
predicts ``t_{i+k+2}`` and is scored by the forward KL from the target's distribution at
position ``i + k + 1``. Each layer attends causally over its own entries, as its cache holds
them. The layers are trained together, the loss their mean (DeepSeek-V3's equal weighting of
MTP depths); gradients flow through the chained hidden states, since at inference every layer
reads its predecessor's output. The number of layers is ``num_steps``, the drafting depth the
pipeline requires. Saved as a separate folder of ``num_steps`` MTP layers
(``save_multi_layer``'s separate form).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxtyping import Int
from torch import Tensor

from speculum.models.decoder import DecoderModel, dense_batch
from speculum.models.multi_layer_eagle import (
    MultiLayerEagleHead,
    load_multi_layer,
    random_multi_layer,
    save_multi_layer,
)
from speculum.training.recipes import (
    DraftOptions,
    Metrics,
    Recipe,
    distill,
    run_target,
    shifted,
    trainable,
    valid_entries,
    weighted_steps,
)

__all__ = ["RECIPE"]


def build(target: DecoderModel, options: DraftOptions, split: Any) -> MultiLayerEagleHead:
    """``num_steps`` MTP layers of the target's kind."""
    head = random_multi_layer(target, options.num_steps, seed=options.seed)
    return trainable(head, target)


def loss(
    head: MultiLayerEagleHead,
    target: DecoderModel,
    windows: Int[Tensor, "batch seq"],
    options: DraftOptions,
) -> tuple[Tensor, Metrics]:
    """The mean over layers of each layer's distillation loss (module docstring); in
    evaluation the metrics ``kl_k`` and ``acc_k`` per layer ``k``."""
    out = run_target(target, windows)
    batch, n = windows.shape[0], windows.shape[1] - 1
    hidden = out.final[:, :n]
    steps = []
    for k in range(head.num_layers):
        forward = dense_batch(shifted(windows, k + 1, n))
        output = head.layer_forward(k, forward, None, hidden)
        valid = valid_entries(batch, n, k, windows.device)
        steps.append(
            distill(
                head.layer_logits(k, output),
                shifted(out.logits, k + 1, n),
                valid,
                report=not head.training,
            )
        )
        if options.chain_hidden:
            hidden = output
    return weighted_steps(steps, [1.0 / head.num_layers] * head.num_layers)


def save(head: MultiLayerEagleHead, folder: Path) -> Path:
    """The separate multi-layer MTP folder."""
    return save_multi_layer(head, folder)


def load(folder: Path, target: DecoderModel) -> MultiLayerEagleHead:
    """``load_multi_layer(folder, target)``."""
    return load_multi_layer(folder, target)


RECIPE = Recipe(name="multi_layer_eagle", build=build, loss=loss, save=save, load=load)
