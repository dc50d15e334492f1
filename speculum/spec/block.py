"""Reference stages of the block drafters (DFLASH, DSPARK): the block forward, drawing a
block's draft tokens, the verify-budget scheduler, and the context write after verify.

The stages run any block head with the duck-typed interface of
``speculum.models.block_draft``: ``config.mask_token_id``, ``capture_layers``,
``forward(batch, pool)``, ``logits``, ``write_context(batch, pool, captured)`` and, for heads
that draw their block sequentially (DSPARK), ``initial_state``, ``step_logits`` and optionally
``confidence``. ``resources`` is anything with ``draft`` and ``draft_pool``.

**Randomness.** Draft token ``k`` (1-based) of a round sits at position ``seq_lens + k`` and,
when drafts are sampled, is drawn with ``uniforms(seed, Stream.DRAFT, seq_lens + k, 1)``, as
EAGLE's sampled chains are.

**Verify budget and non-anticipation.** A round may verify fewer draft tokens of a request than
it drafted (ragged verify: one target forward, a different length per row). Whether token
``k`` is verified must be decided from what was known *before* token ``k`` was drawn, or the
verified tokens stop being draws from their ``q`` and sampling is no longer lossless (the
DSpark paper's example: a draft ``q = (0.5, 0.5)`` for a target ``p = (0.7, 0.3)``, verified
only when it drew the first token, emits it with probability ``0.5 + 0.5 * 0.7 = 0.85``).
So:

- a token's *confidence* (the predicted chance that it is accepted given the earlier ones) is
  computed from the block's hidden state and the *previous* token only, and its *survival* is
  the product of confidences up to it, which never grows along a row;
- the round's *budget* (draft tokens verified over the whole batch) is a function of the batch
  size, the cost table and the *previous* round's survivals, never of this round's tokens
  (:func:`choose_budget`);
- the verified tokens are the ``budget`` largest survivals (ties to the earlier position, then
  the earlier row), a prefix of every row (:func:`select_verify_lens`): token ``k``'s rank
  depends on its own survival, its row's earlier ones and other rows', none of which depends on
  token ``k``.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from speculum.spec.draft import gather_nodes
from speculum.spec.paged import extend_batch, tail_batch
from speculum.spec.sampling import (
    Stream,
    draft_logits_guarded,
    drafting,
    filtered_probs,
    reads_path,
    sample_from_probs,
    uniforms,
)
from speculum.state.block import BlockConfig, BlockProposal, BlockState
from speculum.state.forward import ForwardBatch
from speculum.state.kv import PagedKV
from speculum.state.record import make
from speculum.state.sampling import SamplingParams
from speculum.state.tree import Verified

__all__ = [
    "block_batch",
    "propose_block",
    "survival",
    "round_seconds",
    "choose_budget",
    "select_verify_lens",
    "verify_capacity",
    "budget_bound",
    "plan_verify",
    "write_accepted_context",
]


def block_batch(
    kv: PagedKV, root_tokens: Int[Tensor, " batch"], block_size: int, mask_token_id: int
) -> ForwardBatch:
    """The block ``[root, MASK x (B - 1)]`` at positions ``seq_lens .. seq_lens + B - 1``,
    written at the tail slots after the committed entries, every slot seeing the context prefix
    and every other slot (bidirectional attention inside the block)."""
    batch = root_tokens.shape[0]
    device = root_tokens.device
    masks = torch.full((batch, block_size - 1), mask_token_id, dtype=torch.int64, device=device)
    tokens = torch.cat([root_tokens[:, None].to(torch.int64), masks], dim=1)
    positions = kv.seq_lens[:, None] + torch.arange(block_size, device=device)
    visible = torch.ones(batch, block_size, block_size, dtype=torch.bool, device=device)
    return tail_batch(kv, tokens, positions, visible)


def _draw(
    logits: Float[Tensor, "batch *rows vocab"],
    sampling: SamplingParams,
    positions: Int[Tensor, " batch *rows"],
    sample_drafts: bool,
) -> tuple[Int[Tensor, " batch *rows"], Float[Tensor, "batch *rows vocab"] | None]:
    """Draft tokens at ``positions``: the argmax, or a draw from the filtered distribution
    (returned too, since the verifier must see exactly what each token was drawn from)."""
    if not sample_drafts:
        return logits.argmax(-1), None
    q = filtered_probs(logits, sampling)
    u = uniforms(sampling.seed, Stream.DRAFT, positions, 1)[..., 0]
    return sample_from_probs(q, u), q


def _top_probability(logits: Float[Tensor, "*rows vocab"]) -> Float[Tensor, " *rows"]:
    """The draft's own probability of its likeliest token: the confidence of a head without
    a confidence head (computed before the token is drawn)."""
    return torch.softmax(logits, dim=-1).amax(-1)


def propose_block(
    resources: Any, state: BlockState, config: BlockConfig
) -> tuple[BlockProposal, Float[Tensor, "batch num_draft vocab"] | None]:
    """One block forward and the round's ``num_drafts`` draft tokens, with their confidences
    and (sampled drafts) the distributions they were drawn from.

    DFLASH heads draw every token from its own slot's logits, in parallel. Heads with a
    sequential part (DSPARK's Markov head) walk the slots in order: slot ``k``'s logits get the
    bias of the token before it (the root for the first), then its token is drawn and becomes
    the next slot's previous token. Under penalties (``sampling.penalties``) or a grammar
    (``sampling.grammar``) every head walks the slots in order, slot ``k``'s penalties
    counting, and its grammar mask following, the tokens drawn at the slots before it, as the
    target's do at that depth: every drafted token is one the grammar allows there. With free
    drafts (``spec.sampling.drafting``) the grammar is the target's alone, and without
    penalties a DFLASH head draws its slots in parallel again.
    """
    head, kv = resources.draft, state.kv
    batch = block_batch(kv, state.root_tokens, config.block_size, head.config.mask_token_id)
    hidden = head(batch, resources.draft_pool)
    hidden = hidden[:, config.first_slot : config.first_slot + config.num_drafts]
    positions = kv.seq_lens[:, None] + torch.arange(1, config.num_drafts + 1, device=hidden.device)
    sampling = drafting(state.sampling)
    base = draft_logits_guarded(head.logits(hidden), sampling.temperature, sampling.logit_bias)
    markov, penalties = hasattr(head, "step_logits"), sampling.penalties
    if not markov and not reads_path(sampling):
        tokens, q = _draw(base, sampling, positions, config.sample_drafts)
        proposal = make(BlockProposal, tokens=tokens, confidence=_top_probability(base))
        return proposal, q
    previous = state.root_tokens
    recurrent = head.initial_state(hidden[:, 0]) if markov else None
    tokens, qs, confidences = [], [], []
    for k in range(config.num_drafts):
        logits = base[:, k]
        if markov:
            logits, recurrent = head.step_logits(logits, previous, hidden[:, k], recurrent)
        drawn = torch.stack(tokens, dim=1) if tokens and reads_path(sampling) else None
        logits = draft_logits_guarded(
            logits, sampling.temperature, None, penalties, drawn, sampling.grammar
        )
        if getattr(head, "confidence_head", None) is not None:
            confidences.append(head.confidence(hidden[:, k], previous))
        else:
            confidences.append(_top_probability(logits))
        previous, q = _draw(logits, sampling, positions[:, k], config.sample_drafts)
        tokens.append(previous)
        qs.append(q)
    proposal = make(
        BlockProposal, tokens=torch.stack(tokens, dim=1), confidence=torch.stack(confidences, 1)
    )
    return proposal, None if qs[0] is None else torch.stack(qs, dim=1)


def survival(confidence: Float[Tensor, "batch num_draft"]) -> Float[Tensor, "batch num_draft"]:
    """The predicted chance that each draft token and all before it are accepted: the running
    product of the confidences (never increasing along a row)."""
    return torch.cumprod(confidence.float().clamp(0.0, 1.0), dim=1)


def round_seconds(total_tokens: Int[Tensor, "*n"], config: BlockConfig) -> Float[Tensor, "*n"]:
    """Seconds of a round that verifies ``total_tokens`` tokens (roots included), from the cost
    table: linear between its points and continued linearly beyond the first and last two.

    The table's points enter as Python scalars (no host-to-device copy, so the stage can be
    captured in a CUDA graph)."""
    xs, ys = config.cost_tokens, config.cost_seconds
    n = total_tokens.to(torch.float64)
    seconds = ys[0] + (n - xs[0]) * ((ys[1] - ys[0]) / (xs[1] - xs[0]))
    for i in range(1, len(xs) - 1):
        segment = ys[i] + (n - xs[i]) * ((ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]))
        seconds = torch.where(n >= xs[i], segment, seconds)
    return seconds


def choose_budget(
    previous: Float[Tensor, "batch num_draft"], config: BlockConfig
) -> Int[Tensor, ""]:
    """The round's verify budget (draft tokens over the batch) under ``config.budget``.

    ``auto`` maximises the expected tokens per second: with the previous round's survivals
    ``s`` sorted in decreasing order, verifying ``t`` draft tokens emits ``batch + s_1 + ... +
    s_t`` tokens in expectation (a bonus per row) in ``round_seconds(batch + t)``; the smallest
    best ``t`` wins. It reads nothing of the current round.
    """
    batch, width = previous.shape
    full = previous.new_full((), batch * width, dtype=torch.int64)
    if config.budget == "all":
        return full
    if config.budget == "fixed":
        return full.clamp(max=config.budget_tokens)
    ordered = previous.float().flatten().sort(descending=True).values
    gain = batch + torch.cat([ordered.new_zeros(1), ordered.cumsum(0)]).double()
    spent = torch.arange(batch * width + 1, device=previous.device)
    return (gain / round_seconds(batch + spent, config)).argmax()


def select_verify_lens(
    survival: Float[Tensor, "batch num_draft"], budget: Int[Tensor, ""], min_verify: int = 0
) -> Int[Tensor, " batch"]:
    """How many draft tokens of each row to verify: the ``budget`` largest survivals of the
    batch (ties to the earlier position, then the earlier row), which form a prefix of every
    row since survivals never grow along it, and at least ``min_verify`` per row."""
    batch, width = survival.shape
    flat = survival.flatten()
    position = torch.arange(batch * width, device=flat.device) % width
    # Stable sorts: by position (rows stay in order), then by decreasing survival.
    order = torch.sort(position, stable=True).indices
    order = order[torch.sort(flat[order], descending=True, stable=True).indices]
    ranks = torch.arange(order.numel(), device=flat.device)
    rank = torch.empty_like(order).scatter(0, order, ranks)
    chosen = (rank < budget).reshape(batch, width).sum(-1)
    return chosen.clamp(min=min(min_verify, width))


def verify_capacity(config: BlockConfig, batch: int, budget_bound: int | None = None) -> int | None:
    """Rows of a packed verify forward: a static bound on the tokens a round verifies (roots
    included) that is below the padded ``batch * (num_drafts + 1)``, or ``None`` (verify
    padded) when no bound saves a row or ``config.packed_verify`` is off.

    A budget of at most ``N`` draft tokens (``fixed``: ``N``; ``auto``: ``budget_bound``,
    read on the host before the round) verifies at most ``N`` draft tokens over the batch,
    plus up to ``min_verify`` per row that the budget did not reach
    (:func:`select_verify_lens`), plus the roots. ``all`` verifies every token, and ``auto``
    without a bound may too (its budget is then known only on the device): both run padded.
    """
    padded = batch * (config.num_drafts + 1)
    if not config.packed_verify or config.budget == "all":
        return None
    most = config.budget_tokens if config.budget == "fixed" else budget_bound
    if most is None:
        return None
    floor = batch * min(config.min_verify, config.num_drafts)
    bound = batch + most + floor
    return bound if bound < padded else None


def budget_bound(budget: int) -> int:
    """The smallest power of two ``>= budget`` (1 for 0): the static bound an ``auto`` round is
    captured for, so a batch bucket needs at most ``log2(batch * num_drafts) + 1`` graphs."""
    return 1 << max(budget - 1, 0).bit_length()


def plan_verify(
    state: BlockState, proposal: BlockProposal, config: BlockConfig
) -> tuple[Int[Tensor, " batch"] | None, Float[Tensor, "batch num_draft"]]:
    """The round's verify lengths (``None``: every draft token) and this round's survivals,
    which the next round's budget reads. A budget the host chose (``state.budget``) is used
    as given."""
    current = survival(proposal.confidence)
    if config.budget == "all":
        return None, current
    budget = choose_budget(state.survival, config) if state.budget is None else state.budget[0]
    return select_verify_lens(current, budget, config.min_verify), current


def write_accepted_context(resources: Any, kv: PagedKV, verified: Verified) -> None:
    """The draft cache catches up: the injected context of the root and the accepted draft
    tokens (the target's captured features at the accepted path's nodes) is written at cache
    indices ``seq_lens .. seq_lens + num_accepted`` of the pre-round ``kv``. The block's own
    K/V written there while drafting are overwritten; entries past them are never read."""
    acc = verified.accepted
    captured = tuple(gather_nodes(c, acc.path) for c in verified.captured)
    batch = extend_batch(kv, acc.emitted.clamp(min=0), acc.num_accepted + 1)
    resources.draft.write_context(batch, resources.draft_pool, captured)
