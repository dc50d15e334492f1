"""Attention and KV-write ops. Default kernels: the ``spec`` reference implementations."""

from __future__ import annotations

import torch
from torch import Tensor

from speculum.spec import attention as spec_attention
from speculum.spec import paged as spec_paged

__all__ = ["latent_attention", "paged_attention", "write_kv"]


@torch.library.custom_op("speculum::write_kv", mutates_args=("cache",))
def write_kv(cache: Tensor, slots: Tensor, values: Tensor) -> None:
    """Write ``values [batch, q, kv_head, head_dim]`` into ``cache`` at flat ``slots``."""
    spec_paged.write_kv(cache, slots, values)


@torch.library.custom_op("speculum::paged_attention", mutates_args=())
def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    prefix_lens: Tensor,
    q_lens: Tensor,
    new_mask: Tensor,
    scale: float,
    window: int = 0,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of new tokens over their paged prefix and each other, each seeing its last
    ``window`` keys only when ``window`` is above 0, with each head's ``sinks`` logit in the
    softmax's denominator when given (see ``spec.attention``)."""
    return spec_attention.paged_attention(
        q, k_cache, v_cache, page_table, prefix_lens, q_lens, new_mask, scale, window, sinks
    )


@paged_attention.register_fake
def _(q, k_cache, v_cache, page_table, prefix_lens, q_lens, new_mask, scale, window=0, sinks=None):
    # One output row per query head, as wide as a value head (latent attention's values are
    # narrower than its keys).
    return q.new_empty(*q.shape[:-1], v_cache.shape[-1])


@torch.library.custom_op("speculum::latent_attention", mutates_args=())
def latent_attention(
    q: Tensor,
    cache: Tensor,
    page_table: Tensor,
    prefix_lens: Tensor,
    q_lens: Tensor,
    new_mask: Tensor,
    scale: float,
    latent_dim: int,
) -> Tensor:
    """Multi-head latent attention run absorbed over a latent cache whose rows are ``[latent
    (latent_dim) | rope key]``, the latent as the values (see ``spec.attention``)."""
    return spec_attention.latent_attention(
        q, cache, page_table, prefix_lens, q_lens, new_mask, scale, latent_dim
    )


@latent_attention.register_fake
def _(q, cache, page_table, prefix_lens, q_lens, new_mask, scale, latent_dim):
    return q.new_empty(*q.shape[:-1], latent_dim)


@write_kv.register_fake
def _(cache, slots, values):
    return None
