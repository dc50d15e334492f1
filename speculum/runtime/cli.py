"""Command line: ``speculum generate ...`` (also ``python -m speculum``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from speculum.models.loading import DTYPES
from speculum.pipelines import ALGORITHMS
from speculum.runtime.engine import NgramOptions
from speculum.runtime.generate import generate

__all__ = ["main", "parser"]


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes comma-separated integers, e.g. 1,2,3 ({err})"
        ) from err


def parser() -> argparse.ArgumentParser:
    """The ``speculum`` argument parser."""
    top = argparse.ArgumentParser(prog="speculum", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="decode one prompt and print the completion")
    gen.add_argument(
        "--model",
        help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json); "
        "default: the bundled tiny random model",
    )
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
    prompt.add_argument("--prompt-ids", type=_prompt_ids, help="prompt token ids, e.g. 1,2,3")
    gen.add_argument("--algorithm", default="plain", help=f"one of {', '.join(sorted(ALGORITHMS))}")
    gen.add_argument(
        "--draft",
        help="draft model folder (EAGLE / EAGLE-3 heads; MTP defaults to the target's folder)",
    )
    gen.add_argument("--num-steps", type=int, default=3, help="draft depth per round")
    gen.add_argument("--topk", type=int, default=1, help="children per node (1 = chain)")
    gen.add_argument(
        "--num-draft-tokens",
        type=int,
        help="tree nodes verified per round, root included (default num-steps + 1 for chains)",
    )
    gen.add_argument(
        "--sample-drafts",
        action="store_true",
        help="draw draft tokens from the draft's distribution (topk independent chains)",
    )
    gen.add_argument(
        "--no-chain-hidden",
        dest="chain_hidden",
        action="store_false",
        help="multi_layer_eagle: feed every MTP layer the target's hidden state instead of the "
        "previous layer's output",
    )
    ngram = gen.add_argument_group("n-gram drafting (--algorithm ngram; no --draft needed)")
    ngram.add_argument(
        "--ngram-max-depth", type=int, help="longest suffix matched and deepest draft (default 18)"
    )
    ngram.add_argument("--ngram-min-match", type=int, help="shortest suffix matched (default 1)")
    ngram.add_argument(
        "--ngram-min-breadth", type=int, help="first-level children of a longest match (default 1)"
    )
    ngram.add_argument(
        "--ngram-max-breadth",
        type=int,
        help="first-level children of a one-token match; cap per node (default 10)",
    )
    ngram.add_argument(
        "--ngram-corpus",
        metavar="FILE",
        help="token corpus to match against: .npy ids (-1 between documents) or one document of "
        "ids per line",
    )
    ngram.add_argument(
        "--ngram-order", choices=["recency", "frequency"], help="child order (default recency)"
    )
    ngram.add_argument(
        "--ngram-store-tokens",
        type=int,
        metavar="N",
        help="budget of the store shared across requests, in tokens (0 = off; default 1048576)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    gen.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's")
    gen.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA, run decoding rounds eagerly instead of as captured CUDA graphs",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``speculum`` console script; returns the exit status."""
    args = parser().parse_args(argv)
    ngram_fields = ("max_depth", "min_match", "min_breadth", "max_breadth", "corpus", "order")
    ngram = {f: getattr(args, f"ngram_{f}") for f in (*ngram_fields, "store_tokens")}
    try:
        (result,) = generate(
            [args.prompt] if args.prompt is not None else [args.prompt_ids],
            model=args.model,
            algorithm=args.algorithm,
            draft=args.draft,
            num_steps=args.num_steps,
            topk=args.topk,
            num_draft_tokens=args.num_draft_tokens,
            sample_drafts=args.sample_drafts,
            chain_hidden=args.chain_hidden,
            ngram=NgramOptions(**{k: v for k, v in ngram.items() if v is not None}),
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            seed=args.seed,
            device=args.device,
            dtype=args.dtype,
            cuda_graphs=args.cuda_graphs,
        )
    except (ValueError, RuntimeError, KeyError, MemoryError) as err:
        print(f"speculum: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        payload = {
            "token_ids": list(result.token_ids),
            # The contract makes text a string; a model without a tokenizer has no text.
            "text": result.text or "",
            "finish_reason": result.finish_reason,
            "stats": result.stats,
        }
        print(json.dumps(payload))
    else:
        print(result.text if result.text is not None else list(result.token_ids))
        stats = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.stats.items()
        )
        print(stats, file=sys.stderr)
    return 0
