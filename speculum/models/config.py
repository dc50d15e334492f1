"""Decoder configuration, parsed from a Hugging Face ``config.json``.

One config covers the Llama family as transformers writes it: ``LlamaForCausalLM`` (with Llama
3.1 ``rope_scaling``), ``Qwen2ForCausalLM`` (q/k/v bias), ``Qwen3ForCausalLM`` (q/k RMSNorm) and
``MistralForCausalLM``, and the mixture-of-experts kinds of them: ``MixtralForCausalLM``,
``Qwen2MoeForCausalLM`` (with its sigmoid-gated shared expert), ``Qwen3MoeForCausalLM`` and
``Glm4MoeForCausalLM`` (GLM-4.5: partial rotary, DeepSeek-V3's group-limited sigmoid routing,
shared experts, dense first layers), whose routing settings are a :class:`MoEConfig`, and
DeepSeek's multi-head latent attention with DeepSeek routing (``DeepseekV2ForCausalLM``,
``DeepseekV3ForCausalLM``, with YaRN rope scaling), whose attention shapes are an
:class:`MLAConfig`, and the hybrid ``Qwen3NextForCausalLM`` (gated DeltaNet layers between
gated full-attention layers, zero-centred norms, Qwen2-MoE-style experts), whose
linear-attention shapes are a :class:`LinearAttentionConfig`, and gpt-oss
(``GptOssForCausalLM``: alternating windowed and full layers with attention sinks, biased
q/k/v/o, YaRN rope, MoE with a biased router, biased experts and a clamped GLU; MXFP4
checkpoints are refused, naming the fix), and the hybrid
``NemotronHForCausalLM`` (one mixer per layer: Mamba-2, attention without rotary embedding or a
squared-ReLU MLP or a mixture of squared-ReLU experts), whose layer plan, Mamba-2 shapes and
routing are a :class:`MambaConfig`, and Gemma-3's text decoder (``Gemma3ForCausalLM``:
local windowed layers with their own rotary base between global ones, q/k norms, norms around
the attention and the MLP, zero-centred norm weights, embeddings scaled by
``sqrt(hidden_size)``, a tanh-GELU MLP, ``query_pre_attn_scalar`` and an optional final logit
soft cap; attention logit soft-capping and bidirectional attention are refused). Both
spellings of the rotary settings are read: ``rope_theta`` plus ``rope_scaling`` (transformers
4) and ``rope_parameters`` (transformers 5).

Values no model can run with are refused here, naming the file, the key and the value: sizes
that are not positive integers, attention heads that do not group evenly over the KV heads, a
``head_dim`` the rotary embedding cannot rotate, ``rope_theta`` or ``rms_norm_eps`` not above
zero, EOS ids outside the vocabulary, routing settings that contradict each other
(``num_experts_per_tok`` above the number of experts or above what the allowed expert groups
hold, two different expert counts, ``topk_group`` above ``n_group``, experts that do not split
into ``n_group`` groups, an unknown ``scoring_func`` or ``topk_method``), latent attention
widths missing or not positive (``kv_lora_rank`` ...) or an odd ``qk_rope_head_dim``, and an
unreadable ``generation_config.json``.

Sliding-window attention: Mistral and Mixtral window every layer with ``sliding_window``; Qwen2,
Qwen3 and Qwen2-MoE window the layers ``layer_types`` names ``"sliding_attention"``
(transformers 5 writes it), else by transformers' default rule (Qwen2/Qwen3: layers from
``max_window_layers`` on; Qwen2-MoE: even layers below ``max_window_layers``), and only with
``use_sliding_window``; Qwen3-MoE windows every layer with ``use_sliding_window``; gpt-oss
windows the layers ``layer_types`` names (by default the even ones) with ``sliding_window``
(default 128), no switch needed, and Gemma-3 the layers ``layer_types`` names (by default five
of every ``sliding_window_pattern`` = 6) with ``sliding_window`` (default 4096). Llama, GLM-4.5
and DeepSeek have no window (transformers reads no ``sliding_window`` for them). A
``layer_types`` of the wrong length or with an unknown kind is refused, and so is one naming
sliding layers of a config without a window.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "CheckpointError",
    "DecoderConfig",
    "LinearAttentionConfig",
    "MLAConfig",
    "MambaConfig",
    "MoEConfig",
    "UnsupportedModel",
    "SUPPORTED_ARCHITECTURES",
    "ROPE_TYPES",
    "SCORING_FUNCS",
    "TOPK_METHODS",
    "FP8_QUANT_METHODS",
    "check_quantization_method",
    "read_json_object",
]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM",
    "GptOssForCausalLM",
    "NemotronHForCausalLM",
    "Gemma3ForCausalLM",
)
#: architecture -> transformers' ``model_type``
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3NextForCausalLM": "qwen3_next",
    "GptOssForCausalLM": "gpt_oss",
    "NemotronHForCausalLM": "nemotron_h",
    "Gemma3ForCausalLM": "gemma3_text",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: Architectures whose every layer takes ``sliding_window`` (transformers reads no
#: ``layer_types`` for them).
WINDOW_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
#: Architectures whose windowed layers follow ``layer_types`` (or transformers' default rule).
WINDOW_BY_LAYER_TYPE = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "GptOssForCausalLM",
    "Gemma3ForCausalLM",
)
#: Architectures whose ``layer_types`` and ``sliding_window`` are read without a
#: ``use_sliding_window`` switch (gpt-oss: alternating windowed and full layers by default;
#: Gemma-3: five local layers to a global one).
WINDOW_WITHOUT_SWITCH = (
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
    "Gemma3ForCausalLM",
)
#: The attention kinds ``layer_types`` may name.
LAYER_TYPES = ("full_attention", "sliding_attention")
#: Architectures whose attention is multi-head latent attention (:class:`MLAConfig`).
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


class UnsupportedModel(ValueError):
    """A checkpoint whose architecture or settings this decoder does not implement."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: files or weights missing, extra, or of the
    wrong shape or dtype, or a config value no model can run with."""


#: Each mixture-of-experts architecture (whose configs carry a :class:`MoEConfig`) -> the
#: dense architecture with the same attention. GLM-4.5 has none in transformers; its own
#: config with every layer dense (``first_k_dense_replace`` = the layer count) is one.
_DENSE_ARCHITECTURES = {
    "MixtralForCausalLM": "MistralForCausalLM",
    "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
    "Qwen3MoeForCausalLM": "Qwen3ForCausalLM",
    "Glm4MoeForCausalLM": "Glm4MoeForCausalLM",
    "DeepseekV2ForCausalLM": "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM": "Qwen3ForCausalLM",
    "GptOssForCausalLM": "LlamaForCausalLM",
    "NemotronHForCausalLM": "LlamaForCausalLM",
}
#: Architectures with DeepSeek-style MoE settings (``n_routed_experts``, ``n_shared_experts``,
#: ``first_k_dense_replace``, ``n_group`` ...) -> transformers' defaults for the routing keys
#: a ``config.json`` leaves out (see :func:`_deepseek_moe_settings`).
_DEEPSEEK_STYLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "Glm4MoeForCausalLM": {
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
    },
    "DeepseekV2ForCausalLM": {
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "norm_topk_prob": False,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
    },
    "DeepseekV3ForCausalLM": {
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
    },
}
#: How router logits become expert scores: their softmax over every expert, their sigmoid, or
#: (``softmax_topk``, gpt-oss) the softmax over the chosen experts' logits only, after the top
#: k is taken from the logits.
SCORING_FUNCS = ("softmax", "sigmoid", "softmax_topk")
#: How the ``top_k`` experts are chosen: plain top-k (``greedy``: Qwen, Mixtral, DeepSeek-V2),
#: or top-k inside the ``topk_group`` best of ``n_group`` groups of consecutive experts, a group
#: ranked by its best score (``group_limited_greedy``: DeepSeek-V2) or by the sum of its two best
#: bias-corrected scores (``noaux_tc``: DeepSeek-V3, GLM-4.5).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@attrs.define(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    """Routing and expert shapes of a mixture-of-experts decoder (all static).

    A sparse layer's MLP scores every one of ``num_experts`` experts (``scoring_func``: softmax
    or sigmoid of the router logits), sends every token to ``top_k`` of them (chosen as
    ``topk_method`` says, from ``n_group`` groups of which the ``topk_group`` best are allowed,
    by the scores plus the router's ``e_score_correction_bias`` for ``noaux_tc``) and sums their
    outputs weighted by their scores (renormalised to sum to one when ``norm_topk_prob``, then
    times ``routed_scaling_factor``). Where the shared expert's width
    ``shared_expert_intermediate_size`` is above zero (Qwen2-MoE), every token also goes
    through a shared expert, scaled by a sigmoid gate; where ``n_shared_experts`` is above zero
    (DeepSeek, GLM-4.5), through an ungated shared MLP ``n_shared_experts`` experts wide. Layer
    ``n`` is sparse unless ``n`` is in ``dense_layers`` or ``n + 1`` is not a multiple of
    ``sparse_step`` (transformers' ``mlp_only_layers`` or ``first_k_dense_replace``, and
    ``decoder_sparse_step``); dense layers run the usual MLP of
    ``DecoderConfig.intermediate_size``. ``float32_router`` routes as transformers' DeepSeek
    and GLM routers do (see ``kernels.model_ops.moe_reference``). The new fields' names are
    the hub configs' own; their defaults are Qwen's and Mixtral's routing.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    float32_router: bool = False
    #: gpt-oss: the router has a bias (``mlp.router.bias``), and every expert's gate/up and
    #: down projections have biases.
    biases: bool = False
    #: gpt-oss's clamped GLU when above 0: ``gate`` clamped to at most ``swiglu_limit``, ``up``
    #: to ``[-swiglu_limit, swiglu_limit]``, then ``(up + 1) * gate * sigmoid(swiglu_alpha *
    #: gate)``; 0 is SwiGLU's ``silu(gate) * up``.
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"MoEConfig: top_k {self.top_k} must be between 1 and num_experts "
                f"{self.num_experts} (each token goes to top_k distinct experts): fix top_k"
            )
        problem = _routing_problem(
            num_experts=self.num_experts,
            top_k=self.top_k,
            scoring_func=self.scoring_func,
            topk_method=self.topk_method,
            n_group=self.n_group,
            topk_group=self.topk_group,
        )
        if problem:
            raise ValueError(f"MoEConfig: {problem}")

    @property
    def routing(self) -> tuple[int, bool, str, str, int, int, float]:
        """The routing arguments of ``kernels.model_ops.moe`` and ``moe_row_weights``, in
        their order: ``top_k``, ``norm_topk_prob``, ``scoring_func``, ``topk_method``,
        ``n_group``, ``topk_group``, ``routed_scaling_factor``."""
        return (
            self.top_k,
            self.norm_topk_prob,
            self.scoring_func,
            self.topk_method,
            self.n_group,
            self.topk_group,
            self.routed_scaling_factor,
        )

    @property
    def has_correction_bias(self) -> bool:
        """Whether the router holds an ``e_score_correction_bias`` (``noaux_tc`` routing)."""
        return self.topk_method == "noaux_tc"

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a mixture-of-experts MLP (else a dense one)."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


def _routing_problem(
    *,
    num_experts: int,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
) -> str | None:
    """Why an expert choice is unknown or cannot pick ``top_k`` experts (``None`` when it
    can), naming the hub config's keys."""
    if scoring_func not in SCORING_FUNCS:
        return f"scoring_func {scoring_func!r} is not one of {', '.join(SCORING_FUNCS)}"
    if topk_method not in TOPK_METHODS:
        return f"topk_method {topk_method!r} is not one of {', '.join(TOPK_METHODS)}"
    if topk_method == "greedy":
        return None  # the groups are not used
    if n_group < 1 or num_experts % n_group:
        return (
            f"n_group {n_group} does not divide the {num_experts} routed experts "
            "(n_routed_experts) into equal groups; fix n_group"
        )
    if topk_group < 1:
        return f"topk_group {topk_group} must be at least 1; fix topk_group"
    if topk_group > n_group:
        return (
            f"topk_group {topk_group} is more than n_group {n_group} (a token may use "
            "topk_group of the n_group groups); fix topk_group"
        )
    per_group = num_experts // n_group
    if topk_method == "noaux_tc" and per_group < 2:
        return (
            f"noaux_tc ranks a group by its two best experts, but n_group {n_group} leaves "
            f"{per_group} expert per group; fix n_group"
        )
    if top_k > topk_group * per_group:
        return (
            f"num_experts_per_tok {top_k} is more than the {topk_group * per_group} experts a "
            f"token may use (topk_group {topk_group} × {per_group} experts per group), so "
            "routing is impossible; fix num_experts_per_tok, topk_group or n_group"
        )
    return None


@attrs.define(frozen=True, slots=True, kw_only=True)
class MLAConfig:
    """Shapes of multi-head latent attention (DeepSeek-V2/V3; all static).

    Each token's hidden state is compressed to a latent of ``kv_lora_rank`` values (RMS-normed)
    and a rotary key of ``qk_rope_head_dim`` values shared by every head; ``kv_b_proj`` expands
    the latent into each head's ``qk_nope_head_dim`` key and ``v_head_dim`` value columns. The
    queries come from ``q_proj``, or through the low-rank ``q_a_proj`` / ``q_b_proj`` pair when
    ``q_lora_rank`` is set. ``rope_interleave``: the rotary dimensions pair up interleaved
    (``(x0, x1), (x2, x3) ..``, DeepSeek's own layout) rather than as halves.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and (expanded) key: the unrotated part then the rotary."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values the paged cache holds per token and layer: the latent then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@attrs.define(frozen=True, slots=True, kw_only=True)
class LinearAttentionConfig:
    """Shapes of a hybrid decoder's gated DeltaNet layers (Qwen3-Next; all static).

    ``layer_types[n]`` is ``"linear_attention"`` or ``"full_attention"`` for decoder layer
    ``n``. A linear-attention layer projects each token to ``num_k_heads`` query and key heads
    of ``k_dim`` and ``num_v_heads`` value heads of ``v_dim``, runs them through a causal
    conv1d of ``conv_kernel`` taps, then the gated delta rule (see ``spec.recurrent``)."""

    layer_types: tuple[str, ...]
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: queries, keys and values concatenated."""
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a gated DeltaNet layer."""
        return self.layer_types[layer] == "linear_attention"

    def ordinal(self, layer: int) -> int:
        """Layer ``layer``'s index among the layers of its own kind (its pool layer)."""
        return kind_ordinal(self.layer_types, layer)


def kind_ordinal(layer_types: tuple[str, ...], layer: int) -> int:
    """Layer ``layer``'s index among the layers of its own kind in ``layer_types`` (its layer
    in the KV pool for an attention layer, in the recurrent pool for a recurrent one)."""
    kind = layer_types[layer]
    return sum(t == kind for t in layer_types[:layer])


#: Nemotron-H's layer kinds as transformers 5 writes them (``layers_block_type``), and the
#: letters of the older ``hybrid_override_pattern`` spelling: one mixer per layer.
NEMOTRON_H_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@attrs.define(frozen=True, slots=True, kw_only=True)
class MambaConfig:
    """Shapes of a hybrid decoder's Mamba-2 layers and its layer plan (Nemotron-H; all static).

    ``layer_types[n]`` is decoder layer ``n``'s one mixer: ``"linear_attention"`` (Mamba-2),
    ``"full_attention"`` (attention without rotary embedding), ``"mlp"`` (a non-gated
    squared-ReLU MLP) or ``"moe"`` (a mixture of such MLPs routed by ``moe``: DeepSeek-V3's
    grouped sigmoid routing, plus an ungated squared-ReLU shared expert
    ``moe.shared_expert_intermediate_size`` wide). A Mamba-2 layer projects each token to a
    gate ``z``, the conv inputs ``xBC`` (``num_heads * head_dim`` values ``x``, then
    ``n_groups`` groups of ``state_size`` input and output projections ``B`` and ``C``) and a
    step size per head; the causal conv1d of ``conv_kernel`` taps (with a bias when
    ``conv_bias``) and SiLU run over ``xBC``, then the selective state-space recurrence per
    head (see ``spec.recurrent.mamba2_scan``) with step sizes clamped to ``time_step_limit``.
    ``proj_bias``: the in/out projections' biases."""

    layer_types: tuple[str, ...]
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    time_step_limit: tuple[float, float]
    moe: MoEConfig | None = None

    @property
    def inner_size(self) -> int:
        """Width of ``x``, of the gate ``z`` and of the output projection's input."""
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: ``x``, ``B`` and ``C`` concatenated."""
        return self.inner_size + 2 * self.n_groups * self.state_size

    def is_mamba(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a Mamba-2 layer."""
        return self.layer_types[layer] == "linear_attention"

    def ordinal(self, layer: int) -> int:
        """Layer ``layer``'s index among the layers of its own kind (its pool layer)."""
        return kind_ordinal(self.layer_types, layer)


@attrs.define(frozen=True, slots=True, kw_only=True)
class DecoderConfig:
    """Shapes and options of a Llama-family decoder (all static)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str
    #: DeepSeek-V3-style multi-token-prediction layers stored after the decoder's own layers
    #: (``model.layers.{num_layers} ...``); the target ignores them, an MTP draft loads them.
    num_nextn_predict_layers: int = 0
    #: Routing of the mixture-of-experts layers; ``None`` for a dense decoder. MTP layers are
    #: of the target's kind; the other draft layers shaped like the target's are dense
    #: (:meth:`dense`).
    moe: MoEConfig | None = None
    #: Multi-head latent attention's shapes (DeepSeek-V2/V3); ``None`` for grouped-query
    #: attention. With MLA, ``head_dim`` is the rotary width ``mla.qk_rope_head_dim`` and
    #: ``num_kv_heads`` equals ``num_heads``.
    mla: MLAConfig | None = None
    #: The share of each head's dimensions the rotary embedding turns (the first
    #: ``head_dim * partial_rotary_factor``; GLM-4.5's 0.5); the rest pass through.
    partial_rotary_factor: float = 1.0
    #: Layers that attend to their whole context although ``sliding_window`` is set (Qwen's
    #: ``full_attention`` layers); every other layer sees the last ``sliding_window`` keys.
    full_attention_layers: tuple[int, ...] = ()
    #: gpt-oss: each attention head has a learned sink logit (``self_attn.sinks``) that joins
    #: the softmax's denominator and carries no value.
    attention_sinks: bool = False

    def attention_window(self, layer: int) -> int:
        """How many keys (the query's own included) a query of layer ``layer`` sees at most:
        ``sliding_window`` for a windowed layer, 0 (no limit) for a full-attention one."""
        if self.sliding_window is None or layer in self.full_attention_layers:
            return 0
        return self.sliding_window

    #: Gated DeltaNet layers of a hybrid decoder (Qwen3-Next); ``None`` when every layer
    #: attends.
    linear: LinearAttentionConfig | None = None
    #: Qwen3-Next's gated attention: ``q_proj`` also yields a per-head output gate, and the
    #: attention output is scaled by its sigmoid before ``o_proj``.
    attention_output_gate: bool = False
    #: Added to every RMSNorm weight but the DeltaNet's output norm: 1.0 for Qwen3-Next,
    #: whose checkpoints store zero-centred norm weights (scale ``1 + weight``).
    norm_offset: float = 0.0
    #: Nemotron-H's layer plan and Mamba-2 shapes (one mixer per layer: Mamba-2, attention
    #: without rotary embedding, or a squared-ReLU MLP); ``None`` for every other family.
    mamba: MambaConfig | None = None
    #: The MLP's activation: ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (Gemma-3's
    #: tanh-approximated GELU, gating the up projection the same way).
    hidden_act: str = "silu"
    #: Gemma-3: attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` rather than
    #: ``head_dim ** -0.5``; ``None`` for the usual scale.
    query_pre_attn_scalar: int | None = None
    #: Gemma-3: the rotary base of the windowed (local) layers, unscaled (``rope_theta`` and
    #: ``rope_scaling`` are the global layers'); ``None``: every layer rotates alike.
    local_rope_theta: float | None = None
    #: Gemma-3: the token embeddings are multiplied by this (``sqrt(hidden_size)``).
    embedding_scale: float = 1.0
    #: Gemma-3's norms around both blocks: ``post_attention_layernorm`` normalises the
    #: attention's output before the residual add, ``pre_feedforward_layernorm`` and
    #: ``post_feedforward_layernorm`` the MLP's input and output.
    sandwich_norms: bool = False
    #: Gemma: logits become ``cap * tanh(logits / cap)``; ``None``: no cap.
    final_logit_softcapping: float | None = None

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates with :attr:`local_rope_theta` (a windowed layer of
        a config that has one)."""
        return self.local_rope_theta is not None and self.attention_window(layer) > 0

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep recurrent state (gated DeltaNet or Mamba-2) in a
        ``RecurrentPool`` rather than K/V."""
        return self.linear is not None or self.mamba is not None

    def is_recurrent(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` keeps recurrent state (and no K/V)."""
        if self.mamba is not None:
            return self.mamba.is_mamba(layer)
        return self.linear is not None and self.linear.is_linear(layer)

    @property
    def num_kv_layers(self) -> int:
        """Layers whose K/V the paged pool holds: the attention layers."""
        if self.mamba is not None:
            return self.mamba.layer_types.count("full_attention")
        return sum(not self.is_recurrent(n) for n in range(self.num_layers))

    def cache_layer(self, layer: int) -> int:
        """The pool layer of decoder layer ``layer``: its index among the layers of its kind
        in a hybrid (attention layers in the KV pool, recurrent ones in the recurrent pool),
        itself otherwise."""
        plan = self.mamba or self.linear
        return layer if plan is None else plan.ordinal(layer)

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head the rotary embedding turns."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> DecoderConfig:
        """Parse a ``config.json`` dictionary, rejecting what this decoder cannot run.

        ``where`` names the file (and the section of it ``raw`` is) in error messages. Raises
        :class:`UnsupportedModel` for an architecture or setting speculum does not implement
        and :class:`CheckpointError` for a value no model can run with (see the module
        docstring)."""
        if not isinstance(raw, dict):
            raise UnsupportedModel(f"{where} must hold a JSON object, not {type(raw).__name__}")
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(raw.get("model_type"))
        mamba = _mamba_settings(raw, where) if arch == "NemotronHForCausalLM" else None
        if mamba is not None:  # Nemotron-H's names for the shared keys
            raw = {
                **raw,
                "num_hidden_layers": len(mamba.layer_types),
                "rms_norm_eps": raw.get("layer_norm_epsilon", 1e-5),
            }
        missing = [k for k in _REQUIRED if raw.get(k) is None]
        if missing:
            raise UnsupportedModel(f"{where} lacks required keys {missing}")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"{where}: architecture {arch!r} is not supported; speculum runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        check_quantization_method(raw, where)
        gemma = _gemma_settings(raw, where) if arch == "Gemma3ForCausalLM" else {}
        if not gemma and raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(
                f"{where}: hidden_act {raw['hidden_act']!r}: only 'silu' is supported"
            )
        rope = _rope_settings(raw, where, arch)
        size = {key: _integer(raw, key, where, minimum=1) for key in _REQUIRED}
        heads, hidden = size["num_attention_heads"], size["hidden_size"]
        mla = _mla_settings(raw, arch, where)
        kv_heads = _integer(raw, "num_key_value_heads", where, minimum=1, default=heads)
        if mla is not None:
            # MLA's keys and values come per head out of one latent: transformers' DeepSeek
            # configs carry a num_key_value_heads that nothing reads (V3's default is 128).
            kv_heads = heads
        _check_head_groups(heads, kv_heads, where)
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        glm = arch == "Glm4MoeForCausalLM"
        qwen3_next = arch == "Qwen3NextForCausalLM"
        gpt_oss = arch == "GptOssForCausalLM"
        attention_bias = bool(raw.get("attention_bias", gpt_oss))
        head_dim = mla.qk_rope_head_dim if mla else _head_dim(raw, hidden, heads, where)
        eos_ids = _token_ids(raw, "eos_token_id", where, size["vocab_size"])
        nextn = _integer(raw, "num_nextn_predict_layers", where, minimum=0, default=0)
        window, full_layers = _window_settings(raw, arch, where, size["num_hidden_layers"])
        return cls(
            architecture=arch,
            vocab_size=size["vocab_size"],
            hidden_size=hidden,
            intermediate_size=size["intermediate_size"],
            num_layers=size["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive(
                raw.get("rms_norm_eps", 1e-5 if gpt_oss else 1e-6), "rms_norm_eps", where, "1e-6"
            ),
            rope_theta=rope[0],
            rope_scaling=rope[1],
            max_position_embeddings=_integer(
                raw,
                "max_position_embeddings",
                where,
                minimum=1,
                default=_GEMMA3_DEFAULTS["max_position_embeddings"] if gemma else 2048,
            ),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", bool(gemma))),
            qkv_bias=(qwen2 and _qwen2_qkv_bias(raw, arch)) or attention_bias,
            o_bias=attention_bias and not (qwen2 or glm),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=qwen3 or qwen3_next or bool(gemma) or (glm and bool(raw.get("use_qk_norm"))),
            sliding_window=window,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            num_nextn_predict_layers=nextn,
            moe=_moe_settings(raw, arch, where, size["num_hidden_layers"], nextn),
            mla=mla,
            partial_rotary_factor=_partial_rotary_factor(
                raw, where, head_dim, 0.5 if glm else 0.25 if qwen3_next else 1.0
            ),
            full_attention_layers=full_layers,
            linear=_linear_settings(raw, where, size["num_hidden_layers"]) if qwen3_next else None,
            attention_output_gate=qwen3_next,
            norm_offset=1.0 if qwen3_next or gemma else 0.0,
            attention_sinks=gpt_oss,
            mamba=mamba,
            **gemma,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DecoderConfig:
        """Read ``config.json`` (and extra EOS ids from a sibling ``generation_config.json``).

        Raises :class:`CheckpointError` naming either file when it is unreadable or holds a
        value no model can run with, :class:`UnsupportedModel` for what speculum does not
        implement."""
        path = Path(path)
        config = cls.from_dict(read_json_object(path), str(path))
        gen_path = path.with_name("generation_config.json")
        if gen_path.exists():
            gen = read_json_object(gen_path)
            extra = _token_ids(gen, "eos_token_id", str(gen_path), config.vocab_size)
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
            config = attrs.evolve(config, eos_token_ids=merged)
        return config

    def dense(self) -> DecoderConfig:
        """This config with a dense MLP in every layer, under the dense architecture with the
        same attention (Mixtral -> Mistral, Qwen2-MoE -> Qwen2, Qwen3-MoE -> Qwen3, GLM-4.5
        and DeepSeek -> themselves with every layer dense, Qwen3-Next -> Qwen3 with its head
        shapes and partial rotary, every layer a plain attention layer): the shape of draft
        layers built like the target's for training (EAGLE, EAGLE-3, block and frozen-KV
        drafts; MTP layers keep the target's own kind)."""
        # gpt-oss's sibling is a Llama with its head shapes, biases and YaRN rope, but no
        # window (Llama reads none) and no sinks.
        no_window = {"sliding_window": None, "full_attention_layers": ()}
        return attrs.evolve(
            self,
            architecture=_DENSE_ARCHITECTURES.get(self.architecture, self.architecture),
            moe=None,
            linear=None,
            mamba=None,
            attention_output_gate=False,
            norm_offset=0.0,
            attention_sinks=False,
            **(no_window if self.architecture == "GptOssForCausalLM" else {}),
        )

    def to_dict(self) -> dict[str, Any]:
        """A ``config.json`` dictionary that transformers and :meth:`from_dict` both read."""
        model_type = MODEL_TYPES[self.architecture]
        rope_parameters = {"rope_type": "default", **(self.rope_scaling or {})}
        rope_parameters["rope_theta"] = self.rope_theta
        if self.partial_rotary_factor != 1.0:
            rope_parameters["partial_rotary_factor"] = self.partial_rotary_factor
        eos = list(self.eos_token_ids)
        nextn = {"num_nextn_predict_layers": self.num_nextn_predict_layers}
        return {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_bias,
            "mlp_bias": self.mlp_bias,
            **_window_dict(self),
            "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
            "bos_token_id": self.bos_token_id,
            "torch_dtype": self.dtype,
            **(nextn if self.num_nextn_predict_layers else {}),
            **(_moe_dict(self) if self.moe is not None else _dense_moe_dict(self)),
            **(_glm4_moe_dict(self) if self.architecture == "Glm4MoeForCausalLM" else {}),
            **(_mla_dict(self) if self.mla is not None else {}),
            **(_linear_dict(self.linear) if self.linear is not None else {}),
            **(_mamba_dict(self) if self.mamba is not None else {}),
            **(_gemma_dict(self) if self.architecture == "Gemma3ForCausalLM" else {}),
        }


#: transformers' defaults for Gemma-3's own keys.
_GEMMA3_DEFAULTS = {
    "query_pre_attn_scalar": 256,
    "rope_local_base_freq": 10000.0,
    "rope_theta": 1000000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 131072,
}


def _gemma_settings(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma-3's :class:`DecoderConfig` fields from its ``config.json`` (transformers 4's
    ``rope_local_base_freq`` or transformers 5's per-layer-type ``rope_parameters``), refusing
    what the decoder does not run: another activation, attention logit soft-capping (it
    would change the attention op itself) and bidirectional attention."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModel(
            f"{where}: hidden_activation {act!r}: Gemma-3 is run with 'gelu_pytorch_tanh' only"
        )
    if raw.get("attn_logit_softcapping") is not None:
        raise UnsupportedModel(
            f"{where}: attn_logit_softcapping {raw['attn_logit_softcapping']!r}: speculum's "
            "attention does not soft-cap scores (Gemma-3's released configs set none); set it "
            "to null only if the checkpoint was trained without it"
        )
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModel(
            f"{where}: use_bidirectional_attention is set: that is an encoder (EmbeddingGemma), "
            "not a causal decoder speculum can decode with"
        )
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModel(
            f"{where}: rope_parameters.sliding_attention.rope_type {local['rope_type']!r}: "
            "Gemma-3's local layers rotate with the default rope only"
        )
    theta = local.get("rope_theta", raw.get("rope_local_base_freq"))
    theta = _GEMMA3_DEFAULTS["rope_local_base_freq"] if theta is None else theta
    cap = raw.get("final_logit_softcapping")
    scalar = _integer(
        raw,
        "query_pre_attn_scalar",
        where,
        minimum=1,
        default=_GEMMA3_DEFAULTS["query_pre_attn_scalar"],
    )
    return {
        "hidden_act": act,
        "query_pre_attn_scalar": scalar,
        "local_rope_theta": _positive(theta, "rope_local_base_freq", where, "10000.0"),
        "embedding_scale": _integer(raw, "hidden_size", where, minimum=1) ** 0.5,
        "sandwich_norms": True,
        "final_logit_softcapping": None
        if cap is None
        else _positive(cap, "final_logit_softcapping", where, "30.0 or null"),
    }


def _window_settings(
    raw: dict[str, Any], arch: str, where: str, num_layers: int
) -> tuple[int | None, tuple[int, ...]]:
    """``(sliding_window, full_attention_layers)`` as transformers reads them for ``arch``
    (module docstring): no window where the architecture or ``use_sliding_window`` has none."""
    if arch not in WINDOW_EVERY_LAYER + WINDOW_BY_LAYER_TYPE:
        return None, ()
    gpt_oss, gemma = arch == "GptOssForCausalLM", arch == "Gemma3ForCausalLM"
    used = arch in WINDOW_WITHOUT_SWITCH or _boolean(raw, "use_sliding_window", where, False)
    default = 128 if gpt_oss else _GEMMA3_DEFAULTS["sliding_window"] if gemma else None
    window = _integer(raw, "sliding_window", where, minimum=1, default=default) if used else None
    if arch in WINDOW_EVERY_LAYER:
        return window, ()
    types = raw.get("layer_types")
    if types is None and gpt_oss:  # transformers' default: windowed, full, windowed, ...
        types = [("sliding_attention", "full_attention")[n % 2] for n in range(num_layers)]
    if types is None and gemma:  # transformers' default: every pattern-th layer is global
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern"))
        pattern = _GEMMA3_DEFAULTS["sliding_window_pattern"] if pattern is None else pattern
        pattern = _integer(
            {"sliding_window_pattern": pattern}, "sliding_window_pattern", where, minimum=1
        )
        types = [
            "full_attention" if (n + 1) % pattern == 0 else "sliding_attention"
            for n in range(num_layers)
        ]
    if types is None:
        first = _integer(raw, "max_window_layers", where, minimum=0, default=28)
        qwen2_moe = arch == "Qwen2MoeForCausalLM"
        windowed = [
            (n < first and n % 2 == 0) if qwen2_moe else n >= first for n in range(num_layers)
        ]
        types = ["sliding_attention" if w and window else "full_attention" for w in windowed]
    if not (
        isinstance(types, list)
        and len(types) == num_layers
        and all(t in LAYER_TYPES for t in types)
    ):
        raise CheckpointError(
            f"{where}: layer_types is {types!r}; it must list one of {', '.join(LAYER_TYPES)} "
            f"per layer (num_hidden_layers {num_layers}): fix layer_types in the file"
        )
    if window is None and "sliding_attention" in types:
        raise CheckpointError(
            f"{where}: layer_types names sliding_attention layers but the config has no window "
            "(use_sliding_window false or sliding_window null): set use_sliding_window and "
            "sliding_window, or make every layer full_attention"
        )
    if window is None:
        return None, ()  # one spelling of "no window", whatever layer_types lists
    return window, tuple(n for n, t in enumerate(types) if t == "full_attention")


def _window_dict(config: DecoderConfig) -> dict[str, Any]:
    """The sliding-window keys of ``config.json`` as transformers reads them for the
    architecture: ``layer_types`` where it is read, ``use_sliding_window`` for Qwen's."""
    keys: dict[str, Any] = {"sliding_window": config.sliding_window}
    switched = WINDOW_BY_LAYER_TYPE + ("Qwen3MoeForCausalLM",)
    if config.architecture in switched and config.architecture not in WINDOW_WITHOUT_SWITCH:
        keys["use_sliding_window"] = config.sliding_window is not None
    if config.architecture in WINDOW_BY_LAYER_TYPE:
        keys["layer_types"] = [
            "sliding_attention" if config.attention_window(n) else "full_attention"
            for n in range(config.num_layers)
        ]
    return keys


def _gemma_dict(config: DecoderConfig) -> dict[str, Any]:
    """Gemma-3's own ``config.json`` keys, its rotary settings nested by layer type as
    transformers 5 writes them (and the local base as transformers 4 did)."""
    full = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    local = {"rope_type": "default", "rope_theta": config.local_rope_theta}
    return {
        "hidden_activation": config.hidden_act,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "rope_local_base_freq": config.local_rope_theta,
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": None,
    }


def _qwen2_qkv_bias(raw: dict[str, Any], arch: str) -> bool:
    """Whether a Qwen2-family config has q/k/v biases: Qwen2 always (transformers ignores any
    ``qkv_bias`` key there), Qwen2-MoE unless its ``qkv_bias`` key says otherwise."""
    return arch != "Qwen2MoeForCausalLM" or bool(raw.get("qkv_bias", True))


def _moe_dict(config: DecoderConfig) -> dict[str, Any]:
    """The routing keys of ``config.json`` as transformers spells them for the architecture."""
    moe = config.moe
    assert moe is not None
    routing = {"num_experts_per_tok": moe.top_k}
    if config.architecture == "MixtralForCausalLM":
        # Mixtral's intermediate_size is the experts' (and always renormalises the top k).
        return {**routing, "num_local_experts": moe.num_experts}
    if config.architecture == "GptOssForCausalLM":  # intermediate_size is the experts' too
        return {
            **routing,
            "num_local_experts": moe.num_experts,
            "swiglu_limit": moe.swiglu_limit,
            "swiglu_alpha": moe.swiglu_alpha,
        }
    if config.architecture in _DEEPSEEK_STYLE_DEFAULTS:
        return {
            **routing,
            "n_routed_experts": moe.num_experts,
            "moe_intermediate_size": moe.expert_intermediate_size,
            "n_shared_experts": moe.n_shared_experts,
            "first_k_dense_replace": len(moe.dense_layers),
            "scoring_func": moe.scoring_func,
            "topk_method": moe.topk_method,
            "n_group": moe.n_group,
            "topk_group": moe.topk_group,
            "routed_scaling_factor": moe.routed_scaling_factor,
            "norm_topk_prob": moe.norm_topk_prob,
        }
    qwen = {
        **routing,
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": moe.sparse_step,
        "mlp_only_layers": list(moe.dense_layers),
    }
    if config.architecture in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM"):
        qwen["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    if config.architecture == "Qwen2MoeForCausalLM":
        qwen["qkv_bias"] = config.qkv_bias
    return qwen


def _linear_dict(linear: LinearAttentionConfig) -> dict[str, Any]:
    """Qwen3-Next's linear-attention keys."""
    return {
        "layer_types": list(linear.layer_types),
        "linear_num_key_heads": linear.num_k_heads,
        "linear_num_value_heads": linear.num_v_heads,
        "linear_key_head_dim": linear.k_dim,
        "linear_value_head_dim": linear.v_dim,
        "linear_conv_kernel_dim": linear.conv_kernel,
    }


def _linear_settings(raw: dict[str, Any], where: str, num_layers: int) -> LinearAttentionConfig:
    """Qwen3-Next's linear-attention shapes, with transformers' defaults: ``layer_types``, or
    every ``full_attention_interval``-th layer (default 4) full attention and the rest linear."""
    interval = _integer(raw, "full_attention_interval", where, minimum=1, default=4)
    kinds = ("linear_attention", "full_attention")
    default = [kinds[(n + 1) % interval == 0] for n in range(num_layers)]
    layer_types = raw.get("layer_types") or default
    if not (
        isinstance(layer_types, list)
        and len(layer_types) == num_layers
        and all(t in kinds for t in layer_types)
    ):
        raise CheckpointError(
            f"{where}: layer_types is {layer_types!r}; it must list {num_layers} entries "
            f"(num_hidden_layers), each {' or '.join(map(repr, kinds))}: fix layer_types"
        )
    dims = {
        key: _integer(raw, key, where, minimum=1, default=default_value)
        for key, default_value in (
            ("linear_num_key_heads", 16),
            ("linear_num_value_heads", 32),
            ("linear_key_head_dim", 128),
            ("linear_value_head_dim", 128),
            ("linear_conv_kernel_dim", 4),
        )
    }
    if dims["linear_num_value_heads"] % dims["linear_num_key_heads"]:
        raise CheckpointError(
            f"{where}: linear_num_value_heads {dims['linear_num_value_heads']} is not a "
            f"multiple of linear_num_key_heads {dims['linear_num_key_heads']} (each key head "
            "serves a group of value heads): fix one of them"
        )
    return LinearAttentionConfig(
        layer_types=tuple(layer_types),
        num_k_heads=dims["linear_num_key_heads"],
        num_v_heads=dims["linear_num_value_heads"],
        k_dim=dims["linear_key_head_dim"],
        v_dim=dims["linear_value_head_dim"],
        conv_kernel=dims["linear_conv_kernel_dim"],
    )


def _mamba_settings(raw: dict[str, Any], where: str) -> MambaConfig:
    """Nemotron-H's layer plan (``layers_block_type``, or the older ``hybrid_override_pattern``
    string) and Mamba-2 shapes, with transformers' defaults (and its older key spellings,
    ``mamba_n_groups`` ...). Mixture-of-experts layers (``"moe"``, ``E``) behind latent
    projections (``moe_latent_size``) are refused."""
    kinds = raw.get("layers_block_type") or raw.get("layer_types")
    pattern = raw.get("hybrid_override_pattern")
    if kinds is None and isinstance(pattern, str) and set(pattern) <= set(NEMOTRON_H_KINDS):
        kinds = [NEMOTRON_H_KINDS[c] for c in pattern]
    if not (
        isinstance(kinds, list) and kinds and all(k in NEMOTRON_H_KINDS.values() for k in kinds)
    ):
        raise CheckpointError(
            f"{where}: the layer plan is {kinds or pattern!r}; layers_block_type must list one "
            f"of {', '.join(NEMOTRON_H_KINDS.values())} per layer (or hybrid_override_pattern "
            "one of the letters M * - E): fix it in the file"
        )
    if "moe" in kinds and raw.get("moe_latent_size") is not None:
        raise UnsupportedModel(
            f"{where}: Nemotron-H mixture-of-experts layers with latent projections "
            f"(moe_latent_size {raw['moe_latent_size']}) are not supported yet; use a "
            "checkpoint whose experts read the hidden state (moe_latent_size null)"
        )
    for key, wanted in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if raw.get(key, wanted) != wanted:
            raise UnsupportedModel(f"{where}: {key} {raw[key]!r}: only {wanted!r} is supported")

    def size(key: str, old: str, default: int) -> int:
        value = _integer(raw, key, where, minimum=1)
        return _integer(raw, old, where, minimum=1, default=default) if value is None else value

    heads, state, groups = (
        _integer(raw, "mamba_num_heads", where, minimum=1, default=128),
        _integer(raw, "ssm_state_size", where, minimum=1, default=128),
        size("n_groups", "mamba_n_groups", 8),
    )
    if heads % groups:
        raise CheckpointError(
            f"{where}: mamba_num_heads {heads} is not a multiple of n_groups {groups} (each "
            "group of B/C projections serves as many heads): fix one of them"
        )
    limit = raw.get("time_step_limit", raw.get("mamba_dt_limit", (0.0, math.inf)))
    if isinstance(limit, (list, tuple)):  # transformers writes infinity as {"__float__": ..}
        limit = [b["__float__"] if isinstance(b, dict) and "__float__" in b else b for b in limit]
    numbers = isinstance(limit, list) and all(
        isinstance(b, (int, float, str)) and not isinstance(b, bool) for b in limit
    )
    if not (numbers and len(limit) == 2):
        raise CheckpointError(
            f"{where}: time_step_limit is {limit!r}; it must be [low, high]: fix it in the file"
        )
    return MambaConfig(
        layer_types=tuple(kinds),
        num_heads=heads,
        head_dim=_integer(raw, "mamba_head_dim", where, minimum=1, default=64),
        state_size=state,
        n_groups=groups,
        conv_kernel=size("conv_kernel", "mamba_d_conv", 4),
        conv_bias=_boolean(raw, "use_conv_bias", where, bool(raw.get("mamba_conv_bias", True))),
        proj_bias=_boolean(raw, "use_bias", where, False),
        time_step_limit=(float(limit[0]), float(limit[1])),
        moe=_nemotron_h_moe(raw, where) if "moe" in kinds else None,
    )


def _nemotron_h_moe(raw: dict[str, Any], where: str) -> MoEConfig:
    """The routing of Nemotron-H's mixture-of-experts layers, with transformers' defaults:
    DeepSeek-V3's (sigmoid scores, ``noaux_tc`` groups, float32 router)."""
    experts = _integer(raw, "n_routed_experts", where, minimum=1, default=8)
    routing = {
        "num_experts": experts,
        "top_k": _integer(raw, "num_experts_per_tok", where, minimum=1, default=2),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": _integer(raw, "n_group", where, minimum=1, default=1),
        "topk_group": _integer(raw, "topk_group", where, minimum=1, default=1),
    }
    problem = _routing_problem(**routing)
    if problem:
        raise CheckpointError(f"{where}: {problem} in the file")
    return MoEConfig(
        **routing,
        expert_intermediate_size=_integer(
            raw, "moe_intermediate_size", where, minimum=1, default=7688
        ),
        norm_topk_prob=_boolean(raw, "norm_topk_prob", where, True),
        shared_expert_intermediate_size=_integer(
            raw, "moe_shared_expert_intermediate_size", where, minimum=1, default=7688
        ),
        routed_scaling_factor=_positive(
            raw.get("routed_scaling_factor", 1.0), "routed_scaling_factor", where, "1.0 or 2.5"
        ),
        float32_router=True,
    )


def _mamba_dict(config: DecoderConfig) -> dict[str, Any]:
    """Nemotron-H's own keys (transformers 5's spelling)."""
    mamba = config.mamba
    assert mamba is not None
    return {
        "layers_block_type": list(mamba.layer_types),
        "layer_norm_epsilon": config.rms_norm_eps,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "mamba_num_heads": mamba.num_heads,
        "mamba_head_dim": mamba.head_dim,
        "ssm_state_size": mamba.state_size,
        "n_groups": mamba.n_groups,
        "conv_kernel": mamba.conv_kernel,
        "use_conv_bias": mamba.conv_bias,
        "use_bias": mamba.proj_bias,
        "time_step_limit": list(mamba.time_step_limit),
        **(_nemotron_h_moe_dict(mamba.moe) if mamba.moe is not None else {}),
    }


def _nemotron_h_moe_dict(moe: MoEConfig) -> dict[str, Any]:
    """Nemotron-H's routing keys."""
    return {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "moe_shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": moe.norm_topk_prob,
    }


def _mla_dict(config: DecoderConfig) -> dict[str, Any]:
    """The latent-attention keys of a DeepSeek ``config.json``."""
    mla = config.mla
    assert mla is not None
    keys = {
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
    }
    if config.architecture == "DeepseekV3ForCausalLM":
        keys["rope_interleave"] = mla.rope_interleave
    return keys


def _mla_settings(raw: dict[str, Any], arch: str, where: str) -> MLAConfig | None:
    """The latent-attention shapes of a DeepSeek architecture (``None`` for any other)."""
    if arch not in MLA_ARCHITECTURES:
        return None
    why = {
        "kv_lora_rank": "the width of the compressed key/value latent",
        "qk_nope_head_dim": "each head's unrotated query/key width",
        "qk_rope_head_dim": "the rotary query/key width",
        "v_head_dim": "each head's value width",
    }
    size = {}
    for key, meaning in why.items():
        size[key] = _integer(raw, key, where, minimum=1)
        if size[key] is None:
            raise CheckpointError(
                f"{where}: a multi-head latent attention config needs {key} ({meaning}), which "
                f"the file lacks: add {key} to the file"
            )
    if size["qk_rope_head_dim"] % 2:
        raise CheckpointError(
            f"{where}: qk_rope_head_dim {size['qk_rope_head_dim']} is odd; the rotary "
            "embedding rotates pairs of dimensions: fix qk_rope_head_dim in the file"
        )
    interleave = arch == "DeepseekV2ForCausalLM" or raw.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise CheckpointError(
            f"{where}: rope_interleave is {interleave!r}; it must be true or false: fix it in "
            "the file"
        )
    return MLAConfig(
        q_lora_rank=_integer(raw, "q_lora_rank", where, minimum=1),
        rope_interleave=interleave,
        **size,
    )


def _dense_moe_dict(config: DecoderConfig) -> dict[str, Any]:
    """For a DeepSeek-style architecture with no sparse layer (:meth:`DecoderConfig.dense`),
    ``first_k_dense_replace`` covering every layer, which reads back as a dense decoder."""
    if config.architecture not in _DEEPSEEK_STYLE_DEFAULTS:
        return {}
    return {"first_k_dense_replace": config.num_layers}


def _glm4_moe_dict(config: DecoderConfig) -> dict[str, Any]:
    """GLM-4.5's own attention keys: its ``attention_bias`` is the q/k/v biases' (its o_proj
    has none)."""
    return {"attention_bias": config.qkv_bias, "use_qk_norm": config.qk_norm}


#: The ``quant_method`` values whose (FP8) layouts ``models.fp8`` loads.
FP8_QUANT_METHODS = ("fp8", "compressed-tensors")


def check_quantization_method(raw: dict[str, Any], where: str) -> None:
    """Refuse checkpoints quantized other than in FP8 (``quantization_config``; ``models.fp8``
    reads and checks the FP8 layouts): the one place other methods are refused, for targets
    and drafts alike. The released gpt-oss checkpoints are MXFP4; the error says how to
    dequantize."""
    quant = raw.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method in FP8_QUANT_METHODS:
        return
    fix = "load float (bfloat16) or FP8 weights (docs/fp8.md)"
    if method == "mxfp4":
        fix = (
            "dequantize to bfloat16 first: transformers.GptOssForCausalLM.from_pretrained("
            "folder, quantization_config=transformers.Mxfp4Config(dequantize=True), "
            "dtype=torch.bfloat16).save_pretrained(new_folder), or use a bf16 export (e.g. "
            "unsloth/gpt-oss-20b-BF16)"
        )
    raise UnsupportedModel(
        f"{where}: quantization_config quant_method {method!r} is not supported (speculum "
        f"loads unquantized or FP8 weights); {fix}"
    )


def _arch_from_model_type(model_type: str | None) -> str:
    by_type = {kind: arch for arch, kind in MODEL_TYPES.items()}
    return by_type.get(model_type or "", f"<model_type {model_type!r}>")


def _required_integer(raw: dict[str, Any], key: str, where: str, why: str) -> int:
    """``raw[key]`` as a positive integer, or a :class:`CheckpointError` saying it is needed
    (``why``: what it is)."""
    value = _integer(raw, key, where, minimum=1)
    if value is None:
        raise CheckpointError(
            f"{where}: a mixture-of-experts config needs {key} ({why}), which the file lacks: "
            f"add {key} to the file"
        )
    return value


def _expert_count(raw: dict[str, Any], where: str) -> int:
    """The number of routed experts: ``num_experts`` (Qwen's hub configs) or
    ``num_local_experts`` (Mixtral's, and transformers 5's Qwen3-MoE); both must agree."""
    given = {
        key: _integer(raw, key, where, minimum=1)
        for key in ("num_experts", "num_local_experts")
        if raw.get(key) is not None
    }
    if not given:
        raise CheckpointError(
            f"{where}: a mixture-of-experts config needs num_experts (or num_local_experts), "
            "the number of routed experts, which the file lacks: add it"
        )
    if len(set(given.values())) > 1:
        raise CheckpointError(
            f"{where}: num_experts {given['num_experts']} and num_local_experts "
            f"{given['num_local_experts']} disagree: keep one, the number of experts the "
            "checkpoint holds"
        )
    return next(iter(given.values()))


def _layer_list(
    raw: dict[str, Any], key: str, where: str, num_layers: int, nextn: int
) -> tuple[int, ...]:
    """``raw[key]``, a list of layer indices (none when absent): the ``num_layers`` decoder
    layers and the ``nextn`` MTP layers stored after them."""
    value = raw.get(key) or []
    total = num_layers + nextn
    ok = isinstance(value, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n < total for n in value
    )
    if not ok:
        counted = f" plus num_nextn_predict_layers {nextn}" if nextn else ""
        raise CheckpointError(
            f"{where}: {key} is {value!r}; it must be a list of layer indices in 0 .. "
            f"{total - 1} (num_hidden_layers {num_layers}{counted}): fix {key} in the file"
        )
    return tuple(sorted(set(value)))


def _top_k(raw: dict[str, Any], experts: int, count_key: str, where: str) -> int:
    """``num_experts_per_tok``: required, and at most the ``experts`` (``raw[count_key]``)."""
    top_k = _required_integer(raw, "num_experts_per_tok", where, "experts per token")
    if top_k > experts:
        raise CheckpointError(
            f"{where}: num_experts_per_tok {top_k} is more than the {experts} experts "
            f"({count_key}): each token is routed to num_experts_per_tok distinct experts; fix "
            "num_experts_per_tok (or the expert count) in the file"
        )
    return top_k


def _boolean(raw: dict[str, Any], key: str, where: str, default: bool) -> bool:
    """``raw[key]``, true or false (``default`` when absent)."""
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(
            f"{where}: {key} is {value!r}; it must be true or false: fix it in the file"
        )
    return value


def _moe_settings(
    raw: dict[str, Any], arch: str, where: str, num_layers: int, nextn: int
) -> MoEConfig | None:
    """The routing of a mixture-of-experts architecture (``None`` for a dense one), with
    transformers' defaults for what the file leaves out. ``mlp_only_layers`` may name the
    ``nextn`` MTP layers after the ``num_layers`` decoder layers too: an MTP layer is built as
    the decoder would build a layer of its index (``decoder.decoder_layer``)."""
    if arch not in _DENSE_ARCHITECTURES or arch == "NemotronHForCausalLM":  # its own: mamba.moe
        return None
    if arch in _DEEPSEEK_STYLE_DEFAULTS:
        return _deepseek_moe_settings(raw, where, num_layers, _DEEPSEEK_STYLE_DEFAULTS[arch])
    experts = _expert_count(raw, where)
    top_k = _top_k(raw, experts, "num_experts", where)
    if arch == "MixtralForCausalLM":
        size = _required_integer(raw, "intermediate_size", where, "each expert's width")
        return MoEConfig(
            num_experts=experts, top_k=top_k, expert_intermediate_size=size, norm_topk_prob=True
        )
    if arch == "GptOssForCausalLM":
        return MoEConfig(
            num_experts=experts,
            top_k=top_k,
            expert_intermediate_size=_required_integer(
                raw, "intermediate_size", where, "each expert's width"
            ),
            norm_topk_prob=False,
            scoring_func="softmax_topk",
            biases=True,
            swiglu_limit=_positive(raw.get("swiglu_limit", 7.0), "swiglu_limit", where, "7.0"),
            swiglu_alpha=_positive(raw.get("swiglu_alpha", 1.702), "swiglu_alpha", where, "1.702"),
        )
    shared = 0
    if arch in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM"):
        shared = _required_integer(
            raw, "shared_expert_intermediate_size", where, "the shared expert's width"
        )
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=_required_integer(
            raw, "moe_intermediate_size", where, "each expert's width"
        ),
        norm_topk_prob=_boolean(raw, "norm_topk_prob", where, False),
        shared_expert_intermediate_size=shared,
        sparse_step=_integer(raw, "decoder_sparse_step", where, minimum=1, default=1),
        dense_layers=_layer_list(raw, "mlp_only_layers", where, num_layers, nextn),
    )


def _deepseek_moe_settings(
    raw: dict[str, Any], where: str, num_layers: int, defaults: dict[str, Any]
) -> MoEConfig | None:
    """The routing of a DeepSeek-style MoE config (DeepSeek-V2/V3, GLM-4.5 share the key
    names), ``defaults`` standing in for the keys the file leaves out (transformers' defaults
    for the architecture). ``None`` when ``first_k_dense_replace`` covers every layer (a dense
    decoder, which needs no routing keys). Routing that is unknown or cannot work is refused,
    naming the key (see :func:`_routing_problem`)."""
    first_dense = _integer(
        raw, "first_k_dense_replace", where, minimum=0, default=defaults["first_k_dense_replace"]
    )
    if first_dense >= num_layers:
        return None
    experts = _required_integer(raw, "n_routed_experts", where, "the number of routed experts")
    routing = {
        "num_experts": experts,
        "top_k": _top_k(raw, experts, "n_routed_experts", where),
        "scoring_func": raw.get("scoring_func") or defaults["scoring_func"],
        "topk_method": raw.get("topk_method") or defaults["topk_method"],
        **{
            key: _integer(raw, key, where, minimum=1, default=defaults[key])
            for key in ("n_group", "topk_group")
        },
    }
    problem = _routing_problem(**routing)
    if problem:
        raise CheckpointError(f"{where}: {problem} in the file")
    scale = raw.get("routed_scaling_factor", defaults["routed_scaling_factor"])
    return MoEConfig(
        **routing,
        expert_intermediate_size=_required_integer(
            raw, "moe_intermediate_size", where, "each expert's width"
        ),
        norm_topk_prob=_boolean(raw, "norm_topk_prob", where, defaults["norm_topk_prob"]),
        dense_layers=tuple(range(first_dense)),
        routed_scaling_factor=_positive(scale, "routed_scaling_factor", where, "1.0 or 2.5"),
        n_shared_experts=_integer(
            raw, "n_shared_experts", where, minimum=0, default=defaults["n_shared_experts"]
        ),
        float32_router=True,
    )


def _partial_rotary_factor(raw: dict[str, Any], where: str, head_dim: int, default: float) -> float:
    """The share of each head the rotary embedding turns: ``rope_parameters`` (transformers 5)
    or the top level (transformers 4), else the architecture's ``default`` (GLM-4.5's 0.5);
    it must turn an even number of dimensions, at least two."""
    params = raw.get("rope_parameters") or {}
    given = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    factor = default if given is None else given
    number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    rotary = int(head_dim * factor) if number and math.isfinite(factor) else 0
    if not (number and 0 < factor <= 1 and rotary >= 2 and rotary % 2 == 0):
        raise CheckpointError(
            f"{where}: partial_rotary_factor is {factor!r}; with head_dim {head_dim} it must "
            "be a number in (0, 1] turning an even number of dimensions (at least 2): fix "
            "partial_rotary_factor in the file"
        )
    return float(factor)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or a :class:`CheckpointError` naming the file and why it
    cannot be read (missing, not UTF-8, not JSON, or JSON that is not an object)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))  # JSON is UTF-8 (RFC 8259)
    except (OSError, ValueError) as err:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(
            f"cannot read {path}: {err}; fix the file (it must hold one JSON object)"
        ) from err
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(raw).__name__}")
    return raw


def _integer(
    raw: dict[str, Any], key: str, where: str, *, minimum: int, default: int | None = None
) -> int | None:
    """``raw[key]`` as an ``int`` of at least ``minimum`` (``default`` when absent or null);
    an integral float such as ``4096.0`` counts as the integer it is."""
    value = raw.get(key)
    if value is None:
        return default
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value < minimum:
        raise CheckpointError(
            f"{where}: {key} is {value!r}; it must be an integer of at least {minimum}: fix "
            f"{key} in the file"
        )
    return int(value)


def _positive(value: Any, key: str, where: str, typical: str) -> float:
    """``value`` as a finite float above zero, else a :class:`CheckpointError` naming ``key``
    and a ``typical`` value."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise CheckpointError(
            f"{where}: {key} is {value!r}; it must be a number above zero, the value the model "
            f"was trained with (typically {typical}): fix {key} in the file"
        )
    return float(value)


def _check_head_groups(heads: int, kv_heads: int, where: str) -> None:
    """Grouped-query attention shares each KV head among ``heads / kv_heads`` query heads."""
    if heads % kv_heads:
        raise CheckpointError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv_heads}, so the query heads cannot share the KV heads evenly: fix "
            "num_key_value_heads (or num_attention_heads) in the file"
        )


def _head_dim(raw: dict[str, Any], hidden: int, heads: int, where: str) -> int:
    """``head_dim`` as given (Qwen3 sets one other than ``hidden / heads``; the weights then
    decide, see ``loading.check_keys``), else ``hidden / heads``; even, as RoPE rotates pairs."""
    head_dim = _integer(raw, "head_dim", where, minimum=1)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(
                f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads "
                f"{heads} and no head_dim is given: set head_dim in the file"
            )
        head_dim = hidden // heads
    if head_dim % 2:
        raise CheckpointError(
            f"{where}: head_dim {head_dim} (given, or hidden_size / num_attention_heads) is "
            "odd; the rotary embedding rotates pairs of dimensions: fix head_dim in the file"
        )
    return head_dim


def _token_ids(raw: dict[str, Any], key: str, where: str, vocab_size: int) -> tuple[int, ...]:
    """``raw[key]``, a token id or a list of them (none when absent), each in the vocabulary."""
    value = raw.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise CheckpointError(
            f"{where}: {key} is {value!r}; it must be a token id or a list of token ids in "
            f"0 .. {vocab_size - 1} (vocab_size {vocab_size}): fix {key} in the file"
        )
    return tuple(ids)


def _rope_theta(raw: dict[str, Any], params: dict[str, Any], where: str) -> float:
    """``rope_theta`` from ``rope_parameters`` (transformers 5) or the top level (transformers
    4), 10000 when neither has one; when both do they must agree, as each reader sees one."""
    given = {
        key: _positive(value, key, where, "10000.0 or more")
        for key, value in (
            ("rope_parameters.rope_theta", params.get("rope_theta")),
            ("rope_theta", raw.get("rope_theta")),
        )
        if value is not None
    }
    if len(set(given.values())) > 1:
        raise CheckpointError(
            f"{where}: rope_parameters.rope_theta {given['rope_parameters.rope_theta']} and "
            f"rope_theta {given['rope_theta']} disagree (transformers 5 reads the first, 4 the "
            "second): set both to the checkpoint's training value"
        )
    return next(iter(given.values()), 10000.0)


#: transformers' rope settings for a gpt-oss config that names none.
_GPT_OSS_ROPE = {
    "rope_theta": 150000.0,
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
#: Architectures whose rope may be YaRN-scaled: DeepSeek's latent attention, gpt-oss, and
#: Llama (gpt-oss's dense sibling, :meth:`DecoderConfig.dense`).
YARN_ARCHITECTURES = (*MLA_ARCHITECTURES, "GptOssForCausalLM", "LlamaForCausalLM")


def _rope_settings(
    raw: dict[str, Any], where: str, arch: str
) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    if arch == "Gemma3ForCausalLM":
        # transformers 5 nests Gemma-3's settings by layer type: the global layers' are the
        # model's rope_theta and scaling (the local layers': ``_gemma_settings``).
        params = params.get("full_attention", params)
        if not params and raw.get("rope_theta") is None:
            params = {"rope_theta": _GEMMA3_DEFAULTS["rope_theta"]}
    scaling = raw.get("rope_scaling") or None
    if arch == "GptOssForCausalLM" and not (params or scaling):
        params = {**_GPT_OSS_ROPE, "rope_theta": raw.get("rope_theta") or 150000.0}
    theta = _rope_theta(raw, params, where)
    source = dict(scaling or params)
    source.pop("rope_theta", None)
    source.pop("partial_rotary_factor", None)  # DecoderConfig.partial_rotary_factor
    rope_type = source.get("rope_type", source.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(
            f"{where}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "yarn":
        _check_yarn(source, "rope_scaling" if scaling else "rope_parameters", where, arch)
    if rope_type == "default":
        return theta, None
    source["rope_type"] = rope_type
    source.pop("type", None)
    return theta, source


def _check_yarn(source: dict[str, Any], section: str, where: str, arch: str) -> None:
    """YaRN scaling is read for :data:`YARN_ARCHITECTURES` (its rotary tables and the factor
    it scales attention scores by, see ``decoder.rope_attention_factor``) with the two keys of
    ``section`` (``rope_scaling`` or ``rope_parameters``) it cannot do without."""
    if arch not in YARN_ARCHITECTURES:
        raise UnsupportedModel(
            f"{where}: rope type 'yarn' is supported for {', '.join(YARN_ARCHITECTURES)} only, "
            f"not {arch}"
        )
    for key in ("factor", "original_max_position_embeddings"):
        _positive(source.get(key), f"{section}.{key}", where, "the checkpoint's value")
