"""Triton twins of the ops ``speculum::filtered_probs``, ``speculum::sample_from_probs`` and
``speculum::counter_uniforms``.

The filter and the draw compute exactly the function of their ``speculum.spec.sampling``
reference, one program per row (``batch * prod(rows)`` rows), each looping over the vocabulary
in ``BLOCK`` chunks; only the order of float sums differs. The uniforms are the reference's bits
(integer hashing, exact), in one launch where the reference's int64 tensor ops make ~170.
:func:`register` installs them as the ops' CUDA kernels.

**filtered_probs without a sort.** Every filter keeps a prefix of the spec's rank order
(descending scaled logit, then ascending index): top-k the first ``k``, top-p the ranks whose
preceding mass is short of ``top_p``, min-p the tokens whose probability is at least ``min_p``
times the top one (probability rises with the scaled logit). A prefix is described by a
*threshold range* ``[lo, hi]`` of order keys (the float's bits mapped to a signed integer that
sorts like the float) plus a count: tokens with a key above ``hi`` are in, tokens below ``lo``
out, and tokens inside the range are in while their index among the range's tokens, counted in
index order, passes a test. Inside a range whose tokens all share one key that index order *is*
the rank order, which is how ties keep exactly ``k``, lowest index first.

A radix search finds each range. It keeps the invariant "the weight of keys above ``hi`` is short
of the target, the weight of keys from ``lo`` up reaches it", and each pass over the row splits
``[lo, hi]`` into ``2**RADIX_BITS`` key buckets, sums the weight per bucket, and keeps the highest
bucket whose upward weight reaches the target, clipped to the keys actually present. It stops
when the range holds a single key or a single token, or (top-k) exactly the tokens still
needed. Top-k weighs tokens by 1 with target ``k``; top-p weighs them by their exp within the
top-k set with target ``top_p`` times that set's mass, and its tie rule compares the mass above
the range plus ``index * exp`` with the target, which is the spec's cumulative sum. Min-p is a
plain per-token test. Rows with no filter skip all of this (two passes), greedy rows are one
pass.

**Speed** (H200, vocabulary 128256, ``benchmarks/sampling.py``): greedy rows and
``sample_from_probs`` beat torch at every row count, but rows with top-k/top-p filters take
2-6 ms, slower than the torch reference: each of the ~10-20 search passes re-reads the row in one
program, and the per-bucket sums cost more than the memory traffic.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from jaxtyping import Float, Int
from torch import Tensor

import speculum.spec.sampling  # noqa: F401  (defines the ops this module registers kernels for)

__all__ = [
    "counter_uniforms_triton",
    "filtered_probs_triton",
    "sample_from_probs_triton",
    "register",
]

#: Vocabulary chunk each loop iteration of a row's program handles (tests pass tiny blocks so
#: that small vocabularies cross several chunks). Measured on an H200 at vocabulary 128256:
#: 2048 beats 1024 for filtered_probs, and 4096 beats 2048 for sample_from_probs.
DEFAULT_BLOCK = 2048
SAMPLE_BLOCK = 4096
#: A search pass splits the threshold range into 2**RADIX_BITS buckets: 11 passes at most for
#: 32-bit keys, usually fewer (each pass also clips the range to the keys present). Each pass
#: costs in proportion to the bucket count, so 3 bits measured ~25% faster than 4 on an H200.
DEFAULT_RADIX_BITS = 3


@triton.jit
def _scaled_block(x_row, idx, mask, t):
    """Logits of one chunk divided by the temperature, ``-inf`` past the row's end.

    ``div_rn`` is IEEE division, as torch's ``/``: the filters act on these exact values, and an
    approximate quotient could tie two logits that torch keeps apart (or split a tie).
    """
    x = tl.load(x_row + idx, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, tl.zeros_like(x) + t)


@triton.jit
def _order_key(s):
    """An int64 that sorts like the float ``s``: negatives get their magnitude bits flipped.

    ``-0.0`` maps to the key of ``+0.0`` because the spec's sort treats them as equal (a tie).
    """
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(s == 0.0, 0, key).to(tl.int64)


@triton.jit
def _in_top_k(key, mask, k_lo, k_hi, k_need, k_seen):
    """Membership of the top-k set for one chunk, and the running count of top-k range tokens.

    A token inside the range ``[k_lo, k_hi]`` is in while fewer than ``k_need`` range tokens
    come before it in index order (``k_seen`` counts those of earlier chunks). An empty range
    (``k_hi < k_lo``) means "every key above ``k_hi``" and skips the scan.
    """
    if k_hi >= k_lo:
        in_range = mask & (key >= k_lo) & (key <= k_hi)
        flag = in_range.to(tl.int32)
        before = k_seen + tl.cumsum(flag, 0) - flag
        in_k = mask & ((key > k_hi) | (in_range & (before < k_need)))
        k_seen += tl.sum(flag, 0)
    else:
        in_k = mask & (key > k_hi)
    return in_k, k_seen


@triton.jit
def _search(
    x_row,
    V,
    t,
    m,
    lo,
    hi,
    target,
    top_p,
    k_lo,
    k_hi,
    k_need,
    MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    """Narrow the key range ``[lo, hi]`` to the threshold of top-k (count) or top-p (mass).

    Count mode weighs every token 1 against ``target = k``. Mass mode weighs top-k members by
    ``exp(s - m)``; its target, ``top_p`` times the top-k mass, is set after the first pass,
    which sees the whole top-k set. Returns ``(lo, hi, above, target, size)``: the final range,
    the weight of keys above it, the target and the number of tokens in the range.
    """
    RADIX: tl.constexpr = 1 << RADIX_BITS
    offs = tl.arange(0, BLOCK)
    digits = tl.arange(0, RADIX)
    shifts = tl.arange(0, 64).to(tl.int64)
    above = tl.zeros([], tl.float64)
    # Mass mode passes target < 0 and always makes a first pass: that pass sets the target.
    done = (lo == hi) & (target >= 0)
    size = tl.zeros([], tl.int32) + V  # a count search that makes no pass has every token tied
    while not done:
        # Buckets are 2**shift keys wide, the smallest power of two giving at most RADIX buckets.
        shift = tl.sum((((hi - lo) >> shifts) >= RADIX).to(tl.int64), 0)
        count = tl.zeros([RADIX], tl.int32)
        weight = tl.zeros([RADIX], tl.float64)
        key_min = tl.zeros([BLOCK], tl.int64) + hi
        key_max = tl.zeros([BLOCK], tl.int64) + lo
        k_seen = tl.zeros([], tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            mask = idx < V
            s = _scaled_block(x_row, idx, mask, t)
            key = _order_key(s)
            in_range = mask & (key >= lo) & (key <= hi)
            digit = ((key - lo) >> shift).to(tl.int32)
            hit = in_range[:, None] & (digit[:, None] == digits[None, :])
            count += tl.sum(hit.to(tl.int32), 0)
            if MASS:
                in_k, k_seen = _in_top_k(key, mask, k_lo, k_hi, k_need, k_seen)
                w = tl.where(in_k, tl.exp(s - m), 0.0)
                weight += tl.sum(tl.where(hit, w[:, None], 0.0), 0).to(tl.float64)
            key_min = tl.minimum(key_min, tl.where(in_range, key, hi))
            key_max = tl.maximum(key_max, tl.where(in_range, key, lo))
        if MASS:
            target = tl.where(target < 0, top_p.to(tl.float64) * tl.sum(weight, 0), target)
        else:
            weight = count.to(tl.float64)
        key_min_all = tl.min(key_min, 0)
        key_max_all = tl.max(key_max, 0)
        # upward[j]: weight of buckets j and above; keep the highest bucket reaching the target.
        # If float rounding leaves none reaching it (this pass regroups the last pass's sums),
        # the threshold is the lowest token of the range.
        upward = tl.sum(tl.where(digits[None, :] >= digits[:, None], weight[None, :], 0.0), 1)
        reach = (above + upward >= target) & (count > 0)
        highest = tl.max(tl.where(reach, digits, -1), 0)
        lowest = tl.min(tl.where(count > 0, digits, RADIX), 0)
        j = tl.where(highest >= 0, highest, lowest)
        chosen = tl.sum(tl.where(digits == j, count, 0), 0)
        bucket_lo = lo + (j.to(tl.int64) << shift)
        bucket_hi = bucket_lo + (tl.full([], 1, tl.int64) << shift) - 1
        # One key left in the range: it is the threshold, and the weight above stays.
        single = key_min_all == key_max_all
        above = tl.where(single, above, above + tl.sum(tl.where(digits > j, weight, 0.0), 0))
        lo = tl.where(single, key_min_all, tl.maximum(bucket_lo, key_min_all))
        hi = tl.where(single, key_max_all, tl.minimum(bucket_hi, key_max_all))
        size = tl.where(single, tl.sum(count, 0), chosen)
        done = single | (lo == hi) | (chosen == 1)
        if not MASS:
            # Count mode may also stop once the bucket holds exactly the tokens still needed.
            done = done | (chosen.to(tl.float64) == target - above)
    return lo, hi, above, target, size


@triton.jit
def _kept_pass(
    x_row,
    out_row,
    V,
    t,
    m,
    top,
    min_p,
    k_lo,
    k_hi,
    k_need,
    p_lo,
    p_hi,
    p_above,
    p_target,
    total,
    WRITE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One pass deciding every token: returns the kept mass, or writes ``exp / total`` if WRITE.

    The decisions depend only on the inputs and on running counts in index order, so the
    summing pass and the writing pass agree token for token.
    """
    offs = tl.arange(0, BLOCK)
    k_seen = tl.zeros([], tl.int32)
    p_seen = tl.zeros([], tl.int32)
    kept_mass = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        mask = idx < V
        s = _scaled_block(x_row, idx, mask, t)
        key = _order_key(s)
        e = tl.exp(s - m)
        in_k, k_seen = _in_top_k(key, mask, k_lo, k_hi, k_need, k_seen)
        # Inside the top-p range (one key, so one exp value) the token with `before` top-k
        # members ahead of it has preceding mass p_above + before * e: the spec's cumsum.
        in_p_range = in_k & (key >= p_lo) & (key <= p_hi)
        flag = in_p_range.to(tl.int32)
        before = p_seen + tl.cumsum(flag, 0) - flag
        p_seen += tl.sum(flag, 0)
        in_p = in_k & (
            (key > p_hi)
            | (in_p_range & (p_above + before.to(tl.float64) * e.to(tl.float64) < p_target))
        )
        # e is exp(s - m), so the top token's is exactly 1 and min-p compares e with min_p.
        keep = (in_p & (e >= min_p)) | (idx == top)
        if WRITE:
            tl.store(out_row + idx, tl.where(keep, e / total.to(tl.float32), 0.0), mask=mask)
        else:
            kept_mass += tl.sum(tl.where(keep & mask, e, 0.0), 0).to(tl.float64)
    return kept_mass


@triton.jit
def _filtered_probs_kernel(
    x_ptr,
    out_ptr,
    t_ptr,
    k_ptr,
    p_ptr,
    min_p_ptr,
    V,
    rows_per_request,
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    request = row // rows_per_request
    x_row = x_ptr + row * V
    out_row = out_ptr + row * V
    offs = tl.arange(0, BLOCK)
    t = tl.load(t_ptr + request)
    if t == 0:
        # Greedy: the one-hot of the argmax, lowest index on ties. Each lane keeps its first
        # maximum, so the lowest lane index among the row's maxima is the first occurrence.
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            mask = idx < V
            x = tl.load(x_row + idx, mask=mask, other=float("-inf")).to(tl.float32)
            better = x > best
            best = tl.where(better, x, best)
            best_idx = tl.where(better, idx, best_idx)
            tl.store(out_row + idx, tl.zeros([BLOCK], tl.float32), mask=mask)
        top = tl.min(tl.where(best == tl.max(best, 0), best_idx, V), 0)
        # The zeros above were stored by other threads; the barrier orders them before the one.
        tl.debug_barrier()
        tl.store(out_row + top, 1.0)
    else:
        top_k = tl.load(k_ptr + request)
        top_p = tl.load(p_ptr + request)
        min_p = tl.load(min_p_ptr + request)
        # Pass 0: max and softmax denominator (online), first index of the max, smallest key.
        m = tl.full([], float("-inf"), tl.float32)
        denom = tl.zeros([], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        key_min = tl.full([BLOCK], 0x7FFFFFFF, tl.int64)
        for start in range(0, V, BLOCK):
            idx = start + offs
            mask = idx < V
            s = _scaled_block(x_row, idx, mask, t)
            m_new = tl.maximum(m, tl.max(s, 0))
            # Until a finite logit is seen m is -inf; shift by 0 then so exp never sees -inf+inf.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            denom = denom * tl.exp(m - shift) + tl.sum(tl.exp(s - shift), 0)
            m = m_new
            better = s > best
            best = tl.where(better, s, best)
            best_idx = tl.where(better, idx, best_idx)
            key_min = tl.minimum(key_min, tl.where(mask, _order_key(s), 0x7FFFFFFF))
        top = tl.min(tl.where(best == m, best_idx, V), 0)
        key_lo = tl.min(key_min, 0)
        key_hi = _order_key(m)
        use_k = (top_k > 0) & (top_k < V)
        use_p = top_p < 1.0
        if use_k | use_p | (min_p > 0.0):
            # A filter that is off keeps every key above an empty range [key_lo, key_lo - 1].
            k_lo = key_lo
            k_hi = key_lo - 1
            k_need = tl.zeros([], tl.int32) + V  # V may arrive as a constexpr (vocab 1)
            if use_k:
                k_lo, k_hi, k_above, _, k_size = _search(
                    x_row, V, t, m, key_lo, key_hi, top_k.to(tl.float64), top_p,
                    k_lo, k_hi, k_need, False, BLOCK, RADIX_BITS,
                )  # fmt: skip
                k_need = top_k.to(tl.int32) - k_above.to(tl.int32)
                # A range kept whole is "every key from k_lo up": no tie count needed.
                k_hi = tl.where(k_need >= k_size, k_lo - 1, k_hi)
            p_lo = key_lo
            p_hi = key_lo - 1
            p_above = tl.zeros([], tl.float64)
            p_target = tl.zeros([], tl.float64) - 1.0  # set by the search's first pass
            if use_p:
                p_lo, p_hi, p_above, p_target, _ = _search(
                    x_row, V, t, m, k_lo, key_hi, p_target, top_p,
                    k_lo, k_hi, k_need, True, BLOCK, RADIX_BITS,
                )  # fmt: skip
            kept = _kept_pass(
                x_row, out_row, V, t, m, top, min_p, k_lo, k_hi, k_need,
                p_lo, p_hi, p_above, p_target, 1.0, False, BLOCK,
            )  # fmt: skip
            _kept_pass(
                x_row, out_row, V, t, m, top, min_p, k_lo, k_hi, k_need,
                p_lo, p_hi, p_above, p_target, kept, True, BLOCK,
            )  # fmt: skip
        else:
            for start in range(0, V, BLOCK):
                idx = start + offs
                mask = idx < V
                s = _scaled_block(x_row, idx, mask, t)
                tl.store(out_row + idx, tl.exp(s - m) / denom, mask=mask)


@triton.jit
def _sample_from_probs_kernel(p_ptr, u_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p_row = p_ptr + row * V
    offs = tl.arange(0, BLOCK)
    # Pass 1: the total and the last token with positive probability.
    total = tl.zeros([], tl.float64)
    last = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        p = tl.load(p_row + idx, mask=idx < V, other=0.0).to(tl.float32)
        total += tl.sum(p, 0).to(tl.float64)
        last = tl.maximum(last, tl.where(p > 0, idx, 0))
    last_positive = tl.max(last, 0)
    target = tl.load(u_ptr + row).to(tl.float64) * total
    # Pass 2: the first token whose cumulative sum exceeds the target, stopping once found. It
    # must also have positive probability: a scan's regrouped sums can step up by an ulp at a
    # zero, and a zero-probability token is never drawn.
    carry = tl.zeros([], tl.float64)
    found = tl.zeros([], tl.int32) + V
    start = tl.zeros([], tl.int32)
    while (start < V) & (found == V):
        idx = start + offs
        mask = idx < V
        p = tl.load(p_row + idx, mask=mask, other=0.0).to(tl.float32)
        cdf = carry + tl.cumsum(p, 0).to(tl.float64)
        found = tl.min(tl.where(mask & (cdf > target) & (p > 0), idx, V), 0)
        carry += tl.sum(p, 0).to(tl.float64)
        start += BLOCK
    tl.store(out_ptr + row, tl.minimum(found, last_positive).to(tl.int64))


def _num_warps(block: int) -> int:
    return max(4, min(16, block // 256))


def filtered_probs_triton(
    logits: Float[Tensor, "batch *rows vocab"],
    temperature: Float[Tensor, " batch"],
    top_k: Int[Tensor, " batch"],
    top_p: Float[Tensor, " batch"],
    min_p: Float[Tensor, " batch"],
    *,
    block: int = DEFAULT_BLOCK,
    radix_bits: int = DEFAULT_RADIX_BITS,
    num_warps: int | None = None,
) -> Float[Tensor, "batch *rows vocab"]:
    """The ``speculum::filtered_probs`` op in Triton: the same function as the spec, unvalidated.

    ``block`` is the vocabulary chunk per loop iteration (a power of two), ``radix_bits`` the
    bits a search pass resolves and ``num_warps`` the warps per row; none changes the result.
    """
    vocab = logits.shape[-1]
    x = logits.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    rows_per_request = math.prod(x.shape[1:-1])
    _filtered_probs_kernel[(x.shape[0] * rows_per_request,)](
        x,
        out,
        temperature.float().contiguous(),
        top_k.long().contiguous(),
        top_p.float().contiguous(),
        min_p.float().contiguous(),
        vocab,
        rows_per_request,
        BLOCK=block,
        RADIX_BITS=radix_bits,
        num_warps=num_warps or _num_warps(block),
    )
    return out


def sample_from_probs_triton(
    probs: Float[Tensor, "batch *rows vocab"],
    u: Float[Tensor, " batch *rows"],
    *,
    block: int = SAMPLE_BLOCK,
    num_warps: int | None = None,
) -> Int[Tensor, " batch *rows"]:
    """The ``speculum::sample_from_probs`` op in Triton: inverse-CDF draws, as the spec's."""
    vocab = probs.shape[-1]
    p = probs.contiguous()
    out = torch.empty(p.shape[:-1], dtype=torch.int64, device=p.device)
    if out.numel() == 0:
        return out
    _sample_from_probs_kernel[(out.numel(),)](
        p, u.float().contiguous(), out, vocab, BLOCK=block, num_warps=num_warps or _num_warps(block)
    )
    return out


@triton.jit
def _mul32(x, c: tl.constexpr):
    """``x * c mod 2**32`` in int64 without overflow (the reference's 16-bit split)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _rotl32(x, r: tl.constexpr):
    return ((x << r) & 0xFFFFFFFF) | (x >> (32 - r))


@triton.jit
def _murmur_word(h, word):
    """One 32-bit word of MurmurHash3_x86_32's body."""
    k = _mul32(word, 0xCC9E2D51)
    k = _rotl32(k, 15)
    k = _mul32(k, 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & 0xFFFFFFFF


# Triton compiles an int argument equal to 1 as a Python constant, which has no ``.to``.
@triton.jit(do_not_specialize=["stream"])
def _uniforms_kernel(
    seed_ptr, counter_ptr, out_ptr, rows, width, stream, BLOCK: tl.constexpr, BITS: tl.constexpr
):
    """Program ``(row, block)``: the uniforms of columns ``block * BLOCK ..`` of one
    ``(batch, row)`` counter, hashed as ``speculum.spec.sampling.uniforms`` hashes them."""
    row = tl.program_id(0).to(tl.int64)
    column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = column < width
    seed = tl.load(seed_ptr + row // rows)
    count = tl.load(counter_ptr + row)
    h = tl.zeros([BLOCK], dtype=tl.int64)
    h = _murmur_word(h, seed & 0xFFFFFFFF)
    h = _murmur_word(h, (seed >> 32) & 0xFFFFFFFF)
    h = _murmur_word(h, stream.to(tl.int64))
    h = _murmur_word(h, count & 0xFFFFFFFF)
    h = _murmur_word(h, (count >> 32) & 0xFFFFFFFF)
    h = _murmur_word(h, column)
    h = h ^ 24  # the length in bytes of six words
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    h = h ^ (h >> 16)
    u = ((h >> (32 - BITS)).to(tl.float32) + 0.5) * (1.0 / (1 << BITS))
    tl.store(out_ptr + row * width + column, u, mask=mask)


def counter_uniforms_triton(
    seed: Int[Tensor, " batch"], counter: Int[Tensor, "batch rows"], stream: int, width: int
) -> Float[Tensor, "batch rows width"]:
    """Fused ``speculum::counter_uniforms``: one launch, the reference's bits."""
    batch, rows = counter.shape
    out = torch.empty(batch, rows, width, dtype=torch.float32, device=counter.device)
    if out.numel() == 0:
        return out
    block = min(1024, triton.next_power_of_2(width))
    _uniforms_kernel[(batch * rows, triton.cdiv(width, block))](
        seed.contiguous(),
        counter.contiguous(),
        out,
        rows,
        width,
        stream,
        BLOCK=block,
        BITS=speculum.spec.sampling._UNIFORM_BITS,
    )
    return out


def register() -> None:
    """Install the Triton kernels as the CUDA kernels of the sampling ops (idempotent)."""
    torch.library.register_kernel("speculum::counter_uniforms", "cuda", counter_uniforms_triton)
    torch.library.register_kernel("speculum::filtered_probs", "cuda", filtered_probs_triton)
    torch.library.register_kernel("speculum::sample_from_probs", "cuda", sample_from_probs_triton)
