"""Issue 6's zoo: every speculative algorithm on one trained target, against transformers.

One run trains, with a fixed seed, a ``small`` target (``train_target``: as many steps of 64
windows of 512 tokens as fit ``--target-seconds``, measured by a short calibration run, unless
``--target-steps`` fixes them) on a sample of the interpreter's installed ``.py`` files, then
its drafts (``train_draft``: eagle, eagle3, mtp, multi_layer_eagle, standalone, dflash, dspark;
as many steps as fit ``--draft-seconds`` each unless ``--draft-steps``). n-gram drafting needs
no training.

Then, on 64 held-out prompts (the first 128 tokens of held-out files of the target's own
corpus split), 256 new tokens each, EOS ignored, greedy and at temperature 0.7, for plain
decoding, eagle, eagle3 (a chain and a 16-node tree), mtp, multi_layer_eagle, standalone and
ngram (chains of ``--num-steps`` drafts), and the block drafters dflash and dspark (blocks of
their trained size, 7 draft tokens each):

- acceptance length: tokens emitted per verify round, bonus token included, over every round of
  the largest-batch run (all prompts);
- tokens/s at batch 1 (the first 8 prompts, one at a time: an engine of ``max_batch`` 1) and at
  batch 16 (all prompts, an engine of ``max_batch`` 16), end to end (prefill included), after a
  warm-up on random prompts that captures the CUDA graphs; one engine per method and batch size
  serves both temperatures, restored to its fresh state before each run, so the n-gram store
  never holds an earlier run's continuations of the same prompts;
- speedup: tokens/s over plain decoding's at the same batch and temperature.

Peers, measured first, on the same weights, greedy, batch 1, the first ``--peer-prompts`` (4)
prompts: transformers'
``generate`` (``LlamaForCausalLM.from_pretrained`` of the target folder), assisted generation
with the standalone draft as ``assistant_model``, and prompt lookup decoding
(``prompt_lookup_num_tokens=10``); tokens/s and speedup over transformers' plain ``generate``
and over speculum's best method at batch 1, greedy. A peer that fails is reported, not fatal.
Everything computes in float32, with TF32 matmuls on CUDA.

Run on one GPU, training included, in about 10 minutes:
``python benchmarks/zoo.py --out results/zoo`` (``--work DIR`` keeps the trained models, and a
rerun with the same ``--work`` reuses them; ``--tiny`` is a CPU smoke run of the script itself,
whose numbers mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode.py, which adds the checkout

from decode import sync, table  # noqa: E402

from speculum.models.loading import load_model  # noqa: E402
from speculum.runtime import scheduler  # noqa: E402
from speculum.runtime.engine import SpecOptions, engine_from_model  # noqa: E402
from speculum.runtime.generate import Generation, acceptance_stats, generate  # noqa: E402
from speculum.training.data import heldout_windows, load_split  # noqa: E402
from speculum.training.draft import TREE, train_draft  # noqa: E402
from speculum.training.recipes import recipe  # noqa: E402
from speculum.training.target import train_target  # noqa: E402

#: Drafts trained, in the order they are trained and reported.
DRAFTS = ("eagle", "eagle3", "mtp", "multi_layer_eagle", "standalone", "dflash", "dspark")
#: Updates of the calibration run that times a training step before the budgeted run.
CALIBRATION_STEPS = 30

#: What ``--tiny`` replaces: a CPU run of the whole script in a few minutes.
TINY = {
    "size": "test",
    "max_bytes": 300_000,
    "vocab_size": 1024,
    "target_seconds": 15.0,
    "target_batch_size": 8,
    "target_length": 65,
    "draft_seconds": 5.0,
    "draft_batch_size": 8,
    "draft_length": 64,
    "prompts": 4,
    "prompt_tokens": 32,
    "new_tokens": 16,
    "batches": "1,2",
    "sequential_prompts": 4,
    "peer_prompts": 2,
}


def budgeted_steps(train: Callable[[int], float], seconds: float) -> int:
    """Updates that fit ``seconds``: ``train(steps)`` runs a calibration training and returns
    the time of one update (``TrainResult.step_seconds``: start-up, evaluations and saving
    left out, which a short run would otherwise charge to its few updates; on the H200 that
    once made a 150 s budget train for 27 s)."""
    return max(CALIBRATION_STEPS, int(seconds / train(CALIBRATION_STEPS)))


def train_zoo_target(args, work: Path, device: str) -> dict[str, Any]:
    """Train the target into ``work/target`` (reused if already there); its training record."""
    out = work / "target"
    if not (out / "config.json").is_file():
        options = dict(
            size=args.size,
            corpus_dir=work / "corpus",
            max_bytes=args.max_bytes,
            vocab_size=args.vocab_size,
            batch_size=args.target_batch_size,
            length=args.target_length,
            device=device,
            seed=args.seed,
        )

        def calibrate(steps: int) -> float:
            trial = work / "calibration" / "target"
            per_step = train_target(trial, steps=steps, progress=False, **options).step_seconds
            shutil.rmtree(trial)
            return per_step

        steps = args.target_steps or budgeted_steps(calibrate, args.target_seconds)
        train_target(out, steps=steps, **options)
    record = json.loads((out / "training.json").read_text())
    return {
        "model": f"target ({record['size']})",
        "steps": record["steps"],
        "train s": record["seconds"],
        "held-out loss": record["heldout_loss"],
        "held-out accuracy": record["heldout_metrics"]["accuracy"],
    }


def train_zoo_draft(args, work: Path, algorithm: str, device: str) -> dict[str, Any]:
    """Train ``algorithm``'s draft into ``work/ALGORITHM`` (reused if already there); its
    training record, with the acceptance length ``train_draft`` measured."""
    out = work / algorithm
    if not (out / "training.json").is_file():
        options = dict(
            target_dir=work / "target",
            algorithm=algorithm,
            batch_size=args.draft_batch_size,
            length=args.draft_length,
            device=device,
            seed=args.seed,
            num_steps=args.num_steps,
        )

        def calibrate(steps: int) -> float:
            trial = work / "calibration" / algorithm
            metrics = train_draft(out_dir=trial, steps=steps, progress=False, **options)
            shutil.rmtree(trial)
            return metrics["step_seconds"]

        steps = args.draft_steps or budgeted_steps(calibrate, args.draft_seconds)
        train_draft(out_dir=out, steps=steps, **options)
    record = json.loads((out / "training.json").read_text())
    metrics = record["metrics"]
    return {
        "model": algorithm,
        "steps": record["options"]["steps"],
        "train s": metrics["train_seconds"],
        "held-out loss": metrics["heldout_loss"],
        "acceptance (train_draft)": metrics["acceptance_length"],
    }


def heldout_prompts(target_dir: Path, bos: int | None, count: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of the first ``count`` held-out files at least that long
    (documents start with ``bos``); when there are too few, non-overlapping windows from the
    start of the held-out tokens instead."""
    heldout = load_split(target_dir / "corpus").heldout
    starts = np.flatnonzero(heldout == bos)
    ends = np.append(starts[1:], len(heldout))
    starts = starts[ends - starts > length][:count]
    if len(starts) == count:
        return [heldout[s : s + length].tolist() for s in starts]
    print(
        f"only {len(starts)} held-out files hold {length} tokens; using windows instead",
        file=sys.stderr,
    )
    return heldout_windows(heldout, count, length, 1)[0].tolist()


def methods(args) -> list[tuple[str, str, SpecOptions | None]]:
    """(label, algorithm, round shape) of every speculum method measured."""
    chain = SpecOptions(num_steps=args.num_steps)
    return [
        ("plain", "plain", None),
        ("eagle", "eagle", chain),
        ("eagle3 chain", "eagle3", chain),
        ("eagle3 tree", "eagle3", TREE),
        ("mtp", "mtp", chain),
        ("multi_layer_eagle", "multi_layer_eagle", chain),
        ("standalone", "standalone", chain),
        ("ngram", "ngram", None),
        # Block drafters at their trained block size (DFLASH 8: 7 draft tokens; DSPARK 7: 7),
        # every draft token verified.
        ("dflash", "dflash", SpecOptions()),
        ("dspark", "dspark", SpecOptions()),
    ]


def warmed_engine(target, draft, algorithm, spec, prompt_len: int, batch: int, args):
    """An engine of ``max_batch`` ``batch`` for ``prompt_len``-token prompts, warmed up on
    ``batch`` random prompts at every measured temperature (capturing its decoding graphs and
    compiling the sampling kernels), then put back to its fresh state."""
    engine = engine_from_model(
        target,
        algorithm=algorithm,
        draft=draft,
        spec=spec,
        max_batch=batch,
        max_context=prompt_len + args.new_tokens + 1,
        graph_buckets=(batch,),
    )
    fresh = scheduler.take_snapshot(engine, scheduler.new_state(engine))
    generator = torch.Generator().manual_seed(args.seed)
    warm = torch.randint(0, target.config.vocab_size, (batch, prompt_len), generator=generator)
    for temperature in args.temperature_list:
        generate(warm.tolist(), engine=engine, max_new_tokens=8, temperature=temperature)
    scheduler.restore(engine, fresh)
    sync(engine.device.type)
    return engine, fresh


def acceptance_length(results: list[Generation]) -> float:
    """Tokens per verify round, bonus included, over every round of ``results``."""
    histograms = [r.stats["accept_length_histogram"] for r in results]
    total = [sum(c) for c in itertools.zip_longest(*histograms, fillvalue=0)]
    return float(acceptance_stats(total)["accept_length_mean"])


def method_rows(target, draft, method, prompts, args) -> list[dict[str, Any]]:
    """One method's row per temperature: acceptance length and tokens/s at every batch size
    (batch 1 over the first ``--sequential-prompts`` prompts, larger batches over all of
    them). One engine per batch size serves every temperature, restored to its fresh state
    before each run (``scheduler.restore``: no n-gram store holds an earlier run's
    continuations of the same prompts)."""
    label, algorithm, spec = method
    rows = [{"method": label, "temperature": t} for t in args.temperature_list]
    for batch in args.batch_sizes:
        chosen = prompts[: args.sequential_prompts] if batch == 1 else prompts
        engine, fresh = warmed_engine(target, draft, algorithm, spec, len(chosen[0]), batch, args)
        for row in rows:
            scheduler.restore(engine, fresh)
            results = generate(
                chosen,
                engine=engine,
                max_new_tokens=args.new_tokens,
                temperature=row["temperature"],
                seed=args.seed,
                ignore_eos=True,
            )
            row["accept length"] = acceptance_length(results)  # the largest batch's, last
            row[f"tok/s b{batch}"] = float(results[0].stats["tokens_per_second"])
    return rows


def add_speedups(rows: list[dict[str, Any]], batches: list[int]) -> None:
    """Each row's tokens/s over plain decoding's at the same batch and temperature."""
    plain = {r["temperature"]: r for r in rows if r["method"] == "plain"}
    for row in rows:
        for batch in batches:
            base = plain[row["temperature"]][f"tok/s b{batch}"]
            row[f"speedup b{batch}"] = row[f"tok/s b{batch}"] / base


def hf_tokens_per_second(model, prompts: list[list[int]], args, device: str, **options) -> float:
    """transformers' greedy ``generate`` of ``--new-tokens`` per prompt, one prompt at a time
    (after a short warm-up), in generated tokens per second."""

    def run(prompt: list[int], new_tokens: int) -> int:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
            **options,
        )
        return out.shape[1] - ids.shape[1]

    run(prompts[0], 8)
    sync(device)
    begin = time.perf_counter()
    tokens = sum(run(p, args.new_tokens) for p in prompts)
    sync(device)
    return tokens / (time.perf_counter() - begin)


def peer_rows(work: Path, prompts: list[list[int]], args, device: str) -> list[dict[str, Any]]:
    """transformers' plain, assisted (standalone draft) and prompt-lookup generation, greedy,
    batch 1; a peer that fails gets its error in the row instead of numbers."""
    rows: list[dict[str, Any]] = []

    def hf(folder: Path):
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(folder).to(device).eval()

    peers = {
        "transformers plain": dict,
        "transformers assisted (standalone)": lambda: {"assistant_model": hf(work / "standalone")},
        "transformers prompt lookup": lambda: {"prompt_lookup_num_tokens": 10},
    }
    for name, options in peers.items():
        row: dict[str, Any] = {"method": name}
        try:
            model = hf(work / "target")
            row["tok/s b1"] = hf_tokens_per_second(model, prompts, args, device, **options())
        except Exception as error:  # the peer's failure must not lose the rest of the run
            row["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        rows.append(row)
        print(table([row]), flush=True)
    plain = rows[0].get("tok/s b1", float("nan"))
    for row in rows:
        if "tok/s b1" in row:
            row["vs transformers plain"] = row["tok/s b1"] / plain
    return rows


def compare_peers(peers: list[dict[str, Any]], greedy: list[dict[str, Any]]) -> None:
    """Each peer's tokens/s over speculum's best greedy method at batch 1, in place."""
    best = max(greedy, key=lambda r: r["tok/s b1"])
    for row in peers:
        if "tok/s b1" in row:
            row[f"vs speculum {best['method']}"] = row["tok/s b1"] / best["tok/s b1"]


def header(device: str) -> str:
    """The command line, device, torch version and date of this run."""
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    command = shlex.join(["python", *sys.argv])
    return f"`{command}` on {name}, torch {torch.__version__}, {datetime.date.today()}"


def parse_args() -> argparse.Namespace:
    """The command line (``--tiny`` replaces the sizes by :data:`TINY`'s)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--tiny", action="store_true", help="CPU smoke run of the script (numbers mean nothing)")
    add("--work", type=Path, help="folder for the trained models (default: a temporary one)")
    add("--out", type=Path, help="write tables.md and results.json here")
    add("--seed", type=int, default=0)
    add("--size", default="small", help="target preset")
    add("--max-bytes", type=int, default=32_000_000, help="corpus sample")
    add("--vocab-size", type=int, default=8192)
    add("--target-seconds", type=float, default=120.0, help="target training budget")
    add("--target-steps", type=int, help="fixed target steps instead of the budget")
    add("--target-batch-size", type=int, default=64)
    add("--target-length", type=int, default=512)
    add("--draft-seconds", type=float, default=12.0, help="training budget of each draft")
    add("--draft-steps", type=int, help="fixed steps of each draft instead of the budget")
    add("--draft-batch-size", type=int, default=32)
    add("--draft-length", type=int, default=512)
    add("--num-steps", type=int, default=3, help="draft depth (chains and training)")
    add("--prompts", type=int, default=64)
    add("--prompt-tokens", type=int, default=128)
    add("--new-tokens", type=int, default=256)
    add("--batches", default="1,16", help="batch sizes, comma-separated")
    add("--sequential-prompts", type=int, default=8, help="prompts measured at batch 1")
    add("--peer-prompts", type=int, default=4, help="prompts the transformers peers continue")
    add("--temperatures", default="0,0.7")
    add("--no-peer", action="store_true", help="skip transformers")
    args = parser.parse_args()
    if args.tiny:
        vars(args).update(TINY)
    args.batch_sizes = [int(b) for b in args.batches.split(",")]
    args.temperature_list = [float(t) for t in args.temperatures.split(",")]
    return args


def save(out: Path | None, title: str, sections: dict[str, list[dict[str, Any]]]) -> str:
    """The Markdown report of ``sections``, also written with a JSON of every number to
    ``out`` when given."""
    report = "\n\n".join(f"## {name}\n\n{table(rows)}" for name, rows in sections.items())
    report = f"{title}\n\n{report}\n"
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "tables.md").write_text(report)
        (out / "results.json").write_text(json.dumps({"header": title, **sections}, indent=1))
    return report


def main() -> None:
    """Train the zoo, measure it and its peers, and print the tables."""
    args = parse_args()
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda":
        torch.set_float32_matmul_precision("high")
    title = header(device)
    print(title, flush=True)
    begin = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - begin

    work = args.work or Path(tempfile.mkdtemp(prefix="speculum-zoo-"))
    training = [train_zoo_target(args, work, device)]
    training += [train_zoo_draft(args, work, name, device) for name in DRAFTS]
    sections = {"training": training}
    print(table(training), f"({elapsed():.0f} s)", flush=True)
    save(args.out, title, sections)

    target = load_model(work / "target", device=device).eval().requires_grad_(False)
    drafts = {name: recipe(name).load(work / name, target) for name in DRAFTS}
    prompts = heldout_prompts(
        work / "target", target.config.bos_token_id, args.prompts, args.prompt_tokens
    )
    # The peers first: a run cut short by its time limit still compares them with the
    # speculum rows measured by then.
    if not args.no_peer:
        peers = peer_rows(work, prompts[: args.peer_prompts], args, device)
        sections["transformers, greedy, batch 1"] = peers
        save(args.out, title, sections)
    rows: dict[float, list[dict[str, Any]]] = {t: [] for t in args.temperature_list}
    for method in methods(args):
        for row in method_rows(target, drafts.get(method[1]), method, prompts, args):
            rows[row["temperature"]].append(row)
            print(table([row]), f"({elapsed():.0f} s)", flush=True)
        for temperature, done in rows.items():
            add_speedups(done, args.batch_sizes)
            sections[f"speculum, temperature {temperature:g}"] = done
        save(args.out, title, sections)
    if not args.no_peer:
        compare_peers(sections["transformers, greedy, batch 1"], rows[0.0])
    print("\n" + save(args.out, title, sections))
    print(f"models in {work}")


if __name__ == "__main__":
    main()
