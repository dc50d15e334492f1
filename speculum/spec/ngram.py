"""Model-free n-gram drafting (SGLang's NGRAM): a token store, a corpus index and the matcher.

Everything here runs on the host (CPU tensors viewed as numpy arrays) and is a pure function of
its arguments: :func:`insert` returns a new store and leaves the one handed in unchanged, and
:func:`match` reads histories, a store and a corpus and returns a batch of draft trees.

Sources
    A request's tokens (its **history**: prompt and every emitted token, ending with the root,
    the last verified token) are matched against three sources:

    (a) the history itself (prompt lookup);
    (b) a **store** of token streams shared across requests (:class:`NgramStore`): a ring buffer
        of ``capacity`` int32 entries plus a sorted index of at most as many entries, so its
        memory is fixed by its token budget; inserting past the budget overwrites the oldest
        entries;
    (c) an optional read-only **corpus** (:class:`CorpusIndex`): token documents with a suffix
        array of the reversed text.

Occurrences
    For a suffix length ``L`` (``max_depth`` down to ``min_match``, longest first) an
    *occurrence* is a place in a source where the request's last ``L`` tokens appear, inside one
    stream, followed by at least one token: the *continuation*. The history's own last ``L``
    tokens are not an occurrence (nothing follows them yet). Only the ``max_occurrences`` most
    recent occurrences of each length are used (corpus ranges are sampled evenly instead).
    Recency is one timeline: the corpus (file order) is oldest, then the store (insertion
    order), then the request's own history (position order), newest.

Tree (SGLang's ``buildRecency``, with both breadth endpoints reachable)
    One tree per request, root = the last verified token, at most ``num_draft_tokens`` nodes
    including the root. For each suffix length ``L`` with occurrences, longest first, a
    breadth-first expansion walks the continuations of those occurrences, merging into the one
    tree (a token already present under a node is reused, not duplicated). A node's candidate
    children are the distinct tokens that follow its path in the occurrences, ordered by
    ``order``: ``"recency"`` (most recent occurrence first) or ``"frequency"`` (most
    occurrences first, ties to the most recent). The expansion of length ``L`` takes, at a node
    ``k`` levels below the root, the first ::

        max(1, min_breadth + floor((max_breadth - min_breadth) * (max_depth - L - k) / D))

    candidates, ``D = max(1, max_depth - 1)``: a match of the full ``max_depth`` starts with
    ``min_breadth`` children, a single-token match with ``max_breadth``, and every level down
    has ``(max_breadth - min_breadth) / D`` fewer (SGLang's linear schedule; SGLang places the
    endpoints one length lower). Long, confident matches draft narrow deep trees; short ones
    wide shallow trees. No node gets more than ``max_breadth`` children in total and no node is
    deeper than ``min(max_depth, num_draft_tokens - 1)``. Expansion stops when the tree is
    full. (SGLang's ``PROB`` mode expands best-first by estimated path probability; here
    ``frequency`` changes the order only, the breadth-first shape is the same.)

Padding (exact, no masking needed in ``spec.accept``)
    Trees are returned at the fixed width ``num_draft_tokens`` with ``num_nodes[b]`` (root
    included) real nodes first; nodes from ``num_nodes[b]`` on are fillers laid out so that
    acceptance can never reach them:

    - the first filler is a child of the root carrying the token of node 1, the root's first
      child. ``spec.accept`` tries siblings in node order, so node 1 is tried first: if it is
      accepted the walk leaves the root, and if it is rejected its token's residual mass is set
      to exactly 0, so the duplicate is accepted with probability ``0`` (``u * mass < 0`` is
      false for every coin): never, greedy or sampled, whatever the filters;
    - every further filler descends from that dead node (a complete ``max_children``-ary tree
      under it, or more dead duplicates at the root when trees are one level deep), so it is
      unreachable.

    A request with no occurrence at all has no node 1: it gets one **guess** node, the root
    token repeated (a run continuing), before the fillers. The guess is a real draft token and
    may be accepted (lossless like any draft: ``draft_probs=None`` is exact for any tree chosen
    without looking at the acceptance coins); ``num_nodes`` does not count it.
    :func:`tree_bounds` gives the depth and children-per-node bounds every returned tree obeys,
    which are the static ``max_depth`` and ``max_children`` to verify with.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from speculum.state.record import make, record, static
from speculum.state.tree import DraftTree

__all__ = [
    "ORDERS",
    "NgramConfig",
    "NgramStore",
    "CorpusIndex",
    "NgramDraft",
    "validate_ngram_config",
    "tree_bounds",
    "new_store",
    "insert",
    "insert_many",
    "live_streams",
    "build_corpus_index",
    "load_corpus",
    "corpus_documents",
    "match",
]

#: Child orders of :class:`NgramConfig`.
ORDERS = ("recency", "frequency")

#: Recency keys: corpus positions < store positions < history positions on one timeline.
_STORE_KEY = 1 << 40
_HISTORY_KEY = 1 << 60
_SEPARATOR = -1


@record
class NgramConfig:
    """Static shape of n-gram drafting (see the module docstring for what each field does).

    ``num_draft_tokens`` counts tree nodes including the root; ``max_depth`` is both the longest
    suffix matched and the deepest draft; suffixes shorter than ``min_match`` are not matched.
    """

    num_draft_tokens: int = static()
    max_depth: int = static(default=18)
    min_match: int = static(default=1)
    min_breadth: int = static(default=1)
    max_breadth: int = static(default=10)
    order: str = static(default="recency")
    max_occurrences: int = static(default=256)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_ngram_config(config: NgramConfig) -> None:
    """Raise ``ValueError`` naming every setting that cannot work, and how to fix it."""
    fields = (
        "num_draft_tokens",
        "max_depth",
        "min_match",
        "min_breadth",
        "max_breadth",
        "max_occurrences",
    )
    for name in fields:
        value = getattr(config, name)
        if not _is_int(value):
            raise ValueError(f"ngram {name} must be an int, got {value!r}")
    c = config
    rules = [
        (
            c.num_draft_tokens >= 2,
            f"num_draft_tokens={c.num_draft_tokens} must be >= 2 (root "
            "plus at least one draft token)",
        ),
        (c.max_depth >= 1, f"max_depth={c.max_depth} must be >= 1"),
        (
            1 <= c.min_match <= max(c.max_depth, 1),
            f"min_match={c.min_match} must be in 1 .. max_depth={c.max_depth}",
        ),
        (c.min_breadth >= 1, f"min_breadth={c.min_breadth} must be >= 1"),
        (
            c.max_breadth >= c.min_breadth,
            f"max_breadth={c.max_breadth} must be >= min_breadth={c.min_breadth}",
        ),
        (c.order in ORDERS, f"order={c.order!r} must be one of {', '.join(ORDERS)}"),
        (c.max_occurrences >= 1, f"max_occurrences={c.max_occurrences} must be >= 1"),
    ]
    problems = [message for ok, message in rules if not ok]
    if problems:
        raise ValueError("invalid n-gram configuration: " + "; ".join(problems))


def _filler_capacity(children: int, levels: int) -> int:
    """Nodes a complete ``children``-ary tree holds in ``levels`` levels below its root."""
    return sum(children**level for level in range(1, levels + 1))


def tree_bounds(config: NgramConfig) -> tuple[int, int]:
    """``(max_depth, max_children)`` that every tree :func:`match` returns obeys.

    Real nodes are at most ``min(max_depth, num_draft_tokens - 1)`` deep with at most
    ``max_breadth`` children each; the root may also carry the dead filler, and the fillers
    below it need a fan-out that fits them in the remaining depth.
    """
    n = config.num_draft_tokens
    depth = min(config.max_depth, n - 1)
    if depth == 1:
        return 1, n - 1  # fillers can only sit at the root
    fan_out = max(config.max_breadth + 1, 2)
    # Worst case: root, guess, dead filler, and n - 3 fillers under the dead one.
    while fan_out < n - 1 and _filler_capacity(fan_out, depth - 1) < n - 3:
        fan_out += 1
    return depth, min(fan_out, n - 1)


# ---------------------------------------------------------------------------------- the store


@record
class NgramStore:
    """Token streams shared across requests, in a fixed-capacity ring buffer with an index.

    ``tokens[p % capacity]`` holds the entry written at absolute position ``p``; entries
    ``length - capacity .. length - 1`` are live (all of them once the ring has wrapped). An
    entry is a token id (``>= 0``), a stream separator (``-1``), or a *context* token ``t``
    stored as ``-t - 2``: context tokens can be matched and read as continuations but no
    occurrence ends on them (another stream already holds those occurrences).

    The index lists the occurrence-capable entries (a token id followed by another token of its
    stream) written before absolute position ``indexed``, sorted by token then position:
    ``index_tokens`` / ``index_positions``. Entries written since are found by scanning, and
    every ``index_every`` entries they are merged in (and evicted ones dropped), so a lookup
    costs a binary search plus a scan of at most ``index_every`` entries, not the whole ring.
    Memory is bounded by the budget: ``capacity`` ring entries (int32) and at most
    ``capacity`` index entries (int32 token + int64 position), whatever is inserted.
    """

    tokens: Int[Tensor, " capacity"]
    length: Int[Tensor, ""]
    index_tokens: Int[Tensor, " index"]
    index_positions: Int[Tensor, " index"]
    indexed: Int[Tensor, ""]
    index_every: int = static()


def new_store(capacity: int, *, index_every: int | None = None) -> NgramStore:
    """An empty store of ``capacity`` entries (tokens plus one separator per stream).

    ``index_every`` (default ``max(1024, capacity // 16)``) is how many new entries are scanned
    before they are merged into the index.
    """
    if not _is_int(capacity) or capacity < 2:
        raise ValueError(
            f"store capacity={capacity!r}: need an int >= 2 (a token and its separator); "
            "switch the store off instead of making it tiny"
        )
    if index_every is None:
        index_every = max(1024, capacity // 16)
    if not _is_int(index_every) or index_every < 1:
        raise ValueError(f"index_every={index_every!r} must be an int >= 1")
    return NgramStore(
        tokens=torch.full((capacity,), _SEPARATOR, dtype=torch.int32),
        length=torch.tensor(0, dtype=torch.int64),
        index_tokens=torch.zeros(0, dtype=torch.int32),
        index_positions=torch.zeros(0, dtype=torch.int64),
        indexed=torch.tensor(0, dtype=torch.int64),
        index_every=index_every,
    )


def _encode_stream(
    tokens: Sequence[int] | np.ndarray | Tensor, lead: int, trail: int
) -> np.ndarray:
    if isinstance(tokens, Tensor):
        tokens = tokens.detach().cpu().numpy()
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"insert: a stream must be a 1-D sequence of token ids, got {array!r}")
    array = array.astype(np.int64)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max - 2):
        raise ValueError("insert: token ids must be >= 0 and fit in int32")
    if not (_is_int(lead) and _is_int(trail) and lead >= 0 and trail >= 0):
        raise ValueError(f"insert: lead={lead!r} and trail={trail!r} must be ints >= 0")
    encoded = array.copy()
    context = np.zeros(array.size, dtype=bool)
    context[:lead] = True
    context[max(0, array.size - trail) :] = True
    encoded[context] = -array[context] - 2
    return encoded


def _occurrence_entries(ring: np.ndarray, start: int, stop: int, length: int):
    """Positions in ``[start, stop)`` (ascending) holding a token id followed by another token
    of the same stream, and those tokens."""
    positions = np.arange(start, stop, dtype=np.int64)
    capacity = ring.size
    values = ring[positions % capacity]
    following = ring[(positions + 1) % capacity]
    keep = (values >= 0) & (positions + 1 < length) & (following != _SEPARATOR)
    return positions[keep], values[keep]


def _merge_index(
    ring: np.ndarray, length: int, tokens: np.ndarray, positions: np.ndarray, indexed: int
) -> tuple[np.ndarray, np.ndarray]:
    """The index with entries ``indexed .. length - 1`` merged in and evicted ones dropped."""
    start = max(0, length - ring.size)
    live = positions >= start
    tokens, positions = tokens[live], positions[live]
    new_positions, new_tokens = _occurrence_entries(ring, max(indexed, start), length, length)
    order = np.argsort(new_tokens, kind="stable")  # by token, then position
    new_tokens, new_positions = new_tokens[order], new_positions[order]
    # New positions exceed every indexed one: inserting after equal tokens keeps positions
    # ascending within each token.
    at = np.searchsorted(tokens, new_tokens, side="right")
    return np.insert(tokens, at, new_tokens), np.insert(positions, at, new_positions)


def insert_many(
    store: NgramStore, streams: Iterable[tuple[Sequence[int] | np.ndarray | Tensor, int, int]]
) -> NgramStore:
    """Append ``(tokens, lead, trail)`` streams in order; returns a new store (one copy).

    The first ``lead`` and last ``trail`` tokens of a stream are context only (module
    docstring). Each stream is followed by a separator. Streams with no occurrence-bearing
    token are skipped. Entries beyond the capacity evict the oldest ones; the store handed in is
    never changed.
    """
    parts = []
    for tokens, lead, trail in streams:
        encoded = _encode_stream(tokens, lead, trail)
        if (encoded >= 0).any():
            parts.extend([encoded, np.array([_SEPARATOR])])
    if not parts:
        return store
    data = np.concatenate(parts)
    capacity = store.tokens.numel()
    length = int(store.length) + data.size
    positions = np.arange(length - data.size, length)
    keep = slice(max(0, data.size - capacity), None)
    ring = store.tokens.clone()
    ring[torch.from_numpy(positions[keep] % capacity)] = torch.from_numpy(
        data[keep].astype(np.int32)
    )
    index_tokens, index_positions, indexed = (
        store.index_tokens,
        store.index_positions,
        int(store.indexed),
    )
    if length - indexed >= store.index_every:
        merged_tokens, merged_positions = _merge_index(
            ring.numpy(), length, index_tokens.numpy(), index_positions.numpy(), indexed
        )
        index_tokens = torch.from_numpy(merged_tokens.astype(np.int32))
        index_positions = torch.from_numpy(merged_positions)
        indexed = length
    return make(
        NgramStore,
        tokens=ring,
        length=torch.tensor(length),
        index_tokens=index_tokens,
        index_positions=index_positions,
        indexed=torch.tensor(indexed),
        index_every=store.index_every,
    )


def insert(
    store: NgramStore,
    tokens: Sequence[int] | np.ndarray | Tensor,
    *,
    lead: int = 0,
    trail: int = 0,
) -> NgramStore:
    """Append one token stream; returns a new store and leaves ``store`` unchanged."""
    return insert_many(store, [(tokens, lead, trail)])


def _decode(values: np.ndarray) -> np.ndarray:
    """Token ids of ring entries: context entries decoded, separators stay -1."""
    return np.where(values <= -2, -values - 2, values)


def live_streams(store: NgramStore) -> list[tuple[list[int], list[bool]]]:
    """The live streams, oldest first, as ``(tokens, occurrence_may_end_here)`` lists.

    The oldest stream may have lost its beginning to eviction. For tests and inspection.
    """
    ring = store.tokens.numpy().astype(np.int64)
    capacity, length = ring.size, int(store.length)
    start = max(0, length - capacity)
    values = ring[np.arange(start, length) % capacity]
    streams, tokens, real = [], [], []
    for value in values.tolist():
        if value == _SEPARATOR:
            if tokens:
                streams.append((tokens, real))
            tokens, real = [], []
        else:
            tokens.append(value if value >= 0 else -value - 2)
            real.append(value >= 0)
    if tokens:
        streams.append((tokens, real))
    return streams


# ---------------------------------------------------------------------------------- the corpus


@record
class CorpusIndex:
    """A read-only token corpus and the suffix array of its reversal.

    ``tokens`` holds the documents in file order separated by -1; ``suffixes`` sorts the
    suffixes of ``tokens`` reversed, so that the request's suffixes of every length are
    prefixes of one reversed string and their ranges nest (one binary search per length).
    """

    tokens: Int[Tensor, " corpus"]
    suffixes: Int[Tensor, " corpus"]


def _suffix_array(text: np.ndarray) -> np.ndarray:
    """Suffix array by prefix doubling (``O(n log^2 n)``); -1 sorts below every token and the
    end of the text below -1."""
    n = text.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = text.astype(np.int64) + 2  # end of text -> 0, separator -> 1, token t -> t + 2
    step = 1
    while True:
        second = np.zeros(n, dtype=np.int64)
        if step < n:
            second[: n - step] = rank[step:]
        order = np.lexsort((second, rank))
        first_sorted, second_sorted = rank[order], second[order]
        new_group = np.ones(n, dtype=bool)
        new_group[1:] = (first_sorted[1:] != first_sorted[:-1]) | (
            second_sorted[1:] != second_sorted[:-1]
        )
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(new_group)
        if rank.max() == n or step >= n:
            return order
        step *= 2


def build_corpus_index(documents: Iterable[Sequence[int]] | np.ndarray) -> CorpusIndex:
    """Index ``documents`` (token-id sequences, or one array with -1 between documents)."""
    if isinstance(documents, np.ndarray):
        flat = documents.astype(np.int64).reshape(-1)
    else:
        parts = []
        for doc in documents:
            parts.extend([np.asarray(list(doc), dtype=np.int64), np.array([_SEPARATOR])])
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if flat.size and (flat.min() < _SEPARATOR or flat.max() > np.iinfo(np.int32).max):
        raise ValueError("corpus: token ids must be >= 0 and fit in int32 (-1 separates documents)")
    suffixes = _suffix_array(flat[::-1].copy())
    return CorpusIndex(
        tokens=torch.from_numpy(flat.astype(np.int32)), suffixes=torch.from_numpy(suffixes)
    )


def load_corpus(path: str | Path) -> CorpusIndex:
    """Read and index a token file.

    ``.npy``: a 1-D integer array, -1 between documents. Anything else: text, one document per
    line, token ids separated by spaces or commas (blank lines are skipped).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"n-gram corpus {str(path)!r} is not a file")
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"n-gram corpus {path}: need a 1-D integer array, got {array.dtype} {array.shape}"
            )
        return build_corpus_index(array)
    documents = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.replace(",", " ").split()
        try:
            documents.append([int(f) for f in fields])
        except ValueError as err:
            raise ValueError(
                f"n-gram corpus {path}, line {number}: expected token ids separated by spaces or "
                f"commas ({err})"
            ) from err
    return build_corpus_index([d for d in documents if d])


def corpus_documents(corpus: CorpusIndex) -> list[list[int]]:
    """The corpus documents as lists (for tests and inspection)."""
    docs, current = [], []
    for token in corpus.tokens.tolist():
        if token == _SEPARATOR:
            docs.append(current)
            current = []
        else:
            current.append(token)
    if current:
        docs.append(current)
    return [d for d in docs if d]


def _bound(values_at, lo: int, hi: int, target: int, upper: bool) -> int:
    """First index in ``[lo, hi)`` whose value is ``>= target`` (``> target`` if ``upper``);
    ``values_at(i)`` is nondecreasing on the range."""
    while lo < hi:
        mid = (lo + hi) // 2
        value = values_at(mid)
        if value < target or (upper and value == target):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _corpus_ranges(
    text: np.ndarray, suffixes: np.ndarray, context: np.ndarray, longest: int
) -> list[tuple[int, int]]:
    """``ranges[L - 1]``: the range of ``suffixes`` (of the reversed ``text``) whose suffixes
    start with the request's last ``L`` tokens reversed, for ``L = 1 ..`` until one is empty.

    The ranges nest, so each length narrows the previous range by one more character.
    """
    n = text.size
    lo, hi, ranges = 0, n, []
    for length in range(1, min(longest, context.size) + 1):
        want = int(context[context.size - length])
        offset = length - 1
        if hi - lo <= 4096:  # small range: gather its characters and search them at once
            at = suffixes[lo:hi] + offset
            chars = np.where(at < n, text[np.maximum(n - 1 - at, 0)], -2)
            new_lo = lo + int(np.searchsorted(chars, want, side="left"))
            new_hi = lo + int(np.searchsorted(chars, want, side="right"))
        else:

            def char(i: int, offset: int = offset) -> int:
                at = int(suffixes[i]) + offset
                return int(text[n - 1 - at]) if at < n else -2

            new_lo = _bound(char, lo, hi, want, upper=False)
            new_hi = _bound(char, new_lo, hi, want, upper=True)
        if new_lo >= new_hi:
            break
        lo, hi = new_lo, new_hi
        ranges.append((lo, hi))
    return ranges


# ---------------------------------------------------------------------------------- matching


@record
class NgramDraft:
    """A batch of n-gram draft trees (fixed width ``num_draft_tokens``) and how many of each
    tree's nodes are matched candidates, root included; the rest are the guess and fillers."""

    tree: DraftTree
    num_nodes: Int[Tensor, " batch"]


class _Occurrences:
    """Occurrences of one source for one request: ``ends`` (every occurrence of the last token,
    ascending, so newest last), the subset ``long_ends`` that also matches the token before it,
    with its match lengths, the recency key of position 0, and a continuation reader."""

    def __init__(self, ends, long_ends, long_lengths, key_base, read):
        self.ends, self.long_ends, self.long_lengths = ends, long_ends, long_lengths
        self.key_base, self.read = key_base, read
        # at_least[L]: how many occurrences match at least L tokens (L >= 2).
        self.at_least = np.cumsum(np.bincount(long_lengths)[::-1])[::-1].tolist()

    def count(self, length: int) -> int:
        if length == 1:
            return self.ends.size
        return self.at_least[length] if length < len(self.at_least) else 0

    def newest(self, length: int, room: int) -> np.ndarray:
        """The ``room`` most recent ends of occurrences at least ``length`` long, ascending."""
        if room <= 0:
            return self.ends[:0]
        ends = self.ends if length == 1 else self.long_ends[self.long_lengths >= length]
        return ends[-room:]


def _long_matches(ends: np.ndarray, context: np.ndarray, same_at, longest: int):
    """The occurrences among ``ends`` that match at least the last two context tokens, and
    their match lengths (at most ``longest``); ``same_at(positions, token)`` says where a
    source holds ``token`` inside the occurrence's stream."""
    if longest < 2 or ends.size == 0:
        return ends[:0], np.zeros(0, dtype=np.int64)
    ends = ends[same_at(ends - 1, int(context[-2]))]
    lengths = np.full(ends.size, 2, dtype=np.int64)
    alive = np.arange(ends.size)
    for back in range(2, longest):
        alive = alive[same_at(ends[alive] - back, int(context[-1 - back]))]
        if alive.size == 0:
            break
        lengths[alive] += 1
    return ends, lengths


def _forward(read, ends: np.ndarray, width: int) -> np.ndarray:
    """``[m, width]`` tokens after each end, cut (to -1) at the first unreadable one."""
    if ends.size == 0 or width == 0:
        return np.zeros((ends.size, width), dtype=np.int64)
    tokens = read(ends[:, None] + np.arange(1, width + 1)[None, :])
    valid = np.logical_and.accumulate(tokens >= 0, axis=1)
    return np.where(valid, tokens, -1)


def _history_occurrences(context: np.ndarray, longest: int) -> _Occurrences:
    size = context.size
    ends = np.flatnonzero(context[:-1] == context[-1])

    def same_at(pos, token):
        return (pos >= 0) & (context[np.maximum(pos, 0)] == token)

    def read(pos):
        return np.where(pos < size, context[np.minimum(pos, size - 1)], -1)

    long_ends, long_lengths = _long_matches(ends, context, same_at, longest)
    return _Occurrences(ends, long_ends, long_lengths, _HISTORY_KEY, read)


class _StoreView:
    """Numpy views of a store for one decoding step, shared by every request of the batch."""

    def __init__(self, store: NgramStore):
        self.ring = store.tokens.numpy()
        self.capacity = self.ring.size
        self.length = int(store.length)
        self.start = max(0, self.length - self.capacity)
        self.index_tokens = store.index_tokens.numpy()
        self.index_positions = store.index_positions.numpy()
        tail_start = max(int(store.indexed), self.start)
        self.tail_ends, self.tail_tokens = _occurrence_entries(
            self.ring, tail_start, self.length, self.length
        )

    def same_at(self, pos: np.ndarray, token: int) -> np.ndarray:
        raw = self.ring[pos % self.capacity]
        return (pos >= self.start) & ((raw == token) | (raw == -token - 2))

    def read(self, pos: np.ndarray) -> np.ndarray:
        """Token ids at absolute positions (context decoded); -1 outside the live window."""
        live = (pos >= self.start) & (pos < self.length)
        raw = self.ring[pos % self.capacity].astype(np.int64)
        return np.where(live, _decode(raw), -1)

    def occurrences(self, context: np.ndarray, longest: int) -> _Occurrences:
        token = int(context[-1])
        # The query must have the index's dtype, or numpy converts the whole index first.
        query = np.array([token, token + 1], dtype=self.index_tokens.dtype)
        lo, hi = np.searchsorted(self.index_tokens, query)
        indexed = self.index_positions[lo:hi]
        indexed = indexed[np.searchsorted(indexed, self.start) :]  # evicted since the merge
        ends = np.concatenate([indexed, self.tail_ends[self.tail_tokens == token]])
        long_ends, long_lengths = _long_matches(ends, context, self.same_at, longest)
        return _Occurrences(ends, long_ends, long_lengths, _STORE_KEY, self.read)


class _CorpusView:
    """Views of a corpus index (no copies: corpora can be large)."""

    def __init__(self, corpus: CorpusIndex):
        self.text = corpus.tokens.numpy()
        self.suffixes = corpus.suffixes.numpy()

    def read(self, pos: np.ndarray) -> np.ndarray:
        n = self.text.size
        return np.where(pos < n, self.text[np.minimum(pos, n - 1)], -1).astype(np.int64)

    def ranges(self, context: np.ndarray, longest: int) -> list[tuple[int, int]]:
        if self.text.size == 0:
            return []
        return _corpus_ranges(self.text, self.suffixes, context, longest)

    def sample(self, lo: int, hi: int, count: int) -> np.ndarray:
        """Match ends (corpus positions of the last context token) of up to ``count`` suffixes
        of the range, evenly spaced, that have a continuation; ascending."""
        rows = np.arange(lo, hi) if hi - lo <= count else np.linspace(lo, hi - 1, count).round()
        ends = np.sort(self.text.size - 1 - self.suffixes[rows.astype(np.int64)])
        return ends[self.read(ends + 1) >= 0]


def _breadth(config: NgramConfig, length: int, level: int) -> int:
    """Candidates taken at ``level`` below the root by the expansion of suffix length
    ``length`` (the module docstring's schedule, in exact integer arithmetic)."""
    span = max(1, config.max_depth - 1)
    extra = (config.max_breadth - config.min_breadth) * (config.max_depth - length - level)
    return max(1, config.min_breadth + extra // span)


class _Tree:
    """The tree under construction: root first, nodes in creation order (parents first)."""

    def __init__(
        self,
        root: int,
        size: int,
        max_depth: int,
        max_children: int,
        legal: Callable[[tuple[int, ...]], bool] | None = None,
    ):
        self.tokens, self.parents, self.depths = [root], [-1], [0]
        self.kids: list[dict[int, int]] = [{}]
        self.size, self.max_depth, self.max_children = size, max_depth, max_children
        # Under a grammar: whether it accepts a path of draft tokens (root excluded).
        self.legal = legal
        self.paths: list[tuple[int, ...]] = [()]

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.size

    def allows(self, node: int, token: int) -> bool:
        """Whether the grammar (if any) accepts ``token`` after ``node``'s path: a token it
        refuses the target can never emit, so it is pruned with everything after it."""
        return self.legal is None or self.legal((*self.paths[node], token))

    def child(self, node: int, token: int) -> int | None:
        """The child of ``node`` carrying ``token``, created if there is room; else None."""
        existing = self.kids[node].get(token)
        if existing is not None:
            return existing
        if self.full or len(self.kids[node]) >= self.max_children:
            return None
        self.paths.append((*self.paths[node], token))
        self.tokens.append(token)
        self.parents.append(node)
        self.depths.append(self.depths[node] + 1)
        self.kids.append({})
        self.kids[node][token] = len(self.tokens) - 1
        return len(self.tokens) - 1


def _ranked_children(continuations, keys, rows, level, order):
    """The distinct tokens at ``level`` after ``rows`` (best first) and their row groups."""
    tokens = continuations[rows, level]
    valid = tokens >= 0
    rows, tokens = rows[valid], tokens[valid]
    if rows.size == 0:
        return []
    distinct, inverse, counts = np.unique(tokens, return_inverse=True, return_counts=True)
    latest = np.full(distinct.size, -1, dtype=np.int64)
    np.maximum.at(latest, inverse, keys[rows])
    if order == "recency":
        ranking = np.argsort(-latest, kind="stable")
    else:
        ranking = np.lexsort((-latest, -counts))
    groups = np.split(rows[np.argsort(inverse, kind="stable")], np.cumsum(counts)[:-1])
    return [(int(distinct[i]), groups[i]) for i in ranking]


def _expand(tree: _Tree, config: NgramConfig, length: int, continuations, keys, memo) -> None:
    """Breadth-first expansion of one suffix length's occurrences into ``tree``."""
    queue = deque([(0, np.arange(keys.size))])
    while queue and not tree.full:
        node, rows = queue.popleft()
        level = tree.depths[node]
        if level >= tree.max_depth:
            continue
        if node not in memo:
            memo[node] = _ranked_children(continuations, keys, rows, level, config.order)
        # Refused tokens are skipped before the breadth is counted: their room goes to the
        # next candidates.
        ranked = (c for c in memo[node] if c[0] in tree.kids[node] or tree.allows(node, c[0]))
        for token, group in itertools.islice(ranked, _breadth(config, length, level)):
            child = tree.child(node, token)
            if child is not None:
                queue.append((child, group))
            if tree.full:
                return


def _match_row(
    context: np.ndarray,
    store: _StoreView | None,
    corpus: _CorpusView | None,
    config: NgramConfig,
    bounds: tuple[int, int],
    legal: Callable[[tuple[int, ...]], bool] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """The real nodes of one request's tree: (tokens, parents, depths), root first; with
    ``legal``, only paths it accepts (:func:`match`)."""
    depth_bound, _ = bounds
    tree = _Tree(int(context[-1]), config.num_draft_tokens, depth_bound, config.max_breadth, legal)
    longest = min(config.max_depth, context.size)
    if longest < config.min_match:
        return tree.tokens, tree.parents, tree.depths
    sources = [_history_occurrences(context, longest)]
    if store is not None:
        sources.append(store.occurrences(context, longest))
    ranges = corpus.ranges(context, longest) if corpus is not None else []
    width = depth_bound
    previous, memo = None, {}
    for length in range(longest, config.min_match - 1, -1):
        span = ranges[length - 1] if length <= len(ranges) else None
        signature = (*(s.count(length) for s in sources), span)
        if signature != previous:  # a new set of occurrences: newest first, up to the cap
            previous, memo = signature, {}
            blocks, keys, room = [], [], config.max_occurrences
            for source in sources:  # history (newest) first, then the store
                chosen = source.newest(length, room)
                room -= chosen.size
                blocks.append(_forward(source.read, chosen, width))
                keys.append(source.key_base + chosen)
            if span is not None and room:
                chosen = corpus.sample(*span, room)
                blocks.append(_forward(corpus.read, chosen, width))
                keys.append(chosen)
            continuations, all_keys = np.concatenate(blocks), np.concatenate(keys)
        if all_keys.size == 0:
            continue
        _expand(tree, config, length, continuations, all_keys, memo)
        if tree.full:
            break
    return tree.tokens, tree.parents, tree.depths


def _pad(
    tokens: list[int], parents: list[int], depths: list[int], size: int, bounds: tuple[int, int]
) -> tuple[list[int], list[int], list[int]]:
    """Append the guess (if there is no real draft node) and the unreachable fillers."""
    depth_bound, fan_out = bounds
    tokens, parents, depths = list(tokens), list(parents), list(depths)
    if len(tokens) == 1 and size > 1:  # no match: guess the root token again
        tokens.append(tokens[0])
        parents.append(0)
        depths.append(1)
    if len(tokens) >= size:
        return tokens, parents, depths
    dead = len(tokens)  # a duplicate of node 1 under the root: never accepted
    tokens.append(tokens[1])
    parents.append(0)
    depths.append(1)
    hosts = deque([dead])
    placed = {dead: 0}
    while len(tokens) < size:
        if depth_bound == 1:
            host = 0  # one-level trees: more dead duplicates at the root
        else:
            assert hosts, "tree_bounds leaves room for every filler"
            host = hosts[0]
            if placed[host] == fan_out or depths[host] >= depth_bound:
                hosts.popleft()
                continue
            placed[host] += 1
        tokens.append(tokens[1])
        parents.append(host)
        depths.append(depths[host] + 1)
        placed[len(tokens) - 1] = 0
        hosts.append(len(tokens) - 1)
    return tokens, parents, depths


def match(
    history: Int[Tensor, "batch context"],
    history_len: Int[Tensor, " batch"],
    config: NgramConfig,
    *,
    store: NgramStore | None = None,
    corpus: CorpusIndex | None = None,
    legal: Callable[[int, tuple[int, ...]], bool] | None = None,
) -> NgramDraft:
    """Draft trees for a batch from n-gram matches (module docstring), on the host.

    ``history[b, :history_len[b]]`` are request ``b``'s tokens, ending with the root (the last
    verified token); ``history_len >= 1``. Returns CPU tensors: trees of ``num_draft_tokens``
    nodes, padded exactly (never-accepted fillers), and each tree's count of matched nodes.
    ``legal(b, path)`` (structured output: whether row ``b``'s grammar accepts the draft
    tokens ``path`` after the root) prunes each continuation at its first token it refuses, so
    the tree's matched nodes are all tokens the masked target can emit, and the room goes to
    the next candidates (the fillers and the no-match guess stay placeholders).
    """
    validate_ngram_config(config)
    history = history.detach().cpu().numpy()
    lengths = history_len.detach().cpu().numpy()
    batch = history.shape[0]
    if lengths.shape != (batch,) or (
        batch and (lengths.min() < 1 or lengths.max() > history.shape[1])
    ):
        raise ValueError(
            f"match: history_len must be [batch] with values in 1 .. {history.shape[1]}, got "
            f"{lengths.tolist()}"
        )
    contexts = [history[b, : lengths[b]].astype(np.int64) for b in range(batch)]
    if any((c < 0).any() for c in contexts):
        raise ValueError("match: history tokens before history_len must be >= 0")
    bounds = tree_bounds(config)
    store_view = _StoreView(store) if store is not None else None
    corpus_view = _CorpusView(corpus) if corpus is not None else None
    size = config.num_draft_tokens
    rows, counts = [], []
    for row, context in enumerate(contexts):
        row_legal = None if legal is None else functools.partial(legal, row)
        real = _match_row(context, store_view, corpus_view, config, bounds, row_legal)
        counts.append(len(real[0]))
        rows.append(_pad(*real, size, bounds))
    tokens, parents, depths = (
        torch.tensor([row[i] for row in rows], dtype=torch.int64).reshape(batch, size)
        for i in range(3)
    )
    tree = make(DraftTree, tokens=tokens, parents=parents, depths=depths)
    return make(NgramDraft, tree=tree, num_nodes=torch.tensor(counts, dtype=torch.int64))
