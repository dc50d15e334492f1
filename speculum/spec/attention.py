"""Reference attention over the paged KV cache, for prefill, decode, extend and tree verify.

One function covers every shape: a batch of ``q`` query tokens per request (rows padded to a
common ``q`` with ``q_lens``) attends to its request's cached prefix of ``prefix_lens`` tokens,
all visible, and to a *tail* of ``t`` cache indices after the prefix under a boolean
``new_mask[b, i, j]`` (query ``i`` sees tail index ``prefix_lens[b] + j``). Prefill, decode and
draft-extend pass a causal mask with ``t == q``; tree verify passes the tree mask; a multi-step
draft passes ``t > q``, its earlier steps' tokens sitting in the tail before the current step's.
The queries' K/V must already be in the cache. Which tail entries exist is the mask's business:
a column no valid query should see must be False.

Sliding-window attention (``window > 0``) keeps, of each query's visible keys in cache order,
the last ``window``: a query's visible keys are its context, the prefix (positions ``0 ..
prefix_lens - 1``) then its path through the tail (one key per position, ancestors before
descendants, itself last), so the ``k``-th from the end sits at position ``p - k`` for a query
at position ``p``. Keeping the last ``window`` is transformers' rule for Mistral and Qwen's
windowed layers, key position ``> p - window`` (the query itself and ``window - 1`` keys before
it), for every shape at once: a prefill chunk, a decode step, a chain verify, a tree node at
depth ``d`` (position ``prefix_lens + d``) and a multi-step draft, with no positions passed.

Attention sinks (gpt-oss): ``sinks[h]``, a learned logit per query head, joins each softmax's
denominator as one more score with no value, so a query's weights sum to less than one.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.spec.paged import gather_kv

__all__ = [
    "check_latent_shapes",
    "latent_attention",
    "paged_attention",
    "visible_keys",
    "window_limits",
]


def window_limits(
    prefix_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q tail"],
    window: int,
) -> tuple[Int[Tensor, "batch q"], Bool[Tensor, "batch q tail"]]:
    """Where a ``window``-wide sliding window cuts each query's context (module docstring):
    ``(first_key, tail_mask)``, query ``i`` of request ``b`` seeing the prefix indices from
    ``first_key[b, i]`` on and the tail columns of ``tail_mask[b, i]`` (``new_mask`` less the
    columns more than ``window - 1`` visible keys back). ``window == 0`` is full attention:
    the whole prefix and ``new_mask`` itself."""
    batch, q, tail = new_mask.shape
    if window < 0:
        raise ValueError(f"window={window}: a sliding window is a key count (0: no window)")
    if window == 0:
        return prefix_lens.new_zeros(batch, q), new_mask
    # seen[b, i, j]: tail keys query i sees up to column j, so a seen column j sits
    # count - seen[j] keys before the query's own (the last it sees).
    seen = new_mask.to(torch.int64).cumsum(-1)
    count = seen[..., -1] if tail else prefix_lens.new_zeros(batch, q)
    tail_mask = new_mask & (count[..., None] - seen < window)
    first_key = (prefix_lens[:, None] + count - window).clamp(min=0)
    return first_key, tail_mask


def visible_keys(
    prefix_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q tail"],
    seq: int,
    window: int = 0,
) -> Bool[Tensor, "batch q seq"]:
    """Which cache indices each query attends to.

    Index ``s`` is visible to query ``i`` of request ``b`` when it is in the prefix
    (``s < prefix_lens[b]``), or when it is tail index ``j = s - prefix_lens[b] < tail`` with
    ``new_mask[b, i, j]``; with a sliding ``window`` (above 0), when it is moreover one of the
    query's last ``window`` such indices (:func:`window_limits`).
    """
    q, tail = new_mask.shape[1], new_mask.shape[2]
    first_key, new_mask = window_limits(prefix_lens, new_mask, window)
    s = torch.arange(seq, device=prefix_lens.device)[None, :]
    rel = s - prefix_lens[:, None]  # [batch, seq]: index within the tail
    in_prefix = (rel < 0)[:, None, :] & (s[:, None, :] >= first_key[:, :, None])
    if tail == 0:  # nothing after the prefix (and no column to gather the mask from)
        return in_prefix
    in_tail = (rel >= 0) & (rel < tail)
    gathered = new_mask.gather(2, rel.clamp(0, tail - 1)[:, None, :].expand(-1, q, -1))
    return in_prefix | (in_tail[:, None, :] & gathered)


def paged_attention(
    q: Float[Tensor, "batch q head head_dim"],
    k_cache: Float[Tensor, "page page_size kv_head head_dim"],
    v_cache: Float[Tensor, "page page_size kv_head head_dim"],
    page_table: Int[Tensor, "batch max_pages"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q tail"],
    scale: float,
    window: int = 0,
    sinks: Float[Tensor, " head"] | None = None,
) -> Float[Tensor, "batch q head head_dim"]:
    """Softmax attention of queries over (prefix + masked tail), grouped-query aware, each
    query seeing only its last ``window`` keys when ``window`` is above 0 (sliding-window
    attention; see the module docstring), each head's ``sinks`` logit joining the softmax's
    denominator when given.

    Computed in float32; padded query rows (``i >= q_lens[b]``) return zeros.
    """
    keys = gather_kv(k_cache, page_table).float()  # [batch, seq, kv_head, d]
    values = gather_kv(v_cache, page_table).float()
    group = q.shape[2] // keys.shape[2]
    keys = keys.repeat_interleave(group, dim=2)
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.float(), keys) * scale
    visible = visible_keys(prefix_lens, new_mask, keys.shape[1], window)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    # A query that sees no key (padding) would be NaN after softmax; it gets all-zero weights
    # instead (nan_to_num would also hide a real NaN coming out of the model).
    has_key = visible.any(-1)[:, None, :, None]
    scores = scores.masked_fill(~has_key, 0.0)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1) * has_key
    else:  # the sink is one more column of the softmax, dropped after it (it has no value)
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1] * has_key
    # Weight 0 times a NaN/inf value would still be NaN, so each query's output must depend on
    # the values it sees alone: not on a stale slot, a padded query's column, or a tree node
    # off its path. Non-finite values are zeroed for the product, and a query that does see one
    # gets NaN, as exact arithmetic would give it.
    finite = values.isfinite().all(-1)  # [batch, seq, head]
    out = torch.einsum("bhqs,bshd->bqhd", probs, torch.where(finite[..., None], values, 0.0))
    sees_non_finite = (visible[:, :, :, None] & ~finite[:, None]).any(2)  # [batch, q, head]
    out = out.masked_fill(sees_non_finite[..., None], float("nan"))
    valid = torch.arange(q.shape[1], device=q.device)[None, :] < q_lens[:, None]
    return torch.where(valid[:, :, None, None], out, 0.0).to(q.dtype)


def check_latent_shapes(
    q: Float[Tensor, "batch q head cache_dim"],
    cache: Float[Tensor, "page page_size kv_head cache_dim"],
    latent_dim: int,
) -> None:
    """Raise ``ValueError`` unless ``q`` and ``cache`` are absorbed latent attention's: one
    cached "head" per token, queries as wide as it, a latent of ``latent_dim`` leading columns
    with rotary columns after it."""
    if cache.dim() != 4 or cache.shape[2] != 1:
        raise ValueError(
            f"a latent cache is [page, page_size, 1, latent + rope] (one cached head per "
            f"token), got {tuple(cache.shape)}: allocate it with KVPool.allocate_latent"
        )
    if q.dim() != 4 or q.shape[-1] != cache.shape[-1]:
        raise ValueError(
            f"absorbed queries [batch, q, head, {cache.shape[-1]}] must be as wide as the "
            f"latent cache's rows, got {tuple(q.shape)}: concatenate W_UKᵀ q_nope and q_pe"
        )
    if not 0 < latent_dim < cache.shape[-1]:
        raise ValueError(
            f"latent_dim={latent_dim} must leave both latent and rotary columns in the cache's "
            f"{cache.shape[-1]}: pass kv_lora_rank"
        )


def latent_attention(
    q: Float[Tensor, "batch q head cache_dim"],
    cache: Float[Tensor, "page page_size 1 cache_dim"],
    page_table: Int[Tensor, "batch max_pages"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q tail"],
    scale: float,
    latent_dim: int,
) -> Float[Tensor, "batch q head latent"]:
    """Multi-head latent attention (DeepSeek-V2/V3) run absorbed over a latent cache.

    Each cached token is one row ``[latent (latent_dim) | rotated rope key]``; every query head
    (``[W_UKᵀ q_nope | rotated q_pe]``, as wide as a row) attends to the rows over prefix and
    masked tail as :func:`paged_attention` does, with the rows' latent columns as the values.
    Returns each head's latent output (``W_UV`` maps it to ``v_head_dim`` outside).
    """
    check_latent_shapes(q, cache, latent_dim)
    values = cache[..., :latent_dim]
    return paged_attention(q, cache, values, page_table, prefix_lens, q_lens, new_mask, scale)
