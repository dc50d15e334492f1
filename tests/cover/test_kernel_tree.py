"""Parity of the Triton tree kernels with their spec twins, run under Triton's interpreter.

Without a GPU, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before this module imports the
kernels, so every launcher runs on CPU tensors (with a GPU, on CUDA copies). Hypothesis draws
the structure (tree shapes, bounds, block sizes, modes) and a seed; the tensors come from a
generator with that seed. The vocabularies are tiny and the vocabulary block (``block_v``)
smaller still, so every pass over the residual runs several blocks with a masked tail.
``tests/gpu/test_kernel_tree_gpu.py`` runs the same parity at real sizes on a device.

Acceptance is compared exactly. One-hot (greedy) targets must match bit for bit by construction;
sampled ones could in principle differ where the reference's comparison sits within a rounding
error of its threshold (the kernels sum the vocabulary in another order), which random
float32 data over a handful of entries does not hit.
"""

from __future__ import annotations

import kernel_cases as kc
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.kernels.triton_tree import (
    accept_tree_triton,
    build_tree_triton,
    commit_kv_triton,
    register,
)
from speculum.spec.accept import accept_tree
from speculum.spec.tree import build_tree_nodes
from speculum.spec.verify import commit_kv

seeds = kc.seeds
#: Where the launchers run: the interpreter takes CPU tensors, compiled kernels CUDA ones.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*tensors):
    return kc.to_device(tensors, DEVICE)


# ---------------------------------------------------------------- inputs


@st.composite
def candidate_sets(draw, max_candidates: int = 12, vocab: int = 6):
    """``(tokens, parents, scores, root_tokens, num_draft_tokens)`` for ``build_tree``."""
    gen = torch.Generator().manual_seed(draw(seeds))
    batch = draw(st.integers(1, 3))
    if draw(st.booleans()):
        num_cand = draw(st.integers(1, max_candidates))
        tokens, parents, scores = kc.forest_candidates(gen, batch, num_cand, vocab)
    else:
        topk, num_steps = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        tokens, parents, scores = kc.eagle_candidates(gen, batch, topk, num_steps, vocab)
    num_draft_tokens = draw(st.integers(2, tokens.shape[1] + 1))
    roots = torch.randint(0, vocab, (batch,), generator=gen)
    return tokens, parents, scores, roots, num_draft_tokens


@st.composite
def trees(draw, vocab: int, max_nodes: int = 8):
    """``(tokens, parents)`` of random trees, chains, or EAGLE-2 trees built by the spec.

    Half the time the tokens come from the first two ids only, so siblings repeat tokens.
    """
    gen = torch.Generator().manual_seed(draw(seeds))
    batch = draw(st.integers(1, 3))
    shape = draw(st.sampled_from(["random", "chain", "eagle"]))
    vocab = min(vocab, draw(st.sampled_from([2, vocab])))
    if shape == "eagle":
        tokens, parents, scores, roots, n = draw(candidate_sets(vocab=vocab))
        tokens, parents, _ = build_tree_nodes(tokens, parents, scores, roots, n)
        return tokens, parents
    n = draw(st.integers(1, max_nodes))
    if shape == "chain":
        parents = torch.arange(-1, n - 1).expand(batch, n).clone()
    else:
        parents = torch.stack(
            [torch.full((batch,), -1)]
            + [torch.randint(0, i, (batch,), generator=gen) for i in range(1, n)],
            dim=1,
        )
    return torch.randint(0, vocab, (batch, n), generator=gen), parents


def distributions(gen, tokens, parents, vocab: int, greedy: bool, with_draft: bool):
    """Target (and draft) rows for a tree, often favouring the tokens of a node's children.

    Greedy targets are one-hot; sampled ones have zeros (as filtered distributions do). Draft
    rows give every node's own token positive probability, as a draw from them requires.
    """
    batch, n = tokens.shape
    # A random child's token per node (a random token at leaves), so walks get past the root.
    is_child = parents[:, None, :] == torch.arange(n)[None, :, None]  # [b, node, child]
    pick = torch.where(is_child, torch.rand(batch, n, n, generator=gen), -1.0).argmax(-1)
    favourite = torch.where(
        is_child.any(-1), tokens.gather(1, pick), torch.randint(0, vocab, (batch, n), generator=gen)
    )
    if greedy:
        argmax = torch.where(
            torch.rand(batch, n, generator=gen) < 0.7,
            favourite,
            torch.randint(0, vocab, (batch, n), generator=gen),
        )
        target = F.one_hot(argmax, vocab).float()
    else:
        logits = 2 * torch.randn(batch, n, vocab, generator=gen)
        logits = logits.scatter_add(2, favourite[..., None], torch.full((batch, n, 1), 2.0))
        dropped = torch.rand(batch, n, vocab, generator=gen) < 0.3
        dropped &= logits < logits.amax(-1, keepdim=True)  # every row keeps its best entry
        target = torch.softmax(logits.masked_fill(dropped, float("-inf")), -1)
    if not with_draft:
        return target, None
    logits = torch.randn(batch, n, vocab, generator=gen)
    own = F.one_hot(tokens, vocab).bool()
    dropped = (torch.rand(batch, n, vocab, generator=gen) < 0.3) & ~own
    return target, torch.softmax(logits.masked_fill(dropped, float("-inf")), -1)


def coins_for(batch: int, seed: int, max_depth: int, max_children: int):
    """The ACCEPT coins and per-length RESAMPLE uniforms of ``batch`` requests from ``seed``."""
    seeds_ = torch.arange(batch, dtype=torch.int64) * 7919 + seed
    positions = torch.arange(batch, dtype=torch.int64) * 5 + 3
    return kc.accept_coins(seeds_, positions, max_depth, max_children)


# ---------------------------------------------------------------- accept


@settings(max_examples=250)
@given(
    st.integers(1, 12).flatmap(lambda v: st.tuples(st.just(v), trees(v))),
    st.booleans(),
    st.booleans(),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(0, 2),
    st.integers(0, 2),
    st.booleans(),
    seeds,
)
def test_accept_matches_spec(
    vocab_tree, greedy, with_draft, block_v, extra_depth, extra_kids, high_coins, seed
):
    vocab, (tokens, parents) = vocab_tree
    gen = torch.Generator().manual_seed(seed)
    target, draft = distributions(gen, tokens, parents, vocab, greedy, with_draft)
    # Bounds larger than the tree needs must not change the walk.
    max_depth = int(kc.depths_of(parents).max()) + extra_depth
    max_children = max(kc.most_children(parents), 1) + extra_kids
    coins, bonus = coins_for(tokens.shape[0], seed, max_depth, max_children)
    if high_coins:
        # Coins near 1 reject most children, so residuals go through several rejections.
        coins = 1 - (1 - coins) / 16

    want = accept_tree(tokens, parents, target, draft, coins, bonus)
    inputs = on_device(tokens, parents, target, draft, coins, bonus)
    got = accept_tree_triton(*inputs, block_v=block_v)
    for name, g, w in zip(("path", "emitted", "num_accepted"), got, want):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w), (name, g, w)


@pytest.mark.parametrize("block_v", [1, 2])
def test_accept_keeps_the_residual_when_a_rejection_rounds_to_zero(block_v):
    """q just above r everywhere: the coin near 1 rejects and max(r - q, 0) is all zeros.

    Mathematically that rejection has probability 0; the reference then keeps r rather than
    draw from an empty row (which would return token 0). Two entries sum alike in any order,
    so kernel and reference see the same rounding.
    """
    tokens, parents = torch.tensor([[1, 0]]), torch.tensor([[-1, 0]])
    target = torch.full((1, 2, 2), 0.5)
    draft = torch.tensor([[[0.5, 0.5], [0.5 + 2.0**-24, 0.5]]])
    coins = torch.full((1, 1, 1), 1 - 2.0**-24)
    bonus = torch.tensor([[0.9, 0.9]])
    want = accept_tree(tokens, parents, target, draft, coins, bonus)
    inputs = on_device(tokens, parents, target, draft, coins, bonus)
    got = accept_tree_triton(*inputs, block_v=block_v)
    assert [t.tolist() for t in want] == [[[0, -1]], [[1, -1]], [0]]
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


@pytest.mark.parametrize("block_v", [1, 4])
def test_repeated_sibling_tokens_leave_the_residual_once(block_v):
    """Siblings 1 and 2 both carry token 0: the second finds it already removed (found on a GPU
    run, where the bonus draw once subtracted token 0's mass twice)."""
    tokens, parents = torch.tensor([[0, 0, 0]]), torch.tensor([[-1, 0, 0]])
    target = torch.tensor([[[0.5, 0.25, 0.0, 0.25]]]).expand(1, 3, 4).contiguous()
    coins = torch.tensor([[[0.75, 0.5]]])
    bonus = torch.tensor([[0.25, 0.5]])  # threshold 0.125: token 1
    want = accept_tree(tokens, parents, target, None, coins, bonus)
    got = accept_tree_triton(
        *on_device(tokens, parents, target, None, coins, bonus), block_v=block_v
    )
    assert want[1].tolist() == [[1, -1]]
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


@pytest.mark.parametrize("with_draft", [False, True])
def test_bonus_past_every_cumulative_sum_is_the_last_positive_token(with_draft):
    """u * mass rounds up to the whole mass: the draw clamps to the last positive token.

    A lone subnormal entry m has every u > 1/2 round u * m to m, in any summation order;
    a row of zeros (which acceptance never sees) gives token 0 as sample_from_probs does.
    """
    tokens, parents = torch.tensor([[0], [0]]), torch.tensor([[-1], [-1]])
    target = torch.zeros(2, 1, 6)
    target[0, 0, 3] = 2.0**-149
    coins = torch.zeros(2, 0, 1)
    bonus = torch.full((2, 1), 0.75)
    draft = torch.full((2, 1, 6), 1 / 6) if with_draft else None
    want = accept_tree(tokens, parents, target, draft, coins, bonus)
    got = accept_tree_triton(*on_device(tokens, parents, target, draft, coins, bonus), block_v=2)
    assert want[1].tolist() == [[3], [0]]
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


# ---------------------------------------------------------------- build_tree


@settings(max_examples=150)
@given(candidate_sets(), st.sampled_from([1, 2, 4, 16]))
def test_build_tree_matches_spec(candidates, block_j):
    tokens, parents, scores, roots, num_draft_tokens = candidates
    want = build_tree_nodes(*candidates)
    got = build_tree_triton(
        *on_device(tokens, parents, scores, roots), num_draft_tokens, block_j=block_j
    )
    for name, g, w in zip(("tokens", "parents", "depths"), got, want):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w), (name, g, w)


# ---------------------------------------------------------------- commit


@settings(max_examples=150)
@given(kc.commits(kc.CommitSizes()), st.sampled_from([1, 2, 4]))
def test_commit_matches_spec(commit, block):
    k, v, page_table, seq_lens, path = commit
    page_size = k.shape[2]
    # The order argument of commit_kv_triton: along a path, cache indices strictly increase and
    # the entry at depth d moves down (or stays), never up.
    for row in path.tolist():
        nodes = [p for p in row if p >= 0]
        assert all(a < b for a, b in zip(nodes, nodes[1:]))
        assert all(d <= p for d, p in enumerate(nodes))
    source, destination = kc.commit_slots(page_table, page_size, seq_lens, path)

    got_k, got_v = k.clone().to(DEVICE), v.clone().to(DEVICE)
    source_dev, destination_dev = on_device(source, destination)
    commit_kv(k, v, source, destination)
    commit_kv_triton(got_k, got_v, source_dev, destination_dev, block=block)
    assert torch.equal(got_k.cpu(), k) and torch.equal(got_v.cpu(), v)


@settings(max_examples=30)
@given(kc.commits(kc.CommitSizes()), st.sampled_from([1, 4]))
def test_commit_of_a_latent_pool_matches_spec(commit, block):
    """A latent attention pool (one K head per token, no V values) commits as the spec does."""
    k, _, page_table, seq_lens, path = commit
    k = k[:, :, :, :1].contiguous()
    v = k.new_empty(*k.shape[:4], 0)
    source, destination = kc.commit_slots(page_table, k.shape[2], seq_lens, path)
    got_k, got_v = k.clone().to(DEVICE), v.clone().to(DEVICE)
    commit_kv(k, v, source, destination)
    commit_kv_triton(got_k, got_v, *on_device(source, destination), block=block)
    assert torch.equal(got_k.cpu(), k) and got_v.shape == v.shape


# ---------------------------------------------------------------- registration


def test_register_leaves_cpu_on_the_reference():
    """register() installs CUDA kernels only; CPU calls keep the spec (twice is harmless)."""
    register()
    register()
    gen = torch.Generator().manual_seed(0)
    tokens, parents, scores = kc.eagle_candidates(gen, 2, 2, 3, 5)
    roots = torch.tensor([1, 2])
    tree = build_tree_nodes(tokens, parents, scores, roots, 5)
    assert torch.equal(tree[2], kc.depths_of(tree[1]))
    target = torch.softmax(torch.randn(2, 5, 5, generator=gen), -1)
    coins, bonus = coins_for(2, 0, 3, 2)
    got = accept_tree(tree[0], tree[1], target, None, coins, bonus)
    assert all(t.device.type == "cpu" for t in got)
