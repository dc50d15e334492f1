"""Adaptive speculation: a pipeline that holds several pipeline values and runs, each round,
the one with the best measured goodput at the batch's size.

Speculation pays at small batches and can cost at large ones: a round of ``num_steps`` draft
tokens costs more than a plain step, and once the target's forward is compute-bound the extra
tree tokens are no longer free. What decides is goodput, tokens emitted per second, not the
acceptance length alone. It is kept as a pure value:

- :class:`Goodput`, the measurement record: per batch-size range (``AdaptivePolicy.ranges``)
  and per variant, decayed sums of the tokens its rounds emitted, of their requests' rounds,
  of the rounds and of their durations; per range, pooled over every variant that ran, the
  acceptance of each draft position and the host time between rounds. :func:`observe` folds
  one round in; :func:`rates` reads each variant's goodput at a batch size: tokens per
  request and round (a chain's from the pooled acceptance, when the variants' depths are
  known) times the batch, over seconds per round (charged the pooled host time).
- :func:`choose`, a pure function of that record: a variant not measured yet in the batch's
  range first (in variant order; measured means over ``samples`` requests' rounds, since one
  round's tokens vary with acceptance), otherwise the best, except that a variant within the
  exploration ``margin`` of the best that has not run for ``refresh`` rounds runs once, to keep
  its measurement fresh. It never picks a measured variant whose goodput is lower than
  another's by more than the margin. Once some range is measured throughout, a range that is
  not runs the best by :func:`estimates` (the unmeasured variants' goodput borrowed from the
  nearest such range) and measures the rest one round every ``refresh`` rounds.
- :func:`pipeline` composes the variants into one pipeline value. Its decode chooses, runs the
  chosen variant's own decode on the shared batch state and times it. Switching is choosing
  another value: nothing is backed up or restored, and every variant keeps its own CUDA graphs
  and buffers (an engine wraps each variant's decode, never the adaptive one).

The variants must share one batch state record. :func:`eagle_variants` builds chains of several
depths over one ``EagleState``, depth 0 being plain decoding that keeps the draft caught up
(``eagle.plain_round``), so a later round can speculate again. A depth-0 round is several plain
steps with one draft-extend over all of them: caught up after every step, the draft cost ~10%
of plain decoding's throughput on the H200 (an 8B target at batch 1), over the 3% that
adaptive speculation may lose.

Where measurements live. The record is shared by all requests and changes every round, so it is
not batch state: it lives in ``Resources.goodput``, a :class:`~speculum.pipelines.base.Cell`
holding a :class:`Measurements` value (the record, plus rounds whose timing is on its way) that
each round replaces. A scheduler snapshot keeps the value; restoring puts it back.

Timing. On the CPU a round is timed with ``AdaptivePolicy.clock`` around the call (the work is
done when it returns). On CUDA the call only queues work, so a round is timed with CUDA events
and its requests' token counts copied to the host without waiting
(``speculum.state.host.to_host``); a later round folds the measurement in once the events have
fired, so no host sync is added. Neither counts the scheduler's host work between rounds, which
a round pays once whatever its depth, so per token it weighs most on shallow rounds (on the
H200 at batch 1, uncounted, it made chains of 1 read 9% faster than they ran and chains of 5
0%). So each round's lap is also closed by the host clock when the next round starts: the time
from one start to the next beyond the round's own is host time between rounds, pooled per range
(like acceptance: it does not depend on the variant) and charged to every measured round. A
prefill closes the lap without a sample (its time is no round's), and a sample is capped at the
round's own duration (a pause between scheduler steps is no round's either). Under the
overlapped scheduler the next round starts while this one runs, and the host time comes out as
none, as it should: hidden host work costs nothing.

Randomness. Greedy output is plain decoding's whatever the choices. Sampled output is exactly
target-distributed: every variant is lossless and each choice depends only on earlier rounds.
Which tokens a seed yields depends on which variants ran, hence on measured times, so sampled
adaptive decoding is not reproducible from run to run (a deterministic ``clock`` makes it so on
the CPU).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from speculum.pipelines import eagle
from speculum.pipelines.base import Pipeline, Resources, StepOutput
from speculum.state.host import HostCopy, to_host

__all__ = [
    "DEFAULT_RANGES",
    "AdaptivePolicy",
    "Measured",
    "Goodput",
    "Lap",
    "Measurements",
    "accepted_per_draft_token",
    "acceptance_length",
    "host_per_round",
    "close_lap",
    "prefill",
    "validate_policy",
    "new_goodput",
    "new_measurements",
    "range_of",
    "observe",
    "rates",
    "estimates",
    "choose",
    "settle",
    "decode",
    "eagle_variants",
    "pipeline",
    "variants_of",
]

#: Upper bounds of the batch-size ranges measured apart: the CUDA-graph buckets, since a batch
#: runs padded to its bucket and costs what the bucket costs.
DEFAULT_RANGES = (1, 2, 4, 8, 16, 32, 64)


@attrs.define(frozen=True, slots=True, kw_only=True)
class AdaptivePolicy:
    """How the adaptive pipeline measures and chooses.

    ``ranges``: increasing upper bounds of the batch-size ranges measured apart (a batch of
    ``b`` requests falls in the first range ``>= b``; larger batches in the last).
    ``margin``: the exploration margin, relative to the best goodput (0.05: within 5%). A
    variant inside it still runs now and then; one below it is never chosen while measured.
    ``warmup``: rounds per range and variant that run but are not measured (the first one
    captures the variant's CUDA graph for that bucket). ``samples``: how many requests' rounds
    (a round of ``b`` requests counts ``b``) a variant's measurement needs before it counts.
    Tokens per round vary with acceptance: at batch 1, one round of a chain of 3 that accepts
    nothing reads as slower than plain decoding, and judged on it alone the best chain would
    be shut out; a large batch's round averages over its rows and is enough alone.
    ``decay``: the weight earlier rounds keep each time a variant's new round is folded in.
    ``prior``: the weight, in requests' rounds, with which each later draft token's pooled
    acceptance leans toward the acceptance of the token before it (:func:`acceptance_length`).
    ``refresh``: a variant inside the margin that has not run for this many rounds of its range
    runs once. ``expire``: a measurement this many rounds of its range old counts as none, so
    the variant is measured again (a variant once below the margin gets another chance).
    ``clock``: seconds, for timing rounds on the CPU (CUDA rounds are timed with events).
    """

    ranges: tuple[int, ...] = DEFAULT_RANGES
    margin: float = 0.05
    warmup: int = 2
    samples: int = 16
    decay: float = 0.97
    prior: float = 4.0
    refresh: int = 32
    expire: int = 1024
    clock: Callable[[], float] = time.perf_counter


@attrs.define(frozen=True, slots=True, kw_only=True)
class Measured:
    """One variant in one batch-size range.

    ``rounds`` counts its rounds folded in, warm-up included; ``tokens``, ``rows`` (requests'
    rounds), ``timed_rounds`` (rounds) and ``seconds`` are decayed sums over its measured
    rounds, which covered ``samples`` requests' rounds since the measurement began; ``last`` is
    the range's round count when it last ran.
    """

    rounds: int = 0
    samples: int = 0
    tokens: float = 0.0
    rows: float = 0.0
    timed_rounds: float = 0.0
    seconds: float = 0.0
    last: int = 0


@attrs.define(frozen=True, slots=True, kw_only=True)
class Goodput:
    """The measurement record: ``table[r][v]`` is variant ``v`` in range ``r``, ``rounds[r]``
    the rounds folded in for range ``r``. ``tried[r][i]`` and ``accepted[r][i]`` are decayed
    counts, pooled over every chain that ran in range ``r``, of requests' rounds that reached
    draft token ``i + 1`` and of those that accepted it (empty until a chain reports them).
    ``host_seconds[r]`` and ``host_rounds[r]`` are the decayed host time between rounds of range
    ``r`` and the decayed count of rounds it was measured after, pooled over every variant."""

    table: tuple[tuple[Measured, ...], ...]
    rounds: tuple[int, ...]
    tried: tuple[tuple[float, ...], ...]
    accepted: tuple[tuple[float, ...], ...]
    host_seconds: tuple[float, ...]
    host_rounds: tuple[float, ...]


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class Lap:
    """One round's measurement on its way: the range and variant it ran in, its batch's
    ``rows``, the tokens it emitted per request (on their way to the host) and its duration,
    host-timed (``seconds``) or between two CUDA events (``events``). ``started`` is the host
    clock when the round's call began; ``closed`` says the next round or a prefill has begun
    since, and ``wall`` the seconds from ``started`` to the next round's start (``None`` when a
    prefill came first)."""

    range_index: int
    variant: int
    rows: int
    tokens: HostCopy
    started: float
    seconds: float = 0.0
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    closed: bool = False
    wall: float | None = None

    def ready(self) -> bool:
        """Whether the lap is closed, the round has finished and its count has arrived (never
        blocks)."""
        return (
            self.closed and self.tokens.ready() and (self.events is None or self.events[1].query())
        )

    def host(self, seconds: float) -> float | None:
        """Host seconds between this round, which took ``seconds`` (its :meth:`duration`), and
        the next, beyond the round's own, at most ``seconds``; ``None`` when a prefill came
        between."""
        if self.wall is None:
            return None
        return min(max(self.wall - seconds, 0.0), seconds)

    def duration(self) -> float:
        """The round's seconds (call once :meth:`ready`)."""
        if self.events is None:
            return self.seconds
        return self.events[0].elapsed_time(self.events[1]) / 1e3


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class Measurements:
    """The value in ``Resources.goodput``: the record and the laps not yet folded into it."""

    goodput: Goodput
    laps: tuple[Lap, ...] = ()


def validate_policy(policy: AdaptivePolicy) -> None:
    """Raise ``ValueError`` naming every setting of ``policy`` that cannot work."""
    ranges = policy.ranges
    problems = []
    if not ranges or any(not isinstance(r, int) or r < 1 for r in ranges):
        problems.append(f"ranges={ranges!r} must be batch sizes >= 1, at least one")
    elif list(ranges) != sorted(set(ranges)):
        problems.append(f"ranges={ranges!r} must increase strictly, e.g. (1, 2, 4, 8)")
    if not 0 <= policy.margin <= 1:
        problems.append(f"margin={policy.margin!r} must lie in [0, 1] (a fraction of the best)")
    if not 0 <= policy.decay <= 1:
        problems.append(f"decay={policy.decay!r} must lie in [0, 1]")
    if not policy.prior >= 0:
        problems.append(f"prior={policy.prior!r} must be >= 0 (requests' rounds; 0: no lean)")
    for name, least in (("warmup", 0), ("samples", 1), ("refresh", 0), ("expire", 1)):
        value = getattr(policy, name)
        if not isinstance(value, int) or value < least:
            problems.append(f"{name}={value!r} must be an int >= {least}")
    if problems:
        raise ValueError("invalid adaptive policy: " + "; ".join(problems))


def new_goodput(policy: AdaptivePolicy, num_variants: int) -> Goodput:
    """A record with nothing measured."""
    row, ranges = (Measured(),) * num_variants, len(policy.ranges)
    return Goodput(
        table=(row,) * ranges,
        rounds=(0,) * ranges,
        tried=((),) * ranges,
        accepted=((),) * ranges,
        host_seconds=(0.0,) * ranges,
        host_rounds=(0.0,) * ranges,
    )


def new_measurements(policy: AdaptivePolicy, num_variants: int) -> Measurements:
    """The initial value of ``Resources.goodput`` for an adaptive pipeline of that many variants."""
    return Measurements(goodput=new_goodput(policy, num_variants))


def range_of(policy: AdaptivePolicy, batch: int) -> int:
    """Index of the batch-size range a batch of ``batch`` requests falls in."""
    return next(
        (i for i, bound in enumerate(policy.ranges) if bound >= batch), len(policy.ranges) - 1
    )


def _put(items: tuple[Any, ...], index: int, value: Any) -> tuple[Any, ...]:
    return items[:index] + (value,) + items[index + 1 :]


def _stale(goodput: Goodput, policy: AdaptivePolicy, range_index: int, m: Measured) -> bool:
    return goodput.rounds[range_index] - m.last > policy.expire


def observe(
    goodput: Goodput,
    policy: AdaptivePolicy,
    range_index: int,
    variant: int,
    tokens: float,
    seconds: float,
    rows: int = 1,
    accepted: Sequence[int] = (),
    host: float | None = None,
) -> Goodput:
    """``goodput`` with one round of ``variant`` in range ``range_index`` folded in: its
    ``rows`` requests emitted ``tokens`` tokens in ``seconds``. Warm-up rounds count but are not
    measured; a stale measurement starts again rather than decays.

    A chain round also reports ``accepted[i]``, how many of its requests accepted draft token
    ``i + 1`` (one entry per draft token; the first is tried by every request, the next by
    those that accepted the one before). These fold into the range's pooled acceptance, warm-up
    rounds included (a graph capture slows a round, not its acceptance). ``host``, the host
    seconds between this round and the next (``None``: not measured), folds into the range's
    pooled host time, warm-up rounds included too.
    """
    m = goodput.table[range_index][variant]
    now = goodput.rounds[range_index] + 1
    if m.rounds < policy.warmup:
        new = attrs.evolve(m, rounds=m.rounds + 1, last=now)
    else:
        fresh = m.samples > 0 and not _stale(goodput, policy, range_index, m)
        keep = policy.decay if fresh else 0.0
        # A round too fast for the clock still took some time: keep goodput finite.
        new = Measured(
            rounds=m.rounds + 1,
            samples=m.samples + rows if fresh else rows,
            tokens=keep * m.tokens + tokens,
            rows=keep * m.rows + rows,
            timed_rounds=keep * m.timed_rounds + 1,
            seconds=keep * m.seconds + max(seconds, 1e-9),
            last=now,
        )
    row = _put(goodput.table[range_index], variant, new)
    tried, taken = goodput.tried, goodput.accepted
    if accepted:
        reached = (rows, *accepted[:-1])
        tried = _put(tried, range_index, _fold(tried[range_index], reached, policy.decay))
        taken = _put(taken, range_index, _fold(taken[range_index], accepted, policy.decay))
    host_seconds, host_rounds = goodput.host_seconds, goodput.host_rounds
    if host is not None:
        decayed = policy.decay * host_seconds[range_index] + host
        host_seconds = _put(host_seconds, range_index, decayed)
        host_rounds = _put(host_rounds, range_index, policy.decay * host_rounds[range_index] + 1)
    return Goodput(
        table=_put(goodput.table, range_index, row),
        rounds=_put(goodput.rounds, range_index, now),
        tried=tried,
        accepted=taken,
        host_seconds=host_seconds,
        host_rounds=host_rounds,
    )


def _fold(counts: tuple[float, ...], new: Sequence[int], decay: float) -> tuple[float, ...]:
    """Decayed ``counts`` plus ``new``, position by position (the longer of the two)."""
    size = max(len(counts), len(new))
    old = (*counts, *(0.0,) * (size - len(counts)))
    add = (*new, *(0,) * (size - len(new)))
    return tuple(decay * c + n for c, n in zip(old, add))


def accepted_per_draft_token(emitted: Sequence[int], depth: int) -> list[int]:
    """How many requests of a chain round of ``depth`` draft tokens accepted each of them, from
    the tokens each request emitted (``n`` emitted: draft tokens ``1 .. n - 1`` accepted)."""
    return [sum(n >= i + 2 for n in emitted) for i in range(depth)]


def acceptance_length(
    goodput: Goodput, policy: AdaptivePolicy, range_index: int, depth: int
) -> float:
    """Tokens per request a chain of ``depth`` draft tokens emits per round, from the range's
    pooled acceptance: ``1 + sum over k <= depth of prod over i < k of p_i``. ``p_0`` is the
    share of requests that accepted draft token 1 (0 while none tried it); each later ``p_i``
    is the share of those reaching draft token ``i + 1`` that accepted it, leaning toward
    ``p_{i-1}`` with the weight of ``policy.prior`` requests' rounds:
    ``(accepted_i + prior p_{i-1}) / (tried_i + prior)``.

    Why lean: only chains that reach a draft token measure it, so while a shallower chain
    runs, the deeper tokens' counts decay and their share stays where the deeper chain left
    it, usually a stretch of low acceptance, which is why it stopped running. On the H200 at
    batch 1 the share of draft token 2 froze at 0.19 from about two requests' rounds, against
    0.5 for token 1, and the chain of 3, the best by 7%, did not run again for three passes.
    Leaning, a share whose counts have decayed follows the token before it, which every chain
    keeps measuring.
    """
    tried, taken = goodput.tried[range_index], goodput.accepted[range_index]
    length, reach, share = 1.0, 1.0, 0.0
    for i in range(depth):
        reached = tried[i] if i < len(tried) else 0.0
        accepted = taken[i] if i < len(taken) else 0.0
        lean = policy.prior if i > 0 else 0.0
        weight = reached + lean
        share = (accepted + lean * share) / weight if weight > 0 else 0.0
        reach *= share
        length += reach
    return length


def host_per_round(goodput: Goodput, range_index: int) -> float:
    """The range's pooled host seconds between rounds, per round (0 until measured)."""
    laps = goodput.host_rounds[range_index]
    return goodput.host_seconds[range_index] / laps if laps > 0 else 0.0


def rates(
    goodput: Goodput,
    policy: AdaptivePolicy,
    batch: int,
    depths: Sequence[int] | None = None,
) -> tuple[float | None, ...]:
    """Each variant's goodput (tokens per second) at a batch of ``batch`` requests, from its
    measurements in the batch's range; ``None`` for a variant not measured yet (warming up, or
    over fewer than ``samples`` requests' rounds) or whose measurement is stale.

    A variant's goodput is ``batch`` times the tokens a request gets from one of its rounds,
    over the seconds a round takes: a round costs what the range's CUDA-graph bucket costs,
    however many of its rows are filled, so a variant measured while the batch was still
    filling (requests prefilled beside the first rounds) is judged at today's batch, not at
    the fill it was measured at (at batch 64 on the H200, read as tokens per second over its
    own rows, a chain of 1 measured so read 23% below what it ran, and lost to a chain of 3 for
    good).
    Each measured round is charged the range's pooled host time between rounds
    (:func:`host_per_round`) on top of its own seconds.

    With ``depths`` (each variant's draft tokens per round, 0 for a variant without drafts),
    a chain's tokens per request and round are the acceptance length of its depth under the
    range's pooled acceptance (:func:`acceptance_length`), not its own tokens. Acceptance
    varies along a sequence and its variance is high, so tokens measured by each chain over its
    own rounds compare chains over different stretches of text; pooled, every chain's rounds
    inform every depth they reach, at the same time.
    """
    return _rates(goodput, policy, range_of(policy, batch), batch, depths)


def _rates(
    goodput: Goodput,
    policy: AdaptivePolicy,
    range_index: int,
    batch: int,
    depths: Sequence[int] | None,
) -> tuple[float | None, ...]:
    """:func:`rates` at a batch of ``batch`` from the measurements of range ``range_index``."""
    return tuple(
        None
        if m.samples < policy.samples or _stale(goodput, policy, range_index, m)
        else batch * _per_request_rate(goodput, policy, range_index, m, depths[v] if depths else 0)
        for v, m in enumerate(goodput.table[range_index])
    )


def _per_request_rate(
    goodput: Goodput, policy: AdaptivePolicy, range_index: int, m: Measured, depth: int
) -> float:
    """A measured variant's tokens per request over seconds per round: its own tokens per
    request's round, or for a chain (``depth > 0``) its depth's pooled acceptance length; a
    round's seconds are its own plus the pooled host time after it."""
    per_round = m.seconds / m.timed_rounds + host_per_round(goodput, range_index)
    if depth == 0:
        return m.tokens / m.rows / per_round
    return acceptance_length(goodput, policy, range_index, depth) / per_round


def estimates(
    goodput: Goodput, policy: AdaptivePolicy, batch: int, depths: Sequence[int] | None = None
) -> tuple[float | None, ...]:
    """Each variant's goodput at a batch of ``batch`` requests as far as the record tells:
    :func:`rates` where the batch's range has measured it, and otherwise borrowed from the
    nearest range where every variant is measured (the larger on ties), scaled by how the
    variants measured in both compare (its rates as they are where none is); ``None`` for
    the variants unmeasured here while no other range is measured throughout.

    A rarely visited range (the few rounds at each smaller batch while a batch drains, or fills
    beside prefills) would otherwise take several rounds of every variant, the slowest
    included, to measure before it could choose; borrowed, it runs what its neighbour found
    best and measures the rest now and then (:func:`choose`).
    """
    return _estimates(goodput, policy, batch, depths, rates(goodput, policy, batch, depths))


def _estimates(
    goodput: Goodput,
    policy: AdaptivePolicy,
    batch: int,
    depths: Sequence[int] | None,
    measured: tuple[float | None, ...],
) -> tuple[float | None, ...]:
    """:func:`estimates` from the batch's own ``measured`` rates (:func:`rates`)."""
    if None not in measured:
        return measured
    here = range_of(policy, batch)
    by_distance = sorted(range(len(policy.ranges)), key=lambda r: (abs(r - here), -r))
    for other in by_distance[1:]:
        borrowed = _rates(goodput, policy, other, batch, depths)
        if None in borrowed:
            continue
        both = [v for v, rate in enumerate(measured) if rate is not None]
        scale = sum(measured[v] for v in both) / sum(borrowed[v] for v in both) if both else 1.0
        return tuple(
            rate if rate is not None else scale * borrowed[v] for v, rate in enumerate(measured)
        )
    return measured


def choose(
    goodput: Goodput, policy: AdaptivePolicy, batch: int, depths: Sequence[int] | None = None
) -> int:
    """The variant to run for a batch of ``batch`` requests: a pure function of the record.

    Where the batch's range has every variant measured: the best (the lower index on ties),
    unless a variant within ``margin`` of the best has not run for more than ``refresh``
    rounds, in which case the longest-idle such variant. Goodput is read by :func:`rates`
    (with ``depths``: chains by the pooled acceptance).

    Where it has not: the first unmeasured variant, while no range is measured throughout;
    otherwise the best by :func:`estimates` (borrowed from a measured neighbour), except that
    once no unmeasured variant has run for more than ``refresh`` rounds, the longest-idle one
    runs, so the range's own measurements build up without paying for every variant at once.
    """
    index = range_of(policy, batch)
    row, now = goodput.table[index], goodput.rounds[index]
    measured = _rates(goodput, policy, index, batch, depths)
    unmeasured = [v for v, rate in enumerate(measured) if rate is None]
    if unmeasured:
        guess = _estimates(goodput, policy, batch, depths, measured)
        if None in guess:
            return unmeasured[0]
        if now - max(row[v].last for v in unmeasured) > policy.refresh:
            return min(unmeasured, key=lambda v: (row[v].last, v))  # the longest idle
        return max(range(len(guess)), key=lambda v: (guess[v], -v))
    best = max(range(len(measured)), key=lambda v: (measured[v], -v))
    floor = (1.0 - policy.margin) * measured[best]
    close = [v for v, rate in enumerate(measured) if rate >= floor]
    idle = min(close, key=lambda v: (row[v].last, v))
    return idle if now - row[idle].last > policy.refresh else best


def settle(
    measurements: Measurements, policy: AdaptivePolicy, depths: Sequence[int] | None = None
) -> Measurements:
    """Fold the laps that have arrived, in the order they ran, into the record (with
    ``depths``, a chain's lap also reports how many requests accepted each draft token)."""
    goodput, laps = measurements.goodput, measurements.laps
    while laps and laps[0].ready():
        lap, laps = laps[0], laps[1:]
        counts = lap.tokens.get().tolist()
        accepted = accepted_per_draft_token(counts, depths[lap.variant] if depths else 0)
        seconds = lap.duration()
        goodput = observe(
            goodput,
            policy,
            lap.range_index,
            lap.variant,
            sum(counts),
            seconds,
            lap.rows,
            accepted,
            lap.host(seconds),
        )
    return Measurements(goodput=goodput, laps=laps)


def close_lap(measurements: Measurements, now: float | None) -> Measurements:
    """``measurements`` with the last round's lap closed: by the next round, starting at host
    clock ``now`` (the lap's wall time measured), or by a prefill (``now=None``: not measured).
    A closed lap stays as it is."""
    if not measurements.laps or measurements.laps[-1].closed:
        return measurements
    last = measurements.laps[-1]
    wall = None if now is None else now - last.started
    closed = attrs.evolve(last, closed=True, wall=wall)
    return attrs.evolve(measurements, laps=(*measurements.laps[:-1], closed))


def _timed(
    run: Callable[[Resources, Any], tuple[Any, StepOutput]],
    resources: Resources,
    state: Any,
    clock: Callable[[], float],
    where: dict[str, int],
) -> tuple[Any, StepOutput, Lap]:
    """``run(resources, state)`` and its lap (``where``: its ``Lap`` fields ``range_index``,
    ``variant``, ``rows`` and ``started``); host-timed on the CPU, by events on CUDA."""
    if state.kv.seq_lens.device.type != "cuda":
        begin = clock()
        state, output = run(resources, state)
        seconds = clock() - begin
        tokens = to_host(output.num_tokens)
        return state, output, Lap(**where, tokens=tokens, seconds=seconds)
    stream = torch.cuda.current_stream()  # looked up once for both events
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    state, output = run(resources, state)
    tokens = to_host(output.num_tokens)
    end.record(stream)
    return state, output, Lap(**where, tokens=tokens, events=(start, end))


def decode(
    resources: Resources,
    state: Any,
    *,
    variants: tuple[Pipeline, ...],
    policy: AdaptivePolicy,
    depths: tuple[int, ...] | None = None,
) -> tuple[Any, StepOutput]:
    """One round of the variant :func:`choose` picks from the measurements in
    ``resources.goodput``, which gain the round's lap (``depths``: see :func:`pipeline`)."""
    cell = _measurements_cell(resources)
    started = policy.clock()
    # Every variant's state pages its cache; reading the size there skips a pass over the
    # state's leaves (~0.1 ms of host time per round, which all variants would pay).
    batch = state.kv.seq_lens.shape[0]
    index = range_of(policy, batch)
    variant = choose(cell.value.goodput, policy, batch, depths)
    where = {"range_index": index, "variant": variant, "rows": batch, "started": started}
    state, output, lap = _timed(variants[variant].decode, resources, state, policy.clock, where)
    # The last round's lap is folded in once this round is queued, while the device runs it:
    # before the launch, as at first, the bookkeeping delayed every round (on the H200 at batch
    # 1, a single-variant adaptive pipeline ran 0.2 ms per round behind its fixed pipeline).
    # The choice therefore reads the record up to the round before the last.
    measurements = close_lap(cell.value, started)
    cell.value = settle(attrs.evolve(measurements, laps=(*measurements.laps, lap)), policy, depths)
    return state, output


def prefill(resources: Resources, chunk: Any, *, first: Pipeline) -> tuple[Any, StepOutput]:
    """The ``first`` variant's prefill of ``chunk``, closing the last round's lap unmeasured:
    the host time a prefill takes between two rounds is neither round's."""
    cell = _measurements_cell(resources)
    cell.value = close_lap(cell.value, None)
    return first.prefill(resources, chunk)


def _measurements_cell(resources: Resources) -> Any:
    """``resources.goodput``, checked to hold the adaptive pipeline's measurements."""
    cell = resources.goodput
    if cell is None or not isinstance(cell.value, Measurements):
        raise ValueError(
            "the adaptive pipeline keeps its measurements in Resources.goodput; build the "
            "resources with goodput=Cell(adaptive.new_measurements(policy, len(variants)))"
        )
    return cell


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def eagle_variants(
    steps: Sequence[int],
    *,
    sample_drafts: bool = False,
    vocab_size: int,
    plain_tokens: int | None = None,
) -> tuple[Pipeline, ...]:
    """EAGLE-family chains of each draft depth in ``steps``, in increasing order, over one
    ``EagleState`` (their carried prediction keeps one candidate); depth 0 is
    ``eagle.plain_pipeline``, rounds of ``plain_tokens`` plain steps (default: as many tokens
    as the deepest chain's round emits at most, so it reserves no more cache). ``sample_drafts``
    and ``vocab_size`` are ``eagle.round_config``'s.
    """
    steps = tuple(steps)
    if not steps:
        raise ValueError("adaptive speculation needs at least one draft depth, e.g. (0, 1, 3, 5)")
    bad = [s for s in steps if not _is_int(s) or s < 0]
    if bad:
        raise ValueError(f"adaptive draft depths must be ints >= 0 (0: no drafts), got {bad}")
    twice = sorted({s for s in steps if steps.count(s) > 1})
    if twice:
        raise ValueError(f"adaptive draft depths {twice} are listed more than once; list each once")
    plain_tokens = max(steps) + 1 if plain_tokens is None else plain_tokens
    return tuple(
        eagle.plain_pipeline(num_tokens=plain_tokens)
        if s == 0
        else eagle.pipeline(num_steps=s, sample_drafts=sample_drafts, vocab_size=vocab_size)
        for s in sorted(steps)
    )


def pipeline(
    variants: Sequence[Pipeline],
    *,
    policy: AdaptivePolicy | None = None,
    depths: Sequence[int] | None = None,
) -> Pipeline:
    """The adaptive pipeline value over ``variants``, which must share one batch state record
    (prefill is the first variant's, which also closes the last round's lap). It may emit and
    write as much as its largest variant; its decode runs host code (the choice), so it is
    never captured whole.

    ``depths`` (one per variant: its draft tokens per round, 0 for none) says the variants are
    chains of one draft, whose first ``k`` draft tokens are accepted alike at every depth
    (:func:`eagle_variants`'s are): their goodput is then read from the acceptance pooled over
    all of them (:func:`rates`). Without it, each variant is judged by its own tokens.
    """
    variants, policy = tuple(variants), policy or AdaptivePolicy()
    if not variants:
        raise ValueError("an adaptive pipeline needs at least one variant")
    validate_policy(policy)
    if depths is not None:
        depths = tuple(depths)
        if len(depths) != len(variants) or not all(_is_int(d) and d >= 0 for d in depths):
            raise ValueError(
                f"depths={depths!r} must give each of the {len(variants)} variants its draft "
                "tokens per round, an int >= 0 (0: no drafts)"
            )
    return Pipeline(
        name="adaptive",
        prefill=functools.partial(prefill, first=variants[0]),
        decode=functools.partial(decode, variants=variants, policy=policy, depths=depths),
        max_tokens_per_step=max(v.max_tokens_per_step for v in variants),
        kv_lookahead=max(v.kv_lookahead for v in variants),
        host_work=True,
    )


def variants_of(pipeline: Pipeline) -> tuple[Pipeline, ...]:
    """The variants an adaptive pipeline value (:func:`pipeline`) chooses among, in order."""
    return pipeline.decode.keywords["variants"]
