"""Host cost of the n-gram matcher per decoding step: microseconds vs history length and store size.

``speculum.spec.ngram.match`` runs on the host before every NGRAM verify forward, so its cost
adds to each step's latency unless it overlaps the device (it does not yet). This script times
it on synthetic token streams that look like text with repeats: a Zipf-like law over 32000
ids, where about half of every stream copies spans of a few source documents (so matches are
found and trees fill, the expensive case) and the rest is fresh. It also times
:func:`insert_many`, the per-step store update, and the corpus lookup.

Run: ``python benchmarks/ngram_matcher.py`` (``--quick`` for a smaller sweep). Record
construction type checks are off (``SPECULUM_TYPECHECK`` unset), as in production.

``--device cuda`` times the device matcher instead (``speculum.spec.ngram_device.match_chain``,
the chain found inside a round): replayed from a CUDA graph, timed with CUDA events, against
the history's capacity (its cost follows the capacity, the page table's width, not the
history's length) and the batch (``--device cpu`` runs it eagerly, as a smoke test).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

os.environ.pop("SPECULUM_TYPECHECK", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from speculum.runtime.graphs import capture  # noqa: E402
from speculum.spec.ngram import (  # noqa: E402
    NgramConfig,
    build_corpus_index,
    insert_many,
    match,
    new_store,
)
from speculum.spec.ngram_device import match_chain  # noqa: E402

VOCAB = 32000


#: Zipf-Mandelbrot token law p(r) ~ 1 / (r + 2.7): the likeliest id has ~3% of the mass, as in
#: English text under a 32k BPE vocabulary.
LAW = 1.0 / (np.arange(VOCAB) + 2.7)
LAW /= LAW.sum()


def text_like(rng: np.random.Generator, length: int, sources: list[np.ndarray]) -> np.ndarray:
    """Zipf-like tokens where about half the stream copies spans (8-64 tokens) of ``sources``."""
    out, size = [], 0
    while size < length:
        if sources and rng.random() < 0.5:
            src = sources[rng.integers(len(sources))]
            span = int(rng.integers(8, 65))
            start = int(rng.integers(0, max(1, src.size - span)))
            piece = src[start : start + span]
        else:
            piece = rng.choice(VOCAB, size=int(rng.integers(8, 65)), p=LAW).astype(np.int64)
        out.append(piece)
        size += piece.size
    return np.concatenate(out)[:length]


def time_call(fn, repeat: int) -> float:
    fn()  # warm up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def device_table(args: argparse.Namespace, rng: np.random.Generator) -> None:
    """Microseconds per ``match_chain`` call on ``args.device`` (a CUDA graph replay, timed
    with events, on CUDA), histories filled to half their capacity with text-like tokens."""
    device = torch.device(args.device)
    config = NgramConfig(num_draft_tokens=args.num_draft_tokens, min_breadth=1, max_breadth=1)
    sources = [text_like(rng, 4096, []) for _ in range(8)]
    print(
        f"device n-gram matcher on {device}, us per call, num_draft_tokens="
        f"{config.num_draft_tokens}, max_depth={config.max_depth}"
    )
    print()
    print("| capacity | batch | match (us) | chain tokens |")
    print("| ---: | ---: | ---: | ---: |")
    capacities = [1024, 4096, 16384] if args.quick else [1024, 4096, 16384, 131072]
    for capacity in capacities:
        for batch in [1, 16, 64]:
            rows = [text_like(rng, capacity // 2, sources) for _ in range(batch)]
            history = torch.full((batch, capacity), -1, dtype=torch.int64)
            history[:, : capacity // 2] = torch.from_numpy(np.stack(rows))
            lengths = torch.full((batch,), capacity // 2, dtype=torch.int64)
            args_ = (history.to(device), lengths.to(device))
            chains = match_chain(*args_, config).num_nodes.float().mean() - 1
            if device.type == "cuda":
                graph = capture(lambda h, n: match_chain(h, n, config), args_)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                for _ in range(50):
                    graph.graph.replay()
                end.record()
                torch.cuda.synchronize()
                us = start.elapsed_time(end) / 50 * 1e3
            else:
                us = time_call(partial(match_chain, *args_, config), 5)
            print(f"| {capacity} | {batch} | {us:,.1f} | {float(chains):.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller sweep")
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--order", default="recency", choices=["recency", "frequency"])
    parser.add_argument("--device", help="time the device matcher on this device instead")
    args = parser.parse_args()
    if args.device is not None:
        device_table(args, np.random.default_rng(0))
        return
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    histories = [256, 1024, 4096] if args.quick else [256, 1024, 4096, 16384]
    stores = [0, 1 << 16, 1 << 20] if args.quick else [0, 1 << 16, 1 << 20, 1 << 22]
    batches = [1, 16]
    config = NgramConfig(num_draft_tokens=args.num_draft_tokens, order=args.order)

    # Store contents: earlier streams that later histories partly copy.
    corpus_streams = [text_like(rng, 4096, []) for _ in range(8)]
    print(
        f"n-gram matcher, host cost per step (us), num_draft_tokens={config.num_draft_tokens}, "
        f"max_depth={config.max_depth}, breadth {config.min_breadth}-{config.max_breadth}, "
        f"order={config.order}, torch threads=1"
    )
    print()
    print("| history | store tokens | batch | match / step | match / request | nodes filled |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for store_tokens in stores:
        store = None
        if store_tokens:
            store = new_store(store_tokens)
            filled, streams = 0, []
            while filled < store_tokens:
                stream = text_like(rng, 2048, corpus_streams)
                streams.append((stream, 0, 0))
                filled += stream.size + 1
            store = insert_many(store, streams)
        for history_len in histories:
            for batch in batches:
                rows = [text_like(rng, history_len, corpus_streams) for _ in range(batch)]
                history = torch.from_numpy(np.stack(rows))
                lengths = torch.full((batch,), history_len, dtype=torch.int64)
                repeat = max(3, int(200 / batch))
                drafted = match(history, lengths, config, store=store)
                us = time_call(partial(match, history, lengths, config, store=store), repeat)
                nodes = float(drafted.num_nodes.float().mean())
                print(
                    f"| {history_len} | {store_tokens} | {batch} | {us:,.0f} | {us / batch:,.0f} "
                    f"| {nodes:.1f} |"
                )

    print()
    print("| store tokens | insert 16 streams of 64 tokens (us) |")
    print("| ---: | ---: |")
    for store_tokens in stores[1:]:
        store = new_store(store_tokens)
        streams = [(text_like(rng, 64, []), 17, 7) for _ in range(16)]
        us = time_call(partial(insert_many, store, streams), 20)
        print(f"| {store_tokens} | {us:,.0f} |")

    print()
    print("| corpus tokens | build index (s) | match, history 1024, batch 1 (us) |")
    print("| ---: | ---: | ---: |")
    for corpus_tokens in [1 << 16, 1 << 20] if args.quick else [1 << 16, 1 << 20, 1 << 22]:
        docs = [text_like(rng, 4096, corpus_streams) for _ in range(corpus_tokens // 4096)]
        start = time.perf_counter()
        corpus = build_corpus_index(docs)
        built = time.perf_counter() - start
        history = torch.from_numpy(text_like(rng, 1024, corpus_streams))[None]
        lengths = torch.tensor([1024])
        us = time_call(partial(match, history, lengths, config, corpus=corpus), 50)
        print(f"| {corpus_tokens} | {built:.2f} | {us:,.0f} |")


if __name__ == "__main__":
    main()
