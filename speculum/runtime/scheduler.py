"""The reference scheduler: continuous batching as pure functions over a state value.

``add_request``, ``cancel`` and ``step`` each take a :class:`SchedulerState` and return a new one;
the state handed in is never changed, so a snapshot is just a kept value (plus a copy of the KV
pages it points at, since the pool is the one owned resource). Requests wait until pages for their
whole budget (prompt + max_new_tokens + the pipeline's lookahead) are free, are prefilled in
chunks within a token budget per step, decode together, and leave on a stop token, a stop string,
``max_new_tokens`` or the context limit, freeing their pages.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from speculum.pipelines.base import PrefillChunk, StepOutput
from speculum.runtime.engine import Engine
from speculum.state.batch import concat_rows, take_rows
from speculum.state.kv import (
    PADDING_PAGE,
    KVPoolExhausted,
    PageAllocator,
    PagedKV,
    allocate,
    free,
    new_allocator,
)
from speculum.state.record import record, snapshot
from speculum.state.sampling import SamplingParams

__all__ = [
    "Sampling",
    "Request",
    "RequestOutput",
    "SchedulerState",
    "Snapshot",
    "new_state",
    "add_request",
    "cancel",
    "step",
    "take_snapshot",
    "restore",
    "is_idle",
    "pages_needed",
]


@attrs.define(frozen=True, slots=True, kw_only=True)
class Sampling:
    """Host-side sampling settings of one request (validated by :func:`add_request`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


@attrs.define(frozen=True, slots=True, kw_only=True)
class Request:
    """One request's host-side record: what it asked for and what it has so far.

    ``round_lengths[k]`` counts the decoding rounds that emitted ``k`` tokens (bonus included,
    before any stop condition cut the round short): the acceptance-length histogram.
    """

    rid: int
    prompt: tuple[int, ...]
    sampling: Sampling
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    output: tuple[int, ...] = ()
    pages: tuple[int, ...] = ()
    prefilled: int = 0
    num_forwards: int = 0
    round_lengths: tuple[int, ...] = ()
    finish_reason: str | None = None

    @property
    def num_rounds(self) -> int:
        """Decoding rounds this request took part in."""
        return sum(self.round_lengths)


@attrs.define(frozen=True, slots=True, kw_only=True)
class RequestOutput:
    """What one step produced for one request."""

    rid: int
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    request: Request


@record
class SchedulerState:
    """Everything the scheduler knows, as one value.

    ``batch`` is the pipeline's batch state with one row per entry of ``running``, in order
    (``None`` while nothing runs).
    """

    waiting: tuple[Request, ...]
    prefilling: tuple[Request, ...]
    running: tuple[Request, ...]
    batch: Any
    allocator: PageAllocator
    next_rid: int
    num_steps: int


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class Snapshot:
    """A scheduler state plus the contents of the KV pages it points at, by value, and the
    values of the engine's shared cells (the n-gram store; immutable, kept by reference)."""

    state: SchedulerState
    pages: torch.Tensor
    pool_pages: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    cells: tuple[Any, ...] = ()


def new_state(engine: Engine) -> SchedulerState:
    """An empty scheduler state with every KV page free."""
    return SchedulerState(
        waiting=(),
        prefilling=(),
        running=(),
        batch=None,
        allocator=new_allocator(engine.config.num_pages),
        next_rid=0,
        num_steps=0,
    )


def pages_needed(engine: Engine, prompt_len: int, max_new_tokens: int) -> int:
    """Pages reserved for a request: its whole token budget plus the pipeline's lookahead."""
    tokens = min(prompt_len + max_new_tokens, engine.config.max_context)
    return math.ceil((tokens + engine.pipeline.kv_lookahead) / engine.config.page_size)


def _validate(engine: Engine, prompt: tuple[int, ...], sampling: Sampling, max_new: int) -> None:
    vocab = engine.resources.target.config.vocab_size
    context = engine.config.max_context
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")
    bad = sorted({t for t in prompt if not 0 <= t < vocab})
    if bad:
        raise ValueError(
            f"prompt token ids {bad[:8]} are outside the vocabulary [0, {vocab}); "
            "use ids from the model's tokenizer"
        )
    if len(prompt) >= context:
        raise ValueError(
            f"prompt of {len(prompt)} tokens leaves no room in the context of {context} tokens; "
            "shorten the prompt or raise max_context"
        )
    if max_new < 1:
        raise ValueError(f"max_new_tokens={max_new}: must be at least 1")
    checks = [
        (sampling.temperature >= 0 and math.isfinite(sampling.temperature), "temperature >= 0"),
        (sampling.top_k >= 0, "top_k >= 0 (0 switches it off)"),
        (0 < sampling.top_p <= 1, "0 < top_p <= 1"),
        (0 <= sampling.min_p <= 1, "0 <= min_p <= 1"),
    ]
    for ok, rule in checks:
        if not ok:
            raise ValueError(f"invalid sampling settings {sampling}: need {rule}")
    need = pages_needed(engine, len(prompt), max_new)
    if need > engine.config.num_pages - 1:
        raise KVPoolExhausted(
            f"the request needs {need} KV pages but the pool has only "
            f"{engine.config.num_pages - 1}; lower max_new_tokens or build the engine with more "
            "KV pages"
        )


def add_request(
    engine: Engine,
    state: SchedulerState,
    prompt: list[int] | tuple[int, ...],
    *,
    sampling: Sampling | None = None,
    max_new_tokens: int = 64,
    stop_token_ids: tuple[int, ...] = (),
    stop_strings: tuple[str, ...] = (),
    ignore_eos: bool = False,
) -> tuple[SchedulerState, int]:
    """Queue a request; returns the new state and the request id.

    Raises ``ValueError`` (or :class:`KVPoolExhausted` when the request could never fit) naming
    the problem; the state handed in is unchanged either way.
    """
    prompt = tuple(int(t) for t in prompt)
    sampling = sampling or Sampling()
    _validate(engine, prompt, sampling, max_new_tokens)
    if stop_strings and engine.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; the engine was built without one")
    vocab = engine.resources.target.config.vocab_size
    sampling = attrs.evolve(sampling, top_k=min(sampling.top_k, vocab))
    stops = frozenset(stop_token_ids) | (
        frozenset() if ignore_eos else frozenset(engine.eos_token_ids)
    )
    request = Request(
        rid=state.next_rid,
        prompt=prompt,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stops,
        stop_strings=tuple(stop_strings),
    )
    new = attrs.evolve(state, waiting=(*state.waiting, request), next_rid=state.next_rid + 1)
    return new, request.rid


def cancel(engine: Engine, state: SchedulerState, rid: int) -> SchedulerState:
    """Remove request ``rid`` wherever it is and free its pages.

    Raises ``KeyError`` when no live request has that id (the state is unchanged).
    """
    for group in ("waiting", "prefilling", "running"):
        requests: tuple[Request, ...] = getattr(state, group)
        index = next((i for i, r in enumerate(requests) if r.rid == rid), None)
        if index is None:
            continue
        allocator = _free_pages(state.allocator, [requests[index]])
        state = attrs.evolve(
            state, **{group: requests[:index] + requests[index + 1 :]}, allocator=allocator
        )
        if group == "running":
            state = attrs.evolve(state, batch=_drop_rows(state.batch, len(requests), [index]))
        return state
    raise KeyError(f"no live request with id {rid}")


def _free_pages(allocator: PageAllocator, requests: list[Request]) -> PageAllocator:
    """Free every page of ``requests`` in one call (a call scans the free stack once)."""
    pages = [p for request in requests for p in request.pages]
    return free(allocator, torch.tensor(pages, dtype=torch.int64))


def _drop_rows(batch: Any, size: int, drop: list[int]) -> Any:
    dropped = set(drop)
    keep = [i for i in range(size) if i not in dropped]
    return take_rows(batch, torch.tensor(keep, dtype=torch.int64)) if keep else None


def _admit(engine: Engine, state: SchedulerState) -> SchedulerState:
    """Move waiting requests, first come first served, to prefilling while pages and slots last."""
    allocator, admitted = state.allocator, []
    room = engine.config.max_batch - len(state.prefilling) - len(state.running)
    for request in state.waiting:
        need = pages_needed(engine, len(request.prompt), request.max_new_tokens)
        if len(admitted) >= room or need > int(allocator.num_free):
            break
        allocator, pages = allocate(allocator, need)
        admitted.append(attrs.evolve(request, pages=tuple(pages.tolist())))
    return attrs.evolve(
        state,
        waiting=state.waiting[len(admitted) :],
        prefilling=(*state.prefilling, *admitted),
        allocator=allocator,
    )


def _page_table(engine: Engine, requests: tuple[Request, ...]) -> torch.Tensor:
    width = engine.config.max_pages_per_request(engine.pipeline.kv_lookahead)
    table = torch.full((len(requests), width), PADDING_PAGE, dtype=torch.int64)
    for row, request in enumerate(requests):
        table[row, : len(request.pages)] = torch.tensor(request.pages, dtype=torch.int64)
    return table


def _sampling_params(requests: tuple[Request, ...]) -> SamplingParams:
    s = [r.sampling for r in requests]
    return SamplingParams(
        temperature=torch.tensor([x.temperature for x in s], dtype=torch.float32),
        top_k=torch.tensor([x.top_k for x in s], dtype=torch.int64),
        top_p=torch.tensor([x.top_p for x in s], dtype=torch.float32),
        min_p=torch.tensor([x.min_p for x in s], dtype=torch.float32),
        seed=torch.tensor([x.seed for x in s], dtype=torch.int64),
    )


def _prefill_chunk(engine: Engine, requests: tuple[Request, ...]) -> tuple[PrefillChunk, list[int]]:
    """The next chunk of each prefilling request that fits the step's token budget."""
    budget, sizes = engine.config.prefill_budget, []
    for request in requests:
        size = min(len(request.prompt) - request.prefilled, budget)
        sizes.append(size)
        budget -= size
    chosen = tuple(r for r, n in zip(requests, sizes) if n > 0)
    sizes = [n for n in sizes if n > 0]
    tokens = torch.zeros(len(chosen), max(sizes), dtype=torch.int64)
    for row, (request, size) in enumerate(zip(chosen, sizes)):
        tokens[row, :size] = torch.tensor(request.prompt[request.prefilled :][:size])
    device = engine.device
    kv = PagedKV(
        page_table=_page_table(engine, chosen).to(device),
        seq_lens=torch.tensor([r.prefilled for r in chosen], dtype=torch.int64, device=device),
        page_size=engine.config.page_size,
    )
    after = [r.prefilled + n for r, n in zip(chosen, sizes)]
    next_tokens = [r.prompt[i] if i < len(r.prompt) else -1 for r, i in zip(chosen, after)]
    prefix = torch.full((len(chosen), max(r.prefilled for r in chosen)), -1, dtype=torch.int64)
    for row, request in enumerate(chosen):
        prefix[row, : request.prefilled] = torch.tensor(request.prompt[: request.prefilled])
    chunk = PrefillChunk(
        kv=kv,
        tokens=tokens.to(device),
        q_lens=torch.tensor(sizes, dtype=torch.int64, device=device),
        next_tokens=torch.tensor(next_tokens, dtype=torch.int64, device=device),
        sampling=_to_device(_sampling_params(chosen), device),
        prefix_tokens=prefix,  # host tensor: only host-side drafters (n-gram) read it
    )
    return chunk, sizes


def _to_device(tree: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree
    )


def _emitted(output: StepOutput) -> list[list[int]]:
    """Each row's emitted tokens, through one device-to-host copy."""
    packed = torch.cat([output.num_tokens[:, None], output.tokens], dim=1).tolist()
    return [row[1 : 1 + row[0]] for row in packed]


def _extend(engine: Engine, request: Request, tokens: list[int]) -> tuple[Request, tuple[int, ...]]:
    """Append emitted tokens one by one until a stop condition fires; returns what was kept."""
    output, reason = list(request.output), None
    for token in tokens:
        output.append(token)
        reason = _finish_reason(engine, request, output)
        if reason:
            break
    kept = tuple(output[len(request.output) :])
    return attrs.evolve(request, output=tuple(output), finish_reason=reason), kept


def _finish_reason(engine: Engine, request: Request, output: list[int]) -> str | None:
    if output[-1] in request.stop_token_ids:
        return "stop"
    if request.stop_strings:
        text = engine.tokenizer.decode(output)
        tail = max(map(len, request.stop_strings)) + 16  # only the newest text can hold a new match
        previous = engine.tokenizer.decode(output[:-1])
        if any(s in text[max(0, len(previous) - tail) :] for s in request.stop_strings):
            return "stop"
    if len(output) >= request.max_new_tokens:
        return "length"
    if len(request.prompt) + len(output) >= engine.config.max_context:
        return "length"
    return None


def _decode(engine: Engine, state: SchedulerState) -> tuple[SchedulerState, list[RequestOutput]]:
    if not state.running:
        return state, []
    batch, output = engine.pipeline.decode(engine.resources, state.batch)
    outputs, running, finished = [], [], []
    for row, (request, tokens) in enumerate(zip(state.running, _emitted(output))):
        request = attrs.evolve(
            request,
            num_forwards=request.num_forwards + 1,
            round_lengths=_count(request.round_lengths, len(tokens)),
        )
        request, kept = _extend(engine, request, tokens)
        outputs.append(_output(request, kept))
        (finished if request.finish_reason else running).append((row, request))
    allocator = _free_pages(state.allocator, [r for _, r in finished])
    batch = _drop_rows(batch, len(state.running), [row for row, _ in finished])
    state = attrs.evolve(
        state, running=tuple(r for _, r in running), batch=batch, allocator=allocator
    )
    return state, outputs


def _count(histogram: tuple[int, ...], value: int) -> tuple[int, ...]:
    padded = histogram + (0,) * (value + 1 - len(histogram))
    return padded[:value] + (padded[value] + 1,) + padded[value + 1 :]


def _output(request: Request, kept: tuple[int, ...]) -> RequestOutput:
    return RequestOutput(
        rid=request.rid,
        new_token_ids=kept,
        finished=request.finish_reason is not None,
        finish_reason=request.finish_reason,
        request=request,
    )


def _prefill(engine: Engine, state: SchedulerState) -> tuple[SchedulerState, list[RequestOutput]]:
    if not state.prefilling:
        return state, []
    chunk, sizes = _prefill_chunk(engine, state.prefilling)
    rows, first = engine.pipeline.prefill(engine.resources, chunk)
    first_tokens = _emitted(first)
    prefilling, joined, done, outputs = [], [], [], []
    for index, request in enumerate(state.prefilling):
        if index >= len(sizes):
            prefilling.append(request)
            continue
        request = attrs.evolve(
            request,
            prefilled=request.prefilled + sizes[index],
            num_forwards=request.num_forwards + 1,
        )
        if request.prefilled < len(request.prompt):
            prefilling.append(request)
            continue
        request, kept = _extend(engine, request, first_tokens[index])
        outputs.append(_output(request, kept))
        (done if request.finish_reason else joined).append((index, request))
    allocator = _free_pages(state.allocator, [r for _, r in done])
    if joined:
        new_rows = take_rows(rows, torch.tensor([i for i, _ in joined], dtype=torch.int64))
        batch = new_rows if state.batch is None else concat_rows([state.batch, new_rows])
        state = attrs.evolve(state, running=(*state.running, *(r for _, r in joined)), batch=batch)
    return attrs.evolve(state, prefilling=tuple(prefilling), allocator=allocator), outputs


def step(engine: Engine, state: SchedulerState) -> tuple[SchedulerState, list[RequestOutput]]:
    """One scheduler step: a decoding round for running requests, then admission and a prefill
    chunk for waiting ones. Returns the new state and what each touched request produced."""
    state, decoded = _decode(engine, state)
    state, prefilled = _prefill(engine, _admit(engine, state))
    return attrs.evolve(state, num_steps=state.num_steps + 1), decoded + prefilled


def is_idle(state: SchedulerState) -> bool:
    """Whether no request is waiting, prefilling or running."""
    return not (state.waiting or state.prefilling or state.running)


def _held_pages(state: SchedulerState) -> torch.Tensor:
    pages = [p for r in (*state.prefilling, *state.running) for p in r.pages]
    return torch.tensor(pages, dtype=torch.int64)


def take_snapshot(engine: Engine, state: SchedulerState) -> Snapshot:
    """The state by value: cloned tensors, and a copy of every KV page a live request holds."""
    pages = _held_pages(state)
    pool_pages = tuple(
        (pool.k[:, pages.to(pool.k.device)].clone(), pool.v[:, pages.to(pool.v.device)].clone())
        for pool in engine.resources.pools
    )
    cells = tuple(cell.value for cell in engine.resources.cells)
    return Snapshot(state=snapshot(state), pages=pages, pool_pages=pool_pages, cells=cells)


def restore(engine: Engine, snap: Snapshot) -> SchedulerState:
    """Write the snapshot's KV pages back into the pools, its values back into the shared
    cells, and return its state.

    Pages freed and reused after the snapshot was taken get their old contents back, so the
    restored state decodes exactly as it would have at snapshot time.
    """
    for pool, (k, v) in zip(engine.resources.pools, snap.pool_pages):
        index = snap.pages.to(pool.k.device)
        pool.k[:, index] = k
        pool.v[:, index] = v
    for cell, value in zip(engine.resources.cells, snap.cells):
        cell.value = value
    return snapshot(snap.state)
