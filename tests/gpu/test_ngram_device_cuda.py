"""The device n-gram matcher on the GPU: its round captured whole (match, verify, accept,
commit, append: one CUDA graph per bucket), replayed without a host sync, equal to the eager
CPU reference and to eager CUDA rounds, greedy (= plain decoding) and sampled with penalties
and logprobs, synchronous and overlapped."""

from __future__ import annotations

import pytest
import torch
from test_graphs_cuda import PROMPTS, _target

from speculum.runtime import scheduler
from speculum.runtime.engine import NgramOptions, SpecOptions, engine_from_model
from speculum.runtime.generate import generate
from speculum.runtime.graphs import GraphedDecode, capture, replay
from speculum.spec import ngram
from speculum.spec.ngram_device import match_chain

pytestmark = pytest.mark.gpu

#: Repetitive prompts as well, so that chains are long and accepted.
REPEATING = [[(5 * i + j % (2 + i % 4)) % 96 for j in range(12 + i)] for i in range(6)]


def _engine(target, **options):
    settings = dict(
        algorithm="ngram",
        spec=SpecOptions(num_draft_tokens=6),
        ngram=NgramOptions(matcher="device", max_depth=5),
        page_size=4,
        max_context=96,
        max_batch=8,
    )
    return engine_from_model(target, **(settings | options))


def test_the_matcher_replayed_from_a_graph_equals_the_cpu_reference():
    """``match_chain`` captured once and replayed over new histories gives exactly the CPU
    function's trees (integer code: no rounding anywhere)."""
    config = ngram.NgramConfig(num_draft_tokens=8, max_depth=6, min_breadth=1, max_breadth=1)
    generator = torch.Generator().manual_seed(0)

    def histories():
        tokens = torch.randint(0, 4, (8, 200), generator=generator)
        lengths = torch.randint(1, 200, (8,), generator=generator)
        tokens = torch.where(torch.arange(200)[None, :] < lengths[:, None], tokens, -1)
        return tokens, lengths

    first = histories()
    graph = capture(lambda h, n: match_chain(h, n, config), tuple(x.cuda() for x in first))
    for _ in range(5):
        tokens, lengths = histories()
        got = replay(graph, (tokens.cuda(), lengths.cuda()))
        want = match_chain(tokens, lengths, config)
        for field in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(got.tree, field).cpu(), getattr(want.tree, field))
        assert torch.equal(got.num_nodes.cpu(), want.num_nodes)


def test_whole_rounds_are_captured_per_bucket_and_replay_without_a_host_sync():
    target = _target()
    engine = _engine(target)
    assert isinstance(engine.pipeline.decode, GraphedDecode)
    plain = engine_from_model(target, page_size=4, max_context=96, max_batch=8)
    prompts = PROMPTS + REPEATING
    results = generate(prompts, engine=engine, max_new_tokens=24)
    expected = generate(prompts, engine=plain, max_new_tokens=24)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert max(r.stats["accept_length_mean"] for r in results) > 1.0  # drafts accepted
    buckets = sorted({c.captured.inputs[0].shape[0] for _, _, c in engine.pipeline.decode.graphs})
    assert 8 in buckets and set(buckets) <= set(engine.config.graph_buckets)
    # A captured round asks the host nothing: replayed with CUDA's sync check set to error.
    state = scheduler.new_state(engine)
    for prompt in REPEATING[:3]:
        state, _ = scheduler.add_request(engine, state, prompt, max_new_tokens=30)
    for _ in range(4):
        state, _ = scheduler.step(engine, state)
    batch = state.batch
    engine.pipeline.decode(engine.resources, batch)  # captured (bucket 4) if not yet
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.pipeline.decode(engine.resources, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_captured_rounds_equal_the_eager_cpu_reference_greedy():
    """The same fp32 target on the CPU (eager rounds, the reference) and on CUDA (captured
    rounds): the same greedy tokens and the same rounds."""
    target = _target()
    cpu = _engine(target.to("cpu"))
    reference = generate(REPEATING, engine=cpu, max_new_tokens=24)
    cuda = _engine(target.to("cuda"))
    results = generate(REPEATING, engine=cuda, max_new_tokens=24)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert [r.stats["accept_length_histogram"] for r in results] == [
        r.stats["accept_length_histogram"] for r in reference
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_captured_sampled_rounds_equal_eager_ones_with_penalties_and_logprobs(overlap):
    """Seeded sampling, a presence penalty and logprobs: captured rounds (synchronous or
    overlapped) draw exactly the eager CUDA rounds' tokens."""
    target = _target()
    settings = dict(penalties=True, max_logprobs=2)
    captured = _engine(target, overlap=overlap, **settings)
    eager = _engine(target, cuda_graphs=False, **settings)
    options = dict(max_new_tokens=24, temperature=0.8, seed=3, presence_penalty=0.5, logprobs=2)
    prompts = PROMPTS + REPEATING
    results = generate(prompts, engine=captured, **options)
    reference = generate(prompts, engine=eager, **options)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    # The same alternatives; values to float32 rounding: an overlapped batch gathers its rows
    # at other times than the eager one, and the GEMMs of another row count round differently.
    for ours, theirs in zip(results, reference, strict=True):
        for step, expected in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert step["token_id"] == expected["token_id"]
            assert step["logprob"] == pytest.approx(expected["logprob"], abs=1e-4)
            got = [(t["token_id"], t["logprob"]) for t in step["top_logprobs"]]
            want = [
                (t["token_id"], pytest.approx(t["logprob"], abs=1e-4))
                for t in expected["top_logprobs"]
            ]
            assert got == want
