"""Eager-side input checks that name the offending batch rows, at one host sync per check."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Bool
from torch import Tensor

__all__ = ["checking", "raise_for_rows"]


def checking() -> bool:
    """Whether eager validation runs here: not while ``torch.compile`` traces and not while a
    CUDA graph is being captured (both forbid the host sync a check costs). Captured stages are
    validated by the eager warm-up calls that precede capture."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def raise_for_rows(
    context: str, problems: Sequence[str], flags: Sequence[Bool[Tensor, " batch"]]
) -> None:
    """Raise ``ValueError`` listing each problem flagged in some batch row, with the rows.

    ``flags[i][b]`` says whether ``problems[i]`` holds for batch row ``b``; all flags come to
    the host in one copy.
    """
    rows = torch.stack(list(flags)).tolist()
    found = [
        f"{what} in batch rows {[b for b, bad in enumerate(row) if bad]}"
        for what, row in zip(problems, rows, strict=True)
        if any(row)
    ]
    if found:
        raise ValueError(f"{context}: " + "; ".join(found))
