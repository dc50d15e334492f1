"""Command line: ``speculum generate ...``, ``speculum serve ...``, ``speculum train-target ...``
and ``speculum train-draft ...`` (also ``python -m speculum``)."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch

from speculum.models.decoder import GEMV_KINDS
from speculum.models.draft_kind import draft_algorithm
from speculum.models.loading import DTYPES
from speculum.pipelines import ADAPTIVE, ALGORITHMS, BLOCK, SPECULATIVE
from speculum.runtime import distributed, scheduler
from speculum.runtime.compiled import STAGES, check_stages
from speculum.runtime.default_model import DEFAULT_ALGORITHM, default_model_dir
from speculum.runtime.engine import GPU_DECODE_STEPS, GRAMMAR_DRAFTS, NgramOptions, check_gemv
from speculum.runtime.generate import (
    REQUEST_SETTINGS,
    Comparison,
    compare_plain,
    engine_for,
    generate,
)
from speculum.runtime.grammar import GRAMMAR_FIELDS
from speculum.runtime.mla_kernel import MLA_KERNELS

__all__ = ["main", "parser"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one ``speculum: error: ...`` line (status 2),
    like the errors found while decoding, instead of the usage text and the message."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` on one line and exit with status 2."""
        # argparse says "argument --a/--alias: ..."; one name is enough, none when it is there.
        named = re.fullmatch(r"argument ([^/:]+)(?:/[^:]*)?: (.*)", message, re.S)
        if named:
            flag, rest = named.groups()
            message = rest if flag in rest else f"{flag}: {rest}"
        self.exit(2, f"speculum: error: {message}\n")


def _number(flag: str, kind: type, least: float, most: float | None = None, *, above: bool = False):
    """An argparse type: a ``kind`` (int or float) at least ``least`` (above it with
    ``above``) and at most ``most``; the error names ``flag``, the value and the range."""
    what = "an integer" if kind is int else "a number"
    bounds = f"> {least}" if above else f">= {least}"
    if most is not None:
        bounds += f" and <= {most}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        low_ok = value is not None and (value > least if above else value >= least)
        if not low_ok or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"{flag} takes {what} {bounds}, not {text!r}")
        return value

    return parse


def _name_list(flag: str, check: Callable[[object], tuple[str, ...]]):
    """An argparse type: comma-separated names, as ``check`` canonicalises them
    (``runtime.compiled.check_stages``, ``runtime.engine.check_gemv``); refusals name ``flag``."""

    def parse(text: str) -> tuple[str, ...]:
        try:
            return check(tuple(n.strip() for n in text.split(",") if n.strip()))
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{flag}: {error}") from None

    return parse


def _int_list(flag: str, example: str, least: int, what: str, outside: str = "out of range"):
    """An argparse type: comma-separated integers (``what``), at least one, each at least
    ``least``; the errors name ``flag``, and a value below ``least`` is ``outside``."""

    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",")]
        if items == [""]:
            raise argparse.ArgumentTypeError(f"{flag} is empty: give {what}, e.g. {example}")
        try:
            values = [int(t) for t in items]
        except ValueError as err:
            raise argparse.ArgumentTypeError(
                f"{flag} takes comma-separated {what}, e.g. {example}, not {text!r}"
            ) from err
        low = [v for v in values if v < least]
        if low:
            raise argparse.ArgumentTypeError(
                f"{flag}: {low[0]} is {outside} ({what} are >= {least})"
            )
        return values

    return parse


def _prompt_text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("--prompt is empty: give some text to continue")
    return text


def _logit_bias(text: str) -> dict[int, float]:
    """``--logit-bias``'s JSON object of token ids and biases, checked as
    ``scheduler.Sampling`` checks it."""
    try:
        bias = scheduler.Sampling(logit_bias=json.loads(text)).logit_bias
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(
            f"--logit-bias {text}: expected a JSON object of token ids and biases in "
            f"[-100, 100], e.g. '{{\"5\": -100}}' ({err})"
        ) from err
    return dict(bias)


def _constraint(field: str, flag: str, from_file: bool) -> Callable[[str], str]:
    """An argparse type for a grammar flag: its text (read from the file it names when
    ``from_file``), checked as ``scheduler.Sampling`` checks ``field``."""

    def parse(value: str) -> str:
        try:
            text = Path(value).read_text() if from_file else value
            return getattr(scheduler.Sampling(**{field: text}), field)
        except (OSError, TypeError, ValueError, ImportError) as err:
            raise argparse.ArgumentTypeError(f"{flag} {value}: {err}") from err

    return parse


def _stop_text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError(
            "--stop is empty: an empty stop string would end every request at its first token; "
            "drop it"
        )
    return text


def _algorithm(text: str) -> str:
    name = text.lower()
    if name not in ALGORITHMS:
        raise argparse.ArgumentTypeError(
            f"unknown algorithm {text!r}; choose one of {', '.join(sorted(ALGORITHMS))}"
        )
    return name


def _budget(text: str) -> str | int:
    if text in ("all", "auto"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"--verify-budget takes all, auto or a number of draft tokens >= 0, not {text!r}"
        )
    return value


def _cost_table(path: str) -> tuple[tuple[int, float], ...]:
    try:
        raw = json.loads(Path(path).read_text())
        return tuple((int(n), float(s)) for n, s in raw)
    except (OSError, ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(
            f"--cost-table {path}: expected a JSON list of [tokens, seconds] pairs ({err})"
        ) from err


#: The per-request settings that are numbers, each with its flag's parser (range included).
_SETTINGS = {
    "max_new_tokens": _number("--max-new-tokens", int, 1),
    "temperature": _number("--temperature", float, 0.0),
    "top_k": _number("--top-k", int, 0),
    "top_p": _number("--top-p", float, 0.0, 1.0, above=True),
    "min_p": _number("--min-p", float, 0.0, 1.0),
    "seed": _number("--seed", int, 0),
    "logprobs": _number("--logprobs", int, 0),
    "prompt_logprobs": _number("--prompt-logprobs", int, 0),
    "repetition_penalty": _number("--repetition-penalty", float, 0.0, above=True),
    "presence_penalty": _number("--presence-penalty", float, -2.0, 2.0),
    "frequency_penalty": _number("--frequency-penalty", float, -2.0, 2.0),
    "min_tokens": _number("--min-tokens", int, 0),
}


def parser() -> argparse.ArgumentParser:
    """The ``speculum`` argument parser."""
    top = _Parser(prog="speculum", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="decode one prompt and print the completion")
    gen.add_argument(
        "--model",
        help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json); "
        "default: the bundled tiny code model (with its EAGLE-3 draft unless --algorithm)",
    )
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt", type=_prompt_text, help="prompt text (needs the model's tokenizer.json)"
    )
    prompt.add_argument(
        "--prompt-ids",
        type=_int_list("--prompt-ids", "1,2,3", 0, "token ids", "outside the vocabulary"),
        help="prompt token ids, e.g. 1,2,3",
    )
    prompt.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="several prompts decoded as one batch: one per line, or in a .jsonl file one "
        'object per line, {"prompt": TEXT} or {"prompt_ids": [...]} with any of '
        + ", ".join(REQUEST_SETTINGS)
        + " of its own",
    )
    gen.add_argument(
        "--output",
        metavar="FILE",
        help="--prompts-file: write the results there, one JSON object per line (default: stdout)",
    )
    gen.add_argument(
        "--algorithm",
        "--speculative-algorithm",
        type=_algorithm,
        help=f"one of {', '.join(sorted(ALGORITHMS))}, any case (default: the --draft's kind; "
        "eagle3 on the bundled model; plain on --model without --draft)",
    )
    gen.add_argument(
        "--compare-plain",
        action="store_const",
        const=True,
        help="also decode with plain decoding: warm both engines, alternate timed passes and "
        "print the median speedup, its spread and the acceptance length",
    )
    gen.add_argument(
        "--passes",
        type=_number("--passes", int, 1),
        help="timed passes of each engine for --compare-plain (default 3)",
    )
    gen.add_argument(
        "--draft",
        "--speculative-draft-model-path",
        help="draft model folder (EAGLE / EAGLE-3 heads, DFLASH / DSPARK blocks; MTP defaults "
        "to the target's folder)",
    )
    gen.add_argument(
        "--num-steps",
        "--speculative-num-steps",
        type=_number("--num-steps", int, 1),
        help="draft depth per round (default 3)",
    )
    gen.add_argument(
        "--topk",
        "--speculative-eagle-topk",
        type=_number("--topk", int, 1),
        help="draft children per node (default 1 = chain); sampling's top-k is --top-k",
    )
    gen.add_argument(
        "--num-draft-tokens",
        "--speculative-num-draft-tokens",
        type=_number("--num-draft-tokens", int, 2),
        help="tree nodes verified per round, root included (default num-steps + 1 for chains)",
    )
    gen.add_argument(
        "--sample-drafts",
        action="store_const",
        const=True,
        help="draw draft tokens from the draft's distribution (topk independent chains)",
    )
    gen.add_argument(
        "--adaptive-steps",
        type=_int_list("--adaptive-steps", "0,1,3,5", 0, "draft depths"),
        metavar="N,N,...",
        help="adaptive speculation (EAGLE family and standalone, chains): draft depths to "
        "choose from each round by measured goodput at the batch's size, 0 = no speculation; "
        "replaces --num-steps",
    )
    gen.add_argument(
        "--adaptive-margin",
        type=_number("--adaptive-margin", float, 0.0),
        help="exploration margin of --adaptive-steps: depths within this fraction of the best "
        "goodput keep being sampled (default 0.05)",
    )
    gen.add_argument(
        "--decode-steps",
        type=_number("--decode-steps", int, 1),
        metavar="K",
        help="plain decoding: steps per launch (one CUDA graph), stop conditions checked after "
        f"it (default 1 on the CPU, {GPU_DECODE_STEPS} on CUDA)",
    )
    gen.add_argument(
        "--no-chain-hidden",
        dest="chain_hidden",
        action="store_const",
        const=False,
        help="multi_layer_eagle: feed every MTP layer the target's hidden state instead of the "
        "previous layer's output",
    )
    block = gen.add_argument_group("block drafting (--algorithm dflash or dspark)")
    block.add_argument(
        "--block-size",
        type=_number("--block-size", int, 1),
        help="block width: DFLASH drafts N - 1 tokens, DSPARK N (default: the draft's)",
    )
    block.add_argument(
        "--verify-budget",
        type=_budget,
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
        type=_number("--min-verify", int, 0),
        help="draft tokens every request verifies at least (default 0)",
    )
    block.add_argument(
        "--padded-verify",
        dest="packed_verify",
        action="store_const",
        const=False,
        help="run a fixed budget's verify over every row's whole block (padded) instead of the "
        "verified tokens alone (packed, the default); the same tokens either way",
    )
    ngram = gen.add_argument_group("n-gram drafting (--algorithm ngram; no --draft needed)")
    ngram.add_argument(
        "--ngram-max-depth",
        type=_number("--ngram-max-depth", int, 1),
        help="longest suffix matched and deepest draft (default 18)",
    )
    ngram.add_argument(
        "--ngram-min-match",
        type=_number("--ngram-min-match", int, 1),
        help="shortest suffix matched (default 1)",
    )
    ngram.add_argument(
        "--ngram-min-breadth",
        type=_number("--ngram-min-breadth", int, 1),
        help="first-level children of a longest match (default 1)",
    )
    ngram.add_argument(
        "--ngram-max-breadth",
        type=_number("--ngram-max-breadth", int, 1),
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
        type=_number("--ngram-store-tokens", int, 0),
        metavar="N",
        help="budget of the store shared across requests, in tokens (0 = off; default 1048576 "
        "with the host matcher, off with the device one)",
    )
    ngram.add_argument(
        "--ngram-matcher",
        choices=["host", "device"],
        help="where drafts are matched: host (trees from the history, the store and the corpus; "
        "default) or device (one chain from the request's history, inside the captured round)",
    )
    gen.add_argument("--max-new-tokens", type=_SETTINGS["max_new_tokens"], default=64)
    gen.add_argument("--temperature", type=_SETTINGS["temperature"], default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=_SETTINGS["top_k"], default=0, help="0 = off")
    gen.add_argument("--top-p", type=_SETTINGS["top_p"], default=1.0, help="1 = off")
    gen.add_argument("--min-p", type=_SETTINGS["min_p"], default=0.0, help="0 = off")
    gen.add_argument("--seed", type=_SETTINGS["seed"], default=0)
    gen.add_argument(
        "--logprobs",
        type=_SETTINGS["logprobs"],
        default=0,
        metavar="N",
        help="report each generated token's log-probability and its N most likely alternatives "
        '(--json\'s "logprobs"; see docs/request_controls.md); 0 = off',
    )
    gen.add_argument(
        "--prompt-logprobs",
        type=_SETTINGS["prompt_logprobs"],
        metavar="N",
        help="report each prompt token's log-probability given the tokens before it and the N "
        "most likely tokens there (--json's \"prompt_logprobs\"; 0 = the token's own alone; "
        "the prompt is then prefilled in full, not from the prefix cache)",
    )
    gen.add_argument(
        "--logit-bias",
        type=_logit_bias,
        metavar="JSON",
        help="add each bias (in [-100, 100]) to its token's logit, e.g. '{\"5\": -100}' bans "
        "token 5 (OpenAI's and vLLM's logit_bias)",
    )
    gen.add_argument(
        "--repetition-penalty",
        type=_SETTINGS["repetition_penalty"],
        default=1.0,
        help="divide the positive logits and multiply the negative ones of every token of the "
        "prompt and the output so far by this (> 0; 1 = off)",
    )
    gen.add_argument(
        "--presence-penalty",
        type=_SETTINGS["presence_penalty"],
        default=0.0,
        help="subtract this from the logit of every token already generated ([-2, 2]; 0 = off)",
    )
    gen.add_argument(
        "--frequency-penalty",
        type=_SETTINGS["frequency_penalty"],
        default=0.0,
        help="subtract this times its count from the logit of every token already generated "
        "([-2, 2]; 0 = off)",
    )
    gen.add_argument(
        "--min-tokens",
        type=_SETTINGS["min_tokens"],
        default=0,
        metavar="N",
        help="no EOS, stop token or stop string ends a completion before N tokens (<= "
        "--max-new-tokens)",
    )
    gen.add_argument(
        "--json-schema",
        type=_constraint("json_schema", "--json-schema", from_file=True),
        metavar="FILE",
        help="constrain the output to JSON valid under the JSON schema in FILE (xgrammar; "
        "exact under speculation, see docs/request_controls.md)",
    )
    gen.add_argument(
        "--regex",
        type=_constraint("regex", "--regex", from_file=False),
        metavar="REGEX",
        help="constrain the output to the regular expression REGEX",
    )
    gen.add_argument(
        "--grammar",
        type=_constraint("grammar", "--grammar", from_file=True),
        metavar="FILE",
        help="constrain the output to the EBNF grammar in FILE (xgrammar's GBNF dialect, "
        "rule root)",
    )
    gen.add_argument(
        "--grammar-drafts",
        choices=list(GRAMMAR_DRAFTS),
        help="what a grammar masks under speculation: masked, the drafts too (one host round "
        "trip per draft level, higher acceptance; the default), or free, the target alone (one "
        "round trip a round); exact either way",
    )
    gen.add_argument(
        "--n",
        type=_number("--n", int, 1),
        default=1,
        metavar="N",
        help="N completions of each prompt, each with its own random streams (seeds derived "
        "from --seed; the first keeps it); --json prints them as a list",
    )
    gen.add_argument(
        "--stop",
        action="append",
        type=_stop_text,
        metavar="TEXT",
        help="end the request when its text contains TEXT (repeatable); the text printed ends "
        "before it",
    )
    gen.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        help="--stop: keep the stop string at the end of the text",
    )
    gen.add_argument(
        "--ignore-eos", action="store_true", help="decode on past the model's end-of-text token"
    )
    limits = gen.add_argument_group("engine limits")
    limits.add_argument(
        "--max-context",
        "--context-length",
        type=_number("--max-context", int, 1),
        help="tokens per request, prompt included (default: the model's "
        "max_position_embeddings, at most 4096)",
    )
    limits.add_argument(
        "--max-batch",
        "--max-running-requests",
        type=_number("--max-batch", int, 1),
        default=16,
        help="requests decoded together (%(default)s)",
    )
    limits.add_argument(
        "--page-size",
        type=_number("--page-size", int, 1),
        default=16,
        help="tokens per KV-cache page (%(default)s)",
    )
    gen.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs: auto (the default) is cuda when a GPU is visible, else cpu",
    )
    gen.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's")
    gen.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA, run decoding rounds eagerly instead of as captured CUDA graphs",
    )
    gen.add_argument(
        "--compile-stages",
        type=_name_list("--compile-stages", check_stages),
        default=(),
        help="compile parts of each decoding round with torch.compile, comma-separated: "
        f"{', '.join(STAGES)} (default: none, the hand-written path; see docs/gpu.md)",
    )
    gen.add_argument(
        "--mla-kernel",
        choices=MLA_KERNELS,
        default="triton",
        help="kernel of a DeepSeek target's latent attention in decoding rounds: triton "
        "(default) or flashinfer, planned on the host before each round (CUDA, bfloat16, "
        "synchronous scheduling, plain decoding or chains; see docs/mla.md)",
    )
    gen.add_argument(
        "--half-gemv",
        type=_name_list("--half-gemv", check_gemv),
        default=(),
        help="on CUDA, run these projections' decode-sized matmuls with speculum's Triton "
        f"matrix-vector kernel instead of cuBLAS, comma-separated: {', '.join(GEMV_KINDS)} "
        "(default: none; see docs/gpu.md)",
    )
    gen.add_argument(
        "--overlap",
        action="store_true",
        help="overlap scheduling: prepare each step on the host while the device runs the "
        "previous one (same tokens)",
    )
    gen.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="compute every prompt's KV afresh instead of reusing the pages of prompt prefixes "
        "earlier requests computed (see docs/prefix_cache.md)",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="print the completion once it is finished (default: as it is decoded; --json "
        "and --compare-plain print at the end)",
    )
    parallel = gen.add_argument_group("tensor parallelism (see docs/tensor_parallel.md)")
    parallel.add_argument(
        "--tp",
        "--tp-size",
        type=_number("--tp", int, 1),
        help="shard the model over N processes, started by the command itself or by "
        "torchrun --nproc-per-node N (default: torchrun's process count, else 1)",
    )
    parallel.add_argument(
        "--draft-tp",
        type=_number("--draft-tp", int, 1),
        help="1 keeps the draft whole on every rank; default: sharded like the target",
    )
    _add_serve(commands, gen)
    _add_train_target(commands)
    _add_train_draft(commands)
    return top


#: ``generate``'s options that build the engine (not a request's settings, prompts or output),
#: which ``speculum serve`` takes too.
_ENGINE_DESTS = (
    "model",
    "algorithm",
    "max_context",
    "max_batch",
    "page_size",
    "device",
    "dtype",
    "cuda_graphs",
    "compile_stages",
    "mla_kernel",
    "half_gemv",
    "overlap",
    "prefix_cache",
    "tp",
)


def _add_serve(commands: argparse._SubParsersAction, gen: argparse.ArgumentParser) -> None:
    """``speculum serve``: ``generate``'s engine options (the very same argparse actions, so
    the two commands build engines alike) and the server's own."""
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve a model (default: the bundled pair) over HTTP: /v1/completions, "
        "/v1/chat/completions, /v1/models, /health and /metrics (see docs/serving.md).",
    )
    engine_dests = {*_ENGINE_DESTS, *_ALGORITHM_OPTIONS} - {"compare_plain", "passes"}
    for action in gen._actions:
        if action.dest in engine_dests:
            serve._add_action(action)
    own = serve.add_argument_group("server")
    own.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    own.add_argument(
        "--port",
        type=_number("--port", int, 0, 65535),
        default=8000,
        help="port to listen on, 0 for any free one, named in the log (%(default)s)",
    )
    own.add_argument(
        "--max-queue",
        type=_number("--max-queue", int, 0),
        default=256,
        metavar="N",
        help="requests that may wait beyond --max-batch; more get HTTP 429 (%(default)s)",
    )
    own.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 endpoints (default: none)",
    )
    own.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="names requests may give as 'model', the first one the default (default: the "
        "--model argument as given, or speculum-default for the bundled model)",
    )
    own.add_argument(
        "--max-logprobs",
        type=_number("--max-logprobs", int, 0),
        default=20,
        metavar="N",
        help="most top_logprobs (or prompt_logprobs) a request may ask for; every round "
        "computes N alternatives per token, 0 computes none (%(default)s)",
    )
    own.add_argument(
        "--no-logit-bias",
        dest="logit_bias",
        action="store_false",
        help="refuse logit_bias and keep no [batch, vocab] bias rows on the device",
    )
    own.add_argument(
        "--no-penalties",
        dest="penalties",
        action="store_false",
        help="refuse presence_penalty, frequency_penalty, repetition_penalty and min_tokens, "
        "and keep no per-request token counts on the device",
    )
    own.add_argument(
        "--no-overlap",
        action="store_true",
        help="on CUDA, step synchronously (there the server overlaps scheduling by default, "
        "except with --mla-kernel flashinfer, which plans on the host between steps)",
    )
    own.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (%(default)s)",
    )


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


#: Options whose value may begin with "-" (negative ids, a prompt such as "-x"): argparse would
#: take such a value for an option, so ``--prompt-ids -5`` is joined into ``--prompt-ids=-5``.
_DASHED_VALUES = ("--prompt", "--prompt-ids", "--adaptive-steps", "--stop")


def _join_dashed_values(argv: Sequence[str], known: set[str]) -> list[str]:
    """``argv`` with each of :data:`_DASHED_VALUES` and a following value that starts with "-"
    but is no option of ``known`` written as one ``FLAG=VALUE`` word."""
    joined: list[str] = []
    words = iter(argv)
    for word in words:
        if word in _DASHED_VALUES:
            value = next(words, None)
            if value is not None and value.startswith("-") and value.split("=")[0] not in known:
                joined.append(f"{word}={value}")
                continue
            joined.extend([word] if value is None else [word, value])
            continue
        joined.append(word)
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``speculum`` console script; returns the exit status."""
    top = parser()
    known = {s for p in _subparsers(top) for a in p._actions for s in a.option_strings}
    args = top.parse_args(_join_dashed_values(sys.argv[1:] if argv is None else argv, known))
    if args.command == "train-target":
        return _train_target(args)
    if args.command == "train-draft":
        return _train_draft(args)
    if args.command == "serve":
        return _serve_command(args)
    return _generate_command(args)


class _Progress:
    """What the command has decoded so far (``generate``'s ``on_tokens``), written to stdout
    as it comes when ``echo``; Ctrl-C reports it."""

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.ids: list[int] = []
        self.text = ""
        self.first_at: float | None = None  # when the first token came

    def __call__(self, index: int, ids: tuple[int, ...], text: str) -> None:
        """Keep (and, when echoing, print) one step's new tokens of the command's prompt."""
        self.first_at = self.first_at or time.perf_counter()
        self.ids.extend(ids)
        self.text += text
        if self.echo and text:
            print(text, end="", flush=True)

    def close(self) -> None:
        """Nothing to close (the same calls as :class:`_BatchProgress`)."""

    def stats(self) -> dict[str, float | int | str]:
        """Tokens so far, and their rate after the first one."""
        seconds = time.perf_counter() - self.first_at if self.first_at else 0.0
        rate = (len(self.ids) - 1) / seconds if len(self.ids) > 1 and seconds > 0 else 0.0
        return {
            "num_new_tokens": len(self.ids),
            "tokens_per_second": rate,
            "finish_reason": "interrupted",
        }


class _BatchProgress:
    """``--prompts-file``'s progress bar on stderr (tokens, tokens/s, ETA over the prompts'
    budgets), fed by ``generate``'s ``on_tokens``."""

    def __init__(self, show: bool) -> None:
        self.show, self.bar, self.tokens = show, None, 0
        self.started = time.perf_counter()
        self.prompts, self.budget = 0, 0

    def start(self, prompts: list, max_new_tokens: int) -> None:
        """Size the bar by the budgets of ``prompts`` (their own or ``max_new_tokens``); it
        opens with the first tokens, so that its rate leaves the model's loading out."""
        self.prompts = len(prompts)
        self.budget = sum(
            p.get("max_new_tokens", max_new_tokens) if isinstance(p, dict) else max_new_tokens
            for p in prompts
        )

    def __call__(self, index: int, ids: tuple[int, ...], text: str) -> None:
        """Count one step's tokens of prompt ``index``."""
        if self.bar is None:
            from tqdm import tqdm

            self.started = time.perf_counter()
            self.bar = tqdm(
                desc=f"{self.prompts} prompts",
                total=self.budget,
                unit="tok",
                file=sys.stderr,
                disable=not self.show,
            )
        self.tokens += len(ids)
        self.bar.update(len(ids))

    def close(self) -> None:
        """Close the bar (finished early: the requests that stopped before their budget)."""
        if self.bar is not None:
            self.bar.total = self.bar.n
            self.bar.close()
            self.bar = None

    def stats(self) -> dict[str, float | int | str]:
        """Tokens so far over the whole batch, and their rate."""
        seconds = time.perf_counter() - self.started
        return {
            "num_new_tokens": self.tokens,
            "tokens_per_second": self.tokens / seconds if seconds > 0 else 0.0,
            "finish_reason": "interrupted",
        }


def _read_prompts(path: str) -> list[str | dict]:
    """The prompts of ``--prompts-file``: its non-blank lines, or for a ``.jsonl`` file one
    object per non-blank line (see :func:`_prompt_object`)."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--prompts-file {path}: cannot read it ({err})") from err
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise ValueError(f"--prompts-file {path} holds no prompts (blank lines are skipped)")
    if not path.endswith(".jsonl"):
        return [line for _, line in numbered]
    return [_prompt_object(line, f"{path}:{n}") for n, line in numbered]


def _prompt_object(line: str, where: str) -> dict:
    """One JSONL prompt: ``{"prompt": TEXT}`` or ``{"prompt_ids": [...]}`` and settings among
    ``REQUEST_SETTINGS``, the numbers range-checked as their flags are."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not a JSON object ({err})") from err
    keys = {"prompt", "prompt_ids", *REQUEST_SETTINGS}
    if not isinstance(raw, dict) or len({"prompt", "prompt_ids"} & set(raw)) != 1:
        raise ValueError(f'{where}: expected {{"prompt": TEXT}} or {{"prompt_ids": [ids]}}')
    if set(raw) - keys:
        raise ValueError(
            f"{where}: unknown keys {sorted(set(raw) - keys)}; settings are "
            f"{', '.join(REQUEST_SETTINGS)}"
        )
    prompt = raw.get("prompt", raw.get("prompt_ids"))
    ids = raw.get("prompt_ids", [0])
    if not prompt or not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise ValueError(f"{where}: the prompt must be non-empty text or non-negative ids")
    kinds = {"stop_token_ids": int, "stop_strings": str}
    for name, kind in kinds.items():
        value = raw.get(name, [])
        values = [value] if isinstance(value, kind) else value
        if not isinstance(values, list) or not all(type(v) is kind for v in values):
            raise ValueError(f"{where}: {name} takes one {kind.__name__} or a list of them")
    for name in ("logit_bias", *GRAMMAR_FIELDS):
        if name in raw:
            try:
                scheduler.Sampling(**{name: raw[name]})
            except (TypeError, ValueError) as err:
                raise ValueError(f"{where}: {err}") from err
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if type(raw.get(name, False)) is not bool:
            raise ValueError(f"{where}: {name} takes true or false")
    for name, parse in _SETTINGS.items():
        if name in raw:
            try:
                parse(str(raw[name]) if type(raw[name]) in (int, float) else repr(raw[name]))
            except argparse.ArgumentTypeError as err:
                raise ValueError(f"{where}: {name}: {err}") from err
    return raw


def _payload(result) -> dict:
    """One result as ``--json`` prints it: ids, text, finish reason (and error), statistics,
    and the log-probabilities when asked for."""
    return {
        "token_ids": list(result.token_ids),
        # The contract makes text a string; a model without a tokenizer has no text.
        "text": result.text or "",
        "finish_reason": result.finish_reason,
        **_error_field(result),
        "stats": result.stats,
        **({} if result.logprobs is None else {"logprobs": result.logprobs}),
        **_prompt_logprobs(result),
    }


def _prompt_logprobs(result) -> dict:
    """``--json``'s ``"prompt_logprobs"`` field of a result, when asked for."""
    return {} if result.prompt_logprobs is None else {"prompt_logprobs": result.prompt_logprobs}


def _report_completions(args: argparse.Namespace, results: list) -> int:
    """``--n``'s completions of one prompt: with ``--json`` one object, ``{"completions":
    [...]}``, each as ``--json`` prints a single result; otherwise each text under a
    ``=== completion i ===`` line and its statistics on stderr. The exit status."""
    if args.json:
        print(json.dumps({"completions": [_payload(r) for r in results]}))
        return _errors_status(results)
    for index, result in enumerate(results):
        print(f"=== completion {index} ===")
        print(result.text if result.text is not None else list(result.token_ids))
        print(f"completion {index}: {_stats_line(result.stats)}", file=sys.stderr)
    return _errors_status(results)


def _report_batch(args: argparse.Namespace, results: list) -> int:
    """``--prompts-file``'s results: JSON lines to ``--output`` (or stdout) and a table on
    stderr; the exit status. With ``--n`` N > 1, result ``index`` is completion ``index % N``
    of prompt ``index // N``, which its line says (``prompt_index``, ``completion``)."""
    n = args.n
    lines = [
        json.dumps(
            {
                "index": i,
                **({"prompt_index": i // n, "completion": i % n} if n > 1 else {}),
                "token_ids": list(r.token_ids),
                "text": r.text or "",
                "finish_reason": r.finish_reason,
                **_error_field(r),
                "stats": r.stats,
                **({} if r.logprobs is None else {"logprobs": r.logprobs}),
                **_prompt_logprobs(r),
            }
        )
        for i, r in enumerate(results)
    ]
    if args.output is None:
        print("\n".join(lines))
    else:
        try:
            Path(args.output).write_text("".join(f"{line}\n" for line in lines))
        except OSError as err:
            print(f"speculum: error: --output {args.output}: {err}", file=sys.stderr)
            return 2
    print(_table(results), file=sys.stderr)
    return _errors_status(results)


def _error_field(result) -> dict[str, str]:
    """``{"error": why}`` for a result the engine could not decode (``finish_reason`` error),
    nothing otherwise."""
    return {} if result.error is None else {"error": result.error}


def _errors_status(results: list) -> int:
    """Each failed request's error on stderr, and the exit status: 1 when any failed (the
    others were decoded and reported all the same), 0 otherwise."""
    for result in results:
        if result.error is not None:
            print(f"speculum: error: {result.error}", file=sys.stderr)
    return int(any(r.error is not None for r in results))


def _table(results: list) -> str:
    """One row per result: index, tokens, finish reason, acceptance length, text's start."""
    rows = [f"{'#':>4} {'tokens':>7} {'finish':<8} {'accept':>6}  text"]
    for i, r in enumerate(results):
        text = (r.text or "").replace("\n", "\\n")
        text = text if len(text) <= 40 else text[:39] + "…"
        rows.append(
            f"{i:>4} {len(r.token_ids):>7} {r.finish_reason:<8} "
            f"{r.stats['accept_length_mean']:>6.2f}  {text}"
        )
    total = sum(len(r.token_ids) for r in results)
    rows.append(
        f"{len(results)} prompts, {total} tokens, {results[0].stats['tokens_per_second']:.1f} tok/s"
    )
    return "\n".join(rows)


def _generate_command(args: argparse.Namespace) -> int:
    """``speculum generate``: decode, print, report; the exit status."""
    launching = (args.tp or 1) > 1 and not distributed.launched()  # on_tokens would run there
    leader, batch = distributed.is_leader(), args.prompts_file is not None
    echo = args.stream and not (args.json or args.compare_plain or launching or batch)
    echo = echo and args.n == 1  # completions would interleave
    progress = _BatchProgress(leader) if batch else _Progress(echo and leader)
    try:
        algorithm = _chosen_algorithm(args)
        _check_generate_options(args)
        prompts, options = _generate_call(args, algorithm)
        if args.compare_plain:
            passes = {} if args.passes is None else {"passes": args.passes}
            comparison = compare_plain(prompts, **options, **passes)
            results, plain = comparison.speculative, comparison
        else:
            on_tokens = {} if launching else {"on_tokens": progress}
            if batch:
                progress.start(prompts, args.max_new_tokens)
            results, plain = generate(prompts, **options, **on_tokens), None
    except (ValueError, RuntimeError, KeyError, MemoryError, OSError) as err:
        progress.close()
        if leader:
            print(f"speculum: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        progress.close()
        if leader:
            _report_interrupted(args, progress)
        return 130
    progress.close()
    if not leader:  # under torchrun every rank decodes; rank 0 reports
        return 0
    if batch:
        return _report_batch(args, results)
    if args.n > 1:
        return _report_completions(args, results)
    (result,) = results
    if result.stats.get("length_limit") == "max_context":
        print(_context_notice(result, args.max_new_tokens), file=sys.stderr)
    if args.json:
        payload = _payload(result)
        if plain is not None:
            payload["compare_plain"] = _comparison(plain)
        print(json.dumps(payload))
        return _errors_status(results)
    if progress.echo and result.text is not None and result.text.startswith(progress.text):
        print(result.text[len(progress.text) :], flush=True)  # the rest, and the newline
    else:
        print(result.text if result.text is not None else list(result.token_ids))
    print(_stats_line(result.stats), file=sys.stderr)
    if plain is not None:
        c = _comparison(plain)
        print(
            f"speculative {c['tokens_per_second']:.1f} tok/s vs plain "
            f"{c['plain_tokens_per_second']:.1f} tok/s: speedup {c['speedup']:.2f}x (median of "
            f"{len(c['speedups'])} alternating passes after a warm-up; "
            f"{min(c['speedups']):.2f}x-{max(c['speedups']):.2f}x), acceptance length "
            f"{c['accept_length_mean']:.2f} (tokens per verify step, bonus included), same "
            f"tokens as plain: {'yes' if c['same_tokens'] else 'no'}",
            file=sys.stderr,
        )
    return _errors_status(results)


def _serve_command(args: argparse.Namespace) -> int:
    """``speculum serve``: build the engine as ``generate`` would from the same flags, serve
    it until SIGINT or SIGTERM (the running requests finish first); the exit status."""
    try:
        from speculum.serving.app import serve
        from speculum.serving.chat import load_chat_template
    except ImportError as err:
        print(
            f"speculum: error: speculum serve needs the serve extra ({err.name} is missing): "
            "pip install 'speculum[serve]'",
            file=sys.stderr,
        )
        return 2
    try:
        if (args.tp or int(os.environ.get("WORLD_SIZE", "1"))) > 1:
            raise ValueError("--tp: speculum serve runs in one process; serve with --tp 1")
        if args.overlap and args.no_overlap:
            raise ValueError("--overlap and --no-overlap contradict each other; give one")
        algorithm = _chosen_algorithm(args)
        options = _engine_options(args, algorithm)
        # flashinfer's MLA plans need synchronous steps: no overlap unless asked for.
        synchronous = args.no_overlap or args.mla_kernel == "flashinfer"
        options["overlap"] = args.overlap or (options["device"] == "cuda" and not synchronous)
        engine = engine_for(
            **options,
            max_logprobs=args.max_logprobs,
            logit_bias=args.logit_bias,
            penalties=args.penalties,
        )
        folder = default_model_dir() if args.model is None else Path(args.model)
        template = load_chat_template(folder)
    except (ValueError, RuntimeError, KeyError, MemoryError, OSError) as err:
        print(f"speculum: error: {err}", file=sys.stderr)
        return 2
    names = args.served_model_name or [args.model or "speculum-default"]
    print(
        f"speculum: serving {names[0]!r} ({engine.pipeline.name}) on http://{args.host}:"
        f"{args.port}/v1; chat template: {'yes' if template else 'none'}",
        file=sys.stderr,
    )
    serve(
        engine,
        host=args.host,
        port=args.port,
        served_model_names=names,
        chat_template=template,
        api_key=args.api_key,
        max_queue=args.max_queue,
        log_level=args.log_level,
    )
    return 0


def _stats_line(stats: dict[str, object]) -> str:
    """``key=value, ...`` with floats to 4 significant digits."""
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()
    )


def _report_interrupted(args: argparse.Namespace, progress: _Progress) -> None:
    """After Ctrl-C: what was decoded (unless already streamed) and its statistics."""
    stats = progress.stats()
    if isinstance(progress, _BatchProgress):
        pass  # the bar showed the batch's progress; its results were never complete
    elif args.json:
        payload = {"token_ids": progress.ids, "text": progress.text}
        print(json.dumps({**payload, "finish_reason": "interrupted", "stats": stats}))
    elif progress.echo:
        print(flush=True)  # end the streamed line
    elif progress.ids:
        print(progress.text or progress.ids)
    print(_stats_line(stats), file=sys.stderr)
    print("speculum: interrupted", file=sys.stderr)


def _context_notice(result, max_new_tokens: int) -> str:
    """The line saying that the context, not ``--max-new-tokens``, ended ``result``."""
    return (
        f"speculum: note: stopped after {len(result.token_ids)} new tokens, not "
        f"--max-new-tokens {max_new_tokens}: the prompt and the output filled the context of "
        f"{result.stats['max_context']} tokens (--max-context, up to the model's "
        "max_position_embeddings)"
    )


def _subparsers(top: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of ``top``'s commands."""
    (commands,) = (a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return list(commands.choices.values())


#: The ``--ngram-*`` options that are fields of ``NgramOptions`` by the same name.
_NGRAM_FIELDS = (
    "max_depth",
    "min_match",
    "min_breadth",
    "max_breadth",
    "corpus",
    "order",
    "matcher",
)
#: Options of ``generate`` that only some algorithms read: destination -> (the flag, the
#: algorithms that read it). Given with any other algorithm, they are an error, not ignored.
_CHAIN = SPECULATIVE - BLOCK
_ALGORITHM_OPTIONS: dict[str, tuple[str, frozenset[str]]] = {
    "draft": ("--draft", SPECULATIVE),
    "num_steps": ("--num-steps", _CHAIN),
    "topk": ("--topk", _CHAIN),
    "num_draft_tokens": ("--num-draft-tokens", _CHAIN | {"ngram"}),
    "sample_drafts": ("--sample-drafts", SPECULATIVE),
    "grammar_drafts": ("--grammar-drafts", SPECULATIVE),
    "adaptive_steps": ("--adaptive-steps", ADAPTIVE),
    "adaptive_margin": ("--adaptive-margin", ADAPTIVE),
    "chain_hidden": ("--no-chain-hidden", frozenset({"multi_layer_eagle"})),
    "block_size": ("--block-size", BLOCK),
    "verify_budget": ("--verify-budget", BLOCK),
    "cost_table": ("--cost-table", BLOCK),
    "min_verify": ("--min-verify", BLOCK),
    "packed_verify": ("--padded-verify", BLOCK),
    "decode_steps": ("--decode-steps", frozenset({"plain"})),
    **{
        f"ngram_{f}": (f"--ngram-{f.replace('_', '-')}", frozenset({"ngram"}))
        for f in (*_NGRAM_FIELDS, "store_tokens")
    },
    "draft_tp": ("--draft-tp", SPECULATIVE),
    "compare_plain": ("--compare-plain", frozenset(ALGORITHMS) - {"plain"}),
    "passes": ("--passes", frozenset(ALGORITHMS) - {"plain"}),
}


def _check_generate_options(args: argparse.Namespace) -> None:
    """Refuse ``generate``'s output options without what they apply to."""
    if args.output is not None and args.prompts_file is None:
        raise ValueError("--output writes --prompts-file's results: add --prompts-file FILE")
    if args.compare_plain and args.prompts_file is not None:
        raise ValueError("--compare-plain times one prompt: use --prompt or --prompt-ids")
    if args.compare_plain and args.n > 1:
        raise ValueError("--compare-plain times one completion: drop --n")
    if args.passes is not None and not args.compare_plain:
        raise ValueError("--passes counts --compare-plain's timed passes: add --compare-plain")


def _chosen_algorithm(args: argparse.Namespace) -> str:
    """The algorithm the command decodes with: ``--algorithm``, else the kind of the
    ``--draft`` folder (said on stderr), else eagle3 on the bundled model and plain on
    ``--model``. Raises ``ValueError`` for an option that algorithm does not read."""
    algorithm = args.algorithm
    if algorithm is None and args.draft is not None:
        algorithm = draft_algorithm(args.draft)
        if distributed.is_leader():
            print(
                f"speculum: decoding with --algorithm {algorithm}, the kind of the draft in "
                f"{args.draft}",
                file=sys.stderr,
            )
    if algorithm is None:
        algorithm = DEFAULT_ALGORITHM if args.model is None else "plain"
    for dest, (flag, readers) in _ALGORITHM_OPTIONS.items():
        if getattr(args, dest, None) is None or algorithm in readers:  # None: not given
            continue
        why = (
            "plain decoding drafts nothing (with --model, speculation needs --draft DIR or "
            "--algorithm NAME)"
            if algorithm == "plain"
            else f"only {', '.join(sorted(readers))} read it"
        )
        hint = "; sampling's top-k is --top-k" if dest == "topk" else ""
        raise ValueError(f"{flag} has no effect with --algorithm {algorithm}: {why}{hint}")
    return algorithm


def _generate_call(args: argparse.Namespace, algorithm: str) -> tuple[list, dict]:
    """The prompts and the keyword arguments of the command's ``generate`` call with
    ``algorithm`` (options that ``algorithm`` does not read left out)."""
    if args.prompts_file is not None:
        prompts = _read_prompts(args.prompts_file)
    else:
        prompts = [args.prompt] if args.prompt is not None else [args.prompt_ids]
    return prompts, dict(
        **_engine_options(args, algorithm),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        logit_bias=args.logit_bias,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        json_schema=args.json_schema,
        regex=args.regex,
        grammar=args.grammar,
        n=args.n,
        stop_strings=tuple(args.stop or ()),
        include_stop_str_in_output=args.include_stop_str_in_output,
        ignore_eos=args.ignore_eos,
    )


def resolved_device(name: str) -> str:
    """``--device``'s value as the engine takes it: ``"auto"`` is ``"cuda"`` when torch sees a
    GPU, else ``"cpu"`` (as vLLM and SGLang pick the accelerator without being told); ``"cpu"``
    and ``"cuda"`` stay as given."""
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def _engine_options(args: argparse.Namespace, algorithm: str) -> dict[str, object]:
    """The keyword arguments of ``generate`` that build the engine, from the command's flags
    (:data:`_ENGINE_DESTS` and the drafting options ``algorithm`` reads)."""
    options = {
        dest: getattr(args, dest)
        for dest, (_, readers) in _ALGORITHM_OPTIONS.items()
        if algorithm in readers
        and dest not in ("compare_plain", "passes")
        and not dest.startswith("ngram_")
        and getattr(args, dest) is not None
    }
    ngram = {f: getattr(args, f"ngram_{f}") for f in (*_NGRAM_FIELDS, "store_tokens")}
    return dict(
        model=args.model,
        algorithm=algorithm,
        ngram=NgramOptions(**{k: v for k, v in ngram.items() if v is not None}),
        max_context=args.max_context,
        max_batch=args.max_batch,
        page_size=args.page_size,
        device=resolved_device(args.device),
        dtype=args.dtype,
        cuda_graphs=args.cuda_graphs,
        compile_stages=args.compile_stages,
        mla_kernel=args.mla_kernel,
        half_gemv=args.half_gemv,
        overlap=args.overlap,
        prefix_cache=args.prefix_cache,
        tp=args.tp or int(os.environ.get("WORLD_SIZE", "1")),
        **options,
    )


def _comparison(comparison: Comparison) -> dict[str, float | bool | list[float]]:
    """The median pass's tokens per second, speedup and acceptance length, every pass's
    speedup, and whether speculation emitted plain decoding's tokens."""
    (result,), (plain,) = comparison.speculative, comparison.plain
    return {
        "tokens_per_second": result.stats["tokens_per_second"],
        "plain_tokens_per_second": plain.stats["tokens_per_second"],
        "speedup": comparison.speedup,
        "speedups": list(comparison.speedups),
        "accept_length_mean": result.stats["accept_length_mean"],
        "same_tokens": result.token_ids == plain.token_ids,
    }


#: What the training commands report as ``speculum: error: ...`` (status 2) rather than a
#: traceback: bad options, missing or unreadable folders and files, numerical blow-ups.
_TRAINING_ERRORS = (ValueError, RuntimeError, KeyError, MemoryError, OSError)


def _print_metrics(metrics: dict[str, object]) -> None:
    """One ``key=value, ...`` line on stdout."""
    print(_stats_line(metrics))


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
