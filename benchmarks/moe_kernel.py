"""The routed experts of one MoE layer on the GPU: the dense reference kernel against the grouped
GEMM (``speculum.kernels.grouped_moe``), at a real model's shape, under CUDA graphs.

Prints, per batch size (tokens per step), each kernel's time per layer, the bytes a step must
read (the selected experts' weights: ``min(E, rows * k)`` experts at most) over the measured
HBM copy bandwidth as the floor, and the relative error of each against a float64 reference::

    python benchmarks/moe_kernel.py [--experts 64 --top-k 6 --hidden 2048 --inter 1408]

The default shape is DeepSeek-V2-Lite's MoE layer (64 routed experts, top 6, hidden 2048,
expert width 1408).
"""

from __future__ import annotations

import argparse

import torch

from speculum.kernels.grouped_moe import moe_cuda
from speculum.kernels.model_ops import moe_reference


def _bench(fn, iters: int = 50) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth, bytes per second (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / (ms / 1e3)


def _row(rows: int, router, gate_up, down, k: int, bandwidth: float) -> str:
    """One table row: both kernels over ``rows`` random tokens."""
    x = torch.randn(rows, router.shape[1], device=router.device, dtype=router.dtype)

    def reference():
        return moe_reference(x, router, gate_up, down, k, True)

    def routed():
        # The op's CUDA kernel: the same routing, then the grouped GEMMs.
        return moe_cuda(x, router, gate_up, down, k, True)

    exact = moe_reference(x.double(), router.double(), gate_up.double(), down.double(), k, True)
    errors = [float((out().double() - exact).norm() / exact.norm()) for out in (reference, routed)]
    ref_ms, grouped_ms = _bench(reference), _bench(routed)
    read = min(router.shape[0], rows * k)
    floor_us = read * gate_up[0].numel() * 3 // 2 * gate_up.dtype.itemsize / bandwidth * 1e6
    return (
        f"| {rows} | {read} | {floor_us:.1f} | {ref_ms * 1e3:.1f} | {grouped_ms * 1e3:.1f} | "
        f"{ref_ms / grouped_ms:.1f}x | {errors[0]:.1e} | {errors[1]:.1e} |"
    )


def main() -> None:
    """Time both kernels at each batch size and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=1408)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    args = parser.parse_args()
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    torch.manual_seed(0)
    dev, dtype = "cuda", torch.bfloat16
    router = torch.randn(e, h, device=dev, dtype=dtype) * h**-0.5
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=dtype) * h**-0.5
    down = torch.randn(e, h, i, device=dev, dtype=dtype) * i**-0.5
    bandwidth = _copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; shape E={e} k={k} H={h} I={i} bf16")
    print(
        "| rows | experts read (max) | floor us | reference us | grouped us | ref/grouped "
        "| rel err ref | rel err grouped |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.batches:
        print(_row(rows, router, gate_up, down, k, bandwidth))


if __name__ == "__main__":
    main()
