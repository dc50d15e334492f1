"""Time the Triton paged-attention kernel at decode and tree-verify shapes on one CUDA GPU.

Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16, page_size 16), pages
scattered at random over a pool. Reports median times of eager calls (``do_bench``: includes the
host's launch cost, tens of microseconds) and of CUDA-graph replays (``do_bench_cudagraph``: what
a captured decode step pays), and, from the replay time, the achieved bandwidth (bytes of K/V the
requests can see, plus queries and output) and matrix rate (over the visible query-key pairs).
Decode is memory-bound: compare its bandwidth with the card's (about 4.3 TB/s copy on an H200);
a prefill chunk is matrix-bound.

Run: ``python benchmarks/attention.py`` (needs a GPU, Triton and the repository on the path).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from speculum.kernels.triton_attention import paged_attention_triton  # noqa: E402
from speculum.spec.paged import causal_mask  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16


def inputs(batch: int, prefix: int, q: int, mask: torch.Tensor) -> dict:
    """Random bf16 queries and pool, each request's pages a random subset of the pool."""
    tail = mask.shape[2]
    pages = math.ceil((prefix + tail) / PAGE_SIZE)
    order = torch.randperm(batch * pages, device="cuda") + 1
    shape = (1 + batch * pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    return {
        "q": torch.randn(batch, q, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE),
        "k_cache": torch.randn(shape, device="cuda", dtype=DTYPE),
        "v_cache": torch.randn(shape, device="cuda", dtype=DTYPE),
        "page_table": order.view(batch, pages),
        "prefix_lens": torch.full((batch,), prefix, device="cuda"),
        "q_lens": torch.full((batch,), q, device="cuda"),
        "new_mask": mask.to("cuda"),
        "scale": HEAD_DIM**-0.5,
    }


def measure(name: str, batch: int, prefix: int, q: int, mask: torch.Tensor) -> None:
    """Print one table row."""
    args = inputs(batch, prefix, q, mask)
    call = lambda: paged_attention_triton(**args)  # noqa: E731
    eager = triton.testing.do_bench(call, return_mode="median")
    ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    # Each request reads its whole prefix plus the tail columns (all seen by some query here).
    kv_bytes = 2 * batch * (prefix + mask.shape[2]) * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    io_bytes = 2 * args["q"].numel() * DTYPE.itemsize
    # Two matrix products (QK^T and PV) over the (query, key) pairs that are visible.
    flops = 4 * HEADS * HEAD_DIM * (batch * q * prefix + int(mask.sum()))
    seconds = ms * 1e-3
    print(
        f"{name:<12}{batch:>6}{prefix:>8}{q:>5}{eager * 1e3:>10.1f}{ms * 1e3:>10.1f}"
        f"{(kv_bytes + io_bytes) / seconds / 1e12:>9.2f}{flops / seconds / 1e12:>9.1f}"
    )


def main() -> None:
    """Decode at batch 1/8/32/64 x prefix 512/4096, then tree verify and a prefill chunk."""
    head = f"{'shape':<12}{'batch':>6}{'prefix':>8}{'q':>5}{'eager us':>10}{'graph us':>10}"
    print(f"{head}{'TB/s':>9}{'TFLOP/s':>9}")
    for prefix in (512, 4096):
        for batch in (1, 8, 32, 64):
            measure("decode", batch, prefix, 1, causal_mask(batch, 1))
    for batch in (1, 8, 32):
        tree = torch.rand(batch, 64, 64) < 0.2  # density of a 64-token EAGLE tree's ancestry
        measure("tree verify", batch, 2048, 64, tree | torch.eye(64, dtype=torch.bool))
    measure("prefill", 1, 0, 2048, causal_mask(1, 2048))


if __name__ == "__main__":
    main()
