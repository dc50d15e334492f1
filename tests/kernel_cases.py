"""Inputs and helpers shared by the Triton kernel parity tests on the CPU and on a GPU.

``tests/cover/test_kernel_*.py`` run the kernels under Triton's interpreter at tiny sizes;
``tests/gpu/test_kernel_*_gpu.py`` run the same checks on a CUDA device at serving sizes. The
builders here take the sizes and the device (directly, or as that of the ``torch.Generator``
passed), so each side keeps its own ranges. Nothing here imports Triton at import time: the CPU
model-ops tests skip themselves where it is missing.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import torch
from hypothesis import strategies as st

from speculum.spec.attention import latent_attention, paged_attention, visible_keys
from speculum.spec.paged import cache_slots, causal_mask, slots_at
from speculum.spec.sampling import Stream, uniforms
from speculum.spec.tree import select_frontier, sibling_ranks
from speculum.state.kv import PADDING_PAGE
from speculum.state.sampling import SamplingParams

seeds = st.integers(0, 2**31 - 1)


def to_device(tensors, device) -> list:
    """``tensors`` moved to ``device``; ``None`` (an absent draft) stays ``None``."""
    return [None if t is None else t.to(device) for t in tensors]


# ---------------------------------------------------------------- model ops


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between ``a`` and ``b``, in units in the last place of their dtype."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

    def ordered(t: torch.Tensor) -> torch.Tensor:
        # Sign-magnitude bit patterns to integers in float order (+0 and -0 both 0).
        i = t.contiguous().view(bits[t.dtype]).long()
        return torch.where(i < 0, -(i & ((1 << (8 * t.element_size() - 1)) - 1)), i)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def randn(
    *shape: int,
    dtype: torch.dtype,
    scale: float = 1.0,
    gen: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Normal samples of ``shape``, times ``scale`` in float32, in ``dtype``.

    Drawn from ``gen`` on its device, or from the global generator of ``device``.
    """
    device = gen.device if gen is not None else device
    return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)


def rope_inputs(
    batch: int,
    q: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    gen: torch.Generator | None = None,
    device: str | torch.device = "cpu",
    max_position: int = 131072,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[batch, q, heads, head_dim]`` and positions below ``max_position`` (by default
    Llama 3.1's context), from ``gen`` or the global generator of ``device``."""
    device = gen.device if gen is not None else device
    x = randn(batch, q, heads, head_dim, dtype=dtype, gen=gen, device=device)
    positions = torch.randint(0, max_position, (batch, q), generator=gen, device=device)
    return x, positions


def rope_write_kv_inputs(
    batch: int,
    q: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    page_size: int = 4,
    gen: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Arguments of ``speculum::rope_write_kv``: queries, keys and values as the strided heads
    of one fused ``[q | k | v]`` projection, positions, rotary frequencies, K/V caches of
    random contents, and distinct random slots outside the padding page (page 0)."""
    device = gen.device if gen is not None else device
    fused = randn(batch, q, heads + 2 * kv_heads, head_dim, dtype=dtype, gen=gen, device=device)
    queries, keys, values = fused.split([heads, kv_heads, kv_heads], dim=2)
    _, positions = rope_inputs(batch, q, 1, head_dim, dtype, gen=gen, device=device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    pages = 1 + -(-batch * q // page_size) + 1
    shape = (pages, page_size, kv_heads, head_dim)
    real = torch.randperm((pages - 1) * page_size, generator=gen, device=device) + page_size
    return {
        "q": queries,
        "k": keys,
        "v": values,
        "positions": positions,
        "inv_freq": inv_freq,
        "k_cache": randn(*shape, dtype=dtype, gen=gen, device=device),
        "v_cache": randn(*shape, dtype=dtype, gen=gen, device=device),
        "slots": real[: batch * q].view(batch, q),
    }


def rope_write_kv_both(launch, reference, inputs: dict) -> tuple[tuple, tuple]:
    """``(out, k_cache, v_cache)`` after ``launch`` and after ``reference``, each on its own
    copy of the caches."""
    results = []
    for fn in (launch, reference):
        args = {
            **inputs,
            "k_cache": inputs["k_cache"].clone(),
            "v_cache": inputs["v_cache"].clone(),
        }
        out = fn(**args)
        results.append((out, args["k_cache"], args["v_cache"]))
    return results[0], results[1]


# ---------------------------------------------------------------- paged attention

GARBAGE = (float("nan"), float("inf"), float("-inf"), 1e30)


def causal_tail_mask(batch: int, q: int, tail: int) -> torch.Tensor:
    """[batch, q, tail]: causal over the first ``q`` tail columns, nothing past them."""
    pad = torch.zeros(batch, q, tail - q, dtype=torch.bool)
    return torch.cat([causal_mask(batch, q), pad], dim=2)


def pages_needed(prefix_lens: list[int], tail: int, page_size: int) -> list[int]:
    """Pages each request's prefix and ``tail`` new columns take."""
    return [math.ceil((p + tail) / page_size) for p in prefix_lens]


def page_table(order, counts: list[int], max_pages: int, device="cpu") -> torch.Tensor:
    """Request ``b`` gets the next ``counts[b]`` pages of ``order``, padded with the sink."""
    rows, used = [], 0
    for c in counts:
        rows.append(list(order[used : used + c]) + [PADDING_PAGE] * (max_pages - c))
        used += c
    return torch.tensor(rows, dtype=torch.int64, device=device)


def attention_inputs(
    gen: torch.Generator,
    *,
    prefix_lens: list[int],
    q_lens: list[int],
    new_mask: torch.Tensor,
    page_table: torch.Tensor,
    num_pages: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    latent_dim: int | None = None,
    window: int = 0,
    sinks: bool = False,
) -> dict:
    """Float32 inputs of ``paged_attention`` on ``gen``'s device, with a ``ref_mask`` beside.

    With ``latent_dim``, the values are the keys' first ``latent_dim`` columns (a strided view,
    as latent attention's cache gives them).

    Every pool slot that some query row (padding too, as the reference defines it) sees within
    its sliding ``window`` (0: none) holds a random value; every other slot, and every padded
    query row, holds NaN, inf or 1e30.
    With ``sinks``, each head has a random sink logit (gpt-oss's attention sinks).
    ``ref_mask`` is ``new_mask`` where it has a column; the reference needs one tail column to
    gather from, and an all-False one sees nothing.
    """
    device = gen.device
    batch, q, tail = new_mask.shape
    new_mask, page_table = new_mask.to(device), page_table.to(device)
    prefix = torch.tensor(prefix_lens, device=device)
    lens = torch.tensor(q_lens, device=device)
    ref_mask = new_mask if tail else torch.zeros(batch, q, 1, dtype=torch.bool, device=device)
    seq = page_table.shape[1] * page_size
    seen = visible_keys(prefix, ref_mask, seq, window).any(1)
    s = torch.arange(seq, device=device)
    live = (page_table[:, s // page_size] * page_size + s % page_size)[seen]
    garbage = torch.tensor(GARBAGE, device=device)

    def pool() -> torch.Tensor:
        shape = (num_pages * page_size, kv_heads, head_dim)
        values = garbage[torch.randint(len(GARBAGE), shape, generator=gen, device=device)]
        values[live] = torch.randn(live.numel(), *shape[1:], generator=gen, device=device)
        return values.view(num_pages, page_size, kv_heads, head_dim)

    k_cache = pool()
    v_cache = pool() if latent_dim is None else k_cache[..., :latent_dim]
    queries = torch.randn(batch, q, heads, head_dim, generator=gen, device=device)
    queries[torch.arange(q, device=device)[None, :] >= lens[:, None]] = float("nan")
    return {
        "q": queries,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "page_table": page_table,
        "prefix_lens": prefix,
        "q_lens": lens,
        "new_mask": new_mask,
        "ref_mask": ref_mask,
        "scale": head_dim**-0.5,
        "window": window,
        "sinks": 2 * torch.randn(heads, generator=gen, device=device) if sinks else None,
    }


def tree_mask(batch: int, q: int, tail: int, seed: int) -> torch.Tensor:
    """Random trees: query ``i`` sees itself and an ancestor chain of earlier tail columns."""
    gen = torch.Generator().manual_seed(seed)
    offset = tail - q  # earlier draft steps sit before this step's tokens
    mask = torch.zeros(batch, q, tail, dtype=torch.bool)
    parent = [
        [int(torch.randint(-1, i, (), generator=gen)) for i in range(q)] for _ in range(batch)
    ]
    for b in range(batch):
        mask[b, :, :offset] = torch.rand(q, offset, generator=gen) < 0.3
        for i in range(q):
            mask[b, i, offset + i] = True
            if parent[b][i] >= 0:
                mask[b, i, offset:] |= mask[b, parent[b][i], offset:]
    return mask


def kernel_args(inputs: dict) -> dict:
    """The arguments of ``paged_attention`` among :func:`attention_inputs`' (all but
    ``ref_mask``)."""
    return {k: v for k, v in inputs.items() if k != "ref_mask"}


def run_attention(
    inputs: dict, dtype: torch.dtype = torch.float32, num_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, reference): the kernel on ``dtype`` copies of q, k and v into a NaN-poisoned
    output, the reference in float32 over ``ref_mask``."""
    from speculum.kernels.triton_attention import paged_attention_triton

    args = kernel_args(inputs)
    want = paged_attention(**{**args, "new_mask": inputs["ref_mask"]})
    q, k, v = (args.pop(name).to(dtype) for name in ("q", "k_cache", "v_cache"))
    out = q.new_full((*q.shape[:-1], v.shape[-1]), float("nan"))
    got = paged_attention_triton(q, k, v, **args, num_splits=num_splits, out=out)
    return got, want


def run_latent(
    inputs: dict,
    latent_dim: int,
    dtype: torch.dtype = torch.float32,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, reference) of latent attention over :func:`attention_inputs` built with
    ``latent_dim``: the Triton kernel on ``dtype`` copies of the queries and the cache into a
    NaN-poisoned output, the spec twin in float32 over ``ref_mask``."""
    from speculum.kernels.triton_mla import latent_attention_triton

    common = [inputs[name] for name in ("page_table", "prefix_lens", "q_lens")]
    want = latent_attention(
        inputs["q"], inputs["k_cache"], *common, inputs["ref_mask"], inputs["scale"], latent_dim
    )
    q, cache = inputs["q"].to(dtype), inputs["k_cache"].to(dtype)
    out = q.new_full((*q.shape[:-1], latent_dim), float("nan"))
    got = latent_attention_triton(
        q,
        cache,
        *common,
        inputs["new_mask"],
        inputs["scale"],
        latent_dim,
        num_splits=num_splits,
        out=out,
    )
    return got, want


def assert_verify_equals_decode_steps(kernel, chain: dict) -> None:
    """``kernel(**chain)`` over a causal chain of ``t`` tokens per request gives each token
    exactly the bits of its own decode step (``kernel`` on that token alone, after a prefix
    one token longer per step)."""
    verify = kernel(**chain)
    batch, t = chain["q"].shape[:2]
    for j in range(t):
        step = {
            **chain,
            "q": chain["q"][:, j : j + 1],
            "prefix_lens": chain["prefix_lens"] + j,
            "q_lens": torch.ones_like(chain["q_lens"]),
            "new_mask": causal_mask(batch, 1).to(chain["q"].device),
        }
        assert torch.equal(kernel(**step)[:, 0], verify[:, j]), j


# ---------------------------------------------------------------- sampling

ATOL = 1e-6
FRAGILE = 1e-6


def f32(value: float) -> float:
    """``value`` rounded to float32."""
    return float(np.float32(value))


def sampling_params(temperature, top_k, top_p, min_p, device="cpu") -> SamplingParams:
    """Per-request parameters from sequences of numbers (seeds all zero)."""
    return SamplingParams(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
        seed=torch.zeros(len(temperature), dtype=torch.int64, device=device),
    )


def filter_args(params: SamplingParams) -> tuple:
    """The filter arguments of ``filtered_probs_triton`` and the reference."""
    return params.temperature, params.top_k, params.top_p, params.min_p


# ---------------------------------------------------------------- draft trees


def forest_candidates(gen: torch.Generator, batch: int, num_cand: int, vocab: int):
    """Valid candidate sets: any earlier parent, scores = parent score * 2**-k (ties common)."""
    parents = torch.full((batch, num_cand), -1, dtype=torch.int64)
    scores = torch.ones(batch, num_cand)
    halvings = torch.randint(0, 4, (batch, num_cand), generator=gen)
    for i in range(num_cand):
        parents[:, i] = torch.randint(-1, i, (batch,), generator=gen)
        above = scores.gather(1, parents[:, i : i + 1].clamp(min=0))[:, 0]
        scores[:, i] = torch.where(parents[:, i] < 0, 1.0, above) * 2.0 ** -halvings[:, i]
    tokens = torch.randint(0, vocab, (batch, num_cand), generator=gen)
    return tokens, parents, scores


def eagle_candidates(gen: torch.Generator, batch: int, topk: int, num_steps: int, vocab: int):
    """EAGLE-2 candidates: ``topk`` children of the root, then of each step's ``topk`` best.

    Child probabilities are powers of two, so equal scores (and the tie rule) are common.
    """
    probs = 2.0 ** -torch.randint(0, 4, (batch, num_steps, topk, topk), generator=gen).float()
    tokens = [torch.randint(0, vocab, (batch, topk), generator=gen)]
    scores = [probs[:, 0, 0]]
    parents = [torch.full((batch, topk), -1, dtype=torch.int64)]
    offset = 0  # candidate index of the previous step's first candidate
    for s in range(1, num_steps):
        frontier = select_frontier(scores[-1], topk)
        parent_score = scores[-1].gather(1, frontier)
        scores.append((parent_score[:, :, None] * probs[:, s]).flatten(1))
        tokens.append(torch.randint(0, vocab, (batch, topk * topk), generator=gen))
        parents.append((offset + frontier)[:, :, None].expand(-1, -1, topk).flatten(1))
        offset += scores[-2].shape[1]
    return torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)


def depths_of(parents: torch.Tensor) -> torch.Tensor:
    """Each node's depth (parents precede their children)."""
    depths = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depths[:, i] = depths.gather(1, parents[:, i : i + 1])[:, 0] + 1
    return depths


def most_children(parents: torch.Tensor) -> int:
    """The most children of any node (0 for single-node trees)."""
    return int((sibling_ranks(parents)[:, 1:] + 1).max()) if parents.shape[1] > 1 else 0


def accept_coins(
    seed: torch.Tensor, positions: torch.Tensor, max_depth: int, max_children: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ACCEPT coins and per-length RESAMPLE uniforms, drawn as ``spec.accept`` draws them."""
    steps = torch.arange(1, max_depth + 2)
    coins = uniforms(seed, Stream.ACCEPT, positions[:, None] + steps[:-1], max_children)
    bonus = uniforms(seed, Stream.RESAMPLE, positions[:, None] + steps, 1)[..., 0]
    return coins, bonus


@attrs.frozen
class CommitSizes:
    """The ranges :func:`commits` draws from; the defaults are the interpreter's tiny sizes."""

    max_batch: int = 3
    page_sizes: tuple[int, ...] = (1, 2, 4)
    max_nodes: int = 8
    max_depth: int = 5
    #: Sequence lengths are drawn below this.
    max_seq_len: int = 8
    #: How many nodes each request's path may fall short of the longest possible one.
    max_shortfall: int = 2
    max_layers: int = 3
    heads: tuple[int, ...] = (1, 2)
    head_dims: tuple[int, ...] = (1, 2, 3)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


@st.composite
def commits(draw, sizes: CommitSizes):
    """``(k, v, page_table, seq_lens, path)``: a pool, page tables and accepted paths, as
    ``commit_path`` turns them into slots.

    Sequence lengths are arbitrary, so the committed prefix and the tree share a page and both
    the tree and the moved path cross page boundaries.
    """
    gen = torch.Generator().manual_seed(draw(seeds))
    batch = draw(st.integers(1, sizes.max_batch))
    page_size = draw(st.sampled_from(sizes.page_sizes))
    num_nodes = draw(st.integers(1, sizes.max_nodes))
    max_depth = draw(st.integers(0, sizes.max_depth))
    seq_lens = torch.randint(0, sizes.max_seq_len, (batch,), generator=gen)
    pages_each = -(-(int(seq_lens.max()) + num_nodes) // page_size)
    num_pages = 1 + batch * pages_each
    # Distinct pages for every request, in shuffled order; page 0 is the padding sink.
    table = (1 + torch.randperm(num_pages - 1, generator=gen)).reshape(batch, pages_each)
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.int64)
    for b in range(batch):
        # Long paths are the interesting ones (a later depth's destination is an earlier
        # depth's source), so the count is drawn down from the longest possible.
        num = max(min(max_depth, num_nodes - 1) - draw(st.integers(0, sizes.max_shortfall)), 0)
        nodes = torch.randperm(num_nodes - 1, generator=gen)[:num].sort().values + 1
        path[b, : num + 1] = torch.cat([torch.zeros(1, dtype=torch.int64), nodes])
    layers = draw(st.integers(1, sizes.max_layers))
    heads, head_dim = draw(st.sampled_from(sizes.heads)), draw(st.sampled_from(sizes.head_dims))
    shape = (layers, num_pages, page_size, heads, head_dim)
    dtype = draw(st.sampled_from(sizes.dtypes))
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return k, v, table, seq_lens, path


def commit_slots(
    page_table: torch.Tensor, page_size: int, seq_lens: torch.Tensor, path: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) pool slots of the accepted ``path``, as ``commit_path`` finds them."""
    valid = path >= 0
    source = slots_at(page_table, page_size, seq_lens[:, None] + path.clamp(min=0), valid)
    return source, cache_slots(page_table, page_size, seq_lens, valid)


def linear_operands(
    gen: torch.Generator, rows: int, n_out: int, n_in: int, dtype: torch.dtype, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x [rows, n_in]``, ``weight [n_out, n_in]`` and a bias or ``None``, normal, in
    ``dtype``, on ``gen``'s device."""
    x = randn(rows, n_in, dtype=dtype, gen=gen)
    weight = randn(n_out, n_in, dtype=dtype, gen=gen)
    return x, weight, randn(n_out, dtype=dtype, gen=gen) if bias else None


def linear_bound(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """How far ``linear(x, weight, bias)`` summed in float32 from exact products (16-bit
    operands; float32 ones rounded once) in any order, then rounded to ``out_dtype``, may be
    from the exact value: ``(n + 2) * 2**-24`` times the sum of magnitudes (the classic bound
    on recursive summation), plus, for a 16-bit output, half an ulp of its rounding and the
    subnormals' step."""
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    bound = (x.shape[-1] + 2) * 2.0**-24 * magnitude
    if out_dtype == torch.float32:
        return bound
    info = torch.finfo(out_dtype)
    exact = torch.nn.functional.linear(
        x.double(), weight.double(), None if bias is None else bias.double()
    )
    return bound * (1 + info.eps) + info.eps / 2 * exact.abs() + info.smallest_normal * info.eps


def decoded_with_gemv(
    target, kinds: tuple[str, ...], prompts, max_new_tokens: int, draft=None, spec=None, **limits
) -> list[list[int]]:
    """Greedy tokens of ``prompts``, decoded together by an engine over ``target`` (plain
    decoding, or EAGLE-3 rounds of ``spec`` with ``draft``) whose projections of ``kinds`` run
    ``speculum::half_linear`` (``EngineConfig.half_gemv``); ``limits`` size the engine."""
    from speculum.runtime import scheduler
    from speculum.runtime.engine import engine_from_model
    from speculum.runtime.generate import run_to_completion

    engine = engine_from_model(
        target,
        algorithm="plain" if draft is None else "eagle3",
        draft=draft,
        spec=spec,
        half_gemv=kinds,
        **limits,
    )
    state, rids = scheduler.new_state(engine), []
    for prompt in prompts:
        state, rid = scheduler.add_request(engine, state, prompt, max_new_tokens=max_new_tokens)
        rids.append(rid)
    _, finished = run_to_completion(engine, state)
    return [finished[rid].output for rid in rids]
