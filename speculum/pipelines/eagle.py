"""The EAGLE family (EAGLE, EAGLE-2 trees, EAGLE-3, MTP/NEXTN) and STANDALONE, one composition.

One round, SGLang's sequence as pure stages over records:

1. ``prepare_draft``: the first level of candidates, the top-k of the draft's last prediction
   (carried from the previous round's draft-extend).
2. ``draft``: ``num_steps - 1`` draft forwards, each expanding the ``topk`` best frontier
   nodes by their ``topk`` most likely children (EAGLE-2); or ``draft_sampled``: ``topk``
   independent chains drawn from the draft's filtered distribution.
3. ``build_tree``: keep the ``num_draft_tokens - 1`` best candidates by cumulative draft
   probability, under the root (the last verified token).
4. ``verify``: one target forward over the tree under the tree mask.
5. ``accept``: recursive rejection sampling (greedy is its one-hot special case).
6. ``commit``: the accepted path's K/V moves to consecutive cache slots; the bonus token becomes
   the next root. Rejected slots are dropped with the record that pointed at them.
7. ``draft_extend``: the draft runs over the accepted tokens, paired with the target's hidden
   states, so its cache and its next prediction are ready for the next round.

``plain_round`` is the family's round without draft tokens (``num_steps = 0``): a few plain
steps of the target, one token each, then draft-extend over them all as in step 7. Adaptive
speculation (``pipelines.adaptive``) switches between it and chains of several depths on one
state.

The draft heads differ only in how they turn target features into their input hidden state and
how they embed and predict (``speculum.models.draft``, ``speculum.models.standalone``). The
stages are shared: the draft stages live in ``speculum.spec.draft``; tree building, acceptance,
verify and commit in ``speculum.spec``; this module composes them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from speculum.pipelines import plain
from speculum.pipelines.base import (
    Pipeline,
    PrefillChunk,
    Resources,
    StepOutput,
    prefill_output,
    verified_output,
)
from speculum.spec.draft import draft_extend, extend_draft, propose
from speculum.spec.prefill import prefill_target
from speculum.spec.tree import build_tree, validate_tree_config
from speculum.spec.verify import commit_path, verify_tree
from speculum.state.draft import DraftPrediction, EagleConfig, EagleState
from speculum.state.kv import PagedKV
from speculum.state.record import make, replace
from speculum.state.tree import AcceptResult, DraftTree, Verified

__all__ = [
    "EagleConfig",
    "EagleState",
    "DraftPrediction",
    "prefill",
    "verify",
    "commit",
    "decode",
    "finish_round",
    "plain_round",
    "round_config",
    "pipeline",
    "plain_pipeline",
]


def prefill(
    resources: Resources, chunk: PrefillChunk, *, config: EagleConfig
) -> tuple[EagleState, StepOutput]:
    """Target prefill of a prompt chunk, then the draft over the same positions.

    An EAGLE head's entry ``i`` pairs the target's hidden state of prompt token ``i`` with
    token ``i + 1``: the chunk's own next token, the prompt token after the chunk, or, for the
    chunk that ends the prompt, the first generated token. A head that runs ``ahead`` reads the
    chunk's tokens and that following token itself (the following token is read again at the
    start of the next chunk, to the same cache entry).
    """
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
    first = out.first_tokens
    following = torch.where(chunk.next_tokens >= 0, chunk.next_tokens, first)
    stream = F.pad(chunk.tokens, (0, 1)).scatter(1, chunk.q_lens[:, None], following[:, None])
    ahead = resources.draft.ahead
    prediction = extend_draft(
        resources,
        chunk.kv,
        stream[:, 1 - ahead :],
        chunk.q_lens + ahead,
        out.hidden,
        out.captured,
        config.topk,
        chunk.sampling,
        first[:, None],  # the prefill's token, not yet counted in the penalties
    )
    state = make(
        EagleState, kv=out.kv, root_tokens=first, prediction=prediction, sampling=chunk.sampling
    )
    return state, prefill_output(first, out.faults, out.logprobs, out.prompt_logprobs)


def verify(
    resources: Resources,
    state: EagleState,
    tree: DraftTree,
    config: EagleConfig,
    draft_probs: Float[Tensor, "batch num_nodes vocab"] | None = None,
) -> Verified:
    """One target forward over the tree (capturing what the draft head consumes), then
    acceptance. ``draft_probs`` is ``None`` for top-k drafts (the verifier's draft
    distribution is then the one-hot of each token) and the sampling distributions for
    sampled drafts."""
    return verify_tree(
        resources.target,
        resources.target_pool,
        state.kv,
        tree,
        state.sampling,
        max_depth=config.num_steps,
        max_children=config.topk,
        capture_layers=resources.draft.capture_layers,
        draft_probs=draft_probs,
    )


def commit(resources: Resources, state: EagleState, accepted: AcceptResult) -> PagedKV:
    """The accepted path becomes the committed sequence of the target cache (see
    ``spec.verify.commit_path``); the draft cache is caught up by ``draft_extend``."""
    return commit_path(resources.target_pool, state.kv, accepted)


def decode(
    resources: Resources, state: EagleState, *, config: EagleConfig
) -> tuple[EagleState, StepOutput]:
    """One speculative round: draft, build the tree, verify, accept, commit, draft-extend."""
    candidates, draft_probs = propose(resources, state, config)
    tree = build_tree(candidates, state.root_tokens, config.num_draft_tokens)
    verified = verify(resources, state, tree, config, draft_probs)
    return finish_round(resources, state, verified, config)


def finish_round(
    resources: Resources, state: EagleState, verified: Verified, config: EagleConfig
) -> tuple[EagleState, StepOutput]:
    """The end of every round: draft-extend over the accepted tokens, commit them, and emit
    them with the bonus token, which becomes the next root."""
    kv = commit(resources, state, verified.accepted)
    return _caught_up(resources, state, verified, config, kv)


def _caught_up(
    resources: Resources,
    state: EagleState,
    verified: Verified,
    config: EagleConfig,
    kv: PagedKV,
) -> tuple[EagleState, StepOutput]:
    """Draft-extend over the accepted tokens, the committed cache ``kv``, and the emission."""
    acc = verified.accepted
    prediction = draft_extend(resources, state, verified, config)
    bonus = acc.emitted.gather(1, acc.num_accepted[:, None])[:, 0]
    new_state = replace(state, kv=kv, root_tokens=bonus, prediction=prediction)
    return new_state, verified_output(verified)


def plain_round(
    resources: Resources, state: EagleState, *, config: EagleConfig, num_tokens: int = 1
) -> tuple[EagleState, StepOutput]:
    """``num_tokens`` plain decoding steps over an EAGLE state (a round with ``num_steps = 0``).

    Each step, the target decodes one token alone and samples the next exactly as plain
    decoding does (same stream, same counter, so the same token). Then one draft-extend runs
    over the tokens emitted, so the draft's cache and carried prediction are caught up and a
    later round may draft again: adaptive speculation switches between this round and
    speculative ones on one state. Catching up once per ``num_tokens`` steps, in one draft
    forward over all of them, is what makes the round cost about plain decoding's steps: a
    draft-extend per step costs ~10% of an 8B target's step at batch 1 (on the H200).
    """
    steps = plain.run_steps(
        resources,
        state.kv,
        state.root_tokens,
        state.sampling,
        num_tokens,
        resources.draft.capture_layers,
    )
    ones = torch.ones_like(state.kv.seq_lens)
    # The steps' tokens as an accepted chain: node d is the token fed at step d, whose hidden
    # state the draft pairs with the token sampled after it.
    path = torch.arange(num_tokens, device=ones.device).expand(ones.shape[0], num_tokens)
    accepted = make(
        AcceptResult,
        path=path,
        emitted=steps.tokens,
        num_accepted=ones * (num_tokens - 1),
        chain=True,
    )
    verified = make(
        Verified,
        accepted=accepted,
        final_hidden=torch.cat(steps.hidden, dim=1),
        captured=tuple(torch.cat(layer, dim=1) for layer in zip(*steps.captured)),
        faults=steps.faults,  # step d's distribution decided token d
        logprobs=steps.logprobs,
    )
    # Each step wrote its K/V at its own committed position: nothing to move.
    kv = replace(state.kv, seq_lens=state.kv.seq_lens + num_tokens)
    new_state, output = _caught_up(resources, state, verified, config, kv)
    return new_state, replace(output, plain_steps=True)


def round_config(
    *,
    num_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    sample_drafts: bool = False,
    vocab_size: int,
) -> EagleConfig:
    """The validated shape of a round, for pipelines that draft with these stages.

    ``num_draft_tokens`` counts tree nodes including the root; it defaults to
    ``num_steps + 1`` for chains (``topk == 1``) and to ``topk * num_steps + 1`` for sampled
    drafts (every chain verified), and must be given for top-k trees.
    """
    full = topk * num_steps + 1
    if num_draft_tokens is None:
        if topk != 1 and not sample_drafts:
            raise ValueError("num_draft_tokens is required when topk > 1 (a tree's size)")
        num_draft_tokens = full
    if sample_drafts and num_draft_tokens != full:
        raise ValueError(
            f"sampled drafts verify all topk * num_steps = {full - 1} draft tokens: "
            f"num_draft_tokens must be {full} (root included), not {num_draft_tokens}; pruning "
            "sampled candidates by score would bias the output"
        )
    validate_tree_config(num_steps, topk, num_draft_tokens, vocab_size)
    return EagleConfig(
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
        sample_drafts=sample_drafts,
    )


def pipeline(**options: Any) -> Pipeline:
    """The pipeline value for a draft head of any kind (EAGLE, EAGLE-3, MTP, STANDALONE);
    ``options`` are :func:`round_config`'s."""
    return _pipeline(round_config(**options), decode)


def plain_pipeline(*, topk: int = 1, num_tokens: int = 1) -> Pipeline:
    """The ``num_steps = 0`` member of the family: :func:`plain_round` of ``num_tokens`` plain
    steps over an EAGLE state whose carried prediction keeps ``topk`` candidates (adaptive
    speculation's variant without speculation)."""
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"a plain round decodes num_tokens >= 1 tokens, got {num_tokens!r}")
    config = EagleConfig(num_steps=0, topk=topk, num_draft_tokens=1)
    pipeline = _pipeline(config, functools.partial(plain_round, num_tokens=num_tokens))
    # The steps write num_tokens entries; a draft that runs ahead writes one more.
    return replace(pipeline, max_tokens_per_step=num_tokens, kv_lookahead=num_tokens + 1)


def _pipeline(
    config: EagleConfig,
    decode_round: Callable[..., tuple[EagleState, StepOutput]],
) -> Pipeline:
    num_steps, topk = config.num_steps, config.topk
    # Verify writes the tree after the committed tokens; drafting writes its tail there, one
    # entry further for heads that run ahead; draft-extend writes the accepted tokens.
    lookahead = max(config.num_draft_tokens, (num_steps - 1) * topk + 1, num_steps + 2)
    return Pipeline(
        name="eagle",
        prefill=functools.partial(prefill, config=config),
        decode=functools.partial(decode_round, config=config),
        max_tokens_per_step=num_steps + 1,
        kv_lookahead=lookahead,
    )
