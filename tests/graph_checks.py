"""CUDA graphs on the CPU, for the tests of what wraps them: a stand-in capture whose replay
runs the recorded call, and what a graphed decode owns (its captured graphs and buffers)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from speculum.runtime import graphs
from speculum.runtime.graphs import GraphedDecode
from speculum.state.record import snapshot


def graph_buffers(decode: GraphedDecode) -> list[tuple[object, list[torch.Tensor]]]:
    """Every graph ``decode`` has captured, with clones of its static input and output buffers."""
    captures = [graph.captured for _, _, graph in decode.graphs]
    return [
        (captured, [x.clone() for x in (*captured.inputs, *pytree.tree_leaves(captured.outputs))])
        for captured in captures
    ]


def changed(decode: GraphedDecode, before: list[tuple[object, list[torch.Tensor]]]) -> bool:
    """Whether ``decode`` captured a graph or wrote a static buffer since ``before``."""
    now = graph_buffers(decode)
    if [c for c, _ in now] != [c for c, _ in before]:
        return True
    return any(
        not torch.equal(a, b) for (_, new), (_, old) in zip(now, before) for a, b in zip(new, old)
    )


class FakeGraph:
    """A CUDA graph's contract on the CPU: replay runs the recorded call on the static inputs
    and writes its results into the static outputs, in place."""

    def __init__(self, fn, inputs, spec, outputs):
        self.fn, self.inputs, self.spec, self.outputs = fn, inputs, spec, outputs

    def replay(self):
        fresh = self.fn(*pytree.tree_unflatten(list(self.inputs), self.spec))
        for static, value in zip(pytree.tree_leaves(self.outputs), pytree.tree_leaves(fresh)):
            static.copy_(value)


def fake_capture(fn, args, *, pool=None, warmup=2):
    """``graphs.capture``'s stand-in: static inputs and outputs as a capture makes them, and a
    :class:`FakeGraph` over them."""
    leaves, spec = pytree.tree_flatten(args)
    inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in leaves)
    outputs = snapshot(fn(*pytree.tree_unflatten(list(inputs), spec)))
    graph = FakeGraph(fn, inputs, spec, outputs)
    return graphs.Captured(graph=graph, inputs=inputs, in_spec=spec, outputs=outputs)
