"""STANDALONE's recipe: a smaller Llama of the target's kind and vocabulary, distilled.

The draft is a whole decoder, by default half the target's width and depth (head size kept,
query and K/V heads halved, MLP width scaled with the hidden size), over the target's
vocabulary, so it reads the target's tokenizer. With ``distill`` (the default) it learns the
target's next-token distribution at every position (forward KL, soft labels); without, the
corpus's next tokens (cross-entropy), as a small LM would be pre-trained. It reads no target
features. Saved with ``save_model`` (``config.json`` + ``model.safetensors``, which
``load_standalone`` and transformers' ``LlamaForCausalLM.from_pretrained`` read); ``train_draft``
adds the target's ``tokenizer.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor

from speculum.models.config import DecoderConfig
from speculum.models.decoder import DecoderModel, dense_batch
from speculum.models.loading import random_model, save_model
from speculum.models.standalone import StandaloneHead, load_standalone
from speculum.training.recipes import (
    DraftOptions,
    Metrics,
    Recipe,
    distill,
    run_target,
    trainable,
    valid_entries,
)

__all__ = ["RECIPE", "standalone_config"]


def standalone_config(target: DecoderConfig, size: tuple[int, int] | None) -> DecoderConfig:
    """The draft's config: ``size = (hidden_size, num_layers)``, default half the target's.

    The head size stays the target's; query heads fill the width and K/V heads keep the
    target's grouping as far as the new head count divides. The draft is dense, also for a
    mixture-of-experts target (``DecoderConfig.dense``).
    """
    head_dim = target.head_dim
    if size is None:
        hidden = max(head_dim, target.hidden_size // 2 // head_dim * head_dim)
        layers = max(1, target.num_layers // 2)
    else:
        hidden, layers = size
    if hidden < head_dim or hidden % head_dim or layers < 1:
        raise ValueError(
            f"standalone_size={size}: the hidden size must be a positive multiple of the "
            f"target's head size {head_dim} and there must be at least one layer"
        )
    heads = hidden // head_dim
    wanted = max(1, round(target.num_kv_heads * heads / target.num_heads))
    kv_heads = max(d for d in range(1, wanted + 1) if heads % d == 0)
    return attrs.evolve(
        target.dense(),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=max(1, target.intermediate_size * hidden // target.hidden_size),
        num_nextn_predict_layers=0,
    )


def build(target: DecoderModel, options: DraftOptions, split: Any) -> StandaloneHead:
    """A random decoder of :func:`standalone_config`'s shape, on the target's device and in
    its dtype."""
    config = standalone_config(target.config, options.standalone_size)
    weight = target.model.embed_tokens.weight
    model = random_model(config, seed=options.seed, std=0.02)
    model = model.to(device=weight.device, dtype=weight.dtype)
    return trainable(StandaloneHead(model, target.config.vocab_size), target)


def loss(
    head: StandaloneHead,
    target: DecoderModel,
    windows: Int[Tensor, "batch seq"],
    options: DraftOptions,
) -> tuple[Tensor, Metrics]:
    """Distillation to the target at every position, or next-token cross-entropy without
    ``distill``; in evaluation the metrics ``kl``/``acc`` against the target, or ``ce``."""
    if not options.distill:
        hidden, _ = head.model(dense_batch(windows[:, :-1]), None)
        ce = F.cross_entropy(head.logits(hidden).flatten(0, 1), windows[:, 1:].flatten())
        return ce, ({} if head.training else {"ce": float(ce)})
    out = run_target(target, windows)
    hidden, _ = head.model(dense_batch(windows), None)
    batch, length = windows.shape
    valid = valid_entries(batch, length, 0, windows.device)
    return distill(head.logits(hidden), out.logits, valid, report=not head.training)


def save(head: StandaloneHead, folder: Path) -> Path:
    """``config.json`` and ``model.safetensors`` of the draft decoder."""
    return save_model(head.model, folder)


def load(folder: Path, target: DecoderModel) -> StandaloneHead:
    """``load_standalone(folder, target)``."""
    return load_standalone(folder, target)


RECIPE = Recipe(name="standalone", build=build, loss=loss, save=save, load=load)
