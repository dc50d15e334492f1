"""One module per decoding algorithm, each a composition of shared stages into a Pipeline value."""

from __future__ import annotations

from collections.abc import Callable

from speculum.pipelines import (
    adaptive,
    dflash,
    dspark,
    eagle,
    frozen_kv_mtp,
    multi_layer_eagle,
    ngram,
    plain,
    standalone,
)
from speculum.pipelines.base import Pipeline, PrefillChunk, Resources, StepOutput, prefill, step
from speculum.state.record import replace

__all__ = [
    "ALGORITHMS",
    "ADAPTIVE",
    "BLOCK",
    "SPECULATIVE",
    "Pipeline",
    "PrefillChunk",
    "Resources",
    "StepOutput",
    "adaptive",
    "get_pipeline",
    "prefill",
    "step",
]

#: Algorithm name -> pipeline constructor. The EAGLE family and STANDALONE share one
#: composition; the draft head (EAGLE-1, EAGLE-3 or MTP layers, or a whole small LM) is what
#: differs, and the engine loads it by this name. FROZEN_KV_MTP runs EAGLE's drafting stages
#: with a head that reads the target's cache and records only a seed between rounds.
#: ``adaptive`` is not an algorithm of its own: it composes pipeline values of one algorithm
#: (``adaptive.pipeline``, ``adaptive.eagle_variants``), so it has no entry here.
ALGORITHMS: dict[str, Callable[..., Pipeline]] = {
    "plain": plain.pipeline,
    "eagle": eagle.pipeline,
    "eagle3": eagle.pipeline,
    "mtp": eagle.pipeline,
    "nextn": eagle.pipeline,
    "standalone": standalone.pipeline,
    "ngram": ngram.pipeline,
    "frozen_kv_mtp": frozen_kv_mtp.pipeline,
    "multi_layer_eagle": multi_layer_eagle.pipeline,
    "dflash": dflash.pipeline,
    "dspark": dspark.pipeline,
}
#: Block drafters: one draft forward per round gives a whole block of draft tokens.
BLOCK = frozenset({"dflash", "dspark"})
#: Algorithms that need a draft model (NGRAM drafts from token matches, without one).
SPECULATIVE = frozenset(ALGORITHMS) - {"plain", "ngram"}
#: Algorithms whose draft depths adaptive speculation switches between: the EAGLE family and
#: STANDALONE share one batch state at every depth (``adaptive.eagle_variants``).
ADAPTIVE = frozenset({"eagle", "eagle3", "mtp", "nextn", "standalone"})


def get_pipeline(algorithm: str, **options: object) -> Pipeline:
    """The pipeline value of ``algorithm``; a clear error lists the known algorithms."""
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; choose one of {', '.join(sorted(ALGORITHMS))}"
        )
    return replace(ALGORITHMS[algorithm](**options), name=algorithm)
