"""Time xgrammar's and llguidance's token masks per generated token at a ~150k vocabulary.

The vocabulary is synthetic (no download): the 256 bytes plus random printable byte strings of
2 to 8 bytes, 151,936 ids as Qwen's. For each engine and grammar the script compiles the
grammar (timed), then walks a fixed valid output token by token (single-byte tokens), timing
the packed int32 bitmask fill (token ``t`` at bit ``t % 32`` of word ``t // 32``, the same
layout in both engines) plus the token's accept, and prints one table of the compile time, the
first token's time, and the mean, median, 90th and 99th percentile per token (the walks are 19
and 45 tokens, so p99 is about the slowest token), each the median over ``--repeats`` runs
(the machine is shared, so single runs are noisy). Both engines write JSON compact (no whitespace,
``,`` and ``:``). ``pip install 'speculum[bench]'`` brings llguidance; xgrammar is
``speculum[grammar]``. docs/request_controls.md has the numbers and the choice they led to."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

VOCAB = 151_936
CASES = {
    "json_schema": (
        '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},'
        '"tags":{"type":"array","items":{"type":"string"}}},"required":["name","age","tags"]}',
        '{"name":"speculum","age":3,"tags":["a","bc"]}',
    ),
    "regex": (r"[a-z]+@[a-z]+\.(com|org)", "someone@example.org"),
}


def vocabulary(size: int = VOCAB) -> list[bytes]:
    """256 single bytes, then distinct random printable strings of 2 to 8 bytes, then an empty
    last id (EOS): ``size`` ids (``benchmarks/request_controls.py`` builds its tokenizer from
    them)."""
    rng = random.Random(0)
    words = dict.fromkeys(bytes([b]) for b in range(256))
    while len(words) < size - 1:
        words[bytes(rng.randrange(33, 127) for _ in range(rng.randint(2, 8)))] = None
    return [*words, b""]


# A walk's two calls: fill the packed mask row, accept a token id (False: refused).
Step = tuple[Callable[[], None], Callable[[int], bool]]
# An engine: compile (kind, source) → a grammar; start a grammar → a fresh walk.
Engine = tuple[Callable[[str, str], Any], Callable[[Any], Step]]


def xgrammar_engine(vocab: list[bytes]) -> Engine:
    """Compile with an uncached ``GrammarCompiler`` over ``vocab`` (raw bytes, EOS the last id);
    step a ``GrammarMatcher`` filling ``xgr.allocate_token_bitmask``'s (1, ⌈V/32⌉) int32 row."""
    import xgrammar as xgr  # here, not at the top: request_controls.py imports this module

    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[len(vocab) - 1])
    # No cache: each repeat times a real compilation, as llguidance's does.
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile_(kind: str, source: str) -> Any:
        if kind == "json_schema":
            return compiler.compile_json_schema(source, any_whitespace=False, separators=(",", ":"))
        return compiler.compile_regex(source)

    def start(compiled: Any) -> Step:
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, len(vocab))
        return (lambda: matcher.fill_next_token_bitmask(bitmask)), matcher.accept_token

    return compile_, start


def llguidance_engine(vocab: list[bytes]) -> Engine:
    """Compile by building an ``LLMatcher`` (llguidance compiles a grammar when its matcher is
    made) over an ``LLTokenizer`` of ``vocab``; step it filling ``llguidance.numpy``'s
    (1, ⌈V/32⌉) int32 row."""
    import llguidance as llg
    import llguidance.numpy as llg_np

    class ByteTokenizer:
        """What ``llg.TokenizerWrapper`` reads: the token list, EOS, and an encoder (each byte
        is its own id here)."""

        eos_token_id, bos_token_id, tokens = len(vocab) - 1, None, vocab

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(ByteTokenizer()))
    compact = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def compile_(kind: str, source: str) -> Any:
        grammar = (
            llg.LLMatcher.grammar_from_json_schema(json.loads(source), overrides=compact)
            if kind == "json_schema"
            else llg.LLMatcher.grammar_from_regex(source)
        )
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"llguidance refused the {kind}: {matcher.get_error()}")
        return matcher

    def start(matcher: Any) -> Step:
        bitmask = llg_np.allocate_token_bitmask(1, len(vocab))
        return (lambda: llg_np.fill_next_token_bitmask(matcher, bitmask)), matcher.consume_token

    return compile_, start


ENGINES = {"xgrammar": xgrammar_engine, "llguidance": llguidance_engine}


def time_case(engine: Engine, kind: str, source: str, text: str) -> tuple[float, list[float]]:
    """Seconds to compile ``source``, and seconds per token of mask + accept over ``text``, one
    byte token at a time."""
    compile_, start = engine
    begin = time.perf_counter()
    compiled = compile_(kind, source)
    compile_s = time.perf_counter() - begin
    fill, accept = start(compiled)
    times = []
    for byte in text.encode():
        begin = time.perf_counter()
        fill()
        if not accept(byte):
            raise AssertionError(f"{kind}: the grammar refused byte {byte!r} of {text!r}")
        times.append(time.perf_counter() - begin)
    return compile_s, times


def percentile(sorted_times: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ascending ``sorted_times``."""
    return sorted_times[round(q * (len(sorted_times) - 1))]


def summary(engine: Engine, kind: str, repeats: int) -> tuple[int, list[float]]:
    """Tokens walked, and the medians over ``repeats`` runs of [compile, first token, mean,
    median, p90, p99] in milliseconds."""
    runs = []
    for _ in range(repeats):
        compile_s, times = time_case(engine, kind, *CASES[kind])
        first = times[0]  # llguidance builds lexer states lazily, at the first masks
        times.sort()
        stats = [compile_s, first, statistics.fmean(times), statistics.median(times)]
        runs.append([*stats, *(percentile(times, q) for q in (0.9, 0.99))])
    return len(times), [1e3 * statistics.median(column) for column in zip(*runs, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per engine and grammar")
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    args = parser.parse_args()
    vocab = vocabulary()
    print(f"vocab {VOCAB}; ms, median of {args.repeats} runs; mask+accept per token")
    print("| grammar | engine | tokens | compile | first token | mean | median | p90 | p99 |")
    print("|" + " --- |" * 9)
    for name in args.engines:
        begin = time.perf_counter()
        engine = ENGINES[name](vocab)
        print(f"<!-- {name} tokenizer setup {time.perf_counter() - begin:.2f} s -->")
        for kind in CASES:
            tokens, ms = summary(engine, kind, args.repeats)
            cells = " | ".join(f"{value:.3f}" for value in ms)
            print(f"| {kind} | {name} | {tokens} | {cells} |")


if __name__ == "__main__":
    main()
