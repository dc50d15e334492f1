"""Time xgrammar's token mask per generated token at a ~150k vocabulary on this machine.

The vocabulary is synthetic (no download): the 256 bytes plus random printable byte strings of
2 to 8 bytes, 151,936 ids as Qwen's. For each grammar the script walks a fixed valid output
token by token (single-byte tokens), timing ``fill_next_token_bitmask`` and ``accept_token``,
and prints a table of the median and 90th percentile per token. llguidance is not measured
yet (docs/request_controls.md says why xgrammar was chosen)."""

from __future__ import annotations

import random
import statistics
import time
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


def time_case(compiler: Any, kind: str, source: str, text: str) -> list[float]:
    """Seconds per token of mask + accept over ``text``, one byte token at a time
    (``compiler``: an xgrammar ``GrammarCompiler``)."""
    import xgrammar as xgr  # here, not at the top: request_controls.py imports this module

    compiled = (
        compiler.compile_json_schema(source, any_whitespace=False, separators=(",", ":"))
        if kind == "json_schema"
        else compiler.compile_regex(source)
    )
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    times = []
    for byte in text.encode():
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        assert matcher.accept_token(byte)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(vocabulary(), xgr.VocabType.RAW, stop_token_ids=[VOCAB - 1])
    compiler = xgr.GrammarCompiler(info)
    print(f"| grammar | tokens | median ms/token | p90 ms/token |  (vocab {VOCAB})")
    print("| --- | --- | --- | --- |")
    for kind, (source, text) in CASES.items():
        times = sorted(time_case(compiler, kind, source, text))
        p90 = times[int(0.9 * (len(times) - 1))]
        print(f"| {kind} | {len(times)} | {1e3 * statistics.median(times):.3f} | {1e3 * p90:.3f} |")


if __name__ == "__main__":
    main()
