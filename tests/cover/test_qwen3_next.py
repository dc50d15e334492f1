"""Hybrid targets (Qwen3-Next: gated DeltaNet layers between gated attention layers, a
shared-expert MoE): equal to transformers, and every pipeline equal to plain decoding with the
recurrent state kept per request, per draft node, committed for the accepted path only."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_config
from heads import (
    agreeing_dspark,
    agreeing_head,
    agreeing_multi_layer,
    assert_greedy_equals_transformers,
    assert_pipeline_equals_plain,
    assert_sampled_snapshot_replays,
    assert_tree_states_follow_paths,
    markov_target,
    pipeline_engine,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from safetensors.torch import load_file, save_file
from stats import chi2_stat, chi2_threshold, tv_bound
from strategies import page_sizes, parent_lists, prefill_budgets, prompt_batches
from test_scheduler_machine import PROMPTS, Expected, SchedulerMachine

from speculum import kernels
from speculum.models.block_draft import random_block_draft
from speculum.models.config import (
    CheckpointError,
    DecoderConfig,
    LinearAttentionConfig,
    MoEConfig,
)
from speculum.models.decoder import GatedAttention, GatedDeltaNet
from speculum.models.draft import random_draft
from speculum.models.draft_loading import DraftTargetMismatch
from speculum.models.frozen_kv import random_frozen_kv
from speculum.models.loading import load_model, random_model, save_model
from speculum.models.multi_layer_eagle import random_multi_layer
from speculum.models.parallel import UnsupportedSplit, shard_
from speculum.models.standalone import StandaloneHead
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.runtime.graphs import pad_batch
from speculum.spec.accept import accept
from speculum.spec.paged import causal_mask, extend_batch
from speculum.spec.recurrent import gated_delta_rule
from speculum.spec.verify import commit_path
from speculum.state.batch import take_rows
from speculum.state.kv import KVPool, PagedKV, allocated_pages
from speculum.state.parallel import TensorParallel
from speculum.state.record import tree_equal
from speculum.state.recurrent import PADDING_SLOT, RecurrentPool
from speculum.state.tree import DraftTree

transformers.logging.disable_progress_bar()

VOCAB = 96


def hf_qwen3_next(**changes: object) -> transformers.PreTrainedModel:
    """A float32 transformers Qwen3-Next model (linear, full, linear, full layers; MoE with a
    shared expert in every layer), every parameter random (norms included: zero-centred)."""
    config = transformers.Qwen3NextConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "full_attention_interval": 2,
            "max_position_embeddings": 128,
            **changes,
        }
    )
    model = transformers.Qwen3NextForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            std = param.shape[-1] ** -0.5 if param.dim() >= 2 else 0.3
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    """The transformers model and the folder its ``save_pretrained`` wrote."""
    model = hf_qwen3_next()
    folder = tmp_path_factory.mktemp("qwen3_next")
    model.save_pretrained(folder)
    return model, folder


def test_greedy_decoding_equals_transformers_generate(hf_checkpoint) -> None:
    """Plain greedy decoding through the scheduler (chunked prefill, a batch of prompts of
    several lengths) emits transformers' ``generate`` tokens, token for token."""
    hf, folder = hf_checkpoint
    assert_greedy_equals_transformers(hf, load_model(folder))


def test_the_checkpoint_loads_into_the_hybrid_layer_plan(hf_checkpoint) -> None:
    """Every weight of transformers' layout loads strictly: DeltaNet layers under
    ``linear_attn``, gated attention under ``self_attn``, and the pool holds K/V for the
    attention layers only, recurrent slots for the DeltaNet layers."""
    _, folder = hf_checkpoint
    model = load_model(folder)
    kinds = [type(getattr(layer, layer.mixer_name)) for layer in model.model.layers]
    assert kinds == [GatedDeltaNet, GatedAttention, GatedDeltaNet, GatedAttention]
    pool = model.new_pool(5, 4, state_slots=3, state_ring=6)
    assert pool.k.shape == (2, 5, 4, 2, 16)
    assert pool.recurrent.conv.shape == (2, 3, 6, 2 * 2 * 8 + 4 * 8, 3)
    assert pool.recurrent.ssm.shape == (2, 3, 6, 4, 8, 8)


def test_bad_layer_types_are_refused_naming_the_field(hf_checkpoint) -> None:
    """A ``layer_types`` list that does not cover the layers is a clear error."""
    _, folder = hf_checkpoint
    raw = hf_checkpoint[0].config.to_dict()
    raw["layer_types"] = ["linear_attention"] * 3
    with pytest.raises(CheckpointError, match="layer_types .* must list 4 entries"):
        DecoderConfig.from_dict(raw)


#: A Markov-ish hybrid target (heads.markov_target): DeltaNet, attention, DeltaNet, attention,
#: the attention layers gated, norms zero-centred, a shared-expert MoE in every layer.
HYBRID = {
    "architecture": "Qwen3NextForCausalLM",
    "qk_norm": True,
    "partial_rotary_factor": 0.5,
    "attention_output_gate": True,
    "norm_offset": 1.0,
    "linear": LinearAttentionConfig(
        layer_types=("linear_attention", "full_attention") * 2,
        num_k_heads=2,
        num_v_heads=4,
        k_dim=8,
        v_dim=4,
        conv_kernel=4,
    ),
}
MOE = MoEConfig(
    num_experts=4,
    top_k=2,
    expert_intermediate_size=16,
    norm_topk_prob=True,
    shared_expert_intermediate_size=24,
)
PIPE_VOCAB = 16
TARGET = markov_target(PIPE_VOCAB, **HYBRID, moe=MOE)
#: A small hybrid standalone draft that rarely agrees with the target: rollback every round.
STRANGER = random_model(
    tiny_config(vocab_size=PIPE_VOCAB, num_layers=4, **HYBRID),
    seed=8,
    std=0.5,
)
#: name -> (algorithm, draft, spec options); "tree" takes a drawn tree shape.
PIPELINES = {
    "plain": ("plain", None, {}),
    "plain 3 steps": ("plain", None, {"decode_steps": 3}),
    "eagle chain": ("eagle", agreeing_head(TARGET, "eagle"), {"num_steps": 4}),
    "eagle tree": ("eagle", agreeing_head(TARGET, "eagle"), "tree"),
    "adaptive": ("eagle", agreeing_head(TARGET, "eagle"), {"adaptive_steps": (0, 1, 3)}),
    "standalone self": ("standalone", StandaloneHead(TARGET, PIPE_VOCAB), {"num_steps": 3}),
    "standalone self tree": ("standalone", StandaloneHead(TARGET, PIPE_VOCAB), "tree"),
    "standalone stranger": ("standalone", StandaloneHead(STRANGER, PIPE_VOCAB), "tree"),
    "ngram": ("ngram", None, {"num_draft_tokens": 6}),
    # Qwen3-Next's MTP layer (a gated full-attention MoE layer), agreeing and random.
    "mtp chain": ("mtp", agreeing_head(TARGET, "mtp"), {"num_steps": 3}),
    "mtp tree": ("mtp", agreeing_head(TARGET, "mtp"), "tree"),
    "mtp stranger tree": ("mtp", random_draft(TARGET, "mtp", seed=4, std=0.3), "tree"),
    "adaptive mtp": ("mtp", agreeing_head(TARGET, "mtp"), {"adaptive_steps": (0, 2, 3)}),
    "adaptive standalone": (
        "standalone",
        StandaloneHead(TARGET, PIPE_VOCAB),
        {"adaptive_steps": (1, 3)},
    ),
    "multi-layer eagle": (
        "multi_layer_eagle",
        agreeing_multi_layer(TARGET, 3),
        {"num_steps": 3},
    ),
    "multi-layer eagle stranger": (
        "multi_layer_eagle",
        random_multi_layer(TARGET, 2, seed=6, std=0.3),
        {"num_steps": 2},
    ),
    # Frozen-KV layers reading the attention layers' K/V (decoder layers 3 and 1).
    "frozen kv": (
        "frozen_kv_mtp",
        random_frozen_kv(TARGET, num_layers=2, source_layers=(3, 1), seed=3, std=0.3),
        "tree",
    ),
    # Block drafters read captured hidden states, never the target's cache.
    "dflash": ("dflash", random_block_draft(TARGET, "dflash", seed=1, std=0.3, block_size=6), {}),
    "dspark": ("dspark", agreeing_dspark(TARGET, block_size=6), {}),
    "dspark stranger": (
        "dspark",
        random_block_draft(TARGET, "dspark", seed=2, std=0.3, block_size=5, num_layers=1),
        {},
    ),
}
TREES = st.sampled_from([(3, 1, 4), (3, 2, 6), (2, 3, 7), (4, 2, 8)])


def hybrid_engine(name: str, tree: tuple[int, int, int] = (3, 2, 6), **limits):
    return pipeline_engine(TARGET, PIPELINES[name], tree, **({"page_size": 4} | limits))


@pytest.mark.parametrize("name", sorted(set(PIPELINES) - {"plain"}))
@settings(max_examples=2)
@given(
    prompts=prompt_batches(PIPE_VOCAB, max_batch=3),
    tree=TREES,
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
)
def test_every_pipeline_equals_plain_greedy_on_a_hybrid_target(
    name, prompts, tree, page_size, prefill_budget
) -> None:
    """Token for token, for a batch of prompts, any page size, chunked prefill or not, and
    tree shape: each draft node's candidate state follows its path, commit keeps the
    accepted one, and a rejected draft token leaves no trace."""
    limits = {"page_size": page_size, "prefill_budget": prefill_budget}
    assert_pipeline_equals_plain(hybrid_engine, name, prompts, tree, **limits)


def decoded(engine, prompts: list[list[int]], max_new_tokens: int) -> list[scheduler.Request]:
    """The finished requests of greedy ``prompts`` through the scheduler, in order."""
    state, rids = scheduler.new_state(engine), []
    for prompt in prompts:
        state, rid = scheduler.add_request(engine, state, prompt, max_new_tokens=max_new_tokens)
        rids.append(rid)
    _, finished = run_to_completion(engine, state)
    return [finished[rid] for rid in rids]


TWO_PROMPTS = [[1, 2, 3], [9, 9, 9, 1, 4]]


@pytest.mark.parametrize("name", ["standalone self", "standalone self tree"])
def test_the_target_drafting_for_itself_is_accepted_every_round(name) -> None:
    """The target as its own standalone draft (its own recurrent pool, one state ahead)
    agrees with itself: every round accepts its whole chain, the deepest state committed."""
    ours = decoded(hybrid_engine(name, (3, 2, 6)), TWO_PROMPTS, 25)
    plain = decoded(hybrid_engine("plain"), TWO_PROMPTS, 25)
    assert [r.output for r in ours] == [r.output for r in plain]
    for request in ours:  # 25 tokens: the prefill's, then six rounds of 4
        assert request.round_lengths == (0, 0, 0, 0, 6)


def test_a_draft_that_rarely_agrees_rolls_back_and_stays_exact() -> None:
    """With a stranger as the draft, most rounds reject at once (the state of every rejected
    node is left behind), and the tokens are still plain decoding's."""
    ours = decoded(hybrid_engine("standalone stranger"), TWO_PROMPTS, 20)
    plain = decoded(hybrid_engine("plain"), TWO_PROMPTS, 20)
    assert [r.output for r in ours] == [r.output for r in plain]
    for request in ours:
        assert 2 * request.round_lengths[1] > request.num_rounds


def test_snapshot_restore_of_a_hybrid_batch_replays_exactly() -> None:
    """A snapshot of a sampled batch on the hybrid target (its pages and its recurrent slots,
    and the self-draft's), restored after the states were overwritten, replays bit for bit."""
    engine = hybrid_engine("standalone self tree", (3, 2, 6))
    assert_sampled_snapshot_replays(engine)


def test_cancel_frees_the_state_slot() -> None:
    """Each admitted request holds one recurrent slot; cancelling it (or finishing) frees it,
    and a request admitted afterwards decodes as it would alone."""
    engine = hybrid_engine("eagle chain", max_batch=2)
    state = scheduler.new_state(engine)
    state, first = scheduler.add_request(engine, state, [3, 1, 4], max_new_tokens=12)
    state, second = scheduler.add_request(engine, state, [2, 7], max_new_tokens=12)
    state, _ = scheduler.step(engine, state)
    assert int(state.state_slots.num_free) == 0
    held = {r.state_slot for r in state.running}
    assert held == {1, 2}
    state = scheduler.cancel(engine, state, first)
    assert int(state.state_slots.num_free) == 1
    state, third = scheduler.add_request(engine, state, [5, 5, 1], max_new_tokens=8)
    state, finished = run_to_completion(engine, state)
    assert int(state.state_slots.num_free) == 2
    alone = generate([[5, 5, 1]], engine=hybrid_engine("plain"), max_new_tokens=8)
    assert finished[third].output == alone[0].token_ids


def test_the_prefix_cache_is_off_for_a_hybrid_target() -> None:
    """A shared page holds K/V, not the recurrent state at its end: a repeated prompt is
    prefilled afresh (no cached tokens) and decodes as the first time."""
    engine = hybrid_engine("plain")
    assert engine.prefix_lookahead is None
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    first = generate([prompt], engine=engine, max_new_tokens=6)[0]
    again = generate([prompt], engine=engine, max_new_tokens=6)[0]
    assert again.token_ids == first.token_ids
    assert again.stats["cached_tokens"] == 0


def test_a_frozen_kv_draft_reading_a_deltanet_layer_is_refused() -> None:
    """A gated DeltaNet layer keeps recurrent state, no K/V: a frozen-KV source naming one is
    refused, listing the attention layers it may read instead."""
    with pytest.raises(DraftTargetMismatch, match=r"layers \[2\] .* attention layers \[1, 3\]"):
        random_frozen_kv(TARGET, source_layers=(2,))


@pytest.mark.parametrize("name", ["mtp tree", "multi-layer eagle", "dspark"])
def test_agreeing_drafts_accept_deep_on_the_hybrid_target(name) -> None:
    """The equality above is only strong if rounds accept deep paths: the agreeing MTP,
    multi-layer and DSPARK drafts do (their recurrent target state committed past several
    draft tokens a round)."""
    results = generate(TWO_PROMPTS, engine=hybrid_engine(name), max_new_tokens=24)
    # The first prompt leads the target off its Markov vote (EAGLE accepts little there too).
    assert results[1].stats["accept_length_mean"] > 1.8


_alone_cache: dict = {}


def machine_engine():
    """The state machine's engine: the target drafting for itself in trees, so both pools
    hold recurrent slots."""
    return hybrid_engine("standalone self tree", (3, 2, 6), **MACHINE_LIMITS)


MACHINE_LIMITS = {"page_size": 4, "max_context": 40, "prefill_budget": 6, "max_batch": 3}
#: The scheduler machine's prompts, in this target's vocabulary.
MACHINE_PROMPTS = [tuple(t % PIPE_VOCAB for t in prompt) for prompt in PROMPTS]


def alone(prompt: tuple[int, ...], max_new: int, sampling: scheduler.Sampling) -> tuple[int, ...]:
    """What a request yields on the machine's engine when it is the only one."""
    key = (prompt, max_new, sampling)
    if key not in _alone_cache:
        engine = machine_engine()
        state, _ = scheduler.add_request(
            engine, scheduler.new_state(engine), prompt, sampling=sampling, max_new_tokens=max_new
        )
        _, finished = run_to_completion(engine, state)
        (request,) = finished.values()
        _alone_cache[key] = request.output
    return _alone_cache[key]


class HybridSchedulerMachine(SchedulerMachine):
    """The scheduler state machine (``test_scheduler_machine``) on a hybrid target and draft:
    add / step / cancel / snapshot / restore keep every request's tokens what it yields alone,
    and its recurrent slot its own."""

    def __init__(self) -> None:
        super().__init__()
        self.engine = machine_engine()
        self.state = scheduler.new_state(self.engine)

    @rule(
        prompt=st.sampled_from(MACHINE_PROMPTS),
        max_new=st.integers(1, 6),
        temperature=st.sampled_from([0.0, 1.0]),
        seed=st.integers(0, 3),
    )
    def add(self, prompt, max_new, temperature, seed):
        sampling = scheduler.Sampling(temperature=temperature, top_k=0, seed=seed)
        self.state, rid = scheduler.add_request(
            self.engine, self.state, prompt, sampling=sampling, max_new_tokens=max_new
        )
        self.model[rid] = Expected(tokens=alone(prompt, max_new, sampling))

    @invariant()
    def batch_rows_follow_the_running_requests(self):
        """Each admitted request holds its own slot, and the batch rows name it."""
        admitted = self.state.prefilling + self.state.running
        slots = [r.state_slot for r in admitted]
        allocator = self.state.state_slots
        assert len(set(slots)) == len(slots) and 0 not in slots
        assert set(slots) == allocated_pages(allocator), "a state slot leaked"
        assert all(r.state_slot == 0 for r in self.state.waiting)
        if self.state.running:
            assert self.state.batch.kv.state_slots.tolist() == [
                r.state_slot for r in self.state.running
            ]


HybridSchedulerMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=25, deadline=None
)
test_hybrid_scheduler_state_machine = HybridSchedulerMachine.TestCase


def test_the_hub_mtp_weights_are_tolerated(hf_checkpoint, tmp_path: Path) -> None:
    """Released Qwen3-Next folders carry MTP weights (``mtp.*``) that the target does not
    read (transformers ignores them too): loading still succeeds, and still refuses any
    other stray key."""
    _, folder = hf_checkpoint
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    load_model(tmp_path)
    tensors["model.stray.weight"] = torch.zeros(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.stray.weight"):
        load_model(tmp_path)


def test_the_gated_delta_rule_op_passes_torch_custom_op_checks() -> None:
    """``speculum::gated_delta_rule`` declares what it mutates (the layer's conv and delta-rule
    states) and its fake kernel gives the output's shape, so it traces and captures."""
    gen = torch.Generator().manual_seed(0)
    dims = [2, 4, 4, 3]  # key heads, key dim, value heads, value dim
    channels, batch, q = 2 * 2 * 4 + 4 * 3, 2, 3
    conv, ssm = torch.randn(3, 5, channels, 3, generator=gen), torch.randn(3, 5, 4, 4, 3)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    args = (
        conv,
        ssm,
        torch.tensor([1, 2]),
        torch.tensor([4, 0]),
        torch.tensor([3, 2]),
        tree.expand(batch, q, q),
        torch.randn(batch, q, channels, generator=gen),
        torch.randn(channels, 4, generator=gen),
        -torch.rand(batch, q, 4, generator=gen),
        torch.rand(batch, q, 4, generator=gen),
        dims,
    )
    torch.library.opcheck(kernels.gated_delta_rule, args)


def test_graph_padding_rows_leave_the_real_rows_states_alone() -> None:
    """A captured round runs the batch padded to its bucket with copies of row 0: the copies
    move to the padding slot, so the real rows' tokens and recurrent states are those of the
    unpadded round."""
    engine = hybrid_engine("standalone self tree", (3, 2, 6), max_batch=4)
    state = scheduler.new_state(engine)
    for prompt in TWO_PROMPTS:
        state, _ = scheduler.add_request(engine, state, prompt, max_new_tokens=20)
    while state.waiting or state.prefilling:
        state, _ = scheduler.step(engine, state)
    pools = [p.recurrent for p in engine.resources.pools]
    before = [(s.conv.clone(), s.ssm.clone()) for s in pools]
    _, unpadded = engine.pipeline.decode(engine.resources, state.batch)
    after = [(s.conv.clone(), s.ssm.clone()) for s in pools]
    for states, (conv, ssm) in zip(pools, before, strict=True):
        states.conv.copy_(conv)
        states.ssm.copy_(ssm)
    padded = pad_batch(state.batch, 4)
    assert padded.kv.state_slots[2:].tolist() == [PADDING_SLOT] * 2
    _, out = engine.pipeline.decode(engine.resources, padded)
    assert tree_equal(take_rows(out, torch.arange(2)), unpadded)
    # Equal up to rounding: the padded batch's projections are matrix products of another
    # shape; a padding row writing a real slot would change its entries wholesale.
    real = torch.tensor([r.state_slot for r in state.running])
    for states, (conv, ssm) in zip(pools, after, strict=True):
        assert torch.allclose(states.conv[:, real], conv[:, real], rtol=1e-5, atol=1e-6)
        assert torch.allclose(states.ssm[:, real], ssm[:, real], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["standalone self tree", "eagle chain"])
def test_overlapped_scheduling_on_a_hybrid_target_equals_plain(name) -> None:
    """Overlapped, a request's last round runs once more before its finish is known: the ring
    holds that round's states too, so the tokens are plain decoding's."""
    ours = decoded(hybrid_engine(name, (3, 2, 6), overlap=True), TWO_PROMPTS, 20)
    plain = decoded(hybrid_engine("plain"), TWO_PROMPTS, 20)
    assert [r.output for r in ours] == [r.output for r in plain]


def test_saving_writes_a_folder_transformers_reads_back(hf_checkpoint, tmp_path: Path) -> None:
    """``save_model`` writes the hub layout and a config transformers builds the same model
    from: its logits are the original's, and loading it back gives the same weights."""
    _, folder = hf_checkpoint
    model = load_model(folder)
    save_model(model, tmp_path)
    # Both read by from_pretrained: transformers' own save/load round trip already differs
    # from the model built in place in the last bits (1e-6 here).
    original, again = (
        transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        for path in (folder, tmp_path)
    )
    tokens = torch.tensor([[3, 17, 42, 5, 9, 9, 1]])
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, original(tokens).logits)
    reloaded = load_model(tmp_path).state_dict()
    assert all(torch.equal(t, reloaded[k]) for k, t in model.state_dict().items())


@settings(max_examples=25)
@given(parents=parent_lists(), prefix=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_each_tree_node_gets_the_state_of_its_own_path(parents, prefix, seed) -> None:
    """Over a tree, each node's output and candidate state are exactly what running its path
    (root to node) as a chain after the same committed state gives: a node's state follows its
    path, never its siblings'."""
    gen = torch.Generator().manual_seed(seed)
    dims, ring, n = [1, 4, 2, 3], 8, len(parents)
    channels = 2 * 4 + 2 * 3

    def pools():
        g = torch.Generator().manual_seed(seed)
        conv = torch.randn(2, ring, channels, 3, generator=g)
        return conv, torch.randn(2, ring, 2, 4, 3, generator=g)

    mixed = torch.randn(1, n, channels, generator=gen)
    weight, gate = torch.randn(channels, 4, generator=gen), -torch.rand(1, n, 2, generator=gen)
    beta = torch.rand(1, n, 2, generator=gen)

    def run(conv, ssm, mask, nodes):
        return gated_delta_rule(
            conv, ssm, torch.tensor([1]), torch.tensor([prefix]), torch.tensor([len(nodes)]),
            mask, mixed[:, nodes], weight, gate[:, nodes], beta[:, nodes], dims,
        )  # fmt: skip

    assert_tree_states_follow_paths(run, parents, prefix, pools)


def _greedy_accept(tokens: list[int], parents: list[int], targets: list[int], max_children: int):
    """``accept`` of one request's tree (``depths`` from ``parents``) whose target puts all
    its mass on ``targets[i]`` after node ``i``."""
    depths = [0]
    for parent in parents[1:]:
        depths.append(depths[parent] + 1)
    tree = DraftTree(
        tokens=torch.tensor([tokens]),
        parents=torch.tensor([parents]),
        depths=torch.tensor([depths]),
    )
    probs = torch.nn.functional.one_hot(torch.tensor([targets]), 8).float()
    zero = torch.tensor([0])
    return accept(tree, probs, zero, zero, max(depths), max_children=max_children)


def test_commit_moves_recurrent_states_for_trees_only() -> None:
    """A chain round's commit leaves the recurrent pool untouched (no write at all: its
    accepted node at depth d already sits at depth d's entry); a tree round whose accepted
    node is not at its depth's index copies that node's states to the depth's entry, and
    nothing else changes."""
    ring, prefix = 6, 3
    gen = torch.Generator().manual_seed(0)
    states = RecurrentPool(
        conv=torch.randn(2, 3, ring, 5, 3, generator=gen),
        ssm=torch.randn(2, 3, ring, 2, 4, 3, generator=gen),
    )
    pool = KVPool(
        k=torch.zeros(1, 3, 4, 1, 2), v=torch.zeros(1, 3, 4, 1, 2), page_size=4, recurrent=states
    )
    kv = PagedKV(
        page_table=torch.tensor([[1, 2]]),
        seq_lens=torch.tensor([prefix]),
        page_size=4,
        state_slots=torch.tensor([2]),
    )
    before = [c.clone() for c in (states.conv, states.ssm)]
    versions = [c._version for c in (states.conv, states.ssm)]

    chain = _greedy_accept([1, 5, 6], [-1, 0, 1], [5, 6, 7], max_children=1)
    assert chain.chain and chain.path.tolist() == [[0, 1, 2]]
    commit_path(pool, kv, chain)
    assert [c._version for c in (states.conv, states.ssm)] == versions
    assert all(torch.equal(c, b) for c, b in zip((states.conv, states.ssm), before))

    # Root's children 5 (node 1) and 6 (node 2); node 3 (7) follows 6: path 0, 2, 3.
    tree = _greedy_accept([1, 5, 6, 7], [-1, 0, 0, 2], [6, 0, 7, 2], max_children=2)
    assert not tree.chain and tree.path.tolist() == [[0, 2, 3]]
    commit_path(pool, kv, tree)
    for cache, old in zip((states.conv, states.ssm), before):
        want = old.clone()
        want[:, 2, (prefix + 2) % ring] = old[:, 2, (prefix + 3) % ring]
        assert torch.equal(cache, want)


def test_tensor_parallelism_refuses_a_hybrid() -> None:
    """A hybrid (dense here, so that its MoE layers are not what refuses) is not split over
    ranks yet: sharding says so and leaves the model as it was."""
    model = random_model(tiny_config(vocab_size=PIPE_VOCAB, num_layers=4, **HYBRID), seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedSplit, match="tp=2: Qwen3-Next's gated DeltaNet"):
        shard_(model, TensorParallel(rank=0, size=2))
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


STATS_VOCAB = 6
#: A hybrid target whose temperature-1 next-token law is spread (the likeliest token 0.4-0.9),
#: and an EAGLE head that mostly agrees with it, so rounds accept sampled drafts.
STATS_TARGET = markov_target(STATS_VOCAB, head_scale=0.25, **HYBRID, moe=MOE)
STATS_HEAD = agreeing_head(STATS_TARGET, "eagle")


def exact_joint(prompt: list[int], num_tokens: int) -> np.ndarray:
    """The hybrid target's temperature-1 law of the first ``num_tokens`` tokens after
    ``prompt`` (last token fastest), each prefix decoded alone by plain decoding's forward."""
    joint = np.ones(1)
    for step in range(num_tokens):
        prefixes = [prompt + list(t) for t in itertools.product(range(STATS_VOCAB), repeat=step)]
        probs = []
        for prefix in prefixes:
            pool = STATS_TARGET.new_pool(4, 8, state_slots=2, state_ring=2)
            kv = PagedKV(
                page_table=torch.tensor([[1, 2]]),
                seq_lens=torch.tensor([0]),
                page_size=8,
                state_slots=torch.tensor([1]),
            )
            batch = extend_batch(kv, torch.tensor([prefix]), torch.tensor([len(prefix)]))
            hidden, _ = STATS_TARGET(batch, pool)
            probs.append(torch.softmax(STATS_TARGET.logits(hidden[0, -1]).double(), -1))
        joint = (joint[:, None] * torch.stack(probs).numpy()).reshape(-1)
    return joint


def test_sampled_speculation_on_a_hybrid_target_follows_the_target_law() -> None:
    """Seeded sampling through EAGLE trees on the hybrid target: the first four tokens of
    4000 requests (one per seed) follow the target's exact joint law (chi-square and total
    variation far in the tail), with draft tokens accepted along the way."""
    prompt, num_tokens, seeds, chunk = [1, 4, 2], 4, 4000, 1000
    engine = engine_from_model(
        STATS_TARGET,
        algorithm="eagle",
        draft=STATS_HEAD,
        spec=SpecOptions(num_steps=3, topk=2, num_draft_tokens=6),
        page_size=4,
        max_batch=chunk,
        max_context=16,
        prefill_budget=chunk * len(prompt),
    )
    outputs, emitted, rounds = [], 0, 0
    for start in range(0, seeds, chunk):
        state = scheduler.new_state(engine)
        for seed in range(start, start + chunk):
            sampling = scheduler.Sampling(temperature=1.0, seed=seed)
            state, _ = scheduler.add_request(
                engine, state, prompt, sampling=sampling, max_new_tokens=num_tokens
            )
        _, finished = run_to_completion(engine, state)
        for request in finished.values():
            outputs.append(request.output)
            rounds += request.num_rounds
            emitted += sum(k * n for k, n in enumerate(request.round_lengths))
    assert emitted > 1.2 * rounds  # drafts were accepted, not only bonus tokens
    code = np.zeros(seeds, dtype=np.int64)
    for j in range(num_tokens):
        code = code * STATS_VOCAB + np.array([o[j] for o in outputs])
    joint = exact_joint(prompt, num_tokens)
    counts = np.bincount(code, minlength=STATS_VOCAB**num_tokens).astype(np.float64)
    assert counts[joint == 0].sum() == 0
    chi2, dof = chi2_stat(counts, seeds * joint)
    assert chi2 < chi2_threshold(dof, 6.0), (chi2, dof)
    assert 0.5 * np.abs(counts / seeds - joint).sum() < tv_bound(joint, seeds, 1e-9)


@settings(max_examples=20)
@given(
    q_lens=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    prefix=st.integers(0, 5),
    chunk=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_chunked_prefill_equals_the_recurrent_form(q_lens, prefix, chunk, seed) -> None:
    """The gated delta rule's prefill form (the causal conv at once, the delta rule ``chunk``
    tokens at a time) gives the recurrent form's outputs for every real token and writes the
    state after each row's last token where the recurrent form does, from a committed prefix
    or none; a row with no tokens writes nothing of its own."""
    gen = torch.Generator().manual_seed(seed)
    dims, ring, batch, q = [2, 4, 4, 3], 6, len(q_lens), max(q_lens) or 1
    channels = 2 * 2 * 4 + 4 * 3
    conv = torch.randn(batch + 1, ring, channels, 3, generator=gen, dtype=torch.float64)
    ssm = torch.randn(batch + 1, ring, 4, 4, 3, generator=gen, dtype=torch.float64)
    lens = torch.tensor(q_lens)
    args = (
        torch.arange(1, batch + 1),
        torch.full((batch,), prefix),
        lens,
        causal_mask(batch, q),
        torch.randn(batch, q, channels, generator=gen, dtype=torch.float64),
        torch.randn(channels, 4, generator=gen, dtype=torch.float64),
        -torch.rand(batch, q, 4, generator=gen, dtype=torch.float64),
        torch.rand(batch, q, 4, generator=gen, dtype=torch.float64),
        dims,
    )
    states = [(conv.clone(), ssm.clone()) for _ in range(2)]
    recurrent = gated_delta_rule(*states[0], *args)
    chunked = gated_delta_rule(*states[1], *args, chunk)
    # The recurrent form's cell computes its queries, keys and values in float32.
    close = {"rtol": 1e-5, "atol": 1e-6}
    for row, n in enumerate(q_lens):
        torch.testing.assert_close(chunked[row, :n], recurrent[row, :n], **close)
        entry = (prefix + n - 1) % ring
        for ours, theirs in zip(states[1], states[0], strict=True):
            if n:
                torch.testing.assert_close(ours[row + 1, entry], theirs[row + 1, entry], **close)
            else:  # nothing new: every entry as it was
                assert torch.equal(ours[row + 1], (conv, ssm)[ours.dim() - 4][row + 1])
