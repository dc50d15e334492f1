"""Prompt log-probabilities on the GPU: engines whose rounds are CUDA graphs, prefilling in
small chunks, report for every prompt token the log_softmax of one whole-prompt forward of the
target (fp32), for plain decoding and every pipeline."""

from __future__ import annotations

import pytest
import torch
from test_graphs_cuda import LABELS, PROMPTS, _drafts, _target

from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.paged import extend_batch
from speculum.state import PagedKV

pytestmark = pytest.mark.gpu

TOLERANCE = {"abs": 1e-4, "rel": 1e-4}


def whole_prompt_logprobs(target, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt), vocab]``: log_softmax of the target's logits at each prompt position."""
    tokens = torch.tensor([prompt], device="cuda")
    pages = -(-len(prompt) // 4)
    kv = PagedKV(
        page_table=torch.arange(1, pages + 1, device="cuda")[None],
        seq_lens=torch.zeros(1, dtype=torch.int64, device="cuda"),
        page_size=4,
    )
    lengths = torch.tensor([len(prompt)], device="cuda")
    hidden, _ = target(extend_batch(kv, tokens, lengths), target.new_pool(pages + 1, 4))
    return torch.log_softmax(target.logits(hidden[0]).float(), dim=-1).cpu()


@pytest.mark.parametrize("label", ["plain", *LABELS])
def test_chunked_prompt_logprobs_equal_a_whole_prompt_forward(label):
    target = _target()
    options = {}
    if label != "plain":
        algorithm, draft, spec = _drafts(target)[label]
        options = {"algorithm": algorithm, "draft": draft, "spec": spec}
    limits = {"page_size": 4, "max_context": 96, "max_batch": 8, "prefill_budget": 5}
    engine = engine_from_model(target, **limits, **options)
    results = generate(PROMPTS, engine=engine, max_new_tokens=4, prompt_logprobs=3)
    for prompt, result in zip(PROMPTS, results):
        expected = whole_prompt_logprobs(target, prompt)
        entries = result.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for i, entry in enumerate(entries[1:], start=1):
            assert entry["token_id"] == prompt[i]
            want = expected[i - 1, prompt[i]].item()
            assert entry["logprob"] == pytest.approx(want, **TOLERANCE)
            top = [t["logprob"] for t in entry["top_logprobs"]]
            assert top == pytest.approx(expected[i - 1].topk(3).values.tolist(), **TOLERANCE)
