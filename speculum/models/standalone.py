"""STANDALONE drafting: a separate small causal LM as the draft, with its own cache and head.

It consumes no target features; it reads tokens like any language model. Where an EAGLE head's
cache entry ``i`` pairs the target's hidden state of token ``i`` with token ``i + 1``, a
standalone draft's entry ``i`` holds token ``i`` itself, so its cache runs one entry *ahead* of
the target's: it already holds the last verified token, whose prediction starts the next round.
"""

from __future__ import annotations

from pathlib import Path

import torch
from jaxtyping import Float
from torch import Tensor, nn

from speculum.models.decoder import DecoderModel
from speculum.models.loading import CheckpointError, load_model
from speculum.state.forward import ForwardBatch
from speculum.state.kv import KVPool
from speculum.state.parallel import SINGLE, TensorParallel

__all__ = ["StandaloneHead", "VocabularyMismatch", "load_standalone"]


class VocabularyMismatch(CheckpointError):
    """A standalone draft whose vocabulary differs from the target's."""


class StandaloneHead(nn.Module):
    """A whole decoder used as a draft head (see the module docstring for ``ahead``)."""

    algorithm = "standalone"
    capture_layers: tuple[int, ...] = ()
    #: Cache entries the draft holds beyond the target's committed tokens.
    ahead = 1

    def __init__(self, model: DecoderModel, target_vocab_size: int) -> None:
        super().__init__()
        if model.config.vocab_size != target_vocab_size:
            raise VocabularyMismatch(
                f"the standalone draft has a vocabulary of {model.config.vocab_size} tokens and "
                f"the target {target_vocab_size}: draft tokens must be target tokens, so use a "
                "draft trained with the target's tokenizer"
            )
        self.model = model

    @property
    def draft_vocab_size(self) -> int:
        """How many distinct tokens the draft can propose: its whole vocabulary."""
        return self.model.config.vocab_size

    def target_features(
        self, final_hidden: Float[Tensor, "batch q hidden"], captured: tuple[Tensor, ...]
    ) -> Float[Tensor, "batch q 0"]:
        """Nothing: a standalone draft reads tokens only."""
        return final_hidden[..., :0]

    def forward(self, batch: ForwardBatch, pool: KVPool, hidden: Tensor) -> Tensor:
        """The draft's final hidden states over ``batch`` (``hidden`` is ignored)."""
        return self.model(batch, pool)[0]

    def logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """The draft's own next-token logits."""
        return self.model.logits(hidden)

    def new_pool(
        self, num_pages: int, page_size: int, dtype: torch.dtype | None = None, **states: int
    ) -> KVPool:
        """A KV pool shaped for the draft model, indexed by the target's page ids; a hybrid
        draft's recurrent ``states`` sizes go to ``DecoderModel.new_pool`` (its slots are
        indexed by the target's slot ids)."""
        return self.model.new_pool(num_pages, page_size, dtype, **states)


def load_standalone(
    folder: str | Path,
    target: DecoderModel,
    algorithm: str = "standalone",
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    tp: TensorParallel = SINGLE,
) -> StandaloneHead:
    """Load any checkpoint :func:`load_model` accepts as a standalone draft for ``target``.

    ``algorithm`` is accepted for a uniform signature with ``load_draft`` and must be
    ``standalone``; ``tp`` shards the draft model (see ``models.parallel.shard_``).
    """
    if algorithm != "standalone":
        raise ValueError(f"load_standalone loads standalone drafts, not {algorithm!r}")
    weight = target.model.embed_tokens.weight
    model = load_model(folder, dtype=dtype or weight.dtype, device=device or weight.device, tp=tp)
    return StandaloneHead(model, target.config.vocab_size)
