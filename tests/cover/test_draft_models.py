"""Draft heads (EAGLE-1, EAGLE-3, MTP) against a plain dense re-implementation, per layout.

Each case writes a draft checkpoint by hand, key by key, in one published layout (every tensor
random, norms and biases included), next to a tiny random target; ``load_draft`` reads it back
and the head's outputs over the paged cache (a prefill, then single-token steps, batch of two
ragged rows, page sizes 1 and 3) must equal ``reference`` below, which reads the same tensors by
their checkpoint names and attends densely over contiguous K/V.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from heads import PORTABLE_LAYOUTS
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from speculum.models.config import UnsupportedModel
from speculum.models.decoder import DecoderModel
from speculum.models.draft import DraftHead, default_capture_layers, random_draft
from speculum.models.draft_loading import (
    LAYOUTS,
    DraftTargetMismatch,
    load_draft,
    save_draft,
)
from speculum.models.loading import CheckpointError, load_model, random_model, save_model
from speculum.spec.draft import likeliest, top_children
from speculum.spec.paged import extend_batch
from speculum.state.kv import PADDING_PAGE, PagedKV

VOCAB, HIDDEN, LAYERS = 64, 32, 8
EPS, THETA = 1e-5, 10000.0
TOL = {"rtol": 1e-4, "atol": 1e-4}


# ----------------------------------------------------------------------------------------
# Writing checkpoints by hand


@attrs.define(frozen=True)
class Shape:
    """What the reference needs to know about a draft layer."""

    hidden: int = HIDDEN
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    intermediate: int = 48


def layer_config(shape: Shape, **extra: Any) -> dict[str, Any]:
    """A Llama-style ``config.json`` for a one-layer draft."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": 256,
        "torch_dtype": "float32",
        **extra,
    }


def attention_shapes(p: str, shape: Shape, width: int, *, qkv_bias=False, qk_norm=False):
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = {
        f"{p}self_attn.q_proj.weight": (q, width),
        f"{p}self_attn.k_proj.weight": (kv, width),
        f"{p}self_attn.v_proj.weight": (kv, width),
        f"{p}self_attn.o_proj.weight": (shape.hidden, q),
    }
    if qkv_bias:
        out |= {f"{p}self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))}
    if qk_norm:
        out |= {f"{p}self_attn.{n}_norm.weight": (shape.head_dim,) for n in ("q", "k")}
    return out


def mlp_shapes(p: str, shape: Shape) -> dict[str, tuple[int, ...]]:
    h, i = shape.hidden, shape.intermediate
    return {
        f"{p}mlp.gate_proj.weight": (i, h),
        f"{p}mlp.up_proj.weight": (i, h),
        f"{p}mlp.down_proj.weight": (h, i),
    }


def randomise(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Matrices at 1/sqrt(fan_in), norm weights near one, biases near zero, all random."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        if key.endswith("norm.weight"):
            out[key] = 1.0 + 0.3 * noise
        elif key.endswith("bias"):
            out[key] = 0.3 * noise
        else:
            out[key] = noise * shape[-1] ** -0.5
    return out


def vocab_map(draft_vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """``d2t`` and ``t2d`` for a random subset of the target vocabulary, in increasing order."""
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    ids = ids.sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(draft_vocab), "t2d": t2d}


def write(folder: Path, config: dict, tensors: dict[str, torch.Tensor], bin_: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if bin_:
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file(tensors, str(folder / "model.safetensors"))


@attrs.define(frozen=True)
class Case:
    """A checkpoint as written: the algorithm, its tensors and what the reference needs."""

    name: str
    algorithm: str
    tensors: dict[str, torch.Tensor]
    shape: Shape
    prefix: str = ""
    capture: tuple[int, ...] = ()
    num_layers: int = 1
    fc_bias: bool = True
    norm_before_residual: bool = False


def eagle_case(folder: Path, name: str) -> Case:
    """EAGLE reference (two layers, own embedding, .bin) or SGLang (one, q/k/v bias, no fc
    bias, shared embedding)."""
    shape = Shape()
    reference = name == "eagle-reference"
    layers = 2 if reference else 1
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (HIDDEN, 2 * HIDDEN)}
    if reference:
        shapes |= {"fc.bias": (HIDDEN,), "embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= attention_shapes(p, shape, HIDDEN, qkv_bias=not reference)
        shapes |= mlp_shapes(p, shape)
        shapes[f"{p}post_attention_layernorm.weight"] = (HIDDEN,)
        if i > 0:
            shapes[f"{p}input_layernorm.weight"] = (HIDDEN,)
    config = layer_config(shape, num_hidden_layers=layers)
    if not reference:
        config |= {"architectures": ["LlamaForCausalLMEagle"], "bias": False, "qkv_bias": True}
    tensors = randomise(shapes, seed=11)
    write(folder, config, tensors, bin_=reference)
    return Case(name, "eagle", tensors, shape, num_layers=layers, fc_bias=reference)


def eagle3_case(folder: Path, name: str) -> Case:
    """EAGLE reference (.bin, 40-id draft vocabulary, default capture layers), SGLang/SpecForge
    (48-wide draft over a 32-wide target, own embedding, eagle_config ids) or speculators
    (Qwen3 layer with q/k norms, fc bias, norm_before_fc, vLLM-counted ids)."""
    if name == "sglang-eagle3":
        shape, draft_vocab, ids = Shape(hidden=48, head_dim=12), 50, [5, 1, 2]
    else:
        shape, draft_vocab, ids = Shape(), (40 if name == "eagle3-reference" else VOCAB), None
    speculators = name == "speculators-eagle3"
    p = "layers.0." if speculators else "midlayer."
    h = shape.hidden
    shapes = attention_shapes(p, shape, 2 * h, qk_norm=speculators) | mlp_shapes(p, shape)
    shapes |= {f"{p}{n}.weight": (h,) for n in ("input_layernorm", "hidden_norm")}
    shapes |= {
        f"{p}post_attention_layernorm.weight": (h,),
        "fc.weight": (h, 3 * HIDDEN),
        "norm.weight": (h,),
        "lm_head.weight": (draft_vocab, h),
    }
    if name == "sglang-eagle3":
        shapes["embed_tokens.weight"] = (VOCAB, h)
    if speculators:
        shapes |= {"fc.bias": (h,), "input_norm.weight": (3 * HIDDEN,)}
    tensors = randomise(shapes, seed=12) | vocab_map(draft_vocab, seed=13)
    if name == "eagle3-reference":
        config = layer_config(shape, architectures=["LlamaForCausalLMEagle3"])
        config["draft_vocab_size"] = draft_vocab
        capture = (1, 3, 4)
    elif name == "sglang-eagle3":
        config = layer_config(shape, architectures=["LlamaForCausalLMEagle3"])
        config |= {
            "draft_vocab_size": draft_vocab,
            "target_hidden_size": HIDDEN,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        }
        capture = (1, 2, 5)
    else:
        inner = layer_config(shape, model_type="qwen3")
        del inner["architectures"]
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": inner,
            "draft_vocab_size": draft_vocab,
            "norm_before_fc": True,
            "eagle_aux_hidden_state_layer_ids": [6, 2, 3],  # vLLM counts layer inputs
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": None}},
        }
        capture = (1, 2, 5)
    write(folder, config, tensors, bin_=name == "eagle3-reference")
    return Case(
        name,
        "eagle3",
        tensors,
        shape,
        prefix=p,
        capture=capture,
        fc_bias=speculators,
        norm_before_residual=speculators,  # vLLM's default for speculators configs
    )


def mtp_case(folder: Path, name: str, target_folder: Path) -> Case:
    """DeepSeek-V3-style MTP layer inside the target checkpoint (with its own embedding and
    shared head), in a folder of its own, or exported as SGLang does (``model.layers.0``)."""
    shape = Shape(intermediate=64)
    index = 0 if name == "mtp-exported" else LAYERS
    p = f"model.layers.{index}."
    shapes = attention_shapes(p, shape, HIDDEN) | mlp_shapes(p, shape)
    shapes |= {f"{p}{n}.weight": (HIDDEN,) for n in ("enorm", "hnorm", "shared_head.norm")}
    shapes |= {
        f"{p}input_layernorm.weight": (HIDDEN,),
        f"{p}post_attention_layernorm.weight": (HIDDEN,),
        f"{p}eh_proj.weight": (HIDDEN, 2 * HIDDEN),
    }
    if name == "mtp-in-target":
        shapes |= {f"{p}embed_tokens.weight": (VOCAB, HIDDEN)}
        shapes |= {f"{p}shared_head.head.weight": (VOCAB, HIDDEN)}
    tensors = randomise(shapes, seed=14)
    config = json.loads((target_folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    if name == "mtp-exported":
        config["num_hidden_layers"] = 1
    if name == "mtp-in-target":
        write(folder, config, load_file(target_folder / "model.safetensors") | tensors, False)
    else:
        write(folder, config, tensors, False)
    return Case(name, "mtp", tensors, shape, prefix=p)


#: Every layout of a Llama-family target (Qwen3-Next's own: test_qwen3_next_mtp).
CASES = [*PORTABLE_LAYOUTS, "mtp-exported"]


# ----------------------------------------------------------------------------------------
# The plain reference: dense causal attention over contiguous K/V, one sequence at a time


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def linear(w: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    y = x @ w[f"{name}.weight"].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * inv
    cos = torch.cat([angles.cos()] * 2, -1)[:, None]
    sin = torch.cat([angles.sin()] * 2, -1)[:, None]
    first, second = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-second, first], -1) * sin


def attention(w: dict, p: str, shape: Shape, x: torch.Tensor) -> torch.Tensor:
    n, hd = x.shape[0], shape.head_dim
    q = linear(w, f"{p}self_attn.q_proj", x).view(n, shape.heads, hd)
    k = linear(w, f"{p}self_attn.k_proj", x).view(n, shape.kv_heads, hd)
    v = linear(w, f"{p}self_attn.v_proj", x).view(n, shape.kv_heads, hd)
    if f"{p}self_attn.q_norm.weight" in w:
        q, k = rms(q, w[f"{p}self_attn.q_norm.weight"]), rms(k, w[f"{p}self_attn.k_norm.weight"])
    positions = torch.arange(n)
    q, k = rotate(q, positions), rotate(k, positions)
    group = shape.heads // shape.kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
    return linear(w, f"{p}self_attn.o_proj", out)


def mlp(w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = linear(w, f"{p}mlp.gate_proj", x), linear(w, f"{p}mlp.up_proj", x)
    return linear(w, f"{p}mlp.down_proj", F.silu(gate) * up)


def reference(
    case: Case, target: DecoderModel, ids: torch.Tensor, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's output (hidden fed back) and its logits over the target vocabulary."""
    w, p, shape = case.tensors, case.prefix, case.shape
    own = f"{p}embed_tokens.weight" if case.algorithm == "mtp" else "embed_tokens.weight"
    embed = w.get(own, target.model.embed_tokens.weight)[ids]
    head = target.lm_head.weight
    if case.algorithm == "eagle":
        x = linear(w, "fc", torch.cat([embed, hidden], -1))
        for i in range(case.num_layers):
            lp = f"layers.{i}."
            inp = rms(x, w[f"{lp}input_layernorm.weight"]) if i > 0 else x  # layer 0: no norm
            x = x + attention(w, lp, shape, inp)
            x = x + mlp(w, lp, rms(x, w[f"{lp}post_attention_layernorm.weight"]))
        return x, x @ head.T
    if case.algorithm == "eagle3":
        normed = rms(hidden, w[f"{p}hidden_norm.weight"])
        x = torch.cat([rms(embed, w[f"{p}input_layernorm.weight"]), normed], -1)
        x = (normed if case.norm_before_residual else hidden) + attention(w, p, shape, x)
        x = x + mlp(w, p, rms(x, w[f"{p}post_attention_layernorm.weight"]))
        small = rms(x, w["norm.weight"]) @ w["lm_head.weight"].T
        logits = torch.full((x.shape[0], VOCAB), float("-inf"))
        logits[:, torch.arange(small.shape[-1]) + w["d2t"]] = small
        return x, logits
    x = torch.cat([rms(embed, w[f"{p}enorm.weight"]), rms(hidden, w[f"{p}hnorm.weight"])], -1)
    x = x @ w[f"{p}eh_proj.weight"].T
    x = x + attention(w, p, shape, rms(x, w[f"{p}input_layernorm.weight"]))
    x = x + mlp(w, p, rms(x, w[f"{p}post_attention_layernorm.weight"]))
    x = rms(x, w[f"{p}shared_head.norm.weight"])
    return x, x @ w.get(f"{p}shared_head.head.weight", head).T


def reference_features(case: Case, final: torch.Tensor, captured: list[torch.Tensor]):
    """What the draft reads at positions the target fed."""
    if case.algorithm != "eagle3":
        return final
    x = torch.cat(captured, -1)
    if "input_norm.weight" in case.tensors:
        x = rms(x, case.tensors["input_norm.weight"])
    return linear(case.tensors, "fc", x)


# ----------------------------------------------------------------------------------------
# Running a head over the paged cache


def page_table(lengths: list[int], page_size: int, seed: int) -> tuple[torch.Tensor, int]:
    counts = [math.ceil(n / page_size) for n in lengths]
    num_pages = 1 + sum(counts)
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
    order, rows, start = order.tolist(), [], 0
    width = max(counts) + 1
    for count in counts:
        rows.append([*order[start : start + count], *[PADDING_PAGE] * (width - count)])
        start += count
    return torch.tensor(rows), num_pages


def run_paged(
    head: DraftHead,
    ids: list[torch.Tensor],
    hidden: list[torch.Tensor],
    schedule: list[list[int]],
    page_size: int,
) -> list[torch.Tensor]:
    """Feed row ``b``'s tokens in ``schedule[b]`` chunks (a row out of chunks rides along with
    ``q_len`` 0, padded entries hold garbage ids and hidden states)."""
    batch, width = len(ids), hidden[0].shape[-1]
    table, num_pages = page_table([len(r) for r in ids], page_size, seed=page_size)
    pool = head.new_pool(num_pages, page_size)
    seq_lens = torch.zeros(batch, dtype=torch.int64)
    outs: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    for step in range(max(map(len, schedule))):
        q_lens = [s[step] if step < len(s) else 0 for s in schedule]
        q = max(q_lens)
        step_ids = torch.full((batch, q), VOCAB - 1)
        garbage = torch.Generator().manual_seed(step)  # seeded: a failure replays alone
        step_hidden = torch.randn(batch, q, width, generator=garbage) * 100
        for b, n in enumerate(q_lens):
            start = int(seq_lens[b])
            step_ids[b, :n] = ids[b][start : start + n]
            step_hidden[b, :n] = hidden[b][start : start + n]
        kv = PagedKV(page_table=table, seq_lens=seq_lens, page_size=page_size)
        q_lens_t = torch.tensor(q_lens)
        out = head(extend_batch(kv, step_ids, q_lens_t), pool, step_hidden)
        for b, n in enumerate(q_lens):
            outs[b].append(out[b, :n])
        seq_lens = seq_lens + q_lens_t
    return [torch.cat(o) for o in outs]


# ----------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config(num_layers=LAYERS, intermediate_size=64)
    return save_model(random_model(config, seed=5, std=0.3), tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def target(target_folder: Path) -> DecoderModel:
    return load_model(target_folder)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, target_folder: Path) -> dict:
    """Every case written once: name -> (folder, Case)."""
    out = {}
    for name in CASES:
        folder = tmp_path_factory.mktemp(name)
        if name.startswith("mtp"):
            case = mtp_case(folder, name, target_folder)
        elif "eagle3" in name:
            case = eagle3_case(folder, name)
        else:
            case = eagle_case(folder, name)
        out[name] = (folder, case)
    return out


def copy_case(written: dict, name: str, dest: Path) -> Path:
    folder, _ = written[name]
    dest.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


# ----------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("name", CASES)
def test_forward_and_logits_match_reference(
    written: dict, target: DecoderModel, name: str, page_size: int
) -> None:
    """A prefill then single-token steps over the paged cache, two rows of different lengths
    (one idle for the last steps): outputs and logits equal the dense reference."""
    folder, case = written[name]
    head = load_draft(folder, target, case.algorithm)
    assert isinstance(head, DraftHead)
    assert head.algorithm == case.algorithm and head.capture_layers == case.capture
    gen = torch.Generator().manual_seed(7)
    schedule = [[3, 1, 1, 1, 1], [5, 1, 1]]
    lengths = [sum(s) for s in schedule]
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    hidden = [torch.randn(n, case.shape.hidden, generator=gen) for n in lengths]
    with torch.no_grad():
        outs = run_paged(head, ids, hidden, schedule, page_size)
        for row_ids, row_hidden, out in zip(ids, hidden, outs):
            ref_out, ref_logits = reference(case, target, row_ids, row_hidden)
            torch.testing.assert_close(out, ref_out, **TOL)
            logits = head.logits(out)
            assert logits.dtype == torch.float32 and logits.shape == (len(row_ids), VOCAB)
            assert torch.equal(logits.isinf(), ref_logits.isinf())
            finite = ~ref_logits.isinf()
            torch.testing.assert_close(logits[finite], ref_logits[finite], **TOL)


@pytest.mark.parametrize("name", CASES)
def test_target_features_from_a_real_target_forward(
    written: dict, target: DecoderModel, name: str
) -> None:
    """The draft's first-step input comes from the target run with the head's capture layers
    (EAGLE-3: fc over the captured layers, ascending; EAGLE-1 and MTP: the final hidden)."""
    folder, case = written[name]
    head = load_draft(folder, target, case.algorithm)
    prompt = torch.tensor([[3, 14, 15, 9, 2, 6]])
    kv = PagedKV(page_table=torch.tensor([[1, 2]]), seq_lens=torch.tensor([0]), page_size=4)
    with torch.no_grad():
        final, captured = target(
            extend_batch(kv, prompt, torch.tensor([6])),
            target.new_pool(3, 4),
            head.capture_layers,
        )
        features = head.target_features(final, captured)
    assert len(captured) == len(case.capture)
    expected = reference_features(case, final[0], [c[0] for c in captured])
    torch.testing.assert_close(features[0], expected, **TOL)


def test_eagle3_logits_live_in_the_draft_vocabulary(written: dict, target: DecoderModel):
    """Target ids outside the draft vocabulary get -inf; draft id i lands on i + d2t[i]."""
    folder, case = written["eagle3-reference"]
    head = load_draft(folder, target, "eagle3")
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, small = head.logits(hidden), head.draft_logits(hidden)
    ids = torch.arange(40) + case.tensors["d2t"]
    assert torch.equal(logits[:, ids], small)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert bool(logits[:, outside].isneginf().all()) and int(outside.sum()) == VOCAB - 40


def test_default_capture_layers() -> None:
    """(1, L//2 - 1, L - 4): the outputs of the layers SGLang and vLLM capture by default."""
    assert default_capture_layers(8) == (1, 3, 4)
    assert default_capture_layers(32) == (1, 15, 28)
    assert default_capture_layers(61) == (1, 29, 57)
    with pytest.raises(UnsupportedModel, match="not three distinct layers"):
        default_capture_layers(4)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "mtp"])
def test_mismatched_target_is_named(
    written: dict, algorithm: str, tmp_path: Path, target: DecoderModel
) -> None:
    """A draft of another target: the error says which numbers disagree."""
    name = {"eagle": "sglang-eagle", "eagle3": "eagle3-reference", "mtp": "mtp"}[algorithm]
    folder, _ = written[name]
    wider = random_model(tiny_config(num_layers=LAYERS, hidden_size=48, head_dim=12))
    with pytest.raises(DraftTargetMismatch, match=r"different target.*hidden size.*32.*48"):
        load_draft(folder, wider, algorithm)
    bigger = random_model(tiny_config(num_layers=LAYERS, vocab_size=80))
    with pytest.raises(DraftTargetMismatch, match=r"different target.*draft 64 ids vs target 80"):
        load_draft(folder, bigger, algorithm)
    if algorithm == "eagle3":
        shallow = random_model(tiny_config(num_layers=4))
        with pytest.raises(DraftTargetMismatch, match=r"layer 5 but the target has 4 layers"):
            load_draft(written["sglang-eagle3"][0], shallow, algorithm)


def edit_weights(folder: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite the folder's weights file after ``edit`` changed its tensors in place."""
    path = folder / "pytorch_model.bin"
    if path.exists():
        tensors = torch.load(path, weights_only=True)
        edit(tensors)
        torch.save(tensors, path)
    else:
        path = folder / "model.safetensors"
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, str(path))


#: per case: (a required key to remove, a key to transpose into the wrong shape).
STRICT = {
    "eagle-reference": ("layers.1.input_layernorm.weight", "fc.weight"),
    "sglang-eagle": ("layers.0.self_attn.q_proj.bias", "fc.weight"),
    "eagle3-reference": ("midlayer.hidden_norm.weight", "fc.weight"),
    "sglang-eagle3": ("embed_tokens.weight", "midlayer.self_attn.q_proj.weight"),
    "speculators-eagle3": ("layers.0.self_attn.k_norm.weight", "fc.weight"),
    "mtp-in-target": ("model.layers.8.shared_head.norm.weight", "model.layers.8.eh_proj.weight"),
    "mtp": ("model.layers.8.mlp.down_proj.weight", "model.layers.8.eh_proj.weight"),
    "mtp-exported": ("model.layers.0.enorm.weight", "model.layers.0.eh_proj.weight"),
}


@pytest.mark.parametrize("name", CASES)
def test_loading_is_strict(written: dict, tmp_path: Path, target, name: str) -> None:
    """A removed, an extra or a mis-shaped tensor is refused, naming it."""
    removed, reshaped = STRICT[name]
    _, case = written[name]
    prefix = case.prefix if case.algorithm == "mtp" else ""
    extra = f"{prefix}rotary_scale"

    folder = copy_case(written, name, tmp_path / "removed")
    edit_weights(folder, lambda t: t.pop(removed))
    with pytest.raises(CheckpointError, match=rf"missing weights \['{removed}'\]"):
        load_draft(folder, target, case.algorithm)

    folder = copy_case(written, name, tmp_path / "extra")
    edit_weights(folder, lambda t: t.update({extra: torch.ones(3)}))
    with pytest.raises(CheckpointError, match=rf"unexpected weights \['{extra}'\]"):
        load_draft(folder, target, case.algorithm)

    folder = copy_case(written, name, tmp_path / "reshaped")
    edit_weights(folder, lambda t: t.update({reshaped: t[reshaped].T.contiguous()}))
    with pytest.raises(CheckpointError, match=rf"shapes disagree.*'{reshaped}: checkpoint"):
        load_draft(folder, target, case.algorithm)


def test_eagle1_first_layer_norm_is_refused(written: dict, tmp_path: Path, target) -> None:
    """EAGLE-1's first layer has no input norm; a checkpoint with one is another model."""
    folder = copy_case(written, "sglang-eagle", tmp_path / "d")
    edit_weights(folder, lambda t: t.update({"layers.0.input_layernorm.weight": torch.ones(32)}))
    with pytest.raises(CheckpointError, match=r"layers\.0\.input_layernorm.*skips"):
        load_draft(folder, target, "eagle")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update({"d2t": t["d2t"][:-1]}), r"d2t has shape \(39,\).*40 ids"),
        (lambda t: t.update({"t2d": t["t2d"][:-1]}), r"t2d has shape \(63,\).*64 ids"),
        (lambda t: t.pop("d2t"), r"missing weights \['d2t'\].*40 ids"),
        (lambda t: t.update({"d2t": t["d2t"] + 100}), r"outside the target vocabulary"),
        (lambda t: t.update({"t2d": ~t["t2d"]}), r"t2d and d2t disagree"),
    ],
    ids=["d2t size", "t2d size", "d2t missing", "d2t range", "t2d disagrees"],
)
def test_bad_vocabulary_map(written, tmp_path, target, edit: Callable, message: str) -> None:
    """d2t / t2d of the wrong size, out of range, missing or inconsistent."""
    folder = copy_case(written, "eagle3-reference", tmp_path / "d")
    edit_weights(folder, edit)
    with pytest.raises(CheckpointError, match=message):
        load_draft(folder, target, "eagle3")


def test_layout_and_algorithm_errors(written, tmp_path, target, target_folder) -> None:
    """The wrong algorithm for a layout, an unknown layout, a target without MTP layers."""
    with pytest.raises(CheckpointError, match=r"'eagle3' \(sglang-eagle3 layout\), not 'eagle'"):
        load_draft(written["sglang-eagle3"][0], target, "eagle")
    folder = copy_case(written, "sglang-eagle", tmp_path / "d")
    edit_weights(folder, lambda t: t.update({"head.weight": t.pop("fc.weight")}))
    with pytest.raises(CheckpointError, match="unknown draft layout"):
        load_draft(folder, target, "eagle")
    with pytest.raises(CheckpointError, match=r"no MTP layers"):
        load_draft(target_folder, target, "mtp")


def test_target_with_mtp_layers_loads_as_the_target(written: dict, target_folder: Path):
    """load_model tolerates model.layers.{L}.* when config.json declares
    num_nextn_predict_layers; the target's logits do not change."""
    plain = load_model(target_folder)
    with_mtp = load_model(written["mtp-in-target"][0])
    assert with_mtp.config.num_nextn_predict_layers == 1
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    kv = PagedKV(page_table=torch.tensor([[1, 2]]), seq_lens=torch.tensor([0]), page_size=4)
    batch = extend_batch(kv, prompt, torch.tensor([5]))
    with torch.no_grad():
        a = plain.logits(plain(batch, plain.new_pool(3, 4))[0])
        b = with_mtp.logits(with_mtp(batch, with_mtp.new_pool(3, 4))[0])
    assert torch.equal(a, b)
    config = json.loads((written["mtp-in-target"][0] / "config.json").read_text())
    del config["num_nextn_predict_layers"]
    undeclared = written["mtp-in-target"][0].parent / "undeclared"
    copy_case(written, "mtp-in-target", undeclared)
    (undeclared / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected weights \['model\.layers\.8\."):
        load_model(undeclared)


@pytest.mark.parametrize("name", CASES)
def test_save_draft_round_trips(written: dict, tmp_path: Path, target, name: str) -> None:
    """Every head saved in every layout of its algorithm loads back with identical weights
    and outputs."""
    folder, case = written[name]
    head = load_draft(folder, target, case.algorithm)
    batch = extend_batch(
        PagedKV(page_table=torch.tensor([[1, 2]]), seq_lens=torch.tensor([0]), page_size=4),
        torch.tensor([[5, 6, 7]]),
        torch.tensor([3]),
    )
    hidden = torch.randn(1, 3, case.shape.hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = head.logits(head(batch, head.new_pool(3, 4), hidden))
    for layout in (k for k in PORTABLE_LAYOUTS if LAYOUTS[k] == case.algorithm):
        out = save_draft(head, tmp_path / layout, layout, target=target)
        again = load_draft(out, target, case.algorithm)
        assert again.config.capture_layers == head.config.capture_layers
        a, b = dict(head.named_parameters()), dict(again.named_parameters())
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        with torch.no_grad():
            got = again.logits(again(batch, again.new_pool(3, 4), hidden))
        assert torch.equal(got, expected), layout


def test_save_draft_refuses_what_a_layout_cannot_hold(tmp_path: Path, target) -> None:
    """An SGLang EAGLE-3 midlayer has no q/k/v bias; the writer says so instead of writing a
    checkpoint that would load as something else."""
    head = random_draft(target, "eagle3")
    biased = attrs.evolve(head.config.layer, qkv_bias=True)
    head = random_draft(target, "eagle3", layer=biased)
    with pytest.raises(ValueError, match="cannot express"):
        save_draft(head, tmp_path, "sglang-eagle3")
    save_draft(head, tmp_path / "ok", "speculators-eagle3")
    with pytest.raises(ValueError, match="writes the target too"):
        save_draft(random_draft(target, "mtp"), tmp_path / "m", "mtp-in-target")


def test_random_draft_runs(target: DecoderModel) -> None:
    """random_draft builds a working head of each kind on the target's device and dtype."""
    for algorithm in ("eagle", "eagle3", "mtp", "nextn", "eagle2"):
        head = random_draft(target, algorithm, seed=1)
        batch = extend_batch(
            PagedKV(page_table=torch.tensor([[1]]), seq_lens=torch.tensor([0]), page_size=4),
            torch.tensor([[1, 2]]),
            torch.tensor([2]),
        )
        with torch.no_grad():
            hidden = torch.randn(1, 2, HIDDEN, generator=torch.Generator().manual_seed(0))
            out = head(batch, head.new_pool(2, 4), hidden)
        assert out.shape == (1, 2, HIDDEN) and head.logits(out).isfinite().all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), topk=st.integers(1, 6), rows=st.integers(1, 3))
def test_reduced_vocabulary_heads_rank_over_their_own_ids(target, seed, topk, rows):
    """An EAGLE-3 head with a reduced vocabulary ranks its children over its own ids and
    returns target ids: the same tokens and probabilities as ranking the full-vocabulary
    distribution it stands for."""
    gen = torch.Generator().manual_seed(seed)
    draft_vocab = 24
    head = random_draft(target, "eagle3", seed=seed, std=0.3, draft_vocab_size=draft_vocab)
    ids = torch.randperm(target.config.vocab_size, generator=gen)[:draft_vocab].sort().values
    head.set_target_ids(ids)
    hidden = torch.randn(rows, 2, head.config.hidden_size, generator=gen)
    probs, tokens = top_children(head, hidden, topk)
    full = torch.softmax(head.logits(hidden), dim=-1).topk(topk, dim=-1)
    assert torch.equal(tokens, full.indices)
    torch.testing.assert_close(probs, full.values)
    assert bool(torch.isin(tokens, ids).all())


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0]), min_size=1, max_size=12),
    rows=st.integers(1, 3),
    k=st.integers(1, 4),
)
def test_likeliest_ranks_as_topk_and_a_chain_breaks_ties_to_the_lowest_id(values, rows, k):
    """``likeliest`` gives ``torch.topk``'s values (largest first) for every ``k``, ids holding
    those values; for one child (a chain's max reduction) the id is the lowest of the row's
    largest entries, whatever the device (topk leaves the order of ties unspecified)."""
    probs = torch.tensor(values).roll(1).expand(rows, -1) * torch.arange(1, rows + 1)[:, None]
    k = min(k, probs.shape[-1])
    top, ids = likeliest(probs, k)
    assert torch.equal(top, probs.topk(k, dim=-1).values)
    assert torch.equal(probs.gather(-1, ids), top)
    if k == 1:
        lowest = (probs == probs.max(dim=-1, keepdim=True).values).int().argmax(dim=-1)
        assert torch.equal(ids[:, 0], lowest)
