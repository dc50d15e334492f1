"""EAGLE-3's recipe: training-time test over the target's low/mid/high features.

As the EAGLE-3 paper and SpecForge (``specforge/core/eagle3.py``) train it:

- **features**: ``fc`` over the outputs of the target layers the head captures, concatenated;
- **training-time test (TTT)**: ``num_steps`` self-fed steps over each window. Step 0 reads the
  target's features; step ``k > 0`` reads the head's own step ``k - 1`` outputs at the same
  entries, with the tokens shifted ``k`` further (the ground-truth ``t_{i+k+1}``) at rotary
  positions ``i + k``, exactly what the head sees when it drafts ``k`` steps ahead. Step ``k``'s
  query at entry ``i`` attends to the step-0 keys of entries ``<= i`` (the draft's cache of
  verified tokens) and to its own earlier steps' keys of entry ``i`` only (its ancestors in a
  chain). Speculum's head runs cache-free under a mask, so step ``k`` runs over the
  concatenation of steps ``0 .. k`` with that mask (:func:`ttt_mask`): earlier steps are
  recomputed, which costs ``(k + 1)`` step-lengths of work instead of one but needs no cache;
- **loss**: ``sum_k 0.8**k * KL(p_target || q_draft)`` where ``p_target`` is the target's
  distribution restricted to the draft vocabulary and renormalised, counted at the entries
  whose target greedy token the draft vocabulary contains (SpecForge's position mask; at other
  entries the draft cannot propose the right token whatever it learns);
- **reduced vocabulary**: the ``draft_vocab_size`` most frequent tokens of the training split,
  EOS always included, in ascending id order (``d2t``/``t2d`` in the saved checkpoint). The
  head's own ``lm_head`` starts from the target's rows of those tokens and its ``norm`` from the
  target's final norm (a warm start; both train).

Saved in SGLang's ``LlamaForCausalLMEagle3`` layout (``sglang-eagle3``), which ``load_draft``,
SGLang and SpecForge read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.models.decoder import DecoderModel, dense_batch
from speculum.models.draft import Eagle3Head, random_draft
from speculum.models.draft_loading import load_draft, save_draft
from speculum.training.recipes import (
    DraftOptions,
    Metrics,
    Recipe,
    depth_weights,
    distill,
    run_target,
    shifted,
    trainable,
    valid_entries,
    weighted_steps,
)

__all__ = ["RECIPE", "frequent_tokens", "ttt_forward", "ttt_mask"]

#: The published EAGLE-3 drafts for Llama 3 (128k ids) propose from 32 000 tokens.
DEFAULT_DRAFT_VOCAB = 32_000


def frequent_tokens(
    tokens: np.ndarray, size: int, vocab_size: int, always: tuple[int, ...] = ()
) -> Int[Tensor, " size"]:
    """The ``size`` most frequent ids of ``tokens`` below ``vocab_size`` (ties to the lower
    id), ``always`` included whatever their count, in ascending order."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    counts = counts.astype(np.float64)
    counts[[i for i in always if 0 <= i < vocab_size]] = np.inf
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return torch.from_numpy(np.sort(order[:size]).astype(np.int64))


def ttt_mask(n: int, steps: int, device: torch.device | None = None) -> Bool[Tensor, "q q"]:
    """Attention of ``steps`` concatenated TTT steps of ``n`` entries each: query ``(a, i)``
    sees key ``(0, j)`` for ``j <= i`` and keys ``(c, i)`` for ``1 <= c <= a``."""
    index = torch.arange(steps * n, device=device)
    step, entry = index // n, index % n
    causal_step0 = (step[None, :] == 0) & (entry[None, :] <= entry[:, None])
    own_column = (
        (step[None, :] >= 1) & (step[None, :] <= step[:, None]) & (entry[None, :] == entry[:, None])
    )
    return causal_step0 | own_column


def build(target: DecoderModel, options: DraftOptions, split: Any) -> Eagle3Head:
    """A one-layer EAGLE-3 head over the target's default capture layers, its vocabulary the
    split's most frequent tokens (EOS included)."""
    vocab = target.config.vocab_size
    size = min(options.draft_vocab_size or DEFAULT_DRAFT_VOCAB, vocab)
    head = random_draft(
        target, "eagle3", seed=options.seed, draft_vocab_size=0 if size == vocab else size
    )
    ids = frequent_tokens(split.train, size, vocab, target.config.eos_token_ids)
    head.set_target_ids(ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[ids.to(target.lm_head.weight.device)])
        head.norm.weight.copy_(target.model.norm.weight)
    return trainable(head, target)


def ttt_forward(
    head: Eagle3Head,
    features: Float[Tensor, "batch n hidden"],
    windows: Int[Tensor, "batch seq"],
    num_steps: int,
) -> list[Float[Tensor, "batch n hidden"]]:
    """The head's outputs at each TTT step ``k < num_steps`` for entries ``i < n = seq - 1``:
    step ``k`` reads token ``t_{i+k+1}`` at position ``i + k`` and the step ``k - 1`` output
    (``features`` at step 0), attending as :func:`ttt_mask` allows."""
    batch, n = windows.shape[0], windows.shape[1] - 1
    positions = torch.arange(n, device=windows.device).expand(batch, n)
    inputs, tokens, outputs = [features], [], []
    for k in range(num_steps):
        tokens.append(shifted(windows, k + 1, n))
        forward = dense_batch(
            torch.cat(tokens, dim=1),
            torch.cat([positions + j for j in range(k + 1)], dim=1),
            ttt_mask(n, k + 1, windows.device).expand(batch, -1, -1),
        )
        hidden = head(forward, None, torch.cat(inputs, dim=1))[:, k * n :]
        inputs.append(hidden)
        outputs.append(hidden)
    return outputs


def loss(
    head: Eagle3Head,
    target: DecoderModel,
    windows: Int[Tensor, "batch seq"],
    options: DraftOptions,
) -> tuple[Tensor, Metrics]:
    """TTT over ``options.num_steps`` steps (module docstring); in evaluation the metrics
    ``kl_k`` and ``acc_k`` per depth ``k`` (``acc``: the head's argmax, mapped to target ids,
    is the target's greedy token, over every entry with a label)."""
    out = run_target(target, windows, head.capture_layers)
    batch, n = windows.shape[0], windows.shape[1] - 1
    ids = head.target_ids
    in_vocab = torch.zeros(head.config.vocab_size, dtype=torch.bool, device=ids.device)
    in_vocab[ids] = True
    features = head.target_features(out.final, out.captured)[:, :n]
    steps = []
    for k, hidden in enumerate(ttt_forward(head, features, windows, options.num_steps)):
        labels = shifted(out.logits, k + 1, n)
        greedy = labels.argmax(-1)
        valid = valid_entries(batch, n, k, windows.device)
        logits = head.draft_logits(hidden)
        step_loss, metrics = distill(
            logits, labels[..., ids], valid & in_vocab[greedy], report=not head.training
        )
        if metrics:  # the draft vocabulary's argmax, in target ids, against every label
            agree = (ids[logits.argmax(-1)] == greedy) & valid
            metrics["acc"] = float(agree.sum() / valid.sum().clamp(min=1))
        steps.append((step_loss, metrics))
    return weighted_steps(steps, depth_weights(options.num_steps))


def save(head: Eagle3Head, folder: Path) -> Path:
    """SGLang's EAGLE-3 layout (with ``d2t``/``t2d``)."""
    return save_draft(head, folder, "sglang-eagle3")


def load(folder: Path, target: DecoderModel) -> Eagle3Head:
    """``load_draft(folder, target, "eagle3")``."""
    return load_draft(folder, target, "eagle3")


RECIPE = Recipe(name="eagle3", build=build, loss=loss, save=save, load=load)
