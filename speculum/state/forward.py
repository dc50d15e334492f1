"""The record a model forward reads: which tokens, at which positions, against which cache."""

from __future__ import annotations

from jaxtyping import Bool, Int
from torch import Tensor

from speculum.state.record import record

__all__ = ["ForwardBatch"]


@record
class ForwardBatch:
    """Inputs of one model forward over ``q`` new tokens per request (rows padded to ``q``).

    ``positions`` are rotary positions; ``slots`` are the flat pool slots the new tokens' K/V
    are written to (padding rows point at the padding sink); the new tokens occupy cache
    indices ``prefix_lens + 0 .. q_lens - 1`` and see each other through ``new_mask``.
    """

    input_ids: Int[Tensor, "batch q"]
    positions: Int[Tensor, "batch q"]
    slots: Int[Tensor, "batch q"]
    page_table: Int[Tensor, "batch max_pages"]
    prefix_lens: Int[Tensor, " batch"]
    q_lens: Int[Tensor, " batch"]
    new_mask: Bool[Tensor, "batch q q"]
