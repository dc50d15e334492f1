"""Nemotron-H targets (Mamba-2 layers between attention-without-rotary and squared-ReLU MLP
layers, one mixer per layer): loaded strictly from transformers' own folders, equal to
transformers in float32, and every pipeline equal to plain decoding with the Mamba-2 conv and
SSM states kept per request, per draft node, committed for the accepted path only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_config
from heads import (
    agreeing_dspark,
    agreeing_head,
    assert_greedy_equals_transformers,
    assert_pipeline_equals_plain,
    assert_sampled_snapshot_replays,
    assert_tree_states_follow_paths,
    markov_target,
    pipeline_engine,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from strategies import page_sizes, parent_lists, prefill_budgets, prompt_batches
from test_models import assert_ragged_logits_equal

from speculum import kernels
from speculum.models.block_draft import random_block_draft
from speculum.models.config import (
    NEMOTRON_H_KINDS,
    CheckpointError,
    DecoderConfig,
    MambaConfig,
    MoEConfig,
    UnsupportedModel,
)
from speculum.models.decoder import Mamba2Mixer, NoPEAttention, SquaredReluMLP, SquaredReluMoE
from speculum.models.draft import random_draft
from speculum.models.draft_loading import DraftTargetMismatch
from speculum.models.frozen_kv import random_frozen_kv
from speculum.models.loading import load_model, random_model, save_model
from speculum.models.parallel import UnsupportedSplit, shard_
from speculum.models.standalone import StandaloneHead
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.recurrent import mamba2_scan
from speculum.state.parallel import TensorParallel

transformers.logging.disable_progress_bar()

VOCAB = 128


def hf_nemotron_h(pattern: str = "M*M-E") -> transformers.PreTrainedModel:
    """A float32 transformers Nemotron-H (Mamba-2, attention, Mamba-2, MLP, MoE layers by
    default), every parameter random: norms, ``D``, the step-size biases and the router's
    correction biases too, ``A_log`` in [0, 1)."""
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        hybrid_override_pattern=pattern,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=32,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
    )
    model = transformers.NemotronHForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = param.shape[-1] ** -0.5 if param.dim() >= 2 else 0.3
            param.copy_(torch.randn(param.shape, generator=gen) * std)
            if name.endswith(("A_log", "dt_bias")):
                param.copy_(torch.rand(param.shape, generator=gen))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    """The transformers model and the folder its ``save_pretrained`` wrote."""
    model = hf_nemotron_h()
    folder = tmp_path_factory.mktemp("nemotron_h")
    model.save_pretrained(folder)
    return model, folder


def test_the_checkpoint_loads_into_the_layer_plan(hf_checkpoint) -> None:
    """Every weight of transformers' layout (``backbone.*``, experts one by one) loads strictly
    into one mixer per layer; the pool holds K/V for the attention layer only and conv/SSM
    slots for the Mamba-2 layers (``[conv_dim, kernel - 1]`` and ``[heads, head_dim,
    d_state]``)."""
    _, folder = hf_checkpoint
    model = load_model(folder)
    kinds = [type(layer.mixer) for layer in model.model.layers]
    assert kinds == [Mamba2Mixer, NoPEAttention, Mamba2Mixer, SquaredReluMLP, SquaredReluMoE]
    pool = model.new_pool(5, 4, state_slots=3, state_ring=6)
    assert pool.k.shape == (1, 5, 4, 2, 16)
    assert pool.recurrent.conv.shape == (2, 3, 6, 4 * 16 + 2 * 2 * 16, 3)
    assert pool.recurrent.ssm.shape == (2, 3, 6, 4, 16, 16)


def test_logits_equal_transformers(hf_checkpoint) -> None:
    """Chunked prefill and decode through the paged cache and the recurrent slots, in a ragged
    batch (each chunk from the previous one's committed conv and SSM states), give
    transformers' float32 logits at every position."""
    hf, folder = hf_checkpoint
    assert_ragged_logits_equal(hf, load_model(folder))


def test_greedy_decoding_equals_transformers_generate(hf_checkpoint) -> None:
    """Plain greedy decoding through the scheduler (chunked prefill, a batch of prompts of
    several lengths) emits transformers' ``generate`` tokens, token for token."""
    hf, folder = hf_checkpoint
    assert_greedy_equals_transformers(hf, load_model(folder))


def test_the_older_pattern_spelling_reads_as_the_same_plan(hf_checkpoint) -> None:
    """Hub configs written before transformers 5 name the plan ``hybrid_override_pattern``
    (and ``num_hidden_layers``): the same layer plan, MoE routing included. Experts behind
    latent projections are refused, naming the key, and a pattern with an unknown letter is a
    clear error."""
    raw = {k: v for k, v in hf_checkpoint[0].config.to_dict().items() if k != "layers_block_type"}
    new = DecoderConfig.from_dict(hf_checkpoint[0].config.to_dict())
    old = DecoderConfig.from_dict({**raw, "hybrid_override_pattern": "M*M-E"})
    assert old.mamba == new.mamba
    assert "".join(NEMOTRON_PATTERN[kind] for kind in old.mamba.layer_types) == "M*M-E"
    assert old.mamba.moe.routed_scaling_factor == 1.5 and old.mamba.moe.n_group == 2
    with pytest.raises(UnsupportedModel, match="moe_latent_size 16"):
        DecoderConfig.from_dict({**raw, "hybrid_override_pattern": "M*ME", "moe_latent_size": 16})
    with pytest.raises(CheckpointError, match="hybrid_override_pattern"):
        DecoderConfig.from_dict({**raw, "hybrid_override_pattern": "M*X-"})


def test_a_stray_weight_is_refused_and_mtp_weights_tolerated(hf_checkpoint, tmp_path) -> None:
    """Strict loading: MTP weights (``mtp.*``, which transformers ignores) are tolerated, any
    other key the decoder does not declare is named in the error."""
    _, folder = hf_checkpoint
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    load_model(tmp_path)
    tensors["backbone.layers.0.mixer.stray"] = torch.zeros(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="backbone.layers.0.mixer.stray"):
        load_model(tmp_path)


def test_saving_writes_a_folder_transformers_reads_back(hf_checkpoint, tmp_path) -> None:
    """``save_model`` writes the hub layout and a config transformers builds the same model
    from (its logits are the original's), and loading it back gives the same weights."""
    hf, folder = hf_checkpoint
    model = load_model(folder)
    save_model(model, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.tensor([[3, 17, 42, 5, 9, 9, 1]])
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits)
    reloaded = load_model(tmp_path).state_dict()
    assert all(torch.equal(t, reloaded[k]) for k, t in model.state_dict().items())


#: Layer kind -> its letter in ``hybrid_override_pattern``.
NEMOTRON_PATTERN = {kind: letter for letter, kind in NEMOTRON_H_KINDS.items()}
#: A Markov-ish Nemotron-H target (heads.markov_target): Mamba-2, attention, Mamba-2, MoE.
HYBRID = {
    "architecture": "NemotronHForCausalLM",
    "num_layers": 4,
    "mamba": MambaConfig(
        layer_types=("linear_attention", "full_attention", "linear_attention", "moe"),
        num_heads=4,
        head_dim=8,
        state_size=8,
        n_groups=2,
        conv_kernel=4,
        conv_bias=True,
        proj_bias=False,
        time_step_limit=(0.0, float("inf")),
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_intermediate_size=16,
            norm_topk_prob=True,
            shared_expert_intermediate_size=24,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            n_group=2,
            topk_group=1,
            float32_router=True,
        ),
    ),
}
PIPE_VOCAB = 16
TARGET = markov_target(PIPE_VOCAB, **HYBRID)
#: A small Nemotron-H standalone draft that rarely agrees with the target: rollback often.
STRANGER = random_model(tiny_config(vocab_size=PIPE_VOCAB, **HYBRID), seed=8, std=0.5)
#: name -> (algorithm, draft, spec options); "tree" takes a drawn tree shape.
PIPELINES = {
    "plain": ("plain", None, {}),
    "eagle chain": ("eagle", agreeing_head(TARGET, "eagle"), {"num_steps": 4}),
    "eagle tree": ("eagle", agreeing_head(TARGET, "eagle"), "tree"),
    "adaptive": ("eagle", agreeing_head(TARGET, "eagle"), {"adaptive_steps": (0, 1, 3)}),
    "standalone self tree": ("standalone", StandaloneHead(TARGET, PIPE_VOCAB), "tree"),
    "standalone stranger": ("standalone", StandaloneHead(STRANGER, PIPE_VOCAB), "tree"),
    "ngram": ("ngram", None, {"num_draft_tokens": 6}),
    # Block drafters read captured hidden states, never the target's cache.
    "dflash": ("dflash", random_block_draft(TARGET, "dflash", seed=1, std=0.3, block_size=6), {}),
    "dspark": ("dspark", agreeing_dspark(TARGET, block_size=6), {}),
    "adaptive standalone": (
        "standalone",
        StandaloneHead(TARGET, PIPE_VOCAB),
        {"adaptive_steps": (1, 3)},
    ),
}
TREES = st.sampled_from([(3, 1, 4), (3, 2, 6), (4, 2, 8)])


def hybrid_engine(name: str, tree: tuple[int, int, int] = (3, 2, 6), **limits):
    return pipeline_engine(TARGET, PIPELINES[name], tree, **({"page_size": 4} | limits))


@pytest.mark.parametrize("name", sorted(set(PIPELINES) - {"plain"}))
@settings(max_examples=1)
@given(
    prompts=prompt_batches(PIPE_VOCAB, max_batch=3),
    tree=TREES,
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
)
def test_every_pipeline_equals_plain_greedy_on_a_nemotron_h_target(
    name, prompts, tree, page_size, prefill_budget
) -> None:
    """Token for token, for a batch of prompts, any page size, chunked prefill or not, and
    tree shape: each draft node's Mamba-2 states follow its path, commit keeps the accepted
    node's, and a rejected draft token leaves no trace."""
    limits = {"page_size": page_size, "prefill_budget": prefill_budget}
    assert_pipeline_equals_plain(hybrid_engine, name, prompts, tree, **limits)


def test_the_target_drafting_for_itself_accepts_every_round() -> None:
    """The target as its own standalone draft (its own Mamba-2 slots) agrees with itself:
    every round accepts its whole path, the deepest node's state committed."""
    prompts = [[1, 2, 3], [9, 9, 9, 1, 4]]
    ours = generate(prompts, engine=hybrid_engine("standalone self tree"), max_new_tokens=17)
    plain = generate(prompts, engine=hybrid_engine("plain"), max_new_tokens=17)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]
    assert all(r.stats["accept_length_mean"] == 4.0 for r in ours)


def test_snapshot_restore_of_a_nemotron_h_batch_replays_exactly() -> None:
    """A snapshot of a sampled batch (its pages, its Mamba-2 slots and the self-draft's),
    restored after the states were overwritten, replays bit for bit."""
    assert_sampled_snapshot_replays(hybrid_engine("standalone self tree"))


@settings(max_examples=10)
@given(parents=parent_lists(max_nodes=6), prefix=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_each_tree_node_gets_the_mamba2_state_of_its_own_path(parents, prefix, seed) -> None:
    """Over a tree, each node's output and candidate conv/SSM states are exactly what running
    its path (root to node) as a chain after the same committed state gives."""
    gen = torch.Generator().manual_seed(seed)
    dims, ring, n = [4, 3, 2, 5], 8, len(parents)  # heads, head_dim, groups, d_state
    channels = 4 * 3 + 2 * 2 * 5

    def pools():
        g = torch.Generator().manual_seed(seed)
        conv = torch.randn(2, ring, channels, 3, generator=g)
        return conv, torch.randn(2, ring, 4, 3, 5, generator=g)

    xbc = torch.randn(1, n, channels, generator=gen)
    weight, bias = torch.randn(channels, 4, generator=gen), torch.randn(channels, generator=gen)
    dt, a, d = torch.rand(1, n, 4, generator=gen), -torch.rand(4, generator=gen), torch.randn(4)

    def run(conv, ssm, mask, nodes):
        return mamba2_scan(
            conv, ssm, torch.tensor([1]), torch.tensor([prefix]), torch.tensor([len(nodes)]),
            mask, xbc[:, nodes], weight, bias, dt[:, nodes], a, d, dims,
        )  # fmt: skip

    assert_tree_states_follow_paths(run, parents, prefix, pools)


def test_the_mamba2_op_passes_torch_custom_op_checks() -> None:
    """``speculum::mamba2_scan`` declares what it mutates (the layer's conv and SSM states)
    and its fake kernel gives the output's shape, so it traces and captures."""
    gen = torch.Generator().manual_seed(0)
    dims = [4, 3, 2, 5]
    channels, batch, q = 4 * 3 + 2 * 2 * 5, 2, 3
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    args = (
        torch.randn(3, 5, channels, 3, generator=gen),
        torch.randn(3, 5, 4, 3, 5, generator=gen),
        torch.tensor([1, 2]),
        torch.tensor([4, 0]),
        torch.tensor([3, 2]),
        tree.expand(batch, q, q),
        torch.randn(batch, q, channels, generator=gen),
        torch.randn(channels, 4, generator=gen),
        torch.randn(channels, generator=gen),
        torch.rand(batch, q, 4, generator=gen),
        -torch.rand(4, generator=gen),
        torch.randn(4, generator=gen),
        dims,
    )
    torch.library.opcheck(kernels.mamba2_scan, args)


def test_tensor_parallelism_refuses_mamba2_layers() -> None:
    """Mamba-2 layers are not split over ranks yet: sharding says so, naming them."""
    with pytest.raises(UnsupportedSplit, match="tp=2: Nemotron-H's Mamba-2 layers"):
        shard_(random_model(tiny_config(**HYBRID), seed=1), TensorParallel(rank=0, size=2))


@pytest.mark.parametrize("algorithm", ["mtp", "nextn", "multi_layer_eagle", "frozen_kv_mtp"])
def test_mtp_and_frozen_kv_drafts_are_refused(algorithm) -> None:
    """Nemotron-H's MTP layers are not built, and its attention caches keys without rotary
    embedding, which a frozen-KV draft's rotated queries do not read: refused before anything
    is built, saying why; building such heads directly is refused too."""
    with pytest.raises(UnsupportedModel, match="Mamba-2 hybrid target NemotronHForCausalLM"):
        engine_from_model(TARGET, algorithm=algorithm, draft=object())
    with pytest.raises(UnsupportedModel, match="MTP layers of NemotronHForCausalLM"):
        random_draft(TARGET, "mtp")
    with pytest.raises(DraftTargetMismatch, match="caches keys without rotary embedding"):
        random_frozen_kv(TARGET)
