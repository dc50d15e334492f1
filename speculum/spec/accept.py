"""One acceptance rule for greedy and sampled decoding, chains and trees: recursive rejection.

The rule (SpecInfer's multi-draft speculative sampling; Leviathan et al. 2023 and Chen et al.
2023 for chains) walks the tree from the root. At the current node, with residual target
distribution ``r`` (initially ``p = target_probs[node]``), the children are tried in node order;
child ``c`` with token ``x``, drawn from ``q_c``, is accepted with probability
``min(1, r(x) / q_c(x))``. On acceptance the walk moves to ``c`` and ``r`` becomes
``target_probs[c]``; on rejection ``r`` becomes ``normalise(max(r - q_c, 0))`` and the next
sibling is tried. When no child is accepted (or the node is a leaf) the bonus token is drawn
from ``r``.

Why it is lossless: one trial emits ``x`` with probability ``sum_x q(x) min(1, r(x)/q(x))``
restricted to ``x = y``, i.e. ``min(q(y), r(y))``, and otherwise (probability
``sum max(r - q, 0)``) continues with ``max(r - q, 0)`` normalised, which contributes
``max(r(y) - q(y), 0)``; the two add up to ``r(y)``. By induction over the siblings the token
chosen at a node is distributed exactly as ``p``, and moving to the accepted child conditions
the next token on it, as the target does. This needs only that each child's token is a draw
from its ``q_c`` given everything the walk has seen before it (earlier siblings and their
outcomes), made independently of the acceptance coins.

Two special cases, both derived from the rule rather than coded separately:

- ``draft_probs=None`` means every ``q_c`` is the one-hot of the node's own token (drafts
  chosen deterministically: argmax, top-k). The test becomes "accept ``x`` with probability
  ``r(x)``" and the residual is ``r`` with ``x`` removed, renormalised: SGLang's target-only
  rule (``tree_speculative_sampling_target_only`` with both thresholds 1). Because a one-hot
  ``q`` is the exact distribution of a token *given the tree*, this is lossless for any tree
  however it was produced (sampled, pruned by score, with duplicate siblings), as long as the
  tree does not depend on the acceptance coins.
- Greedy requests have one-hot ``target_probs``: the argmax ``a`` has ``r(a) = 1``, so a child
  carrying ``a`` is accepted with probability ``min(1, 1/q(a)) = 1`` and any other child with
  ``min(1, 0) = 0``; rejecting another child leaves ``max(r - q, 0)``, still all mass on ``a``;
  the bonus is ``a``. That is exactly the walk along the target's argmax (first sibling
  carrying it), i.e. greedy plain decoding.

SGLang draws one coin per depth and compares it to the cumulative target mass of the siblings
tried so far; here every child rank gets its own coin. Both are exact; per-child coins also stay
exact when siblings repeat a token (trees sampled i.i.d.).

Randomness: the coin of the child of rank ``k`` (0-based among its siblings) at depth ``d`` is
``uniforms(seed, Stream.ACCEPT, root_positions + d, ...)[k]`` (``root_positions + d`` is that
child's token position), and the bonus token at position ``root_positions + num_accepted + 1``
uses ``uniforms(seed, Stream.RESAMPLE, that position, 1)``. A walk stopping at depth ``a``
consumes ACCEPT counters up to ``root_positions + a + 1`` and the next round's root sits at
``root_positions + a + 1``, so its coins start at fresh counters: rounds never share a draw.

The walk itself is the custom op ``speculum::accept_tree`` (:func:`accept_tree`), so a device
can run it as one kernel instead of hundreds of small ones. Its inputs are plain tensors and the
uniforms are drawn before it, so the counter-based generator lives in one place: every coin, and
the bonus uniform for every walk length ``0 .. max_depth`` (the walk picks the one its length
needs). The default kernel is the reference walk below; ``speculum.kernels.triton_tree``
registers a CUDA twin.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from speculum.spec.checks import checking, raise_for_rows
from speculum.spec.sampling import Stream, sample_from_probs, uniforms
from speculum.spec.tree import _children_of, sibling_ranks
from speculum.state.record import make, replace
from speculum.state.tree import AcceptResult, DraftTree

__all__ = ["accept", "accept_tree"]


def _try_child(
    residual: Float[Tensor, "batch vocab"],
    token: Int[Tensor, " batch"],
    q: Float[Tensor, "batch vocab"] | None,
    u: Float[Tensor, " batch"],
) -> tuple[Tensor, Tensor]:
    """One sibling trial: (accepted [batch], residual after a rejection [batch, vocab]).

    ``residual`` is kept unnormalised (mass ``z``) so no division can produce NaN:
    ``u < (r(x)/z) / q(x)`` is tested as ``u * q(x) * z < r(x)``, and the rejection residual
    ``max(r/z - q, 0)`` is kept scaled by ``z`` as ``max(r - z q, 0)``.
    """
    mass = residual.sum(-1)
    r_x = residual.gather(1, token[:, None])[:, 0]
    vocab = torch.arange(residual.shape[-1], device=residual.device)
    if q is None:
        # One-hot q: accept with probability r(x); on rejection remove x (exactly, no rounding).
        accepted = u * mass < r_x
        rejected = torch.where(vocab[None, :] == token[:, None], 0.0, residual)
    else:
        q_x = q.gather(1, token[:, None])[:, 0]
        accepted = u * q_x * mass < r_x
        rejected = (residual - mass[:, None] * q).clamp(min=0.0)
        # Rejection has probability sum(max(r - q, 0)); where that is 0 mathematically, float
        # rounding can still reject (e.g. q == r with a sum of 1 + 1 ulp). Keep r then, rather
        # than an all-zero row whose draw would be token 0, possibly outside the support.
        rejected = torch.where(rejected.sum(-1, keepdim=True) > 0, rejected, residual)
    return accepted, rejected


def _rows(values: Tensor, index: Int[Tensor, " batch"]) -> Tensor:
    """``values[b, index[b]]`` for a ``[batch, num_nodes, ...]`` tensor."""
    shape = (values.shape[0], 1, *values.shape[2:])
    return values.gather(1, index.reshape(-1, *([1] * (values.ndim - 1))).expand(shape))[:, 0]


def _check_accept(
    tree: DraftTree,
    target_probs: Tensor,
    seed: Tensor,
    root_positions: Tensor,
    max_depth: int,
    draft_probs: Tensor | None,
    max_children: int,
) -> None:
    """Eager validation of :func:`accept`'s inputs (one host sync); skipped when compiling."""
    batch, n = tree.tokens.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape[:2] != (batch, n):
        raise ValueError(
            f"accept: target_probs must be [batch, num_nodes, vocab] = [{batch}, {n}, vocab], "
            f"got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != tuple(target_probs.shape):
        raise ValueError(
            f"accept: draft_probs must have target_probs' shape {tuple(target_probs.shape)}, got "
            f"{tuple(draft_probs.shape)}; both are over the target vocabulary (map a reduced "
            "draft vocabulary back first)"
        )
    for name, value in (("seed", seed), ("root_positions", root_positions)):
        if tuple(value.shape) != (batch,) or value.dtype != torch.int64:
            raise ValueError(
                f"accept: {name} must be an int64 [batch] = ({batch},) tensor, got "
                f"{value.dtype} {tuple(value.shape)}"
            )
    if max_depth < 0 or max_children < 1:
        raise ValueError(
            f"accept: max_depth={max_depth} must be >= 0 and max_children={max_children} >= 1"
        )
    if not checking():
        return
    node = torch.arange(n, device=tree.parents.device)
    parent_depth = tree.depths.gather(1, tree.parents.clamp(min=0))
    # The last rank + 1 of any child is the most children a node has.
    most_children = (
        (sibling_ranks(tree.parents)[:, 1:] + 1).amax(-1)
        if n > 1
        else torch.zeros(batch, dtype=torch.int64, device=tree.parents.device)
    )
    flags = [
        (tree.parents[:, 0] != -1) | (tree.depths[:, 0] != 0),
        ((tree.parents[:, 1:] < 0) | (tree.parents[:, 1:] >= node[1:])).any(-1),
        (tree.depths[:, 1:] != parent_depth[:, 1:] + 1).any(-1),
        ((tree.tokens < 0) | (tree.tokens >= vocab)).any(-1),
        tree.depths.amax(-1) > max_depth,
        most_children > max_children,
        ~((target_probs >= 0) & target_probs.isfinite()).flatten(1).all(-1)
        | ~(target_probs.sum(-1) > 0).all(-1),
    ]
    problems = [
        "the root (node 0) must have parent -1 and depth 0",
        "a node whose parent is not an earlier node",
        "depths that are not parent depth + 1",
        f"a token outside the vocabulary 0 .. {vocab - 1}",
        f"a tree deeper than max_depth={max_depth} (pass the tree's depth bound)",
        f"a node with more than max_children={max_children} children",
        "target_probs with a negative or non-finite entry or a row of zero mass",
    ]
    if draft_probs is not None:
        q_token = draft_probs.gather(2, tree.tokens[:, :, None])[:, 1:, 0]
        flags.append(
            ~((draft_probs >= 0) & draft_probs.isfinite()).flatten(1).all(-1)
            | ~(q_token > 0).all(-1)
        )
        problems.append(
            "draft_probs with a negative or non-finite entry, or a draft token that has "
            "probability 0 under its own draft_probs row (it cannot have been drawn from it: "
            "hand over exactly the filtered distribution each token was sampled from)"
        )
    raise_for_rows("accept: invalid inputs", problems, flags)


def accept(
    tree: DraftTree,
    target_probs: Float[Tensor, "batch num_nodes vocab"],
    seed: Int[Tensor, " batch"],
    root_positions: Int[Tensor, " batch"],
    max_depth: int,
    draft_probs: Float[Tensor, "batch num_nodes vocab"] | None = None,
    *,
    max_children: int | None = None,
    verify_lens: Int[Tensor, " batch"] | None = None,
) -> AcceptResult:
    """Walk each request's tree by recursive rejection sampling; emit accepted tokens + a bonus.

    ``target_probs[b, i]`` is the target's filtered distribution (``filtered_probs``; one-hot
    for greedy requests) of the token after node ``i``. ``draft_probs[b, i]`` is the
    distribution node ``i``'s token was drawn from, given everything drafted before it (row 0,
    the root, is ignored); ``None`` means drafts were chosen deterministically (one-hot at each
    node's token), and is also the right choice for any tree whose nodes were selected after
    sampling (e.g. sampled EAGLE-2 candidates pruned by score), since a selected token is no
    longer a draw from its ``q``. ``root_positions[b]`` is the position of the root token.

    ``max_depth`` is a static bound on the tree depth and fixes the output width
    ``max_depth + 1``; ``max_children`` bounds the children per node (``topk`` for EAGLE-2
    trees; the default ``num_nodes - 1`` always suffices). Neither changes which uniforms a
    given walk uses, only how many are drawn, so any sufficient bounds give identical results.

    Returns ``AcceptResult``: ``path`` (root first), ``emitted`` (accepted tokens then the bonus
    token) and ``num_accepted``, padded with -1 to width ``max_depth + 1``, and ``chain`` when
    ``max_children`` is 1 (a static fact commit uses to skip moving recurrent states). Eager
    calls validate the tree and distributions (one host sync) and raise ``ValueError`` naming
    the batch rows; under ``torch.compile`` the check is skipped. See the module docstring for
    the rule, its randomness and why it is lossless.

    ``verify_lens[b]`` (ragged verify), when given, verifies only row ``b``'s nodes of depth
    ``<= verify_lens[b]``: deeper nodes are dropped from the tree before the walk, so a walk
    that reaches the limit draws its bonus from the target's distribution there. Losslessness
    needs the limit to be chosen without looking at the tokens it cuts off (a node's fate may
    depend only on what was known before its token was drawn): otherwise the tokens that are
    verified are no longer draws from their ``q``.
    """
    num_nodes = tree.tokens.shape[1]
    max_children = max(num_nodes - 1, 1) if max_children is None else max_children
    _check_accept(tree, target_probs, seed, root_positions, max_depth, draft_probs, max_children)
    if verify_lens is not None:
        if tuple(verify_lens.shape) != (tree.tokens.shape[0],) or verify_lens.dtype != torch.int64:
            raise ValueError(
                f"accept: verify_lens must be an int64 [batch] = ({tree.tokens.shape[0]},) "
                f"tensor, got {verify_lens.dtype} {tuple(verify_lens.shape)}"
            )
        # A parent of -1 makes a node nobody's child: the walk (and its CUDA twin) never
        # reaches it.
        kept = tree.depths <= verify_lens[:, None]
        tree = replace(tree, parents=torch.where(kept, tree.parents, -1))
    return _accept_core(
        tree, target_probs, seed, root_positions, max_depth, draft_probs, max_children
    )


def _accept_core(
    tree: DraftTree,
    target_probs: Float[Tensor, "batch num_nodes vocab"],
    seed: Int[Tensor, " batch"],
    root_positions: Int[Tensor, " batch"],
    max_depth: int,
    draft_probs: Float[Tensor, "batch num_nodes vocab"] | None,
    max_children: int,
) -> AcceptResult:
    device = tree.tokens.device
    depth_positions = root_positions[:, None] + torch.arange(1, max_depth + 1, device=device)
    coins = uniforms(seed, Stream.ACCEPT, depth_positions, max_children)  # [b, depth, rank]
    # A walk of a accepted tokens puts its bonus at root + a + 1: one uniform per possible a.
    bonus_positions = root_positions[:, None] + torch.arange(1, max_depth + 2, device=device)
    bonus_coins = uniforms(seed, Stream.RESAMPLE, bonus_positions, 1)[..., 0]  # [b, depth + 1]
    path, emitted, num_accepted = accept_tree(
        tree.tokens,
        tree.parents,
        target_probs.float(),
        None if draft_probs is None else draft_probs.float(),
        coins,
        bonus_coins,
    )
    # At most one child per node makes the tree a chain in level order: node d at depth d.
    return make(
        AcceptResult,
        path=path,
        emitted=emitted,
        num_accepted=num_accepted,
        chain=max_children == 1,
    )


@torch.library.custom_op("speculum::accept_tree", mutates_args=())
def accept_tree(
    tokens: Tensor,
    parents: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None,
    coins: Tensor,
    bonus_coins: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``speculum::accept_tree`` op: the acceptance walk on bare tensors, unvalidated.

    ``tokens`` and ``parents`` are the tree's int64 ``[batch, num_nodes]`` tables;
    ``target_probs`` and ``draft_probs`` (or ``None``: one-hot drafts) float32
    ``[batch, num_nodes, vocab]``. ``coins[b, d, k]`` (float32 ``[batch, max_depth,
    max_children]``) is the ACCEPT uniform of the rank-``k`` child at depth ``d + 1``, and
    ``bonus_coins[b, a]`` (``[batch, max_depth + 1]``) the RESAMPLE uniform of the bonus token
    after ``a`` accepted nodes; their shapes fix ``max_depth`` and ``max_children``. Returns
    ``(path, emitted, num_accepted)`` as in :class:`AcceptResult`. This default kernel is the
    reference walk; ``speculum.kernels.triton_tree`` registers a CUDA twin.
    """
    batch = tokens.shape[0]
    max_depth, max_children = coins.shape[1], coins.shape[2]
    device = tokens.device
    kids = _children_of(parents, max_children)  # [batch, num_nodes, max_children]

    current = torch.zeros(batch, dtype=torch.int64, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    residual = target_probs[:, 0]
    path = [current]
    # Static loops: depth up to max_depth, child rank up to max_children. Rows that stopped keep
    # computing on dead values that every update masks out.
    for depth in range(max_depth):
        node_kids = _rows(kids, current)  # [batch, max_children]
        moved = torch.zeros_like(walking)
        nxt = current
        for rank in range(max_children):
            child = node_kids[:, rank]
            trying = walking & ~moved & (child >= 0)
            safe = child.clamp(min=0)
            token = tokens.gather(1, safe[:, None])[:, 0]
            q = None if draft_probs is None else _rows(draft_probs, safe)
            accepted, rejected = _try_child(residual, token, q, coins[:, depth, rank])
            accepted = accepted & trying
            residual = torch.where((trying & ~accepted)[:, None], rejected, residual)
            nxt = torch.where(accepted, child, nxt)
            moved = moved | accepted
        walking = moved
        current = nxt
        residual = torch.where(moved[:, None], _rows(target_probs, current), residual)
        path.append(torch.where(moved, current, -1))

    path = torch.stack(path, dim=1)  # [batch, max_depth + 1]
    num_accepted = (path[:, 1:] >= 0).sum(-1)
    u = bonus_coins.gather(1, num_accepted[:, None])[:, 0]
    bonus = sample_from_probs(residual, u)

    # emitted[j] = token of path[j + 1] for j < num_accepted, the bonus at j == num_accepted.
    column = torch.arange(max_depth + 1, device=device)
    next_nodes = torch.cat([path[:, 1:], torch.full_like(path[:, :1], -1)], dim=1)
    path_tokens = tokens.gather(1, next_nodes.clamp(min=0))
    emitted = torch.where(column < num_accepted[:, None], path_tokens, -1)
    emitted = torch.where(column == num_accepted[:, None], bonus[:, None], emitted)
    return path, emitted, num_accepted


@accept_tree.register_fake
def _(tokens, parents, target_probs, draft_probs, coins, bonus_coins):
    batch, width = bonus_coins.shape
    path = tokens.new_empty((batch, width), dtype=torch.int64)
    emitted = tokens.new_empty((batch, width), dtype=torch.int64)
    return path, emitted, tokens.new_empty((batch,), dtype=torch.int64)
