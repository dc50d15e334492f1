"""Parity of the Triton recurrent kernels (gated delta rule, Mamba-2, their causal conv) with
``spec.recurrent``, run under Triton's interpreter.

Hypothesis draws the structure (chain or tree, batch, queries, head counts and dimensions
around powers of two, ring size) and a seed; the tensors, the pool's prior states included,
come from a generator with that seed. Outputs of valid queries and every state slot but the
padding sink must agree to float32 rounding (the kernels sum in another order than torch).
Chains longer than the ring check that the kernels write only the states a later read needs
and still leave the ring as the reference does.
``tests/gpu/test_kernel_recurrent_gpu.py`` runs the same parity at real sizes on a device.
"""

from __future__ import annotations

import kernel_cases as kc
import pytest
import recurrent_cases as rc
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum import kernels
from speculum.models.config import LinearAttentionConfig, MambaConfig
from speculum.models.loading import random_model
from speculum.models.standalone import StandaloneHead
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.recurrent import node_parents

pytest.importorskip("triton")
from speculum.kernels import triton_recurrent as tr  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAUNCHERS = {
    "gated_delta_rule": tr.gated_delta_rule_triton,
    "mamba2_scan": tr.mamba2_scan_triton,
}


@st.composite
def delta_dims(draw):
    """``(k_heads, k_dim, v_heads, v_dim)``: value heads a multiple of key heads."""
    k_heads = draw(st.integers(1, 2))
    v_heads = k_heads * draw(st.integers(1, 2))
    return k_heads, draw(st.sampled_from([4, 6, 8])), v_heads, draw(st.sampled_from([4, 8, 40]))


@st.composite
def mamba_dims(draw):
    """``(heads, head_dim, n_groups, d_state)``: heads a multiple of groups."""
    groups = draw(st.integers(1, 2))
    heads = groups * draw(st.integers(1, 2))
    return heads, draw(st.sampled_from([4, 6, 20])), groups, draw(st.sampled_from([4, 8, 12]))


@st.composite
def forwards(draw):
    """``(kind, args)`` of one forward: a chain (up to twice the ring) or a tree."""
    kind = draw(st.sampled_from(sorted(LAUNCHERS)))
    chain = draw(st.booleans())
    ring = draw(st.integers(2, 5))
    q = draw(st.integers(1, 2 * ring if chain else ring - 1 if ring > 2 else 1))
    gen = torch.Generator().manual_seed(draw(kc.seeds))
    batch = draw(st.integers(1, 3))
    kernel = draw(st.sampled_from([2, 4]))
    shape = draw(delta_dims() if kind == "gated_delta_rule" else mamba_dims())
    return kind, rc.INPUTS[kind](gen, batch, q, chain, shape, ring + 3, kernel)


@settings(max_examples=40)
@given(forwards())
def test_recurrent_kernels_equal_the_reference(case):
    kind, args = case
    rc.compare(kind, LAUNCHERS[kind], args, DEVICE, atol=2e-5, rtol=2e-5)


def test_kept_states_name_the_reloaded_and_the_last_ring_queries():
    # Tail index = query index; query 3 hangs under 0, query 4 under 3; rings of 2.
    parents = torch.tensor([[-1, 0, 1, 0, 3, 4], [-1, 0, 1, 2, 3, 4]])
    kept = tr.kept_states(parents, torch.tensor([6, 3]), offset=0, ring=2)
    assert kept.tolist() == [
        [True, False, False, False, True, True],
        [False, True, True, False, False, False],
    ]


def test_node_parents_of_the_test_masks_are_the_drawn_parents():
    parents = [[-1, 0, 0, 2, 1], [-1, -1, 1, 1, 3]]
    mask = rc.tree_mask(parents, tail=5)
    assert node_parents(mask).tolist() == parents


#: Tiny hybrids: gated DeltaNet (linear, attention) and Mamba-2 (Mamba-2, attention, MLP).
HYBRIDS = {
    "qwen3_next": dict(
        architecture="Qwen3NextForCausalLM",
        norm_offset=1.0,
        qk_norm=True,
        partial_rotary_factor=0.25,
        attention_output_gate=True,
        linear=LinearAttentionConfig(
            layer_types=("linear_attention", "full_attention"),
            num_k_heads=1,
            num_v_heads=2,
            k_dim=8,
            v_dim=8,
            conv_kernel=4,
        ),
    ),
    "nemotron_h": dict(
        architecture="NemotronHForCausalLM",
        num_layers=3,
        mamba=MambaConfig(
            layer_types=("linear_attention", "full_attention", "mlp"),
            num_heads=2,
            head_dim=8,
            state_size=8,
            n_groups=1,
            conv_kernel=4,
            conv_bias=True,
            proj_bias=False,
            time_step_limit=(0.0, float("inf")),
        ),
    ),
}


@pytest.mark.parametrize("kind", sorted(HYBRIDS))
def test_a_hybrid_decoding_on_the_kernels_emits_the_references_tokens(kind, monkeypatch):
    """The decoder's recurrent layers on the Triton launchers (as on CUDA): plain decoding
    (prefill chunks longer than the ring) and the target drafting for itself in trees emit
    the tokens of the reference recurrences."""
    target = random_model(tiny_config(**HYBRIDS[kind]), seed=3, std=0.3)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 9]]
    tree = SpecOptions(num_steps=2, topk=2, num_draft_tokens=4)

    def decoded() -> list[list[int]]:
        plain = generate(prompts, engine=engine_from_model(target), max_new_tokens=6)
        engine = engine_from_model(
            target, algorithm="standalone", draft=StandaloneHead(target, 64), spec=tree
        )
        tokens = generate(prompts, engine=engine, max_new_tokens=6)
        return [list(r.token_ids) for r in plain + tokens]

    expected = decoded()
    monkeypatch.setattr(kernels, "gated_delta_rule", tr.gated_delta_rule_triton)
    monkeypatch.setattr(kernels, "mamba2_scan", tr.mamba2_scan_triton)
    assert decoded() == expected
