"""Structured output: a request's JSON schema, regex or EBNF grammar as a token mask.

The grammar engine is xgrammar (``pip install 'speculum[grammar]'``): maintained, the engine
vLLM and SGLang use by default, with token bitmasks, rollback and forks. A request's grammar
is checked when its :class:`~speculum.runtime.scheduler.Sampling` is built (tokenizer-free,
:func:`check`), compiled against the engine's tokenizer when it is added
(:func:`constraint`), and read by the scheduler, in a round, as the set of tokens allowed
after the request's output so far and a tree path, packed into int32 bitmasks
(:func:`fill_bitmask`) that the round unpacks on the device (``docs/request_controls.md``).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from speculum.models.tokenizer import Tokenizer

__all__ = [
    "GRAMMAR_FIELDS",
    "Constraint",
    "check",
    "constraint",
    "words",
    "fill_bitmask",
    "fill_bitmasks",
    "legal",
    "forget_shorter",
    "finished",
]

#: The request fields that constrain output, at most one per request (vLLM's names).
GRAMMAR_FIELDS = ("json_schema", "regex", "grammar")
#: How JSON is written under a schema: compact, without whitespace (``{"a":1,"b":[2,3]}``), so
#: that a model cannot loop on whitespace and no vocabulary needs a space token.
_COMPACT = {"any_whitespace": False, "separators": (",", ":")}


def _xgrammar() -> Any:
    """The xgrammar module, or an ImportError saying how to install it."""
    try:
        import xgrammar
    except ImportError as err:
        raise ImportError(
            "structured output (json_schema, regex, grammar) needs xgrammar; install it with "
            "pip install 'speculum[grammar]' (or pip install xgrammar)"
        ) from err
    return xgrammar


def _source(field: str, value: object) -> str:
    """A grammar field's text: a JSON schema may be a mapping (dumped to JSON) or its text."""
    if field == "json_schema" and isinstance(value, Mapping):
        return json.dumps(value)
    if not isinstance(value, str):
        kinds = "a JSON string or a dict" if field == "json_schema" else "a string"
        raise TypeError(f"{field}={value!r}: must be {kinds}, not {type(value).__name__}")
    return value


def _grammar(field: str, source: str) -> Any:
    """The tokenizer-free xgrammar ``Grammar`` of a field's text."""
    xgr = _xgrammar()
    if field == "json_schema":
        return xgr.Grammar.from_json_schema(source, **_COMPACT)
    if field == "regex":
        return xgr.Grammar.from_regex(source)
    return xgr.Grammar.from_ebnf(source)


def check(field: str, value: object) -> str | None:
    """``value`` of the grammar field ``field`` checked and as text (a JSON schema given as a
    dict dumped to JSON); None stays None. Raises ``TypeError`` for a value of the wrong kind
    and ``ValueError`` naming the field and xgrammar's reason for one it cannot parse."""
    if value is None:
        return None
    source = _source(field, value)
    try:
        _grammar(field, source)
    except (RuntimeError, ValueError) as err:  # xgrammar raises RuntimeError from C++
        reason = str(err).strip().split("\n")[0]
        raise ValueError(
            f"{field}={source[:200]!r} is not a valid {_KINDS[field]}: {reason}; fix it, or "
            "leave the field unset"
        ) from err
    return source


_KINDS = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}


@attrs.define(slots=True, eq=False)
class _Matcher:
    """An xgrammar matcher and the tokens it has accepted: a cache of what
    :func:`fill_bitmask` would compute from scratch (it is rebuilt whenever the output it is asked
    about does not extend those tokens, so a kept state value reads its own). ``masks`` holds
    the packed mask row already computed after each token sequence (a round's verify asks
    about the nodes its draft masked, the next round's root is the last round's carried
    prediction: each is computed once), ``computed`` counts the rows xgrammar wrote."""

    inner: Any
    accepted: tuple[int, ...]
    masks: dict[tuple[int, ...], torch.Tensor] = attrs.field(factory=dict)
    computed: int = 0


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class Constraint:
    """A request's grammar compiled against the engine's tokenizer: ``field`` names its kind
    (:data:`GRAMMAR_FIELDS`), ``compiled`` is xgrammar's ``CompiledGrammar`` and ``vocab`` the
    target's vocabulary size. ``cache`` holds a matcher advanced over the output it last read
    (a cache only: every answer depends on the output asked about alone)."""

    field: str
    compiled: Any
    vocab: int
    cache: _Matcher = attrs.field(factory=lambda: _Matcher(inner=None, accepted=()))


@functools.lru_cache(maxsize=4)
def _compiler(tokenizer: Tokenizer, vocab: int, stop_ids: tuple[int, ...]) -> Any:
    """xgrammar's compiler for one engine's tokenizer: each token id's bytes (special tokens
    give none), with ``stop_ids`` (the model's EOS) ending the grammar."""
    xgr = _xgrammar()
    encoded = [tokenizer.token_bytes(i) if i < tokenizer.vocab_size else b"" for i in range(vocab)]
    info = xgr.TokenizerInfo(
        encoded, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=list(stop_ids)
    )
    return xgr.GrammarCompiler(info)


def constraint(
    field: str, source: str, tokenizer: Tokenizer | None, vocab: int, stop_ids: tuple[int, ...]
) -> Constraint:
    """``source``, the text of grammar field ``field``, compiled for an engine with
    ``tokenizer``, a ``vocab``-token target and the stop tokens ``stop_ids`` that end a
    complete output (at least one is needed: a grammar ends its output with one)."""
    if tokenizer is None:
        raise ValueError(f"{field}: structured output needs a tokenizer; the engine has none")
    if not stop_ids:
        raise ValueError(
            f"{field}: structured output ends its output with an EOS token, and the model "
            "declares none; give the engine a model with eos_token_ids"
        )
    compiler = _compiler(tokenizer, vocab, tuple(sorted(stop_ids)))
    if field == "json_schema":
        compiled = compiler.compile_json_schema(source, **_COMPACT)
    elif field == "regex":
        compiled = compiler.compile_regex(source)
    else:
        compiled = compiler.compile_grammar(source)
    return Constraint(field=field, compiled=compiled, vocab=vocab)


def _matcher(c: Constraint, output: tuple[int, ...]) -> Any:
    """A matcher that has accepted ``output``, or None when ``output`` leaves the grammar.

    The cached matcher is rolled back to where ``output`` parts from the tokens it accepted
    and advanced over the rest: a round walks every tree path this way, from the output
    before the round, so each path costs its own tokens, not the whole output."""
    cache = c.cache
    if cache.inner is None:
        cache.inner, cache.accepted = _xgrammar().GrammarMatcher(c.compiled), ()
    common = _common_prefix(cache.accepted, output)
    if common < len(cache.accepted):
        cache.inner.rollback(len(cache.accepted) - common)
    walked = common
    for token in output[common:]:
        if cache.inner.is_terminated() or not cache.inner.accept_token(token):
            break
        walked += 1
    # One slice, not a tuple grown per token: each growth would copy the whole output.
    cache.accepted = output[:walked]
    return cache.inner if walked == len(output) else None


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens ``a`` and ``b`` share. The tuples are compared as slices (in C,
    not token by token in Python: they hold the whole output), stepping back from the end by
    doubling, since two paths asked about in a round part within their last few tokens."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    back = 1
    while a[: max(n - back, 0)] != b[: max(n - back, 0)]:
        back *= 2
    common = max(n - back, 0)
    while a[common] == b[common]:  # a mismatch lies below n: this stops there
        common += 1
    return common


def words(vocab: int) -> int:
    """How many int32 words a packed bitmask of ``vocab`` tokens takes (xgrammar's layout:
    token ``t`` is bit ``t % 32`` of word ``t // 32``)."""
    return (vocab + 31) // 32


#: One row a round asks for: a request's constraint, the token sequence the mask follows (its
#: output, then a tree path), and the bitmask row to write it to.
Ask = tuple[Constraint, tuple[int, ...], int]


def fill_bitmask(c: Constraint, output: tuple[int, ...], bitmask: torch.Tensor, index: int) -> None:
    """Write into row ``index`` of ``bitmask`` (host int32 ``[rows, words(vocab)]``, packed as
    xgrammar packs it) which tokens may follow ``output`` under the grammar. All ones where
    nothing may follow: past the grammar's end (its EOS accepted: the request ends there) or
    after a token the grammar forbids (a draft token the masked target can never accept, so
    what follows it is never emitted); a row of no allowed token would read as a fault. A
    sequence asked about before (since :func:`forget_shorter` last dropped it) is copied from
    the cache rather than walked again."""
    fill_bitmasks([(c, output, index)], bitmask)


def fill_bitmasks(asks: Sequence[Ask], bitmask: torch.Tensor) -> None:
    """:func:`fill_bitmask` for each ``(constraint, output, index)`` of ``asks``, the rows of
    a round's ask over the whole batch. The masks no cache holds are computed in waves, each
    one call to xgrammar's ``BatchGrammarMatcher``, which fills its rows on parallel threads
    (:func:`_threads`): a wave takes at most one sequence per constraint (a request's matcher
    holds one state at a time), so a chain's ask over a batch is one wave and a tree's verify
    one per node that its draft did not mask. The rows do not depend on the waves: each is
    its sequence's mask."""
    left = list(asks)
    while left:
        left = _wave(left, bitmask)


def _wave(asks: list[Ask], bitmask: torch.Tensor) -> list[Ask]:
    """Write the rows of ``asks`` that are cached, dead (all ones) or the first uncached one
    of their constraint (xgrammar, in one batched call); return the asks left for the next
    wave."""
    later: list[Ask] = []
    walked: list[tuple[Any, Ask]] = []  # (its matcher, an ask the wave computes)
    busy: set[int] = set()  # the constraints whose matcher this wave holds
    for ask in asks:
        c, output, index = ask
        known = c.cache.masks.get(output)
        if known is not None:
            bitmask[index] = known
        elif id(c) in busy:
            later.append(ask)
        elif (matcher := _matcher(c, output)) is None or matcher.is_terminated():
            bitmask[index] = -1
            c.cache.masks[output] = bitmask[index].clone()
        else:
            busy.add(id(c))
            walked.append((matcher, ask))
    if walked:
        matchers = [matcher for matcher, _ in walked]
        filler = _filler(_threads(len(walked)))
        filler.batch_fill_next_token_bitmask(matchers, bitmask, [a[2] for _, a in walked])
    for _, (c, output, index) in walked:
        c.cache.computed += 1
        c.cache.masks[output] = bitmask[index].clone()
    return later


#: The most threads that fill one wave of masks (:func:`fill_bitmasks`). A process-wide
#: setting: 1 (the default) fills the rows in turn on the calling thread; None, half the CPUs
#: this process may run on (the rest stay for the scheduler's own thread, torch's and other
#: engines'). One thread was faster on the H200's 16-CPU host at batch 8 (an EAGLE-3 chain-3
#: JSON-schema round 11.4 ms against 11.9, docs/request_controls.md): a wave starts its
#: threads anew, and a row's mask takes tens of microseconds.
FILL_THREADS: int | None = 1


def _threads(rows: int) -> int:
    """How many threads fill a wave of ``rows`` masks: one a row, at most :data:`FILL_THREADS`.
    (xgrammar's own default, half the host's hardware threads, counts CPUs outside the
    process's share, and it starts that many at every call whatever the rows.)"""
    if FILL_THREADS is not None:
        most = FILL_THREADS
    elif hasattr(os, "sched_getaffinity"):
        most = len(os.sched_getaffinity(0)) // 2
    else:
        most = (os.cpu_count() or 1) // 2
    return max(1, min(rows, most))


def _filler(threads: int) -> Any:
    """xgrammar's batched filler with ``threads`` threads (one: the rows in turn, no thread
    started), made once per calling thread (a server steps each model's engine on its own
    thread, and a filler keeps its thread pool in itself between a call's start and end)."""
    fillers = _FILLERS.__dict__.setdefault("by_threads", {})
    if threads not in fillers:
        fillers[threads] = _xgrammar().BatchGrammarMatcher(threads)
    return fillers[threads]


_FILLERS = threading.local()


def forget_shorter(c: Constraint, length: int) -> None:
    """Drop the cached masks of sequences shorter than ``length`` tokens: once the output is
    that long, every sequence asked about extends it. (A rejected branch's masks stay until
    the output outgrows them, a few rounds at most: a round drafts a bounded depth.)"""
    masks = c.cache.masks
    for key in [key for key in masks if len(key) < length]:
        del masks[key]


def legal(c: Constraint, tokens: tuple[int, ...]) -> bool:
    """Whether the grammar accepts ``tokens`` one by one (none after its end): a host drafter
    (n-gram) prunes its proposals at the first token for which this fails."""
    return _matcher(c, tokens) is not None


def finished(c: Constraint, output: tuple[int, ...]) -> bool:
    """Whether ``output`` has ended the grammar (its stop token accepted)."""
    matcher = _matcher(c, output)
    return matcher is not None and matcher.is_terminated()
