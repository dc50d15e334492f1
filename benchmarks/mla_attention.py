"""Multi-head latent attention (MLA) over the latent cache on one CUDA GPU: speculum's Triton
paged-attention kernel run absorbed (one latent "KV head" of ``kv_lora_rank + qk_rope_head_dim``
values per token, V the first ``kv_lora_rank`` of them) beside flashinfer's MLA kernel
(``BatchMLAPagedAttentionWrapper``) on the same pages.

DeepSeek-V2-Lite's attention: 16 query heads, kv_lora_rank 512, qk_rope_head_dim 64, softmax
scale ``(128 + 64) ** -0.5``, bf16, page size 16 (both kernels read the same pool: flashinfer's
``ckv`` and ``kpe`` caches are views of speculum's latent pages). Rows: decode (one query per
request) at batch 1/8/32/64 and prefix 512/4096, and a chain verify (4 queries per request,
causal over themselves) at batch 1 and 32. Times are medians of CUDA-graph replays
(``do_bench_cudagraph``); bandwidth counts the latent cache the requests see plus queries and
outputs. flashinfer's ``plan()`` runs once before timing, as a captured step would run it
outside the graph; its error column is the relative difference from speculum's output.

Run: ``python benchmarks/mla_attention.py`` (needs a GPU and Triton; flashinfer's rows where
flashinfer is installed).
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

HEADS, LATENT, ROPE, PAGE_SIZE, DTYPE = 16, 512, 64, 16, torch.bfloat16
SCALE = (128 + ROPE) ** -0.5


def inputs(batch: int, prefix: int, q: int) -> dict:
    """Random absorbed queries and a latent pool, each request's pages scattered at random."""
    pages = math.ceil((prefix + q) / PAGE_SIZE)
    order = torch.randperm(batch * pages, device="cuda") + 1
    latent = torch.randn(1 + batch * pages, PAGE_SIZE, 1, LATENT + ROPE, device="cuda")
    latent = latent.to(DTYPE)
    return {
        "q": torch.randn(batch, q, HEADS, LATENT + ROPE, device="cuda", dtype=DTYPE),
        "k_cache": latent,
        "v_cache": latent[..., :LATENT],
        "page_table": order.view(batch, pages),
        "prefix_lens": torch.full((batch,), prefix, device="cuda"),
        "q_lens": torch.full((batch,), q, device="cuda"),
        "new_mask": causal_mask(batch, q).to("cuda"),
        "scale": SCALE,
    }


def flashinfer_call(args: dict, workspace: torch.Tensor):
    """flashinfer's MLA kernel over the same pages, planned here; ``None`` without it."""
    try:
        import flashinfer
    except ImportError:
        return None
    batch, q = args["q"].shape[:2]
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
        HEADS,
        LATENT,
        ROPE,
        PAGE_SIZE,
        q > 1,  # causal over the new tokens (flashinfer aligns the queries to the end)
        SCALE,
        DTYPE,
        DTYPE,
    )
    ckv = args["k_cache"][:, :, 0, :LATENT]
    kpe = args["k_cache"][:, :, 0, LATENT:]
    query = args["q"].reshape(batch * q, HEADS, LATENT + ROPE)
    q_nope, q_pe = query[..., :LATENT].contiguous(), query[..., LATENT:].contiguous()
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe)


def report(name: str, kernel: str, batch: int, prefix: int, q: int, call) -> None:
    """Time ``call`` as graph replays and print the row."""
    ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    cache_bytes = batch * (prefix + q) * (LATENT + ROPE) * DTYPE.itemsize
    io_bytes = batch * q * HEADS * (2 * LATENT + ROPE) * DTYPE.itemsize
    print(
        f"{name:<14}{kernel:<22}{batch:>6}{prefix:>8}{q:>4}{ms * 1e3:>10.1f}"
        f"{(cache_bytes + io_bytes) / (ms * 1e-3) / 1e12:>8.2f}"
    )


def measure(name: str, batch: int, prefix: int, q: int, workspace: torch.Tensor) -> None:
    """One row for speculum's kernel and, when installed, one for flashinfer's."""
    args = inputs(batch, prefix, q)
    ours = lambda: paged_attention_triton(**args)  # noqa: E731
    report(name, "triton (absorbed)", batch, prefix, q, ours)
    theirs = flashinfer_call(args, workspace)
    if theirs is not None:
        expected = ours().reshape(batch * q, HEADS, LATENT).float()
        error = (theirs().float() - expected).norm() / expected.norm()
        report(name, f"flashinfer ({error:.0e})", batch, prefix, q, theirs)


def main() -> None:
    """Decode rows, then chain-verify rows."""
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    print(f"{'shape':<14}{'kernel':<22}{'batch':>6}{'prefix':>8}{'q':>4}{'us':>10}{'TB/s':>8}")
    for prefix in (512, 4096):
        for batch in (1, 8, 32, 64):
            measure("decode", batch, prefix, 1, workspace)
    for batch in (1, 32):
        measure("chain verify", batch, 2048, 4, workspace)


if __name__ == "__main__":
    main()
