"""Prefix cache: an index of full KV pages by the prompt tokens they hold, as a value.

A page-sized block of prompt tokens is named by a hash chain, as vLLM's automatic prefix caching
does: block ``j``'s key is ``sha256(key of block j - 1, its tokens)``, so a key names the whole
prefix up to the end of its block. A key may also cover ``lookahead`` tokens after its block,
for drafts whose cache entry at a position depends on the token after it (an EAGLE head pairs
the target's hidden state of token ``i`` with token ``i + 1``).

The index maps keys to pages and counts, per page, the live requests whose page tables point
at it. A cached page no request holds is *reclaimable*: it keeps its contents for a later hit,
and the scheduler evicts the least recently used ones when it needs pages, so the cache never
makes the pool run out sooner. Pages in the index are never on the allocator's free stack.

Every function returns a new index; the one handed in is unchanged (its dicts are never
written after it is built), so a scheduler state holding an index is a value.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence

import attrs

from speculum.state.kv import PADDING_PAGE

__all__ = [
    "CachedPage",
    "PrefixIndex",
    "block_keys",
    "lookup",
    "acquire",
    "release",
    "register",
    "reclaimable",
    "evict",
    "forget_holders",
]


@attrs.define(frozen=True, slots=True, kw_only=True)
class CachedPage:
    """One cached page: its block's ``key``, its ``depth`` in the chain (block index), how
    many live requests hold it (``refs``), when it was cached (``since``) and when it was last
    acquired or released (``last_used``), on the index's clock."""

    key: bytes
    depth: int
    refs: int
    since: int
    last_used: int


@attrs.define(frozen=True, slots=True, kw_only=True)
class PrefixIndex:
    """Cached pages by key (``pages``) and by page id (``cached``), and the clock that dates
    their use (LRU). Compared by value."""

    pages: dict[bytes, int] = attrs.field(factory=dict)
    cached: dict[int, CachedPage] = attrs.field(factory=dict)
    clock: int = 0


@functools.lru_cache(maxsize=1024)
def block_keys(tokens: tuple[int, ...], page_size: int, lookahead: int) -> tuple[bytes, ...]:
    """The chain keys of every full block of ``tokens`` whose ``lookahead`` following tokens
    are known too: block ``j`` (tokens ``j * page_size .. (j + 1) * page_size - 1``) has a key
    when ``(j + 1) * page_size + lookahead <= len(tokens)``."""
    keys, parent = [], b""
    for end in range(page_size, len(tokens) - lookahead + 1, page_size):
        block = tokens[end - page_size : end + lookahead]
        parent = hashlib.sha256(parent + b",".join(str(t).encode() for t in block)).digest()
        keys.append(parent)
    return tuple(keys)


def lookup(index: PrefixIndex, keys: Sequence[bytes]) -> tuple[int, ...]:
    """The pages of the longest run of ``keys``, from the first, that the index holds."""
    pages = []
    for key in keys:
        page = index.pages.get(key)
        if page is None:
            break
        pages.append(page)
    return tuple(pages)


def acquire(index: PrefixIndex, pages: Iterable[int]) -> PrefixIndex:
    """``index`` with one more holder of each cached page of ``pages`` (a request's hit)."""
    return _counted(index, pages, +1)


def release(index: PrefixIndex, pages: Iterable[int]) -> tuple[PrefixIndex, tuple[int, ...]]:
    """A finished request's ``pages`` let go of: cached ones lose a holder (at none they become
    reclaimable, keeping their contents), the others are returned, for the allocator to free.
    The chain's later blocks are dated older, so its tail is evicted first (as vLLM does)."""
    pages = tuple(pages)
    private = tuple(p for p in pages if p not in index.cached)
    return _counted(index, reversed(pages), -1), private


def _counted(index: PrefixIndex, pages: Iterable[int], change: int) -> PrefixIndex:
    """``index`` with ``change`` holders for each cached page of ``pages``, dated in order."""
    pages = [p for p in pages if p in index.cached]
    if not pages:  # most steps: nothing cached is taken or let go of, and nothing is copied
        return index
    cached, clock = dict(index.cached), index.clock
    for page in pages:
        entry = cached[page]
        if entry.refs + change < 0:
            raise ValueError(f"cached page {page} released more often than it was acquired")
        clock += 1
        cached[page] = attrs.evolve(entry, refs=entry.refs + change, last_used=clock)
    return attrs.evolve(index, cached=cached, clock=clock)


def register(index: PrefixIndex, keys: Sequence[bytes], pages: Sequence[int]) -> PrefixIndex:
    """``index`` with block ``j``'s page ``pages[j]`` cached under ``keys[j]``, held by the
    request that wrote it, for every block whose key is not cached yet (a block another request
    cached first stays the writer's own, private page). An entry of ``PADDING_PAGE`` (a block
    the request has let go of, outside its sliding window) holds no page and is skipped."""
    new = [
        (j, k, p)
        for j, (k, p) in enumerate(zip(keys, pages))
        if k not in index.pages and p != PADDING_PAGE
    ]
    if not new:
        return index
    by_key, cached, clock = dict(index.pages), dict(index.cached), index.clock
    for depth, key, page in new:
        if page in cached:
            raise ValueError(f"page {page} is cached already under another key")
        clock += 1
        by_key[key] = page
        cached[page] = CachedPage(key=key, depth=depth, refs=1, since=clock, last_used=clock)
    return PrefixIndex(pages=by_key, cached=cached, clock=clock)


def reclaimable(index: PrefixIndex) -> int:
    """How many cached pages no request holds (the scheduler may evict them for room)."""
    return sum(1 for entry in index.cached.values() if entry.refs == 0)


def evict(index: PrefixIndex, count: int) -> tuple[PrefixIndex, tuple[int, ...]]:
    """``index`` without its ``count`` least recently used reclaimable pages (deepest blocks
    first among equals), and those pages, for the allocator to free. Raises ``ValueError``
    when fewer than ``count`` are reclaimable."""
    idle = [(e.last_used, -e.depth, p) for p, e in index.cached.items() if e.refs == 0]
    if count > len(idle):
        raise ValueError(f"cannot evict {count} cached pages: {len(idle)} are reclaimable")
    if count <= 0:
        return index, ()
    gone = tuple(p for _, _, p in sorted(idle)[:count])
    cached = {p: e for p, e in index.cached.items() if p not in gone}
    by_key = {e.key: p for p, e in cached.items()}
    return attrs.evolve(index, pages=by_key, cached=cached), gone


def forget_holders(index: PrefixIndex) -> PrefixIndex:
    """``index`` with every page reclaimable: the cache a fresh scheduler state starts from,
    whose requests are those of no earlier state."""
    cached = {p: attrs.evolve(e, refs=0) for p, e in index.cached.items()}
    return attrs.evolve(index, cached=cached)
