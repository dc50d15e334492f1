"""What a practitioner meets in the first minutes of ``speculum generate`` (issue 21).

A draft is never ignored: without ``--algorithm`` the draft folder's kind picks the algorithm
(and stderr says so), a folder of no known kind exits 2 naming ``--algorithm``, and options the
chosen algorithm does not read exit 2 with the reason. Algorithm names are case-insensitive and
SGLang's ``--speculative-*`` spellings are aliases. Every numeric flag is range-checked while
parsing, with one ``speculum: error:`` line and no usage text; empty prompts are refused alike
for text and ids. ``--max-context`` cutting a budget is said. ``speculum.generate`` is the real
function (signature, docstring), takes a bare stop string and vLLM's ``speculative_config``.
``--compare-plain`` warms both engines and alternates timed passes. Text streams as it is
decoded and Ctrl-C (SIGINT, in a subprocess) exits 130 with what was decoded and no traceback.
``--prompts-file`` equals per-prompt ``generate``. The README documents every flag.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import tiny_config
from test_cli import run_cli

from speculum.models.block_draft import random_block_draft, save_block_draft
from speculum.models.draft_kind import draft_algorithm
from speculum.models.draft_loading import save_random_draft
from speculum.models.frozen_kv import random_frozen_kv, save_frozen_kv
from speculum.models.loading import random_model, save_model
from speculum.models.multi_layer_eagle import random_multi_layer, save_multi_layer
from speculum.models.tokenizer import byte_level_tokenizer, load_tokenizer, save_tokenizer
from speculum.runtime import cli
from speculum.runtime.default_model import default_model_dir
from speculum.runtime.generate import generate

PROMPT = [5, 9, 3, 7]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A random 4-layer target over 64 ids and one random draft of every kind for it."""
    root = tmp_path_factory.mktemp("cli-ux")
    target = random_model(tiny_config(num_layers=4), seed=3, std=0.3)
    small = random_model(tiny_config(num_layers=1), seed=4, std=0.3)
    unknown = save_model(small, root / "unknown")
    raw = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps(raw | {"architectures": ["FooForCausalLM"]}))
    return {
        "target": save_model(target, root / "target"),
        "eagle": save_random_draft(target, "eagle", root / "eagle", layout="eagle-reference"),
        "eagle3": save_random_draft(target, "eagle3", root / "eagle3", std=0.3),
        "mtp": save_random_draft(target, "mtp", root / "mtp", std=0.3),
        "mtp-in-target": save_random_draft(
            target, "mtp", root / "mtp-in-target", std=0.3, layout="mtp-in-target"
        ),
        "multi_layer_eagle": save_multi_layer(
            random_multi_layer(target, 2, std=0.3), root / "multi", target=target
        ),
        "frozen_kv_mtp": save_frozen_kv(random_frozen_kv(target, std=0.3), root / "frozen"),
        "dflash": save_block_draft(random_block_draft(target, "dflash", std=0.3), root / "dflash"),
        "dspark": save_block_draft(random_block_draft(target, "dspark", std=0.3), root / "dspark"),
        "standalone": save_model(small, root / "standalone"),
        "unknown": unknown,
        "other-vocabulary": save_model(
            random_model(tiny_config(vocab_size=258), seed=5), root / "other-vocabulary"
        ),
    }


def ids(tokens: list[int]) -> str:
    return ",".join(map(str, tokens))


def check_one_error_line(status: int, out: str, err: str, *words: str) -> None:
    """Exit 2, nothing on stdout, one ``speculum: error:`` line naming ``words``."""
    assert (status, out) == (2, ""), (status, out, err)
    assert err.startswith("speculum: error: ") and err.count("\n") == 1, err
    assert "usage" not in err and "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


# ---------------------------------------------------------------------------------------------
# Item 1: a draft is never ignored


KINDS = [
    "eagle",
    "eagle3",
    "mtp",
    "multi_layer_eagle",
    "frozen_kv_mtp",
    "dflash",
    "dspark",
    "standalone",
]


@pytest.mark.parametrize("kind", KINDS)
def test_the_draft_folder_says_which_algorithm_it_is_for(folders, kind):
    assert draft_algorithm(folders[kind]) == kind


def test_mtp_layers_inside_a_target_folder_are_an_mtp_draft(folders):
    assert draft_algorithm(folders["mtp-in-target"]) == "mtp"


@pytest.mark.parametrize("kind", ["eagle3", "dspark", "standalone"])
def test_a_draft_without_algorithm_speculates_and_says_so(capsys, folders, kind):
    args = ["--model", str(folders["target"]), "--prompt-ids", ids(PROMPT), "--json"]
    status, out, err = run_cli(
        capsys, *args, "--draft", str(folders[kind]), "--max-new-tokens", "9"
    )
    assert status == 0, err
    assert (
        err
        == f"speculum: decoding with --algorithm {kind}, the kind of the draft in {folders[kind]}\n"
    )
    payload = json.loads(out)
    assert payload["stats"]["num_rounds"] >= 1
    (plain,) = generate([PROMPT], model=folders["target"], max_new_tokens=9)
    (same,) = generate([PROMPT], model=folders["target"], draft=folders[kind], max_new_tokens=9)
    assert payload["token_ids"] == list(plain.token_ids) == list(same.token_ids)
    assert payload["stats"]["accept_length_histogram"] == same.stats["accept_length_histogram"]


def test_compare_plain_with_a_draft_loads_the_draft(capsys, folders):
    """The trap: ``--model T --draft D --compare-plain`` once decoded plainly twice, so a draft
    of another vocabulary went unnoticed."""
    args = ["--model", str(folders["target"]), "--prompt-ids", ids(PROMPT), "--compare-plain"]
    status, out, err = run_cli(capsys, *args, "--draft", str(folders["eagle3"]), "--json")
    assert status == 0 and err.startswith("speculum: decoding with --algorithm eagle3, the kind")
    assert json.loads(out)["compare_plain"]["same_tokens"] is True
    status, out, err = run_cli(capsys, *args, "--draft", str(folders["other-vocabulary"]))
    assert err.startswith("speculum: decoding with --algorithm standalone")  # loaded: refused
    check_one_error_line(status, out, err.split("\n", 1)[1], "vocabulary of 258 tokens")


def test_a_draft_of_no_known_kind_names_algorithm(capsys, folders):
    status, out, err = run_cli(
        capsys, "--model", str(folders["target"]), "--draft", str(folders["unknown"]),
        "--prompt-ids", ids(PROMPT),
    )  # fmt: skip
    check_one_error_line(status, out, err, "FooForCausalLM", "--algorithm")


NOT_READ = {
    # name: (options after --model TARGET --prompt-ids ..., words of the error)
    "draft top-k on plain": (
        ["--topk", "50", "--temperature", "0.7"],
        ["--topk", "plain", "--top-k"],
    ),
    "num-steps on plain": (["--num-steps", "3"], ["--num-steps", "plain", "--draft DIR"]),
    "ngram option on plain": (["--ngram-max-depth", "4"], ["--ngram-max-depth", "plain"]),
    "compare-plain on plain": (["--compare-plain"], ["--compare-plain", "plain"]),
    "block option on eagle3": (
        ["--algorithm", "eagle3", "--draft", "{eagle3}", "--block-size", "4"],
        ["--block-size", "eagle3", "dflash, dspark"],
    ),
    "tree option on dflash": (
        ["--draft", "{dflash}", "--topk", "2"],
        ["--topk", "dflash"],
    ),
}


@pytest.mark.parametrize("name", list(NOT_READ))
def test_options_the_algorithm_does_not_read_exit_2(capsys, folders, name):
    flags, words = NOT_READ[name]
    flags = [f.format(**{k: str(v) for k, v in folders.items()}) for f in flags]
    status, out, err = run_cli(
        capsys, "--model", str(folders["target"]), "--prompt-ids", ids(PROMPT), "--json", *flags
    )
    if "--draft" in flags and "--algorithm" not in flags:  # the inference notice comes first
        assert err.startswith("speculum: decoding with --algorithm ")
        err = err.split("\n", 1)[1]
    check_one_error_line(status, out, err, *words)


def test_sglang_spellings_and_upper_case_names_are_aliases(capsys, folders):
    common = ["--model", str(folders["target"]), "--prompt-ids", ids(PROMPT), "--json"]
    ours = run_cli(
        capsys, *common, "--algorithm", "eagle3", "--num-steps", "3", "--topk", "1",
        "--num-draft-tokens", "4", "--draft", str(folders["eagle3"]),
    )  # fmt: skip
    sglang = run_cli(
        capsys, *common, "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--speculative-draft-model-path", str(folders["eagle3"]),
    )  # fmt: skip
    assert ours[0] == sglang[0] == 0, (ours, sglang)
    a, b = json.loads(ours[1]), json.loads(sglang[1])
    assert a["token_ids"] == b["token_ids"]
    assert a["stats"]["accept_length_histogram"] == b["stats"]["accept_length_histogram"]


# ---------------------------------------------------------------------------------------------
# Item 5: argument hygiene


BAD_ARGUMENTS = {
    # name: (arguments after --model TARGET, words of the one error line)
    "negative id after a space": (["--prompt-ids", "-5,3"], ["--prompt-ids", "-5", "vocabulary"]),
    "empty id": (["--prompt-ids", "1,,2"], ["--prompt-ids", "'1,,2'"]),
    "empty ids": (["--prompt-ids", ""], ["--prompt-ids", "empty"]),
    "empty text": (["--prompt", ""], ["--prompt", "empty"]),
    "tp 0": (["--prompt-ids", "1", "--tp", "0"], ["--tp", ">= 1", "'0'"]),
    "max-new-tokens 0": (["--prompt-ids", "1", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    "top-p 0": (["--prompt-ids", "1", "--top-p", "0"], ["--top-p", "> 0.0 and <= 1.0"]),
    "top-p above 1": (["--prompt-ids", "1", "--top-p", "1.5"], ["--top-p", "'1.5'"]),
    "min-p negative": (["--prompt-ids", "1", "--min-p=-0.1"], ["--min-p", "'-0.1'"]),
    "seed negative": (["--prompt-ids", "1", "--seed=-1"], ["--seed", "'-1'"]),
    "max-context 0": (["--prompt-ids", "1", "--max-context", "0"], ["--max-context"]),
    "page-size 0": (["--prompt-ids", "1", "--page-size", "0"], ["--page-size"]),
    "adaptive depth negative": (
        ["--prompt-ids", "1", "--adaptive-steps", "1,-1"],
        ["--adaptive-steps", "-1"],
    ),
    "verify budget negative": (["--prompt-ids", "1", "--verify-budget=-2"], ["--verify-budget"]),
    "not a number": (["--prompt-ids", "1", "--temperature", "warm"], ["--temperature", "'warm'"]),
    "unknown algorithm": (
        ["--prompt-ids", "1", "--algorithm", "eagle9"],
        ["--algorithm", "eagle9"],
    ),
    "bad choice": (["--prompt-ids", "1", "--device", "tpu"], ["--device", "tpu"]),
}


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_bad_arguments_are_one_line_while_parsing(capsys, folders, name):
    args, words = BAD_ARGUMENTS[name]
    with pytest.raises(SystemExit) as stopped:
        cli.main(["generate", "--model", str(folders["target"]), *args])
    out, err = capsys.readouterr()
    check_one_error_line(stopped.value.code, out, err, *words)


def test_a_prompt_that_starts_with_a_dash_is_text(capsys, tmp_path):
    folder = save_model(random_model(tiny_config(vocab_size=258), seed=1), tmp_path / "m")
    save_tokenizer(byte_level_tokenizer(), folder)
    status, out, err = run_cli(
        capsys, "--model", str(folder), "--prompt", "-x", "--max-new-tokens", "2", "--json"
    )
    assert status == 0, err
    (expected,) = generate("-x", model=folder, max_new_tokens=2)
    assert json.loads(out)["token_ids"] == list(expected.token_ids)


# ---------------------------------------------------------------------------------------------
# Item 2: engine limits on the command line, and a budget the context cuts is said


def test_max_context_caps_the_output_with_a_notice(capsys, folders):
    args = ["--model", str(folders["target"]), "--prompt-ids", ids(PROMPT), "--json"]
    status, out, err = run_cli(
        capsys, *args, "--max-context", "10", "--max-batch", "2", "--page-size", "4",
        "--max-new-tokens", "1000000000",
    )  # fmt: skip
    assert status == 0
    payload = json.loads(out)
    assert len(payload["token_ids"]) == 10 - len(PROMPT)
    assert payload["finish_reason"] == "length"
    assert payload["stats"]["length_limit"] == "max_context"
    assert payload["stats"]["max_context"] == 10
    assert err == (
        "speculum: note: stopped after 6 new tokens, not --max-new-tokens 1000000000: the "
        "prompt and the output filled the context of 10 tokens (--max-context, up to the "
        "model's max_position_embeddings)\n"
    )
    (expected,) = generate([PROMPT], model=folders["target"], max_new_tokens=6)
    assert payload["token_ids"] == list(expected.token_ids)
    assert expected.stats["length_limit"] == "max_new_tokens"
    status, out, err = run_cli(capsys, *args, "--max-context", "10", "--max-new-tokens", "6")
    assert (status, err) == (0, "")  # the budget fits: no notice
    assert json.loads(out)["stats"]["length_limit"] == "max_new_tokens"


def test_a_max_context_above_the_model_exits_2(capsys, folders):
    status, out, err = run_cli(
        capsys, "--model", str(folders["target"]), "--prompt-ids", "1", "--max-context", "99999"
    )
    check_one_error_line(status, out, err, "max_context=99999", "max_position_embeddings")


# ---------------------------------------------------------------------------------------------
# Item 9: speculum.generate is the real function; stop_strings; vLLM's speculative_config


def test_speculum_generate_is_the_function_itself():
    import speculum

    assert speculum.generate is generate
    parameters = inspect.signature(speculum.generate).parameters
    assert "speculative_config" in parameters and "args" not in parameters
    assert generate.__doc__.count("chains multi-layer EAGLE's MTP layers") == 1


def test_a_bare_stop_string_is_one_string():
    """``stop_strings="and"`` stops at "and", not at the first "a", "n" or "d" (the bundled
    model, greedy)."""
    prompt, common = "def fibonacci(n):", {"algorithm": "plain", "max_new_tokens": 24}
    (free,) = generate(prompt, **common)
    assert "and" in free.text and free.text.index("n") < free.text.index("and")
    (bare,) = generate(prompt, stop_strings="and", **common)
    (listed,) = generate(prompt, stop_strings=("and",), **common)
    (chars,) = generate(prompt, stop_strings=list("and"), **common)
    assert bare.token_ids == listed.token_ids and bare.finish_reason == "stop"
    # The text ends before the stop string; the tokens keep the one that completed it.
    assert "and" not in bare.text and len(bare.token_ids) < len(free.token_ids)
    assert len(chars.token_ids) < len(bare.token_ids)


def test_vllm_speculative_config_is_read(folders):
    target, eagle3 = folders["target"], folders["eagle3"]
    (ours,) = generate([PROMPT], model=target, algorithm="Eagle3", draft=eagle3, num_steps=2)
    config = {"method": "EAGLE3", "model": str(eagle3), "num_speculative_tokens": 2}
    (vllm,) = generate([PROMPT], model=target, speculative_config=config)
    assert vllm.token_ids == ours.token_ids
    assert vllm.stats["accept_length_histogram"] == ours.stats["accept_length_histogram"]
    with pytest.raises(ValueError, match=r"keys \['speculative_model'\] are not read"):
        generate([PROMPT], model=target, speculative_config={"speculative_model": "x"})
    with pytest.raises(ValueError, match="num_steps given both as arguments and through"):
        generate([PROMPT], model=target, num_steps=4, speculative_config=config)


# ---------------------------------------------------------------------------------------------
# Item 6: --compare-plain warms both engines, then alternates timed passes


def test_compare_plain_warms_then_alternates_and_reports_the_median(monkeypatch, folders):
    from speculum.runtime import generate as module

    calls = []

    @functools.wraps(generate)  # the same signature, which compare_plain reads
    def recorded(*args, **kwargs):
        calls.append(kwargs["engine"])
        return generate(*args, **kwargs)

    monkeypatch.setattr(module, "generate", recorded)
    comparison = module.compare_plain(
        [PROMPT], model=folders["target"], draft=folders["eagle3"], max_new_tokens=5, passes=4
    )
    speculative, plain = calls[0], calls[1]
    assert speculative.pipeline.name == "eagle3" and plain.pipeline.name == "plain"
    assert calls == [speculative, plain] * 5  # one untimed warm-up pass each, then 4 timed
    assert len(comparison.speedups) == 4
    assert comparison.speedup == sorted(comparison.speedups)[2]  # the (upper) median pass
    assert comparison.speculative[0].token_ids == comparison.plain[0].token_ids


def test_compare_plain_on_the_command_line_reports_every_pass(capsys, folders):
    args = ["--model", str(folders["target"]), "--draft", str(folders["eagle3"])]
    args += ["--prompt-ids", ids(PROMPT), "--max-new-tokens", "4", "--compare-plain"]
    status, out, err = run_cli(capsys, *args, "--passes", "3", "--json")
    assert status == 0, err
    c = json.loads(out)["compare_plain"]
    assert len(c["speedups"]) == 3 and c["speedup"] == sorted(c["speedups"])[1]
    assert c["speedup"] == pytest.approx(c["tokens_per_second"] / c["plain_tokens_per_second"])
    status, _, err = run_cli(capsys, *args, "--passes", "1")
    assert status == 0 and "(median of 1 alternating passes after a warm-up;" in err
    status, out, err = run_cli(capsys, *args[:-1], "--passes", "2")
    check_one_error_line(status, out, err.split("\n", 1)[1], "--passes", "--compare-plain")


# ---------------------------------------------------------------------------------------------
# Item 3: text streams as it is decoded; Ctrl-C stops cleanly


def test_streamed_pieces_add_up_to_the_result():
    pieces: list[tuple[int, tuple[int, ...], str]] = []
    prompts = ["def f(x):", "class A:"]
    results = generate(
        prompts, algorithm="plain", max_new_tokens=12, on_tokens=lambda *p: pieces.append(p)
    )
    assert len(pieces) > 2  # several steps, not one piece at the end
    for i, result in enumerate(results):
        mine = [(ids, text) for index, ids, text in pieces if index == i]
        assert tuple(t for ids, _ in mine for t in ids) == result.token_ids
        assert "".join(text for _, text in mine) == result.text


def test_a_character_cut_between_tokens_is_shown_whole():
    from speculum.runtime.generate import _TextStream

    shown = []
    engine = SimpleNamespace(tokenizer=load_tokenizer(default_model_dir()))
    tokenizer = engine.tokenizer
    ids = tokenizer.encode("é€")[1:]  # byte-level pieces of two multi-byte characters
    stream = _TextStream(engine, lambda *piece: shown.append(piece[2]), rids=[7])
    for k, token in enumerate(ids):
        done = k == len(ids) - 1
        request = SimpleNamespace(stop_strings=(), include_stop_str_in_output=False)
        stream(SimpleNamespace(rid=7, new_token_ids=(token,), finished=done, request=request))
    assert "".join(shown) == "é€" and "\ufffd" not in "".join(shown)


def test_the_command_line_streams_the_same_text(capsys):
    args = ["--prompt", "def f(x):", "--algorithm", "plain", "--max-new-tokens", "16"]
    streamed = run_cli(capsys, *args)
    whole = run_cli(capsys, *args, "--no-stream")
    assert streamed[0] == whole[0] == 0
    assert streamed[1] == whole[1] and streamed[1].endswith("\n")


def test_ctrl_c_stops_cleanly_with_what_was_generated(tmp_path):
    """SIGINT while text streams: exit 130, the streamed text kept, statistics, no
    traceback."""
    command = [sys.executable, "-m", "speculum", "generate", "--prompt", "def f(x):"]
    command += ["--max-new-tokens", "100000", "--algorithm", "plain"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path
    )
    try:
        first = b""
        while not first.strip():  # until some visible text has streamed
            ready, _, _ = select.select([process.stdout], [], [], 120)
            assert ready, "no streamed text within 120 s"
            chunk = os.read(process.stdout.fileno(), 4096)
            assert chunk, "the command ended before any text streamed"
            first += chunk
        process.send_signal(signal.SIGINT)
        rest, err = process.communicate(timeout=60)
    finally:
        process.kill()
    out, err = (first + rest).decode(), err.decode()
    assert process.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert out.strip() and out.endswith("\n")
    assert "finish_reason=interrupted" in err and err.endswith("speculum: interrupted\n")
    tokens = int(err.split("num_new_tokens=")[1].split(",")[0])
    assert 1 <= tokens < 1000


@pytest.mark.parametrize("mode", ["--json", "--no-stream"])
def test_ctrl_c_reports_what_was_generated_in_every_mode(capsys, monkeypatch, mode):
    def interrupted(prompts, *, on_tokens, **options):
        on_tokens(0, (104, 105), "hi")
        on_tokens(0, (33,), "!")
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "generate", interrupted)
    status, out, err = run_cli(capsys, "--prompt", "x", "--algorithm", "plain", mode)
    assert status == 130
    assert err.startswith("num_new_tokens=3, tokens_per_second=")
    assert err.endswith("finish_reason=interrupted\nspeculum: interrupted\n")
    if mode == "--json":
        payload = json.loads(out)
        assert payload["token_ids"] == [104, 105, 33] and payload["text"] == "hi!"
        assert payload["finish_reason"] == payload["stats"]["finish_reason"] == "interrupted"
    else:
        assert out == "hi!\n"


# ---------------------------------------------------------------------------------------------
# Item 4: several prompts in one batch


def test_a_prompts_file_decodes_each_line_as_generate_does_alone(capsys, tmp_path):
    folder = save_model(random_model(tiny_config(vocab_size=258), seed=1, std=0.3), tmp_path / "m")
    save_tokenizer(byte_level_tokenizer(), folder)
    lines = [
        {"prompt": "def f(x):"},
        {"prompt_ids": [256, 10, 20], "max_new_tokens": 3},
        {"prompt": "class A:", "temperature": 0.9, "seed": 4, "top_k": 20},
        {"prompt_ids": [256, 7], "stop_token_ids": 9, "ignore_eos": True},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n\n" for line in lines))  # blanks skipped
    output = tmp_path / "out.jsonl"
    args = ["--model", str(folder), "--prompts-file", str(prompts), "--max-new-tokens", "6"]
    status, out, err = run_cli(capsys, *args, "--output", str(output))
    assert (status, out) == (0, "")
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["index"] for row in rows] == [0, 1, 2, 3]
    for line, row in zip(lines, rows):
        settings = {k: v for k, v in line.items() if k not in ("prompt", "prompt_ids")}
        prompt = line.get("prompt", line.get("prompt_ids"))
        (alone,) = generate([prompt], model=folder, **{"max_new_tokens": 6, **settings})
        assert row["token_ids"] == list(alone.token_ids)
        assert (row["text"], row["finish_reason"]) == (alone.text, alone.finish_reason)
    assert "   #  tokens finish   accept  text" in err and "4 prompts, " in err
    assert "tok/s" in err  # the progress bar

    text_file = tmp_path / "prompts.txt"
    text_file.write_text("def f(x):\n\nclass A:\n")
    status, out, _ = run_cli(capsys, "--model", str(folder), "--prompts-file", str(text_file))
    assert status == 0
    expected = generate(["def f(x):", "class A:"], model=folder)
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == [
        list(r.token_ids) for r in expected
    ]


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('{"prompt": "a", "temperature": -1}', ["prompts.jsonl:2", "temperature", "'-1'"]),
        ('{"prompt": ""}', ["prompts.jsonl:2", "non-empty"]),
        ('{"prompt_ids": [1, -2]}', ["prompts.jsonl:2", "non-negative"]),
        ('{"prompt": "a", "prompt_ids": [1]}', ["prompts.jsonl:2", "prompt_ids"]),
        ('{"prompt": "a", "colour": 1}', ["prompts.jsonl:2", "'colour'"]),
        ('{"prompt": "a", "stop_strings": 3}', ["prompts.jsonl:2", "stop_strings"]),
        ('{"prompt": "a", "include_stop_str_in_output": 1}', ["jsonl:2", "include_stop_str"]),
        ("not json", ["prompts.jsonl:2", "not a JSON object"]),
    ],
)
def test_a_bad_prompts_file_line_is_one_error_line(capsys, folders, tmp_path, line, words):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1]}\n' + line + "\n")
    status, out, err = run_cli(
        capsys, "--model", str(folders["target"]), "--prompts-file", str(prompts)
    )
    check_one_error_line(status, out, err, *words)


def test_the_readme_documents_every_flag_and_alias():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (generate_parser,) = (p for p in cli._subparsers(cli.parser()) if p.prog.endswith("generate"))
    for action in generate_parser._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help") and not flag.startswith("--ngram-"):
                assert f"`{flag}" in readme, flag
