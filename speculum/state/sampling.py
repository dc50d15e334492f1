"""Per-request sampling settings, as a batch record."""

from __future__ import annotations

from jaxtyping import Float, Int
from torch import Tensor

from speculum.state.record import record

__all__ = ["SamplingParams"]


@record
class SamplingParams:
    """How each request turns logits into a token.

    ``temperature == 0`` is greedy (argmax); ``top_k == 0``, ``top_p == 1`` and ``min_p == 0``
    switch the corresponding filter off. ``seed`` keys the request's counter-based random
    streams: a request's draws depend only on its seed and on token positions, never on the
    batch it runs in, so snapshot/restore and re-batching replay bit-exactly.
    """

    temperature: Float[Tensor, " batch"]
    top_k: Int[Tensor, " batch"]
    top_p: Float[Tensor, " batch"]
    min_p: Float[Tensor, " batch"]
    seed: Int[Tensor, " batch"]
