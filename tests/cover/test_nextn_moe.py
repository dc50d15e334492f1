"""DeepSeek-style NextN / MTP layers of a mixture-of-experts target's own kind, stored in the
target's folder (``model.layers.{L + i}``, experts one by one as the target stores its own):
built as the target builds layer ``L + i``, loaded strictly, written back exactly, and decoding
(``--algorithm nextn`` on the target folder: chains reusing the one layer, trees, multi-layer
EAGLE over two MoE MTP layers, seeded sampling) equal to plain decoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import attrs
import pytest
from conftest import tiny_config
from heads import agreeing_head, agreeing_multi_layer, markov_target
from safetensors.torch import load_file
from test_eagle_stats import CHUNK, SEEDS, exact_joint, joint_stats, lossless, sample_tokens
from test_models import edit_weights

from speculum.models.config import CheckpointError, DecoderConfig, MoEConfig
from speculum.models.decoder import SparseMoE
from speculum.models.draft import random_draft
from speculum.models.draft_loading import load_draft, save_draft
from speculum.models.loading import load_model, random_model
from speculum.models.multi_layer_eagle import (
    load_multi_layer,
    random_multi_layer,
    save_multi_layer,
)
from speculum.runtime.engine import SpecOptions, build_engine, engine_from_model
from speculum.runtime.generate import acceptance_stats, generate

VOCAB = 16
QWEN3_MOE = MoEConfig(
    num_experts=4, top_k=2, expert_intermediate_size=24, norm_topk_prob=True, dense_layers=(1,)
)
#: family -> config fields of a 4-layer Markov target (``heads.markov_target``); each rule
#: makes layers 4 and 5, the MTP layers, sparse.
FAMILIES = {
    "qwen3-moe": {"architecture": "Qwen3MoeForCausalLM", "qk_norm": True, "moe": QWEN3_MOE},
    "qwen2-moe": {
        "architecture": "Qwen2MoeForCausalLM",
        "qkv_bias": True,
        "moe": attrs.evolve(
            QWEN3_MOE, norm_topk_prob=False, shared_expert_intermediate_size=40, dense_layers=(2,)
        ),
    },
}
TARGET_LAYERS = 4


class Written(NamedTuple):
    """A family's target folder with one MTP layer, and with two."""

    family: str
    mtp: Path
    multi: Path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def written(request, tmp_path_factory) -> Written:
    """The family's Markov target saved with MTP layers that agree with it (one, and two)."""
    target = markov_target(VOCAB, **FAMILIES[request.param])
    root = tmp_path_factory.mktemp(request.param)
    mtp = save_draft(agreeing_head(target, "mtp"), root / "mtp", "mtp-in-target", target=target)
    multi = save_multi_layer(agreeing_multi_layer(target, 2), root / "multi", target=target)
    return Written(request.param, mtp, multi)


def test_mtp_layers_are_the_targets_layers_after_its_own(written: Written) -> None:
    """Each MTP layer is an MoE layer of the target's routing (Qwen2-MoE's shared expert
    too), its K/V in its own layer of the draft's pool: one layer for MTP (reused by every
    chain step), two for two-layer EAGLE."""
    target = load_model(written.mtp)
    head = load_draft(written.mtp, target, "mtp")
    multi = load_multi_layer(written.multi, target)
    reference = target.model.layers[0].mlp
    layers = [head.decoder, *(layer.decoder for layer in multi.layers)]
    for layer in layers:
        assert isinstance(layer.mlp, SparseMoE)
        assert layer.mlp.num_experts == reference.num_experts == 4
        assert layer.mlp.moe == reference.moe
        assert (layer.mlp.shared_expert is None) == (written.family == "qwen3-moe")
    assert [layer.self_attn.layer for layer in layers] == [0, 0, 1]
    assert head.new_pool(3, 4).k.shape[0] == 1 and multi.new_pool(3, 4).k.shape[0] == 2


@pytest.mark.parametrize(
    ("changes", "sparse"),
    [
        ({}, [True, True]),
        ({"dense_layers": (2,)}, [False, True]),
        ({"sparse_step": 2}, [False, True]),
    ],
    ids=["every layer sparse", "mlp_only_layers names layer L", "decoder_sparse_step 2"],
)
def test_an_mtp_layers_kind_is_the_targets_rule_at_its_index(
    changes: dict, sparse: list[bool], tmp_path: Path
) -> None:
    """Over a 2-layer Qwen3-MoE target, MTP layers 2 and 3 are sparse exactly where the
    target's rule says layers 2 and 3 are (``mlp_only_layers`` may name them); the kinds
    survive the target's config.json."""
    target = random_model(
        tiny_config(
            architecture="Qwen3MoeForCausalLM",
            qk_norm=True,
            moe=attrs.evolve(QWEN3_MOE, **{"dense_layers": (), **changes}),
        )
    )
    head = random_multi_layer(target, 2, seed=1)
    assert [isinstance(layer.decoder.mlp, SparseMoE) for layer in head.layers] == sparse
    assert isinstance(random_draft(target, "mtp").decoder.mlp, SparseMoE) == sparse[0]
    folder = save_multi_layer(head, tmp_path, target=target)
    loaded = load_multi_layer(folder, load_model(folder))
    assert [isinstance(layer.decoder.mlp, SparseMoE) for layer in loaded.layers] == sparse


def test_mlp_only_layers_may_name_mtp_layers_too() -> None:
    """``mlp_only_layers`` names decoder layers and, when the file declares them, MTP layers;
    an index past both is refused, naming the range."""
    raw = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, moe=QWEN3_MOE).to_dict()
    raw |= {"num_nextn_predict_layers": 1, "mlp_only_layers": [2]}
    assert DecoderConfig.from_dict(raw).moe.dense_layers == (2,)
    message = r"mlp_only_layers is \[3\].*0 \.\. 2 \(num_hidden_layers 2 plus num_nextn_pre"
    with pytest.raises(CheckpointError, match=message):
        DecoderConfig.from_dict({**raw, "mlp_only_layers": [3]})


#: head kind -> (its folder in :class:`Written`, its loader, the index of its last MTP layer)
LOADERS = {
    "mtp": ("mtp", lambda folder, target: load_draft(folder, target, "mtp"), TARGET_LAYERS),
    "multi_layer_eagle": ("multi", load_multi_layer, TARGET_LAYERS + 1),
}


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_missing_or_extra_expert_of_an_mtp_layer_is_named(
    written: Written, kind: str, tmp_path: Path
) -> None:
    """The MTP layers' per-expert keys are checked strictly, each missing or unexpected one
    named; the target loads from the same folder regardless (it ignores its MTP layers)."""
    field, load, layer = LOADERS[kind]
    folder = Path(shutil.copytree(getattr(written, field), tmp_path / "copy"))
    tensors = load_file(folder / "model.safetensors")
    gone = f"model.layers.{layer}.mlp.experts.3.down_proj.weight"
    edit_weights(folder, lambda t: t.pop(gone))
    target = load_model(folder)
    with pytest.raises(CheckpointError, match=rf"missing weights \['{gone}'\]"):
        load(folder, target)
    extra = gone.replace(".experts.3.", ".experts.4.")
    edit_weights(folder, lambda t: t.update({gone: tensors[gone], extra: tensors[gone].clone()}))
    with pytest.raises(CheckpointError, match=rf"unexpected weights \['{extra}'\]"):
        load(folder, target)


def test_the_released_duplicate_embedding_is_accepted_and_shared(
    written: Written, tmp_path: Path
) -> None:
    """DeepSeek's released MTP layer stores a copy of the target's embedding
    (``model.layers.{L}.embed_tokens.weight``): accepted (not required), the head then reads
    the target's own embedding, and its weights are those loaded without the copy."""
    folder = Path(shutil.copytree(written.mtp, tmp_path / "copy"))
    key = f"model.layers.{TARGET_LAYERS}.embed_tokens.weight"
    edit_weights(folder, lambda t: t.update({key: t["model.embed_tokens.weight"].clone()}))
    target = load_model(folder)
    head = load_draft(folder, target, "mtp")
    assert head.embedding is target.model.embed_tokens and not head.config.own_embedding
    without = dict(load_draft(written.mtp, target, "mtp").named_parameters())
    params = dict(head.named_parameters())
    assert params.keys() == without.keys()
    assert all(params[name].equal(without[name]) for name in params)


def test_the_target_folder_round_trips_with_its_mtp_layers(
    written: Written, tmp_path: Path
) -> None:
    """Target and MTP layers loaded from the folder and saved back write the same keys, the
    same tensors and the same config.json."""
    target = load_model(written.mtp)
    head = load_draft(written.mtp, target, "mtp")
    saved = [
        (written.mtp, save_draft(head, tmp_path / "mtp", "mtp-in-target", target=target)),
        (
            written.multi,
            save_multi_layer(
                load_multi_layer(written.multi, target), tmp_path / "multi", target=target
            ),
        ),
    ]
    for original, again in saved:
        theirs, ours = (load_file(f / "model.safetensors") for f in (original, again))
        assert sorted(ours) == sorted(theirs)
        assert all(ours[key].equal(theirs[key]) for key in theirs)
        config = [json.loads((f / "config.json").read_text()) for f in (original, again)]
        assert config[0] == config[1]


PROMPTS = [[1, 2, 3], [9, 9, 9, 1, 4], [15], [7, 0, 5, 2, 11, 3, 8]]
LIMITS = {"page_size": 4, "max_context": 48, "prefill_budget": 5}
SPECS = {
    "chain 1": {"num_steps": 1},
    "chain 3": {"num_steps": 3},
    "tree": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6},
}


@pytest.fixture(scope="module")
def plain(written: Written) -> list[list[int]]:
    """Plain greedy tokens of the target loaded from its folder."""
    results = generate(PROMPTS, engine=build_engine(written.mtp, **LIMITS), max_new_tokens=16)
    return [r.token_ids for r in results]


def assert_accepts_drafts(results, deep: bool) -> None:
    """Every request's rounds accept drafts (equality with plain decoding is only strong
    then), and with several draft steps some request accepts paths two drafts deep."""
    lengths = [r.stats["accept_length_mean"] for r in results]
    assert min(lengths) > 1.2, lengths
    assert not deep or max(lengths) > 2.5, lengths


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_nextn_on_the_target_folder_equals_plain_greedy(written, plain, spec: str) -> None:
    """``--algorithm nextn`` with the target's folder (the draft defaults to it): chains of 1
    and 3 steps over the one MTP layer, and a tree, emit plain decoding's tokens, accepting
    drafts."""
    engine = build_engine(written.mtp, algorithm="nextn", spec=SpecOptions(**SPECS[spec]), **LIMITS)
    results = generate(PROMPTS, engine=engine, max_new_tokens=16)
    assert [r.token_ids for r in results] == plain
    assert_accepts_drafts(results, deep=SPECS[spec]["num_steps"] > 1)


def test_multi_layer_eagle_over_two_moe_mtp_layers_equals_plain_greedy(written, plain) -> None:
    """Two MoE MTP layers from the target's folder, one per draft depth."""
    engine = build_engine(
        written.multi, algorithm="multi_layer_eagle", spec=SpecOptions(num_steps=2), **LIMITS
    )
    results = generate(PROMPTS, engine=engine, max_new_tokens=16)
    assert [r.token_ids for r in results] == plain
    assert_accepts_drafts(results, deep=True)


def test_seeded_mtp_chains_from_the_folder_follow_the_target_law(tmp_path: Path) -> None:
    """Sampling is lossless with an MoE MTP layer loaded from a Qwen3-MoE target's folder:
    the first two tokens that 3-step chains emit at temperature 1, over many seeds, follow the
    law enumerated from the target's own next-token distributions (``test_eagle_stats``'s
    check), with rounds accepting drafts."""
    vocab = 6  # test_eagle_stats enumerates joints over its VOCAB, also 6
    written = markov_target(vocab, head_scale=0.25, **FAMILIES["qwen3-moe"])
    folder = save_draft(agreeing_head(written, "mtp"), tmp_path, "mtp-in-target", target=written)
    target = load_model(folder)
    prompt = [3, 1, 4]
    engine = engine_from_model(
        target,
        algorithm="mtp",
        draft=load_draft(folder, target, "mtp"),
        spec=SpecOptions(num_steps=3),
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
