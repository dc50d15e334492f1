"""EAGLE-2 draft trees: frontier selection, build_tree, tree masks and child lists.

Every property is checked against a plain-Python reference over random candidate sets. Scores
are products of powers of two, so they are exact in float32 and ties are common: the tie rule
(lower candidate index first) is exercised, not just assumed.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.spec.tree import (
    build_tree,
    children,
    num_candidates,
    select_frontier,
    tree_mask,
    validate_tree_config,
)
from speculum.state.record import make
from speculum.state.tree import DraftCandidates, DraftTree

# ---------------------------------------------------------------- references


def ref_rank(scores: list[float]) -> list[int]:
    """Indices by descending score, ties toward the lower index."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def ref_depths(parents: list[int]) -> list[int]:
    depths = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def ref_ancestors(parents: list[int], i: int) -> set[int]:
    seen = {i}
    while parents[i] >= 0:
        i = parents[i]
        seen.add(i)
    return seen


def ref_build(tokens, parents, scores, root, num_draft_tokens):
    """build_tree in plain Python: (tokens, parents, depths, kept candidate indices)."""
    kept = sorted(ref_rank(scores)[: num_draft_tokens - 1])
    node_of = {c: j + 1 for j, c in enumerate(kept)}
    node_parents = [-1] + [0 if parents[c] < 0 else node_of[parents[c]] for c in kept]
    node_tokens = [root] + [tokens[c] for c in kept]
    return node_tokens, node_parents, ref_depths(node_parents), kept


def as_candidates(tokens, parents, scores) -> DraftCandidates:
    return make(
        DraftCandidates,
        tokens=torch.tensor(tokens, dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
        scores=torch.tensor(scores, dtype=torch.float32),
    )


def eagle_candidates(step_probs: torch.Tensor, step_tokens: torch.Tensor, topk: int):
    """EAGLE-2 candidates from per-step child probabilities, using select_frontier.

    ``step_probs[b, s, f, k]``/``step_tokens[b, s, f, k]``: probability and token of frontier
    node ``f``'s ``k``-th child at step ``s`` (step 0 uses ``f = 0`` only: the root).
    """
    batch, num_steps = step_probs.shape[:2]
    tokens = [step_tokens[:, 0, 0]]
    scores = [step_probs[:, 0, 0]]
    parents = [torch.full((batch, topk), -1, dtype=torch.int64)]
    offset = 0  # candidate index of the previous step's first candidate
    for s in range(1, num_steps):
        frontier = select_frontier(scores[-1], topk)  # [batch, topk] into the previous step
        parent_score = scores[-1].gather(1, frontier)
        scores.append((parent_score[:, :, None] * step_probs[:, s]).flatten(1))
        tokens.append(step_tokens[:, s].flatten(1))
        parents.append((offset + frontier)[:, :, None].expand(-1, -1, topk).flatten(1))
        offset += scores[-2].shape[1]
    return make(
        DraftCandidates,
        tokens=torch.cat(tokens, 1),
        parents=torch.cat(parents, 1),
        scores=torch.cat(scores, 1),
    )


# ---------------------------------------------------------------- strategies


@st.composite
def candidate_forests(draw, max_candidates=20):
    """Random candidate sets: any earlier parent, scores = parent score * 2**-k (ties common)."""
    batch = draw(st.integers(1, 3))
    num_cand = draw(st.integers(1, max_candidates))
    rows = []
    for _ in range(batch):
        parents, scores, tokens = [], [], []
        for i in range(num_cand):
            p = draw(st.integers(-1, i - 1))
            k = draw(st.integers(0, 3))
            parents.append(p)
            scores.append((1.0 if p < 0 else scores[p]) * 2.0**-k)
            tokens.append(draw(st.integers(0, 9)))
        rows.append((tokens, parents, scores))
    num_draft_tokens = draw(st.integers(2, num_cand + 1))
    roots = draw(st.lists(st.integers(0, 9), min_size=batch, max_size=batch))
    return rows, num_draft_tokens, roots


@st.composite
def eagle_settings(draw):
    batch = draw(st.integers(1, 3))
    num_steps = draw(st.integers(1, 4))
    topk = draw(st.integers(1, 3))
    exps = draw(
        st.lists(
            st.integers(0, 3),
            min_size=batch * num_steps * topk * topk,
            max_size=batch * num_steps * topk * topk,
        )
    )
    probs = torch.tensor([2.0**-k for k in exps]).reshape(batch, num_steps, topk, topk)
    tokens = torch.randint(0, 50, probs.shape, generator=torch.Generator().manual_seed(len(exps)))
    num_draft_tokens = draw(st.integers(2, num_candidates(num_steps, topk) + 1))
    return probs, tokens, topk, num_draft_tokens


# ---------------------------------------------------------------- select_frontier


@settings(max_examples=60)
@given(
    rows=st.lists(
        st.lists(st.integers(0, 4).map(lambda k: 2.0**-k), min_size=6, max_size=6),
        min_size=1,
        max_size=4,
    ),
    topk=st.integers(1, 6),
)
def test_select_frontier_is_stable_descending_topk(rows, topk):
    got = select_frontier(torch.tensor(rows), topk)
    assert got.dtype == torch.int64
    assert got.tolist() == [ref_rank(r)[:topk] for r in rows]


def test_select_frontier_rejects_topk_out_of_range():
    with pytest.raises(ValueError, match="topk=4"):
        select_frontier(torch.zeros(2, 3), 4)


# ---------------------------------------------------------------- build_tree


def check_tree_against_reference(tree: DraftTree, cands, roots, num_draft_tokens):
    tokens, parents, scores = (cands.tokens.tolist(), cands.parents.tolist(), cands.scores.tolist())
    n = num_draft_tokens
    assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == (len(roots), n)
    for b in range(len(roots)):
        ref_tokens, ref_parents, ref_dep, kept = ref_build(
            tokens[b], parents[b], scores[b], roots[b], num_draft_tokens
        )
        # Parent-closed: every kept candidate's parent is kept (or is the root).
        assert all(parents[b][c] < 0 or parents[b][c] in kept for c in kept)
        got_parents = tree.parents[b].tolist()
        assert got_parents[0] == -1 and all(got_parents[i] < i for i in range(1, n))
        assert tree.tokens[b].tolist() == ref_tokens
        assert got_parents == ref_parents
        assert tree.depths[b].tolist() == ref_dep
        # Kept = exactly the top-(n-1) scores with the tie rule: nothing left out outscores a
        # kept candidate, and on a tie the kept one has the lower index.
        left_out = set(range(len(scores[b]))) - set(kept)
        for c in kept:
            for o in left_out:
                assert (scores[b][c], -c) > (scores[b][o], -o)


@settings(max_examples=150)
@given(candidate_forests())
def test_build_tree_matches_reference(forest):
    rows, num_draft_tokens, roots = forest
    cands = as_candidates(*zip(*rows))
    tree = build_tree(cands, torch.tensor(roots), num_draft_tokens)
    check_tree_against_reference(tree, cands, roots, num_draft_tokens)


@settings(max_examples=100)
@given(eagle_settings())
def test_build_tree_over_eagle_candidates(setting):
    probs, tokens, topk, num_draft_tokens = setting
    cands = eagle_candidates(probs, tokens, topk)
    batch, num_steps = probs.shape[:2]
    assert cands.tokens.shape == (batch, num_candidates(num_steps, topk))
    roots = list(range(batch))
    tree = build_tree(cands, torch.tensor(roots), num_draft_tokens)
    check_tree_against_reference(tree, cands, roots, num_draft_tokens)
    assert int(tree.depths.max()) <= min(num_steps, num_draft_tokens - 1)


@pytest.mark.parametrize("num_steps", [1, 2, 5])
def test_topk1_chain_keeps_every_candidate(num_steps):
    probs = torch.rand(2, num_steps, 1, 1, generator=torch.Generator().manual_seed(num_steps))
    tokens = torch.arange(2 * num_steps).reshape(2, num_steps, 1, 1)
    cands = eagle_candidates(probs, tokens, 1)
    tree = build_tree(cands, torch.tensor([7, 8]), num_steps + 1)
    chain = list(range(-1, num_steps))
    assert tree.parents.tolist() == [chain, chain]
    assert tree.depths.tolist() == [list(range(num_steps + 1))] * 2
    assert tree.tokens[:, 1:].tolist() == tokens.flatten(1).tolist()
    assert tree.tokens[:, 0].tolist() == [7, 8]


def test_build_tree_rejects_malformed_candidates():
    good = dict(tokens=[[1, 2, 3]], parents=[[-1, 0, 1]], scores=[[0.5, 0.25, 0.125]])
    roots = torch.tensor([0])
    build_tree(as_candidates(**good), roots, 3)
    with pytest.raises(ValueError, match="num_draft_tokens=5"):
        build_tree(as_candidates(**good), roots, 5)
    with pytest.raises(ValueError, match="scored above its parent"):
        build_tree(as_candidates(**{**good, "scores": [[0.5, 0.75, 0.1]]}), roots, 3)
    with pytest.raises(ValueError, match="parent index"):
        build_tree(as_candidates(**{**good, "parents": [[-1, 1, 1]]}), roots, 3)
    with pytest.raises(ValueError, match="NaN"):
        build_tree(as_candidates(**{**good, "scores": [[0.5, float("nan"), 0.1]]}), roots, 3)


# ---------------------------------------------------------------- tree_mask and children


@st.composite
def random_trees(draw, max_nodes=12):
    batch = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_nodes))
    parents = [[-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)] for _ in range(batch)]
    return make(
        DraftTree,
        tokens=torch.zeros(batch, n, dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
        depths=torch.tensor([ref_depths(p) for p in parents], dtype=torch.int64),
    )


@settings(max_examples=150)
@given(random_trees())
def test_tree_mask_is_ancestor_or_self(tree):
    mask = tree_mask(tree)
    assert mask.dtype == torch.bool
    for b, parents in enumerate(tree.parents.tolist()):
        n = len(parents)
        want = [[j in ref_ancestors(parents, i) for j in range(n)] for i in range(n)]
        assert mask[b].tolist() == want
        # Row sums are depth + 1: the mask and the depths agree.
        assert (mask[b].sum(-1) - 1).tolist() == tree.depths[b].tolist()


@settings(max_examples=150)
@given(random_trees(), st.integers(1, 12))
def test_children_lists(tree, max_children):
    got = children(tree, max_children)
    assert got.shape == (*tree.parents.shape, max_children) and got.dtype == torch.int64
    for b, parents in enumerate(tree.parents.tolist()):
        for i in range(len(parents)):
            kids = [j for j in range(len(parents)) if parents[j] == i][:max_children]
            assert got[b, i].tolist() == kids + [-1] * (max_children - len(kids))


# ---------------------------------------------------------------- validate_tree_config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ((0, 2, 4, 10), "num_steps=0"),
        ((3, 0, 4, 10), "topk=0"),
        ((3, 11, 4, 10), "topk=11 > vocab_size=10"),
        ((3, 2, 1, 10), "num_draft_tokens=1"),
        ((2, 2, 8, 10), "propose only topk \\+ \\(num_steps - 1\\) \\* topk\\*\\*2 = 6"),
        ((3, 1, 3, 10), "topk=1 drafts a chain"),
        ((3, 1, 5, 10), "topk=1 drafts a chain"),
        ((3, 2, 4, 0), "vocab_size=0"),
        ((3.0, 2, 4, 10), "num_steps must be an int"),
        ((3, True, 4, 10), "topk must be an int"),
    ],
)
def test_validate_tree_config_names_the_problem(config, message):
    with pytest.raises(ValueError, match=message):
        validate_tree_config(*config)


@settings(max_examples=300)
@given(
    num_steps=st.integers(-1, 6),
    topk=st.integers(-1, 5),
    num_draft_tokens=st.integers(-1, 40),
    vocab_size=st.integers(0, 6),
)
def test_validate_tree_config_accepts_exactly_the_possible(
    num_steps, topk, num_draft_tokens, vocab_size
):
    possible = (
        num_steps >= 1
        and 1 <= topk <= vocab_size
        and 2 <= num_draft_tokens <= num_candidates(num_steps, topk) + 1
        and (topk > 1 or num_draft_tokens == num_steps + 1)
    )
    if possible:
        validate_tree_config(num_steps, topk, num_draft_tokens, vocab_size)
    else:
        with pytest.raises(ValueError, match="invalid draft tree configuration"):
            validate_tree_config(num_steps, topk, num_draft_tokens, vocab_size)


def test_shallow_trees_are_allowed():
    # topk > 1 with fewer nodes than steps: valid, and the tree is at most num_draft_tokens-1 deep.
    validate_tree_config(num_steps=6, topk=2, num_draft_tokens=4, vocab_size=10)
