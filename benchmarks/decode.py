"""Decoding on one GPU: plain decoding against the HBM roofline, one speculative round split by
stage, break-even acceptance lengths, and transformers' ``generate`` as the peer.

The target is shaped like Llama-3.1-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads,
intermediate 14336, vocabulary 128256) with random bf16 weights, and the draft like an EAGLE-3
head for it (one layer, a 32000-token draft vocabulary). Random weights make acceptance
meaningless, so speculative decoding is reported as what a round costs and the acceptance length
at which it breaks even with plain decoding: ``round time / plain step time`` (a round emits
its acceptance length in tokens where plain decoding emits one).

- plain: tokens/s of the decode loop (``pipeline.decode`` as CUDA graphs, one device-to-host
  copy per step, as the scheduler does), for a 512-token prompt and 256 new tokens; the roofline
  is the bytes a step must read (every weight but the embedding table, plus the KV cache at the
  mean context) over the copy bandwidth measured in the same run.
- round split: each stage captured alone and replayed (median of device-event timings); the
  model floor is the target's tree forward with its logits plus the draft's forwards with
  theirs; host work is the full round's call from Python (padding, replay, output gather, one
  device-to-host copy) minus its replay.
- peer: transformers' ``generate`` on the same weights with a static cache, greedy, eager.

- profile (``--profile``): the device kernels of one eager plain step and one eager chain-3 round
  at batch 1, by total time, to show what the time over the floor is spent on.

- adaptive (``--adaptive``): decode tokens/s of the scheduler's loop for plain decoding, fixed
  chains of 1, 3 and 5 draft tokens and adaptive speculation over depths 0, 1, 3, 5, at batch
  sizes 1, 4, 16, 32, 64 (``--adaptive-batches``), with two drafts: the random EAGLE-3 head
  (greedy; it accepts nothing) and a draft of controlled acceptance (``markov_models``: a
  target whose next token follows a fixed permutation of the last one with probability about
  ``--acceptance`` at temperature 1, and an EAGLE-1 head that drafts that permutation;
  sampled at temperature 1). A row's prompts are prefilled in one chunk, so its requests
  decode together in full rounds to the end. Each configuration runs its workload on its
  own engine once to warm up (graph capture, and adaptive's first measurements), then
  ``--passes`` times (default 3), the row's engines taking turns pass by pass (the GPU's
  speed drifts), and reports the median pass; ``spread`` is the widest fastest-over-slowest
  ratio, less 1, among the row's configurations (differences smaller than it are noise).
  ``--adaptive-drafts`` picks the drafts whose rows run (default both). The loop is
  synchronous unless ``--adaptive-overlap`` overlaps every configuration's.
  ``--host-profile`` prints, per row, the host's functions by their own time (cProfile) over
  one more pass of the plain, the chain-3 and the adaptive engine, each after a pass with its
  decode timed on the device (the device's and the host's milliseconds per step).
- overlap (``--overlap``): the same loop, synchronous against overlapped
  (``EngineConfig.overlap``), for plain decoding and a chain-3 round of the controlled draft
  at batch 1 and 32 (``--overlap-batches``), with the scheduler's host time per step and the
  part of it the overlapped loop hides; and, timed on the device (CUDA events around each
  round), the time per step the device spends outside its rounds, waiting for the host,
  synchronous and overlapped (``idle removed``: the share of it overlapping removes).

- fp8 (``--fp8 channel|tensor|block``): plain decoding over the bf16 target, then over the same
  weights quantized to FP8 in place (``models.fp8.quantize_``: per-channel, per-tensor or
  DeepSeek's 128 x 128 block scales), with each one's weight bytes, roofline, peak GPU memory
  and the FP8 kernel its decode steps run (``kernels.fp8.cuda_kernel``: the Triton
  matrix-vector kernel up to 16 rows, ``_scaled_mm`` or the dequantizing reference above).

- half-precision GEMV (``--half-gemv qkv,o [all ...]``): plain decoding with every projection
  on cuBLAS (``off``), then with each given set of projection kinds
  (``EngineConfig.half_gemv``: ``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``, or ``all``)
  on the Triton matrix-vector kernel at decode rows (``kernels.half``), each at every batch
  size of ``--batches``, with its tokens/s over the ``off`` row's (``on/off``); with
  ``--profile``, the batch-1 kernel profiles of ``off`` and of the last set.

- multi-step (``--decode-steps 1,4,8``): the scheduler's loop for plain decoding of K steps
  per round (one CUDA graph; ``SpecOptions.decode_steps``) at batch sizes 1, 8, 64
  (``--decode-batches``), each K against single steps in the same run: tokens/s, speedup,
  time per step and per token, and the host's time per step; synchronous, or overlapped with
  ``--decode-overlap``. ``--shape small`` is the zoo's ``small`` target (28M parameters, where
  the host's time per step matters most); the default the 8B shape.

- ragged verify (``--ragged-verify``): a DSPARK-style chain verify of a block of
  ``--ragged-width`` draft tokens per request (plus its root) over a ``--prompt``-token
  context, at batch sizes 1, 8, 32, 64 (``--ragged-batches``), with a budget of ``N`` draft
  tokens over the batch (``--ragged-budgets``, per request: ``N = per_request * batch``,
  spread unevenly over the rows): the target's forward and logits (verify's model work,
  ``spec.verify.target_logits``) over the padded ``[batch, width + 1]`` rows against the
  packed ``batch + N`` verified tokens, each a CUDA graph replayed (median of device events).

- MLA kernels (``--mla-kernels``, an MLA ``--shape`` such as ``deepseek-v2-lite``): the
  scheduler's synchronous loop (CUDA graphs) for plain decoding (one step a round) and a NextN
  chain-3 round (the random MTP head, greedy) at batch sizes 1, 8, 32 (``--mla-batches``),
  with the target's latent attention run by the Triton kernel and by flashinfer's MLA kernel
  planned on the host (``EngineConfig.mla_kernel``): decode tokens/s of each and their ratio
  (interleaved passes, the median; ``spread`` as in ``--adaptive``).

``--adaptive``, ``--overlap``, ``--fp8``, ``--half-gemv``, ``--decode-steps``,
``--ragged-verify`` and ``--mla-kernels`` run only their own tables.
Every other plain row times single steps (``decode_steps=1``: one token per decode call).

Run on the GPU: ``python benchmarks/decode.py`` (``--batches 1,8`` to narrow it; ``--tiny`` for
a CPU smoke run of the script itself, whose numbers mean nothing). ``--tp 2`` shards target and
draft over two GPUs (two worker processes started by the script, or ``torchrun
--nproc-per-node 2 benchmarks/decode.py``); times are rank 0's, the roofline is one GPU's
shard of the weights and KV cache over one GPU's bandwidth. ``--shape`` picks another target:
``deepseek-v2-lite`` (latent attention and MoE, an MTP head), ``nemotron-h-8b`` (a hybrid of
Mamba-2, attention and MLP layers) or ``qwen3-next-like`` (gated DeltaNet and gated attention
with MoE, Qwen3-Next-80B's layers with a quarter of its experts, an MTP head); a hybrid's
roofline adds each request's recurrent states, read and written once a step. A hybrid's
recurrent layers run the Triton kernels (``kernels.triton_recurrent``) on the GPU;
``--recurrent-kernels reference`` runs the ``spec.recurrent`` reference (a Python loop of small
ops per query) instead, for the baseline rows.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import itertools
import math
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

os.environ.pop("SPECULUM_TYPECHECK", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from speculum.kernels import fp8 as fp8_ops  # noqa: E402
from speculum.kernels import recurrent as recurrent_ops  # noqa: E402
from speculum.models.config import (  # noqa: E402
    NEMOTRON_H_KINDS,
    DecoderConfig,
    LinearAttentionConfig,
    MambaConfig,
    MLAConfig,
    MoEConfig,
)
from speculum.models.decoder import (  # noqa: E402
    GEMV_KINDS,
    DecoderModel,
    Fp8Linear,
    SparseMoE,
    cache_kv_heads,
    fuse_projections_,
)
from speculum.models.draft import build_draft, draft_config  # noqa: E402
from speculum.models.fp8 import Fp8Scheme, quantize_  # noqa: E402
from speculum.models.loading import randomize_  # noqa: E402
from speculum.models.parallel import shard_  # noqa: E402
from speculum.pipelines import adaptive, eagle  # noqa: E402
from speculum.pipelines.adaptive import AdaptivePolicy  # noqa: E402
from speculum.runtime import distributed, scheduler  # noqa: E402
from speculum.runtime.default_model import TINY_CONFIG  # noqa: E402
from speculum.runtime.engine import Engine, SpecOptions, engine_from_model  # noqa: E402
from speculum.runtime.generate import acceptance_stats, run_to_completion  # noqa: E402
from speculum.runtime.graphs import capture, pad_batch  # noqa: E402
from speculum.runtime.mla_kernel import MLA_KERNELS, UnsupportedKernel  # noqa: E402
from speculum.spec import recurrent as spec_recurrent  # noqa: E402
from speculum.spec.draft import draft_extend, draft_forward, no_ancestors, propose  # noqa: E402
from speculum.spec.paged import extend_batch, tail_batch  # noqa: E402
from speculum.spec.tree import build_tree, chain_tree, tree_mask  # noqa: E402
from speculum.spec.verify import target_logits  # noqa: E402
from speculum.state.kv import PagedKV  # noqa: E402
from speculum.state.parallel import SINGLE, TensorParallel  # noqa: E402
from speculum.state.record import replace  # noqa: E402
from speculum.training.target import SIZES  # noqa: E402

LLAMA_8B = attrs.evolve(
    TINY_CONFIG,
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    eos_token_ids=(),
    bos_token_id=None,
    dtype="bfloat16",
)
#: The sizes of the CPU smoke-run stand-ins (``--tiny``).
TINY_SIZES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
#: The CPU smoke-run stand-in: same code paths, tiny sizes.
TINY = attrs.evolve(LLAMA_8B, **TINY_SIZES)
#: DeepSeek-V2-Lite's shape (``--shape deepseek-v2-lite``): 27 layers of multi-head latent
#: attention (16 heads, kv_lora_rank 512, rope 64, YaRN 40x), layer 0 dense (10944 wide), the
#: others 64 routed experts (1408 wide, top 6, softmax, not renormalised) plus 2 shared. Its
#: draft is a NextN layer of the same kind (an MLA + MoE layer: ``random_draft(target, "mtp")``).
DEEPSEEK_V2_LITE = attrs.evolve(
    LLAMA_8B,
    architecture="DeepseekV2ForCausalLM",
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    num_layers=27,
    num_heads=16,
    num_kv_heads=16,
    head_dim=64,
    rope_theta=10000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    max_position_embeddings=163840,
    mla=MLAConfig(
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    moe=MoEConfig(
        num_experts=64,
        top_k=6,
        expert_intermediate_size=1408,
        norm_topk_prob=False,
        dense_layers=(0,),
        n_shared_experts=2,
        float32_router=True,
    ),
)
#: The zoo's ``small`` target (``training.target.SIZES["small"]``, its 8192-id vocabulary):
#: ~28M parameters, whose steps are short enough for the host's time per step to matter.
SMALL = attrs.evolve(
    LLAMA_8B, vocab_size=8192, rope_theta=10000.0, tie_word_embeddings=True, **SIZES["small"]
)
#: Nemotron-H-8B's shape (``--shape nemotron-h-8b``): 52 layers of one mixer each, 24 Mamba-2
#: (128 heads of 64, state 128, 8 groups, conv 4), 4 attention without rotary embedding (32
#: heads, 8 KV heads of 128) and 24 squared-ReLU MLPs (21504 wide); vocabulary 131072. The
#: pattern spreads the 4 attention layers over the first two thirds, as the released 8B does.
NEMOTRON_H_8B = attrs.evolve(
    LLAMA_8B,
    architecture="NemotronHForCausalLM",
    vocab_size=131072,
    intermediate_size=21504,
    num_layers=52,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    mamba=MambaConfig(
        layer_types=tuple(NEMOTRON_H_KINDS[c] for c in "M-M-M-M*-" * 4 + "M-" * 8),
        num_heads=128,
        head_dim=64,
        state_size=128,
        n_groups=8,
        conv_kernel=4,
        conv_bias=True,
        proj_bias=False,
        time_step_limit=(0.0, float("inf")),
    ),
)
#: A Qwen3-Next-80B-A3B-like shape (``--shape qwen3-next-like``): its 48 layers, three gated
#: DeltaNet layers (16 key heads and 32 value heads of 128, conv 4) to one gated attention
#: layer (16 heads, 2 KV heads of 256, a quarter rotary), each with a mixture of experts
#: (top 10, 512 wide, plus a 512-wide shared expert); vocabulary 151936. It keeps 128 of the
#: 512 experts so that the bf16 weights fit one H200 (a token reads as many).
QWEN3_NEXT_LIKE = attrs.evolve(
    LLAMA_8B,
    architecture="Qwen3NextForCausalLM",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5120,
    num_layers=48,
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    rope_theta=10000000.0,
    rms_norm_eps=1e-6,
    qk_norm=True,
    partial_rotary_factor=0.25,
    attention_output_gate=True,
    norm_offset=1.0,
    linear=LinearAttentionConfig(
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 12,
        num_k_heads=16,
        num_v_heads=32,
        k_dim=128,
        v_dim=128,
        conv_kernel=4,
    ),
    moe=MoEConfig(
        num_experts=128,
        top_k=10,
        expert_intermediate_size=512,
        norm_topk_prob=True,
        shared_expert_intermediate_size=512,
    ),
)
#: ``--shape`` -> the target's config.
SHAPES = {
    "llama-3.1-8b": LLAMA_8B,
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    "nemotron-h-8b": NEMOTRON_H_8B,
    "qwen3-next-like": QWEN3_NEXT_LIKE,
    "small": SMALL,
}
#: ``--shape`` -> its CPU smoke-run stand-in (``--tiny``).
TINY_SHAPES = {
    "llama-3.1-8b": TINY,
    "small": TINY,
    "deepseek-v2-lite": attrs.evolve(
        DEEPSEEK_V2_LITE,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        mla=MLAConfig(
            q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8
        ),
        moe=attrs.evolve(DEEPSEEK_V2_LITE.moe, num_experts=8, top_k=2, expert_intermediate_size=16),
    ),
    "nemotron-h-8b": attrs.evolve(
        NEMOTRON_H_8B,
        **TINY_SIZES,
        mamba=attrs.evolve(
            NEMOTRON_H_8B.mamba,
            layer_types=tuple(NEMOTRON_H_KINDS[c] for c in "M*M-"),
            num_heads=4,
            head_dim=16,
            state_size=16,
            n_groups=2,
        ),
    ),
    "qwen3-next-like": attrs.evolve(
        QWEN3_NEXT_LIKE,
        **TINY_SIZES,
        linear=attrs.evolve(
            QWEN3_NEXT_LIKE.linear,
            layer_types=("linear_attention", "full_attention") * 2,
            num_k_heads=2,
            num_v_heads=4,
            k_dim=16,
            v_dim=16,
        ),
        moe=attrs.evolve(
            QWEN3_NEXT_LIKE.moe,
            num_experts=8,
            top_k=2,
            expert_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
}
DRAFT_VOCAB = 32000
#: Plain decoding one step per decode call, whatever the device's default (the rows that time
#: a step, and the plain rows of the scheduling tables, as they were measured before).
SINGLE_STEPS = SpecOptions(decode_steps=1)
#: (label, num_steps, topk, num_draft_tokens) of the speculative rounds measured.
ROUNDS = (("chain 3", 3, 1, 4), ("chain 5", 5, 1, 6), ("tree 8", 4, 4, 8))


@contextlib.contextmanager
def building_on(device: str, dtype: torch.dtype) -> Iterator[None]:
    """Modules constructed inside are allocated on ``device`` in ``dtype`` directly."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)


def build_models(
    config: DecoderConfig, device: str, dtype: torch.dtype, tp: TensorParallel = SINGLE
) -> tuple[Any, Any]:
    """The random target and an EAGLE-3 head for it (draft ids a random subset of the
    target's), both this rank's shard of ``tp``: every rank draws the same full weights and
    keeps its slices, so any ``tp`` runs the same model. A mixture-of-experts target gets an
    MTP (NextN) head instead: a layer of the target's own kind, as DeepSeek and Qwen3-Next ship
    it (Qwen3-Next's a gated full-attention MoE layer; Nemotron-H's MTP layer is not built,
    docs/hybrid.md)."""
    with building_on(device, dtype):
        target = DecoderModel(config)
    randomize_(target, seed=0, std=0.02)
    target.reset_rope()
    shard_(target, tp)  # before the head is built: it borrows the sharded embedding and lm_head
    algorithm = "mtp" if config.moe is not None and config.mamba is None else "eagle3"
    vocab = {"draft_vocab_size": min(DRAFT_VOCAB, config.vocab_size // 2)}
    with building_on(device, dtype):
        head_config = draft_config(config, algorithm, **(vocab if algorithm == "eagle3" else {}))
        head = build_draft(head_config, target)
    randomize_(head, seed=1, std=0.02)
    head.reset_buffers()
    shard_(head, tp)
    if algorithm == "eagle3":
        ids = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(2))
        head.set_target_ids(ids[: head.config.head_vocab_size].sort().values.to(device))
    return target.eval().requires_grad_(False), head.eval().requires_grad_(False)


def median_ms(run: Callable[[], Any], device: str, repeat: int) -> float:
    """Median milliseconds of ``run()``: device events on CUDA, the host clock on the CPU."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            run()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def stage_ms(fn: Callable[..., Any], args: tuple[Any, ...], device: str, repeat: int) -> float:
    """Median time of one stage call: its CUDA-graph replay on CUDA, eager on the CPU."""

    def tensors_out(*inputs: Any) -> list[torch.Tensor]:
        # A capture returns tensors alone; a greedy draft returns no draft probabilities (None).
        return [x for x in pytree.tree_leaves(fn(*inputs)) if isinstance(x, torch.Tensor)]

    if device != "cuda":
        return median_ms(lambda: tensors_out(*args), device, repeat)
    graph = capture(tensors_out, args).graph
    return median_ms(graph.replay, device, repeat)


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written)."""
    size = (1 << 30) if device == "cuda" else (1 << 24)
    buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(4)]
    for b in buffers:
        b.random_(0, 255)

    def copy_twice() -> None:
        buffers[1].copy_(buffers[0])
        buffers[3].copy_(buffers[2])

    ms = median_ms(copy_twice, device, 20)
    return 4 * size / (ms / 1e3)


def step_bytes(target: DecoderModel, batch: int, context: float) -> float:
    """Bytes one plain decode step must read: every weight but the embedding table (a step reads
    only ``batch`` of its rows) and but the routed experts no token can select (a sparse layer
    reads at most ``min(experts, batch * top_k)`` of them), plus the cache of ``context`` tokens
    per request (K and V per head; for latent attention the latent and rotary key)."""
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    embedding = target.model.embed_tokens.weight
    if embedding is not target.lm_head.weight:
        weights -= embedding.numel() * embedding.element_size()
    for moe in (m for m in target.modules() if isinstance(m, SparseMoE)):
        experts = moe.experts_gate_up, moe.experts_down
        unread = max(0, moe.num_experts - batch * moe.moe.top_k) / moe.num_experts
        weights -= unread * sum(t.numel() * t.element_size() for t in experts)
    c = target.config
    if c.mla is not None:
        per_layer = c.mla.cache_dim
    else:
        per_layer = 2 * cache_kv_heads(target, c.num_kv_heads) * c.head_dim  # this rank's heads
    cache = batch * context * c.num_kv_layers * per_layer * embedding.element_size()
    if not c.is_hybrid:
        return weights + cache
    # A hybrid's recurrent layers read their states (conv and float32 SSM) and write them back.
    states = target.new_pool(2, 1, state_slots=2, state_ring=2).recurrent
    per_request = sum(t[:, 1, 0].numel() * t.element_size() for t in (states.conv, states.ssm))
    return weights + cache + 2 * batch * per_request


def make_engine(
    target,
    head,
    batch: int,
    context: int,
    rounds: tuple[int, int, int] | None,
    fuse: bool = True,
    half_gemv: tuple[str, ...] = (),
) -> Engine:
    """A plain engine (``rounds`` None) or a speculative engine of ``head``'s algorithm
    (EAGLE-3, or MTP for an MoE target) with that (steps, topk, tokens);
    ``fuse`` fuses the models' projections (in place, for every later engine too),
    ``half_gemv`` names the projections run by the Triton matrix-vector kernel."""
    spec = (
        SINGLE_STEPS
        if rounds is None
        else SpecOptions(num_steps=rounds[0], topk=rounds[1], num_draft_tokens=rounds[2])
    )
    return engine_from_model(
        target,
        algorithm="plain" if rounds is None else head.algorithm,
        draft=None if rounds is None else head,
        spec=spec,
        max_batch=batch,
        max_context=context,
        prefill_budget=2048,
        graph_buckets=(batch,),
        fuse_projections=fuse,
        half_gemv=half_gemv,
    )


def running(engine: Engine, batch: int, prompt: int, new_tokens: int) -> Any:
    """A scheduler state with ``batch`` random prompts prefilled and decoding."""
    generator = torch.Generator().manual_seed(batch)
    vocab = engine.resources.target.config.vocab_size
    state = scheduler.new_state(engine)
    for _ in range(batch):
        ids = torch.randint(0, vocab, (prompt,), generator=generator).tolist()
        state, _ = scheduler.add_request(
            engine, state, ids, max_new_tokens=new_tokens, ignore_eos=True
        )
    while state.waiting or state.prefilling:
        state, _ = scheduler.step(engine, state)
    return state


def plain_row(
    target,
    head,
    batch: int,
    args,
    bandwidth: float,
    device: str,
    fuse: bool = True,
    half_gemv: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Plain decoding's tokens/s over ``args.new_tokens`` steps, and its roofline ratio."""
    context = args.prompt + args.new_tokens + 64
    engine = make_engine(target, head, batch, context, None, fuse, half_gemv)
    state = running(engine, batch, args.prompt, args.new_tokens + 8).batch
    decode = engine.pipeline.decode
    state, _ = decode(engine.resources, state)  # capture outside the timed loop
    sync(device)
    begin = time.perf_counter()
    for _ in range(args.new_tokens):
        state, out = decode(engine.resources, state)
        out.tokens.tolist()  # the scheduler's one device-to-host copy per step
    seconds = time.perf_counter() - begin
    step_ms = seconds / args.new_tokens * 1e3
    context = args.prompt + args.new_tokens / 2
    roofline_ms = step_bytes(target, batch, context) / bandwidth * 1e3
    return {
        "batch": batch,
        "projections": "fused" if fuse else "separate",
        "tok/s": batch * args.new_tokens / seconds,
        "ms/step": step_ms,
        "roofline ms": roofline_ms,
        "of roofline": roofline_ms / step_ms,
    }


def sync(device: str) -> None:
    """Wait for the device (a no-op on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def round_row(target, head, batch: int, label, rounds, args, plain_ms: float, device: str):
    """One EAGLE-3 round at ``batch``: per-stage times, model floor, host work, break-even."""
    engine = make_engine(target, head, batch, args.prompt + args.new_tokens + 64, rounds)
    state = running(engine, batch, args.prompt, args.new_tokens).batch
    res, n = engine.resources, args.repeat
    config = eagle.round_config(
        num_steps=rounds[0],
        topk=rounds[1],
        num_draft_tokens=rounds[2],
        vocab_size=head.draft_vocab_size,
    )
    padded = pad_batch(state, batch)
    candidates, draft_probs = propose(res, padded, config)
    tree = build_tree(candidates, padded.root_tokens, config.num_draft_tokens)
    verified = eagle.verify(res, padded, tree, config, draft_probs)
    times = {
        "draft": stage_ms(lambda s: propose(res, s, config), (padded,), device, n),
        "build_tree": stage_ms(
            lambda c, r: build_tree(c, r, config.num_draft_tokens),
            (candidates, padded.root_tokens),
            device,
            n,
        ),
        "verify+accept": stage_ms(
            lambda s, t: eagle.verify(res, s, t, config, draft_probs), (padded, tree), device, n
        ),
        "draft-extend": stage_ms(
            lambda s, v: draft_extend(res, s, v, config), (padded, verified), device, n
        ),
        "commit": stage_ms(
            lambda s, a: eagle.commit(res, s, a), (padded, verified.accepted), device, n
        ),
    }
    target_ms = stage_ms(functools.partial(target_tree_forward, res), (padded, tree), device, n)
    times["accept"] = times["verify+accept"] - target_ms
    times["verify"] = target_ms
    del times["verify+accept"]
    floor = target_ms + draft_floor_ms(res, padded, config, device, n)
    decode = engine.pipeline.decode
    call_ms = median_ms(lambda: decode(res, state)[1].tokens.tolist(), device, n)
    replay = decode.graphs[0][2].captured.graph.replay if device == "cuda" else None
    replay_ms = median_ms(replay, device, n) if replay else call_ms
    times["host"] = call_ms - replay_ms
    return {
        "batch": batch,
        "round": label,
        **{
            k: times[k]
            for k in ("draft", "build_tree", "verify", "accept", "commit", "draft-extend", "host")
        },
        "round ms": call_ms,
        "model floor": floor,
        "non-model": 1 - floor / call_ms,
        "break-even AL": call_ms / plain_ms,
    }


def target_tree_forward(res, state, tree):
    """The target's forward over a tree and its logits: verify's model work alone."""
    positions = state.kv.seq_lens[:, None] + tree.depths
    batch = tail_batch(state.kv, tree.tokens, positions, tree_mask(tree))
    hidden, captured = res.target(batch, res.target_pool, res.draft.capture_layers)
    return res.target.logits(hidden), captured


def draft_floor_ms(res, state, config, device: str, repeat: int) -> float:
    """The draft's model work in a round: ``num_steps - 1`` drafting forwards over ``topk``
    nodes and one draft-extend forward over ``num_steps + 1`` tokens, each with its logits."""
    k, kv = config.topk, replace(state.kv, seq_lens=state.kv.seq_lens + res.draft.ahead)
    tokens = state.prediction.top_tokens
    hidden = state.prediction.hidden[:, None, :].expand(-1, k, -1).contiguous()

    def step(tokens, hidden):
        out, _ = draft_forward(res, kv, 1, tokens, hidden, no_ancestors(kv, k))
        return res.draft.logits(out)

    width = config.num_steps + 1
    ext_tokens = state.root_tokens[:, None].expand(-1, width).contiguous()
    ext_hidden = state.prediction.hidden[:, None, :].expand(-1, width, -1).contiguous()

    def extend(tokens, hidden):
        batch = extend_batch(kv, tokens, torch.full_like(kv.seq_lens, width))
        return res.draft.logits(res.draft(batch, res.draft_pool, hidden))

    steps = (config.num_steps - 1) * stage_ms(step, (tokens, hidden), device, repeat)
    return steps + stage_ms(extend, (ext_tokens, ext_hidden), device, repeat)


def hf_copy(target):
    """transformers' ``LlamaForCausalLM`` holding ``target``'s weights (loaded strictly)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = target.config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
    )
    device = target.lm_head.weight.device
    with building_on(device.type, target.lm_head.weight.dtype):
        hf = LlamaForCausalLM(hf_config)
    hf.load_state_dict(target.state_dict(), strict=True)
    return hf.eval()


def peer_row(hf, batch: int, args, device: str) -> dict[str, Any]:
    """transformers' greedy ``generate`` with a static cache, eager (its automatic
    torch.compile of static-cache decoding is switched off: it recompiles for every cache
    length, which a fixed-budget run cannot amortise), decode tokens/s."""
    try:
        ids = torch.randint(0, hf.config.vocab_size, (batch, args.prompt), device=device)

        def run(new_tokens: int) -> float:
            sync(device)
            begin = time.perf_counter()
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                cache_implementation="static",
                disable_compile=True,
                pad_token_id=0,
            )
            sync(device)
            return time.perf_counter() - begin

        run(4)  # warm-up
        total, prefill = run(args.new_tokens), run(1)
        seconds = max(total - prefill, 1e-9)
        return {"batch": batch, "tok/s": batch * (args.new_tokens - 1) / seconds}
    except Exception as error:  # the peer's failure must not lose the rest of the run
        return {"batch": batch, "tok/s": float("nan"), "error": f"{type(error).__name__}: {error}"}


def profile(target, head, args, device: str, half_gemv: tuple[str, ...] = ()) -> str:
    """Kernel-time tables (torch.profiler) of eager plain steps and eager chain-3 rounds at
    batch 1, the projections of ``half_gemv`` on the Triton GEMV; eager so that every kernel
    is attributed, the launch gaps aside."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    sections = []
    for label, rounds in (("plain step", None), ("eagle3 chain-3 round", ROUNDS[0][1:])):
        context = args.prompt + args.new_tokens + 64
        engine = make_engine(target, head, 1, context, rounds, half_gemv=half_gemv)
        state = running(engine, 1, args.prompt, args.new_tokens).batch
        decode = engine.pipeline.decode
        decode = getattr(decode, "decode", decode)  # the eager round under the graph wrapper
        for _ in range(3):
            state, _ = decode(engine.resources, state)
        sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profiler(activities=activities) as prof:
            for _ in range(5):
                state, out = decode(engine.resources, state)
                out.tokens.tolist()
        sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        top = prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60)
        sections.append(f"### {label} x5\n\n```\n{top}\n```")
    return "\n\n".join(sections)


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of ``rows`` (floats to 4 significant digits)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))

    def cell(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    """Parse the options and run every measurement: in this process, or in ``--tp`` worker
    processes started here (unless torchrun started this one), whose rank 0 prints."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny model")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="llama-3.1-8b",
        help="the target's shape (DeepSeek-V2-Lite drafts with its NextN layer kind, the others "
        "with an EAGLE-3 head)",
    )
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--profile", action="store_true", help="print kernel profiles last")
    parser.add_argument(
        "--tp",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="shard target and draft over N processes, one GPU each (default: torchrun's count)",
    )
    parser.add_argument(
        "--compare-unfused",
        action="store_true",
        help="first a plain row with separate q/k/v and gate/up projections, at the first batch",
    )
    parser.add_argument("--adaptive", action="store_true", help="adaptive vs fixed steps only")
    parser.add_argument("--overlap", action="store_true", help="sync vs overlap only")
    parser.add_argument("--adaptive-batches", default="1,4,16,32,64")
    parser.add_argument(
        "--adaptive-drafts",
        default="markov,random",
        help="with --adaptive: the drafts whose rows to run (markov, random or both)",
    )
    parser.add_argument(
        "--adaptive-overlap",
        action="store_true",
        help="schedule every --adaptive configuration overlapped (default: synchronously)",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="with --adaptive: cProfile one more pass of the plain, chain-3 and adaptive engines",
    )
    parser.add_argument(
        "--passes", type=int, default=3, help="timed passes per --adaptive/--overlap row (median)"
    )
    parser.add_argument("--overlap-batches", default="1,32")
    parser.add_argument(
        "--fp8",
        choices=sorted(FP8_SCHEMES),
        help="plain decoding bf16 vs the same weights in FP8 with these scales, only",
    )
    parser.add_argument(
        "--half-gemv",
        nargs="+",
        type=gemv_kinds,
        help="plain decoding only: every projection on cuBLAS, then each given set of "
        "projection kinds (comma-separated, or all) on the Triton GEMV, e.g. qkv,o all",
    )
    parser.add_argument(
        "--decode-steps",
        help="multi-step plain decoding only: steps per round to compare with 1, e.g. 4,8",
    )
    parser.add_argument("--decode-batches", default="1,8,64")
    parser.add_argument(
        "--decode-overlap", action="store_true", help="schedule --decode-steps rows overlapped"
    )
    parser.add_argument(
        "--acceptance", type=float, default=0.7, help="per-token acceptance of the markov draft"
    )
    parser.add_argument(
        "--recurrent-kernels",
        choices=["triton", "reference"],
        default="triton",
        help="a hybrid's recurrent layers on the GPU: the Triton kernels, or spec.recurrent's "
        "token-by-token reference (the baseline)",
    )
    parser.add_argument(
        "--ragged-verify", action="store_true", help="padded vs packed ragged verify only"
    )
    parser.add_argument("--ragged-batches", default="1,8,32,64")
    parser.add_argument("--ragged-width", type=int, default=7, help="draft tokens per block")
    parser.add_argument(
        "--ragged-budgets", default="1,2,4", help="verified draft tokens per request, on average"
    )
    parser.add_argument(
        "--mla-kernels",
        action="store_true",
        help="latent attention Triton vs flashinfer only (an MLA --shape: deepseek-v2-lite)",
    )
    parser.add_argument("--mla-batches", default="1,8,32")
    args = parser.parse_args()
    if args.tp > 1 and not distributed.launched():
        distributed.launch(functools.partial(measure, args), args.tp)
    else:
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """Every measurement ``args`` asks for, printed as tables by rank 0 (transformers' peer is
    left out under tensor parallelism: it runs unsharded)."""
    device = "cpu" if args.tiny else "cuda"
    if args.recurrent_kernels == "reference" and device == "cuda":
        use_reference_recurrence()
    tp = distributed.tensor_parallel(args.tp, device)
    report = print if tp.is_leader else lambda *_, **__: None
    config = (TINY_SHAPES if args.tiny else SHAPES)[args.shape]
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.adaptive or args.overlap:
        scheduling_tables(config, device, dtype, args)
        return
    if args.decode_steps:
        multi_step_table(config, device, dtype, args)
        return
    if args.ragged_verify:
        ragged_table(config, device, dtype, args)
        return
    if args.mla_kernels:
        mla_kernel_table(config, device, dtype, args)
        return
    if args.fp8 and (tp.size > 1 or config.moe is not None):
        raise SystemExit("--fp8 runs one device and a dense target (docs/fp8.md)")
    target, head = build_models(config, device, dtype, tp)
    if args.fp8:
        fp8_table(target, head, args, device)
        return
    if args.half_gemv:
        half_gemv_table(target, head, args, device)
        return
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report(
        f"device: {name} x tp {tp.size}; copy bandwidth {bandwidth / 1e9:.0f} GB/s per device; "
        f"torch {torch.__version__}"
    )
    batches = [int(b) for b in args.batches.split(",")]
    plain, rounds, peers = [], [], []
    begin = time.perf_counter()
    if args.compare_unfused:  # before any engine fuses the shared models in place
        row = plain_row(target, head, batches[0], args, bandwidth, device, fuse=False)
        plain.append(row)
        report(table([row]), flush=True)
    for batch in batches:
        row = plain_row(target, head, batch, args, bandwidth, device)
        plain.append(row)
        report(table([row]), flush=True)
        for label, *shape in ROUNDS:
            r = round_row(target, head, batch, label, tuple(shape), args, row["ms/step"], device)
            rounds.append(r)
            report(table([r]), flush=True)
        report(f"batch {batch} done at {time.perf_counter() - begin:.0f} s", flush=True)
    if not args.no_peer and tp.size == 1 and config.architecture == "LlamaForCausalLM":
        hf = hf_copy(target)
        for row in (r for r in plain if r["projections"] == "fused"):
            peer = peer_row(hf, row["batch"], args, device)
            peer["ours/peer"] = row["tok/s"] / peer["tok/s"]
            peers.append(peer)
            report(table([peer]), flush=True)
        del hf
    report("\n## plain decoding\n\n" + table(plain))
    report(f"\n## speculative round ({head.algorithm} head), ms\n\n" + table(rounds))
    if peers:
        report(
            "\n## transformers generate (static cache, eager), decode tokens/s\n\n" + table(peers)
        )
    if args.profile:
        report("\n## profile, batch 1\n\n" + profile(target, head, args, device))


def use_reference_recurrence() -> None:
    """Make the recurrent ops' CUDA kernels ``spec.recurrent``'s references, in place of the
    Triton kernels ``speculum.kernels`` registered (this process only)."""
    recurrent_ops.gated_delta_rule.register_kernel("cuda")(spec_recurrent.gated_delta_rule)
    recurrent_ops.mamba2_scan.register_kernel("cuda")(spec_recurrent.mamba2_scan)


#: ``--fp8`` choice -> the scheme the target's linear layers are quantized with.
FP8_SCHEMES = {
    "channel": Fp8Scheme(method="compressed-tensors", strategy="channel"),
    "tensor": Fp8Scheme(method="fp8", strategy="tensor"),
    "block": Fp8Scheme(method="fp8", strategy="block", block=(128, 128)),
}


def fp8_table(target, head, args, device: str) -> None:
    """Plain decoding at each of ``args.batches`` over the bf16 target, then over its weights
    quantized in place by ``args.fp8``'s scheme: tokens/s, roofline (FP8 weights read as one
    byte each), weight bytes and the peak GPU memory of each row (weights, KV pool, graphs)."""
    bandwidth = copy_bandwidth(device)
    rows = []
    unquantized = str(target.model.embed_tokens.weight.dtype).removeprefix("torch.")
    for weights in (unquantized, f"fp8 {args.fp8}"):
        if weights != unquantized:
            quantize_(target, FP8_SCHEMES[args.fp8])
        weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
        for batch in (int(b) for b in args.batches.split(",")):
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            row = {"weights": weights, "fp8 kernel": fp8_kernel(target, batch, device)}
            row["weight GB"] = weight_bytes / 1e9
            row |= plain_row(target, head, batch, args, bandwidth, device)
            if device == "cuda":
                row["peak GPU GB"] = torch.cuda.max_memory_allocated() / 1e9
            rows.append(row)
            print(table([row]), flush=True)
    print(f"\n## plain decoding, {unquantized} vs FP8 weights\n\n" + table(rows))


def fp8_kernel(target, batch: int, device: str) -> str:
    """The kernel ``speculum::fp8_linear`` runs for a decode step of ``batch`` rows through
    ``target``'s first MLP down projection (``kernels.fp8.cuda_kernel``; ``-`` where it is not
    FP8, ``reference`` off CUDA)."""
    down = target.model.layers[0].mlp.down_proj
    if not isinstance(down, Fp8Linear):
        return "-"
    if device != "cuda":
        return "reference"
    x = torch.empty(batch, down.weight.shape[1], device=device, dtype=torch.bfloat16)
    return fp8_ops.cuda_kernel(x, down.weight, list(down.block))


def gemv_kinds(text: str) -> tuple[str, ...]:
    """``--half-gemv``'s sets: comma-separated projection kinds, ``all`` for every one."""
    return GEMV_KINDS if text == "all" else tuple(t for t in text.split(",") if t)


def half_gemv_table(target, head, args, device: str) -> None:
    """Plain decoding at each of ``args.batches`` with every projection on cuBLAS, then with
    each of ``args.half_gemv``'s sets on the Triton matrix-vector kernel: tokens/s, roofline,
    and tokens/s over the cuBLAS row of the batch (``on/off``); with ``--profile``, the
    kernel profiles at batch 1 with every projection on cuBLAS and with the last set."""
    bandwidth = copy_bandwidth(device)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        off = None
        for kinds in [(), *args.half_gemv]:
            row = {"half_gemv": ",".join(kinds) or "off"}
            row |= plain_row(target, head, batch, args, bandwidth, device, half_gemv=kinds)
            off = off or row["tok/s"]
            row["on/off"] = row["tok/s"] / off
            rows.append(row)
            print(table([row]), flush=True)
    print("\n## plain decoding, cuBLAS vs the Triton GEMV per projection kind\n\n" + table(rows))
    if args.profile:
        for kinds in [(), args.half_gemv[-1]]:
            tables = profile(target, head, args, device, kinds)
            print(f"\n## profile, batch 1, half_gemv {','.join(kinds) or 'off'}\n\n{tables}")


#: Draft depths adaptive speculation chooses among (0: plain rounds that keep the draft caught
#: up); the fixed chains it is compared with are the others.
ADAPTIVE_STEPS = (0, 1, 3, 5)


def markov_models(
    config: DecoderConfig, device: str, dtype: torch.dtype, acceptance: float
) -> tuple[Any, Any]:
    """A target and an EAGLE-1 head whose drafts are accepted with probability ``acceptance``
    per token at temperature 1 (shapes, hence costs, as :func:`build_models`' pair).

    The target's ``lm_head`` reads its unit-variance embedding back through a permutation,
    scaled by ``s``, and its layers' output projections are damped, so its next token is
    ``perm^-1(last)`` with probability about ``sigmoid(s w - ln V - s^2 w / 2)`` (``w`` the
    width, ``V`` the vocabulary: the vote's logit is ``s |e|^2``, the others' are normal with
    variance ``s^2 w``); ``s`` solves that for ``acceptance``. The head passes the token's
    embedding through and reads the same ``lm_head``, so its argmax drafts are that vote and
    each is accepted with the vote's probability.
    """
    with building_on(device, dtype):
        target = DecoderModel(config)
        head = build_draft(draft_config(config, "eagle"), target)
    randomize_(target, seed=0, std=0.02)
    randomize_(head, seed=1, std=0.02)
    target.reset_rope()
    head.reset_buffers()
    w, vocab = config.hidden_size, config.vocab_size
    logit = math.log(vocab) + math.log(acceptance / (1 - acceptance))
    scale = (
        w - math.sqrt(w * w - 2 * w * logit)
    ) / w  # the smaller root of w s^2 / 2 - w s + logit
    generator = torch.Generator(device).manual_seed(2)
    with torch.no_grad():
        embed = target.model.embed_tokens.weight
        embed.normal_(0.0, 1.0, generator=generator)
        perm = torch.randperm(vocab, device=device, generator=generator)
        target.lm_head.weight.copy_(scale * embed[perm])
        for name, param in target.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(0.02)
        head.fc.weight[:, :w] = torch.eye(w, dtype=dtype, device=device)
        head.fc.weight[:, w:] *= 0.1
        for name, param in head.named_parameters():
            if name.endswith("o_proj.weight"):
                param.mul_(0.1)
            elif name.endswith("down_proj.weight"):
                param.zero_()
    return target.eval().requires_grad_(False), head.eval().requires_grad_(False)


def scheduled_engine(
    target,
    head,
    algorithm: str,
    spec: SpecOptions | None,
    batch: int,
    args,
    overlap: bool,
    mla_kernel: str = "triton",
) -> Engine:
    """An engine for the scheduler's loop at ``batch`` (one CUDA-graph bucket). Its prefill
    budget takes every prompt in one chunk, so the requests start decoding together and run
    full rounds to the end: with chunks, the requests prefilled first decode beside the later
    chunks, and a configuration that emits more tokens per round there (a chain, a plain
    round of six steps) leaves more of the timed loop to a tail of rounds with rows already
    finished (at batch 64, 0.94 of plain's tokens/s for rounds 1.16 times as fast per token)."""
    return engine_from_model(
        target,
        algorithm=algorithm,
        draft=head if algorithm != "plain" else None,
        spec=SINGLE_STEPS if spec is None else spec,
        max_batch=batch,
        max_context=args.prompt + args.new_tokens + 64,
        prefill_budget=batch * args.prompt,
        graph_buckets=(batch,),
        overlap=overlap,
        mla_kernel=mla_kernel,
    )


def prefilled(engine: Engine, batch: int, args, temperature: float, device: str):
    """The scheduler's state once ``batch`` random prompts are prefilled (in one chunk, with
    :func:`scheduled_engine`'s budget), the device caught up."""
    generator = torch.Generator().manual_seed(batch)
    vocab = engine.resources.target.config.vocab_size
    sampling = scheduler.Sampling(temperature=temperature, seed=batch)
    state = scheduler.new_state(engine)
    for _ in range(batch):
        ids = torch.randint(0, vocab, (args.prompt,), generator=generator).tolist()
        state, _ = scheduler.add_request(
            engine, state, ids, sampling=sampling, max_new_tokens=args.new_tokens, ignore_eos=True
        )
    while state.waiting or state.prefilling:
        state, _ = scheduler.step(engine, state)
    sync(device)
    return state


def timed_loop(engine: Engine, state, batch: int, args, device: str):
    """The scheduler's loop from ``state`` until each request has ``args.new_tokens`` tokens.
    Returns its seconds, the tokens emitted during it (the device state at its start counts
    what came before, whether or not the host has collected it yet), and the final state and
    finished requests."""
    # Every row's root (or next token) is emitted and not yet in the cache.
    emitted = int((state.batch.kv.seq_lens + 1).sum()) - batch * args.prompt
    begin = time.perf_counter()
    final, finished = run_to_completion(engine, state)
    sync(device)
    seconds = time.perf_counter() - begin
    return seconds, sum(len(r.output) for r in finished.values()) - emitted, final, finished


def round_counts(engine: Engine, batch: int) -> list[int] | None:
    """Rounds adaptive speculation has run per depth at ``batch`` (None: not adaptive)."""
    if engine.resources.goodput is None:
        return None
    goodput = engine.resources.goodput.value.goodput
    return [m.rounds for m in goodput.table[adaptive.range_of(AdaptivePolicy(), batch)]]


@attrs.define(eq=False)
class DeviceClock:
    """Wraps a pipeline's decode to time each round on the device: CUDA events around the call
    for a state on a GPU (read after the pass, so no sync is added), the host clock for one on
    the CPU, where the call has done its work when it returns."""

    decode: Callable[[Any, Any], Any]
    laps: list[Any] = attrs.field(factory=list)
    #: Host seconds spent inside the decode calls (queueing the round) since :meth:`seconds`.
    calls: float = 0.0

    def __call__(self, resources: Any, state: Any) -> Any:
        """Run the round between two marks."""
        begin = time.perf_counter()
        if state.kv.seq_lens.device.type != "cuda":
            out = self.decode(resources, state)
            elapsed = time.perf_counter() - begin
            self.laps.append(elapsed)
            self.calls += elapsed
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.decode(resources, state)
        end.record()
        self.laps.append((start, end))
        self.calls += time.perf_counter() - begin
        return out

    def seconds(self) -> float:
        """Device seconds of the rounds since the last call (waits for them), and forget them
        and the host seconds of their calls."""
        laps, self.laps, self.calls = self.laps, [], 0.0
        if any(isinstance(lap, tuple) for lap in laps):
            torch.cuda.synchronize()
        return sum(
            lap[0].elapsed_time(lap[1]) / 1e3 if isinstance(lap, tuple) else lap for lap in laps
        )


def clocked(engine: Engine) -> tuple[Engine, DeviceClock]:
    """``engine`` with its decode timed by a :class:`DeviceClock`."""
    clock = DeviceClock(engine.pipeline.decode)
    return attrs.evolve(engine, pipeline=attrs.evolve(engine.pipeline, decode=clock)), clock


def loop_rows(
    engines: dict[Any, tuple[Engine, DeviceClock | None]],
    batch: int,
    args,
    temperature: float,
    device: str,
) -> dict[Any, dict[str, Any]]:
    """Per engine (with its :class:`DeviceClock` or ``None``): tokens/s, acceptance length and
    host time per step of the median of ``args.passes`` timed passes after a first that warms
    up (graph capture, and adaptive speculation's first measurements), with their ``spread``
    (fastest over slowest, less 1: a difference between rows smaller than it is noise), and
    for adaptive speculation the share of that pass's rounds that ran each depth. With a clock
    (from :func:`clocked`), also the rounds' device time per step and the time per step the
    device spent outside them, waiting for the host.

    The engines' passes interleave, one pass of each in turn: the GPU's speed drifts over
    minutes (plain decoding at batch 64 moved 12% between processes), and engines timed one
    after another would compare different stretches of that drift."""
    for engine, _ in engines.values():
        start = prefilled(engine, batch, args, temperature, device)
        timed_loop(engine, start, batch, args, device)
    runs: dict[Any, list[dict[str, Any]]] = {name: [] for name in engines}
    for _ in range(args.passes):
        for name, (engine, clock) in engines.items():
            runs[name].append(timed_pass(engine, batch, args, temperature, device, clock))
    rows = {}
    for name, passes in runs.items():
        passes.sort(key=lambda run: run["tok/s"])
        spread = passes[-1]["tok/s"] / passes[0]["tok/s"] - 1
        rows[name] = {**passes[len(passes) // 2], "spread": spread}
    return rows


def timed_pass(
    engine: Engine,
    batch: int,
    args,
    temperature: float,
    device: str,
    clock: DeviceClock | None,
) -> dict[str, Any]:
    """One timed pass of :func:`loop_rows`' workload, from prefill to the last token."""
    start = prefilled(engine, batch, args, temperature, device)
    counts = round_counts(engine, batch)
    if clock is not None:
        # Forget the rounds before the timed loop (the warm-up pass's).
        clock.seconds()
    seconds, tokens, final, finished = timed_loop(engine, start, batch, args, device)
    histogram: list[int] = []
    for request in finished.values():
        lengths = request.round_lengths
        histogram = [a + b for a, b in itertools.zip_longest(histogram, lengths, fillvalue=0)]
    steps = final.num_steps - start.num_steps
    row = {
        "tok/s": tokens / seconds,
        "AL": acceptance_stats(histogram)["accept_length_mean"],
        "ms/step": seconds / steps * 1e3,
        "host ms/step": (final.host_seconds - start.host_seconds) / steps * 1e3,
        "hidden ms/step": (final.hidden_seconds - start.hidden_seconds) / steps * 1e3,
    }
    if clock is not None:
        row["decode call ms/step"] = clock.calls / steps * 1e3
        row["device ms/step"] = clock.seconds() / steps * 1e3
        row["idle ms/step"] = row["ms/step"] - row["device ms/step"]
    if counts is not None:
        ran = [b - a for a, b in zip(counts, round_counts(engine, batch))]
        row["depths run"] = " ".join(
            f"{s}:{n / max(sum(ran), 1):.2f}" for s, n in zip(ADAPTIVE_STEPS, ran) if n
        )
        row["measured tok/s"] = measured_rates(engine, batch)
    return row


def measured_rates(engine: Engine, batch: int) -> str:
    """Adaptive speculation's goodput estimate per depth at ``batch`` when the pass ended
    (what its choice saw; "-" for a depth not measured then)."""
    goodput = engine.resources.goodput.value.goodput
    estimates = adaptive.rates(goodput, AdaptivePolicy(), batch, ADAPTIVE_STEPS)
    return " ".join(
        f"{s}:{'-' if r is None else f'{r:.0f}'}" for s, r in zip(ADAPTIVE_STEPS, estimates)
    )


def adaptive_row(target, head, algorithm, label, batch, args, temperature, device):
    """Plain, each fixed chain and adaptive speculation at ``batch``: tokens/s and acceptance."""
    row: dict[str, Any] = {"draft": label, "batch": batch}

    def profiled(engine: Engine, name: str) -> None:
        if args.host_profile:
            print(f"\n## host profile, {name}, {label} draft, batch {batch}\n")
            print(host_profile(engine, batch, args, temperature, device), flush=True)

    specs = {
        "plain": None,
        **{f"chain {steps}": SpecOptions(num_steps=steps) for steps in ADAPTIVE_STEPS[1:]},
        "adaptive": SpecOptions(adaptive_steps=ADAPTIVE_STEPS),
    }
    engines = {
        name: scheduled_engine(
            target,
            head,
            "plain" if spec is None else algorithm,
            spec,
            batch,
            args,
            args.adaptive_overlap,
        )
        for name, spec in specs.items()
    }
    results = loop_rows(
        {n: (e, None) for n, e in engines.items()}, batch, args, temperature, device
    )
    for name in ("plain", "chain 3", "adaptive"):
        profiled(engines[name], name)
    fixed = {name: results[name]["tok/s"] for name in specs if name != "adaptive"}
    row["plain tok/s"] = fixed["plain"]
    for steps in ADAPTIVE_STEPS[1:]:
        row[f"chain {steps} tok/s"] = results[f"chain {steps}"]["tok/s"]
        row[f"chain {steps} AL"] = results[f"chain {steps}"]["AL"]
    result, best = results["adaptive"], max(fixed, key=fixed.__getitem__)
    row.update(
        {
            "adaptive tok/s": result["tok/s"],
            "adaptive AL": result["AL"],
            "/plain": result["tok/s"] / fixed["plain"],
            "best fixed": best,
            "/best fixed": result["tok/s"] / fixed[best],
            "depths run": result["depths run"],
            "measured tok/s": result["measured tok/s"],
            "spread": max(r["spread"] for r in results.values()),
        }
    )
    return row


#: What :func:`host_profile` reports of its unprofiled pass.
CLOCKED_KEYS = ("ms/step", "device ms/step", "idle ms/step", "host ms/step", "decode call ms/step")


def host_profile(engine: Engine, batch: int, args, temperature: float, device: str) -> str:
    """The host's functions by their own time over one more timed pass of ``engine``
    (cProfile, from the prefilled state to the last token), after an unprofiled pass with the
    decode timed on the device (:class:`DeviceClock`): its device and idle time per step, and
    the host's time inside the decode calls (queueing each round: the adaptive layer's choice
    is there, the scheduler's collection is not). Profiling slows every Python call alike, so
    compare two engines' tables, not their seconds with the unprofiled rows."""
    timed, clock = clocked(engine)
    unprofiled = timed_pass(timed, batch, args, temperature, device, clock)
    start = prefilled(engine, batch, args, temperature, device)
    profiler = cProfile.Profile()
    profiler.enable()
    _, _, final, _ = timed_loop(engine, start, batch, args, device)
    profiler.disable()
    text = io.StringIO()
    text.write(
        "unprofiled pass, decode timed on the device: "
        + ", ".join(f"{key} {unprofiled[key]:.3f}" for key in CLOCKED_KEYS)
        + f"\n{final.num_steps - start.num_steps} scheduler steps profiled\n"
    )
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(20)
    # Adaptive speculation's own functions and the host-device copies and graphs each round
    # pays for, whatever their rank above.
    stats.sort_stats("cumtime").print_stats(r"adaptive\.py|host\.py|graphs\.py|cuda", 25)
    return text.getvalue()


def overlap_row(target, head, label, spec, batch, args, device) -> dict[str, Any]:
    """The same workload scheduled synchronously and overlapped."""
    algorithm = "plain" if spec is None else "eagle"
    engines = {
        overlap: clocked(scheduled_engine(target, head, algorithm, spec, batch, args, overlap))
        for overlap in (False, True)
    }
    runs = loop_rows(engines, batch, args, 1.0, device)
    sync_run, overlapped = runs[False], runs[True]
    return {
        "round": label,
        "batch": batch,
        "sync tok/s": sync_run["tok/s"],
        "overlap tok/s": overlapped["tok/s"],
        "speedup": overlapped["tok/s"] / sync_run["tok/s"],
        "spread": max(sync_run["spread"], overlapped["spread"]),
        "AL": overlapped["AL"],
        "sync host ms/step": sync_run["host ms/step"],
        "overlap host ms/step": overlapped["host ms/step"],
        "hidden ms/step": overlapped["hidden ms/step"],
        "hidden share": overlapped["hidden ms/step"] / max(overlapped["host ms/step"], 1e-9),
        # The same from wall times: what overlapping took off a step, over the host's share.
        "hidden share (times)": (sync_run["ms/step"] - overlapped["ms/step"])
        / max(sync_run["host ms/step"], 1e-9),
        # What the device waits for: the step's time outside its rounds (host work the device
        # cannot run beside), synchronous and overlapped, and the share overlapping removed.
        "sync idle ms/step": sync_run["idle ms/step"],
        "overlap idle ms/step": overlapped["idle ms/step"],
        "idle removed": 1 - overlapped["idle ms/step"] / max(sync_run["idle ms/step"], 1e-9),
    }


def multi_step_rows(target, batch: int, steps: list[int], args, device: str) -> list[dict]:
    """Plain decoding of each of ``steps`` steps per round through the scheduler's loop at
    ``batch``, against single steps (:func:`loop_rows`: interleaved passes, the median)."""
    engines = {
        k: (
            scheduled_engine(
                target,
                None,
                "plain",
                SpecOptions(decode_steps=k),
                batch,
                args,
                args.decode_overlap,
            ),
            None,
        )
        for k in steps
    }
    runs = loop_rows(engines, batch, args, 0.0, device)
    rows = []
    for k, run in runs.items():
        rows.append(
            {
                "batch": batch,
                "steps/round": k,
                "tok/s": run["tok/s"],
                "/1 step": run["tok/s"] / runs[1]["tok/s"],
                "ms/round": run["ms/step"],
                "ms/token step": run["ms/step"] / k,
                "host ms/round": run["host ms/step"],
                "spread": run["spread"],
            }
        )
    return rows


def multi_step_table(config: DecoderConfig, device: str, dtype: torch.dtype, args) -> None:
    """The ``--decode-steps`` table: multi-step plain decoding against single steps."""
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    mode = "overlapped" if args.decode_overlap else "synchronous"
    print(f"device: {name}; torch {torch.__version__}; {args.shape}; {mode}", flush=True)
    steps = sorted({1, *(int(k) for k in args.decode_steps.split(","))})
    target, _ = build_models(config, device, dtype)
    begin, rows = time.perf_counter(), []
    for batch in [int(b) for b in args.decode_batches.split(",")]:
        rows += multi_step_rows(target, batch, steps, args, device)
        print(table(rows[-len(steps) :]), f"({time.perf_counter() - begin:.0f} s)", flush=True)
    print(f"\n## multi-step plain decoding ({args.shape}, {mode}), decode tokens/s\n")
    print(table(rows))


def scheduling_tables(config: DecoderConfig, device: str, dtype: torch.dtype, args) -> None:
    """The ``--adaptive`` and ``--overlap`` tables."""
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; acceptance {args.acceptance}", flush=True)
    begin, rows, overlaps = time.perf_counter(), [], []
    markov = markov_models(config, device, dtype, args.acceptance)
    batches = [int(b) for b in args.adaptive_batches.split(",")]
    drafts = args.adaptive_drafts.split(",") if args.adaptive else []
    unknown = sorted(set(drafts) - {"markov", "random"})
    if unknown:
        raise SystemExit(f"--adaptive-drafts: unknown drafts {unknown}; use markov, random or both")
    if "markov" in drafts:
        for batch in batches:
            rows.append(adaptive_row(*markov, "eagle", "markov", batch, args, 1.0, device))
            print(table(rows[-1:]), f"({time.perf_counter() - begin:.0f} s)", flush=True)
    if args.overlap:
        for batch in [int(b) for b in args.overlap_batches.split(",")]:
            for label, spec in (("plain", None), ("chain 3", SpecOptions(num_steps=3))):
                overlaps.append(overlap_row(*markov, label, spec, batch, args, device))
                print(table(overlaps[-1:]), f"({time.perf_counter() - begin:.0f} s)", flush=True)
    del markov
    if "random" in drafts:
        random_pair = build_models(config, device, dtype)
        for batch in batches:
            rows.append(adaptive_row(*random_pair, "eagle3", "random", batch, args, 0.0, device))
            print(table(rows[-1:]), f"({time.perf_counter() - begin:.0f} s)", flush=True)
    if rows:
        print("\n## adaptive speculation vs plain and fixed chains, decode tokens/s\n")
        print(table(rows))
    if overlaps:
        print("\n## synchronous vs overlapped scheduling, decode tokens/s\n\n" + table(overlaps))


def mla_kernel_row(target, head, label, spec, batch, args, device) -> dict[str, Any]:
    """One workload at ``batch`` with the target's latent attention run by each kernel: the
    Triton kernel and flashinfer's planned one (its column empty, and the reason printed,
    where flashinfer cannot run, e.g. on the CPU)."""
    algorithm = "plain" if spec is None else head.algorithm
    engines = {}
    for kernel in MLA_KERNELS:
        try:
            engine = scheduled_engine(target, head, algorithm, spec, batch, args, False, kernel)
        except UnsupportedKernel as refused:
            print(f"{label}, batch {batch}: {refused}", flush=True)
            continue
        engines[kernel] = (engine, None)
    runs = loop_rows(engines, batch, args, 0.0, device)
    row = {"round": label, "batch": batch}
    for kernel in MLA_KERNELS:
        row[f"{kernel} tok/s"] = runs[kernel]["tok/s"] if kernel in runs else "-"
    ratio = "-"
    if "flashinfer" in runs:
        ratio = runs["flashinfer"]["tok/s"] / runs["triton"]["tok/s"]
    row["flashinfer/triton"] = ratio
    row["spread"] = max(run["spread"] for run in runs.values())
    row["AL"] = runs["triton"]["AL"]
    return row


def mla_kernel_table(config: DecoderConfig, device: str, dtype: torch.dtype, args) -> None:
    """The ``--mla-kernels`` table: plain decoding and a NextN chain-3 round with each latent
    attention kernel."""
    if config.mla is None:
        raise SystemExit(
            f"--mla-kernels needs an MLA target: --shape deepseek-v2-lite, not {args.shape}"
        )
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; {args.shape}; synchronous", flush=True)
    target, head = build_models(config, device, dtype)
    begin, rows = time.perf_counter(), []
    for batch in [int(b) for b in args.mla_batches.split(",")]:
        for label, spec in (("plain", None), ("nextn chain 3", SpecOptions(num_steps=3))):
            rows.append(mla_kernel_row(target, head, label, spec, batch, args, device))
            print(table(rows[-1:]), f"({time.perf_counter() - begin:.0f} s)", flush=True)
    print(f"\n## latent attention kernels ({args.shape}, synchronous), decode tokens/s\n")
    print(table(rows))


def uneven_lens(batch: int, budget: int, width: int, seed: int) -> torch.Tensor:
    """Verify lengths of ``batch`` rows summing to ``budget`` (at most ``width`` each), spread
    unevenly as a verify budget spreads them: in proportion to random weights (the rows of
    highest survival verify deeper), the remainder to the heaviest rows first."""
    weights = torch.rand(batch, generator=torch.Generator().manual_seed(seed)) + 0.25
    lens = (budget * weights / weights.sum()).floor().long().clamp(max=width)
    order = torch.argsort(weights, descending=True).tolist()
    while int(lens.sum()) < budget:
        for row in order:
            if int(lens.sum()) < budget and lens[row] < width:
                lens[row] += 1
    return lens


def verify_inputs(target, batch: int, width: int, context: int, device: str):
    """A pool holding ``batch`` requests' ``context`` cached tokens (zeros), their chain of
    ``width`` draft tokens and root, as ``(kv, pool, tree)``."""
    page_size = 16
    pages = math.ceil((context + width + 1) / page_size)
    pool = target.new_pool(1 + batch * pages, page_size)
    table_ = 1 + torch.arange(batch * pages, device=device).view(batch, pages)
    kv = PagedKV(
        page_table=table_,
        seq_lens=torch.full((batch,), context, device=device),
        page_size=page_size,
    )
    tokens = torch.randint(target.config.vocab_size, (batch, width + 1), device=device)
    return kv, pool, chain_tree(tokens[:, 0], tokens[:, 1:])


def ragged_rows(target, batch: int, args, device: str) -> list[dict[str, Any]]:
    """Padded against packed verify forwards at ``batch``, one row per budget."""
    width = args.ragged_width
    kv, pool, tree = verify_inputs(target, batch, width, args.prompt, device)
    positions = kv.seq_lens[:, None] + tree.depths
    rows = []
    for per_request in [int(n) for n in args.ragged_budgets.split(",")]:
        budget = min(per_request * batch, width * batch)
        lens = uneven_lens(batch, budget, width, seed=batch).to(device)
        forward = tail_batch(kv, tree.tokens, positions, tree_mask(tree), q_lens=lens + 1)
        times = {}
        for layout, capacity in (("padded", None), ("packed", batch + budget)):
            if capacity == batch * (width + 1):
                capacity = None  # every token verified: nothing to pack
            verify = functools.partial(
                target_logits, target, pool, capture_layers=(), capacity=capacity
            )
            times[layout] = stage_ms(
                lambda b, verify=verify: verify(b)[2], (forward,), device, args.repeat
            )
        rows.append(
            {
                "batch": batch,
                "block": width,
                "verified/request": budget / batch,
                "rows padded": batch * (width + 1),
                "rows packed": batch + budget,
                "padded ms": times["padded"],
                "packed ms": times["packed"],
                "packed/padded": times["packed"] / times["padded"],
            }
        )
    return rows


def ragged_table(config: DecoderConfig, device: str, dtype: torch.dtype, args) -> None:
    """The ``--ragged-verify`` table: verify's model work padded against packed."""
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; {args.shape}", flush=True)
    target, _ = build_models(config, device, dtype)
    fuse_projections_(target)
    rows, begin = [], time.perf_counter()
    for batch in [int(b) for b in args.ragged_batches.split(",")]:
        rows += ragged_rows(target, batch, args, device)
        print(table(rows[-1:]), f"({time.perf_counter() - begin:.0f} s)", flush=True)
    print(f"\n## ragged verify ({args.shape}, context {args.prompt}), target forward + logits\n")
    print(table(rows))


if __name__ == "__main__":
    main()
