"""Reference attention over the paged KV cache, for prefill, decode, extend and tree verify.

One function covers every shape: a batch of ``q`` new tokens per request (rows padded to a common
``q`` with ``q_lens``) attends to its request's cached prefix of ``prefix_lens`` tokens and to the
new tokens themselves under a boolean ``new_mask`` (causal for prefill/decode/extend, the tree
mask for verify). The new tokens' K/V must already be in the cache at indices
``prefix_lens + 0 .. q-1``.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.spec.paged import gather_kv

__all__ = ["paged_attention", "visible_keys"]


def visible_keys(
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q q"],
    seq: int,
) -> Bool[Tensor, "batch q seq"]:
    """Which cache indices each new token attends to.

    Index ``s`` is visible to new token ``i`` of request ``b`` when it is in the prefix
    (``s < prefix_lens[b]``), or when it is new token ``j = s - prefix_lens[b]`` with
    ``j < q_lens[b]`` and ``new_mask[b, i, j]``.
    """
    q = new_mask.shape[1]
    s = torch.arange(seq, device=prefix_lens.device)[None, :]
    rel = s - prefix_lens[:, None]  # [batch, seq]: index among the new tokens
    in_prefix = rel < 0
    in_new = (rel >= 0) & (rel < q_lens[:, None])
    gathered = new_mask.gather(2, rel.clamp(0, q - 1)[:, None, :].expand(-1, q, -1))
    return in_prefix[:, None, :] | (in_new[:, None, :] & gathered)


def paged_attention(
    q: Float[Tensor, "batch q head head_dim"],
    k_cache: Float[Tensor, "page page_size kv_head head_dim"],
    v_cache: Float[Tensor, "page page_size kv_head head_dim"],
    page_table: Int[Tensor, "batch max_pages"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q q"],
    scale: float,
) -> Float[Tensor, "batch q head head_dim"]:
    """Softmax attention of new tokens over (prefix + new tokens), grouped-query aware.

    Computed in float32; padded query rows (``i >= q_lens[b]``) return zeros.
    """
    keys = gather_kv(k_cache, page_table).float()  # [batch, seq, kv_head, d]
    values = gather_kv(v_cache, page_table).float()
    group = q.shape[2] // keys.shape[2]
    keys = keys.repeat_interleave(group, dim=2)
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.float(), keys) * scale
    visible = visible_keys(prefix_lens, q_lens, new_mask, keys.shape[1])[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    # Padding rows see no key and would be NaN after softmax; they get zero weights instead
    # (not nan_to_num, which would also hide a real NaN coming out of the model).
    has_key = visible.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1) * has_key
    out = torch.einsum("bhqs,bshd->bqhd", probs, values)
    valid = torch.arange(q.shape[1], device=q.device)[None, :] < q_lens[:, None]
    return torch.where(valid[:, :, None, None], out, 0.0).to(q.dtype)
