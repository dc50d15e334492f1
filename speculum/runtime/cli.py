"""Command line: ``speculum generate ...``, ``speculum train-target ...`` and
``speculum train-draft ...`` (also ``python -m speculum``)."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from speculum.models.loading import DTYPES
from speculum.pipelines import ALGORITHMS
from speculum.runtime import distributed
from speculum.runtime.engine import NgramOptions
from speculum.runtime.generate import generate

__all__ = ["main", "parser"]


def _int_list(flag: str, example: str):
    """An argparse type: comma-separated integers, named ``flag`` in its error."""

    def parse(text: str) -> list[int]:
        try:
            return [int(t) for t in text.split(",") if t.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(
                f"{flag} takes comma-separated integers, e.g. {example} ({err})"
            ) from err

    return parse


def _budget(text: str) -> str | int:
    if text in ("all", "auto"):
        return text
    try:
        return int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"--verify-budget takes all, auto or a number of draft tokens, not {text!r}"
        ) from err


def _cost_table(path: str) -> tuple[tuple[int, float], ...]:
    try:
        raw = json.loads(Path(path).read_text())
        return tuple((int(n), float(s)) for n, s in raw)
    except (OSError, ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(
            f"--cost-table {path}: expected a JSON list of [tokens, seconds] pairs ({err})"
        ) from err


def parser() -> argparse.ArgumentParser:
    """The ``speculum`` argument parser."""
    top = argparse.ArgumentParser(prog="speculum", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="decode one prompt and print the completion")
    gen.add_argument(
        "--model",
        help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json); "
        "default: the bundled tiny code model (with its EAGLE-3 draft unless --algorithm)",
    )
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
    prompt.add_argument(
        "--prompt-ids", type=_int_list("--prompt-ids", "1,2,3"), help="prompt token ids, e.g. 1,2,3"
    )
    gen.add_argument(
        "--algorithm",
        help=f"one of {', '.join(sorted(ALGORITHMS))} (default: eagle3 on the bundled model, "
        "plain on --model)",
    )
    gen.add_argument(
        "--compare-plain",
        action="store_true",
        help="also decode with plain decoding; print the speedup and the acceptance length",
    )
    gen.add_argument(
        "--draft",
        help="draft model folder (EAGLE / EAGLE-3 heads, DFLASH / DSPARK blocks; MTP defaults "
        "to the target's folder)",
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
        "--adaptive-steps",
        type=_int_list("--adaptive-steps", "0,1,3,5"),
        default=(),
        metavar="N,N,...",
        help="adaptive speculation (EAGLE family and standalone, chains): draft depths to "
        "choose from each round by measured goodput at the batch's size, 0 = no speculation; "
        "replaces --num-steps",
    )
    gen.add_argument(
        "--adaptive-margin",
        type=float,
        default=0.05,
        help="exploration margin of --adaptive-steps: depths within this fraction of the best "
        "goodput keep being sampled (%(default)s)",
    )
    gen.add_argument(
        "--no-chain-hidden",
        dest="chain_hidden",
        action="store_false",
        help="multi_layer_eagle: feed every MTP layer the target's hidden state instead of the "
        "previous layer's output",
    )
    block = gen.add_argument_group("block drafting (--algorithm dflash or dspark)")
    block.add_argument(
        "--block-size",
        type=int,
        help="block width: DFLASH drafts N - 1 tokens, DSPARK N (default: the draft's)",
    )
    block.add_argument(
        "--verify-budget",
        type=_budget,
        default="all",
        help="draft tokens verified per round over the batch: all, auto (from --cost-table) or "
        "a number (default all)",
    )
    block.add_argument(
        "--cost-table",
        metavar="FILE",
        type=_cost_table,
        help="JSON list of [tokens verified in a round, seconds] pairs for --verify-budget auto",
    )
    block.add_argument(
        "--min-verify",
        type=int,
        default=0,
        help="draft tokens every request verifies at least (default 0)",
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
    gen.add_argument(
        "--logprobs",
        type=int,
        default=0,
        metavar="N",
        help="report each generated token's log-probability and its N most likely alternatives "
        '(--json\'s "logprobs"; see docs/request_controls.md); 0 = off',
    )
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    gen.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's")
    gen.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA, run decoding rounds eagerly instead of as captured CUDA graphs",
    )
    gen.add_argument(
        "--overlap",
        action="store_true",
        help="overlap scheduling: prepare each step on the host while the device runs the "
        "previous one (same tokens)",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    parallel = gen.add_argument_group("tensor parallelism (see docs/tensor_parallel.md)")
    parallel.add_argument(
        "--tp",
        type=int,
        help="shard the model over N processes, started by the command itself or by "
        "torchrun --nproc-per-node N (default: torchrun's process count, else 1)",
    )
    parallel.add_argument(
        "--draft-tp",
        type=int,
        help="1 keeps the draft whole on every rank; default: sharded like the target",
    )
    _add_train_target(commands)
    _add_train_draft(commands)
    return top


def _add_training_options(
    command: argparse.ArgumentParser, defaults: dict[str, object] | None
) -> None:
    """Options shared by both training commands, with ``defaults`` by parameter name; with
    ``None`` an option left out is not passed on at all, so the recipe's own default applies."""

    def option(flag: str, help: str, **kwargs: object) -> None:
        if defaults is None:
            kwargs.update(default=argparse.SUPPRESS, help=f"{help} (default: the recipe's)")
        else:
            name = flag[2:].replace("-", "_")
            kwargs.update(default=defaults[name], help=f"{help} (%(default)s)")
        command.add_argument(flag, **kwargs)

    option("--steps", "optimizer steps", type=int)
    option("--batch-size", "token windows per step", type=int)
    option("--length", "tokens per window, length - 1 of them predicted", type=int)
    option("--lr", "peak learning rate", type=float)
    option("--device", "where to train", choices=["cpu", "cuda"])
    option("--seed", "seed of the corpus sample, the initial weights and the windows", type=int)
    corpus = "the target's corpus" if defaults is None else "the interpreter's installed .py files"
    command.add_argument(
        "--files", nargs="+", metavar="F", help=f"text files to train on (default: {corpus})"
    )
    command.add_argument(
        "--overwrite", action="store_true", help="replace a finished model in OUT_DIR"
    )
    command.add_argument(
        "--save-dtype",
        choices=sorted(DTYPES),
        help="store the finished weights in this dtype (default: as trained, float32)",
    )
    command.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="save a resumable checkpoint every N steps (default: after the first step ending "
        "a minute after the last save, so that an interrupt loses about a minute)",
    )
    command.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no phase lines or progress bar on stderr",
    )


def _add_train_target(commands: argparse._SubParsersAction) -> None:
    from speculum.training.target import SIZES, train_target

    # One source of truth for the defaults: train_target's signature.
    defaults = {
        name: p.default
        for name, p in inspect.signature(train_target).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    train = commands.add_parser(
        "train-target",
        help="train a small Llama code model on the installed .py files",
        description="Train a Llama target on a sample of the .py files installed with this "
        "Python and save it as a Hugging Face folder (config.json, model.safetensors, "
        "tokenizer.json, corpus/). An interrupted run resumes when rerun with the same "
        "options; its checkpoint lives in OUT_DIR.work until the model is finished.",
    )
    train.add_argument("out_dir", metavar="OUT_DIR", help="folder of the finished model")
    train.add_argument(
        "--size", default=defaults["size"], choices=list(SIZES), help="model preset (%(default)s)"
    )
    _add_training_options(train, defaults)
    train.add_argument(
        "--max-bytes",
        type=int,
        default=defaults["max_bytes"],
        help="bytes of text sampled from the corpus (%(default)s)",
    )
    train.add_argument(
        "--vocab-size",
        type=int,
        default=defaults["vocab_size"],
        help="BPE vocabulary (%(default)s)",
    )


def _add_train_draft(commands: argparse._SubParsersAction) -> None:
    draft = commands.add_parser(
        "train-draft",
        help="train a draft for a target made by train-target",
        description="Train a draft model for --target with --algorithm and save it in a "
        "layout `speculum generate --draft` reads. Options left out take the recipe's "
        "defaults.",
    )
    draft.add_argument("out_dir", metavar="OUT_DIR", help="folder of the finished draft")
    draft.add_argument("--target", required=True, metavar="DIR", help="the target model folder")
    draft.add_argument("--algorithm", required=True, help="the draft kind, e.g. eagle, eagle3, mtp")
    _add_training_options(draft, None)
    draft.add_argument(
        "--num-steps",
        type=int,
        default=argparse.SUPPRESS,
        help="draft depth: EAGLE-3's training-time-test steps, multi-layer EAGLE's layer count",
    )
    draft.add_argument(
        "--draft-vocab-size",
        type=int,
        default=argparse.SUPPRESS,
        help="EAGLE-3: ids of the draft's reduced vocabulary",
    )
    draft.add_argument(
        "--block-size",
        type=int,
        default=argparse.SUPPRESS,
        help="DFLASH / DSPARK: the block width (DFLASH 8: 7 draft tokens; DSPARK 7: 7 tokens)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``speculum`` console script; returns the exit status."""
    args = parser().parse_args(argv)
    if args.command == "train-target":
        return _train_target(args)
    if args.command == "train-draft":
        return _train_draft(args)
    try:
        result = _generate(args, args.algorithm)
        plain = _generate(args, "plain") if args.compare_plain else None
    except (ValueError, RuntimeError, KeyError, MemoryError, OSError) as err:
        if distributed.is_leader():
            print(f"speculum: error: {err}", file=sys.stderr)
        return 2
    if not distributed.is_leader():  # under torchrun every rank decodes; rank 0 reports
        return 0
    if args.json:
        payload = {
            "token_ids": list(result.token_ids),
            # The contract makes text a string; a model without a tokenizer has no text.
            "text": result.text or "",
            "finish_reason": result.finish_reason,
            "stats": result.stats,
        }
        if result.logprobs is not None:
            payload["logprobs"] = result.logprobs
        if plain is not None:
            payload["compare_plain"] = _comparison(result, plain)
        print(json.dumps(payload))
        return 0
    print(result.text if result.text is not None else list(result.token_ids))
    stats = ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.stats.items()
    )
    print(stats, file=sys.stderr)
    if plain is not None:
        c = _comparison(result, plain)
        print(
            f"speculative {c['tokens_per_second']:.1f} tok/s vs plain "
            f"{c['plain_tokens_per_second']:.1f} tok/s: speedup {c['speedup']:.2f}x, acceptance "
            f"length {c['accept_length_mean']:.2f} (tokens per verify step, bonus included), "
            f"same tokens as plain: {'yes' if c['same_tokens'] else 'no'}",
            file=sys.stderr,
        )
    return 0


def _generate(args: argparse.Namespace, algorithm: str | None):
    """One ``generate`` call with the command's options and ``algorithm``."""
    ngram_fields = ("max_depth", "min_match", "min_breadth", "max_breadth", "corpus", "order")
    ngram = {f: getattr(args, f"ngram_{f}") for f in (*ngram_fields, "store_tokens")}
    (result,) = generate(
        [args.prompt] if args.prompt is not None else [args.prompt_ids],
        model=args.model,
        algorithm=algorithm,
        draft=args.draft,
        num_steps=args.num_steps,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
        sample_drafts=args.sample_drafts,
        chain_hidden=args.chain_hidden,
        adaptive_steps=() if algorithm == "plain" else args.adaptive_steps,
        adaptive_margin=args.adaptive_margin,
        block_size=args.block_size,
        verify_budget=args.verify_budget,
        cost_table=args.cost_table,
        min_verify=args.min_verify,
        ngram=NgramOptions(**{k: v for k, v in ngram.items() if v is not None}),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        logprobs=args.logprobs,
        device=args.device,
        dtype=args.dtype,
        cuda_graphs=args.cuda_graphs,
        overlap=args.overlap,
        tp=args.tp or int(os.environ.get("WORLD_SIZE", "1")),
        draft_tp=args.draft_tp,
    )
    return result


def _comparison(result, plain) -> dict[str, float | bool]:
    """Speedup of ``result`` over the plain run ``plain``, and its acceptance length."""
    return {
        "tokens_per_second": result.stats["tokens_per_second"],
        "plain_tokens_per_second": plain.stats["tokens_per_second"],
        "speedup": result.stats["tokens_per_second"] / plain.stats["tokens_per_second"],
        "accept_length_mean": result.stats["accept_length_mean"],
        "same_tokens": result.token_ids == plain.token_ids,
    }


#: What the training commands report as ``speculum: error: ...`` (status 2) rather than a
#: traceback: bad options, missing or unreadable folders and files, numerical blow-ups.
_TRAINING_ERRORS = (ValueError, RuntimeError, KeyError, MemoryError, OSError)


def _print_metrics(metrics: dict[str, object]) -> None:
    """One ``key=value, ...`` line on stdout."""
    print(
        ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
        )
    )


def _interrupted(out_dir: Path) -> int:
    """Tell where a rerun of an interrupted training command for ``out_dir`` starts, as the
    checkpoint on disk says; the exit status (130, as for a shell's Ctrl-C)."""
    from speculum.training.loop import saved_progress
    from speculum.training.target import checkpoint_file

    path = checkpoint_file(out_dir)
    try:
        saved = saved_progress(path)
    except ValueError as err:  # a damaged checkpoint: the rerun will refuse it too
        print(f"\nspeculum: interrupted; {err}", file=sys.stderr)
        return 130
    if saved is None:
        told = "no checkpoint was saved yet, so rerunning the same command starts from step 0"
    else:
        told = (
            f"rerun the same command to resume from step {saved[0]} of {saved[1]} "
            f"(the checkpoint in {path})"
        )
    print(f"\nspeculum: interrupted; {told}", file=sys.stderr)
    return 130


def _train_target(args: argparse.Namespace) -> int:
    """``speculum train-target``: train, save, print the losses; the exit status."""
    from speculum.training.target import train_target

    try:
        result = train_target(
            Path(args.out_dir),
            size=args.size,
            max_bytes=args.max_bytes,
            vocab_size=args.vocab_size,
            steps=args.steps,
            batch_size=args.batch_size,
            length=args.length,
            lr=args.lr,
            device=args.device,
            seed=args.seed,
            files=None if args.files is None else [Path(f) for f in args.files],
            overwrite=args.overwrite,
            progress=args.progress,
            save_dtype=args.save_dtype,
            checkpoint_every=args.checkpoint_every,
        )
    except _TRAINING_ERRORS as err:
        print(f"speculum: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(Path(args.out_dir))
    _print_metrics(
        {
            "model": args.out_dir,
            "steps": result.steps,
            "train_loss": result.train_loss,
            "heldout_loss": result.heldout_loss,
            **{f"heldout_{k}": v for k, v in result.heldout_metrics.items()},
            "seconds": result.seconds,
        }
    )
    return 0


def _train_draft(args: argparse.Namespace) -> int:
    """``speculum train-draft``: hand the options given to ``train_draft`` (the others take
    its defaults) and print the metrics it returns; the exit status."""
    options = {
        name: getattr(args, name)
        for name in (
            "steps",
            "batch_size",
            "length",
            "lr",
            "device",
            "seed",
            "num_steps",
            "draft_vocab_size",
            "block_size",
        )
        if hasattr(args, name)
    }
    try:
        from speculum.training.draft import train_draft

        metrics = train_draft(
            target_dir=Path(args.target),
            algorithm=args.algorithm,
            out_dir=Path(args.out_dir),
            files=None if args.files is None else [Path(f) for f in args.files],
            overwrite=args.overwrite,
            progress=args.progress,
            save_dtype=args.save_dtype,
            checkpoint_every=args.checkpoint_every,
            **options,
        )
    except _TRAINING_ERRORS as err:
        print(f"speculum: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(Path(args.out_dir))
    _print_metrics(metrics)
    return 0


if __name__ == "__main__":  # torchrun -m speculum.runtime.cli, like python -m speculum
    sys.exit(main())
