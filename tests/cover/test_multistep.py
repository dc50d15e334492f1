"""Multi-step plain decoding (issue 24, item 2): a round of K plain steps in one launch emits
exactly the tokens, log-probabilities, finish reasons and statistics of K single steps, greedy
and seeded sampled, with penalties and ``min_tokens``, with stop tokens, stop strings and token
budgets that land inside a launch (the tokens after a stop discarded, the text cut at the stop),
for batches whose requests finish at different steps, synchronous or overlapped; every page is
free again afterwards. ``decode_steps`` is refused where it cannot apply, naming the fix.

Other files run the multi-step pipeline ("plain 3 steps" of ``test_overlap.PIPELINES``) through
their every-pipeline checks: overlap, grammars, fault isolation, log-probabilities."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import prompt_batches
from test_cli import parse_one_object, run_cli

from speculum.models.loading import random_model, save_model
from speculum.models.tokenizer import Tokenizer, byte_level_tokenizer
from speculum.pipelines import plain
from speculum.runtime import scheduler
from speculum.runtime.engine import (
    GPU_DECODE_STEPS,
    SpecOptions,
    decode_steps,
    engine_from_model,
)
from speculum.runtime.generate import generate, run_to_completion

VOCAB = 258  # the byte-level tokenizer's: stop strings are text
MODEL = random_model(tiny_config(vocab_size=VOCAB), seed=3, std=0.3)
TOKENIZER = Tokenizer(byte_level_tokenizer())


def engine(steps: int, overlap: bool = False, page_size: int = 4, max_context: int = 48):
    """A plain engine of ``steps`` steps per round that applies penalties and reports two
    log-probabilities per token; no prefix cache, so that a finished batch holds no page."""
    return engine_from_model(
        MODEL,
        tokenizer=TOKENIZER,
        spec=SpecOptions(decode_steps=steps),
        overlap=overlap,
        page_size=page_size,
        max_context=max_context,
        penalties=True,
        max_logprobs=2,
        prefix_cache=False,
    )


def decoded(engine, requests: list[tuple[list[int], dict]]) -> list[scheduler.Request]:
    """The finished requests, in order, after every page was checked free again."""
    state, rids = scheduler.new_state(engine), []
    for prompt, options in requests:
        state, rid = scheduler.add_request(engine, state, prompt, **options)
        rids.append(rid)
    state, finished = run_to_completion(engine, state)
    assert int(state.allocator.num_free) == engine.config.num_pages - 1, "a page leaked"
    return [finished[rid] for rid in rids]


def observed(request: scheduler.Request) -> tuple:
    """Everything a user reads of a finished request, statistics included, but the values of
    the log-probabilities (:func:`assert_same_logprobs`)."""
    top_ids = [tuple(i for i, _ in t.top_logprobs) for t in request.logprobs]
    return (
        request.output,
        request.finish_reason,
        top_ids,
        request.num_forwards,
        request.round_lengths,
    )


def assert_same_logprobs(got: scheduler.Request, want: scheduler.Request) -> None:
    """The log-probabilities' values agree to float32 rounding: a CPU matmul over another
    batch (overlapped rows retire a step later) may round differently."""

    def values(request: scheduler.Request) -> list[float]:
        return [v for t in request.logprobs for v in (t.logprob, *(x for _, x in t.top_logprobs))]

    assert values(got) == pytest.approx(values(want), rel=1e-5, abs=1e-5)


@st.composite
def request_batches(draw) -> list[tuple[list[int], dict]]:
    """1-4 prompts, each greedy or seeded sampled, with its own budget and, half the time,
    penalties (``min_tokens`` among them)."""
    batch = []
    for prompt in draw(prompt_batches(VOCAB, max_batch=4)):
        max_new = draw(st.integers(1, 12))
        penalized = draw(st.booleans())
        sampling = scheduler.Sampling(
            temperature=draw(st.sampled_from([0.0, 1.0])),
            top_k=draw(st.sampled_from([0, 20])),
            seed=draw(st.integers(0, 2**31 - 1)),
            logprobs=2,
            repetition_penalty=1.3 if penalized else 1.0,
            frequency_penalty=0.5 if penalized else 0.0,
            min_tokens=draw(st.integers(0, max_new)) if penalized else 0,
        )
        batch.append((prompt, {"sampling": sampling, "max_new_tokens": max_new}))
    return batch


@settings(max_examples=10, deadline=None)
@given(
    batch=request_batches(),
    steps=st.integers(2, 4),  # 1 is the reference
    overlap=st.booleans(),
    page_size=st.sampled_from([1, 4]),
    max_context=st.sampled_from([16, 48]),
    data=st.data(),
)
def test_multi_step_rounds_emit_single_steps_tokens(
    batch, steps, overlap, page_size, max_context, data
):
    """Stops are drawn from the tokens and text a free run emits, so they fire at any step of a
    launch; requests finish at different steps (by a stop, their budget or the context limit).
    Multi-step and single-step decoding then agree on every token, log-probability, finish
    reason and round count, and leak no page."""
    single_step = engine(1, page_size=page_size, max_context=max_context)
    free = decoded(single_step, batch)
    stopped = []
    for (prompt, options), run in zip(batch, free):
        at = data.draw(st.integers(0, len(run.output) - 1))
        kind = data.draw(st.sampled_from(["none", "token", "string"]))
        text = TOKENIZER.decode(run.output[: at + 1])
        stops = {
            "none": {},
            "token": {"stop_token_ids": (run.output[at],)},
            "string": {"stop_strings": (text[-2:],)} if text else {},
        }[kind]
        stopped.append((prompt, options | stops))
    single = decoded(single_step, stopped)
    multi = decoded(engine(steps, overlap, page_size, max_context), stopped)
    assert [observed(r) for r in multi] == [observed(r) for r in single]
    for ours, theirs in zip(multi, single):
        assert_same_logprobs(ours, theirs)


def test_the_text_ends_exactly_at_a_stop_string_inside_a_launch():
    """A stop string completed in the middle of a 4-step launch: the request keeps the tokens
    up to it and its text stops before it, as with single steps."""
    (free,) = generate([[72, 105]], engine=engine(1), max_new_tokens=24)
    texts = [TOKENIZER.decode(free.token_ids[:n]) for n in range(len(free.token_ids) + 1)]
    # The prefill emits token 0 and launches of 4 tokens 1-4, 5-8, ...: token j is decided by
    # step (j - 1) % 4 of its launch. The first token after the first launch that completes a
    # two-character string new to the text, before its launch's last step:
    stop = next(
        j
        for j in range(5, len(free.token_ids))
        if (j - 1) % 4 != 3 and texts[j + 1][-2:] not in texts[j]
    )
    needle = texts[stop + 1][-2:]
    runs = [
        generate([[72, 105]], engine=engine(k), max_new_tokens=24, stop_strings=(needle,))[0]
        for k in (1, 4)
    ]
    for run in runs:
        assert run.finish_reason == "stop" and run.token_ids == free.token_ids[: stop + 1]
        assert run.text == texts[stop + 1][: texts[stop + 1].index(needle)]
    assert runs[0].stats["num_rounds"] == runs[1].stats["num_rounds"] == stop


def test_a_round_reserves_and_writes_k_cache_slots_ahead():
    """K steps write K cache entries past the committed tokens: the round's lookahead, which
    the scheduler reserves per request (twice, overlapped: a finished request runs one more
    round before its finish is known)."""
    for k in (1, 3):
        pipeline = engine(k).pipeline
        assert (pipeline.max_tokens_per_step, pipeline.kv_lookahead) == (k, k)
        assert engine(k, overlap=True).kv_lookahead == 2 * k


def test_the_default_is_one_step_on_the_cpu_and_more_on_cuda():
    assert engine_from_model(MODEL).pipeline.max_tokens_per_step == 1
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert decode_steps("plain", SpecOptions(), cpu) == 1
    assert decode_steps("plain", SpecOptions(), cuda) == GPU_DECODE_STEPS > 1
    assert decode_steps("eagle3", SpecOptions(), cuda) == 1  # its rounds have their own shape
    assert decode_steps("plain", SpecOptions(decode_steps=2), cuda) == 2


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_bad_decode_steps_are_refused_naming_the_setting(value):
    with pytest.raises((TypeError, ValueError), match="decode_steps"):
        SpecOptions(decode_steps=value)


def test_decode_steps_are_refused_for_speculative_and_ngram_engines():
    with pytest.raises(ValueError, match="only algorithm='plain' does.*Drop decode_steps"):
        engine_from_model(MODEL, algorithm="ngram", spec=SpecOptions(decode_steps=2))
    with pytest.raises(ValueError, match="num_steps >= 1"):
        plain.pipeline(num_steps=0)


def test_the_command_line_takes_decode_steps(capsys, tmp_path):
    folder = save_model(MODEL, tmp_path / "target")
    args = ["--model", str(folder), "--prompt-ids", "1,2,3", "--json", "--max-new-tokens", "9"]
    runs = []
    for extra in ([], ["--decode-steps", "4"]):
        status, out, _ = run_cli(capsys, *args, *extra)
        assert status == 0
        runs.append(parse_one_object(out))
    assert runs[0]["token_ids"] == runs[1]["token_ids"] and len(runs[1]["token_ids"]) == 9
    status, _, err = run_cli(capsys, *args, "--algorithm", "ngram", "--decode-steps", "2")
    assert status == 2 and "--decode-steps has no effect with --algorithm ngram" in err
    status, _, err = run_cli(capsys, *args, "--decode-steps", "0")
    assert status == 2 and "--decode-steps" in err
