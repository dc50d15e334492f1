"""The reference scheduler: continuous batching as pure functions over a state value.

``add_request``, ``cancel`` and ``step`` each take a :class:`SchedulerState` and return a new one;
the state handed in is never changed, so a snapshot is just a kept value (plus a copy of the KV
pages it points at, since the pool is the one owned resource). Because the pool holds one state's
pages, one state value at a time owns the engine and may step it (:func:`new_state`).

Requests wait until pages for their whole budget (prompt + max_new_tokens + the pipeline's
lookahead) are free, are prefilled in chunks within a token budget per step, decode together, and
leave on a stop token, a stop string, ``max_new_tokens`` or the context limit, freeing their
pages. With the prefix cache (``EngineConfig.prefix_cache``), a request whose prompt starts with
full pages an earlier prompt filled points its page table at them and is prefilled from there;
a finished request's cached pages stay in the index, reclaimable (``docs/prefix_cache.md``).

A step launches device work (a decoding round, a prefill chunk) and collects what it emitted:
the host reads the tokens, checks stop conditions and retires finished requests. Synchronously,
each launch is collected at once. Overlapped (``EngineConfig.overlap``), a step collects the
previous step's launches after launching its own round, so the host's work for step ``t + 1``
(collecting step ``t``, admission, the next prefill chunk) runs while the device computes round
``t + 1``'s predecessor. The next round needs no token the host has not read yet: its inputs are
the batch state's device tensors, the placeholders of tokens still being computed. A request
that finished is therefore retired one step late, and the round it ran meanwhile is dropped.
Both paths run the same functions; only the moment of collection differs.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from speculum.pipelines.base import Pipeline, PrefillChunk, StepOutput
from speculum.runtime import checks
from speculum.runtime import grammar as structured
from speculum.runtime.engine import Engine
from speculum.runtime.mla_kernel import planned_round
from speculum.spec.sampling import describe_faults
from speculum.state.batch import concat_rows, take_rows
from speculum.state.host import HostCopy, to_device, to_host
from speculum.state.kv import (
    PADDING_PAGE,
    KVPoolExhausted,
    PageAllocator,
    PagedKV,
    allocate,
    free,
    new_allocator,
)
from speculum.state.prefix import (
    PrefixIndex,
    acquire,
    block_keys,
    evict,
    forget_holders,
    lookup,
    reclaimable,
    register,
    release,
)
from speculum.state.record import record, replace, snapshot, tree_map_tensors
from speculum.state.sampling import Penalties, SamplingParams, TokenLogprobs

#: Owner tokens (:func:`new_state`): unique in the process, so a state can only ever match the
#: engine whose latest claim it carries.
_TOKENS = itertools.count(1)

__all__ = [
    "GREEDY_BELOW",
    "Sampling",
    "TokenLogprob",
    "Request",
    "RequestOutput",
    "SchedulerState",
    "Snapshot",
    "Launched",
    "new_state",
    "add_request",
    "cancel",
    "step",
    "take_snapshot",
    "restore",
    "is_idle",
    "pages_needed",
    "pages_reserved",
    "host_stats",
    "warm_up",
]


#: Temperatures below this decode greedily, as vLLM does: ``logits / temperature`` would
#: approach float32's range, and the draws would be the argmax anyway.
GREEDY_BELOW = 1e-5


def _temperature(value: object) -> float:
    """A checked temperature, with those below :data:`GREEDY_BELOW` made greedy (0.0)."""
    temperature = checks.real("temperature", value, low=0.0)
    return 0.0 if temperature < GREEDY_BELOW else temperature


#: The largest logit bias, either way (OpenAI's and vLLM's range): -100 bans a token in
#: practice, +100 all but forces it.
MAX_LOGIT_BIAS = 100.0


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A checked logit bias as sorted ``(token_id, bias)`` pairs: ``{token_id: bias}`` with
    ids as ints or decimal strings (OpenAI's JSON keys), each bias a number in [-100, 100];
    None is none. The vocabulary bound is checked by ``add_request``, which knows it."""
    if value is None:
        return ()
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)  # the stored form, as attrs.evolve hands it back
    if not isinstance(value, Mapping):
        raise TypeError(
            f"logit_bias={value!r}: must map token ids to biases, e.g. {{5: -100.0}}, not "
            f"{type(value).__name__}"
        )
    pairs = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdecimal() else key
        token = checks.integer(f"logit_bias key {key!r}", token, minimum=0)
        pairs[token] = checks.real(
            f"logit_bias[{token}]", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS
        )
    return tuple(sorted(pairs.items()))


def _prompt_logprobs(value: object) -> int | None:
    """A checked ``prompt_logprobs``: None (none asked for) or an integer >= 0."""
    return None if value is None else checks.integer("prompt_logprobs", value, minimum=0)


#: The largest presence or frequency penalty, either way (OpenAI's and vLLM's range).
MAX_PENALTY = 2.0


@attrs.define(frozen=True, slots=True, kw_only=True)
class Sampling:
    """Host-side sampling settings of one request, checked when built.

    ``temperature`` 0 is greedy, and so is any temperature below :data:`GREEDY_BELOW`
    (1e-5; stored as 0.0). ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 switch those filters off.
    ``seed`` keys the request's 64-bit random streams: any integer that fits int64 (negative
    seeds are hashed as two's complement). Refused with ``TypeError``: a float, a bool or
    ``None`` for ``top_k`` or ``seed``, a non-number for the others; with ``ValueError``: a
    value out of range, or one that leaves its range once rounded to float32 (the dtype
    sampling runs in: ``temperature=1e39`` becomes inf, ``top_p=1e-50`` becomes 0).

    ``logprobs`` N > 0 asks for each generated token's log-probability and the N most likely
    tokens of the distribution it was decided by (:class:`TokenLogprob`; the engine must be
    built with ``max_logprobs >= N``); 0 asks for none. The distribution is the target's, in
    float32, divided by the temperature (greedy requests: as it is), before top-k, top-p and
    min-p truncation, and the same whatever the pipeline (``docs/request_controls.md``).

    ``logit_bias`` ``{token_id: bias}`` (OpenAI's and vLLM's) adds ``bias``, in [-100, 100],
    to the target's logit of that token before the temperature, the filters and the
    log-probabilities, at every position; stored as sorted ``(token_id, bias)`` pairs. The
    engine must be built with ``logit_bias=True``.

    ``repetition_penalty`` (> 0, 1 is off; transformers' and vLLM's) divides the positive
    logits and multiplies the negative ones of every token of the prompt and of the output so
    far; ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], 0 is off; OpenAI's) are
    subtracted from the logit of every token of the output, once and once per occurrence.
    ``min_tokens`` bans the request's stop tokens (EOS unless ignored, ``stop_token_ids``)
    until that many tokens have been generated, and no stop string ends it before then
    (at most ``max_new_tokens``, checked by ``add_request``). All apply after the logit bias
    and before the temperature, at every tree node and draft position as plain decoding
    would apply them to the same prefix (``docs/request_controls.md``); the engine must be
    built with ``penalties=True`` unless they are off.

    ``prompt_logprobs`` N (vLLM's; None, the default, asks for none) returns, for each prompt
    token but the first, its log-probability given the tokens before it and the N most likely
    tokens there (``Request.prompt_logprobs``; 0: the token's own value alone), under the
    target's raw distribution (no temperature, bias, penalty or grammar), from the prefill's
    logits; such a request is prefilled in full, never from the prefix cache.

    ``json_schema`` (a JSON string or a dict), ``regex`` or ``grammar`` (xgrammar's EBNF), at
    most one, constrain the output to that language (``runtime.grammar``): at each position
    the tokens the grammar forbids get ``-inf`` before anything reads the logits, and the
    request ends once the grammar has accepted EOS. Checked when built (``ValueError`` naming
    the field and the parser's reason); the engine needs a tokenizer and a model with an EOS
    token (``docs/request_controls.md``).
    """

    temperature: float = attrs.field(default=0.0, converter=_temperature)
    top_k: int = attrs.field(default=0, converter=checks.converter(checks.integer, minimum=0))
    top_p: float = attrs.field(
        default=1.0, converter=checks.converter(checks.real, low=0.0, high=1.0, open_low=True)
    )
    min_p: float = attrs.field(
        default=0.0, converter=checks.converter(checks.real, low=0.0, high=1.0)
    )
    seed: int = attrs.field(
        default=0,
        converter=checks.converter(
            checks.integer,
            minimum=checks.INT64_MIN,
            maximum=checks.INT64_MAX,
            fix="seeds key 64-bit random streams; reduce it, e.g. seed % 2**63",
        ),
    )
    logprobs: int = attrs.field(default=0, converter=checks.converter(checks.integer, minimum=0))
    prompt_logprobs: int | None = attrs.field(default=None, converter=_prompt_logprobs)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    repetition_penalty: float = attrs.field(
        default=1.0, converter=checks.converter(checks.real, low=0.0, open_low=True)
    )
    presence_penalty: float = attrs.field(
        default=0.0,
        converter=checks.converter(checks.real, low=-MAX_PENALTY, high=MAX_PENALTY),
    )
    frequency_penalty: float = attrs.field(
        default=0.0,
        converter=checks.converter(checks.real, low=-MAX_PENALTY, high=MAX_PENALTY),
    )
    min_tokens: int = attrs.field(default=0, converter=checks.converter(checks.integer, minimum=0))
    json_schema: str | None = attrs.field(
        default=None, converter=functools.partial(structured.check, "json_schema")
    )
    regex: str | None = attrs.field(
        default=None, converter=functools.partial(structured.check, "regex")
    )
    grammar: str | None = attrs.field(
        default=None, converter=functools.partial(structured.check, "grammar")
    )

    def __attrs_post_init__(self) -> None:
        given = [f for f in structured.GRAMMAR_FIELDS if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(
                f"{' and '.join(given)} are all set: a request follows one grammar; keep one"
            )

    @property
    def constrained(self) -> tuple[str, str] | None:
        """The request's grammar as ``(field, text)`` (``json_schema``, ``regex`` or
        ``grammar``), or None when its output is free."""
        return next(
            ((f, getattr(self, f)) for f in structured.GRAMMAR_FIELDS if getattr(self, f)), None
        )

    @property
    def penalized(self) -> bool:
        """Whether any penalty or ``min_tokens`` is on (the engine must apply them)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 0
        )


@attrs.define(frozen=True, slots=True, kw_only=True)
class TokenLogprob:
    """One generated token's log-probability under the target's distribution that decided it
    (:class:`Sampling` says which), and that distribution's ``top_logprobs``: the request's
    ``logprobs`` most likely ``(token_id, logprob)`` pairs, most likely first."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


@attrs.define(frozen=True, slots=True, kw_only=True)
class Request:
    """One request's host-side record: what it asked for and what it has so far.

    ``round_lengths[k]`` counts the decoding rounds that emitted ``k`` tokens (bonus included,
    before any stop condition cut the round short): the acceptance-length histogram. A request
    the engine could not decode finishes with ``finish_reason == "error"`` and ``error`` saying
    why (its id and the cause). ``logprobs`` holds one :class:`TokenLogprob` per token of
    ``output`` when the request asked for them (``Sampling.logprobs > 0``), else nothing.
    ``output`` holds every token emitted up to the one that completed a stop string (vLLM's
    ``token_ids`` too); ``include_stop_str_in_output`` says whether the request's text keeps
    the stop string (``generate``'s ``Generation.text`` ends before it unless so).
    ``pages`` are its page-table entries (page ``j`` holds tokens ``j * page_size`` on); an
    entry of ``PADDING_PAGE`` is one let go of, wholly outside the sliding window of every
    later query (``Engine.kv_window``).
    ``state_slot`` is its slot in a hybrid model's recurrent pool, held like its ``pages``
    while it is admitted (0, the padding slot, otherwise and for models without one).
    ``cached_tokens`` counts the prompt tokens whose KV pages came from the prefix cache
    (their prefill was skipped).
    ``constraint`` is the request's grammar compiled for the engine (``Sampling.json_schema``,
    ``regex``, ``grammar``), or None. ``prompt_logprobs`` holds, when the request asked for
    them (``Sampling.prompt_logprobs``), one entry per prompt token prefilled so far: None for
    the first, then each token's :class:`TokenLogprob` given the tokens before it.
    """

    rid: int
    prompt: tuple[int, ...]
    sampling: Sampling
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    include_stop_str_in_output: bool = False
    output: tuple[int, ...] = ()
    pages: tuple[int, ...] = ()
    state_slot: int = 0
    prefilled: int = 0
    cached_tokens: int = 0
    num_forwards: int = 0
    round_lengths: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    constraint: structured.Constraint | None = None

    @property
    def num_rounds(self) -> int:
        """Decoding rounds this request took part in."""
        return sum(self.round_lengths)


@attrs.define(frozen=True, slots=True, kw_only=True)
class RequestOutput:
    """What one step produced for one request (``error``: why it could not be decoded, when
    ``finish_reason == "error"``)."""

    rid: int
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    request: Request
    error: str | None = None


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class Launched:
    """Device work launched and not collected yet: the ids of the requests of its rows, in row
    order, and each row's ``[num_tokens, faults, tokens...]`` on its way to the host (one copy:
    the fault status travels with the tokens, costing no sync of its own). ``decode`` marks a
    decoding round (a prefill chunk emits each row's first token), ``plain_steps`` a round of
    plain steps (``StepOutput.plain_steps``: a round per token in the statistics).
    ``num_top`` is how many top alternatives each token's log-probabilities carry when they
    travel in the same copy (:func:`_launched`), ``None`` when they do not. ``launched_at``
    and ``blocked_before`` (the state's ``blocked_seconds`` then) date the launch on the host
    clock, for the hidden-host-time statistic."""

    rids: tuple[int, ...]
    tokens: HostCopy
    decode: bool
    plain_steps: bool
    num_top: int | None
    launched_at: float
    blocked_before: float


@record
class SchedulerState:
    """Everything the scheduler knows, as one value.

    ``batch`` is the pipeline's batch state with one row per entry of ``running``, in order
    (``None`` while nothing runs). Overlapped, ``in_flight`` is the previous step's device work,
    collected by the next step; ``running`` then includes requests whose last tokens are still
    in flight, and ``batch`` is one round ahead of what the requests record.

    Host timing, summed over steps: ``host_seconds`` of work on the host (blocking waits for
    the device excluded), ``blocked_seconds`` of waiting for device results, and
    ``hidden_seconds``, the host work done while the device was still computing the round the
    host then waited for (a lower bound: work is counted as hidden only when the round it
    overlapped was found unfinished).

    ``owner`` is the token of the engine claim this state carries (:func:`new_state`): only a
    state whose token is the engine's may step it. ``state_slots`` hands out a hybrid model's
    recurrent-state slots (one per admitted request; ``None`` for models without them).
    state whose token is the engine's may step it.

    ``prefix`` is the prefix cache: the cached pages (never on the allocator's free stack) and
    how many live requests hold each (``state.prefix``).
    """

    waiting: tuple[Request, ...]
    prefilling: tuple[Request, ...]
    running: tuple[Request, ...]
    batch: Any
    allocator: PageAllocator
    next_rid: int
    num_steps: int
    in_flight: tuple[Launched, ...] = ()
    host_seconds: float = 0.0
    blocked_seconds: float = 0.0
    hidden_seconds: float = 0.0
    owner: int = 0
    state_slots: PageAllocator | None = None
    prefix: PrefixIndex = attrs.field(factory=PrefixIndex)


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class Snapshot:
    """A scheduler state plus the contents of the KV pages it points at, by value, the values
    of the engine's shared cells (the n-gram store, the adaptive measurements; immutable, kept
    by reference) and the shape of the engine it was taken from (``(name, value)`` pairs that
    :func:`restore` compares with its engine's). A hybrid model's recurrent states are
    overwritten in place by every token (not appended like K/V), so the snapshot copies every
    ring entry of each slot a live request holds (``slots``, ``pool_states``: conv and
    delta-rule states per pool, empty without recurrent layers)."""

    state: SchedulerState
    pages: torch.Tensor
    pool_pages: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    slots: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.int64))
    pool_states: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    cells: tuple[Any, ...]
    shape: tuple[tuple[str, Any], ...]


def new_state(engine: Engine) -> SchedulerState:
    """An empty scheduler state with every KV page free but those of the engine's prefix
    cache, which the state keeps, reclaimable (the cache of the state that owned the engine
    last, see ``Engine.prefix_index``; empty with the cache off).

    The state claims the engine: its pools hold one state's pages, so a state made earlier
    (and every value derived from it) can no longer step it. A step hands the claim on to the
    state it returns; :func:`add_request` and :func:`cancel` keep it; :func:`restore` claims
    the engine for the snapshot's state.
    """
    index = forget_holders(engine.prefix_index.value)
    if engine.prefix_lookahead is None:
        index = PrefixIndex()
    state = SchedulerState(
        waiting=(),
        prefilling=(),
        running=(),
        batch=None,
        allocator=new_allocator(engine.config.num_pages, index.cached),
        next_rid=0,
        num_steps=0,
        owner=_claim(engine),
        state_slots=new_allocator(engine.config.max_batch + 1) if _hybrid(engine) else None,
        prefix=index,
    )
    engine.prefix_index.value = index
    return state


def _hybrid(engine: Engine) -> bool:
    """Whether the engine's pools hold recurrent state (a hybrid target or draft)."""
    return any(pool.recurrent is not None for pool in engine.resources.pools)


def _claim(engine: Engine) -> int:
    """A fresh owner token, now the engine's: states carrying an older one can no longer step it."""
    token = next(_TOKENS)
    engine.owner.value = token
    return token


def _check_owner(engine: Engine, state: SchedulerState, action: str) -> None:
    """Refuse to ``action`` a state that no longer owns the engine: the pages it points at may
    hold another state's tokens since, and it would silently decode garbage."""
    if state.owner != engine.owner.value:
        raise ValueError(
            f"cannot {action} this scheduler state: it no longer owns the engine's KV pages "
            f"(its owner token is {state.owner}, the engine's {engine.owner.value}). A later "
            "new_state(engine) or restore(engine, ...) claimed them, or a step of this state "
            "or of a value derived from it has rewritten them since. Step the newest state "
            "value; to come back to a state later, keep it with take_snapshot and bring it "
            "back with restore"
        )


def pages_needed(engine: Engine, prompt_len: int, max_new_tokens: int) -> int:
    """Pages a request's whole token budget spans, plus the engine's lookahead (the
    pipeline's, and one more round when overlapped): its page-table entries."""
    tokens = min(prompt_len + max_new_tokens, engine.config.max_context)
    return math.ceil((tokens + engine.kv_lookahead) / engine.config.page_size)


def pages_reserved(engine: Engine, prompt_len: int, max_new_tokens: int) -> int:
    """Pages a request may hold at once: :func:`pages_needed`, or, where pages outside the
    window go back to the pool (``Engine.kv_window``), at most the pages one launch spans
    (:func:`_window_pages`): the window's keys before its first query and what it writes, a
    prefill chunk or a round's lookahead."""
    need = pages_needed(engine, prompt_len, max_new_tokens)
    window = engine.kv_window
    if window is None:
        return need
    chunk = min(engine.config.prefill_budget, prompt_len) + _ahead(engine)
    span = max(window + engine.kv_lookahead, window - 1 + chunk)
    # A span of n slots starting anywhere in a page touches at most this many pages.
    page_size = engine.config.page_size
    return min(need, (span + 2 * page_size - 2) // page_size)


def _ahead(engine: Engine) -> int:
    """Entries the draft's cache holds past the target's (a standalone draft's 1), which a
    prefill chunk writes past its tokens."""
    return getattr(engine.resources.draft, "ahead", 0)


def _window_pages(engine: Engine, window: int, request: Request) -> tuple[int, int]:
    """The page-table entries ``[first, end)`` the next launch for ``request`` may read or
    write on an engine whose queries read ``window`` keys back (``Engine.kv_window``).

    A prefill chunk's queries start at ``prefilled``; a round's at the cache's length or
    later, which is at least every emitted token but the last (overlapped, a round still in
    flight has moved it on by what it emits, which the lookahead covers). A query sees itself
    and the ``window - 1`` keys before it, so the entries before ``first`` are read by no later
    launch (each starts at or after this one's first query): their pages can go back to the
    pool. ``end`` covers the slots the launch may write: the chunk (and the entry after it of a
    draft that runs ahead), or the engine's lookahead past the cache, within the request's
    whole budget (:func:`pages_needed`)."""
    if request.prefilled < len(request.prompt):
        start = request.prefilled
        chunk = min(len(request.prompt) - start, engine.config.prefill_budget)
        end = start + chunk + _ahead(engine)
    else:
        start = len(request.prompt) + len(request.output) - 1
        end = start + 1 + engine.kv_lookahead
    page_size = engine.config.page_size
    last = pages_needed(engine, len(request.prompt), request.max_new_tokens)
    return max(0, start - window + 1) // page_size, min(math.ceil(end / page_size), last)


def _token_ids(field: str, values: object, vocab: int) -> tuple[int, ...]:
    """``values`` as a tuple of token ids of the model's vocabulary."""
    ids = checks.integers(field, values)
    bad = sorted({t for t in ids if not 0 <= t < vocab})
    if bad:
        raise ValueError(
            f"{field} token ids {bad[:8]} are outside the vocabulary [0, {vocab}); "
            "use ids from the model's tokenizer"
        )
    return ids


def _stop_strings(values: object) -> tuple[str, ...]:
    """``values`` as a tuple of non-empty strings; a bare string is one stop string."""
    if isinstance(values, str):
        values = (values,)
    strings = checks.sequence("stop_strings", values, of="strings", fix="or one string")
    for i, string in enumerate(strings):
        checks.instance(f"stop_strings[{i}]", string, kind=str)
        if not string:
            raise ValueError(
                f"stop_strings[{i}]='': an empty stop string matches at once and would end "
                "every request at its first token; drop it"
            )
    return strings


def _validate(engine: Engine, prompt: tuple[int, ...], max_new: int) -> None:
    """Refuse a request the engine cannot hold (its prompt and settings already checked)."""
    context = engine.config.max_context
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")
    if len(prompt) >= context:
        raise ValueError(
            f"prompt of {len(prompt)} tokens leaves no room in the context of {context} tokens; "
            "shorten the prompt or raise max_context"
        )
    need = pages_reserved(engine, len(prompt), max_new)
    if need > engine.config.num_pages - 1:
        raise KVPoolExhausted(
            f"the request needs {need} KV pages but the pool has only "
            f"{engine.config.num_pages - 1}; lower max_new_tokens or build the engine with more "
            "KV pages"
        )


def _check_logprobs(engine: Engine, sampling: Sampling) -> None:
    """Refuse more top alternatives than the engine's rounds compute (a static shape)."""
    most = engine.config.max_logprobs
    if sampling.logprobs > most:
        raise ValueError(
            f"logprobs={sampling.logprobs} asks for more top alternatives than the engine "
            f"computes (max_logprobs={most}); build the engine with max_logprobs >= "
            f"{sampling.logprobs}, or ask for at most {most}"
        )


def _check_logit_bias(engine: Engine, sampling: Sampling, vocab: int) -> None:
    """Refuse a logit bias the engine does not apply, or one naming ids outside the vocabulary."""
    if not sampling.logit_bias:
        return
    if not engine.config.logit_bias:
        raise ValueError(
            "logit_bias: the engine was built without logit_bias, so its rounds add no bias; "
            "build it with logit_bias=True (engine_from_model, build_engine; generate does so "
            "when asked for one)"
        )
    _token_ids("logit_bias", [token for token, _ in sampling.logit_bias], vocab)


def _check_penalties(engine: Engine, sampling: Sampling, max_new_tokens: int) -> None:
    """Refuse penalties or ``min_tokens`` the engine does not apply, and more ``min_tokens``
    than the request may generate."""
    if sampling.min_tokens > max_new_tokens:
        raise ValueError(
            f"min_tokens={sampling.min_tokens} exceeds max_new_tokens={max_new_tokens}: the "
            "request would end before its minimum; lower min_tokens or raise max_new_tokens"
        )
    if sampling.penalized and not engine.config.penalties:
        raise ValueError(
            "repetition_penalty, presence_penalty, frequency_penalty and min_tokens need an "
            "engine that applies them, and this one was built without penalties; build it with "
            "penalties=True (engine_from_model, build_engine; generate does so when asked for "
            "one)"
        )


def _constraint(engine: Engine, sampling: Sampling) -> structured.Constraint | None:
    """The request's grammar compiled for the engine, or None when its output is free."""
    if sampling.constrained is None:
        return None
    field, source = sampling.constrained
    vocab = engine.resources.target.config.vocab_size
    return structured.constraint(field, source, engine.tokenizer, vocab, engine.eos_token_ids)


def add_request(
    engine: Engine,
    state: SchedulerState,
    prompt: list[int] | tuple[int, ...],
    *,
    sampling: Sampling | None = None,
    max_new_tokens: int = 64,
    stop_token_ids: tuple[int, ...] = (),
    stop_strings: str | tuple[str, ...] = (),
    ignore_eos: bool = False,
    include_stop_str_in_output: bool = False,
) -> tuple[SchedulerState, int]:
    """Queue a request; returns the new state and the request id.

    ``prompt`` and ``stop_token_ids`` are token ids of the model's vocabulary (ints; numpy and
    torch integers too, never floats or bools), ``max_new_tokens`` an int >= 1, ``sampling`` a
    :class:`Sampling` (greedy by default; temperatures below :data:`GREEDY_BELOW` are greedy),
    ``stop_strings`` non-empty strings (a bare string is one stop string; they need the
    engine's tokenizer; a round that completes one ends the request there and its later tokens
    are discarded, and the request's text excludes the stop string unless
    ``include_stop_str_in_output``, a flag); ``sampling.logprobs`` at most the engine's
    ``max_logprobs``; ``sampling.min_tokens`` at most ``max_new_tokens``. Raises
    ``TypeError`` for a value of the wrong kind, ``ValueError`` for one out of range and
    :class:`KVPoolExhausted` for a request that could never fit, each naming the setting, the
    value and the fix; the state handed in is unchanged either way.
    """
    vocab = engine.resources.target.config.vocab_size
    if isinstance(prompt, str):
        raise TypeError(
            f"prompt={prompt!r}: add_request takes token ids, not text; encode it first, e.g. "
            "engine.tokenizer.encode(text)"
        )
    prompt = _token_ids("prompt", prompt, vocab)
    max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, minimum=1)
    sampling = checks.instance(
        "sampling", Sampling() if sampling is None else sampling, kind=Sampling
    )
    stop_ids = _token_ids("stop_token_ids", stop_token_ids, vocab)
    stop_strings = _stop_strings(stop_strings)
    ignore_eos = checks.flag("ignore_eos", ignore_eos)
    include_stop = checks.flag("include_stop_str_in_output", include_stop_str_in_output)
    _validate(engine, prompt, max_new_tokens)
    _check_logprobs(engine, sampling)
    _check_logit_bias(engine, sampling, vocab)
    _check_penalties(engine, sampling, max_new_tokens)
    constraint = _constraint(engine, sampling)
    if stop_strings and engine.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; the engine was built without one")
    sampling = attrs.evolve(sampling, top_k=min(sampling.top_k, vocab))
    stops = frozenset(stop_ids) | (frozenset() if ignore_eos else frozenset(engine.eos_token_ids))
    request = Request(
        rid=state.next_rid,
        prompt=prompt,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stops,
        stop_strings=stop_strings,
        include_stop_str_in_output=include_stop,
        constraint=constraint,
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
        state = _release_pages(state, [requests[index]])
        state = attrs.evolve(state, **{group: requests[:index] + requests[index + 1 :]})
        if group == "running":
            batch = _drop_rows(engine, state.batch, len(requests), [index])
            state = attrs.evolve(state, batch=batch)
        return state
    raise KeyError(f"no live request with id {rid}")


def _release_pages(state: SchedulerState, requests: list[Request]) -> SchedulerState:
    """``state`` with every page and state slot of ``requests`` let go of: cached pages lose a
    holder and stay cached (``state.prefix.release``), the others are freed in one call; a
    hybrid model's state slots are freed (a waiting request holds neither). No requests, the
    round's usual case, leave ``state`` as it is."""
    if not requests:
        return state
    pages = [p for request in requests for p in request.pages if p != PADDING_PAGE]
    index, private = release(state.prefix, pages)
    allocator = free(state.allocator, torch.tensor(private, dtype=torch.int64))
    slots, held = state.state_slots, [r.state_slot for r in requests if r.state_slot]
    if slots is not None and held:
        slots = free(slots, torch.tensor(held, dtype=torch.int64))
    return attrs.evolve(state, allocator=allocator, prefix=index, state_slots=slots)


def _cached_prefix(engine: Engine, index: PrefixIndex, request: Request) -> tuple[int, ...]:
    """The cached pages ``request``'s prompt starts with (none with the cache off), leaving at
    least its last token to prefill: that token's logits decide the first generated one. A
    request asking for prompt log-probabilities uses none: a cached page's tokens have no
    logits to read them from, so its whole prompt is prefilled again."""
    lookahead, page_size, prompt = engine.prefix_lookahead, engine.config.page_size, request.prompt
    if lookahead is None or request.sampling.prompt_logprobs is not None:
        return ()
    keys = block_keys(prompt, page_size, lookahead)
    return lookup(index, keys[: (len(prompt) - 1) // page_size])


def _register_prefilled(engine: Engine, index: PrefixIndex, request: Request) -> PrefixIndex:
    """``index`` with the prompt pages ``request``'s prefill has filled so far (nothing with
    the cache off). A page is cached once its K/V, the target's and the draft's, are all
    written: the chunk that writes a page's last token is given the token after it."""
    lookahead, page_size = engine.prefix_lookahead, engine.config.page_size
    if lookahead is None:
        return index
    keys = block_keys(request.prompt, page_size, lookahead)[: request.prefilled // page_size]
    return register(index, keys, request.pages)


def _rows(engine: Engine, rows: list[int]) -> torch.Tensor:
    """Row indices on the engine's device (copied without waiting for the device)."""
    return to_device(torch.tensor(rows, dtype=torch.int64), engine.device)


def _drop_rows(engine: Engine, batch: Any, size: int, drop: list[int]) -> Any:
    if not drop:
        return batch
    dropped = set(drop)
    keep = [i for i in range(size) if i not in dropped]
    return take_rows(batch, _rows(engine, keep)) if keep else None


def _take_pages(
    allocator: PageAllocator, index: PrefixIndex, count: int
) -> tuple[PageAllocator, PrefixIndex, tuple[int, ...]]:
    """``count`` pages off the free stack, the least recently used reclaimable cached pages
    evicted first when free ones run short (:class:`KVPoolExhausted` when even that is not
    enough)."""
    short = min(count - int(allocator.num_free), reclaimable(index))
    index, evicted = evict(index, short)
    if evicted:
        allocator = free(allocator, torch.tensor(evicted, dtype=torch.int64))
    allocator, pages = allocate(allocator, max(count, 0))
    return allocator, index, tuple(pages.tolist())


def _reserved(engine: Engine, requests: tuple[Request, ...]) -> int:
    """The pages ``requests`` may hold at once, together (:func:`pages_reserved`)."""
    return sum(pages_reserved(engine, len(r.prompt), r.max_new_tokens) for r in requests)


def _admit(engine: Engine, state: SchedulerState) -> SchedulerState:
    """Move waiting requests, first come first served, to prefilling while pages and slots last.

    A request whose prompt starts with cached pages shares them (its page table points at them)
    and is prefilled after them; it is given pages of its own for the rest. Cached pages no
    request holds count as room: the least recently used are evicted when free pages run out.

    Where pages outside the window go back to the pool (``Engine.kv_window``), a request takes
    its pages launch by launch (:func:`_slide_windows`), and is admitted while the pages every
    live request may hold at once (:func:`pages_reserved`) fit the pool, so that none of them
    ever waits for a page: the pool less what the requests hold is at least what they may
    still take, whoever shares which cached page. It shares only the cached pages its
    window reads.
    """
    allocator, index, slots, admitted = state.allocator, state.prefix, state.state_slots, []
    room = engine.config.max_batch - len(state.prefilling) - len(state.running)
    window, page_size = engine.kv_window, engine.config.page_size
    reserved = _reserved(engine, (*state.prefilling, *state.running))
    for request in state.waiting:
        shared = _cached_prefix(engine, index, request)
        request = attrs.evolve(
            request, prefilled=len(shared) * page_size, cached_tokens=len(shared) * page_size
        )
        if len(admitted) >= room:
            break
        if window is None:
            need = pages_needed(engine, len(request.prompt), request.max_new_tokens) - len(shared)
            held = acquire(index, shared)  # first, so the eviction below spares them
            if need > int(allocator.num_free) + reclaimable(held):
                break
            allocator, index, own = _take_pages(allocator, held, need)
            request = attrs.evolve(request, pages=shared + own)
        else:
            reserved += pages_reserved(engine, len(request.prompt), request.max_new_tokens)
            if reserved > engine.config.num_pages - 1:
                break
            first, _ = _window_pages(engine, window, request)
            index = acquire(index, shared[first:])
            request = attrs.evolve(request, pages=(PADDING_PAGE,) * first + shared[first:])
        if slots is not None:  # max_batch bounds the admitted requests: a slot is free
            slots, slot = allocate(slots, 1)
            request = attrs.evolve(request, state_slot=int(slot[0]))
        admitted.append(request)
    return attrs.evolve(
        state,
        waiting=state.waiting[len(admitted) :],
        prefilling=(*state.prefilling, *admitted),
        allocator=allocator,
        state_slots=slots,
        prefix=index,
    )


def _slide_windows(engine: Engine, state: SchedulerState, group: str) -> SchedulerState:
    """``state`` with each request of ``group`` (``"prefilling"`` or ``"running"``) holding the
    pages of its next launch (:func:`_window_pages`), where pages outside the window go back to
    the pool (``Engine.kv_window``; otherwise ``state`` itself).

    The pages wholly before the window are let go of (a cached page loses a holder and stays
    cached, the others are freed) and their entries point at the padding sink, which no query
    reads: every key there lies outside its window. The pages the launch may write are taken
    from the pool (:func:`_take_pages`; admission saw to it that they are there). The batch's
    rows of running requests get their new page tables."""
    window = engine.kv_window
    if window is None:
        return state
    allocator, index, requests = state.allocator, state.prefix, []
    for request in getattr(state, group):
        first, end = _window_pages(engine, window, request)
        pages = request.pages
        index, private = release(index, [p for p in pages[:first] if p != PADDING_PAGE])
        if private:
            allocator = free(allocator, torch.tensor(private, dtype=torch.int64))
        kept = tuple(PADDING_PAGE if j < first else p for j, p in enumerate(pages))
        kept += (PADDING_PAGE,) * (first - len(kept))
        allocator, index, new = _take_pages(allocator, index, end - len(kept))
        requests.append(attrs.evolve(request, pages=kept + new))
    changed = any(r.pages != old.pages for r, old in zip(requests, getattr(state, group)))
    state = attrs.evolve(state, allocator=allocator, prefix=index, **{group: tuple(requests)})
    if group == "running" and changed:
        table = to_device(_page_table(engine, state.running), engine.device)
        state = attrs.evolve(
            state, batch=replace(state.batch, kv=replace(state.batch.kv, page_table=table))
        )
    return state


def _page_table(engine: Engine, requests: tuple[Request, ...]) -> torch.Tensor:
    width = engine.config.max_pages_per_request(engine.kv_lookahead)
    table = torch.full((len(requests), width), PADDING_PAGE, dtype=torch.int64)
    for row, request in enumerate(requests):
        table[row, : len(request.pages)] = torch.tensor(request.pages, dtype=torch.int64)
    return table


def _sampling_params(
    requests: tuple[Request, ...], num_logprobs: int, bias_vocab: int, penalty_vocab: int
) -> SamplingParams:
    """The requests' settings as device rows; a dense logit-bias row each over ``bias_vocab``
    tokens (zeros without one; no columns, so nothing added, when ``bias_vocab`` is 0), and
    penalty rows over ``penalty_vocab`` tokens (:func:`_penalties`). The bias is always a
    tensor: a captured round's records may hold nothing else."""
    s = [r.sampling for r in requests]
    bias = torch.zeros(len(s), bias_vocab, dtype=torch.float32)
    for row, x in enumerate(s if bias_vocab else ()):
        for token, value in x.logit_bias:
            bias[row, token] = value
    return SamplingParams(
        temperature=torch.tensor([x.temperature for x in s], dtype=torch.float32),
        top_k=torch.tensor([x.top_k for x in s], dtype=torch.int64),
        top_p=torch.tensor([x.top_p for x in s], dtype=torch.float32),
        min_p=torch.tensor([x.min_p for x in s], dtype=torch.float32),
        seed=torch.tensor([x.seed for x in s], dtype=torch.int64),
        num_logprobs=num_logprobs,
        logit_bias=bias,
        penalties=_penalties(requests, penalty_vocab),
    )


def _constrained(
    engine: Engine,
    requests: tuple[Request, ...],
    sampling: SamplingParams,
    pending: tuple[Launched, ...] = (),
) -> SamplingParams:
    """``sampling`` (the rows of ``requests``) with a grammar callback when a request has a
    grammar (``SamplingParams.grammar``, :func:`_bitmasks`), as it is otherwise. ``pending``
    are the launches still in flight (overlapped: the previous step's), whose tokens the
    requests' outputs do not hold yet."""
    if all(r.constraint is None for r in requests):
        return sampling
    vocab = engine.resources.target.config.vocab_size
    return replace(sampling, grammar=_Grammar(requests, pending, vocab, engine.device))


@attrs.define(slots=True, eq=False)
class _Grammar:
    """A round's grammar callback (``SamplingParams.grammar``, a ``state.sampling.HostGrammar``):
    called with path tokens, the packed masks after them (:func:`_bitmasks`); ``legal`` tells
    a host drafter (n-gram) whether a row's grammar accepts a path."""

    requests: tuple[Request, ...]
    pending: tuple[Launched, ...]
    vocab: int
    device: torch.device
    # The tokens in flight, read at the first ``legal`` (a drafter asks about many paths).
    late: dict[int, tuple[int, ...]] | None = attrs.field(default=None, init=False)

    def __call__(self, paths: torch.Tensor) -> torch.Tensor:
        return _bitmasks(self.requests, self.pending, self.vocab, self.device, paths)

    def legal(self, row: int, path: tuple[int, ...]) -> bool:
        """Whether row ``row``'s grammar accepts ``path`` after the request's output (and the
        tokens of the launches in flight); always, for a request without one."""
        request = self.requests[row]
        if request.constraint is None:
            return True
        if self.late is None:
            self.late = _pending_tokens(self.pending)
        before = request.output + self.late.get(request.rid, ())
        return structured.legal(request.constraint, before + path)


def _bitmasks(
    requests: tuple[Request, ...],
    pending: tuple[Launched, ...],
    vocab: int,
    device: torch.device,
    paths: torch.Tensor,
) -> torch.Tensor:
    """Which tokens each request's grammar allows after its output so far (with the tokens of
    the ``pending`` launches) followed by each of its ``paths`` (``paths[b, ..., :]``: row
    ``b``'s draft tokens on a tree path, padding -1), as int32 bitmasks ``[batch, ...,
    words]`` packed as xgrammar packs them (``spec.sampling.unpack_bitmask`` reads them), on
    ``device``; all ones for a request without a grammar. The host work of a round with a
    grammar: xgrammar writes every row into one host tensor, copied to the device at once
    (``docs/request_controls.md``)."""
    host = paths.cpu()  # the round has reached this point, so every pending launch has too
    late = _pending_tokens(pending)
    rows = math.prod(host.shape[1:-1])
    # Written row by row, in pinned memory on CUDA, copied to the device from there: one fill
    # or pinning copy of the whole ask (0.5 MB for 8 requests' 4 nodes at a 128k vocabulary)
    # would run as a parallel region of torch's host threads, which can cost milliseconds.
    shape = (host.shape[0] * rows, structured.words(vocab))
    packed = torch.empty(shape, dtype=torch.int32, pin_memory=device.type == "cuda")
    # Python lists, read once: a tensor's rows iterated one by one cost a view each.
    tokens = host.reshape(host.shape[0], rows, host.shape[-1]).tolist()
    asks = []
    for b in range(host.shape[0]):
        request = requests[b] if b < len(requests) else None
        if request is None or request.constraint is None:
            for i in range(b * rows, (b + 1) * rows):
                packed[i] = -1  # all allowed
            continue
        before = request.output + late.get(request.rid, ())
        structured.forget_shorter(request.constraint, len(before))
        for i, path in enumerate(tokens[b]):
            asks.append((request.constraint, before + _path(path), b * rows + i))
    structured.fill_bitmasks(asks, packed)  # every other row; the batch at once: threads
    return to_device(packed.reshape(*host.shape[:-1], -1), device)


def _pending_tokens(launches: tuple[Launched, ...]) -> dict[int, tuple[int, ...]]:
    """The tokens each request emitted in ``launches`` (in order), which the host has not
    collected yet: an overlapped round follows them. A request that a stop ends among them
    runs its next round in vain (it is dropped), so its tokens need no cut here."""
    tokens: dict[int, tuple[int, ...]] = {}
    for launched in launches:
        for rid, row in zip(launched.rids, launched.tokens.get().tolist()):
            tokens[rid] = tokens.get(rid, ()) + tuple(row[2 : 2 + row[0]])
    return tokens


def _path(tokens: list[int]) -> tuple[int, ...]:
    """A path's tokens, padding (-1) dropped."""
    return tuple(t for t in tokens if t >= 0)


def _for_round(
    engine: Engine,
    requests: tuple[Request, ...],
    sampling: SamplingParams,
    pending: tuple[Launched, ...] = (),
) -> SamplingParams:
    """``sampling`` (the rows of ``requests``) as one round of them reads it: with its grammar
    callback (:func:`_constrained`) and marked when a request has a top-k, top-p or min-p
    filter (``SamplingParams.filters``: which kernels filter); :func:`_unconstrained` drops
    both after the round."""
    s = [r.sampling for r in requests]
    filters = any(x.top_k > 0 or x.top_p < 1 or x.min_p > 0 for x in s)
    return replace(_constrained(engine, requests, sampling, pending), filters=filters)


def _unconstrained(batch: Any) -> Any:
    """``batch`` with its round's grammar callback and filter mark dropped: rows of batches
    with and without them then join, and snapshots keep nothing of a past round's."""
    if batch is None or (batch.sampling.grammar is None and not batch.sampling.filters):
        return batch
    return replace(batch, sampling=replace(batch.sampling, grammar=None, filters=False))


def _penalties(requests: tuple[Request, ...], vocab: int) -> Penalties:
    """The requests' penalties and ``min_tokens`` as rows over ``vocab`` tokens: each prompt's
    tokens and stop tokens marked, no output counted yet (a prefill's round counts the first
    token it emits); with ``vocab`` 0 (an engine without penalties), rows of no columns."""
    s = [r.sampling for r in requests]
    prompt = torch.zeros(len(s), vocab, dtype=torch.bool)
    stops = torch.zeros(len(s), vocab, dtype=torch.bool)
    for row, request in enumerate(requests if vocab else ()):
        prompt[row, list(request.prompt)] = True
        stops[row, [t for t in request.stop_token_ids if t < vocab]] = True
    return Penalties(
        repetition=torch.tensor([x.repetition_penalty for x in s], dtype=torch.float32),
        presence=torch.tensor([x.presence_penalty for x in s], dtype=torch.float32),
        frequency=torch.tensor([x.frequency_penalty for x in s], dtype=torch.float32),
        min_tokens=torch.tensor([x.min_tokens for x in s], dtype=torch.int64),
        num_output=torch.zeros(len(s), dtype=torch.int64),
        prompt=prompt,
        counts=torch.zeros(len(s), vocab, dtype=torch.int32),
        stops=stops,
    )


def _bias_vocab(engine: Engine) -> int:
    """The width of the logit-bias rows: the target's vocabulary, or 0 (no bias)."""
    return engine.resources.target.config.vocab_size if engine.config.logit_bias else 0


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
    kv = PagedKV(
        page_table=_page_table(engine, chosen),
        seq_lens=torch.tensor([r.prefilled for r in chosen], dtype=torch.int64),
        page_size=engine.config.page_size,
        state_slots=torch.tensor([r.state_slot for r in chosen], dtype=torch.int64),
    )
    after = [r.prefilled + n for r, n in zip(chosen, sizes)]
    next_tokens = [r.prompt[i] if i < len(r.prompt) else -1 for r, i in zip(chosen, after)]
    prefix = torch.full((len(chosen), max(r.prefilled for r in chosen)), -1, dtype=torch.int64)
    for row, request in enumerate(chosen):
        prefix[row, : request.prefilled] = torch.tensor(request.prompt[: request.prefilled])
    device = engine.device
    chunk = PrefillChunk(
        kv=tree_map_tensors(lambda x: to_device(x, device), kv),
        tokens=to_device(tokens, device),
        q_lens=to_device(torch.tensor(sizes, dtype=torch.int64), device),
        next_tokens=to_device(torch.tensor(next_tokens, dtype=torch.int64), device),
        sampling=tree_map_tensors(
            lambda x: to_device(x, device),
            _sampling_params(
                chosen,
                engine.config.max_logprobs,
                _bias_vocab(engine),
                engine.resources.target.config.vocab_size if engine.config.penalties else 0,
            ),
        ),
        prefix_tokens=prefix,  # host tensor: only host-side drafters (n-gram) read it
        prompt_logprobs=max(
            (r.sampling.prompt_logprobs for r in chosen if r.sampling.prompt_logprobs is not None),
            default=None,
        ),
    )
    return chunk, sizes


def _launched(
    state: SchedulerState, requests: tuple[Request, ...], output: StepOutput, decode: bool
) -> Launched:
    """A launch's record: its rows' emitted tokens and fault status queued to the host in one
    packed copy, and their log-probabilities in the same copy when a request of the launch
    asked for them (float32 bit patterns as integers: one transfer, no sync of their own)."""
    packed = [output.num_tokens[:, None], output.faults[:, None], output.tokens]
    logprobs = output.logprobs if any(r.sampling.logprobs for r in requests) else None
    if logprobs is not None:
        top_ids, top_logprobs = logprobs.top_ids, logprobs.top_logprobs
        packed += [_bits(logprobs.chosen), top_ids.flatten(1), _bits(top_logprobs).flatten(1)]
    return Launched(
        rids=tuple(r.rid for r in requests),
        tokens=to_host(torch.cat(packed, dim=1)),
        decode=decode,
        plain_steps=output.plain_steps,
        num_top=None if logprobs is None else logprobs.top_ids.shape[2],
        launched_at=time.perf_counter(),
        blocked_before=state.blocked_seconds,
    )


def _bits(x: torch.Tensor) -> torch.Tensor:
    """float32 values as their bit patterns in int64, to travel with the tokens (:func:`_floats`
    reads them back exactly)."""
    return x.float().view(torch.int32).long()


def _floats(x: torch.Tensor) -> torch.Tensor:
    """The float32 values whose bit patterns :func:`_bits` packed into ``x``."""
    return x.to(torch.int32).view(torch.float32)


def _row_logprobs(
    packed: torch.Tensor, num_top: int | None
) -> list[list[tuple[float, list[int], list[float]]] | None]:
    """Each row's ``(logprob, top ids, top logprobs)`` per emitted token (those it emitted,
    ``packed[row, 0]``), unpacked from a launch's copy (:func:`_launched`); ``None`` per row
    when the launch carried none."""
    if num_top is None:
        return [None] * packed.shape[0]
    width = (packed.shape[1] - 2) // (2 + 2 * num_top)  # tokens, logprobs, top ids and logprobs
    ends = itertools.accumulate([2, width, width, width * num_top, width * num_top])
    _, _, chosen, top_ids, top_logprobs = torch.tensor_split(packed, list(ends)[:-1], dim=1)
    chosen, top_logprobs = _floats(chosen), _floats(top_logprobs).reshape(-1, width, num_top)
    top_ids = top_ids.reshape(-1, width, num_top)
    rows = zip(chosen.tolist(), top_ids.tolist(), top_logprobs.tolist())
    return [list(zip(*row))[:n] for row, n in zip(rows, packed[:, 0].tolist())]


def _emitted(
    state: SchedulerState, launched: Launched, first: bool
) -> tuple[SchedulerState, list[tuple[list[int], int, list | None]]]:
    """Each row's emitted tokens, fault status and, when the launch carried them, the tokens'
    log-probabilities (:func:`_row_logprobs`), waiting for them if they are still on their
    way. The first launch a step collects dates the host work it overlapped: everything since
    it launched (waits excluded) ran while the device computed it, if it is found unfinished."""
    ready = launched.tokens.ready()
    begin = time.perf_counter()
    host = launched.tokens.get()
    packed = host.tolist()
    waited = time.perf_counter() - begin
    hidden = 0.0
    if first and not ready:
        blocked = state.blocked_seconds - launched.blocked_before
        hidden = max(0.0, begin - launched.launched_at - blocked)
    state = attrs.evolve(
        state,
        blocked_seconds=state.blocked_seconds + waited,
        hidden_seconds=state.hidden_seconds + hidden,
    )
    logprobs = _row_logprobs(host, launched.num_top)
    return state, [(row[2 : 2 + row[0]], row[1], lp) for row, lp in zip(packed, logprobs)]


def _extend(engine: Engine, request: Request, tokens: list[int]) -> dict[str, Any]:
    """The changes to ``request`` of appending emitted tokens one by one until a stop
    condition fires: its ``output`` and ``finish_reason`` (the caller makes them, with the
    round's other changes, in one new record: one per request and round)."""
    output, reason = list(request.output), None
    for token in tokens:
        output.append(token)
        reason = _finish_reason(engine, request, output)
        if reason:
            break
    return {"output": tuple(output), "finish_reason": reason}


def _with_logprobs(request: Request, kept: tuple[int, ...], logprobs: list | None) -> Request:
    """``request`` with the log-probabilities of its newly ``kept`` tokens appended (the first
    ``len(kept)`` of the round's, each cut to the request's own number of alternatives), when
    it asked for them."""
    count = request.sampling.logprobs
    if not count or logprobs is None:
        return request
    new = tuple(
        TokenLogprob(
            token_id=token,
            logprob=chosen,
            top_logprobs=tuple(zip(top_ids[:count], top_logprobs[:count])),
        )
        for token, (chosen, top_ids, top_logprobs) in zip(kept, logprobs)
    )
    return attrs.evolve(request, logprobs=request.logprobs + new)


def _failed(request: Request, faults: int) -> Request:
    """``request`` finished because its next token could not be decoded: ``error`` names the
    request, how far it got and the cause."""
    error = (
        f"request {request.rid} could not be decoded after {len(request.output)} tokens: "
        f"{describe_faults(faults)}; it was finished with finish_reason 'error' and the other "
        "requests decode on"
    )
    return attrs.evolve(request, finish_reason="error", error=error)


def completes_stop_string(
    tokenizer: Any, output: Sequence[int], stop_strings: Sequence[str]
) -> bool:
    """Whether the newest token of ``output`` completed one of ``stop_strings``: one occurs in
    the text from ``tail`` characters before that token's text to its end (``tail``: the
    longest stop string and 16 more), only the newest text being able to hold a new match.

    Only the output's last tokens are decoded: a window of them that, before the newest
    token, decodes to more than ``tail`` characters (a token gives a character or a byte of
    one; special tokens give none, so the window doubles while it falls short). What its
    start may decode differently from the whole output (a character cut in its bytes, a
    leading space) is then more than ``tail`` characters back, so the text checked is the
    whole output's. Decoding the whole output for every token cost time growing with its
    length, per request and token.
    """
    tail = max(map(len, stop_strings)) + 16
    size = tail + 8
    while True:
        window = list(output[-size:])
        previous = tokenizer.decode(window[:-1])
        if len(previous) >= tail + 4 or size >= len(output):
            break
        size *= 2
    text = tokenizer.decode(window)
    return any(s in text[max(0, len(previous) - tail) :] for s in stop_strings)


def _finish_reason(engine: Engine, request: Request, output: list[int]) -> str | None:
    if request.constraint is not None and structured.finished(request.constraint, tuple(output)):
        return "stop"  # the grammar accepted EOS (which ignore_eos does not make a stop token)
    # Nothing stops a request before its min_tokens (vLLM's rule; its stop tokens are banned
    # from the distributions until then anyway).
    stoppable = len(output) >= request.sampling.min_tokens
    if stoppable and output[-1] in request.stop_token_ids:
        return "stop"
    if (
        stoppable
        and request.stop_strings
        and completes_stop_string(engine.tokenizer, output, request.stop_strings)
    ):
        return "stop"
    if len(output) >= request.max_new_tokens:
        return "length"
    if len(request.prompt) + len(output) >= engine.config.max_context:
        return "length"
    return None


def _launch_decode(
    engine: Engine, state: SchedulerState, pending: tuple[Launched, ...] = ()
) -> tuple[SchedulerState, tuple[Launched, ...]]:
    """Launch a decoding round for every running request; the batch moves one round on.
    ``pending`` are the launches not collected yet (overlapped), which the round follows."""
    if not state.running:
        return state, ()
    state = _slide_windows(engine, state, "running")
    sampling = _for_round(engine, state.running, state.batch.sampling, pending)
    batch = replace(state.batch, sampling=sampling)
    with planned_round(engine, state.running):  # flashinfer's MLA plans, where the engine has them
        batch, output = engine.pipeline.decode(engine.resources, batch)
    launched = _launched(state, state.running, output, decode=True)
    return attrs.evolve(state, batch=_unconstrained(batch)), (launched,)


def _launch_prefill(
    engine: Engine, state: SchedulerState
) -> tuple[SchedulerState, tuple[Launched, ...]]:
    """Launch one prefill chunk. Requests whose prompt it completes join ``running`` at once
    (their rows are appended to the batch); their first tokens are collected like a round's."""
    if not state.prefilling:
        return state, ()
    state = _slide_windows(engine, state, "prefilling")
    chunk, sizes = _prefill_chunk(engine, state.prefilling)
    chosen = state.prefilling[: chunk.tokens.shape[0]]  # the chunk's rows: the first ones
    chunk = replace(chunk, sampling=_for_round(engine, chosen, chunk.sampling))
    rows, first = engine.pipeline.prefill(engine.resources, chunk)
    rows = _unconstrained(rows)
    # A pipeline of the user's may return a plain StepOutput, which has none.
    prompt_logprobs = _chunk_logprobs(chosen, sizes, getattr(first, "prompt_logprobs", None))
    prefilling, joined, joined_rows, cache = [], [], [], state.prefix
    for index, request in enumerate(state.prefilling):
        if index < len(sizes):
            request = attrs.evolve(
                request,
                prefilled=request.prefilled + sizes[index],
                num_forwards=request.num_forwards + 1,
                prompt_logprobs=request.prompt_logprobs + prompt_logprobs[index],
            )
            cache = _register_prefilled(engine, cache, request)
        if request.prefilled < len(request.prompt):
            prefilling.append(request)
        else:
            joined.append(request)
            joined_rows.append(index)
    state = attrs.evolve(state, prefilling=tuple(prefilling), prefix=cache)
    if not joined:
        return state, ()
    index = _rows(engine, joined_rows)
    new_rows = take_rows(rows, index)
    batch = new_rows if state.batch is None else concat_rows([state.batch, new_rows])
    launched = _launched(state, tuple(joined), take_rows(first, index), decode=False)
    return attrs.evolve(state, running=(*state.running, *joined), batch=batch), (launched,)


def _chunk_logprobs(
    requests: tuple[Request, ...], sizes: list[int], logprobs: TokenLogprobs | None
) -> list[tuple[TokenLogprob | None, ...]]:
    """The prompt log-probabilities a prefill chunk adds to each of its ``requests`` (its
    rows, of ``sizes`` tokens), from the chunk's ``PrefillOutput.prompt_logprobs``: a request
    that asked for them gets None for its prompt's first token (in its first chunk) and an
    entry for each prompt token that follows one of its chunk's, each with its own number of
    alternatives; the others get nothing. Read to the host at once (one copy, waited for)."""
    if logprobs is None:
        if any(r.sampling.prompt_logprobs is not None for r in requests):
            raise ValueError(
                "prompt_logprobs: the pipeline's prefill returned none for a chunk that asked "
                "for them; build its output with pipelines.base.prefill_output"
            )
        return [()] * len(requests)
    host = tree_map_tensors(lambda x: x.cpu(), logprobs)
    added = []
    for row, (request, size) in enumerate(zip(requests, sizes)):
        count, start = request.sampling.prompt_logprobs, request.prefilled
        if count is None:
            added.append(())
            continue
        # Chunk token i is prompt token start + i; the last prompt token predicts no prompt token.
        width = min(size, len(request.prompt) - 1 - start)
        chosen = host.chosen[row, :width].tolist()
        top_ids = host.top_ids[row, :width, :count].tolist()
        top_logprobs = host.top_logprobs[row, :width, :count].tolist()
        entries = tuple(
            TokenLogprob(
                token_id=request.prompt[start + i + 1],
                logprob=chosen[i],
                top_logprobs=tuple(zip(top_ids[i], top_logprobs[i])),
            )
            for i in range(width)
        )
        added.append(((None,) if start == 0 else ()) + entries)
    return added


def _collect(
    engine: Engine, state: SchedulerState, launches: tuple[Launched, ...]
) -> tuple[SchedulerState, list[RequestOutput]]:
    """Hand each launch's tokens to its requests, token by token until a stop condition
    fires, and retire the requests that finished: their pages are freed and their rows
    dropped. Rows of requests no longer running (finished or cancelled since the launch) are
    ignored: that is the round an overlapped finished request runs in vain."""
    outputs = []
    for number, launched in enumerate(launches):
        state, emitted = _emitted(state, launched, first=number == 0)
        at = {r.rid: i for i, r in enumerate(state.running)}
        running, finished = list(state.running), []
        for rid, (tokens, faults, logprobs) in zip(launched.rids, emitted):
            if rid not in at:
                continue
            # A faulty row's tokens are those decided before its fault: a stop condition
            # among them still finishes the request normally, as it would have alone.
            request = running[at[rid]]
            changes = _extend(engine, request, tokens)
            kept = changes["output"][len(request.output) :]
            if launched.decode and tokens:
                # Plain steps count as plain decoding's would: a round per token kept.
                lengths = [1] * len(kept) if launched.plain_steps else [len(tokens)]
                changes["num_forwards"] = request.num_forwards + len(lengths)
                changes["round_lengths"] = functools.reduce(_count, lengths, request.round_lengths)
            request = _with_logprobs(attrs.evolve(request, **changes), kept, logprobs)
            if faults and not request.finish_reason:
                request = _failed(request, faults)
            outputs.append(_output(request, kept))
            running[at[rid]] = request
            if request.finish_reason:
                finished.append(at[rid])
        state = attrs.evolve(
            state,
            running=tuple(r for i, r in enumerate(running) if i not in finished),
            batch=_drop_rows(engine, state.batch, len(running), finished),
        )
        state = _release_pages(state, [running[i] for i in finished])
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
        error=request.error,
    )


def step(engine: Engine, state: SchedulerState) -> tuple[SchedulerState, list[RequestOutput]]:
    """One scheduler step: a decoding round for running requests, then admission and a prefill
    chunk for waiting ones. Returns the new state and what each touched request produced.

    Synchronously, each launch is collected at once. Overlapped (``engine.config.overlap``),
    the previous step's launches are collected after this step's round is launched, and this
    step's launches are left in flight: the outputs returned are the previous step's.

    ``state`` must own the engine (:func:`new_state`; a ``ValueError`` says so otherwise), and
    the returned state takes the claim over: the state handed in can no longer step. A step
    that raises changes nothing that could be seen: the engine's shared cells (the n-gram
    store, the adaptive measurements) get back the values they had, the claim stays with
    ``state``, and the KV slots the step may have written lie past what ``state`` counts as
    written, so retrying the step writes them again. Cached prefix pages it evicted and
    wrote are evicted and written again by the retry; a :func:`new_state` made after it
    starts with an empty prefix cache.
    """
    _check_owner(engine, state, "step")
    entry = tuple(cell.value for cell in engine.resources.cells)
    try:
        state, outputs = _step(engine, state)
    except BaseException:
        # Rounds replace the cells' values as they go (the n-gram round inserts its streams):
        # left behind by a failed step, a retry would insert them again.
        _set_cells(engine, entry)
        # The step may have evicted cached pages and written into them: a new state must not
        # trust the cache it would start from (a retry of this step evicts them again).
        engine.prefix_index.value = PrefixIndex()
        raise
    engine.prefix_index.value = state.prefix
    return attrs.evolve(state, owner=_claim(engine)), outputs


def _step(engine: Engine, state: SchedulerState) -> tuple[SchedulerState, list[RequestOutput]]:
    """:func:`step`'s work, which may replace the cells' values before it fails."""
    begin, blocked = time.perf_counter(), state.blocked_seconds
    earlier = state.in_flight
    state, launched = _launch_decode(engine, attrs.evolve(state, in_flight=()), earlier)
    if not engine.config.overlap:
        earlier, launched = launched, ()
    state, decoded = _collect(engine, state, earlier)
    state, chunk = _launch_prefill(engine, _admit(engine, state))
    prefilled = []
    if engine.config.overlap:
        launched += chunk
    else:
        state, prefilled = _collect(engine, state, chunk)
    host = time.perf_counter() - begin - (state.blocked_seconds - blocked)
    state = attrs.evolve(
        state,
        in_flight=launched,
        num_steps=state.num_steps + 1,
        host_seconds=state.host_seconds + host,
    )
    return state, decoded + prefilled


def host_stats(state: SchedulerState) -> dict[str, float]:
    """Host time per step so far, in milliseconds: ``host_ms_per_step`` (host work, waits for
    the device excluded), ``hidden_host_ms_per_step`` (the part done while the device was busy
    with the round the host then waited for: all of it when overlapping hides it, about none
    synchronously) and ``blocked_ms_per_step`` (waiting for device results)."""
    steps = max(state.num_steps, 1)
    return {
        "host_ms_per_step": 1e3 * state.host_seconds / steps,
        "hidden_host_ms_per_step": 1e3 * state.hidden_seconds / steps,
        "blocked_ms_per_step": 1e3 * state.blocked_seconds / steps,
    }


def is_idle(state: SchedulerState) -> bool:
    """Whether no request is waiting, prefilling or running."""
    return not (state.waiting or state.prefilling or state.running)


def warm_up(engine: Engine, prompt_len: int = 8, max_new_tokens: int = 16) -> None:
    """Decode throwaway requests so that every CUDA graph is captured and every kernel compiled
    before the first real request (a server's first requests would otherwise wait seconds for
    them): ``prompt_len``-token prompts at every graph batch bucket up to ``max_batch``, greedy
    and sampled, with and without a top-p filter (``SamplingParams.filters``: a graph of its
    own), then one prompt of each length class (:func:`warm_up_lengths`) alone, since
    kernels' tiles and Triton's integer specialisations follow the prefill chunk's length.

    Every request finishes and frees its pages, and the shared cells (the n-gram store, the
    adaptive measurements) get back the values they had, so the warm-up leaves nothing a later
    request could see; the next :func:`new_state` takes the engine over.
    """
    cells = tuple(cell.value for cell in engine.resources.cells)
    sizes = sorted({min(bucket, engine.config.max_batch) for bucket in engine.config.graph_buckets})
    variants = (Sampling(), Sampling(temperature=1.0), Sampling(temperature=1.0, top_p=0.9))
    for batch, sampling in itertools.product(sizes, variants):
        _decode_throwaway(
            engine, [_warm_up_prompt(engine, prompt_len, 0)] * batch, sampling, max_new_tokens
        )
    lengths = warm_up_lengths(engine.config.prefill_budget, engine.config.max_context // 2)
    for first, length in enumerate(lengths, start=1):
        # Each prompt starts elsewhere in the vocabulary: no prefix-cache hit shortens it.
        _decode_throwaway(engine, [_warm_up_prompt(engine, length, first)], Sampling(), 2)
    _set_cells(engine, cells)


def warm_up_lengths(prefill_budget: int, longest: int) -> tuple[int, ...]:
    """Prompt lengths that reach every tile choice and integer specialisation of a prefill
    chunk of up to ``prefill_budget`` tokens: 1, each power of two and one past it (the
    tiles step at powers of two; Triton specialises integers equal to 1 and multiples of 16),
    and a chunk of the full budget followed by a remainder; none above ``longest``."""
    lengths = {1, prefill_budget + 1}
    power = 1
    while power <= prefill_budget:
        lengths |= {power, power + 1}
        power *= 2
    return tuple(sorted(n for n in lengths if n <= longest))


def _warm_up_prompt(engine: Engine, length: int, first: int) -> tuple[int, ...]:
    vocab = engine.resources.target.config.vocab_size
    return tuple(token % vocab for token in range(first * 97 + 1, first * 97 + 1 + length))


def _decode_throwaway(
    engine: Engine, prompts: list[tuple[int, ...]], sampling: Sampling, max_new_tokens: int
) -> None:
    """Decode ``prompts`` to their end on a fresh state (the warm-up's requests)."""
    state = new_state(engine)
    for prompt in prompts:
        state, _ = add_request(
            engine, state, prompt, sampling=sampling, max_new_tokens=max_new_tokens, ignore_eos=True
        )
    while not is_idle(state):
        state, _ = step(engine, state)


def _held_pages(state: SchedulerState) -> torch.Tensor:
    """Every page the state's requests or its prefix cache hold, once each."""
    pages = [p for r in (*state.prefilling, *state.running) for p in r.pages]
    held = {*pages, *state.prefix.cached} - {PADDING_PAGE}  # freed entries hold no page
    return torch.tensor(sorted(held), dtype=torch.int64)


def take_snapshot(engine: Engine, state: SchedulerState) -> Snapshot:
    """The state by value: cloned tensors, a copy of every KV page a live request or the prefix
    cache holds, the shared cells' values and the engine's shape. ``state`` must own the engine
    (the pages of a state that no longer does may hold another state's tokens): a
    ``ValueError`` says so."""
    _check_owner(engine, state, "snapshot")
    pages = _held_pages(state)
    pool_pages = tuple(
        (pool.k[:, pages.to(pool.k.device)].clone(), pool.v[:, pages.to(pool.v.device)].clone())
        for pool in engine.resources.pools
    )
    cells = tuple(cell.value for cell in engine.resources.cells)
    slots = torch.tensor(
        [r.state_slot for r in (*state.prefilling, *state.running)], dtype=torch.int64
    )
    pool_states = tuple(
        (
            pool.recurrent.conv[:, slots.to(pool.recurrent.conv.device)].clone(),
            pool.recurrent.ssm[:, slots.to(pool.recurrent.ssm.device)].clone(),
        )
        for pool in engine.resources.pools
        if pool.recurrent is not None
    )
    return Snapshot(
        state=snapshot(state),
        pages=pages,
        pool_pages=pool_pages,
        cells=cells,
        shape=_engine_shape(engine),
        slots=slots,
        pool_states=pool_states,
    )


def restore(engine: Engine, snap: Snapshot) -> SchedulerState:
    """Write the snapshot's KV pages back into the pools, its values back into the shared
    cells, and return its state, which now owns the engine (:func:`new_state`).

    Pages freed and reused after the snapshot was taken get their old contents back, so the
    restored state decodes exactly as it would have at snapshot time. A snapshot taken from an
    engine of another shape (device, KV pages and their size, context and batch limits,
    overlap, shared cells, the pipeline's kind and static config) is refused with a
    ``ValueError`` naming each difference, before anything is written: the engine is unchanged.
    """
    differences = _shape_differences(dict(snap.shape), dict(_engine_shape(engine)))
    if differences:
        raise ValueError(
            "the snapshot was taken from an engine of another shape, whose state and pages do "
            f"not fit this one: {'; '.join(differences)}. Restore it into an engine built with "
            "the same settings"
        )
    for pool, (k, v) in zip(engine.resources.pools, snap.pool_pages):
        index = snap.pages.to(pool.k.device)
        pool.k[:, index] = k
        pool.v[:, index] = v
    hybrid = [pool.recurrent for pool in engine.resources.pools if pool.recurrent is not None]
    for states, (conv, ssm) in zip(hybrid, snap.pool_states):
        states.conv[:, snap.slots.to(conv.device)] = conv
        states.ssm[:, snap.slots.to(ssm.device)] = ssm
    _set_cells(engine, snap.cells)
    engine.prefix_index.value = snap.state.prefix
    # The snapshot's own token: every value of the state it was taken of owns the pages again.
    engine.owner.value = snap.state.owner
    return snapshot(snap.state)


def _set_cells(engine: Engine, values: tuple[Any, ...]) -> None:
    for cell, value in zip(engine.resources.cells, values):
        cell.value = value


def _engine_shape(engine: Engine) -> tuple[tuple[str, Any], ...]:
    """What a snapshot's state and pages must match to be restored into ``engine``, as
    ``(name, value)`` pairs of plain values: where the pools live and their sizes, the limits
    that shape a state (page-table width, batch), overlap (an overlapped state holds a round in
    flight), whether rounds count penalties (a state's penalty rows), the shared cells, and the
    pipeline's kind and static config."""
    config, resources = engine.config, engine.resources
    # Pools are [layer, page, page_size, kv_head, head_dim]; pages are compared on their own.
    pools = tuple(
        (name, (pool.k.shape[0], *pool.k.shape[3:], str(pool.k.dtype), *_state_shape(pool)))
        for name, pool in zip(("target_pool", "draft_pool"), resources.pools)
    )
    return (
        ("device", str(engine.device)),
        ("num_pages", config.num_pages),
        ("page_size", config.page_size),
        ("max_context", config.max_context),
        ("max_batch", config.max_batch),
        ("overlap", config.overlap),
        ("max_logprobs", config.max_logprobs),
        ("penalties", config.penalties),
        ("prefix_lookahead", engine.prefix_lookahead),
        ("kv_window", engine.kv_window),
        *pools,
        ("cells", tuple(type(cell.value).__name__ for cell in resources.cells)),
        *_static_items("pipeline", engine.pipeline),
    )


def _state_shape(pool: Any) -> tuple[int, ...]:
    """A pool's recurrent-state shape (nothing for a pool without recurrent layers)."""
    return () if pool.recurrent is None else (*pool.recurrent.conv.shape, *pool.recurrent.ssm.shape)


def _static_items(path: str, value: Any) -> Iterator[tuple[str, Any]]:
    """``value``'s static config flattened to ``(path, plain value)`` pairs: a pipeline by its
    kind, round shape and decode, a ``functools.partial`` by its function and keywords, a
    record by its fields, a tensor by its shape and dtype, any other object by its type."""
    if isinstance(value, Pipeline):
        for name in ("name", "max_tokens_per_step", "kv_lookahead", "host_work"):
            yield f"{path}.{name}", getattr(value, name)
        yield from _static_items(f"{path}.decode", value.decode)
    elif _plain(value) or isinstance(value, tuple) and all(map(_plain, value)):
        yield path, value
    elif isinstance(value, functools.partial):
        yield path, _qualified_name(value.func)
        for key, item in sorted(value.keywords.items()):
            yield from _static_items(f"{path}.{key}", item)
    elif callable(getattr(value, "decode", None)):
        # A wrapper (CUDA graphs, a timer) runs the round it wraps; its caches are no config.
        yield from _static_items(path, value.decode)
    elif isinstance(value, tuple):
        for index, item in enumerate(value):
            yield from _static_items(f"{path}[{index}]", item)
    elif isinstance(value, torch.Tensor):
        yield path, (tuple(value.shape), str(value.dtype))
    elif attrs.has(type(value)):
        for field in attrs.fields(type(value)):
            yield from _static_items(f"{path}.{field.name}", getattr(value, field.name))
    else:
        yield path, _qualified_name(value)


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _qualified_name(value: Any) -> str:
    """A function's or class's dotted name; for any other object, its class's."""
    named = value if hasattr(value, "__qualname__") else type(value)
    return f"{named.__module__}.{named.__qualname__}"


def _shape_differences(snap: dict[str, Any], engine: dict[str, Any]) -> list[str]:
    """``"name: snapshot X, engine Y"`` for every item of the two shapes that differs, except
    the settings of a function that differs itself (another kind's settings say nothing)."""

    def show(shape: dict[str, Any], key: str) -> str:
        return repr(shape[key]) if key in shape else "absent"

    differing = [
        key
        for key in dict.fromkeys([*snap, *engine])
        if key not in snap or key not in engine or snap[key] != engine[key]
    ]
    return [
        f"{key}: snapshot {show(snap, key)}, engine {show(engine, key)}"
        for key in differing
        if not any(key.startswith((f"{other}.", f"{other}[")) for other in differing)
    ]
