"""What each request control costs a speculative round: milliseconds per scheduler step of a
full batch decoding, with the control on every request, against no control.

The target is shaped like Llama-3.1-8B with random bf16 weights and the draft like an EAGLE-3
head for it (``benchmarks/decode.py``'s models), given an EOS id (the vocabulary's last) and a
synthetic tokenizer over the whole vocabulary (``grammar_masks.vocabulary``: the 256 bytes and
random printable strings), so that structured output has realistic masks to compute. For each
round shape (``--rounds``, labels of ``decode.ROUNDS``) and batch size (``--batches``), one
engine per control, built with only the opt-in that control needs (as ``generate`` builds
them), decodes ``batch`` requests of ``--prompt`` random tokens:

- none: greedy, no control (the ratio's base);
- penalties: ``repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5``
  (an engine with ``penalties=True``);
- logprobs=5 (``max_logprobs=5``): each token's log-probability and 5 alternatives, unpacked
  on the host;
- logit_bias: 32 random ids biased (``logit_bias=True``);
- json_schema: ``grammar_masks``' schema (xgrammar masks, on the host, for every draft step
  and every tree node: on CUDA the round runs as graphs cut where it asks for them, each cut
  one read of the path tokens and one packed copy of the masks; ``num_steps + 1`` cuts);
- json_schema free: the same schema with free drafts (``SpecOptions.grammar_drafts="free"``:
  the grammar masks the target alone, so a round asks once, for the verified tree's nodes,
  and is cut once);
- min_tokens: ``min_tokens = max_new_tokens``, EOS not ignored (``penalties=True``);
- sampled: temperature 1, no filter; sampled top_p=0.9: the same with a top-p filter (a
  round marked as filtering, ``SamplingParams.filters``: its filtered rows take the sort).

A timed step is one scheduler step (the round, its one device-to-host copy, the host's
collection of its tokens) whose batch is full and has no prefill: the median over
``--measure`` such steps, after ``--warmup`` (graph capture), each between
``torch.cuda.synchronize()`` calls on CUDA. A request whose grammar ends is replaced by a new
one, and the steps that prefill it are not timed. ``x none`` is the ratio to the same row's
no-control time. Random weights make acceptance meaningless; the ``tokens/round`` column says
how many tokens the timed rounds emitted per request. ``masks ms`` is the host's part of a
json_schema round: the median over the timed steps of the time its grammar asks spent reading
path tokens and filling and copying the masks (``scheduler._bitmasks``, timed after a device
synchronize, so the wait for the round's device work so far is not counted).

Run on the GPU: ``python benchmarks/request_controls.py`` (``--tiny`` for a CPU smoke run of
the script itself, on shorter prompts and fewer steps, whose numbers mean nothing but the
``masks ms`` column's with ``--vocab 128256``: the host's mask work at the 8B's vocabulary);
``--controls none,json_schema,"json_schema free"`` measures those rows alone, none always
first: the ratio's base).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import LLAMA_8B, ROUNDS, TINY, build_models, sync, table  # noqa: E402
from grammar_masks import CASES, vocabulary  # noqa: E402

from speculum.models.tokenizer import EOS, Tokenizer, byte_level_tokenizer  # noqa: E402
from speculum.runtime import grammar, scheduler  # noqa: E402
from speculum.runtime.engine import Engine, SpecOptions, engine_from_model  # noqa: E402

#: Whether xgrammar is installed: without it the json_schema row is left out (say so).
GRAMMAR = importlib.util.find_spec("xgrammar") is not None
#: The engine options of a row that are ``SpecOptions`` fields, not ``engine_from_model``'s.
SPEC_OPTIONS = ("grammar_drafts",)
#: The penalties row's settings.
PENALTIES = {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5}


def controls(vocab: int, max_new_tokens: int) -> dict[str, tuple[dict, dict, bool]]:
    """Each measured control: the engine options it needs, its ``Sampling`` settings, and
    whether its requests ignore EOS (all but ``min_tokens``, which bans EOS itself)."""
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[:32].tolist()
    bias = {token: (-1.0) ** token * 5.0 for token in ids}
    measured = {
        "none": ({}, {}, True),
        "penalties": ({"penalties": True}, PENALTIES, True),
        "logprobs=5": ({"max_logprobs": 5}, {"logprobs": 5}, True),
        "logit_bias": ({"logit_bias": True}, {"logit_bias": bias}, True),
        "json_schema": ({}, {"json_schema": CASES["json_schema"][0]}, True),
        "json_schema free": (
            {"grammar_drafts": "free"},
            {"json_schema": CASES["json_schema"][0]},
            True,
        ),
        "min_tokens": ({"penalties": True}, {"min_tokens": max_new_tokens}, False),
        "sampled": ({}, {"temperature": 1.0, "seed": 0}, True),
        "sampled top_p=0.9": ({}, {"temperature": 1.0, "top_p": 0.9, "seed": 0}, True),
    }
    if GRAMMAR:
        return measured
    return {k: v for k, v in measured.items() if not k.startswith("json_schema")}


def synthetic_tokenizer(size: int) -> Tokenizer:
    """A byte-level tokenizer of ``size`` ids: the 256 bytes, then ``grammar_masks``' random
    printable strings, then EOS (``</s>``, the last id). It only decodes (the prompts are ids)."""
    names = {i: name for name, i in byte_level_tokenizer().get_vocab().items() if i < 256}
    words = vocabulary(size)[256:-1]  # printable ASCII: each byte is named by itself
    vocab = {names[i]: i for i in range(256)} | {w.decode(): 256 + i for i, w in enumerate(words)}
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([EOS])
    return Tokenizer(inner)


@contextlib.contextmanager
def timing_masks(device: str) -> Iterator[list[float]]:
    """Inside, each grammar ask (``scheduler._bitmasks``) appends its host milliseconds to
    the list yielded: timed after a device synchronize, so that the ask's read of the path
    tokens does not count the device work queued before it."""
    asks: list[float] = []
    bitmasks = scheduler._bitmasks

    def timed(*args: Any) -> Any:
        sync(device)
        begin = time.perf_counter()
        masks = bitmasks(*args)
        sync(device)
        asks.append(1e3 * (time.perf_counter() - begin))
        return masks

    scheduler._bitmasks = timed
    try:
        yield asks
    finally:
        scheduler._bitmasks = bitmasks


def timed_steps(
    engine: Engine, args: argparse.Namespace, batch: int, add: Callable[[Any], Any], device: str
) -> tuple[list[float], float, list[float]]:
    """Milliseconds of each timed step (a full batch decoding, no prefill), the tokens its
    rounds emitted per request, and the host milliseconds of each timed step's grammar asks
    (:func:`timing_masks`), over ``args.warmup`` untimed then ``args.measure`` timed steps;
    ``add(state)`` queues one more request."""
    state = scheduler.new_state(engine)
    times, emitted, seen, masks = [], 0, 0, []
    while len(times) < args.measure:
        while len(state.running) + len(state.prefilling) + len(state.waiting) < batch:
            state = add(state)
        full = len(state.running) == batch and not (state.waiting or state.prefilling)
        sync(device)
        with timing_masks(device) as asks:
            begin = time.perf_counter()
            state, outputs = scheduler.step(engine, state)
            sync(device)
            elapsed = time.perf_counter() - begin
        if full:
            seen += 1
            if seen > args.warmup:
                times.append(1e3 * elapsed)
                masks.append(sum(asks))
                emitted += sum(len(o.new_token_ids) for o in outputs)
    return times, emitted / (batch * args.measure), masks


def budget(args: argparse.Namespace, shape: tuple[int, int, int]) -> int:
    """``max_new_tokens`` of every request: more than its warm-up and timed rounds can emit
    (a round emits at most ``num_steps + 1`` tokens), so none ends by length while timed."""
    return (args.warmup + args.measure + 4) * (shape[0] + 1) + 8


def row(target, head, tokenizer, batch: int, label: str, shape, control, args, device) -> dict:
    """One control's median step time at ``batch`` for the round shape ``shape``."""
    options, settings, ignore_eos = control
    max_new = budget(args, shape)
    spec = {k: v for k, v in options.items() if k in SPEC_OPTIONS}
    engine = engine_from_model(
        target,
        algorithm=head.algorithm,
        draft=head,
        spec=SpecOptions(num_steps=shape[0], topk=shape[1], num_draft_tokens=shape[2], **spec),
        tokenizer=tokenizer,
        max_batch=batch,
        max_context=args.prompt + max_new + 64,
        prefill_budget=max(2048, args.prompt),
        graph_buckets=(batch,),
        cuda_graphs=device == "cuda",
        prefix_cache=False,  # every prompt is new anyway
        **{k: v for k, v in options.items() if k not in SPEC_OPTIONS},
    )
    sampling = scheduler.Sampling(**settings)
    generator = torch.Generator().manual_seed(batch)
    vocab = target.config.vocab_size

    def add(state):
        prompt = torch.randint(0, vocab, (args.prompt,), generator=generator).tolist()
        state, _ = scheduler.add_request(
            engine, state, prompt, sampling=sampling, max_new_tokens=max_new, ignore_eos=ignore_eos
        )
        return state

    times, tokens, masks = timed_steps(engine, args, batch, add, device)
    return {"round": label, "batch": batch, "ms/round": statistics.median(times),
            "masks ms": statistics.median(masks), "tokens/round": tokens}  # fmt: skip


def chosen(measured: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The rows of ``measured`` that ``--controls`` names (all without it), ``none`` first."""
    if args.controls is None:
        return measured
    names = ["none", *(n.strip() for n in args.controls.split(",") if n.strip() != "none")]
    unknown = [n for n in names if n not in measured]
    if unknown:
        raise SystemExit(f"--controls: unknown {unknown}; choose among {list(measured)}")
    return {n: measured[n] for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", default="chain 3,tree 8", help="labels of decode.ROUNDS")
    parser.add_argument(
        "--controls", default=None, help="the rows to measure, comma-separated (default: all)"
    )
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--measure", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny model")
    parser.add_argument(
        "--vocab", type=int, help="the --tiny model's vocabulary (128256 for the 8B's mask work)"
    )
    parser.add_argument(
        "--fill-threads",
        type=int,
        default=grammar.FILL_THREADS,
        help="grammar.FILL_THREADS (%(default)s; 0: half the CPUs the process may run on)",
    )
    args = parser.parse_args()
    if args.tiny:  # the smoke run checks the script, not the numbers: keep it short
        args.prompt, args.measure = min(args.prompt, 64), min(args.measure, 8)
        torch.set_num_threads(1)  # tiny matrices gain nothing from threads on a shared CPU
    device = "cpu" if args.tiny else "cuda"
    grammar.FILL_THREADS = args.fill_threads or None
    if args.vocab and not args.tiny:
        parser.error("--vocab sets the --tiny model's vocabulary; the GPU run's is the 8B's")
    config = attrs.evolve(TINY, vocab_size=args.vocab or TINY.vocab_size) if args.tiny else LLAMA_8B
    config = attrs.evolve(config, eos_token_ids=(config.vocab_size - 1,))
    target, head = build_models(config, device, torch.float32 if args.tiny else torch.bfloat16)
    tokenizer = synthetic_tokenizer(config.vocab_size)
    shapes = {label: shape for label, *shape in ROUNDS}
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        f"{name}; torch {torch.__version__}; {head.algorithm} draft; prompt {args.prompt}; "
        f"grammar fill threads {args.fill_threads or 'half the CPUs'}"
    )
    if not GRAMMAR:
        print("xgrammar is not installed: no json_schema rows (pip install xgrammar)")
    rows = []
    for label in args.rounds.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            base = None
            measured = chosen(controls(config.vocab_size, budget(args, shapes[label])), args)
            for control, spec in measured.items():
                r = {"control": control, **row(target, head, tokenizer, batch, label,
                                               shapes[label], spec, args, device)}  # fmt: skip
                base = base or r["ms/round"]
                r["x none"] = r["ms/round"] / base
                rows.append(r)
                print(table([r]), flush=True)
                if device == "cuda":
                    torch.cuda.empty_cache()
    print("\n## request controls, ms per round\n\n" + table(rows))


if __name__ == "__main__":
    main()
