"""Log-probabilities (``Sampling.logprobs``): every pipeline reports, for each generated token,
the target's log-probability of it and the top-N alternatives, from the distribution that
decided it: ``log_softmax(logits / temperature)`` (greedy: the logits as they are), before top-k,
top-p and min-p. They equal plain decoding's and a direct forward's to float tolerance, bonus
tokens and tree paths included; a request asking for more than the engine computes is refused
and leaves the state unchanged."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from test_eagle import TARGET, VOCAB
from test_overlap import PIPELINES, engine

from speculum.models.loading import save_model
from speculum.runtime import cli, scheduler
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.paged import extend_batch
from speculum.spec.sampling import token_logprobs
from speculum.spec.verify import path_logprobs
from speculum.state import PagedKV, SamplingParams
from speculum.state.record import make
from speculum.state.tree import AcceptResult

PROMPTS = [[1, 2, 3], [5], [9, 4, 12, 0, 7], [3, 3]]
MAX_LOGPROBS = 4
#: Float tolerance: incremental and whole-sequence forwards round float32 differently, by a
#: few ulps of logits up to ~30 in size.
TOLERANCE = {"abs": 1e-5, "rel": 1e-5}
GREEDY = {}
#: Sampled with truncating filters, which the reported distribution ignores.
SAMPLED = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 13}


def target_logprobs(prompt: list[int], output: tuple[int, ...], temperature: float):
    """``[len(output), vocab]``: log_softmax of the target's logits / temperature (greedy: as
    they are) at each generated position, by one forward of the target over prompt + output."""
    tokens = torch.tensor([prompt + list(output)])
    pages = -(-tokens.shape[1] // 4)
    kv = PagedKV(
        page_table=torch.arange(1, pages + 1)[None],
        seq_lens=torch.zeros(1, dtype=torch.int64),
        page_size=4,
    )
    hidden, _ = TARGET(
        extend_batch(kv, tokens, torch.tensor([tokens.shape[1]])), TARGET.new_pool(pages + 1, 4)
    )
    logits = TARGET.logits(hidden[0, len(prompt) - 1 : -1]).float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def assert_token_logprobs(entries: list[dict], expected: torch.Tensor, tokens, num_top: int):
    """Each entry is token ``d``'s: its log-probability is ``expected[d, token]`` and its
    ``num_top`` alternatives are the most likely tokens of ``expected[d]`` (compared by value,
    so near ties may come in either order), each with its own log-probability."""
    assert [e["token_id"] for e in entries] == list(tokens)
    for entry, row in zip(entries, expected):
        assert entry["logprob"] == pytest.approx(row[entry["token_id"]].item(), **TOLERANCE)
        top = entry["top_logprobs"]
        assert len(top) == num_top
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(row.topk(num_top).values.tolist(), **TOLERANCE)
        for t in top:
            assert t["logprob"] == pytest.approx(row[t["token_id"]].item(), **TOLERANCE)


def assert_same_logprobs(got: list[dict], want: list[dict]):
    """Two runs' log-probabilities agree to tolerance (alternatives compared by value)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["token_id"] == w["token_id"]
        assert g["logprob"] == pytest.approx(w["logprob"], **TOLERANCE)
        g_top = [t["logprob"] for t in g["top_logprobs"]]
        assert g_top == pytest.approx([t["logprob"] for t in w["top_logprobs"]], **TOLERANCE)


_plain_runs: dict = {}


def plain_run(setting: str):
    """Plain decoding of ``PROMPTS`` with log-probabilities: the ground truth."""
    if setting not in _plain_runs:
        options = GREEDY if setting == "greedy" else SAMPLED
        _plain_runs[setting] = generate(
            PROMPTS,
            engine=engine("plain", False, max_logprobs=MAX_LOGPROBS),
            max_new_tokens=10,
            logprobs=MAX_LOGPROBS,
            **options,
        )
    return _plain_runs[setting]


@pytest.mark.parametrize("setting", ["greedy", "sampled"])
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_pipeline_reports_the_targets_logprobs_of_each_token(name, setting):
    """Per token: the log-probability under the target's distribution at that position and its
    top alternatives, as a direct forward of the target computes them. Greedy, every pipeline
    emits plain decoding's tokens with plain decoding's log-probabilities, including the bonus
    tokens and the tokens of tree paths (speculative rounds here accept several tokens)."""
    options = GREEDY if setting == "greedy" else SAMPLED
    results = generate(
        PROMPTS,
        engine=engine(name, False, max_logprobs=MAX_LOGPROBS),
        max_new_tokens=10,
        logprobs=MAX_LOGPROBS,
        **options,
    )
    for prompt, result in zip(PROMPTS, results):
        expected = target_logprobs(prompt, result.token_ids, options.get("temperature", 0.0))
        assert_token_logprobs(result.logprobs, expected, result.token_ids, MAX_LOGPROBS)
    if setting == "greedy":
        for result, plain in zip(results, plain_run(setting)):
            assert result.token_ids == plain.token_ids
            assert_same_logprobs(result.logprobs, plain.logprobs)
        # Rounds emitted bonus tokens after accepted drafts (adaptive's and multi-step plain
        # rounds emit several tokens too, counted as a round each).
        if not name.startswith("plain") and name != "adaptive":
            assert max(r.stats["accept_length_mean"] for r in results) > 1


@pytest.mark.parametrize("name", ["plain", "eagle tree", "frozen_kv_mtp", "adaptive"])
def test_overlapped_scheduling_reports_the_same_logprobs_cut_at_stops(name):
    """Overlapped, rounds run past a request's end; its log-probabilities are still those of
    its kept tokens, one per token, cut with them at a stop token."""
    options = {"max_new_tokens": 9, "logprobs": 2, "stop_token_ids": (3,)}
    runs = [
        generate(PROMPTS, engine=engine(name, overlap, max_logprobs=3), **options)
        for overlap in (False, True)
    ]
    for synchronous, overlapped in zip(*runs):
        assert overlapped.token_ids == synchronous.token_ids
        assert len(synchronous.logprobs) == len(synchronous.token_ids)
        assert_same_logprobs(overlapped.logprobs, synchronous.logprobs)
    assert any(r.finish_reason == "stop" for r in runs[0])


def test_each_request_gets_its_own_number_of_alternatives_or_none():
    """In one batch: a request asking for 1 gets one alternative per token, one asking for none
    gets ``None`` (``Request.logprobs`` empty), and neither changes the other's tokens."""
    eng = engine("eagle tree", False, max_logprobs=MAX_LOGPROBS)
    state = scheduler.new_state(eng)
    state, one = scheduler.add_request(
        eng, state, PROMPTS[0], sampling=scheduler.Sampling(logprobs=1), max_new_tokens=6
    )
    state, none = scheduler.add_request(eng, state, PROMPTS[1], max_new_tokens=6)
    finished = {}
    while not scheduler.is_idle(state):
        state, outputs = scheduler.step(eng, state)
        finished.update((o.rid, o.request) for o in outputs if o.finished)
    alone = generate([PROMPTS[1]], engine=engine("plain", False), max_new_tokens=6)[0]
    assert finished[none].output == alone.token_ids and finished[none].logprobs == ()
    entries = finished[one].logprobs
    assert [e.token_id for e in entries] == list(finished[one].output)
    assert all(len(e.top_logprobs) == 1 for e in entries)
    (plain,) = generate([PROMPTS[1]], engine=eng, max_new_tokens=6, logprobs=0)
    assert plain.logprobs is None and plain.token_ids == alone.token_ids


def test_logprobs_beyond_the_engines_max_are_refused_and_the_state_is_unchanged():
    eng = engine("plain", False, max_logprobs=2)
    state = scheduler.new_state(eng)
    with pytest.raises(ValueError, match=r"logprobs=3 .*max_logprobs=2.*max_logprobs >= 3"):
        scheduler.add_request(eng, state, [1], sampling=scheduler.Sampling(logprobs=3))
    assert state.waiting == () and state.next_rid == 0
    with pytest.raises(ValueError, match=r"logprobs=1 .*max_logprobs=0"):
        generate([[1]], engine=engine("plain", False), logprobs=1)
    with pytest.raises(ValueError, match="logprobs"):
        scheduler.Sampling(logprobs=-1)
    with pytest.raises(TypeError, match="logprobs"):
        scheduler.Sampling(logprobs=1.0)
    with pytest.raises(ValueError, match="max_logprobs"):
        engine("plain", False, max_logprobs=-1)


def test_generate_builds_an_engine_that_computes_what_it_asks_for(tmp_path):
    """Without an engine, ``generate(logprobs=N)`` builds one with ``max_logprobs=N``."""
    save_model(TARGET, tmp_path)
    (result,) = generate([[1, 2]], model=tmp_path, max_new_tokens=3, logprobs=2)
    assert [len(e["top_logprobs"]) for e in result.logprobs] == [2, 2, 2]
    (result,) = generate([[1, 2]], model=tmp_path, max_new_tokens=3)
    assert result.logprobs is None


def test_a_snapshot_is_refused_by_an_engine_computing_other_logprobs():
    """The batch's static number of alternatives is part of the engine's shape."""
    source = engine("plain", False, max_logprobs=2)
    state, _ = scheduler.add_request(source, scheduler.new_state(source), [1, 2])
    state, _ = scheduler.step(source, state)
    snap = scheduler.take_snapshot(source, state)
    with pytest.raises(ValueError, match="max_logprobs: snapshot 2, engine 0"):
        scheduler.restore(engine("plain", False), snap)


@settings(max_examples=20, deadline=None)
@given(
    logits=st.lists(
        st.lists(st.floats(-30, 30, width=32), min_size=VOCAB, max_size=VOCAB),
        min_size=2,
        max_size=2,
    ),
    temperatures=st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=2, max_size=2),
    num_top=st.integers(0, VOCAB + 2),
    data=st.data(),
)
def test_token_logprobs_are_the_log_softmax_of_the_tempered_logits(
    logits, temperatures, num_top, data
):
    """A row of each request: the chosen token's entry of ``log_softmax(logits / t)`` (greedy:
    ``t = 1``) and the ``num_top`` largest (at most the vocabulary); nothing for 0."""
    x = torch.tensor(logits)[:, None]
    tokens = torch.tensor([[data.draw(st.integers(0, VOCAB - 1))] for _ in logits])
    got = token_logprobs(x, torch.tensor(temperatures), tokens, num_top)
    if num_top == 0:
        assert got.top_logprobs.shape == (2, 1, 0) and not got.chosen.any()
        return
    scale = torch.tensor([t or 1.0 for t in temperatures])[:, None, None]
    want = torch.log_softmax(x / scale, dim=-1)
    torch.testing.assert_close(got.chosen, want.gather(-1, tokens[..., None])[..., 0])
    top = want.topk(min(num_top, VOCAB), dim=-1)
    torch.testing.assert_close(got.top_logprobs, top.values)
    torch.testing.assert_close(want.gather(-1, got.top_ids), got.top_logprobs)


def test_the_host_copy_carries_logprobs_bit_for_bit():
    """The float32 log-probabilities travel as bit patterns in the tokens' one copy and come
    back exactly (NaN-free extremes included)."""
    values = torch.tensor([[-0.0, -1e-30, -88.7, float("-inf")]])
    assert torch.equal(scheduler._floats(scheduler._bits(values)), values)


def test_a_tree_paths_tokens_read_the_distributions_of_their_path_nodes():
    """Token ``d`` of the emission reads the row of path node ``d`` (not of node ``d``): with
    one distinct distribution per node, each token's log-probability is its path node's."""
    logits = torch.randn(2, 6, VOCAB, generator=torch.Generator().manual_seed(1))
    accepted = make(
        AcceptResult,
        path=torch.tensor([[0, 2, 5], [0, 1, -1]]),
        emitted=torch.tensor([[4, 9, 1], [3, 8, -1]]),
        num_accepted=torch.tensor([2, 1]),
    )
    sampling = SamplingParams(
        temperature=torch.tensor([0.0, 2.0]),
        top_k=torch.tensor([1, 0]),
        top_p=torch.ones(2),
        min_p=torch.zeros(2),
        seed=torch.zeros(2, dtype=torch.int64),
        num_logprobs=3,
    )
    got = path_logprobs(logits, accepted, sampling)
    for row, (path, tokens, t) in enumerate([([0, 2, 5], [4, 9, 1], 1.0), ([0, 1], [3, 8], 2.0)]):
        want = torch.log_softmax(logits[row, path] / t, dim=-1)
        chosen = want.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(got.chosen[row, : len(path)], chosen)
        torch.testing.assert_close(got.top_logprobs[row, : len(path)], want.topk(3).values)
    off = path_logprobs(logits, accepted, attrs.evolve(sampling, num_logprobs=0))
    assert off.top_ids.shape == (2, 3, 0) and not off.chosen.any()


def test_rounds_compute_nothing_when_no_logprobs_can_be_asked_for():
    """An engine with ``max_logprobs=0`` reports zeros and no alternatives: no softmax, and
    every output leaf is still a tensor, as a captured round's must be."""
    eng = engine_from_model(TARGET, page_size=4, max_context=48)
    state, _ = scheduler.add_request(eng, scheduler.new_state(eng), [1, 2])
    state, _ = scheduler.step(eng, state)
    assert state.batch.sampling.num_logprobs == 0
    _, output = eng.pipeline.decode(eng.resources, state.batch)
    assert output.logprobs.top_ids.shape == (1, 1, 0) and not output.logprobs.chosen.any()
    assert all(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(output))


def test_the_command_line_prints_logprobs_in_its_json_on_request(capsys, tmp_path):
    """``--logprobs N``: ``--json`` gains ``logprobs``, one entry per token in
    ``Generation.logprobs``' shape; without it the key is absent."""
    folder = save_model(TARGET, tmp_path / "target")
    args = ["generate", "--model", str(folder), "--prompt-ids", "1,2,3", "--json"]
    assert cli.main([*args, "--max-new-tokens", "4", "--logprobs", "2"]) == 0
    payload = json.loads(capsys.readouterr().out)
    (expected,) = generate([[1, 2, 3]], model=folder, max_new_tokens=4, logprobs=2)
    assert payload["logprobs"] == expected.logprobs
    assert [len(e["top_logprobs"]) for e in payload["logprobs"]] == [2, 2, 2, 2]
    assert cli.main([*args, "--max-new-tokens", "4"]) == 0
    assert "logprobs" not in json.loads(capsys.readouterr().out)
