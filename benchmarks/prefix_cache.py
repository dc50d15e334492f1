"""Prefix caching on a multi-turn chat workload: time to first token and throughput, with and
without the cache.

The target is shaped like Llama-3.1-8B with random bf16 weights and the draft like an EAGLE-3
head for it (``benchmarks/decode.py``'s models). ``--conversations`` chats share one system
prompt of ``--system`` tokens; each turn adds a user message of ``--user`` random tokens and
the reply, ``--reply`` generated tokens (``ignore_eos``), so turn ``t``'s prompt resends the
whole conversation so far. The turns run in waves: every conversation's turn ``t`` is added at
once and decoded to the end before turn ``t + 1``. Time to first token is from the wave's
start to each request's first token; throughput is all tokens generated over the whole
workload's time. Each configuration first runs a warm-up workload of other random tokens (graph
capture; the cache it leaves holds none of the measured prefixes).

Run on the GPU: ``python benchmarks/prefix_cache.py`` (``--tiny`` for a CPU smoke run of the
script itself, whose numbers mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import LLAMA_8B, TINY, build_models  # noqa: E402

from speculum.runtime import scheduler  # noqa: E402
from speculum.runtime.engine import Engine, SpecOptions, engine_from_model  # noqa: E402


def conversations(args: argparse.Namespace, vocab: int, seed: int) -> tuple[list, list]:
    """The system prompt and, per conversation, its user messages (random token ids)."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(count: int) -> list[int]:
        return torch.randint(0, vocab, (count,), generator=generator).tolist()

    system = tokens(args.system)
    users = [[tokens(args.user) for _ in range(args.turns)] for _ in range(args.conversations)]
    return system, users


def workload(engine: Engine, args: argparse.Namespace, seed: int, device: str) -> dict:
    """Run every turn of every conversation, wave by wave: times to first token (s), the
    tokens generated, the prompt tokens and those found cached, and the wall time."""
    vocab = engine.resources.target.config.vocab_size
    system, users = conversations(args, vocab, seed)
    history = [list(system) for _ in users]
    ttft, generated, prompt_tokens, cached = [], 0, 0, 0
    state = scheduler.new_state(engine)
    begin = time.perf_counter()
    for turn in range(args.turns):
        wave = {}
        start = time.perf_counter()
        for index, chat in enumerate(users):
            prompt = history[index] + chat[turn]
            state, rid = scheduler.add_request(
                engine, state, prompt, max_new_tokens=args.reply, ignore_eos=True
            )
            wave[rid] = index
            history[index] = prompt
        first: dict[int, float] = {}
        while not scheduler.is_idle(state):
            state, outputs = scheduler.step(engine, state)
            now = time.perf_counter()
            for out in outputs:
                if out.new_token_ids and out.rid not in first:
                    first[out.rid] = now - start
                if out.finished:
                    request = out.request
                    history[wave[out.rid]] += list(request.output)
                    generated += len(request.output)
                    prompt_tokens += len(request.prompt)
                    cached += request.cached_tokens
        ttft += list(first.values())
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - begin
    return {
        "ttft": ttft,
        "generated": generated,
        "prompt": prompt_tokens,
        "cached": cached,
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=1024)
    parser.add_argument("--user", type=int, default=128)
    parser.add_argument("--reply", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny model")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    config = TINY if args.tiny else LLAMA_8B
    dtype = torch.float32 if args.tiny else torch.bfloat16
    target, head = build_models(config, device, dtype)
    context = args.system + args.turns * (args.user + args.reply) + 16
    print(
        f"{args.conversations} conversations x {args.turns} turns: system prompt {args.system}, "
        f"user messages {args.user}, replies {args.reply} tokens; {device}"
    )
    print("| algorithm | prefix cache | TTFT mean ms | TTFT p50 ms | TTFT max ms | "
          "cached / prompt tokens | generated tok/s | wall s |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for algorithm in ("plain", "eagle3"):
        for cache in (False, True):
            engine = engine_from_model(
                target,
                algorithm=algorithm,
                draft=None if algorithm == "plain" else head,
                spec=None if algorithm == "plain" else SpecOptions(num_steps=3),
                max_batch=args.conversations,
                max_context=context,
                prefill_budget=4096,
                prefix_cache=cache,
                cuda_graphs=not args.tiny,
            )
            workload(engine, args, seed=1, device=device)  # warm-up: other tokens
            run = workload(engine, args, seed=2, device=device)
            ms = [1e3 * t for t in run["ttft"]]
            print(
                f"| {algorithm} | {'on' if cache else 'off'} | {statistics.mean(ms):.1f} | "
                f"{statistics.median(ms):.1f} | {max(ms):.1f} | "
                f"{run['cached']} / {run['prompt']} | {run['generated'] / run['wall']:.0f} | "
                f"{run['wall']:.2f} |",
                flush=True,
            )
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
