"""Acceptance: greedy walks against plain Python, exact mocks, and statistical losslessness.

The statistical tests decode whole rounds (the bonus token is the next round's root) of a toy
"target language model", a fixed random Markov chain over a few tokens, with three kinds of
toy draft: deterministic EAGLE-2 top-k trees from a different Markov chain, sampled chains, and
trees whose siblings are sampled i.i.d. Every batch row is one sequence with its own seed; the
joint distribution of the first three emitted tokens must equal the chain's. Thresholds are set
for a false-alarm probability of about 1e-9 (a 6-sigma chi-square quantile; a McDiarmid bound
for total variation), and the draws are fixed by their seeds, so a failure is a behaviour
change, never bad luck. Deliberately wrong rules must fail the same check, which shows the
check has the power to see the bugs it is there for.

``tests/nocover/test_accept_stats.py`` reuses this harness with many more samples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stats import chi2_stat, chi2_threshold, tv_bound

import speculum.spec.accept as accept_module
from speculum.spec.accept import accept
from speculum.spec.sampling import Stream, filtered_probs, sample_from_probs, uniforms
from speculum.spec.tree import build_tree, children, select_frontier, tree_mask
from speculum.state.record import make
from speculum.state.sampling import SamplingParams
from speculum.state.tree import DraftCandidates, DraftTree

# ---------------------------------------------------------------- plain-Python references


def ref_children(parents: list[int], i: int) -> list[int]:
    return [j for j in range(len(parents)) if parents[j] == i]


def ref_greedy_walk(parents, tokens, argmax, max_depth):
    """Greedy acceptance in plain Python: follow the first child carrying the target's argmax."""
    path, emitted, cur = [0], [], 0
    while len(path) <= max_depth:
        match = [c for c in ref_children(parents, cur) if tokens[c] == argmax[cur]]
        if not match:
            break
        cur = match[0]
        path.append(cur)
        emitted.append(tokens[cur])
    emitted.append(argmax[cur])
    pad = [-1] * (max_depth + 1)
    return (path + pad)[: max_depth + 1], (emitted + pad)[: max_depth + 1], len(path) - 1


def as_tree(tokens, parents) -> DraftTree:
    depths = []
    for row in parents:
        d = []
        for p in row:
            d.append(0 if p < 0 else d[p] + 1)
        depths.append(d)
    return make(
        DraftTree,
        tokens=torch.tensor(tokens, dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
        depths=torch.tensor(depths, dtype=torch.int64),
    )


@st.composite
def random_trees(draw, vocab=6, max_nodes=10):
    """Random trees (siblings may repeat a token) with depth bound and a random ``max_depth``."""
    batch = draw(st.integers(1, 4))
    n = draw(st.integers(1, max_nodes))
    parents = [[-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)] for _ in range(batch)]
    tokens = [[draw(st.integers(0, vocab - 1)) for _ in range(n)] for _ in range(batch)]
    tree = as_tree(tokens, parents)
    max_depth = int(tree.depths.max()) + draw(st.integers(0, 2))
    return tree, max_depth


def seeds_and_positions(batch: int, salt: int = 0):
    index = torch.arange(batch, dtype=torch.int64)
    return index * 2654435761 + salt, index * 7 + 3


# ---------------------------------------------------------------- greedy and exact mocks


@settings(max_examples=120)
@given(random_trees(), st.data())
def test_greedy_equals_argmax_walk(tree_and_depth, data):
    tree, max_depth = tree_and_depth
    batch, n = tree.tokens.shape
    vocab = 6
    argmax = data.draw(
        st.lists(
            st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n),
            min_size=batch,
            max_size=batch,
        )
    )
    target = torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float()
    seed, positions = seeds_and_positions(batch, data.draw(st.integers(0, 2**40)))
    # Sampled drafts under a greedy target must give the same walk: draft_probs with q(x) > 0.
    q = torch.rand(batch, n, vocab, generator=torch.Generator().manual_seed(n)) + 0.01
    q = q / q.sum(-1, keepdim=True)
    for draft_probs in (None, q):
        result = accept(tree, target, seed, positions, max_depth, draft_probs)
        for b in range(batch):
            path, emitted, num = ref_greedy_walk(
                tree.parents[b].tolist(), tree.tokens[b].tolist(), argmax[b], max_depth
            )
            assert result.path[b].tolist() == path
            assert result.emitted[b].tolist() == emitted
            assert int(result.num_accepted[b]) == num
        emitted = result.emitted
        assert ((emitted >= 0).sum(-1) == result.num_accepted + 1).all()
        column = torch.arange(max_depth + 1)
        assert (emitted[column[None] > result.num_accepted[:, None]] == -1).all()
        assert (result.path[column[None] > result.num_accepted[:, None]] == -1).all()


def test_greedy_from_filtered_probs_of_logits():
    """temperature == 0 one-hots from filtered_probs walk exactly the logits' argmax."""
    gen = torch.Generator().manual_seed(1)
    batch, n, vocab = 64, 7, 11
    parents = [[-1, 0, 0, 1, 1, 2, 3]] * batch
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
    logits = torch.randn(batch, n, vocab, generator=gen)
    tree = as_tree(tokens.tolist(), parents)
    params = SamplingParams(
        temperature=torch.zeros(batch),
        top_k=torch.zeros(batch, dtype=torch.int64),
        top_p=torch.ones(batch),
        min_p=torch.zeros(batch),
        seed=torch.arange(batch, dtype=torch.int64),
    )
    # Make the argmax agree with a random child 60% of the time, so walks of every length occur.
    for i, kids in enumerate([[1, 2], [3, 4], [5], [6], [], [], []]):
        if kids:
            pick = torch.tensor(kids)[torch.randint(0, len(kids), (batch,), generator=gen)]
            agree = torch.rand(batch, generator=gen) < 0.6
            want = tokens.gather(1, pick[:, None])[:, 0]
            logits[:, i] = torch.where(
                agree[:, None],
                logits[:, i].scatter(1, want[:, None], 10.0),
                logits[:, i],
            )
    target = filtered_probs(logits, params)
    result = accept(tree, target, params.seed, torch.full((batch,), 5), 3)
    argmax = logits.argmax(-1).tolist()
    for b in range(batch):
        path, emitted, _ = ref_greedy_walk(parents[b], tokens[b].tolist(), argmax[b], 3)
        assert result.path[b].tolist() == path
        assert result.emitted[b].tolist() == emitted
    assert len(set(result.num_accepted.tolist())) >= 3


def first_child_chain_depth(parents: list[int]) -> int:
    depth, cur = 0, 0
    while kids := ref_children(parents, cur):
        cur, depth = kids[0], depth + 1
    return depth


@settings(max_examples=60)
@given(random_trees(vocab=5), st.booleans())
def test_mock_target_agreeing_with_first_child_accepts_the_chain(tree_and_depth, sampled):
    tree, max_depth = tree_and_depth
    batch, n = tree.tokens.shape
    vocab = 5
    kids = children(tree, max(n - 1, 1))[..., 0]
    first_token = tree.tokens.gather(1, kids.clamp(min=0))
    argmax = torch.where(kids >= 0, first_token, 0)
    target = torch.nn.functional.one_hot(argmax, vocab).float()
    draft = torch.full((batch, n, vocab), 1.0 / vocab) if sampled else None
    seed, positions = seeds_and_positions(batch)
    result = accept(tree, target, seed, positions, max_depth, draft)
    for b in range(batch):
        want = first_child_chain_depth(tree.parents[b].tolist())
        assert int(result.num_accepted[b]) == want
        assert int(result.emitted[b, want]) == int(argmax[b, result.path[b, want]])


@settings(max_examples=60)
@given(random_trees(vocab=5), st.booleans())
def test_mock_target_that_never_agrees_emits_only_the_bonus(tree_and_depth, sampled):
    tree, max_depth = tree_and_depth
    batch, n = tree.tokens.shape
    vocab = 6  # tree tokens are 0..4, the target always wants 5
    target = torch.zeros(batch, n, vocab)
    target[..., 5] = 1.0
    draft = torch.full((batch, n, vocab), 1.0 / vocab) if sampled else None
    seed, positions = seeds_and_positions(batch)
    result = accept(tree, target, seed, positions, max_depth, draft)
    assert result.num_accepted.tolist() == [0] * batch
    assert result.emitted.tolist() == [[5] + [-1] * max_depth] * batch
    assert result.path.tolist() == [[0] + [-1] * max_depth] * batch


@settings(max_examples=40)
@given(random_trees(vocab=4), st.integers(0, 2**62))
def test_sampled_results_are_paths_rows_are_independent_bounds_do_not_matter(tree_and_depth, salt):
    """Sampled acceptance follows tree edges and emits in-support tokens; a row's result depends
    only on its own inputs; larger bounds only add padding."""
    tree, max_depth = tree_and_depth
    batch, n = tree.tokens.shape
    gen = torch.Generator().manual_seed(salt % 1000)
    target = torch.rand(batch, n, 4, generator=gen) ** 3 * (
        torch.rand(batch, n, 4, generator=gen) < 0.7
    )
    target[..., 0] += 0.01  # every row keeps some mass
    seed, positions = seeds_and_positions(batch, salt)
    full = accept(tree, target, seed, positions, max_depth)
    for b in range(batch):
        num = int(full.num_accepted[b])
        path, emitted = full.path[b].tolist(), full.emitted[b].tolist()
        for j in range(num):
            assert int(tree.parents[b, path[j + 1]]) == path[j]
            assert emitted[j] == int(tree.tokens[b, path[j + 1]])
        assert target[b, path[num], emitted[num]] > 0
    wide = accept(tree, target, seed, positions, max_depth + 2, max_children=n + 3)
    tight = int(children(tree, max(n, 1)).ge(0).sum(-1).max())
    narrow = accept(tree, target, seed, positions, max_depth, max_children=max(tight, 1))
    assert torch.equal(wide.path[:, : max_depth + 1], full.path)
    assert torch.equal(wide.emitted[:, : max_depth + 1], full.emitted)
    assert (wide.emitted[:, max_depth + 1 :] == -1).all()
    assert torch.equal(narrow.emitted, full.emitted)
    for b in range(batch):
        row = make(
            DraftTree,
            tokens=tree.tokens[b : b + 1],
            parents=tree.parents[b : b + 1],
            depths=tree.depths[b : b + 1],
        )
        alone = accept(row, target[b : b + 1], seed[b : b + 1], positions[b : b + 1], max_depth)
        assert torch.equal(alone.emitted[0], full.emitted[b])


def test_accept_rejects_bad_inputs():
    tree = as_tree([[0, 1, 2]], [[-1, 0, 1]])
    target = torch.full((1, 3, 4), 0.25)
    seed, pos = torch.tensor([1]), torch.tensor([0])
    with pytest.raises(ValueError, match="deeper than max_depth=1"):
        accept(tree, target, seed, pos, 1)
    with pytest.raises(ValueError, match="more than max_children=1"):
        accept(as_tree([[0, 1, 2]], [[-1, 0, 0]]), target, seed, pos, 1, max_children=1)
    with pytest.raises(ValueError, match="probability 0 under its own draft_probs"):
        q = torch.zeros(1, 3, 4)
        q[..., 3] = 1.0
        accept(tree, target, seed, pos, 2, q)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        accept(as_tree([[0, 1, 9]], [[-1, 0, 1]]), target, seed, pos, 2)
    with pytest.raises(ValueError, match="zero mass"):
        accept(tree, torch.zeros(1, 3, 4), seed, pos, 2)
    with pytest.raises(ValueError, match="int64"):
        accept(tree, target, seed.int(), pos, 2)


# ---------------------------------------------------------------- toy models for statistics

VOCAB = 5
GEN = torch.Generator().manual_seed(2024)
TARGET_LOGITS = torch.randn(VOCAB, VOCAB, generator=GEN) * 1.5
# The draft is a different chain, correlated with the target but often wrong.
DRAFT_LOGITS = 0.5 * TARGET_LOGITS + torch.randn(VOCAB, VOCAB, generator=GEN)


def chain_params(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> SamplingParams:
    return SamplingParams(
        temperature=torch.full((rows,), float(temperature)),
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        top_p=torch.full((rows,), float(top_p)),
        min_p=torch.full((rows,), float(min_p)),
        seed=torch.zeros(rows, dtype=torch.int64),
    )


def markov(logits: torch.Tensor, **setting) -> torch.Tensor:
    """``[V, V]``: row ``a`` is the filtered distribution of the token after token ``a``."""
    return filtered_probs(logits, chain_params(logits.shape[0], **setting))


def topk_tree_round(draft: torch.Tensor, topk: int, num_steps: int, num_draft_tokens: int):
    """EAGLE-2: deterministic top-k expansion of the draft chain, pruned by cumulative score."""

    def propose(root, position, seed):
        batch = root.shape[0]
        probs = draft[root]  # [batch, V]
        tok = select_frontier(probs, topk)
        scores, tokens = [probs.gather(1, tok)], [tok]
        parents = [torch.full((batch, topk), -1, dtype=torch.int64)]
        offset = 0
        for _ in range(1, num_steps):
            frontier = select_frontier(scores[-1], topk)
            parent_tok = tokens[-1].gather(1, frontier)
            child_probs = draft[parent_tok]  # [batch, topk, V]
            child_tok = select_frontier(child_probs.flatten(0, 1), topk).reshape(batch, topk, topk)
            parent_score = scores[-1].gather(1, frontier)[:, :, None]
            scores.append((parent_score * child_probs.gather(2, child_tok)).flatten(1))
            tokens.append(child_tok.flatten(1))
            parents.append((offset + frontier)[:, :, None].expand(-1, -1, topk).flatten(1))
            offset += scores[-2].shape[1]
        cands = make(
            DraftCandidates,
            tokens=torch.cat(tokens, 1),
            parents=torch.cat(parents, 1),
            scores=torch.cat(scores, 1),
        )
        return build_tree(cands, root, num_draft_tokens), None

    propose.max_children = topk
    return propose


def sampled_tree_round(
    draft: torch.Tensor, branching: tuple[int, ...], pass_probs=True, claimed=None
):
    """Every node at depth d gets ``branching[d]`` children drawn i.i.d. from the draft chain.

    ``branching = (1,) * num_steps`` is a sampled chain. Draws use the DRAFT stream with the
    child's position as counter and its index within its level as column. The verifier is told
    the drafts came from ``claimed`` (default: ``draft``, the truth), or nothing when
    ``pass_probs`` is false (target-only acceptance).
    """
    claimed = draft if claimed is None else claimed

    def propose(root, position, seed):
        batch = root.shape[0]
        tokens, parents = [root[:, None]], [torch.full((batch, 1), -1, dtype=torch.int64)]
        depths = [torch.zeros(batch, 1, dtype=torch.int64)]
        level_start, level = 0, root[:, None]
        for depth, k in enumerate(branching, start=1):
            width = level.shape[1] * k
            parent_tok = level.repeat_interleave(k, dim=1)  # [batch, width]
            u = uniforms(seed, Stream.DRAFT, (position + depth)[:, None], width)[:, 0]
            child = sample_from_probs(draft[parent_tok], u)
            parent_index = level_start + torch.arange(width) // k
            tokens.append(child)
            parents.append(parent_index.expand(batch, width))
            depths.append(torch.full((batch, width), depth, dtype=torch.int64))
            level_start += level.shape[1]
            level = child
        tree = make(
            DraftTree,
            tokens=torch.cat(tokens, 1),
            parents=torch.cat(parents, 1),
            depths=torch.cat(depths, 1),
        )
        q = claimed[tree.tokens.gather(1, tree.parents.clamp(min=0))]
        return tree, q if pass_probs else None

    propose.max_children = max(branching)
    return propose


def decode(propose, target, max_depth, num_samples, first=0, num_tokens=3, salt=0):
    """Run whole speculative rounds over ``num_samples`` seeds; the first ``num_tokens`` tokens."""
    seed = torch.arange(num_samples, dtype=torch.int64) * 2654435761 + salt
    root = torch.full((num_samples,), first, dtype=torch.int64)
    position = torch.full((num_samples,), 17, dtype=torch.int64)
    width = num_tokens + max_depth + 2  # the last column absorbs padding writes
    out = torch.full((num_samples, width), -1, dtype=torch.int64)
    count = torch.zeros(num_samples, dtype=torch.int64)
    column = torch.arange(max_depth + 1)
    for _ in range(num_tokens):  # every round emits at least one token
        tree, q = propose(root, position, seed)
        result = accept(
            tree,
            target[tree.tokens],
            seed,
            position,
            max_depth,
            q,
            max_children=propose.max_children,
        )
        n = result.num_accepted + 1
        valid = column[None] < n[:, None]
        index = torch.where(valid, count[:, None] + column[None], width - 1).clamp(max=width - 1)
        out = out.scatter(1, index, torch.where(valid, result.emitted, -1))
        count = count + n
        root = result.emitted.gather(1, result.num_accepted[:, None])[:, 0]
        position = position + n
    return out[:, :num_tokens]


def joint_stats(tokens: torch.Tensor, target: torch.Tensor, first: int) -> dict:
    """Chi-square and total variation of the emitted token tuples against the chain's law."""
    n, k = tokens.shape
    p = target.double().numpy()
    joint = p[first]
    for _ in range(1, k):
        # joint over (y1..yj) times p(y_{j+1} | y_j): y_j is the last (fastest) index.
        joint = (joint.reshape(-1, VOCAB)[:, :, None] * p[None]).reshape(-1)
    code = np.zeros(n, dtype=np.int64)
    for j in range(k):
        code = code * VOCAB + tokens[:, j].numpy()
    counts = np.bincount(code, minlength=VOCAB**k).astype(np.float64)
    stat, dof = chi2_stat(counts, n * joint)
    tv = 0.5 * np.abs(counts / n - joint).sum()
    return dict(
        off_support=float(counts[joint == 0].sum()),
        chi2=stat,
        threshold=chi2_threshold(dof, z=6.0),
        tv=float(tv),
        tv_bound=tv_bound(joint, n, false_alarm=1e-9),
    )


def lossless(stats: dict) -> bool:
    return (
        stats["off_support"] == 0
        and stats["chi2"] < stats["threshold"]
        and stats["tv"] < stats["tv_bound"]
    )


def pruned_sampled_tree_round(draft, branching, num_draft_tokens, pass_probs):
    """Siblings sampled i.i.d., then the best ``num_draft_tokens - 1`` kept by cumulative q.

    Selecting on the sampled tokens means a kept token is no longer a draw from its ``q``:
    only target-only acceptance (``draft_probs=None``) stays exact on such a tree.
    """
    full = sampled_tree_round(draft, branching)

    def propose(root, position, seed):
        tree, q = full(root, position, seed)
        q_token = q.gather(2, tree.tokens[:, :, None])[:, :, 0]
        scores = [torch.ones_like(q_token[:, 0])]
        for i, parent in enumerate(tree.parents[0, 1:].tolist(), start=1):  # static shape
            scores.append(scores[parent] * q_token[:, i])
        cands = make(
            DraftCandidates,
            tokens=tree.tokens[:, 1:],
            parents=tree.parents[:, 1:] - 1,
            scores=torch.stack(scores[1:], 1),
        )
        kept = build_tree(cands, root, num_draft_tokens)
        q_kept = draft[kept.tokens.gather(1, kept.parents.clamp(min=0))]
        return kept, q_kept if pass_probs else None

    propose.max_children = max(branching)
    return propose


# ---------------------------------------------------------------- statistical losslessness

SAMPLES = 20_000
FIRST = 4  # the root token of every sequence; its row of the target chain is the flattest

FILTERS = dict(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05)

# name -> (target/draft filter setting, proposer factory (draft chain -> propose), max_depth)
SCENARIOS = {
    "eagle2-topk2-steps3-n5": ({}, lambda q: topk_tree_round(q, 2, 3, 5), 3),
    "eagle2-topk3-steps3-n8-filtered": (FILTERS, lambda q: topk_tree_round(q, 3, 3, 8), 3),
    "eagle2-topk1-chain": ({}, lambda q: topk_tree_round(q, 1, 3, 4), 3),
    "sampled-chain": ({}, lambda q: sampled_tree_round(q, (1, 1, 1)), 3),
    "sampled-chain-filtered": (
        dict(top_k=3, min_p=0.1),
        lambda q: sampled_tree_round(q, (1, 1, 1)),
        3,
    ),
    "iid-tree-221": ({}, lambda q: sampled_tree_round(q, (2, 2, 1)), 3),
    "iid-tree-32-filtered-target-only": (
        FILTERS,
        lambda q: sampled_tree_round(q, (3, 2), pass_probs=False),
        2,
    ),
    "pruned-sampled-tree-target-only": (
        {},
        lambda q: pruned_sampled_tree_round(q, (2, 2, 2), 5, pass_probs=False),
        3,
    ),
}


def run_scenario(name: str, samples: int = SAMPLES, salt: int = 0) -> dict:
    setting, factory, max_depth = SCENARIOS[name]
    target = markov(TARGET_LOGITS, **setting)
    tokens = decode(
        factory(markov(DRAFT_LOGITS, **setting)), target, max_depth, samples, first=FIRST, salt=salt
    )
    return joint_stats(tokens, target, FIRST)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sampled_decoding_is_lossless(name):
    stats = run_scenario(name)
    assert lossless(stats), stats


@pytest.mark.parametrize(
    "propose",
    [
        topk_tree_round(markov(DRAFT_LOGITS), 2, 3, 5),
        sampled_tree_round(markov(DRAFT_LOGITS), (2, 1)),
    ],
    ids=["eagle2-tree", "sampled-tree"],
)
def test_greedy_decoding_emits_the_argmax_chain(propose):
    target = markov(TARGET_LOGITS, temperature=0.0)
    tokens = decode(propose, target, 3, 2_000, first=FIRST, num_tokens=6)
    want, last = [], FIRST
    for _ in range(6):
        last = int(target[last].argmax())
        want.append(last)
    assert (tokens == torch.tensor(want)).all()


# ---------------------------------------------------------------- the check catches wrong rules

_TRY_CHILD = accept_module._try_child
_UNIFORMS = accept_module.uniforms


def _no_residual(residual, token, q, u):
    """Wrong: after a rejection keep sampling from r itself instead of max(r - q, 0)."""
    accepted, _ = _TRY_CHILD(residual, token, q, u)
    return accepted, residual


def _accept_with_q(residual, token, q, u):
    """Wrong: accept x with probability q(x) instead of min(1, r(x) / q(x))."""
    _, rejected = _TRY_CHILD(residual, token, q, u)
    return u < q.gather(1, token[:, None])[:, 0], rejected


def _bonus_on_accept_stream(seed, stream, counter, width):
    """Wrong: the bonus reuses the ACCEPT coin that just rejected a child (shared stream)."""
    stream = Stream.ACCEPT if stream == Stream.RESAMPLE else stream
    return _UNIFORMS(seed, stream, counter, width)


WRONG_RULES = {
    "no-residual-eagle2": ("_try_child", _no_residual, "eagle2-topk2-steps3-n5"),
    "no-residual-chain": ("_try_child", _no_residual, "sampled-chain"),
    "accept-with-q-chain": ("_try_child", _accept_with_q, "sampled-chain"),
    "accept-with-q-tree": ("_try_child", _accept_with_q, "iid-tree-221"),
    "shared-stream-eagle2": ("uniforms", _bonus_on_accept_stream, "eagle2-topk2-steps3-n5"),
    "shared-stream-chain": ("uniforms", _bonus_on_accept_stream, "sampled-chain"),
}


@pytest.mark.parametrize("name", list(WRONG_RULES))
def test_wrong_rules_fail_the_check(name, monkeypatch):
    attribute, wrong, scenario = WRONG_RULES[name]
    monkeypatch.setattr(accept_module, attribute, wrong)
    stats = run_scenario(scenario)
    assert not lossless(stats), stats
    assert stats["chi2"] > 3 * stats["threshold"], stats  # detected with a wide margin


def test_wrong_draft_probs_fail_the_check():
    """Drafts drawn from the filtered draft chain, but the verifier is handed the unfiltered one.

    The classic bug: the probability given to the verifier is not the distribution the token
    was drawn from.
    """
    setting = dict(top_k=3, min_p=0.1)
    target, drawn = markov(TARGET_LOGITS, **setting), markov(DRAFT_LOGITS, **setting)
    propose = sampled_tree_round(drawn, (1, 1, 1), claimed=markov(DRAFT_LOGITS))
    stats = joint_stats(decode(propose, target, 3, SAMPLES, first=FIRST), target, FIRST)
    assert stats["chi2"] > 3 * stats["threshold"], stats


def test_draft_probs_on_a_pruned_sampled_tree_fail_the_check():
    """Passing q for tokens that were selected after sampling is biased (use None there)."""
    target = markov(TARGET_LOGITS)
    propose = pruned_sampled_tree_round(markov(DRAFT_LOGITS), (2, 2, 2), 5, pass_probs=True)
    stats = joint_stats(decode(propose, target, 3, SAMPLES, first=FIRST), target, FIRST)
    assert stats["chi2"] > 3 * stats["threshold"], stats


# ---------------------------------------------------------------- traceability


def test_tree_and_accept_trace_with_fullgraph():
    """build_tree, tree_mask, children and accept compile without graph breaks, same results."""
    gen = torch.Generator().manual_seed(3)
    batch, vocab = 3, 7
    cands = make(
        DraftCandidates,
        tokens=torch.randint(0, vocab, (batch, 6), generator=gen),
        parents=torch.tensor([[-1, -1, 0, 0, 1, 1]] * batch),
        scores=torch.tensor([[0.5, 0.4, 0.3, 0.1, 0.2, 0.1]] * batch),
    )
    target = torch.softmax(torch.randn(batch, 5, vocab, generator=gen), -1)
    draft = torch.softmax(torch.randn(batch, 5, vocab, generator=gen), -1)
    seed, positions = seeds_and_positions(batch)

    def round_(cands, root, target, draft):
        tree = build_tree(cands, root, 5)
        sampled = accept(tree, target, seed, positions, 3, draft, max_children=2)
        greedy = accept(tree, target, seed, positions, 3, max_children=2)
        return tree_mask(tree), children(tree, 2), sampled, greedy

    root = torch.tensor([1, 2, 3])
    want = round_(cands, root, target, draft)
    got = torch.compile(round_, fullgraph=True, backend="eager")(cands, root, target, draft)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(a, b)
