"""Parity of the Triton tree kernels with their spec twins on a CUDA device, at real sizes.

Each case draws its sizes with Hypothesis (vocabularies up to 128256 entries, up to 64
requests, trees up to 64 nodes from EAGLE-2 drafts of ``topk`` up to 8 and depth up to 8) and
its tensors from a seeded generator; the Triton launcher runs on the device and the reference
(the op's default kernel) on the CPU copies.

Acceptance is compared exactly. Greedy targets are one-hot, where the kernel must agree bit for
bit whatever the drafts. Sampled targets and drafts put their mass on a support of at most 64
tokens per request, as filtered distributions (top-k, top-p, min-p) do: zeros add exactly in any
order, so the kernel's sums (in another order than torch's) stay within a few ulps of the
reference's and a decision differs only on a rounding tie. Dense sampled rows over 100k entries
would put the inverse-CDF draw within rounding error of a step boundary in a sizeable fraction
of cases, where either answer is correct.
"""

from __future__ import annotations

import kernel_cases as kc
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.kernels.triton_tree import (
    accept_tree_triton,
    build_tree_triton,
    commit_kv_triton,
    register,
)
from speculum.spec.accept import accept, accept_tree
from speculum.spec.tree import build_tree, build_tree_nodes
from speculum.spec.verify import commit_kv, commit_path
from speculum.state.kv import KVPool, PagedKV
from speculum.state.record import make
from speculum.state.tree import DraftCandidates, DraftTree

pytestmark = pytest.mark.gpu

seeds = kc.seeds
vocabs = st.one_of(st.integers(2, 300), st.integers(1000, 128256), st.sampled_from([32000, 128256]))
#: Elements of one [batch, num_nodes, vocab] tensor: the batch is cut to fit, so the CPU
#: reference stays quick.
BUDGET = 2**24

# ---------------------------------------------------------------- inputs


@st.composite
def eagle_settings(draw):
    """``(topk, num_steps, num_draft_tokens)`` with at most 64 nodes."""
    topk, num_steps = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    num_cand = topk + (num_steps - 1) * topk * topk
    num_draft_tokens = num_steps + 1 if topk == 1 else draw(st.integers(2, min(64, num_cand + 1)))
    return topk, num_steps, num_draft_tokens


def distributions(gen, tokens, parents, support, vocab: int, greedy: bool, with_draft: bool):
    """Target and draft rows; tree tokens come from each request's ``support``.

    Greedy targets are one-hot (often at a child's token) with dense drafts; sampled rows put
    random weights on the support, some of them zero, the draft always on a node's own token.
    """
    batch, n = tokens.shape
    is_child = parents[:, None, :] == torch.arange(n)[None, :, None]
    pick = torch.where(is_child, torch.rand(batch, n, n, generator=gen), -1.0).argmax(-1)
    random_token = support.gather(1, torch.randint(0, support.shape[1], (batch, n), generator=gen))
    favourite = torch.where(is_child.any(-1), tokens.gather(1, pick), random_token)
    if greedy:
        argmax = torch.where(torch.rand(batch, n, generator=gen) < 0.7, favourite, random_token)
        target = F.one_hot(argmax, vocab).float()
        draft = torch.softmax(torch.randn(batch, n, vocab, generator=gen), -1)
        return target, draft if with_draft else None

    def on_support(boost: torch.Tensor) -> torch.Tensor:
        weights = torch.rand(batch, n, support.shape[1], generator=gen)
        weights = weights * (torch.rand(weights.shape, generator=gen) < 0.7)
        rows = torch.zeros(batch, n, vocab).scatter(2, support[:, None].expand(-1, n, -1), weights)
        rows = rows.scatter_add(2, boost[..., None], torch.full((batch, n, 1), 0.5))
        return rows / rows.sum(-1, keepdim=True)

    target = on_support(favourite)
    return target, on_support(tokens) if with_draft else None


@st.composite
def accept_cases(draw):
    """A batch of trees (EAGLE-2 built by the spec, or chains) with distributions and coins."""
    gen = torch.Generator().manual_seed(draw(seeds))
    vocab = draw(vocabs)
    topk, num_steps, num_nodes = draw(eagle_settings())
    if draw(st.booleans()):
        topk, num_steps, num_nodes = 1, num_steps, num_steps + 1
    batch = max(1, min(draw(st.integers(1, 64)), BUDGET // (num_nodes * vocab)))
    support_size = min(vocab, draw(st.integers(1, 64)))
    support = torch.stack(
        [torch.randperm(vocab, generator=gen)[:support_size] for _ in range(batch)]
    )
    cand_tokens, cand_parents, scores = kc.eagle_candidates(gen, batch, topk, num_steps, vocab)
    # Draft tokens from the support, so sampled targets can accept them.
    cand_tokens = support.gather(1, cand_tokens % support_size)
    roots = support[:, 0]
    tokens, parents, _ = build_tree_nodes(cand_tokens, cand_parents, scores, roots, num_nodes)
    greedy, with_draft = draw(st.booleans()), draw(st.booleans())
    target, draft = distributions(gen, tokens, parents, support, vocab, greedy, with_draft)
    max_depth = int(kc.depths_of(parents).max()) + draw(st.integers(0, 1))
    max_children = max(kc.most_children(parents), 1) + draw(st.integers(0, 1))
    seed = torch.arange(batch, dtype=torch.int64) * 7919 + draw(seeds)
    positions = torch.randint(0, 4096, (batch,), generator=gen)
    coins, bonus = kc.accept_coins(seed, positions, max_depth, max_children)
    if draw(st.booleans()):
        coins = 1 - (1 - coins) / 16  # mostly rejections: long chains of residual updates
    return (tokens, parents, target, draft, coins, bonus), (seed, positions, max_depth)


def cuda(tensors):
    return kc.to_device(tensors, "cuda")


# ---------------------------------------------------------------- parity


@settings(max_examples=25)
@given(accept_cases(), st.sampled_from([1024, 4096]))
def test_accept_matches_spec_on_cuda(case, block_v):
    inputs, _ = case
    want = accept_tree(*inputs)
    got = accept_tree_triton(*cuda(inputs), block_v=block_v)
    for name, g, w in zip(("path", "emitted", "num_accepted"), got, want):
        assert g.is_cuda and torch.equal(g.cpu(), w), (name, g, w)


@settings(max_examples=40)
@given(seeds, st.integers(1, 64), st.booleans(), eagle_settings(), st.integers(1, 512))
def test_build_tree_matches_spec_on_cuda(seed, batch, eagle, setting, num_cand):
    gen = torch.Generator().manual_seed(seed)
    if eagle:
        topk, num_steps, num_draft_tokens = setting
        candidates = kc.eagle_candidates(gen, batch, topk, num_steps, 128256)
    else:
        candidates = kc.forest_candidates(gen, batch, num_cand, 128256)
        num_draft_tokens = min(setting[2], num_cand + 1)
    roots = torch.randint(0, 128256, (batch,), generator=gen)
    want = build_tree_nodes(*candidates, roots, num_draft_tokens)
    got = build_tree_triton(*cuda([*candidates, roots]), num_draft_tokens)
    for name, g, w in zip(("tokens", "parents", "depths"), got, want):
        assert torch.equal(g.cpu(), w), (name, g, w)


#: Pools, page tables and accepted paths (see tests/cover/test_kernel_tree.py) at serving sizes.
SERVING_COMMITS = kc.CommitSizes(
    max_batch=64,
    page_sizes=(1, 16, 64),
    max_nodes=64,
    max_depth=8,
    max_seq_len=300,
    max_shortfall=3,
    max_layers=4,
    heads=(1, 8),
    head_dims=(64, 128),
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
)


@settings(max_examples=20)
@given(kc.commits(SERVING_COMMITS))
def test_commit_matches_spec_on_cuda(commit):
    k, v, page_table, seq_lens, path = commit
    source, destination = kc.commit_slots(page_table, k.shape[2], seq_lens, path)
    k_dev, v_dev = k.cuda(), v.cuda()
    commit_kv(k, v, source, destination)
    commit_kv_triton(k_dev, v_dev, source.cuda(), destination.cuda())
    assert torch.equal(k_dev.cpu(), k) and torch.equal(v_dev.cpu(), v)


# ---------------------------------------------------------------- dispatch and capture


def as_tree(tokens: torch.Tensor, parents: torch.Tensor) -> DraftTree:
    depths = kc.depths_of(parents.cpu()).to(parents.device)
    return make(DraftTree, tokens=tokens, parents=parents, depths=depths)


def to_cuda(record):
    return pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, record)


@settings(max_examples=5)
@given(accept_cases())
def test_registered_ops_serve_the_public_stages_on_cuda(case):
    """After register(), build_tree, accept and commit_path on CUDA equal their CPU results."""
    register()
    (tokens, parents, target, draft, coins, _), (seed, positions, max_depth) = case
    gen = torch.Generator().manual_seed(int(seed[0]))
    batch, max_children = tokens.shape[0], coins.shape[2]

    tree = as_tree(tokens, parents)
    want = accept(tree, target, seed, positions, max_depth, draft, max_children=max_children)
    args = (target, seed, positions, max_depth, draft)
    got = accept(to_cuda(tree), *to_cuda(args), max_children=max_children)
    for name in ("path", "emitted", "num_accepted"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name

    fields = kc.eagle_candidates(gen, batch, 4, 4, 1000)
    cands = make(DraftCandidates, **dict(zip(("tokens", "parents", "scores"), fields)))
    roots = torch.randint(0, 1000, (batch,), generator=gen)
    want_tree = build_tree(cands, roots, 20)
    got_tree = build_tree(to_cuda(cands), roots.cuda(), 20)
    for name in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(got_tree, name).cpu(), getattr(want_tree, name)), name

    page_size, pages_each = 4, 1 + (300 + tokens.shape[1]) // 4
    page_table = 1 + torch.randperm(batch * pages_each, generator=gen).reshape(batch, -1)
    kv = make(
        PagedKV,
        page_table=page_table,
        seq_lens=torch.randint(0, 300, (batch,), generator=gen),
        page_size=page_size,
    )
    pool = KVPool.allocate(
        num_layers=2,
        num_pages=1 + batch * pages_each,
        page_size=page_size,
        num_kv_heads=2,
        head_dim=64,
    )
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    pool_dev = KVPool(k=pool.k.cuda(), v=pool.v.cuda(), page_size=page_size)
    want_kv = commit_path(pool, kv, want)
    got_kv = commit_path(pool_dev, to_cuda(kv), got)
    assert torch.equal(got_kv.seq_lens.cpu(), want_kv.seq_lens)
    assert torch.equal(pool_dev.k.cpu(), pool.k) and torch.equal(pool_dev.v.cpu(), pool.v)


def test_accept_kernel_replays_in_a_cuda_graph():
    """The launcher captures (scratch allocation included); replays on new inputs stay exact."""
    gen = torch.Generator().manual_seed(0)
    batch, vocab, num_nodes, max_depth, max_children = 8, 32000, 24, 5, 4
    cands = kc.eagle_candidates(gen, batch, 4, max_depth, vocab)
    support = torch.stack([torch.randperm(vocab, generator=gen)[:64] for _ in range(batch)])
    cands = (support.gather(1, cands[0] % 64), *cands[1:])
    tokens, parents, _ = build_tree_nodes(*cands, support[:, 0], num_nodes)

    def inputs(salt: int):
        g = torch.Generator().manual_seed(salt)
        target, draft = distributions(g, tokens, parents, support, vocab, salt % 2 == 0, True)
        seed = torch.arange(batch, dtype=torch.int64) + 1000 * salt
        positions = torch.zeros(batch, dtype=torch.int64)
        coins, bonus = kc.accept_coins(seed, positions, max_depth, max_children)
        return [tokens, parents, target, draft, coins, bonus]

    static = cuda(inputs(0))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        accept_tree_triton(*static)  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = accept_tree_triton(*static)
    for salt in (1, 2, 3, 4):
        fresh = inputs(salt)
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        want = accept_tree(*fresh)
        assert all(torch.equal(o.cpu(), w) for o, w in zip(outputs, want)), salt
