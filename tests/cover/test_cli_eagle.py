"""``speculum generate --algorithm eagle|eagle3|mtp``: greedy tokens, acceptance stats, errors.

Checkpoints are written under ``tmp_path`` from the models of ``test_eagle_stats.py``: the
mostly-Markov 6-token target (``save_model``), and draft heads that agree with it (so rounds
accept several tokens) or not, in the published layouts (``save_draft``): SGLang EAGLE and
EAGLE-3, the EAGLE reference's ``pytorch_model.bin`` files (with a reduced EAGLE-3 vocabulary
through ``d2t``), vLLM speculators, and MTP layers inside the target's own folder; plus random
checkpoints over 64 ids with nothing planted. With
``--temperature 0`` every speculative run must print exactly the ``token_ids`` of ``--algorithm
plain``; its ``stats`` must carry an acceptance histogram that agrees with its mean, its
per-position rates and the number of tokens. Bad flags exit with status 2 and one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import test_eagle_stats as h  # its mostly-Markov target and heads
from conftest import tiny_config
from heads import agreeing_head
from test_cli import run_cli

from speculum.models.draft_loading import save_draft, save_random_draft
from speculum.models.loading import random_model, save_model
from speculum.runtime.generate import generate

VOCAB = h.VOCAB
#: A prompt whose greedy continuation cycles through five of the six tokens, and departs from
#: the target's Markov vote now and then (so agreeing drafts see rejections too).
PROMPT = "1,1"
MAX_NEW = 21


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-eagle")
    target = h.TARGET
    other = random_model(
        tiny_config(vocab_size=VOCAB, num_layers=4, hidden_size=48, head_dim=12), seed=2
    )
    wide = random_model(tiny_config(num_layers=4), seed=3, std=0.3)  # 64 ids, nothing planted
    return {
        "wide-target": save_model(wide, root / "wide-target"),
        "wide-eagle": save_random_draft(
            wide, "eagle", root / "wide-eagle", layout="eagle-reference"
        ),
        "wide-eagle3": save_random_draft(wide, "eagle3", root / "wide-eagle3", std=0.3),
        "wide-target-mtp": save_random_draft(
            wide, "mtp", root / "wide-target-mtp", std=0.3, layout="mtp-in-target"
        ),
        "target": save_model(target, root / "target"),
        "eagle": save_draft(agreeing_head(h.TARGET, "eagle"), root / "eagle", "sglang-eagle"),
        "eagle-reference": save_draft(
            agreeing_head(h.TARGET, "eagle"), root / "eagle-reference", "eagle-reference"
        ),
        "eagle-random": save_random_draft(target, "eagle", root / "eagle-random", seed=7, std=0.3),
        "eagle3": save_draft(h.agreeing_eagle3_head(), root / "eagle3", "sglang-eagle3"),
        "eagle3-speculators": save_draft(
            h.agreeing_eagle3_head(), root / "eagle3-speculators", "speculators-eagle3"
        ),
        "eagle3-reduced": save_draft(
            h.reduced_vocab_eagle3_head(), root / "eagle3-reduced", "eagle3-reference"
        ),
        "mtp-in-target": save_draft(
            agreeing_head(h.TARGET, "mtp"), root / "target-mtp", "mtp-in-target", target=target
        ),
        "mtp-random": save_random_draft(target, "mtp", root / "mtp-random", seed=7, std=0.3),
        "eagle3-other-target": save_random_draft(other, "eagle3", root / "eagle3-other"),
    }


def generate_json(capsys, *args: str, prompt: str = PROMPT) -> dict:
    status, out, err = run_cli(
        capsys, "--prompt-ids", prompt, "--max-new-tokens", str(MAX_NEW), "--temperature", "0",
        "--json", *args,
    )  # fmt: skip
    assert status == 0, err
    assert out.endswith("\n") and out.count("\n") == 1, out  # exactly one JSON object
    return json.loads(out)


def check_acceptance_stats(payload: dict, max_tokens_per_round: int) -> None:
    """The histogram is the source; mean, rates, round count and token count must agree."""
    stats = payload["stats"]
    histogram = stats["accept_length_histogram"]
    assert isinstance(histogram, list) and all(type(n) is int and n >= 0 for n in histogram)
    assert len(histogram) <= max_tokens_per_round + 1
    assert histogram[0] == 0, "every round emits at least the bonus token"
    rounds = sum(histogram)
    assert rounds == stats["num_rounds"] >= 1
    emitted = sum(k * n for k, n in enumerate(histogram))
    assert stats["accept_length_mean"] == pytest.approx(emitted / rounds, rel=1e-12)
    rates = stats["accept_rate_per_position"]
    # Position d (1-based) was accepted in the rounds that emitted more than d tokens.
    expected = [sum(histogram[d + 1 :]) / rounds for d in range(1, len(histogram) - 1)]
    assert rates == pytest.approx(expected, rel=1e-12)
    assert all(a >= b for a, b in zip(rates, rates[1:])), "a deeper token needs its parent"
    # The first token comes from prefill; a stop may cut only the last round short.
    tokens = len(payload["token_ids"])
    assert emitted >= tokens - 1
    assert emitted - (len(histogram) - 1) < tokens - 1


@pytest.fixture(scope="module")
def plain_tokens(folders) -> list[int]:
    """Greedy plain decoding of the target (through ``generate``; the CLI test below checks
    that ``--algorithm plain`` prints the same)."""
    (result,) = generate(
        [[int(t) for t in PROMPT.split(",")]], model=folders["target"], max_new_tokens=MAX_NEW
    )
    assert len(result.token_ids) == MAX_NEW
    return list(result.token_ids)


def test_plain_cli_reports_one_token_per_round(capsys, folders, plain_tokens):
    payload = generate_json(capsys, "--model", str(folders["target"]), "--algorithm", "plain")
    assert payload["token_ids"] == plain_tokens
    check_acceptance_stats(payload, 1)
    assert payload["stats"]["accept_length_mean"] == 1.0
    assert payload["stats"]["accept_rate_per_position"] == []


#: (algorithm, draft folder key or None for MTP layers in the target's folder, round flags,
#: whether the draft agrees with the target so that rounds must accept draft tokens)
RUNS = {
    "eagle-chain": ("eagle", "eagle", [], True),
    "eagle-reference-tree": (
        "eagle",
        "eagle-reference",
        ["--num-steps", "4", "--topk", "2", "--num-draft-tokens", "6"],
        True,
    ),
    "eagle-random-chain": ("eagle", "eagle-random", ["--num-steps", "2"], False),
    "eagle3-tree": (
        "eagle3",
        "eagle3",
        ["--num-steps", "3", "--topk", "2", "--num-draft-tokens", "5"],
        True,
    ),
    "eagle3-speculators-tree": (
        "eagle3",
        "eagle3-speculators",
        ["--topk", "3", "--num-draft-tokens", "8"],
        True,
    ),
    "eagle3-reduced-vocab-tree": (
        "eagle3",
        "eagle3-reduced",
        ["--num-steps", "2", "--topk", "3", "--num-draft-tokens", "7"],
        False,
    ),
    "mtp-in-target-chain": ("mtp", None, ["--num-steps", "5"], True),
    "nextn-in-target-tree": ("nextn", None, ["--topk", "2", "--num-draft-tokens", "4"], True),
    "mtp-own-folder-chain": ("mtp", "mtp-random", [], False),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_greedy_speculative_cli_prints_the_plain_tokens(capsys, folders, plain_tokens, name):
    algorithm, draft, flags, agrees = RUNS[name]
    if draft is None:  # MTP layers inside the target checkpoint: --draft defaults to --model
        model, extra = folders["mtp-in-target"], []
    else:
        model, extra = folders["target"], ["--draft", str(folders[draft])]
    payload = generate_json(capsys, "--model", str(model), "--algorithm", algorithm, *extra, *flags)
    assert payload["token_ids"] == plain_tokens
    assert payload["finish_reason"] == "length"
    steps = int(flags[flags.index("--num-steps") + 1]) if "--num-steps" in flags else 3
    check_acceptance_stats(payload, steps + 1)
    if agrees:
        # The 6-token target's greedy path is its Markov vote, which these drafts predict.
        assert payload["stats"]["accept_length_mean"] > 2.0, payload["stats"]


def test_a_target_folder_with_mtp_layers_still_decodes_plainly(capsys, folders, plain_tokens):
    payload = generate_json(capsys, "--model", str(folders["mtp-in-target"]))
    assert payload["token_ids"] == plain_tokens


#: Random checkpoints over 64 ids with nothing planted: rounds rarely accept, but every path of
#: the loaders and the pipeline still runs.
WIDE_RUNS = {
    "eagle-reference-chain": ("eagle", "wide-eagle", []),
    "eagle3-tree": ("eagle3", "wide-eagle3", ["--topk", "4", "--num-draft-tokens", "9"]),
    "mtp-in-target-tree": (
        "mtp",
        None,
        ["--num-steps", "2", "--topk", "2", "--num-draft-tokens", "5"],
    ),
}


@pytest.mark.parametrize("name", list(WIDE_RUNS))
def test_random_wide_checkpoints_print_the_plain_tokens(capsys, folders, name):
    algorithm, draft, flags = WIDE_RUNS[name]
    prompt = "7,50,3,33,12,61,0,9"
    plain = generate_json(capsys, "--model", str(folders["wide-target"]), prompt=prompt)
    if draft is None:
        model, extra = folders["wide-target-mtp"], []
    else:
        model, extra = folders["wide-target"], ["--draft", str(folders[draft])]
    payload = generate_json(
        capsys, "--model", str(model), "--algorithm", algorithm, *extra, *flags, prompt=prompt
    )
    assert payload["token_ids"] == plain["token_ids"]
    assert len(set(plain["token_ids"])) > 5  # not a degenerate repetition
    steps = int(flags[flags.index("--num-steps") + 1]) if "--num-steps" in flags else 3
    check_acceptance_stats(payload, steps + 1)


ERRORS = {
    "eagle3-without-draft": (["--algorithm", "eagle3"], r"needs a draft model.*--draft"),
    "draft-of-another-target": (
        ["--algorithm", "eagle3", "--draft", "{eagle3-other-target}"],
        r"different target model.*hidden size",
    ),
    "draft-of-another-algorithm": (
        ["--algorithm", "eagle3", "--draft", "{eagle}"],
        r"holds a draft for algorithm 'eagle'",
    ),
    "missing-draft-folder": (
        ["--algorithm", "eagle", "--draft", "{target}/nowhere"],
        r"does not exist",
    ),
    "topk-above-vocabulary": (
        ["--algorithm", "eagle", "--draft", "{eagle}", "--topk", "7", "--num-draft-tokens", "8"],
        rf"topk=7 > vocab_size={VOCAB}",
    ),
    "chain-with-wrong-tree-size": (
        [
            "--algorithm",
            "eagle3",
            "--draft",
            "{eagle3}",
            "--num-steps",
            "3",
            "--topk",
            "1",
            "--num-draft-tokens",
            "6",
        ],
        r"num_draft_tokens must be num_steps \+ 1 = 4, got 6",
    ),  # fmt: skip
    "tree-without-size": (
        ["--algorithm", "eagle3", "--draft", "{eagle3}", "--topk", "2"],
        r"num_draft_tokens is required when topk > 1",
    ),
    "tree-larger-than-the-candidates": (
        [
            "--algorithm",
            "eagle",
            "--draft",
            "{eagle}",
            "--num-steps",
            "2",
            "--topk",
            "2",
            "--num-draft-tokens",
            "8",
        ],
        r"propose only .* 6 candidates",
    ),  # fmt: skip
    "no-draft-steps": (
        ["--algorithm", "mtp", "--model", "{mtp-in-target}", "--num-steps", "0"],
        r"--num-steps takes an integer >= 1, not '0'",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_speculative_flags_exit_2_with_one_line(capsys, folders, name):
    flags, pattern = ERRORS[name]
    args = [a.format(**{k: str(v) for k, v in folders.items()}) for a in flags]
    if "--model" not in args:
        args = ["--model", str(folders["target"]), *args]
    status, out, err = run_cli(capsys, "--prompt-ids", PROMPT, "--json", *args)
    assert status == 2
    assert out == ""
    assert err.startswith("speculum: error: ") and err.endswith("\n") and err.count("\n") == 1
    assert re.search(pattern, err), err


def test_the_eagle_page_example_runs(tmp_path, monkeypatch, capsys):
    """docs/eagle.md's Python example runs as written (its greedy-equality assert included)."""
    page = Path(__file__).resolve().parents[2] / "docs" / "eagle.md"
    (block,) = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # tempfile.mkdtemp() lands in tmp_path
    monkeypatch.setattr("tempfile.tempdir", None)
    exec(compile(block, str(page), "exec"), {"__name__": "__example__"})
    assert capsys.readouterr().out.count("\n") == 4
