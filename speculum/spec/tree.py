"""EAGLE-2 dynamic draft trees: frontier selection, tree building, tree masks, child lists.

One round of EAGLE-2 drafting (SGLang's ``EAGLEWorker.draft``) proposes candidates level by
level: step 0 gives the ``topk`` best children of the root; every later step takes the ``topk``
best candidates of the previous step (the *frontier*, :func:`select_frontier`) and gives each
its ``topk`` best children, so ``num_steps`` steps give ``topk + (num_steps - 1) * topk**2``
candidates. Each candidate's score is its cumulative draft probability (the product along its
path). :func:`build_tree` keeps the ``num_draft_tokens - 1`` best-scoring candidates under the
root, which is SGLang's ``organize_draft_results`` + ``build_tree_kernel_efficient``.

Every tensor function here is traceable by ``torch.compile(fullgraph=True)``: shapes decide the
Python control flow, tensor values never do. Eager-only validation (one host sync) is skipped
while compiling, as in :mod:`speculum.spec.sampling`. :func:`build_tree`'s tensor work is the
custom op ``speculum::build_tree`` (:func:`build_tree_nodes`), whose default kernel is the
reference math here and whose CUDA kernel ``speculum.kernels.triton_tree`` registers.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.spec.checks import checking, raise_for_rows
from speculum.state.record import make
from speculum.state.tree import DraftCandidates, DraftTree

__all__ = [
    "select_frontier",
    "build_tree",
    "chain_tree",
    "tree_mask",
    "tree_path_tokens",
    "children",
    "sibling_ranks",
    "validate_tree_config",
    "num_candidates",
    "build_tree_nodes",
]


def num_candidates(num_steps: int, topk: int) -> int:
    """How many candidates ``num_steps`` EAGLE-2 steps propose: ``topk + (num_steps-1)*topk**2``."""
    return topk + (num_steps - 1) * topk * topk


def _is_int(value: object) -> bool:
    # bool is an int subclass, but ``topk=True`` is a bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def validate_tree_config(num_steps: int, topk: int, num_draft_tokens: int, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the cause and the fix if the tree settings cannot work.

    ``vocab_size`` is the vocabulary the draft picks its ``topk`` tokens from (EAGLE-3's reduced
    draft vocabulary where there is one). Rejected:

    - ``num_steps < 1``, ``topk < 1``, ``num_draft_tokens < 2`` (no draft token to verify);
    - ``topk > vocab_size`` (siblings must carry distinct tokens);
    - ``num_draft_tokens - 1 > topk + (num_steps - 1) * topk**2``: more tree nodes than the
      draft proposes candidates;
    - ``topk == 1`` with ``num_draft_tokens != num_steps + 1``: a chain keeps every candidate,
      so ``num_draft_tokens`` is determined (SGLang silently overrides it with a warning; here
      it is an error, so the configuration says what runs).

    Allowed on purpose: ``topk > 1`` with ``num_draft_tokens - 1 < num_steps``. The kept tree
    then cannot reach depth ``num_steps`` (a node at depth ``d`` needs its ``d - 1`` ancestors
    kept too), so the last draft steps are wasted work, but the result is correct; SGLang
    accepts it too. Such trees are at most ``num_draft_tokens - 1`` deep: that, or
    ``num_steps`` if smaller, is the ``max_depth`` to give :func:`speculum.spec.accept.accept`.
    """
    names = dict(
        num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens, vocab_size=vocab_size
    )
    for name, value in names.items():
        if not _is_int(value):
            raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    problems = []
    if num_steps < 1:
        problems.append(
            f"num_steps={num_steps}: the draft must run at least one step; use num_steps >= 1"
        )
    if topk < 1:
        problems.append(f"topk={topk}: each node needs at least one child; use topk >= 1")
    if vocab_size < 1:
        problems.append(f"vocab_size={vocab_size}: the draft vocabulary is empty")
    elif topk > vocab_size:
        problems.append(
            f"topk={topk} > vocab_size={vocab_size}: siblings carry distinct tokens, so a node "
            f"has at most vocab_size children; use topk <= {vocab_size}"
        )
    if num_draft_tokens < 2:
        problems.append(
            f"num_draft_tokens={num_draft_tokens}: the tree is the root plus at least one draft "
            "token; use num_draft_tokens >= 2 (or the plain pipeline for no speculation)"
        )
    if not problems:
        available = num_candidates(num_steps, topk)
        if num_draft_tokens - 1 > available:
            problems.append(
                f"num_draft_tokens={num_draft_tokens} needs {num_draft_tokens - 1} draft nodes "
                f"but num_steps={num_steps}, topk={topk} propose only topk + (num_steps - 1) * "
                f"topk**2 = {available} candidates; use num_draft_tokens <= {available + 1} or "
                "raise num_steps / topk"
            )
        if topk == 1 and num_draft_tokens != num_steps + 1:
            problems.append(
                f"topk=1 drafts a chain of num_steps={num_steps} tokens, so num_draft_tokens "
                f"must be num_steps + 1 = {num_steps + 1}, got {num_draft_tokens}; set "
                f"num_draft_tokens={num_steps + 1} (or num_steps={num_draft_tokens - 1})"
            )
    if problems:
        raise ValueError("invalid draft tree configuration: " + "; ".join(problems))


def select_frontier(scores: Float[Tensor, "batch m"], topk: int) -> Int[Tensor, "batch topk"]:
    """Indices of the ``topk`` highest scores per row, in descending score order.

    Ties go to the lower index (a stable sort), so the selection is deterministic and identical
    on every backend; ``torch.topk`` promises no tie order.
    """
    if not 1 <= topk <= scores.shape[-1]:
        raise ValueError(
            f"select_frontier: topk={topk} must be in 1 .. {scores.shape[-1]} (the number of "
            "scores per row)"
        )
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :topk]


def _ancestor_mask(
    parents: Int[Tensor, "batch num_nodes"],
) -> Bool[Tensor, "batch num_nodes num_nodes"]:
    """``mask[b, i, j]``: node ``j`` is node ``i`` or one of its ancestors.

    Pointer doubling: after round ``k`` a row holds the ancestors fewer than ``2**k`` steps up,
    and ``jump`` the ``2**k``-th ancestor (the root, which is its own parent here, once the walk
    runs off the top: the root is everyone's ancestor, so that adds nothing wrong). A tree of
    ``n`` nodes is at most ``n - 1`` deep, so ``ceil(log2(n))`` rounds are enough: a static loop.
    """
    batch, n = parents.shape
    jump = parents.clamp(min=0)
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(batch, n, n)
    for _ in range(math.ceil(math.log2(n)) if n > 1 else 0):
        # mask[i] |= mask[jump[i]]: the ancestors 2**k .. 2**(k+1) - 1 steps above i.
        above = mask.gather(1, jump[:, :, None].expand(batch, n, n))
        mask = mask | above
        jump = jump.gather(1, jump)
    return mask


def tree_mask(tree: DraftTree) -> Bool[Tensor, "batch num_nodes num_nodes"]:
    """Attention mask of the tree: ``mask[b, i, j]`` iff node ``j`` is node ``i`` or its ancestor.

    Node ``i``'s query may see exactly the draft tokens on its own path, root included.
    """
    return _ancestor_mask(tree.parents)


def tree_path_tokens(
    tree: DraftTree, ancestors: Bool[Tensor, "batch num_nodes num_nodes"]
) -> Int[Tensor, "batch num_nodes num_nodes"]:
    """``path[b, i, j]``: the token of node ``j`` when ``j`` is node ``i`` or one of its
    ancestors and not the root, else -1 (``ancestors`` is :func:`tree_mask`). Row ``i`` holds
    the draft tokens a sequence ending at node ``i`` adds to the request's output: what a
    penalty at that node counts besides the output before the round
    (``spec.sampling.penalized_logits``)."""
    not_root = torch.arange(ancestors.shape[-1], device=ancestors.device) > 0
    return torch.where(ancestors & not_root, tree.tokens[:, None, :], -1)


def sibling_ranks(parents: Int[Tensor, "batch num_nodes"]) -> Int[Tensor, "batch num_nodes"]:
    """Each node's rank among its parent's children in node order (0 = first child; root: 0).

    A stable sort by parent lists each parent's children contiguously in node order; a node's
    rank is its place in that list minus where its parent's run starts. ``O(n log n)`` per row,
    where comparing every pair of nodes would take ``O(n**2)`` memory.
    """
    sorted_parents, order = torch.sort(parents, dim=-1, stable=True)
    run_start = torch.searchsorted(sorted_parents, sorted_parents)  # first index of equal parents
    place = torch.arange(parents.shape[-1], device=parents.device).expand_as(parents)
    return torch.zeros_like(parents).scatter(1, order, place - run_start)


def children(tree: DraftTree, max_children: int) -> Int[Tensor, "batch num_nodes max_children"]:
    """Each node's children in increasing node order, padded with -1.

    A node with more than ``max_children`` children keeps only its first ``max_children`` (the
    caller chooses a bound: ``topk`` for EAGLE-2 trees, ``num_nodes - 1`` always suffices).
    """
    if max_children < 1:
        raise ValueError(f"children: max_children={max_children} must be >= 1")
    return _children_of(tree.parents, max_children)


def _children_of(
    parents: Int[Tensor, "batch num_nodes"], max_children: int
) -> Int[Tensor, "batch num_nodes max_children"]:
    """:func:`children` of a bare parent table (the ``speculum::accept_tree`` op has no record)."""
    batch, n = parents.shape
    rank = sibling_ranks(parents)
    # Child j goes to slot parent * max_children + rank of a flat [n * max_children] table; the
    # root and children past max_children go to one extra slot that is cut off afterwards.
    slots = n * max_children
    fits = (parents >= 0) & (rank < max_children)
    index = torch.where(fits, parents * max_children + rank, slots)
    node = torch.arange(n, device=parents.device).expand(batch, n)
    table = torch.full((batch, slots + 1), -1, dtype=torch.int64, device=parents.device)
    table = table.scatter(1, index, torch.where(fits, node, -1))
    return table[:, :slots].reshape(batch, n, max_children)


def chain_tree(
    root_tokens: Int[Tensor, " batch"], tokens: Int[Tensor, "batch num_draft"]
) -> DraftTree:
    """The chain ``root -> tokens[:, 0] -> tokens[:, 1] -> ...`` as a draft tree (node ``i``
    at depth ``i``), through :func:`build_tree` with scores that halve along the chain."""
    steps = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    candidates = make(
        DraftCandidates,
        tokens=tokens,
        parents=steps - 1,
        scores=torch.pow(0.5, steps + 1.0).to(torch.float32),
    )
    return build_tree(candidates, root_tokens, tokens.shape[1] + 1)


def _check_candidates(
    candidates: DraftCandidates, root_tokens: Int[Tensor, " batch"], num_draft_tokens: int
) -> None:
    """Eager validation of :func:`build_tree`'s inputs (one host sync); skipped when compiling."""
    batch, num_cand = candidates.tokens.shape
    if not 2 <= num_draft_tokens <= num_cand + 1:
        raise ValueError(
            f"build_tree: num_draft_tokens={num_draft_tokens} must be in 2 .. {num_cand + 1} "
            f"(the root plus at most the {num_cand} candidates); see validate_tree_config"
        )
    if tuple(root_tokens.shape) != (batch,):
        raise ValueError(
            f"build_tree: root_tokens must be [batch] = ({batch},), got {tuple(root_tokens.shape)}"
        )
    if not checking():
        return
    index = torch.arange(num_cand, device=candidates.parents.device)
    parents, scores = candidates.parents, candidates.scores
    parent_score = scores.gather(1, parents.clamp(min=0))
    flags = [
        ((parents < -1) | (parents >= index)).any(-1),
        ~scores.isfinite().all(-1),
        ((parents >= 0) & (scores > parent_score)).any(-1),
    ]
    problems = [
        "a parent index that is not -1 or smaller than the candidate's own index",
        "a score that is NaN or infinite",
        "a candidate scored above its parent (scores must be cumulative path probabilities, "
        "or the kept set would not be closed under parents)",
    ]
    raise_for_rows("build_tree: invalid draft candidates", problems, flags)


def build_tree(
    candidates: DraftCandidates, root_tokens: Int[Tensor, " batch"], num_draft_tokens: int
) -> DraftTree:
    """The draft tree of the ``num_draft_tokens - 1`` best candidates under the verified root.

    Keeps the best ``num_draft_tokens - 1`` candidates by score, ties toward the lower candidate
    index. A parent has a lower index and a score at least its child's, so it ranks ahead of
    the child and the kept set is closed under parents: it is a tree. The kept candidates are
    put back in candidate (level) order; node 0 holds ``root_tokens``, node ``j + 1`` the
    ``j``-th kept candidate. Parents are renumbered to node indices (children of the root get
    0) and depths computed. A ``topk == 1`` chain with ``num_draft_tokens == num_steps + 1``
    keeps every candidate.

    In eager mode, malformed candidates (a parent index not below the child's, non-finite
    scores, a child outscoring its parent) raise ``ValueError`` naming the batch rows.
    """
    _check_candidates(candidates, root_tokens, num_draft_tokens)
    return _build_tree_core(candidates, root_tokens, num_draft_tokens)


def _build_tree_core(
    candidates: DraftCandidates, root_tokens: Int[Tensor, " batch"], num_draft_tokens: int
) -> DraftTree:
    tokens, parents, depths = build_tree_nodes(
        candidates.tokens, candidates.parents, candidates.scores, root_tokens, num_draft_tokens
    )
    return make(DraftTree, tokens=tokens, parents=parents, depths=depths)


@torch.library.custom_op("speculum::build_tree", mutates_args=())
def build_tree_nodes(
    candidate_tokens: Tensor,
    candidate_parents: Tensor,
    scores: Tensor,
    root_tokens: Tensor,
    num_draft_tokens: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``speculum::build_tree`` op: :func:`build_tree` on bare tensors, unvalidated.

    Takes the candidates' ``tokens``, ``parents`` (int64) and ``scores`` (float), each
    ``[batch, num_candidates]``, and ``root_tokens [batch]``; returns the tree's ``tokens``,
    ``parents`` and ``depths``, each int64 ``[batch, num_draft_tokens]``. This default kernel is
    the reference; ``speculum.kernels.triton_tree`` registers a CUDA twin.
    """
    batch, num_cand = candidate_tokens.shape
    keep = num_draft_tokens - 1
    device = candidate_tokens.device
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :keep]
    kept = torch.sort(best, dim=-1).values  # [batch, keep], level order
    kept_tokens = candidate_tokens.gather(1, kept)
    kept_parents = candidate_parents.gather(1, kept)

    # node_of[b, c]: the node index of candidate c (1 .. keep), 0 where not kept; only kept
    # parents are ever looked up, and children of the root (parent -1) map to node 0.
    node_ids = torch.arange(1, keep + 1, device=device).expand(batch, keep)
    node_of = torch.zeros(batch, num_cand, dtype=torch.int64, device=device).scatter(
        1, kept, node_ids
    )
    parent_nodes = torch.where(kept_parents < 0, 0, node_of.gather(1, kept_parents.clamp(min=0)))
    root_parent = torch.full((batch, 1), -1, dtype=torch.int64, device=device)
    parents = torch.cat([root_parent, parent_nodes], dim=1)
    tokens = torch.cat([root_tokens[:, None], kept_tokens], dim=1).to(torch.int64)
    depths = _ancestor_mask(parents).sum(-1) - 1
    return tokens, parents, depths.to(torch.int64)


@build_tree_nodes.register_fake
def _(candidate_tokens, candidate_parents, scores, root_tokens, num_draft_tokens):
    shape = (candidate_tokens.shape[0], num_draft_tokens)
    return tuple(candidate_tokens.new_empty(shape, dtype=torch.int64) for _ in range(3))
