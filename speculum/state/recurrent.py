"""Recurrent state of hybrid models (gated DeltaNet, Mamba-2 layers): an owned resource like
KV pages.

Each recurrent layer keeps, per request, a short-convolution state (the last ``kernel - 1``
inputs of its causal conv1d) and a recurrent state: the delta rule's ``[head, k_dim, v_dim]``
(gated DeltaNet) or the SSM state ``[head, head_dim, d_state]`` (Mamba-2).
They live in a :class:`RecurrentPool`, allocated once and written in place by contract, one
*slot* per request (slot 0 is the padding sink, never handed out). Records name slots
(``PagedKV.state_slots``), as they name pages.

Unlike K/V, a recurrent state is overwritten by every token, so a slot keeps a small *ring* of
states: the state after the token at cache index ``t`` lives at ring entry ``t % ring``. A
forward over ``q`` tokens after a committed prefix of ``P`` starts each token from its parent's
state (``P - 1``'s ring entry for the first, a tree node's parent's for the rest) and writes
each token's state at its own cache index, exactly where its K/V go. So, as with K/V, a chain
of draft tokens that verify rejects leaves nothing to undo: the next round starts from the
committed prefix, whose entry no round overwrites as long as a round writes fewer than
``ring`` entries past it (the engine sizes ``ring`` from the pipeline's lookahead). A tree's
accepted node sits at its own index, not at its depth: commit copies its state to the entry of
the accepted depth (``spec.recurrent.commit_states``), as ``commit_kv`` moves its K/V.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

__all__ = ["RecurrentPool", "PADDING_SLOT"]

#: State slot that padded rows and models without recurrent layers name; never allocated.
PADDING_SLOT = 0


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class RecurrentPool:
    """The conv and recurrent states of one model's recurrent layers (gated DeltaNet or
    Mamba-2).

    ``conv`` is ``[layer, slot, ring, channels, kernel - 1]`` and ``ssm`` is ``[layer, slot,
    ring, head, k_dim, v_dim]`` (a Mamba-2 layer's ``[head, head_dim, d_state]`` in the last
    three places; layer ``i`` is the model's ``i``-th recurrent layer).
    ``ring`` is how many consecutive cache indices' states a slot keeps (see the module
    docstring).
    """

    conv: Tensor
    ssm: Tensor

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_slots: int,
        ring: int,
        channels: int,
        kernel: int,
        heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> RecurrentPool:
        """Zero-filled pool of ``num_slots`` slots (slot 0 is the padding sink). The recurrent
        state is float32 whatever ``dtype`` the conv inputs are, as transformers keeps it."""
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: need at least 2 (slot 0 is reserved)")
        if ring < 2:
            raise ValueError(
                f"ring={ring}: a slot keeps the committed state and at least one candidate; "
                "give ring >= 2 (the pipeline's KV lookahead + 1)"
            )
        rows = (num_layers, num_slots, ring)
        return cls(
            conv=torch.zeros(*rows, channels, kernel - 1, dtype=dtype, device=device),
            ssm=torch.zeros(*rows, heads, k_dim, v_dim, dtype=torch.float32, device=device),
        )

    def to(self, device: torch.device | str) -> RecurrentPool:
        """This pool's states on ``device`` (itself when they are there already)."""
        return RecurrentPool(conv=self.conv.to(device), ssm=self.ssm.to(device))

    @property
    def num_slots(self) -> int:
        """Slots in the pool, the padding sink included."""
        return self.conv.shape[1]

    @property
    def ring(self) -> int:
        """Consecutive cache indices whose states a slot keeps."""
        return self.conv.shape[2]
