"""Failure isolation: a request whose logits cannot be sampled (a NaN embedding row, a logit that
overflows under its temperature) finishes alone with ``finish_reason == "error"``, in the step
that met the fault, with the tokens decided before it; every other request decodes exactly as it
would alone. Every pipeline, greedy and seeded sampling, synchronous and overlapped."""

from __future__ import annotations

import copy
import json

import attrs
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from strategies import prompt_batches
from test_cli import parse_one_object, run_cli
from test_eagle import TARGET, VOCAB
from test_overlap import PIPELINES, engine

from speculum.models.loading import save_model
from speculum.pipelines.base import one_token_output, verified_output
from speculum.runtime import scheduler
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.spec.sampling import Fault, describe_faults, first_fault, guard_logits, logit_faults
from speculum.state.kv import allocated_pages
from speculum.state.record import make
from speculum.state.tree import AcceptResult, Verified

#: The token whose embedding row is NaN in ``POISONED``: the target's logits are NaN from the
#: first position that feeds it on. The Markov target of ``test_eagle`` emits it in the middle
#: of many greedy continuations, so faults land inside speculative rounds, not only at prefill.
POISON = 7


def poisoned(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose embedding row of ``POISON`` is NaN."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.model.embed_tokens.weight[POISON] = float("nan")
    return copied


POISONED = poisoned(TARGET)
LIMITS = {"page_size": 4, "max_context": 48}


def pipeline_engine(name: str, target: torch.nn.Module, overlap: bool = False, **limits):
    """An engine of ``test_overlap.PIPELINES[name]`` over ``target``."""
    return engine(name, overlap, target=target, **limits)


def outcome(generation) -> tuple[tuple[int, ...], str]:
    return generation.token_ids, generation.finish_reason


_plain_alone: dict = {}


def plain_alone(prompt: tuple[int, ...], max_new_tokens: int):
    """Greedy plain decoding of ``prompt`` alone over the poisoned target: the ground truth."""
    key = (prompt, max_new_tokens)
    if key not in _plain_alone:
        engine = engine_from_model(POISONED, **LIMITS)
        (_plain_alone[key],) = generate(
            [list(prompt)], engine=engine, max_new_tokens=max_new_tokens
        )
    return _plain_alone[key]


def test_the_poisoned_target_fails_some_requests_mid_decode_and_spares_others():
    """The ground truth is informative: with these prompts, plain decoding fails one request at
    prefill, one after several tokens, and finishes one normally."""
    fails_at_prefill = plain_alone((1, POISON, 2), 10)
    assert outcome(fails_at_prefill) == ((), "error")
    results = [plain_alone((p,), 10) for p in range(VOCAB) if p != POISON]
    assert any(r.finish_reason == "error" and len(r.token_ids) >= 3 for r in results)
    assert any(r.finish_reason == "length" for r in results)
    # The state machine's target fails a temperature of 1e-4 at once, and samples temperature 1.
    assert pipeline_alone("plain", (3,), 5, SETTINGS[2]) == ((), "error")
    assert pipeline_alone("plain", (3,), 5, SETTINGS[1])[1] == "length"


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("overlap", [False, True])
@settings(max_examples=3)
@given(prompts=prompt_batches(VOCAB, max_batch=5), max_new_tokens=st.integers(1, 12))
@example(prompts=[[3], [1, POISON, 2], [12, 4], [9]], max_new_tokens=12)
def test_every_pipeline_fails_exactly_where_plain_decoding_alone_fails(
    name, overlap, prompts, max_new_tokens
):
    """Greedy: each request emits plain decoding's tokens alone and finishes for the same reason,
    ``error`` included, whatever else shares its batch. A fault on a draft token the target
    rejects spoils nothing (attention weighs only what each query sees); one on the accepted
    path cuts the round before the token it would have decided."""
    engine = pipeline_engine(name, POISONED, overlap, max_batch=3)
    results = generate(prompts, engine=engine, max_new_tokens=max_new_tokens)
    expected = [plain_alone(tuple(p), max_new_tokens) for p in prompts]
    assert [outcome(r) for r in results] == [outcome(e) for e in expected]
    for result in results:
        assert (result.error is not None) == (result.finish_reason == "error")


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_garbage_in_free_pages_changes_no_token(name):
    """Pools filled with NaN before any request (what a failed request leaves in the pages it
    frees) give every pipeline the tokens and acceptance of clean pools: no query ever reads a
    slot it does not see, padded queries and rejected tree nodes included."""
    prompts = [[3], [12, 4], [9], [0, 15, 0, 0, 0], [2] * 8]
    clean = generate(prompts, engine=pipeline_engine(name, TARGET), max_new_tokens=12)
    dirty_engine = pipeline_engine(name, TARGET)
    for pool in dirty_engine.resources.pools:
        pool.k.fill_(float("nan"))
        pool.v.fill_(float("nan"))
    dirty = generate(prompts, engine=dirty_engine, max_new_tokens=12)
    assert [(outcome(r), r.stats["accept_length_histogram"]) for r in dirty] == [
        (outcome(r), r.stats["accept_length_histogram"]) for r in clean
    ]


SAMPLED = sorted(name for name, (*_, greedy_only) in PIPELINES.items() if not greedy_only)


@pytest.mark.parametrize("name", SAMPLED)
@settings(max_examples=2)
@given(prompts=prompt_batches(VOCAB, max_batch=4), seed=st.integers(0, 3))
def test_seeded_sampling_in_a_batch_with_failures_equals_each_request_alone(name, prompts, seed):
    """Seeded sampling: every request's tokens and finish reason in the batch equal what the
    same pipeline gives it alone."""
    options = {"max_new_tokens": 10, "temperature": 1.0, "top_k": 6, "seed": seed}
    batch = generate(prompts, engine=pipeline_engine(name, POISONED, max_batch=4), **options)
    alone = [generate([p], engine=pipeline_engine(name, POISONED), **options)[0] for p in prompts]
    assert [outcome(r) for r in batch] == [outcome(r) for r in alone]


def huge_logits_target(model: torch.nn.Module = TARGET) -> torch.nn.Module:
    """A copy of ``model`` with logits around 1e35: finite, and greedy or temperature-1 sampling
    of them is fine, but divided by a temperature of 1e-4 they overflow float32."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.lm_head.weight.mul_(1e35)
    return copied


@pytest.mark.parametrize("name", ["plain", "eagle chain", "eagle3 sampled drafts"])
def test_a_temperature_that_overflows_the_logits_fails_only_its_request(name):
    target = huge_logits_target()
    engine = pipeline_engine(name, target, max_batch=4)
    state = scheduler.new_state(engine)
    settings_by_row = [
        scheduler.Sampling(),
        scheduler.Sampling(temperature=1e-4, seed=1),
        scheduler.Sampling(temperature=1.0, seed=2),
    ]
    rids = []
    for sampling in settings_by_row:
        state, rid = scheduler.add_request(
            engine, state, [3, 4], sampling=sampling, max_new_tokens=6
        )
        rids.append(rid)
    finished = {}
    while not scheduler.is_idle(state):
        state, outputs = scheduler.step(engine, state)
        finished.update((o.rid, o) for o in outputs if o.finished)
    failed = finished[rids[1]]
    assert failed.finish_reason == "error" and failed.request.output == ()
    assert f"request {rids[1]} " in failed.error and "overflows" in failed.error
    for rid, sampling in zip((rids[0], rids[2]), (settings_by_row[0], settings_by_row[2])):
        alone_engine = pipeline_engine(name, target)
        alone_state, _ = scheduler.add_request(
            alone_engine,
            scheduler.new_state(alone_engine),
            [3, 4],
            sampling=sampling,
            max_new_tokens=6,
        )
        while not scheduler.is_idle(alone_state):
            alone_state, outs = scheduler.step(alone_engine, alone_state)
            alone = [o for o in outs if o.finished]
            if alone:
                assert finished[rid].request.output == alone[0].request.output
                assert finished[rid].finish_reason == "length"


def test_the_error_names_the_request_and_the_cause():
    engine = engine_from_model(POISONED, **LIMITS)
    state, first = scheduler.add_request(engine, scheduler.new_state(engine), [3], max_new_tokens=4)
    state, bad = scheduler.add_request(engine, state, [POISON], max_new_tokens=4)
    state, outputs = scheduler.step(engine, state)
    (failed,) = [o for o in outputs if o.rid == bad]
    assert failed.finished and failed.finish_reason == "error"
    assert failed.error.startswith(f"request {bad} could not be decoded after 0 tokens")
    assert "NaN" in failed.error
    assert [r.rid for r in state.running] == [first]


# --- the stage-level pieces -------------------------------------------------------------------


def test_logit_faults_name_each_cause_per_row():
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [[0.0, 1.0, -inf], [nan, 0.0, 0.0], [inf, 0.0, 0.0], [-inf, -inf, -inf], [3e38, 0, 0]]
    )
    temperature = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5])
    faults = logit_faults(logits, temperature).tolist()
    assert faults == [0, Fault.NAN, Fault.POSINF, Fault.NO_TOKEN, Fault.POSINF]
    assert logit_faults(logits[4:], torch.tensor([0.0])).tolist() == [0]  # greedy: no division
    assert "NaN" in describe_faults(Fault.NAN | Fault.NO_TOKEN)
    assert "-inf" in describe_faults(Fault.NAN | Fault.NO_TOKEN)


@given(
    logits=st.lists(
        st.lists(
            st.sampled_from([0.0, 2.5, -1.0, float("nan"), float("inf")]), min_size=3, max_size=3
        ),
        min_size=1,
        max_size=6,
    )
)
def test_guarded_logits_keep_every_usable_row_bit_for_bit(logits):
    x = torch.tensor(logits).reshape(len(logits), 1, 3)
    guarded, faults = guard_logits(x)
    usable = faults == 0
    assert torch.equal(guarded[usable], x[usable])
    assert torch.equal(guarded[~usable], torch.zeros_like(x[~usable]))
    assert guarded.isfinite().all()


@given(
    faults=st.lists(st.lists(st.sampled_from([0, 0, 1, 4]), min_size=4, max_size=4), min_size=1),
    data=st.data(),
)
def test_first_fault_keeps_the_tokens_decided_before_the_first_faulty_step(faults, data):
    num_tokens = [data.draw(st.integers(1, 4)) for _ in faults]
    kept, first = first_fault(torch.tensor(faults), torch.tensor(num_tokens))
    for row, n, k, f in zip(faults, num_tokens, kept.tolist(), first.tolist()):
        bad = [d for d in range(n) if row[d]]
        assert (k, f) == ((bad[0], row[bad[0]]) if bad else (n, 0))


def test_a_faulty_node_off_the_accepted_path_spoils_nothing():
    """Node 2 (a rejected sibling) is faulty in row 0; node 1, on row 1's accepted path at
    depth 1, is faulty: row 1 keeps the token its root decided and reports the fault."""
    accepted = make(
        AcceptResult,
        path=torch.tensor([[0, 1, -1], [0, 1, 3]]),
        emitted=torch.tensor([[5, 6, -1], [5, 6, 7]]),
        num_accepted=torch.tensor([1, 2]),
    )
    verified = make(
        Verified,
        accepted=accepted,
        final_hidden=torch.zeros(2, 4, 1),
        captured=(),
        faults=torch.tensor([[0, 0, 1, 0], [0, 4, 0, 0]]),
    )
    out = verified_output(verified)
    assert out.num_tokens.tolist() == [2, 1] and out.faults.tolist() == [0, 4]
    single = one_token_output(torch.tensor([3, 4]), torch.tensor([0, 2]))
    assert single.num_tokens.tolist() == [1, 0] and single.faults.tolist() == [0, 2]


# --- a state machine mixing good and poisoned requests ------------------------------------------

PROMPTS = [(3,), (12, 4), (9,), (1, POISON, 2), (0,), (5, 1)]
MACHINE_PIPELINES = ["plain", "eagle tree", "mtp", "ngram", "ngram device"]
#: Both kinds of fault: the poisoned embedding row, and logits that a temperature of 1e-4
#: overflows.
FRAGILE = huge_logits_target(POISONED)
SETTINGS = [
    scheduler.Sampling(),
    scheduler.Sampling(temperature=1.0, top_k=6, seed=3),
    scheduler.Sampling(temperature=1e-4, seed=1),
]


@attrs.define
class Expected:
    """What one request must yield: its tokens and finish reason alone."""

    tokens: tuple[int, ...]
    reason: str
    output: tuple[int, ...] = ()
    done: bool = False


_pipeline_alone: dict = {}


def pipeline_alone(
    name: str, prompt: tuple[int, ...], max_new_tokens: int, sampling: scheduler.Sampling
) -> tuple[tuple[int, ...], str]:
    """The tokens and finish reason of ``prompt`` decoded alone by pipeline ``name`` over
    ``FRAGILE``."""
    key = (name, prompt, max_new_tokens, sampling)
    if key not in _pipeline_alone:
        engine = pipeline_engine(name, FRAGILE)
        state, _ = scheduler.add_request(
            engine,
            scheduler.new_state(engine),
            prompt,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
        )
        _, finished = run_to_completion(engine, state)
        (request,) = finished.values()
        _pipeline_alone[key] = request.output, request.finish_reason
    return _pipeline_alone[key]


class PoisonMachine(RuleBasedStateMachine):
    """Adds, steps and cancels requests over a target with both kinds of fault, greedy and
    sampled, some of which fail (pages of failed requests are reused by later ones); checks
    every emitted token and finish reason against the same pipeline alone after every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.name = ""
        self.engine = None
        self.state = None
        self.model: dict[int, Expected] = {}

    @precondition(lambda self: self.engine is None)
    @rule(name=st.sampled_from(MACHINE_PIPELINES), overlap=st.booleans())
    def build(self, name, overlap):
        self.name = name
        self.engine = pipeline_engine(name, FRAGILE, overlap, max_batch=3, num_pages=16)
        self.state = scheduler.new_state(self.engine)

    @precondition(lambda self: self.engine is not None)
    @rule(
        prompt=st.sampled_from(PROMPTS),
        max_new=st.integers(1, 10),
        sampling=st.sampled_from(SETTINGS),
    )
    def add(self, prompt, max_new, sampling):
        self.state, rid = scheduler.add_request(
            self.engine, self.state, prompt, sampling=sampling, max_new_tokens=max_new
        )
        tokens, reason = pipeline_alone(self.name, prompt, max_new, sampling)
        self.model[rid] = Expected(tokens=tokens, reason=reason)

    @precondition(lambda self: self.engine is not None)
    @rule()
    def step(self):
        self.state, outputs = scheduler.step(self.engine, self.state)
        for out in outputs:
            expected = self.model[out.rid]
            expected.output += out.new_token_ids
            assert expected.output == expected.tokens[: len(expected.output)]
            if out.finished:
                assert (expected.output, out.finish_reason) == (expected.tokens, expected.reason)
                expected.done = True

    @precondition(lambda self: any(not e.done for e in self.model.values()))
    @rule(data=st.data())
    def cancel(self, data):
        live = [rid for rid, e in self.model.items() if not e.done]
        rid = data.draw(st.sampled_from(live))
        self.state = scheduler.cancel(self.engine, self.state, rid)
        self.model[rid].done = True

    @invariant()
    def failed_requests_leave_no_pages_behind(self):
        if self.state is None:
            return
        held = [p for r in self.state.prefilling + self.state.running for p in r.pages]
        assert set(held) == allocated_pages(self.state.allocator)


PoisonMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=30)
test_poison_state_machine = PoisonMachine.TestCase


def test_the_command_line_reports_a_failed_request_and_exits_1(capsys, tmp_path):
    """``--json`` keeps one object, with ``finish_reason`` error and the error; text mode prints
    what was decoded and the error on stderr; a prompts file reports every prompt, the failed
    one with its error."""
    folder = save_model(POISONED, tmp_path / "poisoned")
    model = ("--model", str(folder))
    status, out, err = run_cli(capsys, *model, "--prompt-ids", f"1,{POISON}", "--json")
    payload = parse_one_object(out)
    assert status == 1 and payload["finish_reason"] == "error" and payload["token_ids"] == []
    assert payload["error"].startswith("request 0 could not be decoded after 0 tokens")
    assert "speculum: error: request 0 could not be decoded" in err
    status, out, err = run_cli(capsys, *model, "--prompt-ids", "3", "--json")
    assert status == 0 and "error" not in parse_one_object(out)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(f'{{"prompt_ids": [3]}}\n{{"prompt_ids": [1, {POISON}]}}\n')
    status, out, err = run_cli(capsys, *model, "--prompts-file", str(prompts))
    lines = [json.loads(line) for line in out.splitlines()]
    assert status == 1 and [line["finish_reason"] for line in lines] == ["length", "error"]
    assert "error" not in lines[0] and lines[1]["error"].startswith("request 1 ")


@given(
    rows=st.lists(
        st.lists(
            st.sampled_from(
                [0.0, -3.5, 2.0, 3e38, -3e38, float("nan"), float("inf"), -float("inf")]
            ),
            min_size=4,
            max_size=4,
        ),
        min_size=1,
        max_size=5,
    ),
    data=st.data(),
)
def test_logit_faults_read_from_the_largest_logit_equal_the_elementwise_definition(rows, data):
    """NaN anywhere; else +inf anywhere once divided by the temperature (overflow included);
    else every logit -inf: one ``amax`` finds exactly what checking every scaled logit would."""
    temperature = [data.draw(st.sampled_from([0.0, 1.0, 0.5, 1e-4, 3.0])) for _ in rows]
    faults = logit_faults(torch.tensor(rows), torch.tensor(temperature)).tolist()
    for row, t, got in zip(rows, temperature, faults):
        scaled = torch.tensor(row) / (t if t > 0 else 1.0)  # float32, as sampling divides
        if scaled.isnan().any():
            assert got == Fault.NAN
        elif scaled.isposinf().any():
            assert got == Fault.POSINF
        else:
            assert got == (Fault.NO_TOKEN if (scaled == -float("inf")).all() else 0)
