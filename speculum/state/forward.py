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

    **Packed layout** (ragged verify, ``spec.paged.pack_batch``): with ``q_starts`` given, the
    per-token fields ``input_ids``, ``positions`` and ``slots`` are one row ``[1, tokens]`` of
    the requests' real tokens back to back, request ``b``'s ``q_lens[b]`` tokens at
    ``q_starts[b] ..``, and the rows after the last request's are padding (token 0, written to
    the padding sink). The per-request fields keep the padded shapes (``new_mask`` is still
    ``[batch, q, tail]``, row ``i`` of request ``b`` describing its packed token
    ``q_starts[b] + i``), so every GEMM and elementwise op runs over ``tokens`` rows instead of
    ``batch * q``. Without ``q_starts`` (``None``) the layout is padded: ``rows == batch`` and
    ``width == q``.
    """

    input_ids: Int[Tensor, "rows width"]
    positions: Int[Tensor, "rows width"]
    slots: Int[Tensor, "rows width"]
    page_table: Int[Tensor, "batch max_pages"]
    prefix_lens: Int[Tensor, " batch"]
    q_lens: Int[Tensor, " batch"]
    new_mask: Bool[Tensor, "batch q tail"]
    state_slots: Int[Tensor, " batch"] = attrs.field(
        default=attrs.Factory(lambda batch: torch.zeros_like(batch.prefix_lens), takes_self=True)
    )
    q_starts: Int[Tensor, " batch"] | None = attrs.field(
        default=None, validator=lambda batch, _, value: check_layout(batch, value)
    )
    #: A prompt chunk: every row's queries are a causal run of new tokens, whose only state a
    #: later forward reads is the last one's, so recurrent layers may run their chunked form.
    prefill: bool = static(default=False)
    #: The flashinfer MLA wrapper planned on the host for this forward (an id from
    #: ``kernels.flashinfer_mla.LatentPlans.bind``), which its latent-attention layers run;
    #: -1, the default, runs the ``speculum::latent_attention`` op. Only the target's forward
    #: sets it, from its pool's plans, while the scheduler has planned a round.
    latent_plan: int = static(default=-1)

    @property
    def packed(self) -> bool:
        """Whether the tokens are packed (``q_starts`` given) rather than padded to ``q``."""
        return self.q_starts is not None


def check_layout(batch: ForwardBatch, q_starts: Tensor | None) -> None:
    """Refuse per-token fields whose shape fits neither layout (see :class:`ForwardBatch`)."""
    tokens = tuple(batch.input_ids.shape)
    padded = tuple(batch.new_mask.shape[:2])
    if q_starts is None and tokens != padded:
        raise ValueError(
            f"ForwardBatch: padded tokens must be [batch, q] = {list(padded)} like new_mask, "
            f"got {list(tokens)} (pass q_starts for the packed layout)"
        )
    if q_starts is not None and tokens[0] != 1:
        raise ValueError(
            f"ForwardBatch: packed tokens are one row [1, tokens], got {list(tokens)} "
            "(build the packed batch with spec.paged.pack_batch)"
        )
