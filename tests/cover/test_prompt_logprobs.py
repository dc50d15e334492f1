"""Prompt log-probabilities (``Sampling.prompt_logprobs``, vLLM's): for each prompt token but
the first (``None``), its log-probability given the tokens before it and the top-N there, under
the target's raw distribution, read from the prefill's logits. They equal ``log_softmax`` of
transformers' float32 logits, whatever the chunking, the batch and the pipeline; a request that
asks for them is prefilled in full even when its prefix is cached."""

from __future__ import annotations

import json

import pytest
import torch
from test_overlap import PIPELINES, engine
from transformers import LlamaForCausalLM

from speculum.models.loading import load_model
from speculum.runtime import cli, scheduler
from speculum.runtime.default_model import write_tiny_model
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate

TOLERANCE = {"abs": 1e-4, "rel": 1e-5}
PROMPTS = [[256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100], [256, 97], [7]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny random Llama with its byte-level tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def hf_logprobs(folder, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt), vocab]``: transformers' float32 log_softmax at each prompt position."""
    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_prompt_logprobs(entries, expected: torch.Tensor, prompt: list[int], num_top: int):
    """``entries`` are ``None`` then, for prompt token ``i``, its log-probability
    ``expected[i - 1, prompt[i]]`` and the ``num_top`` largest of ``expected[i - 1]``."""
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        row = expected[i - 1]
        assert entry["token_id"] == prompt[i]
        assert entry["logprob"] == pytest.approx(row[prompt[i]].item(), **TOLERANCE)
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert values == pytest.approx(row.topk(num_top).values.tolist(), **TOLERANCE)
        for t in entry["top_logprobs"]:
            assert t["logprob"] == pytest.approx(row[t["token_id"]].item(), **TOLERANCE)


@pytest.mark.parametrize("budget", [4, 64])
def test_prompt_logprobs_are_transformers_log_softmax_in_chunks_and_batches(folder, budget):
    """Prefilled together in chunks of ``budget`` tokens (a chunk ends mid-prompt, rows share
    chunks), each prompt's entries are transformers' values; sampling settings, a bias and a
    penalty do not change them (the raw distribution), and the first token has None."""
    eng = engine_from_model(
        load_model(folder), prefill_budget=budget, logit_bias=True, penalties=True
    )
    results = generate(
        PROMPTS,
        engine=eng,
        max_new_tokens=2,
        prompt_logprobs=3,
        temperature=0.7,
        logit_bias={72: 50.0},
        repetition_penalty=1.5,
    )
    for prompt, result in zip(PROMPTS, results):
        assert_prompt_logprobs(result.prompt_logprobs, hf_logprobs(folder, prompt), prompt, 3)


def test_zero_alternatives_give_the_tokens_own_value_and_none_asked_gives_none(folder):
    plain, zero = (
        generate(PROMPTS[:2], model=folder, max_new_tokens=1, prompt_logprobs=n) for n in (None, 0)
    )
    assert all(r.prompt_logprobs is None for r in plain)
    for prompt, result in zip(PROMPTS, zero):
        assert all(e["top_logprobs"] == [] for e in result.prompt_logprobs[1:])
        assert_prompt_logprobs(result.prompt_logprobs, hf_logprobs(folder, prompt), prompt, 0)
    assert [r.token_ids for r in zero] == [r.token_ids for r in plain]


def test_a_request_asking_for_them_is_prefilled_in_full_past_a_cached_prefix(folder):
    """A cached page's tokens have no fresh logits: the request skips the prefix cache (it
    reports no cached tokens) and still gets every entry; one without them reuses the cache."""
    eng = engine_from_model(load_model(folder), page_size=4)
    prompt = PROMPTS[0]
    (first,) = generate([prompt], engine=eng, max_new_tokens=1)
    (cached,) = generate([prompt], engine=eng, max_new_tokens=1)
    (asked,) = generate([prompt], engine=eng, max_new_tokens=1, prompt_logprobs=2)
    assert cached.stats["cached_tokens"] > 0 and asked.stats["cached_tokens"] == 0
    assert asked.token_ids == first.token_ids
    assert_prompt_logprobs(asked.prompt_logprobs, hf_logprobs(folder, prompt), prompt, 2)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_pipeline_reports_plain_decodings_prompt_logprobs(name):
    """Every pipeline's prefill reports them (the target's, whatever the draft), chunked."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 4]]
    options = {"max_new_tokens": 1, "prompt_logprobs": 2}
    want = generate(prompts, engine=engine("plain", False, prefill_budget=3), **options)
    got = generate(prompts, engine=engine(name, False, prefill_budget=3), **options)
    for g, w in zip(got, want):
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert a["token_id"] == b["token_id"]
            assert a["logprob"] == pytest.approx(b["logprob"], **TOLERANCE)


def test_overlapped_scheduling_reports_the_same_entries():
    """Overlapped, a chunk that asks waits for its own values: the entries are the same."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 4]]
    options = {"max_new_tokens": 3, "prompt_logprobs": 1}
    runs = [
        generate(prompts, engine=engine("eagle tree", overlap, prefill_budget=3), **options)
        for overlap in (False, True)
    ]
    assert [r.prompt_logprobs for r in runs[1]] == [r.prompt_logprobs for r in runs[0]]


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        scheduler.Sampling(prompt_logprobs=-1)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        scheduler.Sampling(prompt_logprobs=1.5)


def test_the_command_line_prints_prompt_logprobs_in_its_json(capsys, folder):
    args = ["generate", "--model", str(folder), "--prompt-ids", "256,72,105", "--json"]
    assert cli.main([*args, "--max-new-tokens", "2", "--prompt-logprobs", "1"]) == 0
    payload = json.loads(capsys.readouterr().out)
    (expected,) = generate([[256, 72, 105]], model=folder, max_new_tokens=2, prompt_logprobs=1)
    assert payload["prompt_logprobs"] == expected.prompt_logprobs
    assert payload["prompt_logprobs"][0] is None and len(payload["prompt_logprobs"]) == 3
    assert cli.main([*args, "--max-new-tokens", "2"]) == 0
    assert "prompt_logprobs" not in json.loads(capsys.readouterr().out)
