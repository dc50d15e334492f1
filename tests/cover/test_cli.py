"""The ``speculum generate`` contract (issue 2, point 8), held exactly.

``speculum generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--algorithm plain]
[--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--min-p P] [--seed S]
[--device auto|cpu|cuda] [--dtype float32|bfloat16|float16] [--json]``: with ``--json`` stdout is
exactly one JSON object with ``token_ids`` (generated ids only), ``text`` (their decoding) and
``stats`` (at least ``num_forward_steps`` and ``tokens_per_second``). Bad input exits with
status 2 and one line on stderr naming the cause. Most cases call ``cli.main`` in-process; a few
go through a real subprocess (``python -m speculum`` and the console script when installed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

import speculum
from speculum.models.loading import random_model, save_model
from speculum.models.tokenizer import byte_level_tokenizer, load_tokenizer, save_tokenizer
from speculum.runtime import cli
from speculum.runtime.default_model import TINY_CONFIG, default_model_dir

REPO = Path(__file__).resolve().parents[2]

#: Smaller than the default model (2 layers, 32 wide) and with a 64-token context, so that a
#: prompt longer than the context is cheap to build. Same 258-id byte-level vocabulary.
SMALL_CONFIG = attrs.evolve(
    TINY_CONFIG,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    max_position_embeddings=64,
)
BOS = SMALL_CONFIG.bos_token_id
VOCAB = SMALL_CONFIG.vocab_size
CONTEXT = SMALL_CONFIG.max_position_embeddings


def _write_small(folder: Path, *, tokenizer: bool = True) -> Path:
    save_model(random_model(SMALL_CONFIG, seed=1, std=0.2), folder)
    if tokenizer:
        save_tokenizer(byte_level_tokenizer(), folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A small random Llama folder with a byte-level tokenizer.json."""
    return _write_small(tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="module")
def model_dir_no_tokenizer(tmp_path_factory) -> Path:
    """The same kind of folder without tokenizer.json."""
    return _write_small(tmp_path_factory.mktemp("small-no-tok"), tokenizer=False)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``speculum generate ARGS`` in-process: (exit status, stdout, stderr); a usage error
    found while parsing exits (``SystemExit``) with its status."""
    try:
        status = cli.main(["generate", *args])
    except SystemExit as stopped:
        status = stopped.code
    out, err = capsys.readouterr()
    return status, out, err


def parse_one_object(stdout: str) -> dict:
    """Stdout must be exactly one JSON object (one line, nothing before or after it)."""
    assert stdout.endswith("\n") and stdout.count("\n") == 1, stdout
    payload = json.loads(stdout)
    assert isinstance(payload, dict)
    return payload


def check_contract(payload: dict, max_new_tokens: int, tokenizer=None) -> None:
    ids = payload["token_ids"]
    vocab = VOCAB if tokenizer is None else tokenizer.vocab_size
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert 1 <= len(ids) <= max_new_tokens
    assert all(0 <= t < vocab for t in ids)
    assert isinstance(payload["text"], str)
    if tokenizer is not None:
        assert payload["text"] == tokenizer.decode(ids)
    stats = payload["stats"]
    assert type(stats["num_forward_steps"]) is int and stats["num_forward_steps"] >= 1
    assert type(stats["tokens_per_second"]) is float and stats["tokens_per_second"] > 0


def ids_arg(ids: list[int]) -> str:
    return ",".join(map(str, ids))


# ---------------------------------------------------------------------------------------------
# The JSON contract


def test_json_output_is_one_object_with_the_contract_fields(capsys, model_dir):
    status, out, err = run_cli(
        capsys, "--model", str(model_dir), "--prompt-ids", "256,72,105", "--max-new-tokens", "7"
    )
    assert status == 0 and out  # without --json: text on stdout, stats on stderr
    assert "num_forward_steps=" in err

    status, out, _ = run_cli(
        capsys, "--model", str(model_dir), "--prompt-ids", "256,72,105", "--max-new-tokens", "7",
        "--json",
    )  # fmt: skip
    assert status == 0
    payload = parse_one_object(out)
    check_contract(payload, 7, load_tokenizer(model_dir))
    # Greedy decoding of a random model rarely hits EOS: the budget is used to the last token.
    if payload["finish_reason"] == "length":
        assert len(payload["token_ids"]) == 7


def test_greedy_cli_equals_generate(capsys, model_dir):
    prompt = [BOS, 10, 20, 30, 40, 50]
    status, out, _ = run_cli(
        capsys, "--model", str(model_dir), "--prompt-ids", ids_arg(prompt), "--max-new-tokens",
        "12", "--json", "--algorithm", "plain", "--temperature", "0",
    )  # fmt: skip
    assert status == 0
    payload = parse_one_object(out)
    check_contract(payload, 12, load_tokenizer(model_dir))
    (expected,) = speculum.generate([prompt], model=model_dir, max_new_tokens=12)
    assert payload["token_ids"] == list(expected.token_ids)
    assert payload["text"] == expected.text


def test_generated_tokens_stop_at_the_context_limit(capsys, model_dir):
    prompt = [BOS, *range(1, 10)]
    status, out, _ = run_cli(
        capsys, "--model", str(model_dir), "--prompt-ids", ids_arg(prompt),
        "--max-new-tokens", "500", "--json",
    )  # fmt: skip
    assert status == 0
    payload = parse_one_object(out)
    assert len(payload["token_ids"]) <= CONTEXT - len(prompt)
    check_contract(payload, 500)


def test_prompt_text_goes_through_the_tokenizer(capsys, model_dir):
    text = "def fibonacci(n):"
    ids = load_tokenizer(model_dir).encode(text)
    assert ids == [BOS, *text.encode()]  # byte-level tokenizer: BOS, then the bytes
    args = ["--model", str(model_dir), "--max-new-tokens", "6", "--json"]
    _, from_text, _ = run_cli(capsys, *args, "--prompt", text)
    _, from_ids, _ = run_cli(capsys, *args, "--prompt-ids", ids_arg(ids))
    a, b = parse_one_object(from_text), parse_one_object(from_ids)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]


def test_default_is_the_bundled_model_with_its_eagle3_draft(capsys):
    """No --model: the bundled tiny code model decodes with its EAGLE-3 draft, and emits
    exactly what plain greedy decoding of the same model emits."""
    folder = default_model_dir()
    status, out, _ = run_cli(
        capsys, "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--json"
    )
    assert status == 0
    payload = parse_one_object(out)
    check_contract(payload, 24, load_tokenizer(folder))
    assert payload["stats"]["accept_length_mean"] > 1.0  # speculation ran and accepted drafts
    (plain,) = speculum.generate(
        "def fibonacci(n):", model=folder, algorithm="plain", max_new_tokens=24
    )
    assert payload["token_ids"] == list(plain.token_ids)


def test_compare_plain_reports_speedup_and_acceptance(capsys, model_dir):
    args = ["--model", str(model_dir), "--prompt-ids", "256,5,6,5,6,5", "--max-new-tokens", "12"]
    status, out, _ = run_cli(capsys, *args, "--algorithm", "ngram", "--compare-plain", "--json")
    assert status == 0
    payload = parse_one_object(out)
    comparison = payload["compare_plain"]
    assert comparison["same_tokens"] is True
    assert comparison["accept_length_mean"] == payload["stats"]["accept_length_mean"]
    expected = comparison["tokens_per_second"] / comparison["plain_tokens_per_second"]
    assert comparison["speedup"] == pytest.approx(expected)
    status, _, err = run_cli(capsys, *args, "--algorithm", "ngram", "--compare-plain")
    assert status == 0 and "speedup" in err and "same tokens as plain: yes" in err


# ---------------------------------------------------------------------------------------------
# Sampling flags and seeds


def sampled(capsys, model_dir, seed: int, *extra: str) -> list[int]:
    status, out, _ = run_cli(
        capsys, "--model", str(model_dir), "--prompt-ids", "256,5,6,7", "--max-new-tokens",
        "16", "--temperature", "1.5", "--seed", str(seed), "--json", *extra,
    )  # fmt: skip
    assert status == 0
    payload = parse_one_object(out)
    check_contract(payload, 16, load_tokenizer(model_dir))
    return payload["token_ids"]


def test_same_seed_same_tokens_other_seed_other_tokens(capsys, model_dir):
    first = sampled(capsys, model_dir, 1)
    assert sampled(capsys, model_dir, 1) == first
    # 16 draws at temperature 1.5 over 258 ids: two seeds agreeing everywhere is ~impossible.
    assert sampled(capsys, model_dir, 2) != first
    (expected,) = speculum.generate(
        [[256, 5, 6, 7]], model=model_dir, max_new_tokens=16, temperature=1.5, seed=1
    )
    assert list(expected.token_ids) == first


def test_sampling_filters_are_passed_through(capsys, model_dir):
    filters = ("--top-k", "3", "--top-p", "0.9", "--min-p", "0.05")
    tokens = sampled(capsys, model_dir, 4, *filters)
    assert sampled(capsys, model_dir, 4, *filters) == tokens
    (expected,) = speculum.generate(
        [[256, 5, 6, 7]], model=model_dir, max_new_tokens=16, temperature=1.5, seed=4,
        top_k=3, top_p=0.9, min_p=0.05,
    )  # fmt: skip
    assert list(expected.token_ids) == tokens
    # top-k 1 is greedy whatever the temperature and seed.
    greedy = sampled(capsys, model_dir, 4, "--temperature", "0")
    assert sampled(capsys, model_dir, 9, "--top-k", "1") == greedy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes(capsys, model_dir, dtype):
    status, out, _ = run_cli(
        capsys, "--model", str(model_dir), "--prompt-ids", "256,1,2", "--max-new-tokens", "4",
        "--dtype", dtype, "--device", "cpu", "--json",
    )  # fmt: skip
    assert status == 0
    check_contract(parse_one_object(out), 4, load_tokenizer(model_dir))


# ---------------------------------------------------------------------------------------------
# Bad input: exit status 2, one line on stderr naming the cause, nothing on stdout


def _unsupported_dir(folder: Path, model_dir: Path) -> Path:
    folder.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    return folder


BAD_INPUT = {
    # name: (arguments after --model DIR, which model folder, words the message must contain)
    "unknown algorithm": (["--prompt-ids", "256,1", "--algorithm", "eagle9"], "ok", ["eagle9"]),
    "token id too large": (["--prompt-ids", f"256,1,{VOCAB + 5}"], "ok", [str(VOCAB + 5)]),
    "negative token id": (["--prompt-ids=-3,1"], "ok", ["-3", "vocabulary"]),
    "prompt longer than the context": (
        ["--prompt-ids", ids_arg([1] * (CONTEXT + 10))],
        "ok",
        [str(CONTEXT + 10), "context"],
    ),
    "empty prompt": (["--prompt-ids", ""], "ok", ["empty"]),
    "max-new-tokens 0": (["--prompt-ids", "256,1", "--max-new-tokens", "0"], "ok", ["0"]),
    "negative temperature": (["--prompt-ids", "1", "--temperature", "-1"], "ok", ["temperature"]),
    "temperature inf in float32": (
        ["--prompt-ids", "1", "--temperature", "1e39"],
        "ok",
        ["temperature=1e+39", "float32"],
    ),
    "top-p 0 in float32": (["--prompt-ids", "1", "--top-p", "1e-50"], "ok", ["top_p=", "float32"]),
    "seed beyond int64": (["--prompt-ids", "1", "--seed", str(2**64)], "ok", ["seed=", "64-bit"]),
    "missing model folder": (["--prompt-ids", "1"], "missing", ["does-not-exist"]),
    "folder without config.json": (["--prompt-ids", "1"], "empty", ["config.json"]),
    "unsupported architecture": (["--prompt-ids", "1"], "gpt2", ["GPT2LMHeadModel"]),
    "--prompt without tokenizer.json": (["--prompt", "hi"], "no-tokenizer", ["tokenizer"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUT), ids=list(BAD_INPUT))
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, model_dir, model_dir_no_tokenizer, case):
    args, which, words = BAD_INPUT[case]
    folder = {
        "ok": lambda: model_dir,
        "missing": lambda: tmp_path / "does-not-exist",
        "empty": lambda: tmp_path,
        "gpt2": lambda: _unsupported_dir(tmp_path / "gpt2", model_dir),
        "no-tokenizer": lambda: model_dir_no_tokenizer,
    }[which]()
    status, out, err = run_cli(capsys, "--model", str(folder), *args, "--json")
    assert status == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("speculum: error: ")
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("gpu", [True, False])
def test_device_auto_is_cuda_exactly_when_torch_sees_a_gpu(monkeypatch, gpu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert cli.resolved_device("auto") == ("cuda" if gpu else "cpu")
    assert [cli.resolved_device(name) for name in ("cpu", "cuda")] == ["cpu", "cuda"]


def test_the_default_device_decodes_as_the_device_it_resolves_to(capsys, model_dir):
    """Without ``--device`` the command runs where ``auto`` points (the CPU on a machine
    without a GPU), with that device's tokens."""
    args = ("--model", str(model_dir), "--prompt-ids", "1,2", "--max-new-tokens", "6", "--json")
    status, out, _ = run_cli(capsys, *args)
    explicit, out_explicit, _ = run_cli(capsys, *args, "--device", cli.resolved_device("auto"))
    assert status == explicit == 0
    assert parse_one_object(out)["token_ids"] == parse_one_object(out_explicit)["token_ids"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA exists here")
def test_cuda_without_cuda_exits_2(capsys, model_dir):
    status, out, err = run_cli(
        capsys, "--model", str(model_dir), "--prompt-ids", "1", "--device", "cuda", "--json"
    )
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("speculum: error: ") and "CUDA" in err


@pytest.mark.parametrize(
    "args",
    [
        ["--prompt", "hi", "--prompt-ids", "1,2"],  # both
        [],  # neither
        ["--prompt-ids", "1,x"],  # not integers
        ["--prompt-ids", "1", "--dtype", "float64"],
        ["--prompt-ids", "1", "--device", "tpu"],
    ],
    ids=["both prompts", "no prompt", "bad ids", "bad dtype", "bad device"],
)
def test_argument_errors_exit_2(capsys, model_dir, args):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--model", str(model_dir), *args])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "error:" in err.splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# Through a real process


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _commands() -> dict[str, list[str]]:
    commands = {"python -m speculum": [sys.executable, "-m", "speculum"]}
    script = Path(sys.executable).parent / "speculum"
    if script.is_file():  # the console script of `pip install -e .`
        commands["speculum script"] = [str(script)]
    return commands


@pytest.mark.parametrize("command", list(_commands().values()), ids=list(_commands()))
def test_subprocess(command, model_dir, capsys):
    prompt = [BOS, 3, 1, 4, 1, 5]
    args = ["generate", "--model", str(model_dir), "--prompt-ids", ids_arg(prompt)]
    done = subprocess.run(
        [*command, *args, "--max-new-tokens", "9", "--json"],
        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    payload = parse_one_object(done.stdout)
    check_contract(payload, 9, load_tokenizer(model_dir))
    _, out, _ = run_cli(capsys, *args[1:], "--max-new-tokens", "9", "--json")
    assert payload["token_ids"] == parse_one_object(out)["token_ids"]

    bad = subprocess.run(
        [*command, *args, "--algorithm", "nope"],
        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("speculum: error: ") and bad.stderr.count("\n") == 1
    assert "'nope'" in bad.stderr


def test_subprocess_readme_command_on_the_default_model():
    """The README's main job, in a fresh process: the bundled model runs, no download."""
    done = subprocess.run(
        [sys.executable, "-m", "speculum", "generate", "--prompt", "def fibonacci(n):",
         "--max-new-tokens", "32", "--json"],
        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    check_contract(parse_one_object(done.stdout), 32, load_tokenizer(default_model_dir()))


# ---------------------------------------------------------------------------------------------
# The Python examples of the README and docs/ run as written


@pytest.mark.parametrize("page", ["README.md", "docs/embedding.md"])
def test_documented_python_examples_run(page, tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (REPO / page).read_text(), re.S)
    assert blocks, f"{page} has no python example"
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # tempfile.mkdtemp() lands in tmp_path
    monkeypatch.setattr("tempfile.tempdir", None)
    for block in blocks:
        exec(compile(block, page, "exec"), {"__name__": "__example__"})
    assert capsys.readouterr().out.startswith("{")  # each example prints its tokens
