"""Qwen3-Next's MTP layer as a draft (``--algorithm mtp``): read strictly from the ``mtp.*``
weights hub checkpoints ship beside the target's (which transformers ignores), computing what
SGLang's ``qwen3_next_mtp.py`` computes, and chains and trees of it equal plain greedy
decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_qwen3_next import TARGET, hf_qwen3_next

from speculum.models.config import CheckpointError, UnsupportedModel
from speculum.models.draft import MTPHead
from speculum.models.draft_loading import load_draft, save_draft, save_random_draft
from speculum.models.loading import load_model
from speculum.models.multi_layer_eagle import (
    load_multi_layer,
    random_multi_layer,
    save_multi_layer,
)
from speculum.runtime.engine import SpecOptions, build_engine
from speculum.runtime.generate import generate
from speculum.spec.paged import extend_batch
from speculum.state.kv import PagedKV

#: The MTP weights outside its decoder layer, as Qwen3-Next checkpoints name them (SGLang's
#: ``Qwen3NextForCausalLMMTP.load_weights`` and vLLM's ``Qwen3NextMultiTokenPredictor``).
OUTER = ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")
FULL_ATTENTION_LAYER = "model.layers.1."  # the tiny target's layers: linear, full, linear, full


def mtp_tensors(target: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """Random MTP weights by their hub names: ``mtp.layers.0.*`` has the key set and shapes of
    one of the target's full-attention layers (gated attention, the sparse MLP with its shared
    expert, experts one by one), plus ``mtp.fc``, the two pre-fc norms and ``mtp.norm``."""
    gen = torch.Generator().manual_seed(11)
    shapes = {
        "mtp.layers.0." + key.removeprefix(FULL_ATTENTION_LAYER): value.shape
        for key, value in target.items()
        if key.startswith(FULL_ATTENTION_LAYER)
    }
    shapes |= {OUTER[0]: (hidden, 2 * hidden), OUTER[1]: (hidden,), OUTER[2]: (hidden,)}
    shapes["mtp.norm.weight"] = (hidden,)
    return {
        key: torch.randn(shape, generator=gen) * (shape[-1] ** -0.5 if len(shape) > 1 else 0.3)
        for key, shape in shapes.items()
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    """transformers' Qwen3-Next folder with MTP weights added to its safetensors (and
    ``mtp_num_hidden_layers: 1`` in its config, as released configs say)."""
    hf = hf_qwen3_next()
    folder = tmp_path_factory.mktemp("qwen3_next_mtp")
    hf.save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors |= mtp_tensors(tensors, hf.config.hidden_size)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = (folder / "config.json").read_text().replace("{", '{"mtp_num_hidden_layers": 1,', 1)
    (folder / "config.json").write_text(config)
    return hf, folder


def reference_mtp(folder: Path, tmp: Path, hf: transformers.PreTrainedModel):
    """SGLang's structure built from transformers' own classes: the MTP weights renamed as
    SGLang renames them (``mtp.layers`` -> ``model.layers``, ``mtp.norm`` -> ``model.norm``)
    into a one-layer full-attention ``Qwen3NextForCausalLM``, whose ``model(inputs_embeds=)``
    runs the layer and the final norm; plus ``mtp.fc`` and the zero-centred pre-fc norms."""
    found = load_file(str(folder / "model.safetensors"))
    renamed = {k.replace("mtp.", "model.", 1): v for k, v in found.items() if k.startswith("mtp.")}
    renamed["model.embed_tokens.weight"] = found["model.embed_tokens.weight"]
    renamed["lm_head.weight"] = found["lm_head.weight"]
    for key in OUTER:
        del renamed[key.replace("mtp.", "model.", 1)]
    config = hf.config.to_dict() | {"num_hidden_layers": 1, "layer_types": ["full_attention"]}
    transformers.Qwen3NextConfig(**config).save_pretrained(tmp)
    save_file(renamed, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    layer = transformers.Qwen3NextForCausalLM.from_pretrained(tmp).eval()

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = hf.config.rms_norm_eps
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)

    def run(tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embeds = layer.model.embed_tokens(tokens)
        pair = torch.cat([norm(embeds, found[OUTER[1]]), norm(hidden, found[OUTER[2]])], dim=-1)
        x = pair @ found[OUTER[0]].T
        return layer.model(inputs_embeds=x).last_hidden_state

    return run


def test_the_hub_mtp_layer_loads_strictly_and_computes_sglangs_forward(
    checkpoint, tmp_path: Path
) -> None:
    """``load_draft(folder, target, "mtp")`` finds the ``mtp.*`` layer and its forward over a
    prompt (token ``i + 1`` with the target's hidden state of token ``i``) equals SGLang's
    structure built from transformers' own layer."""
    hf, folder = checkpoint
    target = load_model(folder)
    head = load_draft(folder, target, "mtp")
    assert isinstance(head, MTPHead) and not head.config.own_head
    tokens = torch.tensor([[3, 17, 42, 5, 9, 9, 1, 30]])
    with torch.no_grad():
        hidden = hf.model(tokens).last_hidden_state
        expected = reference_mtp(folder, tmp_path, hf)(tokens[:, 1:], hidden[:, :-1])
        kv = PagedKV(
            page_table=torch.tensor([[1, 2]]),
            seq_lens=torch.tensor([0]),
            page_size=8,
            state_slots=torch.tensor([0]),
        )
        batch = extend_batch(kv, tokens[:, 1:], torch.tensor([tokens.shape[1] - 1]))
        ours = head(batch, head.new_pool(4, 8), hidden[:, :-1])
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "spec",
    [
        SpecOptions(num_steps=3),
        SpecOptions(num_steps=3, topk=2, num_draft_tokens=6),
        SpecOptions(adaptive_steps=(0, 1, 3)),
    ],
    ids=["chain", "tree", "adaptive"],
)
def test_mtp_decoding_equals_plain_greedy(checkpoint, spec) -> None:
    """The target folder alone (the MTP layer inside it) drives ``--algorithm mtp``: chains,
    trees and adaptive depths emit plain greedy decoding's tokens."""
    _, folder = checkpoint
    prompts = [[3, 17, 42, 5], [9] * 11, [1, 2]]
    limits = {"page_size": 4, "max_context": 64}
    plain = generate(prompts, engine=build_engine(folder, **limits), max_new_tokens=14)
    engine = build_engine(folder, algorithm="mtp", spec=spec, **limits)
    ours = generate(prompts, engine=engine, max_new_tokens=14)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]


def test_saving_writes_the_hub_layout_back(checkpoint, tmp_path: Path) -> None:
    """``save_draft(head, folder, "qwen3-next-mtp", target=...)`` writes the target with the
    MTP layer under the hub's names, which both loaders read back to equal weights; the
    DeepSeek layouts refuse a Qwen3-Next MTP layer."""
    _, folder = checkpoint
    target = load_model(folder)
    head = load_draft(folder, target, "mtp")
    out = save_draft(head, tmp_path / "out", "qwen3-next-mtp", target=target)
    assert load_file(str(out / "model.safetensors")).keys() == (
        load_file(str(folder / "model.safetensors")).keys()
    )
    again = load_draft(out, load_model(out), "mtp")
    a, b = dict(head.named_parameters()), dict(again.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="cannot express an MTP layer of Qwen3NextForCausalLM"):
        save_draft(head, tmp_path / "deepseek", "mtp-in-target", target=target)
    random = save_random_draft(target, "mtp", tmp_path / "random", seed=3)
    assert isinstance(load_draft(random, load_model(random), "mtp"), MTPHead)


def rewritten(folder: Path, tmp: Path, change) -> Path:
    """A copy of ``folder`` whose tensors went through ``change`` (a dict, changed in place)."""
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text((folder / "config.json").read_text())
    return tmp


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop("mtp.norm.weight"), r"missing weights \['mtp.norm.weight'\]"),
        (
            lambda t: t.pop("mtp.layers.0.mlp.experts.2.up_proj.weight"),
            "mtp.layers.0.mlp.experts.2.up_proj.weight",
        ),
        (
            lambda t: t.update({"mtp.layers.0.mlp.stray.weight": torch.zeros(2)}),
            r"unexpected weights \['mtp.layers.0.mlp.stray.weight'\]",
        ),
    ],
    ids=["missing norm", "missing expert", "unexpected"],
)
def test_a_missing_or_unexpected_mtp_key_is_refused(checkpoint, tmp_path, change, message):
    """Loading the MTP layer is strict: a missing or an unexpected ``mtp.*`` key is named."""
    _, folder = checkpoint
    bad = rewritten(folder, tmp_path, change)
    target = load_model(bad)  # the target itself ignores mtp.* (as transformers does)
    with pytest.raises(CheckpointError, match=message):
        load_draft(bad, target, "mtp")


def test_two_mtp_layers_are_refused_and_a_folder_without_them_says_so(checkpoint, tmp_path):
    """speculum runs one MTP layer: a second ``mtp.layers.1`` is refused naming both; a
    Qwen3-Next folder without ``mtp.*`` weights says which keys it looked for."""
    _, folder = checkpoint

    def second(tensors: dict[str, torch.Tensor]) -> None:
        tensors |= {
            k.replace("layers.0.", "layers.1."): v.clone()
            for k, v in tensors.items()
            if k.startswith("mtp.layers.0.")
        }

    (tmp_path / "two").mkdir()
    two = rewritten(folder, tmp_path / "two", second)
    with pytest.raises(UnsupportedModel, match=r"MTP layers \[0, 1\]"):
        load_draft(two, load_model(two), "mtp")
    (tmp_path / "none").mkdir()
    none = rewritten(
        folder,
        tmp_path / "none",
        lambda t: [t.pop(k) for k in [k for k in t if k.startswith("mtp.")]],
    )
    with pytest.raises(CheckpointError, match="mtp.fc.weight"):
        load_draft(none, load_model(none), "mtp")


def test_multi_layer_heads_over_qwen3_next_round_trip(tmp_path: Path) -> None:
    """Multi-layer EAGLE heads over a Qwen3-Next target (gated full-attention MoE layers) save
    in the DeepSeek-style multi-layer form, inside the target's folder or on their own, and
    load back to equal weights."""
    head = random_multi_layer(TARGET, 2, seed=1)
    inside = save_multi_layer(head, tmp_path / "inside", target=TARGET)
    alone = save_multi_layer(head, tmp_path / "alone")
    ours = dict(head.named_parameters())
    for again in (load_multi_layer(inside, load_model(inside)), load_multi_layer(alone, TARGET)):
        theirs = dict(again.named_parameters())
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
