"""Compiled against hand-written, stage by stage (``EngineConfig.compile_stages``).

Two tables, on ``benchmarks/decode.py``'s Llama-3.1-8B-shaped target (random bf16 weights) and
its EAGLE-3 head:

- kernels: each hand kernel a stage name can replace (``runtime.compiled.KERNEL_STAGES``),
  timed as the op (its Triton kernel) and as ``torch.compile`` of its reference math
  (``dynamic=False``, inductor without CUDA graphs), each captured in a CUDA graph of one call
  and replayed (median of device-event timings), at the shapes a decode step gives it
  (batch ``--batches``; hidden 4096, intermediate 14336, 32 heads of 128, a 128256 vocabulary).
- rounds: a whole decoding round (plain decoding, one step; an EAGLE-3 chain of 3; a tree of 8
  nodes) captured per bucket by the engine, for each ``compile_stages`` setting of
  :data:`SETTINGS` that ``--settings`` names: the replay of its graph (``replay ms``, the
  device's time) and the call from Python (``call ms``, with the copies into and out of the
  graph), each against the hand-written round (``compile_stages=()``) as ``/hand`` (below 1
  is faster); ``first call s`` is the first round's time, compilation and capture included.

A stage earns its place in the default where its row is faster in the rounds table: that is
where the compiled code sits among its neighbours, as it will run (``docs/gpu.md``, "Compiled
stages", records the choice and the numbers).

Run on the GPU: ``python benchmarks/compile_stages.py`` (``--batches 1,8``; ``--rounds plain``,
``--settings round,all`` and ``--layers 8`` narrow the rounds table, each setting compiling
a whole round per batch; ``--kernels-only`` skips it; ``--tiny`` for a CPU smoke run of the
script itself, whose numbers mean nothing: there rounds are compiled and padded, not captured,
and kernels are their references).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import LLAMA_8B, TINY, build_models, median_ms, running, stage_ms, table  # noqa: E402

from speculum.kernels import model_ops  # noqa: E402
from speculum.runtime.compiled import KERNEL_STAGES, ROUND  # noqa: E402
from speculum.runtime.engine import Engine, SpecOptions, engine_from_model  # noqa: E402
from speculum.spec import sampling  # noqa: E402

#: ``--settings`` names -> the ``compile_stages`` the rounds table compares with the
#: hand-written round (``hand``, always timed first).
SETTINGS: dict[str, tuple[str, ...]] = {
    "hand": (),
    ROUND: (ROUND,),
    **{f"{ROUND}+{stage}": (ROUND, stage) for stage in KERNEL_STAGES},
    "all": (ROUND, *KERNEL_STAGES),
}
#: (label, algorithm, spec options) of the rounds timed.
ROUNDS = (
    ("plain", "plain", SpecOptions(decode_steps=1)),
    ("chain 3", "eagle3", SpecOptions(num_steps=3)),
    ("tree 8", "eagle3", SpecOptions(num_steps=4, topk=4, num_draft_tokens=8)),
)


def kernel_inputs(
    batch: int, config: Any, device: str, dtype: torch.dtype
) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """stage/op label -> (the op, its arguments at a decode step's shapes)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, head_dim, vocab = config.num_heads, config.head_dim, config.vocab_size

    def rand(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=kind)

    logits = rand(batch, vocab, kind=torch.float32) * 4
    temperature = torch.ones(batch, device=device)
    top_k = torch.zeros(batch, dtype=torch.int64, device=device)
    top_p = torch.full((batch,), 0.9, device=device)
    min_p = torch.zeros(batch, device=device)
    probs = torch.softmax(logits, -1)
    seed = torch.arange(batch, device=device)
    counter = torch.arange(batch, device=device)[:, None] * 7
    return {
        "model_ops rms_norm": (model_ops.rms_norm, (rand(batch, hidden), rand(hidden), 1e-5)),
        "model_ops add_rms_norm": (
            model_ops.add_rms_norm,
            (rand(batch, hidden), rand(batch, hidden), rand(hidden), 1e-5),
        ),
        "model_ops rope": (
            model_ops.rope,
            (
                rand(batch, 1, heads, head_dim),
                torch.arange(batch, device=device)[:, None] + 500,
                torch.rand(head_dim // 2, device=device),
            ),
        ),
        "model_ops silu_mul": (model_ops.silu_mul, (rand(batch, inter), rand(batch, inter))),
        "sampling filtered_probs (top-p 0.9)": (
            sampling._filtered_probs_op,
            (logits, temperature, top_k, top_p, min_p),
        ),
        "sampling filtered_probs (greedy)": (
            sampling._filtered_probs_op,
            (logits, temperature * 0, top_k, top_p * 0 + 1, min_p),
        ),
        "sampling sample_from_probs": (
            sampling._sample_from_probs_op,
            (probs, torch.rand(batch, device=device)),
        ),
        "sampling counter_uniforms": (sampling.counter_uniforms, (seed, counter, 3, 4)),
    }


def compiled_reference(op: Any) -> Callable[..., Any]:
    """``torch.compile`` of ``op``'s reference math, as a compiled round traces it."""
    references = {o: r for stage in KERNEL_STAGES.values() for o, r in stage.items()}
    return torch.compile(
        references[op], dynamic=False, fullgraph=True, options={"triton.cudagraphs": False}
    )


def kernel_rows(config: Any, batches: list[int], device: str, repeat: int) -> list[dict]:
    """Each replaceable hand kernel against its compiled reference, per batch."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows = []
    for batch in batches:
        for label, (op, args) in kernel_inputs(batch, config, device, dtype).items():
            hand = stage_ms(op, args, device, repeat)
            try:
                compiled = stage_ms(compiled_reference(op), args, device, repeat)
            except torch._inductor.exc.InductorError as error:
                # torch 2.11's inductor fails on some (reference, shape) pairs: the row says so
                # and the table goes on (the hand kernel is kept there whatever the time).
                print(f"batch {batch}, {label}: compile failed: {str(error).splitlines()[0]}")
                compiled = float("nan")
            rows.append(
                {
                    "batch": batch,
                    "stage op": label,
                    "hand µs": hand * 1e3,
                    "compiled µs": compiled * 1e3,
                    "compiled/hand": compiled / hand,
                }
            )
    return rows


def round_engine(target, head, algorithm: str, spec: SpecOptions, batch: int, stages, args):
    """An engine of one bucket (``batch``) that compiles ``stages`` of its rounds."""
    return engine_from_model(
        target,
        algorithm=algorithm,
        draft=None if algorithm == "plain" else head,
        spec=spec,
        max_batch=batch,
        max_context=args.prompt + 256,
        prefill_budget=2048,
        graph_buckets=(batch,),
        compile_stages=stages,
    )


def round_times(engine: Engine, batch: int, args, device: str) -> tuple[float, float, float]:
    """(seconds to capture the first round, compilation included; device ms of a replay; ms of
    the call from Python), over ``batch`` decoding requests."""
    state = running(engine, batch, args.prompt, 64).batch
    decode, resources = engine.pipeline.decode, engine.resources
    begin = time.perf_counter()
    decode(resources, state)
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - begin
    call = median_ms(lambda: decode(resources, state), device, args.repeat)
    graphs = getattr(decode, "graphs", None)
    replay = median_ms(graphs[0][2].captured.graph.replay, device, args.repeat) if graphs else call
    return first, replay, call


def chosen_settings(names: str) -> list[tuple[str, ...]]:
    """The ``compile_stages`` of each ``--settings`` name, the hand-written round first."""
    unknown = sorted(set(names.split(",")) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {', '.join(SETTINGS)}")
    return [SETTINGS["hand"], *(SETTINGS[n] for n in names.split(",") if n != "hand")]


def round_rows(target, head, batches: list[int], args, device: str) -> list[dict]:
    """The rounds of :data:`ROUNDS` that ``args.rounds`` names at each batch, for each
    setting ``args.settings`` names."""
    rows = []
    for batch in batches:
        for label, algorithm, spec in (r for r in ROUNDS if r[0] in args.rounds.split(",")):
            hand = None
            for stages in chosen_settings(args.settings):
                torch._dynamo.reset()  # each setting compiles afresh, as a new engine would
                engine = round_engine(target, head, algorithm, spec, batch, stages, args)
                first, replay, call = round_times(engine, batch, args, device)
                hand = hand or (replay, call)
                rows.append(
                    {
                        "batch": batch,
                        "round": label,
                        "compile_stages": "+".join(stages) or "(hand)",
                        "replay ms": replay,
                        "/hand": replay / hand[0],
                        "call ms": call,
                        "call /hand": call / hand[1],
                        "first call s": first,
                    }
                )
                print(table(rows[-1:]), flush=True)
    return rows


def main() -> None:
    """Print the kernels table, then the rounds table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny model")
    parser.add_argument("--kernels-only", action="store_true", help="skip the rounds table")
    parser.add_argument(
        "--rounds", default=",".join(r[0] for r in ROUNDS), help="rounds to time (%(default)s)"
    )
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help="compile_stages settings to time against the hand-written round (%(default)s)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="target layers in the rounds table (default: the 8B shape's 32); fewer compile "
        "faster, and weigh the per-round stages (sampling, tree) more against per-layer ones",
    )
    args = parser.parse_args()
    chosen_settings(args.settings)  # refused before anything is measured
    device = "cpu" if args.tiny else "cuda"
    config = TINY if args.tiny else LLAMA_8B
    if args.tiny:
        args.prompt, args.repeat = min(args.prompt, 16), min(args.repeat, 3)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    kernels = kernel_rows(config, batches, device, args.repeat)
    print("\n## hand kernels against compiled references, µs per call\n\n" + table(kernels))
    if args.kernels_only:
        return
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.layers:
        config = attrs.evolve(config, num_layers=args.layers)
    target, head = build_models(config, device, dtype)
    rounds = round_rows(target, head, batches, args, device)
    print("\n## decoding rounds by compile_stages, ms per round\n\n" + table(rounds))


if __name__ == "__main__":
    main()
