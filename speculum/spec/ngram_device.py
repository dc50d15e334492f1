"""The device n-gram matcher: one chain per request, found with static shapes on the device.

:func:`speculum.spec.ngram.match` builds trees on the host from the history, a shared store and
a corpus. This is its device twin for the history alone (vLLM's ``ngram_gpu`` proposer does
the same kind of search): every tensor has a shape fixed by the batch, the history's capacity
and the configuration, nothing is read back to the host, so a round that drafts with it, then
verifies, accepts and commits, is one pure device function (one CUDA graph per batch bucket).

The rule (request history ``h[0 .. n-1]``, ending with the root ``h[n-1]``)
    An *occurrence* of length ``L`` ends at ``e <= n - 2`` where ``h[e-L+1 .. e] ==
    h[n-L .. n-1]``. Let ``M`` be the longest ``L`` in ``min_match .. max_depth`` that has an
    occurrence, and ``e*`` its most recent (largest) end. The chain is ``h[e*+1 ..]``, the
    tokens that followed it, cut at the history's end and at the depth bound ``min(max_depth,
    num_draft_tokens - 1)`` (:func:`speculum.spec.ngram.tree_bounds`). Without an occurrence
    the chain is one *guess*, the root token repeated.

Relation to the host matcher
    With ``min_breadth == max_breadth == 1``, ``order="recency"``, no store and no corpus,
    the host's tree is a chain too and starts with exactly this chain: its longest suffix
    length's walk follows the most recent occurrence, whose continuation is ranked first at
    every level. Where that continuation runs out (the occurrence lies within the last
    ``depth`` tokens) the host goes on along older occurrences that agree with the chain so
    far, and shorter suffix lengths may extend it further; the device chain stops there and
    pads. So the device chain is a prefix of the host chain, equal to it whenever the most
    recent occurrence has a full-depth continuation (``tests/cover/test_ngram_device.py``).

Padding
    The tree is laid out exactly as :func:`speculum.spec.ngram.match` lays out a chain of
    the same length: real nodes ``0 .. k`` (root, chain or guess), then a dead duplicate of
    node 1 under the root, then fillers below it in a complete ``fan_out``-ary tree in
    breadth-first order, all never accepted (the host module's docstring proves why).
"""

from __future__ import annotations

import torch
from jaxtyping import Int
from torch import Tensor

from speculum.spec.ngram import NgramConfig, NgramDraft, tree_bounds
from speculum.state.record import make
from speculum.state.tree import DraftTree

__all__ = ["match_lengths", "chain_tree", "match_chain", "append_tokens"]

# Sentinels that no token id (>= 0) and no empty history slot (-1) equals.
_BEFORE_START = -3
_NO_SUFFIX = -2


def match_lengths(
    history: Int[Tensor, "batch context"], history_len: Int[Tensor, " batch"], longest: int
) -> Int[Tensor, "batch context"]:
    """``lengths[b, e]``: how many tokens ending at position ``e`` equal the last tokens of row
    ``b``'s history (its suffix), at most ``longest``; positions past the history are not
    masked here (:func:`match_chain` keeps ``e <= n - 2``).

    All suffix lengths at once: column ``t`` of position ``e``'s window holds ``h[e - longest
    + t]`` (a strided view, no copy), compared with suffix token ``longest - t``; column 0
    compares with a sentinel and never matches, so the match length is ``longest`` minus the
    last mismatching column, found as a max over the columns' indices. Memory: two bytes per
    ``batch * context * (longest + 1)`` (the comparison and the indexed mismatches)."""
    batch, width = history.shape
    back = torch.arange(longest, device=history.device)
    at = history_len[:, None] - 1 - back[None, :]
    suffix = torch.where(at >= 0, history.gather(1, at.clamp(min=0)), _NO_SUFFIX)
    # Oldest first, after the sentinel: column t holds suffix token longest - t.
    suffix = torch.cat([suffix.new_full((batch, 1), _NO_SUFFIX), suffix.flip(1)], dim=1)
    before = history.new_full((batch, longest), _BEFORE_START)
    padded = torch.cat([before, history], dim=1)  # [batch, longest + context]
    windows = padded.unfold(1, longest + 1, 1)[:, :width]  # [batch, context, longest + 1]
    mismatch = windows != suffix[:, None, :]
    small = torch.uint8 if longest < 256 else torch.int32
    column = torch.arange(longest + 1, dtype=small, device=history.device)
    last = torch.where(mismatch, column, 0).amax(dim=-1)
    return longest - last.long()


def _filler_levels(fan_out: int, count: int) -> list[int]:
    """First index (1-based, breadth-first under the dead node) of each level >= 1 of a
    complete ``fan_out``-ary tree that ``count`` fillers reach: level ``L`` starts at
    ``1 + fan_out + ... + fan_out ** (L - 1)``."""
    starts, start = [], 1
    while start <= count:
        starts.append(start)
        start = start * fan_out + 1
    return starts


def chain_tree(
    root: Int[Tensor, " batch"],
    chain: Int[Tensor, "batch depth"],
    length: Int[Tensor, " batch"],
    config: NgramConfig,
) -> DraftTree:
    """The padded tree of ``num_draft_tokens`` nodes for each row's chain
    ``chain[b, :length[b]]`` after ``root[b]`` (``length`` 0: the guess), laid out as
    :func:`speculum.spec.ngram.match` lays out a chain (module docstring)."""
    size = config.num_draft_tokens
    depth_bound, fan_out = tree_bounds(config)
    node = torch.arange(size, device=root.device)[None, :]
    real = length.clamp(min=1)[:, None]  # the guess counts as node 1
    first = torch.where(length > 0, chain[:, 0], root)[:, None]
    # Node i carries chain token i - 1 up to the chain's length, node 1's token after it.
    spare = first.expand(-1, size - 1 - chain.shape[1])
    tokens = torch.where(
        node <= length[:, None], torch.cat([root[:, None], chain, spare], 1), first
    )
    # Fillers: index s >= 1 below the dead node (node real + 1), in breadth-first order.
    dead = real + 1
    s = node - dead
    if depth_bound == 1:
        filler_parent, filler_depth = torch.zeros_like(s), torch.ones_like(s)
    else:
        level = sum((s >= start).long() for start in _filler_levels(fan_out, size))
        filler_parent = dead + (s - 1).div(fan_out, rounding_mode="floor")
        filler_depth = 1 + level
    parents = torch.where(node <= real, node - 1, torch.where(node == dead, 0, filler_parent))
    depths = torch.where(node <= real, node, torch.where(node == dead, 1, filler_depth))
    return make(DraftTree, tokens=tokens, parents=parents, depths=depths)


def match_chain(
    history: Int[Tensor, "batch context"], history_len: Int[Tensor, " batch"], config: NgramConfig
) -> NgramDraft:
    """Each row's chain (module docstring's rule) as a padded draft tree, and its count of
    matched nodes, root included (1 for the guess, as the host counts it). Pure tensor code
    with static shapes: no host sync. ``history[b, :history_len[b]]`` ends with the root;
    ``history_len >= 1``."""
    width = history.shape[1]
    depth, _ = tree_bounds(config)
    n = history_len[:, None]
    lengths = match_lengths(history, history_len, config.max_depth)
    end = torch.arange(width, device=history.device)[None, :]
    valid = (end <= n - 2) & (lengths >= config.min_match)
    # Longest first, then the most recent: one max over length * width + end.
    best = torch.where(valid, lengths * width + end, -1).amax(dim=1)
    found = best >= 0
    start = best.remainder(width) + 1
    at = start[:, None] + torch.arange(depth, device=history.device)[None, :]
    length = torch.where(found, (history_len - start).clamp(min=0, max=depth), 0)
    chain = history.gather(1, at.clamp(max=width - 1))
    root = history.gather(1, (history_len - 1)[:, None])[:, 0]
    tree = chain_tree(root, chain, length, config)
    return make(NgramDraft, tree=tree, num_nodes=1 + length)


def append_tokens(
    history: Int[Tensor, "batch context"],
    history_len: Int[Tensor, " batch"],
    emitted: Int[Tensor, "batch max_tokens"],
    counts: Int[Tensor, " batch"],
) -> tuple[Int[Tensor, "batch context"], Int[Tensor, " batch"]]:
    """``history`` with ``emitted[b, :counts[b]]`` written after ``history_len[b]``, and the
    new lengths (capped at the capacity), on whatever device they live.

    Written into a copy widened by ``emitted``'s width, so no two writes share an index and
    none falls outside, then cut back: a request stops at its context limit, and what an
    overlapped round writes past it is never read."""
    width = history.shape[1]
    column = torch.arange(emitted.shape[1], device=history.device)
    index = history_len[:, None] + column[None, :]
    wide = torch.cat([history, torch.full_like(emitted, -1)], dim=1)
    wide = wide.scatter(1, index, torch.where(column[None, :] < counts[:, None], emitted, -1))
    return wide[:, :width], (history_len + counts).clamp(max=width)
