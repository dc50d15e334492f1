"""The one engine loop: a thread that owns the scheduler state and steps it.

HTTP handlers never touch the state. They :meth:`EngineLoop.submit` a job's requests with a
:class:`Channel` and :meth:`EngineLoop.cancel` it; both are commands on a queue that the loop
applies between two steps (``scheduler.add_request``, ``scheduler.cancel``), so a request is
admitted at the next step whatever the others are doing. After each step the loop posts every
``scheduler.RequestOutput`` to its request's channel, which hands it to the handler's event
loop. The number of live requests is bounded (``max_live``): a submission beyond it is refused
at once with :class:`QueueFull`, instead of growing a queue without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from speculum.runtime import scheduler
from speculum.runtime.engine import Engine
from speculum.serving.metrics import Metrics
from speculum.state.kv import KVPoolExhausted

__all__ = ["Admitted", "Channel", "EngineLoop", "Emitted", "Failed", "QueueFull", "Ticket"]

_log = logging.getLogger("speculum.serve")


class QueueFull(Exception):
    """The server holds as many live requests as it may; try again later (HTTP 429)."""


@attrs.define(frozen=True, slots=True)
class Admitted:
    """Every request of the job was added to the scheduler."""


@attrs.define(frozen=True, slots=True)
class Emitted:
    """One step's output of the job's request ``index``."""

    index: int
    output: scheduler.RequestOutput


@attrs.define(frozen=True, slots=True)
class Failed:
    """The job failed: refused by ``add_request`` (``status`` 400) or the engine's step raised
    (500); none of its requests is live any more."""

    message: str
    status: int


class Channel:
    """Where one HTTP request's events go: an ``asyncio.Queue`` of the handler's event loop,
    fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()

    def put(self, event: Admitted | Emitted | Failed) -> None:
        """Hand ``event`` to the handler (thread-safe); dropped once its event loop closed."""
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody listens
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@attrs.define(eq=False, slots=True)
class Ticket:
    """A submitted job: its requests (prompt ids and ``add_request``'s keyword arguments), its
    channel and when it arrived (``time.perf_counter``)."""

    requests: tuple[tuple[tuple[int, ...], Mapping[str, Any]], ...]
    channel: Channel
    arrived: float


@attrs.define(slots=True)
class _Live:
    """A live request's ticket, index in its job, last-token time and acceptance histogram."""

    ticket: Ticket
    index: int
    last_token_at: float | None = None
    round_lengths: tuple[int, ...] = ()


class EngineLoop:
    """The thread that owns ``engine``'s scheduler state (see the module's docstring).

    At most ``max_live`` requests are live (submitted and not finished) at once. ``metrics``
    is updated after every step.
    """

    def __init__(self, engine: Engine, *, max_live: int, metrics: Metrics) -> None:
        self.engine, self.max_live, self.metrics = engine, max_live, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live_count = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="speculum-engine", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def submit(
        self, requests: Sequence[tuple[tuple[int, ...], Mapping[str, Any]]], channel: Channel
    ) -> Ticket:
        """Queue a job's requests; raises :class:`QueueFull` when they would make more than
        ``max_live`` live requests. The channel then receives :class:`Admitted` or
        :class:`Failed`, then each request's outputs."""
        with self._lock:
            if self._live_count + len(requests) > self.max_live:
                raise QueueFull(
                    f"the server is full: {self._live_count} requests are live and it holds at "
                    f"most {self.max_live} (--max-batch plus --max-queue); retry later"
                )
            self._live_count += len(requests)
        ticket = Ticket(requests=tuple(requests), channel=channel, arrived=time.perf_counter())
        self._inbox.put(("add", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Cancel the job's requests still live (nothing when all have finished); their pages
        are freed before the next step."""
        self._inbox.put(("cancel", ticket))

    def stop(self, timeout: float | None = None) -> None:
        """Finish every live request, then end the thread (waiting up to ``timeout`` s)."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    def _release(self, count: int) -> None:
        with self._lock:
            self._live_count -= count

    def _run(self) -> None:
        state = scheduler.new_state(self.engine)
        live: dict[int, _Live] = {}
        while not (self._stopping and scheduler.is_idle(state)):
            try:
                state = self._iterate(state, live)
            except Exception as err:  # the engine itself failed: every live job fails
                _log.exception("the engine loop failed; failing every live request")
                state = self._fail_all(live, f"the engine failed: {err}")

    def _iterate(
        self, state: scheduler.SchedulerState, live: dict[int, _Live]
    ) -> scheduler.SchedulerState:
        """Apply the queued commands (waiting for one when idle), then step once."""
        for command, ticket in self._commands(block=scheduler.is_idle(state)):
            state = self._apply(state, live, command, ticket)
        if not scheduler.is_idle(state):
            state, outputs = scheduler.step(self.engine, state)
            self._dispatch(live, outputs)
        self.metrics.observe_state(state)
        return state

    def _commands(self, block: bool) -> list[tuple[str, Ticket | None]]:
        """The queued commands; waits for one when ``block``."""
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(
        self,
        state: scheduler.SchedulerState,
        live: dict[int, _Live],
        command: str,
        ticket: Ticket | None,
    ) -> scheduler.SchedulerState:
        if command == "stop":
            self._stopping = True
        elif command == "add":
            state = self._add(state, live, ticket)
        elif command == "cancel":
            rids = [rid for rid, entry in live.items() if entry.ticket is ticket]
            for rid in rids:
                state = scheduler.cancel(self.engine, state, rid)
                del live[rid]
                self.metrics.finished.labels("abort").inc()
            self._release(len(rids))
        return state

    def _add(
        self, state: scheduler.SchedulerState, live: dict[int, _Live], ticket: Ticket
    ) -> scheduler.SchedulerState:
        """Add every request of ``ticket``, or none of them (a refused one fails the job)."""
        added = state
        try:
            rids = []
            for prompt, settings in ticket.requests:
                added, rid = scheduler.add_request(self.engine, added, prompt, **settings)
                rids.append(rid)
        except (TypeError, ValueError, KVPoolExhausted) as err:
            self._release(len(ticket.requests))  # before the answer: a client may resubmit at once
            ticket.channel.put(Failed(str(err), 400))
            return state
        for index, (rid, (prompt, _)) in enumerate(zip(rids, ticket.requests)):
            live[rid] = _Live(ticket=ticket, index=index)
            self.metrics.prompt_tokens.inc(len(prompt))
        ticket.channel.put(Admitted())
        return added

    def _dispatch(self, live: dict[int, _Live], outputs: list[scheduler.RequestOutput]) -> None:
        """Post each output to its request's channel, and count it in the metrics."""
        now = time.perf_counter()
        for output in outputs:
            entry = live.get(output.rid)
            if entry is None:  # cancelled meanwhile
                continue
            if output.new_token_ids:
                if not entry.last_token_at:  # its first token: its prefill is done
                    self.metrics.observe_prefill(output.request)
                since = entry.last_token_at or entry.ticket.arrived
                (self.metrics.itl if entry.last_token_at else self.metrics.ttft).observe(
                    now - since
                )
                entry.last_token_at = now
                self.metrics.generation_tokens.inc(len(output.new_token_ids))
            self.metrics.observe_rounds(entry.round_lengths, output.request.round_lengths)
            entry.round_lengths = output.request.round_lengths
            if output.finished:
                # Released before its last output is posted: a client that has its answer may
                # submit the next request at once and find the room this one leaves.
                del live[output.rid]
                self._release(1)
                self.metrics.finished.labels(output.finish_reason).inc()
                self.metrics.e2e.observe(now - entry.ticket.arrived)
            entry.ticket.channel.put(Emitted(entry.index, output))

    def _fail_all(self, live: dict[int, _Live], message: str) -> scheduler.SchedulerState:
        """Fail every live job and start over from an empty state."""
        tickets = {id(e.ticket): e.ticket for e in live.values()}
        self._release(len(live))  # before the answers, as for finished requests
        for ticket in tickets.values():
            ticket.channel.put(Failed(message, 500))
        for _ in live:
            self.metrics.finished.labels("error").inc()
        live.clear()
        return scheduler.new_state(self.engine)
