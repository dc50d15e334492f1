"""FP8 checkpoints (per-tensor, per-channel, DeepSeek's block scales; quant_method fp8 and
compressed-tensors): strict loading, weights that stay FP8, logits equal to the same weights
dequantized (ours and transformers' in float32), and speculative decoding over an FP8 target
equal to plain decoding over it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import tiny_config
from heads import agreeing_head, markov_target, pipeline_engine
from safetensors.torch import load_file, save_file
from test_models import edit_config, edit_weights, relative_error

from speculum.models.config import CheckpointError, MoEConfig, UnsupportedModel
from speculum.models.decoder import Fp8Linear, dense_batch, fuse_projections_
from speculum.models.draft import random_draft
from speculum.models.draft_loading import load_draft, save_draft
from speculum.models.fp8 import Fp8Scheme, dequantize_, quantize_
from speculum.models.loading import load_model, random_model, randomize_, save_model
from speculum.models.parallel import UnsupportedSplit, shard_
from speculum.runtime.generate import generate
from speculum.state.parallel import TensorParallel

transformers.logging.disable_progress_bar()

E4M3 = torch.float8_e4m3fn
DOWN = "model.layers.1.mlp.down_proj"
#: layout -> (scheme, config changes): every granularity of both quant methods, with and
#: without a static activation scale, an ignore list by name and by pattern, partial blocks
#: (DeepSeek's 128 x 128 over 32-wide weights, 16 x 8 over 48-wide ones), a block the size of
#: a weight, and q/k/v biases.
LAYOUTS = {
    "fp8-tensor": (Fp8Scheme(method="fp8", strategy="tensor"), {}),
    "fp8-tensor-static": (Fp8Scheme(method="fp8", strategy="tensor", static_input=True), {}),
    "fp8-channel-ignore": (Fp8Scheme(method="fp8", strategy="channel", ignore=(DOWN,)), {}),
    "deepseek-block-128": (Fp8Scheme(method="fp8", strategy="block", block=(128, 128)), {}),
    # one block exactly the size of the 32 x 32 q and o projections: still a block scale
    "fp8-block-32": (Fp8Scheme(method="fp8", strategy="block", block=(32, 32)), {}),
    "fp8-block-16x8-qwen2": (
        Fp8Scheme(method="fp8", strategy="block", block=(16, 8)),
        {"architecture": "Qwen2ForCausalLM", "qkv_bias": True, "intermediate_size": 48},
    ),
    "ct-tensor-static": (
        Fp8Scheme(method="compressed-tensors", strategy="tensor", static_input=True),
        {},
    ),
    "ct-channel-ignore-re": (
        Fp8Scheme(method="compressed-tensors", strategy="channel", ignore=("re:.*k_proj$",)),
        {},
    ),
    "ct-block": (Fp8Scheme(method="compressed-tensors", strategy="block", block=(16, 16)), {}),
}
PROMPT = [3, 17, 5, 60, 2, 2, 41, 8]


def fp8_checkpoint(folder: Path, scheme: Fp8Scheme, **changes: object) -> Path:
    """A tiny random float32 model quantized by ``scheme`` and saved as an FP8 checkpoint."""
    config = tiny_config(tie_word_embeddings=False, **changes)
    model = quantize_(random_model(config, seed=4, std=0.3), scheme, input_scale=0.02)
    return save_model(model, folder)


def dequantized_checkpoint(fp8: Path, folder: Path) -> Path:
    """The FP8 checkpoint ``fp8`` written as an unquantized float32 one: each FP8 weight
    times its scale, each element's scale found by its block index (written here, apart from
    speculum's own dequantization)."""
    config = json.loads((fp8 / "config.json").read_text())
    quant = config.pop("quantization_config")
    groups = quant.get("config_groups", {"": {"weights": {}}})
    block = quant.get("weight_block_size") or groups.popitem()[1]["weights"].get("block_structure")
    tensors = load_file(fp8 / "model.safetensors")
    out = {}
    for key, tensor in tensors.items():
        if key.endswith(("_scale", "_scale_inv")):
            continue
        if tensor.dtype == E4M3:
            scale = tensors.get(key + "_scale", tensors.get(key + "_scale_inv"))
            rows, cols = tensor.shape
            if block is not None:
                per_element = scale[torch.arange(rows) // block[0]][
                    :, torch.arange(cols) // block[1]
                ]
            else:
                per_element = scale.reshape(-1, 1)  # one per tensor or one per row
            tensor = tensor.float() * per_element
        out[key] = tensor.float()
    folder.mkdir()
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """Float32 logits ``[seq, vocab]`` of a cache-free forward of ``prompt``."""
    hidden, _ = model(dense_batch(torch.tensor([prompt])), None)
    return model.logits(hidden)[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp8_logits_equal_the_dequantized_weights(layout: str, tmp_path: Path) -> None:
    """The quantized layers load as FP8 weights (one byte each, also when the model computes
    in bfloat16), ignored ones stay float; float32 logits equal those of the same weights
    dequantized into an unquantized checkpoint, bit for bit, and transformers' on that
    checkpoint."""
    scheme, changes = LAYOUTS[layout]
    fp8 = fp8_checkpoint(tmp_path / "fp8", scheme, **changes)
    model = load_model(fp8)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    ignored = {DOWN, "model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.k_proj"}
    linears = [n for n, m in model.named_modules() if n.startswith("model.layers.") and "proj" in n]
    assert set(layers) == {n for n in linears if not scheme.ignores(n)}
    assert set(linears) - set(layers) <= ignored
    assert all(m.weight.dtype == E4M3 for m in layers.values())
    bf16 = load_model(fp8, dtype=torch.bfloat16)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(m.weight.dtype == E4M3 for m in bf16.modules() if isinstance(m, Fp8Linear))
    reference = dequantized_checkpoint(fp8, tmp_path / "float32")
    ours = logits(model, PROMPT)
    assert torch.equal(ours, logits(load_model(reference), PROMPT))
    assert torch.equal(ours, logits(dequantize_(load_model(fp8), torch.float32), PROMPT))
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
    assert relative_error(ours, theirs) < 1e-5


def test_deepseek_v3_block_fp8_with_latent_attention(tmp_path: Path) -> None:
    """DeepSeek-V3's own layout on its attention: every projection (q_a, q_b, kv_a, the
    absorbed kv_b, o) and dense MLP FP8 in 128 x 128 blocks (scales ``weight_scale_inv``),
    equal to the dequantized weights, ours and transformers'."""
    hf_config = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        q_lora_rank=12,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        first_k_dense_replace=2,
        max_position_embeddings=128,
    )
    transformers.DeepseekV3ForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    model = randomize_(load_model(tmp_path / "hf"), seed=2, std=0.3)
    assert model.config.mla is not None
    quantize_(model, Fp8Scheme(method="fp8", strategy="block", block=(128, 128)))
    fp8 = save_model(model, tmp_path / "fp8")
    assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" in load_file(
        fp8 / "model.safetensors"
    )
    loaded = load_model(fp8)
    assert isinstance(loaded.model.layers[0].self_attn.kv_b_proj, Fp8Linear)
    reference = dequantized_checkpoint(fp8, tmp_path / "float32")
    ours = logits(loaded, PROMPT)
    assert torch.equal(ours, logits(load_model(reference), PROMPT))
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
    assert relative_error(ours, theirs) < 1e-5


@pytest.fixture(scope="module")
def block_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An FP8 checkpoint in 16 x 16 blocks (``weight_scale_inv``) to break."""
    folder = tmp_path_factory.mktemp("block") / "fp8"
    return fp8_checkpoint(folder, Fp8Scheme(method="fp8", strategy="block", block=(16, 16)))


@pytest.fixture
def broken(block_checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of :func:`block_checkpoint` for one test to edit."""
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((block_checkpoint / name).read_bytes())
    return tmp_path


Q = "model.layers.0.self_attn.q_proj"


def set_quantization(folder: Path, **changes: object) -> None:
    """Rewrite ``quantization_config`` in ``folder``'s config.json with ``changes``."""
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    edit_config(folder, quantization_config={**quant, **changes})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda f: edit_weights(f, lambda t: t.pop(f"{Q}.weight_scale_inv")),
            rf"missing weights \['{Q}.weight_scale_inv'\]",
        ),
        (
            lambda f: edit_weights(
                f, lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1)})
            ),
            r"unexpected weights \['model.norm.weight_scale_inv'\]",
        ),
        (
            lambda f: set_quantization(f, weight_block_size=[128, 128]),
            rf"'{Q}.weight_scale_inv' has shape \(2, 2\), but weight_block_size \[128, 128\] in "
            r"config.json gives a weight of shape \(32, 32\) scales of shape \(1, 1\)",
        ),
        (
            lambda f: set_quantization(f, weight_block_size=[128]),
            r"weight_block_size is \[128\]; it must be two positive integers",
        ),
        (
            lambda f: set_quantization(f, ignored_layers=[Q]),
            rf"\['{Q}.weight \(F8_E4M3\)'\] hold FP8 values, but speculum keeps them in the "
            r"compute dtype",
        ),
        (
            lambda f: edit_weights(
                f, lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].float()})
            ),
            rf"makes \['{Q}.weight \(F32\)'\] FP8 layers, but the checkpoint holds them in "
            r"another dtype \(F8_E4M3 expected\)",
        ),
        (
            lambda f: edit_weights(
                f, lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(torch.float8_e5m2)})
            ),
            r"\['lm_head.weight \(F8_E5M2\)'\] hold FP8 values, but speculum keeps them",
        ),
        (
            lambda f: edit_config(f, quantization_config=None),
            rf"'{Q}.weight \(F8_E4M3\)'.* hold FP8 values, but config.json has no "
            "quantization_config",
        ),
    ],
    ids=[
        "missing scale",
        "unexpected scale",
        "wrong weight_block_size",
        "malformed weight_block_size",
        "FP8 weight of an ignored layer",
        "float weight of an FP8 layer",
        "FP8 lm_head",
        "FP8 without quantization_config",
    ],
)
def test_fp8_loading_is_strict(broken: Path, edit, message: str) -> None:
    edit(broken)
    with pytest.raises(CheckpointError, match=message):
        load_model(broken)


def test_per_channel_scales_must_have_one_value_per_row(tmp_path: Path) -> None:
    folder = fp8_checkpoint(tmp_path, Fp8Scheme(method="compressed-tensors", strategy="channel"))
    edit_weights(folder, lambda t: t.update({f"{Q}.weight_scale": torch.ones(16, 1)}))
    with pytest.raises(CheckpointError, match=rf"'{Q}.weight_scale' has shape \(16, 1\), but"):
        load_model(folder)


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3 FP8 weights load"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}
                },
            },
            "quantizes weights to 4-bit int; speculum loads 8-bit float",
        ),
    ],
)
def test_other_quantizations_are_refused(broken: Path, quant: dict, message: str) -> None:
    edit_config(broken, quantization_config=quant)
    with pytest.raises(UnsupportedModel, match=message):
        load_model(broken)


def test_fp8_moe_experts_and_tensor_parallel_are_refused(broken: Path, tmp_path: Path) -> None:
    """Both raise naming what is not supported, rather than loading something else."""
    with pytest.raises(UnsupportedModel, match="FP8 .* tensor parallelism"):
        load_model(broken, tp=TensorParallel(rank=0, size=2))
    with pytest.raises(UnsupportedSplit, match="FP8 linear layers cannot be split"):
        shard_(load_model(broken), TensorParallel(rank=0, size=2))
    sharded = shard_(random_model(tiny_config()), TensorParallel(rank=0, size=2))
    with pytest.raises(UnsupportedModel, match="FP8 layers are not tensor-parallel yet"):
        quantize_(sharded, Fp8Scheme(method="fp8", strategy="tensor"))
    experts = MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=16, norm_topk_prob=True)
    model = random_model(tiny_config(architecture="Qwen3MoeForCausalLM", moe=experts))
    with pytest.raises(UnsupportedModel, match="FP8 MoE experts not supported yet"):
        quantize_(model, Fp8Scheme(method="fp8", strategy="tensor"))
    save_model(model, tmp_path / "moe")
    set_quantization_to = json.loads((broken / "config.json").read_text())["quantization_config"]
    edit_config(tmp_path / "moe", quantization_config=set_quantization_to)
    with pytest.raises(UnsupportedModel, match="FP8 MoE experts not supported yet"):
        load_model(tmp_path / "moe")


def test_speculative_decoding_over_an_fp8_target_equals_plain(tmp_path: Path) -> None:
    """EAGLE chains and trees and n-gram drafting over an FP8 target (bfloat16 drafts are
    not needed: the draft head stays float) emit exactly plain greedy decoding's tokens over
    that target, and the rounds accept deep paths."""
    target = markov_target(16)
    quantize_(target, Fp8Scheme(method="fp8", strategy="block", block=(16, 16)))
    head = agreeing_head(target, "eagle")
    prompts = [[1, 2, 3], [9, 9, 9, 1], [4, 7]]
    plain = generate(
        prompts, engine=pipeline_engine(target, ("plain", None, {}), (0, 0, 0)), max_new_tokens=20
    )
    for pipeline in [
        ("eagle", head, {"num_steps": 3}),
        ("eagle", head, "tree"),
        ("ngram", None, {"num_steps": 3}),
    ]:
        engine = pipeline_engine(target, pipeline, (3, 2, 6))
        ours = generate(prompts, engine=engine, max_new_tokens=20)
        assert [r.token_ids for r in ours] == [r.token_ids for r in plain]
        if pipeline[0] == "eagle":
            assert all(r.stats["accept_length_mean"] > 1.5 for r in ours)


#: case -> (scheme, config changes, whether q/k/v fuse)
FUSING = {
    "tensor": (*LAYOUTS["fp8-tensor"], True),
    "block-16x8-bias": (*LAYOUTS["fp8-block-16x8-qwen2"], True),
    # one 128 x 128 block per 32-wide projection: a scale per tensor, fused per row
    "deepseek-block-128": (*LAYOUTS["deepseek-block-128"], True),
    "float-k-between": (*LAYOUTS["ct-channel-ignore-re"], False),
    # 12-row blocks would straddle q_proj's 32 rows and k_proj's
    "block-12-rows": (Fp8Scheme(method="fp8", strategy="block", block=(12, 16)), {}, False),
    # each projection its own static activation scale
    "static": (*LAYOUTS["fp8-tensor-static"], False),
}


@pytest.mark.parametrize("case", sorted(FUSING))
def test_fp8_projections_fuse_where_their_scales_line_up(case: str, tmp_path: Path) -> None:
    """Fusing FP8 q/k/v (and gate/up) concatenates their weights (as views: no second copy)
    and scales where they line up, leaves them separate where not, and changes no parameter,
    no output and no saved byte."""
    scheme, changes, fuses = FUSING[case]
    fp8 = fp8_checkpoint(tmp_path / "fp8", scheme, **changes)
    model = load_model(fp8)
    separate = logits(model, PROMPT)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections_(model)
    attn = model.model.layers[0].self_attn
    assert (attn.qkv is not None) == fuses
    if fuses:
        assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv.weight.data_ptr()
        assert attn.qkv.weight.dtype == E4M3
    torch.testing.assert_close(logits(model, PROMPT), separate, rtol=1e-6, atol=1e-6)
    after = model.state_dict()
    assert all(torch.equal(after[k].float(), v.float()) for k, v in before.items())
    saved = load_file(save_model(model, tmp_path / "again") / "model.safetensors")
    original = load_file(fp8 / "model.safetensors")
    assert all(torch.equal(saved[k].float(), v.float()) for k, v in original.items())


@pytest.mark.parametrize(
    ("shape", "block", "rows", "bias", "dtype"),
    [
        ((48, 40), (16, 16), 1, False, torch.float32),  # partial column blocks
        ((40, 48), (16, 8), 3, True, torch.float32),  # partial row blocks, with a bias
        ((64, 256), (128, 128), 5, False, torch.float32),  # DeepSeek's blocks
        ((32, 24), (32, 24), 2, True, torch.float32),  # one scale per tensor
        ((32, 24), (1, 24), 16, False, torch.float32),  # one per row, one full tile of rows
        ((37, 300), (1, 300), 7, True, torch.float16),  # per row: odd widths, two K steps
        ((37, 300), (37, 300), 1, False, torch.float16),  # per tensor: odd widths
        ((19, 520), (1, 520), 17, False, torch.float32),  # per row: two tiles of rows
    ],
)
def test_the_triton_fp8_gemv_equals_the_reference(shape, block, rows, bias, dtype) -> None:
    """The matrix-vector kernel (run by Triton's interpreter here, whose dot cannot read
    bfloat16: tests/gpu checks that) computes the reference's dequantized product in ``x``'s
    dtype: the same rounded weights, summed in float32 in another order."""
    pytest.importorskip("triton")
    from speculum.kernels import fp8
    from speculum.kernels.triton_fp8 import fp8_gemv

    gen = torch.Generator().manual_seed(rows)
    weight, scale = fp8.quantize_weight(torch.randn(shape, generator=gen), block)
    x = torch.randn(rows, shape[1], generator=gen).to(dtype)
    b = torch.randn(shape[0], generator=gen).to(dtype) if bias else None
    rounded = fp8.dequantize(weight, scale, block, dtype).float()  # the reference's weights
    expected = F.linear(x.float(), rounded, b.float() if bias else None)
    ours = fp8_gemv(x[None], weight, scale, list(block), b)[0]
    assert ours.dtype == dtype
    # float32: another summation order (TF32 would be off by ~1e-3); else the output's rounding
    tolerance = 1e-4 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(ours.float(), expected, rtol=tolerance, atol=tolerance)


def test_the_cuda_kernel_is_chosen_by_row_count_alone() -> None:
    """Up to ``GEMV_ROWS`` rows (decode, small verifies) every scale layout runs the Triton
    matrix-vector kernel; above, ``_scaled_mm`` only where it applies (here, on the CPU,
    never: the reference), whatever the scales."""
    pytest.importorskip("triton")
    from speculum.kernels import fp8

    weight = torch.zeros(32, 64, dtype=fp8.FP8)
    for block in ([32, 64], [1, 64], [16, 16]):
        assert fp8.cuda_kernel(torch.zeros(2, 8, 64), weight, block) == "triton_gemv"
        assert fp8.cuda_kernel(torch.zeros(17, 64), weight, block) == "reference"


def test_an_fp8_draft_checkpoint_is_refused_not_misread(tmp_path: Path) -> None:
    """Drafts load unquantized: an FP8 tensor in a draft checkpoint (its values meaningless
    without scales) is named, not cast."""
    target = random_model(tiny_config(tie_word_embeddings=False))
    folder = save_draft(random_draft(target, "eagle3"), tmp_path, "sglang-eagle3")
    key = next(k for k in load_file(folder / "model.safetensors") if k.endswith("q_proj.weight"))
    edit_weights(folder, lambda t: t.update({key: t[key].to(E4M3)}))
    with pytest.raises(CheckpointError, match=rf"\['{key} \(F8_E4M3\)'\] hold FP8 values, but "):
        load_draft(folder, target, "eagle3")


def test_quantizing_a_bfloat16_model_keeps_its_compute_dtype() -> None:
    """``quantize_`` on a bfloat16 model: FP8 weights, float32 scales, biases still bfloat16,
    and the same logits as its weights dequantized to bfloat16."""
    config = tiny_config(architecture="Qwen2ForCausalLM", qkv_bias=True)
    model = random_model(config, seed=1, std=0.3).to(torch.bfloat16)
    quantize_(model, Fp8Scheme(method="fp8", strategy="channel"))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert (q_proj.weight.dtype, q_proj.weight_scale.dtype) == (E4M3, torch.float32)
    assert q_proj.bias.dtype == torch.bfloat16
    ours = logits(model, PROMPT[:4])
    assert torch.equal(ours, logits(dequantize_(model, torch.bfloat16), PROMPT[:4]))


@pytest.mark.parametrize("static", [False, True])
def test_the_triton_activation_quantizer_equals_the_reference(static: bool) -> None:
    """Per-token (or static) e4m3 quantization of activations in one launch (Triton's
    interpreter here) gives the reference's scales and values, rows of zeros included.

    The interpreter's float-to-e4m3 conversion drops the carry when rounding up crosses a
    power of two (124.0 becomes 64.0 where the GPU, like torch, gives 128.0), so values that
    round to a power of two may come out halved here; tests/gpu checks every value exactly."""
    pytest.importorskip("triton")
    from speculum.kernels import fp8
    from speculum.kernels.triton_fp8 import quantize_rows_triton

    rows = torch.randn(5, 1100, generator=torch.Generator().manual_seed(0)) * 3
    rows[2] = 0.0
    scale = torch.tensor([0.01]) if static else None
    expected, expected_scale = fp8.quantize_rows(rows, scale)
    ours, ours_scale = quantize_rows_triton(rows, scale)
    assert torch.equal(ours_scale, expected_scale)
    ours, expected = ours.float(), expected.float()
    power_of_two = (expected != 0) & (expected.abs().log2() % 1 == 0)
    assert torch.equal(ours[~power_of_two], expected[~power_of_two])
    halved = ours[power_of_two] * torch.where(ours[power_of_two] == expected[power_of_two], 1, 2)
    assert torch.equal(halved, expected[power_of_two])
