"""Host cost of running a decoding round through its CUDA-graph wrapper, graph replay excluded.

Every captured round pays host work around its replay: flattening the batch state, finding the
bucket's graph, copying the state into the graph's static inputs and the rows out of its
static outputs. This script measures that work alone, on any machine: ``runtime.graphs.capture``
is replaced by a stand-in that records the call's outputs once and whose replay does nothing,
so what is timed is exactly the wrapper's host work (plus, on a GPU, its copy launches).

    python benchmarks/graph_host.py [--rounds 2000] [--batches 1,3,16]

Prints microseconds per round for plain decoding and an EAGLE chain of 3 on a tiny model, per
batch size (a batch below its bucket also pays the padding).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.runtime import graphs, scheduler
from speculum.runtime.default_model import TINY_CONFIG
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.state.record import snapshot


class _NoReplay:
    """A graph whose replay does nothing: the static outputs keep the recorded call's."""

    def replay(self) -> None:
        """Nothing: only the wrapper's host work is timed."""


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


def microseconds_per_round(engine, batch: int, rounds: int) -> float:
    """Host time of one wrapped round over a ``batch``-row state (its graph captured first)."""
    wrapped = graphs.GraphedDecode(engine.pipeline.decode, graphs.DEFAULT_BUCKETS)
    state = decoding_state(engine, batch)
    wrapped(engine.resources, state)  # captures
    begin = time.perf_counter()
    for _ in range(rounds):
        wrapped(engine.resources, state)
    return (time.perf_counter() - begin) / rounds * 1e6


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
        "plain": engine_from_model(target, max_batch=16, max_context=128),
        "eagle chain 3": engine_from_model(
            target,
            algorithm="eagle",
            draft=random_draft(target, "eagle", seed=1),
            spec=SpecOptions(num_steps=3),
            max_batch=16,
            max_context=128,
        ),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    print("| round | batch | wrapper host us/round |")
    print("|---|---:|---:|")
    for name, engine in engines.items():
        for batch in (int(b) for b in args.batches.split(",")):
            cost = microseconds_per_round(engine, batch, args.rounds)
            print(f"| {name} | {batch} | {cost:.0f} |", flush=True)


if __name__ == "__main__":
    main()
