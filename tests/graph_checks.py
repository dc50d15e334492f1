"""What a graphed decode owns, for isolation tests: its captured graphs and their buffers."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from speculum.runtime.graphs import GraphedDecode


def graph_buffers(decode: GraphedDecode) -> list[tuple[object, list[torch.Tensor]]]:
    """Every graph ``decode`` has captured, with clones of its static input and output buffers."""
    return [
        (captured, [x.clone() for x in (*captured.inputs, *pytree.tree_leaves(captured.outputs))])
        for _, _, captured in decode.graphs
    ]


def changed(decode: GraphedDecode, before: list[tuple[object, list[torch.Tensor]]]) -> bool:
    """Whether ``decode`` captured a graph or wrote a static buffer since ``before``."""
    now = graph_buffers(decode)
    if [c for c, _ in now] != [c for c, _ in before]:
        return True
    return any(
        not torch.equal(a, b) for (_, new), (_, old) in zip(now, before) for a, b in zip(new, old)
    )
