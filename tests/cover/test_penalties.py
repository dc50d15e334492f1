"""Penalties and ``min_tokens`` under speculation (issue 25, item 2): repetition, presence and
frequency penalties and ``min_tokens`` give every pipeline, chains, trees and adaptive, plain
decoding's tokens (greedy) and law (sampled), because the distribution at each tree node
counts the draft tokens on its path; greedy plain decoding with a repetition penalty is
transformers'. Bad settings are refused with their name, value and range; the command line
takes ``--repetition-penalty``, ``--presence-penalty``, ``--frequency-penalty`` and
``--min-tokens``."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli import parse_one_object, run_cli
from test_eagle import VOCAB
from test_generate import hf_model
from test_overlap import PIPELINES, engine

from speculum.models.loading import load_model
from speculum.runtime import scheduler
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.spec.draft import top_children
from speculum.spec.sampling import count_emitted, penalized_logits
from speculum.spec.tree import tree_mask, tree_path_tokens
from speculum.state.sampling import Penalties, SamplingParams
from speculum.state.tree import DraftTree

PROMPTS = [[1, 2, 3], [5], [9, 4, 12, 0, 7], [3, 3, 3]]

#: Strong enough to overrule the Markov target's vote inside a round: with the draft tokens on
#: the path left out of the counts, the chains and trees of this file differ from plain
#: decoding (checked by hand when these were chosen).
STRONG = [
    {"repetition_penalty": 3.0},
    {"frequency_penalty": 2.0},
    {"presence_penalty": 2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": 1.3, "frequency_penalty": 1.0},
]


def with_settings(prompts, settings_per_prompt):
    """Mapping prompts, each with its own settings (``generate``'s per-prompt form)."""
    return [{"prompt_ids": p, **s} for p, s in zip(prompts, settings_per_prompt)]


def token_ids(results):
    return [list(r.token_ids) for r in results]


# ---------------------------------------------------------------------------------------------
# The penalty of a path position is the penalty of the whole sequence prefix


def reference_logits(logits, prompt, output, setting, stops):
    """One row's logits penalized from scratch, token by token, for the sequence ``prompt +
    output`` (vLLM's order: min_tokens ban, repetition, frequency, presence)."""
    x = logits.float().clone()
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731 (the device's dtype)
    if len(output) < setting["min_tokens"]:
        x[list(stops)] = float("-inf")
    for token in set(prompt) | set(output):
        r = f32(setting["repetition"])
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token in set(output):
        x[token] = x[token] - f32(setting["frequency"]) * output.count(token)
        x[token] = x[token] - f32(setting["presence"])
    return x


def penalty_rows(prompts, outputs, settings_list, stops, vocab) -> Penalties:
    """The device rows of requests with these prompts, outputs so far and settings."""
    rows = len(prompts)
    prompt = torch.zeros(rows, vocab, dtype=torch.bool)
    stop = torch.zeros(rows, vocab, dtype=torch.bool)
    counts = torch.zeros(rows, vocab, dtype=torch.int32)
    for row in range(rows):
        prompt[row, prompts[row]] = True
        stop[row, list(stops[row])] = True
        for token in outputs[row]:
            counts[row, token] += 1
    column = lambda name, dtype=torch.float32: torch.tensor(  # noqa: E731
        [s[name] for s in settings_list], dtype=dtype
    )
    return Penalties(
        repetition=column("repetition"),
        presence=column("presence"),
        frequency=column("frequency"),
        min_tokens=column("min_tokens", torch.int64),
        num_output=torch.tensor([len(o) for o in outputs], dtype=torch.int64),
        prompt=prompt,
        counts=counts,
        stops=stop,
    )


@st.composite
def trees(draw, vocab: int, max_nodes: int = 7):
    """A random draft tree (node 0 the root, parents before children) over ``vocab``."""
    num_nodes = draw(st.integers(1, max_nodes))
    parents, depths = [-1], [0]
    for node in range(1, num_nodes):
        parent = draw(st.integers(0, node - 1))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=num_nodes, max_size=num_nodes))
    return tokens, parents, depths


penalty_settings = st.fixed_dictionaries(
    {
        "repetition": st.floats(0.2, 4.0),
        "presence": st.floats(-2.0, 2.0),
        "frequency": st.floats(-2.0, 2.0),
        "min_tokens": st.integers(0, 6),
    }
)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 9), rows=st.integers(1, 3))
def test_a_path_position_is_penalized_as_the_whole_prefix_would_be(data, vocab, rows):
    """``penalized_logits`` over a tree (the round's start counts plus the path's draft
    tokens, ``tree_path_tokens``) equals the penalty computed from scratch for the sequence the
    node ends: prompt, output so far, then the path's draft tokens. Rows without penalties
    pass bit for bit."""
    tokens_st = st.lists(st.integers(0, vocab - 1), max_size=5)
    prompts = [data.draw(tokens_st.filter(bool)) for _ in range(rows)]
    outputs = [data.draw(tokens_st) for _ in range(rows)]
    setting = [data.draw(penalty_settings) for _ in range(rows)]
    stops = [data.draw(st.sets(st.integers(0, vocab - 1), max_size=2)) for _ in range(rows)]
    drawn = [data.draw(trees(vocab)) for _ in range(rows)]
    width = max(len(t[0]) for t in drawn)
    # Padding nodes hang off the root; only the drawn nodes are compared.
    pad = lambda rows_, fill: [r + [fill] * (width - len(r)) for r in rows_]  # noqa: E731
    tree = DraftTree(
        tokens=torch.tensor(pad([t[0] for t in drawn], 0)),
        parents=torch.tensor([p + [0] * (width - len(p)) for _, p, _ in drawn]),
        depths=torch.tensor(pad([[*d] for *_, d in drawn], 1)),
    )
    logits = torch.randn(rows, width, vocab, generator=torch.Generator().manual_seed(vocab))
    penalties = penalty_rows(prompts, outputs, setting, stops, vocab)
    got = penalized_logits(logits, penalties, tree_path_tokens(tree, tree_mask(tree)))
    for row, (tokens, parents, _) in enumerate(drawn):
        for node in range(len(tokens)):
            path, at = [], node
            while at > 0:
                path.insert(0, tokens[at])
                at = parents[at]
            expected = reference_logits(
                logits[row, node], prompts[row], outputs[row] + path, setting[row], stops[row]
            )
            torch.testing.assert_close(got[row, node], expected, rtol=1e-6, atol=1e-6)
    off = {"repetition": 1.0, "presence": 0.0, "frequency": 0.0, "min_tokens": 0}
    neutral = penalty_rows(prompts, outputs, [off] * rows, stops, vocab)
    assert torch.equal(
        penalized_logits(logits, neutral, tree_path_tokens(tree, tree_mask(tree))), logits
    )


def test_only_emitted_tokens_are_counted():
    penalties = penalty_rows(
        [[0]],
        [[1]],
        [{"repetition": 1.0, "presence": 0.0, "frequency": 0.0, "min_tokens": 0}],
        [set()],
        4,
    )
    tokens = torch.tensor([[2, 2, 3, -1]])
    counted = count_emitted(penalties, tokens, torch.tensor([2]))  # the 3 was cut off
    assert counted.counts.tolist() == [[0, 1, 2, 0]] and counted.num_output.tolist() == [3]
    assert penalties.counts.tolist() == [[0, 1, 0, 0]]  # the record handed in is unchanged


@pytest.mark.parametrize("reduced", [False, True], ids=["full vocabulary", "reduced vocabulary"])
def test_top_k_drafting_ranks_the_controlled_draft_logits(reduced):
    """EAGLE-style top-k drafting ranks the draft's logits after the requests' bias and
    penalties, counting each row's path: over a reduced vocabulary (EAGLE-3's ``target_ids``)
    each column is penalized as its target token is."""
    vocab, columns = 8, torch.tensor([5, 2, 7, 0, 3])
    logits = torch.tensor([[[3.0, 2.9, 2.8, 2.7, 2.6]] * 2])  # [batch 1, rows 2, columns]
    if reduced:
        draft = SimpleNamespace(draft_logits=lambda h: h, target_ids=columns)
    else:
        draft = SimpleNamespace(logits=lambda h: torch.zeros(1, 2, vocab).index_copy(2, columns, h))
    setting = {"repetition": 4.0, "presence": 0.0, "frequency": 0.0, "min_tokens": 0}
    penalties = penalty_rows([[2]], [[5]], [setting], [set()], vocab)
    sampling = SamplingParams(
        temperature=torch.zeros(1),
        top_k=torch.zeros(1, dtype=torch.int64),
        top_p=torch.ones(1),
        min_p=torch.zeros(1),
        seed=torch.zeros(1, dtype=torch.int64),
        logit_bias=torch.zeros(1, vocab).index_fill(1, torch.tensor([0]), 5.0),
        penalties=penalties,
    )
    path = torch.tensor([[[-1], [7]]])  # row 1's path holds token 7
    _, ranked = top_children(draft, logits, 3, sampling, path)
    # 5 (output) and 2 (prompt) are penalized everywhere, 7 on row 1's path; 0 is boosted.
    assert ranked.tolist() == [[[0, 7, 3], [0, 3, 5]]]


# ---------------------------------------------------------------------------------------------
# Greedy: transformers' repetition penalty, and every pipeline equals plain decoding


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_repetition_penalty_equals_transformers(penalty, tmp_path):
    hf = hf_model("Llama", tmp_path)
    built = engine_from_model(load_model(tmp_path), page_size=4, max_context=64, penalties=True)
    prompts = [[3, 17, 42, 5], [9] * 11, [1, 2]]
    results = generate(
        prompts, engine=built, max_new_tokens=16, ignore_eos=True, repetition_penalty=penalty
    )
    free = generate(prompts, engine=built, max_new_tokens=16, ignore_eos=True)
    assert token_ids(results) != token_ids(free)  # the penalty changes the output
    for prompt, result in zip(prompts, results):
        expected = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
            repetition_penalty=penalty,
        )[0, len(prompt) :]
        assert list(result.token_ids) == expected.tolist()


@pytest.fixture(scope="module")
def plain_strong():
    """Greedy plain decoding of ``PROMPTS`` under each ``STRONG`` setting."""
    built = engine("plain", False, penalties=True)
    return [
        token_ids(generate(with_settings(PROMPTS, [s] * 4), engine=built, max_new_tokens=16))
        for s in STRONG
    ]


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_strong_penalties_inside_rounds_give_plain_decodings_tokens(name, plain_strong):
    built = engine(name, False, penalties=True)
    for setting, expected in zip(STRONG, plain_strong):
        results = generate(with_settings(PROMPTS, [setting] * 4), engine=built, max_new_tokens=16)
        assert token_ids(results) == expected, setting


request_settings = st.fixed_dictionaries(
    {},
    optional={
        "repetition_penalty": st.sampled_from([0.5, 1.0, 1.2, 2.5]),
        "presence_penalty": st.sampled_from([-1.0, 0.0, 0.8, 2.0]),
        "frequency_penalty": st.sampled_from([-0.5, 0.0, 1.0, 2.0]),
        "min_tokens": st.integers(0, 10),
        "stop_token_ids": st.sets(st.integers(0, VOCAB - 1), max_size=2).map(tuple),
    },
)


@pytest.mark.parametrize("name", sorted(set(PIPELINES) - {"plain"}))
@settings(max_examples=3, deadline=None)
@given(
    prompts=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_size=1, max_size=4
    ),
    data=st.data(),
    overlap=st.booleans(),
    prefill_budget=st.integers(2, 8),
)
def test_any_mix_of_penalized_requests_decodes_as_plain_decoding(
    name, prompts, data, overlap, prefill_budget
):
    """Greedy, requests with and without penalties and min_tokens (stop tokens that would
    fire early among them) in one batch, prompts prefilled in chunks, overlapped or not: every
    pipeline emits plain decoding's tokens and finishes each request for plain decoding's
    reason."""
    mix = with_settings(prompts, [data.draw(request_settings) for _ in prompts])
    plain = generate(mix, engine=engine("plain", False, penalties=True), max_new_tokens=12)
    built = engine(name, overlap, penalties=True, prefill_budget=prefill_budget)
    results = generate(mix, engine=built, max_new_tokens=12)
    assert [(r.token_ids, r.finish_reason) for r in results] == [
        (r.token_ids, r.finish_reason) for r in plain
    ]
    for request, result in zip(mix, results):
        if request.get("min_tokens", 0) and result.finish_reason == "stop":
            assert len(result.token_ids) > request["min_tokens"] - 1


@pytest.mark.parametrize("name", ["plain", "eagle tree", "dflash"])
def test_min_tokens_holds_back_the_stop_tokens(name):
    """A stop token plain decoding emits at once may not end the request before
    ``min_tokens``; afterwards it ends it as usual."""
    (free,) = generate([[1, 2, 3]], engine=engine("plain", False), max_new_tokens=12)
    stop = free.token_ids[1]
    built = engine(name, False, penalties=True)
    (held,) = generate(
        [[1, 2, 3]], engine=built, max_new_tokens=12, stop_token_ids=stop, min_tokens=6
    )
    assert len(held.token_ids) >= 6 and stop not in held.token_ids[:5]
    assert held.finish_reason == "length" or held.token_ids[-1] == stop


def test_a_restored_snapshot_decodes_on_with_the_counts_it_had():
    """The counts are batch-state tensors: a snapshot taken mid-decoding keeps them by value,
    so decoding on after a restore gives the tokens decoding on gave the first time, which
    are plain decoding's."""
    built = engine("eagle tree", False, penalties=True)
    sampling = scheduler.Sampling(**STRONG[3])
    state = scheduler.new_state(built)
    for prompt in PROMPTS:
        state, _ = scheduler.add_request(built, state, prompt, sampling=sampling, max_new_tokens=16)
    for _ in range(3):
        state, _ = scheduler.step(built, state)
    snap = scheduler.take_snapshot(built, state)
    _, first = run_to_completion(built, state)
    _, again = run_to_completion(built, scheduler.restore(built, snap))
    outputs = [list(first[rid].output) for rid in sorted(first)]
    assert [list(again[rid].output) for rid in sorted(again)] == outputs
    plain = engine("plain", False, penalties=True)
    assert outputs == token_ids(
        generate(with_settings(PROMPTS, [STRONG[3]] * 4), engine=plain, max_new_tokens=16)
    )


# ---------------------------------------------------------------------------------------------
# Sampled: the speculative law is plain decoding's penalized law


def exact_penalized_joint(stats, prompt, setting, num_tokens):
    """The target's law of the first ``num_tokens`` tokens after ``prompt`` under the
    penalties of ``setting`` (from scratch for every prefix), flat, last token fastest."""
    vocab = stats.VOCAB
    rows = {
        "repetition": setting["repetition_penalty"],
        "presence": setting["presence_penalty"],
        "frequency": setting["frequency_penalty"],
        "min_tokens": 0,
    }
    joint = np.ones(1)
    for step in range(num_tokens):
        outputs = [list(t) for t in itertools.product(range(vocab), repeat=step)]
        logits = stats.next_token_logits(stats.TARGET, [prompt + o for o in outputs])
        penalized = torch.stack(
            [reference_logits(x, prompt, o, rows, set()) for x, o in zip(logits, outputs)]
        )
        probs = torch.softmax(penalized.double() / setting["temperature"], dim=-1).numpy()
        joint = (joint[:, None] * probs).reshape(-1)
    return joint


@pytest.mark.parametrize(
    "spec",
    [
        {"num_steps": 3, "topk": 2, "num_draft_tokens": 5},
        {"num_steps": 2, "topk": 2, "sample_drafts": True},
    ],
    ids=["eagle tree", "sampled chains"],
)
def test_sampled_tokens_follow_plain_decodings_penalized_law(spec):
    """Seeded sampling under penalties: the empirical joint law of the first three tokens of
    a speculative pipeline is the exact penalized law (chi-square and total variation, as
    ``test_eagle_stats``). The first is the prefill's, the second the first round's root's;
    the third is decided at depth 1 of that round when its draft token was accepted, where
    the penalties must count that draft token (left out, this test fails)."""
    import test_eagle_stats as stats

    from speculum.runtime.engine import SpecOptions

    setting = {
        "temperature": 1.0,
        "repetition_penalty": 1.6,
        "presence_penalty": 0.6,
        "frequency_penalty": 0.9,
    }
    prompt = [1, 4, 2]
    built = engine_from_model(
        stats.TARGET,
        algorithm="eagle",
        draft=stats.head_for("eagle", "agree"),
        spec=SpecOptions(**spec),
        page_size=stats.PAGE_SIZE,
        max_batch=stats.CHUNK,
        max_context=stats.MAX_CONTEXT,
        prefill_budget=stats.CHUNK * len(prompt),
        num_pages=stats.CHUNK * 4 + 1,
        penalties=True,
    )
    (tokens,), (histogram,) = stats.sample_tokens(built, [(prompt, setting)], 6000, 3)
    result = stats.joint_stats(tokens, exact_penalized_joint(stats, prompt, setting, 3))
    assert stats.lossless(result), result
    assert sum(histogram[2:]) > 0.2 * sum(histogram), histogram  # draft tokens get accepted


# ---------------------------------------------------------------------------------------------
# Refusals and the command line


@pytest.mark.parametrize(
    ("setting", "error", "words"),
    [
        ({"repetition_penalty": 0.0}, ValueError, ["repetition_penalty=0.0", "> 0"]),
        ({"repetition_penalty": -1}, ValueError, ["repetition_penalty=-1", "> 0"]),
        ({"presence_penalty": 2.5}, ValueError, ["presence_penalty=2.5", "[-2, 2]"]),
        ({"frequency_penalty": float("nan")}, ValueError, ["frequency_penalty=nan", "[-2, 2]"]),
        ({"frequency_penalty": "1"}, TypeError, ["frequency_penalty='1'", "not str"]),
        ({"min_tokens": -1}, ValueError, ["min_tokens=-1", ">= 0"]),
        ({"min_tokens": 2.0}, TypeError, ["min_tokens=2.0", "integer"]),
    ],
)
def test_bad_penalties_are_refused_naming_the_setting(setting, error, words):
    with pytest.raises(error) as raised:
        scheduler.Sampling(**setting)
    assert all(w in str(raised.value) for w in words), str(raised.value)


def test_min_tokens_past_max_new_tokens_and_engines_without_penalties_are_refused():
    built = engine("plain", False, penalties=True)
    state = scheduler.new_state(built)
    with pytest.raises(ValueError, match=r"min_tokens=9 exceeds max_new_tokens=8.*lower"):
        scheduler.add_request(
            built, state, [1], sampling=scheduler.Sampling(min_tokens=9), max_new_tokens=8
        )
    without = engine("plain", False)
    bare = scheduler.new_state(without)
    for setting in ({"repetition_penalty": 1.1}, {"min_tokens": 1}):
        with pytest.raises(ValueError, match="built without penalties.*penalties=True"):
            scheduler.add_request(without, bare, [1], sampling=scheduler.Sampling(**setting))
    assert state.waiting == () and bare.waiting == () and state.next_rid == 0
    # Penalties switched off need no such engine.
    scheduler.add_request(without, bare, [1], sampling=scheduler.Sampling(repetition_penalty=1))


@pytest.mark.parametrize("name", ["plain", "eagle tree", "adaptive"])
def test_every_leaf_of_a_penalized_round_is_a_tensor(name):
    """A CUDA graph captures records whose leaves are all tensors (``runtime.graphs``)."""
    built = engine(name, False, penalties=True)
    state, _ = scheduler.add_request(built, scheduler.new_state(built), [3, 4], max_new_tokens=6)
    state, _ = scheduler.step(built, state)
    leaves = torch.utils._pytree.tree_leaves(
        (state.batch, built.pipeline.decode(built.resources, state.batch))
    )
    assert leaves and all(isinstance(leaf, torch.Tensor) for leaf in leaves)


def test_the_command_line_takes_penalties_and_min_tokens(capsys, tmp_path):
    prompt = "def fibonacci(n):"
    common = ["--prompt", prompt, "--algorithm", "plain", "--max-new-tokens", "12", "--json"]
    flags = ["--repetition-penalty", "1.5", "--presence-penalty", "0.5"]
    flags += ["--frequency-penalty", "-0.5", "--min-tokens", "4"]
    status, out, _ = run_cli(capsys, *common, *flags)
    assert status == 0
    (expected,) = generate(
        prompt,
        algorithm="plain",
        max_new_tokens=12,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        min_tokens=4,
    )
    (free,) = generate(prompt, algorithm="plain", max_new_tokens=12)
    assert parse_one_object(out)["token_ids"] == list(expected.token_ids) != list(free.token_ids)
    for flag, bad, rule in [
        ("--repetition-penalty", "0", "> 0.0"),
        ("--presence-penalty", "3", "<= 2.0"),
        ("--frequency-penalty", "x", ">= -2.0"),
        ("--min-tokens", "-1", ">= 0"),
    ]:
        status, out, err = run_cli(capsys, *common, flag, bad)
        assert status == 2 and out == "" and flag in err and rule in err, err
    # A line of a prompts file may carry its own; a bad one is refused naming the line.
    prompts = tmp_path / "prompts.jsonl"
    line = {"prompt": prompt, "repetition_penalty": 1.5, "presence_penalty": 0.5}
    line |= {"frequency_penalty": -0.5, "min_tokens": 4}
    prompts.write_text(json.dumps(line) + "\n" + json.dumps({"prompt": prompt}) + "\n")
    status, out, _ = run_cli(capsys, "--prompts-file", str(prompts), *common[2:-1])
    own, shared = (json.loads(x)["token_ids"] for x in out.splitlines())
    assert status == 0 and own == list(expected.token_ids) and shared == list(free.token_ids)
    prompts.write_text(json.dumps({"prompt": prompt, "presence_penalty": 5}) + "\n")
    status, out, err = run_cli(capsys, "--prompts-file", str(prompts), *common[2:-1])
    assert status == 2 and "prompts.jsonl:1" in err and "presence_penalty" in err, err
