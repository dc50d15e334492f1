"""The decoder against transformers on tiny random checkpoints, strict loading, and the tokenizer.

transformers initialises biases to zero and norm weights to one, which would let a forgotten
bias or a misplaced norm pass unnoticed; every parameter is randomised before saving.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from speculum.models.config import UnsupportedModel
from speculum.models.decoder import DecoderModel, dense_batch, float32_logits, fuse_projections_
from speculum.models.draft import random_draft
from speculum.models.loading import CheckpointError, load_model, random_model, save_model
from speculum.models.tokenizer import (
    BOS,
    EOS,
    byte_level_tokenizer,
    load_tokenizer,
    save_tokenizer,
)
from speculum.runtime.default_model import TINY_CONFIG
from speculum.runtime.engine import engine_from_model
from speculum.spec.paged import extend_batch
from speculum.state.kv import PADDING_PAGE, PagedKV

transformers.logging.disable_progress_bar()

VOCAB = 96
LAYERS = 2
HEADS = 4
MAX_POSITIONS = 256
MAX_PROMPT = 12
#: max |ours - transformers| / max |transformers|, in float32.
RELATIVE_TOLERANCE = 1e-4

# head_dim 8 or 16 with theta 1e4 gives wavelengths 6.3, 63, 628, ... (and 20, 199, ... at 16):
# an original context of 64 puts frequencies in each of llama3's unscaled, smoothed and scaled
# bands.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

#: name -> (transformers family, extra config), one per feature the decoder must get right.
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("Llama", {}),
    "llama-bias": ("Llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3.1-rope": ("Llama", {"rope_parameters": LLAMA3_ROPE}),
    "linear-rope": ("Llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0}}),
    "qwen2": ("Qwen2", {}),  # q/k/v bias
    "qwen3": ("Qwen3", {"head_dim": 24}),  # q/k norm, head_dim != hidden / heads
    # A window no shorter than the context is accepted and changes nothing.
    "mistral": ("Mistral", {"sliding_window": MAX_POSITIONS}),
    # Windows shorter than the prompts: every layer (Mistral), or layers from
    # max_window_layers on (Qwen2), through chunks, decode steps and pages alike.
    "mistral-window": ("Mistral", {"sliding_window": 3}),
    "qwen2-window": (
        "Qwen2",
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    # Mixtures of experts (4 experts, top 2): Mixtral always renormalises the top k; Qwen2-MoE
    # adds a gated shared expert and does not renormalise; Qwen3-MoE does, with a dense layer.
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": (
        "Qwen2Moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40,
        },
    ),
    "qwen3-moe": (
        "Qwen3Moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "head_dim": 16,
        },
    ),
    # GLM-4.5: half the head turns (partial rotary), q/k/v bias, q/k norm; sigmoid scores with
    # a correction bias pick 3 experts inside the best 2 of 3 groups, renormalised and scaled;
    # an ungated shared expert; layer 0 dense.
    "glm4-moe": (
        "Glm4Moe",
        {
            "n_routed_experts": 6,
            "num_experts_per_tok": 3,
            "n_group": 3,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "moe_intermediate_size": 24,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "attention_bias": True,
            "use_qk_norm": True,
            "head_dim": 16,
        },
    ),
}


@attrs.define(frozen=True)
class Spec:
    """One tiny transformers model."""

    case: str
    hidden: int
    kv_heads: int
    tied: bool
    seed: int


def hf_model(spec: Spec) -> transformers.PreTrainedModel:
    """A transformers causal LM with every parameter (biases and norms too) random."""
    family, extra = CASES[spec.case]
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB,
        hidden_size=spec.hidden,
        intermediate_size=spec.hidden * 3 // 2,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=spec.tied,
        **extra,
    )
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in random_tensors(model):
            # Matrices at 1/sqrt(fan_in) keep activations O(1); vectors (norms, biases) far
            # enough from transformers' 1 and 0 that leaving one out changes the logits.
            std = param.shape[-1] ** -0.5 if param.dim() >= 2 else 0.3  # experts: 3-D
            mean = 1.0 if "norm" in name else 0.0
            param.copy_(torch.randn(param.shape, generator=gen) * std + mean)
    return model.eval()


def random_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors a random test model draws: every parameter, and the routers'
    ``e_score_correction_bias`` (a buffer in transformers, zero unless drawn)."""
    biases = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    return [*model.named_parameters(), *biases]


def specs(case: str | None = None) -> st.SearchStrategy[Spec]:
    """Models of one or any case, tied or not, with MHA (4 KV heads) or GQA (2 or 1)."""
    return st.builds(
        Spec,
        case=st.sampled_from(sorted(CASES)) if case is None else st.just(case),
        hidden=st.sampled_from([32, 64]),
        kv_heads=st.sampled_from([4, 2, 1]),
        tied=st.booleans(),
        seed=st.integers(0, 2**16),
    )


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return float((ours - ref).abs().max() / ref.abs().max())


def reference(
    hf: transformers.PreTrainedModel, prompt: list[int], capture: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits ``[seq, vocab]`` and ``[1 + len(capture), seq, hidden]`` streams.

    Stream 0 is the final-normed hidden state, then the output of each captured layer:
    ``hidden_states[n + 1]``, except for the last layer, whose ``hidden_states`` entry is
    post-norm; its output is read at the final norm's input instead.
    """
    pre_norm: list[torch.Tensor] = []
    hook = hf.model.norm.register_forward_pre_hook(lambda _, args: pre_norm.append(args[0]))
    try:
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), output_hidden_states=True)
    finally:
        hook.remove()
    layer_outputs = [*out.hidden_states[1:-1], pre_norm[0]]
    streams = [out.hidden_states[-1], *(layer_outputs[n] for n in capture)]
    return out.logits[0], torch.cat(streams)


def page_table(lengths: list[int], page_size: int, order: list[int], extra: int) -> torch.Tensor:
    """Rows of consecutive pages from ``order`` (enough for ``lengths``), sink-padded."""
    counts = [math.ceil(n / page_size) for n in lengths]
    width = max(counts) + extra
    rows, start = [], 0
    for count in counts:
        rows.append([*order[start : start + count], *[PADDING_PAGE] * (width - count)])
        start += count
    return torch.tensor(rows, dtype=torch.int64)


def run_in_steps(
    model: DecoderModel,
    prompts: list[list[int]],
    chunks: list[list[int]],
    table: torch.Tensor,
    page_size: int,
    capture: tuple[int, ...],
) -> list[torch.Tensor]:
    """Feed ``prompts[b]`` in ``chunks[b]``; step ``t`` appends chunk ``t`` of every row.

    Rows out of chunks ride along as padding (``q_lens == 0``), shorter chunks are padded up to
    the step's longest, and padded positions hold a non-zero id, which ``extend_batch`` must mask.
    Each row keeps its recurrent state (a hybrid's) in a slot of its own.
    Returns per row ``[1 + len(capture), seq, hidden]``: final-normed hidden, then captures.
    """
    batch = len(prompts)
    # Each row its own recurrent-state slot (hybrids; other models' pools ignore these), the
    # ring longer than any chunk.
    states = {"state_slots": batch + 1, "state_ring": max(map(max, chunks)) + 1}
    pool = model.new_pool(int(table.max()) + 1, page_size, **states)
    slots = torch.arange(1, batch + 1)
    seq_lens = torch.zeros(batch, dtype=torch.int64)
    streams: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    for step in range(max(map(len, chunks))):
        q_lens = [c[step] if step < len(c) else 0 for c in chunks]
        ids = torch.full((batch, max(q_lens)), VOCAB - 1)
        for b, n in enumerate(q_lens):
            start = int(seq_lens[b])
            ids[b, :n] = torch.tensor(prompts[b][start : start + n])
        kv = PagedKV(page_table=table, seq_lens=seq_lens, page_size=page_size, state_slots=slots)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        with torch.no_grad():
            hidden, captured = model(extend_batch(kv, ids, q_lens_t), pool, capture)
        stacked = torch.stack([hidden, *captured], dim=1)  # [batch, streams, q, hidden]
        for b, n in enumerate(q_lens):
            streams[b].append(stacked[b, :, :n])
        seq_lens = seq_lens + q_lens_t
    return [torch.cat(s, dim=1) for s in streams]


#: A ragged batch of prompts, and how :func:`assert_ragged_logits_equal` feeds each.
RAGGED_PROMPTS = [[3, 17, 42, 5, 88, 1, 9], [9] * 11, [60, 2]]
RAGGED_CHUNKS = [[3, 1, 1, 2], [4, 7], [1, 1]]


def assert_ragged_logits_equal(hf: transformers.PreTrainedModel, ours: DecoderModel) -> None:
    """Chunked prefill and decode of :data:`RAGGED_PROMPTS` through the paged cache (pages of
    3 tokens), in a ragged batch, give ``hf``'s float32 logits at every position."""
    table = page_table([len(p) for p in RAGGED_PROMPTS], 3, list(range(1, 12)), extra=1)
    stepped = run_in_steps(ours, RAGGED_PROMPTS, RAGGED_CHUNKS, table, 3, ())
    for prompt, streams in zip(RAGGED_PROMPTS, stepped, strict=True):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        assert relative_error(ours.logits(streams[0]), expected) < 1e-5


@st.composite
def chunkings(draw: st.DrawFn, length: int) -> list[int]:
    """How a prompt is fed: in one call, in random chunks, or a prefill then 1-token decodes."""
    mode = draw(st.sampled_from(["one call", "chunks", "prefill + decode"]))
    if mode == "one call" or length == 1:
        cuts: list[int] = []
    elif mode == "chunks":
        cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=length - 1)))
    else:
        cuts = list(range(draw(st.integers(1, length)), length))
    bounds = [0, *cuts, length]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def saved(hf: transformers.PreTrainedModel, folder: Path, **kwargs) -> Path:
    """``hf`` saved to ``folder`` the way transformers does (safetensors)."""
    hf.save_pretrained(folder, **kwargs)
    return folder


@settings(max_examples=100, deadline=None)
@given(spec=specs(), data=st.data())
def test_logits_and_captures_match_transformers(spec: Spec, data: st.DataObject) -> None:
    """Any architecture, batch of ragged prompts, page layout and chunking: logits, final
    hidden states and captured layer outputs equal transformers'; chunked prefill and decode
    through the cache equal a one-call prefill."""
    hf = hf_model(spec)
    with tempfile.TemporaryDirectory() as folder:
        model = load_model(saved(hf, Path(folder)))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == spec.tied
    if data.draw(st.booleans(), label="fused projections"):
        fuse_projections_(model)

    token = st.integers(0, VOCAB - 1)
    prompt = st.lists(token, min_size=1, max_size=MAX_PROMPT)
    prompts = data.draw(st.lists(prompt, min_size=1, max_size=3))
    lengths = [len(p) for p in prompts]
    chunks = [data.draw(chunkings(n)) for n in lengths]
    page_size = data.draw(st.integers(1, 6))
    num_pages = 1 + sum(math.ceil(n / page_size) for n in lengths) + data.draw(st.integers(0, 2))
    order = data.draw(st.permutations(range(1, num_pages)))
    table = page_table(lengths, page_size, order, extra=data.draw(st.integers(0, 1)))
    layers = data.draw(st.permutations(range(LAYERS)))
    capture = tuple(layers[: data.draw(st.integers(0, LAYERS))])

    stepped = run_in_steps(model, prompts, chunks, table, page_size, capture)
    one_call = run_in_steps(model, prompts, [[n] for n in lengths], table, page_size, capture)
    for prompt, ours, whole in zip(prompts, stepped, one_call):
        ref_logits, ref_streams = reference(hf, prompt, capture)
        assert relative_error(model.logits(ours[0]), ref_logits) < RELATIVE_TOLERANCE
        for stream, ref_stream in zip(ours, ref_streams):
            assert relative_error(stream, ref_stream) < RELATIVE_TOLERANCE
        torch.testing.assert_close(ours, whole)


@pytest.mark.parametrize("case", ["llama-bias", "qwen3"])
def test_fused_projections_change_no_weight_and_no_output(case: str, tmp_path: Path) -> None:
    """Fusing keeps every parameter (name, shape, value), computes what the separate
    projections compute, saves and loads back as the same checkpoint, and leaves training
    (gradients reach each projection) and a later ``.to()`` (separate projections again)
    correct."""
    hf = hf_model(Spec(case=case, hidden=32, kv_heads=2, tied=False, seed=3))
    model = load_model(saved(hf, tmp_path / "hf"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = list(range(1, VOCAB, 7))
    table = page_table([len(prompt)], 4, list(range(1, 10)), extra=0)
    (separate,) = run_in_steps(model, [prompt], [[3, len(prompt) - 3]], table, 4, (0,))
    fuse_projections_(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv.weight.data_ptr()
    (fused,) = run_in_steps(model, [prompt], [[3, len(prompt) - 3]], table, 4, (0,))
    torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-6)

    reloaded = load_model(save_model(model, tmp_path / "ours"))
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in before.items())

    tokens = torch.tensor([prompt])
    model.requires_grad_(True)
    hidden, _ = model(dense_batch(tokens), None)
    model.logits(hidden).logsumexp(-1).sum().backward()
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, model.model.layers[1].mlp.up_proj):
        assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0
    model.requires_grad_(False)

    wide = model.to(torch.float64)
    (moved,) = run_in_steps(wide, [prompt], [[len(prompt)]], table, 4, (0,))
    torch.testing.assert_close(moved.float(), separate, rtol=1e-4, atol=1e-5)


def test_engines_built_over_one_model_keep_its_fused_tensors() -> None:
    """Every engine fuses the models it is built over; a second engine over the same target
    and draft keeps the fused tensors the first one's CUDA graphs read (fused anew, the old
    tensors would be freed under those graphs: an illegal memory access on the H200, or
    garbage weights once the memory is reused). After ``.to()`` gives the projections copies
    of their own, fusing again fuses them."""
    target = random_model(TINY_CONFIG, seed=0, std=0.1)
    draft = random_draft(target, "eagle3", seed=1, std=0.1)

    def fused() -> list[torch.Tensor]:
        blocks = [*target.modules(), *draft.modules()]
        return [m.qkv.weight for m in blocks if getattr(m, "qkv", None) is not None] + [
            m.gate_up.weight for m in blocks if getattr(m, "gate_up", None) is not None
        ]

    engine_from_model(target, algorithm="eagle3", draft=draft, max_context=64)
    first = fused()
    assert len(first) == 2 * TINY_CONFIG.num_layers + 2
    engine_from_model(target, algorithm="eagle3", draft=draft, max_context=64)
    engine_from_model(target, max_context=64)
    assert all(a is b for a, b in zip(first, fused(), strict=True))
    target.to(torch.float64)
    fuse_projections_(target)
    moved = fused()[: TINY_CONFIG.num_layers]
    assert all(w.dtype == torch.float64 and w is not old for w, old in zip(moved, first))


def test_sharded_checkpoint(tmp_path: Path) -> None:
    """An index plus several shard files loads like one file; a missing shard is named."""
    spec = Spec(case="qwen3", hidden=32, kv_heads=2, tied=False, seed=1)
    hf = hf_model(spec)
    folder = saved(hf, tmp_path, max_shard_size="20KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert (folder / "model.safetensors.index.json").exists() and len(shards) > 1
    prompt = list(range(0, VOCAB, 9))
    table = page_table([len(prompt)], 4, list(range(1, 10)), extra=0)
    model = load_model(folder)
    (ours,) = run_in_steps(model, [prompt], [[len(prompt)]], table, 4, ())
    ref_logits, _ = reference(hf, prompt, ())
    assert relative_error(model.logits(ours[0]), ref_logits) < RELATIVE_TOLERANCE
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"shard files that do not exist.*{shards[-1].name}"):
        load_model(folder)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A small valid single-file Llama checkpoint to break."""
    return saved(hf_model(Spec(case="llama", hidden=32, kv_heads=2, tied=False, seed=0)), tmp_path)


def edit_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite ``model.safetensors`` after ``edit`` changed its tensors in place."""
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def edit_config(folder: Path, **changes: object) -> None:
    """Rewrite ``config.json`` with ``changes`` applied."""
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


UP = "model.layers.1.mlp.up_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
EXTRA = "model.layers.0.self_attn.rotary_scale"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(UP), rf"missing weights \['{UP}'\]"),
        (lambda t: t.update({EXTRA: torch.ones(3)}), rf"unexpected weights \['{EXTRA}'\]"),
        (
            lambda t: t.update({K: t[K].T.contiguous()}),
            rf"shapes disagree with config.json: \['{K}: checkpoint \(32, 16\) vs config "
            r"\(16, 32\)'\]",
        ),
    ],
    ids=["missing", "unexpected", "wrong shape"],
)
def test_weights_must_match_config(checkpoint: Path, edit: Callable, message: str) -> None:
    """Loading is strict: the error names the offending weight and what is wrong with it."""
    edit_weights(checkpoint, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(checkpoint)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"architecture 'GPT2LMHeadModel' is not supp"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
            r"rope type 'dynamic' is not supported; supported: default, linear, llama3, yarn",
        ),
        ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, r"rope type 'longrope' is not"),
        (
            {"architectures": ["Qwen3ForCausalLM"], "rope_scaling": {"type": "yarn", "factor": 4}},
            r"'yarn' is supported for Deepseek.*LlamaForCausalLM only, not Qwen3ForCausalLM",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    ],
    ids=[
        "architecture",
        "rope type (transformers 5)",
        "rope type (transformers 4)",
        "yarn",
        "activation",
    ],
)
def test_unsupported_config(checkpoint: Path, changes: dict, message: str) -> None:
    """A config naming something the decoder does not implement is refused, naming it."""
    edit_config(checkpoint, **changes)
    with pytest.raises(UnsupportedModel, match=message):
        load_model(checkpoint)


def test_missing_config(checkpoint: Path) -> None:
    """A folder without config.json is not a model folder."""
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_model(checkpoint)


@pytest.mark.parametrize(
    "corrupt",
    [lambda data: b"not a safetensors file", lambda data: data[: len(data) // 2]],
    ids=["garbage", "truncated"],
)
def test_corrupt_weights_file(checkpoint: Path, corrupt: Callable[[bytes], bytes]) -> None:
    """An unreadable safetensors file is named in the error."""
    path = checkpoint / "model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(CheckpointError, match=r"cannot read weights file .*model\.safetensors"):
        load_model(checkpoint)


@pytest.fixture(scope="module")
def byte_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple]:
    """(ours, transformers' AutoTokenizer) over the byte-level tokenizer, with and without the
    BOS-adding post-processor."""
    pairs = {}
    for bos in (True, False):
        inner = byte_level_tokenizer()
        if not bos:
            inner.post_processor = None
        folder = save_tokenizer(inner, tmp_path_factory.mktemp("tokenizer")).parent
        pairs[bos] = (load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder))
    return pairs


@settings(max_examples=200, deadline=None)
@given(text=st.text().filter(lambda t: BOS not in t and EOS not in t), bos=st.booleans())
def test_byte_level_round_trip(byte_tokenizers: dict, text: str, bos: bool) -> None:
    """Ids are the UTF-8 bytes (after BOS when the post-processor adds it), decoding restores
    the text, and both agree with what transformers' AutoTokenizer does by default."""
    ours, auto = byte_tokenizers[bos]
    ids = ours.encode(text)
    assert ids == [256] * bos + list(text.encode("utf-8"))
    assert ours.decode(ids) == text
    assert ids == auto.encode(text)
    assert ours.decode(ids) == auto.decode(ids, skip_special_tokens=True)


def test_byte_level_special_tokens(byte_tokenizers: dict) -> None:
    """258 ids; <s> is 256 and </s> 257; their text inside a prompt is read as the special token,
    as transformers does, and decoding leaves special tokens out."""
    ours, auto = byte_tokenizers[True]
    assert ours.vocab_size == 258
    assert (ours.inner.token_to_id(BOS), ours.inner.token_to_id(EOS)) == (256, 257)
    assert ours.encode("a</s>b") == auto.encode("a</s>b") == [256, 97, 257, 98]
    assert ours.decode(torch.tensor([256, 104, 105, 257])) == "hi"


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    """A missing or unreadable tokenizer.json is named, with the --prompt-ids way out."""
    path = tmp_path / "tokenizer.json"
    with pytest.raises(CheckpointError, match=rf"{path} does not exist.*--prompt-ids"):
        load_tokenizer(tmp_path)
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"cannot read tokenizer {path}.*--prompt-ids"):
        load_tokenizer(tmp_path)


def test_cast_weights_stores_a_smaller_dtype_that_loads_back_close(tmp_path: Path) -> None:
    """Weights stored in bf16 load in the config's float32, each within bf16 rounding."""
    from conftest import tiny_config

    from speculum.models.loading import cast_weights, random_model, save_model

    model = random_model(tiny_config(), seed=3, std=0.3)
    save_model(model, tmp_path)
    cast_weights(tmp_path, torch.bfloat16)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    loaded = load_model(tmp_path)
    for name, param in model.named_parameters():
        again = dict(loaded.named_parameters())[name]
        assert again.dtype == torch.float32
        assert torch.equal(again, param.to(torch.bfloat16).float())


# The example once failed a property counting distinct values (more in float32 than rounded to
# bfloat16): its 96 products happened to stay distinct in bfloat16 too.
@example(rows=1, hidden=16, seed=65535)
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 5), hidden=st.sampled_from([16, 64]), seed=st.integers(0, 2**16))
def test_bfloat16_logits_are_the_float32_accumulated_product(rows, hidden, seed) -> None:
    """A bfloat16 model's logits are the exact product of its bfloat16 values accumulated in
    float32, not rounded back to bfloat16 (whose ulp would turn near-ties into ties)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen).bfloat16()
    w = (torch.randn(VOCAB, hidden, generator=gen) * 2).bfloat16()
    # A planted near-tie, so that every draw tells the two apart: row 0 scores token 0 at 1 and
    # token 1 at 1 + 2**-8, exact in float32 but half a bfloat16 ulp apart, so rounding to
    # bfloat16 (half to even) ties them at 1.
    h[0, :2] = torch.tensor([1.0, 2**-8])
    w[:2] = 0
    w[0, 0] = w[1, 0] = w[1, 1] = 1
    logits = float32_logits(h, w)
    exact = h.double() @ w.double().T
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), exact, rtol=1e-6, atol=1e-5)
    assert logits[0, :2].tolist() == [1.0, 1 + 2**-8]
    assert (h.float() @ w.float().T).bfloat16()[0, :2].tolist() == [1.0, 1.0]
