"""Sampled block drafting is lossless: the DSpark paper's non-anticipation example, and the
first two tokens of DFLASH and DSPARK pipelines (ragged verify included) against the target's
exact law, with the statistics of ``test_eagle_stats``."""

from __future__ import annotations

import math

import pytest
import torch
from test_eagle_stats import (
    MAX_CONTEXT,
    PAGE_SIZE,
    TARGET,
    exact_joint,
    joint_stats,
    lossless,
    sample_tokens,
)

import speculum.pipelines.dflash as dflash_module
from speculum.models.block_draft import random_block_draft
from speculum.pipelines import get_pipeline
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.spec import block as spec_block
from speculum.spec.accept import accept
from speculum.spec.sampling import Stream, sample_from_probs, uniforms
from speculum.spec.tree import chain_tree

# ------------------------------------------------------------- the non-anticipation example

P_TARGET = torch.tensor([0.7, 0.3])
Q_DRAFT = torch.tensor([0.5, 0.5])
REQUESTS = 40_000


def first_token_law(verify: str) -> float:
    """The frequency of token A (id 0) as the first emitted token, over many requests that each
    draft one token from ``q = (0.5, 0.5)`` for a target ``p = (0.7, 0.3)``.

    ``anticipating`` verifies the draft token only when it is A (a confidence read off the
    drawn token); ``ours`` verifies the rows the scheduler picks from confidences computed
    before the draw (the draft's own top probability, 0.5 for every row) under a budget of
    half the batch.
    """
    seed = torch.arange(REQUESTS, dtype=torch.int64)
    root_positions = torch.full((REQUESTS,), 10, dtype=torch.int64)
    q = Q_DRAFT.expand(REQUESTS, 1, 2)
    u = uniforms(seed, Stream.DRAFT, root_positions[:, None] + 1, 1)[..., 0]
    drafted = sample_from_probs(q, u)
    if verify == "anticipating":
        lens = (drafted[:, 0] == 0).to(torch.int64)
    else:
        confidence = q.amax(-1)  # known before the draw
        lens = spec_block.select_verify_lens(
            spec_block.survival(confidence), torch.tensor(REQUESTS // 2)
        )
        assert int(lens.sum()) == REQUESTS // 2
    tree = chain_tree(torch.zeros(REQUESTS, dtype=torch.int64), drafted)
    result = accept(
        tree,
        P_TARGET.expand(REQUESTS, 2, 2),
        seed,
        root_positions,
        1,
        torch.cat([q, q], dim=1),  # row 0 (the root) is ignored
        verify_lens=lens,
    )
    return float((result.emitted[:, 0] == 0).double().mean())


def test_a_non_anticipating_verify_budget_keeps_the_target_law():
    """The DSpark paper's appendix example: deciding whether to verify a token from the token
    itself turns P(A) = 0.7 into 0.5 * 1 + 0.5 * 0.7 = 0.85; the scheduler, which decides from
    what was known before the draw, keeps 0.7."""
    sigma = math.sqrt(0.7 * 0.3 / REQUESTS)
    assert abs(first_token_law("ours") - 0.7) < 6 * sigma
    anticipating = first_token_law("anticipating")
    assert abs(anticipating - 0.85) < 6 * math.sqrt(0.85 * 0.15 / REQUESTS)


# ----------------------------------------------------------------- the pipelines, end to end

VOCAB = TARGET.config.vocab_size
CHUNK = 1500
SEEDS = 4500


def agreeing_dspark(scale: float):
    """A DSPARK head whose Markov head carries the target's Markov vote as logits (``W2 W1[x]``
    = ``scale`` times the target's ``lm_head`` against token ``x``'s embedding) and whose
    backbone adds a small random part, so its sampled drafts are close to, not equal to, the
    target's distribution."""
    head = random_block_draft(TARGET, "dspark", seed=5, std=0.3, block_size=3, markov_rank=VOCAB)
    embed, lm = TARGET.model.embed_tokens.weight, TARGET.lm_head.weight
    with torch.no_grad():
        head.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB))
        head.markov_head.markov_w2.weight.copy_(scale * (lm @ embed.T))
        head.norm.weight.mul_(0.1)
    return head


CASES = {
    "dflash-sampled": dict(
        algorithm="dflash",
        head=lambda: random_block_draft(TARGET, "dflash", seed=4, std=0.3, block_size=4),
        spec=SpecOptions(sample_drafts=True),
        setting={"temperature": 1.3},
        prompt=[1, 4, 2],
    ),
    "dspark-sampled-ragged-topp": dict(
        algorithm="dspark",
        head=lambda: agreeing_dspark(0.3),
        spec=SpecOptions(sample_drafts=True, verify_budget=CHUNK),
        setting={"temperature": 1.0, "top_p": 0.9},
        prompt=[5, 4, 3],
    ),
    "dspark-argmax-auto": dict(
        algorithm="dspark",
        head=lambda: agreeing_dspark(0.3),
        spec=SpecOptions(verify_budget="auto", cost_table=((1, 1.0), (4000, 3.0))),
        setting={"temperature": 1.0},
        prompt=[2, 5],
    ),
}


def block_engine(case: dict, head):
    spec = case["spec"]
    lookahead = get_pipeline(
        case["algorithm"],
        block_size=head.config.block_size,
        budget=spec.verify_budget,
        cost_table=spec.cost_table,
    ).kv_lookahead
    per_request = math.ceil((len(case["prompt"]) + 2 + lookahead) / PAGE_SIZE)
    return engine_from_model(
        TARGET,
        algorithm=case["algorithm"],
        draft=head,
        spec=spec,
        page_size=PAGE_SIZE,
        num_pages=CHUNK * per_request + 1,
        max_batch=CHUNK,
        max_context=MAX_CONTEXT,
        prefill_budget=CHUNK * len(case["prompt"]),
    )


@pytest.mark.parametrize("name", list(CASES))
def test_first_two_tokens_follow_the_target_law(name):
    case = CASES[name]
    engine = block_engine(case, case["head"]())
    groups = [(case["prompt"], case["setting"])]
    (tokens,), (histogram,) = sample_tokens(engine, groups, SEEDS, 2)
    stats = joint_stats(tokens, exact_joint(TARGET, case["prompt"], case["setting"], 2))
    rounds = sum(histogram)
    stats["accept_length_mean"] = sum(k * n for k, n in enumerate(histogram)) / rounds
    assert lossless(stats), stats
    # Otherwise rounds would mostly emit bonus tokens and prove little about accepts.
    assert stats["accept_length_mean"] > 1.2, stats


def _anticipating_plan(original):
    """Wrong scheduler: verifies a row's draft tokens only when its first one is even (the
    decision reads the token it decides about)."""

    def plan(state, proposal, config):
        _, survival = original(state, proposal, config)
        even = proposal.tokens[:, 0] % 2 == 0
        return torch.where(even, config.num_drafts, 0), survival

    return plan


def test_the_check_catches_an_anticipating_scheduler(monkeypatch):
    monkeypatch.setattr(dflash_module, "plan_verify", _anticipating_plan(spec_block.plan_verify))
    case = CASES["dflash-sampled"]
    engine = block_engine(case, case["head"]())
    (tokens,), _ = sample_tokens(engine, [(case["prompt"], case["setting"])], CHUNK, 2)
    stats = joint_stats(tokens, exact_joint(TARGET, case["prompt"], case["setting"], 2))
    assert not lossless(stats), stats
