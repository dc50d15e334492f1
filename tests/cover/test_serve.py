"""``speculum serve`` over real HTTP: a server on 127.0.0.1 (uvicorn in a thread, or the command
in a subprocess), talked to with the official ``openai`` client and httpx.

The main server decodes the tiny test model with itself as a STANDALONE draft, so greedy rounds
accept every draft token and the acceptance series move; its greedy output must equal
``speculum.generate``'s for the same engine settings, token for token. A second server (plain,
two requests at most, no queue, an API key, no chat template, and a target whose embedding row of
token 255 is NaN) covers refusals, the full queue, disconnects and a request the engine cannot
decode. Readiness and drains are waited for by polling, never by sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import attrs
import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from speculum.models.loading import random_model, save_model
from speculum.models.tokenizer import load_tokenizer
from speculum.runtime import scheduler
from speculum.runtime.default_model import TINY_CONFIG, write_tiny_model
from speculum.runtime.generate import engine_for, generate
from speculum.serving.app import create_app
from speculum.serving.chat import ChatTemplate, load_chat_template, render

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
#: The main server's engine: the tiny model drafting for itself.
SPEC = {"algorithm": "standalone", "num_steps": 3, "max_context": 256}
#: The token whose embedding row is NaN in the second server's target.
POISON = 255
KEY = "sekrit"
#: How long a wait for the server may take before the test fails (it takes well under a second).
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The tiny model with a chat template, and a copy whose token ``POISON`` is NaN."""
    root = tmp_path_factory.mktemp("serve")
    target = write_tiny_model(root / "target")
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    # Untied, so that only the input row is NaN: a request fails once the token is fed.
    poisoned = random_model(attrs.evolve(TINY_CONFIG, tie_word_embeddings=False), seed=1)
    with torch.no_grad():
        poisoned.model.embed_tokens.weight[POISON] = float("nan")
    save_model(poisoned, root / "poisoned")
    (root / "poisoned" / "tokenizer.json").write_text((target / "tokenizer.json").read_text())
    return {"target": target, "poisoned": root / "poisoned"}


@contextmanager
def running(app) -> Iterator[str]:
    """``app`` served by uvicorn in a thread on a socket bound here; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()


def wait_for(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (connection errors count as not yet) until it holds."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    raise AssertionError("the server never got there")


@pytest.fixture(scope="module")
def main_url(folders) -> Iterator[str]:
    target = folders["target"]
    engine = engine_for(
        model=target, draft=target, max_logprobs=5, logit_bias=True, penalties=True, **SPEC
    )
    app = create_app(engine, served_model_names=["tiny"], chat_template=load_chat_template(target))
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def small_url(folders) -> Iterator[str]:
    engine = engine_for(model=folders["poisoned"], algorithm="plain", max_batch=2, logit_bias=True)
    app = create_app(engine, served_model_names=["small"], api_key=KEY, max_queue=0)
    with running(app) as url:
        yield url


def client(url: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, **options)


def reference(folders, prompts: list, max_new_tokens: int, **settings) -> list:
    """``speculum.generate``'s results for the main server's engine settings."""
    target = folders["target"]
    engine = {"model": target, "draft": target, **SPEC}
    return generate(prompts, max_new_tokens=max_new_tokens, **engine, **settings)


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics``, parsed by prometheus-client's parser, by name and labels."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def idle(url: str) -> bool:
    """No request running or waiting, and no KV page held."""
    m = metrics(url)
    names = ("speculum:num_requests_running", "speculum:num_requests_waiting")
    return all(m[(n, ())] == 0 for n in names) and m[("speculum:kv_pages_used", ())] == 0


PROMPTS = [f"def f{i}(x):\n    return x * {i}" for i in range(16)]
#: A JSON schema the tiny model's answers follow (short, so that they finish).
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _schema_format(schema: dict) -> dict:
    """OpenAI's ``response_format`` for ``schema``."""
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_sixteen_concurrent_greedy_requests_each_equal_generate(main_url, folders) -> None:
    """16 concurrent greedy completions, half of them streamed, each get exactly
    ``speculum.generate``'s tokens, text, finish reason and token counts."""
    expected = reference(folders, PROMPTS, 12)
    tokenizer = load_tokenizer(folders["target"])
    api = openai.AsyncOpenAI(base_url=f"{main_url}/v1", api_key="none", max_retries=0)

    async def one(i: int) -> tuple[list[int], str, str, dict]:
        options = dict(model="tiny", prompt=PROMPTS[i], max_tokens=12, temperature=0)
        extra = {"return_token_ids": True}
        if i % 2:
            stream = await api.completions.create(
                **options, stream=True, stream_options={"include_usage": True}, extra_body=extra
            )
            ids, text, reason, usage = [], "", None, None
            async for chunk in stream:
                for choice in chunk.choices:
                    ids += choice.model_extra["token_ids"]
                    text += choice.text
                    reason = choice.finish_reason or reason
                usage = chunk.usage or usage
            return ids, text, reason, usage.model_dump()
        done = await api.completions.create(**options, extra_body=extra)
        choice = done.choices[0]
        return (
            choice.model_extra["token_ids"],
            choice.text,
            choice.finish_reason,
            done.usage.model_dump(),
        )

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(16)))

    for i, (ids, text, reason, usage) in enumerate(asyncio.run(all_of_them())):
        assert ids == list(expected[i].token_ids)
        assert text == expected[i].text
        assert reason == expected[i].finish_reason
        assert usage["prompt_tokens"] == len(tokenizer.encode(PROMPTS[i]))
        assert usage["completion_tokens"] == len(ids)
        assert usage["total_tokens"] == usage["prompt_tokens"] + len(ids)
    assert {r.finish_reason for r in expected} == {"stop", "length"}  # both kinds are covered


def test_usage_reports_the_speculative_statistics(main_url) -> None:
    """The ``speculative`` usage extension: the self-draft accepts every draft token, so each
    round emits num_steps + 1 tokens (a round may be cut by max_tokens)."""
    done = client(main_url).completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0
    )
    spec = done.usage.model_extra["speculative"]
    assert spec["algorithm"] == "standalone"
    assert spec["accepted_draft_tokens"] > 0
    assert spec["accept_length_mean"] > 2.0
    # Every round but the prefill's first token emitted 1 + its accepted drafts.
    histogram_tokens = spec["num_rounds"] + spec["accepted_draft_tokens"]
    assert histogram_tokens >= done.usage.completion_tokens - 1


def test_streamed_chat_equals_the_whole_answer_and_generate(main_url, folders) -> None:
    """A streamed chat completion opens with the assistant role, its pieces add up to the
    non-streamed answer, which is ``generate``'s continuation of the rendered template."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    api = client(main_url)
    whole = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    chunks = list(
        api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    text = render(load_chat_template(folders["target"]), messages)
    prompt = load_tokenizer(folders["target"]).encode(text, add_special_tokens=False)
    (expected,) = reference(folders, [prompt], 10)
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.prompt_tokens == len(prompt)


def test_the_stream_is_server_sent_events_ending_with_done(main_url) -> None:
    """On the wire: ``data: {json}`` events, the last one ``data: [DONE]``."""
    body = {"prompt": "x", "max_tokens": 3, "temperature": 0, "stream": True}
    lines = httpx.post(f"{main_url}/v1/completions", json=body).text.split("\n\n")
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_logprobs_in_openai_formats_equal_generate(main_url, folders) -> None:
    """Completions' ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset) and chat's
    (``content`` entries with token, logprob, bytes, top_logprobs) carry ``generate``'s
    values."""
    (expected,) = reference(folders, [PROMPTS[3]], 6, logprobs=2)
    api = client(main_url)
    done = api.completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=2
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0
    for got, want in zip(lp.token_logprobs, expected.logprobs):
        assert got == pytest.approx(want["logprob"], abs=1e-4)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    chat = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.bytes) == 1  # a byte-level token is one byte, whatever its text
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6


def assert_vllm_prompt_logprobs(got: list, expected: list, top: int, tokenizer) -> None:
    """vLLM's ``prompt_logprobs`` (None, then per prompt token ``{"token id": {"logprob",
    "rank", "decoded_token"}}``, the prompt token first) holding ``generate``'s entries."""
    assert got[0] is None and expected[0] is None
    assert len(got) == len(expected)
    for shown, want in zip(got[1:], expected[1:]):
        token, alternatives = str(want["token_id"]), want["top_logprobs"]
        assert len(alternatives) == top
        assert next(iter(shown)) == token
        assert set(shown) == {token} | {str(a["token_id"]) for a in alternatives}
        assert shown[token]["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
        ranks = {str(a["token_id"]): rank for rank, a in enumerate(alternatives, 1)}
        assert shown[token]["rank"] == ranks.get(token)
        for a in alternatives:
            entry = shown[str(a["token_id"])]
            assert entry["logprob"] == pytest.approx(a["logprob"], abs=1e-4)
            assert entry["rank"] == ranks[str(a["token_id"])]
        for key, entry in shown.items():
            assert entry["decoded_token"] == tokenizer.decode([int(key)])


def test_prompt_logprobs_in_vllms_format_equal_generate(main_url, folders) -> None:
    """vLLM's ``prompt_logprobs``: each completions choice carries its prompt's, a chat
    response the rendered template's, with ``generate(..., prompt_logprobs=2)``'s values;
    refused with a 400 naming the field on chat too, and the server serves on."""
    tokenizer = load_tokenizer(folders["target"])
    messages = [{"role": "user", "content": "hi"}]
    text = render(load_chat_template(folders["target"]), messages)
    prompts = [tokenizer.encode(PROMPTS[5]), tokenizer.encode(PROMPTS[6])]
    prompts.append(tokenizer.encode(text, add_special_tokens=False))
    expected = reference(folders, prompts, 2, prompt_logprobs=2)
    api = client(main_url)
    extra = {"prompt_logprobs": 2}
    done = api.completions.create(
        model="tiny", prompt=PROMPTS[5:7], max_tokens=2, temperature=0, extra_body=extra
    )
    for choice, want in zip(done.choices, expected):
        got = choice.model_extra["prompt_logprobs"]
        assert_vllm_prompt_logprobs(got, want.prompt_logprobs, 2, tokenizer)
    chat = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, temperature=0, extra_body=extra
    )
    got = chat.model_extra["prompt_logprobs"]
    assert_vllm_prompt_logprobs(got, expected[2].prompt_logprobs, 2, tokenizer)
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 9}
        )
    assert refused.value.body["param"] == "prompt_logprobs"
    assert api.chat.completions.create(model="tiny", messages=messages, max_tokens=2).choices


@pytest.mark.parametrize("text", ["héllo € 😀", "plain ascii", "\u0000\x7f"])
def test_token_bytes_add_up_to_the_text_even_inside_a_character(folders, text) -> None:
    """Chat log-probabilities' ``bytes``: each token's own bytes, so that the pieces of a
    character cut between tokens add up to its UTF-8 (their texts are U+FFFD); special tokens
    have none."""
    tokenizer = load_tokenizer(folders["target"])
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()
    assert tokenizer.token_bytes(256) == b""  # <s>


def test_a_stop_string_ends_the_text_before_it(main_url, folders) -> None:
    """``stop`` ends the completion at the token completing it; the text ends before it."""
    (free,) = reference(folders, [PROMPTS[5]], 24)
    stop = next(free.text[i : i + 2] for i in range(4, 20) if free.text[i : i + 2].isprintable())
    done = client(main_url).completions.create(
        model="tiny", prompt=PROMPTS[5], max_tokens=24, temperature=0, stop=[stop]
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == free.text[: free.text.index(stop)]


def ids_by_choice(choices) -> dict[int, list[int]]:
    """Each choice's ``token_ids`` (vLLM's ``return_token_ids``), by its ``index``; streamed
    choices' pieces joined in order."""
    ids: dict[int, list[int]] = {}
    for choice in choices:
        ids.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
    return ids


def test_n_choices_are_generates_completions_streamed_or_not(main_url, folders) -> None:
    """``n``: each prompt gets ``n`` choices, numbered prompt after prompt (choice ``i * n + j``
    is completion ``j`` of prompt ``i``), each exactly ``generate(..., n=n)``'s completion with
    the same seed, log-probabilities included; a stream tags every chunk with its choice.
    Greedy choices are all alike; the prompt counts once in the usage."""
    sampled = dict(temperature=0.9, top_k=40, seed=11, logprobs=2)
    expected = reference(folders, PROMPTS[:2], 8, n=2, **sampled)
    api = client(main_url)
    options = dict(model="tiny", prompt=PROMPTS[:2], max_tokens=8, n=2)
    extra = {"extra_body": {"return_token_ids": True, "top_k": 40}}
    done = api.completions.create(**options, **extra, temperature=0.9, seed=11, logprobs=2)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert ids_by_choice(done.choices) == {i: list(r.token_ids) for i, r in enumerate(expected)}
    for choice, want in zip(done.choices, expected):
        assert choice.logprobs.token_logprobs == pytest.approx(
            [e["logprob"] for e in want.logprobs], abs=1e-4
        )
    assert expected[0].token_ids != expected[1].token_ids  # the completions differ
    tokenizer = load_tokenizer(folders["target"])
    assert done.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS[:2])
    stream = api.completions.create(**options, **extra, temperature=0.9, seed=11, stream=True)
    assert ids_by_choice(c for chunk in stream for c in chunk.choices) == ids_by_choice(
        done.choices
    )
    alike = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        n=2,
        temperature=0,
    )
    assert [c.index for c in alike.choices] == [0, 1]
    assert alike.choices[0].message.content == alike.choices[1].message.content
    chunks = list(
        api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            n=2,
            temperature=0,
            stream=True,
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {i: c.message.content for i, c in enumerate(alike.choices)}
    assert sum(c.choices[0].delta.role == "assistant" for c in chunks) == 2  # one per choice


def test_penalties_and_min_tokens_equal_generate(main_url, folders) -> None:
    """OpenAI's presence and frequency penalties, vLLM's repetition penalty and ``min_tokens``
    give ``generate``'s tokens with the same settings, greedy and seeded; ``min_tokens``
    holds a stop token off until that many tokens are out."""
    api = client(main_url)
    free = (
        api.completions.create(
            model="tiny",
            prompt=PROMPTS[4],
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        .choices[0]
        .model_extra["token_ids"]
    )
    stop = [free[1]]  # ends a free completion at its second token
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    cases = [
        dict(penalties, temperature=0.0),
        dict(penalties, temperature=0.8, seed=5),
        dict(stop_token_ids=stop, temperature=0.0),
        dict(stop_token_ids=stop, min_tokens=6, temperature=0.0),
    ]
    expected = reference(folders, [{"prompt": PROMPTS[4], **case} for case in cases], 12)
    assert list(expected[0].token_ids) != free  # the penalties change the output
    assert len(expected[2].token_ids) == 2 and len(expected[3].token_ids) >= 6
    for case, want in zip(cases, expected):
        openai_names = {"presence_penalty", "frequency_penalty", "temperature", "seed"}
        done = api.completions.create(
            model="tiny",
            prompt=PROMPTS[4],
            max_tokens=12,
            **{k: v for k, v in case.items() if k in openai_names},
            extra_body={
                "return_token_ids": True,
                **{k: v for k, v in case.items() if k not in openai_names},
            },
        )
        assert done.choices[0].model_extra["token_ids"] == list(want.token_ids)
        assert done.choices[0].finish_reason == want.finish_reason


def test_response_format_and_guided_regex_constrain_the_output(main_url, folders) -> None:
    """``response_format`` ``json_schema`` gives JSON valid under the schema, ``json_object``
    any JSON object (``generate``'s tokens under those schemas, greedy and seeded), vLLM's
    ``guided_regex`` a full match; each finishes with ``stop`` once its grammar is complete."""
    messages = [{"role": "user", "content": "answer"}]
    text = render(load_chat_template(folders["target"]), messages)
    prompt = load_tokenizer(folders["target"]).encode(text, add_special_tokens=False)
    seeded = dict(temperature=1.0, seed=3)  # a seed whose object has keys
    cases = [
        ({"json_schema": SCHEMA}, _schema_format(SCHEMA)),
        ({"json_schema": {"type": "object"}}, {"type": "json_object"}),
        ({"json_schema": {"type": "object"}, **seeded}, {"type": "json_object"}),
    ]
    expected = reference(folders, [{"prompt": prompt, **case} for case, _ in cases], 40)
    api = client(main_url)

    def ask(case: dict, form: dict):
        return api.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=40,
            response_format=form,
            extra_body={"return_token_ids": True},
            **{"temperature": 0.0, **{k: v for k, v in case.items() if k in seeded}},
        ).choices[0]

    with ThreadPoolExecutor(len(cases)) as pool:  # decoded together, as a server would
        answers = list(pool.map(ask, *zip(*cases)))
    for answer, want in zip(answers, expected):
        assert answer.model_extra["token_ids"] == list(want.token_ids)
    value = json.loads(answers[0].message.content)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    assert answers[0].finish_reason == answers[1].finish_reason == "stop"
    assert isinstance(json.loads(answers[1].message.content), dict)
    assert answers[2].message.content.startswith('{"')  # keys of its own choosing
    pattern = "[a-z]{3}-[0-9]{2}"
    guided = api.completions.create(
        model="tiny", prompt="id:", max_tokens=20, extra_body={"guided_regex": pattern}
    )
    assert re.fullmatch(pattern, guided.choices[0].text)
    assert guided.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x", "temperature": "hot"}, "temperature", "expected a number"),
        ({"prompt": "x", "model": "gpt-4"}, "model", "does not exist"),
        ({"prompt": "x" * 300}, "prompt", "context"),
        ({"prompt": "x", "colour": 3}, "colour", "unknown field"),
        ({"prompt": "x", "n": 0}, "n", "expected an integer >= 1"),
        ({"prompt": "x", "n": 10**9}, "n", "at most 272 live requests"),
        ({"prompt": ["x"] * 300}, "prompt", "at most 272 live requests"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "best_of", "not supported"),
        ({"prompt": "x", "echo": True}, "echo", "not supported"),
        ({"prompt": "x", "presence_penalty": 5}, "presence_penalty", "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
        ({"prompt": "x", "min_tokens": 20}, "min_tokens", "exceeds the completion's budget"),
        ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format", "expected"),
        (
            {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format",
            "expected",
        ),
        (
            {"prompt": "x", "response_format": _schema_format({"type": "nonsense"})},
            "response_format",
            "not a valid JSON schema",
        ),
        (
            {"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "guided_regex",
            "give one",
        ),
        ({"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex", "regular expression"),
        ({"prompt": "x", "top_p": 0}, "top_p", "top_p"),
        ({"prompt": "x", "logprobs": 9}, "logprobs", "at most 5"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", "an integer >= 0"),
        ({"prompt": "x", "prompt_logprobs": "x"}, "prompt_logprobs", "an integer >= 0"),
        ({"prompt": "x", "prompt_logprobs": 6}, "prompt_logprobs", "at most 5"),
        ({"prompt": "x", "prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "stream"),
        ({"prompt": "x", "logit_bias": {"999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"prompt": [1, 2, 9999]}, "prompt", "neither text nor"),
        ({}, "prompt", "required"),
    ],
)
def test_bad_requests_get_400_with_an_error_object_and_the_server_serves_on(
    main_url, body, param, words
) -> None:
    """Each refusal is OpenAI's error object naming the field; the next request succeeds."""
    response = httpx.post(f"{main_url}/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]
    ok = httpx.post(f"{main_url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_body_that_is_not_json_is_a_400(main_url) -> None:
    bad = httpx.post(f"{main_url}/v1/chat/completions", content=b'{"messages": [')
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_json"


def test_metrics_parse_and_count_what_was_generated(main_url) -> None:
    """``/metrics`` parses with prometheus-client; the generated-token counter and the
    acceptance counters move by what a request reports, and the gauges settle at zero."""
    wait_for(lambda: idle(main_url))
    before = metrics(main_url)
    done = client(main_url).completions.create(
        model="tiny", prompt=PROMPTS[7], max_tokens=9, temperature=0
    )
    wait_for(lambda: idle(main_url))
    after = metrics(main_url)

    def moved(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    spec = done.usage.model_extra["speculative"]
    assert moved("speculum:generation_tokens_total") == 9
    assert moved("speculum:prompt_tokens_total") == done.usage.prompt_tokens
    assert moved("speculum:request_success_total", finished_reason="length") == 1
    assert moved("speculum:time_to_first_token_seconds_count") == 1
    algorithm = {"algorithm": "standalone"}
    assert moved("speculum:spec_decode_num_drafts_total", **algorithm) == spec["num_rounds"]
    accepted = moved("speculum:spec_decode_num_accepted_tokens_total", **algorithm)
    assert accepted == spec["accepted_draft_tokens"] > 0
    first = moved(
        "speculum:spec_decode_num_accepted_tokens_per_pos_total", position="0", **algorithm
    )
    assert first > 0
    assert after[("speculum:spec_accept_length", (("algorithm", "standalone"),))] > 1.0


def test_a_repeated_prompt_is_served_from_the_prefix_cache(main_url) -> None:
    """The second of two identical long prompts reports its cached tokens in the usage (as
    OpenAI's ``prompt_tokens_details``), the same tokens as the first, and the hit counters
    move by them; an idle server holds no page (cached pages are reclaimable)."""
    prompt = "".join(PROMPTS[:6])  # several full pages of 16 tokens
    wait_for(lambda: idle(main_url))
    before = metrics(main_url)
    runs = [
        client(main_url).completions.create(
            model="tiny", prompt=prompt, max_tokens=4, temperature=0
        )
        for _ in range(2)
    ]
    wait_for(lambda: idle(main_url))
    after = metrics(main_url)
    cached = runs[1].usage.prompt_tokens_details.cached_tokens
    assert runs[0].choices[0].text == runs[1].choices[0].text
    assert 0 < cached < runs[1].usage.prompt_tokens and cached % 16 == 0
    hits = ("speculum:prefix_cache_hits_total", ())
    queries = ("speculum:prefix_cache_queries_total", ())
    assert after[hits] - before.get(hits, 0.0) >= cached
    assert after[queries] - before.get(queries, 0.0) == 2 * runs[1].usage.prompt_tokens
    assert after[("speculum:prefix_cache_pages", ())] > 0


def test_models_and_health(main_url) -> None:
    models = client(main_url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{main_url}/health").json() == {"status": "ok"}


def assert_serves_json_objects(url: str) -> None:
    """A greedy ``json_object`` completion from the server at ``url`` is a JSON object (or,
    cut at its token limit, the start of one)."""
    shaped = client(url).completions.create(
        model="tiny",
        prompt="x",
        max_tokens=64,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    choice = shaped.choices[0]
    assert choice.text.startswith("{")
    assert choice.finish_reason == "length" or isinstance(json.loads(choice.text), dict)


def test_overlapped_serving_equals_generate_and_cancels_cleanly(folders, monkeypatch) -> None:
    """Overlap scheduling (the default on CUDA): concurrent greedy requests get ``generate``'s
    tokens, and a stream dropped after its first token is cancelled while a round of it is in
    flight, its pages freed. The engine takes exactly two steps while the stream starts (the
    prefill launched, then collected with a round launched), so it cannot finish first."""
    target = folders["target"]
    engine = engine_for(model=target, draft=target, overlap=True, **SPEC)
    expected = reference(folders, PROMPTS[:6], 10)
    with running(create_app(engine, served_model_names=["tiny"])) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        async def one(prompt: str) -> list[int]:
            done = await api.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            return done.choices[0].model_extra["token_ids"]

        async def all_of_them() -> list[list[int]]:
            return await asyncio.gather(*(one(p) for p in PROMPTS[:6]))

        assert asyncio.run(all_of_them()) == [list(r.token_ids) for r in expected]
        # Structured output is served overlapped too: each round's masks follow the tokens of
        # the round still in flight.
        assert_serves_json_objects(url)
        wait_for(lambda: idle(url))
        steps, limited, step = threading.Semaphore(2), threading.Event(), scheduler.step

        def counted(engine, state):
            if limited.is_set():
                steps.acquire()
            return step(engine, state)

        monkeypatch.setattr(scheduler, "step", counted)
        limited.set()
        dropped = client(url).completions.create(
            model="tiny",
            prompt="x",
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},  # a chunk per step, text or not
        )
        next(iter(dropped))
        dropped.close()
        limited.clear()
        steps.release()  # the loop may wait for a third step
        wait_for(lambda: idle(url))
        key = ("speculum:request_success_total", (("finished_reason", "abort"),))
        assert metrics(url)[key] == 1


def test_the_api_key_is_required_on_v1(small_url) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(small_url).models.list()
    assert small(small_url).models.list().data
    assert httpx.get(f"{small_url}/health").status_code == 200  # no key needed


def small(url: str) -> openai.OpenAI:
    return client(url).with_options(api_key=KEY)


#: A short request that never meets the poisoned token (sampled at OpenAI's default
#: temperature 1 without a seed, it could draw it: a failure by chance).
SHORT = dict(model="small", prompt="x", max_tokens=2, temperature=0, logit_bias={str(POISON): -100})
#: A long greedy request that never meets the poisoned token.
LONG = dict(
    model="small",
    prompt="long",
    max_tokens=900,
    temperature=0,
    extra_body={"ignore_eos": True},
    logit_bias={str(POISON): -100},
)


def test_a_full_server_answers_429_and_a_disconnect_frees_the_request(
    small_url, monkeypatch
) -> None:
    """With two requests live (--max-batch 2, --max-queue 0) a third gets 429; a client that
    disconnects mid-stream cancels its request (its pages are freed), after which requests are
    admitted again. The engine's steps are held while the two must stay live, so that neither
    can finish whatever the machine's speed."""
    api = small(small_url)
    wait_for(lambda: idle(small_url))
    aborted = metrics(small_url).get(
        ("speculum:request_success_total", (("finished_reason", "abort"),)), 0.0
    )
    steps_may_run, step = threading.Event(), scheduler.step
    steps_may_run.set()

    def held(engine, state):
        steps_may_run.wait()
        return step(engine, state)

    monkeypatch.setattr(scheduler, "step", held)
    first, second = (api.completions.create(**LONG, stream=True) for _ in range(2))
    next(iter(first)), next(iter(second))  # both are live
    steps_may_run.clear()  # the step under way may end; neither request is near 900 tokens
    with pytest.raises(openai.RateLimitError) as refused:
        api.completions.create(**SHORT)
    assert refused.value.body["code"] == "queue_full"
    first.close()
    second.close()
    steps_may_run.set()
    wait_for(lambda: idle(small_url))
    after = metrics(small_url)
    key = ("speculum:request_success_total", (("finished_reason", "abort"),))
    assert after[key] == aborted + 2
    assert api.completions.create(**SHORT).choices[0].text


def test_a_request_the_engine_cannot_decode_fails_alone(small_url) -> None:
    """A prompt holding the poisoned token fails with a 500 error object (streamed: an error
    event); a request running beside it finishes normally."""
    api = small(small_url)
    beside = api.completions.create(**{**LONG, "max_tokens": 40}, stream=True)
    chunks = iter(beside)
    next(chunks)
    with pytest.raises(openai.InternalServerError) as failed:
        api.completions.create(model="small", prompt=[1, POISON, 2], max_tokens=4)
    assert failed.value.body["code"] == "engine_error"
    assert "could not be decoded" in failed.value.body["message"]
    with pytest.raises(openai.APIError, match="could not be decoded"):
        list(api.completions.create(model="small", prompt=[POISON], max_tokens=4, stream=True))
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"


def test_a_step_that_raises_fails_the_live_requests_and_the_loop_serves_on(
    small_url, monkeypatch
) -> None:
    """An exception out of ``scheduler.step`` (a bug, a device error) fails the requests then
    live with a 500 naming it; the loop starts over from an empty state and serves on."""

    def broken(engine, state):
        raise RuntimeError("device on fire")

    monkeypatch.setattr(scheduler, "step", broken)
    with pytest.raises(openai.InternalServerError, match="device on fire"):
        small(small_url).completions.create(**SHORT)
    monkeypatch.undo()
    assert small(small_url).completions.create(**SHORT).choices
    wait_for(lambda: idle(small_url))


@pytest.mark.parametrize("field", ["presence_penalty", "min_tokens"])
def test_penalties_on_a_server_started_without_them_are_a_400(small_url, field) -> None:
    """The small server's engine keeps no penalty state (``--no-penalties``): a request that
    asks for a penalty or ``min_tokens`` is refused, naming the field and the flag."""
    with pytest.raises(openai.BadRequestError, match="--no-penalties") as refused:
        small(small_url).completions.create(
            model="small", prompt="x", max_tokens=4, extra_body={field: 1}
        )
    assert refused.value.body["param"] == field


def test_chat_without_a_template_is_a_clear_400(small_url) -> None:
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        small(small_url).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}]
        )


def test_templates_render_as_transformers_renders_them(folders) -> None:
    """Loops, conditionals, ``raise_exception`` and ``tojson``, rendered as transformers'
    ``apply_chat_template`` does."""
    from transformers import PreTrainedTokenizerFast

    source = (
        "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no') }}{% endif %}"
        "<|{{ m['role'] }}|>\n  {{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    theirs = PreTrainedTokenizerFast(
        tokenizer_file=str(folders["target"] / "tokenizer.json"), eos_token="</s>"
    )
    theirs.chat_template = source
    ours = ChatTemplate(source=source, origin="test", special_tokens=(("eos_token", "</s>"),))
    messages = [{"role": "user", "content": 'héllo "x"'}, {"role": "assistant", "content": "y"}]
    assert render(ours, messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_serve_command_drains_running_requests_on_sigterm(folders) -> None:
    """``speculum serve`` in its own process, overlapped: a request streaming when SIGTERM comes
    finishes (``generate``'s tokens, then ``[DONE]``), and the process exits with status 0."""
    env = {k: v for k, v in os.environ.items() if k != "SPECULUM_TYPECHECK"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "speculum", "serve", "--model", str(folders["target"])]
    command += ["--port", "0", "--served-model-name", "t", "--max-context", "128", "--overlap"]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in process.stderr:
            found = re.search(r"Uvicorn running on (http://\S+)", line)
            if found:
                url = found.group(1)
                break
        assert url is not None
        body = {"prompt": "a", "max_tokens": 60, "temperature": 0, "stream": True}
        body.update(ignore_eos=True, return_token_ids=True)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=DEADLINE_S) as r:
            events = r.iter_lines()
            first = next(e for e in events if e)
            process.send_signal(signal.SIGTERM)
            rest = [e for e in events if e]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(event[6:]) for event in [first, *rest[:-1]]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        ids = [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
        (alone,) = generate(
            ["a"], model=folders["target"], max_new_tokens=60, max_context=128, ignore_eos=True
        )
        assert ids == list(alone.token_ids)
        assert process.wait(DEADLINE_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()


#: ``generate``'s per-request flags, each with the request field that carries it over HTTP.
REQUEST_FLAGS = {
    "--max-new-tokens": "max_tokens",
    "--n": "n",
    "--temperature": "temperature",
    "--top-k": "top_k",
    "--top-p": "top_p",
    "--min-p": "min_p",
    "--seed": "seed",
    "--logprobs": "logprobs",
    "--prompt-logprobs": "prompt_logprobs",
    "--logit-bias": "logit_bias",
    "--repetition-penalty": "repetition_penalty",
    "--presence-penalty": "presence_penalty",
    "--frequency-penalty": "frequency_penalty",
    "--min-tokens": "min_tokens",
    "--json-schema": "guided_json",
    "--regex": "guided_regex",
    "--grammar": "guided_grammar",
    "--stop": "stop",
    "--include-stop-str-in-output": "include_stop_str_in_output",
    "--ignore-eos": "ignore_eos",
}
#: ``generate``'s flags about its own prompts and printing, which a server has no use for.
OUTPUT_FLAGS = {"--prompt", "--prompt-ids", "--prompts-file", "--output", "--json", "--no-stream"}
OUTPUT_FLAGS |= {"--compare-plain", "--passes"}


def test_serve_takes_every_engine_flag_of_generate_and_requests_carry_the_rest() -> None:
    """Every flag of ``generate`` is a flag of ``serve`` too, but for its request settings,
    which are fields of each HTTP request (both endpoints read each), and its output options."""
    from speculum.runtime.cli import parser
    from speculum.serving import protocol

    commands = parser()._subparsers._group_actions[0].choices
    flags = {
        name: {option for action in commands[name]._actions for option in action.option_strings}
        for name in ("generate", "serve")
    }
    assert flags["generate"] - flags["serve"] == set(REQUEST_FLAGS) | OUTPUT_FLAGS
    assert set(REQUEST_FLAGS.values()) <= protocol._COMPLETION_FIELDS & protocol._CHAT_FIELDS


def test_serve_applies_penalties_unless_told_not_to() -> None:
    from speculum.runtime.cli import parser

    assert parser().parse_args(["serve"]).penalties
    assert not parser().parse_args(["serve", "--no-penalties"]).penalties


def test_serve_refuses_tensor_parallelism(capsys) -> None:
    from speculum.runtime.cli import main

    assert main(["serve", "--tp", "2"]) == 2
    assert "speculum: error: --tp" in capsys.readouterr().err
