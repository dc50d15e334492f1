"""Mixture-of-experts targets (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5): equal to transformers,
strict per-expert checkpoints that round-trip, routing settings checked, and every pipeline
equal to plain decoding on an MoE target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_config
from heads import (
    PORTABLE_LAYOUTS,
    agreeing_head,
    assert_greedy_equals_transformers,
    assert_sampled_snapshot_replays,
    draw_correction_biases_,
    markov_target,
    pipeline_engine,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from strategies import page_sizes, prefill_budgets, prompt_batches
from test_eagle_stats import CHUNK, SEEDS, exact_joint, joint_stats, lossless, sample_tokens
from test_models import (
    CASES,
    assert_ragged_logits_equal,
    edit_config,
    edit_weights,
    random_tensors,
    relative_error,
)

from speculum.kernels import model_ops
from speculum.models.block_draft import load_block_draft, random_block_draft, save_block_draft
from speculum.models.config import DecoderConfig, MoEConfig
from speculum.models.decoder import SparseMoE, dense_batch
from speculum.models.draft import random_draft
from speculum.models.draft_loading import LAYOUTS, load_draft, save_draft
from speculum.models.frozen_kv import load_frozen_kv, random_frozen_kv, save_frozen_kv
from speculum.models.loading import CheckpointError, load_model, random_model, save_model
from speculum.models.multi_layer_eagle import (
    load_multi_layer,
    random_multi_layer,
    save_multi_layer,
)
from speculum.models.parallel import UnsupportedSplit, shard_
from speculum.models.standalone import StandaloneHead
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import acceptance_stats, generate
from speculum.state.parallel import TensorParallel

transformers.logging.disable_progress_bar()

VOCAB = 96  # test_models.run_in_steps pads with id VOCAB - 1 of its own VOCAB, also 96
#: architecture family -> transformers config fields: 4 experts, top 2, and what the family
#: adds (test_models' cases: Qwen3-MoE a dense layer and renormalised top-k; Qwen2-MoE its gated
#: shared expert; GLM-4.5 6 experts in 3 groups, sigmoid routing, a shared expert, a dense
#: layer 0).
FAMILIES = dict(CASES[case] for case in ("mixtral", "qwen2-moe", "qwen3-moe", "glm4-moe"))


def hf_moe(family: str, **changes: object) -> transformers.PreTrainedModel:
    """A float32 transformers MoE model, every parameter (norms, biases, routers) random: the
    routers' logits spread enough that every expert is picked by some tokens."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **{**FAMILIES[family], **changes},
    )
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in random_tensors(model):
            std = param.shape[-1] ** -0.5 if param.dim() >= 2 else 0.3
            mean = 1.0 if "norm" in name else 0.0
            param.copy_(torch.randn(param.shape, generator=gen) * std + mean)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_checkpoint(request, tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    """Each family's transformers model and the folder its ``save_pretrained`` wrote."""
    model = hf_moe(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def test_layers_are_the_kinds_the_config_names(hf_checkpoint) -> None:
    """Every layer is sparse except Qwen3-MoE's ``mlp_only_layers`` and GLM-4.5's first
    ``first_k_dense_replace``; Qwen2-MoE's experts have a gated shared one, GLM-4.5's an
    ungated one."""
    hf, folder = hf_checkpoint
    ours = load_model(folder)
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers]
    family = type(hf).__name__.removesuffix("ForCausalLM")
    kinds = {"Qwen3Moe": [True, False], "Glm4Moe": [False, True]}
    assert sparse == kinds.get(family, [True, True])
    moe = next(layer.mlp for layer in ours.model.layers if isinstance(layer.mlp, SparseMoE))
    assert (moe.shared_expert is not None, moe.shared_experts is not None) == (
        family == "Qwen2Moe",
        family == "Glm4Moe",
    )


def test_logits_match_transformers_through_the_paged_cache(hf_checkpoint) -> None:
    """Chunked prefill and decode through the cache, in a ragged batch, give transformers'
    logits (float32)."""
    hf, folder = hf_checkpoint
    assert_ragged_logits_equal(hf, load_model(folder))


def test_greedy_decoding_equals_transformers_generate(hf_checkpoint) -> None:
    """Plain greedy decoding through the scheduler (chunked prefill, a batch of prompts) emits
    transformers' ``generate`` tokens, token for token."""
    hf, folder = hf_checkpoint
    assert_greedy_equals_transformers(hf, load_model(folder))


def test_saving_writes_the_hub_layout_back_exactly(hf_checkpoint, tmp_path: Path) -> None:
    """Load then save writes transformers' key names, experts one by one, with the same
    tensors, and config.json reads back as the same config; transformers loads the result."""
    hf, folder = hf_checkpoint
    ours = load_model(folder)
    saved = save_model(ours, tmp_path)
    theirs, again = load_file(folder / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(again) == sorted(theirs)
    assert all(torch.equal(again[key], theirs[key]) for key in theirs)
    reloaded = load_model(saved)
    assert reloaded.config == ours.config
    reread = type(hf).from_pretrained(saved).eval()
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        assert torch.equal(reread(tokens).logits, hf(tokens).logits)


def checkpoint_copy(hf_checkpoint, tmp_path: Path) -> Path:
    """A copy of the family's checkpoint, to break."""
    hf, _ = hf_checkpoint
    hf.save_pretrained(tmp_path)
    return tmp_path


def test_a_missing_or_extra_expert_is_named(hf_checkpoint, tmp_path: Path) -> None:
    """Per-expert keys are checked strictly, each missing or unexpected one named."""
    folder = checkpoint_copy(hf_checkpoint, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    gone = next(k for k in tensors if ".experts.3." in k)
    edit_weights(folder, lambda t: t.pop(gone))
    with pytest.raises(CheckpointError, match=rf"missing weights \['{gone}'\]"):
        load_model(folder)
    extra = gone.replace(".experts.3.", ".experts.9.")
    edit_weights(folder, lambda t: t.update({gone: tensors[gone], extra: tensors[gone].clone()}))
    with pytest.raises(CheckpointError, match=rf"unexpected weights \['{extra}'\]"):
        load_model(folder)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok 5 is more than the 4 experts"),
        ({"num_experts_per_tok": 0}, r"num_experts_per_tok is 0; it must be an integer of at"),
        ({"num_experts": 4, "num_local_experts": 6}, r"num_experts 4 and num_local_experts 6"),
        ({"num_experts": None, "num_local_experts": None}, r"needs num_experts \(or num_local"),
        ({"moe_intermediate_size": None}, r"needs moe_intermediate_size \(each expert's width"),
        ({"mlp_only_layers": [2]}, r"mlp_only_layers is \[2\]; it must be a list of layer ind"),
        ({"norm_topk_prob": "yes"}, r"norm_topk_prob is 'yes'; it must be true or false"),
    ],
    ids=["top-k above experts", "top-k 0", "two counts", "no count", "no width", "layers", "norm"],
)
def test_inconsistent_routing_settings_are_refused(changes: dict, message: str) -> None:
    """A Qwen3-MoE config.json whose routing fields no model can run with fails at load,
    naming the field."""
    raw = hf_moe("Qwen3Moe").config.to_dict()
    with pytest.raises(CheckpointError, match=message):
        DecoderConfig.from_dict({**raw, **changes})


def test_moe_config_refuses_a_top_k_beyond_its_experts() -> None:
    """Built directly (not from a file), the routing is checked too."""
    with pytest.raises(ValueError, match=r"top_k 5 must be between 1 and num_experts 4"):
        MoEConfig(num_experts=4, top_k=5, expert_intermediate_size=8, norm_topk_prob=False)


def test_qwen2_moe_without_qkv_bias_matches_transformers(tmp_path: Path) -> None:
    """Qwen2-MoE's ``qkv_bias`` key switches the q/k/v biases off (dense Qwen2 has no such
    switch), and the config saved back keeps it off."""
    hf = hf_moe("Qwen2Moe", qkv_bias=False)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.model.layers[0].self_attn.q_proj.bias is None
    tokens = torch.tensor([[5, 9, 1, 40, 33, 2]])
    hidden, _ = ours(dense_batch(tokens), None)
    with torch.no_grad():
        assert relative_error(ours.logits(hidden)[0], hf(tokens).logits[0]) < 1e-5
    assert load_model(save_model(ours, tmp_path / "again")).config == ours.config


def test_a_bad_routing_field_fails_load_model(hf_checkpoint, tmp_path: Path) -> None:
    """``load_model`` names the file and the field."""
    folder = checkpoint_copy(hf_checkpoint, tmp_path)
    edit_config(folder, num_experts_per_tok=7)
    with pytest.raises(CheckpointError, match=r"config.json: num_experts_per_tok 7 is more than"):
        load_model(folder)


def test_tensor_parallelism_refuses_moe_layers_and_changes_nothing() -> None:
    """Experts are not split over ranks yet: sharding says so and leaves the model whole."""
    model = random_model(MOE_CONFIG, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedSplit, match=r"tp=2: mixture-of-experts layers cannot be split"):
        shard_(model, TensorParallel(rank=0, size=2))
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_the_moe_op_is_a_registered_op_with_a_fake_kernel_and_gradients() -> None:
    """``speculum::moe`` passes torch's custom-op checks (schema, fake kernel for tracing and
    capture, autograd through the reference)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    router = torch.randn(4, 8, generator=gen)
    gate_up = torch.randn(4, 12, 8, generator=gen, requires_grad=True)
    down = torch.randn(4, 8, 6, generator=gen)
    torch.library.opcheck(model_ops.moe, (x, router, gate_up, down, 2, True))


def test_an_expert_no_row_selects_cannot_make_nan() -> None:
    """Every row runs through every expert, but an unselected expert's output is dropped, not
    multiplied by zero: an expert that overflows on rows it was not chosen for changes
    nothing."""
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(3, 8, generator=gen) + 0.1  # positive, so the router's rows order the experts
    router = torch.tensor([[1.0] * 8, [2.0] * 8, [3.0] * 8, [0.0] * 8])  # expert 3 never top 2
    gate_up = torch.randn(4, 12, 8, generator=gen)
    down = torch.randn(4, 8, 6, generator=gen)
    finite = model_ops.moe(x, router, gate_up, down, 2, False)
    gate_up[3] = float("inf")
    assert torch.equal(model_ops.moe(x, router, gate_up, down, 2, False), finite)
    assert finite.isfinite().all()


def test_rows_route_alone() -> None:
    """A row's output depends on that row alone (no capacity shared across the batch)."""
    model = random_model(MOE_CONFIG, seed=2, std=0.3)
    tokens = torch.tensor([[5, 9, 1, 40, 33], [7, 7, 7, 2, 60]])
    together, _ = model(dense_batch(tokens), None)
    for row in range(2):
        alone, _ = model(dense_batch(tokens[row : row + 1]), None)
        torch.testing.assert_close(alone[0], together[row], rtol=1e-6, atol=1e-6)


#: A Qwen2-MoE-shaped tiny target: q/k/v bias, gated shared expert, layer 2 dense.
MOE_CONFIG = tiny_config(
    architecture="Qwen2MoeForCausalLM",
    qkv_bias=True,
    moe=MoEConfig(
        num_experts=4,
        top_k=2,
        expert_intermediate_size=24,
        norm_topk_prob=False,
        shared_expert_intermediate_size=40,
        dense_layers=(2,),
    ),
)
PIPE_VOCAB = 16
TARGET = markov_target(
    PIPE_VOCAB, architecture=MOE_CONFIG.architecture, qkv_bias=True, moe=MOE_CONFIG.moe
)
#: A Mixtral-shaped standalone draft: an MoE model in the draft's seat too.
SMALL = random_model(
    tiny_config(
        vocab_size=PIPE_VOCAB,
        num_layers=1,
        architecture="MixtralForCausalLM",
        moe=MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=64, norm_topk_prob=True),
    ),
    seed=8,
    std=0.3,
)
#: A GLM-4.5-shaped tiny target: partial rotary, q/k/v bias, q/k norm, 3 of 6 experts chosen
#: by sigmoid scores plus a (random) correction bias inside the best 2 of 3 groups, scaled, an
#: ungated shared expert, layer 0 dense.
GLM_TARGET = markov_target(
    PIPE_VOCAB,
    architecture="Glm4MoeForCausalLM",
    qkv_bias=True,
    qk_norm=True,
    partial_rotary_factor=0.5,
    moe=MoEConfig(
        num_experts=6,
        top_k=3,
        expert_intermediate_size=24,
        norm_topk_prob=True,
        dense_layers=(0,),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=3,
        topk_group=2,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        float32_router=True,
    ),
)


draw_correction_biases_(GLM_TARGET, seed=7)


def pipelines(target) -> dict:
    """name -> (algorithm, draft, spec options) over ``target``; tree shapes are drawn per
    example. The MTP layer is of the target's kind (the target's layer ``L``: an MoE layer
    with the target's routing and shared expert), built to agree with the target; chains reuse
    it."""
    mtp_head = agreeing_head(target, "mtp")
    return {
        "plain": ("plain", None, {}),
        "eagle chain": ("eagle", agreeing_head(target, "eagle"), {"num_steps": 4}),
        "eagle3 tree": ("eagle3", random_draft(target, "eagle3", seed=11, std=0.3), "tree"),
        "mtp": ("mtp", mtp_head, "tree"),
        "mtp chain 1": ("mtp", mtp_head, {"num_steps": 1}),
        "mtp chain 3": ("mtp", mtp_head, {"num_steps": 3}),
        "standalone": ("standalone", StandaloneHead(SMALL, PIPE_VOCAB), {"num_steps": 3}),
        "ngram": ("ngram", None, {"num_draft_tokens": 6}),
        "dflash": (
            "dflash",
            random_block_draft(target, "dflash", seed=1, std=0.3, block_size=4),
            {},
        ),
        "dspark": (
            "dspark",
            random_block_draft(target, "dspark", seed=2, std=0.3, block_size=4),
            {},
        ),
        "frozen_kv_mtp": ("frozen_kv_mtp", random_frozen_kv(target, seed=4, std=0.3), "tree"),
        "multi_layer_eagle": (
            "multi_layer_eagle",
            random_multi_layer(target, 3, seed=5, std=0.3),
            {"num_steps": 3},
        ),
    }


#: target family -> (target, its pipelines by name)
TARGETS = {
    "qwen2-moe": (TARGET, pipelines(TARGET)),
    "glm4-moe": (GLM_TARGET, pipelines(GLM_TARGET)),
}
PIPELINES = TARGETS["qwen2-moe"][1]
#: (num_steps, topk, num_draft_tokens) of the pipelines that take a drawn tree.
TREES = st.sampled_from([(3, 1, 4), (3, 2, 6), (2, 3, 7), (4, 2, 8)])


def moe_engine(name: str, tree: tuple[int, int, int], family: str = "qwen2-moe", **limits):
    target, pipes = TARGETS[family]
    return pipeline_engine(target, pipes[name], tree, **limits)


@pytest.mark.parametrize("family", sorted(TARGETS))
@pytest.mark.parametrize("name", sorted(PIPELINES))
@settings(max_examples=3)
@given(
    prompts=prompt_batches(PIPE_VOCAB, max_batch=4),
    tree=TREES,
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
)
def test_every_pipeline_equals_plain_greedy_on_an_moe_target(
    family, name, prompts, tree, page_size, prefill_budget
) -> None:
    """Token for token, for a batch of prompts, any page size, chunked prefill or not, and
    tree shape, on a Qwen2-MoE-shaped and a GLM-4.5-shaped target; EAGLE-family, block and
    frozen-KV draft layers built from the MoE target are dense, MTP and multi-layer EAGLE layers
    are MoE layers of the target's kind."""
    limits = {"page_size": page_size, "prefill_budget": prefill_budget}
    engine = moe_engine(name, tree, family, **limits)
    ours = generate(prompts, engine=engine, max_new_tokens=10)
    plain_engine = moe_engine("plain", tree, family, **limits)
    plain = generate(prompts, engine=plain_engine, max_new_tokens=10)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]


def test_speculative_rounds_on_the_moe_target_accept_deep_paths() -> None:
    """The equality above is only strong if rounds accept drafts."""
    engine = moe_engine("eagle chain", (0, 0, 0), page_size=4)
    results = generate([[1, 2, 3], [9, 9, 9, 1]], engine=engine, max_new_tokens=30)
    assert all(r.stats["accept_length_mean"] > 1.5 for r in results)


def test_sampled_requests_yield_in_a_batch_what_they_yield_alone() -> None:
    """Seeded sampling on the MoE target, speculative (EAGLE-3 tree): each request's tokens do
    not depend on the requests batched with it."""
    prompts = [[4, 2, 8], [1] * 9, [15, 3], [7, 7, 0, 5, 2]]
    options = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 5}
    engine = moe_engine("eagle3 tree", (3, 2, 6), page_size=4)
    together = generate(prompts, engine=engine, **options)
    for prompt, result in zip(prompts, together, strict=True):
        (alone,) = generate([prompt], engine=engine, **options)
        assert alone.token_ids == result.token_ids


def test_snapshot_restore_of_an_moe_batch_replays_exactly() -> None:
    """A snapshot of a sampled batch on the MoE target, restored, replays bit for bit."""
    engine = moe_engine("mtp", (3, 2, 6), page_size=4)
    assert_sampled_snapshot_replays(engine)


def test_speculative_sampling_on_an_moe_target_follows_the_target_law() -> None:
    """Seeded sampling is lossless on an MoE target: the first two tokens that MTP tree rounds
    (the MTP layer an MoE layer of the target's kind) emit at temperature 1, over many seeds,
    follow the law enumerated from the target's own next-token distributions
    (``test_eagle_stats``'s check), with rounds accepting drafts."""
    vocab = 6  # test_eagle_stats enumerates joints over its VOCAB, also 6
    target = markov_target(
        vocab,
        head_scale=0.25,
        architecture=MOE_CONFIG.architecture,
        qkv_bias=True,
        moe=MOE_CONFIG.moe,
    )
    prompt = [3, 1, 4]
    engine = engine_from_model(
        target,
        algorithm="mtp",
        draft=agreeing_head(target, "mtp"),
        spec=SpecOptions(num_steps=3, topk=2, num_draft_tokens=5),
        page_size=4,
        num_pages=CHUNK * 3 + 1,
        max_batch=CHUNK,
        max_context=12,
        prefill_budget=CHUNK * len(prompt),
    )
    (tokens,), (histogram,) = sample_tokens(engine, [(prompt, {})], SEEDS // 2, 2)
    stats = joint_stats(tokens, exact_joint(target, prompt, {}, 2))
    assert lossless(stats), stats
    assert acceptance_stats(histogram)["accept_length_mean"] > 1.2, stats


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two modules hold the same parameters under the same names."""
    left, right = a.state_dict(), b.state_dict()
    return list(left) == list(right) and all(torch.equal(left[k], right[k]) for k in left)


@pytest.mark.parametrize("family", sorted(TARGETS))
@pytest.mark.parametrize("layout", PORTABLE_LAYOUTS)
def test_drafts_for_an_moe_target_round_trip_in_every_layout(
    family: str, layout: str, tmp_path: Path
) -> None:
    """A head built for an MoE target saves and loads back in every layout, the target's own
    folder included, config included: EAGLE-family layers are dense (the dense sibling
    architecture; for GLM-4.5 its own with every layer dense, partial rotary kept), an MTP
    layer is the target's layer after its own, here an MoE layer of the target's routing."""
    target = TARGETS[family][0]
    algorithm = LAYOUTS[layout]
    head = random_draft(target, algorithm, seed=1, std=0.3)
    if algorithm == "mtp":
        assert head.config.layer.moe == target.config.moe
        assert isinstance(head.decoder.mlp, SparseMoE)
    else:
        assert head.config.layer.moe is None
        dense = {"qwen2-moe": "Qwen2ForCausalLM", "glm4-moe": "Glm4MoeForCausalLM"}[family]
        assert head.config.layer.architecture in (dense, "LlamaForCausalLM")
    save_draft(head, tmp_path, layout, target=target)
    loaded = load_draft(tmp_path, target, algorithm)
    assert same_weights(loaded, head)
    assert loaded.config.layer == head.config.layer


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_other_drafts_for_an_moe_target_round_trip(family: str, tmp_path: Path) -> None:
    """Block drafts, FROZEN_KV_MTP and multi-layer EAGLE heads (MoE layers) of an MoE target
    save and load in folders of their own."""
    target = TARGETS[family][0]
    for algorithm in ("dflash", "dspark"):
        head = random_block_draft(target, algorithm, seed=1, std=0.3, block_size=4)
        save_block_draft(head, tmp_path / algorithm)
        assert same_weights(load_block_draft(tmp_path / algorithm, target, algorithm), head)
    frozen = random_frozen_kv(target, seed=1, std=0.3)
    save_frozen_kv(frozen, tmp_path / "frozen")
    assert same_weights(load_frozen_kv(tmp_path / "frozen", target), frozen)
    multi = random_multi_layer(target, 2, seed=1, std=0.3)
    save_multi_layer(multi, tmp_path / "multi")
    assert same_weights(load_multi_layer(tmp_path / "multi", target), multi)
