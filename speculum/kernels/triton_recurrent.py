"""Triton twins of the recurrent layers' updates (``spec.recurrent``): the short causal conv,
the gated delta rule (gated DeltaNet) and the Mamba-2 state-space update, over ``q`` queries
whose candidate states go into the recurrent pool's ring, each query starting from its
parent's state (chains: the previous query; trees: the parent node, ``node_parents``).

The reference runs a Python loop over the queries, a dozen small batched ops per query and
layer, which inside a captured verify round costs far more in launches than in work. Here a
layer is two launches whatever ``q``:

- :func:`causal_conv` runs one program per (request, block of channels) that walks the
  queries in order: the parent's conv state (its last ``kernel - 1`` inputs, read from the
  parent's ring entry) and the query's input form the window; the conv plus bias and SiLU
  is the output, and the window's last ``kernel - 1`` columns are the query's own entry.
- :func:`delta_rule_scan` runs one program per (request, value head, block of value
  columns): the delta rule updates each column of a head's ``[k_dim, v_dim]`` state on its
  own, so the columns split across programs. :func:`mamba2_state_scan` runs one program per
  (request, head, block of ``head_dim`` rows), each row of the ``[head_dim, d_state]`` SSM
  state being independent likewise.

Each program keeps the state of its tile in registers, in float32, from one query to the
next when the next query's parent is the previous one (every query of a prefill chunk,
decode step or chain), and reloads it from the parent's ring entry otherwise (a tree node
whose parent is not its predecessor, or the first query, whose parent is the committed
prefix's last token). A query's state is written to its own entry only where something can
read it (:func:`kept_states`): a later query of this forward that reloads it, or a later
round (the last ``ring`` queries; earlier ones are overwritten within the forward anyway),
so a long prefill chunk writes a handful of states, not one per token. Stores are followed
by a barrier, so the program's later loads of an entry see its earlier stores.

Padded queries (``i >= q_lens``) write nothing (the reference writes them into the padding
slot, whose contents nobody reads). The programs issue no host sync; the launch grids depend
on shapes only, so the kernels are captured into CUDA graphs like any other.

Floating point: the reference's operations in float32, in its order but for the sums (the
conv's ``kernel`` taps, the delta rule's and Mamba-2's reductions over ``k_dim`` and
``d_state``), which the kernels reduce as trees: outputs and states agree with the
reference to a few float32 ulps (``tests/cover/test_kernel_recurrent.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.kernels.recurrent import gated_delta_rule, mamba2_scan
from speculum.spec.recurrent import node_parents

__all__ = [
    "causal_conv",
    "delta_rule_scan",
    "gated_delta_rule_triton",
    "kept_states",
    "mamba2_scan_triton",
    "mamba2_state_scan",
    "register",
]

#: Channels per conv program.
CONV_BLOCK = 128
#: Value columns per delta-rule program (a [k_dim, 32] float32 tile: 16 KiB at k_dim 128).
DELTA_BLOCK_V = 32
#: ``head_dim`` rows per Mamba-2 program.
MAMBA_BLOCK_P = 16


def kept_states(
    parents: Int[Tensor, "batch q"], q_lens: Int[Tensor, " batch"], offset: int, ring: int
) -> Bool[Tensor, "batch q"]:
    """Which queries' recurrent states must be written to their ring entries: valid queries
    (``i < q_lens``) that a later query of the forward reloads (a child that is not the next
    query; the kernels carry the state to the next query in registers) or that a later round
    may read (the last ``ring`` valid queries; an earlier query's entry is overwritten by the
    query ``ring`` places after it in this forward). ``parents`` are tail indices
    (:func:`~speculum.spec.recurrent.node_parents`) and query ``i`` sits at tail index
    ``offset + i``."""
    batch, q = parents.shape
    index = torch.arange(q, device=parents.device)
    parent_query = parents - offset
    far = (parent_query >= 0) & (parent_query != index - 1)
    # Children that are not the next query name their parent; the rest write to a spare column.
    target = torch.where(far, parent_query, q)
    reloaded = torch.zeros(batch, q + 1, dtype=torch.bool, device=parents.device)
    reloaded = reloaded.scatter(1, target, True)[:, :q]
    lens = q_lens[:, None]
    return (index < lens) & (reloaded | (index >= lens - ring))


def _scan_args(
    ssm: Tensor,
    slots: Tensor,
    prefix_lens: Tensor,
    q_lens: Tensor,
    parents: Tensor,
    offset: int,
) -> tuple:
    """The arguments both state-update kernels take after their own tensors: the rows' slots,
    prefix lengths, parents and kept-state flags, ``q``, ``offset``, the ring size and the
    pool's slot and ring strides."""
    _require_contiguous_rows("ssm", ssm, 3)
    keep = kept_states(parents, q_lens, offset, ssm.shape[1])
    return (
        slots,
        prefix_lens,
        parents.contiguous(),
        keep.to(torch.int8),
        parents.shape[1],
        offset,
        ssm.shape[1],
        ssm.stride(0),
        ssm.stride(1),
    )


def _require_contiguous_rows(name: str, cache: Tensor, dims: int) -> None:
    """The kernels address a cache's last ``dims`` axes as one contiguous row per entry."""
    if not cache[0, 0].is_contiguous() or cache.dim() != dims + 2:
        raise ValueError(
            f"{name} of shape {tuple(cache.shape)}: the Triton recurrent kernels need "
            f"[slot, ring, ...] with contiguous entries of {dims} axes (a layer of the "
            "recurrent pool, RecurrentPool.conv[layer] / .ssm[layer])"
        )


# ---------------------------------------------------------------- shared by the kernels


@triton.jit
def _parent_entry(prefix, parent, ring):
    """The ring entry of the parent at tail index ``parent`` after a prefix of ``prefix``,
    and whether it exists (none before the first token: entry 0 then, read and ignored)."""
    at = prefix + parent
    started = at >= 0
    return tl.where(started, at % ring, 0), started


@triton.jit
def _parent_state(head, tile, tile_in, state, prefix, parent, i, offset, ring, stride_ring):
    """The state tile query ``i`` starts from: ``state`` (the previous query's, in registers)
    when its parent is the previous query, else its parent's ring entry (zeros before the
    first token)."""
    if (i == 0) | (parent != offset + i - 1):
        entry, started = _parent_entry(prefix, parent, ring)
        state = tl.load(head + entry * stride_ring + tile, mask=tile_in, other=0.0)
        state = tl.where(started, state, 0.0)
    return state


@triton.jit
def _keep_state(head, tile, tile_in, state, keep_ptr, b, q, i, prefix, offset, ring, stride_ring):
    """Store query ``i``'s state tile at its own ring entry when :func:`kept_states` keeps it,
    visible to the later queries that may reload it (a tree node's children)."""
    keep = tl.load(keep_ptr + b * q + i) != 0
    own = (prefix + offset + i) % ring
    tl.store(head + own * stride_ring + tile, state, mask=_where_flag(tile_in, keep))
    tl.debug_barrier()


@triton.jit
def _where_flag(mask, flag):
    """``mask & flag`` for a scalar ``flag``, spelled so that Triton's interpreter broadcasts
    it too (it rejects a scalar boolean anded onto a block as a mask)."""
    return mask & ((mask.to(tl.int32) * 0 + flag.to(tl.int32)) != 0)


@triton.jit
def _conv_kernel(
    conv_ptr,
    mixed_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    slots_ptr,
    prefix_ptr,
    q_lens_ptr,
    parents_ptr,
    q,
    offset,
    ring,
    channels,
    stride_slot,
    stride_ring,
    stride_weight,
    KERNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    js = tl.arange(0, BLOCK_K)
    c_in = cs < channels
    taps = c_in[:, None] & (js < KERNEL)[None, :]
    weight = tl.load(weight_ptr + cs[:, None] * stride_weight + js[None, :], mask=taps, other=0.0)
    weight = weight.to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cs, mask=c_in, other=0.0).to(tl.float32)
    slot = tl.load(slots_ptr + b)
    prefix = tl.load(prefix_ptr + b)
    q_len = tl.load(q_lens_ptr + b)
    base = conv_ptr + slot.to(tl.int64) * stride_slot
    # Entry column j holds the input j taps back from the newest (column KERNEL - 2).
    history = c_in[:, None] & (js < KERNEL - 1)[None, :]
    shifted = c_in[:, None] & (js >= 1)[None, :] & (js < KERNEL)[None, :]
    rows = cs[:, None] * (KERNEL - 1)
    for i in range(q):
        entry, started = _parent_entry(prefix, tl.load(parents_ptr + b * q + i), ring)
        window = tl.load(base + entry * stride_ring + rows + js[None, :], history, 0.0)
        window = tl.where(started, window, 0.0)
        x = tl.load(mixed_ptr + (b * q + i) * channels + cs, mask=c_in, other=0.0)
        # The input enters the state in the state's dtype, as the reference casts it.
        window = tl.where(js[None, :] == KERNEL - 1, x.to(window.dtype)[:, None], window)
        acc = tl.sum(window.to(tl.float32) * weight, axis=1)
        if HAS_BIAS:
            acc += bias
        out = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (b * q + i) * channels + cs, out, mask=c_in)
        own = (prefix + offset + i) % ring
        written = _where_flag(shifted, i < q_len)
        tl.store(base + own * stride_ring + rows + js[None, :] - 1, window, mask=written)
        # The next query may read this entry (a tree node's child): make the store visible.
        tl.debug_barrier()


def causal_conv(
    conv: Float[Tensor, "slot ring channels kernel_1"],
    slots: Int[Tensor, " batch"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    parents: Int[Tensor, "batch q"],
    offset: int,
    mixed: Float[Tensor, "batch q channels"],
    conv_weight: Float[Tensor, "channels kernel"],
    conv_bias: Float[Tensor, " channels"] | None,
) -> Float[Tensor, "batch q channels"]:
    """SiLU of the depthwise causal conv of each query's window (its parent's conv state,
    then its own input), in ``conv``'s dtype; each valid query's state (the window's last
    ``kernel - 1`` inputs) written at its cache index's ring entry of its slot, in place.
    ``parents`` are tail indices and query ``i`` sits at tail index ``offset + i``."""
    _require_contiguous_rows("conv", conv, 2)
    batch, q, channels = mixed.shape
    kernel = conv_weight.shape[1]
    out = torch.empty(batch, q, channels, dtype=conv.dtype, device=mixed.device)
    if conv_weight.stride(1) != 1:
        conv_weight = conv_weight.contiguous()
    grid = (batch, triton.cdiv(channels, CONV_BLOCK))
    _conv_kernel[grid](
        conv,
        mixed.contiguous(),
        conv_weight,
        conv_bias if conv_bias is not None else conv_weight,
        out,
        slots,
        prefix_lens,
        q_lens,
        parents.contiguous(),
        q,
        offset,
        conv.shape[1],
        channels,
        conv.stride(0),
        conv.stride(1),
        conv_weight.stride(0),
        KERNEL=kernel,
        HAS_BIAS=conv_bias is not None,
        BLOCK_C=CONV_BLOCK,
        BLOCK_K=triton.next_power_of_2(kernel),
    )
    return out


# ---------------------------------------------------------------- gated delta rule


@triton.jit
def _delta_rule_kernel(
    ssm_ptr,
    x_ptr,
    gate_ptr,
    beta_ptr,
    out_ptr,
    slots_ptr,
    prefix_ptr,
    parents_ptr,
    keep_ptr,
    q,
    offset,
    ring,
    stride_slot,
    stride_ring,
    root_k,
    K_HEADS: tl.constexpr,
    V_HEADS: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (V_HEADS // K_HEADS)
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_in, v_in = ks < K_DIM, vs < V_DIM
    tile_in = k_in[:, None] & v_in[None, :]
    tile = ks[:, None] * V_DIM + vs[None, :]
    slot = tl.load(slots_ptr + b)
    prefix = tl.load(prefix_ptr + b)
    head = ssm_ptr + slot.to(tl.int64) * stride_slot + h * K_DIM * V_DIM
    channels = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for i in range(q):
        parent = tl.load(parents_ptr + b * q + i)
        state = _parent_state(
            head, tile, tile_in, state, prefix, parent, i, offset, ring, stride_ring
        )
        row = x_ptr + (b * q + i) * channels
        query = tl.load(row + kh * K_DIM + ks, mask=k_in, other=0.0).to(tl.float32)
        key = tl.load(row + (K_HEADS + kh) * K_DIM + ks, mask=k_in, other=0.0).to(tl.float32)
        value = tl.load(row + 2 * K_HEADS * K_DIM + h * V_DIM + vs, mask=v_in, other=0.0)
        query = query * tl.rsqrt(tl.sum(query * query, axis=0) + 1e-6)
        key = key * tl.rsqrt(tl.sum(key * key, axis=0) + 1e-6)
        g = tl.load(gate_ptr + (b * q + i) * V_HEADS + h).to(tl.float32)
        beta = tl.load(beta_ptr + (b * q + i) * V_HEADS + h).to(tl.float32)
        state = state * tl.exp(g)
        remembered = tl.sum(state * key[:, None], axis=0)
        delta = (value.to(tl.float32) - remembered) * beta
        state = state + key[:, None] * delta[None, :]
        out = tl.sum(state * (query / root_k)[:, None], axis=0)
        tl.store(out_ptr + ((b * q + i) * V_HEADS + h) * V_DIM + vs, out, mask=v_in)
        _keep_state(
            head, tile, tile_in, state, keep_ptr, b, q, i, prefix, offset, ring, stride_ring
        )


def delta_rule_scan(
    ssm: Float[Tensor, "slot ring head k_dim v_dim"],
    slots: Int[Tensor, " batch"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    parents: Int[Tensor, "batch q"],
    offset: int,
    x: Float[Tensor, "batch q channels"],
    gate: Float[Tensor, "batch q head"],
    beta: Float[Tensor, "batch q head"],
    dims: Sequence[int],
    out_dtype: torch.dtype,
) -> Float[Tensor, "batch q head v_dim"]:
    """The gated delta rule over the conv outputs ``x`` (queries, keys, values of ``dims =
    (k_heads, k_dim, v_heads, v_dim)``), each query from its parent's state (tail index
    ``parents``; query ``i`` at ``offset + i``), the states :func:`kept_states` names
    written into ``ssm`` (float32) in place; outputs in ``out_dtype``."""
    k_heads, k_dim, v_heads, v_dim = dims
    batch, q, _ = x.shape
    out = torch.empty(batch, q, v_heads, v_dim, dtype=out_dtype, device=x.device)
    grid = (batch, v_heads, triton.cdiv(v_dim, DELTA_BLOCK_V))
    _delta_rule_kernel[grid](
        ssm,
        x.contiguous(),
        gate.contiguous(),
        beta.contiguous(),
        out,
        *_scan_args(ssm, slots, prefix_lens, q_lens, parents, offset),
        k_dim**0.5,
        K_HEADS=k_heads,
        V_HEADS=v_heads,
        K_DIM=k_dim,
        V_DIM=v_dim,
        BLOCK_K=triton.next_power_of_2(k_dim),
        BLOCK_V=min(DELTA_BLOCK_V, triton.next_power_of_2(v_dim)),
    )
    return out


def gated_delta_rule_triton(
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
    dims: list[int],
    chunk: int = 0,
) -> Float[Tensor, "batch q head v_dim"]:
    """``speculum::gated_delta_rule`` in two launches (:func:`causal_conv`, then
    :func:`delta_rule_scan`), same arguments and results as the reference. ``chunk`` (the
    reference's chunked prefill form) changes nothing here: the scan keeps each state in
    registers from one query to the next whatever the form, and stores the ones a later forward
    may read (:func:`kept_states`), a superset of what the chunked form writes."""
    parents = node_parents(new_mask)
    offset = new_mask.shape[2] - new_mask.shape[1]
    x = causal_conv(conv, slots, prefix_lens, q_lens, parents, offset, mixed, conv_weight, None)
    scan = (ssm, slots, prefix_lens, q_lens, parents, offset)
    return delta_rule_scan(*scan, x, gate, beta, dims, mixed.dtype)


# ---------------------------------------------------------------- Mamba-2


@triton.jit
def _mamba2_kernel(
    ssm_ptr,
    x_ptr,
    dt_ptr,
    a_ptr,
    d_ptr,
    out_ptr,
    slots_ptr,
    prefix_ptr,
    parents_ptr,
    keep_ptr,
    q,
    offset,
    ring,
    stride_slot,
    stride_ring,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUPS: tl.constexpr,
    D_STATE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // (HEADS // GROUPS)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    p_in, n_in = ps < HEAD_DIM, ns < D_STATE
    tile_in = p_in[:, None] & n_in[None, :]
    tile = ps[:, None] * D_STATE + ns[None, :]
    slot = tl.load(slots_ptr + b)
    prefix = tl.load(prefix_ptr + b)
    head = ssm_ptr + slot.to(tl.int64) * stride_slot + h * HEAD_DIM * D_STATE
    channels = HEADS * HEAD_DIM + 2 * GROUPS * D_STATE
    a = tl.load(a_ptr + h).to(tl.float32)
    skip = tl.load(d_ptr + h).to(tl.float32)
    state = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for i in range(q):
        parent = tl.load(parents_ptr + b * q + i)
        state = _parent_state(
            head, tile, tile_in, state, prefix, parent, i, offset, ring, stride_ring
        )
        row = x_ptr + (b * q + i) * channels
        x = tl.load(row + h * HEAD_DIM + ps, mask=p_in, other=0.0).to(tl.float32)
        bs = row + HEADS * HEAD_DIM + g * D_STATE + ns
        b_in = tl.load(bs, mask=n_in, other=0.0).to(tl.float32)
        c_out = tl.load(bs + GROUPS * D_STATE, mask=n_in, other=0.0).to(tl.float32)
        step = tl.load(dt_ptr + (b * q + i) * HEADS + h).to(tl.float32)
        state = state * tl.exp(step * a) + (step * x)[:, None] * b_in[None, :]
        y = tl.sum(state * c_out[None, :], axis=1) + skip * x
        tl.store(out_ptr + ((b * q + i) * HEADS + h) * HEAD_DIM + ps, y, mask=p_in)
        _keep_state(
            head, tile, tile_in, state, keep_ptr, b, q, i, prefix, offset, ring, stride_ring
        )


def mamba2_state_scan(
    ssm: Float[Tensor, "slot ring head head_dim d_state"],
    slots: Int[Tensor, " batch"],
    prefix_lens: Int[Tensor, " batch"],
    q_lens: Int[Tensor, " batch"],
    parents: Int[Tensor, "batch q"],
    offset: int,
    x: Float[Tensor, "batch q channels"],
    dt: Float[Tensor, "batch q head"],
    A: Float[Tensor, " head"],
    D: Float[Tensor, " head"],
    dims: Sequence[int],
    out_dtype: torch.dtype,
) -> Float[Tensor, "batch q head head_dim"]:
    """Mamba-2's state update over the conv outputs ``x`` (``x``, ``B``, ``C`` of ``dims =
    (heads, head_dim, n_groups, d_state)``), each query from its parent's state (tail index
    ``parents``; query ``i`` at ``offset + i``), the states :func:`kept_states` names
    written into ``ssm`` (float32) in place; outputs in ``out_dtype``."""
    heads, head_dim, groups, d_state = dims
    batch, q, _ = x.shape
    out = torch.empty(batch, q, heads, head_dim, dtype=out_dtype, device=x.device)
    grid = (batch, heads, triton.cdiv(head_dim, MAMBA_BLOCK_P))
    _mamba2_kernel[grid](
        ssm,
        x.contiguous(),
        dt.contiguous(),
        A.contiguous(),
        D.contiguous(),
        out,
        *_scan_args(ssm, slots, prefix_lens, q_lens, parents, offset),
        HEADS=heads,
        HEAD_DIM=head_dim,
        GROUPS=groups,
        D_STATE=d_state,
        BLOCK_P=min(MAMBA_BLOCK_P, triton.next_power_of_2(head_dim)),
        BLOCK_N=triton.next_power_of_2(d_state),
    )
    return out


def mamba2_scan_triton(
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
    dims: list[int],
) -> Float[Tensor, "batch q head head_dim"]:
    """``speculum::mamba2_scan`` in two launches (:func:`causal_conv`, then
    :func:`mamba2_state_scan`), same arguments and results as the reference."""
    parents = node_parents(new_mask)
    offset = new_mask.shape[2] - new_mask.shape[1]
    x = causal_conv(conv, slots, prefix_lens, q_lens, parents, offset, xbc, conv_weight, conv_bias)
    scan = (ssm, slots, prefix_lens, q_lens, parents, offset)
    return mamba2_state_scan(*scan, x, dt, A, D, dims, xbc.dtype)


def register() -> None:
    """Install the Triton launchers as the CUDA kernels of ``speculum::gated_delta_rule`` and
    ``speculum::mamba2_scan`` (idempotent)."""
    gated_delta_rule.register_kernel("cuda")(gated_delta_rule_triton)
    mamba2_scan.register_kernel("cuda")(mamba2_scan_triton)
