"""Request controls under speculation (issue 25): stop strings end a request at the token that
completes one, inside a multi-token round too, with plain decoding's tokens and text whatever
the pipeline; the text returned and streamed excludes the stop string unless
``include_stop_str_in_output``; ``token_ids`` keep every emitted token. The command line takes
``--stop``, ``--include-stop-str-in-output`` and ``--ignore-eos``."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli import parse_one_object, run_cli
from test_eagle import VOCAB
from test_logprobs import assert_token_logprobs, target_logprobs
from test_overlap import PIPELINES, engine

from speculum.models.loading import random_model
from speculum.models.tokenizer import Tokenizer, byte_level_tokenizer
from speculum.runtime import cli, scheduler
from speculum.runtime.default_model import default_draft_dir, default_model_dir
from speculum.runtime.engine import build_engine, engine_from_model
from speculum.runtime.generate import generate

PROMPT = "def fibonacci(n):"
#: Completed by the first token of one of the bundled EAGLE-3 chain's rounds (" of" after
#: " function"), which emits two more tokens the stop discards.
STOP = "function of"


@pytest.fixture(scope="module")
def bundled() -> dict:
    """The bundled model, plain and with its EAGLE-3 draft (a chain of 3 steps)."""
    return {
        "plain": build_engine(default_model_dir(), algorithm="plain"),
        "eagle3 chain": build_engine(
            default_model_dir(), algorithm="eagle3", draft=default_draft_dir()
        ),
    }


def streamed(engine, prompt, **options):
    """``generate``'s one result and what ``on_tokens`` streamed: each step's ids and text."""
    steps = []
    (result,) = generate(
        prompt, engine=engine, on_tokens=lambda i, ids, text: steps.append((ids, text)), **options
    )
    return result, steps


def test_a_stop_string_inside_a_round_ends_it_as_plain_decoding_does(bundled):
    free, free_steps = streamed(bundled["eagle3 chain"], PROMPT, max_new_tokens=32)
    tokenizer = bundled["plain"].tokenizer
    assert STOP in free.text
    # The token that completes the stop string, and the free speculative round that emits it
    # with more tokens after it: the round the stop cuts short.
    ids = free.token_ids
    end = next(n for n in range(len(ids)) if STOP in tokenizer.decode(ids[: n + 1]))
    emitted = next(e for e in itertools.accumulate(len(s) for s, _ in free_steps) if e > end)
    assert emitted > end + 1, "the stop string must land inside a multi-token round"
    for name, built in bundled.items():
        result, steps = streamed(built, PROMPT, max_new_tokens=32, stop_strings=STOP)
        assert result.finish_reason == "stop", name
        assert result.token_ids == free.token_ids[: end + 1], name
        assert result.text == free.text[: free.text.index(STOP)], name
        assert "".join(text for _, text in steps) == result.text, name
        assert sum(len(ids) for ids, _ in steps) == len(result.token_ids), name
        kept, _ = streamed(
            built,
            PROMPT,
            max_new_tokens=32,
            stop_strings=STOP,
            include_stop_str_in_output=True,
        )
        assert kept.token_ids == result.token_ids, name
        assert kept.text == tokenizer.decode(result.token_ids), name
        assert kept.text.endswith(STOP) and kept.text.startswith(result.text + STOP), name


@pytest.fixture(scope="module")
def byte_engine():
    """Plain decoding of a random model over a byte-level tokenizer (one token, one byte)."""
    model = random_model(tiny_config(vocab_size=258), seed=3, std=0.3)
    tokenizer = Tokenizer(byte_level_tokenizer())
    return engine_from_model(model, tokenizer=tokenizer, page_size=4, max_context=64)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), include=st.booleans())
def test_stop_strings_are_cut_from_the_text_and_the_stream(byte_engine, data, include):
    """Any stop strings, some found in the free text (across tokens), some only begun there
    (held back while streaming, then shown): the stream adds up to the text, which ends before
    the first stop string unless ``include_stop_str_in_output``; the tokens are the free run's
    up to the one completing it."""
    prompt, budget = [72, 105], 20
    free, _ = streamed(byte_engine, [prompt], max_new_tokens=budget)
    text = free.text
    starts = st.integers(0, len(text) - 1)
    pieces = st.tuples(starts, st.integers(1, 4)).map(lambda s: text[s[0] : s[0] + s[1]])
    begun = st.tuples(starts, st.sampled_from(["\x00\x01", "\x02"])).map(
        lambda s: text[s[0] :] + s[1]
    )
    stops = data.draw(st.lists(st.one_of(pieces, begun), min_size=1, max_size=3))
    result, steps = streamed(
        byte_engine,
        [prompt],
        max_new_tokens=budget,
        stop_strings=stops,
        include_stop_str_in_output=include,
    )
    tokenizer = byte_engine.tokenizer
    decoded = tokenizer.decode(result.token_ids)
    assert result.token_ids == free.token_ids[: len(result.token_ids)]
    assert "".join(text for _, text in steps) == result.text
    found = [decoded.find(s) for s in stops if s in decoded]
    assert (result.finish_reason == "stop") == bool(found)
    if include or not found:
        assert result.text == decoded
    else:
        assert result.text == decoded[: min(found)]
        assert not any(s in result.text for s in stops)


def test_include_stop_str_in_output_is_a_flag_kept_on_the_request(byte_engine):
    state = scheduler.new_state(byte_engine)
    added, _ = scheduler.add_request(
        byte_engine, state, [72], stop_strings="ab", include_stop_str_in_output=True
    )
    assert added.waiting[0].include_stop_str_in_output is True
    with pytest.raises(TypeError, match=r"include_stop_str_in_output='yes'.*True or False"):
        scheduler.add_request(
            byte_engine, state, [72], stop_strings="ab", include_stop_str_in_output="yes"
        )
    assert state.waiting == () and state.next_rid == 0


def test_the_command_line_takes_stop_strings_and_ignore_eos(capsys, bundled):
    tokenizer = bundled["plain"].tokenizer
    common = ["--prompt", PROMPT, "--algorithm", "plain", "--max-new-tokens", "32"]
    status, out, _ = run_cli(capsys, *common, "--json")
    free = parse_one_object(out)
    status, out, _ = run_cli(capsys, *common, "--json", "--stop", "zzz", "--stop", STOP)
    stopped = parse_one_object(out)
    assert status == 0 and stopped["finish_reason"] == "stop"
    assert stopped["text"] == free["text"][: free["text"].index(STOP)]
    assert STOP in tokenizer.decode(stopped["token_ids"])
    status, out, _ = run_cli(capsys, *common, "--stop", STOP)  # streamed as it is decoded
    assert status == 0 and out == stopped["text"] + "\n"
    keep = ("--json", "--stop", STOP, "--include-stop-str-in-output")
    status, out, _ = run_cli(capsys, *common, *keep)
    assert parse_one_object(out)["text"] == tokenizer.decode(stopped["token_ids"])
    status, out, err = run_cli(capsys, *common, "--stop", "")
    assert status == 2 and "--stop is empty" in err and out == ""
    args = cli.parser().parse_args(["generate", *common, "--ignore-eos", "--stop=-x"])
    _, options = cli._generate_call(args, "plain")
    assert options["ignore_eos"] is True and options["stop_strings"] == ("-x",)
    assert options["include_stop_str_in_output"] is False
    assert cli.main(["generate", *common, "--json", "--stop", "-x"]) == 0
    assert "-x" not in parse_one_object(capsys.readouterr().out)["text"]


def test_a_prompts_file_line_may_keep_its_stop_string(capsys, bundled, tmp_path):
    lines = [{"prompt": PROMPT}, {"prompt": PROMPT, "include_stop_str_in_output": True}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    common = ["--algorithm", "plain", "--max-new-tokens", "32", "--stop", STOP]
    status, out, _ = run_cli(capsys, "--prompts-file", str(prompts), *common)
    cut, kept = (json.loads(line) for line in out.splitlines())
    assert status == 0 and cut["token_ids"] == kept["token_ids"]
    assert kept["text"] == bundled["plain"].tokenizer.decode(kept["token_ids"])
    assert kept["text"].startswith(cut["text"] + STOP) and STOP not in cut["text"]


# ---------------------------------------------------------------------------------------------
# logit_bias: added to the target's logits before everything else, at every tree node

BIAS_PROMPTS = [[1, 2, 3], [5], [9, 4, 12, 0, 7]]


@pytest.fixture(scope="module")
def free_markov():
    """Greedy plain decoding of the Markov target of ``test_eagle``, without a bias."""
    return generate(BIAS_PROMPTS, engine=engine("plain", False), max_new_tokens=12)


def banned_and_boosted(free) -> dict[int, float]:
    """A bias that bans the first token plain decoding picks for the first prompt and boosts
    one it never picks there."""
    first = free[0].token_ids
    unused = next(t for t in range(VOCAB) if t not in first)
    return {first[0]: -100.0, unused: 8.0}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_greedy_decoding_under_a_logit_bias_is_plain_decodings(name, free_markov):
    bias = banned_and_boosted(free_markov)
    plain = generate(
        BIAS_PROMPTS,
        engine=engine("plain", False, logit_bias=True),
        max_new_tokens=12,
        logit_bias=bias,
    )
    banned = min(bias, key=bias.get)
    assert plain[0].token_ids != free_markov[0].token_ids  # the bias changes the output
    assert all(banned not in r.token_ids for r in plain)
    results = generate(
        BIAS_PROMPTS,
        engine=engine(name, False, logit_bias=True),
        max_new_tokens=12,
        logit_bias=bias,
    )
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]


@pytest.mark.parametrize("name", ["plain", "eagle tree", "eagle3 sampled drafts", "dflash"])
def test_sampled_tokens_come_from_the_biased_distribution(name, free_markov):
    """Each sampled token's reported log-probability is ``log_softmax((logits + bias) / T)``
    of a direct forward, so the distribution that decided it had the bias; a banned token is
    never drawn."""
    bias = banned_and_boosted(free_markov)
    row = torch.zeros(VOCAB)
    row[list(bias)] = torch.tensor(list(bias.values()))
    temperature = 0.8
    results = generate(
        BIAS_PROMPTS,
        engine=engine(name, False, logit_bias=True, max_logprobs=2),
        max_new_tokens=10,
        temperature=temperature,
        seed=5,
        logprobs=2,
        logit_bias=bias,
    )
    for prompt, result in zip(BIAS_PROMPTS, results):
        unbiased = target_logprobs(prompt, result.token_ids, temperature)
        expected = torch.log_softmax(unbiased + row / temperature, dim=-1)
        assert min(bias, key=bias.get) not in result.token_ids
        assert_token_logprobs(result.logprobs, expected, result.token_ids, 2)


@pytest.mark.parametrize(
    ("bias", "error", "words"),
    [
        ({VOCAB: 1.0}, ValueError, ["logit_bias", f"[{VOCAB}]", "outside the vocabulary"]),
        ({3: float("nan")}, ValueError, ["logit_bias[3]", "nan", "[-100, 100]"]),
        ({3: 100.5}, ValueError, ["logit_bias[3]", "100.5", "[-100, 100]"]),
        ({-1: 1.0}, ValueError, ["logit_bias key -1"]),
        ({"x": 1.0}, TypeError, ["logit_bias key 'x'"]),
        ([(3, 1.0, 2)], TypeError, ["logit_bias", "must map token ids to biases"]),
    ],
)
def test_a_bad_logit_bias_is_refused_and_the_state_is_unchanged(bias, error, words):
    biased = engine("plain", False, logit_bias=True)
    state = scheduler.new_state(biased)
    with pytest.raises(error) as raised:
        scheduler.add_request(biased, state, [1, 2], sampling=scheduler.Sampling(logit_bias=bias))
    assert all(w in str(raised.value) for w in words), str(raised.value)
    assert state.waiting == () and state.next_rid == 0


def test_a_logit_bias_needs_an_engine_built_for_it():
    unbiased = engine("plain", False)
    state = scheduler.new_state(unbiased)
    sampling = scheduler.Sampling(logit_bias={"3": -100})  # OpenAI's JSON keys are strings
    assert sampling.logit_bias == ((3, -100.0),)
    with pytest.raises(ValueError, match="built without logit_bias.*logit_bias=True"):
        scheduler.add_request(unbiased, state, [1, 2], sampling=sampling)
    assert state.waiting == ()


def test_the_command_line_takes_a_logit_bias(capsys, tmp_path):
    common = ["--prompt", PROMPT, "--algorithm", "plain", "--max-new-tokens", "8", "--json"]
    status, out, _ = run_cli(capsys, *common)
    free = parse_one_object(out)["token_ids"]
    banned = json.dumps({str(free[0]): -100})
    status, out, _ = run_cli(capsys, *common, "--logit-bias", banned)
    biased = parse_one_object(out)["token_ids"]
    assert status == 0 and free[0] not in biased and biased != free
    (alone,) = generate(PROMPT, algorithm="plain", max_new_tokens=8, logit_bias={free[0]: -100})
    assert list(alone.token_ids) == biased
    for bad in ('{"5": 101}', "[5]", '{"5": "x"}', "{5: 1}"):
        status, out, err = run_cli(capsys, *common, "--logit-bias", bad)
        assert status == 2 and out == "" and "--logit-bias" in err and "[-100, 100]" in err
    # A prompt of a file may carry its own (OpenAI's JSON: string keys); a bad one is refused.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "logit_bias": {str(free[0]): -100}}) + "\n")
    status, out, _ = run_cli(capsys, "--prompts-file", str(prompts), *common[2:-1])
    assert status == 0 and json.loads(out)["token_ids"] == biased
    prompts.write_text(json.dumps({"prompt": PROMPT, "logit_bias": {"5": 200}}) + "\n")
    status, out, err = run_cli(capsys, "--prompts-file", str(prompts), *common[2:-1])
    assert status == 2 and "prompts.jsonl:1" in err and "logit_bias[5]" in err


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("controls", [{}, {"logit_bias": True, "max_logprobs": 2}])
def test_every_leaf_of_a_round_is_a_tensor(name, controls):
    """A CUDA graph captures records whose leaves are tensors (``runtime.graphs``; ``None``,
    an optional field a round leaves empty, is a constant of the graph): a control an engine
    was built without must still be a tensor (with no columns), never None, in the batch state
    a round reads and in everything it returns."""
    built = engine(name, False, **controls)
    state, _ = scheduler.add_request(built, scheduler.new_state(built), [3, 4], max_new_tokens=6)
    state, _ = scheduler.step(built, state)
    round_output = built.pipeline.decode(built.resources, state.batch)
    leaves = torch.utils._pytree.tree_leaves((state.batch, round_output))
    assert leaves and all(leaf is None or isinstance(leaf, torch.Tensor) for leaf in leaves)
    controls_in_and_out = (state.batch.sampling, round_output[0].sampling)
    control_leaves = torch.utils._pytree.tree_leaves(controls_in_and_out)
    assert control_leaves and all(isinstance(leaf, torch.Tensor) for leaf in control_leaves)
