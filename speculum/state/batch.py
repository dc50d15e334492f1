"""Row operations over batch records: every tensor leaf of a batch record has a leading batch axis.

Continuous batching is then two generic functions: requests leave with :func:`take_rows` and join
with :func:`concat_rows`, whatever pipeline's state the record is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.utils._pytree as pytree

__all__ = ["take_rows", "concat_rows", "batch_size", "shared_size"]

T = TypeVar("T")


def batch_size(tree: object) -> int:
    """The leading-axis size shared by every tensor leaf of ``tree``."""
    return shared_size(
        {x.shape[0] for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)}
    )


def shared_size(sizes: set[int]) -> int:
    """The one leading-axis size among a batch record's tensors' ``sizes`` (for callers that
    collect them while walking the record anyway); a record whose tensors disagree is an
    error."""
    if len(sizes) != 1:
        raise ValueError(f"batch record has inconsistent leading axes {sorted(sizes)}")
    return next(iter(sizes))


def take_rows(tree: T, rows: torch.Tensor) -> T:
    """Rows ``rows`` (an int index tensor) of every tensor leaf, in that order."""
    return pytree.tree_map(
        lambda x: x.index_select(0, rows.to(x.device)) if isinstance(x, torch.Tensor) else x, tree
    )


def concat_rows(trees: Sequence[T]) -> T:
    """Stack batch records of one treespec along the batch axis.

    Tensor leaves whose trailing shapes differ (page tables of different widths) are an error:
    callers build rows at the widths the batch uses.
    """
    if not trees:
        raise ValueError("concat_rows needs at least one record")
    leaves, specs = zip(*(pytree.tree_flatten(t) for t in trees))
    if any(s != specs[0] for s in specs[1:]):
        raise ValueError("concat_rows: records differ in structure or static fields")
    joined = [
        torch.cat(group, 0) if isinstance(group[0], torch.Tensor) else group[0]
        for group in zip(*leaves)
    ]
    return pytree.tree_unflatten(joined, specs[0])
