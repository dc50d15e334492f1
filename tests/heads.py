"""Draft heads built to agree with "mostly Markov" test targets, so rounds accept deep paths."""

from __future__ import annotations

import torch

from speculum.models.decoder import DecoderModel
from speculum.models.draft import random_draft


def agreeing_head(target: DecoderModel, algorithm: str, seed: int = 3):
    """An EAGLE-1 or MTP head that mostly predicts the target's Markov vote.

    Its input projection passes the token embedding through and its MLP adds nothing, so its
    logits are the target's ``lm_head`` applied to that embedding, plus small terms from the
    target's hidden state and from attention (kept small but non-zero, so that the features
    handed over by verify and the draft's own KV cache still matter).
    """
    head = random_draft(target, algorithm, seed=seed, std=0.3)
    width = target.config.hidden_size
    projection = head.fc if algorithm == "eagle" else head.eh_proj
    layer = head.layers[0] if algorithm == "eagle" else head.decoder
    with torch.no_grad():
        projection.weight[:, :width] = torch.eye(width)
        projection.weight[:, width:] *= 0.1
        if projection.bias is not None:
            projection.bias.zero_()
        layer.self_attn.o_proj.weight.mul_(0.1)
        layer.mlp.down_proj.weight.zero_()
    return head
