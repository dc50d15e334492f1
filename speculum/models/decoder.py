"""One Llama-family decoder over the paged KV cache.

Each layer composes an attention block and an MLP block chosen from the config: grouped-query
:class:`Attention`, or DeepSeek's multi-head latent attention (:class:`LatentAttention`, over a
cache of latents); the dense SwiGLU :class:`MLP`, or a mixture of experts (:class:`SparseMoE`)
in the sparse layers of Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, DeepSeek and gpt-oss
checkpoints (gpt-oss's attention sinks, biased experts and clamped GLU are options of the same
blocks); in
hybrids, recurrent layers with per-request state slots (Qwen3-Next's :class:`GatedDeltaNet`)
or, for Nemotron-H, one mixer per layer (:class:`MixerLayer`: :class:`Mamba2Mixer`,
:class:`NoPEAttention`, :class:`SquaredReluMLP` or :class:`SquaredReluMoE`); the one forward
runs them all.

Module and parameter names mirror transformers' (``model.layers.0.self_attn.q_proj.weight``), so
a Hugging Face state dict loads without renaming. The forward reads a :class:`ForwardBatch`,
writes the new tokens' K/V into the pool (the owned resource) and returns hidden states; logits
are a separate call so that pipelines compute them only where they are needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from speculum import kernels
from speculum.kernels.flashinfer_mla import planned_latent_attention
from speculum.models.config import DecoderConfig
from speculum.spec.attention import window_limits
from speculum.state.forward import ForwardBatch
from speculum.state.kv import KVPool
from speculum.state.parallel import SINGLE, TensorParallel
from speculum.state.record import replace
from speculum.state.recurrent import RecurrentPool

__all__ = [
    "Attention",
    "DecoderLayer",
    "DecoderModel",
    "LMHead",
    "MLP",
    "RMSNorm",
    "ResidualLayer",
    "Router",
    "SparseMoE",
    "apply_rope",
    "cache_kv_heads",
    "check_packable",
    "dense_attention",
    "decoder_layer",
    "dense_batch",
    "float32_logits",
    "FusedLinear",
    "Fp8Linear",
    "GEMV_KINDS",
    "apply_keeping_dtypes",
    "dense_weight",
    "GatedAttention",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "GroupGatedRMSNorm",
    "LatentAttention",
    "Mamba2Mixer",
    "MixerLayer",
    "NoPEAttention",
    "SquaredReluMLP",
    "SquaredReluMoE",
    "StackedExperts",
    "attention_block",
    "fuse_projections_",
    "fused_linear",
    "gemv_projections_",
    "holds",
    "mla_softmax_scale",
    "mlp_block",
    "pool_for",
    "project",
    "recurrent_pool_for",
    "rope_attention_factor",
    "rope_inv_freq",
    "widest_window",
]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as transformers does. ``offset`` is added to
    the stored weight (1.0 for Qwen3-Next's zero-centred norms, whose scale is ``1 + weight``)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    @property
    def scale(self) -> Tensor:
        """What the normalised values are multiplied by: ``weight + offset``."""
        return self.weight if self.offset == 0.0 else self.weight + self.offset

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last axis of ``x``, scaled by :attr:`scale` (``kernels.model_ops``)."""
        return kernels.model_ops.rms_norm(x, self.scale, self.eps)


def rope_inv_freq(config: DecoderConfig) -> Float[Tensor, " half"]:
    """Rotary inverse frequencies, with linear, Llama 3.1 or YaRN frequency scaling applied: one
    per pair of the ``config.rotary_dim`` dimensions that turn (all of a head's but GLM-4.5's)."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, config.rope_theta, dim, scaling)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _local_inv_freq(config: DecoderConfig) -> Float[Tensor, " half"]:
    """The rotary table of Gemma-3's windowed layers: ``config.local_rope_theta``, unscaled
    (empty for a config without one)."""
    if config.local_rope_theta is None:
        return torch.zeros(0)
    local = attrs.evolve(config, rope_theta=config.local_rope_theta, rope_scaling=None)
    return rope_inv_freq(local)


def _yarn_inv_freq(
    inv_freq: Float[Tensor, " half"], theta: float, dim: int, scaling: dict
) -> Float[Tensor, " half"]:
    """YaRN's frequencies, as transformers computes them: interpolated (divided by
    ``factor``) below the ``beta_slow`` rotation count over the original context, kept above
    ``beta_fast``, linearly blended between."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(config: DecoderConfig) -> float:
    """The factor YaRN scales rotated queries and keys by (transformers multiplies its cosines
    and sines by it): ``attention_factor`` when given, else from ``mscale`` over
    ``mscale_all_dim``, else from ``factor`` alone; 1 for every other rope type."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = (scaling.get(k) for k in ("factor", "mscale", "mscale_all_dim"))
    if mscale and all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
    return _yarn_mscale(factor)


def mla_softmax_scale(config: DecoderConfig) -> float:
    """Latent attention's softmax scale: ``qk_head_dim ** -0.5``, times ``mscale(factor,
    mscale_all_dim) ** 2`` under a scaled rope with ``mscale_all_dim`` (DeepSeek's YaRN)."""
    assert config.mla is not None
    scale = config.mla.qk_head_dim**-0.5
    scaling = config.rope_scaling or {}
    if scaling.get("mscale_all_dim"):
        mscale = _yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def apply_rope(
    x: Float[Tensor, "batch q head head_dim"],
    positions: Int[Tensor, "batch q"],
    inv_freq: Float[Tensor, " half"],
) -> Float[Tensor, "batch q head head_dim"]:
    """Rotate halves of ``x`` by ``positions * inv_freq`` (the non-interleaved convention)."""
    return kernels.model_ops.rope(x, positions, inv_freq.to(x.device))


class FusedLinear(NamedTuple):
    """Several projections of one input stored as one weight (and bias): the projections'
    parameters are views of these rows, in order. FP8 projections (:class:`Fp8Linear`) add
    the fused ``scale`` of ``block``-shaped blocks (their weights' scales, row blocks in
    order)."""

    weight: Tensor
    bias: Tensor | None
    scale: Tensor | None = None
    block: tuple[int, int] | None = None

    def __call__(
        self, x: Float[Tensor, "*rows in"], gemv: bool = False
    ) -> Float[Tensor, "*rows out"]:
        """Every projection of ``x`` at once, concatenated; float weights through
        ``speculum::half_linear`` where ``gemv`` (see :func:`gemv_projections_`)."""
        if self.scale is None or self.block is None:
            if gemv:
                return kernels.half.half_linear(x, self.weight, self.bias, False)
            return F.linear(x, self.weight, self.bias)
        return kernels.fp8.fp8_linear(x, self.weight, self.scale, list(self.block), None, self.bias)


def _fused_fp8_scales(layers: list[Fp8Linear]) -> tuple[Tensor, tuple[int, int]] | None:
    """The scales and block of FP8 ``layers`` (over one input) fused: one scale per row where
    each layer has one per row or one in all, their row blocks stacked where the layers share
    a block that no layer but the last leaves partial; ``None`` where they do not line up, or
    a layer has a static input scale (each layer's own)."""
    if any(layer.input_scale is not None for layer in layers):
        return None
    width = layers[0].in_features
    if all(
        layer.block[1] >= width and (layer.block[0] == 1 or layer.block[0] >= layer.out_features)
        for layer in layers
    ):
        rows = [layer.weight_scale.detach().expand(layer.out_features, 1) for layer in layers]
        return torch.cat(rows), (1, width)
    block = layers[0].block
    if all(layer.block == block for layer in layers) and all(
        layer.out_features % block[0] == 0 for layer in layers[:-1]
    ):
        return torch.cat([layer.weight_scale.detach() for layer in layers]), block
    return None


def fused_linear(*linears: nn.Linear | Fp8Linear) -> FusedLinear | None:
    """Concatenate ``linears``' weights (and biases) into one tensor and make each linear's
    parameters views of its rows, in place: memory is not duplicated, and state dicts,
    loading and saving still see the separate parameters. FP8 layers fuse with their scales
    (:func:`_fused_fp8_scales`); ``None`` (nothing changed) where float and FP8 layers mix
    or FP8 scales do not line up."""
    scales: tuple[Tensor, tuple[int, int]] | tuple[()] = ()
    if all(isinstance(linear, Fp8Linear) for linear in linears):
        found = _fused_fp8_scales([linear for linear in linears if isinstance(linear, Fp8Linear)])
        if found is None:
            return None
        scales = found
    elif not all(isinstance(linear, nn.Linear) for linear in linears):
        return None
    fused = []
    for name in ("weight", "bias"):
        params = [getattr(linear, name) for linear in linears]
        if params[0] is None:
            fused.append(None)
            continue
        joined = torch.cat([p.detach() for p in params])
        start = 0
        for p in params:
            p.data = joined[start : start + p.shape[0]]
            start += p.shape[0]
        fused.append(joined)
    return FusedLinear(*fused, *scales)


def holds(fused: FusedLinear | None, first: nn.Linear) -> bool:
    """Whether ``fused`` still holds the storage of its projections, ``first`` the first of
    them (a later ``.to()`` gives each parameter a copy of its own).

    Under ``torch.compile`` (``runtime.compiled``) only ``fused``'s presence is traced: storage
    pointers cannot be (and ``assume_constant_result`` over modules fails on torch 2.11), and a
    model's fusion is fixed once its engine is built (a ``.to()`` after that would need the
    engine rebuilt anyway)."""
    if fused is None:
        return False
    if torch.compiler.is_compiling():
        return True
    return fused.weight.untyped_storage().data_ptr() == first.weight.untyped_storage().data_ptr()


def fused_weights(fused: FusedLinear | None, first: nn.Linear) -> FusedLinear | None:
    """``fused`` when it may stand in for its projections: it still holds their storage
    (:func:`holds`) and no gradient is wanted (the fused tensor is not a parameter). ``None``
    sends the caller down the separate projections."""
    if torch.is_grad_enabled() and first.weight.requires_grad:
        return None
    return fused if holds(fused, first) else None


#: The projection kinds whose matmuls may run ``speculum::half_linear`` (``kernels.half``: the
#: Triton matrix-vector kernel at decode rows on CUDA): attention's q/k/v (fused or not) and
#: output projections, the MLP's gate/up (fused or not) and down projections, the logits.
GEMV_KINDS = ("qkv", "o", "gate_up", "down", "lm_head")


def gemv_projections_(module: nn.Module, kinds: tuple[str, ...]) -> nn.Module:
    """Make the float projections of ``kinds`` (:data:`GEMV_KINDS`) inside ``module`` run
    ``speculum::half_linear``, and every other kind ``F.linear``, in place; returns ``module``.

    Each :class:`Attention`, :class:`MLP` and :class:`LMHead` records the kinds it has in
    ``gemv``; parameters, state dicts and loading are untouched. FP8 layers (their own
    kernel), tensor-parallel row shards (their own all-reduce) and calls that want gradients
    keep their usual path (:func:`project`). Values are those of ``F.linear`` up to the order
    of the float32 sums, and a row's values do not depend on how many rows share the call.
    The setting is the model's: the last engine built over a model decides its eager calls
    (CUDA graphs keep the kernels they captured)."""
    parts = {Attention: {"qkv", "o"}, MLP: {"gate_up", "down"}, LMHead: {"lm_head"}}
    for sub in module.modules():
        for kind, names in parts.items():
            if isinstance(sub, kind):
                sub.gemv = frozenset(names.intersection(kinds))
    return module


def project(linear: nn.Module, x: Float[Tensor, "*rows in"], gemv: bool) -> Tensor:
    """``linear(x)``, through ``speculum::half_linear`` where ``gemv`` is set and ``linear`` is
    a plain ``nn.Linear`` called without gradients (the op has no backward); FP8 and
    tensor-parallel layers (subclasses) run their own forward."""
    if gemv and type(linear) is nn.Linear and not _wants_grad(linear.weight):
        return kernels.half.half_linear(x, linear.weight, linear.bias, False)
    return linear(x)


def _wants_grad(weight: Tensor) -> bool:
    return torch.is_grad_enabled() and weight.requires_grad


def fuse_projections_(module: nn.Module) -> nn.Module:
    """Fuse the projections of every attention block (q, k, v) and MLP (gate, up) inside
    ``module`` into one matmul each, in place; returns ``module``.

    A decode step at batch 1 is a chain of GEMVs: Llama-8B's k and v projections read 8 MB
    each, too little to reach memory bandwidth on their own, and every separate projection is
    another launch. Values are unchanged: a fused output row is each projection's, concatenated
    (bit for bit up to the matmul library's choice of kernel). Fuse after the model is on its
    device and in its dtype; a later ``.to()`` quietly falls back to the separate projections.
    Fusing a fused model again keeps its fused tensors: every engine built over a model fuses
    it, and the CUDA graphs an earlier engine captured read those tensors (replaced, they would
    be freed under the graphs).
    """
    for sub in module.modules():
        if isinstance(sub, (Attention, MLP)):
            sub.fuse_()
    return module


class Attention(nn.Module):
    """Grouped-query self-attention over the paged cache.

    ``input_size`` is the width of ``x`` (the q/k/v projections' input); it defaults to
    ``hidden_size``. EAGLE-3's draft layer attends over ``[embedding; hidden]``, twice as wide.
    ``window`` is the layer's sliding window (``config.attention_window``; 0: full attention):
    a query sees its last ``window`` keys, itself included. With ``config.attention_sinks``
    (gpt-oss) each head's learned ``sinks`` logit joins the softmax's denominator. Under YaRN
    rope the scores are scaled by the square of its attention factor (transformers scales the
    rotated queries and keys by it; the values are not rotated).
    """

    def __init__(self, config: DecoderConfig, layer: int, input_size: int | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.window = config.attention_window(layer)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        width = config.hidden_size if input_size is None else input_size
        self.q_proj = nn.Linear(width, q_out, bias=config.qkv_bias)
        self.k_proj = nn.Linear(width, kv_out, bias=config.qkv_bias)
        self.v_proj = nn.Linear(width, kv_out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_out, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
        self.qk_norm = config.qk_norm
        self.qkv: FusedLinear | None = None
        #: The projection kinds run by ``speculum::half_linear`` (:func:`gemv_projections_`).
        self.gemv: frozenset[str] = frozenset()
        # Gemma-3 scales scores by query_pre_attn_scalar rather than the head width.
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.scale = rope_attention_factor(config) ** 2 / math.sqrt(scalar)
        sinks = nn.Parameter(torch.zeros(config.num_heads)) if config.attention_sinks else None
        self.register_parameter("sinks", sinks)

    def fuse_(self) -> None:
        """Keep the q, k and v weights (and biases) in one tensor (see :func:`fuse_projections_`);
        a no-op for attention without its own K/V projections, and where they do not fuse
        (float and FP8 ones mixed, or FP8 scales that do not line up: :func:`fused_linear`)."""
        names = ("q_proj", "k_proj", "v_proj")
        kinds = (nn.Linear, Fp8Linear)
        projections = all(isinstance(getattr(self, name, None), kinds) for name in names)
        if projections and not holds(self.qkv, self.q_proj):
            self.qkv = fused_linear(self.q_proj, self.k_proj, self.v_proj)

    def queries(
        self, x: Tensor, batch: ForwardBatch, inv_freq: Tensor
    ) -> Float[Tensor, "batch q head head_dim"]:
        """The rotated (and, for qk-norm kinds, normed) queries of ``x``."""
        return apply_rope(self._query_heads(self.q_proj(x)), batch.positions, inv_freq)

    def keys_values(
        self, x: Tensor, batch: ForwardBatch, inv_freq: Tensor
    ) -> tuple[
        Float[Tensor, "batch q kv_head head_dim"], Float[Tensor, "batch q kv_head head_dim"]
    ]:
        """The rotated keys and the values of ``x``."""
        ks, vs = self._key_value_heads(self.k_proj(x), self.v_proj(x))
        return apply_rope(ks, batch.positions, inv_freq), vs

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of ``x`` split into heads, q/k normed for qk-norm kinds,
        not yet rotated: one matmul when the projections are fused."""
        weights, gemv = fused_weights(self.qkv, self.q_proj), "qkv" in self.gemv
        if weights is None:
            q, k, v = (project(p, x, gemv) for p in (self.q_proj, self.k_proj, self.v_proj))
        else:
            kv_out = self.num_kv_heads * self.head_dim
            q, k, v = weights(x, gemv).split([self.num_heads * self.head_dim, kv_out, kv_out], -1)
        return (self._query_heads(q), *self._key_value_heads(k, v))

    def _query_heads(self, projected: Tensor) -> Float[Tensor, "batch q head head_dim"]:
        b, q, _ = projected.shape
        qs = projected.view(b, q, self.num_heads, self.head_dim)
        return self.q_norm(qs) if self.qk_norm else qs

    def _key_value_heads(
        self, keys: Tensor, values: Tensor
    ) -> tuple[
        Float[Tensor, "batch q kv_head head_dim"], Float[Tensor, "batch q kv_head head_dim"]
    ]:
        b, q, _ = keys.shape
        ks = keys.view(b, q, self.num_kv_heads, self.head_dim)
        vs = values.view(b, q, self.num_kv_heads, self.head_dim)
        return (self.k_norm(ks) if self.qk_norm else ks), vs

    def attend(
        self, qs: Float[Tensor, "batch q head head_dim"], batch: ForwardBatch, pool: KVPool
    ) -> Float[Tensor, "batch q hidden"]:
        """Attention of ``qs`` over layer ``self.layer``'s cache as ``batch`` shows it,
        projected back."""
        return self.project_out(self.attention_heads(qs, batch, pool).flatten(2))

    def project_out(self, heads: Float[Tensor, "batch q width"]) -> Float[Tensor, "batch q hidden"]:
        """``o_proj`` of the heads' concatenated outputs (:func:`project`)."""
        return project(self.o_proj, heads, "o" in self.gemv)

    def attention_heads(
        self, qs: Float[Tensor, "batch q head head_dim"], batch: ForwardBatch, pool: KVPool
    ) -> Float[Tensor, "batch q head head_dim"]:
        """Each head's attention output of ``qs`` over layer ``self.layer``'s cache."""
        return kernels.paged_attention(
            qs,
            pool.k[self.layer],
            pool.v[self.layer],
            batch.page_table,
            batch.prefix_lens,
            batch.q_lens,
            batch.new_mask,
            self.scale,
            self.window,
            self.sinks,
            batch.q_starts,
        )

    def forward(
        self, x: Tensor, batch: ForwardBatch, pool: KVPool | None, inv_freq: Tensor
    ) -> Float[Tensor, "batch q hidden"]:
        """Project, rotate, write K/V into the pool, attend, and project back.

        With ``pool=None`` (training) nothing is cached: the queries attend to each other's
        keys alone under ``batch.new_mask`` (cut to the window), differentiably
        (:func:`dense_attention`).
        """
        qs, ks, vs = self.heads(x)
        if pool is None:
            qs, ks = (apply_rope(t, batch.positions, inv_freq) for t in (qs, ks))
            _, mask = window_limits(batch.prefix_lens, batch.new_mask, self.window)
            out = dense_attention(qs, ks, vs, mask, self.scale, self.sinks)
            return self.project_out(out.flatten(2))
        qs = kernels.model_ops.rope_write_kv(
            qs,
            ks,
            vs,
            batch.positions,
            inv_freq.to(qs.device),
            pool.k[self.layer],
            pool.v[self.layer],
            batch.slots,
        )
        return self.attend(qs, batch, pool)


def dense_attention(
    qs: Float[Tensor, "batch q head head_dim"],
    ks: Float[Tensor, "batch k kv_head head_dim"],
    vs: Float[Tensor, "batch k kv_head head_dim"],
    mask: Bool[Tensor, "batch q k"],
    scale: float | None = None,
    sinks: Float[Tensor, " head"] | None = None,
) -> Float[Tensor, "batch q head v_dim"]:
    """Grouped-query softmax attention of ``qs`` over ``ks``/``vs`` where ``mask`` allows, with
    no cache (training), scaled by ``scale`` (default ``head_dim ** -0.5``), each head's
    ``sinks`` logit (gpt-oss) joining the denominator. Every query must see at least one
    key."""
    group = qs.shape[2] // ks.shape[2]
    scale = 1.0 / math.sqrt(qs.shape[-1]) if scale is None else scale
    qs, ks, vs = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
    ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[:, None], scale=scale)
    if sinks is not None:
        # A sink adds exp(sink) to the denominator: the output shrinks by the share the keys
        # keep, sum / (sum + exp(sink)) = sigmoid(logsumexp(scores) - sink).
        scores = (qs @ ks.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
        keep = torch.sigmoid(scores.logsumexp(-1) - sinks[:, None].to(scores.dtype))
        out = out * keep[..., None].to(out.dtype)
    return out.transpose(1, 2)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3) over a latent paged cache.

    Parameters carry the hub's names: ``q_proj`` (or ``q_a_proj``, ``q_a_layernorm``,
    ``q_b_proj`` when ``q_lora_rank`` is set), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj``. The cache holds, per token, the normed latent ``c`` and the
    rotated key ``k_pe`` (:meth:`KVPool.allocate_latent`), never the per-head keys and values.
    Attention runs *absorbed*: ``kv_b_proj``'s key rows ``W_UK`` fold into the queries (head
    ``h`` scores ``[q_nope W_UK_h, q_pe] . [c, k_pe]``, which is ``q_nope . k_nope + q_pe .
    k_pe``), every head attends to the one latent "KV head" with the latent as its values, and
    ``kv_b_proj``'s value rows ``W_UV`` map each head's latent output to ``v_head_dim`` before
    ``o_proj``. The ``latent_attention`` op runs it (its Triton kernel reads each latent row
    once, as key and as value, for every head and query token of a request).

    Rotary dims that pair up interleaved (``rope_interleave``, DeepSeek-V2's complex rope) are
    permuted to halves (evens then odds) before the halves-convention rope op: a query's and a
    key's rotary parts get the same permutation, so their dot product is unchanged, and each
    rotated value is the one transformers computes.
    """

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError("LatentAttention needs a config with mla settings (config.mla)")
        self.layer = layer
        self.num_heads = config.num_heads
        self.mla = mla
        h, heads, bias = config.hidden_size, config.num_heads, config.qkv_bias
        q_out = heads * mla.qk_head_dim
        # The latent norms' eps is transformers' RMSNorm default, not the config's.
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, h, bias=config.o_bias)
        self.scale = mla_softmax_scale(config)
        self.rope_factor = rope_attention_factor(config)

    def _rotate(self, x: Tensor, batch: ForwardBatch, inv_freq: Tensor) -> Tensor:
        """The rotary part ``x`` rotated at ``batch.positions`` (in halves order)."""
        if self.mla.rope_interleave:  # (x0, x1), (x2, x3) .. -> x0, x2, .. then x1, x3, ..
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        rotated = apply_rope(x, batch.positions, inv_freq)
        return rotated if self.rope_factor == 1.0 else rotated * self.rope_factor

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each head's unrotated and (not yet rotated) rotary query parts."""
        if self.mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        b, n, _ = x.shape
        q = q.view(b, n, self.num_heads, self.mla.qk_head_dim)
        return q.split([self.mla.qk_nope_head_dim, self.mla.qk_rope_head_dim], -1)

    def _latent(self, x: Tensor, batch: ForwardBatch, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        """The normed latent ``[batch, q, 1, kv_lora_rank]`` and the rotated rotary key
        ``[batch, q, 1, qk_rope_head_dim]`` of ``x``: what the cache holds."""
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.mla.kv_lora_rank, self.mla.qk_rope_head_dim], -1
        )
        k_pe = self._rotate(k_pe[:, :, None], batch, inv_freq)
        return self.kv_a_layernorm(latent)[:, :, None], k_pe

    def _up_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``kv_b_proj`` per head (in ``dtype`` when it is FP8): key rows ``[head, nope,
        latent]``, value rows ``[head, v, latent]``."""
        weight = dense_weight(self.kv_b_proj, dtype)
        up = weight.view(self.num_heads, -1, self.mla.kv_lora_rank)
        return up.split([self.mla.qk_nope_head_dim, self.mla.v_head_dim], 1)

    def forward(
        self, x: Tensor, batch: ForwardBatch, pool: KVPool | None, inv_freq: Tensor
    ) -> Float[Tensor, "batch q hidden"]:
        """Project, write the latent and rotary key into the pool, attend absorbed, project
        back. With ``pool=None`` (training) the latent is expanded to per-head keys and values
        and the queries attend to each other under ``batch.new_mask`` (:func:`dense_attention`)."""
        q_nope, q_pe = self._queries(x)
        q_pe = self._rotate(q_pe, batch, inv_freq)
        latent, k_pe = self._latent(x, batch, inv_freq)
        up_k, up_v = self._up_weights(x.dtype)
        if pool is None:
            k_nope = torch.einsum("bsr,hnr->bshn", latent[:, :, 0], up_k)
            keys = torch.cat([k_nope, k_pe.expand(-1, -1, self.num_heads, -1)], -1)
            values = torch.einsum("bsr,hvr->bshv", latent[:, :, 0], up_v)
            qs = torch.cat([q_nope, q_pe], -1)
            out = dense_attention(qs, keys, values, batch.new_mask, self.scale)
            return self.o_proj(out.flatten(2))
        cache = pool.k[self.layer]
        kernels.write_kv(cache, batch.slots, torch.cat([latent, k_pe], -1))
        q_latent = torch.einsum("bqhn,hnr->bqhr", q_nope, up_k)
        if batch.latent_plan >= 0:  # a target forward the host planned (flashinfer's kernel)
            out = planned_latent_attention(q_latent, q_pe, cache, batch.latent_plan)
        else:
            out = kernels.latent_attention(
                torch.cat([q_latent, q_pe], -1),
                cache,
                batch.page_table,
                batch.prefix_lens,
                batch.q_lens,
                batch.new_mask,
                self.scale,
                self.mla.kv_lora_rank,
                batch.q_starts,
            )
        return self.o_proj(torch.einsum("bqhr,hvr->bqhv", out, up_v).flatten(2))


class GatedAttention(Attention):
    """Qwen3-Next's gated full attention: grouped-query attention with q/k norms and partial
    rotary, whose ``q_proj`` yields each head's queries then its output gate (``2 * head_dim``
    rows per head), the attention output scaled by ``sigmoid(gate)`` before ``o_proj``. The
    query projection is wider than the keys', so q, k and v are never fused."""

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__(config, layer)
        width = 2 * config.num_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width, bias=config.qkv_bias)

    def fuse_(self) -> None:
        """Nothing to fuse: the gated query projection is not the keys' width."""

    def forward(
        self, x: Tensor, batch: ForwardBatch, pool: KVPool | None, inv_freq: Tensor
    ) -> Float[Tensor, "batch q hidden"]:
        """Project, rotate, write K/V, attend, gate and project back."""
        if pool is None:
            raise ValueError(
                "Qwen3-Next runs over a KV pool only (pool=None, cache-free training, is not "
                "supported for hybrid models)"
            )
        b, n, _ = x.shape
        qs, gate = self.q_proj(x).view(b, n, self.num_heads, 2 * self.head_dim).chunk(2, -1)
        ks, vs = self._key_value_heads(self.k_proj(x), self.v_proj(x))
        qs = kernels.model_ops.rope_write_kv(
            self.q_norm(qs),
            ks,
            vs,
            batch.positions,
            inv_freq.to(x.device),
            pool.k[self.layer],
            pool.v[self.layer],
            batch.slots,
        )
        out = self.attention_heads(qs, batch, pool) * torch.sigmoid(gate)
        return self.project_out(out.flatten(2))


class GatedRMSNorm(nn.Module):
    """The gated DeltaNet's output norm: RMS-normed in float32, scaled by ``weight``, times
    ``silu(gate)`` (transformers' ``Qwen3NextRMSNormGated``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        """``weight * rms_norm(x) * silu(gate)``, in ``x``'s dtype."""
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention (gated DeltaNet) over the recurrent pool.

    Parameters carry the hub's names: ``in_proj_qkvz`` (per key-head group: queries, keys,
    values, output gate ``z``), ``in_proj_ba`` (per group: write strengths ``b``, decay inputs
    ``a``), ``conv1d`` (depthwise, no bias), ``dt_bias``, ``A_log``, ``norm`` and ``out_proj``.
    The per-request conv and delta-rule states live in ``pool.recurrent`` at the batch's state
    slots, layer ``self.layer`` (its ordinal among linear layers); ``spec.recurrent`` runs the
    recurrence, each token from its parent's state, so tree verify keeps a candidate state per
    node.
    """

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        linear = config.linear
        if linear is None:
            raise ValueError("GatedDeltaNet needs a config with linear settings (config.linear)")
        self.linear = linear
        self.layer = linear.ordinal(layer)
        h = config.hidden_size
        k_width, v_width = linear.num_k_heads * linear.k_dim, linear.num_v_heads * linear.v_dim
        channels = linear.conv_channels
        self.conv1d = nn.Conv1d(channels, channels, linear.conv_kernel, groups=channels, bias=False)
        self.in_proj_qkvz = nn.Linear(h, 2 * k_width + 2 * v_width, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * linear.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(linear.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(linear.num_v_heads))
        self.norm = GatedRMSNorm(linear.v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(v_width, h, bias=False)

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The conv inputs (queries, keys, values), ``z`` ``[b, q, v_head, v_dim]``, ``b`` and
        ``a`` ``[b, q, v_head]`` of ``x``, from the projections' per-key-head-group layout."""
        lin = self.linear
        b, n, _ = x.shape
        group = lin.num_v_heads // lin.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(b, n, lin.num_k_heads, -1)
        q, k, v, z = qkvz.split([lin.k_dim, lin.k_dim, group * lin.v_dim, group * lin.v_dim], -1)
        beta, a = self.in_proj_ba(x).view(b, n, lin.num_k_heads, 2 * group).split(group, -1)
        mixed = torch.cat([t.reshape(b, n, -1) for t in (q, k, v)], -1)
        heads = (b, n, lin.num_v_heads)
        return mixed, z.reshape(*heads, lin.v_dim), beta.reshape(heads), a.reshape(heads)

    def forward(
        self, x: Tensor, batch: ForwardBatch, pool: KVPool | None, inv_freq: Tensor
    ) -> Float[Tensor, "batch q hidden"]:
        """Conv, gated delta rule from each token's parent state (written into the pool at
        the batch's state slots), gated norm and output projection."""
        if pool is None or pool.recurrent is None:
            raise ValueError(
                "a gated DeltaNet layer needs the recurrent pool (build the pool with the "
                "model's new_pool, and give each request its own PagedKV.state_slots); "
                "cache-free training is not supported for hybrid models"
            )
        lin = self.linear
        mixed, z, beta, a = self._split(x)
        gate = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = kernels.gated_delta_rule(
            pool.recurrent.conv[self.layer],
            pool.recurrent.ssm[self.layer],
            batch.state_slots,
            batch.prefix_lens,
            batch.q_lens,
            batch.new_mask,
            mixed,
            self.conv1d.weight[:, 0],
            gate,
            beta.sigmoid(),
            [lin.num_k_heads, lin.k_dim, lin.num_v_heads, lin.v_dim],
            DELTA_RULE_CHUNK if batch.prefill else 0,
        )
        return self.out_proj(self.norm(out, z).flatten(2))


#: Tokens per chunk of the gated delta rule's prefill form (fla-core's and transformers' 64).
DELTA_RULE_CHUNK = 64


def attention_block(
    config: DecoderConfig, layer: int
) -> Attention | LatentAttention | GatedDeltaNet:
    """The attention kind of decoder layer ``layer``: a gated DeltaNet in a hybrid config's
    linear-attention layers; else gated attention where the config has an output gate
    (Qwen3-Next), latent attention where it has MLA shapes, attention without rotary
    embedding in Nemotron-H, or grouped-query attention, each reading its pool layer (a
    hybrid's pool holds its attention layers only)."""
    if config.linear is not None and config.linear.is_linear(layer):
        return GatedDeltaNet(config, layer)
    cache_layer = config.cache_layer(layer)
    if config.attention_output_gate:
        return GatedAttention(config, cache_layer)
    if config.mla is not None:
        return LatentAttention(config, cache_layer)
    if config.mamba is not None:
        return NoPEAttention(config, cache_layer)
    return Attention(config, cache_layer)


def widest_window(module: nn.Module) -> int | None:
    """How many keys back from its own position any query of ``module``'s attention layers
    reads the KV cache: the widest of their sliding windows, or None when one of them attends
    to every key (full or latent attention) or ``module`` has none. Recurrent layers read state
    slots, not pages, and do not count."""
    windows = [
        getattr(m, "window", 0)
        for m in module.modules()
        if isinstance(m, (Attention, LatentAttention))
    ]
    return None if not windows or 0 in windows else max(windows)


def pool_for(
    module: nn.Module,
    config: DecoderConfig,
    num_layers: int,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype | None = None,
) -> KVPool:
    """A zeroed pool of ``num_layers`` layers for the attention ``module`` holds, in its dtype
    (unless given) and on its device, the one place a model's pool and its drafts' pools are
    shaped (page 0 is the padding sink): the latent layout when its attention is
    :class:`LatentAttention` (``config.mla``'s shapes), else K/V heads of ``config``'s
    ``head_dim`` (this rank's heads when ``module`` is sharded)."""
    weight = next(module.parameters())
    dtype, device = dtype or weight.dtype, weight.device
    if config.is_hybrid:
        num_layers = config.num_kv_layers
    common = dict(num_layers=num_layers, num_pages=num_pages, page_size=page_size)
    if config.mla is not None and any(isinstance(m, LatentAttention) for m in module.modules()):
        return KVPool.allocate_latent(
            **common,
            latent_dim=config.mla.kv_lora_rank,
            rope_dim=config.mla.qk_rope_head_dim,
            dtype=dtype,
            device=device,
        )
    return KVPool.allocate(
        **common,
        num_kv_heads=cache_kv_heads(module, config.num_kv_heads),
        head_dim=config.head_dim,
        dtype=dtype,
        device=device,
    )


def recurrent_pool_for(
    config: DecoderConfig, num_slots: int, ring: int, dtype: torch.dtype
) -> RecurrentPool:
    """A zeroed recurrent pool for ``config``'s recurrent layers (gated DeltaNet or Mamba-2):
    ``num_slots`` slots (one per request that may be live at once, plus the padding sink)
    keeping ``ring`` consecutive states each (more than any round writes past the committed
    prefix: the pipeline's KV lookahead + 1). A Mamba-2 layer's SSM state ``[head, head_dim,
    d_state]`` takes the delta rule's ``[head, k_dim, v_dim]`` place."""
    if config.mamba is not None:
        mamba = config.mamba
        shapes = (mamba.conv_channels, mamba.conv_kernel, mamba.num_heads)
        dims = (mamba.head_dim, mamba.state_size)
    elif config.linear is not None:
        linear = config.linear
        shapes = (linear.conv_channels, linear.conv_kernel, linear.num_v_heads)
        dims = (linear.k_dim, linear.v_dim)
    else:
        raise ValueError(f"{config.architecture} has no recurrent layers")
    return RecurrentPool.allocate(
        num_layers=sum(config.is_recurrent(n) for n in range(config.num_layers)),
        num_slots=num_slots,
        ring=ring,
        channels=shapes[0],
        kernel=shapes[1],
        heads=shapes[2],
        k_dim=dims[0],
        v_dim=dims[1],
        dtype=dtype,
    )


def dense_batch(
    tokens: Int[Tensor, "batch q"],
    positions: Int[Tensor, "batch q"] | None = None,
    mask: Bool[Tensor, "batch q q"] | None = None,
) -> ForwardBatch:
    """Inputs of a cache-free forward (``pool=None``): ``tokens`` at ``positions`` (default
    ``0 .. q-1``) attending to each other under ``mask`` (default causal)."""
    batch, q = tokens.shape
    device = tokens.device
    if positions is None:
        positions = torch.arange(q, device=device).expand(batch, q)
    if mask is None:
        mask = torch.ones(q, q, dtype=torch.bool, device=device).tril().expand(batch, q, q)
    zeros = torch.zeros(batch, dtype=torch.int64, device=device)
    return ForwardBatch(
        input_ids=tokens,
        positions=positions,
        slots=torch.zeros_like(tokens),
        page_table=zeros[:, None],
        prefix_lens=zeros,
        q_lens=torch.full_like(zeros, q),
        new_mask=mask,
    )


class MLP(nn.Module):
    """Gated feed-forward, ``intermediate_size`` wide (default: the config's): SwiGLU, or
    Gemma's tanh-GELU gate (``config.hidden_act``)."""

    def __init__(self, config: DecoderConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        h, bias = config.hidden_size, config.mlp_bias
        i = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up: FusedLinear | None = None
        #: The projection kinds run by ``speculum::half_linear`` (:func:`gemv_projections_`).
        self.gemv: frozenset[str] = frozenset()

    def fuse_(self) -> None:
        """Keep the gate and up weights in one tensor (see :func:`fuse_projections_`), where
        they fuse (:func:`fused_linear`)."""
        if not holds(self.gate_up, self.gate_proj):
            self.gate_up = fused_linear(self.gate_proj, self.up_proj)

    def forward(self, x: Tensor) -> Tensor:
        """``down(act(gate(x)) * up(x))``: gate and up in one matmul when fused."""
        weights, gemv = fused_weights(self.gate_up, self.gate_proj), "gate_up" in self.gemv
        if weights is None:
            gate, up = project(self.gate_proj, x, gemv), project(self.up_proj, x, gemv)
        else:
            gate, up = weights(x, gemv).chunk(2, dim=-1)
        if self.gelu:
            hidden = F.gelu(gate, approximate="tanh") * up
        else:
            hidden = kernels.model_ops.silu_mul(gate, up)
        return project(self.down_proj, hidden, "down" in self.gemv)


def apply_keeping_dtypes(
    module: nn.Module, fn: Callable[[Tensor], Tensor], recurse: bool, names: list[str]
) -> nn.Module:
    """``nn.Module._apply(module, fn, recurse)`` (what ``.to()``, ``.cuda()``, ``.half()`` go
    through), except that each of ``module``'s own parameters ``names`` whose dtype the cast
    changed is replaced by its value before the cast, on the device the cast moved it to (no
    rounding kept). Returns ``module``."""
    before = {name: module._parameters[name].data for name in names}
    nn.Module._apply(module, fn, recurse)
    for name, old in before.items():
        param = module._parameters[name]
        if param.dtype != old.dtype:
            param.data = old.to(param.device)
    return module


class Fp8Linear(nn.Module):
    """A linear layer whose weight stays FP8 (e4m3) in memory, with float32 scales, one per
    ``block`` of the weight (``kernels.fp8``: ``(out, in)`` per tensor, ``(1, in)`` per
    channel, DeepSeek-V3's ``(128, 128)``); ``input_scale`` is a checkpoint's static
    activation scale (``None``: activations are scaled per token when quantized).

    Calling it runs ``speculum::fp8_linear`` (``kernels.fp8``): the weight dequantized to the
    input's dtype on the CPU; on CUDA a Triton kernel that dequantizes in registers (up to 16
    rows), ``torch._scaled_mm`` or the reference (docs/fp8.md says which runs where).
    Casting the model (``.to(bfloat16)``) leaves the weight and its scales as they are; the
    bias follows the cast. ``models.fp8`` builds these from checkpoints and from float models."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        block: tuple[int, int],
        static_input: bool,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        scales = (-(-out_features // block[0]), -(-in_features // block[1]))
        fp8 = torch.empty(out_features, in_features, dtype=kernels.fp8.FP8)
        self.weight = nn.Parameter(fp8, requires_grad=False)
        float32 = torch.empty(scales, dtype=torch.float32)
        self.weight_scale = nn.Parameter(float32, requires_grad=False)
        self.input_scale: nn.Parameter | None = None
        if static_input:
            one = torch.empty(1, 1, dtype=torch.float32)
            self.input_scale = nn.Parameter(one, requires_grad=False)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def forward(self, x: Float[Tensor, "*rows in"]) -> Float[Tensor, "*rows out"]:
        """``x @ weight.T + bias`` with the weight's real (scaled) values."""
        block = list(self.block)
        return kernels.fp8.fp8_linear(
            x, self.weight, self.weight_scale, block, self.input_scale, self.bias
        )

    def dequantized(self, dtype: torch.dtype) -> Float[Tensor, "out in"]:
        """The weight's real values ``weight * scale`` in ``dtype``."""
        return kernels.fp8.dequantize(self.weight, self.weight_scale, self.block, dtype)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Fp8Linear:
        """``nn.Module._apply`` keeping the weight FP8 and the scales float32."""
        kept = [
            n
            for n in ("weight", "weight_scale", "input_scale")
            if self._parameters.get(n) is not None
        ]
        return apply_keeping_dtypes(self, fn, recurse, kept)


def dense_weight(linear: nn.Linear | Fp8Linear, dtype: torch.dtype) -> Float[Tensor, "out in"]:
    """A linear layer's weight as a tensor to compute with: its own, or an FP8 layer's
    dequantized to ``dtype`` (for the few places that read a weight rather than call the
    layer: latent attention's absorbed ``kv_b_proj``)."""
    if isinstance(linear, Fp8Linear):
        return linear.dequantized(dtype)
    return linear.weight


class Router(nn.Module):
    """A mixture-of-experts router: ``weight [E, H]`` scores every expert, and for
    ``noaux_tc`` routing (DeepSeek-V3, GLM-4.5) ``e_score_correction_bias [E]`` is added to the
    scores to choose the experts (not to weight them); gpt-oss's router adds ``bias [E]`` to its
    logits. Named as the hub names them (``mlp.gate.weight``,
    ``mlp.gate.e_score_correction_bias``; gpt-oss: ``mlp.router.weight``, ``mlp.router.bias``).

    With ``keep_float32`` (DeepSeek, GLM-4.5) the router stays float32 when the model is cast
    to another dtype, as transformers keeps it (``_keep_in_fp32_modules_strict``): the
    correction biases are float32 in the released checkpoints, and rounding them to bfloat16
    would change which experts tokens go to."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        correction_bias: bool,
        keep_float32: bool,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias: nn.Parameter | None = None
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        self.register_parameter("bias", nn.Parameter(torch.zeros(num_experts)) if bias else None)
        self.keep_float32 = keep_float32

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Router:
        """``nn.Module._apply`` (which ``.to()``, ``.cuda()``, ``.half()`` go through), then,
        with ``keep_float32``, each tensor cast away from float32 is replaced by its float32
        value before the cast, on the device the cast moved it to (no rounding kept)."""
        kept = [
            n for n, p in self._parameters.items() if p is not None and p.dtype == torch.float32
        ]
        return apply_keeping_dtypes(self, fn, recurse, kept if self.keep_float32 else [])


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (``config.moe``): a :class:`Router` ``gate`` scoring every
    expert, the experts' SwiGLU weights stacked for batched kernels (``experts_gate_up [E, 2I,
    H]``, each expert's gate rows then its up rows, and ``experts_down [E, H, I]``; gpt-oss's
    biases ``experts_gate_up_bias [E, 2I]`` and ``experts_down_bias [E, H]`` and its clamped
    GLU with ``config.moe.biases`` and ``swiglu_limit``), and, where the config has one, a
    shared expert every token goes through: Qwen2-MoE's ``shared_expert`` scaled by
    ``sigmoid(shared_expert_gate(x))``, or DeepSeek's and GLM-4.5's ungated ``shared_experts``
    (``n_shared_experts`` experts wide).

    The routed part is the custom op ``speculum::moe`` (``kernels.model_ops.moe``), free of
    host syncs and data-dependent shapes. Checkpoints store the experts one by one (gpt-oss:
    stacked, in another layout); ``models.loading`` maps between the layouts.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("SparseMoE needs a config with moe settings (config.moe is None)")
        h, i, experts = config.hidden_size, moe.expert_intermediate_size, moe.num_experts
        self.num_experts = experts
        self.moe = moe
        self.gate = Router(h, experts, moe.has_correction_bias, moe.float32_router, moe.biases)
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * i, h))
        self.experts_down = nn.Parameter(torch.empty(experts, h, i))
        for name, shape in (
            ("experts_gate_up_bias", (experts, 2 * i)),
            ("experts_down_bias", (experts, h)),
        ):
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)) if moe.biases else None)
        self.shared_expert: MLP | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.shared_experts: MLP | None = None
        if moe.n_shared_experts:
            self.shared_experts = MLP(config, i * moe.n_shared_experts)

    def forward(self, x: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows hidden"]:
        """The routed experts' weighted sum, plus the shared expert(s) where there are any
        (added last, as transformers does)."""
        moe = self.moe
        out = kernels.model_ops.moe(
            x,
            self.gate.weight,
            self.experts_gate_up,
            self.experts_down,
            *moe.routing,
            self.gate.e_score_correction_bias,
            moe.float32_router,
            self.gate.bias,
            self.experts_gate_up_bias,
            self.experts_down_bias,
            moe.swiglu_limit,
            moe.swiglu_alpha,
        )
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def mlp_block(config: DecoderConfig, layer: int) -> MLP | SparseMoE:
    """The MLP kind of decoder layer ``layer``: a mixture of experts in the config's sparse
    layers, else the dense SwiGLU."""
    if config.moe is not None and config.moe.is_sparse(layer):
        return SparseMoE(config)
    return MLP(config)


class ResidualLayer(nn.Module):
    """A decoder layer: its ``blocks`` (the layer short of its last residual add, from the
    stream and its ``input_layernorm``-ed copy) and that add."""

    def forward(
        self, x: Tensor, batch: ForwardBatch, pool: KVPool | None, inv_freq: Tensor
    ) -> Tensor:
        """The stream leaving the layer: ``x`` plus what its blocks add."""
        out, x = self.blocks(self.input_layernorm(x), x, batch, pool, inv_freq)
        return x + out


class DecoderLayer(ResidualLayer):
    """Pre-norm attention and MLP blocks with residual connections (``x + attn(norm(x))``,
    then ``+ mlp(norm(.))``); the MLP block is the layer's kind (:func:`mlp_block`). With
    ``config.sandwich_norms`` (Gemma-3) each block's output is normed too before its
    residual add: ``x + norm(attn(norm(x)))``, then ``+ norm(mlp(norm(.)))``."""

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        mixer = attention_block(config, layer)
        # Named as transformers names it: a hybrid's DeltaNet layers hold ``linear_attn``.
        self.mixer_name = "linear_attn" if isinstance(mixer, GatedDeltaNet) else "self_attn"
        setattr(self, self.mixer_name, mixer)
        self.mlp = mlp_block(config, layer)
        eps, offset = config.rms_norm_eps, config.norm_offset
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    def blocks(
        self,
        normed: Tensor,
        x: Tensor,
        batch: ForwardBatch,
        pool: KVPool | None,
        inv_freq: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """The layer short of its last residual add: from the input stream ``x`` and its
        input-normed ``normed``, returns ``(mlp_out, stream)`` whose sum is the stream leaving
        the layer, so a caller can fuse that add into the next norm."""
        attended = getattr(self, self.mixer_name)(normed, batch, pool, inv_freq)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attended)
            out = self.mlp(self.pre_feedforward_layernorm(x))
            return self.post_feedforward_layernorm(out), x
        norm = self.post_attention_layernorm
        normed, x = kernels.model_ops.add_rms_norm(attended, x, norm.scale, norm.eps)
        return self.mlp(normed), x


class NoPEAttention(Attention):
    """Grouped-query attention without positional embedding (Nemotron-H's attention layers:
    the Mamba-2 layers carry the order), over the paged cache."""

    def forward(
        self, x: Tensor, batch: ForwardBatch, pool: KVPool | None, inv_freq: Tensor
    ) -> Float[Tensor, "batch q hidden"]:
        """Project, write K/V into the pool unrotated, attend, and project back (with
        ``pool=None``, the queries attend to each other's keys under ``batch.new_mask``)."""
        qs, ks, vs = self.heads(x)
        if pool is None:
            return self.project_out(dense_attention(qs, ks, vs, batch.new_mask).flatten(2))
        kernels.write_kv(pool.k[self.layer], batch.slots, ks)
        kernels.write_kv(pool.v[self.layer], batch.slots, vs)
        return self.attend(qs, batch, pool)


class SquaredReluMLP(nn.Module):
    """Nemotron-H's non-gated MLP: ``down(relu(up(x)) ** 2)``, ``intermediate_size`` wide
    (default: the config's)."""

    def __init__(self, config: DecoderConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        h, bias = config.hidden_size, config.mlp_bias
        i = config.intermediate_size if intermediate_size is None else intermediate_size
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """``down(relu(up(x)) ** 2)``."""
        return self.down_proj(F.relu(self.up_proj(x)).square())


class StackedExperts(nn.Module):
    """Non-gated experts' weights stacked (transformers' ``NemotronHExperts``): ``up_proj [E,
    I, H]`` and ``down_proj [E, H, I]``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SquaredReluMoE(nn.Module):
    """Nemotron-H's mixture of experts (``config.mamba.moe``): a float32 :class:`Router`
    ``gate`` with DeepSeek-V3's grouped sigmoid routing, non-gated squared-ReLU experts
    (:class:`StackedExperts`) and an ungated squared-ReLU ``shared_experts`` every token goes
    through, added last.

    The routed experts run densely, as ``kernels.model_ops.moe_reference`` runs SwiGLU ones:
    every row through every expert, the outputs of experts a row did not select dropped by
    ``where``; no host sync and no data-dependent shape (CUDA graphs capture it), at ``E /
    top_k`` times routing's FLOPs."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        assert config.mamba is not None and config.mamba.moe is not None
        moe = config.mamba.moe
        self.moe = moe
        h = config.hidden_size
        self.gate = Router(h, moe.num_experts, correction_bias=True, keep_float32=True)
        self.experts = StackedExperts(moe.num_experts, h, moe.expert_intermediate_size)
        self.shared_experts = SquaredReluMLP(config, moe.shared_expert_intermediate_size)

    def forward(self, x: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows hidden"]:
        """The routed experts' weighted sum plus the shared expert."""
        moe = self.moe
        rows = x.reshape(-1, x.shape[-1])
        weights = kernels.model_ops.moe_row_weights(
            rows,
            self.gate.weight,
            *moe.routing,
            self.gate.e_score_correction_bias,
            moe.float32_router,
        )
        out = torch.zeros_like(rows)
        for expert in range(moe.num_experts):
            hidden = F.relu(F.linear(rows, self.experts.up_proj[expert])).square()
            expert_out = F.linear(hidden, self.experts.down_proj[expert])
            weight = weights[:, expert, None]
            out = out + torch.where(weight != 0, (expert_out * weight).to(x.dtype), 0)
        return out.view(x.shape) + self.shared_experts(x)


class GroupGatedRMSNorm(nn.Module):
    """Mamba-2's output norm (transformers' ``NemotronHRMSNormGated``): ``x * silu(gate)``
    RMS-normed in float32 over groups of ``group_size`` channels, scaled by ``weight``."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        """``weight * group_rms_norm(x * silu(gate))``, in ``x``'s dtype."""
        gated = (x.float() * F.silu(gate.float())).unflatten(-1, (-1, self.group_size))
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.flatten(-2).to(x.dtype)


class Mamba2Mixer(nn.Module):
    """A Mamba-2 layer (Nemotron-H's ``mixer``) over the recurrent pool.

    Parameters carry the hub's names: ``in_proj`` (the gate ``z``, the conv inputs ``xBC``,
    then one step-size input per head), ``conv1d`` (depthwise), ``dt_bias``, ``A_log``,
    ``D``, ``norm`` (:class:`GroupGatedRMSNorm`, one group per B/C group) and ``out_proj``.
    The per-request conv and SSM states live in ``pool.recurrent`` at the batch's state
    slots, layer ``self.layer`` (its ordinal among Mamba-2 layers); ``spec.recurrent``'s
    :func:`~speculum.spec.recurrent.mamba2_scan` runs the recurrence, each token from its
    parent's state, so tree verify keeps a candidate state per node, as for gated DeltaNet.
    """

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        mamba = config.mamba
        if mamba is None:
            raise ValueError("Mamba2Mixer needs a config with Mamba-2 settings (config.mamba)")
        self.mamba = mamba
        self.layer = mamba.ordinal(layer)
        h, inner, channels = config.hidden_size, mamba.inner_size, mamba.conv_channels
        self.in_proj = nn.Linear(h, inner + channels + mamba.num_heads, bias=mamba.proj_bias)
        self.conv1d = nn.Conv1d(
            channels, channels, mamba.conv_kernel, groups=channels, bias=mamba.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(mamba.num_heads))
        self.A_log = nn.Parameter(torch.zeros(mamba.num_heads))
        self.D = nn.Parameter(torch.ones(mamba.num_heads))
        self.norm = GroupGatedRMSNorm(inner, inner // mamba.n_groups, config.rms_norm_eps)
        self.out_proj = nn.Linear(inner, h, bias=mamba.proj_bias)

    def forward(
        self, x: Tensor, batch: ForwardBatch, pool: KVPool | None, inv_freq: Tensor
    ) -> Float[Tensor, "batch q hidden"]:
        """Conv and state-space update from each token's parent state (written into the pool
        at the batch's state slots), gated norm and output projection."""
        if pool is None or pool.recurrent is None:
            raise ValueError(
                "a Mamba-2 layer needs the recurrent pool (build the pool with the model's "
                "new_pool, and give each request its own PagedKV.state_slots); cache-free "
                "training is not supported for hybrid models"
            )
        m = self.mamba
        z, xbc, dt = self.in_proj(x).split([m.inner_size, m.conv_channels, m.num_heads], -1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*m.time_step_limit)
        out = kernels.mamba2_scan(
            pool.recurrent.conv[self.layer],
            pool.recurrent.ssm[self.layer],
            batch.state_slots,
            batch.prefix_lens,
            batch.q_lens,
            batch.new_mask,
            xbc,
            self.conv1d.weight[:, 0],
            self.conv1d.bias,
            dt,
            -self.A_log.float().exp(),
            self.D,
            [m.num_heads, m.head_dim, m.n_groups, m.state_size],
        )
        return self.out_proj(self.norm(out.flatten(2), z))


class MixerLayer(ResidualLayer):
    """A layer of one mixer (Nemotron-H): ``x + mixer(norm(x))``, the mixer the layer plan's
    kind (``config.mamba.layer_types``): :class:`Mamba2Mixer`, attention
    (:func:`attention_block`), :class:`SquaredReluMLP` or :class:`SquaredReluMoE`. Named as
    the hub names it (``norm``, ``mixer``)."""

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        assert config.mamba is not None
        kind = config.mamba.layer_types[layer]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer: nn.Module
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(config, layer)
        elif kind == "full_attention":
            self.mixer = attention_block(config, layer)
        elif kind == "moe":
            self.mixer = SquaredReluMoE(config)
        else:
            self.mixer = SquaredReluMLP(config)
        self.reads_cache = kind in ("linear_attention", "full_attention")

    @property
    def input_layernorm(self) -> RMSNorm:
        """The pre-norm (what :class:`DecoderModel` fuses the previous residual add into)."""
        return self.norm

    def blocks(
        self,
        normed: Tensor,
        x: Tensor,
        batch: ForwardBatch,
        pool: KVPool | None,
        inv_freq: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """``(mixer_out, x)``, whose sum is the stream leaving the layer (as
        :meth:`DecoderLayer.blocks`)."""
        if self.reads_cache:
            return self.mixer(normed, batch, pool, inv_freq), x
        return self.mixer(normed), x


def decoder_layer(config: DecoderConfig, layer: int, cache_layer: int) -> DecoderLayer:
    """Decoder layer ``layer`` exactly as a model of ``config`` builds it (the attention and
    MLP kinds the config gives that index), its attention reading and writing layer
    ``cache_layer`` of its pool instead of layer ``layer``.

    MTP layers are built here: DeepSeek-style checkpoints store them after the decoder's own
    layers (``model.layers.{num_layers + i}``), so layer ``num_layers + i`` has the kind the
    config's rule gives that index (an MoE layer in an MoE model), while its K/V live in layer
    ``i`` of the draft's own pool (:func:`pool_for`)."""
    built = DecoderLayer(config, layer)
    built.self_attn.layer = cache_layer
    return built


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (transformers' ``model.*``)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer = DecoderLayer if config.mamba is None else MixerLayer
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)


def float32_logits(
    hidden: Float[Tensor, "*rows hidden"], weight: Float[Tensor, "vocab hidden"]
) -> Float[Tensor, "*rows vocab"]:
    """``hidden @ weight.T`` accumulated in float32 and never rounded to the weights' dtype.

    A bfloat16 logit has an ulp of 0.03 to 0.125 at common magnitudes, so rounding logits to
    bfloat16 turns near-ties into exact ties that two forwards of the same tokens (a decode
    step and a verify over several tokens run different matmul kernels) break differently.
    On CUDA the matmul writes float32 directly (same bytes read); elsewhere the operands are
    widened. Training (gradients wanted) keeps the differentiable ``linear``.
    """
    if weight.dtype == torch.float32 or (torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(hidden, weight).float()
    if hidden.is_cuda:
        rows = hidden.reshape(-1, hidden.shape[-1])
        out = torch.mm(rows, weight.t(), out_dtype=torch.float32)
        return out.view(*hidden.shape[:-1], weight.shape[0])
    return F.linear(hidden.float(), weight.float())


class LMHead(nn.Linear):
    """A bias-free projection onto a vocabulary: calling it gives logits in the weights' dtype,
    :meth:`logits` float32 ones (:func:`float32_logits`). Its own class so that tensor
    parallelism (``models.parallel.shard_``) knows which linear layers to split by vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        #: ``{"lm_head"}`` where :meth:`logits` runs ``speculum::half_linear``
        #: (:func:`gemv_projections_`).
        self.gemv: frozenset[str] = frozenset()

    def logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """Float32 logits of ``hidden`` over the whole vocabulary: :func:`float32_logits`, or
        ``speculum::half_linear`` writing float32 where ``gemv`` says so."""
        if "lm_head" in self.gemv and not _wants_grad(self.weight):
            return kernels.half.half_linear(hidden, self.weight, None, True)
        return float32_logits(hidden, self.weight)


def check_packable(config: DecoderConfig, pool: KVPool | None) -> None:
    """Refuse a packed forward that this model cannot run: recurrent layers scan each
    request's tokens in a padded row, and cache-free training has no per-request queries."""
    if pool is None or config.is_hybrid:
        raise ValueError(
            "a packed forward (ragged verify) needs a KV pool and attention-only layers; run "
            "hybrid models and cache-free training with the padded layout (no q_starts)"
        )


def cache_kv_heads(module: nn.Module, default: int) -> int:
    """K/V heads per layer that ``module``'s attention writes into its pool: this rank's share
    under tensor parallelism, ``default`` for a module without attention."""
    return next((m.num_kv_heads for m in module.modules() if isinstance(m, Attention)), default)


class DecoderModel(nn.Module):
    """A Llama-family causal LM over the paged KV cache.

    Weights are fixed during inference; the only state a forward changes is the K/V it writes
    into the pool at ``batch.slots``. ``config`` always describes the whole checkpoint; a model
    sharded over a tensor-parallel group (``models.parallel.shard_``) records the group in
    ``tp`` and holds this rank's slices of the weights and of the KV heads.
    """

    #: The tensor-parallel group the model is sharded over (:data:`SINGLE`: not sharded).
    tp: TensorParallel = SINGLE
    #: How the checkpoint's FP8 layers are quantized (``models.fp8.Fp8Scheme``), written back
    #: as ``quantization_config`` on save; ``None`` for an unquantized model.
    quantization: Any = None

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.register_buffer("local_inv_freq", _local_inv_freq(config), persistent=False)

    def reset_rope(self) -> None:
        """Recompute the rotary tables (after ``to_empty`` wiped buffers)."""
        device = self.model.embed_tokens.weight.device
        self.inv_freq = rope_inv_freq(self.config).to(device)
        self.local_inv_freq = _local_inv_freq(self.config).to(device)

    def embed(self, tokens: Int[Tensor, "*rows"]) -> Float[Tensor, "*rows hidden"]:
        """The residual stream entering layer 0: the tokens' embeddings, times
        ``config.embedding_scale`` (Gemma's ``sqrt(hidden_size)``, rounded to the weights'
        dtype first, as transformers does)."""
        x = self.model.embed_tokens(tokens)
        if self.config.embedding_scale == 1.0:
            return x
        return x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)

    def layer_inv_freq(self, layer: int) -> Float[Tensor, " half"]:
        """The rotary table layer ``layer`` rotates with: Gemma-3's local one in its windowed
        layers (``DecoderConfig.uses_local_rope``), the model's otherwise."""
        return self.local_inv_freq if self.config.uses_local_rope(layer) else self.inv_freq

    def new_pool(
        self,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype | None = None,
        *,
        state_slots: int = 9,
        state_ring: int = 16,
    ) -> KVPool:
        """A zeroed KV pool shaped for this model's attention (:func:`pool_for`); a hybrid
        model's also holds ``state_slots`` recurrent-state slots (slot 0 the padding sink) of
        ``state_ring`` entries each (:func:`recurrent_pool_for`), ignored otherwise."""
        pool = pool_for(self, self.config, self.config.num_layers, num_pages, page_size, dtype)
        if not self.config.is_hybrid:
            return pool
        states = recurrent_pool_for(self.config, state_slots, state_ring, pool.k.dtype)
        return attrs.evolve(pool, recurrent=states.to(pool.k.device))

    def forward(
        self, batch: ForwardBatch, pool: KVPool | None, capture_layers: tuple[int, ...] = ()
    ) -> tuple[Float[Tensor, "batch q hidden"], tuple[Float[Tensor, "batch q hidden"], ...]]:
        """Final-normed hidden states of the new tokens, and the outputs of ``capture_layers``.

        ``pool=None`` runs cache-free and differentiably, for training (see ``dense_batch``).

        ``capture_layers[i] = n`` returns the residual stream leaving layer ``n`` (what
        transformers calls ``hidden_states[n + 1]``), as the EAGLE-3 and MTP drafts need.

        A packed ``batch`` (``ForwardBatch``'s packed layout, ragged verify) gives packed
        ``[1, tokens, hidden]`` outputs: every layer but attention is per token, and attention
        reads each request's queries from its offset.
        """
        if batch.packed:
            check_packable(self.config, pool)
        if pool is not None and pool.latent_plans is not None:
            batch = replace(batch, latent_plan=pool.latent_plans.bind(batch))
        x = self.embed(batch.input_ids)
        layers = self.model.layers
        captured: dict[int, Tensor] = {}
        # Each layer's last residual add is fused into the next norm (the next layer's input
        # norm, or the final norm): one kernel fewer per layer, the same rounding.
        normed = layers[0].input_layernorm(x) if len(layers) else self.model.norm(x)
        for n, layer in enumerate(layers):
            out, x = layer.blocks(normed, x, batch, pool, self.layer_inv_freq(n))
            norm = layers[n + 1].input_layernorm if n + 1 < len(layers) else self.model.norm
            normed, x = kernels.model_ops.add_rms_norm(out, x, norm.scale, norm.eps)
            if n in capture_layers:
                captured[n] = x
        return normed, tuple(captured[n] for n in capture_layers)

    def logits(self, hidden: Float[Tensor, "*rows hidden"]) -> Float[Tensor, "*rows vocab"]:
        """Float32 next-token logits of final-normed hidden states over the whole vocabulary
        (see :func:`float32_logits`), soft-capped where the config says (Gemma)."""
        logits = self.lm_head.logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
