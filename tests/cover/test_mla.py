"""Multi-head latent attention targets (DeepSeek-V2/V3, dense layers): equal to transformers,
strict checkpoints that round-trip, a cache of latents, and every pipeline equal to plain
decoding on an MLA target."""

from __future__ import annotations

import random
import string
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
from test_models import (
    RAGGED_PROMPTS,
    assert_ragged_logits_equal,
    edit_config,
    edit_weights,
    relative_error,
)
from test_training_draft import assert_decodes_like_plain, train, write_target

from speculum import kernels
from speculum.models.block_draft import load_block_draft, random_block_draft, save_block_draft
from speculum.models.config import CheckpointError, DecoderConfig, MLAConfig, MoEConfig
from speculum.models.decoder import LatentAttention, dense_batch
from speculum.models.draft import random_draft
from speculum.models.draft_loading import LAYOUTS, DraftTargetMismatch, load_draft, save_draft
from speculum.models.frozen_kv import random_frozen_kv
from speculum.models.loading import load_model, random_model, save_model
from speculum.models.multi_layer_eagle import (
    load_multi_layer,
    random_multi_layer,
    save_multi_layer,
)
from speculum.models.parallel import UnsupportedSplit, shard_
from speculum.models.standalone import StandaloneHead
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.paged import causal_mask
from speculum.state.parallel import TensorParallel

transformers.logging.disable_progress_bar()

VOCAB = 96  # test_models.run_in_steps pads with id VOCAB - 1 of its own VOCAB, also 96
#: DeepSeek's YaRN: 4x the original context, mscale below mscale_all_dim, so that both the
#: rotary tables (attention factor 0.93) and the softmax scale (mscale 1.14 squared) change.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.7,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
#: DeepSeek's mixture of experts from layer 1 on: 8 routed experts of which 2 per token, one
#: shared expert (the routing of each family by its own defaults or as given).
EXPERTS = {
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
}
#: case -> (family, config changes): V3's interleaved rope and plain q_proj, V3 with halves
#: rope and a low-rank query, V2's complex (interleaved) rope with YaRN, V3 with YaRN (all
#: layers dense); and with MoE layers: V3's sigmoid scores chosen with a (random) correction
#: bias in the best 2 of 4 groups, scaled by 2.5, and V2's softmax with group-limited greedy
#: top-k (and YaRN) or plain greedy top-k.
CASES = {
    "v3": ("DeepseekV3", {}),
    "v3-halves-q-lora": ("DeepseekV3", {"rope_interleave": False, "q_lora_rank": 12}),
    "v2-yarn-q-lora": ("DeepseekV2", {"q_lora_rank": 12, "rope_parameters": YARN}),
    "v3-yarn": ("DeepseekV3", {"rope_parameters": YARN}),
    "v3-moe": ("DeepseekV3", {**EXPERTS, "n_group": 4, "topk_group": 2}),
    "v2-moe-group-limited": (
        "DeepseekV2",
        {
            **EXPERTS,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "rope_parameters": YARN,
        },
    ),
    "v2-moe-greedy": ("DeepseekV2", {**EXPERTS, "n_shared_experts": 2}),
}


def hf_mla(family: str, **changes: object) -> transformers.PreTrainedModel:
    """A float32 transformers DeepSeek model, dense layers only unless ``changes`` say, every
    parameter random (norms around one; routers' correction biases too)."""
    config = getattr(transformers, f"{family}Config")(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 12,
            "qk_rope_head_dim": 8,
            "v_head_dim": 10,
            "first_k_dense_replace": 2,
            "max_position_embeddings": 128,
            **changes,
        }
    )
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = param.shape[-1] ** -0.5 if param.dim() >= 2 else 0.3
            mean = 1.0 if "norm" in name else 0.0
            param.copy_(torch.randn(param.shape, generator=gen) * std + mean)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_checkpoint(request, tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    """Each case's transformers model and the folder its ``save_pretrained`` wrote."""
    family, changes = CASES[request.param]
    model = hf_mla(family, **changes)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def test_greedy_decoding_equals_transformers_generate(hf_checkpoint) -> None:
    """Plain greedy decoding through the scheduler (chunked prefill, a batch of prompts) emits
    transformers' ``generate`` tokens, token for token."""
    hf, folder = hf_checkpoint
    assert_greedy_equals_transformers(hf, load_model(folder))


def test_logits_match_transformers_through_the_latent_cache(hf_checkpoint) -> None:
    """Chunked prefill and decode through the paged latent cache, in a ragged batch, and the
    cache-free (training) forward give transformers' logits (float32)."""
    hf, folder = hf_checkpoint
    ours = load_model(folder)
    assert_ragged_logits_equal(hf, ours)
    for prompt in RAGGED_PROMPTS:
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
            dense, _ = ours(dense_batch(torch.tensor([prompt])), None)
        assert relative_error(ours.logits(dense[0]), expected) < 1e-5


def test_the_cache_holds_the_latent_and_the_rotary_key_per_token(hf_checkpoint) -> None:
    """Per token and layer the pool holds kv_lora_rank + qk_rope_head_dim values (one
    "head"), not per-head keys and values: its ``v`` is empty."""
    _, folder = hf_checkpoint
    pool = load_model(folder).new_pool(num_pages=5, page_size=4)
    assert pool.k.shape == (2, 5, 4, 1, 16 + 8)
    assert pool.v.shape == (2, 5, 4, 1, 0)


def test_saving_writes_the_hub_layout_back_exactly(hf_checkpoint, tmp_path: Path) -> None:
    """Load then save writes transformers' keys with the same tensors, config.json reads back
    as the same config, and transformers loads the result to the same logits."""
    hf, folder = hf_checkpoint
    ours = load_model(folder)
    saved = save_model(ours, tmp_path)
    theirs, again = load_file(folder / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(again) == sorted(theirs)
    assert all(torch.equal(again[key], theirs[key]) for key in theirs)
    assert load_model(saved).config == ours.config
    reread = type(hf).from_pretrained(saved).eval()
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        assert torch.equal(reread(tokens).logits, hf(tokens).logits)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A DeepSeek-V3 checkpoint with a low-rank query, to break."""
    hf_mla("DeepseekV3", q_lora_rank=12).save_pretrained(tmp_path)
    return tmp_path


def test_a_missing_latent_weight_is_named(checkpoint: Path) -> None:
    """Every latent-attention weight is required by its hub name."""
    gone = "model.layers.1.self_attn.kv_a_layernorm.weight"
    edit_weights(checkpoint, lambda t: t.pop(gone))
    with pytest.raises(CheckpointError, match=rf"missing weights \['{gone}'\]"):
        load_model(checkpoint)


def test_a_kv_lora_rank_the_weights_contradict_is_named(checkpoint: Path) -> None:
    """A config whose kv_lora_rank disagrees with kv_b_proj's columns names the field, the
    key and the rank the weights imply."""
    edit_config(checkpoint, kv_lora_rank=20)
    with pytest.raises(
        CheckpointError,
        match=r"kv_lora_rank 20 in config.json disagrees with the weights: "
        r"'model.layers.0.self_attn.kv_b_proj.weight' .* latent of 16 values; set kv_lora_rank "
        r"to 16",
    ):
        load_model(checkpoint)


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"kv_lora_rank": None}, CheckpointError, r"needs kv_lora_rank \(the width of the comp"),
        ({"kv_lora_rank": 0}, CheckpointError, r"kv_lora_rank is 0; it must be an integer of"),
        ({"qk_rope_head_dim": 7}, CheckpointError, r"qk_rope_head_dim 7 is odd"),
        ({"v_head_dim": None}, CheckpointError, r"needs v_head_dim \(each head's value width"),
        ({"q_lora_rank": -1}, CheckpointError, r"q_lora_rank is -1; it must be an integer"),
        ({"rope_interleave": "yes"}, CheckpointError, r"rope_interleave is 'yes'; it must be"),
        (
            {**EXPERTS, "n_group": 2, "topk_group": 3},
            CheckpointError,
            r"topk_group 3 is more than n_group 2",
        ),
        (
            {**EXPERTS, "num_experts_per_tok": 9},
            CheckpointError,
            r"num_experts_per_tok 9 is more than the 8 experts \(n_routed_experts\)",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            CheckpointError,
            r"rope_parameters.original_max_position_embeddings is None; it must be a number",
        ),
    ],
    ids=[
        "no rank",
        "rank 0",
        "odd rope",
        "no v",
        "q rank",
        "interleave",
        "topk_group",
        "top k",
        "yarn",
    ],
)
def test_bad_latent_settings_are_refused_naming_the_field(
    changes: dict, error: type, message: str
) -> None:
    """A DeepSeek config.json whose latent-attention or routing fields no model can run with
    fails at parse, naming the field."""
    raw = hf_mla("DeepseekV3").config.to_dict()
    with pytest.raises(error, match=message):
        DecoderConfig.from_dict({**raw, **changes})


def test_tensor_parallelism_refuses_latent_attention(checkpoint: Path) -> None:
    """Latent attention is not split over ranks yet: sharding says so and changes nothing."""
    model = load_model(checkpoint)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedSplit, match=r"tp=2: multi-head latent attention layers"):
        shard_(model, TensorParallel(rank=0, size=2))
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert isinstance(model.model.layers[0].self_attn, LatentAttention)


#: A tiny DeepSeek-V3-shaped target (interleaved rope, low-rank query, values narrower than
#: keys; layers 1-3 mixture-of-experts with V3's routing: sigmoid scores, a random correction
#: bias choosing inside the best 2 of 3 groups, scaled, one shared expert) whose next token is
#: usually a function of the last one (``heads.markov_target``).
MLA_SHAPES = {
    "architecture": "DeepseekV3ForCausalLM",
    "num_kv_heads": 4,
    "head_dim": 8,
    "mla": MLAConfig(
        q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6
    ),
}
DEEPSEEK_V3_MOE = MoEConfig(
    num_experts=6,
    top_k=2,
    expert_intermediate_size=16,
    norm_topk_prob=True,
    dense_layers=(0,),
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    n_group=3,
    topk_group=2,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    float32_router=True,
)
PIPE_VOCAB = 16
TARGET = markov_target(PIPE_VOCAB, **MLA_SHAPES, moe=DEEPSEEK_V3_MOE)
draw_correction_biases_(TARGET, seed=7)
#: An MLA standalone draft: a latent cache in the draft's seat too.
SMALL = random_model(tiny_config(vocab_size=PIPE_VOCAB, num_layers=1, **MLA_SHAPES), seed=8)
#: DeepSeek's NextN layer for the target: its layer 4, a latent-attention MoE layer.
NEXTN_HEAD = agreeing_head(TARGET, "mtp")
#: name -> (algorithm, draft, spec options); tree shapes are drawn per example. Frozen-KV MTP
#: reads the target's per-head keys, which an MLA cache does not hold: it is refused (below).
PIPELINES = {
    "plain": ("plain", None, {}),
    "eagle chain": ("eagle", agreeing_head(TARGET, "eagle"), {"num_steps": 4}),
    "adaptive": ("eagle", agreeing_head(TARGET, "eagle"), {"adaptive_steps": (0, 1, 3)}),
    "eagle3 tree": ("eagle3", random_draft(TARGET, "eagle3", seed=11, std=0.3), "tree"),
    "mtp": ("mtp", NEXTN_HEAD, "tree"),
    "mtp chain 3": ("mtp", NEXTN_HEAD, {"num_steps": 3}),
    "standalone": ("standalone", StandaloneHead(SMALL, PIPE_VOCAB), {"num_steps": 3}),
    "ngram": ("ngram", None, {"num_draft_tokens": 6}),
    "dflash": ("dflash", random_block_draft(TARGET, "dflash", seed=1, std=0.3, block_size=4), {}),
    "dspark": ("dspark", random_block_draft(TARGET, "dspark", seed=2, std=0.3, block_size=4), {}),
    "multi_layer_eagle": (
        "multi_layer_eagle",
        random_multi_layer(TARGET, 3, seed=5, std=0.3),
        {"num_steps": 3},
    ),
}
#: (num_steps, topk, num_draft_tokens) of the pipelines that take a drawn tree.
TREES = st.sampled_from([(3, 1, 4), (3, 2, 6), (2, 3, 7), (4, 2, 8)])


def mla_engine(name: str, tree: tuple[int, int, int], **limits):
    return pipeline_engine(TARGET, PIPELINES[name], tree, **limits)


@pytest.mark.parametrize("name", sorted(set(PIPELINES) - {"plain"}))
@settings(max_examples=3)
@given(
    prompts=prompt_batches(PIPE_VOCAB, max_batch=4),
    tree=TREES,
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
)
def test_every_pipeline_equals_plain_greedy_on_an_mla_target(
    name, prompts, tree, page_size, prefill_budget
) -> None:
    """Token for token, for a batch of prompts, any page size, chunked prefill or not, and
    tree shape: verify and tree attention over the latent cache, and the path commit that
    moves accepted latents, are exact."""
    limits = {"page_size": page_size, "prefill_budget": prefill_budget}
    ours = generate(prompts, engine=mla_engine(name, tree, **limits), max_new_tokens=10)
    plain = generate(prompts, engine=mla_engine("plain", tree, **limits), max_new_tokens=10)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]


def test_speculative_rounds_on_the_mla_target_accept_deep_paths() -> None:
    """The equality above is only strong if rounds accept drafts."""
    engine = mla_engine("eagle chain", (0, 0, 0), page_size=4)
    results = generate([[1, 2, 3], [9, 9, 9, 1]], engine=engine, max_new_tokens=30)
    assert all(r.stats["accept_length_mean"] > 1.5 for r in results)


def test_drafts_built_from_an_mla_target_cache_as_their_layers_attend() -> None:
    """EAGLE/MTP draft layers are the target's kind (latent attention, latent pool); block
    drafts' Qwen3 layers are grouped-query (per-head pool)."""
    mtp, dflash = PIPELINES["mtp"][1], PIPELINES["dflash"][1]
    assert isinstance(mtp.decoder.self_attn, LatentAttention)
    assert mtp.new_pool(3, 4).k.shape == (1, 3, 4, 1, 16 + 8)
    assert dflash.new_pool(3, 4).v.shape == (2, 3, 4, 4, 8)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two modules hold the same parameters under the same names."""
    left, right = a.state_dict(), b.state_dict()
    return list(left) == list(right) and all(torch.equal(left[k], right[k]) for k in left)


@pytest.mark.parametrize("layout", PORTABLE_LAYOUTS)
def test_drafts_for_an_mla_target_round_trip(layout: str, tmp_path: Path) -> None:
    """EAGLE/MTP heads with latent-attention layers save and load back in every layout (MTP
    layers inside the target's folder too)."""
    head = random_draft(TARGET, LAYOUTS[layout], seed=1, std=0.3)
    target = {"target": TARGET} if layout == "mtp-in-target" else {}
    save_draft(head, tmp_path, layout, **target)
    assert same_weights(load_draft(tmp_path, TARGET, LAYOUTS[layout]), head)


def test_other_drafts_for_an_mla_target_round_trip(tmp_path: Path) -> None:
    """Block drafts and multi-layer EAGLE heads of an MLA target save and load."""
    for algorithm in ("dflash", "dspark"):
        head = random_block_draft(TARGET, algorithm, seed=1, std=0.3, block_size=4)
        save_block_draft(head, tmp_path / algorithm)
        assert same_weights(load_block_draft(tmp_path / algorithm, TARGET, algorithm), head)
    multi = random_multi_layer(TARGET, 2, seed=1, std=0.3)
    save_multi_layer(multi, tmp_path / "multi")
    assert same_weights(load_multi_layer(tmp_path / "multi", TARGET), multi)


def test_the_latent_attention_op_traces() -> None:
    """``speculum::latent_attention`` passes torch's custom-op checks: its fake kernel gives the
    latent's width."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 2, 1, 12, generator=gen)
    q = torch.randn(2, 3, 4, 12, generator=gen)
    args = (torch.tensor([[1, 2], [3, 0]]), torch.tensor([1, 0]), torch.tensor([3, 2]))
    torch.library.opcheck(kernels.latent_attention, (q, cache, *args, causal_mask(2, 3), 0.3, 8))


def test_a_frozen_kv_draft_is_refused_on_an_mla_target() -> None:
    """A frozen-KV draft attends to the target's cached per-head keys, which MLA does not
    keep: building one says so."""
    with pytest.raises(DraftTargetMismatch, match=r"target \(DeepseekV3ForCausalLM\) is multi"):
        random_frozen_kv(TARGET, seed=4)


def test_snapshot_restore_of_an_mla_batch_replays_exactly() -> None:
    """A snapshot of a sampled batch on the MLA target (its latent pages, and the MTP draft's),
    restored, replays bit for bit."""
    engine = mla_engine("mtp", (3, 2, 6), page_size=4)
    assert_sampled_snapshot_replays(engine)


@pytest.mark.parametrize("algorithm", ["eagle3", "mtp"])
def test_train_draft_on_an_mla_target_decodes_like_plain(algorithm, tmp_path: Path) -> None:
    """``train-draft`` trains through the target's cache-free latent attention (EAGLE-3's
    auxiliary hidden states, MTP's final one); the saved draft loads and its chains and trees
    emit plain decoding's tokens."""
    model = random_model(tiny_config(vocab_size=260, bos_token_id=256, **MLA_SHAPES), seed=0)
    target = write_target(tmp_path / "target", model)
    rng = random.Random(0)
    words = ("".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 8))) for _ in range(3000))
    (tmp_path / "corpus.txt").write_text(" ".join(words))
    train(target, [tmp_path / "corpus.txt"], tmp_path / "draft", algorithm, steps=4)
    assert_decodes_like_plain(tmp_path / "draft", target, algorithm)


@pytest.mark.parametrize("algorithm", ["nextn", "multi_layer_eagle"])
def test_deepseek_nextn_layers_in_the_target_folder_decode_like_plain(
    algorithm: str, tmp_path: Path
) -> None:
    """DeepSeek-V3's NextN layout: MTP layers stored in a DeepSeek-V3 folder (written by
    transformers, MoE from layer 1) after the decoder's own layers are latent-attention MoE
    layers with the target's routing; ``--algorithm nextn`` (one layer: chains reuse it, and
    trees) and multi-layer EAGLE (two layers) from that folder emit plain greedy decoding's
    tokens, and the folder reads back the same weights."""
    family, changes = CASES["v3-moe"]
    folder = tmp_path / "deepseek-v3"
    hf_mla(family, **changes).save_pretrained(folder)
    target = load_model(folder)
    if algorithm == "nextn":
        head = agreeing_head(target, "mtp")
        save_draft(head, folder, "mtp-in-target", target=target)
        loaded = load_draft(folder, target, "nextn")
        shapes = [SpecOptions(num_steps=3), SpecOptions(num_steps=3, topk=2, num_draft_tokens=6)]
    else:
        head = random_multi_layer(target, 2, seed=1, std=0.3)
        save_multi_layer(head, folder, target=target)
        loaded = load_multi_layer(folder, target)
        shapes = [SpecOptions(num_steps=2)]
    assert same_weights(loaded, head)
    layer = loaded.decoder if algorithm == "nextn" else loaded.layers[0].decoder
    assert isinstance(layer.self_attn, LatentAttention)
    assert type(layer.mlp).__name__ == "SparseMoE"
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44]]
    plain = generate(prompts, engine=engine_from_model(target, max_context=64), max_new_tokens=12)
    for spec in shapes:
        engine = engine_from_model(
            target, algorithm=algorithm, draft=loaded, spec=spec, max_context=64
        )
        ours = generate(prompts, engine=engine, max_new_tokens=12)
        assert [r.token_ids for r in ours] == [r.token_ids for r in plain]
