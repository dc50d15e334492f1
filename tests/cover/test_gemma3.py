"""Gemma-3's text decoder (``Gemma3ForCausalLM``) composed from the shared blocks: a tiny random
checkpoint written by transformers' own class loads strictly, its logits (soft-capped) equal
transformers' in float32, greedy decoding well past the window equals transformers'
``generate`` (and differs without the windows or without the local rotary base), speculative
pipelines equal plain decoding, the folder saved back reads the same in transformers, and what
the decoder does not run is refused by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import attrs
import pytest
import torch
import transformers
from heads import pipeline_engine, transformers_greedy

from speculum.models.config import DecoderConfig, UnsupportedModel
from speculum.models.decoder import dense_batch
from speculum.models.loading import load_model, save_model
from speculum.models.standalone import StandaloneHead
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.paged import extend_batch
from speculum.state.kv import PagedKV

transformers.logging.disable_progress_bar()

VOCAB = 96
WINDOW = 4
PROMPTS = [[3, 17, 42, 5, 88, 1, 9, 60, 2, 11, 7], [9] * 9, [1, 2]]
NEW_TOKENS = 40
#: Local, global, local, local: the local layers rotate with base 10^4, the global one with
#: 10^6 under linear scaling (factor 2), as the larger released models do.
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def hf_gemma3(layer_types: list[str] = LAYER_TYPES) -> transformers.Gemma3ForCausalLM:
    """A float32 Gemma-3 of 4 layers, every parameter random (std 0.5 / sqrt(fan_in), norm
    weights around 0, their scale around 1), ``query_pre_attn_scalar`` 12 (not the head
    width) and a final logit cap of 1 that bites."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=WINDOW,
        max_position_embeddings=128,
        layer_types=layer_types,
        query_pre_attn_scalar=12,
        final_logit_softcapping=1.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        eos_token_id=None,
    )
    model = transformers.Gemma3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in model.named_parameters():
            std = 0.5 * param.shape[-1] ** -0.5 if param.dim() >= 2 else 0.3
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> tuple[transformers.Gemma3ForCausalLM, Path]:
    """The transformers model and the folder its ``save_pretrained`` wrote."""
    model = hf_gemma3()
    folder = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def target(hf_checkpoint):
    """The checkpoint loaded by speculum."""
    return load_model(hf_checkpoint[1])


def decode(model, **limits) -> list[list[int]]:
    """Plain greedy decoding of :data:`PROMPTS` through the scheduler (pages of 4, chunked
    prefill)."""
    engine = engine_from_model(model, page_size=4, max_context=64, prefill_budget=7, **limits)
    results = generate(PROMPTS, engine=engine, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(r.token_ids) for r in results]


def test_the_config_maps_onto_the_blocks(hf_checkpoint, target) -> None:
    """Each layer's window, its rotary table, the score scale, the norms' zero-centred scale
    and the embedding scale as transformers has them."""
    config = target.config
    assert [layer.self_attn.window for layer in target.model.layers] == [WINDOW, 0, WINDOW, WINDOW]
    assert [config.uses_local_rope(n) for n in range(4)] == [True, False, True, True]
    assert config.local_rope_theta == 1e4 and config.rope_theta == 1e6
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    hf, _ = hf_checkpoint
    assert target.model.layers[0].self_attn.scale == pytest.approx(
        hf.model.layers[0].self_attn.scaling
    )
    assert config.norm_offset == 1.0 and config.qk_norm and config.sandwich_norms
    assert config.embedding_scale == 32**0.5 and config.tie_word_embeddings
    assert config.final_logit_softcapping == 1.0


def test_logits_equal_transformers_cache_free_and_paged(hf_checkpoint, target) -> None:
    """Float32 logits (capped) over 20 tokens, five windows, agree with transformers' forward,
    from the cache-free (training) forward and from the paged one."""
    hf, _ = hf_checkpoint
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    kv = PagedKV(
        page_table=torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]),
        seq_lens=torch.tensor([0, 0]),
        page_size=4,
    )
    with torch.no_grad():
        expected = hf(tokens).logits
        hf.config.final_logit_softcapping = None
        uncapped = hf(tokens).logits
        hf.config.final_logit_softcapping = 1.0
        dense = target.logits(target(dense_batch(tokens), None)[0])
        batch = extend_batch(kv, tokens, torch.tensor([20, 20]))
        paged = target.logits(target(batch, target.new_pool(11, 4))[0])
    assert (uncapped - expected).abs().max() > 0.5  # the cap bites
    torch.testing.assert_close(dense, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(paged, expected, rtol=1e-4, atol=1e-4)


def test_greedy_decoding_past_the_window_equals_transformers_generate(
    hf_checkpoint, target
) -> None:
    """40 greedy tokens (ten windows) for a batch equal transformers' ``generate``; the same
    weights without the windows, or with the global rotary table in the local layers, give
    other tokens. The global layer reads every key, so every page is kept."""
    hf, _ = hf_checkpoint
    expected = transformers_greedy(hf, PROMPTS, NEW_TOKENS)
    assert len({t for tokens in expected for t in tokens}) > 15  # not a degenerate loop
    assert decode(target) == expected
    assert engine_from_model(target, max_context=64).kv_window is None
    windowless = copy.deepcopy(target)
    for layer in windowless.model.layers:
        layer.self_attn.window = 0
    assert decode(windowless) != expected
    global_rope = copy.deepcopy(target)
    global_rope.local_inv_freq = global_rope.inv_freq
    assert decode(global_rope) != expected


def test_an_all_local_gemma_frees_pages_and_equals_transformers(tmp_path) -> None:
    """With every layer local, pages outside the window go back to the pool: in a pool of 10
    pages of 4 for three requests whose whole budgets would take 13 each, greedy decoding
    equals transformers' ``generate``."""
    hf = hf_gemma3(layer_types=["sliding_attention"] * 4)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert engine_from_model(model, page_size=4, max_context=64).kv_window == WINDOW
    assert decode(model, num_pages=10) == transformers_greedy(hf, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize(
    "pipeline",
    [
        ("standalone", "self", {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}),
        ("ngram", None, {"num_draft_tokens": 5}),
    ],
    ids=["standalone self", "ngram"],
)
def test_speculative_pipelines_equal_plain(target, pipeline) -> None:
    """The target drafting for itself (a tree; rounds accept its deepest paths) and
    n-gram drafting emit plain greedy decoding's tokens, 30 past the window, for a batch with
    chunked prefill."""
    algorithm, draft, spec = pipeline
    draft = StandaloneHead(target, VOCAB) if draft == "self" else draft
    limits = {"page_size": 4, "prefill_budget": 6, "max_context": 64}
    engine = pipeline_engine(target, (algorithm, draft, spec), (0, 0, 0), **limits)
    ours = generate(PROMPTS, engine=engine, max_new_tokens=30)
    plain = generate(PROMPTS, engine=engine_from_model(target, **limits), max_new_tokens=30)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]
    if algorithm == "standalone":
        assert all(r.stats["accept_length_mean"] > 2.5 for r in ours)


def test_saved_folders_read_back_in_transformers(hf_checkpoint, target, tmp_path) -> None:
    """``save_model`` writes the hub's layout back: transformers loads every tensor unchanged
    and reads the same layer kinds, rotary bases and scales; speculum reads the same config."""
    hf, _ = hf_checkpoint
    save_model(target, tmp_path)
    assert load_model(tmp_path).config == target.config
    back = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path)
    theirs, reloaded = hf.state_dict(), back.state_dict()
    assert sorted(reloaded) == sorted(theirs)
    assert all(torch.equal(reloaded[k], theirs[k]) for k in theirs)
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"):
        assert getattr(back.config, key) == getattr(hf.config, key)


def test_transformers_4_configs_read_the_same(hf_checkpoint, target) -> None:
    """The transformers 4 spelling (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``,
    ``sliding_window_pattern`` instead of ``layer_types``) gives the same config."""
    raw = json.loads((hf_checkpoint[1] / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        raw.pop(key)
    raw |= {
        "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_local_base_freq": 1e4,
        "sliding_window_pattern": 2,  # layers 1 and 3 global
    }
    config = DecoderConfig.from_dict(raw)
    assert config == attrs.evolve(target.config, full_attention_layers=(1, 3))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "does not soft-cap scores"),
        ({"use_bidirectional_attention": True}, "not a causal decoder"),
        ({"hidden_activation": "gelu"}, "'gelu_pytorch_tanh' only"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "local layers rotate with the default rope only",
        ),
    ],
)
def test_what_the_decoder_does_not_run_is_refused(hf_checkpoint, change, message) -> None:
    """Attention logit soft-capping, bidirectional attention, another activation and scaled
    local rope are refused, naming the key."""
    raw = json.loads((hf_checkpoint[1] / "config.json").read_text()) | change
    with pytest.raises(UnsupportedModel, match=message):
        DecoderConfig.from_dict(raw)
