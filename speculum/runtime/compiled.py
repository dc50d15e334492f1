"""``torch.compile`` as the fuser inside captured rounds (``EngineConfig.compile_stages``).

The design (DESIGN.md section 4) captures each round manually, one CUDA graph per batch
bucket (``runtime.graphs``), and uses ``torch.compile`` only as a fuser: ``dynamic=False``
(a bucket's shapes are fixed, and a new shape is a new capture anyway), ``fullgraph=True``
(a stage has no host work, so a graph break would be a bug), and inductor without its own
CUDA graphs (``triton.cudagraphs`` off: ours capture the compiled kernels).

What is compiled is a pipeline's whole decoding round, :data:`ROUND`: every stage body between
speculum's hand kernels (the custom ops of ``speculum.kernels`` and ``speculum.spec``) becomes
inductor's fused kernels, and the hand kernels stay opaque calls. Each further stage name
replaces a group of hand kernels by inductor's code for their reference math
(:data:`KERNEL_STAGES`), traced into the round where inductor may fuse it with its
neighbours. So every stage can be measured both ways on the device
(``benchmarks/compile_stages.py``) and run the faster way; ``docs/gpu.md`` says which.

Off the GPU's graphs (the CPU, ``cuda_graphs=False``), :class:`CompiledDecode` pads each
batch to its bucket as ``GraphedDecode`` does, so that one compilation serves each bucket
rather than each batch size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from speculum.kernels import model_ops
from speculum.runtime import checks
from speculum.runtime.graphs import DEFAULT_BUCKETS, bucket_for, pad_batch
from speculum.spec import accept, sampling, tree
from speculum.state.batch import batch_size, take_rows

__all__ = [
    "ROUND",
    "RECOMPILE_LIMIT",
    "KERNEL_STAGES",
    "STAGES",
    "CompiledDecode",
    "check_stages",
    "compile_round",
]

#: The stage name that compiles a decoding round, keeping every hand kernel.
ROUND = "round"


def _contiguous(reference: Callable[..., Any]) -> Callable[..., Any]:
    """``reference`` whose tensor outputs are contiguous, as the ops' kernels promise."""

    @functools.wraps(reference)
    def run(*args: Any) -> Any:
        out = reference(*args)
        if isinstance(out, Tensor):
            return out.contiguous()
        return tuple(x.contiguous() for x in out)

    return run


def _default_kernel(op: Any) -> Callable[..., Any]:
    """The Python function an op was defined with: its default kernel, the reference math
    (the ops of ``spec`` have no separate reference function)."""
    return op._init_fn


#: Hand kernels that a stage name swaps for inductor's code of their reference math. Ops that
#: write the KV pool in place (``rope_write_kv``, ``commit_kv``, ``paged_attention``'s
#: ``write_kv``) always stay hand kernels: a mutation cannot be decomposed into a traced
#: function.
KERNEL_STAGES: Mapping[str, Mapping[Any, Callable[..., Any]]] = {
    # The decoder's elementwise ops (RMSNorm, residual add + RMSNorm, rotary, SwiGLU).
    "model_ops": {
        model_ops.rms_norm: model_ops.rms_norm_reference,
        model_ops.add_rms_norm: model_ops.add_rms_norm_reference,
        model_ops.rope: model_ops.rope_reference,
        model_ops.silu_mul: model_ops.silu_mul_reference,
    },
    # Logits to tokens: the filters, the inverse-CDF draw, the counter-based uniforms.
    "sampling": {
        op: _default_kernel(op)
        for op in (
            sampling._filtered_probs_op,
            sampling._sample_from_probs_op,
            sampling.counter_uniforms,
        )
    },
    # The tree's construction and the acceptance walk.
    "tree": {op: _default_kernel(op) for op in (tree.build_tree_nodes, accept.accept_tree)},
}

#: Every stage name ``EngineConfig.compile_stages`` accepts.
STAGES = (ROUND, *KERNEL_STAGES)


def check_stages(value: object) -> tuple[str, ...]:
    """``compile_stages`` as a sorted tuple of known names (:data:`STAGES`); an empty one
    compiles nothing. Any kernel stage needs :data:`ROUND`, the compiled round it is traced
    into: it is added, not required."""
    stages = checks.names(
        "compile_stages",
        value,
        among=STAGES,
        items="stage names",
        kinds="stages",
        example="('round',) or ('round', 'sampling')",
    )
    return tuple(sorted({*stages, ROUND})) if stages else ()


def _decompositions(stages: tuple[str, ...]) -> dict[Any, Callable[..., Any]]:
    """Inductor's decompositions, plus the reference math of each kernel stage's ops."""
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    for stage in stages:
        for op, reference in KERNEL_STAGES.get(stage, {}).items():
            table[op._opoverload] = _contiguous(reference)
    return table


def _backend(stages: tuple[str, ...]) -> Callable[..., Any]:
    """Inductor with the kernel stages' decompositions and no CUDA graphs of its own."""
    from torch._inductor.compile_fx import compile_fx

    return functools.partial(
        compile_fx,
        decompositions=_decompositions(stages),
        config_patches={"triton.cudagraphs": False},
    )


#: Compilations one round function may keep: one per bucket (7 by default), per static
#: configuration of the batch (logprobs asked or not, penalties on or off...). Dynamo's
#: default of 8 would fall back to eager code silently past it.
RECOMPILE_LIMIT = 64


def compile_round(
    decode: Callable[[Any, Any], tuple[Any, Any]], stages: tuple[str, ...]
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``decode(resources, state)`` compiled with ``stages`` (checked by
    :func:`check_stages`, :data:`ROUND` among them): static shapes, one graph, inductor as the
    fuser. Its calls give the round's results (tokens exactly; floats up to the reordering of
    fused arithmetic)."""
    compiled = torch.compile(decode, dynamic=False, fullgraph=True, backend=_backend(stages))

    @functools.wraps(decode)
    def run(resources: Any, state: Any, **options: Any) -> tuple[Any, Any]:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(resources, state, **options)

    return run


@attrs.define(slots=True, eq=False)
class CompiledDecode:
    """A compiled round (:func:`compile_round`) run eagerly, its batch padded to a bucket
    (``runtime.graphs.pad_batch``) so that each bucket compiles once; the padding rows are
    dropped from the results. A round with a grammar (its host callback between stages) runs
    the uncompiled ``decode``, as a graphed round does."""

    decode: Callable[[Any, Any], tuple[Any, Any]]
    compiled: Callable[[Any, Any], tuple[Any, Any]]
    buckets: tuple[int, ...] = DEFAULT_BUCKETS

    def __call__(self, resources: Any, state: Any) -> tuple[Any, Any]:
        """One decoding round over ``state`` (any batch up to the largest bucket)."""
        if state.sampling.grammar is not None:
            return self.decode(resources, state)
        batch = batch_size(state)
        padded = pad_batch(state, bucket_for(batch, self.buckets))
        out = self.compiled(resources, padded)
        if batch_size(padded) == batch:
            return out
        return take_rows(out, torch.arange(batch, device=state.kv.seq_lens.device))
