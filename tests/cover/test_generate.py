"""Plain decoding through the scheduler: equal to transformers, batch-invariant, stops, errors."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest
import torch
import transformers
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.models.loading import load_model, random_model
from speculum.models.tokenizer import Tokenizer, byte_level_tokenizer, load_tokenizer
from speculum.runtime import scheduler
from speculum.runtime.default_model import default_model_dir
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import IncrementalText, generate, run_to_completion
from speculum.state import KVPoolExhausted, tree_equal
from speculum.state.kv import allocated_pages


def hf_model(arch: str, tmp_path, **extra):
    """A random transformers model with peaked logits, saved to and loaded from ``tmp_path``."""
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize(
    ("arch", "extra"),
    [("Llama", {}), ("Qwen2", {}), ("Qwen3", {"head_dim": 16}), ("Mistral", {})],
)
def test_greedy_generate_equals_transformers(arch, extra, tmp_path):
    hf = hf_model(arch, tmp_path, **extra)
    ours = load_model(tmp_path)
    prompts = [[3, 17, 42, 5], [9] * 11, [1, 2]]
    engine = engine_from_model(ours, page_size=4, max_context=64, prefill_budget=7)
    results = generate(prompts, engine=engine, max_new_tokens=16, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0
        )[0, len(prompt) :]
        assert list(result.token_ids) == expected.tolist()


def _sampling(draw_temperature: float, seed: int) -> scheduler.Sampling:
    if draw_temperature == 0:
        return scheduler.Sampling(seed=seed)
    return scheduler.Sampling(temperature=draw_temperature, top_k=20, top_p=0.9, seed=seed)


request_strategy = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(0, 63), min_size=1, max_size=20),
        "max_new_tokens": st.integers(1, 8),
        "arrival": st.integers(0, 6),
        "temperature": st.sampled_from([0.0, 0.7, 1.3]),
        "seed": st.integers(0, 2**40),
    }
)


def _run_alone(model, request, **limits) -> tuple[int, ...]:
    engine = engine_from_model(model, **limits)
    state, _ = scheduler.add_request(
        engine,
        scheduler.new_state(engine),
        request["prompt"],
        sampling=_sampling(request["temperature"], request["seed"]),
        max_new_tokens=request["max_new_tokens"],
    )
    _, finished = run_to_completion(engine, state)
    (done,) = finished.values()
    return done.output


@settings(max_examples=6)
@given(
    requests=st.lists(request_strategy, min_size=8, max_size=8),
    page_size=st.sampled_from([1, 3, 16]),
    prefill_budget=st.sampled_from([4, 64]),
    max_batch=st.sampled_from([3, 8]),
)
def test_each_request_in_a_batch_yields_what_it_yields_alone(
    tiny_model, requests, page_size, prefill_budget, max_batch
):
    limits = {"page_size": page_size, "max_context": 48, "prefill_budget": prefill_budget}
    engine = engine_from_model(tiny_model, max_batch=max_batch, **limits)
    state, rids, finished = scheduler.new_state(engine), {}, {}
    pending = sorted(enumerate(requests), key=lambda item: item[1]["arrival"])
    while pending or not scheduler.is_idle(state):
        while pending and pending[0][1]["arrival"] <= state.num_steps:
            index, request = pending.pop(0)
            state, rids[index] = scheduler.add_request(
                engine,
                state,
                request["prompt"],
                sampling=_sampling(request["temperature"], request["seed"]),
                max_new_tokens=request["max_new_tokens"],
            )
        state, outputs = scheduler.step(engine, state)
        finished.update((o.rid, o.request.output) for o in outputs if o.finished)
    for index, request in enumerate(requests):
        alone = _run_alone(tiny_model, request, max_batch=1, **limits)
        assert finished[rids[index]] == alone
        assert len(alone) == request["max_new_tokens"]


def _engine(model, **limits):
    return engine_from_model(model, **({"page_size": 4, "max_context": 48} | limits))


def test_stop_token_ids_end_the_request_with_that_token(tiny_model):
    (free_run,) = generate([[5, 6, 7]], engine=_engine(tiny_model), max_new_tokens=12)
    stop = free_run.token_ids[4]
    first = free_run.token_ids.index(stop)
    (stopped,) = generate(
        [[5, 6, 7]], engine=_engine(tiny_model), max_new_tokens=12, stop_token_ids=(stop,)
    )
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_eos_from_the_config_stops_unless_ignored(tiny_model):
    (free_run,) = generate([[5, 6, 7]], engine=_engine(tiny_model), max_new_tokens=12)
    eos = free_run.token_ids[3]
    with_eos = attrs.evolve(tiny_model.config, eos_token_ids=(eos,))
    model = random_model(with_eos, seed=0, std=0.3)
    (stopped,) = generate([[5, 6, 7]], engine=_engine(model), max_new_tokens=12)
    assert stopped.token_ids[-1] == eos and stopped.finish_reason == "stop"
    (ignored,) = generate([[5, 6, 7]], engine=_engine(model), max_new_tokens=12, ignore_eos=True)
    assert ignored.token_ids == free_run.token_ids


def test_stop_strings_end_the_request_when_the_text_contains_them():
    model = random_model(tiny_config(vocab_size=258), seed=3, std=0.3)
    tokenizer = Tokenizer(byte_level_tokenizer())
    engine = engine_from_model(model, tokenizer=tokenizer, page_size=4, max_context=64)
    (free_run,) = generate([[72, 105]], engine=engine, max_new_tokens=24)
    text = tokenizer.decode(free_run.token_ids)
    needle = text[5:7]
    assert len(needle) == 2
    (stopped,) = generate([[72, 105]], engine=engine, max_new_tokens=24, stop_strings=(needle,))
    assert stopped.finish_reason == "stop"
    assert needle in tokenizer.decode(stopped.token_ids)
    assert needle not in tokenizer.decode(stopped.token_ids[:-1])
    assert stopped.token_ids == free_run.token_ids[: len(stopped.token_ids)]


def _completes_stop_string_reference(tokenizer, output, stop_strings):
    """The stop-string check on the whole output's text (what the windowed one must equal)."""
    tail = max(map(len, stop_strings)) + 16
    text, previous = tokenizer.decode(output), tokenizer.decode(output[:-1])
    return any(s in text[max(0, len(previous) - tail) :] for s in stop_strings)


TOKENIZERS = {
    "bundled BPE": load_tokenizer(default_model_dir()),
    "bytes": Tokenizer(byte_level_tokenizer()),
}


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(TOKENIZERS)),
    data=st.data(),
)
def test_the_stop_string_check_reads_the_whole_outputs_text(name, data):
    """Windowed over the output's last tokens, the stop-string check decides as one over the
    whole output's text, at every length: with characters cut across byte tokens, runs of
    special tokens (which decode to nothing) and stop strings taken from the text itself."""
    tokenizer = TOKENIZERS[name]
    ids = st.integers(0, tokenizer.vocab_size - 1)
    output = data.draw(st.lists(ids, min_size=1, max_size=160))
    text = tokenizer.decode(output)
    start = data.draw(st.integers(0, len(text)))
    found = text[start : start + data.draw(st.integers(1, 12))]
    stops = [s for s in (found, data.draw(st.text(min_size=1, max_size=3))) if s]
    for end in range(1, len(output) + 1):
        assert scheduler.completes_stop_string(
            tokenizer, output[:end], stops
        ) == _completes_stop_string_reference(tokenizer, output[:end], stops)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(TOKENIZERS)), data=st.data())
def test_streamed_text_is_the_whole_outputs_text_at_every_step(name, data):
    """Decoded a few tokens at a time, a streamed request's text is, after every step, what
    decoding all its tokens gives: with characters cut across byte tokens, special tokens
    (which decode to nothing) and steps of any number of tokens."""
    tokenizer = TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=80))
    text, done = IncrementalText(), 0
    while done < len(ids):
        step = data.draw(st.integers(1, 5))
        assert text.extend(tokenizer, ids[done : done + step]) == tokenizer.decode(
            ids[: done + step]
        )
        done += step


def test_streamed_text_decodes_only_the_newest_tokens():
    """Once the text ends on a whole character, a step decodes only its own tokens and the
    step's before (here ASCII bytes, each a character), however long the output grows."""
    tokenizer, widths = TOKENIZERS["bytes"], []
    counting = SimpleNamespace(decode=lambda ids: widths.append(len(ids)) or tokenizer.decode(ids))
    text, ids = IncrementalText(), [ord(c) for c in "def f(x):\n    return x * 2\n" * 20]
    for done in range(0, len(ids), 3):
        assert text.extend(counting, ids[done : done + 3]) == tokenizer.decode(ids[: done + 3])
    assert max(widths) <= 6


def test_the_context_limit_ends_a_request(tiny_model):
    engine = _engine(tiny_model, max_context=20)
    (result,) = generate([list(range(15))], engine=engine, max_new_tokens=50)
    assert len(result.token_ids) == 5 and result.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([], "empty"),
        ([1, 64], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
        (list(range(48)), "no room in the context"),
    ],
)
def test_bad_prompts_are_refused_and_the_state_is_unchanged(tiny_model, prompt, match):
    engine = _engine(tiny_model)
    state, _ = scheduler.add_request(engine, scheduler.new_state(engine), [1, 2], max_new_tokens=3)
    state, _ = scheduler.step(engine, state)
    before = scheduler.take_snapshot(engine, state).state
    with pytest.raises(ValueError, match=match):
        scheduler.add_request(engine, state, prompt, max_new_tokens=3)
    assert tree_equal(state, before)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "min_p": 1.5}, "min_p"),
        ({"temperature": 1.0, "top_k": -2}, "top_k"),
    ],
)
def test_bad_sampling_settings_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        scheduler.Sampling(**options)


def test_kv_exhaustion_makes_requests_wait_without_touching_running_ones(tiny_model):
    # 7 usable pages of 4 tokens: each request below needs 3 (8 + 3 tokens + 1 lookahead).
    engine = _engine(tiny_model, num_pages=8)
    state = scheduler.new_state(engine)
    rids = []
    for first in range(4):
        state, rid = scheduler.add_request(engine, state, [first + 1] * 8, max_new_tokens=3)
        rids.append(rid)
    state, _ = scheduler.step(engine, state)
    assert [r.rid for r in state.prefilling + state.running] == rids[:2]
    assert [r.rid for r in state.waiting] == rids[2:]
    _, finished = run_to_completion(engine, state)
    for rid, first in zip(rids, range(4)):
        alone = generate([[first + 1] * 8], engine=_engine(tiny_model), max_new_tokens=3)
        assert finished[rid].output == alone[0].token_ids


def test_a_request_that_can_never_fit_is_refused(tiny_model):
    engine = _engine(tiny_model, num_pages=4)
    state = scheduler.new_state(engine)
    with pytest.raises(KVPoolExhausted, match="needs 5 KV pages but the pool has only 3"):
        scheduler.add_request(engine, state, [1] * 10, max_new_tokens=8)
    assert scheduler.is_idle(state)


def test_cancel_frees_pages_and_leaves_the_others_untouched(tiny_model):
    engine = _engine(tiny_model)
    state = scheduler.new_state(engine)
    state, keep = scheduler.add_request(engine, state, [4, 5, 6], max_new_tokens=6)
    state, drop = scheduler.add_request(engine, state, [7, 8], max_new_tokens=6)
    state, _ = scheduler.step(engine, state)
    state, _ = scheduler.step(engine, state)
    held_before = allocated_pages(state.allocator)
    dropped_pages = set(next(r for r in state.running if r.rid == drop).pages)
    state = scheduler.cancel(engine, state, drop)
    assert allocated_pages(state.allocator) == held_before - dropped_pages
    with pytest.raises(KeyError, match=str(drop)):
        scheduler.cancel(engine, state, drop)
    _, finished = run_to_completion(engine, state)
    (alone,) = generate([[4, 5, 6]], engine=_engine(tiny_model), max_new_tokens=6)
    assert finished[keep].output == alone.token_ids


def test_snapshot_restore_replays_sampled_decoding_even_after_pages_are_reused(tiny_model):
    """Restoring must bring back KV pages that were freed and overwritten after the snapshot."""
    engine = _engine(tiny_model, num_pages=7)
    sampling = scheduler.Sampling(temperature=1.0, top_k=30, seed=1234)
    state = scheduler.new_state(engine)
    state, rid = scheduler.add_request(
        engine, state, [3, 1, 4, 1, 5], sampling=sampling, max_new_tokens=10
    )
    for _ in range(3):
        state, _ = scheduler.step(engine, state)
    snap = scheduler.take_snapshot(engine, state)
    _, finished = run_to_completion(engine, state)
    original = finished[rid].output

    # Back to the snapshot (the run above stepped the engine on), cancel the request, and let
    # another request take (and overwrite) the same pages.
    state = scheduler.cancel(engine, scheduler.restore(engine, snap), rid)
    state, _ = scheduler.add_request(engine, state, [9] * 12, max_new_tokens=9)
    state, _ = run_to_completion(engine, state)

    restored = scheduler.restore(engine, snap)
    assert tree_equal(restored, snap.state)
    _, finished = run_to_completion(engine, restored)
    assert finished[rid].output == original
