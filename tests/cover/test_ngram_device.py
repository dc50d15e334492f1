"""The device n-gram matcher (``matcher="device"``): its chain against a pure-Python reference
of its rule and against the host matcher's breadth-1 chains, the exact padded layout, greedy
equality with plain decoding (batches, page sizes, chunked prefill, overlap), snapshot/restore,
the history on the device, and refused settings."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ngram import (
    LAW_SETTINGS,
    TARGET,
    VOCAB,
    ShiftModel,
    assert_first_two_tokens_follow_the_target_law,
)

from speculum.models.loading import random_model, save_model
from speculum.pipelines import get_pipeline
from speculum.runtime import cli, scheduler
from speculum.runtime.engine import NgramOptions, SpecOptions, engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.spec import ngram
from speculum.spec.ngram_device import append_tokens, match_chain
from speculum.state.record import replace

# ------------------------------------------------------------------------------ the matcher


def reference_chain(history: list[int], config: ngram.NgramConfig) -> list[int]:
    """The rule, by brute force: the longest suffix length in ``min_match .. max_depth`` that
    ends earlier in the history, its most recent end, the tokens after it up to the depth."""
    n = len(history)
    depth, _ = ngram.tree_bounds(config)
    for length in range(min(config.max_depth, n - 1), config.min_match - 1, -1):
        suffix = history[n - length :]
        ends = [e for e in range(length - 1, n - 1) if history[e - length + 1 : e + 1] == suffix]
        if ends:
            return history[ends[-1] + 1 :][:depth]
    return []


def chain_cases(deepest: int = 6, largest: int = 12, max_len: int = 20):
    """A breadth-1 recency configuration (the only one the device matcher has; ``max_depth``
    up to ``deepest``, trees of up to ``largest`` nodes), a batch of histories of up to
    ``max_len`` tokens over a small alphabet (so that suffixes repeat), and spare capacity."""

    @st.composite
    def case(draw):
        max_depth = draw(st.integers(1, deepest))
        config = ngram.NgramConfig(
            num_draft_tokens=draw(st.integers(2, largest)),
            max_depth=max_depth,
            min_match=draw(st.integers(1, max_depth)),
            min_breadth=1,
            max_breadth=1,
        )
        alphabet = draw(st.sampled_from([[1, 2], [1, 2, 3], [0, 4, 9, 15]]))
        token_lists = st.lists(st.sampled_from(alphabet), min_size=1, max_size=max_len)
        histories = draw(st.lists(token_lists, min_size=1, max_size=4))
        return config, histories, draw(st.integers(0, 3))

    return case()


def stored(histories: list[list[int]], spare: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, histories)) + spare
    rows = [h + [-1] * (width - len(h)) for h in histories]
    return torch.tensor(rows), torch.tensor([len(h) for h in histories])


def assert_chains_follow_the_rule_and_the_host(config, histories, spare) -> None:
    """For every row: the chain is the reference rule's; the tree is exactly the host's layout
    of that chain (``spec.ngram``'s padding: guess, dead duplicate, fillers); and the host
    matcher's breadth-1 chain starts with it, and equals it whenever the most recent
    occurrence's continuation reaches the depth (or no older occurrence extends it)."""
    history, lengths = stored(histories, spare)
    device = match_chain(history, lengths, config)
    host = ngram.match(history, lengths, config)
    bounds = ngram.tree_bounds(config)
    for row, tokens in enumerate(histories):
        chain = reference_chain(tokens, config)
        count = len(chain)
        assert int(device.num_nodes[row]) == 1 + count
        real = ([tokens[-1], *chain], [-1, *range(count)], list(range(count + 1)))
        laid_out = ngram._pad(*real, config.num_draft_tokens, bounds)
        got = device.tree
        assert got.tokens[row].tolist() == laid_out[0]
        assert got.parents[row].tolist() == laid_out[1]
        assert got.depths[row].tolist() == laid_out[2]
        host_nodes = int(host.num_nodes[row])
        assert host.tree.tokens[row, : count + 1].tolist() == [tokens[-1], *chain]
        assert host_nodes >= count + 1
        if count == bounds[0] or host_nodes == count + 1:
            for field in ("tokens", "parents", "depths"):
                assert getattr(host.tree, field)[row].tolist() == getattr(got, field)[row].tolist()


@settings(max_examples=200)
@given(case=chain_cases())
def test_device_chains_follow_the_rule_pad_as_the_host_and_prefix_its_chains(case):
    assert_chains_follow_the_rule_and_the_host(*case)


def test_a_hand_computed_chain_and_where_the_host_goes_further():
    """``1 2 3 1 2`` matches ``1 2`` at positions 0-1 and drafts ``3 1 2``; the periodic ``1 2
    1 2`` runs out after two tokens, where the host follows an older occurrence."""
    config = ngram.NgramConfig(num_draft_tokens=5, max_depth=3, min_breadth=1, max_breadth=1)
    history, lengths = stored([[1, 2, 3, 1, 2], [5, 1, 2, 1, 2, 1, 2], [7, 8]], 1)
    device = match_chain(history, lengths, config)
    host = ngram.match(history, lengths, config)
    assert device.tree.tokens[0, :4].tolist() == [2, 3, 1, 2]
    assert device.num_nodes.tolist() == [4, 3, 1]
    assert device.tree.tokens[1, :3].tolist() == [2, 1, 2]
    assert host.tree.tokens[1, :4].tolist() == [2, 1, 2, 1]  # the host extends the chain
    # No occurrence: the root token guessed once, then never-accepted duplicates of it.
    assert device.tree.tokens[2].tolist() == [8] * 5
    assert device.tree.parents[2].tolist()[:3] == [-1, 0, 0]


def test_appending_writes_each_row_after_its_length_and_stops_at_the_capacity():
    history = torch.tensor([[1, 2, -1, -1], [3, 4, 5, -1]])
    emitted = torch.tensor([[6, 7, 8], [9, 10, -1]])
    new, lengths = append_tokens(history, torch.tensor([2, 3]), emitted, torch.tensor([2, 2]))
    assert new.tolist() == [[1, 2, 6, 7], [3, 4, 5, 9]]
    assert lengths.tolist() == [4, 4]
    assert history.tolist() == [[1, 2, -1, -1], [3, 4, 5, -1]]  # a new tensor, not a write


# ------------------------------------------------------------------------------ the engine

LIMITS = ("page_size", "max_context", "prefill_budget", "max_batch", "num_pages")


def device_engine(num_draft_tokens=6, overlap=False, **options):
    """An n-gram engine with the device matcher over ``test_ngram``'s Markov target."""
    limits = {"page_size": 4, "max_context": 48} | {
        k: options.pop(k) for k in LIMITS if k in options
    }
    return engine_from_model(
        TARGET,
        algorithm="ngram",
        spec=SpecOptions(num_draft_tokens=num_draft_tokens),
        ngram=NgramOptions(matcher="device", **options),
        overlap=overlap,
        **limits,
    )


def test_the_device_round_is_a_whole_round_and_accepts_deep_chains():
    """No host work (the engine captures and overlaps the whole round); repetitive prompts
    accept several tokens a round."""
    engine = device_engine(num_draft_tokens=8, max_depth=6)
    assert not engine.pipeline.host_work and engine.pipeline.device_round is None
    assert get_pipeline("ngram", matcher="device").decode.keywords["config"].on_device
    assert engine.resources.ngram_store is None
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 7, 3, 9, 7, 7, 3]]
    results = generate(prompts, engine=engine, max_new_tokens=40)
    assert all(r.stats["accept_length_mean"] > 2.0 for r in results)


alphabets = st.sampled_from([[1, 2, 3], [4, 9, 11, 15], list(range(VOCAB))])


@settings(max_examples=25)
@given(
    num_draft_tokens=st.integers(2, 9),
    max_depth=st.integers(1, 6),
    min_match=st.integers(1, 2),
    prompts=alphabets.flatmap(
        lambda a: st.lists(
            st.lists(st.sampled_from(a), min_size=1, max_size=12), min_size=1, max_size=6
        )
    ),
    max_new_tokens=st.integers(1, 14),
    stop_token_ids=st.sets(st.integers(0, VOCAB - 1), max_size=2).map(tuple),
    page_size=st.sampled_from([1, 4]),
    prefill_budget=st.sampled_from([3, 64]),
    max_batch=st.integers(1, 4),
    overlap=st.booleans(),
)
def test_greedy_device_matcher_decoding_equals_plain(
    num_draft_tokens,
    max_depth,
    min_match,
    prompts,
    max_new_tokens,
    stop_token_ids,
    page_size,
    prefill_budget,
    max_batch,
    overlap,
):
    """Token for token and finish reason for finish reason, for every chain length, batch
    mix (requests waiting for batch slots), page size, chunked prefill, overlapped or not,
    and stop tokens or token limits that fire in the middle of a round."""
    limits = {
        "page_size": page_size,
        "max_context": 48,
        "prefill_budget": prefill_budget,
        "max_batch": max_batch,
    }
    engine = device_engine(
        num_draft_tokens,
        overlap,
        max_depth=max_depth,
        min_match=min(min_match, max_depth),
        **limits,
    )
    options = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    results = generate(prompts, engine=engine, **options)
    expected = generate(prompts, engine=engine_from_model(TARGET, **limits), **options)
    assert [(r.token_ids, r.finish_reason) for r in results] == [
        (r.token_ids, r.finish_reason) for r in expected
    ]


def test_seeded_sampling_draws_the_host_matchers_tokens_where_their_chains_agree():
    """Seeded sampled decoding through the device round emits exactly the host round's tokens
    and rounds when both draft the same chains (the same verify, the same counter-based
    coins): on the copy target of ``test_ngram`` the text repeats with period 16, so the
    most recent occurrence always has a full-depth continuation and the host's breadth-1
    chain is the device's."""
    prompts = [[5, 6, 7, 8, 9], [3, 4, 5]]
    options = dict(max_new_tokens=40, temperature=1.0, seed=5)
    common = dict(max_depth=4, min_breadth=1, max_breadth=1)
    results = {}
    for matcher in ("host", "device"):
        store = {"store_tokens": 0} if matcher == "host" else {}
        engine = engine_from_model(
            ShiftModel(),
            algorithm="ngram",
            spec=SpecOptions(num_draft_tokens=5),
            ngram=NgramOptions(matcher=matcher, **common, **store),
            page_size=4,
            max_context=64,
        )
        results[matcher] = generate(prompts, engine=engine, **options)
    ours, expected = results["device"], results["host"]
    assert [r.token_ids for r in ours] == [r.token_ids for r in expected]
    histograms = [r.stats["accept_length_histogram"] for r in ours]
    assert histograms == [r.stats["accept_length_histogram"] for r in expected]
    assert all(sum(h[3:]) >= 3 for h in histograms), "rounds must accept deep chains"


@pytest.mark.parametrize("setting", LAW_SETTINGS)
def test_first_two_tokens_follow_the_target_law(setting):
    """``test_ngram``'s two-token chi-square, through the device round."""
    options = NgramOptions(matcher="device", max_depth=4)
    assert_first_two_tokens_follow_the_target_law(options, 4, setting)


@pytest.mark.parametrize("matcher", ["host", "device"])
def test_a_chunk_without_its_earlier_prompt_tokens_is_refused(matcher):
    """A later chunk's ``prefix_tokens`` must hold every prompt token already in the cache: a
    caller that cuts them short gets the rows named, and the fix."""
    store = {"store_tokens": 0} if matcher == "host" else {}
    engine = engine_from_model(
        TARGET,
        algorithm="ngram",
        spec=SpecOptions(num_draft_tokens=4),
        ngram=NgramOptions(matcher=matcher, **store),
        page_size=4,
        max_context=48,
        prefill_budget=3,
    )
    state, _ = scheduler.add_request(
        engine, scheduler.new_state(engine), [1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=4
    )
    state, _ = scheduler.step(engine, state)  # the first 3 prompt tokens are cached
    chunk, _ = scheduler._prefill_chunk(engine, state.prefilling)
    engine.pipeline.prefill(engine.resources, chunk)  # complete: accepted
    short = replace(chunk, prefix_tokens=chunk.prefix_tokens[:, :2])
    with pytest.raises(ValueError, match=r"prefix_tokens does not hold .* in batch rows \[0\]"):
        engine.pipeline.prefill(engine.resources, short)


@settings(max_examples=6)
@given(steps=st.integers(0, 6), overlap=st.booleans(), seed=st.integers(0, 2**16))
def test_snapshot_restore_replays_sampled_rounds_bit_for_bit(steps, overlap, seed):
    """A snapshot taken after any number of steps (overlapped: with a round in flight) keeps
    the histories by value: running on from it changes nothing it holds, and restoring it
    replays every request's sampled tokens exactly."""
    engine = device_engine(max_depth=4, max_batch=3, overlap=overlap)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [1, 2, 3, 4, 1, 2], [5, 1, 2, 3, 5, 1]]
    state = scheduler.new_state(engine)
    for offset, prompt in enumerate(prompts):
        sampling = scheduler.Sampling(temperature=1.0, top_p=0.95, seed=seed + offset)
        state, _ = scheduler.add_request(
            engine, state, prompt, sampling=sampling, max_new_tokens=20
        )
    for _ in range(steps):
        state, _ = scheduler.step(engine, state)
    snap = scheduler.take_snapshot(engine, state)
    kept = None if snap.state.batch is None else snap.state.batch.history.clone()
    _, first = run_to_completion(engine, state)
    if kept is not None:
        assert torch.equal(snap.state.batch.history, kept)
    _, second = run_to_completion(engine, scheduler.restore(engine, snap))
    assert {r: q.output for r, q in first.items()} == {r: q.output for r, q in second.items()}


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"matcher": "gpu"}, "matcher='gpu' must be one of host, device"),
        ({"matcher": "device", "store_tokens": 1024}, "a shared store (store_tokens > 0)"),
        ({"matcher": "device", "corpus": "corpus.npy"}, "corpus='corpus.npy'"),
        ({"matcher": "device", "max_breadth": 3}, "max_breadth=3"),
        ({"matcher": "device", "order": "frequency"}, "order='frequency'"),
        ({"matcher": "device", "flush_tokens": 4}, "flush_tokens=4"),
    ],
)
def test_settings_the_device_matcher_cannot_read_are_refused(options, named):
    with pytest.raises(ValueError, match="must be one of|does not read") as refused:
        NgramOptions(**options)
    assert named in str(refused.value)
    if options["matcher"] == "device":
        assert "matcher='host'" in str(refused.value)
    # The pipeline constructor refuses the same (a corpus is an index there).
    pipeline_options = {k: v for k, v in options.items() if k not in ("store_tokens", "corpus")}
    if "corpus" in options:
        pipeline_options["corpus"] = ngram.build_corpus_index([[1, 2, 3]])
    if pipeline_options != {"matcher": "device"}:
        with pytest.raises(ValueError, match="must be one of|does not read"):
            get_pipeline("ngram", **pipeline_options)


def test_the_store_defaults_to_off_with_the_device_matcher_and_on_with_the_host_one():
    assert NgramOptions(matcher="device").store_size == 0
    assert NgramOptions().store_size == 1 << 20
    assert NgramOptions(matcher="device", store_tokens=0).store_size == 0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny model folder for the command line and ``speculum.generate``."""
    model = random_model(tiny_config(), seed=1, std=0.3)
    return save_model(model, tmp_path_factory.mktemp("ngram_device") / "model")


def test_vllms_ngram_gpu_method_is_the_device_matcher(folder):
    prompt = [1, 2, 3, 1, 2, 3, 1]
    config = {"method": "ngram_gpu", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    (vllm,) = generate([prompt], model=folder, speculative_config=config, max_new_tokens=12)
    ours = NgramOptions(matcher="device", max_depth=3)
    (expected,) = generate(
        [prompt], model=folder, algorithm="ngram", num_draft_tokens=5, ngram=ours, max_new_tokens=12
    )
    assert vllm.token_ids == expected.token_ids
    assert vllm.stats["accept_length_histogram"] == expected.stats["accept_length_histogram"]


def test_the_command_line_flag_selects_the_device_matcher(folder, capsys):
    common = ["generate", "--model", str(folder), "--prompt-ids", "1,2,3,1,2,3,1", "--json"]
    common += ["--max-new-tokens", "12"]
    assert cli.main(common) == 0
    plain = capsys.readouterr().out
    flags = ["--algorithm", "ngram", "--num-draft-tokens", "5", "--ngram-matcher", "device"]
    assert cli.main(common + flags) == 0
    ours, expected = json.loads(capsys.readouterr().out), json.loads(plain)
    assert ours["token_ids"] == expected["token_ids"]
    assert ours["stats"]["num_rounds"] < expected["stats"]["num_rounds"]
    bad = common + flags + ["--ngram-store-tokens", "64"]
    assert cli.main(bad) != 0
    assert "store_tokens > 0" in capsys.readouterr().err
