"""Time the Triton paged-attention kernel at decode and tree-verify shapes on one CUDA GPU,
and flashinfer's paged kernels on the same inputs where flashinfer is installed.

Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16, page_size 16), pages
scattered at random over a pool. Reports median times of eager calls (``do_bench``: includes the
host's launch cost, tens of microseconds) and of CUDA-graph replays (``do_bench_cudagraph``: what
a captured decode step pays), and, from the replay time, the achieved bandwidth (bytes of K/V the
requests can see, plus queries and output) and matrix rate (over the visible query-key pairs).
Decode is memory-bound: compare its bandwidth with the card's (about 4.3 TB/s copy on an H200);
a prefill chunk is matrix-bound.

flashinfer's rows time ``run()`` alone: its ``plan()`` (host work over the page table) is done
once before timing, as a captured decode step would do it outside the graph. Tree verify uses
its prefill kernel with a boolean ``custom_mask`` (the FA2 path), decode its decode kernel.

``--against REV`` also times the Triton kernel as it was at git revision ``REV`` (or as a saved
copy of ``kernels/triton_attention.py`` at path ``REV`` has it) on the same inputs, in the same
run (rows ``triton @REV``), so that a kernel change is judged by a ratio within one run rather
than against another day's table.

Run: ``python benchmarks/attention.py [--against REV] [--shapes tree,extend]`` (needs a GPU,
Triton and the repository on the path; ``--against`` with a revision needs git history).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from speculum.kernels.triton_attention import paged_attention_triton  # noqa: E402
from speculum.spec.paged import causal_mask  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
#: The row groups ``--shapes`` selects from, in the order they print.
SHAPES = ("decode", "tree", "chain", "extend", "prefill")


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


def flashinfer_call(args: dict, workspace: torch.Tensor):
    """flashinfer's kernel over the same pages and mask, planned here; ``None`` without it."""
    try:
        import flashinfer
    except ImportError:
        return None
    batch, q = args["q"].shape[:2]
    prefix = int(args["prefix_lens"][0])
    kv_len = prefix + q
    pages = args["page_table"][:, : math.ceil(kv_len / PAGE_SIZE)]
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages.shape[1]
    indices = pages.reshape(-1).to(torch.int32)
    last = torch.full((batch,), kv_len - (pages.shape[1] - 1) * PAGE_SIZE, dtype=torch.int32)
    last = last.to("cuda")
    cache = (args["k_cache"], args["v_cache"])
    shape = dict(num_qo_heads=HEADS, num_kv_heads=KV_HEADS, page_size=PAGE_SIZE)
    if q == 1:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(indptr, indices, last, head_dim=HEAD_DIM, q_data_type=DTYPE, **shape)
        query = args["q"][:, 0]
        return lambda: wrapper.run(query, cache)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q
    seen = torch.ones(batch, q, prefix, dtype=torch.bool, device="cuda")
    mask = torch.cat([seen, args["new_mask"]], dim=2).reshape(-1)
    wrapper.plan(
        qo_indptr,
        indptr,
        indices,
        last,
        head_dim_qk=HEAD_DIM,
        custom_mask=mask,
        q_data_type=DTYPE,
        **shape,
    )
    query = args["q"].reshape(batch * q, HEADS, HEAD_DIM)
    return lambda: wrapper.run(query, cache)


def kernel_at(revision: str):
    """``paged_attention_triton`` as ``kernels/triton_attention.py`` was at git ``revision``
    (or as the file at path ``revision`` has it: a checkout without its git history, e.g. the
    GPU machine's copy, takes a file saved with ``git show REV:speculum/kernels/...``), loaded
    as a module of its own (its Triton kernels compile apart from today's)."""
    if Path(revision).is_file():
        source = Path(revision).read_text()
    else:
        source = subprocess.run(
            ["git", "show", f"{revision}:speculum/kernels/triton_attention.py"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    # Triton reads a kernel's source from its file, so the old module must live in one.
    path = Path(tempfile.mkdtemp()) / "triton_attention_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.paged_attention_triton


def measure(
    name: str, batch: int, prefix: int, q: int, mask: torch.Tensor, workspace, others=()
) -> None:
    """Print one table row for the Triton kernel, one per ``(label, kernel)`` of ``others``
    (earlier revisions), and, when installed, one for flashinfer."""
    args = inputs(batch, prefix, q, mask)
    call = lambda: paged_attention_triton(**args)  # noqa: E731
    report(name, "triton", batch, prefix, q, mask, args, call)
    for label, kernel in others:
        report(name, label, batch, prefix, q, mask, args, lambda k=kernel: k(**args))
    fi = flashinfer_call(args, workspace)
    if fi is not None:
        ours = call().reshape(batch * q, HEADS, HEAD_DIM).float()
        error = (fi().reshape_as(ours).float() - ours).norm() / ours.norm()
        report(name, f"flashinfer ({error:.0e})", batch, prefix, q, mask, args, fi)


def report(name, kernel, batch, prefix, q, mask, args, call) -> None:
    """Time ``call`` eagerly and as graph replays; print the row."""
    eager = triton.testing.do_bench(call, return_mode="median")
    ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    # Each request reads its whole prefix plus the tail columns (all seen by some query here).
    kv_bytes = 2 * batch * (prefix + mask.shape[2]) * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    io_bytes = 2 * args["q"].numel() * DTYPE.itemsize
    # Two matrix products (QK^T and PV) over the (query, key) pairs that are visible.
    flops = 4 * HEADS * HEAD_DIM * (batch * q * prefix + int(mask.sum()))
    seconds = ms * 1e-3
    print(
        f"{name:<12}{kernel:<20}{batch:>6}{prefix:>8}{q:>5}{eager * 1e3:>10.1f}{ms * 1e3:>10.1f}"
        f"{(kv_bytes + io_bytes) / seconds / 1e12:>9.2f}{flops / seconds / 1e12:>9.1f}"
    )


def main() -> None:
    """Decode at batch 1/8/32/64 x prefix 512/4096, then tree and chain verify, a short extend
    chunk (fewer rows than a prefill tile: decode-style tiles) and a prefill chunk."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="also time the kernel at git REV")
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}"
    )
    cli = parser.parse_args()
    shapes = set(cli.shapes.split(","))
    if not shapes <= set(SHAPES):
        parser.error(f"--shapes takes {', '.join(SHAPES)}; got {cli.shapes}")
    others = [(f"triton @{cli.against}", kernel_at(cli.against))] if cli.against else []
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    head = f"{'shape':<12}{'kernel':<20}{'batch':>6}{'prefix':>8}{'q':>5}"
    print(f"{head}{'eager us':>10}{'graph us':>10}{'TB/s':>9}{'TFLOP/s':>9}")
    for prefix in (512, 4096) if "decode" in shapes else ():
        for batch in (1, 8, 32, 64):
            measure("decode", batch, prefix, 1, causal_mask(batch, 1), workspace, others)
    for batch in (1, 8, 32) if "tree" in shapes else ():
        tree = torch.rand(batch, 64, 64) < 0.2  # density of a 64-token EAGLE tree's ancestry
        measure(
            "tree verify",
            batch,
            2048,
            64,
            tree | torch.eye(64, dtype=torch.bool),
            workspace,
            others,
        )
    for batch in (1, 64) if "chain" in shapes else ():  # an EAGLE chain of 3 draft tokens
        measure("chain verify", batch, 2048, 4, causal_mask(batch, 4), workspace, others)
    if "extend" in shapes:
        measure("extend", 4, 1024, 100, causal_mask(4, 100), workspace, others)
    if "prefill" in shapes:
        measure("prefill", 1, 0, 2048, causal_mask(1, 2048), workspace, others)


if __name__ == "__main__":
    main()
