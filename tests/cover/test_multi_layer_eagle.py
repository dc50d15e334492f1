"""Multi-layer EAGLE: greedy equality with plain decoding, the carried chain against the head
run from scratch on a fresh prefill, deep acceptance with agreeing layers, snapshot/restore of
a sampled run, and checkpoint I/O."""

from __future__ import annotations

import attrs
import pytest
import torch
from conftest import started, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    max_new_tokens,
    page_sizes,
    prefill_budgets,
    prompt_batches,
    stop_token_sets,
)
from test_eagle import TARGET, VOCAB, plain_greedy

from speculum.models.loading import CheckpointError, load_model, random_model
from speculum.models.multi_layer_eagle import (
    load_multi_layer,
    random_multi_layer,
    save_multi_layer,
)
from speculum.pipelines import multi_layer_eagle
from speculum.pipelines.base import PrefillChunk
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.state import PagedKV

MAX_STEPS = 4


def agreeing_head(num_layers: int):
    """Layers that mostly predict the target's Markov vote: each ``eh_proj`` passes the token
    embedding through and damps the hidden input, attention is damped and the MLP silenced
    (the damped terms stay non-zero, so hidden inputs and each layer's cache still matter)."""
    head = random_multi_layer(TARGET, num_layers, seed=3, std=0.3)
    width = TARGET.config.hidden_size
    with torch.no_grad():
        for layer in head.layers:
            layer.eh_proj.weight[:, :width] = torch.eye(width)
            layer.eh_proj.weight[:, width:] *= 0.1
            layer.decoder.self_attn.o_proj.weight.mul_(0.1)
            layer.decoder.mlp.down_proj.weight.zero_()
    return head


HEADS = {
    **{("agreeing", k): agreeing_head(k) for k in range(1, MAX_STEPS + 1)},
    **{
        ("random", k): random_multi_layer(TARGET, k, seed=4 + k, std=0.3, own_head=k % 2 == 0)
        for k in range(1, MAX_STEPS + 1)
    },
}


def engine(kind, num_steps=3, chain_hidden=True, **limits):
    """An engine running the multi_layer_eagle pipeline with one of the test heads."""
    return engine_from_model(
        TARGET,
        algorithm="multi_layer_eagle",
        draft=HEADS[kind, num_steps],
        spec=SpecOptions(num_steps=num_steps, chain_hidden=chain_hidden),
        **({"page_size": 4, "max_context": 48, "max_batch": 8} | limits),
    )


@settings(max_examples=30)
@given(
    kind=st.sampled_from(["agreeing", "random"]),
    num_steps=st.integers(1, MAX_STEPS),
    chain_hidden=st.booleans(),
    prompts=prompt_batches(VOCAB, max_batch=6),
    max_new_tokens=max_new_tokens,
    stop_token_ids=stop_token_sets(VOCAB),
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
)
def test_greedy_multi_layer_eagle_equals_plain(
    kind,
    num_steps,
    chain_hidden,
    prompts,
    max_new_tokens,
    stop_token_ids,
    page_size,
    prefill_budget,
):
    """Token for token, over 1-4 layers, chained or not, batches of 1-6, page sizes, prompt
    chunking, stop tokens and token limits."""
    limits = {"page_size": page_size, "prefill_budget": prefill_budget}
    spec = engine(kind, num_steps, chain_hidden, **limits)
    results = generate(
        prompts, engine=spec, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
    )
    expected = plain_greedy(prompts, max_new_tokens, stop_token_ids, max_context=48, **limits)
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("chain_hidden", [True, False])
def test_agreeing_layers_are_accepted_several_tokens_deep(chain_hidden):
    """The equality above is only strong if rounds accept multi-token paths."""
    spec = engine("agreeing", 4, chain_hidden)
    results = generate([[1, 2, 3], [9, 9, 9, 1]], engine=spec, max_new_tokens=40)
    for result in results:
        assert result.stats["accept_length_mean"] > 2.0
        assert sum(result.stats["accept_length_histogram"][4:]) > 0


def fresh_prefill(spec, committed, page_table, sampling):
    """The pipeline's prefill of ``committed`` in one chunk, on fresh pools."""
    n = len(committed)
    resources = attrs.evolve(
        spec.resources,
        target_pool=TARGET.new_pool(spec.config.num_pages, spec.config.page_size),
        draft_pool=spec.resources.draft.new_pool(spec.config.num_pages, spec.config.page_size),
    )
    chunk = PrefillChunk(
        kv=PagedKV(
            page_table=page_table,
            seq_lens=torch.zeros(1, dtype=torch.int64),
            page_size=spec.config.page_size,
        ),
        tokens=torch.tensor([committed]),
        q_lens=torch.tensor([n]),
        next_tokens=torch.tensor([-1]),
        sampling=sampling,
    )
    return spec.pipeline.prefill(resources, chunk)


@pytest.mark.parametrize("kind", ["agreeing", "random"])
@pytest.mark.parametrize("chain_hidden", [True, False])
@pytest.mark.parametrize("num_steps", [2, 4])
def test_the_carried_chain_equals_a_fresh_prefill(kind, chain_hidden, num_steps):
    """After rounds of verify, commit and layered re-runs, the chain and the carried hidden
    states are those of the head run from scratch over the committed tokens."""
    spec = engine(kind, num_steps, chain_hidden)
    state, _ = started(spec, [5, 1, 12], rounds=5, max_new_tokens=40)
    (request,) = state.running
    if kind == "agreeing":
        assert max(k for k, n in enumerate(request.round_lengths) if n) > 1
    ours = state.batch
    committed = [*request.prompt, *request.output[:-1]]
    assert int(ours.kv.seq_lens[0]) == len(committed)
    assert int(ours.root_tokens[0]) == request.output[-1]
    theirs, first = fresh_prefill(spec, committed, ours.kv.page_table, ours.sampling)
    assert int(first.tokens[0, 0]) == request.output[-1]
    assert ours.carried.chain.tolist() == theirs.carried.chain.tolist()
    torch.testing.assert_close(ours.carried.hidden, theirs.carried.hidden, rtol=1e-4, atol=1e-5)


def test_draft_arranges_the_chain():
    spec = engine("random", 3)
    state, _ = started(spec, [3, 4], rounds=1, max_new_tokens=20)
    tree = multi_layer_eagle.draft(state.batch)
    assert tree.tokens[0].tolist() == [
        int(state.batch.root_tokens[0]),
        *state.batch.carried.chain[0].tolist(),
    ]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2]
    assert tree.depths[0].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("chain_hidden", [True, False])
def test_snapshot_restore_replays_sampled_decoding(chain_hidden):
    spec = engine("agreeing", 3, chain_hidden)
    sampling = scheduler.Sampling(temperature=1.0, top_p=0.9, seed=77)
    state, rid = started(spec, [4, 2, 8], rounds=2, sampling=sampling, max_new_tokens=20)
    snap = scheduler.take_snapshot(spec, state)
    _, finished = run_to_completion(spec, state)
    first = finished[rid].output
    _, finished = run_to_completion(spec, scheduler.restore(spec, snap))
    assert finished[rid].output == first


def test_pipeline_rejects_trees_and_a_mismatched_head():
    with pytest.raises(ValueError, match="topk=1"):
        multi_layer_eagle.pipeline(num_steps=3, vocab_size=VOCAB, topk=2, num_draft_tokens=6)
    with pytest.raises(ValueError, match="num_steps \\+ 1"):
        multi_layer_eagle.pipeline(num_steps=3, vocab_size=VOCAB, num_draft_tokens=3)
    spec = engine("random", 3)
    bad = attrs.evolve(spec, pipeline=multi_layer_eagle.pipeline(num_steps=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="2 MTP layers"):
        generate([[1, 2]], engine=bad, max_new_tokens=3)


@pytest.mark.parametrize("in_target", [True, False])
@pytest.mark.parametrize("own_head", [True, False])
def test_save_and_load_round_trip(tmp_path, in_target, own_head):
    target = random_model(tiny_config(vocab_size=VOCAB, num_layers=3), seed=1)
    head = random_multi_layer(target, 3, seed=2, own_head=own_head)
    folder = save_multi_layer(head, tmp_path / "d", target=target if in_target else None)
    loaded = load_multi_layer(folder, target)
    assert loaded.config == head.config and loaded.num_layers == 3
    ours, theirs = dict(head.named_parameters()), dict(loaded.named_parameters())
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert [layer.decoder.self_attn.layer for layer in loaded.layers] == [0, 1, 2]
    if in_target:  # the target loads from the same folder, its MTP layers ignored
        again = load_model(folder)
        assert all(torch.equal(a, b) for a, b in zip(again.parameters(), target.parameters()))


def test_loading_is_strict(tmp_path):
    from safetensors.torch import load_file, save_file

    target = random_model(tiny_config(vocab_size=VOCAB, num_layers=3), seed=1)
    folder = save_multi_layer(random_multi_layer(target, 2, seed=2), tmp_path / "d")
    tensors = load_file(folder / "model.safetensors")
    save_file(
        {**tensors, "model.layers.4.extra.weight": torch.zeros(2)}, folder / "model.safetensors"
    )
    with pytest.raises(CheckpointError, match="extra"):
        load_multi_layer(folder, target)
    del tensors["model.layers.4.enorm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="enorm"):
        load_multi_layer(folder, target)
    other = random_model(tiny_config(vocab_size=VOCAB, num_layers=2), seed=1)
    with pytest.raises(CheckpointError):
        load_multi_layer(folder, other)
