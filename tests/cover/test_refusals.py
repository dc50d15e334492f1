"""Bad settings are refused at the door (issue 20): by the records when they are built
(``Sampling``, ``SpecOptions``, ``NgramOptions``, ``EngineConfig``), by ``add_request``, and by
``engine_from_model`` / ``build_engine`` before anything is built, loaded or fused. Each error
is a ``TypeError`` (wrong kind of value) or ``ValueError`` (out of range) naming the setting and
the value, and what was handed in is unchanged. Values that work keep working: numpy and torch
integers, ints for reals, a bare string as one stop string."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.models.loading import random_model
from speculum.models.tokenizer import Tokenizer, byte_level_tokenizer
from speculum.pipelines.adaptive import AdaptivePolicy
from speculum.runtime import scheduler
from speculum.runtime.checks import INT64_MAX, INT64_MIN
from speculum.runtime.engine import (
    EngineConfig,
    NgramOptions,
    SpecOptions,
    build_engine,
    engine_from_model,
)
from speculum.runtime.generate import generate
from speculum.state import tree_equal

MODEL = random_model(tiny_config(), seed=0, std=0.3)
VOCAB = MODEL.config.vocab_size
LIMITS = {"page_size": 4, "max_context": 48}
ENGINE = engine_from_model(MODEL, **LIMITS)


def refused(error: type[Exception], field: str, value: str):
    """``pytest.raises`` for ``error`` whose message begins with ``field=value``."""
    return pytest.raises(error, match="^" + re.escape(f"{field}={value}"))


def float32(x: float) -> float:
    """``x`` rounded to float32 (inf past its range), as the device holds it."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


# ------------------------------------------------------------------------------ Sampling

BAD_SAMPLING = [
    # (setting, value, error, how the message shows the value)
    ("temperature", -1.0, ValueError, "-1.0"),
    ("temperature", math.nan, ValueError, "nan"),
    ("temperature", math.inf, ValueError, "inf"),
    ("temperature", 1e39, ValueError, "1e+39 becomes inf in float32"),
    ("temperature", "0.7", TypeError, "'0.7'"),
    ("temperature", True, TypeError, "True"),
    ("temperature", None, TypeError, "None"),
    ("top_p", 1e-50, ValueError, "1e-50 becomes 0.0 in float32"),
    ("top_p", 0.0, ValueError, "0.0"),
    ("top_p", 1.5, ValueError, "1.5"),
    ("min_p", -0.1, ValueError, "-0.1"),
    ("min_p", 1.01, ValueError, "1.01"),
    ("top_k", 3.9, TypeError, "3.9: must be an integer >= 0"),
    ("top_k", 3.0, TypeError, "3.0"),
    ("top_k", True, TypeError, "True"),
    ("top_k", -1, ValueError, "-1"),
    ("seed", 2**63, ValueError, f"{2**63}: must be an integer in"),
    ("seed", -(2**63) - 1, ValueError, f"{-(2**63) - 1}"),
    ("seed", 1.5, TypeError, "1.5"),
    ("seed", None, TypeError, "None"),
]


@pytest.mark.parametrize(("field", "value", "error", "shown"), BAD_SAMPLING)
def test_bad_sampling_settings_are_refused_when_built(field, value, error, shown):
    with refused(error, field, shown):
        scheduler.Sampling(**{field: value})


def test_sampling_keeps_what_works_as_plain_python_values():
    sampling = scheduler.Sampling(
        temperature=np.float32(0.5), top_k=np.int64(3), top_p=1, min_p=torch.tensor(0.25), seed=-1
    )
    assert sampling == scheduler.Sampling(temperature=0.5, top_k=3, top_p=1.0, min_p=0.25, seed=-1)
    assert type(sampling.top_k) is int and type(sampling.min_p) is float
    assert scheduler.Sampling(seed=INT64_MIN).seed == INT64_MIN
    assert scheduler.Sampling(seed=INT64_MAX).seed == INT64_MAX
    assert scheduler.Sampling(temperature=scheduler.GREEDY_BELOW).temperature == 1e-5


#: Real settings and the range they must lie in, as given and once rounded to float32.
REAL_RANGES = {
    "temperature": lambda x: x >= 0 and math.isfinite(x),
    "top_p": lambda x: 0 < x <= 1,
}


@pytest.mark.parametrize("field", sorted(REAL_RANGES))
@settings(max_examples=200)
@given(value=st.floats(allow_nan=True, allow_infinity=True))
def test_a_real_setting_is_accepted_exactly_when_it_lies_in_its_range_also_in_float32(field, value):
    in_range = REAL_RANGES[field]
    ok = in_range(value) and in_range(float32(value))
    try:
        scheduler.Sampling(**{field: value})
    except ValueError as error:
        assert not ok and str(error).startswith(f"{field}=")
    else:
        assert ok


GREEDY_PROMPTS = [[3, 17, 42, 5], [9] * 7]
GREEDY_TOKENS = [r.token_ids for r in generate(GREEDY_PROMPTS, engine=ENGINE, max_new_tokens=8)]


@settings(max_examples=8)
@given(
    temperature=st.floats(0.0, scheduler.GREEDY_BELOW, exclude_min=True, exclude_max=True),
    seed=st.integers(INT64_MIN, INT64_MAX),
)
def test_a_temperature_below_greedy_below_decodes_exactly_as_greedy(temperature, seed):
    assert scheduler.Sampling(temperature=temperature).temperature == 0.0
    results = generate(
        GREEDY_PROMPTS, engine=ENGINE, max_new_tokens=8, temperature=temperature, seed=seed
    )
    assert [r.token_ids for r in results] == GREEDY_TOKENS


# --------------------------------------------------------------------------- add_request


def busy_state(engine):
    """A state with one request prefilled and decoding: something a refusal could disturb."""
    state, _ = scheduler.add_request(engine, scheduler.new_state(engine), [1, 2], max_new_tokens=3)
    state, _ = scheduler.step(engine, state)
    return state


BAD_REQUESTS = [
    # (add_request's arguments, error, setting, how the message shows the value)
    ({"prompt": [1, 3.9]}, TypeError, "prompt[1]", "3.9"),
    ({"prompt": [True, 2]}, TypeError, "prompt[0]", "True"),
    ({"prompt": "hello"}, TypeError, "prompt", "'hello': add_request takes token ids"),
    ({"prompt": 5}, TypeError, "prompt", "5: must be a sequence of integers"),
    ({"prompt": torch.tensor([1.0, 2.0])}, TypeError, "prompt[0]", "1.0"),
    ({"max_new_tokens": 3.9}, TypeError, "max_new_tokens", "3.9: must be an integer >= 1"),
    ({"max_new_tokens": None}, TypeError, "max_new_tokens", "None"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens", "True"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens", "0: must be an integer >= 1"),
    ({"stop_token_ids": 2}, TypeError, "stop_token_ids", "2: must be a sequence"),
    ({"stop_token_ids": (1.0,)}, TypeError, "stop_token_ids[0]", "1.0"),
    ({"stop_token_ids": (True,)}, TypeError, "stop_token_ids[0]", "True"),
    ({"stop_strings": (1,)}, TypeError, "stop_strings[0]", "1"),
    ({"stop_strings": ("",)}, ValueError, "stop_strings[0]", "''"),
    ({"stop_strings": 3}, TypeError, "stop_strings", "3"),
    ({"sampling": {"temperature": 0.5}}, TypeError, "sampling", "{'temperature': 0.5}"),
    ({"ignore_eos": "no"}, TypeError, "ignore_eos", "'no'"),
]


@pytest.mark.parametrize(("arguments", "error", "field", "shown"), BAD_REQUESTS)
def test_bad_requests_are_refused_and_the_state_is_unchanged(arguments, error, field, shown):
    state = busy_state(ENGINE)
    before = scheduler.take_snapshot(ENGINE, state).state
    arguments = {"prompt": [4, 5], "max_new_tokens": 3} | arguments
    with refused(error, field, shown):
        scheduler.add_request(ENGINE, state, arguments.pop("prompt"), **arguments)
    assert tree_equal(state, before)


@settings(max_examples=50)
@given(st.floats(allow_nan=True, allow_infinity=True) | st.booleans() | st.none())
def test_no_float_bool_or_none_is_taken_for_a_token_count(value):
    state = scheduler.new_state(ENGINE)
    with refused(TypeError, "max_new_tokens", repr(value)):
        scheduler.add_request(ENGINE, state, [1], max_new_tokens=value)
    assert state.waiting == () and state.next_rid == 0


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    state = scheduler.new_state(ENGINE)
    with pytest.raises(ValueError, match=rf"stop_token_ids token ids \[{VOCAB}\] are outside"):
        scheduler.add_request(ENGINE, state, [1], stop_token_ids=(3, VOCAB))
    assert state.waiting == () and state.next_rid == 0


def test_requests_keep_accepting_numpy_and_torch_integers():
    state = scheduler.new_state(ENGINE)
    for prompt in (np.array([4, 5, 6]), torch.tensor([4, 5, 6]), [np.int32(4), torch.tensor(5), 6]):
        state, rid = scheduler.add_request(
            ENGINE, state, prompt, max_new_tokens=np.int64(3), stop_token_ids=[np.int64(7)]
        )
        (request,) = [r for r in state.waiting if r.rid == rid]
        assert request.prompt == (4, 5, 6) and type(request.prompt[0]) is int
        assert request.max_new_tokens == 3 and request.stop_token_ids == frozenset({7})


def test_a_bare_string_is_one_stop_string():
    model = random_model(tiny_config(vocab_size=258), seed=3, std=0.3)
    engine = engine_from_model(model, tokenizer=Tokenizer(byte_level_tokenizer()), **LIMITS)
    state, _ = scheduler.add_request(engine, scheduler.new_state(engine), [72], stop_strings="ab")
    assert state.waiting[0].stop_strings == ("ab",)


def test_generate_refuses_float_token_ids_instead_of_truncating_them():
    with refused(TypeError, "prompt[1]", "2.5"):
        generate([[1, 2.5]], engine=ENGINE, max_new_tokens=2)


# ------------------------------------------------------------------- the engine's limits

BAD_LIMITS = [
    # (engine_from_model's arguments, error, setting, how the message shows the value)
    ({"max_context": 0}, ValueError, "max_context", "0: must be an integer >= 2"),
    ({"max_context": -5}, ValueError, "max_context", "-5"),
    ({"max_context": 32.0}, TypeError, "max_context", "32.0"),
    ({"num_pages": 0}, ValueError, "num_pages", "0: must be an integer >= 2"),
    ({"num_pages": 1}, ValueError, "num_pages", "1"),
    ({"num_pages": 10.5}, TypeError, "num_pages", "10.5"),
    ({"page_size": 0}, ValueError, "page_size", "0: must be an integer >= 1"),
    ({"page_size": True}, TypeError, "page_size", "True"),
    ({"max_batch": 0}, ValueError, "max_batch", "0"),
    ({"max_batch": 2.0}, TypeError, "max_batch", "2.0"),
    ({"prefill_budget": 0}, ValueError, "prefill_budget", "0"),
    ({"prefill_budget": None}, TypeError, "prefill_budget", "None"),
    ({"graph_buckets": ()}, ValueError, "graph_buckets", "()"),
    ({"graph_buckets": (1, 0)}, ValueError, "graph_buckets[1]", "0"),
    ({"graph_buckets": 4}, TypeError, "graph_buckets", "4"),
    ({"cuda_graphs": "no"}, TypeError, "cuda_graphs", "'no'"),
    ({"overlap": 1}, TypeError, "overlap", "1"),
    ({"fuse_projections": None}, TypeError, "fuse_projections", "None"),
    ({"spec": {"num_steps": 3}}, TypeError, "spec", "{'num_steps': 3}"),
    ({"ngram": {}}, TypeError, "ngram", "{}"),
]


@pytest.mark.parametrize(("arguments", "error", "field", "shown"), BAD_LIMITS)
def test_bad_limits_are_refused_before_the_model_is_fused(arguments, error, field, shown):
    model = random_model(tiny_config(), seed=0, std=0.3)
    parameters = list(model.state_dict())
    with refused(error, field, shown):
        engine_from_model(model, **(LIMITS | arguments))
    assert list(model.state_dict()) == parameters  # not fused: the model is as it was


def test_defaults_are_asked_for_with_none_and_numpy_integers_are_accepted():
    engine = engine_from_model(
        MODEL, num_pages=None, max_context=None, max_batch=np.int64(2), graph_buckets=[1, 2]
    )
    assert engine.config.max_context == MODEL.config.max_position_embeddings
    assert engine.config.num_pages > 2 and type(engine.config.max_batch) is int
    assert engine.config.graph_buckets == (1, 2)


def test_engine_config_checks_itself_when_built():
    with refused(ValueError, "max_context", "0"):
        EngineConfig(max_context=0)
    with refused(TypeError, "page_size", "4.0"):
        EngineConfig(page_size=4.0)
    assert EngineConfig().num_pages == 0  # not sized yet: engine_from_model sizes it


def test_build_engine_refuses_bad_limits_before_it_loads_a_model(tmp_path):
    missing = tmp_path / "no-model-here"  # loading it would raise an OSError
    with refused(ValueError, "max_context", "0"):
        build_engine(missing, max_context=0)
    with refused(ValueError, "num_pages", "1"):
        build_engine(missing, num_pages=1)


# ----------------------------------------------------------------- SpecOptions, NgramOptions

BAD_OPTIONS = [
    # (record, its arguments, error, setting, how the message shows the value)
    (SpecOptions, {"num_steps": 0}, ValueError, "num_steps", "0: must be an integer >= 1"),
    (SpecOptions, {"num_steps": 2.0}, TypeError, "num_steps", "2.0"),
    (SpecOptions, {"topk": True}, TypeError, "topk", "True"),
    (SpecOptions, {"num_draft_tokens": 0}, ValueError, "num_draft_tokens", "0"),
    (SpecOptions, {"adaptive_steps": 3}, TypeError, "adaptive_steps", "3"),
    (SpecOptions, {"adaptive_steps": (1, 2.5)}, TypeError, "adaptive_steps[1]", "2.5"),
    (SpecOptions, {"sample_drafts": 1}, TypeError, "sample_drafts", "1"),
    (SpecOptions, {"block_size": 0}, ValueError, "block_size", "0"),
    (SpecOptions, {"verify_budget": -1}, ValueError, "verify_budget", "-1"),
    (SpecOptions, {"verify_budget": 2.5}, TypeError, "verify_budget", "2.5"),
    (SpecOptions, {"min_verify": -1}, ValueError, "min_verify", "-1"),
    (SpecOptions, {"adaptive_policy": {}}, TypeError, "adaptive_policy", "{}"),
    (NgramOptions, {"max_depth": 0}, ValueError, "max_depth", "0"),
    (NgramOptions, {"store_tokens": -1}, ValueError, "store_tokens", "-1"),
    (NgramOptions, {"flush_tokens": 1.5}, TypeError, "flush_tokens", "1.5"),
    (NgramOptions, {"order": 3}, TypeError, "order", "3"),
    (NgramOptions, {"corpus": 3}, TypeError, "corpus", "3"),
    (NgramOptions, {"matcher": 3}, TypeError, "matcher", "3"),
    (NgramOptions, {"matcher": "gpu"}, ValueError, "matcher", "'gpu'"),
]


@pytest.mark.parametrize(("record", "arguments", "error", "field", "shown"), BAD_OPTIONS)
def test_bad_speculation_options_are_refused_when_built(record, arguments, error, field, shown):
    with refused(error, field, shown):
        record(**arguments)


def test_speculation_options_keep_what_works():
    spec = SpecOptions(adaptive_steps=[0, np.int64(2)], num_steps=torch.tensor(2))
    assert spec.adaptive_steps == (0, 2) and spec.num_steps == 2
    assert SpecOptions(verify_budget="auto").verify_budget == "auto"
    assert SpecOptions(adaptive_policy=AdaptivePolicy()).num_draft_tokens is None
    assert NgramOptions(store_tokens=0, corpus=None).store_tokens == 0
