"""FROZEN_KV_MTP: greedy equality with plain decoding, a draft that reads only the target's
committed K/V of its source layers and writes nothing, the draft against the head run from
scratch, deep acceptance with an agreeing head, snapshot/restore, and checkpoint I/O."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from conftest import started, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from strategies import (
    max_new_tokens,
    page_sizes,
    prefill_budgets,
    prompt_batches,
    stop_token_sets,
)
from test_eagle import TARGET, VOCAB, plain_greedy, round_shapes

from speculum.models.draft_loading import DraftTargetMismatch
from speculum.models.frozen_kv import (
    FrozenKVHead,
    load_frozen_kv,
    random_frozen_kv,
    save_frozen_kv,
)
from speculum.models.loading import CheckpointError, random_model, save_model
from speculum.pipelines import ALGORITHMS, frozen_kv_mtp
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, build_engine, engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.spec.paged import extend_batch
from speculum.state import PagedKV
from speculum.state.draft import EagleConfig


def agreeing_head(**options):
    """A head that mostly predicts the target's Markov vote: ``eh_proj`` passes the token
    embedding through (the target's lm_head reads the vote off it) and scales the seed hidden
    down, attention is damped and the MLP silenced. The damped terms stay non-zero, so the seed
    hidden and the target's cached K/V still change the head's output."""
    head = random_frozen_kv(TARGET, seed=3, std=0.3, **options)
    width = TARGET.config.hidden_size
    with torch.no_grad():
        head.eh_proj.weight[:, :width] = torch.eye(width)
        head.eh_proj.weight[:, width:] *= 0.1
        for layer in head.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.zero_()
    return head


HEADS = {
    "agreeing": agreeing_head(),
    # Two layers reading different target layers, with an lm_head of its own.
    "random": random_frozen_kv(
        TARGET, num_layers=2, source_layers=(0, 2), own_head=True, seed=4, std=0.3
    ),
}


def engine(head, num_steps=3, topk=1, num_draft_tokens=None, sample=False, **limits):
    """An engine running the frozen_kv_mtp pipeline with ``head``."""
    spec = SpecOptions(
        num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens, sample_drafts=sample
    )
    return engine_from_model(
        TARGET,
        algorithm="frozen_kv_mtp",
        draft=head,
        spec=spec,
        **({"page_size": 4, "max_context": 48, "max_batch": 8} | limits),
    )


@settings(max_examples=50)
@given(
    head=st.sampled_from(sorted(HEADS)),
    shape=round_shapes,
    sample=st.booleans(),
    prompts=prompt_batches(VOCAB),
    max_new_tokens=max_new_tokens,
    stop_token_ids=stop_token_sets(VOCAB),
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
)
def test_greedy_frozen_kv_mtp_equals_plain(
    head, shape, sample, prompts, max_new_tokens, stop_token_ids, page_size, prefill_budget
):
    """Token for token, for chains, top-k trees and sampled chains (one-hot for greedy
    requests), batches of 1-8, page sizes, prompt chunking, stop tokens and token limits."""
    num_steps, topk, num_draft_tokens = shape
    if sample:
        num_draft_tokens = topk * num_steps + 1
    limits = {"page_size": page_size, "prefill_budget": prefill_budget}
    spec = engine(HEADS[head], num_steps, topk, num_draft_tokens, sample, **limits)
    results = generate(
        prompts, engine=spec, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
    )
    expected = plain_greedy(prompts, max_new_tokens, stop_token_ids, max_context=48, **limits)
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize(("num_steps", "topk", "num_draft_tokens"), [(4, 1, None), (4, 2, 8)])
def test_an_agreeing_head_is_accepted_several_tokens_deep(num_steps, topk, num_draft_tokens):
    """The equality above is only strong if rounds accept multi-token paths."""
    spec = engine(HEADS["agreeing"], num_steps, topk, num_draft_tokens)
    results = generate([[1, 2, 3], [9, 9, 9, 1]], engine=spec, max_new_tokens=40)
    for result in results:
        assert result.stats["accept_length_mean"] > 2.0
        assert sum(result.stats["accept_length_histogram"][num_steps:]) > 0


def corrupt_all_but(pool, kv, sources):
    """Random values everywhere in ``pool`` except the committed entries of layers
    ``sources``: what a draft reading anything else would see."""
    keep = torch.zeros(pool.k.shape[:3], dtype=torch.bool)
    for row in range(kv.seq_lens.shape[0]):
        for index in range(int(kv.seq_lens[row])):
            page = kv.page_table[row, index // kv.page_size]
            keep[list(sources), page, index % kv.page_size] = True
    generator = torch.Generator().manual_seed(0)
    for cache in (pool.k, pool.v):
        noise = torch.randn(cache.shape, generator=generator) * 50
        cache.copy_(torch.where(keep[..., None, None], cache, noise))


@pytest.mark.parametrize("sample", [False, True])
def test_the_draft_reads_only_committed_source_entries_and_writes_nothing(sample):
    head = HEADS["random"]
    topk = 2
    spec = engine(head, num_steps=3, topk=topk, num_draft_tokens=7 if sample else 6, sample=sample)
    assert spec.resources.draft_pool is None  # the head owns no KV
    state, _ = started(
        spec,
        [3, 14, 15, 9, 2, 6],
        rounds=2,
        sampling=scheduler.Sampling(temperature=1.0, seed=3),
        max_new_tokens=20,
    )
    config = EagleConfig(num_steps=3, topk=topk, num_draft_tokens=7, sample_drafts=sample)
    stage = frozen_kv_mtp.draft_sampled if sample else frozen_kv_mtp.draft
    pool = spec.resources.target_pool
    before = (pool.k.clone(), pool.v.clone())
    first = stage(spec.resources, state.batch, config)
    assert torch.equal(pool.k, before[0]) and torch.equal(pool.v, before[1])

    corrupt_all_but(pool, state.batch.kv, head.config.source_layers)
    second = stage(spec.resources, state.batch, config)
    for ours, theirs in zip(
        torch.utils._pytree.tree_leaves(first), torch.utils._pytree.tree_leaves(second)
    ):
        assert torch.equal(ours, theirs)


def reference_chain(head, pool, kv, token, hidden, steps):
    """The head's greedy chain from a seed, one forward per step against ``pool``, every step
    at the committed length ``kv.seq_lens`` (the head writes nothing, so nothing moves)."""
    tokens, scores, score = [], [], 1.0
    for _ in range(steps):
        batch = extend_batch(kv, torch.tensor([[token]]), torch.tensor([1]))
        hidden = head(batch, pool, hidden[:, None])[:, 0]
        probs = torch.softmax(head.logits(hidden), dim=-1)[0]
        token = int(probs.argmax())
        score = score * probs[token]
        tokens.append(token)
        scores.append(score)
    return tokens, torch.stack(scores)


@pytest.mark.parametrize("head_name", sorted(HEADS))
def test_the_draft_equals_the_head_run_on_a_fresh_prefill(head_name):
    """After rounds of commit and seed recording, the carried seed is the target's last
    committed hidden state and the bonus token, and the draft chain is the head's from
    scratch over a fresh plain prefill of the committed tokens."""
    head, num_steps = HEADS[head_name], 4
    spec = engine(head, num_steps=num_steps)
    state, _ = started(spec, [5, 1, 12], rounds=4, max_new_tokens=30)
    (request,) = state.running
    if head_name == "agreeing":
        assert max(k for k, n in enumerate(request.round_lengths) if n) > 1

    ours = state.batch
    committed = [*request.prompt, *request.output[:-1]]
    assert int(ours.kv.seq_lens[0]) == len(committed)
    assert int(ours.seed.tokens[0]) == request.output[-1]
    pool = TARGET.new_pool(spec.config.num_pages, 4)
    fresh = PagedKV(
        page_table=ours.kv.page_table, seq_lens=torch.zeros(1, dtype=torch.int64), page_size=4
    )
    n = len(committed)
    hidden, _ = TARGET(extend_batch(fresh, torch.tensor([committed]), torch.tensor([n])), pool)
    torch.testing.assert_close(ours.seed.hidden, hidden[:, -1], rtol=1e-4, atol=1e-5)

    kv = PagedKV(page_table=fresh.page_table, seq_lens=torch.tensor([n]), page_size=4)
    tokens, scores = reference_chain(head, pool, kv, request.output[-1], hidden[:, -1], num_steps)
    config = EagleConfig(num_steps=num_steps, topk=1, num_draft_tokens=num_steps + 1)
    candidates = frozen_kv_mtp.draft(spec.resources, ours, config)
    assert candidates.tokens[0].tolist() == tokens
    torch.testing.assert_close(candidates.scores[0], scores, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sample", [False, True])
def test_snapshot_restore_replays_sampled_decoding(sample):
    spec = engine(HEADS["agreeing"], 3, 2, 7 if sample else 6, sample=sample)
    sampling = scheduler.Sampling(temperature=1.0, top_p=0.9, seed=77)
    state, rid = started(spec, [4, 2, 8], rounds=2, sampling=sampling, max_new_tokens=20)
    snap = scheduler.take_snapshot(spec, state)
    _, finished = run_to_completion(spec, state)
    first = finished[rid].output
    _, finished = run_to_completion(spec, scheduler.restore(spec, snap))
    assert finished[rid].output == first


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"architecture": "Qwen2ForCausalLM", "qkv_bias": True},
        {"architecture": "Qwen3ForCausalLM", "qk_norm": True},
    ],
)
def test_save_and_load_round_trip(tmp_path, changes):
    target = random_model(tiny_config(vocab_size=VOCAB, num_layers=3, **changes), seed=1)
    head = random_frozen_kv(target, num_layers=2, source_layers=(2, 0), own_head=True, seed=2)
    loaded = load_frozen_kv(save_frozen_kv(head, tmp_path / "draft"), target)
    assert loaded.config == head.config
    ours, theirs = dict(head.named_parameters()), dict(loaded.named_parameters())
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not any("k_proj" in k or "v_proj" in k for k in ours)
    assert ("layers.0.self_attn.q_norm.weight" in ours) == bool(changes.get("qk_norm"))
    assert ("layers.0.self_attn.q_proj.bias" in ours) == bool(changes.get("qkv_bias"))


@pytest.fixture
def saved(tmp_path):
    """A saved head for TARGET, as (folder, its config dict, its tensors)."""
    folder = save_frozen_kv(HEADS["random"], tmp_path / "draft")
    return (
        folder,
        json.loads((folder / "config.json").read_text()),
        load_file(folder / "model.safetensors"),
    )


def rewrite(folder, config=None, tensors=None):
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_strict_loading_names_missing_unexpected_and_misshaped_weights(saved):
    folder, _, tensors = saved
    name = "layers.1.self_attn.q_proj.weight"
    with pytest.raises(CheckpointError, match=rf"missing weights \['{name}'\]"):
        load_frozen_kv(
            rewrite(folder, tensors={k: v for k, v in tensors.items() if k != name}), TARGET
        )
    extra = {**tensors, "layers.0.self_attn.k_proj.weight": torch.zeros(16, 32)}
    with pytest.raises(CheckpointError, match="unexpected weights.*k_proj"):
        load_frozen_kv(rewrite(folder, tensors=extra), TARGET)
    with pytest.raises(CheckpointError, match="shapes disagree.*eh_proj"):
        load_frozen_kv(
            rewrite(folder, tensors={**tensors, "eh_proj.weight": torch.zeros(32, 32)}), TARGET
        )


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (
            {"frozen_kv_source_layers": [0, 4]},
            DraftTargetMismatch,
            r"layers \[4\] are out of range",
        ),
        ({"frozen_kv_source_layers": [-1, 0]}, DraftTargetMismatch, "out of range"),
        ({"frozen_kv_source_layers": [0]}, CheckpointError, "one source layer per draft layer"),
        ({"frozen_kv_source_layers": "last"}, CheckpointError, "list of target layer indices"),
        ({"target_num_hidden_layers": 6}, DraftTargetMismatch, "6-layer target"),
        ({"architectures": ["LlamaForCausalLM"]}, CheckpointError, "not a frozen-KV draft"),
    ],
)
def test_config_errors_are_named(saved, edit, error, match):
    folder, config, _ = saved
    with pytest.raises(error, match=match):
        load_frozen_kv(rewrite(folder, config={**config, **edit}), TARGET)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"vocab_size": VOCAB + 1}, "vocabulary: draft 16 ids vs target 17"),
        ({"hidden_size": 64}, "hidden size"),
        ({"num_kv_heads": 4}, "num_kv_heads"),
        ({"rope_theta": 500.0}, "rope_theta"),
    ],
)
def test_a_draft_for_another_target_is_refused(saved, changes, match):
    folder = saved[0]
    other = random_model(attrs.evolve(TARGET.config, **changes), seed=0)
    with pytest.raises(DraftTargetMismatch, match=match):
        load_frozen_kv(folder, other)


def test_constructor_errors():
    with pytest.raises(DraftTargetMismatch, match=r"layers \[7\] are out of range"):
        random_frozen_kv(TARGET, source_layers=(7,))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_frozen_kv("/nonexistent/folder", TARGET)
    with pytest.raises(ValueError, match="num_draft_tokens is required"):
        frozen_kv_mtp.pipeline(num_steps=3, topk=2, vocab_size=VOCAB)
    assert isinstance(HEADS["random"], FrozenKVHead)


def test_a_plain_model_folder_is_not_a_frozen_kv_draft(tmp_path):
    save_model(TARGET, tmp_path / "target")
    with pytest.raises(CheckpointError, match="not a frozen-KV draft"):
        load_frozen_kv(tmp_path / "target", TARGET)


@pytest.mark.skipif(
    "frozen_kv_mtp" not in ALGORITHMS, reason="frozen_kv_mtp is not registered in ALGORITHMS"
)
def test_build_engine_loads_a_frozen_kv_draft_folder(tmp_path):
    save_model(TARGET, tmp_path / "target")
    save_frozen_kv(HEADS["agreeing"], tmp_path / "draft")
    loaded = build_engine(
        tmp_path / "target",
        algorithm="frozen_kv_mtp",
        draft=tmp_path / "draft",
        spec=SpecOptions(num_steps=3, topk=2, num_draft_tokens=6),
        page_size=4,
        max_context=48,
    )
    assert loaded.pipeline.name == "frozen_kv_mtp" and loaded.resources.draft_pool is None
    (result,) = generate([[5, 6, 7]], engine=loaded, max_new_tokens=20)
    assert [result.token_ids] == plain_greedy([[5, 6, 7]], 20, page_size=4, max_context=48)
    assert result.stats["accept_length_mean"] > 2.0
