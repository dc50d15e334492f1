"""The decoder's elementwise ops (RMSNorm, residual add + RMSNorm, rotary embedding, SwiGLU),
and its mixture-of-experts MLP (``moe``).

Each op's default kernel is a pure-torch reference with exactly the decoder's math, rounding step
for rounding step (``speculum.models.decoder``: ``RMSNorm.forward``, ``apply_rope``, the MLP's
``silu(gate) * up``), so routing the decoder through these ops changes no bit on the CPU. Fused
Triton kernels (``speculum.kernels.triton_model_ops``) register as the CUDA kernels: eagerly the
reference is ~7 kernel launches for a norm and ~10 for rotary, each ~2 µs even inside a CUDA
graph, against one launch fused.

Outputs are fresh contiguous tensors (the Triton kernels write contiguous outputs, so the
reference does too, and the fake kernels say so).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from speculum.spec import paged as spec_paged

__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "clamped_glu",
    "ROUTING_ARGS",
    "moe",
    "moe_reference",
    "moe_routing_weights",
    "moe_row_weights",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_reference",
    "rope_write_kv",
    "rope_write_kv_reference",
    "silu_mul",
    "silu_mul_reference",
]


def rms_norm_reference(
    x: Float[Tensor, "*rows hidden"], weight: Float[Tensor, " hidden"], eps: float
) -> Float[Tensor, "*rows hidden"]:
    """``weight * (x * rsqrt(mean(x^2) + eps))``: statistics in float32, the normed values
    rounded back to ``x.dtype``, then multiplied in the promoted dtype of ``weight`` and ``x``."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_reference(
    x: Float[Tensor, "*rows hidden"],
    residual: Float[Tensor, "*rows hidden"],
    weight: Float[Tensor, " hidden"],
    eps: float,
) -> tuple[Float[Tensor, "*rows hidden"], Float[Tensor, "*rows hidden"]]:
    """``(rms_norm(x + residual), x + residual)``: a decoder layer's residual add (rounded to
    the dtype of the sum, as ``x = x + attn(...)`` is) followed by the next block's norm."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def rope_reference(
    x: Float[Tensor, "batch q head head_dim"],
    positions: Int[Tensor, "batch q"],
    inv_freq: Float[Tensor, " half"],
) -> Float[Tensor, "batch q head head_dim"]:
    """Rotate halves of ``x`` by ``positions * inv_freq`` (the non-interleaved convention).

    Angles, cosines and sines in float32; the cosines and sines rounded to ``x.dtype``; both
    products and their sum rounded to ``x.dtype``. Where ``inv_freq`` covers fewer than
    ``head_dim / 2`` pairs (GLM-4.5's ``partial_rotary_factor``), only the first ``2 * half``
    dimensions of each head turn and the rest pass through, as in transformers.
    """
    rotary = 2 * inv_freq.shape[-1]
    if rotary < x.shape[-1]:
        turned = rope_reference(x[..., :rotary], positions, inv_freq)
        return torch.cat([turned, x[..., rotary:]], dim=-1)
    freqs = positions.float()[..., None] * inv_freq.to(x.device)
    angles = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def rope_write_kv_reference(
    q: Float[Tensor, "batch q head head_dim"],
    k: Float[Tensor, "batch q kv_head head_dim"],
    v: Float[Tensor, "batch q kv_head head_dim"],
    positions: Int[Tensor, "batch q"],
    inv_freq: Float[Tensor, " half"],
    k_cache: Float[Tensor, "page page_size kv_head head_dim"],
    v_cache: Float[Tensor, "page page_size kv_head head_dim"],
    slots: Int[Tensor, "batch q"],
) -> Float[Tensor, "batch q head head_dim"]:
    """An attention layer's rotary embedding and cache write: the rotated keys and the values
    written into the caches at ``slots`` (in place: the pool is the owned resource), the
    rotated queries returned."""
    spec_paged.write_kv(k_cache, slots, rope_reference(k, positions, inv_freq))
    spec_paged.write_kv(v_cache, slots, v)
    return rope_reference(q, positions, inv_freq)


def silu_mul_reference(
    gate: Float[Tensor, "*rows inter"], up: Float[Tensor, "*rows inter"]
) -> Float[Tensor, "*rows inter"]:
    """SwiGLU's ``silu(gate) * up``: silu rounded to ``gate.dtype``, the product rounded again."""
    return F.silu(gate) * up


def clamped_glu(
    gate: Float[Tensor, "*rows inter"], up: Float[Tensor, "*rows inter"], limit: float, alpha: float
) -> Float[Tensor, "*rows inter"]:
    """gpt-oss's expert activation: ``gate`` clamped to at most ``limit``, ``up`` to ``[-limit,
    limit]``, then ``(up + 1) * (gate * sigmoid(gate * alpha))``, rounded step by step as
    transformers rounds it."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_routing_weights(
    logits: Float[Tensor, "rows expert"],
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    correction_bias: Float[Tensor, " expert"] | None = None,
    sorted_topk: bool = True,
) -> Float[Tensor, "rows expert"]:
    """Each row's weight per expert, in float32, as transformers' routers compute them step by
    step: the scores (softmax in float32, or the sigmoid of ``logits``, or for ``softmax_topk``
    (gpt-oss) the logits themselves, the chosen ones' softmax becoming their weights); the
    ``top_k`` experts chosen by ``topk_method`` (``models.config.TOPK_METHODS``) over the scores
    plus ``correction_bias`` (DeepSeek-V3's ``e_score_correction_bias``, which only chooses);
    the chosen experts' unbiased scores, divided by their sum plus 1e-20 when ``renormalize``
    (DeepSeek-V3's epsilon: for softmax scores, whose top-k sum is at least 1/experts, it
    changes no bit of Qwen's plain division), times ``routed_scaling_factor``; zero for every
    other expert.

    ``sorted_topk`` is the ``sorted`` argument of the top-k that chooses (Qwen and Mixtral sort,
    DeepSeek and GLM do not): it orders the chosen scores, hence the rounding of their sum.
    Ties go as ``torch.topk`` breaks them, as in transformers.
    """
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif scoring_func == "sigmoid":
        scores = logits.float().sigmoid()
    else:  # softmax_topk: chosen by logit, weighted by the softmax over the chosen
        scores = logits.float()
    choice = scores if correction_bias is None else scores + correction_bias
    if topk_method != "greedy":
        choice = _best_groups_only(choice, topk_method, n_group, topk_group)
    index = choice.topk(top_k, dim=-1, sorted=sorted_topk)[1]
    top = scores.gather(-1, index)
    if scoring_func == "softmax_topk":
        top = torch.softmax(top, dim=-1)
    if renormalize:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    top = top * routed_scaling_factor
    return torch.zeros_like(scores).scatter(-1, index, top)


def _best_groups_only(
    choice: Float[Tensor, "rows expert"], topk_method: str, n_group: int, topk_group: int
) -> Float[Tensor, "rows expert"]:
    """``choice`` with the experts outside each row's ``topk_group`` best groups masked out
    (0 for ``group_limited_greedy``, -inf for ``noaux_tc``, as transformers fills them).

    The ``n_group`` groups are consecutive runs of experts; a group's score is its best
    expert's (``group_limited_greedy``) or the sum of its best two (``noaux_tc``)."""
    rows, experts = choice.shape
    grouped = choice.view(rows, n_group, experts // n_group)
    if topk_method == "group_limited_greedy":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    group_index = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores).scatter(1, group_index, 1).bool()
    kept = kept[..., None].expand(rows, n_group, experts // n_group).reshape(rows, experts)
    fill = 0.0 if topk_method == "group_limited_greedy" else float("-inf")
    return choice.masked_fill(~kept, fill)


def moe_row_weights(
    rows: Float[Tensor, "row hidden"],
    router: Float[Tensor, "expert hidden"],
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    correction_bias: Float[Tensor, " expert"] | None = None,
    float32_router: bool = False,
    router_bias: Float[Tensor, " expert"] | None = None,
) -> Float[Tensor, "row expert"]:
    """Each row's weight per expert as :func:`moe_reference` scales the experts' outputs by
    them: the router logits (from float32 activations and weights with ``float32_router``, else
    in ``rows.dtype``; plus ``router_bias``, gpt-oss's) routed by :func:`moe_routing_weights`;
    float32 with ``float32_router``, else rounded to ``rows.dtype``. Every kernel of
    ``speculum::moe`` routes through here."""
    if float32_router:
        bias = None if router_bias is None else router_bias.float()
        logits = F.linear(rows.float(), router.float(), bias)
    else:
        logits = F.linear(rows, router, router_bias)
    weights = moe_routing_weights(
        logits,
        top_k,
        renormalize,
        scoring_func,
        topk_method,
        n_group,
        topk_group,
        routed_scaling_factor,
        correction_bias,
        sorted_topk=not float32_router,
    )
    return weights if float32_router else weights.to(rows.dtype)


def moe_reference(
    x: Float[Tensor, "*rows hidden"],
    router: Float[Tensor, "expert hidden"],
    experts_gate_up: Float[Tensor, "expert two_inter hidden"],
    experts_down: Float[Tensor, "expert hidden inter"],
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    correction_bias: Float[Tensor, " expert"] | None = None,
    float32_router: bool = False,
    router_bias: Float[Tensor, " expert"] | None = None,
    gate_up_bias: Float[Tensor, "expert two_inter"] | None = None,
    down_bias: Float[Tensor, "expert hidden"] | None = None,
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 1.702,
) -> Float[Tensor, "*rows hidden"]:
    """The routed experts of a mixture-of-experts MLP: ``sum_e w[row, e] * down_e(silu(gate_e
    (x)) * up_e(x))`` with the weights of :func:`moe_routing_weights`.

    gpt-oss's experts: each projection adds its expert's bias (``gate_up_bias``, ``down_bias``,
    after the matmul, as transformers adds them), and with ``swiglu_limit`` above 0 the
    activation is :func:`clamped_glu` instead of ``silu(gate) * up``.

    Two conventions, as transformers has them: by default (Qwen, Mixtral) the router logits are
    computed in ``x.dtype``, the top-k is sorted, and the weights are rounded to ``x.dtype``
    before they scale the experts' outputs (Mixtral's scale in float32, which differs in the
    last bit of bfloat16 outputs only). With ``float32_router`` (DeepSeek, GLM-4.5, whose
    routers transformers keeps in float32) the logits come from float32 activations and router
    weights, the top-k is unsorted, and each expert's output is scaled by the float32 weight
    and then rounded to ``x.dtype``.

    Dense: every row runs through every expert and the outputs of experts the row did not
    select are dropped (by ``where``, not by a zero weight, so that an expert overflowing on a
    row it was never meant for cannot turn the row's output into NaN). That costs
    ``num_experts / top_k`` times the FLOPs of routing, but has no host sync and no
    data-dependent shape (CUDA graphs capture it), keeps every row independent of the others in
    the batch, and sums the experts in ascending order into a zero accumulator, as transformers
    does. A grouped GEMM over each row's selected experts only is the kernel to register for
    CUDA in its place.
    """
    rows = x.reshape(-1, x.shape[-1])
    weights = moe_row_weights(
        rows,
        router,
        top_k,
        renormalize,
        scoring_func,
        topk_method,
        n_group,
        topk_group,
        routed_scaling_factor,
        correction_bias,
        float32_router,
        router_bias,
    )
    out = torch.zeros_like(rows)
    for expert in range(experts_gate_up.shape[0]):
        gate_up = F.linear(rows, experts_gate_up[expert])
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[expert]
        gate, up = gate_up.chunk(2, dim=-1)
        if swiglu_limit > 0:
            hidden = clamped_glu(gate, up, swiglu_limit, swiglu_alpha)
        else:
            hidden = silu_mul_reference(gate, up)
        expert_out = F.linear(hidden, experts_down[expert])
        if down_bias is not None:
            expert_out = expert_out + down_bias[expert]
        weight = weights[:, expert, None]
        out = out + torch.where(weight != 0, (expert_out * weight).to(x.dtype), 0)
    return out.view(x.shape)


@torch.library.custom_op("speculum::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis of ``x`` (see :func:`rms_norm_reference`)."""
    return rms_norm_reference(x, weight, eps).contiguous()


@torch.library.custom_op("speculum::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(normed, new_residual)`` of a residual add and RMSNorm (see
    :func:`add_rms_norm_reference`)."""
    normed, summed = add_rms_norm_reference(x, residual, weight, eps)
    return normed.contiguous(), summed.contiguous()


@torch.library.custom_op("speculum::rope", mutates_args=())
def rope(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotary embedding of ``x [batch, q, head, head_dim]`` (see :func:`rope_reference`)."""
    return rope_reference(x, positions, inv_freq).contiguous()


@torch.library.custom_op("speculum::rope_write_kv", mutates_args=("k_cache", "v_cache"))
def rope_write_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    inv_freq: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
) -> Tensor:
    """Rotary embedding of queries and keys with the K/V cache write fused (see
    :func:`rope_write_kv_reference`): one launch on the GPU where there were four."""
    return rope_write_kv_reference(
        q, k, v, positions, inv_freq, k_cache, v_cache, slots
    ).contiguous()


@torch.library.custom_op("speculum::silu_mul", mutates_args=())
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` of equally shaped tensors (see :func:`silu_mul_reference`)."""
    return silu_mul_reference(gate, up).contiguous()


@torch.library.custom_op("speculum::moe", mutates_args=())
def moe(
    x: Tensor,
    router: Tensor,
    experts_gate_up: Tensor,
    experts_down: Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    correction_bias: Tensor | None = None,
    float32_router: bool = False,
    router_bias: Tensor | None = None,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 1.702,
) -> Tensor:
    """The routed experts of a mixture-of-experts MLP (see :func:`moe_reference`, also the
    kernel CUDA tensors run until a grouped-GEMM kernel is registered)."""
    return moe_reference(
        x,
        router,
        experts_gate_up,
        experts_down,
        top_k,
        renormalize,
        scoring_func,
        topk_method,
        n_group,
        topk_group,
        routed_scaling_factor,
        correction_bias,
        float32_router,
        router_bias,
        gate_up_bias,
        down_bias,
        swiglu_limit,
        swiglu_alpha,
    ).contiguous()


#: How many of ``speculum::moe``'s arguments after ``renormalize`` route (``scoring_func`` ..
#: ``router_bias``, :func:`moe_row_weights`'s); the rest shape the experts' computation.
ROUTING_ARGS = 8


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.result_type(weight, x))


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    summed = x.new_empty(x.shape, dtype=torch.result_type(x, residual))
    return summed.new_empty(x.shape, dtype=torch.result_type(weight, summed)), summed


@rope.register_fake
def _(x, positions, inv_freq):
    return x.new_empty(x.shape)


@rope_write_kv.register_fake
def _(q, k, v, positions, inv_freq, k_cache, v_cache, slots):
    return q.new_empty(q.shape)


@silu_mul.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.result_type(gate, up))


@moe.register_fake
def _(x, router, experts_gate_up, experts_down, top_k, renormalize, *routing):
    return x.new_empty(x.shape)


def _backward_through(reference):
    """Autograd for an op whose kernels compute ``reference``: the backward pass recomputes the
    (pure-torch, differentiable) reference on the saved inputs and differentiates it. Training
    runs these ops; its cost is a second forward of cheap elementwise work."""

    def setup_context(ctx, inputs, output) -> None:
        ctx.inputs = inputs

    def backward(ctx, *grads):
        inputs = [
            x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, Tensor) else x
            for x in ctx.inputs
        ]
        wanted = [x for x in inputs if isinstance(x, Tensor) and x.requires_grad]
        with torch.enable_grad():
            out = reference(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        found = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
        )
        return tuple(
            next(found) if isinstance(x, Tensor) and x.requires_grad else None for x in inputs
        )

    return backward, setup_context


for _op, _reference in (
    (rms_norm, rms_norm_reference),
    (add_rms_norm, add_rms_norm_reference),
    (rope, rope_reference),
    (silu_mul, silu_mul_reference),
    (moe, moe_reference),
):
    _backward, _setup = _backward_through(_reference)
    _op.register_autograd(_backward, setup_context=_setup)
