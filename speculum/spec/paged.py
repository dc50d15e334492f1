"""Reference paged-KV addressing: slot indices, in-place K/V writes and gathers. Pure torch."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.state.forward import ForwardBatch
from speculum.state.kv import PADDING_PAGE, PagedKV
from speculum.state.record import make

__all__ = ["causal_mask", "cache_slots", "write_kv", "gather_kv", "extend_batch"]


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
    valid = offsets < q_lens[:, None]
    return make(
        ForwardBatch,
        input_ids=torch.where(valid, input_ids, 0),
        positions=kv.seq_lens[:, None] + offsets,
        slots=cache_slots(kv.page_table, kv.page_size, kv.seq_lens, valid),
        page_table=kv.page_table,
        prefix_lens=kv.seq_lens,
        q_lens=q_lens,
        new_mask=causal_mask(batch, q, input_ids.device),
    )
