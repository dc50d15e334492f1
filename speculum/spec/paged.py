"""Reference paged-KV addressing: slot indices, in-place K/V writes and gathers. Pure torch."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.spec.checks import checking
from speculum.state.forward import ForwardBatch
from speculum.state.kv import PADDING_PAGE, PagedKV
from speculum.state.record import make

__all__ = [
    "causal_mask",
    "tail_batch",
    "cache_slots",
    "slots_at",
    "write_kv",
    "gather_kv",
    "extend_batch",
    "pack_batch",
    "packed_rows",
    "pack",
    "unpack",
]


def causal_mask(
    batch: int, q: int, device: torch.device | str = "cpu"
) -> Bool[Tensor, "batch q q"]:
    """New token ``i`` sees new tokens ``0 .. i``."""
    return torch.ones(q, q, dtype=torch.bool, device=device).tril().expand(batch, q, q)


def cache_slots(
    page_table: Int[Tensor, "batch max_pages"],
    page_size: int,
    start: Int[Tensor, " batch"],
    valid: Bool[Tensor, "batch q"],
) -> Int[Tensor, "batch q"]:
    """Flat pool slots (``page * page_size + offset``) of cache indices ``start + 0 .. q-1``.

    Invalid (padding) entries map to the padding sink so that writing them is harmless.
    """
    q = valid.shape[1]
    index = start[:, None] + torch.arange(q, device=start.device)[None, :]
    return slots_at(page_table, page_size, index, valid)


def slots_at(
    page_table: Int[Tensor, "batch max_pages"],
    page_size: int,
    index: Int[Tensor, "batch q"],
    valid: Bool[Tensor, "batch q"],
) -> Int[Tensor, "batch q"]:
    """Flat pool slots of arbitrary cache indices; invalid entries map to the padding sink."""
    # Out-of-range columns fail the gather rather than wrap onto a live page.
    page = page_table.gather(1, torch.where(valid, index // page_size, 0))
    slots = page * page_size + index % page_size
    return torch.where(valid, slots, PADDING_PAGE * page_size)


def write_kv(
    cache: Float[Tensor, "page page_size kv_head head_dim"],
    slots: Int[Tensor, "batch q"],
    values: Float[Tensor, "batch q kv_head head_dim"],
) -> None:
    """Write ``values`` into ``cache`` at ``slots``, in place (the pool is an owned resource)."""
    flat = cache.view(-1, *cache.shape[2:])
    flat.index_copy_(0, slots.reshape(-1), values.reshape(-1, *values.shape[2:]).to(cache.dtype))


def gather_kv(
    cache: Float[Tensor, "page page_size kv_head head_dim"],
    page_table: Int[Tensor, "batch max_pages"],
) -> Float[Tensor, "batch seq kv_head head_dim"]:
    """Every cache index a page table can address, in sequence order.

    ``seq = max_pages * page_size``.
    """
    return cache[page_table].flatten(1, 2)


def extend_batch(
    kv: PagedKV,
    input_ids: Int[Tensor, "batch q"],
    q_lens: Int[Tensor, " batch"],
) -> ForwardBatch:
    """Forward inputs for appending ``q_lens[b]`` tokens to each request, causally.

    Covers prefill chunks, decode (``q == 1``) and draft-extend: token ``i`` goes to cache index
    and rotary position ``seq_lens + i``.
    """
    batch, q = input_ids.shape
    offsets = torch.arange(q, device=input_ids.device)[None, :]
    return tail_batch(
        kv,
        input_ids,
        kv.seq_lens[:, None] + offsets,
        causal_mask(batch, q, input_ids.device),
        q_lens=q_lens,
    )


def tail_batch(
    kv: PagedKV,
    input_ids: Int[Tensor, "batch q"],
    positions: Int[Tensor, "batch q"],
    new_mask: Bool[Tensor, "batch q tail"],
    *,
    tail_start: int = 0,
    q_lens: Int[Tensor, " batch"] | None = None,
) -> ForwardBatch:
    """Forward inputs for queries written after the cached prefix, seeing it and a masked tail.

    Query ``i`` is written at cache index ``seq_lens + tail_start + i`` and sits at rotary
    position ``positions[b, i]``; it sees the prefix ``0 .. seq_lens - 1`` and the tail indices
    ``seq_lens + j`` where ``new_mask[b, i, j]``. Tree verify uses ``tail_start = 0`` with the
    tree mask and depth-based positions; step ``s`` of a ``topk``-wide multi-step draft uses
    ``tail_start = (s - 1) * topk``. ``q_lens`` (default: all ``q``) marks padded rows.
    """
    batch, q = input_ids.shape
    offsets = torch.arange(q, device=input_ids.device)[None, :]
    if q_lens is None:
        q_lens = torch.full((batch,), q, dtype=torch.int64, device=input_ids.device)
    valid = offsets < q_lens[:, None]
    return make(
        ForwardBatch,
        input_ids=torch.where(valid, input_ids, 0),
        positions=positions,
        slots=cache_slots(kv.page_table, kv.page_size, kv.seq_lens + tail_start, valid),
        page_table=kv.page_table,
        prefix_lens=kv.seq_lens,
        q_lens=q_lens,
        new_mask=new_mask,
        state_slots=kv.state_slots,
    )


def packed_rows(
    q_starts: Int[Tensor, " batch"], q_lens: Int[Tensor, " batch"], q: int, capacity: int
) -> Int[Tensor, " tokens"]:
    """For each of ``capacity`` packed rows, the flat padded row ``b * q + i`` it holds:
    request ``b``'s token ``i < q_lens[b]`` sits at packed row ``q_starts[b] + i``. Rows after
    the last request's hold a padding row of the padded layout (one with ``i >= q_lens[b]``;
    one exists whenever the packed rows outnumber the real tokens, as ``capacity <= batch *
    q``). The real tokens must fit, ``sum(q_lens) <= capacity``: those past it are left out."""
    batch = q_lens.shape[0]
    offsets = torch.arange(q, device=q_lens.device)
    valid = offsets[None, :] < q_lens[:, None]
    padding_row = (~valid).flatten().to(torch.int64).argmax()  # the first; 0 when there is none
    # Padding rows of the padded layout scatter into one extra row, dropped after (and so
    # would real tokens past the capacity, rather than write out of bounds).
    destination = (q_starts[:, None] + offsets[None, :]).clamp(max=capacity)
    destination = torch.where(valid, destination, capacity)
    flat = torch.arange(batch * q, device=q_lens.device)
    rows = padding_row.expand(capacity + 1).clone()
    return rows.scatter(0, destination.flatten(), flat)[:capacity]


def pack(
    x: Float[Tensor, "batch q *rest"], rows: Int[Tensor, " tokens"]
) -> Float[Tensor, "1 tokens *rest"]:
    """The packed ``[1, tokens, ...]`` form of padded ``x`` (:func:`packed_rows`'s ``rows``)."""
    return x.flatten(0, 1).index_select(0, rows)[None]


def unpack(
    x: Float[Tensor, "1 tokens *rest"],
    q_starts: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    q: int,
) -> Float[Tensor, "batch q *rest"]:
    """The padded ``[batch, q, ...]`` form of packed ``x``: request ``b``'s row ``i < q_lens[b]``
    is packed row ``q_starts[b] + i``; padding rows are zeros."""
    offsets = torch.arange(q, device=x.device)
    valid = offsets[None, :] < q_lens[:, None]
    index = (q_starts[:, None] + offsets[None, :]).clamp(max=x.shape[1] - 1)
    out = x[0].index_select(0, index.flatten()).unflatten(0, index.shape)
    return torch.where(valid.view(*valid.shape, *[1] * (x.dim() - 2)), out, 0)


def pack_batch(batch: ForwardBatch, capacity: int) -> tuple[ForwardBatch, Int[Tensor, " tokens"]]:
    """The packed form of padded ``batch`` (``ForwardBatch``'s packed layout) over ``capacity``
    rows, and the padded row each packed row holds (:func:`packed_rows`).

    ``capacity`` is a static bound on the real tokens, ``sum(q_lens) <= capacity <= batch * q``
    (a verify budget gives it), so that the forward's shapes do not depend on the lengths and
    the round stays capturable in a CUDA graph; eagerly, more real tokens than that are
    refused (in a captured round, those past it would be left out). Padding rows carry token
    0 and the padding sink's slot, as the padded layout's do, so they write no live cache
    entry.
    """
    if batch.packed:
        raise ValueError("pack_batch: the batch is already packed")
    rows_, q = batch.input_ids.shape
    if not 1 <= capacity <= rows_ * q:
        raise ValueError(
            f"pack_batch: capacity={capacity} must be between 1 and batch * q = {rows_ * q} "
            "(a bound on the real tokens of the forward)"
        )
    if checking() and int(batch.q_lens.sum()) > capacity:  # one host sync, eagerly only
        raise ValueError(
            f"pack_batch: {int(batch.q_lens.sum())} real tokens do not fit capacity="
            f"{capacity}; bound the tokens (a verify budget) or raise the capacity"
        )
    q_starts = torch.cumsum(batch.q_lens, 0) - batch.q_lens
    rows = packed_rows(q_starts, batch.q_lens, q, capacity)
    packed = make(
        ForwardBatch,
        input_ids=pack(batch.input_ids, rows),
        positions=pack(batch.positions, rows),
        slots=pack(batch.slots, rows),
        page_table=batch.page_table,
        prefix_lens=batch.prefix_lens,
        q_lens=batch.q_lens,
        new_mask=batch.new_mask,
        state_slots=batch.state_slots,
        q_starts=q_starts,
    )
    return packed, rows
