"""The recurrent-layer ops (gated DeltaNet, Mamba-2). Default kernels: the ``spec.recurrent``
references (token by token; the chunked delta rule for prompt chunks); on CUDA,
``kernels.triton_recurrent``'s launchers (a causal-conv launch and a state-update launch per
layer, whatever the number of queries) register as the ops' CUDA kernels when
``speculum.kernels`` is imported."""

from __future__ import annotations

import torch
from torch import Tensor

from speculum.spec import recurrent as spec_recurrent

__all__ = ["gated_delta_rule", "mamba2_scan"]


@torch.library.custom_op("speculum::gated_delta_rule", mutates_args=("conv", "ssm"))
def gated_delta_rule(
    conv: Tensor,
    ssm: Tensor,
    slots: Tensor,
    prefix_lens: Tensor,
    q_lens: Tensor,
    new_mask: Tensor,
    mixed: Tensor,
    conv_weight: Tensor,
    gate: Tensor,
    beta: Tensor,
    dims: list[int],
    chunk: int = 0,
) -> Tensor:
    """One linear-attention layer's outputs ``[batch, q, v_head, v_dim]``, each query's conv
    and delta-rule states written into ``conv`` and ``ssm`` in place (see
    ``spec.recurrent.gated_delta_rule``; ``chunk`` above 0: its prefill form)."""
    return spec_recurrent.gated_delta_rule(
        conv, ssm, slots, prefix_lens, q_lens, new_mask, mixed, conv_weight, gate, beta, dims,
        chunk,
    )  # fmt: skip


@gated_delta_rule.register_fake
def _(
    conv, ssm, slots, prefix_lens, q_lens, new_mask, mixed, conv_weight, gate, beta, dims, chunk=0
):
    return mixed.new_empty(*mixed.shape[:2], dims[2], dims[3])


@torch.library.custom_op("speculum::mamba2_scan", mutates_args=("conv", "ssm"))
def mamba2_scan(
    conv: Tensor,
    ssm: Tensor,
    slots: Tensor,
    prefix_lens: Tensor,
    q_lens: Tensor,
    new_mask: Tensor,
    xbc: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    dt: Tensor,
    A: Tensor,
    D: Tensor,
    dims: list[int],
) -> Tensor:
    """One Mamba-2 layer's outputs ``[batch, q, head, head_dim]``, each query's conv and SSM
    states written into ``conv`` and ``ssm`` in place (see ``spec.recurrent.mamba2_scan``)."""
    return spec_recurrent.mamba2_scan(
        conv, ssm, slots, prefix_lens, q_lens, new_mask, xbc, conv_weight, conv_bias, dt, A, D, dims
    )


@mamba2_scan.register_fake
def _(conv, ssm, slots, prefix_lens, q_lens, new_mask, xbc, conv_weight, conv_bias, dt, A, D, dims):
    return xbc.new_empty(*xbc.shape[:2], dims[0], dims[1])
