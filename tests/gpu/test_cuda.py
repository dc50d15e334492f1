"""The reference path on a CUDA device: same tokens and same random bits as on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from speculum.models.draft import random_draft
from speculum.models.frozen_kv import random_frozen_kv
from speculum.models.loading import random_model
from speculum.models.standalone import StandaloneHead
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.sampling import Stream, uniforms

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [11]]


def _target(device: str):
    return random_model(tiny_config(vocab_size=16, num_layers=4), seed=5, std=0.3).to(device)


def _tokens(model, **options):
    engine = engine_from_model(model, page_size=4, max_context=64, **options)
    return [r.token_ids for r in generate(PROMPTS, engine=engine, max_new_tokens=24)]


@pytest.mark.parametrize("stream", list(Stream))
def test_counter_uniforms_are_bit_identical_on_cpu_and_cuda(stream):
    # Every stream: Triton compiles an int argument equal to 1 as a constant, which once broke
    # the kernel for the stream numbered 1.
    seed = torch.tensor([0, 1, 2**40 + 7])
    counter = torch.tensor([[0, 5], [17, 2**33], [3, 4]])
    cpu = uniforms(seed, stream, counter, 8)
    cuda = uniforms(seed.cuda(), stream, counter.cuda(), 8)
    assert torch.equal(cpu, cuda.cpu())


def test_plain_greedy_on_cuda_equals_cpu():
    assert _tokens(_target("cuda")) == _tokens(_target("cpu"))


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize(("num_steps", "topk", "num_draft_tokens"), [(3, 1, 4), (4, 3, 10)])
def test_speculative_greedy_on_cuda_equals_plain(algorithm, num_steps, topk, num_draft_tokens):
    target = _target("cuda")
    head = random_draft(target, algorithm, seed=2, std=0.3)
    spec = SpecOptions(num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens)
    assert _tokens(target, algorithm=algorithm, draft=head, spec=spec) == _tokens(target)


@pytest.mark.parametrize("sample", [False, True])
def test_standalone_and_frozen_kv_greedy_on_cuda_equal_plain(sample):
    target = _target("cuda")
    spec = SpecOptions(
        num_steps=3, topk=2, num_draft_tokens=7 if sample else 6, sample_drafts=sample
    )
    small = random_model(tiny_config(vocab_size=16, num_layers=1), seed=8, std=0.3).to("cuda")
    plain = _tokens(target)
    standalone = StandaloneHead(small, 16)
    assert _tokens(target, algorithm="standalone", draft=standalone, spec=spec) == plain
    frozen = random_frozen_kv(target, seed=2, std=0.3)
    assert _tokens(target, algorithm="frozen_kv_mtp", draft=frozen, spec=spec) == plain


def test_ngram_greedy_on_cuda_equals_plain():
    target = _target("cuda")
    spec = SpecOptions(num_draft_tokens=6)
    assert _tokens(target, algorithm="ngram", spec=spec) == _tokens(target)


def test_sampled_decoding_on_cuda_is_reproducible():
    target = _target("cuda")
    engine = engine_from_model(target, page_size=4, max_context=64)
    first = generate(PROMPTS, engine=engine, max_new_tokens=16, temperature=0.8, seed=3)
    again = generate(PROMPTS, engine=engine, max_new_tokens=16, temperature=0.8, seed=3)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
