"""Multi-head latent attention (MLA) over the latent cache on one CUDA GPU: speculum's latent
kernel (``triton_mla``, the ``speculum::latent_attention`` op the decoder runs) beside its
grouped-query kernel run absorbed on the same call (``triton_attention``, what MLA layers ran
before: one latent "KV head", values its first 512 columns) and flashinfer's MLA kernel
(``BatchMLAPagedAttentionWrapper``) on the same pages.

Shapes: DeepSeek-V2-Lite's attention (16 query heads) and DeepSeek-V3's (128), kv_lora_rank 512,
qk_rope_head_dim 64, softmax scale ``(128 + 64) ** -0.5``, bf16, page size 16 (all kernels read
one pool: flashinfer's ``ckv`` and ``kpe`` caches are views of speculum's latent pages). Rows:
decode (one query per request) at batch 1/8/32/64 and prefix 512/4096, and a chain verify (4
queries per request, causal over themselves) at batch 1 and 32; then V3's heads. Times are
medians of CUDA-graph replays (``do_bench_cudagraph``); bandwidth counts the latent cache the
requests see plus queries and outputs. flashinfer's ``plan()`` runs once before timing, as a
captured step would run it outside the graph. Each other kernel's relative difference from the
latent kernel's output is in parentheses.

``--sweep`` times the latent kernel at other launch shapes (rows, keys per tile, warps, stages)
instead, at five of the shapes, one line per shape and candidate, to pick
``triton_mla.latent_tiles``' half-precision shapes.

Run: ``python benchmarks/mla_attention.py [--sweep]`` (needs a GPU and Triton; flashinfer's rows
where flashinfer is installed).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from speculum.kernels.triton_attention import paged_attention_triton  # noqa: E402
from speculum.kernels.triton_mla import LatentTiles, latent_attention_triton  # noqa: E402
from speculum.spec.paged import causal_mask  # noqa: E402

LATENT, ROPE, PAGE_SIZE, DTYPE = 512, 64, 16, torch.bfloat16
SCALE = (128 + ROPE) ** -0.5
#: (shape, heads, batch, prefix, queries) of every row.
SHAPES = [
    *(("decode", 16, b, p, 1) for p in (512, 4096) for b in (1, 8, 32, 64)),
    *(("chain verify", 16, b, 2048, 4) for b in (1, 32)),
    *(("decode", 128, b, 4096, 1) for b in (1, 32)),
    *(("chain verify", 128, b, 2048, 4) for b in (1, 32)),
]
#: Launch shapes ``--sweep`` tries: 32 rows on 4 warps, 64 rows on 8 (either way 128
#: accumulator registers a thread), and the shapes it times them at.
CANDIDATES = [
    LatentTiles(rows, keys, rows // 8, stages)
    for rows, keys, stages in itertools.product((32, 64), (16, 32, 64), (1, 2))
]
SWEEP_SHAPES = [
    ("decode", 16, 1, 4096, 1),
    ("decode", 16, 32, 4096, 1),
    ("chain verify", 16, 32, 2048, 4),
    ("decode", 128, 32, 4096, 1),
    ("chain verify", 128, 32, 2048, 4),
]


def inputs(heads: int, batch: int, prefix: int, q: int) -> dict:
    """Random absorbed queries and a latent pool, each request's pages scattered at random."""
    pages = math.ceil((prefix + q) / PAGE_SIZE)
    order = torch.randperm(batch * pages, device="cuda") + 1
    latent = torch.randn(1 + batch * pages, PAGE_SIZE, 1, LATENT + ROPE, device="cuda")
    return {
        "q": torch.randn(batch, q, heads, LATENT + ROPE, device="cuda", dtype=DTYPE),
        "cache": latent.to(DTYPE),
        "page_table": order.view(batch, pages),
        "prefix_lens": torch.full((batch,), prefix, device="cuda"),
        "q_lens": torch.full((batch,), q, device="cuda"),
        "new_mask": causal_mask(batch, q).to("cuda"),
        "scale": SCALE,
        "latent_dim": LATENT,
    }


def grouped_query_call(args: dict):
    """The grouped-query kernel run absorbed on the same call (one KV head, values the
    latent's columns)."""
    rest = {k: v for k, v in args.items() if k not in ("cache", "latent_dim")}
    cache = args["cache"]
    return lambda: paged_attention_triton(k_cache=cache, v_cache=cache[..., :LATENT], **rest)


def flashinfer_call(args: dict, workspace: torch.Tensor):
    """flashinfer's MLA kernel over the same pages, planned here; ``None`` without it."""
    try:
        import flashinfer
    except ImportError:
        return None
    batch, q, heads = args["q"].shape[:3]
    kv_len = int(args["prefix_lens"][0]) + q
    pages = args["page_table"][:, : math.ceil(kv_len / PAGE_SIZE)]
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages.shape[1]
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q
    lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="fa2")
    wrapper.plan(
        qo_indptr,
        kv_indptr,
        pages.reshape(-1).to(torch.int32),
        lens,
        heads,
        LATENT,
        ROPE,
        PAGE_SIZE,
        q > 1,  # causal over the new tokens (flashinfer aligns the queries to the end)
        SCALE,
        DTYPE,
        DTYPE,
    )
    ckv = args["cache"][:, :, 0, :LATENT]
    kpe = args["cache"][:, :, 0, LATENT:]
    query = args["q"].reshape(batch * q, heads, LATENT + ROPE)
    q_nope, q_pe = query[..., :LATENT].contiguous(), query[..., LATENT:].contiguous()
    run = lambda: wrapper.run(q_nope, q_pe, ckv, kpe)  # noqa: E731
    return lambda: run().view(batch, q, heads, LATENT)


def report(shape: tuple, kernel: str, call) -> None:
    """Time ``call`` as graph replays and print the row."""
    name, heads, batch, prefix, q = shape
    ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    cache_bytes = batch * (prefix + q) * (LATENT + ROPE) * DTYPE.itemsize
    io_bytes = batch * q * heads * (2 * LATENT + ROPE) * DTYPE.itemsize
    print(
        f"{name:<14}{kernel:<26}{heads:>6}{batch:>6}{prefix:>8}{q:>4}{ms * 1e3:>10.1f}"
        f"{(cache_bytes + io_bytes) / (ms * 1e-3) / 1e12:>8.2f}"
    )


def measure(shape: tuple, workspace: torch.Tensor) -> None:
    """The latent kernel's row, then the grouped-query kernel's and, when installed,
    flashinfer's, each with its relative difference from the latent kernel's output."""
    args = inputs(*shape[1:])
    ours = lambda: latent_attention_triton(**args)  # noqa: E731
    report(shape, "triton latent", ours)
    expected = ours().float()
    others = {"triton grouped-query": grouped_query_call(args)}
    theirs = flashinfer_call(args, workspace)
    if theirs is not None:
        others["flashinfer"] = theirs
    for label, call in others.items():
        if runs(shape, label, call):
            error = (call().float() - expected).norm() / expected.norm()
            report(shape, f"{label} ({error:.0e})", call)


def runs(shape: tuple, label: str, call) -> bool:
    """Whether ``call`` compiles and runs here (compiling outside the timed graph capture);
    names the failure otherwise (e.g. the grouped-query kernel at 128 latent heads, out of
    shared memory on an H200)."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - a launch this GPU cannot run
        print(f"{shape[0]:<14}{label:<26} failed: {type(error).__name__}: {error}"[:160])
        return False
    return True


def sweep(shape: tuple) -> None:
    """The latent kernel at every candidate launch shape (those that fail to compile, e.g. out
    of shared memory, are named and skipped)."""
    args = inputs(*shape[1:])
    for tiles in CANDIDATES:
        label = f"{tiles.rows}r {tiles.keys}k {tiles.num_warps}w {tiles.num_stages}s"
        call = lambda: latent_attention_triton(**args, tiles=tiles)  # noqa: B023, E731
        if runs(shape, label, call):
            report(shape, label, call)


def main() -> None:
    """Every row (or, with ``--sweep``, every candidate launch shape of the latent kernel)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time launch-shape candidates")
    options = parser.parse_args()
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    print(
        f"{'shape':<14}{'kernel':<26}{'heads':>6}{'batch':>6}{'prefix':>8}{'q':>4}{'us':>10}"
        f"{'TB/s':>8}"
    )
    for shape in SWEEP_SHAPES if options.sweep else SHAPES:
        if options.sweep:
            sweep(shape)
        else:
            measure(shape, workspace)


if __name__ == "__main__":
    main()
