"""One module per decoding algorithm, each a composition of shared stages into a Pipeline value."""

from __future__ import annotations

from collections.abc import Callable

from speculum.pipelines import plain
from speculum.pipelines.base import Pipeline, PrefillChunk, Resources, StepOutput, prefill, step

__all__ = [
    "ALGORITHMS",
    "Pipeline",
    "PrefillChunk",
    "Resources",
    "StepOutput",
    "get_pipeline",
    "prefill",
    "step",
]

#: Algorithm name -> pipeline constructor. Later algorithms register here.
ALGORITHMS: dict[str, Callable[..., Pipeline]] = {"plain": plain.pipeline}


def get_pipeline(algorithm: str, **options: object) -> Pipeline:
    """The pipeline value of ``algorithm``; a clear error lists the known algorithms."""
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; choose one of {', '.join(sorted(ALGORITHMS))}"
        )
    return ALGORITHMS[algorithm](**options)
