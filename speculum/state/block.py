"""Records of the block drafters (DFLASH, DSPARK): a round's static shape, its verify-budget
policy, the batch state between rounds and what one draft forward proposes."""

from __future__ import annotations

from jaxtyping import Float, Int
from torch import Tensor

from speculum.state.kv import PagedKV
from speculum.state.record import record, static
from speculum.state.sampling import SamplingParams

__all__ = ["BUDGETS", "BlockConfig", "BlockProposal", "BlockState"]

#: Verify-budget policies: every draft token (``all``), a fixed number of draft tokens over the
#: whole batch (``fixed``), or the number that maximises expected tokens per second under a
#: measured cost table (``auto``).
BUDGETS = ("all", "fixed", "auto")


@record
class BlockConfig:
    """Static shape of a block round and how many of its draft tokens are verified.

    ``block_size`` slots per block give ``num_drafts`` draft tokens, the first from slot
    ``first_slot``. ``sample_drafts`` draws them from the draft's filtered distributions
    (verified against those distributions) instead of taking the argmax (verified by the
    target-only rule). ``budget`` is one of :data:`BUDGETS`; ``fixed`` verifies
    ``budget_tokens`` draft tokens over the batch, ``auto`` reads the cost table
    ``cost_tokens`` -> ``cost_seconds`` (seconds of a round verifying that many tokens in total,
    roots included; linear in between and beyond). Each row verifies at least ``min_verify``
    draft tokens. ``packed_verify`` runs a budgeted round's target forward over the verified
    tokens only, packed (``spec.block.verify_capacity``), instead of the whole block per row.
    """

    block_size: int = static()
    num_drafts: int = static()
    first_slot: int = static()
    sample_drafts: bool = static(default=False)
    budget: str = static(default="all")
    budget_tokens: int = static(default=0)
    min_verify: int = static(default=0)
    cost_tokens: tuple[int, ...] = static(default=())
    cost_seconds: tuple[float, ...] = static(default=())
    packed_verify: bool = static(default=True)


@record
class BlockState:
    """Batch state between rounds.

    ``kv.seq_lens`` counts the tokens in the target cache and, as injected context, in the
    draft cache; ``root_tokens`` is the last verified token (in neither cache), the block's
    slot 0. ``survival[b, k]`` is the previous round's predicted chance that row ``b``'s draft
    token ``k + 1`` was accepted (ones before the first round): the ``auto`` budget of a round
    is chosen from it, before any of the round's draft tokens exist.

    ``budget`` (every entry the same) and ``budget_bound`` are set on the host just before a
    packed ``auto`` round (``pipelines.dflash.auto_decode``): the budget read from
    ``survival``, and a static power of two at least that large which sizes the round's packed
    verify (one captured graph per bound). Otherwise, and between rounds, both are ``None``
    and the round chooses its budget on the device.
    """

    kv: PagedKV
    root_tokens: Int[Tensor, " batch"]
    survival: Float[Tensor, "batch num_draft"]
    sampling: SamplingParams
    budget: Int[Tensor, " batch"] | None = None
    budget_bound: int | None = static(default=None)


@record
class BlockProposal:
    """One draft forward's draft tokens and, per token, the predicted chance that it is
    accepted given the earlier ones (computed before the token was drawn)."""

    tokens: Int[Tensor, "batch num_draft"]
    confidence: Float[Tensor, "batch num_draft"]
