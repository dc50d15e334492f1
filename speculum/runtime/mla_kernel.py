"""Which kernel runs a DeepSeek target's latent attention in decoding rounds
(``EngineConfig.mla_kernel``): speculum's Triton kernel, or flashinfer's MLA kernel planned on
the host before each round (``kernels.flashinfer_mla``; ``docs/mla.md``).

flashinfer's wrapper plans from the requests' KV lengths on the host. Synchronously scheduled,
the host knows every running request's committed length before it launches a round (its
prompt and emitted tokens but the pending last one), and the pipeline fixes the round's target
forwards (:func:`round_forwards`): the scheduler plans them (:func:`planned_round`), then runs
the round, eagerly or as a CUDA-graph replay. Everything else stays on the Triton kernel:
prefill chunks, and the draft's own latent layers and draft-extend, whose lengths after
acceptance are on the device alone.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from speculum.kernels.flashinfer_mla import FLASHINFER_SHAPES, LatentPlans, RoundForward
from speculum.models.decoder import LatentAttention
from speculum.runtime.graphs import bucket_for
from speculum.state.kv import KVPool

__all__ = [
    "CHAIN_ALGORITHMS",
    "MLA_KERNELS",
    "check_mla_kernel",
    "committed_lengths",
    "planned_round",
    "round_forwards",
    "with_latent_plans",
]

#: The kernels a target's latent attention may run in decoding rounds.
MLA_KERNELS = ("triton", "flashinfer")
#: Algorithms whose round runs one target forward, a verify of the draft tree: with ``topk``
#: 1 a chain, causal over itself, which flashinfer's MLA kernel computes.
CHAIN_ALGORITHMS = frozenset({"eagle", "eagle3", "mtp", "nextn", "standalone", "multi_layer_eagle"})


class UnsupportedKernel(ValueError):
    """Raised when ``mla_kernel="flashinfer"`` cannot run here; the message names the cause
    and the fix (usually ``mla_kernel="triton"``, the default)."""


def round_forwards(
    algorithm: str, *, steps: int, num_steps: int, topk: int, num_draft_tokens: int | None
) -> tuple[RoundForward, ...]:
    """The target forwards of one decoding round, in the order it runs them: ``steps`` plain
    decoding steps (step ``d``'s one query after ``d`` tokens past the committed cache), or a
    chain verify of ``num_draft_tokens`` (default ``num_steps + 1``) tokens right after it.
    Refuses rounds whose target forward is not causal over its queries (trees, ``topk > 1``)
    or whose widths are decided on the device (n-gram trees, block drafters, frozen-KV MTP,
    which reads per-head keys an MLA cache does not hold)."""
    if algorithm == "plain":
        return tuple(RoundForward(width=1, offset=d) for d in range(steps))
    if algorithm in CHAIN_ALGORITHMS and topk == 1:
        return (RoundForward(width=num_draft_tokens or num_steps + 1, offset=0),)
    shape = f"topk={topk}" if algorithm in CHAIN_ALGORITHMS else f"algorithm={algorithm!r}"
    raise UnsupportedKernel(
        f"mla_kernel='flashinfer' plans plain decoding and chain verifies (topk=1 of "
        f"{', '.join(sorted(CHAIN_ALGORITHMS))}); {shape} verifies a tree or a block whose mask "
        "or widths flashinfer's MLA kernel cannot take: use mla_kernel='triton' (--mla-kernel "
        "triton) or a chain (topk=1)"
    )


def check_mla_kernel(
    kernel: str,
    target: Any,
    *,
    overlap: bool,
    compile_stages: tuple[str, ...],
    adaptive: bool,
) -> None:
    """Refuse ``kernel`` where it cannot run, before anything is built: for
    ``"flashinfer"``, a target without latent-attention layers, overlapped scheduling
    (the lengths are on the device when the next round launches), compiled rounds (not
    measured with flashinfer's wrapper yet), adaptive speculation (the round's forwards are
    chosen while it runs), a compute dtype other than bfloat16 or float16, latent shapes
    flashinfer is not built for, flashinfer missing, or a device other than CUDA."""
    if kernel == "triton":
        return
    mla = getattr(getattr(target, "config", None), "mla", None)
    if mla is None or not any(isinstance(m, LatentAttention) for m in target.modules()):
        raise UnsupportedKernel(
            "mla_kernel='flashinfer' runs multi-head latent attention (DeepSeek-V2/V3 targets); "
            "this target has no latent-attention layers: drop --mla-kernel flashinfer"
        )
    refusals = (
        (
            overlap,
            "overlap scheduling keeps the requests' lengths on the device when the next "
            "round launches, and flashinfer plans from host lengths: drop --overlap",
        ),
        (
            bool(compile_stages),
            f"compiled rounds (compile_stages={compile_stages}) have not "
            "been run with flashinfer's wrapper: drop --compile-stages",
        ),
        (
            adaptive,
            "adaptive speculation chooses each round's depth, and so its verify width, "
            "as the round runs: drop --adaptive-steps",
        ),
    )
    for refused, why in refusals:
        if refused:
            raise UnsupportedKernel(f"mla_kernel='flashinfer': {why} (or use --mla-kernel triton)")
    weight = target.model.embed_tokens.weight  # the compute dtype (projections may be FP8)
    if weight.dtype not in (torch.bfloat16, torch.float16):
        raise UnsupportedKernel(
            f"mla_kernel='flashinfer' runs bfloat16 or float16 caches; the target is "
            f"{weight.dtype}: load it with --dtype bfloat16, or use --mla-kernel triton"
        )
    if (mla.kv_lora_rank, mla.qk_rope_head_dim) not in FLASHINFER_SHAPES:
        raise UnsupportedKernel(
            f"mla_kernel='flashinfer': kv_lora_rank={mla.kv_lora_rank}, qk_rope_head_dim="
            f"{mla.qk_rope_head_dim} is not a shape flashinfer's MLA kernel is built for "
            f"({FLASHINFER_SHAPES}, DeepSeek-V2/V3's): use --mla-kernel triton"
        )
    try:
        importlib.import_module("flashinfer.mla")
    except Exception as error:  # noqa: BLE001 - any import failure means it cannot run here
        raise UnsupportedKernel(
            f"mla_kernel='flashinfer' needs flashinfer, which does not import here "
            f"({type(error).__name__}: {error}): pip install 'speculum[cuda]' (flashinfer-python), "
            "or use --mla-kernel triton"
        ) from error
    if weight.device.type != "cuda":
        raise UnsupportedKernel(
            f"mla_kernel='flashinfer' runs on CUDA; the target is on {weight.device}: load it "
            "with --device cuda, or use --mla-kernel triton"
        )


def with_latent_plans(
    pool: KVPool,
    target: Any,
    forwards: tuple[RoundForward, ...],
    *,
    stride: int,
    max_rows: int,
) -> KVPool:
    """The target's latent ``pool`` carrying flashinfer plans for ``forwards`` (one wrapper
    set per batch size up to ``max_rows`` rows of ``stride`` page-table entries)."""
    layer = next(m for m in target.modules() if isinstance(m, LatentAttention))
    plans = LatentPlans(
        forwards,
        heads=layer.num_heads,
        latent_dim=layer.mla.kv_lora_rank,
        rope_dim=layer.mla.qk_rope_head_dim,
        page_size=pool.page_size,
        stride=stride,
        max_rows=max_rows,
        scale=layer.scale,
        dtype=pool.k.dtype,
        device=pool.k.device,
    )
    return attrs.evolve(pool, latent_plans=plans)


def committed_lengths(requests: Sequence[Any]) -> list[int]:
    """Each running request's committed cache length on the host: its prompt and emitted
    tokens but the last, which is pending (fed by the next round)."""
    return [len(r.prompt) + len(r.output) - 1 for r in requests]


def planned_round(engine: Any, requests: Sequence[Any]) -> contextlib.AbstractContextManager[None]:
    """A block within which the target's forwards run flashinfer's plans of ``engine``'s next
    round over the running ``requests`` (in batch order), over as many rows as the round runs:
    the batch, or with CUDA graphs the bucket it is padded to. Nothing is planned where the
    target pool carries no plans (the Triton kernel)."""
    plans = engine.resources.target_pool.latent_plans
    if plans is None:
        return contextlib.nullcontext()
    rows = len(requests)
    if engine.config.cuda_graphs and engine.device.type == "cuda":  # GraphedDecode pads
        rows = bucket_for(rows, engine.config.graph_buckets)
    return plans.planned(committed_lengths(requests), rows)
