"""The routed experts of one MoE layer on the GPU: the dense reference kernel, the grouped GEMM
(``speculum.kernels.grouped_moe``) and the pairwise Triton kernel (``kernels.triton_moe``), at
a real model's shape, under CUDA graphs, routing included in each.

Prints, per batch size (tokens per step), each kernel's time per layer and its relative error
against a float64 reference, the kernel ``speculum::moe`` chooses at that size, and the floor:
the bytes a step must read (the selected experts' weights: ``min(E, rows * k)`` experts at
most) over the measured HBM copy bandwidth::

    python benchmarks/moe_kernel.py [--experts 64 --top-k 6 --hidden 2048 --inter 1408]

The default shape is DeepSeek-V2-Lite's MoE layer (64 routed experts, top 6, hidden 2048,
expert width 1408).
"""

from __future__ import annotations

import argparse

import torch
from decode import copy_bandwidth

from speculum.kernels.grouped_moe import few_pairs, grouped_experts
from speculum.kernels.model_ops import moe_reference, moe_row_weights
from speculum.kernels.triton_moe import pairwise_experts


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


def _row(rows: int, router, gate_up, down, k: int, bandwidth: float) -> str:
    """One table row: each kernel over ``rows`` random tokens, routing included."""
    x = torch.randn(rows, router.shape[1], device=router.device, dtype=router.dtype)

    def routed_by(experts):
        def run():
            weights = moe_row_weights(x, router, k, True)
            return experts(x, *weights.topk(k), gate_up, down)

        return run

    kernels = {
        "reference": lambda: moe_reference(x, router, gate_up, down, k, True),
        "grouped": routed_by(grouped_experts),
        "pairwise": routed_by(pairwise_experts),
    }
    exact = moe_reference(x.double(), router.double(), gate_up.double(), down.double(), k, True)
    errors = {n: float((f().double() - exact).norm() / exact.norm()) for n, f in kernels.items()}
    us = {name: _bench(run) * 1e3 for name, run in kernels.items()}
    chosen = "pairwise" if few_pairs(rows * k, router.shape[0]) else "grouped"
    read = min(router.shape[0], rows * k)
    floor_us = read * gate_up[0].numel() * 3 // 2 * gate_up.dtype.itemsize / bandwidth * 1e6
    cells = [f"{us[n]:.1f} ({errors[n]:.0e})" for n in kernels]
    return (
        f"| {rows} | {read} | {floor_us:.1f} | {' | '.join(cells)} | {chosen} | "
        f"{us['reference'] / us[chosen]:.1f}x | {floor_us / us[chosen]:.2f} |"
    )


def main() -> None:
    """Time both kernels at each batch size and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=1408)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128])
    args = parser.parse_args()
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    torch.manual_seed(0)
    dev, dtype = "cuda", torch.bfloat16
    router = torch.randn(e, h, device=dev, dtype=dtype) * h**-0.5
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=dtype) * h**-0.5
    down = torch.randn(e, h, i, device=dev, dtype=dtype) * i**-0.5
    bandwidth = copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; shape E={e} k={k} H={h} I={i} bf16")
    print(
        "| rows | experts read (max) | floor us | reference us (err) | grouped us (err) | "
        "pairwise us (err) | chosen | ref/chosen | of floor |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for rows in args.batches:
        print(_row(rows, router, gate_up, down, k, bandwidth))


if __name__ == "__main__":
    main()
