"""Request controls through captured rounds on the GPU: a logit bias changes greedy output, and
every pipeline's captured rounds under it emit plain decoding's biased tokens; rounds with a
JSON schema run as graphs cut at their grammar masks and emit eager constrained decoding's
tokens, which parse and validate."""

from __future__ import annotations

import json

import attrs
import pytest
import tokenizers
import torch
from test_graphs_cuda import PROMPTS, VOCAB, _drafts, _target, _tokens
from tokenizers import decoders, models

from speculum.models.tokenizer import Tokenizer
from speculum.runtime import scheduler
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate

pytestmark = pytest.mark.gpu

#: Bans one token and favours another (both are in the test vocabulary of 96 ids).
BIAS = {5: -100.0, 17: 6.0}


def _biased(target, **options) -> list[tuple[int, ...]]:
    limits = {"page_size": 4, "max_context": 96, "max_batch": 8, "logit_bias": True}
    engine = engine_from_model(target, **(limits | options))
    results = generate(PROMPTS, engine=engine, max_new_tokens=24, logit_bias=BIAS)
    return [r.token_ids for r in results]


@pytest.mark.parametrize("label", ["eagle chain", "eagle3 tree", "ngram"])
def test_captured_rounds_under_a_logit_bias_equal_plain(label):
    target = _target()
    plain = _biased(target, cuda_graphs=False)
    assert plain != [tuple(t) for t in _tokens(target)]  # the bias changes the output
    assert all(5 not in tokens for tokens in plain)
    assert _biased(target) == plain
    algorithm, draft, spec = _drafts(target)[label]
    assert _biased(target, algorithm=algorithm, draft=draft, spec=spec) == plain


#: One printable character per token id but the last, which is EOS (the end of a JSON value).
CHARS = "".join(chr(32 + i) for i in range(VOCAB - 1))
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 23, 456]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _char_tokenizer() -> Tokenizer:
    inner = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    inner.decoder = decoders.Fuse()
    inner.add_special_tokens(["</s>"])
    return Tokenizer(inner)


def _constrained(target, **options):
    """Greedy outputs of every prompt under :data:`SCHEMA`, and the engine's round."""
    limits = {"page_size": 4, "max_context": 96, "max_batch": 8}
    built = engine_from_model(target, **(limits | options))
    built = attrs.evolve(built, tokenizer=_char_tokenizer(), eos_token_ids=(VOCAB - 1,))
    results = generate(PROMPTS, engine=built, max_new_tokens=40, json_schema=SCHEMA)
    return [r.token_ids for r in results], built.pipeline.decode


@pytest.mark.parametrize("label", [None, "eagle chain", "eagle3 tree", "multi_layer_eagle"])
def test_captured_grammar_rounds_equal_eager_constrained_decoding(label):
    """A round with a grammar is captured as graphs cut where it asks for masks (one read of
    its path tokens and one packed copy of the masks per cut) and replays to eager plain
    constrained decoding's tokens, chains and trees, each output valid JSON of the schema."""
    target = _target()
    eager, _ = _constrained(target, cuda_graphs=False)
    for tokens in eager:
        value = json.loads("".join(CHARS[t] for t in tokens if t != VOCAB - 1))
        assert set(value) == {"ok", "n"} and value["n"] in (1, 23, 456)
    options = {}
    if label is not None:
        algorithm, draft, spec = _drafts(target)[label]
        options = {"algorithm": algorithm, "draft": draft, "spec": spec}
    captured, decode = _constrained(target, **options)
    assert captured == eager
    assert any(c.captured.cuts for _, _, c in decode.graphs), "no round was captured with its cuts"


@pytest.mark.parametrize("label", ["eagle chain", "eagle3 tree", "multi_layer_eagle"])
def test_captured_rounds_with_free_drafts_are_cut_once_and_equal_eager(label):
    """With free drafts (``SpecOptions.grammar_drafts="free"``) no draft step asks for masks:
    a captured round is cut once, at its verify, against ``num_steps + 1`` cuts for a chain
    with masked drafts, and emits eager constrained decoding's tokens either way."""
    target = _target()
    eager, _ = _constrained(target, cuda_graphs=False)
    algorithm, draft, spec = _drafts(target)[label]
    free = attrs.evolve(spec, grammar_drafts="free")
    captured, decode = _constrained(target, algorithm=algorithm, draft=draft, spec=free)
    assert captured == eager
    cuts = [len(c.captured.cuts) for _, _, c in decode.graphs]
    assert cuts and set(cuts) == {1}, cuts
    if label == "eagle chain":
        masked, decode = _constrained(target, algorithm=algorithm, draft=draft, spec=spec)
        assert masked == eager
        assert {len(c.captured.cuts) for _, _, c in decode.graphs} == {spec.num_steps + 1}


def test_captured_ngram_grammar_rounds_are_uncut_and_equal_eager():
    """An n-gram round's tree is built on the host, its proposals pruned by the grammar and
    its masks computed with it: the round is one graph with no cut, and emits eager constrained
    decoding's tokens."""
    target = _target()
    eager, _ = _constrained(target, cuda_graphs=False)
    algorithm, draft, spec = _drafts(target)["ngram"]
    captured, decode = _constrained(target, algorithm=algorithm, draft=draft, spec=spec)
    assert captured == eager
    graphs = decode.keywords["device_round"].graphs
    assert graphs and not any(c.captured.cuts for _, _, c in graphs)


def test_masks_copied_from_pinned_memory_equal_the_hosts():
    """On CUDA an ask's masks are written row by row into pinned host memory and copied from
    there: they equal the same ask's on the CPU, rows of the request with the schema masked
    after each path, the rows of a request without a grammar allowing every token."""
    built = engine_from_model(_target(), page_size=4, max_context=96, max_batch=8)
    built = attrs.evolve(built, tokenizer=_char_tokenizer(), eos_token_ids=(VOCAB - 1,))
    brace, quote = CHARS.index("{"), CHARS.index('"')
    paths = torch.tensor([[[-1, -1], [brace, -1], [brace, quote]]] * 2)  # root, "{", '{"'

    def asked(device: str) -> torch.Tensor:
        # New requests each time: each has its own matcher and cache, so xgrammar writes
        # every row afresh into the ask's own host tensor.
        state = scheduler.new_state(built)
        schema = scheduler.Sampling(json_schema=SCHEMA)
        state, _ = scheduler.add_request(built, state, [1, 2], sampling=schema)
        state, _ = scheduler.add_request(built, state, [3])
        return scheduler._bitmasks(state.waiting, (), VOCAB, torch.device(device), paths).cpu()

    on_cuda, on_cpu = asked("cuda"), asked("cpu")
    assert torch.equal(on_cuda, on_cpu)
    assert (on_cuda[1] == -1).all() and not (on_cuda[0] == -1).all()
