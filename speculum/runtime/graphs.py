"""CUDA-graph capture of pure stages, per batch-size bucket.

A stage is a pure function of records, so capturing it needs nothing from the stage itself:
:func:`capture` flattens the argument records into tensor leaves, copies them into static
buffers, warms the function up on a side stream (cuBLAS handles, Triton compilation) and records
one call into a :class:`torch.cuda.CUDAGraph`; :func:`replay` copies new arguments of the same
structure into the static buffers and replays. The records' static fields (``topk``,
``page_size``...) live in the treespec, so a call whose structure or shapes differ needs another
capture, never a silent reuse.

:class:`GraphedDecode` wraps a pipeline's whole decoding round (draft, tree, verify, accept,
commit, draft-extend: every stage, with no host work between them) and keeps one graph per
batch-size bucket. A round with a grammar, which asks the host for masks in the middle, is
recorded as several graphs cut at those asks (:func:`capture_cut`, :class:`MaskCut`). A batch
runs in the smallest bucket that holds it: its rows are copied into the first rows of the
bucket's static inputs, the rows after them read and write only the padding page
(:class:`BucketGraph`), and the real rows are taken back out of the outputs into fresh memory
that the next replay cannot overwrite, so snapshots of it stay valid.

Graphs and their static buffers are owned resources, like KV pools: a :class:`GraphedDecode`
belongs to one pipeline value and one set of resources; another pipeline value (another step
count, another algorithm) has its own and never touches this one's.

Eager-side validation (NaN logits, malformed trees) costs a host sync, which capture forbids:
it runs during the warm-up calls and is skipped inside the graph (``spec.checks.checking``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import attrs
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from speculum.state.batch import batch_size, shared_size, take_rows
from speculum.state.kv import PADDING_PAGE
from speculum.state.record import leaves_and_structure, rebuilder, replace
from speculum.state.recurrent import PADDING_SLOT

__all__ = [
    "DEFAULT_BUCKETS",
    "BucketGraph",
    "Captured",
    "GraphedDecode",
    "MaskCut",
    "NO_CACHE",
    "bucket_for",
    "capture",
    "capture_cut",
    "pad_batch",
    "replay",
    "without_cache",
]

#: Batch sizes a decoding round is captured for; a batch runs in the smallest bucket that holds it.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@attrs.define(frozen=True, slots=True, eq=False)
class Captured:
    """One recorded call: the graph, the static buffers its inputs are copied into, the
    treespec those inputs must have, and the (static, overwritten-by-each-replay) outputs,
    also kept flattened (``output_leaves``: tensors, and ``None`` where an optional field is
    empty, a constant of the graph), since every replay copies them."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[Any, ...]
    in_spec: pytree.TreeSpec
    outputs: Any
    # A round cut at its grammar masks (:class:`MaskCut`): after ``graph``, for each cut, the
    # host reads ``paths`` (the captured round's path tokens), writes the packed masks into
    # the static ``masks`` and replays the cut's graph, the rest of the round.
    cuts: tuple[tuple[Tensor, Tensor, torch.cuda.CUDAGraph], ...] = ()
    output_leaves: list[Tensor | None] = attrs.field(init=False)
    _rebuild: Callable[[Sequence[Any]], Any] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        leaves = pytree.tree_leaves(self.outputs)
        if not all(x is None or isinstance(x, Tensor) for x in leaves):
            raise TypeError(
                "a captured call must return records whose leaves are all tensors (or None)"
            )
        object.__setattr__(self, "output_leaves", leaves)
        object.__setattr__(self, "_rebuild", rebuilder(self.outputs))

    def unflatten_outputs(self, leaves: Sequence[Tensor | None]) -> Any:
        """The outputs' structure over other ``leaves`` (in ``output_leaves`` order)."""
        return self._rebuild(leaves)


def _signature(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """Each leaf's shape, dtype and device (a non-tensor leaf itself)."""
    return tuple((x.shape, x.dtype, x.device) if isinstance(x, Tensor) else x for x in leaves)


def _rows_and_signature(leaves: Sequence[Any]) -> tuple[int, tuple[Any, ...]]:
    """For a batch record's leaves (every tensor batch-major): the rows they share, and each
    leaf's shape past the rows, dtype and device (a non-tensor leaf itself), in one pass: a
    graph-replayed round computes both on every call."""
    rows, signature = set(), []
    for x in leaves:
        if isinstance(x, Tensor):
            rows.add(x.shape[0])
            signature.append((x.shape[1:], x.dtype, x.device))
        else:
            signature.append(x)
    return shared_size(rows), tuple(signature)


def capture(
    fn: Callable[..., Any], args: tuple[Any, ...], *, pool: Any = None, warmup: int = 2
) -> Captured:
    """Record ``fn(*args)`` into a CUDA graph.

    ``args`` may be any pytree of records and tensors (all on one CUDA device); ``fn`` must not
    synchronise with the host. The warm-up calls run eagerly on a side stream, with whatever
    side effects ``fn`` has (a stage writes KV slots past its inputs' sequence lengths; call it
    with arguments whose writes are harmless, e.g. rows on the padding page). ``pool`` shares
    graph memory between captures (``torch.cuda.graph_pool_handle()``).
    """
    inputs, spec, side = _warmed_up(fn, args, warmup)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn(*pytree.tree_unflatten(list(inputs), spec))
    return Captured(graph=graph, inputs=inputs, in_spec=spec, outputs=outputs)


def _warmed_up(
    fn: Callable[..., Any], args: tuple[Any, ...], warmup: int
) -> tuple[tuple[Any, ...], pytree.TreeSpec, torch.cuda.Stream]:
    """Static copies of ``args``' leaves, their treespec, and the side stream on which
    ``fn`` was called ``warmup`` times over them (cuBLAS handles, Triton compilation)."""
    leaves, spec = pytree.tree_flatten(args)
    inputs = tuple(x.clone() if isinstance(x, Tensor) else x for x in leaves)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*pytree.tree_unflatten(list(inputs), spec))
    return inputs, spec, side


def replay(captured: Captured, args: tuple[Any, ...]) -> Any:
    """Run ``captured`` on new ``args`` of the captured structure; returns its static outputs.

    The outputs are the graph's own buffers: the next replay overwrites them, so copy what must
    outlive it.
    """
    leaves, spec = pytree.tree_flatten(args)
    if spec != captured.in_spec or _signature(leaves) != _signature(captured.inputs):
        raise ValueError(
            "replay: arguments differ from the captured ones in structure, static fields, shapes "
            "or dtypes; capture again for this shape"
        )
    static = [s for s in captured.inputs if isinstance(s, Tensor)]
    copy_all(static, [v for v in leaves if isinstance(v, Tensor)])
    return _run(captured)


def _run(captured: Captured, masks: MaskCut | None = None) -> Any:
    """Replay ``captured``, its inputs already copied in; a round cut at its grammar masks
    asks ``masks`` for each cut's (one host round trip, one packed copy into the cut's static
    buffer) before replaying the graph after it."""
    captured.graph.replay()
    for paths, static_masks, graph in captured.cuts:
        assert masks is not None, "a round cut at grammar masks needs its MaskCut"
        static_masks.copy_(masks(paths), non_blocking=True)
        graph.replay()
    return captured.outputs


#: Positions of a list's tensors, one list per dtype (see :func:`copy_grouped`).
CopyGroups = list[list[int]]


def copy_groups(tensors: Sequence[Any]) -> CopyGroups:
    """The positions of ``tensors``' tensors (other entries are not copied), grouped by
    dtype: :func:`copy_grouped` copies each group at once."""
    groups: dict[torch.dtype, list[int]] = {}
    for position, tensor in enumerate(tensors):
        if isinstance(tensor, Tensor):
            groups.setdefault(tensor.dtype, []).append(position)
    return list(groups.values())


def copy_grouped(groups: CopyGroups, destinations: Sequence[Any], sources: Sequence[Any]) -> None:
    """``destinations[p].copy_(sources[p])`` for every position ``p`` of ``groups``
    (:func:`copy_groups` of either side), as one foreach copy per group.

    A round's state and outputs are ~20 small tensors each; copied one by one, they cost a
    kernel launch each, several microseconds of host time apiece on every round. Grouping them
    costs host time too, so a caller that copies between the same kinds of lists every round
    groups them once.
    """
    for positions in groups:
        torch._foreach_copy_(
            [destinations[p] for p in positions],
            [sources[p] for p in positions],
            non_blocking=True,
        )


def copy_all(destinations: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """``destinations[i].copy_(sources[i])`` for every ``i``, one foreach copy per dtype."""
    copy_grouped(copy_groups(destinations), destinations, sources)


class _BatchRows(NamedTuple):
    """A bucket graph's static buffers as a batch of some size uses them: the first rows of
    the input tensors and of the output tensors (``None`` for other leaves), each with their
    :func:`copy_groups`. Made once per batch size: slicing and grouping ~20 leaves a round cost
    more host time than the copies' launches."""

    inputs: list[Tensor | None]
    input_groups: CopyGroups
    outputs: list[Tensor | None]
    output_groups: CopyGroups


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``batch`` rows."""
    for bucket in sorted(buckets):
        if bucket >= batch:
            return bucket
    raise ValueError(
        f"a batch of {batch} requests exceeds the largest CUDA-graph bucket {max(buckets)}: "
        f"add a bucket >= {batch} (EngineConfig.graph_buckets), lower max_batch, or switch "
        "CUDA graphs off (cuda_graphs=False)"
    )


def pad_batch(state: Any, bucket: int) -> Any:
    """``state`` grown to ``bucket`` rows; the added rows repeat row 0's values but own no
    cache (see :func:`without_cache`)."""
    batch = batch_size(state)
    if batch == bucket:
        return state
    rows = torch.arange(bucket, device=state.kv.seq_lens.device)
    return without_cache(take_rows(state, torch.where(rows < batch, rows, 0)), rows >= batch)


#: What a row that owns no cache holds in its ``PagedKV`` fields: the padding page in every
#: page-table entry, an empty sequence, the padding recurrent-state slot.
NO_CACHE = {"page_table": PADDING_PAGE, "seq_lens": 0, "state_slots": PADDING_SLOT}


def without_cache(state: Any, rows: Tensor) -> Any:
    """``state`` with the rows flagged in ``rows`` (bool ``[batch]``) moved onto the padding
    page (and recurrent-state slot) with an empty sequence (:data:`NO_CACHE`): everything they
    write lands in the padding sinks and nothing they read belongs to a request."""
    kv = state.kv
    changes = {}
    for name, value in NO_CACHE.items():
        field = getattr(kv, name)
        flagged = rows.view(-1, *[1] * (field.ndim - 1))
        changes[name] = torch.where(flagged, value, field)
    return replace(state, kv=replace(kv, **changes))


@attrs.define(slots=True, eq=False)
class MaskCut:
    """The grammar callback (``SamplingParams.grammar``) a captured round is run with: one
    value per :class:`GraphedDecode`, so rounds with a grammar share their graphs (the
    scheduler's callback is new every round, and a static field keys the capture).

    Eagerly (warm-up, and between the graphs of a replay) it asks the round's own callback
    ``fill`` for the packed masks of the ``rows`` real rows (padding rows: all allowed).
    While a round is captured, each call ends the graph being recorded and starts the next:
    the path tokens asked about stay the first graph's output, and a static int32 buffer,
    which the host fills at replay, stands for the masks (:func:`capture_cut`)."""

    fill: Callable[[Tensor], Tensor] | None = None
    rows: int = 0
    words: int = 0  # a packed mask row's int32 words, as the warm-up's masks had them
    # While capturing: the graphs recorded so far, the cuts between them, the memory pool.
    recording: tuple[list[Any], list[Any], Any] | None = None

    def __call__(self, paths: Tensor) -> Tensor:
        if self.recording is not None:
            return self._cut(paths)
        assert self.fill is not None, "MaskCut called before a round set its callback"
        real = self.fill(paths[: self.rows])
        self.words = real.shape[-1]
        padding = real.new_full((paths.shape[0] - self.rows, *real.shape[1:]), -1)
        return torch.cat([real, padding])

    def _cut(self, paths: Tensor) -> Tensor:
        graphs, cuts, pool = self.recording
        graphs[-1].capture_end()
        # Allocated outside the captures and kept by the Captured: the host writes it.
        shape = (*paths.shape[:-1], self.words)
        static = torch.full(shape, -1, dtype=torch.int32, device=paths.device)
        cuts.append((paths, static))
        graphs.append(torch.cuda.CUDAGraph())
        graphs[-1].capture_begin(pool=pool)
        return static


def capture_cut(
    fn: Callable[..., Any], args: tuple[Any, ...], cut: MaskCut, *, pool: Any, warmup: int = 2
) -> Captured:
    """:func:`capture` for a round that asks ``cut`` for grammar masks: recorded as one graph
    per stretch between two asks, so that replaying it (:func:`_run`) runs every device stage
    in graphs and leaves the host one device-to-host read of the path tokens and one packed
    host-to-device copy per ask. The graphs share ``pool`` and replay in the order recorded,
    so a tensor one makes and a later one reads keeps its address."""
    inputs, spec, side = _warmed_up(fn, args, warmup)
    with torch.cuda.stream(side):
        torch.cuda.synchronize()
        graphs, cuts = [torch.cuda.CUDAGraph()], []
        cut.recording = (graphs, cuts, pool)
        graphs[0].capture_begin(pool=pool)
        try:
            outputs = fn(*pytree.tree_unflatten(list(inputs), spec))
        finally:
            cut.recording = None
            graphs[-1].capture_end()
    torch.cuda.current_stream().wait_stream(side)
    joined = tuple((paths, static, graph) for (paths, static), graph in zip(cuts, graphs[1:]))
    return Captured(graph=graphs[0], inputs=inputs, in_spec=spec, outputs=outputs, cuts=joined)


@attrs.define(slots=True, eq=False)
class GraphedDecode:
    """A pipeline's ``decode(resources, state)`` run as one CUDA graph per batch bucket.

    A drop-in value for ``Pipeline.decode``: same call, same results (the graph runs the same
    kernels on the same inputs). Graphs are captured on first use of a bucket and shape. It
    wraps a host-work round's ``Pipeline.device_round`` the same way: any pure stage whose
    input record holds the batch's ``kv`` and ``sampling``, every leaf on the device.
    """

    decode: Callable[[Any, Any], tuple[Any, Any]]
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    graphs: list[tuple[Any, Any, BucketGraph]] = attrs.field(factory=list)
    # Graph memory shared by this decode's captures; made at the first capture, so that the
    # value can be built (and checked) where no GPU is present.
    pool: Any = None
    # The grammar callback its rounds with a grammar are captured and replayed with.
    cut: MaskCut = attrs.field(factory=MaskCut)

    def __call__(self, resources: Any, state: Any) -> tuple[Any, Any]:
        """One decoding round of the wrapped pipeline over ``state`` (any batch up to the
        largest bucket); the returned records are fresh tensors, safe to keep. A round whose
        requests have a grammar (``SamplingParams.grammar``) asks the host for its masks in
        the middle: it runs as graphs cut at each ask (:func:`capture_cut`)."""
        grammar = state.sampling.grammar
        if grammar is not None:
            self.cut.fill, self.cut.rows = grammar, batch_size(state)
            state = replace(state, sampling=replace(state.sampling, grammar=self.cut))
        # Flattened once per round: this is host work on every round, and the lookup key is
        # the check replay() would repeat (structure, static fields, shapes past the rows).
        leaves, structure = leaves_and_structure((state,))
        batch, signature = _rows_and_signature(leaves)
        bucket = bucket_for(batch, self.buckets)
        key = (structure, bucket, signature)
        graph = self._graph_for(resources, state, bucket, key)
        graph.run(leaves, batch, self.cut)
        # The real rows are the static buffers' first ones (BucketGraph.run).
        return graph.fresh_outputs(batch)

    def _graph_for(self, resources: Any, state: Any, bucket: int, key: Any) -> BucketGraph:
        for owner, known, graph in self.graphs:
            if owner is resources and known == key:
                return graph
        # Warm up and capture on an all-padding copy, so the warm-up calls write only the sink.
        padded = pad_batch(state, bucket)
        dummy = without_cache(padded, torch.ones_like(padded.kv.seq_lens, dtype=torch.bool))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        round_fn = functools.partial(self.decode, resources)
        if padded.sampling.grammar is self.cut:
            captured = capture_cut(round_fn, (dummy,), self.cut, pool=self.pool)
        else:
            captured = capture(round_fn, (dummy,), pool=self.pool)
        graph = BucketGraph(captured, _cache_leaves(dummy, captured.inputs))
        self.graphs.append((resources, key, graph))
        return graph


def _cache_leaves(state: Any, inputs: Sequence[Any]) -> dict[str, Tensor]:
    """The static buffers, among ``inputs`` (``state``'s leaves copied), of the ``state.kv``
    fields a padding row must hold :data:`NO_CACHE` in, by field name."""
    leaves, _ = pytree.tree_flatten((state,))
    position = {id(x): i for i, x in enumerate(leaves)}
    return {name: inputs[position[id(getattr(state.kv, name))]] for name in NO_CACHE}


@attrs.define(slots=True, eq=False)
class BucketGraph:
    """One bucket's captured round and what the host knows of its static inputs' rows.

    A batch below its bucket is copied into the first rows of the static inputs, and the rows
    after it are left as they are: each holds some earlier round's real row, or the capture's
    padding row, whole (every leaf of a row is copied together), so a round over it reads and
    computes only valid values; what it must not do is own a cache, so its page table, length
    and recurrent-state slot are reset to the padding sink's (:func:`without_cache`) where an
    earlier, larger batch left a real request's. ``padding_from`` is the first row from which
    all rows are known to be padding: the reset is needed only when a batch shrinks below it,
    and then covers only the rows in between, so a steady batch pays the unpadded copy alone
    (:func:`pad_batch`'s gather cost a copy of every leaf and a launch per leaf).
    """

    captured: Captured
    cache_leaves: dict[str, Tensor]  # the static buffers of NO_CACHE's fields
    padding_from: int = 0  # captured on an all-padding state
    # The static buffers' first rows per batch size seen (views made and grouped once).
    _rows: dict[int, _BatchRows] = attrs.field(factory=dict)

    def run(self, leaves: Sequence[Any], batch: int, masks: MaskCut) -> None:
        """Copy ``batch`` rows of argument ``leaves`` into the static inputs, make the rows
        after them padding (as needed), and replay."""
        if batch < self.padding_from:
            for name, value in NO_CACHE.items():
                self.cache_leaves[name][batch : self.padding_from].fill_(value)
        self.padding_from = batch
        rows = self._rows_of(batch)
        copy_grouped(rows.input_groups, rows.inputs, leaves)
        _run(self.captured, masks)

    def fresh_outputs(self, batch: int) -> Any:
        """The outputs' first ``batch`` rows, in new tensors (the static outputs are
        overwritten by the next replay)."""
        rows = self._rows_of(batch)
        fresh = [x if x is None else torch.empty_like(x) for x in rows.outputs]
        copy_grouped(rows.output_groups, fresh, rows.outputs)
        return self.captured.unflatten_outputs(fresh)

    def _rows_of(self, batch: int) -> _BatchRows:
        rows = self._rows.get(batch)
        if rows is None:
            inputs = [x[:batch] if isinstance(x, Tensor) else None for x in self.captured.inputs]
            outputs = [x if x is None else x[:batch] for x in self.captured.output_leaves]
            rows = _BatchRows(inputs, copy_groups(inputs), outputs, copy_groups(outputs))
            self._rows[batch] = rows
        return rows
