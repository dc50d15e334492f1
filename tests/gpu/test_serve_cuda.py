"""``speculum serve`` on CUDA, its engine built as the command builds it there: overlapped,
rounds captured as CUDA graphs, penalty counts and logit-bias rows on the device, 20
log-probabilities. Request controls over HTTP (``n`` with a seed, penalties, a logit bias,
log-probabilities) give ``generate``'s tokens with the same settings; structured output is
served overlapped, through captured rounds cut at its masks."""

from __future__ import annotations

import pytest
from cover.test_serve import (
    PROMPTS,
    assert_serves_json_objects,
    client,
    ids_by_choice,
    running,
)

from speculum.runtime.default_model import write_tiny_model
from speculum.runtime.generate import engine_for, generate
from speculum.serving.app import create_app

pytestmark = pytest.mark.gpu

#: The sampled, penalized, biased request both sides decode (OpenAI's names where it has them).
SETTINGS = dict(temperature=0.9, seed=11, presence_penalty=1.0, frequency_penalty=0.5)
EXTRA = dict(top_k=40, repetition_penalty=1.3)


def test_controls_over_http_on_cuda_equal_generate(tmp_path) -> None:
    target = write_tiny_model(tmp_path / "target")
    spec = dict(model=target, draft=target, algorithm="standalone", num_steps=3, max_context=256)
    spec["device"] = "cuda"
    engine = engine_for(**spec, overlap=True, max_logprobs=20, logit_bias=True, penalties=True)
    prompts = PROMPTS[:2]
    expected = generate(
        prompts,
        **spec,
        max_new_tokens=16,
        n=2,
        logprobs=2,
        logit_bias={5: -100},
        **SETTINGS,
        **EXTRA,
    )
    with running(create_app(engine, served_model_names=["tiny"])) as url:
        done = client(url).completions.create(
            model="tiny",
            prompt=prompts,
            max_tokens=16,
            n=2,
            logprobs=2,
            logit_bias={"5": -100},
            **SETTINGS,
            extra_body={"return_token_ids": True, **EXTRA},
        )
        assert ids_by_choice(done.choices) == {i: list(r.token_ids) for i, r in enumerate(expected)}
        for choice, want in zip(done.choices, expected):
            assert choice.logprobs.token_logprobs == pytest.approx(
                [e["logprob"] for e in want.logprobs], abs=1e-3
            )
        assert_serves_json_objects(url)
