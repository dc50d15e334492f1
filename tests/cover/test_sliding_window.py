"""Sliding-window attention: the window rule of the attention op, per-layer windows read from
Mistral and Qwen configs as transformers reads them, greedy decoding equal to transformers'
well past the window, and every pipeline equal to plain decoding on a windowed target."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_config
from heads import (
    PORTABLE_LAYOUTS,
    agreeing_head,
    assert_sampled_snapshot_replays,
    markov_target,
    pipeline_engine,
    transformers_greedy,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import page_sizes, prefill_budgets, prompt_batches
from test_models import random_tensors

from speculum import kernels
from speculum.models.block_draft import random_block_draft
from speculum.models.config import CheckpointError, DecoderConfig
from speculum.models.decoder import Attention, dense_batch
from speculum.models.draft import random_draft
from speculum.models.draft_loading import LAYOUTS, load_draft, save_draft
from speculum.models.frozen_kv import random_frozen_kv
from speculum.models.loading import load_model, random_model
from speculum.models.multi_layer_eagle import random_multi_layer
from speculum.models.standalone import StandaloneHead
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.attention import visible_keys
from speculum.spec.paged import causal_mask, extend_batch
from speculum.state.kv import PagedKV

transformers.logging.disable_progress_bar()

VOCAB = 96
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 24}
#: name -> (transformers family, config fields, each layer's window as speculum must read it).
#: Windows of 3 to 6 keys, so that 40 new tokens decode far past them.
FAMILIES: dict[str, tuple[str, dict, list[int]]] = {
    "mistral": ("Mistral", {"sliding_window": 5}, [5, 5, 5]),
    "mixtral": ("Mixtral", {"sliding_window": 4, "num_local_experts": 4, **MOE}, [4, 4, 4]),
    # Qwen2 and Qwen3 window the layers from max_window_layers on (transformers 5 writes the
    # rule out as layer_types); Qwen2-MoE the even layers below it; Qwen3-MoE every layer.
    "qwen2": (
        "Qwen2",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        [0, 4, 4],
    ),
    "qwen3": (
        "Qwen3",
        {
            "use_sliding_window": True,
            "sliding_window": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        [3, 0, 3],
    ),
    "qwen2-moe": (
        "Qwen2Moe",
        {
            "use_sliding_window": True,
            "sliding_window": 3,
            "max_window_layers": 2,
            "num_experts": 4,
            "shared_expert_intermediate_size": 40,
            **MOE,
        },
        [3, 0, 0],
    ),
    "qwen3-moe": (
        "Qwen3Moe",
        {"use_sliding_window": True, "sliding_window": 6, "num_experts": 4, **MOE},
        [6, 6, 6],
    ),
}


def hf_windowed(family: str) -> transformers.PreTrainedModel:
    """A float32 transformers model of ``family`` with every parameter random, wide enough
    (std 2 / sqrt(fan_in)) that attention to far keys changes its greedy tokens."""
    name, fields, _ = FAMILIES[family]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **fields,
    )
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, param in random_tensors(model):
            std = 2 * param.shape[-1] ** -0.5 if param.dim() >= 2 else 0.3
            param.copy_(torch.randn(param.shape, generator=gen) * std + ("norm" in key))
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_checkpoint(request, tmp_path_factory) -> tuple[str, transformers.PreTrainedModel, Path]:
    """Each family's name, transformers model and the folder its ``save_pretrained`` wrote."""
    model = hf_windowed(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


PROMPTS = [[3, 17, 42, 5, 88, 1, 9, 60, 2, 11, 7], [9] * 9, [1, 2]]
NEW_TOKENS = 40


def test_each_layer_gets_the_window_transformers_gives_it(hf_checkpoint) -> None:
    family, _, folder = hf_checkpoint
    model = load_model(folder)
    assert [layer.self_attn.window for layer in model.model.layers] == FAMILIES[family][2]


def test_greedy_decoding_past_the_window_equals_transformers_generate(hf_checkpoint) -> None:
    """Plain greedy decoding through the scheduler (chunked prefill wider than the window,
    pages of 4, a batch) emits transformers' ``generate`` tokens for 40 tokens, many windows
    long; the same weights without the window emit other tokens, so the window is what
    matches."""
    _, hf, folder = hf_checkpoint
    model = load_model(folder)
    expected = transformers_greedy(hf, PROMPTS, NEW_TOKENS)

    def decode() -> list[list[int]]:
        engine = engine_from_model(model, page_size=4, max_context=64, prefill_budget=7)
        results = generate(PROMPTS, engine=engine, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        return [list(r.token_ids) for r in results]

    assert decode() == expected
    for layer in model.model.layers:
        layer.self_attn.window = 0
    assert decode() != expected


def test_configs_round_trip_and_transformers_reads_the_same_windows(hf_checkpoint) -> None:
    """``to_dict`` writes the windows back so that speculum and transformers both read each
    layer's window as it was."""
    family, _, folder = hf_checkpoint
    config = load_model(folder).config
    written = config.to_dict()
    assert DecoderConfig.from_dict(written) == config
    name = FAMILIES[family][0]
    reread = getattr(transformers, f"{name}Config")(**written)
    if hasattr(reread, "layer_types") and name not in ("Mistral", "Mixtral"):
        kinds = [("sliding_attention" if w else "full_attention") for w in FAMILIES[family][2]]
        assert reread.layer_types == kinds
    assert reread.sliding_window == config.sliding_window


def qwen2_config(**changes: object) -> dict:
    """A tiny Qwen2 ``config.json`` dictionary with ``changes``."""
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    }
    return {**base, **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["full_attention"]},
            r"layer_types is \['full_attention'\]; it must list one of full_attention, "
            r"sliding_attention per layer \(num_hidden_layers 2\)",
        ),
        (
            {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["chunked"] * 2},
            r"layer_types is \['chunked', 'chunked'\]",
        ),
        (
            {"use_sliding_window": False, "layer_types": ["sliding_attention"] * 2},
            r"layer_types names sliding_attention layers but the config has no window",
        ),
        ({"use_sliding_window": True, "sliding_window": 0}, r"sliding_window is 0; it must be"),
        ({"use_sliding_window": "yes"}, r"use_sliding_window is 'yes'; it must be true or false"),
    ],
    ids=["layer count", "unknown kind", "no window", "zero window", "not a boolean"],
)
def test_window_settings_no_model_can_run_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        DecoderConfig.from_dict(qwen2_config(**changes))


def test_windows_are_read_only_where_transformers_reads_them() -> None:
    """Qwen without ``use_sliding_window`` (Qwen2.5's hub configs carry a ``sliding_window``
    they do not use) and Llama have no window; Mistral's applies to every layer."""
    unused = DecoderConfig.from_dict(qwen2_config(sliding_window=4, max_window_layers=0))
    llama = DecoderConfig.from_dict(
        qwen2_config(architectures=["LlamaForCausalLM"], sliding_window=4)
    )
    mistral = DecoderConfig.from_dict(
        qwen2_config(architectures=["MistralForCausalLM"], sliding_window=4)
    )
    assert [c.attention_window(n) for c in (unused, llama, mistral) for n in (0, 1)] == [
        0,
        0,
        0,
        0,
        4,
        4,
    ]


@st.composite
def trees(draw: st.DrawFn) -> tuple[list[int], int, int]:
    """A tree of up to 10 nodes in parent-before-child order (``parents[0] == -1`` is the
    root), a prefix length and a window."""
    size = draw(st.integers(1, 10))
    parents = [-1] + [draw(st.integers(0, n - 1)) for n in range(1, size)]
    return parents, draw(st.integers(0, 12)), draw(st.integers(1, 8))


@settings(max_examples=200, deadline=None)
@given(tree=trees())
def test_the_window_keeps_keys_by_position_for_a_tree(tree) -> None:
    """A tree node at depth ``d`` (position ``prefix + d``) sees the keys at positions above
    its own less the window: prefix keys and its ancestors, by position, which is the rule
    transformers applies to a sequence, applied along each path."""
    parents, prefix, window = tree
    depth = []
    for parent in parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    size = len(parents)
    mask = torch.zeros(1, size, size, dtype=torch.bool)
    for node in range(size):
        at = node
        while at >= 0:
            mask[0, node, at] = True
            at = parents[at]
    seq = prefix + size
    got = visible_keys(torch.tensor([prefix]), mask, seq, window)[0]
    for node in range(size):
        position = prefix + depth[node]
        for s in range(seq):
            key_position = s if s < prefix else prefix + depth[s - prefix]
            seen = s < prefix or bool(mask[0, node, s - prefix])
            assert bool(got[node, s]) == (seen and key_position > position - window)


def test_the_attention_op_takes_the_window_and_passes_its_checks() -> None:
    """``speculum::paged_attention`` with a window passes torch's custom-op checks, its window
    changes the result only when it is shorter than the context, and a negative one is
    refused."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 4, 4, 2, 8, generator=gen)
    q = torch.randn(2, 3, 4, 8, generator=gen)
    args = (torch.tensor([[1, 2], [3, 0]]), torch.tensor([4, 0]), torch.tensor([3, 2]))
    call = (q, k_cache, v_cache, *args, causal_mask(2, 3), 0.3)
    torch.library.opcheck(kernels.paged_attention, (*call, 3))
    full = kernels.paged_attention(*call)
    assert torch.equal(kernels.paged_attention(*call, 7), full)
    assert not torch.equal(kernels.paged_attention(*call, 6)[0], full[0])
    with pytest.raises(ValueError, match=r"window=-1: a sliding window is a key count"):
        kernels.paged_attention(*call, -1)


def test_the_cache_free_forward_keeps_the_window() -> None:
    """Training's cache-free forward (``pool=None``) sees what the paged forward sees."""
    model = markov_target(VOCAB, sliding_window=3, full_attention_layers=(1,))
    tokens = torch.tensor([[5, 9, 1, 40, 2, 2, 71, 3, 8]])
    with torch.no_grad():
        dense, _ = model(dense_batch(tokens), None)
        kv = PagedKV(page_table=torch.tensor([[1, 2, 3]]), seq_lens=torch.tensor([0]), page_size=4)
        paged, _ = model(extend_batch(kv, tokens, torch.tensor([9])), model.new_pool(4, 4))
    torch.testing.assert_close(dense, paged, rtol=1e-5, atol=1e-5)


PIPE_VOCAB = 16
#: A mostly-Markov Qwen2-shaped target (``heads.markov_target``) with a 4-key window on layers
#: 1-3, layer 0 full, decoding 30 tokens into a context of 64.
TARGET = markov_target(
    PIPE_VOCAB,
    architecture="Qwen2ForCausalLM",
    qkv_bias=True,
    sliding_window=4,
    full_attention_layers=(0,),
)
#: A random target (no Markov vote) with a 3-key window on every layer: drafts that agree with
#: a Markov target rarely agree with it, so most rounds roll back.
CONTEXTUAL = random_model(
    tiny_config(
        vocab_size=PIPE_VOCAB, num_layers=4, architecture="MistralForCausalLM", sliding_window=3
    ),
    seed=5,
    std=0.5,
)


def pipelines(target) -> dict:
    """name -> (algorithm, draft, spec options) over ``target``; ``"tree"``: drawn per example.
    The standalone draft is the target itself (it always agrees: every round commits the
    deepest path)."""
    mtp_head = agreeing_head(target, "mtp")
    return {
        "plain": ("plain", None, {}),
        "eagle chain": ("eagle", agreeing_head(target, "eagle"), {"num_steps": 4}),
        "adaptive": ("eagle", agreeing_head(target, "eagle"), {"adaptive_steps": (0, 1, 3)}),
        "eagle3 tree": ("eagle3", random_draft(target, "eagle3", seed=11, std=0.3), "tree"),
        "mtp": ("mtp", mtp_head, "tree"),
        "mtp chain 3": ("mtp", mtp_head, {"num_steps": 3}),
        "standalone self": ("standalone", StandaloneHead(target, PIPE_VOCAB), "tree"),
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


TARGETS = {"markov": (TARGET, pipelines(TARGET)), "contextual": (CONTEXTUAL, pipelines(CONTEXTUAL))}
#: (num_steps, topk, num_draft_tokens) of the pipelines that take a drawn tree: depths up to
#: 4, past the 3- and 4-key windows.
TREES = st.sampled_from([(3, 1, 4), (3, 2, 6), (2, 3, 7), (4, 2, 8), (5, 1, 6)])


def windowed_engine(target: str, name: str, tree: tuple[int, int, int], **limits):
    model, pipes = TARGETS[target]
    return pipeline_engine(model, pipes[name], tree, **({"max_context": 64} | limits))


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", sorted(set(TARGETS["markov"][1]) - {"plain"}))
@settings(max_examples=3, deadline=None)
@given(
    prompts=prompt_batches(PIPE_VOCAB, max_batch=4),
    tree=TREES,
    page_size=page_sizes,
    prefill_budget=prefill_budgets,
)
def test_every_pipeline_equals_plain_greedy_on_a_windowed_target(
    target, name, prompts, tree, page_size, prefill_budget
) -> None:
    """Token for token, 30 tokens past 3- and 4-key windows, for a batch of prompts, any page
    size, chunked prefill or not, and tree shape: chain and tree verify, draft-extend and
    commit keep each query's window by position."""
    limits = {"page_size": page_size, "prefill_budget": prefill_budget}
    ours = generate(
        prompts, engine=windowed_engine(target, name, tree, **limits), max_new_tokens=30
    )
    plain = generate(
        prompts, engine=windowed_engine(target, "plain", tree, **limits), max_new_tokens=30
    )
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]


def test_speculative_rounds_on_the_windowed_targets_accept_as_meant() -> None:
    """The equality above is strong only if the Markov target's rounds accept deep paths (the
    target drafting for itself accepts every token), the contextual target's rarely, and the
    window changes the target's tokens."""
    prompts = [[1, 2, 3], [9, 9, 9, 1]]
    chain = generate(
        prompts, engine=windowed_engine("markov", "eagle chain", (0, 0, 0)), max_new_tokens=30
    )
    assert all(r.stats["accept_length_mean"] > 1.5 for r in chain)
    itself = windowed_engine("markov", "standalone self", (4, 1, 5))
    assert all(
        r.stats["accept_length_mean"] > 4
        for r in generate(prompts, engine=itself, max_new_tokens=30)
    )
    rare = generate(
        prompts, engine=windowed_engine("contextual", "eagle chain", (0, 0, 0)), max_new_tokens=30
    )
    assert min(r.stats["accept_length_mean"] for r in rare) < 1.5
    windowed = generate(
        prompts, engine=windowed_engine("contextual", "plain", (0, 0, 0)), max_new_tokens=30
    )
    full = copy.deepcopy(CONTEXTUAL)
    for layer in full.model.layers:
        layer.self_attn.window = 0
    unwindowed = generate(
        prompts, engine=engine_from_model(full, max_context=64), max_new_tokens=30
    )
    assert [r.token_ids for r in windowed] != [r.token_ids for r in unwindowed]


def attention_windows(module: torch.nn.Module) -> list[int]:
    """The window of every grouped-query attention block in ``module``, in order."""
    return [m.window for m in module.modules() if isinstance(m, Attention)]


@pytest.mark.parametrize("target_name", sorted(TARGETS))
@pytest.mark.parametrize("layout", PORTABLE_LAYOUTS)
def test_drafts_for_a_windowed_target_round_trip(
    target_name: str, layout: str, tmp_path: Path
) -> None:
    """EAGLE/MTP heads built for a windowed target save and load back in every layout with
    their weights and their layers' windows (EAGLE-3's Llama midlayer has none)."""
    model = TARGETS[target_name][0]
    head = random_draft(model, LAYOUTS[layout], seed=1, std=0.3)
    target = {"target": model} if layout == "mtp-in-target" else {}
    save_draft(head, tmp_path, layout, **target)
    loaded = load_draft(tmp_path, model, LAYOUTS[layout])
    assert attention_windows(loaded) == attention_windows(head)
    left, right = loaded.state_dict(), head.state_dict()
    assert list(left) == list(right) and all(torch.equal(left[k], right[k]) for k in left)


def test_snapshot_restore_of_a_windowed_batch_replays_exactly() -> None:
    """A snapshot of a sampled batch on the windowed target, taken once its requests have
    decoded past the window, restored, replays bit for bit (every page is still held)."""
    engine = windowed_engine("markov", "mtp", (3, 2, 6), page_size=4)
    assert_sampled_snapshot_replays(engine, steps=4, max_new_tokens=24)
