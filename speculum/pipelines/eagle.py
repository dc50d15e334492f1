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

The draft heads differ only in how they turn target features into their input hidden state and
how they embed and predict (``speculum.models.draft``, ``speculum.models.standalone``); the
stages are shared. An EAGLE head's entry ``i`` pairs the target's hidden state of token ``i``
with token ``i + 1`` and predicts token ``i + 2``; its cache holds one entry per committed
position, at the same page slots as the target's. A standalone draft reads token ``i`` at entry
``i`` and so runs one entry ``ahead``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.pipelines.base import Pipeline, PrefillChunk, Resources, StepOutput
from speculum.spec.paged import extend_batch, tail_batch
from speculum.spec.sampling import Stream, filtered_probs, sample, sample_from_probs, uniforms
from speculum.spec.tree import build_tree, select_frontier, validate_tree_config
from speculum.spec.verify import commit_path, verify_tree
from speculum.state.kv import PagedKV
from speculum.state.record import make, record, replace, static
from speculum.state.sampling import SamplingParams
from speculum.state.tree import AcceptResult, DraftCandidates, DraftTree, Verified

__all__ = [
    "EagleConfig",
    "EagleState",
    "DraftPrediction",
    "prefill",
    "predict",
    "gather_nodes",
    "prepare_draft",
    "draft",
    "draft_sampled",
    "propose",
    "verify",
    "commit",
    "draft_extend",
    "decode",
    "round_config",
    "pipeline",
]


@record
class EagleConfig:
    """Static shape of a round: draft depth, branching, tree size and how drafts are chosen.

    ``sample_drafts`` draws draft tokens from the draft's filtered distribution instead of
    taking its top-k: ``topk`` independent chains of ``num_steps`` tokens, all verified.
    """

    num_steps: int = static()
    topk: int = static()
    num_draft_tokens: int = static()
    sample_drafts: bool = static(default=False)


@record
class DraftPrediction:
    """The draft's prediction at a request's last committed position.

    ``hidden`` is the draft's output there (the input hidden of the first draft step);
    ``top_probs`` / ``top_tokens`` are its ``topk`` most likely next tokens.
    """

    hidden: Float[Tensor, "batch hidden"]
    top_probs: Float[Tensor, "batch topk"]
    top_tokens: Int[Tensor, "batch topk"]


@record
class EagleState:
    """Batch state between rounds.

    ``kv.seq_lens`` counts the tokens whose K/V are in both caches; ``root_tokens`` is the last
    verified token (emitted, not yet in the caches), the root of the next tree.
    """

    kv: PagedKV
    root_tokens: Int[Tensor, " batch"]
    prediction: DraftPrediction
    sampling: SamplingParams


def predict(resources: Resources, hidden: Tensor, topk: int) -> DraftPrediction:
    """Top-k of the draft's next-token distribution at ``hidden`` ([batch, hidden])."""
    probs = torch.softmax(resources.draft.logits(hidden), dim=-1)
    top = probs.topk(topk, dim=-1)
    return make(DraftPrediction, hidden=hidden, top_probs=top.values, top_tokens=top.indices)


def _last_valid(x: Tensor, lengths: Int[Tensor, " batch"]) -> Tensor:
    """``x[b, lengths[b] - 1]`` for each row (rows of length 0 read index 0)."""
    rows = torch.arange(x.shape[0], device=x.device)
    return x[rows, (lengths - 1).clamp(min=0)]


def _draft_extend_core(
    resources: Resources,
    kv: PagedKV,
    tokens: Int[Tensor, "batch q"],
    q_lens: Int[Tensor, " batch"],
    target_hidden: Float[Tensor, "batch q hidden"],
    captured: tuple[Tensor, ...],
    topk: int,
) -> DraftPrediction:
    """Run the draft over positions ``seq_lens + i`` pairing target features with ``tokens``.

    A head that runs ahead of the target (standalone) reads one token more than there are
    target features; its feature input is empty, so padding it costs nothing.
    """
    hidden_in = resources.draft.target_features(target_hidden, captured)
    hidden_in = F.pad(hidden_in, (0, 0, 0, tokens.shape[1] - hidden_in.shape[1]))
    batch = extend_batch(kv, tokens, q_lens)
    hidden_out = resources.draft(batch, resources.draft_pool, hidden_in)
    return predict(resources, _last_valid(hidden_out, q_lens), topk)


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
    batch = extend_batch(chunk.kv, chunk.tokens, chunk.q_lens)
    capture = resources.draft.capture_layers
    hidden, captured = resources.target(batch, resources.target_pool, capture)
    seq_lens = chunk.kv.seq_lens + chunk.q_lens
    first = sample(
        resources.target.logits(_last_valid(hidden, chunk.q_lens)), chunk.sampling, seq_lens
    )
    following = torch.where(chunk.next_tokens >= 0, chunk.next_tokens, first)
    stream = F.pad(chunk.tokens, (0, 1)).scatter(1, chunk.q_lens[:, None], following[:, None])
    ahead = resources.draft.ahead
    prediction = _draft_extend_core(
        resources,
        chunk.kv,
        stream[:, 1 - ahead :],
        chunk.q_lens + ahead,
        hidden,
        captured,
        config.topk,
    )
    state = make(
        EagleState,
        kv=replace(chunk.kv, seq_lens=seq_lens),
        root_tokens=first,
        prediction=prediction,
        sampling=chunk.sampling,
    )
    return state, make(StepOutput, tokens=first[:, None], num_tokens=torch.ones_like(first))


def prepare_draft(state: EagleState) -> DraftCandidates:
    """The first level of draft candidates: children of the root, from the carried prediction."""
    pred = state.prediction
    return make(
        DraftCandidates,
        tokens=pred.top_tokens,
        parents=torch.full_like(pred.top_tokens, -1),
        scores=pred.top_probs,
    )


def _draft_kv(resources: Resources, state: EagleState) -> PagedKV:
    """The draft cache's view: the target's pages, ``ahead`` more committed entries."""
    return replace(state.kv, seq_lens=state.kv.seq_lens + resources.draft.ahead)


def _no_ancestors(kv: PagedKV, width: int) -> Bool[Tensor, "batch width 0"]:
    rows = kv.seq_lens.shape[0]
    return torch.zeros(rows, width, 0, dtype=torch.bool, device=kv.seq_lens.device)


def _draft_forward(
    resources: Resources,
    kv: PagedKV,
    step: int,
    tokens: Int[Tensor, "batch width"],
    hidden: Float[Tensor, "batch width hidden"],
    ancestors: Bool[Tensor, "batch width tail"],
) -> tuple[Float[Tensor, "batch width hidden"], Bool[Tensor, "batch width tail_plus"]]:
    """One draft step over a frontier of ``width`` nodes at depth ``step``.

    Node ``j`` is written at tail slot ``(step - 1) * width + j`` at rotary position
    ``seq_lens + step - 1`` and sees the committed prefix, its ancestors' tail slots and itself.
    Returns the draft's output hidden states and the frontier's mask rows (its descendants'
    ancestors).
    """
    width = tokens.shape[1]
    itself = torch.eye(width, dtype=torch.bool, device=tokens.device).expand(
        tokens.shape[0], width, width
    )
    mask = torch.cat([ancestors, itself], dim=2)
    positions = (kv.seq_lens + step - 1)[:, None].expand(-1, width)
    batch = tail_batch(kv, tokens, positions, mask, tail_start=(step - 1) * width)
    return resources.draft(batch, resources.draft_pool, hidden), mask


def draft(resources: Resources, state: EagleState, config: EagleConfig) -> DraftCandidates:
    """EAGLE-2 multi-step drafting: ``num_steps`` levels of candidates in level order.

    Step ``s`` (1-based) forwards the ``topk`` frontier nodes at depth ``s`` (rotary position
    ``seq_lens + ahead + s - 1``), writing their draft K/V after the draft's committed
    entries at tail slots ``(s - 1) * topk + j``; each sees the prefix and its own ancestors.
    Each frontier node proposes its ``topk`` likeliest children; the ``topk`` best of those by
    cumulative probability form the next frontier. Scores multiply along the path.
    """
    k = config.topk
    kv = _draft_kv(resources, state)
    level = prepare_draft(state)
    tokens, parents, scores = [level.tokens], [level.parents], [level.scores]
    frontier_ids = torch.arange(k, device=kv.seq_lens.device).expand_as(level.tokens)
    frontier_tokens, frontier_scores = level.tokens, level.scores
    frontier_hidden = state.prediction.hidden[:, None, :].expand(-1, k, -1)
    ancestors = _no_ancestors(kv, k)
    offset = k  # candidate index of the next level's first entry
    for step in range(1, config.num_steps):
        hidden, mask = _draft_forward(
            resources, kv, step, frontier_tokens, frontier_hidden, ancestors
        )
        probs = torch.softmax(resources.draft.logits(hidden), dim=-1)
        top = probs.topk(k, dim=-1)  # [batch, k (frontier), k (children)]
        child_scores = (frontier_scores[:, :, None] * top.values).flatten(1)
        child_tokens = top.indices.flatten(1)
        child_parents = frontier_ids.repeat_interleave(k, dim=1)
        tokens.append(child_tokens)
        parents.append(child_parents)
        scores.append(child_scores)
        chosen = select_frontier(child_scores, k)  # [batch, k] indices into the k*k children
        owner = chosen // k  # which frontier node each new frontier node descends from
        frontier_tokens = child_tokens.gather(1, chosen)
        frontier_scores = child_scores.gather(1, chosen)
        frontier_ids = offset + chosen
        frontier_hidden = hidden.gather(1, owner[:, :, None].expand(-1, -1, hidden.shape[-1]))
        ancestors = mask.gather(1, owner[:, :, None].expand(-1, -1, mask.shape[2]))
        offset += k * k
    return make(
        DraftCandidates,
        tokens=torch.cat(tokens, dim=1),
        parents=torch.cat(parents, dim=1),
        scores=torch.cat(scores, dim=1),
    )


def draft_sampled(
    resources: Resources, state: EagleState, config: EagleConfig
) -> tuple[DraftCandidates, Float[Tensor, "batch num_candidates vocab"]]:
    """Sampled drafting: ``topk`` independent chains of ``num_steps`` tokens from the root.

    Each token is drawn from the draft's distribution filtered with the request's own
    temperature / top-k / top-p / min-p (one-hot for greedy requests), on the DRAFT stream at
    the position it would occupy, column = chain. The siblings under the root are i.i.d. draws
    and every candidate is verified, so each token really is a draw from the distribution
    returned beside it: the condition under which recursive rejection is lossless with those
    distributions. Candidate ``(s - 1) * topk + j`` is chain ``j``'s token at depth ``s``.
    """
    k, seq_lens, pred = config.topk, state.kv.seq_lens, state.prediction
    kv = _draft_kv(resources, state)
    hidden = pred.hidden[:, None, :].expand(-1, k, -1)
    q = filtered_probs(resources.draft.logits(hidden), state.sampling)
    ancestors = _no_ancestors(kv, k)
    tokens, qs = [], []
    for step in range(1, config.num_steps + 1):
        u = uniforms(state.sampling.seed, Stream.DRAFT, seq_lens + step, k)
        drawn = sample_from_probs(q, u)
        tokens.append(drawn)
        qs.append(q)
        if step == config.num_steps:
            break
        hidden, ancestors = _draft_forward(resources, kv, step, drawn, hidden, ancestors)
        q = filtered_probs(resources.draft.logits(hidden), state.sampling)
    chain = torch.arange(k, device=seq_lens.device)
    parents = [torch.full_like(tokens[0], -1)] + [
        ((step - 1) * k + chain).expand_as(tokens[0]) for step in range(1, config.num_steps)
    ]
    drawn_q = [q.gather(2, t[:, :, None])[:, :, 0] for q, t in zip(qs, tokens)]
    scores = torch.cumprod(torch.stack(drawn_q, dim=1), dim=1).flatten(1)
    candidates = make(
        DraftCandidates,
        tokens=torch.cat(tokens, dim=1),
        parents=torch.cat(parents, dim=1),
        scores=scores,
    )
    return candidates, torch.cat(qs, dim=1)


def propose(
    resources: Resources, state: EagleState, config: EagleConfig
) -> tuple[DraftCandidates, Float[Tensor, "batch num_nodes vocab"] | None]:
    """A round's candidates and the draft distributions to verify them with: the top-k draft
    (``None``: one-hot) or, with ``sample_drafts``, sampled chains and their distributions."""
    if not config.sample_drafts:
        return draft(resources, state, config), None
    candidates, q = draft_sampled(resources, state, config)
    # Every candidate is kept, in candidate order: node i + 1 is candidate i.
    return candidates, F.pad(q, (0, 0, 1, 0))


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


def gather_nodes(
    x: Float[Tensor, "batch num_nodes hidden"], nodes: Int[Tensor, "batch n"]
) -> Float[Tensor, "batch n hidden"]:
    """``x[b, nodes[b, i]]`` for each row (entries of -1 read node 0)."""
    return x.gather(1, nodes.clamp(min=0)[:, :, None].expand(-1, -1, x.shape[-1]))


def commit(resources: Resources, state: EagleState, accepted: AcceptResult) -> PagedKV:
    """The accepted path becomes the committed sequence of the target cache (see
    ``spec.verify.commit_path``); the draft cache is caught up by ``draft_extend``."""
    return commit_path(resources.target_pool, state.kv, accepted)


def draft_extend(
    resources: Resources,
    state: EagleState,
    verified: Verified,
    config: EagleConfig,
) -> DraftPrediction:
    """The draft catches up on the accepted tokens.

    Entry ``seq_lens + ahead + d`` (``d = 0 ..`` number accepted) reads emitted token ``d``
    (the accepted draft token after path node ``d``, then the bonus token), paired for EAGLE
    heads with the target's hidden state at path node ``d``; it overwrites the speculative
    entries written there while drafting.
    """
    acc = verified.accepted
    hidden = gather_nodes(verified.final_hidden, acc.path)
    captured = tuple(gather_nodes(c, acc.path) for c in verified.captured)
    return _draft_extend_core(
        resources,
        replace(state.kv, seq_lens=state.kv.seq_lens + resources.draft.ahead),
        acc.emitted.clamp(min=0),
        acc.num_accepted + 1,
        hidden,
        captured,
        config.topk,
    )


def decode(
    resources: Resources, state: EagleState, *, config: EagleConfig
) -> tuple[EagleState, StepOutput]:
    """One speculative round: draft, build the tree, verify, accept, commit, draft-extend."""
    candidates, draft_probs = propose(resources, state, config)
    tree = build_tree(candidates, state.root_tokens, config.num_draft_tokens)
    verified = verify(resources, state, tree, config, draft_probs)
    acc = verified.accepted
    prediction = draft_extend(resources, state, verified, config)
    kv = commit(resources, state, acc)
    bonus = acc.emitted.gather(1, acc.num_accepted[:, None])[:, 0]
    new_state = replace(state, kv=kv, root_tokens=bonus, prediction=prediction)
    return new_state, make(StepOutput, tokens=acc.emitted, num_tokens=acc.num_accepted + 1)


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
    config = round_config(**options)
    num_steps, topk = config.num_steps, config.topk
    # Verify writes the tree after the committed tokens; drafting writes its tail there, one
    # entry further for heads that run ahead; draft-extend writes the accepted tokens.
    lookahead = max(config.num_draft_tokens, (num_steps - 1) * topk + 1, num_steps + 2)
    return Pipeline(
        name="eagle",
        prefill=functools.partial(prefill, config=config),
        decode=functools.partial(decode, config=config),
        max_tokens_per_step=num_steps + 1,
        kv_lookahead=lookahead,
    )
