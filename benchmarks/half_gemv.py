"""Half-precision linear layers at decode sizes on the GPU: cuBLAS against the Triton GEMV.

cuBLAS is ``F.linear`` (for the logits, the float32-output matmul of
``models.decoder.float32_logits``); the Triton matrix-vector kernel is
``kernels.triton_fp8.half_gemv``, what ``speculum::half_linear`` runs for the projections
``EngineConfig.half_gemv`` names. The shapes are Llama-3.1-8B's projections: fused q/k/v, o,
fused gate/up, down and lm_head, under CUDA graphs.

Each timed call reads its own copy of the weight, the copies together well past the L2 cache
(50 MB on the H200), as a decode step reads each layer's weight once: a graph replaying one
call over one 32 MB weight would read it from L2. Prints, per shape and row count, each
kernel's time, the weight bandwidth it reaches (weight bytes over time) as a fraction of the
HBM copy bandwidth measured in the same run, the device kernels one call launches (cuBLAS's
split-K adds a reduction kernel), and cuBLAS's time over the Triton kernel's. ``--sweep``
also times the Triton kernel over a grid of tiles (output rows per program, input features
per step, warps, pipeline stages), prints each case's fastest, and last the one tile to set
as ``triton_fp8.TILES["half"]``: the least geometric mean over the cases of its time over the
case's best::

    python benchmarks/half_gemv.py [--rows 1,2,4,8] [--dtype bfloat16] [--sweep]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from decode import copy_bandwidth
from fp8_gemv import SHAPES as FP8_SHAPES
from fp8_gemv import sweep
from moe_kernel import _bench

import speculum.kernels.triton_fp8 as triton_fp8

#: Llama-3.1-8B's projections as the engine runs them, and the logits (float32 out).
SHAPES = {**FP8_SHAPES, "lm_head": (128256, 4096)}
#: Bytes of weight copies each timed call cycles through (past the L2 cache).
ROTATION_BYTES = 512 << 20


def rotating(call, weights: list[torch.Tensor]):
    """A function running ``call(weight)`` over each of ``weights`` (see :func:`per_call_ms`)."""

    def run() -> None:
        for weight in weights:
            call(weight)

    return run


def per_call_ms(call, weights: list[torch.Tensor]) -> float:
    """Milliseconds of one ``call(weight)``, each replay reading every copy in ``weights``."""
    return _bench(rotating(call, weights)) / len(weights)


def kernels_per_call(run) -> int:
    """The device kernels one eager ``run()`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def calls(name: str, x: torch.Tensor) -> dict:
    """The kernels compared for projection ``name`` over rows ``x``: ``weight -> output``."""
    if name == "lm_head":  # logits: float32 out, as models.decoder.float32_logits
        return {
            "cublas": lambda w: torch.mm(x, w.t(), out_dtype=torch.float32),
            "triton": lambda w: triton_fp8.half_gemv(x, w, None, torch.float32),
        }
    return {
        "cublas": lambda w: F.linear(x, w),
        "triton": lambda w: triton_fp8.half_gemv(x, w, None, x.dtype),
    }


def row_line(
    name: str, rows: int, weights: list[torch.Tensor], hbm: float, swept: list[dict] | None
) -> str:
    """One printed line: cuBLAS and the Triton kernel over ``rows`` random rows through
    ``weights`` (copies of one projection's weight); with ``swept`` a list, each tile's time
    over the case's best is appended to it (``{tile: ratio}``)."""
    n_out, n_in = weights[0].shape
    x = torch.randn(rows, n_in, device="cuda").to(weights[0].dtype)
    line = f"{name} {n_out}x{n_in} rows {rows}:"
    times = {}
    for kernel, call in calls(name, x).items():
        ms = times[kernel] = per_call_ms(call, weights)
        launched = kernels_per_call(lambda call=call: call(weights[0]))
        gbs = weights[0].numel() * weights[0].element_size() / (ms / 1e3) / 1e9
        line += f"  {kernel} {ms * 1e3:.1f} us {gbs:.0f} GB/s ({gbs * 1e9 / hbm:.2f}) {launched}k"
    line += f"  cublas/triton {times['cublas'] / times['triton']:.2f}"
    if swept is not None:
        timed = sweep("half", rotating(calls(name, x)["triton"], weights))
        (best, tile), *_ = timed
        swept.append({t: ms / best for ms, t in timed})
        line += f"  best tile {tuple(tile)}: {best / len(weights) * 1e3:.1f} us"
    return line


def overall_tile(swept: list[dict]) -> tuple[float, tuple[int, ...]]:
    """The tile that compiled in every case with the least geometric mean of its time over
    each case's best: ``(mean ratio, tile)``."""
    common = set.intersection(*(set(case) for case in swept))
    means = {t: math.exp(sum(math.log(case[t]) for case in swept) / len(swept)) for t in common}
    tile = min(means, key=means.get)
    return means[tile], tuple(tile)


def main() -> None:
    """Time each shape at each row count and print one line per pair."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8", help="comma-separated row counts")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernel's tiles")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated projections")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    # What HBM moves per second, reads and writes together: the most a weight read can reach.
    hbm = copy_bandwidth("cuda")
    tile = triton_fp8.TILES["half"]
    print(f"HBM copy bandwidth (read + written): {hbm / 1e9:.0f} GB/s; tile {tile}")
    print("per kernel: time, weight GB/s (fraction of the copy bandwidth), kernels per call")
    swept: list[dict] | None = [] if args.sweep else None
    for name in args.shapes.split(","):
        n_out, n_in = SHAPES[name]
        copies = max(1, math.ceil(ROTATION_BYTES / (n_out * n_in * dtype.itemsize)))
        weights = [(torch.randn(n_out, n_in, device="cuda") * 0.02).to(dtype)]
        weights += [weights[0].clone() for _ in range(copies - 1)]
        for rows in (int(r) for r in args.rows.split(",")):
            print(row_line(name, rows, weights, hbm, swept), flush=True)
        del weights
    if swept:
        ratio, tile = overall_tile(swept)
        print(f"overall tile {tile}: {ratio:.3f}x each case's best (geometric mean)")


if __name__ == "__main__":
    main()
