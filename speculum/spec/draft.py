"""Reference draft stages of the EAGLE family and STANDALONE: prepare_draft, draft (EAGLE-2
top-k trees or sampled chains) and draft_extend.

They run any draft head with the duck-typed interface of ``speculum.models.draft`` (and
``speculum.models.standalone``): ``capture_layers``, ``ahead``, ``target_features``,
``forward(batch, pool, hidden)`` and ``logits``. ``resources`` is anything with ``draft`` and
``draft_pool`` (``pipelines.Resources``); this module does not import the models.

An EAGLE head's cache entry ``i`` pairs the target's hidden state of token ``i`` with token
``i + 1`` and predicts token ``i + 2``; a standalone draft reads token ``i`` at entry ``i`` and
so runs one entry ``ahead`` of the target's committed tokens.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.spec.paged import extend_batch, tail_batch
from speculum.spec.prefill import last_valid
from speculum.spec.sampling import (
    Stream,
    biased_logits,
    draft_logits_guarded,
    drafting,
    filtered_probs,
    grammar_logits,
    penalized_logits,
    reads_path,
    sample_from_probs,
    uniforms,
)
from speculum.spec.tree import select_frontier
from speculum.state.draft import DraftPrediction, EagleConfig, EagleState
from speculum.state.kv import KVPool, PagedKV
from speculum.state.record import make, replace
from speculum.state.sampling import SamplingParams
from speculum.state.tree import DraftCandidates, Verified

__all__ = [
    "DraftResources",
    "likeliest",
    "predict",
    "extend_draft",
    "prepare_draft",
    "draft_kv",
    "no_ancestors",
    "draft_forward",
    "draft",
    "draft_sampled",
    "propose",
    "gather_nodes",
    "draft_extend",
]


class DraftResources(Protocol):
    """What the draft stages need: a draft head and its KV pool (``pipelines.Resources``)."""

    draft: Any
    draft_pool: KVPool | None


def top_children(
    draft: Any,
    hidden: Float[Tensor, "batch *rows hidden"],
    topk: int,
    sampling: SamplingParams | None = None,
    path_tokens: Int[Tensor, "batch *rows length"] | None = None,
) -> tuple[Float[Tensor, "batch *rows topk"], Int[Tensor, "batch *rows topk"]]:
    """The ``topk`` likeliest next tokens of ``draft`` at ``hidden``: probabilities and target
    token ids, likeliest first.

    A head with a reduced vocabulary (EAGLE-3's ``d2t``: ``draft_logits`` over its own ids and
    ``target_ids`` mapping them) is ranked over that vocabulary, whose softmax equals the full
    one's (every other target token has probability 0) at a fraction of the cost: a Llama-3
    EAGLE-3 head ranks 32000 ids instead of 128256. With ``sampling``, the requests' logit bias
    and penalties (these counting each row's ``path_tokens`` too, the draft tokens on its tree
    path) shape the ranking as they shape the target's distributions, and the grammar masks
    it after the same path, so the draft proposes what the target will accept (acceptance is
    exact either way); with free drafts (``spec.sampling.drafting``) the grammar is left to
    the target.
    """
    reduced = getattr(draft, "draft_logits", None)
    columns = None if reduced is None else draft.target_ids
    logits = draft.logits(hidden) if reduced is None else reduced(hidden)
    if sampling is not None:
        bias = sampling.logit_bias
        if columns is not None and bias is not None and bias.shape[-1] > 0:
            bias = bias[:, columns]
        logits = biased_logits(logits, bias)
        logits = penalized_logits(logits, sampling.penalties, path_tokens, columns)
        # Masked before the top-k, so that every proposal is a token the grammar allows.
        logits = grammar_logits(logits, drafting(sampling).grammar, path_tokens, columns)
    probs, ids = likeliest(torch.softmax(draft_logits_guarded(logits), dim=-1), topk)
    return probs, ids if columns is None else columns[ids]


def likeliest(
    probs: Float[Tensor, "*rows vocab"], k: int
) -> tuple[Float[Tensor, "*rows k"], Int[Tensor, "*rows k"]]:
    """The ``k`` largest entries of each row of ``probs`` and their ids, largest first.

    A chain drafts one child per node (``k`` 1), and there a max reduction replaces
    ``torch.topk``: on CUDA, topk's selection over a 32000-id row takes several passes (37 µs a
    call in a chain-3 EAGLE-3 round's H200 profile, three calls a round: a sixth of the round's
    work outside the models), a max one. The max also breaks ties to the lowest id on every
    device, where topk's order among equal entries is left unspecified."""
    if k == 1:
        values, ids = probs.max(dim=-1, keepdim=True)
        return values, ids
    top = probs.topk(k, dim=-1)
    return top.values, top.indices


def predict(
    resources: DraftResources,
    hidden: Tensor,
    topk: int,
    sampling: SamplingParams | None = None,
    path_tokens: Int[Tensor, "batch length"] | None = None,
) -> DraftPrediction:
    """Top-k of the draft's next-token distribution at ``hidden`` ([batch, hidden]), shaped
    by ``sampling``'s controls over the output so far plus ``path_tokens`` (tokens emitted but
    not yet counted in it) when given (:func:`top_children`)."""
    probs, tokens = top_children(resources.draft, hidden, topk, sampling, path_tokens)
    return make(DraftPrediction, hidden=hidden, top_probs=probs, top_tokens=tokens)


def extend_draft(
    resources: DraftResources,
    kv: PagedKV,
    tokens: Int[Tensor, "batch q"],
    q_lens: Int[Tensor, " batch"],
    target_hidden: Float[Tensor, "batch q hidden"],
    captured: tuple[Tensor, ...],
    topk: int,
    sampling: SamplingParams | None = None,
    path_tokens: Int[Tensor, "batch length"] | None = None,
) -> DraftPrediction:
    """Run the draft over positions ``seq_lens + i`` pairing target features with ``tokens``;
    its prediction after the last is shaped by ``sampling`` and ``path_tokens``
    (:func:`predict`).

    A head that runs ahead of the target (standalone) reads one token more than there are
    target features; its feature input is empty, so padding it costs nothing.
    """
    hidden_in = resources.draft.target_features(target_hidden, captured)
    hidden_in = F.pad(hidden_in, (0, 0, 0, tokens.shape[1] - hidden_in.shape[1]))
    batch = extend_batch(kv, tokens, q_lens)
    hidden_out = resources.draft(batch, resources.draft_pool, hidden_in)
    return predict(resources, last_valid(hidden_out, q_lens), topk, sampling, path_tokens)


def prepare_draft(state: EagleState) -> DraftCandidates:
    """The first level of draft candidates: children of the root, from the carried prediction."""
    pred = state.prediction
    return make(
        DraftCandidates,
        tokens=pred.top_tokens,
        parents=torch.full_like(pred.top_tokens, -1),
        scores=pred.top_probs,
    )


def draft_kv(resources: DraftResources, state: EagleState) -> PagedKV:
    """The draft cache's view: the target's pages, ``ahead`` more committed entries."""
    return replace(state.kv, seq_lens=state.kv.seq_lens + resources.draft.ahead)


def no_ancestors(kv: PagedKV, width: int) -> Bool[Tensor, "batch width 0"]:
    rows = kv.seq_lens.shape[0]
    return torch.zeros(rows, width, 0, dtype=torch.bool, device=kv.seq_lens.device)


def draft_forward(
    resources: DraftResources,
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


def draft(resources: DraftResources, state: EagleState, config: EagleConfig) -> DraftCandidates:
    """EAGLE-2 multi-step drafting: ``num_steps`` levels of candidates in level order.

    Step ``s`` (1-based) forwards the ``topk`` frontier nodes at depth ``s`` (rotary position
    ``seq_lens + ahead + s - 1``), writing their draft K/V after the draft's committed
    entries at tail slots ``(s - 1) * topk + j``; each sees the prefix and its own ancestors.
    Each frontier node proposes its ``topk`` likeliest children; the ``topk`` best of those by
    cumulative probability form the next frontier. Scores multiply along the path. The
    requests' bias, penalties and grammar rank the children (:func:`top_children`), the
    penalties counting, the grammar masking after, the draft tokens on each frontier node's
    path.
    """
    k, sampling = config.topk, drafting(state.sampling)
    kv = draft_kv(resources, state)
    level = prepare_draft(state)
    tokens, parents, scores = [level.tokens], [level.parents], [level.scores]
    frontier_ids = torch.arange(k, device=kv.seq_lens.device).expand_as(level.tokens)
    frontier_tokens, frontier_scores = level.tokens, level.scores
    frontier_hidden = state.prediction.hidden[:, None, :].expand(-1, k, -1)
    ancestors = no_ancestors(kv, k)
    # The draft tokens on each frontier node's path, itself included (penalties count them,
    # a grammar masks its children after them).
    paths = level.tokens[:, :, None] if reads_path(sampling) else None
    offset = k  # candidate index of the next level's first entry
    for step in range(1, config.num_steps):
        hidden, mask = draft_forward(
            resources, kv, step, frontier_tokens, frontier_hidden, ancestors
        )
        # [batch, k (frontier), k (children)]
        top_probs, top_tokens = top_children(resources.draft, hidden, k, sampling, paths)
        child_scores = (frontier_scores[:, :, None] * top_probs).flatten(1)
        child_tokens = top_tokens.flatten(1)
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
        if paths is not None:
            paths = paths.gather(1, owner[:, :, None].expand(-1, -1, paths.shape[2]))
            paths = torch.cat([paths, frontier_tokens[:, :, None]], dim=2)
        offset += k * k
    return make(
        DraftCandidates,
        tokens=torch.cat(tokens, dim=1),
        parents=torch.cat(parents, dim=1),
        scores=torch.cat(scores, dim=1),
    )


def _sampled_probs(
    resources: DraftResources,
    hidden: Float[Tensor, "batch width hidden"],
    sampling: SamplingParams,
    path_tokens: Int[Tensor, "batch width length"] | None = None,
) -> Float[Tensor, "batch width vocab"]:
    """The draft's filtered distribution at ``hidden``, each request's own settings applied,
    its penalties counting, and its grammar masking after, each chain's ``path_tokens`` (drawn
    so far this round) too."""
    logits = draft_logits_guarded(
        resources.draft.logits(hidden),
        sampling.temperature,
        sampling.logit_bias,
        sampling.penalties,
        path_tokens,
        sampling.grammar,
    )
    return filtered_probs(logits, sampling)


def draft_sampled(
    resources: DraftResources, state: EagleState, config: EagleConfig
) -> tuple[DraftCandidates, Float[Tensor, "batch num_candidates vocab"]]:
    """Sampled drafting: ``topk`` independent chains of ``num_steps`` tokens from the root.

    Each token is drawn from the draft's distribution filtered with the request's own
    temperature / top-k / top-p / min-p (one-hot for greedy requests), on the DRAFT stream at
    the position it would occupy, column = chain. The siblings under the root are i.i.d. draws
    and every candidate is verified, so each token really is a draw from the distribution
    returned beside it: the condition under which recursive rejection is lossless with those
    distributions. Candidate ``(s - 1) * topk + j`` is chain ``j``'s token at depth ``s``.
    Penalties count each chain's own earlier tokens, as the target's at its nodes do, and a
    grammar masks each draw after them, so every drawn token is one the grammar allows (with
    free drafts, ``spec.sampling.drafting``, the draws and their distributions are unmasked).
    """
    k, seq_lens, pred = config.topk, state.kv.seq_lens, state.prediction
    sampling = drafting(state.sampling)
    kv = draft_kv(resources, state)
    hidden = pred.hidden[:, None, :].expand(-1, k, -1)
    q = _sampled_probs(resources, hidden, sampling)
    ancestors = no_ancestors(kv, k)
    tokens, qs = [], []
    for step in range(1, config.num_steps + 1):
        u = uniforms(sampling.seed, Stream.DRAFT, seq_lens + step, k)
        drawn = sample_from_probs(q, u)
        tokens.append(drawn)
        qs.append(q)
        if step == config.num_steps:
            break
        hidden, ancestors = draft_forward(resources, kv, step, drawn, hidden, ancestors)
        path = torch.stack(tokens, dim=2) if reads_path(sampling) else None
        q = _sampled_probs(resources, hidden, sampling, path)
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
    resources: DraftResources, state: EagleState, config: EagleConfig
) -> tuple[DraftCandidates, Float[Tensor, "batch num_nodes vocab"] | None]:
    """A round's candidates and the draft distributions to verify them with: the top-k draft
    (``None``: one-hot) or, with ``sample_drafts``, sampled chains and their distributions."""
    if not config.sample_drafts:
        return draft(resources, state, config), None
    candidates, q = draft_sampled(resources, state, config)
    # Every candidate is kept, in candidate order: node i + 1 is candidate i.
    return candidates, F.pad(q, (0, 0, 1, 0))


def gather_nodes(
    x: Float[Tensor, "batch num_nodes hidden"], nodes: Int[Tensor, "batch n"]
) -> Float[Tensor, "batch n hidden"]:
    """``x[b, nodes[b, i]]`` for each row (entries of -1 read node 0)."""
    return x.gather(1, nodes.clamp(min=0)[:, :, None].expand(-1, -1, x.shape[-1]))


def draft_extend(
    resources: DraftResources,
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
    # The round's tokens are counted in the penalties only after it, and the grammar's output
    # is the round's start: its prediction (for the token after the bonus) reads them itself.
    emitted = torch.arange(acc.emitted.shape[1], device=acc.emitted.device)
    emitted = torch.where(emitted <= acc.num_accepted[:, None], acc.emitted, -1)
    sampling = drafting(state.sampling)  # free drafts: no mask, so no path to read
    return extend_draft(
        resources,
        replace(state.kv, seq_lens=state.kv.seq_lens + resources.draft.ahead),
        acc.emitted.clamp(min=0),
        acc.num_accepted + 1,
        hidden,
        captured,
        config.topk,
        sampling,
        emitted if reads_path(sampling) else None,
    )
