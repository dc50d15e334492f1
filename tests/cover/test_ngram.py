"""NGRAM: the matcher, store and corpus index (properties against brute force), exact padding,
greedy equality with plain decoding, exact acceptance on a copy target, snapshot/restore with a
changing store, a 2-token chi-square, and the command line."""

from __future__ import annotations

import functools
import itertools
import json
import math

import attrs
import numpy as np
import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from stats import assert_matches_distribution

from speculum.models.loading import random_model, save_model
from speculum.pipelines import get_pipeline
from speculum.runtime import cli, scheduler
from speculum.runtime.engine import NgramOptions, SpecOptions, engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.spec import ngram
from speculum.spec.accept import accept
from speculum.spec.paged import extend_batch
from speculum.spec.sampling import filtered_probs
from speculum.state import PagedKV, SamplingParams, tree_equal
from speculum.state.kv import KVPool
from speculum.state.record import snapshot

VOCAB = 16

# ------------------------------------------------------------------------ brute-force sources


def brute_sources(context, store, corpus):
    """Every occurrence as ``(stream, end, recency)``: ``stream[end]`` may end a match.

    Recency follows the documented timeline: corpus (file order), store (insertion order),
    history (position order)."""
    found, clock = [], itertools.count()
    if corpus is not None:
        for doc in ngram.corpus_documents(corpus):
            found += [(doc, end, next(clock)) for end in range(len(doc))]
    if store is not None:
        for tokens, real in ngram.live_streams(store):
            found += [(tokens, end, next(clock)) for end in range(len(tokens)) if real[end]]
    found += [(list(context), end, next(clock)) for end in range(len(context) - 1)]
    return found


def follows(context, path, sources, lengths):
    """Whether ``path`` follows the last ``L`` context tokens somewhere, for some ``L``."""
    for stream, end, _ in sources:
        for length in lengths:
            start = end - length + 1
            if (
                start >= 0
                and stream[start : end + 1] == list(context[-length:])
                and stream[end + 1 : end + 1 + len(path)] == list(path)
            ):
                return True
    return False


def paths(tree, row, count):
    tokens, parents = tree.tokens[row].tolist(), tree.parents[row].tolist()
    for node in range(1, count):
        path, at = [], node
        while at > 0:
            path.insert(0, tokens[at])
            at = parents[at]
        yield node, path


# ------------------------------------------------------------------------ hand-computed trees


def test_a_hand_computed_tree():
    """History ``1 2 3 4 1 2 5 6 1 2 3 7 1 2``: the suffix ``1 2`` occurs three times (the
    longest match), continued by ``3 7 1 2``, ``5 6 1 2``, ``3 4 1 2`` (newest first). With
    max_depth 4 and breadth 1-3, a 2-token match takes 1 + floor(2 * 2 / 3) = 2 children at the
    first level, 1 below: ``3`` (newest) and ``5``; then ``7`` under ``3`` (``4`` is older), ``6``
    under ``5``, and so on until 8 nodes."""
    config = ngram.NgramConfig(num_draft_tokens=8, max_depth=4, min_breadth=1, max_breadth=3)
    history = torch.tensor([[1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]])
    drafted = ngram.match(history, torch.tensor([14]), config)
    assert drafted.tree.tokens.tolist() == [[2, 3, 5, 7, 6, 1, 1, 2]]
    assert drafted.tree.parents.tolist() == [[-1, 0, 0, 1, 2, 3, 4, 5]]
    assert drafted.tree.depths.tolist() == [[0, 1, 1, 2, 2, 3, 3, 4]]
    assert drafted.num_nodes.tolist() == [8]


def test_breadth_grows_as_the_match_shortens_and_order_switches():
    """The context ends ``x a b``. ``x a b`` occurs once (then ``e``); ``a b`` four times,
    followed by ``c``, ``d``, ``c``, ``e`` (oldest first); ``b`` once more, followed by ``f``.
    With max_depth 3 and breadth 1-3, a 3-token match takes 1 first-level child, a 2-token
    match 2 and a 1-token match 3 (and no node more than 3 in all)."""
    x, a, b, c, d, e, f = 9, 1, 2, 3, 4, 5, 6
    history = [a, b, c, a, b, d, a, b, c, x, a, b, e, 7, b, f, 8, x, a, b]
    config = dict(num_draft_tokens=10, max_depth=3, min_breadth=1, max_breadth=3)
    recency = ngram.match(
        torch.tensor([history]),
        torch.tensor([len(history)]),
        ngram.NgramConfig(**config, order="recency"),
    )
    frequency = ngram.match(
        torch.tensor([history]),
        torch.tensor([len(history)]),
        ngram.NgramConfig(**config, order="frequency"),
    )

    def root_children(drafted):
        tokens, parents = drafted.tree.tokens[0].tolist(), drafted.tree.parents[0].tolist()
        real = int(drafted.num_nodes[0])
        return [tokens[i] for i in range(1, real) if parents[i] == 0]

    # Recency: e (the 3-token match); "a b" ranks e, c, d and takes 2 (e again, c); "b" ranks
    # f, e, c, d and takes 3 (f is new).
    assert root_children(recency) == [e, c, f]
    # Frequency: e; "a b" ranks c (twice), e, d and takes c, e; "b" ranks c, f, e, d: f is new.
    assert root_children(frequency) == [e, c, f]
    short = ngram.NgramConfig(**{**config, "max_depth": 2}, order="frequency")
    drafted = ngram.match(torch.tensor([history]), torch.tensor([len(history)]), short)
    # max_depth 2: "a b" is the longest match (breadth 1: c, most frequent), then "b" (breadth
    # 3: c, then d / e / f by count 1 each, newest first: f, e).
    assert root_children(drafted) == [c, f, e]


def test_no_match_drafts_one_guess_then_unreachable_fillers():
    config = ngram.NgramConfig(num_draft_tokens=6, max_depth=3, max_breadth=2)
    drafted = ngram.match(torch.tensor([[4, 5, 6]]), torch.tensor([3]), config)
    assert drafted.num_nodes.tolist() == [1]
    assert drafted.tree.tokens.tolist() == [[6, 6, 6, 6, 6, 6]]
    # node 1: the guess; node 2: its dead duplicate at the root; the rest below node 2.
    assert drafted.tree.parents.tolist() == [[-1, 0, 0, 2, 2, 2]]
    assert ngram.tree_bounds(config) == (3, 3)


# ------------------------------------------------------------------------ store and corpus


def reference_ring(log, capacity):
    """Decoded live entries of a ring that received the entries of ``log`` in order."""
    return log[-capacity:]


streams_strategy = st.lists(
    st.tuples(
        st.lists(st.integers(0, 4), min_size=0, max_size=9),
        st.integers(0, 4),
        st.integers(0, 4),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60)
@given(
    batches=st.lists(streams_strategy, min_size=1, max_size=5),
    capacity=st.integers(2, 40),
    index_every=st.integers(1, 30),
)
def test_store_is_bounded_persistent_and_holds_the_newest_entries(batches, capacity, index_every):
    store = ngram.new_store(capacity, index_every=index_every)
    log = []
    for streams in batches:
        before = snapshot(store)
        new = ngram.insert_many(store, streams)
        assert tree_equal(store, before), "insert changed the store it was given"
        for tokens, lead, trail in streams:
            entries = [(t, lead <= i < len(tokens) - trail) for i, t in enumerate(tokens)]
            if any(real for _, real in entries):
                log += entries + [(-1, False)]
        store = new
        assert store.tokens.numel() == capacity and store.tokens.dtype == torch.int32
        assert store.index_tokens.numel() <= capacity
        assert store.index_positions.numel() == store.index_tokens.numel()
        live = reference_ring(log, capacity)
        streams_seen, current = [], ([], [])
        for token, real in live:
            if token == -1:
                if current[0]:
                    streams_seen.append(current)
                current = ([], [])
            else:
                current[0].append(token)
                current[1].append(real)
        if current[0]:
            streams_seen.append(current)
        assert ngram.live_streams(store) == streams_seen


def test_evicted_index_entries_are_not_occurrences():
    """``7`` is indexed at position 0, then evicted by a smaller insert that does not merge the
    index again: its continuation ``8 9 9`` is still in the ring, but ``7`` no longer is."""
    store = ngram.new_store(6, index_every=5)
    store = ngram.insert(store, [7, 8, 9, 9])  # 5 entries: merged into the index
    store = ngram.insert(store, [1])  # 2 entries: position 0 evicted, no merge
    assert ngram.live_streams(store)[0] == ([8, 9, 9], [True, True, True])
    config = ngram.NgramConfig(num_draft_tokens=3, max_depth=2)
    drafted = ngram.match(torch.tensor([[7]]), torch.tensor([1]), config, store=store)
    assert drafted.num_nodes.tolist() == [1]  # nothing follows a live 7
    drafted = ngram.match(torch.tensor([[8]]), torch.tensor([1]), config, store=store)
    assert drafted.tree.tokens.tolist() == [[8, 9, 9]]


@settings(max_examples=40)
@given(
    text=st.lists(st.integers(-1, 3), min_size=0, max_size=30),
)
def test_suffix_array_sorts_the_reversed_corpus(text):
    corpus = ngram.build_corpus_index(np.array(text, dtype=np.int64))
    reversed_text = text[::-1]
    expected = sorted(range(len(text)), key=lambda i: reversed_text[i:])
    assert corpus.suffixes.tolist() == expected


contexts = st.lists(st.integers(0, 3), min_size=1, max_size=14)
documents = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), max_size=4)


@st.composite
def matcher_case(draw):
    n = draw(st.integers(2, 12))
    max_depth = draw(st.integers(1, 6))
    min_breadth = draw(st.integers(1, 3))
    config = ngram.NgramConfig(
        num_draft_tokens=n,
        max_depth=max_depth,
        min_match=draw(st.integers(1, max_depth)),
        min_breadth=min_breadth,
        max_breadth=draw(st.integers(min_breadth, 4)),
        order=draw(st.sampled_from(ngram.ORDERS)),
        max_occurrences=draw(st.integers(1, 40)),
    )
    store = None
    if draw(st.booleans()):
        store = ngram.new_store(draw(st.integers(2, 40)), index_every=draw(st.integers(1, 20)))
        for streams in draw(st.lists(streams_strategy, max_size=6)):
            store = ngram.insert_many(store, [(t, lo, hi) for t, lo, hi in streams])
    docs = draw(documents)
    corpus = ngram.build_corpus_index(docs) if docs and draw(st.booleans()) else None
    histories = draw(st.lists(contexts, min_size=1, max_size=4))
    return config, store, corpus, histories


def padded(histories):
    width = max(map(len, histories)) + 2
    rows = [h + [-1] * (width - len(h)) for h in histories]
    return torch.tensor(rows), torch.tensor([len(h) for h in histories])


@settings(max_examples=150)
@given(case=matcher_case(), seed=st.integers(0, 2**31))
def test_every_candidate_follows_the_matched_suffix_and_fillers_are_never_accepted(case, seed):
    config, store, corpus, histories = case
    history, lengths = padded(histories)
    drafted = ngram.match(history, lengths, config, store=store, corpus=corpus)
    tree, counts = drafted.tree, drafted.num_nodes.tolist()
    n = config.num_draft_tokens
    depth_bound, max_children = ngram.tree_bounds(config)
    assert tree.tokens.shape == (len(histories), n)
    for row, context in enumerate(histories):
        count = counts[row]
        assert 1 <= count <= n and tree.tokens[row, 0] == context[-1]
        sources = brute_sources(context, store, corpus)
        lengths_ok = range(config.min_match, min(config.max_depth, len(context)) + 1)
        for node, path in paths(tree, row, count):
            assert follows(context, path, sources, lengths_ok), (row, node, path)
        real_kids = {}
        for node in range(1, count):
            parent = int(tree.parents[row, node])
            real_kids.setdefault(parent, []).append(int(tree.tokens[row, node]))
        for kids in real_kids.values():
            assert len(kids) == len(set(kids)) <= config.max_breadth
    # Structure and bounds, then acceptance under random target laws: no walk ever enters a
    # filler (the guess of an empty tree is a real draft and may be accepted).
    generator = torch.Generator().manual_seed(seed)
    batch = len(histories)
    for greedy in (True, False):
        logits = torch.randn(batch, n, 5, generator=generator) * 3
        probs = torch.softmax(logits, -1)
        if greedy:
            probs = torch.nn.functional.one_hot(probs.argmax(-1), 5).float()
        result = accept(
            tree,
            probs,
            torch.randint(0, 2**31, (batch,), generator=generator),
            lengths,
            depth_bound,
            max_children=max_children,
        )
        for row, count in enumerate(counts):
            assert result.path[row].max() < max(count, 2)  # node 1 of an empty tree: the guess


@settings(max_examples=100)
@given(case=matcher_case())
def test_root_children_are_every_continuation_in_recency_or_frequency_order(case):
    """With one-token matching and room for everything, the root's children are exactly the
    tokens that follow the last token somewhere, ranked as documented."""
    config, store, corpus, histories = case
    for order in ngram.ORDERS:
        wide = ngram.NgramConfig(
            num_draft_tokens=6,
            max_depth=1,
            min_breadth=4,
            max_breadth=4,
            order=order,
            max_occurrences=10_000,
        )
        history, lengths = padded(histories)
        drafted = ngram.match(history, lengths, wide, store=store, corpus=corpus)
        for row, context in enumerate(histories):
            latest, count = {}, {}
            for stream, end, clock in brute_sources(context, store, corpus):
                if stream[end] == context[-1] and end + 1 < len(stream):
                    token = stream[end + 1]
                    latest[token] = max(latest.get(token, -1), clock)
                    count[token] = count.get(token, 0) + 1
            if order == "recency":
                ranking = sorted(latest, key=lambda t: -latest[t])
            else:
                ranking = sorted(latest, key=lambda t: (-count[t], -latest[t]))
            real = int(drafted.num_nodes[row])
            assert drafted.tree.tokens[row, 1:real].tolist() == ranking[:4]


def test_corpus_file_formats(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("1 2 3\n\n4,5 6\n")
    array = tmp_path / "corpus.npy"
    np.save(array, np.array([1, 2, 3, -1, 4, 5, 6]))
    for path in (text, array):
        assert ngram.corpus_documents(ngram.load_corpus(path)) == [[1, 2, 3], [4, 5, 6]]
    bad = tmp_path / "bad.txt"
    bad.write_text("1 two 3\n")
    with pytest.raises(ValueError, match="line 1"):
        ngram.load_corpus(bad)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_draft_tokens": 1}, "num_draft_tokens"),
        ({"max_depth": 0}, "max_depth"),
        ({"min_match": 4, "max_depth": 3}, "min_match"),
        ({"min_breadth": 3, "max_breadth": 2}, "max_breadth"),
        ({"order": "bfs"}, "order"),
    ],
)
def test_impossible_settings_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        ngram.validate_ngram_config(ngram.NgramConfig(**{"num_draft_tokens": 4, **options}))


# ------------------------------------------------------------------------ the pipeline


class ShiftModel(torch.nn.Module):
    """A mock target whose greedy next token is ``t + 1`` whatever the context: its greedy
    continuation of ``5 6 7 8 9`` runs through the vocabulary and then repeats the prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.config = tiny_config(vocab_size=VOCAB)
        self.capture_layers = ()

    def new_pool(self, num_pages: int, page_size: int) -> KVPool:
        return KVPool.allocate(
            num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=1
        )

    def forward(self, batch, pool, capture=()):
        return torch.nn.functional.one_hot(batch.input_ids, VOCAB).float(), ()

    def logits(self, hidden):
        return 8.0 * hidden.roll(1, dims=-1)


@pytest.mark.parametrize(
    ("num_draft_tokens", "max_depth", "max_breadth"),
    [(8, 18, 10), (8, 3, 2), (2, 18, 1), (12, 5, 1)],
)
def test_acceptance_reaches_the_tree_depth_once_the_span_repeats(
    num_draft_tokens, max_depth, max_breadth
):
    """Prompt ``5 .. 9``; generation ``10 .. 15 0 .. 4`` has nothing to match (11 rounds of a
    rejected guess, one token each), then every root has occurred before with the right
    continuation: each round accepts a chain of the full depth and emits depth + 1 tokens."""
    depth = min(max_depth, num_draft_tokens - 1)
    rounds = 4
    engine = engine_from_model(
        ShiftModel(),
        algorithm="ngram",
        spec=SpecOptions(num_draft_tokens=num_draft_tokens),
        ngram=NgramOptions(max_depth=max_depth, max_breadth=max_breadth, flush_tokens=4),
        page_size=4,
        max_context=128,
    )
    (result,) = generate(
        [[5, 6, 7, 8, 9]], engine=engine, max_new_tokens=1 + 11 + rounds * (depth + 1)
    )
    assert list(result.token_ids) == [(10 + i) % VOCAB for i in range(len(result.token_ids))]
    histogram = [0] * (depth + 2)
    histogram[1] += 11
    histogram[depth + 1] += rounds
    assert result.stats["accept_length_histogram"] == histogram


def markov_target(vocab: int, scale: float = 1.0, seed: int = 5):
    """A random target whose next token is usually a fixed function of the last one (as in
    ``test_eagle.mostly_markov_target``): n-gram drafts from repetitive prompts often agree."""
    config = tiny_config(vocab_size=vocab, num_layers=3, tie_word_embeddings=False)
    model = random_model(config, seed=seed, std=0.18)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0, generator=generator)
        perm = torch.randperm(vocab, generator=generator)
        model.lm_head.weight.copy_(scale * model.model.embed_tokens.weight[perm])
    return model


TARGET = markov_target(VOCAB)
CORPUS = ngram.build_corpus_index([[1, 2, 3, 4, 5, 6, 7], [3, 3, 9, 12, 3, 3, 9], list(range(16))])


LIMITS = ("page_size", "max_context", "prefill_budget", "max_batch", "num_pages")


def ngram_engine(target=TARGET, num_draft_tokens=8, corpus=False, **options):
    limits = {"page_size": 4, "max_context": 48}
    limits.update({k: options.pop(k) for k in LIMITS if k in options})
    engine = engine_from_model(
        target,
        algorithm="ngram",
        spec=SpecOptions(num_draft_tokens=num_draft_tokens),
        ngram=NgramOptions(**options),
        **limits,
    )
    if corpus:  # the engine loads corpora from files; here the pipeline gets an index directly
        options.pop("store_tokens", None)
        pipeline = get_pipeline(
            "ngram", num_draft_tokens=num_draft_tokens, corpus=CORPUS, **options
        )
        engine = attrs.evolve(engine, pipeline=pipeline)
    return engine


def test_drafts_from_history_are_accepted_several_tokens_deep():
    """The greedy-equality property below is only strong if rounds accept deep paths."""
    engine = ngram_engine(max_depth=6, max_breadth=3, num_draft_tokens=8)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 7, 3, 9, 7, 7, 3]]
    results = generate(prompts, engine=engine, max_new_tokens=40)
    assert all(r.stats["accept_length_mean"] > 2.0 for r in results)


def test_the_engine_hands_decode_its_device_round_through_penalty_counting():
    """``decode`` runs the verify-accept-commit part through its ``device_round`` keyword (where
    a CUDA engine passes the captured one), also under penalty counting, with the tokens of the
    default round."""
    engine = ngram_engine(max_depth=6, max_breadth=3, num_draft_tokens=8, max_batch=2)
    counted = engine_from_model(
        TARGET,
        algorithm="ngram",
        spec=SpecOptions(num_draft_tokens=8),
        ngram=NgramOptions(max_depth=6, max_breadth=3),
        page_size=4,
        max_context=48,
        max_batch=2,
        penalties=True,
    )
    calls = []

    def device_round(resources, round_):
        calls.append(round_.tree.tokens.shape)
        return counted.pipeline.device_round(resources, round_)

    rounds = functools.partial(counted.pipeline.decode, device_round=device_round)
    wrapped = attrs.evolve(counted, pipeline=attrs.evolve(counted.pipeline, decode=rounds))
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 7, 3, 9, 7, 7, 3]]
    options = dict(max_new_tokens=20, temperature=0.9, seed=4, frequency_penalty=0.7)
    results = generate(prompts, engine=wrapped, **options)
    assert [r.token_ids for r in results] == [
        r.token_ids for r in generate(prompts, engine=counted, **options)
    ]
    assert calls and all(shape[1] == 8 for shape in calls)
    # The penalties were counted: without them the same seed draws other tokens.
    unpenalized = generate(prompts, engine=engine, max_new_tokens=20, temperature=0.9, seed=4)
    assert [r.token_ids for r in unpenalized] != [r.token_ids for r in results]


def test_warm_up_leaves_nothing_a_later_request_sees():
    """The server's warm-up decodes throwaway requests at every bucket; afterwards the n-gram
    store holds what it held, so requests draft and decode exactly as on a fresh engine."""
    prompts = [[1, 2, 3], [2, 3, 4, 5]]  # the warm-up's prompt is 1, 2, ..., 8
    options = dict(max_new_tokens=12, temperature=0.8, seed=3)
    settings = dict(max_batch=3, flush_tokens=2, store_tokens=1000)
    fresh = generate(prompts, engine=ngram_engine(**settings), **options)
    warmed = ngram_engine(**settings)
    scheduler.warm_up(warmed)
    after = generate(prompts, engine=warmed, **options)
    assert [r.token_ids for r in after] == [r.token_ids for r in fresh]
    # The drafts too: a store that kept the warm-up's streams would draft (and accept) more.
    assert [r.stats["accept_length_histogram"] for r in after] == [
        r.stats["accept_length_histogram"] for r in fresh
    ]


alphabets = st.sampled_from([[1, 2, 3], [4, 9, 11, 15], list(range(VOCAB))])


@settings(max_examples=50)
@given(
    num_draft_tokens=st.integers(2, 10),
    max_depth=st.integers(1, 6),
    breadth=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    order=st.sampled_from(ngram.ORDERS),
    store=st.sampled_from([(0, 32), (64, 1), (4096, 4)]),
    corpus=st.booleans(),
    prompts=alphabets.flatmap(
        lambda a: st.lists(
            st.lists(st.sampled_from(a), min_size=1, max_size=12), min_size=1, max_size=8
        )
    ),
    max_new_tokens=st.integers(1, 14),
    stop_token_ids=st.sets(st.integers(0, VOCAB - 1), max_size=2).map(tuple),
    page_size=st.sampled_from([1, 4]),
    prefill_budget=st.sampled_from([5, 64]),
)
def test_greedy_ngram_decoding_equals_plain(
    num_draft_tokens,
    max_depth,
    breadth,
    order,
    store,
    corpus,
    prompts,
    max_new_tokens,
    stop_token_ids,
    page_size,
    prefill_budget,
):
    """Token for token, for every tree shape, batch, page size, prompt chunking, store and
    corpus, and stop tokens or token limits that fire in the middle of a round."""
    limits = {"page_size": page_size, "max_context": 48, "prefill_budget": prefill_budget}
    engine = ngram_engine(
        num_draft_tokens=num_draft_tokens,
        corpus=corpus,
        max_depth=max_depth,
        min_breadth=breadth[0],
        max_breadth=breadth[0] + breadth[1],
        order=order,
        store_tokens=store[0],
        flush_tokens=store[1],
        **limits,
    )
    results = generate(
        prompts, engine=engine, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
    )
    plain = engine_from_model(TARGET, **limits)
    expected = generate(
        prompts, engine=plain, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
    )
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


@pytest.mark.parametrize("matcher", ["host", "device"])
def test_chunked_prefill_keeps_the_whole_prompt_in_the_history(matcher):
    """Chunk by chunk, the history gathers the whole prompt, then the first output token; the
    rest of its fixed width (the page table's) is padding."""
    engine = ngram_engine(prefill_budget=3, matcher=matcher)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    state, _ = scheduler.add_request(engine, scheduler.new_state(engine), prompt, max_new_tokens=4)
    while not state.running:
        state, outputs = scheduler.step(engine, state)
    (request,) = state.running
    row = state.batch
    assert int(row.history_len[0]) == len(prompt) + 1
    assert row.history[0, : len(prompt) + 1].tolist() == prompt + list(request.output)
    assert (row.history[0, len(prompt) + 1 :] == -1).all()
    assert row.history.shape[1] == row.kv.page_table.shape[1] * row.kv.page_size


def test_the_store_holds_each_history_position_once_as_an_occurrence():
    """Stretches go in with leading and trailing context: concatenating the occurrence-bearing
    tokens of the store's streams gives the request's history up to ``stored_len``."""
    engine = ngram_engine(
        max_depth=4, num_draft_tokens=5, flush_tokens=3, store_tokens=10_000, max_context=64
    )
    state, _ = scheduler.add_request(
        engine, scheduler.new_state(engine), [3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=50
    )
    for _ in range(8):
        state, _ = scheduler.step(engine, state)
    row = state.batch
    stored, history = int(row.stored_len[0]), row.history[0].tolist()
    assert stored > 8
    streams = ngram.live_streams(engine.resources.ngram_store.value)
    real = [t for tokens, flags in streams for t, ok in zip(tokens, flags) if ok]
    assert real == history[:stored]
    for _, flags in streams:  # every stream: context, occurrences, the trailing depth
        lead = flags.index(True)
        assert flags == [False] * lead + [True] * flags.count(True) + [False] * 4


def test_snapshot_restore_replays_sampling_while_the_store_changes():
    engine = ngram_engine(max_depth=4, flush_tokens=2, store_tokens=120, max_batch=4)
    engine.resources.ngram_store.value = ngram.new_store(120, index_every=16)
    sampling = [scheduler.Sampling(temperature=1.0, top_p=0.95, seed=s) for s in range(3)]
    prompts = [[1, 2, 3, 1, 2, 3, 1], [1, 2, 3, 4, 1, 2], [5, 1, 2, 3, 5, 1]]
    state = scheduler.new_state(engine)
    for prompt, s in zip(prompts, sampling):
        state, _ = scheduler.add_request(engine, state, prompt, sampling=s, max_new_tokens=24)
    for _ in range(4):
        state, _ = scheduler.step(engine, state)
    snap = scheduler.take_snapshot(engine, state)
    kept = engine.resources.ngram_store.value
    _, first = run_to_completion(engine, state)
    changed = engine.resources.ngram_store.value
    assert int(changed.length) > int(kept.length), "the store must change after the snapshot"
    _, second = run_to_completion(engine, scheduler.restore(engine, snap))
    assert {r: q.output for r, q in first.items()} == {r: q.output for r, q in second.items()}
    assert tree_equal(engine.resources.ngram_store.value, changed)
    rounds = sum(sum(q.round_lengths[2:]) for q in first.values())
    assert rounds > 0, "the test needs rounds that accepted draft tokens"


# ------------------------------------------------------------------------ sampled losslessness

SMALL_VOCAB = 6
SMALL = markov_target(SMALL_VOCAB, scale=0.3, seed=2)


def exact_joint(target, prompt, setting):
    """The target's law of the first two generated tokens (second fastest), by prefill."""
    prefixes = [prompt] + [prompt + [t] for t in range(SMALL_VOCAB)]
    rows, longest = len(prefixes), len(prompt) + 1
    pages = math.ceil(longest / 4)
    pool = target.new_pool(rows * pages + 1, 4)
    kv = PagedKV(
        page_table=torch.arange(1, rows * pages + 1).reshape(rows, pages),
        seq_lens=torch.zeros(rows, dtype=torch.int64),
        page_size=4,
    )
    tokens = torch.tensor([p + [0] * (longest - len(p)) for p in prefixes])
    lengths = torch.tensor([len(p) for p in prefixes])
    hidden, _ = target(extend_batch(kv, tokens, lengths), pool)
    logits = target.logits(hidden[torch.arange(rows), lengths - 1])
    params = SamplingParams(
        temperature=torch.full((rows,), setting["temperature"]),
        top_k=torch.full((rows,), setting["top_k"], dtype=torch.int64),
        top_p=torch.full((rows,), setting["top_p"]),
        min_p=torch.zeros(rows),
        seed=torch.zeros(rows, dtype=torch.int64),
    )
    # Verify's tree forward rounds differently from this prefill: keep clear of filter
    # thresholds (1e-4 is a thousand times the float32 discrepancy).
    ordered = torch.softmax(logits.double() / setting["temperature"], -1).sort(-1, True).values
    k = setting["top_k"] or SMALL_VOCAB
    if k < SMALL_VOCAB:
        assert float((ordered[:, k - 1] - ordered[:, k]).min()) > 1e-4
    kept = ordered[:, :k] / ordered[:, :k].sum(-1, keepdim=True)
    if setting["top_p"] < 1:
        assert float((kept.cumsum(-1) - kept - setting["top_p"]).abs().min()) > 1e-4
    probs = filtered_probs(logits, params).double().numpy()
    return (probs[0][:, None] * probs[1:]).reshape(-1)


#: Sampling settings of the two-token law checks: plain, and every filter at once.
LAW_SETTINGS = [
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
    {"temperature": 1.3, "top_k": 4, "top_p": 0.8},
]


def assert_first_two_tokens_follow_the_target_law(options, num_draft_tokens, setting):
    """3000 seeded two-token requests through an n-gram engine over :data:`SMALL` with
    ``options`` (``NgramOptions``): their joint law is the target's (chi-square), and rounds
    accepted drafts on the way."""
    prompt = [1, 4, 2, 1, 4, 2, 1, 4]
    seeds = 3000
    engine = engine_from_model(
        SMALL,
        algorithm="ngram",
        spec=SpecOptions(num_draft_tokens=num_draft_tokens),
        ngram=options,
        page_size=4,
        max_context=16,
        max_batch=seeds,
        num_pages=seeds * 5 + 1,
        prefill_budget=seeds * len(prompt),
    )
    state = scheduler.new_state(engine)
    for seed in range(seeds):
        sampling = scheduler.Sampling(min_p=0.0, seed=seed, **setting)
        state, _ = scheduler.add_request(engine, state, prompt, sampling=sampling, max_new_tokens=2)
    _, finished = run_to_completion(engine, state)
    codes = np.array([q.output[0] * SMALL_VOCAB + q.output[1] for q in finished.values()])
    assert_matches_distribution(codes, exact_joint(SMALL, prompt, setting))
    emitted = [
        k for q in finished.values() for k, n in enumerate(q.round_lengths) for _ in range(n)
    ]
    assert np.mean(emitted) > 1.3, "the accept path must be exercised, not only the bonus"


@pytest.mark.parametrize("setting", LAW_SETTINGS)
def test_first_two_tokens_follow_the_target_law(setting):
    options = NgramOptions(max_depth=4, max_breadth=3, store_tokens=0)
    assert_first_two_tokens_follow_the_target_law(options, 6, setting)


# ------------------------------------------------------------------------ command line


def test_cli_runs_ngram_without_a_draft_and_equals_plain(tmp_path, capsys):
    folder = save_model(random_model(tiny_config(), seed=1, std=0.3), tmp_path / "model")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("1 2 3 4 5 6\n7 8 9\n")
    common = ["generate", "--model", str(folder), "--prompt-ids", "1,2,3,1,2,3,1", "--json"]
    common += ["--max-new-tokens", "12"]
    outputs = {}
    for name, extra in {
        "plain": [],
        "ngram": [
            "--algorithm",
            "ngram",
            "--num-draft-tokens",
            "6",
            "--ngram-max-depth",
            "5",
            "--ngram-min-breadth",
            "2",
            "--ngram-max-breadth",
            "3",
            "--ngram-order",
            "frequency",
            "--ngram-store-tokens",
            "256",
            "--ngram-corpus",
            str(corpus),
            "--ngram-min-match",
            "1",
        ],
    }.items():
        assert cli.main(common + extra) == 0
        outputs[name] = json.loads(capsys.readouterr().out)
    assert outputs["ngram"]["token_ids"] == outputs["plain"]["token_ids"]
    assert outputs["ngram"]["stats"]["num_rounds"] < outputs["plain"]["stats"]["num_rounds"]
    bad = common + ["--algorithm", "ngram", "--ngram-max-breadth", "0"]
    with pytest.raises(SystemExit) as stopped:  # range-checked while parsing
        cli.main(bad)
    assert stopped.value.code == 2
    assert "--ngram-max-breadth takes an integer >= 1" in capsys.readouterr().err
