"""Draft-training recipes: what each speculative algorithm's draft learns from a frozen target.

A :class:`Recipe` is a value of four functions: ``build`` a fresh draft for a target, the
``loss`` of a batch of token windows, ``save`` the draft in a layout speculum's loaders read,
and ``load`` it back with that loader. The target never trains: every recipe runs it once per
batch, cache-free and under ``torch.no_grad()`` (:func:`run_target`), and distils from what it
says, so a draft learns the target's behaviour, not the corpus's. The draft is scored against
the target's *distribution* (forward KL, i.e. cross-entropy with the target's softmax as soft
labels), as the EAGLE reference and SpecForge train, because acceptance is decided by the target.

Positions follow speculum's inference convention (``docs/eagle.md``): over a window
``t_0 .. t_{T-1}`` an EAGLE-style draft's entry ``i`` (``0 <= i < T - 1``) pairs the target's
features of token ``i`` with token ``t_{i+1}`` at rotary position ``i``, and its output predicts
``t_{i+2}``, whose target distribution is the target's output at position ``i + 1``. A recipe
that drafts ``k`` steps deeper reads ``t_{i+k+1}`` and is scored against the target at
``i + k + 1``; entries whose label lies past the window are masked out.

``recipe(name)`` imports the recipe's module on first use (``speculum.training.recipes.<name>``,
each defines ``RECIPE``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from speculum.models.decoder import DecoderModel, dense_batch

if TYPE_CHECKING:
    from speculum.training.data import TokenSplit

__all__ = [
    "RECIPES",
    "DraftOptions",
    "Metrics",
    "Recipe",
    "TargetOutputs",
    "depth_weights",
    "distill",
    "one_step",
    "recipe",
    "run_target",
    "shifted",
    "trainable",
    "valid_entries",
    "weighted_steps",
]

#: Algorithms a draft can be trained for, as ``--algorithm`` and ``engine_from_model`` name them.
RECIPES = (
    "eagle",
    "eagle3",
    "mtp",
    "standalone",
    "multi_layer_eagle",
    "frozen_kv_mtp",
    "dflash",
    "dspark",
)
#: Other names of the same drafts: EAGLE-2 runs EAGLE-1 heads, NEXTN is MTP.
_ALIASES = {"eagle1": "eagle", "eagle2": "eagle", "nextn": "mtp"}


@attrs.define(frozen=True, slots=True, kw_only=True)
class DraftOptions:
    """What shapes a draft and its training, beyond the optimiser's settings.

    ``num_steps``: EAGLE-3's training-time-test depth, frozen-KV MTP's self-fed steps and the
    number of layers of a multi-layer EAGLE head (its drafting depth). ``draft_vocab_size``:
    EAGLE-3's reduced vocabulary, the most frequent training tokens (``None``: the target
    vocabulary, capped at 32 000 as the published EAGLE-3 drafts for Llama 3 are).
    ``standalone_size``: ``(hidden_size, num_layers)`` of a standalone draft (``None``: half the
    target's width and depth). ``distill``: a standalone draft learns the target's distribution
    (else the corpus's next tokens). ``chain_hidden``: a multi-layer EAGLE layer reads the
    previous layer's output (else the target's hidden state), as ``SpecOptions.chain_hidden``.
    ``seed`` seeds the draft's initial weights. ``block_size``: the block width of a DFLASH or
    DSPARK draft (``None``: the recipe's default).
    """

    num_steps: int = 3
    draft_vocab_size: int | None = None
    seed: int = 0
    standalone_size: tuple[int, int] | None = None
    distill: bool = True
    chain_hidden: bool = True
    block_size: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps}: a draft drafts at least one step")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size}: must be at least 1")


#: A loss's named float metrics (filled in evaluation only, see :func:`distill`).
Metrics = dict[str, float]


@attrs.define(frozen=True, slots=True, kw_only=True)
class Recipe:
    """How one algorithm's draft is built, trained, saved and read back.

    ``build(target, options, split)``: a fresh draft on the target's device and in its dtype,
    with only its own parameters trainable. ``loss(head, target, windows, options)``: the
    scalar loss of int64 windows ``[batch, length]`` and float metrics. ``save(head, folder)``
    and ``load(folder, target)``: the checkpoint layout and the speculum loader that reads it.
    ``on_policy``: the draft trains on the target's own greedy continuations of corpus prompts
    rather than on the corpus (``train_draft`` regenerates the data first).
    """

    name: str
    build: Callable[[DecoderModel, DraftOptions, TokenSplit], nn.Module]
    loss: Callable[
        [Any, DecoderModel, Int[Tensor, "batch seq"], DraftOptions], tuple[Tensor, Metrics]
    ]
    save: Callable[[Any, Path], Path]
    load: Callable[[Path, DecoderModel], nn.Module]
    on_policy: bool = False


def recipe(algorithm: str) -> Recipe:
    """The recipe of ``algorithm`` (one of :data:`RECIPES`, or the engine's other spellings
    ``eagle1``/``eagle2`` and ``nextn``), importing its module on first use."""
    name = _ALIASES.get(algorithm, algorithm)
    if name not in RECIPES:
        raise ValueError(
            f"no draft-training recipe for algorithm {algorithm!r}; choose one of "
            f"{', '.join(RECIPES)}"
        )
    return importlib.import_module(f"speculum.training.recipes.{name}").RECIPE


# ----------------------------------------------------------------------------------------
# Shared by the recipes


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class TargetOutputs:
    """What the frozen target says about a batch of windows (no autograd graph)."""

    final: Float[Tensor, "batch seq hidden"]
    captured: tuple[Float[Tensor, "batch seq hidden"], ...]
    logits: Float[Tensor, "batch seq vocab"]

    @property
    def greedy(self) -> Int[Tensor, "batch seq"]:
        """The target's argmax next token at every position."""
        return self.logits.argmax(-1)


def run_target(
    target: DecoderModel, windows: Int[Tensor, "batch seq"], capture_layers: tuple[int, ...] = ()
) -> TargetOutputs:
    """The target over ``windows`` (causal, cache-free): its final-normed hidden states, the
    outputs of ``capture_layers`` and its float32 logits, all without gradients."""
    with torch.no_grad():
        final, captured = target(dense_batch(windows), None, capture_layers)
        return TargetOutputs(final=final, captured=captured, logits=target.logits(final))


def shifted(x: Tensor, offset: int, length: int) -> Tensor:
    """``x[:, offset : offset + length]`` along axis 1, zero-padded at the end to ``length``
    (the entries whose tokens or labels lie past the window; the loss masks them)."""
    part = x[:, offset : offset + length]
    missing = length - part.shape[1]
    if missing <= 0:
        return part
    pad = part.new_zeros((part.shape[0], missing, *part.shape[2:]))
    return torch.cat([part, pad], dim=1)


def valid_entries(
    batch: int, length: int, depth: int, device: torch.device
) -> Bool[Tensor, "batch n"]:
    """Entries ``i < length - depth``: those whose label at depth ``depth`` (0 = the first
    draft step) lies inside the window."""
    return (torch.arange(length, device=device) < length - depth).expand(batch, length)


def distill(
    logits: Float[Tensor, "batch n vocab"],
    target_logits: Float[Tensor, "batch n vocab"],
    mask: Bool[Tensor, "batch n"],
    *,
    report: bool,
) -> tuple[Float[Tensor, ""], Metrics]:
    """Forward KL from the target's distribution to the draft's, averaged over ``mask``.

    The loss is the soft-label cross-entropy ``-sum p log q`` (its gradient is the KL's). With
    ``report`` (evaluation: reading them syncs the device, which training steps skip) the
    metrics are the KL itself (0 when the draft matches) and ``acc``, how often the draft's
    argmax is the target's greedy token; else none.
    """
    p = target_logits.float().softmax(-1)
    cross = -(p * logits.float().log_softmax(-1)).sum(-1)
    weight = mask.float()
    count = weight.sum().clamp(min=1.0)
    loss = (cross * weight).sum() / count
    if not report:
        return loss, {}
    with torch.no_grad():
        entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)
        agree = (logits.argmax(-1) == target_logits.argmax(-1)).float()
        kl = float(((cross - entropy) * weight).sum() / count)
        acc = float((agree * weight).sum() / count)
    return loss, {"kl": kl, "acc": acc}


def one_step(
    head: Any, out: TargetOutputs, windows: Int[Tensor, "batch seq"]
) -> Float[Tensor, "batch n hidden"]:
    """An EAGLE-style head's first draft step over a window: entry ``i`` reads the target's
    features of token ``i`` and token ``t_{i+1}`` at position ``i``, densely (``pool=None``)."""
    n = windows.shape[1] - 1
    hidden = head.target_features(out.final, out.captured)[:, :n]
    return head(dense_batch(windows[:, 1:]), None, hidden)


def trainable(head: nn.Module, target: DecoderModel) -> nn.Module:
    """``head`` in training mode with its own parameters trainable and the target's frozen.

    Speculum's heads borrow the target's embedding and lm_head without registering them; a
    head that registered one would train the target through it, which this refuses.
    """
    target.eval().requires_grad_(False)
    shared = {id(p) for p in target.parameters()} & {id(p) for p in head.parameters()}
    if shared:
        raise ValueError(
            "the draft registers parameters of the target (its embedding or lm_head), which "
            "training would change: borrow them without registering, as build_draft does"
        )
    return head.train().requires_grad_(True)


def depth_weights(num_steps: int) -> list[float]:
    """EAGLE-3's training-time-test weights ``0.8 ** k`` for draft depths ``k = 0 ..``."""
    return [0.8**k for k in range(num_steps)]


def weighted_steps(
    losses: list[tuple[Tensor, Metrics]], weights: list[float]
) -> tuple[Tensor, Metrics]:
    """``sum_k weights[k] * loss_k``, with each step's metrics suffixed by its depth
    (``kl_0``, ``acc_0``, ``kl_1`` ...)."""
    total = sum(w * loss for w, (loss, _) in zip(weights, losses))
    metrics: Metrics = {}
    for k, (_, step) in enumerate(losses):
        metrics |= {f"{name}_{k}": value for name, value in step.items()}
    return total, metrics
