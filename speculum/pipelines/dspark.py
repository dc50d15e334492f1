"""DSPARK: DFLASH's block forward, a Markov head drawing the block token by token, and a
confidence-scheduled verify budget.

The composition is DFLASH's (``pipelines.dflash``); what differs lives in the head and in the
round's configuration:

- the block's slot ``k`` predicts the token after slot ``k``'s (``B`` draft tokens, DeepSpec's
  convention), and its logits get the Markov head's bias from the token before it, so tokens
  are drawn one after another from exact per-token draft distributions (the block forward
  itself runs once);
- each token's confidence comes from the confidence head over the slot's hidden state and the
  previous token, before the token is drawn;
- the verify budget (``budget="auto"`` with a measured cost table) verifies, over the batch,
  the draft tokens of highest survival, as many as maximise the expected tokens per second
  predicted from the previous round's survivals: ragged verify, a different length per
  request in one target forward, decided without looking at the tokens it cuts off
  (``spec.block``; ``docs/dspark.md`` shows why that matters).
"""

from __future__ import annotations

from typing import Any

from speculum.pipelines.base import Pipeline
from speculum.pipelines.dflash import block_pipeline, round_config

__all__ = ["pipeline"]


def pipeline(*, block_size: int, **options: Any) -> Pipeline:
    """The DSPARK pipeline value; ``options`` are ``pipelines.dflash.round_config``'s
    (``sample_drafts``, ``budget``, ``cost_table``, ``min_verify``, ``packed_verify``)."""
    return block_pipeline("dspark", round_config(block_size=block_size, first_slot=0, **options))
