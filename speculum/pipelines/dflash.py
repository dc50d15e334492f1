"""DFLASH: a block of draft tokens from one draft forward, verified as a chain.

The draft (``speculum.models.block_draft``) reads the target's hidden states as injected
context in its own KV cache, and fills a block ``[root, MASK x (B - 1)]`` in one bidirectional
forward (z-lab's DFlash). One round, as pure stages over records:

1. ``propose_block`` (``spec.block``): the block forward and its ``B - 1`` draft tokens, the
   argmax of each slot (or draws from its filtered distribution, with ``sample_drafts``);
2. ``plan_verify``: how many of them each row verifies (all, unless a verify budget says
   otherwise; see ``docs/dspark.md``);
3. ``chain_tree``, ``verify_tree`` (one target forward, the rows ragged when the budget cuts
   them), ``accept`` and ``commit_path``: the shared stages, a chain being a tree;
4. ``write_accepted_context``: the draft cache grows by the root and the accepted tokens, the
   target's captured features at those positions projected to the draft layers' K/V.

Prefill writes the chunk's context the same way; the first block's root is the first sampled
token. Nothing else is carried between rounds (the block is drafted at the start of a round),
except the survivals a verify budget reads. DSPARK (``pipelines.dspark``) is this composition
with a head that draws its block sequentially and slot ``k`` predicting the token after slot
``k``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from speculum.pipelines.base import (
    Pipeline,
    PrefillChunk,
    Resources,
    StepOutput,
    prefill_output,
    verified_output,
)
from speculum.spec.block import (
    budget_bound,
    choose_budget,
    plan_verify,
    propose_block,
    verify_capacity,
    write_accepted_context,
)
from speculum.spec.paged import extend_batch
from speculum.spec.prefill import prefill_target
from speculum.spec.tree import chain_tree
from speculum.spec.verify import commit_path, verify_tree
from speculum.state.block import BUDGETS, BlockConfig, BlockState
from speculum.state.record import make, replace

__all__ = [
    "BlockConfig",
    "BlockState",
    "prefill",
    "decode",
    "auto_decode",
    "round_config",
    "pipeline",
]


def _check_head(resources: Resources, config: BlockConfig) -> None:
    head = resources.draft
    if not hasattr(head, "write_context"):
        raise ValueError(
            f"a block pipeline needs a block draft (speculum.models.block_draft), got "
            f"{type(head).__name__}"
        )
    sequential = hasattr(head, "step_logits")
    if sequential != (config.first_slot == 0):
        kind = "dspark" if sequential else "dflash"
        raise ValueError(f"the draft is a {kind} draft; run it with --algorithm {kind}")


def prefill(
    resources: Resources, chunk: PrefillChunk, *, config: BlockConfig
) -> tuple[BlockState, StepOutput]:
    """Target prefill of a prompt chunk, capturing the layers the draft reads, then the
    chunk's injected context written into the draft cache (no draft forward)."""
    _check_head(resources, config)
    out = prefill_target(
        resources.target,
        resources.target_pool,
        chunk.kv,
        chunk.tokens,
        chunk.q_lens,
        chunk.sampling,
        resources.draft.capture_layers,
        next_tokens=chunk.next_tokens,
        num_prompt_logprobs=chunk.prompt_logprobs,
    )
    batch = extend_batch(chunk.kv, chunk.tokens, chunk.q_lens)
    resources.draft.write_context(batch, resources.draft_pool, out.captured)
    first = out.first_tokens
    survival = torch.ones(first.shape[0], config.num_drafts, device=first.device)
    state = make(
        BlockState, kv=out.kv, root_tokens=first, survival=survival, sampling=chunk.sampling
    )
    return state, prefill_output(first, out.faults, out.logprobs, out.prompt_logprobs)


def decode(
    resources: Resources, state: BlockState, *, config: BlockConfig
) -> tuple[BlockState, StepOutput]:
    """One round: draft a block, plan the verify lengths, verify the chain, accept, commit,
    then write the accepted tokens' context into the draft cache."""
    proposal, q = propose_block(resources, state, config)
    verify_lens, survival = plan_verify(state, proposal, config)
    verified = verify_tree(
        resources.target,
        resources.target_pool,
        state.kv,
        chain_tree(state.root_tokens, proposal.tokens),
        state.sampling,
        max_depth=config.num_drafts,
        max_children=1,
        capture_layers=resources.draft.capture_layers,
        draft_probs=None if q is None else F.pad(q, (0, 0, 1, 0)),  # node i + 1 is token i
        verify_lens=verify_lens,
        capacity=packed_capacity(resources, config, state.root_tokens.shape[0], state.budget_bound),
    )
    acc = verified.accepted
    kv = commit_path(resources.target_pool, state.kv, acc)
    write_accepted_context(resources, state.kv, verified)
    bonus = acc.emitted.gather(1, acc.num_accepted[:, None])[:, 0]
    # The host's budget was this round's alone: a state between rounds carries none.
    new_state = replace(
        state, kv=kv, root_tokens=bonus, survival=survival, budget=None, budget_bound=None
    )
    return new_state, verified_output(verified)


def auto_decode(
    resources: Resources,
    state: BlockState,
    *,
    config: BlockConfig,
    device_round: Callable[[Resources, BlockState], tuple[BlockState, StepOutput]],
) -> tuple[BlockState, StepOutput]:
    """A round under the ``auto`` budget, verified packed: the budget is read on the host
    from the previous round's survivals (a copy of ``batch x num_drafts`` floats, so the
    bound is exact, not a second computation that could round differently), then
    ``device_round`` (:func:`decode`, captured per batch bucket and ``budget_bound``) runs
    with that budget and a packed capacity for the next power of two above it."""
    if resources.target.config.is_hybrid:
        return device_round(resources, state)
    budget = int(choose_budget(state.survival.cpu(), config))
    given = torch.full_like(state.root_tokens, budget)
    return device_round(resources, replace(state, budget=given, budget_bound=budget_bound(budget)))


def packed_capacity(
    resources: Resources, config: BlockConfig, batch: int, bound: int | None = None
) -> int | None:
    """Rows of the round's packed target forward (``spec.block.verify_capacity``, ``bound``
    an ``auto`` round's budget bound), or ``None`` to verify padded: always for hybrid
    targets, whose recurrent layers scan padded rows."""
    if resources.target.config.is_hybrid:
        return None
    return verify_capacity(config, batch, bound)


def round_config(
    *,
    block_size: int,
    first_slot: int,
    sample_drafts: bool = False,
    budget: str | int = "all",
    cost_table: tuple[tuple[int, float], ...] | None = None,
    min_verify: int = 0,
    packed_verify: bool = True,
) -> BlockConfig:
    """The validated shape of a block round.

    ``budget`` is ``"all"``, ``"auto"`` (needs ``cost_table``: ``(tokens verified in the round,
    roots included, seconds)`` pairs, at least two, tokens increasing) or an int, the draft
    tokens verified over the whole batch each round. ``first_slot`` is 1 for DFLASH (slot 0
    holds the root) and 0 for DSPARK. ``packed_verify`` (default) runs a fixed or ``auto``
    budget's target forward over the verified tokens only, packed; off, over the whole block
    of every row (padded), with the same result.
    """
    integral = isinstance(block_size, int) and not isinstance(block_size, bool)
    num_drafts = block_size - first_slot if integral else 0
    problems = []
    if num_drafts < 1:
        problems.append(
            f"block_size={block_size!r}: the block must hold at least one draft token (DFLASH: "
            "block_size >= 2, DSPARK: block_size >= 1)"
        )
    kind, tokens = ("fixed", budget) if isinstance(budget, int) else (budget, 0)
    if kind not in BUDGETS or (kind == "fixed" and tokens < 0):
        problems.append(
            f"verify budget {budget!r}: use 'all', 'auto' or a number of draft tokens >= 0"
        )
    table = tuple(cost_table or ())
    if kind == "auto":
        xs = [int(n) for n, _ in table]
        if len(table) < 2 or any(b <= a for a, b in zip(xs, xs[1:])):
            problems.append(
                "the 'auto' verify budget needs a cost table of at least two (tokens, seconds) "
                "points with increasing token counts (--cost-table FILE)"
            )
        elif any(float(s) <= 0 for _, s in table):
            problems.append("cost table seconds must be positive")
    if min_verify < 0:
        problems.append(f"min_verify={min_verify}: must be >= 0")
    if problems:
        raise ValueError("invalid block round: " + "; ".join(problems))
    return BlockConfig(
        block_size=block_size,
        num_drafts=num_drafts,
        first_slot=first_slot,
        sample_drafts=sample_drafts,
        budget=kind,
        budget_tokens=tokens,
        min_verify=min_verify,
        cost_tokens=tuple(int(n) for n, _ in table),
        cost_seconds=tuple(float(s) for _, s in table),
        packed_verify=packed_verify,
    )


def block_pipeline(name: str, config: BlockConfig) -> Pipeline:
    """The pipeline value of a block round ``config``."""
    # Verify writes the root and the draft tokens after the committed entries; the block
    # forward writes block_size draft-cache entries there; the context write fewer.
    round_fn = functools.partial(decode, config=config)
    shape = {
        "name": name,
        "prefill": functools.partial(prefill, config=config),
        "max_tokens_per_step": config.num_drafts + 1,
        "kv_lookahead": max(config.num_drafts + 1, config.block_size),
    }
    if config.budget != "auto" or not config.packed_verify:
        return Pipeline(decode=round_fn, **shape)
    # A packed auto round reads its budget on the host first (auto_decode); the engine
    # captures the device round per batch bucket and budget bound.
    return Pipeline(
        decode=functools.partial(auto_decode, config=config, device_round=round_fn),
        host_work=True,
        device_round=round_fn,
        **shape,
    )


def pipeline(*, block_size: int, **options: Any) -> Pipeline:
    """The DFLASH pipeline value; ``options`` are :func:`round_config`'s (``sample_drafts``,
    ``budget``, ``cost_table``, ``min_verify``, ``packed_verify``)."""
    return block_pipeline("dflash", round_config(block_size=block_size, first_slot=1, **options))
