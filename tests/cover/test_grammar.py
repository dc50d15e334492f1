"""Structured output under speculation (issue 25, item 5): a request's JSON schema, regex or
EBNF grammar masks every distribution that decides one of its tokens, at every tree node
after the node's path, so every pipeline, chains, trees and adaptive, emits plain constrained
decoding's tokens (greedy) and only outputs the grammar accepts (sampled too), whether the
drafts are masked too or free (``SpecOptions.grammar_drafts``: then a round asks the host for
masks once); JSON-schema
outputs parse and validate; a bad schema or regex is refused naming the field, the state
unchanged; the command line takes ``--json-schema``, ``--regex`` and ``--grammar``."""

from __future__ import annotations

import json

import attrs
import pytest
import tokenizers
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli import parse_one_object, run_cli
from test_eagle import VOCAB
from test_overlap import PIPELINES, engine
from tokenizers import decoders, models

from speculum.models.draft import random_draft
from speculum.models.loading import random_model
from speculum.models.tokenizer import Tokenizer, byte_level_tokenizer
from speculum.runtime import scheduler
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.sampling import unpack_bitmask

pytest.importorskip("xgrammar")

#: The Markov target's 16 tokens as characters (EOS is the last): enough for JSON arrays of
#: integers, arithmetic and short words.
CHARS = "0123456789[],-ab"
EOS = VOCAB - 1


def char_tokenizer(chars: str = CHARS[:EOS]) -> Tokenizer:
    """One token per character of ``chars`` (by default :data:`CHARS` but the last), then
    EOS."""
    vocab = {c: i for i, c in enumerate(chars)}
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.decoder = decoders.Fuse()
    inner.add_special_tokens(["</s>"])
    assert inner.token_to_id("</s>") == len(chars)
    return Tokenizer(inner)


def grammar_engine(name: str, overlap: bool = False, drafts: str = "masked", **limits):
    """Pipeline ``name`` of ``test_overlap`` over the Markov target, with the character
    tokenizer and EOS (the target itself declares none), overlapped or not, its drafts
    masked by the grammar or free (``SpecOptions.grammar_drafts``)."""
    built = engine(name, overlap, spec_options={"grammar_drafts": drafts}, **limits)
    return attrs.evolve(built, tokenizer=char_tokenizer(), eos_token_ids=(EOS,))


def text(token_ids) -> str:
    return "".join(CHARS[t] for t in token_ids if t != EOS)


SCHEMA = {"type": "array", "items": {"enum": [1, 23, -4]}, "minItems": 1, "maxItems": 3}
#: One of each kind, each bounded so that greedy outputs end within 16 tokens.
GRAMMARS = [
    {"json_schema": SCHEMA},
    {"regex": "(1|22|-3)(,[0-9]{1,2}){0,4}"},
    {"grammar": 'root ::= "[" item ("," item)? ("," item)? "]"\nitem ::= [0-9] | "a" [0-9] "b"'},
]
PROMPTS = [[1, 2, 3], [5], [9, 4, 12, 0, 7], [3, 3, 3]]


def constrained(prompts, grammars):
    return [{"prompt_ids": p, **g} for p, g in zip(prompts, grammars)]


@pytest.fixture(scope="module")
def plain_outputs():
    """Greedy plain constrained decoding of every prompt under every grammar."""
    mix = constrained(PROMPTS * len(GRAMMARS), [g for g in GRAMMARS for _ in PROMPTS])
    return generate(mix, engine=grammar_engine("plain"), max_new_tokens=16)


def test_plain_constrained_outputs_follow_their_grammar(plain_outputs):
    import re

    for index, result in enumerate(plain_outputs):
        kind = GRAMMARS[index // len(PROMPTS)]
        assert result.finish_reason == "stop" and result.token_ids[-1] == EOS, result
        if "json_schema" in kind:
            value = json.loads(text(result.token_ids))
            assert 1 <= len(value) <= 3 and set(value) <= {1, 23, -4}
        elif "regex" in kind:
            assert re.fullmatch(kind["regex"], text(result.token_ids))
        else:
            assert re.fullmatch(r"\[(a?[0-9]b?)(,a?[0-9]b?){0,2}\]", text(result.token_ids))


#: What the grammar masks: the drafts too, or the target alone (``SpecOptions.grammar_drafts``).
DRAFTS = ["masked", "free"]


@pytest.mark.parametrize("drafts", DRAFTS)
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_pipeline_emits_plain_constrained_decodings_tokens(name, drafts, plain_outputs):
    mix = constrained(PROMPTS * len(GRAMMARS), [g for g in GRAMMARS for _ in PROMPTS])
    results = generate(mix, engine=grammar_engine(name, drafts=drafts), max_new_tokens=16)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain_outputs]


@pytest.mark.parametrize("drafts", DRAFTS)
@pytest.mark.parametrize(
    "name",
    ["plain", "eagle chain", "eagle tree", "multi_layer_eagle", "dflash", "ngram", "ngram device"],
)
def test_overlapped_engines_emit_plain_constrained_decodings_tokens(name, drafts, plain_outputs):
    """Overlapped, a round is launched before the host has read the previous one's tokens:
    its masks follow them anyway (read from the launch in flight), chains and trees alike."""
    mix = constrained(PROMPTS * len(GRAMMARS), [g for g in GRAMMARS for _ in PROMPTS])
    built = grammar_engine(name, overlap=True, drafts=drafts)
    results = generate(mix, engine=built, max_new_tokens=16)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain_outputs]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in plain_outputs]


@pytest.mark.parametrize("drafts", DRAFTS)
@pytest.mark.parametrize("name", ["eagle tree", "multi_layer_eagle", "dflash", "dspark ragged"])
def test_penalties_and_a_grammar_together_decode_as_plain_decoding(name, drafts, plain_outputs):
    """Free drafts drop the grammar alone from the drafts: their penalties still count the
    path, and with the grammar on the target the output is plain decoding's."""
    mix = constrained(PROMPTS * len(GRAMMARS), [g for g in GRAMMARS for _ in PROMPTS])
    mix = [m | {"repetition_penalty": 1.5, "presence_penalty": 0.5} for m in mix]
    plain = generate(mix, engine=grammar_engine("plain", penalties=True), max_new_tokens=16)
    assert [r.token_ids for r in plain] != [r.token_ids for r in plain_outputs]  # they bite
    built = grammar_engine(name, drafts=drafts, penalties=True)
    results = generate(mix, engine=built, max_new_tokens=16)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]


@pytest.mark.parametrize(
    "name, drafts",
    [(n, "masked") for n in ["eagle tree", "dflash", "ngram", "ngram device"]]
    + [("eagle tree", "free"), ("dflash", "free")],
)
@settings(max_examples=3, deadline=None)
@given(data=st.data(), prefill_budget=st.integers(2, 8))
def test_any_mix_of_constrained_and_free_requests_decodes_as_plain_decoding(
    name, drafts, data, prefill_budget
):
    """Greedy, requests with and without a grammar in one batch, prompts prefilled in chunks:
    every request gets plain decoding's tokens and finish reason."""
    prompts = data.draw(
        st.lists(st.lists(st.integers(0, EOS - 1), min_size=1, max_size=6), min_size=1, max_size=4)
    )
    kinds = [data.draw(st.sampled_from([{}, *GRAMMARS])) for _ in prompts]
    mix = constrained(prompts, kinds)
    plain = generate(mix, engine=grammar_engine("plain"), max_new_tokens=12)
    built = grammar_engine(name, drafts=drafts, prefill_budget=prefill_budget)
    results = generate(mix, engine=built, max_new_tokens=12)
    outcome = [(r.token_ids, r.finish_reason) for r in results]
    assert outcome == [(r.token_ids, r.finish_reason) for r in plain]


@pytest.mark.parametrize(
    "name, drafts",
    [("plain", "masked"), ("eagle tree", "masked"), ("eagle3 sampled drafts", "masked")]
    + [("eagle tree", "free"), ("eagle3 sampled drafts", "free"), ("dflash", "free")],
)
def test_sampled_constrained_outputs_always_validate(name, drafts):
    """Seeded sampling at temperature 1 (the target then often prefers a forbidden token):
    every output is a JSON array of the schema's items, ended by EOS."""
    prompts = [{"prompt_ids": [s % EOS], "seed": s, "json_schema": SCHEMA} for s in range(12)]
    built = grammar_engine(name, drafts=drafts)
    results = generate(prompts, engine=built, temperature=1.0, max_new_tokens=16)
    for result in results:
        value = json.loads(text(result.token_ids))
        assert 1 <= len(value) <= 3 and set(value) <= {1, 23, -4}, result.token_ids


def test_a_byte_level_model_writes_json_its_schema_validates():
    """The default model's kind (byte-level tokenizer, EOS 257), plain and an EAGLE-3 tree:
    the same greedy object, which parses and validates."""
    config = tiny_config(vocab_size=258, eos_token_ids=(257,))
    target = random_model(config, seed=3, std=0.3)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    tokenizer = Tokenizer(byte_level_tokenizer())
    plain = engine_from_model(target, tokenizer=tokenizer, page_size=4, max_context=64)
    tree = engine_from_model(
        target,
        algorithm="eagle3",
        draft=random_draft(target, "eagle3", seed=2, std=0.3),
        spec=SpecOptions(num_steps=3, topk=2, num_draft_tokens=6),
        tokenizer=tokenizer,
        page_size=4,
        max_context=64,
    )
    options = {"json_schema": json.dumps(schema), "max_new_tokens": 40}
    (expected,) = generate(["Answer: "], engine=plain, **options)
    (result,) = generate(["Answer: "], engine=tree, **options)
    assert result.token_ids == expected.token_ids
    value = json.loads(result.text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)


@pytest.mark.parametrize(
    ("setting", "error", "words"),
    [
        ({"json_schema": '{"type": 5}'}, ValueError, ["json_schema=", "not a valid JSON schema"]),
        ({"json_schema": "{not json"}, ValueError, ["json_schema=", "JSON schema"]),
        ({"json_schema": 5}, TypeError, ["json_schema=5", "a JSON string or a dict"]),
        ({"regex": "a(b"}, ValueError, ["regex='a(b'", "not a valid regular expression"]),
        ({"grammar": "root ::= x"}, ValueError, ["grammar=", "not a valid EBNF grammar"]),
        ({"regex": "a", "grammar": 'root ::= "a"'}, ValueError, ["regex and grammar", "one"]),
    ],
)
def test_bad_grammars_are_refused_naming_the_field(setting, error, words):
    with pytest.raises(error) as raised:
        scheduler.Sampling(**setting)
    assert all(w in str(raised.value) for w in words), raised.value


def test_refused_requests_leave_the_state_unchanged():
    """An engine without a tokenizer cannot compile a grammar: ``add_request`` refuses,
    naming the field and the cause, and the state handed in stays as it was."""
    bare = attrs.evolve(engine("plain", False), eos_token_ids=(EOS,))
    state = scheduler.new_state(bare)
    with pytest.raises(ValueError, match="regex: .*tokenizer"):
        scheduler.add_request(bare, state, [1], sampling=scheduler.Sampling(regex="[0-9]"))
    assert state.waiting == () and state.next_rid == 0


def test_a_constrained_round_asks_the_grammar_along_every_tree_path():
    """The round's masks are the grammar's after each node's path: a tree of two branches
    under the root, ``1`` then ``2`` and ``-``, gets three different rows; a request without
    a grammar in the same batch gets rows that allow every token."""
    built = grammar_engine("plain")
    state = scheduler.new_state(built)
    sampling = scheduler.Sampling(regex="1(2|-3)")
    state, rid = scheduler.add_request(built, state, [1], sampling=sampling)
    state, _ = scheduler.add_request(built, state, [2])
    request, free = state.waiting
    paths = torch.tensor([[[-1, -1], [1, -1], [1, 2]]] * 2)  # root, "1", "12"
    packed = scheduler._bitmasks((request, free), (), VOCAB, torch.device("cpu"), paths)
    assert packed.dtype == torch.int32 and packed.shape == (2, 3, 1)  # 16 tokens: one word
    allowed = unpack_bitmask(packed, VOCAB)
    assert allowed[0, 0].nonzero().flatten().tolist() == [1]
    assert allowed[0, 1].nonzero().flatten().tolist() == [2, 13]  # "2" or "-"
    assert allowed[0, 2].nonzero().flatten().tolist() == [EOS]
    assert (packed[1] == -1).all()


def test_the_command_line_takes_grammar_flags(capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}))
    common = ["--prompt", "Answer:", "--algorithm", "plain", "--max-new-tokens", "24", "--json"]
    status, out, _ = run_cli(capsys, *common, "--json-schema", str(schema))
    assert status == 0
    value = json.loads(parse_one_object(out)["text"])
    assert isinstance(value, dict) and set(value) <= {"ok"}
    status, out, _ = run_cli(capsys, *common, "--regex", "(yes|no)")
    plain = parse_one_object(out)["text"]
    assert status == 0 and plain in ("yes", "no")
    for flag, bad, words in [
        ("--json-schema", str(tmp_path / "missing.json"), "No such file"),
        ("--regex", "a(b", "not a valid regular expression"),
        ("--grammar", str(schema), "not a valid EBNF grammar"),
    ]:
        status, out, err = run_cli(capsys, *common, flag, bad)
        assert status == 2 and out == "" and flag in err and words in err, err
    # The bundled EAGLE-3 pipeline, drafts masked or free: the same text as plain decoding.
    drafted = [*common[:2], "--algorithm", "eagle3", *common[4:], "--regex", "(yes|no)"]
    for drafts in DRAFTS:
        status, out, _ = run_cli(capsys, *drafted, "--grammar-drafts", drafts)
        assert status == 0 and parse_one_object(out)["text"] == plain
    for flags, words in [
        (["--grammar-drafts", "loose"], "invalid choice: 'loose'"),
        (["--regex", "(yes|no)", "--grammar-drafts", "free"], "--grammar-drafts"),  # plain
    ]:
        status, out, err = run_cli(capsys, *common, *flags)
        assert status == 2 and out == "" and words in err, err


def _legal(compiled, tokens) -> bool:
    """Whether the grammar accepts ``tokens`` one by one, up to its end or a dead end (tokens
    after the grammar's EOS are never emitted, and where the grammar allows no token of the
    vocabulary, "a4" wanting a "b" the character tokenizer lacks, nothing can be chosen)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)
    for token in tokens:
        if matcher.is_terminated():
            return True
        matcher.fill_next_token_bitmask(bitmask)
        if not unpack_bitmask(bitmask, VOCAB).any():
            return True
        if not matcher.accept_token(token):
            return False
    return True


@pytest.mark.parametrize(
    "name, temperature",
    [
        ("eagle chain", 0.0),
        ("mtp", 0.0),
        ("multi_layer_eagle", 0.0),
        ("dflash", 0.0),
        ("eagle3 sampled drafts", 1.0),
    ],
)
def test_drafts_are_masked_by_the_grammar_along_their_path(name, temperature, monkeypatch):
    """Every path a round asks the grammar about (the drafted chains, each node's prefix) is
    one the grammar allows: drafts are masked before they are chosen, so a chain never
    proposes a token its target must reject for the grammar's sake."""
    from speculum.runtime import grammar as structured

    asked = []
    fill = structured.fill_bitmasks

    def recording(asks, bitmask):
        asked.extend((c.compiled, output) for c, output, _ in asks)
        fill(asks, bitmask)

    monkeypatch.setattr(structured, "fill_bitmasks", recording)
    mix = constrained(PROMPTS * len(GRAMMARS), [g for g in GRAMMARS for _ in PROMPTS])
    generate(mix, engine=grammar_engine(name), temperature=temperature, max_new_tokens=16)
    drafted = [output for _, output in asked if len(output) > 1]
    assert drafted, "no round asked about a drafted path"
    illegal = [output for compiled, output in asked if not _legal(compiled, output)]
    assert illegal == []


def test_packed_masks_mask_exactly_as_xgrammars_dense_application():
    """The packed int32 rows the scheduler copies, unpacked on the device, forbid exactly the
    tokens xgrammar's own mask application does, over a vocabulary that is not a multiple of
    32 (the last word's spare bits ignored)."""
    import xgrammar

    from speculum.runtime import grammar as structured
    from speculum.spec.sampling import grammar_logits

    vocab, words = 70, structured.words(70)
    info = xgrammar.TokenizerInfo([str(i % 10).encode() for i in range(vocab)], vocab_size=vocab)
    compiled = xgrammar.GrammarCompiler(info).compile_regex("[0-4]{2}[5-9]")
    c = structured.Constraint(field="regex", compiled=compiled, vocab=vocab)
    outputs = [(), (1,), (1, 12), (1, 12, 5), (7,)]  # ids: digit = id % 10; (7,) leaves it
    packed = torch.zeros(len(outputs), words, dtype=torch.int32)
    for i, output in enumerate(outputs):
        structured.fill_bitmask(c, output, packed, i)
    logits = torch.randn(len(outputs), vocab, generator=torch.Generator().manual_seed(0))
    masked = grammar_logits(logits[:, None], lambda paths: packed[:, None])[:, 0]
    dense = logits.clone()
    xgrammar.apply_token_bitmask_inplace(dense, packed)
    assert torch.equal(masked, dense)
    assert unpack_bitmask(packed, vocab)[4].all()  # no mask after a token the grammar forbids
    allowed = unpack_bitmask(packed, vocab)[0].nonzero().flatten().tolist()
    assert allowed == [i for i in range(vocab) if i % 10 <= 4]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batchs_masks_take_one_xgrammar_call_per_wave(threads, monkeypatch):
    """The rows of one ask over a batch are filled together: each batched xgrammar call takes
    at most one uncached sequence per request, so the calls number the most any request
    needs, not the rows. Every row equals the mask of its sequence asked alone, filled in
    turn or on threads; repeats are copied, dead paths allow everything."""
    import xgrammar

    from speculum.runtime import grammar as structured

    monkeypatch.setattr(structured, "FILL_THREADS", threads)

    vocab, words = 70, structured.words(70)
    info = xgrammar.TokenizerInfo([str(i % 10).encode() for i in range(vocab)], vocab_size=vocab)
    compiled = xgrammar.GrammarCompiler(info).compile_regex("[0-4]{2}[5-9]")

    def fresh() -> structured.Constraint:
        return structured.Constraint(field="regex", compiled=compiled, vocab=vocab)

    a, b = fresh(), fresh()
    # a: three sequences to compute (one repeated), b: one, and one it refuses (7: not 0-4).
    asked = [(a, ()), (b, (2,)), (a, (1,)), (b, (7,)), (a, (1,)), (a, (1, 12)), (b, (2,))]
    waves = []
    batch_fill = xgrammar.BatchGrammarMatcher.batch_fill_next_token_bitmask

    def counting(self, matchers, *args, **kwargs):
        waves.append(len(matchers))
        return batch_fill(self, matchers, *args, **kwargs)

    monkeypatch.setattr(xgrammar.BatchGrammarMatcher, "batch_fill_next_token_bitmask", counting)
    packed = torch.zeros(len(asked), words, dtype=torch.int32)
    structured.fill_bitmasks([(c, output, i) for i, (c, output) in enumerate(asked)], packed)
    assert waves == [2, 1, 1]  # a's (), b's (2,); a's (1,); a's (1, 12)
    assert (a.cache.computed, b.cache.computed) == (3, 1)
    alone = torch.zeros(len(asked), words, dtype=torch.int32)
    for i, (_, output) in enumerate(asked):
        structured.fill_bitmask(fresh(), output, alone, i)
    assert torch.equal(packed, alone)
    assert (packed[3] == -1).all()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.lists(st.integers(0, 3), max_size=8),
    st.lists(st.integers(0, 3), max_size=8),
)
def test_a_matcher_walks_back_exactly_to_where_a_path_parts(common, left, right):
    """The cached matcher rolls back to the longest prefix its tokens share with the sequence
    asked about, found by comparing slices: the same count as comparing token by token."""
    from speculum.runtime.grammar import _common_prefix

    a, b = tuple(common + left), tuple(common + right)
    expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert _common_prefix(a, b) == expected == _common_prefix(b, a)


def test_a_mask_cut_pads_the_rounds_masks_to_the_bucket():
    """Eagerly (warm-up, and at a replay's cuts) the captured round's grammar callback asks
    the round's own for its real rows and allows every token on the padding rows."""
    from speculum.runtime.graphs import MaskCut

    cut = MaskCut(fill=lambda paths: torch.zeros(*paths.shape[:-1], 3, dtype=torch.int32), rows=2)
    masks = cut(torch.full((4, 5, 2), -1))
    assert masks.shape == (4, 5, 3) and cut.words == 3
    assert (masks[:2] == 0).all() and (masks[2:] == -1).all()


@pytest.mark.parametrize("name", ["eagle chain", "eagle tree", "ngram"])
def test_each_mask_is_computed_once_and_verify_reuses_the_drafts(name, plain_outputs, monkeypatch):
    """A round's verify asks about the tree's nodes, whose masks its draft mostly computed
    already (each level masks its frontier's children after the frontier's path), and the
    root's is the last round's carried prediction's: xgrammar computes the mask after each
    token sequence once, the asks after that copy it. Greedy output is unchanged."""
    from speculum.runtime import grammar as structured

    asked, constraints = [], {}
    fill = structured.fill_bitmasks

    def recording(asks, bitmask):
        asked.extend((id(c), output) for c, output, _ in asks)
        constraints.update((id(c), c) for c, _, _ in asks)
        fill(asks, bitmask)

    monkeypatch.setattr(structured, "fill_bitmasks", recording)
    mix = constrained(PROMPTS * len(GRAMMARS), [g for g in GRAMMARS for _ in PROMPTS])
    results = generate(mix, engine=grammar_engine(name), max_new_tokens=16)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain_outputs]
    computed = sum(c.cache.computed for c in constraints.values())
    unique = set(asked)
    legal = [key for key in unique if _legal(constraints[key[0]].compiled, key[1])]
    # Every mask xgrammar wrote was for a sequence asked about for the first time (dead
    # paths, refused or past the end, get all-ones rows without xgrammar), ...
    assert computed <= len(legal) and computed > 0
    # ... and the verify's (and the next root's) asks found most of theirs already made.
    if name != "ngram":
        assert len(asked) - len(unique) >= len(unique) // 3


def _counted_asks(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the path tokens of every ask a round makes of the host for masks (one
    CUDA-graph cut each in a captured round, ``runtime.graphs.capture_cut``), as they come."""
    calls = []
    bitmasks = scheduler._bitmasks

    def counting(requests, pending, vocab, device, paths):
        calls.append(tuple(paths.shape))
        return bitmasks(requests, pending, vocab, device, paths)

    monkeypatch.setattr(scheduler, "_bitmasks", counting)
    return calls


def test_an_ngram_round_asks_the_host_for_masks_once_before_it_runs(monkeypatch):
    """An n-gram tree is built on the host, so its masks are computed with it and handed to
    the round: one ask per decoding round (its tree) and one per prefill, none from inside
    the round's verify."""
    calls = _counted_asks(monkeypatch)
    built = grammar_engine("ngram")
    for prompt, kind in zip(PROMPTS, GRAMMARS):
        calls.clear()
        (result,) = generate(constrained([prompt], [kind]), engine=built, max_new_tokens=16)
        assert len(calls) == 1 + result.stats["num_rounds"], calls
        # The rounds' asks are whole trees: [batch, num_draft_tokens, num_draft_tokens].
        assert all(shape[1:] == (6, 6) for shape in calls[1:]), calls


#: The pipelines of ``test_overlap`` with a draft model (n-gram trees are built on the host;
#: adaptive speculation's depth 0 runs plain steps, one ask each).
DRAFTED = [n for n in sorted(PIPELINES) if n not in ("adaptive", "ngram shared store")]
DRAFTED = [n for n in DRAFTED if not n.startswith(("plain", "ngram"))]


@pytest.mark.parametrize("name", DRAFTED)
def test_free_drafts_ask_the_host_once_a_round_for_the_verified_tree(name, monkeypatch):
    """With free drafts no draft distribution asks for masks: a round asks once, for every
    node of its verified tree, and a prefill once, for its token. Greedy output is plain
    constrained decoding's (``test_every_pipeline_emits_plain_constrained_decodings_tokens``)."""
    calls = _counted_asks(monkeypatch)
    built = grammar_engine(name, drafts="free")
    for prompt, kind in zip(PROMPTS, GRAMMARS):
        calls.clear()
        (result,) = generate(constrained([prompt], [kind]), engine=built, max_new_tokens=16)
        assert len(calls) == 1 + result.stats["num_rounds"], calls
        # [batch, nodes, path length]: the whole tree at once, root included.
        assert all(shape[1] == shape[2] > 1 for shape in calls[1:]), calls


def test_masked_drafts_ask_the_host_at_every_level_of_an_eagle_chain(monkeypatch):
    """With masked drafts an EAGLE chain of ``num_steps`` levels asks ``num_steps + 1`` times a
    round (the levels after the first, the verify, the carried prediction: as many graph cuts),
    and a prefill twice (its token, the draft's first prediction)."""
    calls = _counted_asks(monkeypatch)
    num_steps = PIPELINES["eagle chain"][2]["num_steps"]
    built = grammar_engine("eagle chain", drafts="masked")
    for prompt, kind in zip(PROMPTS, GRAMMARS):
        calls.clear()
        (result,) = generate(constrained([prompt], [kind]), engine=built, max_new_tokens=16)
        assert len(calls) == 2 + (num_steps + 1) * result.stats["num_rounds"], calls


def test_the_grammar_drafts_option_is_checked():
    for bad, error in [("loose", ValueError), ("Free", ValueError), (True, TypeError)]:
        with pytest.raises(error, match=r"grammar_drafts=.*masked, free"):
            SpecOptions(grammar_drafts=bad)
    assert SpecOptions().grammar_drafts == "masked"


def test_ngram_proposals_under_a_grammar_hold_no_illegal_token():
    """n-gram proposals are copied text: under a grammar each is cut at its first token the
    grammar refuses after the output, so every matched node of the tree is one the target
    can emit, and the room goes to the next candidates."""
    from speculum.runtime import grammar as structured
    from speculum.spec.ngram import NgramConfig, match
    from speculum.spec.tree import tree_mask, tree_path_tokens

    built = grammar_engine("plain")
    state = scheduler.new_state(built)
    sampling = scheduler.Sampling(json_schema=SCHEMA)
    state, _ = scheduler.add_request(built, state, [1], sampling=sampling)
    c = state.waiting[0].constraint
    tokens = {ch: i for i, ch in enumerate(CHARS)}
    prompt = [tokens[ch] for ch in "1,5]1,9]1,-4]1,2a1,7"]
    output = tuple(tokens[ch] for ch in "[1,")  # the schema allows 1, 23 or -4 next
    history = torch.tensor([[*prompt, *output]])
    config = NgramConfig(num_draft_tokens=8, max_depth=3)

    def legal_paths(drafted) -> list[bool]:
        paths = tree_path_tokens(drafted.tree, tree_mask(drafted.tree))[0]
        return [
            structured.legal(c, output + tuple(t for t in paths[node].tolist() if t >= 0))
            for node in range(1, int(drafted.num_nodes[0]))
        ]

    lengths = torch.tensor([history.shape[1]])
    free = legal_paths(match(history, lengths, config))
    pruned = match(history, lengths, config, legal=lambda row, p: structured.legal(c, output + p))
    assert not all(free)  # copied text proposes "5", "9", "7", "]" ...
    assert legal_paths(pruned) and all(legal_paths(pruned))
    assert len(legal_paths(pruned)) > free.count(True)  # their room went to legal candidates
