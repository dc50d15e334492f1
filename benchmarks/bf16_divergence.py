"""Where bfloat16 speculative decoding leaves plain bfloat16 greedy decoding, kernel by kernel.

Runs the setup of the GPU test ``test_bf16_speculative_decoding_matches_plain_bf16_up_to_near_ties``
(its target, drafts, 64 prompts, 32 new tokens; eager rounds) with some kernels swapped, and
prints per pipeline how many sequences diverge from plain decoding, the share of tokens matched
before each sequence's first divergence, and the plain run's top-2 logit gap at each
divergence. Variants:

- ``triton``: the kernels as shipped;
- ``reference-attention``: ``speculum::paged_attention`` by its ``spec`` twin (float32 softmax
  over every key at once, no tiles);
- ``float32-matmuls``: every bfloat16 linear layer computed in float32 and rounded back;
- ``both``: the two swaps together;
- ``plain-batch-1``: plain decoding one prompt at a time against the batched plain run (the
  batch-size noise floor of the reference itself).

Run: ``python benchmarks/bf16_divergence.py [variant ...]`` (needs a CUDA GPU; run from a
checkout, the test module is imported from ``tests/gpu``).
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import test_graphs_cuda as setup  # noqa: E402

from speculum import kernels  # noqa: E402
from speculum.spec import attention as spec_attention  # noqa: E402

PROMPTS = [[(13 * i + 5 * j) % setup.VOCAB for j in range(2 + i % 9)] for i in range(64)]
NEW_TOKENS = 32
VARIANTS = ("triton", "reference-attention", "float32-matmuls", "both", "plain-batch-1")
_linear = F.linear


def float32_linear(x, weight, bias=None):
    """``F.linear`` computed in float32 for bfloat16 CUDA inputs, rounded back to bfloat16."""
    if not (x.is_cuda and x.dtype == torch.bfloat16):
        return _linear(x, weight, bias)
    wide = _linear(x.float(), weight.float(), None if bias is None else bias.float())
    return wide.to(x.dtype)


@contextmanager
def swapped(variant: str):
    """Swap in ``variant``'s kernels (module attributes the decoder looks up at call time)."""
    attention = kernels.paged_attention
    if variant in ("reference-attention", "both"):
        kernels.paged_attention = spec_attention.paged_attention
    if variant in ("float32-matmuls", "both"):
        F.linear = float32_linear
    try:
        yield
    finally:
        kernels.paged_attention, F.linear = attention, _linear


def compare(target, plain: list[list[int]], ours: list[list[int]]) -> tuple[int, float, list]:
    """(diverged sequences, share of tokens before each first divergence, plain top-2 gaps)."""
    diverged, matched, total, gaps = 0, 0, 0, []
    for prompt, a, b in zip(PROMPTS, plain, ours):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        matched, total = matched + same, total + len(a)
        if same < len(a):
            diverged += 1
            gaps.append(setup._logit_gap(target, prompt + a[:same]))
    return diverged, matched / total, sorted(gaps)


def rows_of(variant: str) -> list[tuple[str, int, float, list]]:
    """One row per pipeline (or the batch-1 floor) under ``variant``'s kernels."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target = setup._target(torch.bfloat16)
    plain = setup._tokens(target, PROMPTS, NEW_TOKENS, cuda_graphs=False)
    if variant == "plain-batch-1":
        alone = setup._tokens(target, PROMPTS, NEW_TOKENS, max_batch=1, cuda_graphs=False)
        return [("plain, batch 1 vs 8", *compare(target, plain, alone))]
    rows = []
    for label, (algorithm, draft, spec) in setup._drafts(target).items():
        options = dict(algorithm=algorithm, draft=draft, spec=spec, cuda_graphs=False)
        ours = setup._tokens(target, PROMPTS, NEW_TOKENS, **options)
        rows.append((label, *compare(target, plain, ours)))
    return rows


def main() -> None:
    """Print the table for the variants named on the command line (default: all)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="*", help=f"any of {', '.join(VARIANTS)} (default: all)")
    args = parser.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    print("| kernels | pipeline | diverged (of 64) | tokens matched | plain top-2 gaps |")
    print("| --- | --- | ---: | ---: | --- |")
    for variant in args.variants or VARIANTS:
        start = time.perf_counter()
        with swapped(variant):
            rows = rows_of(variant)
        for label, diverged, matched, gaps in rows:
            shown = ", ".join(f"{g:.3f}" for g in gaps) or "-"
            print(f"| {variant} | {label} | {diverged} | {matched:.2%} | {shown} |", flush=True)
        print(f"<!-- {variant}: {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
