"""The server's Prometheus series, named in vLLM's style with a ``speculum:`` prefix.

One :class:`Metrics` per server, on its own registry (so that several servers in one process,
as in the tests, do not share series). The engine loop updates them after every step; ``GET
/metrics`` renders them in Prometheus' text format.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from speculum.runtime import scheduler
from speculum.state.prefix import reclaimable

__all__ = ["Metrics"]

# No ``*_created`` sample per counter and histogram (as vLLM): a scraper reads the counts.
disable_created_metrics()

#: Time-to-first-token buckets, seconds (vLLM's).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
#: Inter-token-latency buckets, seconds (vLLM's, with two finer ones below).
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
#: End-to-end latency buckets, seconds.
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class Metrics:
    """Every series of ``GET /metrics`` (``docs/serving.md`` lists them), for an engine
    decoding with ``algorithm`` over ``num_pages`` KV pages (page 0, the padding page, not
    counted)."""

    def __init__(self, algorithm: str, num_pages: int) -> None:
        self.registry = CollectorRegistry()
        self.algorithm = algorithm
        r = self.registry
        self.running = Gauge(
            "speculum:num_requests_running", "Requests prefilling or decoding.", registry=r
        )
        self.waiting = Gauge(
            "speculum:num_requests_waiting", "Requests waiting to be admitted.", registry=r
        )
        self.pages_used = Gauge(
            "speculum:kv_pages_used", "KV-cache pages held by live requests.", registry=r
        )
        self.pages_total = Gauge(
            "speculum:kv_pages_total", "KV-cache pages requests may hold.", registry=r
        )
        self.usage = Gauge(
            "speculum:kv_cache_usage_perc", "Fraction of the KV pages in use (0 to 1).", registry=r
        )
        self.prompt_tokens = Counter(
            "speculum:prompt_tokens", "Prompt tokens of admitted requests.", registry=r
        )
        self.prefix_queries = Counter(
            "speculum:prefix_cache_queries",
            "Prompt tokens of prefilled requests, each looked up in the prefix cache.",
            registry=r,
        )
        self.prefix_hits = Counter(
            "speculum:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their prefill skipped).",
            registry=r,
        )
        self.prefix_pages = Gauge(
            "speculum:prefix_cache_pages",
            "KV pages the prefix cache holds, reclaimable ones included.",
            registry=r,
        )
        self.generation_tokens = Counter(
            "speculum:generation_tokens", "Tokens generated.", registry=r
        )
        self.finished = Counter(
            "speculum:request_success",
            "Requests finished, by reason (stop, length, error, abort: cancelled).",
            ["finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "speculum:time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "speculum:inter_token_latency_seconds",
            "Between two successive steps that gave a request tokens (a speculative round may "
            "give several at once).",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "speculum:e2e_request_latency_seconds",
            "From the request's arrival to its last token.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        labels = ["algorithm"]
        self.rounds = Counter(
            "speculum:spec_decode_num_drafts",
            "Decoding rounds (one verify step each).",
            labels,
            registry=r,
        )
        self.emitted = Counter(
            "speculum:spec_decode_num_emitted_tokens",
            "Tokens emitted by decoding rounds, bonus tokens included.",
            labels,
            registry=r,
        )
        self.accepted = Counter(
            "speculum:spec_decode_num_accepted_tokens",
            "Draft tokens accepted by decoding rounds.",
            labels,
            registry=r,
        )
        self.accepted_per_pos = Counter(
            "speculum:spec_decode_num_accepted_tokens_per_pos",
            "Rounds whose draft token at this position (0 = the first) was accepted.",
            ["algorithm", "position"],
            registry=r,
        )
        self.accept_length = Gauge(
            "speculum:spec_accept_length",
            "Mean tokens emitted per decoding round since the start, bonus included (SGLang's "
            "acceptance length; vLLM's mean acceptance length is one less).",
            labels,
            registry=r,
        )
        self.pages_total.set(num_pages - 1)
        self._num_pages = num_pages - 1
        self._rounds = self._emitted = 0

    def observe_state(self, state: scheduler.SchedulerState) -> None:
        """The gauges of a state: requests running and waiting, KV pages in use (cached pages
        no request holds are reclaimable, so not in use), pages the prefix cache holds."""
        self.running.set(len(state.running) + len(state.prefilling))
        self.waiting.set(len(state.waiting))
        used = self._num_pages - int(state.allocator.num_free) - reclaimable(state.prefix)
        self.pages_used.set(used)
        self.usage.set(used / max(self._num_pages, 1))
        self.prefix_pages.set(len(state.prefix.cached))

    def observe_prefill(self, request: scheduler.Request) -> None:
        """Count a request whose prefill is done in the prefix cache's queries and hits."""
        self.prefix_queries.inc(len(request.prompt))
        self.prefix_hits.inc(request.cached_tokens)

    def observe_rounds(self, before: Sequence[int], after: Sequence[int]) -> None:
        """Count the decoding rounds one step added to a request's acceptance-length histogram
        (``Request.round_lengths``, ``before`` and ``after`` the step)."""
        label = self.algorithm
        for length in range(1, len(after)):
            rounds = after[length] - (before[length] if length < len(before) else 0)
            if rounds <= 0:
                continue
            self._rounds += rounds
            self._emitted += rounds * length
            self.rounds.labels(label).inc(rounds)
            self.emitted.labels(label).inc(rounds * length)
            self.accepted.labels(label).inc(rounds * (length - 1))
            for position in range(length - 1):
                self.accepted_per_pos.labels(label, str(position)).inc(rounds)
        if self._rounds:
            self.accept_length.labels(label).set(self._emitted / self._rounds)

    def render(self) -> bytes:
        """Every series in Prometheus' text format."""
        return generate_latest(self.registry)
