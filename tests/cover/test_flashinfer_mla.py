"""flashinfer's MLA kernel planned on the host (``kernels.flashinfer_mla``,
``runtime.mla_kernel``), checked on the CPU against a stand-in for flashinfer's wrapper that
computes what its documentation says ``plan()`` and ``run()`` mean (``FakeWrapper``):

- :func:`plan_inputs` over any committed lengths, bucket padding, round forward and page
  table: each row reads its own page-table row, as many pages as its keys need, and the
  wrapper's causal attention over them is ``spec.attention.latent_attention`` with the
  forward's prefix (Hypothesis).
- The target's forwards take the round's wrappers in order while a round is planned, and
  none otherwise.
- The round's forwards per algorithm, and every refusal of ``mla_kernel="flashinfer"``
  (cause and fix named).
- Whole engines: plain decoding (one and three steps per round) and an MTP chain round on an
  MLA target, planned from the scheduler's host lengths, emit the Triton path's tokens, and
  every target forward of every round ran the wrapper (prefill chunks and the draft did not).
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli import run_cli

from speculum.kernels.flashinfer_mla import LatentPlans, RoundForward, plan_inputs
from speculum.models.config import MLAConfig
from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.runtime import engine as engine_module
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate
from speculum.runtime.mla_kernel import UnsupportedKernel, check_mla_kernel, round_forwards
from speculum.spec.attention import latent_attention
from speculum.spec.paged import causal_mask, pack_batch, tail_batch
from speculum.state.kv import PagedKV

VOCAB = 96
LATENT, ROPE = 16, 8


def flashinfer_attention(q_nope, q_pe, ckv, kpe, pages, inputs, page_size, scale):
    """What flashinfer's MLA wrapper computes (its documentation): request ``b``'s queries
    ``qo_indptr[b] ..`` attend to its ``kv_len_arr[b]`` keys, on the pages
    ``pages[kv_indptr[b] ..]``; causal, query ``i`` of ``n`` sees keys ``< kv_len - n + i + 1``."""
    out = torch.zeros_like(q_nope)
    for b in range(inputs.kv_len_arr.shape[0]):
        q0, q1 = inputs.qo_indptr[b].item(), inputs.qo_indptr[b + 1].item()
        length = inputs.kv_len_arr[b].item()
        start = inputs.kv_indptr[b].item()
        rows = pages[start : start + math.ceil(length / page_size)].long()
        keys = ckv[rows].flatten(0, 1)[:length].float()
        rope = kpe[rows].flatten(0, 1)[:length].float()
        scores = q_nope[q0:q1].float() @ keys.T + q_pe[q0:q1].float() @ rope.T  # [n, h, len]
        n = q1 - q0
        seen = torch.arange(length)[None, :] < (length - n + torch.arange(n) + 1)[:, None]
        if not inputs.causal:
            seen = torch.ones_like(seen)
        scores = torch.where(seen[:, None, :], scores * scale, -math.inf)
        out[q0:q1] = (scores.softmax(-1) @ keys).to(out.dtype)
    return out


class FakeWrapper:
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` as its documentation describes it, on
    any device: ``plan()`` keeps the host arrays, ``run()`` reads the page indices from the
    buffer it was built with (CUDA-graph mode) and attends as :func:`flashinfer_attention`.
    ``runs`` counts its calls over all instances."""

    runs = 0

    def __init__(self, workspace, use_cuda_graph, qo_indptr, kv_indptr, kv_indices, kv_len_arr,
                 backend):  # fmt: skip
        assert use_cuda_graph and backend == "fa2"
        self.indices = kv_indices
        self.inputs = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_dtype, kv_dtype):  # fmt: skip
        assert all(t.dtype == torch.int32 for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr))
        assert kv_indices.numel() == 0  # the forward stages the indices on the device
        inputs = types.SimpleNamespace(
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_len_arr=kv_len_arr, causal=causal
        )
        self.inputs, self.page_size, self.scale = inputs, page_size, sm_scale

    def run(self, q_nope, q_pe, ckv, kpe):
        FakeWrapper.runs += 1
        args = (self.indices, self.inputs, self.page_size, self.scale)
        return flashinfer_attention(q_nope, q_pe, ckv, kpe, *args)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """flashinfer importable as :class:`FakeWrapper`, and the engine's device, dtype and
    shape checks lifted (the fake runs float32 on the CPU at any shape)."""
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = FakeWrapper
    package = types.ModuleType("flashinfer")
    package.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(engine_module, "check_mla_kernel", lambda *args, **kwargs: None)
    FakeWrapper.runs = 0
    return FakeWrapper


# -- plan_inputs ---------------------------------------------------------------------------


@st.composite
def planned_forwards(draw):
    """Committed lengths of a batch, its padded rows, a round forward, a page table wide
    enough for it, and the page size."""
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    committed = draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
    rows = len(committed) + draw(st.integers(0, 3))
    forward = RoundForward(width=draw(st.integers(1, 5)), offset=draw(st.integers(0, 3)))
    longest = max(committed) + forward.offset + forward.width
    stride = math.ceil(longest / page_size) + draw(st.integers(0, 2))
    return committed, rows, forward, stride, page_size


@settings(max_examples=60, deadline=None)
@given(planned_forwards())
def test_plan_inputs_read_each_rows_own_pages_and_lengths(case):
    """Request ``b``'s queries are rows ``b * width ..``, its pages start at its page-table
    row, and it reads its committed cache, the forward's offset and its own queries; padding
    rows read their queries over the padding page alone."""
    committed, rows, forward, stride, page_size = case
    inputs = plan_inputs(committed, rows, forward, stride, page_size)
    lengths = [*committed, *[0] * (rows - len(committed))]
    assert inputs.qo_indptr.tolist() == [b * forward.width for b in range(rows + 1)]
    assert inputs.kv_indptr.tolist() == [b * stride for b in range(rows + 1)]
    expected = [n + forward.offset + forward.width for n in lengths]
    assert inputs.kv_len_arr.tolist() == expected
    assert max(math.ceil(n / page_size) for n in expected) <= stride
    assert inputs.causal == (forward.width > 1)


@settings(max_examples=25, deadline=None)
@given(planned_forwards(), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_planned_attention_is_latent_attention_over_the_prefix(case, heads, seed):
    """flashinfer's attention under :func:`plan_inputs` is ``spec.attention.latent_attention``
    of the forward's queries after a prefix of ``committed + offset`` tokens, causal over
    themselves: the same function the Triton kernel computes."""
    committed, rows, forward, stride, page_size = case
    generator = torch.Generator().manual_seed(seed)
    num_pages = rows * stride + 1
    cache = torch.randn(num_pages, page_size, 1, LATENT + ROPE, generator=generator)
    page_table = (torch.randperm(num_pages - 1, generator=generator)[: rows * stride] + 1).view(
        rows, stride
    )
    page_table[len(committed) :] = 0  # padding rows: the padding page
    q = torch.randn(rows, forward.width, heads, LATENT + ROPE, generator=generator)
    scale = 0.3
    lengths = torch.tensor([*committed, *[0] * (rows - len(committed))])
    width = torch.full((rows,), forward.width)
    expected = latent_attention(
        q,
        cache,
        page_table,
        lengths + forward.offset,
        width,
        causal_mask(rows, forward.width),
        scale,
        LATENT,
    )
    inputs = plan_inputs(committed, rows, forward, stride, page_size)
    flat = q.flatten(0, 1)
    got = flashinfer_attention(
        flat[..., :LATENT],
        flat[..., LATENT:],
        cache[:, :, 0, :LATENT],
        cache[:, :, 0, LATENT:],
        page_table.flatten().int(),
        inputs,
        page_size,
        scale,
    ).view(rows, forward.width, heads, LATENT)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_plan_inputs_refuse_what_the_page_table_cannot_hold():
    with pytest.raises(ValueError, match="more than the page table's 2"):
        plan_inputs([30], 1, RoundForward(width=4, offset=0), stride=2, page_size=16)
    with pytest.raises(ValueError, match="do not fit 1 rows"):
        plan_inputs([3, 4], 1, RoundForward(width=1, offset=0), stride=2, page_size=16)


def _forward_batch(rows: int, width: int, stride: int):
    kv = PagedKV(
        page_table=torch.zeros(rows, stride, dtype=torch.int64),
        seq_lens=torch.zeros(rows, dtype=torch.int64),
        page_size=4,
    )
    positions = torch.arange(width).expand(rows, width)
    return tail_batch(
        kv, torch.zeros(rows, width, dtype=torch.int64), positions, causal_mask(rows, width)
    )


def test_forwards_bind_the_rounds_wrappers_in_order_only_while_planned(fake_flashinfer):
    """Outside a planned round a forward gets no wrapper (-1: the latent-attention op runs);
    inside, the round's forwards take their wrappers in order, cyclically (a captured round's
    warm-up calls and its capture run over one plan), and a forward of another shape, or a
    packed one, is refused."""
    steps = (RoundForward(1, 0), RoundForward(1, 1))
    plans = LatentPlans(
        steps,
        heads=2,
        latent_dim=LATENT,
        rope_dim=ROPE,
        page_size=4,
        stride=3,
        max_rows=4,
        scale=0.3,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    decode = _forward_batch(2, 1, 3)
    assert plans.bind(decode) == -1
    with plans.planned([3, 5], rows=2):
        ids = [plans.bind(decode) for _ in range(4)]
        with pytest.raises(ValueError, match="planned for 2 rows of 1 queries"):
            plans.bind(_forward_batch(2, 2, 3))
        with pytest.raises(ValueError, match="packed"):
            plans.bind(pack_batch(decode, 2)[0])
    assert ids == [id(plans.wrappers[(2, 0)]), id(plans.wrappers[(2, 1)])] * 2
    assert plans.wrappers[(2, 1)].inputs.kv_len_arr.tolist() == [3 + 1 + 1, 5 + 1 + 1]
    assert plans.bind(decode) == -1
    with pytest.raises(ValueError, match="exceed the 4 the engine was built for"):
        plans.plan([1], rows=8)


# -- round forwards and refusals -------------------------------------------------------------


def test_round_forwards_of_plain_steps_and_chains():
    chain = dict(num_steps=3, topk=1, num_draft_tokens=None)
    assert round_forwards("plain", steps=3, **chain) == (
        RoundForward(1, 0),
        RoundForward(1, 1),
        RoundForward(1, 2),
    )
    assert round_forwards("nextn", steps=1, **chain) == (RoundForward(4, 0),)
    assert round_forwards("eagle", steps=1, **(chain | {"num_draft_tokens": 3})) == (
        RoundForward(3, 0),
    )


@pytest.mark.parametrize(
    ("algorithm", "topk", "match"),
    [("mtp", 3, "topk=3 verifies a tree"), ("ngram", 1, "'ngram'"), ("dspark", 1, "'dspark'")],
)
def test_round_forwards_refuse_trees_and_blocks(algorithm, topk, match):
    with pytest.raises(UnsupportedKernel, match=match) as error:
        round_forwards(algorithm, steps=1, num_steps=3, topk=topk, num_draft_tokens=8)
    assert "mla_kernel='triton'" in str(error.value)


def _mla_target(latent=LATENT, rope=ROPE, dtype=torch.float32):
    mla = MLAConfig(
        q_lora_rank=None,
        kv_lora_rank=latent,
        qk_nope_head_dim=8,
        qk_rope_head_dim=rope,
        v_head_dim=8,
    )
    config = tiny_config(
        vocab_size=VOCAB,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=4,
        architecture="DeepseekV3ForCausalLM",
        mla=mla,
    )
    return random_model(config, seed=5, std=0.3).to(dtype)


REFUSALS = {
    "no latent layers": ({}, "no latent-attention layers"),
    "overlap": ({"overlap": True}, "drop --overlap"),
    "compiled": ({"compile_stages": ("round",)}, "drop --compile-stages"),
    "adaptive": ({"adaptive": True}, "drop --adaptive-steps"),
    "float32": ({}, "--dtype bfloat16"),
    "shape": ({}, "kv_lora_rank=16, qk_rope_head_dim=8"),
}


@pytest.mark.parametrize("label", sorted(REFUSALS))
def test_flashinfer_is_refused_naming_cause_and_fix(label, tiny_model):
    changes, match = REFUSALS[label]
    options = {"overlap": False, "compile_stages": (), "adaptive": False} | changes
    target = {
        "no latent layers": tiny_model,
        "float32": _mla_target(),
        "shape": _mla_target(dtype=torch.bfloat16),
    }.get(label, _mla_target(512, 64, torch.bfloat16))
    with pytest.raises(UnsupportedKernel, match=match) as error:
        check_mla_kernel("flashinfer", target, **options)
    assert "triton" in str(error.value) or "drop" in str(error.value)
    check_mla_kernel("triton", target, **options)  # the default is never refused


def test_flashinfer_is_refused_without_flashinfer_or_off_cuda(monkeypatch):
    target = _mla_target(512, 64, torch.bfloat16)
    options = {"overlap": False, "compile_stages": (), "adaptive": False}
    monkeypatch.setitem(sys.modules, "flashinfer.mla", None)  # import fails
    with pytest.raises(UnsupportedKernel, match=r"pip install 'speculum\[cuda\]'"):
        check_mla_kernel("flashinfer", target, **options)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", types.ModuleType("flashinfer.mla"))
    with pytest.raises(UnsupportedKernel, match="runs on CUDA; the target is on cpu"):
        check_mla_kernel("flashinfer", target, **options)


def test_engines_refuse_flashinfer_for_a_tree_round():
    target = _mla_target(512, 64, torch.bfloat16)
    draft = random_draft(target, "mtp", seed=2, std=0.3)
    tree = SpecOptions(num_steps=2, topk=2, num_draft_tokens=4)
    with pytest.raises(UnsupportedKernel):
        engine_from_model(target, algorithm="mtp", draft=draft, spec=tree, mla_kernel="flashinfer")


# -- whole engines, planned by the scheduler -----------------------------------------------

#: Prompts of several lengths through max_batch 3: batches of 3, then fewer as requests end.
PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(1 + 2 * i)] for i in range(5)]
LIMITS = {"page_size": 4, "max_context": 64, "max_batch": 3, "prefill_budget": 8}


def _tokens(target, new_tokens, **options):
    engine = engine_from_model(target, **LIMITS, **options)
    results = generate(PROMPTS, engine=engine, max_new_tokens=new_tokens)
    return [list(r.token_ids) for r in results]


ROUNDS = {
    "plain": lambda target: {},
    "plain, 3 steps a round": lambda target: {"spec": SpecOptions(decode_steps=3)},
    "mtp chain": lambda target: {
        "algorithm": "mtp",
        "draft": random_draft(target, "mtp", seed=2, std=0.3),
        "spec": SpecOptions(num_steps=3, topk=1),
    },
}


@pytest.mark.parametrize("label", sorted(ROUNDS))
def test_planned_rounds_emit_the_triton_paths_tokens(label, fake_flashinfer):
    """The scheduler's host lengths plan each target forward (plain steps at their offsets, a
    chain verify of 4): the wrapper runs in every layer of every round's target forwards and
    the tokens are the latent-attention op's."""
    target = _mla_target()
    options = ROUNDS[label](target)
    expected = _tokens(target, 12, **options)
    assert fake_flashinfer.runs == 0
    assert _tokens(target, 12, mla_kernel="flashinfer", **options) == expected
    assert fake_flashinfer.runs > 0


def test_cli_refuses_flashinfer_for_a_target_without_latent_layers(capsys):
    """The bundled (Llama) pair has no latent attention to plan."""
    status, _, err = run_cli(capsys, "--prompt-ids", "5,6", "--mla-kernel", "flashinfer")
    assert status == 2
    assert "no latent-attention layers: drop --mla-kernel flashinfer" in err
