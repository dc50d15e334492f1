"""Serving benchmark: an async client sends streamed completions to ``speculum serve`` at swept
request rates (Poisson arrivals, as SGLang's ``bench_serving``) and reports, per rate, request
and output-token throughput, time to first token (TTFT), inter-token latency (ITL: the gaps
between streamed chunks, a speculative round's tokens arriving together) and time per output
token after the first (TPOT), p50 and p99.

Prompts are ``--prompts-file`` lines (a ``.jsonl`` file: ``{"prompt": TEXT}`` per line), or
snippets of the ``.py`` files installed with the interpreter (the training corpus). Every request
is greedy with ``ignore_eos``, so that each configuration generates the same number of tokens.

Either point it at a running server (``--url``), or let it start ``speculum serve`` once per
``--launch`` (the flags of that server, e.g. ``--launch "" --launch "--algorithm plain"`` to
compare the bundled EAGLE-3 pair with plain decoding), each on a free port, stopped after its
sweep:

    python benchmarks/serve.py --launch "" --launch "--algorithm plain" --rates 1,4,inf
    python benchmarks/serve.py --url http://127.0.0.1:8000 --num-prompts 128 --max-tokens 256

Rate ``inf`` sends every request at once. Needs the ``serve`` extra and httpx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from speculum.training.corpus import installed_python_files, read_text  # noqa: E402


def corpus_prompts(count: int, chars: int, seed: int) -> list[str]:
    """``count`` snippets of ``chars`` characters from the installed ``.py`` files."""
    rng = random.Random(seed)
    files = installed_python_files()
    prompts: list[str] = []
    while len(prompts) < count:
        text = read_text(rng.choice(files)) or ""
        if len(text) > chars:
            start = rng.randrange(len(text) - chars)
            prompts.append(text[start : start + chars])
    return prompts


def file_prompts(path: Path, count: int) -> list[str]:
    """The first ``count`` prompts of a file: its lines, or ``{"prompt"}`` per ``.jsonl`` line."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        lines = [json.loads(line)["prompt"] for line in lines]
    return (lines * (count // len(lines) + 1))[:count]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    """Send one streamed completion; its TTFT, chunk gaps, tokens and end-to-end time."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            new = sum(len(c.get("token_ids", [])) for c in chunk.get("choices", []))
            if new:
                arrivals.append(time.perf_counter())
                tokens += new
    end = time.perf_counter()
    return {
        "ttft": arrivals[0] - start,
        "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])],
        "tokens": tokens,
        "e2e": end - start,
    }


async def sweep_rate(url: str, prompts: list[str], rate: float, max_tokens: int, seed: int):
    """Send ``prompts`` at Poisson arrivals of ``rate`` per second; the results and the wall."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:

        async def delayed(prompt: str, at: float) -> dict:
            await asyncio.sleep(at)
            return await one_request(client, url, prompt, max_tokens)

        at, tasks = 0.0, []
        for prompt in prompts:
            tasks.append(delayed(prompt, at))
            at += 0.0 if rate == float("inf") else rng.expovariate(rate)
        start = time.perf_counter()
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank), 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(label: str, rate: float, results: list[dict], wall: float) -> str:
    """One table row: throughput and the latency percentiles, in milliseconds."""
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    ms = [
        1e3 * v
        for v in (
            percentile(ttft, 0.5),
            percentile(ttft, 0.99),
            percentile(gaps, 0.5),
            percentile(gaps, 0.99),
            statistics.median(tpot) if tpot else 0.0,
        )
    ]
    cells = [label, f"{rate:g}", f"{len(results) / wall:.2f}", f"{tokens / wall:.1f}"]
    cells += [f"{v:.1f}" for v in ms]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| server | rate (req/s) | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
    "ITL p99 ms | TPOT p50 ms |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


@contextmanager
def launched(flags: str):
    """``speculum serve FLAGS --port 0`` in a subprocess; yields its URL once it listens."""
    command = [sys.executable, "-m", "speculum", "serve", *shlex.split(flags), "--port", "0"]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        said = []  # the server's log so far: it says why, when the server exits instead
        for line in process.stderr:
            said.append(line)
            found = re.search(r"Uvicorn running on (http://\S+)", line)
            if found:
                break
        else:
            log = "".join(said[-20:])
            raise RuntimeError(f"speculum serve {flags} exited with {process.wait()}:\n{log}")
        yield found.group(1)
    finally:
        process.terminate()
        process.wait()
        process.stderr.close()


def main() -> None:
    """Parse the flags, run each server's sweep, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's base URL")
    where.add_argument("--launch", action="append", metavar="FLAGS", help="serve flags")
    parser.add_argument("--rates", default="1,4,inf", help="request rates, req/s (%(default)s)")
    parser.add_argument("--num-prompts", type=int, default=32, help="per rate (%(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request (%(default)s)")
    parser.add_argument("--prompt-chars", type=int, default=200, help="corpus snippets' length")
    parser.add_argument("--prompts-file", type=Path, help="prompts, instead of the corpus")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = (
        file_prompts(args.prompts_file, args.num_prompts)
        if args.prompts_file
        else corpus_prompts(args.num_prompts, args.prompt_chars, args.seed)
    )
    rates = [float(r) for r in args.rates.split(",")]
    print(HEADER)
    servers = [(args.url, None)] if args.url else [(None, flags) for flags in args.launch]
    for url, flags in servers:
        with launched(flags) if flags is not None else _given(url) as base:
            label = url or f"serve {flags}".strip()
            asyncio.run(sweep_rate(base, prompts[:2], float("inf"), 4, args.seed))  # warm-up
            for rate in rates:
                results, wall = asyncio.run(
                    sweep_rate(base, prompts, rate, args.max_tokens, args.seed)
                )
                print(row(label, rate, results, wall), flush=True)


@contextmanager
def _given(url: str):
    yield url.rstrip("/")


if __name__ == "__main__":
    main()
