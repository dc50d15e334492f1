"""DFLASH and DSPARK on CUDA, decoding rounds captured as CUDA graphs: greedy decoding equals
plain decoding with every verify budget (ragged rows included, verified packed and padded)."""

from __future__ import annotations

import pytest
from conftest import tiny_config

from speculum.models.block_draft import random_block_draft
from speculum.models.loading import random_model
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [11]]
SPECS = {
    "all": SpecOptions(),
    "fixed": SpecOptions(verify_budget=4, min_verify=1),  # verified packed
    "fixed-padded": SpecOptions(verify_budget=4, min_verify=1, packed_verify=False),
    # auto: the budget read on the host, rounds captured per power-of-two bound, packed.
    "auto": SpecOptions(verify_budget="auto", cost_table=((1, 1.0), (8, 1.2), (64, 3.0))),
    "auto-padded": SpecOptions(
        verify_budget="auto", cost_table=((1, 1.0), (8, 1.2), (64, 3.0)), packed_verify=False
    ),
    "auto-steep": SpecOptions(verify_budget="auto", cost_table=((1, 1.0), (64, 40.0))),
    "sampled-drafts": SpecOptions(sample_drafts=True, block_size=3),
}


def _tokens(engine, **sampling):
    results = generate(PROMPTS, engine=engine, max_new_tokens=24, **sampling)
    return [r.token_ids for r in results]


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_block_greedy_on_cuda_equals_plain(algorithm, spec):
    target = random_model(tiny_config(vocab_size=16, num_layers=4), seed=5, std=0.3).to("cuda")
    head = random_block_draft(target, algorithm, seed=2, std=0.3, block_size=5)
    limits = {"page_size": 4, "max_context": 64, "prefill_budget": 5, "max_batch": 4}
    engine = engine_from_model(target, algorithm=algorithm, draft=head, spec=SPECS[spec], **limits)
    plain = engine_from_model(target, **limits)
    assert _tokens(engine) == _tokens(plain)
    # Sampled requests run through the same captured rounds.
    assert len(_tokens(engine, temperature=1.0, seed=3)[0]) == 24
