"""Tensor parallelism on the CPU (gloo): every pipeline sharded over two processes emits, on
both ranks, the tokens of one process, greedy and sampled; sharded layers hold the right slices
of the full weights and read only those from the checkpoint; impossible splits fail clearly."""

from __future__ import annotations

import copy
import json
import os
import queue
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from tp_scenarios import (
    NEW_TOKENS,
    ODD,
    SCENARIOS,
    odd_logits,
    rank_results,
    run,
    start_ranks,
    write_checkpoints,
)

import speculum.models.loading as loading
from speculum.models.decoder import cache_kv_heads, fuse_projections_
from speculum.models.draft_loading import load_draft
from speculum.models.frozen_kv import load_frozen_kv
from speculum.models.loading import load_model, open_checkpoint, random_model, save_model
from speculum.models.parallel import UnsupportedSplit, shard_
from speculum.runtime import cli, distributed
from speculum.runtime.engine import SpecOptions, build_engine
from speculum.runtime.generate import generate
from speculum.state.parallel import SINGLE, TensorParallel


def rank(r: int, size: int = 2) -> TensorParallel:
    """Rank ``r``'s place in a group of ``size``: enough to shard and load (no collectives)."""
    return TensorParallel(rank=r, size=size)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def job(folders, tmp_path_factory):
    """The two-process run of every scenario, started now and collected by ``ranks``."""
    out = tmp_path_factory.mktemp("tp-out")
    return start_ranks(folders, out), out


@pytest.fixture(scope="module")
def single(folders, job):
    """Every scenario in this one process (computed while the two-process run is going)."""
    return {name: run(s, folders, SINGLE) for name, s in SCENARIOS.items()}


@pytest.fixture(scope="module")
def ranks(job):
    return rank_results(*job, timeout=600)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_emit_the_tokens_of_one(name, single, ranks):
    """Greedy and seeded sampled runs alike: both ranks emit the same tokens, those of tp=1."""
    assert ranks[0][name] == ranks[1][name] == single[name]
    assert all(len(tokens) == NEW_TOKENS for tokens in single[name])


def test_every_rank_holds_the_same_full_float32_logits(folders, ranks):
    """All-gathered logits are the same bytes on both ranks and the unsharded model's up to
    the rounding of the row-parallel sums (the padded vocabulary row is dropped)."""
    logits = [r["logits"] for r in ranks]
    assert logits[0].dtype == torch.float32 and logits[0].shape == (2, 5, ODD.vocab_size)
    assert torch.equal(logits[0], logits[1])
    torch.testing.assert_close(logits[0], odd_logits(folders["odd"], SINGLE))


def test_under_torchrun_only_rank_zero_prints(folders, ranks):
    """``speculum generate`` in a torchrun job shards over the job's processes by default;
    rank 0 prints the one JSON object (or the one error line), rank 1 nothing."""
    (status0, out0, _), (status1, out1, err1) = (r["cli"] for r in ranks)
    assert (status0, status1, out1, err1) == (0, 0, "", "")
    expected = generate([[4, 5, 6]], model=folders["odd"], max_new_tokens=6)[0]
    assert json.loads(out0)["token_ids"] == list(expected.token_ids)
    (status0, out0, err0), (status1, out1, err1) = (r["cli error"] for r in ranks)
    assert (status0, status1, out0, out1, err1) == (2, 2, "", "", "")
    assert err0.startswith("speculum: error: prompt token ids [61] are outside the vocabulary")


def test_generate_tp_starts_its_own_workers(folders, capsys):
    """``speculum generate --tp 2`` outside torchrun starts two workers and prints rank 0's
    result: the tokens of one process (here EAGLE-3 with a replicated draft, sampled)."""
    argv = ["generate", "--model", folders["markov"], "--algorithm", "eagle3"]
    argv += ["--draft", folders["eagle3"], "--prompt-ids", "1,2,3", "--max-new-tokens", "8"]
    argv += ["--temperature", "0.7", "--seed", "3", "--json"]
    assert cli.main([*argv, "--tp", "2", "--draft-tp", "1"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert cli.main(argv) == 0
    assert two["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]


#: A torchrun worker that joins a group through speculum, reduces once over it and exits with
#: its ``TensorParallel`` still referenced, as a model sharded over the group would hold it.
EXITING_RANK = """
import os
import torch
from speculum.runtime import distributed
TP = distributed.tensor_parallel(int(os.environ["WORLD_SIZE"]))
assert TP.all_reduce(torch.ones(4)).tolist() == [2.0] * 4
"""


def test_ranks_exit_cleanly_while_a_sharded_model_still_holds_the_group(tmp_path):
    """The process group is torn down at exit while the interpreter is whole, even though a
    model (here its group value) outlives ``finish()``: when a reference kept gloo's group
    alive into interpreter shutdown, a rank aborted there in about half of all runs, so three
    clean runs in a row would then have been one chance in eight."""
    script = tmp_path / "rank.py"
    script.write_text(EXITING_RANK)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    jobs = [  # at once: each spends most of its time importing torch
        subprocess.Popen(
            [*torchrun, "--nproc-per-node", "2", str(script)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for job in jobs:
        _, stderr = job.communicate(timeout=180)
        assert job.returncode == 0, stderr[-2000:]


# ------------------------------------------------------------------------------------------
# Sharded weights


def _rows(t: torch.Tensor, start: int, stop: int, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, start, stop - start)


def test_a_rank_loads_its_slices_and_reads_nothing_else(folders, monkeypatch):
    """Rank 1 of 2 holds its query heads, the one (replicated) K/V head, its intermediate
    slice and its vocabulary rows (31 of 61, one zero padding row) of the checkpoint, the
    rest whole; and safetensors is asked for exactly those slices."""
    full = {k: t.read() for k, t in open_checkpoint(folders["odd"]).items()}
    reads: dict[str, tuple[int, ...]] = {}

    def spy(method):
        def reading(self, *index):
            part = method(self, *index)
            reads[self.key] = tuple(part.shape)
            return part

        return reading

    for method in ("read", "__getitem__"):
        original = getattr(loading.CheckpointTensor, method)
        monkeypatch.setattr(loading.CheckpointTensor, method, spy(original))
    model = load_model(folders["odd"], tp=rank(1))
    params = dict(model.named_parameters())
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    expected = {
        f"{attn}.q_proj.weight": _rows(full[f"{attn}.q_proj.weight"], 16, 32),
        f"{attn}.q_proj.bias": _rows(full[f"{attn}.q_proj.bias"], 16, 32),
        f"{attn}.k_proj.weight": full[f"{attn}.k_proj.weight"],
        f"{attn}.v_proj.bias": full[f"{attn}.v_proj.bias"],
        f"{attn}.o_proj.weight": _rows(full[f"{attn}.o_proj.weight"], 16, 32, dim=1),
        f"{attn}.o_proj.bias": full[f"{attn}.o_proj.bias"],
        f"{mlp}.up_proj.weight": _rows(full[f"{mlp}.up_proj.weight"], 32, 64),
        f"{mlp}.down_proj.weight": _rows(full[f"{mlp}.down_proj.weight"], 32, 64, dim=1),
        f"{mlp}.down_proj.bias": full[f"{mlp}.down_proj.bias"],
        "model.embed_tokens.weight": torch.cat(
            [_rows(full["model.embed_tokens.weight"], 31, 61), torch.zeros(1, 32)]
        ),
        "model.norm.weight": full["model.norm.weight"],
    }
    for name, value in expected.items():
        assert torch.equal(params[name], value), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.tp.rank == 1 and cache_kv_heads(model, 0) == 1
    assert model.new_pool(3, 4).k.shape == (2, 3, 4, 1, 8)
    # Every tensor read once, in the shape this rank holds (the padding row is not read).
    assert reads == {k: tuple(params[k].shape) for k in full} | {
        "model.embed_tokens.weight": (30, 32)
    }


def test_a_sharded_draft_holds_its_rows_of_the_reduced_vocabulary(folders):
    """EAGLE-3's own lm_head (24 draft ids) splits by vocabulary like the target's."""
    target = load_model(folders["markov"], tp=rank(0))
    head = load_draft(folders["eagle3"], target, "eagle3", tp=rank(0))
    full = open_checkpoint(folders["eagle3"])["lm_head.weight"].read()
    assert torch.equal(head.lm_head.weight, full[:12])
    whole = load_draft(folders["eagle3"], target, "eagle3")
    assert torch.equal(whole.lm_head.weight, full)
    assert whole.embedding is target.model.embed_tokens  # borrowed, sharded


@settings(max_examples=40)
@given(
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 4), (6, 3), (8, 2)]),
    intermediate=st.sampled_from([12, 16, 18, 24]),
    vocab=st.integers(5, 40),
    size=st.integers(1, 4),
    tied=st.booleans(),
)
def test_shards_put_together_are_the_full_weights(heads, intermediate, vocab, size, tied):
    """Over all ranks: query rows, intermediate slices and vocabulary rows concatenate to the
    full tensors (vocabulary padding is zeros), K/V heads split or each rank holds the one its
    queries read; or, when heads or the intermediate size do not split, ``UnsupportedSplit``
    names it and the model is unchanged."""
    num_heads, num_kv = heads
    config = tiny_config(
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=4,
        intermediate_size=intermediate,
        vocab_size=vocab,
        num_layers=1,
        tie_word_embeddings=tied,
    )
    full = random_model(config, seed=0, std=0.1)
    before = {k: v.clone() for k, v in full.state_dict().items()}
    problem = (
        "num_attention_heads"
        if num_heads % size
        else "num_key_value_heads"
        if num_kv % size and size % num_kv
        else "intermediate_size"
        if intermediate % size
        else None
    )
    if problem:
        model = copy.deepcopy(full)
        with pytest.raises(UnsupportedSplit, match=problem):
            shard_(model, rank(0, size))
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())
        return
    shards = [
        dict(shard_(copy.deepcopy(full), rank(r, size)).named_parameters()) for r in range(size)
    ]
    weights = dict(full.named_parameters())

    def joined(name, dim=0):
        return torch.cat([s[name] for s in shards], dim)

    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert torch.equal(joined(f"{attn}.q_proj.weight"), weights[f"{attn}.q_proj.weight"])
    assert torch.equal(joined(f"{attn}.o_proj.weight", 1), weights[f"{attn}.o_proj.weight"])
    k = weights[f"{attn}.k_proj.weight"].view(num_kv, 4, -1)
    for r, s in enumerate(shards):
        local = max(1, num_kv // size)
        first = r * local if num_kv >= size else r // (size // num_kv)
        assert torch.equal(s[f"{attn}.k_proj.weight"], k[first : first + local].flatten(0, 1))
    for name in ("gate_proj", "up_proj"):
        assert torch.equal(joined(f"{mlp}.{name}.weight"), weights[f"{mlp}.{name}.weight"])
    assert torch.equal(joined(f"{mlp}.down_proj.weight", 1), weights[f"{mlp}.down_proj.weight"])
    table = joined("model.embed_tokens.weight")
    assert torch.equal(table[:vocab], weights["model.embed_tokens.weight"])
    assert not table[vocab:].any() and table.shape[0] == -(-vocab // size) * size
    if not tied:
        assert torch.equal(joined("lm_head.weight")[:vocab], weights["lm_head.weight"])
    assert all(torch.equal(s["model.norm.weight"], weights["model.norm.weight"]) for s in shards)


# ------------------------------------------------------------------------------------------
# Errors


def test_impossible_and_inconsistent_setups_fail_clearly(folders, tmp_path, monkeypatch):
    with pytest.raises(UnsupportedSplit, match="num_attention_heads=4 .* tp=3"):
        load_model(folders["odd"], tp=rank(0, 3))
    target = load_model(folders["markov"], tp=rank(0))
    with pytest.raises(UnsupportedSplit, match="frozen-KV draft reads the target's KV cache"):
        load_frozen_kv(folders["frozen_kv"], target)
    with pytest.raises(ValueError, match="draft_tp=3 with tp=2"):
        build_engine(folders["markov"], algorithm="eagle", draft="unused", tp=rank(0), draft_tp=3)
    with pytest.raises(ValueError, match="ranks of a tensor-parallel group could pick"):
        build_engine(
            folders["markov"],
            algorithm="eagle",
            draft=folders["eagle"],
            spec=SpecOptions(adaptive_steps=(0, 2)),
            tp=rank(0),
        )
    with pytest.raises(ValueError, match="already sharded"):
        shard_(target, rank(0))
    with pytest.raises(ValueError, match="save the unsharded model"):
        save_model(target, tmp_path / "shard")
    fused = fuse_projections_(random_model(tiny_config(), seed=0))
    with pytest.raises(ValueError, match="shard first, then fuse"):
        shard_(fused, rank(0))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        distributed.tensor_parallel(2)
    assert distributed.tensor_parallel(1) is SINGLE


@attrs.define
class Worker:
    """A stand-in for a worker process: just its exit status (None while it runs)."""

    exitcode: int | None = None


def test_workers_started_by_speculum_hand_back_rank_zeros_result_or_the_first_error():
    """What ``launch`` waits for: rank 0's result; an error any rank raised, itself; a worker
    that died without a word, named (rather than a wait forever)."""
    results: queue.Queue = queue.Queue()
    results.put((1, True, ValueError("prompt token ids [70] are outside the vocabulary")))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        distributed._leader_result([Worker(), Worker()], results)
    results.put((0, False, "tokens"))
    assert distributed._leader_result([Worker(), Worker(exitcode=0)], results) == "tokens"
    with pytest.raises(RuntimeError, match="worker 1 exited with status -9"):
        distributed._leader_result([Worker(), Worker(exitcode=-9)], results)
