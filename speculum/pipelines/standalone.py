"""STANDALONE: a separate small causal LM drafts, with its own KV cache, embedding and head.

The pipeline is the EAGLE composition itself (``speculum.pipelines.eagle``): what makes it
STANDALONE is the head the engine loads, ``speculum.models.standalone.StandaloneHead``, which
reads tokens only and keeps its cache one entry ahead of the target's (``head.ahead == 1``).
Chains, EAGLE-2 top-k trees and sampled chains all work; see ``docs/standalone.md``.
"""

from __future__ import annotations

from typing import Any

from speculum.pipelines import eagle
from speculum.pipelines.base import Pipeline

__all__ = ["pipeline"]


def pipeline(**options: Any) -> Pipeline:
    """The STANDALONE pipeline value; ``options`` are ``eagle.round_config``'s."""
    return eagle.pipeline(**options)
