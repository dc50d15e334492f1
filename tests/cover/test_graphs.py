"""The device-independent half of CUDA-graph decoding: buckets and padding rows.

A captured round runs a batch padded to its bucket; the padding rows must change nothing the
real rows emit or the cache pages they own. That is a property of ``pad_batch`` and the stages,
checked here eagerly on the CPU (the GPU tests check the captured graphs themselves).
"""

from __future__ import annotations

import attrs
import pytest
import torch
from graph_checks import fake_capture
from heads import agreeing_head, markov_target
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.runtime import graphs, scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.graphs import GraphedDecode, bucket_for, pad_batch, without_cache
from speculum.state.batch import batch_size, take_rows
from speculum.state.kv import PADDING_PAGE
from speculum.state.record import tree_equal

VOCAB = 24
TARGET = markov_target(VOCAB)
HEAD = agreeing_head(TARGET, "eagle")


@given(st.lists(st.integers(1, 64), min_size=1, max_size=6, unique=True), st.integers(1, 80))
def test_bucket_is_the_smallest_that_holds_the_batch(buckets, batch):
    if batch > max(buckets):
        with pytest.raises(ValueError, match="exceeds the largest CUDA-graph bucket"):
            bucket_for(batch, buckets)
        return
    bucket = bucket_for(batch, buckets)
    assert bucket in buckets and bucket >= batch
    assert all(b < batch or b >= bucket for b in buckets)


def _engine(algorithm, topk, max_batch):
    """A plain or EAGLE (chain or tree of ``topk``) engine over the Markov target."""
    return engine_from_model(
        TARGET,
        algorithm=algorithm,
        draft=HEAD if algorithm == "eagle" else None,
        spec=SpecOptions(num_steps=3, topk=topk, num_draft_tokens=4),
        page_size=4,
        max_context=64,
        max_batch=max_batch,
    )


def _running(engine, prompts):
    state = scheduler.new_state(engine)
    for prompt in prompts:
        state, _ = scheduler.add_request(engine, state, prompt, max_new_tokens=40)
    while state.waiting or state.prefilling:
        state, _ = scheduler.step(engine, state)
    return state


def _owned(engine, state):
    """Contents of every page a running request holds, in every pool."""
    pages = torch.tensor([p for r in state.running for p in r.pages])
    return [(pool.k[:, pages].clone(), pool.v[:, pages].clone()) for pool in engine.resources.pools]


def _pools(engine):
    return [(pool.k.clone(), pool.v.clone()) for pool in engine.resources.pools]


def _put_back(engine, saved):
    for pool, (k, v) in zip(engine.resources.pools, saved):
        pool.k.copy_(k)
        pool.v.copy_(v)


@settings(max_examples=12)
@given(
    algorithm=st.sampled_from(["plain", "eagle"]),
    topk=st.sampled_from([1, 2]),
    prompts=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9), min_size=1, max_size=3
    ),
    extra=st.integers(1, 4),
)
def test_padding_rows_change_nothing_real_rows_emit_or_own(algorithm, topk, prompts, extra):
    """Real rows of a padded batch do not depend on what the padding rows hold (bit for bit:
    the padded batch has one shape, whatever the padding), and emit what the unpadded batch
    emits (token for token: a different batch size may round matrix products differently)."""
    engine = _engine(algorithm, topk, max_batch=4)
    state = _running(engine, prompts)
    batch, bucket = batch_size(state.batch), batch_size(state.batch) + extra
    before = _pools(engine)
    _, unpadded_out = engine.pipeline.decode(engine.resources, state.batch)

    _put_back(engine, before)
    padded = pad_batch(state.batch, bucket)
    assert batch_size(padded) == bucket
    assert bool((padded.kv.page_table[batch:] == PADDING_PAGE).all())
    assert bool((padded.kv.seq_lens[batch:] == 0).all())
    padded_state, padded_out = engine.pipeline.decode(engine.resources, padded)
    padded_pages = _owned(engine, state)

    # The same batch padded with copies of its last row instead of its first.
    _put_back(engine, before)
    rows = torch.arange(bucket)
    other = without_cache(take_rows(state.batch, rows.clamp(max=batch - 1)), rows >= batch)
    other_state, other_out = engine.pipeline.decode(engine.resources, other)

    real = torch.arange(batch)
    assert tree_equal(take_rows(other_out, real), take_rows(padded_out, real))
    assert tree_equal(take_rows(other_state, real), take_rows(padded_state, real))
    for (k, v), (k2, v2) in zip(padded_pages, _owned(engine, state)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert tree_equal(take_rows(padded_out, real), unpadded_out)


def _tokens(engine, requests, late, sampling):
    """Every request's tokens, ``late`` of them queued once the first ones have run 3 steps."""
    state, tokens = scheduler.new_state(engine), {}

    def step(state):
        state, outputs = scheduler.step(engine, state)
        for out in outputs:
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        return state

    for number, (prompt, new_tokens) in enumerate(requests):
        if number == len(requests) - late:
            for _ in range(3):
                state = step(state)
        state, _ = scheduler.add_request(
            engine, state, prompt, sampling=sampling, max_new_tokens=new_tokens
        )
    while not scheduler.is_idle(state):
        state = step(state)
    return tokens


@settings(max_examples=10, deadline=None)
@given(
    algorithm=st.sampled_from(["plain", "eagle"]),
    requests=st.lists(
        st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), st.integers(1, 14)),
        min_size=2,
        max_size=6,
    ),
    late=st.integers(0, 2),
    sampled=st.booleans(),
)
def test_graphed_rounds_emit_eager_tokens_as_the_batch_shrinks_and_grows(
    algorithm, requests, late, sampled
):
    """A graphed decode (its graphs stood in for by eager replays of the recorded call)
    emits, request for request, the eager pipeline's tokens while requests finish at
    different rounds and others join: the batch moves within and across buckets, so static
    rows left over from larger batches (and rows the capture padded) sit after the real
    ones, and rows a finished request held are reset to padding."""
    sampling = scheduler.Sampling(temperature=1.0, top_p=0.9, seed=5) if sampled else None
    eager = _tokens(_engine(algorithm, 2, max_batch=8), requests, late, sampling)
    graphed = _engine(algorithm, 2, max_batch=8)
    graphed = attrs.evolve(
        graphed,
        pipeline=attrs.evolve(
            graphed.pipeline, decode=GraphedDecode(graphed.pipeline.decode, (1, 2, 4, 8))
        ),
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graphs, "capture", fake_capture)
        patch.setattr(torch.cuda, "graph_pool_handle", object)
        assert _tokens(graphed, requests, late, sampling) == eager


def test_engines_capture_rounds_only_on_cuda_and_without_host_work():
    """Which pipelines a CUDA engine graphs: every round whole but n-gram's (host work between
    device stages), whose device part (verify, accept, commit) is captured instead; and only
    with graphs switched on and a batch limit the buckets hold."""
    from speculum.pipelines import get_pipeline
    from speculum.runtime.engine import EngineConfig, _graphed
    from speculum.runtime.graphs import GraphedDecode

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    plain = get_pipeline("plain")
    ngram = get_pipeline("ngram", num_draft_tokens=4)
    config = EngineConfig(max_batch=8, graph_buckets=(1, 8))
    assert isinstance(_graphed(plain, config, cuda).decode, GraphedDecode)
    assert _graphed(plain, config, cpu) is plain
    graphed_ngram = _graphed(ngram, config, cuda)
    assert graphed_ngram.decode.keywords["device_round"].decode is ngram.device_round
    assert isinstance(graphed_ngram.decode.keywords["device_round"], GraphedDecode)
    assert _graphed(ngram, config, cpu) is ngram
    off = EngineConfig(max_batch=8, cuda_graphs=False)
    assert _graphed(plain, off, cuda) is plain
    with pytest.raises(ValueError, match="exceeds the largest CUDA-graph bucket 8"):
        _graphed(plain, EngineConfig(max_batch=9, graph_buckets=(1, 8)), cuda)
