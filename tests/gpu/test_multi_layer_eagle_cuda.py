"""Multi-layer EAGLE on CUDA: greedy (and greedy-equivalent sampled-request) decoding equals
plain decoding, with chained and unchained hidden states."""

from __future__ import annotations

import attrs
import pytest
from conftest import tiny_config

from speculum.models.loading import random_model
from speculum.models.multi_layer_eagle import random_multi_layer
from speculum.pipelines import multi_layer_eagle
from speculum.pipelines.base import Resources
from speculum.runtime.engine import Engine, EngineConfig, engine_from_model
from speculum.runtime.generate import generate

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [11]]


def _tokens(engine):
    return [r.token_ids for r in generate(PROMPTS, engine=engine, max_new_tokens=24)]


@pytest.mark.parametrize("chain_hidden", [True, False])
@pytest.mark.parametrize("num_steps", [1, 3])
def test_multi_layer_eagle_greedy_on_cuda_equals_plain(chain_hidden, num_steps):
    target = random_model(tiny_config(vocab_size=16, num_layers=4), seed=5, std=0.3).to("cuda")
    head = random_multi_layer(target, num_steps, seed=2, std=0.3)
    pipe = multi_layer_eagle.pipeline(num_steps=num_steps, vocab_size=16, chain_hidden=chain_hidden)
    config = EngineConfig(page_size=4, max_context=64, max_batch=4, prefill_budget=5)
    num_pages = config.max_batch * config.max_pages_per_request(pipe.kv_lookahead) + 1
    config = attrs.evolve(config, num_pages=num_pages)
    resources = Resources(
        target=target,
        target_pool=target.new_pool(num_pages, 4),
        draft=head,
        draft_pool=head.new_pool(num_pages, 4),
    )
    spec = Engine(
        pipeline=pipe, resources=resources, config=config, tokenizer=None, eos_token_ids=()
    )
    plain = engine_from_model(target, page_size=4, max_context=64, prefill_budget=5)
    assert _tokens(spec) == _tokens(plain)
