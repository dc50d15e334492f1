"""What an n-gram round costs: its device part captured as CUDA graphs against eager rounds, and
both against a plain decoding step and an EAGLE-3 chain round verifying as many tokens; and the
device matcher's rounds (match, verify, accept, commit in one graph), synchronous and
overlapped.

The target is ``benchmarks/decode.py``'s (Llama-3.1-8B-shaped, random bf16 weights) and so is
the EAGLE-3 head. Every request's prompt is one random 32-token block repeated (``--prompt``
tokens in all), so the matcher finds continuations in each request's history as it would in
repetitive text. Random weights make acceptance meaningless; what is compared is the time per
round of the scheduler's loop (``scheduler.step`` after every prompt is prefilled, the round's
device-to-host copy included), with ``--rounds`` rounds timed after ``--warmup`` rounds (graph
capture). An n-gram round of ``k`` draft tokens verifies ``k`` nodes, as an EAGLE chain of
``k - 1`` steps does (root included); ``break-even`` is the acceptance length at which the
round matches plain decoding's tokens/s (round time over plain step time). The host matcher
drafts trees (breadth 1-10), the device matcher chains: they verify as many nodes, so their
round times compare, not their acceptance.

Run on the GPU: ``python benchmarks/ngram_rounds.py`` (``--tiny`` for a CPU smoke run of the
script itself, whose numbers mean nothing; there every round is eager).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import LLAMA_8B, TINY, build_models, sync  # noqa: E402

from speculum.runtime import scheduler  # noqa: E402
from speculum.runtime.engine import (  # noqa: E402
    Engine,
    NgramOptions,
    SpecOptions,
    engine_from_model,
)


def repeated_prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    """``batch`` prompts, each a random 32-token block repeated up to ``length`` tokens."""
    generator = torch.Generator().manual_seed(batch)
    blocks = torch.randint(0, vocab, (batch, 32), generator=generator)
    return [(block.tolist() * (length // 32 + 1))[:length] for block in blocks]


def round_ms(engine: Engine, batch: int, args: argparse.Namespace, device: str) -> float:
    """Milliseconds per round of the scheduler's loop over ``batch`` decoding requests."""
    vocab = engine.resources.target.config.vocab_size
    state = scheduler.new_state(engine)
    budget = (args.warmup + args.rounds) * engine.pipeline.max_tokens_per_step + 8
    for prompt in repeated_prompts(vocab, batch, args.prompt):
        state, _ = scheduler.add_request(
            engine, state, prompt, max_new_tokens=budget, ignore_eos=True
        )
    while state.waiting or state.prefilling:
        state, _ = scheduler.step(engine, state)
    for _ in range(args.warmup):
        state, _ = scheduler.step(engine, state)
    sync(device)
    begin = time.perf_counter()
    for _ in range(args.rounds):
        state, _ = scheduler.step(engine, state)
    sync(device)
    return (time.perf_counter() - begin) / args.rounds * 1e3


def engines(target, head, batch: int, tokens: int, args) -> dict[str, Engine]:
    """The configurations of one row, by label."""
    limits = dict(
        max_batch=batch,
        max_context=args.prompt + (args.warmup + args.rounds + 2) * (tokens + 1),
        prefill_budget=batch * args.prompt,
        graph_buckets=(batch,),
    )
    ngram = dict(algorithm="ngram", spec=SpecOptions(num_draft_tokens=tokens))
    device = dict(ngram, ngram=NgramOptions(matcher="device"))
    chain = SpecOptions(num_steps=tokens - 1, topk=1)
    return {
        # one step a round (CUDA's default runs four): the columns compare rounds with a step
        "plain": engine_from_model(target, spec=SpecOptions(decode_steps=1), **limits),
        f"eagle3 chain {tokens - 1}": engine_from_model(
            target, algorithm="eagle3", draft=head, spec=chain, **limits
        ),
        "ngram graphed": engine_from_model(target, **ngram, **limits),
        "ngram eager": engine_from_model(target, **ngram, cuda_graphs=False, **limits),
        "ngram device": engine_from_model(target, **device, **limits),
        "ngram device overlap": engine_from_model(target, **device, overlap=True, **limits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tokens", default="4,8", help="draft tokens per n-gram round")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny model")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    target, head = build_models(TINY if args.tiny else LLAMA_8B, device, dtype)
    print(f"{device}; prompts of {args.prompt} tokens; ms per round of the scheduler's loop")
    print(
        "| batch | draft tokens | plain ms | eagle3 chain ms | ngram graphed ms | ngram eager ms "
        "| device matcher ms | device matcher overlap ms | graphed / chain | graphed / eager "
        "| device / graphed | device overlap / graphed | break-even (graphed) "
        "| break-even (device overlap) |"
    )
    print("| ---: " * 14 + "|")
    for batch in (int(b) for b in args.batches.split(",")):
        for tokens in (int(t) for t in args.tokens.split(",")):
            ms = [
                round_ms(e, batch, args, device)
                for e in engines(target, head, batch, tokens, args).values()
            ]
            plain, chain, graphed, eager, on_device, overlapped = ms
            cells = [batch, tokens, *(f"{v:.2f}" for v in ms)]
            ratios = [graphed / chain, graphed / eager, on_device / graphed, overlapped / graphed]
            ratios += [graphed / plain, overlapped / plain]
            cells += [f"{r:.2f}" for r in ratios]
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
