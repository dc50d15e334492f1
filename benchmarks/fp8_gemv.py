"""FP8 linear layers at decode sizes on the GPU: the bfloat16 GEMV, the Triton FP8
matrix-vector kernel (``kernels.triton_fp8.fp8_gemv``) and ``torch._scaled_mm`` with per-token
e4m3 activations, per-channel scales, at Llama-3.1-8B's projection shapes, under CUDA graphs.

Prints, per shape and row count, each kernel's time and the weight bandwidth it reaches (weight
bytes over time: two per bfloat16 weight, one per e4m3 weight) against the measured HBM copy
bandwidth, and the kernel ``speculum::fp8_linear`` chooses (``kernels.fp8.cuda_kernel``).
``--sweep`` also times the matrix-vector kernel over a grid of tiles (output rows per program,
input features per step, warps, pipeline stages) and prints the fastest::

    python benchmarks/fp8_gemv.py [--rows 1,8,16] [--sweep]

``benchmarks/half_gemv.py`` times the same kernel over unquantized bfloat16 weights.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from decode import copy_bandwidth
from moe_kernel import _bench
from triton.runtime.errors import OutOfResources

import speculum.kernels.triton_fp8 as triton_fp8
from speculum.kernels import fp8

#: Llama-3.1-8B's projections as the engine runs them: fused q/k/v, o, fused gate/up, down.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
#: The tiles ``--sweep`` tries (``triton_fp8.Tile``: block_n, block_k, warps, stages).
TILES = [
    triton_fp8.Tile(*t) for t in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (2, 3, 4))
]


def scaled_mm_ms(x, weight, scale, block) -> float:
    """Milliseconds of the ``_scaled_mm`` path at ``x``'s rows (the matrix-vector kernel's row
    limit lowered to 0 for the call, so that the dispatch takes it)."""
    limit, fp8.GEMV_ROWS = fp8.GEMV_ROWS, 0
    try:
        return _bench(lambda: fp8.fp8_linear_cuda(x, weight, scale, block, None, None))
    finally:
        fp8.GEMV_ROWS = limit


def sweep(kind: str, run, tiles=TILES) -> list[tuple[float, triton_fp8.Tile]]:
    """``(ms, tile)`` of each of ``tiles`` that compiles, fastest first, for the matrix-vector
    kernel's weight ``kind`` (``triton_fp8.TILES``: ``"fp8"`` or ``"half"``), timing ``run``
    (which calls the kernel) under each; the module's tile is restored after."""
    default = triton_fp8.TILES[kind]
    timed = []
    try:
        for tile in tiles:
            triton_fp8.TILES[kind] = tile
            try:
                ms = _bench(run)
            except OutOfResources:  # a tile past the SM's shared memory or registers
                continue
            timed.append((ms, tile))
    finally:
        triton_fp8.TILES[kind] = default
    return sorted(timed)


def row_line(name: str, rows: int, dense, q, scale, hbm: float, tiles: bool) -> str:
    """One printed line: each kernel over ``rows`` random bfloat16 rows through the
    ``dense`` (bfloat16) and ``q`` (e4m3, per-channel ``scale``) forms of one weight."""
    n_out, n_in = q.shape
    block = [1, n_in]
    x = torch.randn(rows, n_in, device="cuda").bfloat16()
    times = {
        "bf16": _bench(lambda: F.linear(x, dense)),
        "gemv": _bench(lambda: triton_fp8.fp8_gemv(x, q, scale, block, None)),
        "scaled_mm": scaled_mm_ms(x, q, scale, block),
    }
    line = f"{name} {n_out}x{n_in} rows {rows} ({fp8.cuda_kernel(x, q, block)} runs):"
    for kernel, ms in times.items():
        gbs = n_out * n_in * (2 if kernel == "bf16" else 1) / (ms / 1e3) / 1e9
        line += f"  {kernel} {ms * 1e3:.1f} us {gbs:.0f} GB/s ({gbs * 1e9 / hbm:.2f})"
    if tiles:
        ms, tile = sweep("fp8", lambda: triton_fp8.fp8_gemv(x, q, scale, block, None))[0]
        line += f"  best tile {tile}: {ms * 1e3:.1f} us"
    return line


def main() -> None:
    """Time each shape at each row count and print one line per pair."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16", help="comma-separated row counts")
    parser.add_argument("--sweep", action="store_true", help="also sweep the GEMV's tiles")
    args = parser.parse_args()
    # What HBM moves per second, reads and writes together: the most a weight read can reach.
    hbm = copy_bandwidth("cuda")
    print(f"HBM copy bandwidth (read + written): {hbm / 1e9:.0f} GB/s")
    for name, (n_out, n_in) in SHAPES.items():
        weight = torch.randn(n_out, n_in, device="cuda") * 0.02
        q, scale = fp8.quantize_weight(weight, (1, n_in))
        dense = weight.bfloat16()
        del weight
        for rows in (int(r) for r in args.rows.split(",")):
            print(row_line(name, rows, dense, q, scale, hbm, args.sweep), flush=True)


if __name__ == "__main__":
    main()
