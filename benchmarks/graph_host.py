"""Host cost of running a decoding round through its CUDA-graph wrapper, graph replay excluded.

Every captured round pays host work around its replay: flattening the batch state, finding the
bucket's graph, copying the state into the graph's static inputs and the rows out of its
static outputs. This script measures that work alone, on any machine: ``runtime.graphs.capture``
is replaced by a stand-in that records the call's outputs once and whose replay does nothing,
so what is timed is exactly the wrapper's host work (plus, on a GPU, its copy launches); and,
over the same stand-in, a whole ``scheduler.step`` of a synchronous engine (the wrapper plus
the scheduler's own bookkeeping: collecting tokens, stop checks, pages).

    python benchmarks/graph_host.py [--rounds 2000] [--batches 1,3,16]

Prints microseconds per round for plain decoding and an EAGLE chain of 3 on a tiny model, per
batch size (a batch below its bucket runs in the bucket's graph): the wrapper's whole host work
and the part before the replay, which a GPU waits through (the rest overlaps the replay).
Then two host costs that grow with the engine rather than the batch: freeing a finished
request's pages per pool size, and a request's stop-string check per emitted token and its
streamed text per step, per output length.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.models.tokenizer import load_tokenizer
from speculum.runtime import graphs, scheduler
from speculum.runtime.default_model import TINY_CONFIG, default_model_dir
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import IncrementalText
from speculum.state.kv import allocate, free, new_allocator
from speculum.state.record import snapshot


class _NoReplay:
    """A graph whose replay does nothing (the static outputs keep the recorded call's) but
    note when it was asked for, in ``REPLAYED``."""

    def replay(self) -> None:
        """Note the time: only the wrapper's host work is timed."""
        REPLAYED.append(time.perf_counter())


#: When each replay was asked for (``perf_counter``), for the host time before it.
REPLAYED: list[float] = []


def recorded_once(fn, args, *, pool=None, warmup=2) -> graphs.Captured:
    """``graphs.capture``'s stand-in: one eager call gives the static outputs."""
    leaves, spec = pytree.tree_flatten(args)
    inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in leaves)
    outputs = snapshot(fn(*pytree.tree_unflatten(list(inputs), spec)))
    return graphs.Captured(graph=_NoReplay(), inputs=inputs, in_spec=spec, outputs=outputs)


def decoding_state(engine, batch: int) -> Any:
    """The batch state of ``batch`` requests right after their prefill."""
    state = scheduler.new_state(engine)
    for row in range(batch):
        state, _ = scheduler.add_request(engine, state, [1 + row, 2, 3], max_new_tokens=64)
    while state.waiting or state.prefilling:
        state, _ = scheduler.step(engine, state)
    return state.batch


def microseconds_per_round(engine, batch: int, rounds: int) -> tuple[float, float]:
    """Host time of one wrapped round over a ``batch``-row state (its graph captured first),
    whole and before the replay (what a GPU waits through; the rest overlaps the replay), the
    median of ``rounds`` µs each: this machine's noise moves a mean far more."""
    wrapped = graphs.GraphedDecode(engine.pipeline.decode, graphs.DEFAULT_BUCKETS)
    state = decoding_state(engine, batch)
    wrapped(engine.resources, state)  # captures
    whole, before = [], []
    for _ in range(rounds):
        begin = time.perf_counter()
        wrapped(engine.resources, state)
        whole.append(time.perf_counter() - begin)
        before.append(REPLAYED[-1] - begin)
    return statistics.median(whole) * 1e6, statistics.median(before) * 1e6


def scheduler_microseconds_per_step(engine, batch: int, rounds: int) -> float:
    """Host time of one synchronous ``scheduler.step`` of ``batch`` decoding requests whose
    rounds run through the graph wrapper (captured first); at most 200 rounds, which the
    requests' contexts hold (a round emits at most 4 tokens)."""
    graphed = graphs.GraphedDecode(engine.pipeline.decode, graphs.DEFAULT_BUCKETS)
    engine = attrs.evolve(engine, pipeline=attrs.evolve(engine.pipeline, decode=graphed))
    state = scheduler.new_state(engine)
    for row in range(batch):
        state, _ = scheduler.add_request(engine, state, [1 + row, 2, 3], max_new_tokens=10**6)
    for _ in range(8):  # prefill, capture
        state, _ = scheduler.step(engine, state)
    rounds = min(rounds, 200)
    begin = time.perf_counter()
    for _ in range(rounds):
        state, _ = scheduler.step(engine, state)
    return (time.perf_counter() - begin) / rounds * 1e6


def free_microseconds(num_pages: int, repeats: int = 200) -> float:
    """Host time of freeing a finished request's 20 pages in a pool of ``num_pages``."""
    allocator, pages = allocate(new_allocator(num_pages), 40)
    begin = time.perf_counter()
    for _ in range(repeats):
        free(allocator, pages[:20])
    return (time.perf_counter() - begin) / repeats * 1e6


def stop_check_microseconds(tokenizer, length: int, repeats: int = 200) -> float:
    """Host time of one emitted token's stop-string check after ``length`` output tokens
    (one stop string)."""
    output = [(7919 * i) % tokenizer.vocab_size for i in range(length)]
    begin = time.perf_counter()
    for _ in range(repeats):
        scheduler.completes_stop_string(tokenizer, output, ["</answer>"])
    return (time.perf_counter() - begin) / repeats * 1e6


def stream_step_microseconds(tokenizer, length: int, repeats: int = 200) -> float:
    """Host time of one step's streamed text (3 new tokens) of a request ``length`` output
    tokens long (``generate.IncrementalText``)."""
    output = [(7919 * i) % tokenizer.vocab_size for i in range(length + 3 * repeats)]
    text = IncrementalText()
    text.extend(tokenizer, output[:length])
    begin = time.perf_counter()
    for step in range(repeats):
        text.extend(tokenizer, output[length + 3 * step : length + 3 * step + 3])
    return (time.perf_counter() - begin) / repeats * 1e6


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--batches", default="1,3,16")
    args = parser.parse_args()
    graphs.capture = recorded_once
    torch.cuda.graph_pool_handle = object  # the wrapper asks for a pool before capturing
    config = attrs.evolve(TINY_CONFIG, vocab_size=64, hidden_size=32, intermediate_size=64)
    config = attrs.evolve(config, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    target = random_model(config, seed=0)
    engines = {
        "plain": engine_from_model(target, max_batch=16, max_context=1024),
        "eagle chain 3": engine_from_model(
            target,
            algorithm="eagle",
            draft=random_draft(target, "eagle", seed=1),
            spec=SpecOptions(num_steps=3),
            max_batch=16,
            max_context=1024,
        ),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    print("| round | batch | wrapper host us/round | before the replay | scheduler step host us |")
    print("|---|---:|---:|---:|---:|")
    for name, engine in engines.items():
        for batch in (int(b) for b in args.batches.split(",")):
            wrapper, before = microseconds_per_round(engine, batch, args.rounds)
            step = scheduler_microseconds_per_step(engine, batch, args.rounds)
            print(f"| {name} | {batch} | {wrapper:.0f} | {before:.0f} | {step:.0f} |", flush=True)
    print("\n| KV pages in the pool | free a request's pages, us |\n|---:|---:|")
    for num_pages in (1024, 16384, 65536):
        print(f"| {num_pages} | {free_microseconds(num_pages):.0f} |", flush=True)
    print("\n| output tokens | stop-string check per token, us | streamed text per step, us |")
    print("|---:|---:|---:|")
    tokenizer = load_tokenizer(default_model_dir())  # the bundled model's
    for length in (100, 1000, 4000):
        check = stop_check_microseconds(tokenizer, length)
        stream = stream_step_microseconds(tokenizer, length)
        print(f"| {length} | {check:.0f} | {stream:.0f} |", flush=True)


if __name__ == "__main__":
    main()
