"""Compiled speculative and multi-step rounds (``EngineConfig.compile_stages``): an EAGLE tree
round, a 3-step plain round and a device-matcher n-gram round (matcher included), compiled with
every stage and with the round alone, and an n-gram round's device part and a DSPARK round
verifying a fixed budget packed (ragged verify's ``q_starts`` traced through the target),
compiled with every stage, emit the eager rounds' greedy tokens, and seeded sampled tokens
too; so does the command line's ``--compile-stages``.
Slow on the CPU (each engine compiles a round with inductor's C++ backend), hence here rather
than in ``tests/cover``."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config
from heads import agreeing_head, markov_target

from speculum.models.block_draft import random_block_draft
from speculum.models.loading import random_model, save_model
from speculum.runtime import cli, scheduler
from speculum.runtime.compiled import ROUND, STAGES
from speculum.runtime.engine import NgramOptions, SpecOptions, engine_from_model
from speculum.runtime.generate import run_to_completion

pytestmark = pytest.mark.slow

VOCAB = 16
TARGET = markov_target(VOCAB)
HEAD = agreeing_head(TARGET, "eagle")
PLAIN = random_model(tiny_config(num_layers=1), seed=2, std=0.3)
#: name -> (target, algorithm, draft, spec options)
ROUNDS = {
    "eagle tree": (TARGET, "eagle", HEAD, SpecOptions(num_steps=3, topk=2, num_draft_tokens=5)),
    "plain 3 steps": (PLAIN, "plain", None, SpecOptions(decode_steps=3)),
    # Host work between stages: only the device round (verify, accept, commit) is compiled.
    "ngram": (TARGET, "ngram", None, SpecOptions(num_draft_tokens=4)),
    # The device matcher: the whole round (match, verify, accept, commit, append) is compiled.
    "ngram device": (TARGET, "ngram", None, SpecOptions(num_draft_tokens=4)),
    # A budget of 3 below the batch's 2 x 4 drafts: the target forward runs packed.
    "dspark packed": (
        TARGET,
        "dspark",
        random_block_draft(TARGET, "dspark", seed=2, std=0.3, block_size=4, num_layers=1),
        SpecOptions(verify_budget=3, min_verify=1),
    ),
    # The auto budget read on the host first: the device round is compiled per budget bound.
    "dspark auto": (
        TARGET,
        "dspark",
        random_block_draft(TARGET, "dspark", seed=2, std=0.3, block_size=4, num_layers=1),
        SpecOptions(verify_budget="auto", cost_table=((1, 1.0), (64, 20.0))),
    ),
}


#: n-gram options by round name (the others take the defaults).
NGRAM = {"ngram device": NgramOptions(matcher="device", max_depth=3)}


def decoded(engine, temperature: float) -> list[tuple[tuple[int, ...], str]]:
    """Two requests of different budgets (the batch shrinks and runs padded), seed 7."""
    state, rids = scheduler.new_state(engine), []
    for prompt, budget in (([1, 2, 3], 10), ([4, 5, 6, 7, 8], 6)):
        sampling = scheduler.Sampling(temperature=temperature, seed=7)
        state, rid = scheduler.add_request(
            engine, state, prompt, sampling=sampling, max_new_tokens=budget
        )
        rids.append(rid)
    state, finished = run_to_completion(engine, state)
    return [(finished[rid].output, finished[rid].finish_reason) for rid in rids]


#: (round, compile_stages) pairs: the n-gram and DSPARK rounds with every stage only (their
#: kernels are the tree's and sampling's, compiled there as in the EAGLE round).
CASES = [
    (name, stages)
    for name in ROUNDS
    for stages in ((ROUND,), STAGES)
    if name not in ("ngram", "dspark packed", "dspark auto") or stages == STAGES
]


@pytest.mark.parametrize(("name", "stages"), CASES, ids=[f"{n}-{'+'.join(s)}" for n, s in CASES])
def test_compiled_rounds_emit_the_eager_tokens(name, stages):
    target, algorithm, draft, spec = ROUNDS[name]

    def engine(**options):
        return engine_from_model(
            target,
            algorithm=algorithm,
            draft=draft,
            spec=spec,
            max_context=64,
            page_size=4,
            max_batch=2,
            graph_buckets=(2,),
            prefix_cache=False,
            ngram=NGRAM.get(name),
            **options,
        )

    torch._dynamo.reset()
    eager, compiled = engine(), engine(compile_stages=stages)
    for temperature in (0.0, 1.0):
        assert decoded(compiled, temperature) == decoded(eager, temperature)


def test_the_command_line_compiles_the_stages_it_names(capsys, tmp_path):
    save_model(PLAIN, tmp_path)
    common = ("--model", str(tmp_path), "--max-new-tokens", "4", "--json", "--prompt-ids", "1,2")
    outputs = []
    for extra in ((), ("--compile-stages", "round")):
        torch._dynamo.reset()
        assert cli.main(["generate", *common, *extra]) == 0
        printed = json.loads(capsys.readouterr().out)
        outputs.append([printed[k] for k in ("token_ids", "text", "finish_reason")])
    assert outputs[1] == outputs[0]
