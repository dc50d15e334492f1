"""``speculum generate --algorithm dflash|dspark`` and ``speculum train-draft --algorithm
dflash|dspark``: greedy tokens equal plain decoding's with every budget flag, acceptance stats
agree with the histogram, and bad flags or checkpoints exit with status 2 and one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import test_eagle_stats as h
from test_block_stats import agreeing_dspark
from test_cli_eagle import PROMPT, check_acceptance_stats, generate_json, run_cli
from test_training_draft import corpus, target_dir

from speculum.models.block_draft import random_block_draft, save_block_draft
from speculum.models.loading import save_model
from speculum.runtime import cli
from speculum.runtime.generate import generate

__all__ = ["corpus", "target_dir"]  # fixtures shared with test_training_draft


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-block")
    dflash = random_block_draft(h.TARGET, "dflash", seed=3, std=0.3, block_size=5)
    speculators = root / "speculators"
    save_block_draft(agreeing_dspark(0.3), speculators)
    raw = json.loads((speculators / "config.json").read_text())
    (speculators / "config.json").write_text(json.dumps(raw | {"speculators_model_type": "dspark"}))
    (root / "costs.json").write_text(json.dumps([[1, 1.0], [64, 1.5]]))
    return {
        "target": save_model(h.TARGET, root / "target"),
        "dflash": save_block_draft(dflash, root / "dflash"),
        "dspark": save_block_draft(agreeing_dspark(0.3), root / "dspark"),
        "speculators": speculators,
        "costs": root / "costs.json",
    }


@pytest.fixture(scope="module")
def plain_tokens(folders) -> list[int]:
    (result,) = generate(
        [[int(t) for t in PROMPT.split(",")]], model=folders["target"], max_new_tokens=21
    )
    return list(result.token_ids)


RUNS = {
    "dflash": ("dflash", [], 4),
    "dflash-block-3-budget-1": ("dflash", ["--block-size", "3", "--verify-budget", "1"], 2),
    "dspark": ("dspark", [], 7),
    "dspark-auto": ("dspark", ["--verify-budget", "auto", "--cost-table", "{costs}"], 7),
    "dspark-budget-3": ("dspark", ["--verify-budget", "3"], 7),  # verified packed
    "dspark-budget-3-padded": ("dspark", ["--verify-budget", "3", "--padded-verify"], 7),
    "dspark-block-2-min-verify": (
        "dspark",
        ["--block-size", "2", "--verify-budget", "0", "--min-verify", "1"],
        2,
    ),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_greedy_block_cli_prints_the_plain_tokens(capsys, folders, plain_tokens, name):
    algorithm, flags, drafts = RUNS[name]
    flags = [f.format(**{k: str(v) for k, v in folders.items()}) for f in flags]
    payload = generate_json(
        capsys,
        "--model", str(folders["target"]), "--algorithm", algorithm,
        "--draft", str(folders[algorithm]), *flags,
    )  # fmt: skip
    assert payload["token_ids"] == plain_tokens
    check_acceptance_stats(payload, drafts + 1)
    if name == "dspark":
        assert payload["stats"]["accept_length_mean"] > 1.5, payload["stats"]


ERRORS = {
    "speculators-dspark": (
        ["--algorithm", "dspark", "--draft", "{speculators}"],
        r"speculators .*anchor \+ j.*one position early",
    ),
    "dflash-draft-as-dspark": (
        ["--algorithm", "dspark", "--draft", "{dflash}"],
        r"holds a dflash draft.*--algorithm dflash",
    ),
    "block-too-small": (
        ["--algorithm", "dflash", "--draft", "{dflash}", "--block-size", "1"],
        r"block_size=1",
    ),
    "auto-without-table": (
        ["--algorithm", "dspark", "--draft", "{dspark}", "--verify-budget", "auto"],
        r"cost table",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_block_flags_exit_2_with_one_line(capsys, folders, name):
    flags, pattern = ERRORS[name]
    args = [a.format(**{k: str(v) for k, v in folders.items()}) for a in flags]
    status, out, err = run_cli(
        capsys, "--model", str(folders["target"]), "--prompt-ids", PROMPT, "--json", *args
    )
    assert status == 2 and out == ""
    assert err.startswith("speculum: error: ") and err.count("\n") == 1
    assert re.search(pattern, err), err


def test_a_malformed_budget_or_cost_table_is_a_usage_error(capsys, folders, tmp_path):
    (tmp_path / "bad.json").write_text('{"tokens": 3}')
    for flags in (["--verify-budget", "most"], ["--cost-table", str(tmp_path / "bad.json")]):
        with pytest.raises(SystemExit) as stopped:
            cli.main(["generate", "--prompt-ids", PROMPT, *flags])
        assert stopped.value.code == 2
        assert re.search(r"--verify-budget|--cost-table", capsys.readouterr().err)


def test_train_draft_cli_trains_a_dspark_block(capsys, target_dir, corpus, tmp_path):
    out_dir = tmp_path / "dspark"
    files = [str(f) for f in corpus]
    status = cli.main(
        ["train-draft", str(out_dir), "--target", str(target_dir), "--algorithm", "dspark",
         "--block-size", "3", "--steps", "3", "--batch-size", "2", "--length", "32",
         "--files", *files, "--no-progress"]
    )  # fmt: skip
    assert status == 0, capsys.readouterr().err
    assert "acceptance_length=" in capsys.readouterr().out
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["block_size"] == 3
