"""The tensor-parallel group: an owned resource, like the KV pool.

A model sharded over ``size`` ranks holds this rank's slices of its weights and the
:class:`TensorParallel` value its sharded layers call collectives on. Nothing global is read:
a layer reduces over the group it was built with, so two models sharded over two different
groups never mix. With ``size == 1`` every collective is the identity and no process group is
needed.

Every collective here is a blocking ``torch.distributed`` call on the current stream, which is
what lets a captured CUDA graph hold it (NCCL >= 2.9.6, PyTorch's process group skips its
watchdog bookkeeping while a stream captures).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch.distributed as dist
from jaxtyping import Float
from torch import Tensor

__all__ = ["SINGLE", "TensorParallel"]

# torch 2.13 renamed all_gather_into_tensor (the older name warns there); torch 2.11 has only it.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class TensorParallel:
    """This process's place in a tensor-parallel group of ``size`` ranks.

    ``group`` is the ``torch.distributed`` process group the collectives run over (``None``:
    the default group, all processes). Sharding a model only needs ``rank`` and ``size``; its
    forwards need the group to be initialised.
    """

    rank: int
    size: int
    group: Any = None

    def __attrs_post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"rank {self.rank} of a tensor-parallel group of {self.size}: need "
                "size >= 1 and 0 <= rank < size"
            )

    @property
    def is_leader(self) -> bool:
        """Whether this is rank 0, the one rank that talks to the user."""
        return self.rank == 0

    def all_reduce(self, partial: Tensor) -> Tensor:
        """The sum of ``partial`` over the ranks, on every rank.

        ``partial`` must be a temporary of the caller's (it is summed in place and returned);
        every rank ends with the same bytes.
        """
        if self.size > 1:
            dist.all_reduce(partial, group=self.group)
        return partial

    def all_gather(self, part: Float[Tensor, "*rows part"]) -> Float[Tensor, "*rows whole"]:
        """Every rank's ``part`` concatenated along the last axis in rank order, on every rank
        (``whole = size * part``)."""
        if self.size == 1:
            return part
        # Gathered flat (gloo accepts only the concatenated form), then viewed rank-major.
        flat = part.new_empty(self.size * part.numel())
        _all_gather(flat, part.contiguous().view(-1), group=self.group)
        return flat.view(self.size, *part.shape).movedim(0, -2).flatten(-2)

    def from_leader(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object), on every rank: the inputs every rank must
        agree on (prompts, sampling settings) come from one place."""
        if self.size == 1:
            return value
        box = [value]  # staged through the current GPU under NCCL, through memory under gloo
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


#: One rank: nothing sharded, every collective the identity.
SINGLE = TensorParallel(rank=0, size=1)
