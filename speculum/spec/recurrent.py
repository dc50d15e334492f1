"""Reference recurrent layers over the recurrent pool: short causal conv, then the gated delta
rule (gated DeltaNet) or the Mamba-2 state-space update, token by token, each token starting
from its parent's state. Pure torch, eager.

The same function runs prefill chunks, decode steps, draft steps and tree verify: a query's
parent is the latest tail index its mask row allows before itself (its predecessor for causal
masks, its parent node for tree masks), or the committed prefix when there is none. Each
query's state is written at its own cache index's ring entry (``state.recurrent``) before the
next query reads, so candidate states of every draft node are values kept in the pool until
the round ends, and commit picks the accepted one (:func:`commit_states`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.state.kv import KVPool, PagedKV
from speculum.state.recurrent import PADDING_SLOT
from speculum.state.tree import AcceptResult

__all__ = [
    "node_parents",
    "l2norm",
    "chunked_delta_rule",
    "gated_delta_rule",
    "mamba2_scan",
    "commit_states",
]


def node_parents(new_mask: Bool[Tensor, "batch q tail"]) -> Int[Tensor, "batch q"]:
    """Each query's parent as a tail index: the latest index before its own (query ``i`` sits at
    tail index ``tail - q + i``) that its mask row allows, -1 when none (its parent is the
    last committed token)."""
    q, tail = new_mask.shape[1], new_mask.shape[2]
    own = (tail - q + torch.arange(q, device=new_mask.device))[:, None]
    index = torch.arange(tail, device=new_mask.device)[None, :]
    before = new_mask & (index < own)
    return torch.where(before, index, -1).amax(-1)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x`` divided by its L2 norm over the last axis (as transformers and FLA compute it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _parent_states(
    conv: Float[Tensor, "slot ring channels kernel_1"],
    ssm: Float[Tensor, "slot ring *state"],
    slots: Int[Tensor, " batch"],
    parent: Int[Tensor, " batch"],
) -> tuple[Tensor, Tensor]:
    """The conv ``[batch, channels, kernel_1]`` and recurrent ``[batch, *state]`` states after
    cache index ``parent`` of each row's slot (its ring entry), zeros where ``parent`` is -1
    (before the first token)."""
    ring = conv.shape[1]
    started = parent >= 0
    conv_in = conv[slots, parent.remainder(ring)]
    state = ssm[slots, parent.remainder(ring)]
    return (
        torch.where(started.view(-1, 1, 1), conv_in, 0.0),
        torch.where(started.view(-1, *[1] * (state.dim() - 1)), state, 0.0),
    )


def _scan(
    conv: Float[Tensor, "slot ring channels kernel_1"],
    ssm: Float[Tensor, "slot ring *state"],
    slots: Int[Tensor, " batch"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q tail"],
    mixed: Float[Tensor, "batch q channels"],
    conv_weight: Float[Tensor, "channels kernel"],
    conv_bias: Float[Tensor, " channels"] | None,
    cell: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]],
) -> Float[Tensor, "batch q *out"]:
    """The recurrence every recurrent-state kind shares: each query starts from its parent's
    conv and recurrent states (its ring entry, zeros before the first token), runs the causal
    conv over its window and SiLU, then ``cell(i, conv_out, state) -> (out, state)`` (the
    kind's own update), and writes both states at its own cache index's ring entry before
    the next query reads. Padded queries (``i >= q_lens``) write to the padding slot."""
    ring = conv.shape[1]
    q, tail = mixed.shape[1], new_mask.shape[2]
    parents = node_parents(new_mask)
    outputs = []
    for i in range(q):
        conv_in, state = _parent_states(conv, ssm, slots, prefix_lens + parents[:, i])
        window = torch.cat([conv_in, mixed[:, i, :, None].to(conv.dtype)], -1)
        x = (window * conv_weight).sum(-1)
        out, state = cell(i, F.silu(x if conv_bias is None else x + conv_bias), state)
        outputs.append(out)
        # Written before the next query reads: a later query may be this one's child.
        where = prefix_lens + tail - q + i
        slot = torch.where(i < q_lens, slots, PADDING_SLOT)
        conv[slot, where.remainder(ring)] = window[..., 1:]
        ssm[slot, where.remainder(ring)] = state
    return torch.stack(outputs, 1).to(mixed.dtype)


def chunked_delta_rule(
    query: Float[Tensor, "batch q head k_dim"],
    key: Float[Tensor, "batch q head k_dim"],
    value: Float[Tensor, "batch q head v_dim"],
    gate: Float[Tensor, "batch q head"],
    beta: Float[Tensor, "batch q head"],
    state: Float[Tensor, "batch head k_dim v_dim"],
    chunk: int,
) -> tuple[Float[Tensor, "batch q head v_dim"], Float[Tensor, "batch head k_dim v_dim"]]:
    """The gated delta rule over a causal run of tokens, ``chunk`` tokens at a time (the
    prefill form; the recurrent form runs token by token): outputs and the state after the
    last token, equal to the recurrence up to rounding.

    Queries and keys come L2-normed (queries also scaled by ``1 / sqrt(k_dim)``). Within a
    chunk starting from state ``S0``, with ``G_i`` the cumulative log decay, the values the
    recurrence writes are ``u_i = beta_i (v_i - exp(G_i) S0ᵀk_i - sum_{j<i} exp(G_i - G_j)
    (k_i·k_j) u_j)``, one unit-lower-triangular solve for the chunk; then ``o_i = exp(G_i)
    S0ᵀq_i + sum_{j<=i} exp(G_i - G_j) (q_i·k_j) u_j`` and ``S = exp(G_C) S0 + sum_j
    exp(G_C - G_j) k_j u_jᵀ``. A token with ``gate = beta = 0`` leaves the state as it was
    (how callers pad rows)."""
    outputs = []
    for start in range(0, query.shape[1], chunk):
        # [batch, head, c, dim]: one chunk, heads first.
        q, k, v = (t[:, start : start + chunk].transpose(1, 2) for t in (query, key, value))
        g, b = (t[:, start : start + chunk].transpose(1, 2) for t in (gate, beta))
        cumulative = g.cumsum(-1)
        c = cumulative.shape[-1]
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        # decay[i, j] = exp(G_i - G_j) for j <= i; the masked entries may overflow, so zero
        # their exponents first.
        gap = (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~lower, 0.0)
        decay = gap.exp().masked_fill(~lower, 0.0)
        strict = (decay * (k @ k.transpose(-1, -2))).tril(-1) * b[..., None]
        eye = torch.eye(c, dtype=q.dtype, device=q.device)
        start_decay = cumulative.exp()[..., None]
        written = b[..., None] * (v - start_decay * (k @ state))
        u = torch.linalg.solve_triangular(eye + strict, written, upper=False, unitriangular=True)
        attended = (q @ k.transpose(-1, -2)) * decay
        outputs.append(start_decay * (q @ state) + attended @ u)
        last = cumulative[..., -1:]
        to_end = (last - cumulative).exp()[..., None]
        state = last.exp()[..., None] * state + (k * to_end).transpose(-1, -2) @ u
    return torch.cat(outputs, 2).transpose(1, 2), state


def gated_delta_rule(
    conv: Float[Tensor, "slot ring channels kernel_1"],
    ssm: Float[Tensor, "slot ring head k_dim v_dim"],
    slots: Int[Tensor, " batch"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q tail"],
    mixed: Float[Tensor, "batch q channels"],
    conv_weight: Float[Tensor, "channels kernel"],
    gate: Float[Tensor, "batch q head"],
    beta: Float[Tensor, "batch q head"],
    dims: Sequence[int],
    chunk: int = 0,
) -> Float[Tensor, "batch q head v_dim"]:
    """Linear-attention outputs of ``q`` queries of one layer, writing each query's conv and
    delta-rule states into that layer's ``conv`` and ``ssm`` (``RecurrentPool.conv[layer]``,
    ``.ssm[layer]``) at its slot and cache index's ring entry, in place.

    ``mixed`` are the conv inputs (queries, keys, values concatenated); ``gate`` is the log
    decay ``g`` and ``beta`` the write strength per value head; ``dims`` is ``(k_heads, k_dim,
    v_heads, v_dim)``. Padded queries (``i >= q_lens``) write to the padding slot.

    ``chunk`` above 0 is the prefill form, for a causal run of new tokens per row (a prompt
    chunk; never a tree): the delta rule runs ``chunk`` tokens at a time
    (:func:`chunked_delta_rule`), and only each row's last token's states are written (the
    only ones a later forward reads: the next token's parent).
    """
    k_heads, k_dim, v_heads, v_dim = dims
    batch = mixed.shape[0]
    group = v_heads // k_heads
    if chunk > 0:
        return _chunked_prefill(
            conv, ssm, slots, prefix_lens, q_lens, new_mask, mixed, conv_weight, gate, beta,
            dims, chunk,
        )  # fmt: skip

    def cell(i: int, x: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        query, key, value = x.split([k_heads * k_dim, k_heads * k_dim, v_heads * v_dim], -1)
        query = l2norm(query.view(batch, k_heads, k_dim).float()).repeat_interleave(group, 1)
        key = l2norm(key.view(batch, k_heads, k_dim).float()).repeat_interleave(group, 1)
        value = value.view(batch, v_heads, v_dim).float()
        state = state * gate[:, i].float().exp()[..., None, None]
        remembered = (state * key[..., None]).sum(-2)
        delta = (value - remembered) * beta[:, i].float()[..., None]
        state = state + key[..., None] * delta[..., None, :]
        return (state * (query / k_dim**0.5)[..., None]).sum(-2), state

    return _scan(conv, ssm, slots, prefix_lens, q_lens, new_mask, mixed, conv_weight, None, cell)


def _chunked_prefill(
    conv: Float[Tensor, "slot ring channels kernel_1"],
    ssm: Float[Tensor, "slot ring head k_dim v_dim"],
    slots: Int[Tensor, " batch"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q tail"],
    mixed: Float[Tensor, "batch q channels"],
    conv_weight: Float[Tensor, "channels kernel"],
    gate: Float[Tensor, "batch q head"],
    beta: Float[Tensor, "batch q head"],
    dims: Sequence[int],
    chunk: int,
) -> Float[Tensor, "batch q head v_dim"]:
    """:func:`gated_delta_rule`'s prefill form: the causal conv over each row's run at once,
    the chunked delta rule from the committed prefix's states, and the last real token's conv
    and delta-rule states written at its ring entry (padded tokens change no state)."""
    k_heads, k_dim, v_heads, v_dim = dims
    batch, q = mixed.shape[:2]
    ring, kernel = conv.shape[1], conv_weight.shape[-1]
    conv_in, state = _parent_states(conv, ssm, slots, prefix_lens - 1)
    # window[..., i : i + kernel] is token i's conv window.
    window = torch.cat([conv_in, mixed.transpose(1, 2).to(conv.dtype)], -1)
    x = F.silu((window.unfold(-1, kernel, 1) * conv_weight[:, None]).sum(-1)).transpose(1, 2)
    # In the state's dtype (float32 in the pool), as the recurrent form computes.
    dtype = ssm.dtype
    query, key, value = x.to(dtype).split([k_heads * k_dim, k_heads * k_dim, v_heads * v_dim], -1)
    group = v_heads // k_heads
    query, key = (
        l2norm(t.reshape(batch, q, k_heads, k_dim)).repeat_interleave(group, 2)
        for t in (query, key)
    )
    real = (torch.arange(q, device=mixed.device) < q_lens[:, None])[..., None]
    out, state = chunked_delta_rule(
        query / k_dim**0.5,
        key,
        value.reshape(batch, q, v_heads, v_dim),
        torch.where(real, gate.to(dtype), 0.0),
        torch.where(real, beta.to(dtype), 0.0),
        state,
        chunk,
    )
    last = (q_lens - 1).clamp(min=0)
    taps = last[:, None, None] + 1 + torch.arange(kernel - 1, device=mixed.device)
    where = (prefix_lens + new_mask.shape[2] - q + last).remainder(ring)
    slot = torch.where(q_lens > 0, slots, PADDING_SLOT)
    conv[slot, where] = window.gather(-1, taps.expand(batch, window.shape[1], kernel - 1))
    ssm[slot, where] = state
    return out.to(mixed.dtype)


def mamba2_scan(
    conv: Float[Tensor, "slot ring channels kernel_1"],
    ssm: Float[Tensor, "slot ring head head_dim d_state"],
    slots: Int[Tensor, " batch"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    new_mask: Bool[Tensor, "batch q tail"],
    xbc: Float[Tensor, "batch q channels"],
    conv_weight: Float[Tensor, "channels kernel"],
    conv_bias: Float[Tensor, " channels"] | None,
    dt: Float[Tensor, "batch q head"],
    A: Float[Tensor, " head"],
    D: Float[Tensor, " head"],
    dims: Sequence[int],
) -> Float[Tensor, "batch q head head_dim"]:
    """Mamba-2 (SSD) outputs of ``q`` queries of one layer, writing each query's conv and
    SSM states into that layer's ``conv`` and ``ssm`` at its slot and cache index's ring
    entry, in place, exactly as :func:`gated_delta_rule` does.

    ``xbc`` are the conv inputs (``x``, then ``B`` and ``C`` of ``n_groups`` groups); ``dt``
    the step sizes (softplus-ed and clamped); ``A`` the negative decay rates (``-exp(A_log)``)
    and ``D`` the skip weights per head; ``dims`` is ``(heads, head_dim, n_groups,
    d_state)``. Per head ``h`` of group ``g``, after the conv and SiLU:
    ``S = exp(dt A) S + dt x ⊗ B_g`` and ``y = S C_g + D x``, in float32.
    """
    heads, head_dim, groups, d_state = dims
    batch = xbc.shape[0]
    per_group = heads // groups

    def cell(i: int, out: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        x, b, c = out.float().split([heads * head_dim, groups * d_state, groups * d_state], -1)
        x = x.view(batch, heads, head_dim)
        b, c = (t.view(batch, groups, d_state).repeat_interleave(per_group, 1) for t in (b, c))
        step = dt[:, i].float()
        decay = (step * A.float()).exp()[..., None, None]
        state = state * decay + (step[..., None] * x)[..., None] * b[:, :, None]
        y = (state * c[:, :, None]).sum(-1) + D.float()[:, None] * x
        return y, state

    return _scan(conv, ssm, slots, prefix_lens, q_lens, new_mask, xbc, conv_weight, conv_bias, cell)


def commit_states(pool: KVPool, kv: PagedKV, accepted: AcceptResult) -> None:
    """Copy the state after the accepted path's last node (at its own cache index) to the
    entry of the accepted depth, where the next round reads it, in every recurrent layer, in
    place. A rejected node's state stays behind in an entry no record points at.

    A chain round (``accepted.chain``, static) copies nothing: its accepted node at depth
    ``d`` is node ``d``, already at the entry of depth ``d``. Deciding it from the static
    field, not from the data, keeps the round free of host syncs and CUDA-graph capturable.
    """
    states = pool.recurrent
    if states is None or accepted.chain:
        return
    depth = accepted.num_accepted
    node = accepted.path.gather(1, depth[:, None])[:, 0]
    ring = states.ring
    # Rows of the caches viewed as [layer, slot * ring, ...]: row slot * ring + entry.
    source = kv.state_slots * ring + (kv.seq_lens + node).remainder(ring)
    destination = kv.state_slots * ring + (kv.seq_lens + depth).remainder(ring)
    for cache in (states.conv, states.ssm):
        # view, not flatten: a copy would take the writes and leave the pool as it was.
        rows = cache.view(cache.shape[0], cache.shape[1] * ring, *cache.shape[3:])
        # Fewest bytes torch can move here: pure torch has no copy between two places of one
        # tensor, so the accepted states are gathered once ([layer, batch, ...]: one read and
        # one write of what moves) and written once (one read, one write). Each is a whole
        # ``[...]`` state per (layer, row), so index_select / index_copy_ copy contiguous
        # blocks, where ``cache[:, slots, entry] = cache[:, slots, entry]`` computes an offset
        # per element from two index tensors (1.6x slower on CPU for the same bytes). Rows
        # whose accepted node is its depth still copy onto themselves: skipping them needs a
        # data-dependent shape. The gather also reads every source before any write.
        rows.index_copy_(1, destination, rows.index_select(1, source))
