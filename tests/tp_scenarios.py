"""Tensor-parallel scenarios: tiny checkpoints of every pipeline's models, the runs that
tests/cover/test_tensor_parallel.py (CPU) and tests/gpu/test_tensor_parallel_cuda.py compare
between one process and two, and the worker that torchrun starts for the two-process side.

``torchrun --nproc-per-node 2 tests/tp_scenarios.py FOLDERS_JSON OUT_DIR`` runs every scenario
sharded over the two ranks (gloo), then the CLI, and writes each rank's results to
``OUT_DIR/rank{r}.pt``; ``... OUT_DIR cuda DTYPE`` runs the scenarios alone, over NCCL with
CUDA graphs, in ``DTYPE``, on :data:`MANY_PROMPTS`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import torch
from conftest import tiny_config
from heads import agreeing_head, markov_target

from speculum.models.block_draft import random_block_draft, save_block_draft
from speculum.models.decoder import dense_batch
from speculum.models.draft import random_draft
from speculum.models.draft_loading import save_draft
from speculum.models.frozen_kv import random_frozen_kv, save_frozen_kv
from speculum.models.loading import load_model, random_model, save_model
from speculum.models.multi_layer_eagle import random_multi_layer, save_multi_layer
from speculum.runtime import cli, distributed
from speculum.runtime.engine import SpecOptions, build_engine
from speculum.runtime.generate import generate
from speculum.state.parallel import TensorParallel

VOCAB = 48
#: A target whose every split is a special case: a vocabulary that two ranks split unevenly,
#: one K/V head (replicated on both ranks), biases on every projection, tied embeddings.
ODD = tiny_config(
    vocab_size=61,
    num_kv_heads=1,
    tie_word_embeddings=True,
    qkv_bias=True,
    o_bias=True,
    mlp_bias=True,
)
PROMPTS = [[1, 2, 3], [7, 7, 7, 7, 2, 9, 7, 7, 7], list(range(10, 22))]
NEW_TOKENS = 10
#: The GPU runs' prompts: enough tokens to measure a bf16 match rate.
MANY_PROMPTS = [[(13 * i + 5 * j) % VOCAB for j in range(2 + i % 9)] for i in range(64)]
#: Small pages and a small prefill budget: trees cross page boundaries, prompts are chunked.
LIMITS = {"page_size": 4, "max_context": 96, "max_batch": 4, "prefill_budget": 8}


@attrs.define(frozen=True)
class Scenario:
    """One generate run: the target and draft checkpoints (names in the folder map), the
    pipeline, its round shape, sampling settings and whether the draft is replicated."""

    model: str
    algorithm: str
    draft: str | None = None
    spec: SpecOptions = SpecOptions()
    sampling: dict[str, Any] = attrs.field(factory=dict)
    draft_tp: int | None = None


SAMPLED = {"temperature": 0.9, "top_p": 0.9, "seed": 5}
SCENARIOS = {
    "plain": Scenario("odd", "plain"),
    "plain sampled": Scenario("odd", "plain", sampling=SAMPLED),
    "ngram": Scenario("odd", "ngram", spec=SpecOptions(num_draft_tokens=6)),
    "eagle chain": Scenario("markov", "eagle", "eagle"),
    "eagle tree": Scenario(
        "markov", "eagle", "eagle", SpecOptions(num_steps=3, topk=2, num_draft_tokens=6)
    ),
    "eagle3 replicated draft": Scenario("markov", "eagle3", "eagle3", draft_tp=1),
    "eagle3 sampled drafts": Scenario(
        "markov",
        "eagle3",
        "eagle3",
        SpecOptions(num_steps=2, topk=2, sample_drafts=True),
        sampling={"temperature": 0.8, "seed": 11},
    ),
    "mtp replicated draft": Scenario("markov", "mtp", "mtp", SpecOptions(num_steps=2), draft_tp=1),
    "standalone tree": Scenario(
        "markov",
        "standalone",
        "standalone",
        SpecOptions(num_steps=2, topk=2, num_draft_tokens=4),
    ),
    "multi_layer_eagle": Scenario(
        "markov", "multi_layer_eagle", "multi_layer", SpecOptions(num_steps=2)
    ),
    "frozen_kv_mtp": Scenario("markov", "frozen_kv_mtp", "frozen_kv", SpecOptions(num_steps=2)),
    "dflash": Scenario("markov", "dflash", "dflash"),
    "dspark sampled, ragged": Scenario(
        "markov", "dspark", "dspark", SpecOptions(verify_budget=3), sampling=SAMPLED
    ),
}


def odd_model():
    """The :data:`ODD` target with random (non-zero) biases."""
    model = random_model(ODD, seed=1, std=0.3)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1, generator=generator)
    return model


def write_checkpoints(root: Path) -> dict[str, str]:
    """Every scenario's checkpoints under ``root``; returns name -> folder."""
    markov = markov_target(VOCAB)
    eagle3 = random_draft(markov, "eagle3", seed=6, std=0.3, draft_vocab_size=VOCAB // 2)
    eagle3.set_target_ids(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:24])
    small = random_model(tiny_config(vocab_size=VOCAB, num_layers=1, hidden_size=16), seed=8)
    writers = {
        "odd": lambda f: save_model(odd_model(), f),
        "markov": lambda f: save_model(markov, f),
        "eagle": lambda f: save_draft(agreeing_head(markov, "eagle"), f, "sglang-eagle"),
        "eagle3": lambda f: save_draft(eagle3, f, "sglang-eagle3"),
        "mtp": lambda f: save_draft(agreeing_head(markov, "mtp"), f, "mtp"),
        "standalone": lambda f: save_model(small, f),
        "multi_layer": lambda f: save_multi_layer(random_multi_layer(markov, 2, seed=9), f),
        "frozen_kv": lambda f: save_frozen_kv(random_frozen_kv(markov, seed=10, std=0.3), f),
        "dflash": lambda f: save_block_draft(
            random_block_draft(markov, "dflash", seed=12, std=0.3, block_size=4), f
        ),
        "dspark": lambda f: save_block_draft(
            random_block_draft(markov, "dspark", seed=13, std=0.3, block_size=4), f
        ),
    }
    return {name: str(write(root / name)) for name, write in writers.items()}


def run(
    scenario: Scenario,
    folders: dict[str, str],
    tp: TensorParallel,
    device: str = "cpu",
    dtype: str | None = None,
    prompts: list[list[int]] = PROMPTS,
) -> list[tuple[int, ...]]:
    """The scenario's generated tokens per prompt, on a model sharded over ``tp``."""
    engine = build_engine(
        folders[scenario.model],
        algorithm=scenario.algorithm,
        draft=folders[scenario.draft] if scenario.draft else None,
        spec=scenario.spec,
        device=device,
        dtype=dtype,
        tp=tp,
        draft_tp=scenario.draft_tp,
        **LIMITS,
    )
    results = generate(prompts, engine=engine, max_new_tokens=NEW_TOKENS, **scenario.sampling)
    return [r.token_ids for r in results]


def odd_logits(folder: str, tp: TensorParallel) -> torch.Tensor:
    """The :data:`ODD` target's float32 logits over a cache-free forward of two prompts."""
    model = load_model(folder, tp=tp)
    hidden, _ = model(dense_batch(torch.tensor([[3, 60, 1, 31, 30], [59, 0, 44, 12, 5]])), None)
    return model.logits(hidden)


def cli_run(folder: str, prompt_ids: str) -> tuple[int, str, str]:
    """``speculum generate --json`` on this rank: exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["generate", "--model", folder, "--prompt-ids", prompt_ids, "--json"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main([*argv, "--max-new-tokens", "6"])
    return status, out.getvalue(), err.getvalue()


def start_ranks(folders: dict[str, str], out_dir: Path, *options: str) -> subprocess.Popen:
    """Start :func:`main` on two ranks under torchrun (``options``: device and dtype), with
    this checkout's speculum and test helpers importable."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    script = [__file__, json.dumps(folders), str(out_dir), *options]
    return subprocess.Popen(
        [*torchrun, "--nproc-per-node", "2", *script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rank_results(process: subprocess.Popen, out_dir: Path, timeout: float) -> list[dict]:
    """Wait for :func:`start_ranks`'s job; each rank's results (the job must succeed)."""
    _, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr[-4000:]
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


def main(folders_json: str, out_dir: str, device: str = "cpu", dtype: str | None = None) -> None:
    """One torchrun worker: every scenario on the group, then (on the CPU) the logits and the
    CLI, with a good request and a bad one; writes the results."""
    folders = json.loads(folders_json)
    tp = distributed.tensor_parallel(int(os.environ["WORLD_SIZE"]), device)
    prompts = PROMPTS if device == "cpu" else MANY_PROMPTS
    results: dict[str, Any] = {
        name: run(s, folders, tp, device, dtype, prompts) for name, s in SCENARIOS.items()
    }
    if device == "cpu":
        results["logits"] = odd_logits(folders["odd"], tp)
        results["cli"] = cli_run(folders["odd"], "4,5,6")
        results["cli error"] = cli_run(folders["odd"], f"4,{ODD.vocab_size}")
    torch.save(results, Path(out_dir) / f"rank{tp.rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
