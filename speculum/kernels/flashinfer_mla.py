"""flashinfer's MLA kernel for a target's latent attention, planned on the host before each round.

flashinfer's ``BatchMLAPagedAttentionWrapper`` (fa2 backend) computes what
``speculum::latent_attention`` does for a query block that is causal over itself (a decode step,
a chain verify), 1.4-1.9x faster than the Triton latent kernel on most of DeepSeek-V2-Lite's
shapes on the H200 (``docs/benchmarks.md``). Unlike the Triton kernel it reads the requests'
KV lengths on the host: ``plan()`` splits the work over the SMs from them and writes the work
lists into the wrapper's own device buffers; ``run()`` launches over those lists. In
synchronous scheduling the host knows each request's committed length before it launches a
round, and a round's target forwards are fixed by the pipeline (:class:`RoundForward`): so the
wrappers are planned from the host lengths before the round, and a captured round's ``run()``
calls, recorded once, read the newly planned buffers at each replay (the plan's launch shape
depends on the batch, the query widths and the head count only, which a captured graph fixes).

The page indices are never copied from the host: the wrappers of one :class:`LatentPlans` share
one device buffer holding the forward's whole page table, flattened with the page table's width
as every row's stride (``kv_indptr[b] = b * width``), which each planned target forward fills
from its own (device) page table first (:meth:`LatentPlans.bind`). So the host needs only the
lengths: :func:`plan_inputs` is the pure function from them to flashinfer's plan arguments.

Only the target's forwards of a decoding round are planned; its prefill chunks, the draft's
own latent layers (DeepSeek NextN) and draft-extend keep the Triton kernel, whose lengths after
acceptance live on the device alone. flashinfer is imported when a :class:`LatentPlans` is
built, never by importing this module (it may not import without a GPU).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from jaxtyping import Int
from torch import Tensor

from speculum.state.forward import ForwardBatch

__all__ = [
    "FLASHINFER_SHAPES",
    "LatentPlans",
    "PlanInputs",
    "RoundForward",
    "plan_inputs",
    "planned_latent_attention",
]

#: ``(kv_lora_rank, qk_rope_head_dim)`` flashinfer's MLA kernel is built and tested for
#: (DeepSeek-V2 and V3's).
FLASHINFER_SHAPES = ((512, 64),)
#: flashinfer's recommended split-KV scratch size, shared by every wrapper of a LatentPlans.
WORKSPACE_BYTES = 128 << 20


class RoundForward(NamedTuple):
    """One target forward of a decoding round: ``width`` query tokens per request, causal over
    themselves, after a prefix ``offset`` tokens past the cache the round starts from (plain
    decoding's step ``d`` is ``RoundForward(1, d)``, a chain verify of ``n`` tokens
    ``RoundForward(n, 0)``). Its KV length per request is ``committed + offset + width``."""

    width: int
    offset: int


class PlanInputs(NamedTuple):
    """flashinfer's ``plan()`` arguments for one forward, as int32 host tensors: ``qo_indptr``
    ``[rows + 1]`` (request ``b``'s queries are rows ``qo_indptr[b] ..`` of the flattened
    ``[rows * width]`` queries), ``kv_indptr`` ``[rows + 1]`` (its pages start at
    ``kv_indptr[b]`` in the flattened page table), ``kv_len_arr`` ``[rows]`` (its keys),
    and whether the forward is ``causal`` over its own queries (more than one of them)."""

    qo_indptr: Int[Tensor, " rows_plus_one"]
    kv_indptr: Int[Tensor, " rows_plus_one"]
    kv_len_arr: Int[Tensor, " rows"]
    causal: bool


def plan_inputs(
    committed: Sequence[int], rows: int, forward: RoundForward, stride: int, page_size: int
) -> PlanInputs:
    """The plan of ``forward`` over ``rows`` requests whose caches hold ``committed[b]`` tokens
    when the round starts; rows past ``len(committed)`` (a batch padded to its graph bucket)
    hold no cache (``runtime.graphs.without_cache``: length 0, every page the padding page).
    Every row's pages are its page-table row, ``stride`` entries wide, so the indices need no
    host copy (the flattened page table is the index array). Refuses lengths the page table
    cannot hold (``stride`` pages of ``page_size`` tokens) or more requests than rows."""
    if len(committed) > rows:
        raise ValueError(f"plan_inputs: {len(committed)} requests do not fit {rows} rows")
    lengths = [*committed, *[0] * (rows - len(committed))]
    kv_lens = [n + forward.offset + forward.width for n in lengths]
    if min(lengths, default=0) < 0:
        raise ValueError(f"plan_inputs: committed lengths must be >= 0, got {list(committed)}")
    longest = max(kv_lens, default=0)
    if math.ceil(longest / page_size) > stride:
        raise ValueError(
            f"plan_inputs: a forward over {longest} keys needs {math.ceil(longest / page_size)} "
            f"pages of {page_size}, more than the page table's {stride} (a request's length "
            "and the round's lookahead must fit its reserved pages)"
        )
    steps = torch.arange(rows + 1, dtype=torch.int32)
    return PlanInputs(
        qo_indptr=steps * forward.width,
        kv_indptr=steps * stride,
        kv_len_arr=torch.tensor(kv_lens, dtype=torch.int32),
        causal=forward.width > 1,
    )


#: Every live wrapper by the id a forward batch names it with (``ForwardBatch.latent_plan``):
#: the attention op receives an int, which graph capture and compilers see as a constant.
_WRAPPERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


class LatentPlans:
    """The flashinfer MLA wrappers of one engine's target, planned before each decoding round.

    One wrapper per batch size (graph bucket) and forward of the round (``forwards``, in the
    order the round runs them), made when first planned with CUDA-graph buffers (so a planned
    wrapper's device memory never moves) and a shared split-KV workspace. Owned like a KV pool:
    the target pool carries it (``KVPool.latent_plans``), and the target's forward asks it
    for its plan (:meth:`bind`), which it finds only while a round is planned
    (:meth:`planned`): prefill chunks and every other model's forwards run the Triton kernel.

    ``heads``, ``latent_dim`` (``kv_lora_rank``), ``rope_dim``, ``page_size``, ``stride`` (the
    page table's width), ``scale`` and ``dtype`` describe the target's attention and pool.
    """

    def __init__(
        self,
        forwards: tuple[RoundForward, ...],
        *,
        heads: int,
        latent_dim: int,
        rope_dim: int,
        page_size: int,
        stride: int,
        max_rows: int,
        scale: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        import flashinfer.mla  # noqa: F401 - refused before here when it cannot import

        self.forwards = forwards
        self.heads, self.latent_dim, self.rope_dim = heads, latent_dim, rope_dim
        self.page_size, self.stride, self.scale, self.dtype = page_size, stride, scale, dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.page_indices = torch.zeros(max_rows * stride, dtype=torch.int32, device=device)
        self.wrappers: dict[tuple[int, int], Any] = {}
        # The planned round: its rows (0 when none is planned) and the next forward's index.
        self.rows = 0
        self.cursor = 0

    def _wrapper(self, rows: int, index: int) -> Any:
        """The wrapper of forward ``index`` at ``rows`` rows, made on first use."""
        key = (rows, index)
        if key not in self.wrappers:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            device = self.workspace.device
            wrapper = BatchMLAPagedAttentionWrapper(
                self.workspace,
                use_cuda_graph=True,
                qo_indptr=torch.empty(rows + 1, dtype=torch.int32, device=device),
                kv_indptr=torch.empty(rows + 1, dtype=torch.int32, device=device),
                kv_indices=self.page_indices,
                kv_len_arr=torch.empty(rows, dtype=torch.int32, device=device),
                backend="fa2",
            )
            wrapper.latent_plans = self  # the op reads the latent width through it
            self.wrappers[key] = wrapper
            _WRAPPERS[id(wrapper)] = wrapper
        return self.wrappers[key]

    def plan(self, committed: Sequence[int], rows: int) -> None:
        """Plan every forward of a round over ``rows`` rows (the batch, or its graph bucket)
        whose requests' caches hold ``committed`` tokens (host ints, in batch order)."""
        if rows * self.stride > self.page_indices.numel():
            raise ValueError(
                f"LatentPlans: {rows} rows exceed the {self.page_indices.numel() // self.stride} "
                "the engine was built for (its largest graph bucket or max_batch)"
            )
        no_indices = torch.empty(0, dtype=torch.int32)  # the forward stages them (bind)
        for index, forward in enumerate(self.forwards):
            inputs = plan_inputs(committed, rows, forward, self.stride, self.page_size)
            self._wrapper(rows, index).plan(
                inputs.qo_indptr,
                inputs.kv_indptr,
                no_indices,
                inputs.kv_len_arr,
                self.heads,
                self.latent_dim,
                self.rope_dim,
                self.page_size,
                inputs.causal,
                self.scale,
                self.dtype,
                self.dtype,
            )
        self.rows, self.cursor = rows, 0

    @contextmanager
    def planned(self, committed: Sequence[int], rows: int) -> Iterator[None]:
        """Within the block, the target's forwards run the round planned from ``committed``
        over ``rows`` rows (:meth:`plan`); after it, none is planned."""
        self.plan(committed, rows)
        try:
            yield
        finally:
            self.rows = 0

    def bind(self, batch: ForwardBatch) -> int:
        """The id of the wrapper planned for the next target forward of the round, ``batch``,
        after its page table is staged as the wrappers' page indices; -1 when no round is
        planned (the Triton kernel runs).

        A round's forwards take their wrappers in ``forwards`` order, cyclically (a captured
        round runs its warm-up calls and its capture over one plan). A forward whose shape is
        not the one planned is refused: the plan would attend over other keys."""
        if self.rows == 0:
            return -1
        if batch.packed:
            raise ValueError(
                "flashinfer MLA: a packed (ragged) target forward cannot be planned on the host "
                "(its rows are chosen on the device); use --mla-kernel triton"
            )
        page_table = batch.page_table
        rows, width = batch.new_mask.shape[:2]
        index = self.cursor % len(self.forwards)
        forward = self.forwards[index]
        if (rows, width) != (self.rows, forward.width) or page_table.shape[1] != self.stride:
            raise ValueError(
                f"flashinfer MLA: target forward {index} of the round was planned for {self.rows} "
                f"rows of {forward.width} queries over a {self.stride}-page table, but runs "
                f"{rows} rows of {width} over {page_table.shape[1]} pages; the round's forwards "
                f"({list(self.forwards)}) do not match the pipeline (use --mla-kernel triton)"
            )
        self.cursor += 1
        self.page_indices[: page_table.numel()].copy_(page_table.flatten())
        return id(self.wrappers[(rows, index)])


@torch.library.custom_op("speculum::planned_latent_attention", mutates_args=())
def planned_latent_attention(q_latent: Tensor, q_rope: Tensor, cache: Tensor, plan: int) -> Tensor:
    """Latent attention of absorbed queries, latent parts ``q_latent [batch, q, head, latent]``
    and rotary ``q_rope [batch, q, head, rope]``, over the latent ``cache [page, page_size, 1,
    latent + rope]``, into ``[batch, q, head, latent]``, by the flashinfer wrapper ``plan``
    (:meth:`LatentPlans.bind`'s id): each request's queries are causal over themselves after
    its planned prefix, as a decode step's or a chain verify's are; the same function as
    ``speculum::latent_attention`` on those masks."""
    wrapper = _WRAPPERS[plan]
    latent = wrapper.latent_plans.latent_dim
    batch, q = q_latent.shape[:2]
    out = wrapper.run(
        q_latent.flatten(0, 1).contiguous(),
        q_rope.flatten(0, 1).contiguous(),
        cache[:, :, 0, :latent],
        cache[:, :, 0, latent:],
    )
    return out.view(batch, q, *out.shape[1:])


@planned_latent_attention.register_fake
def _(q_latent, q_rope, cache, plan):
    return torch.empty_like(q_latent)
