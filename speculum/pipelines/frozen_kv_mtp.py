"""FROZEN_KV_MTP: a draft that owns no KV cache and reads the target's (SGLang's FROZEN_KV_MTP).

The head (``speculum.models.frozen_kv``) attends, read-only, to the target's cached K/V of chosen
target layers, for the committed tokens only, at the rotary position of the last committed
token. It caches nothing, so there is nothing to catch up after a round: draft-extend only
records the *seed*, the bonus token and the target's hidden state at the last accepted position,
and the next round's drafting starts from it. One round:

1. ``draft``: the seed forward (the head over the bonus token's embedding and the seed hidden)
   gives the first level of candidates; then ``num_steps - 1`` recurrent steps, each feeding a
   node's token embedding with its parent's output hidden, expand the EAGLE-2 frontier (or draw
   ``topk`` sampled chains). These are the EAGLE stages (``spec.draft.draft``,
   ``spec.draft.draft_sampled``) run over a view whose draft pool *is* the target pool: the head
   reads it and writes nothing, and every node, whatever its depth, sees only the committed
   prefix (the tree mask is the head's to ignore).
2. ``build_tree``, ``verify`` (one target forward over the tree), ``accept``: shared with EAGLE.
3. ``commit``: the accepted path's K/V moves to consecutive target cache slots. It runs before
   draft-extend, so that the cache the next round's draft reads holds the accepted tokens.
4. ``draft_extend``: the new seed, the bonus token and the target's hidden state at the last
   accepted path node (now cache index ``seq_lens - 1``).

Cache slots past the committed tokens are only ever written by verify; the drafting stages
compute tail slots for their batches but the head writes none of them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from speculum.pipelines import eagle
from speculum.pipelines.base import (
    Pipeline,
    PrefillChunk,
    Resources,
    StepOutput,
    prefill_output,
    verified_output,
)
from speculum.spec import draft as spec_draft
from speculum.spec.paged import extend_batch
from speculum.spec.prefill import prefill_target
from speculum.spec.tree import build_tree
from speculum.state.draft import DraftPrediction, EagleConfig, EagleState
from speculum.state.kv import PagedKV
from speculum.state.record import make, record, replace
from speculum.state.sampling import SamplingParams
from speculum.state.tree import DraftCandidates, Verified

__all__ = [
    "Seed",
    "FrozenKVState",
    "prefill",
    "seed_forward",
    "draft",
    "draft_sampled",
    "draft_extend",
    "decode",
    "pipeline",
]


@record
class Seed:
    """Where a request's next draft starts: its last verified token (emitted, not yet in the
    target cache, the root of the next tree) and the target's features at the last committed
    token (cache index ``seq_lens - 1``)."""

    tokens: Int[Tensor, " batch"]
    hidden: Float[Tensor, "batch hidden"]


@record
class FrozenKVState:
    """Batch state between rounds: the target cache (``kv.seq_lens`` committed tokens; the
    draft has no cache) and the seed of the next draft."""

    kv: PagedKV
    seed: Seed
    sampling: SamplingParams


def _seed(
    resources: Resources,
    tokens: Int[Tensor, " batch"],
    hidden: Float[Tensor, "batch n hidden"],
    captured: tuple[Tensor, ...],
    at: Int[Tensor, " batch"],
) -> Seed:
    """The seed of ``tokens`` and the head's features of target output ``at`` of each row."""
    index = at[:, None]
    features = resources.draft.target_features(
        spec_draft.gather_nodes(hidden, index),
        tuple(spec_draft.gather_nodes(c, index) for c in captured),
    )
    return make(Seed, tokens=tokens, hidden=features[:, 0])


def prefill(
    resources: Resources, chunk: PrefillChunk, *, config: EagleConfig
) -> tuple[FrozenKVState, StepOutput]:
    """Target prefill of a prompt chunk; the seed is the first sampled token and the target's
    features at the chunk's last token (the draft runs no forward here)."""
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
    last = (chunk.q_lens - 1).clamp(min=0)
    state = make(
        FrozenKVState,
        kv=out.kv,
        seed=_seed(resources, out.first_tokens, out.hidden, out.captured, last),
        sampling=chunk.sampling,
    )
    return state, prefill_output(out.first_tokens, out.faults, out.logprobs, out.prompt_logprobs)


def seed_forward(resources: Resources, state: FrozenKVState, topk: int) -> DraftPrediction:
    """The head over the seed (bonus token, seed hidden), reading the committed target cache:
    its output hidden and top-k, the first level of candidates."""
    ones = torch.ones_like(state.kv.seq_lens)
    batch = extend_batch(state.kv, state.seed.tokens[:, None], ones)
    hidden = resources.draft(batch, resources.target_pool, state.seed.hidden[:, None, :])
    return spec_draft.predict(resources, hidden[:, 0], topk, state.sampling)


def _eagle_view(
    resources: Resources, state: FrozenKVState, config: EagleConfig
) -> tuple[Resources, EagleState]:
    """What the EAGLE drafting stages need: resources whose draft pool is the target's pool
    (the head only reads it) and a state carrying the seed forward's prediction."""
    view = replace(resources, draft_pool=resources.target_pool)
    carried = make(
        EagleState,
        kv=state.kv,
        root_tokens=state.seed.tokens,
        prediction=seed_forward(resources, state, config.topk),
        sampling=state.sampling,
    )
    return view, carried


def draft(resources: Resources, state: FrozenKVState, config: EagleConfig) -> DraftCandidates:
    """Seed forward, then ``num_steps - 1`` EAGLE-2 expansion steps (``spec.draft.draft``)."""
    return spec_draft.draft(*_eagle_view(resources, state, config), config)


def draft_sampled(
    resources: Resources, state: FrozenKVState, config: EagleConfig
) -> tuple[DraftCandidates, Float[Tensor, "batch num_candidates vocab"]]:
    """Seed forward, then ``topk`` sampled chains (``spec.draft.draft_sampled``)."""
    return spec_draft.draft_sampled(*_eagle_view(resources, state, config), config)


def draft_extend(resources: Resources, verified: Verified) -> Seed:
    """The next seed: the bonus token and the target's features at the last accepted path
    node. No forward: the head has no cache to catch up."""
    acc = verified.accepted
    last = acc.num_accepted[:, None]
    bonus = acc.emitted.gather(1, last)[:, 0]
    node = acc.path.gather(1, last)[:, 0]
    return _seed(resources, bonus, verified.final_hidden, verified.captured, node)


def decode(
    resources: Resources, state: FrozenKVState, *, config: EagleConfig
) -> tuple[FrozenKVState, StepOutput]:
    """One round: draft, build the tree, verify, accept, commit, then record the seed."""
    candidates, draft_probs = spec_draft.propose(*_eagle_view(resources, state, config), config)
    tree = build_tree(candidates, state.seed.tokens, config.num_draft_tokens)
    verified = eagle.verify(resources, state, tree, config, draft_probs)
    kv = eagle.commit(resources, state, verified.accepted)
    new_state = replace(state, kv=kv, seed=draft_extend(resources, verified))
    return new_state, verified_output(verified)


def pipeline(**options: Any) -> Pipeline:
    """The FROZEN_KV_MTP pipeline value; ``options`` are EAGLE's round shape
    (``eagle.round_config``: ``num_steps``, ``topk``, ``num_draft_tokens``, ``sample_drafts``,
    ``vocab_size``)."""
    config = eagle.round_config(**options)
    # Verify writes the tree after the committed tokens; the drafting steps address (but never
    # write) up to (num_steps - 1) * topk tail slots, which must lie inside the page table.
    return Pipeline(
        name="frozen_kv_mtp",
        prefill=functools.partial(prefill, config=config),
        decode=functools.partial(decode, config=config),
        max_tokens_per_step=config.num_steps + 1,
        kv_lookahead=max(config.num_draft_tokens, (config.num_steps - 1) * config.topk),
    )
