"""The gated DeltaNet op. Default kernel: the ``spec.recurrent`` reference (token by token),
on every device; a CUDA kernel (fla-core's gated delta rule, say) would register here."""

from __future__ import annotations

import torch
from torch import Tensor

from speculum.spec import recurrent as spec_recurrent

__all__ = ["gated_delta_rule"]


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
) -> Tensor:
    """One linear-attention layer's outputs ``[batch, q, v_head, v_dim]``, each query's conv
    and delta-rule states written into ``conv`` and ``ssm`` in place (see
    ``spec.recurrent.gated_delta_rule``)."""
    return spec_recurrent.gated_delta_rule(
        conv, ssm, slots, prefix_lens, q_lens, new_mask, mixed, conv_weight, gate, beta, dims
    )


@gated_delta_rule.register_fake
def _(conv, ssm, slots, prefix_lens, q_lens, new_mask, mixed, conv_weight, gate, beta, dims):
    return mixed.new_empty(*mixed.shape[:2], dims[2], dims[3])
