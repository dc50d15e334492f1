"""An engine: a pipeline value plus the resources it runs on and the scheduler's limits."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import torch

from speculum.models.config import UnsupportedModel
from speculum.models.decoder import DecoderModel
from speculum.models.loading import DTYPES, load_model
from speculum.models.tokenizer import Tokenizer, load_tokenizer
from speculum.pipelines import get_pipeline
from speculum.pipelines.base import Pipeline, Resources

__all__ = ["EngineConfig", "Engine", "build_engine", "engine_from_model"]


@attrs.define(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Scheduler limits: KV pages, batch size, context length and prefill chunking."""

    page_size: int = 16
    num_pages: int = 0
    max_batch: int = 16
    max_context: int = 1024
    prefill_budget: int = 512

    def max_pages_per_request(self, lookahead: int) -> int:
        """Page-table width: a full context plus the pipeline's lookahead slots."""
        return math.ceil((self.max_context + lookahead) / self.page_size)


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class Engine:
    """What the scheduler's pure functions run against (the pools are written in place)."""

    pipeline: Pipeline
    resources: Resources
    config: EngineConfig
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        """The device the target model runs on."""
        return self.resources.target_pool.k.device


def engine_from_model(
    target: DecoderModel,
    *,
    algorithm: str = "plain",
    tokenizer: Tokenizer | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    max_batch: int = 16,
    max_context: int | None = None,
    prefill_budget: int = 512,
) -> Engine:
    """An engine over an already-built target model.

    ``max_context`` defaults to the model's ``max_position_embeddings`` (capped at 4096 to keep
    CPU pools small); ``num_pages`` defaults to enough pages for ``max_batch`` full contexts.
    """
    pipeline = get_pipeline(algorithm)
    model_limit = target.config.max_position_embeddings
    context = max_context or min(model_limit, 4096)
    if context > model_limit:
        raise ValueError(
            f"max_context={context} exceeds the model's max_position_embeddings={model_limit}"
        )
    window = target.config.sliding_window
    if window is not None and window < context:
        raise UnsupportedModel(
            f"sliding_window={window} is shorter than the context of {context} tokens and "
            f"sliding-window attention is not implemented; pass max_context <= {window}"
        )
    for name, value in (("page_size", page_size), ("max_batch", max_batch)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be at least 1")
    if prefill_budget < 1:
        raise ValueError(f"prefill_budget={prefill_budget}: must be at least 1")
    config = EngineConfig(
        page_size=page_size,
        num_pages=0,
        max_batch=max_batch,
        max_context=context,
        prefill_budget=prefill_budget,
    )
    per_request = config.max_pages_per_request(pipeline.kv_lookahead)
    config = attrs.evolve(config, num_pages=num_pages or max_batch * per_request + 1)
    resources = Resources(target=target, target_pool=target.new_pool(config.num_pages, page_size))
    return Engine(
        pipeline=pipeline,
        resources=resources,
        config=config,
        tokenizer=tokenizer,
        eos_token_ids=target.config.eos_token_ids,
    )


def build_engine(
    model: str | Path,
    *,
    algorithm: str = "plain",
    device: str = "cpu",
    dtype: str | None = None,
    **limits: int,
) -> Engine:
    """Load a Hugging Face model folder (and its tokenizer, when it has one) into an engine."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available here")
    get_pipeline(algorithm)  # fail on an unknown algorithm before loading weights
    target = load_model(model, dtype=DTYPES[dtype] if dtype else None, device=device)
    folder = Path(model)
    tokenizer = load_tokenizer(folder) if (folder / "tokenizer.json").exists() else None
    return engine_from_model(target, algorithm=algorithm, tokenizer=tokenizer, **limits)
