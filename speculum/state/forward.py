"""The record a model forward reads: which tokens, at which positions, against which cache."""

from __future__ import annotations

import attrs
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from speculum.state.record import record, static

__all__ = ["ForwardBatch"]


@record
class ForwardBatch:
    """Inputs of one model forward over ``q`` query tokens per request (rows padded to ``q``).

    ``positions`` are rotary positions; ``slots`` are the flat pool slots the queries' K/V are
    written to (padding rows point at the padding sink). Each query sees the whole cached prefix
    of ``prefix_lens`` tokens and the ``tail`` cache indices after it that ``new_mask`` allows
    (see ``spec.attention``): causal over the queries themselves for prefill and decode, the
    tree mask for verify. Query ``i`` sits at tail index ``tail - q + i``.

    ``state_slots`` are the requests' recurrent-state slots (``PagedKV.state_slots``), read and
    written by linear-attention layers (default: the padding slot 0, for models without them).
    """

    input_ids: Int[Tensor, "batch q"]
    positions: Int[Tensor, "batch q"]
    slots: Int[Tensor, "batch q"]
    page_table: Int[Tensor, "batch max_pages"]
    prefix_lens: Int[Tensor, " batch"]
    q_lens: Int[Tensor, " batch"]
    new_mask: Bool[Tensor, "batch q tail"]
    state_slots: Int[Tensor, " batch"] = attrs.field(
        default=attrs.Factory(lambda batch: torch.zeros_like(batch.prefix_lens), takes_self=True)
    )
    #: A prompt chunk: every row's queries are a causal run of new tokens, whose only state a
    #: later forward reads is the last one's, so recurrent layers may run their chunked form.
    prefill: bool = static(default=False)
