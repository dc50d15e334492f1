"""End-to-end statistical losslessness of the EAGLE pipelines with real tiny models.

``tests/cover/test_accept.py`` checks the acceptance rule on toy Markov chains; this file checks
the whole pipeline: prefill, multi-step drafting, tree building, tree-masked verify over the
paged cache, acceptance, commit and draft-extend, as the reference scheduler runs them. A tiny
random target over ``VOCAB = 6`` tokens decodes many requests that differ only in their seed
(each seed is one request; 1500 share one batch), and the empirical joint law of the first two
generated tokens (three for one deep tree) is compared with the exact one, enumerated from the
target's own filtered next-token distributions (``filtered_probs`` of a plain prefill of every
prefix). Cases cover every head kind (EAGLE-1, EAGLE-3 with full and reduced vocabulary, MTP),
chains and trees (topk 2 and 3, deep and shallow), top-k and sampled drafting, temperature 1 and
each filter, and a batch mixing greedy, top-p and min-p requests of different prompt lengths.

The target is "mostly Markov" (as in ``tests/cover/test_eagle.py``): its ``lm_head`` reads the
embedding back through a permutation, scaled down so that at temperature 1 the likeliest next
token has probability 0.4-0.9 instead of ~1. Drafts come in two kinds: random heads, and heads
built to predict the target's Markov vote, so that rounds accept draft tokens often (asserted:
mean acceptance length > 1.2) and the accept path, not only the bonus path, is exercised.

Thresholds: a chi-square quantile at 6 standard deviations (Wilson-Hilferty, false-alarm
probability ~1e-9) and a total-variation bound (its expectation bound plus a McDiarmid term at
1e-9); any emitted tuple of exact probability 0 fails outright. The draws are fixed by their
seeds, so a failure is a behaviour change, never bad luck. Three deliberately wrong pipelines
(the bonus drawn from the target instead of the residual; verify ignoring the sampling filters;
sampled drafts verified against another distribution than they were drawn from) must fail the
same check, which shows the check can see the bugs it is there for.

``tests/nocover/test_eagle_stats_large.py`` reuses these helpers for three-token joints, more seeds
and more settings.
"""

from __future__ import annotations

import itertools
import math
import sys

import attrs
import numpy as np
import pytest
import torch
from conftest import tiny_config
from heads import agreeing_head, markov_target
from stats import chi2_stat, chi2_threshold, tv_bound

import speculum.pipelines.eagle as eagle_module
import speculum.spec.accept as accept_module
from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.models.standalone import StandaloneHead
from speculum.pipelines import get_pipeline
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import acceptance_stats, run_to_completion
from speculum.spec.paged import extend_batch
from speculum.spec.sampling import filtered_probs
from speculum.state import PagedKV, SamplingParams
from speculum.state.record import replace

VOCAB = 6
PAGE_SIZE = 4  # small pages: tree tails and draft-extend cross page boundaries
MAX_CONTEXT = 32
#: Requests per scheduler run (the engine's max_batch); more seeds run as further chunks.
CHUNK = 1500
SEEDS = 6000


# ------------------------------------------------------------------------------ the models


TARGET = markov_target(VOCAB, head_scale=0.25)


def agreeing_eagle3_head():
    """An EAGLE-3 head predicting the target's Markov vote.

    EAGLE-3's midlayer reaches the token embedding only through attention (its residual is the
    hidden state), so attention is made to look at the query's own position: head 0's query and
    key are the same vector ``c[token]`` in the two fastest rotary pairs, scaled so that
    ``q . k`` is largest, by a wide margin, at relative distance 0 (for any other key, another
    token or a rotated copy of the same one scores less). Its value is the one-hot of the token,
    which ``o_proj`` maps to a multiple of the token's embedding. With the residual damped
    (``norm_before_residual`` and a small ``hidden_norm``) and the MLP silenced, the output is
    essentially that embedding, and the head's ``lm_head`` (the target's) reads the vote off it.
    The target's features still enter, through the damped residual.
    """
    head = random_draft(TARGET, "eagle3", seed=4, std=0.3, norm_before_residual=True)
    embed = TARGET.model.embed_tokens.weight
    width, head_dim = embed.shape[1], head.config.layer.head_dim
    normed = embed / embed.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()  # input_layernorm
    generator = torch.Generator().manual_seed(1)
    directions = torch.randn(VOCAB, 4, generator=generator)
    directions = directions / directions.norm(dim=-1, keepdim=True)
    qk = torch.zeros(VOCAB, head_dim)
    half = head_dim // 2
    # q . k / sqrt(head_dim) = 30 at distance 0: every other key is >= ~3 below in logit.
    qk[:, [0, 1, half, half + 1]] = directions * math.sqrt(30.0 * math.sqrt(head_dim))
    to_qk = torch.linalg.lstsq(normed, qk).solution.T  # [head_dim, width]
    to_value = torch.linalg.lstsq(normed, torch.eye(VOCAB, head_dim)).solution.T
    unit = embed / embed.norm(dim=-1, keepdim=True) * math.sqrt(width)
    attn = head.midlayer.self_attn
    with torch.no_grad():
        for weight in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            weight.weight.zero_()
        attn.q_proj.weight[:head_dim, :width] = to_qk
        attn.k_proj.weight[:head_dim, :width] = to_qk
        attn.v_proj.weight[:head_dim, :width] = to_value
        attn.o_proj.weight[:, :VOCAB] = 4.0 * unit.T
        head.midlayer.mlp.down_proj.weight.zero_()
        head.midlayer.hidden_norm.weight.fill_(0.3)
        head.lm_head.weight.copy_(TARGET.lm_head.weight)
    return head


def reduced_vocab_eagle3_head():
    """A random EAGLE-3 head whose ``lm_head`` covers 4 of the 6 target ids through ``d2t``."""
    head = random_draft(TARGET, "eagle3", seed=8, std=0.3, draft_vocab_size=4)
    head.set_target_ids(torch.tensor([5, 0, 3, 2]))
    return head


HEADS = {
    ("eagle", "agree"): lambda: agreeing_head(TARGET, "eagle"),
    ("mtp", "agree"): lambda: agreeing_head(TARGET, "mtp"),
    ("eagle3", "agree"): agreeing_eagle3_head,
    ("eagle", "random"): lambda: random_draft(TARGET, "eagle", seed=7, std=0.3),
    ("mtp", "random"): lambda: random_draft(TARGET, "mtp", seed=7, std=0.3),
    ("eagle3", "random"): lambda: random_draft(TARGET, "eagle3", seed=7, std=0.3),
    ("eagle3", "reduced"): reduced_vocab_eagle3_head,
    # STANDALONE: the target as its own draft (sampled drafts are then drawn from exactly the
    # target's law and accepted with probability 1) and a small random LM.
    ("standalone", "agree"): lambda: StandaloneHead(TARGET, VOCAB),
    ("standalone", "random"): lambda: StandaloneHead(
        random_model(tiny_config(vocab_size=VOCAB, num_layers=1), seed=8, std=0.3), VOCAB
    ),
}
_HEAD_CACHE: dict = {}


def head_for(algorithm: str, kind: str):
    key = (algorithm, kind)
    if key not in _HEAD_CACHE:
        _HEAD_CACHE[key] = HEADS[key]()
    return _HEAD_CACHE[key]


# ------------------------------------------------------------------------- the exact law


DEFAULT_SETTING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def params(rows: int, setting: dict) -> SamplingParams:
    """Sampling parameters of ``rows`` requests with one setting (seed irrelevant here)."""
    s = {**DEFAULT_SETTING, **setting}
    return SamplingParams(
        temperature=torch.full((rows,), float(s["temperature"])),
        top_k=torch.full((rows,), int(s["top_k"]), dtype=torch.int64),
        top_p=torch.full((rows,), float(s["top_p"])),
        min_p=torch.full((rows,), float(s["min_p"])),
        seed=torch.zeros(rows, dtype=torch.int64),
    )


def next_token_logits(target, prefixes: list[list[int]]) -> torch.Tensor:
    """``[len(prefixes), vocab]``: the target's logits after each prefix, by a plain prefill."""
    rows, longest = len(prefixes), max(map(len, prefixes))
    pages = math.ceil(longest / PAGE_SIZE)
    pool = target.new_pool(rows * pages + 1, PAGE_SIZE)
    kv = PagedKV(
        page_table=torch.arange(1, rows * pages + 1).reshape(rows, pages),
        seq_lens=torch.zeros(rows, dtype=torch.int64),
        page_size=PAGE_SIZE,
    )
    tokens = torch.zeros(rows, longest, dtype=torch.int64)
    for row, prefix in enumerate(prefixes):
        tokens[row, : len(prefix)] = torch.tensor(prefix)
    lengths = torch.tensor([len(p) for p in prefixes])
    hidden, _ = target(extend_batch(kv, tokens, lengths), pool)
    return target.logits(hidden[torch.arange(rows), lengths - 1])


def filter_margin(logits: torch.Tensor, setting: dict) -> float:
    """How far (in probability) every row is from flipping a top-k / top-p / min-p decision.

    The pipeline's verify computes the target's logits in a tree forward, which differs from a
    plain prefill by float rounding; a token sitting on a filter's threshold could then be kept
    by one and dropped by the other, so settings must keep clear of thresholds (1e-4 is a
    thousand times the float32 discrepancy). Greedy rows must keep clear of argmax ties.
    """
    s = {**DEFAULT_SETTING, **setting}
    if s["temperature"] == 0:
        top2 = torch.softmax(logits.double(), dim=-1).topk(2, dim=-1).values
        return float((top2[:, 0] - top2[:, 1]).min())
    probs = torch.softmax(logits.double() / s["temperature"], dim=-1)
    ordered = probs.sort(dim=-1, descending=True).values
    k = s["top_k"] if 0 < s["top_k"] < VOCAB else VOCAB
    margins = [math.inf]
    if k < VOCAB:
        margins.append(float((ordered[:, k - 1] - ordered[:, k]).min()))
    if s["top_p"] < 1:
        kept = ordered[:, :k] / ordered[:, :k].sum(-1, keepdim=True)
        before = kept.cumsum(-1) - kept
        margins.append(float((before[:, 1:] - s["top_p"]).abs().min()))
    if s["min_p"] > 0:
        margins.append(float((ordered[:, 1:] - s["min_p"] * ordered[:, :1]).abs().min()))
    return min(margins)


def exact_joint(target, prompt: list[int], setting: dict, num_tokens: int) -> np.ndarray:
    """The target's law of the first ``num_tokens`` generated tokens after ``prompt``, flat,
    last token fastest (``itertools.product`` order)."""
    joint = np.ones(1)
    for step in range(num_tokens):
        prefixes = [prompt + list(t) for t in itertools.product(range(VOCAB), repeat=step)]
        logits = next_token_logits(target, prefixes)
        margin = filter_margin(logits, setting)
        assert margin > 1e-4, f"setting {setting} sits {margin:.2g} from a filter threshold"
        probs = filtered_probs(logits, params(len(prefixes), setting)).double().numpy()
        joint = (joint[:, None] * probs).reshape(-1)
    return joint


# ----------------------------------------------------------------------- the empirical law


def speculative_engine(algorithm: str, head, spec: SpecOptions, prompt_len: int, num_tokens: int):
    """An engine whose batch holds ``CHUNK`` requests, all prefilled in one step.

    ``num_pages`` is set to what the requests reserve (rather than the default of a full
    context each), which keeps the allocator's per-request bookkeeping small.
    """
    lookahead = get_pipeline(
        algorithm,
        num_steps=spec.num_steps,
        topk=spec.topk,
        num_draft_tokens=spec.num_draft_tokens,
        sample_drafts=spec.sample_drafts,
        vocab_size=VOCAB,
    ).kv_lookahead
    per_request = math.ceil((prompt_len + num_tokens + lookahead) / PAGE_SIZE)
    return engine_from_model(
        TARGET,
        algorithm=algorithm,
        draft=head,
        spec=spec,
        page_size=PAGE_SIZE,
        num_pages=CHUNK * per_request + 1,
        max_batch=CHUNK,
        max_context=MAX_CONTEXT,
        prefill_budget=CHUNK * prompt_len,
    )


def sample_tokens(
    engine, groups: list[tuple[list[int], dict]], num_seeds: int, num_tokens: int, salt: int = 0
) -> tuple[list[np.ndarray], list[list[int]]]:
    """Decode ``num_seeds`` requests (one per seed), request ``i`` with the prompt and sampling
    setting of ``groups[i % len(groups)]``, so groups share batches row by row.

    Returns, per group, the first ``num_tokens`` tokens of its requests and the summed
    acceptance-length histogram of their rounds.
    """
    rows: list[list] = [[] for _ in groups]
    histograms: list[list[int]] = [[0] for _ in groups]
    for start in range(0, num_seeds, engine.config.max_batch):
        state, rids = scheduler.new_state(engine), []
        for i in range(start, min(start + engine.config.max_batch, num_seeds)):
            prompt, setting = groups[i % len(groups)]
            sampling = scheduler.Sampling(
                seed=salt * 1_000_003 + i, **{**DEFAULT_SETTING, **setting}
            )
            state, rid = scheduler.add_request(
                engine, state, prompt, sampling=sampling, max_new_tokens=num_tokens
            )
            rids.append((i % len(groups), rid))
        _, finished = run_to_completion(engine, state)
        for group, rid in rids:
            request, histogram = finished[rid], histograms[group]
            rows[group].append(request.output)
            histogram += [0] * (len(request.round_lengths) - len(histogram))
            for k, count in enumerate(request.round_lengths):
                histogram[k] += count
    assert all(len(r) == num_tokens for group in rows for r in group), "a request stopped early"
    tokens = [np.array(r, dtype=np.int64).reshape(-1, num_tokens) for r in rows]
    return tokens, histograms


#: Standard deviations of the chi-square quantile: 6 is a false-alarm probability of ~1e-9.
Z = 6.0
FALSE_ALARM = 1e-9


def joint_stats(tokens: np.ndarray, joint: np.ndarray) -> dict:
    """Chi-square (cells with expected count < 5 pooled) and total variation of the emitted
    token tuples against the exact joint law, and the count of tuples the law gives
    probability 0. A one-point law (greedy) has no degrees of freedom: only the off-support
    count speaks."""
    n, k = tokens.shape
    code = np.zeros(n, dtype=np.int64)
    for j in range(k):
        code = code * VOCAB + tokens[:, j]
    counts = np.bincount(code, minlength=VOCAB**k).astype(np.float64)
    chi2, dof = chi2_stat(counts, n * joint)
    return dict(
        samples=n,
        off_support=float(counts[joint == 0].sum()),
        chi2=round(chi2, 2),
        dof=dof,
        threshold=round(chi2_threshold(dof, Z), 2) if dof > 0 else math.inf,
        tv=round(float(0.5 * np.abs(counts / n - joint).sum()), 4),
        tv_bound=round(float(tv_bound(joint, n, FALSE_ALARM)), 4),
    )


def lossless(stats: dict) -> bool:
    return (
        stats["off_support"] == 0
        and stats["chi2"] < stats["threshold"]
        and stats["tv"] < stats["tv_bound"]
    )


def run_case(case: dict, num_tokens: int, num_seeds: int, salt: int = 0) -> list[dict]:
    """Decode one case (all its groups in shared batches) and compare each group with its
    exact law; returns the statistics per group, with the acceptance metrics."""
    groups = case.get("groups") or [(case["prompt"], case["setting"])]
    spec = SpecOptions(**case["spec"])
    head = head_for(case["algorithm"], case["head"])
    longest = max(len(prompt) for prompt, _ in groups)
    engine = speculative_engine(case["algorithm"], head, spec, longest, num_tokens)
    tokens, histograms = sample_tokens(engine, groups, num_seeds, num_tokens, salt)
    results = []
    for (prompt, setting), sampled, histogram in zip(groups, tokens, histograms):
        stats = joint_stats(sampled, exact_joint(TARGET, prompt, setting, num_tokens))
        acceptance = acceptance_stats(histogram)
        stats["accept_length_mean"] = round(acceptance["accept_length_mean"], 3)
        stats["accept_rate_per_position"] = [
            round(r, 3) for r in acceptance["accept_rate_per_position"]
        ]
        results.append(stats)
    return results


# ------------------------------------------------------------------------------- the cases

CHAIN3 = {"num_steps": 3, "topk": 1}

#: name -> algorithm, head kind, round shape, sampling setting, prompt. Every algorithm, chains
#: and trees (topk 2 and 3, shallow and deep), temperature 1 and each filter, agreeing and
#: random heads, a reduced EAGLE-3 vocabulary.
CASES = {
    "eagle-chain-agree": dict(
        algorithm="eagle", head="agree", spec=CHAIN3, setting={}, prompt=[1, 4, 2]
    ),
    "eagle-tree3-agree-topk": dict(
        algorithm="eagle",
        head="agree",
        spec={"num_steps": 3, "topk": 3, "num_draft_tokens": 7},
        setting={"top_k": 3},
        prompt=[5, 3, 1, 0, 4],
    ),
    "eagle3-tree2-agree-topp": dict(
        algorithm="eagle3",
        head="agree",
        spec={"num_steps": 3, "topk": 2, "num_draft_tokens": 5},
        setting={"temperature": 1.5, "top_p": 0.9},
        prompt=[5, 4, 3],
    ),
    "mtp-chain-agree-minp": dict(
        algorithm="mtp",
        head="agree",
        spec={"num_steps": 2, "topk": 1},
        setting={"temperature": 1.3, "min_p": 0.08},
        prompt=[1, 5],
    ),
    "eagle3-chain-reduced-vocab-all-filters": dict(
        algorithm="eagle3",
        head="reduced",
        spec={"num_steps": 4, "topk": 1},
        setting={"temperature": 1.2, "top_k": 4, "top_p": 0.9, "min_p": 0.05},
        prompt=[3, 3],
    ),
    "mtp-tree3-random": dict(
        algorithm="mtp",
        head="random",
        spec={"num_steps": 3, "topk": 3, "num_draft_tokens": 8},
        setting={},
        prompt=[0, 2, 3],
    ),
    "eagle-tree2-random-shallow": dict(
        algorithm="eagle",
        head="random",
        spec={"num_steps": 4, "topk": 2, "num_draft_tokens": 3},
        setting={"temperature": 1.3},
        prompt=[4, 1],
    ),
    # Sampled drafting: tokens drawn from the draft's filtered distribution, which is handed
    # to the verifier (the rule is no longer the one-hot special case).
    "eagle-sampled-chain-agree-topk": dict(
        algorithm="eagle",
        head="agree",
        spec={"num_steps": 3, "topk": 1, "sample_drafts": True},
        setting={"temperature": 1.5, "top_k": 3},
        prompt=[5, 3, 1, 0, 4],
    ),
    "eagle3-sampled-chains3-agree-topp": dict(
        algorithm="eagle3",
        head="agree",
        spec={"num_steps": 2, "topk": 3, "sample_drafts": True},
        setting={"temperature": 2.5, "top_p": 0.9},
        prompt=[4, 1],
    ),
    "standalone-sampled-chain-self": dict(
        algorithm="standalone",
        head="agree",
        spec={"num_steps": 3, "topk": 1, "sample_drafts": True},
        setting={},
        prompt=[2, 5],
    ),
    "standalone-sampled-chains3-random-topk": dict(
        algorithm="standalone",
        head="random",
        spec={"num_steps": 2, "topk": 3, "sample_drafts": True},
        setting={"top_k": 4},
        prompt=[1, 3, 0],
    ),
    "standalone-tree2-self-topp": dict(
        algorithm="standalone",
        head="agree",
        spec={"num_steps": 3, "topk": 2, "num_draft_tokens": 6},
        setting={"top_p": 0.9},
        prompt=[4, 4, 1],
    ),
    "mtp-sampled-chains2-random-minp": dict(
        algorithm="mtp",
        head="random",
        spec={"num_steps": 2, "topk": 2, "sample_drafts": True},
        setting={"min_p": 0.05},
        prompt=[3, 0, 5, 1],
    ),
}


def one_hot_draft_fraction(case: dict, requests: int = 16) -> float:
    """The fraction of requests whose first filtered draft distribution is one-hot.

    The agreeing heads are confident; a filter (min-p, a small top-p) can cut their
    distribution down to one token, and sampled drafting then *is* top-1 drafting, which would
    leave the non-one-hot acceptance rule untested. Sampled cases must keep this low.
    """
    spec = SpecOptions(**case["spec"])
    head = head_for(case["algorithm"], case["head"])
    engine = speculative_engine(case["algorithm"], head, spec, len(case["prompt"]), 2)
    state = scheduler.new_state(engine)
    sampling = scheduler.Sampling(**{**DEFAULT_SETTING, **case["setting"]})
    for seed in range(requests):
        state, _ = scheduler.add_request(
            engine, state, case["prompt"], sampling=attrs.evolve(sampling, seed=seed)
        )
    state, _ = scheduler.step(engine, state)  # prefill: the batch now holds the predictions
    batch = state.batch
    q = filtered_probs(head.logits(batch.prediction.hidden), batch.sampling)
    return float((q.amax(-1) == 1.0).float().mean())


@pytest.mark.parametrize("name", list(CASES))
def test_first_two_tokens_follow_the_target_law(name):
    case = CASES[name]
    if case["spec"].get("sample_drafts"):
        assert one_hot_draft_fraction(case) < 0.5, "the filter leaves the draft one token"
    (stats,) = run_case(case, num_tokens=2, num_seeds=SEEDS)
    assert lossless(stats), stats
    if case["head"] == "agree":
        # Otherwise the rounds would mostly emit bonus tokens and prove little about accepts.
        assert stats["accept_length_mean"] > 1.2, stats


def test_first_three_tokens_of_a_deep_tree_follow_the_target_law():
    """Three tokens reach past the first accepted draft token: the second token of a round
    (accepted at depth 2, or the bonus after one accept) and the round after a short one."""
    (stats,) = run_case(CASES["eagle3-tree2-agree-topp"], num_tokens=3, num_seeds=9000)
    assert lossless(stats), stats
    assert stats["accept_rate_per_position"][1] > 0.2, stats


#: Three kinds of request in one batch, interleaved row by row: greedy, top-p and min-p rows
#: with different prompt lengths (so padded rows and per-row settings are exercised together).
MIXED = dict(
    algorithm="eagle",
    head="agree",
    spec={"num_steps": 3, "topk": 2, "num_draft_tokens": 6},
    groups=[
        ([1, 4, 2], {"temperature": 1.5, "top_p": 0.9}),
        ([4, 1], {"temperature": 1.3, "min_p": 0.08}),
        ([0, 3, 5, 2, 2, 1], {"temperature": 0.0}),
    ],
)


def test_rows_of_a_mixed_batch_each_follow_their_own_law():
    results = run_case(MIXED, num_tokens=2, num_seeds=6000)
    for stats in results:
        assert lossless(stats), results
    assert results[2]["accept_length_mean"] == 4.0, results  # greedy: the Markov vote, always


def _bonus_from_the_target(original):
    """Wrong rule: a rejected sibling's token is not removed from the residual, so the bonus is
    drawn from the target's distribution again (the classic 'resample from p' bug)."""

    def try_child(residual, token, q, u):
        accepted, _ = original(residual, token, q, u)
        return accepted, residual

    return try_child


def _verify_without_filters(original):
    """Wrong verify: the target's distribution ignores top-k / top-p / min-p (temperature only)."""

    def unfiltered(logits, sampling):
        off = replace(
            sampling,
            top_k=torch.zeros_like(sampling.top_k),
            top_p=torch.ones_like(sampling.top_p),
            min_p=torch.zeros_like(sampling.min_p),
        )
        return original(logits, off)

    return unfiltered


def _claim_other_draft_probs(original):
    """Wrong verify for sampled drafts: the verifier is told another distribution (half the
    one the drafts were drawn from, half uniform) than the drafts' own."""

    def verify(resources, state, tree, config, draft_probs=None):
        if draft_probs is not None:
            draft_probs = 0.5 * draft_probs + 0.5 / draft_probs.shape[-1]
        return original(resources, state, tree, config, draft_probs)

    return verify


def _patch_everywhere(monkeypatch, original, replacement) -> None:
    """Rebind ``original`` to ``replacement`` in every speculum module that imported it (the
    stage that calls it may live in the pipeline or in a shared ``spec`` module)."""
    found = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith("speculum") and getattr(module, original.__name__, None) is original
    ]
    assert found, f"{original.__name__} is imported nowhere in speculum"
    for name in found:
        monkeypatch.setattr(sys.modules[name], original.__name__, replacement)


WRONG = {
    "bonus-from-target": (accept_module._try_child, _bonus_from_the_target, "eagle-chain-agree"),
    "unfiltered-verify": (filtered_probs, _verify_without_filters, "eagle-tree3-agree-topk"),
    "misreported-draft-probs": (
        eagle_module.verify,
        _claim_other_draft_probs,
        "eagle-sampled-chain-agree-topk",
    ),
}


@pytest.mark.parametrize("bug", list(WRONG))
def test_the_check_catches_wrong_pipelines(monkeypatch, bug):
    original, wrap, name = WRONG[bug]
    _patch_everywhere(monkeypatch, original, wrap(original))
    (stats,) = run_case(CASES[name], num_tokens=2, num_seeds=1500)
    assert not lossless(stats), (bug, stats)
