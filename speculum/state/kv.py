"""Paged KV cache: the pool (an owned resource) and the records that point into it.

The pool's pages are allocated once and written in place by contract, like JAX's donated
buffers. Everything else is a value: the allocator is a record holding a free-page stack, the
batch's page tables and lengths are a record, so a snapshot of the records is a snapshot of the
allocation, and dropping a record that pointed at rejected draft slots is the whole rollback.

Page 0 is reserved as the *padding sink*: padded token rows write their K/V there, and it is
never handed out, so padding can never overwrite a live token.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import attrs
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from speculum.state.record import record, replace, static
from speculum.state.recurrent import RecurrentPool

__all__ = [
    "PADDING_PAGE",
    "KVPool",
    "KVPoolExhausted",
    "PageAllocator",
    "PagedKV",
    "new_allocator",
    "allocate",
    "free",
    "allocated_pages",
]

#: Page id that padded rows write to; never allocated.
PADDING_PAGE = 0


class KVPoolExhausted(RuntimeError):
    """Raised when an allocation asks for more free pages than the pool has."""


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class KVPool:
    """The K and V pages of one model, allocated once.

    ``k`` and ``v`` have shape ``[layer, page, page_size, kv_head, head_dim]``; layer ``i``'s
    cache is ``k[i]`` (a contiguous view). Pools of a target and its draft model can share one
    allocator and one page table, since both index pages by the same ids.

    A multi-head latent attention pool (:meth:`allocate_latent`) keeps one "head" per token in
    ``k``: the compressed latent then the rotary key; its values are the latent, the first
    columns of ``k``, so ``v`` holds nothing (``head_dim`` 0).

    A hybrid model's pool also holds its linear-attention layers' recurrent states
    (``recurrent``, see ``state.recurrent``); ``k`` and ``v`` then hold only its attention
    layers. ``None`` for models without recurrent layers.

    ``latent_plans``, on a latent pool whose engine runs flashinfer's MLA kernel
    (``EngineConfig.mla_kernel``), is that engine's ``kernels.flashinfer_mla.LatentPlans``: the
    host-planned wrappers the model's forward over this pool binds while a round is planned.
    ``None`` (the default): every forward runs the latent-attention op.
    """

    k: Tensor
    v: Tensor
    page_size: int
    recurrent: RecurrentPool | None = None
    latent_plans: Any = None

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVPool:
        """Zero-filled pool of ``num_pages`` pages (page 0 is the padding sink)."""
        return cls._zeros(
            (num_layers, num_pages, page_size, num_kv_heads), head_dim, head_dim, dtype, device
        )

    @classmethod
    def allocate_latent(
        cls,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        latent_dim: int,
        rope_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVPool:
        """Zero-filled multi-head latent attention pool: per token and layer, ``latent_dim``
        latent values then ``rope_dim`` rotary key values in ``k`` (one head), nothing in
        ``v`` (the latent is the values)."""
        return cls._zeros(
            (num_layers, num_pages, page_size, 1), latent_dim + rope_dim, 0, dtype, device
        )

    @classmethod
    def _zeros(
        cls,
        rows: tuple[int, int, int, int],
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVPool:
        """A pool of ``rows`` (layer, page, page_size, kv_head) with ``k_dim`` / ``v_dim``
        values per K / V head, checked."""
        num_pages, page_size = rows[1], rows[2]
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is reserved)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size}: must be >= 1")
        return cls(
            k=torch.zeros(*rows, k_dim, dtype=dtype, device=device),
            v=torch.zeros(*rows, v_dim, dtype=dtype, device=device),
            page_size=page_size,
        )

    @property
    def num_pages(self) -> int:
        """Pages in the pool, the padding sink included."""
        return self.k.shape[1]


@record
class PageAllocator:
    """Free-page stack: ``free_pages[:num_free]`` are free, the rest are garbage; ``is_free``
    marks the same pages by id, so that freeing checks its pages without a scan of the stack.

    Lives on the host: allocation is decided by the scheduler, between device steps.
    """

    free_pages: Int[Tensor, " page"]
    num_free: Int[Tensor, ""]
    is_free: Bool[Tensor, " page"]
    num_pages: int = static()


def new_allocator(num_pages: int, held: Collection[int] = ()) -> PageAllocator:
    """Allocator over pages ``1 .. num_pages - 1`` (page 0 is the padding sink), all free but
    those in ``held`` (kept by a prefix cache).

    Pages are handed out in increasing order from a fresh allocator.
    """
    taken = set(held)
    free_now = [p for p in range(num_pages - 1, 0, -1) if p not in taken]
    stack = torch.zeros(num_pages, dtype=torch.int64)
    stack[: len(free_now)] = torch.tensor(free_now, dtype=torch.int64)
    is_free = torch.zeros(num_pages, dtype=torch.bool)
    is_free[stack[: len(free_now)]] = True
    return PageAllocator(
        free_pages=stack,
        num_free=torch.tensor(len(free_now)),
        is_free=is_free,
        num_pages=num_pages,
    )


def allocate(alloc: PageAllocator, count: int) -> tuple[PageAllocator, Int[Tensor, " count"]]:
    """Take ``count`` pages off the free stack; the allocator handed in is unchanged.

    Raises :class:`KVPoolExhausted` naming how many pages are free when ``count`` exceed them.
    """
    if count < 0:
        raise ValueError(f"cannot allocate a negative number of pages ({count})")
    num_free = int(alloc.num_free)
    if count > num_free:
        raise KVPoolExhausted(
            f"KV pool exhausted: {count} pages requested, {num_free} of "
            f"{alloc.num_pages - 1} free; finish or cancel requests, or build the engine with "
            "more KV pages"
        )
    pages = alloc.free_pages[num_free - count : num_free].flip(0)
    is_free = alloc.is_free.clone()
    is_free[pages] = False
    return replace(alloc, num_free=torch.tensor(num_free - count), is_free=is_free), pages


def free(alloc: PageAllocator, pages: Int[Tensor, " count"]) -> PageAllocator:
    """Push ``pages`` back on the free stack; the allocator handed in is unchanged.

    Freeing a page that is already free, or the padding sink, is an error (it would let two
    requests share a page).
    """
    pages = pages.to(torch.int64).flatten()
    ids = pages.tolist()
    valid = [0 < p < alloc.num_pages for p in ids]
    already = alloc.is_free[pages.where(torch.tensor(valid, dtype=torch.bool), 0)].tolist()
    bad = [p for p, ok, taken in zip(ids, valid, already) if taken or not ok]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(f"double free or invalid page ids {bad or ids}")
    num_free = int(alloc.num_free)
    stack = alloc.free_pages.clone()
    stack[num_free : num_free + len(pages)] = pages.flip(0)
    is_free = alloc.is_free.clone()
    is_free[pages] = True
    return replace(
        alloc, free_pages=stack, num_free=torch.tensor(num_free + len(pages)), is_free=is_free
    )


def allocated_pages(alloc: PageAllocator) -> set[int]:
    """Ids of the pages currently handed out (for invariants and tests)."""
    return set((~alloc.is_free).nonzero().flatten().tolist()) - {PADDING_PAGE}


@record
class PagedKV:
    """Where a batch's tokens live in the pool.

    ``page_table[b, i]`` is the page holding tokens ``i*page_size .. (i+1)*page_size - 1`` of
    request ``b`` (unused entries are the padding sink); ``seq_lens[b]`` counts the tokens whose
    K/V are in the cache. A token's cache index (its slot in the sequence) is distinct from its
    rotary position: tree tokens sit in consecutive slots at depth-based positions.

    ``state_slots[b]`` is request ``b``'s slot in a hybrid model's recurrent pool
    (``state.recurrent``); the padding slot 0 (the default) for models without recurrent
    layers. Always a tensor, so that a captured round's records hold nothing else.
    """

    page_table: Int[Tensor, "batch max_pages"]
    seq_lens: Int[Tensor, " batch"]
    page_size: int = static()
    state_slots: Int[Tensor, " batch"] = attrs.field(
        default=attrs.Factory(lambda kv: torch.zeros_like(kv.seq_lens), takes_self=True)
    )
