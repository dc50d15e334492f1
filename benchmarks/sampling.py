"""Triton ``filtered_probs`` against the spec (torch) version on CUDA, vocabulary 128256.

Times one call for 1, 8, 64 and 256 rows (median of ``triton.testing.do_bench``) in three
settings: greedy rows, sampled rows with top-p 0.9 and top-k 50, and sampled rows with top-p
0.9 alone (a search over the whole vocabulary). Logits are ``3 * randn``. Also times
``sample_from_probs``. Prints a markdown table.

Run: ``python benchmarks/sampling.py`` on a machine with a CUDA device; ``--block``,
``--radix-bits`` and ``--num-warps`` try other launch settings of the Triton kernels.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import triton.testing

os.environ.pop("SPECULUM_TYPECHECK", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from speculum.kernels.triton_sampling import (  # noqa: E402
    DEFAULT_BLOCK,
    DEFAULT_RADIX_BITS,
    filtered_probs_triton,
    sample_from_probs_triton,
)
from speculum.spec.sampling import (  # noqa: E402
    _filtered_probs_reference,
    _sample_from_probs_reference,
)

VOCAB = 128256
ROWS = [1, 8, 64, 256]
SETTINGS = {
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
    "top-p 0.9, top-k 50": dict(temperature=1.0, top_k=50, top_p=0.9),
    "top-p 0.9": dict(temperature=1.0, top_k=0, top_p=0.9),
}


def params(rows: int, temperature: float, top_k: int, top_p: float) -> tuple:
    def full(value, dtype):
        return torch.full((rows,), value, dtype=dtype, device="cuda")

    return (
        full(temperature, torch.float32),
        full(top_k, torch.int64),
        full(top_p, torch.float32),
        full(0.0, torch.float32),
    )


def microseconds(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def report(op: str, rows: int, spec, fast, skip_spec: bool) -> None:
    """Time both versions and print one table row."""
    t_spec, t_fast = math.nan if skip_spec else microseconds(spec), microseconds(fast)
    print(f"| {op} | {rows} | {t_spec:.0f} | {t_fast:.0f} | {t_spec / t_fast:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK)
    parser.add_argument("--radix-bits", type=int, default=DEFAULT_RADIX_BITS)
    parser.add_argument("--num-warps", type=int, default=None)
    parser.add_argument("--skip-spec", action="store_true", help="time the Triton kernels only")
    options = parser.parse_args()
    launch = dict(block=options.block, num_warps=options.num_warps)
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"block {options.block}, radix bits {options.radix_bits}, warps {options.num_warps}")
    print(f"vocab {VOCAB}, {torch.cuda.get_device_name()}; median microseconds per call\n")
    print("| op | rows | torch (spec) | triton | speed-up |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, setting in SETTINGS.items():
        for rows in ROWS:
            logits = torch.randn(rows, VOCAB, generator=g, device="cuda") * 3
            args = (logits, *params(rows, **setting))
            report(
                f"filtered_probs, {name}",
                rows,
                lambda a=args: _filtered_probs_reference(*a),
                lambda a=args: filtered_probs_triton(*a, radix_bits=options.radix_bits, **launch),
                options.skip_spec,
            )
    for rows in ROWS:
        logits = torch.randn(rows, VOCAB, generator=g, device="cuda") * 3
        probs = torch.softmax(logits, dim=-1)
        u = torch.rand(rows, generator=g, device="cuda")
        report(
            "sample_from_probs",
            rows,
            lambda p=probs, u=u: _sample_from_probs_reference(p, u),
            lambda p=probs, u=u: sample_from_probs_triton(p, u, **launch),
            options.skip_spec,
        )


if __name__ == "__main__":
    main()
