"""Training speculum's own target (issue 6): corpus, tokenizer, training loop, saved folder.

The corpus is a few standard-library modules copied to a temporary folder (every interpreter
has them), small enough that a 2-layer, 32-wide model trains in a second or two. The saved
folder must load in speculum and, unchanged, in transformers with the same logits; a run
interrupted and resumed must end with exactly the parameters of an uninterrupted one; and no
failure may leave a folder that looks like a finished model.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import ManualClock
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import speculum
from speculum.models.decoder import dense_batch
from speculum.models.loading import load_model
from speculum.models.tokenizer import BOS, EOS
from speculum.runtime import cli
from speculum.training import corpus, data, loop, target

transformers.logging.disable_progress_bar()

#: Standard-library modules every interpreter ships: about 100 KB of real Python.
_SOURCES = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "shlex.py"]
#: A test-size run: 2 layers, 32 wide, windows of 33 tokens, a few tens of steps.
_RUN = {"size": "test", "vocab_size": 400, "max_bytes": 10**6, "batch_size": 8, "length": 33}


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> list[Path]:
    """Copies of a few standard-library modules (copies, so their names are not the
    interpreter's and the hashing sees ordinary paths)."""
    stdlib = Path(json.__file__).parents[1]
    folder = tmp_path_factory.mktemp("texts")
    copies = []
    for name in _SOURCES:
        copy = folder / name.replace("/", "_")
        shutil.copyfile(stdlib / name, copy)
        copies.append(copy)
    return copies


@pytest.fixture(scope="module")
def tokenizer(text_files, tmp_path_factory):
    """A 400-id byte-level BPE tokenizer trained on ``text_files``."""
    return data.train_tokenizer(text_files, 400, tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def trained(text_files, tmp_path_factory) -> tuple[Path, loop.TrainResult]:
    """A test-size target trained for 40 steps, and its result."""
    out = tmp_path_factory.mktemp("trained") / "model"
    result = target.train_target(
        out, files=text_files, steps=40, lr=3e-3, eval_every=20, progress=False, **_RUN
    )
    return out, result


# -- corpus ----------------------------------------------------------------------------------


def test_discovery_excludes_test_folders_and_is_deterministic(tmp_path: Path) -> None:
    """Only ``.py`` files outside test and cache folders are found, sorted, every time; the
    root's own location (here under a folder named ``tests``) does not count."""
    root = tmp_path / "tests" / "site-packages"
    kept = ["a.py", "pkg/b.py", "pkg/sub/c.py", "pkg/testsuite.py"]
    dropped = [
        "pkg/test/d.py",
        "pkg/tests/e.py",
        "pkg/testing/f.py",
        "idlelib/idle_test/g.py",
        "pkg/__pycache__/h.py",
        "pkg/notes.txt",
    ]
    for name in kept + dropped:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x = 1\n")
    found = corpus.installed_python_files([root])
    assert found == sorted(root / name for name in kept)
    assert corpus.installed_python_files([root, root]) == found

    installed = corpus.installed_python_files()
    assert installed == sorted(installed) and len(installed) == len(set(installed))
    assert Path(json.__file__) in installed
    assert not any({"__pycache__", "idle_test"} & set(path.parts) for path in installed)


def test_sample_is_deterministic_bounded_and_skips_unreadable(tmp_path: Path) -> None:
    """Same seed, same sample; the sample stops once ``max_bytes`` is reached; non-UTF-8 and
    blank files never enter it; nothing readable is an error naming the cause."""
    files = []
    for i in range(30):
        path = tmp_path / f"m{i}.py"
        path.write_text(f"value_{i} = {i}\n" * 10)
        files.append(path)
    (tmp_path / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (tmp_path / "blank.py").write_text("\n\n")
    everything = [*files, tmp_path / "latin1.py", tmp_path / "blank.py"]
    size = len(files[0].read_bytes())

    sample = corpus.sample_files(everything, 5 * size, seed=3)
    assert sample == corpus.sample_files(list(reversed(everything)), 5 * size, seed=3)
    assert len(sample) == 5 and set(sample) <= set(files)
    assert corpus.sample_files(everything, 10**9, seed=3) != corpus.sample_files(
        everything, 10**9, seed=4
    )
    assert set(corpus.sample_files(everything, 10**9, seed=3)) == set(files)
    with pytest.raises(ValueError, match="empty corpus"):
        corpus.sample_files([tmp_path / "latin1.py", tmp_path / "blank.py"], 10**6, seed=0)


_names = st.text(alphabet="abcdefgh/_.", min_size=1, max_size=12)


@settings(max_examples=50)
@given(
    everything=st.sets(_names, min_size=1, max_size=60),
    data_=st.data(),
    fraction=st.floats(0.01, 0.9),
)
def test_split_is_stable_under_other_files(everything, data_, fraction) -> None:
    """A file's side depends on its name alone: any subset splits the same way."""
    subset = data_.draw(st.sets(st.sampled_from(sorted(everything))))
    train, heldout = corpus.split_files([Path(n) for n in sorted(everything)], fraction)
    sub_train, sub_heldout = corpus.split_files([Path(n) for n in sorted(subset)], fraction)
    assert set(sub_train) == set(train) & {Path(n) for n in subset}
    assert set(sub_heldout) == set(heldout) & {Path(n) for n in subset}


# -- tokenizer and windows ------------------------------------------------------------------


@settings(max_examples=200)
@given(text=st.text())
def test_tokenizer_round_trips_any_text(tokenizer, text: str) -> None:
    """Any string (not containing a special token's text) decodes back to itself, after the
    ``<s>`` the tokenizer adds in front."""
    if BOS in text or EOS in text:
        return
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.inner.token_to_id(BOS)
    assert tokenizer.decode(ids) == text


def test_tokenizer_vocabulary(tokenizer, text_files, tmp_path: Path) -> None:
    """The requested size, special tokens first, merges that compress code; too small a
    vocabulary is refused."""
    assert tokenizer.vocab_size == 400
    assert (tokenizer.inner.token_to_id(BOS), tokenizer.inner.token_to_id(EOS)) == (0, 1)
    source = text_files[0].read_text()
    assert len(tokenizer.encode(source)) < 0.6 * len(source.encode())
    with pytest.raises(ValueError, match="too small"):
        data.train_tokenizer(text_files, 299, tmp_path)


def test_tokenized_split_and_windows(tokenizer, text_files) -> None:
    """Documents are ``<s> text </s>``; windows are contiguous slices of the tokens, random
    ones replayable from the generator, held-out ones read from the start."""
    ids = data.tokenize_files(tokenizer, text_files[:2], separator=1)
    first = tokenizer.encode(text_files[0].read_text())
    assert ids.dtype == np.int32 and ids[: len(first)].tolist() == first
    assert ids[len(first)] == 1 and ids[-1] == 1 and (ids == 0).sum() == 2

    split = data.tokenize_split(tokenizer, text_files, separator=1, seed=0)
    assert split.train.size > 0 and split.heldout.size > 0
    windows = data.random_windows(split.train, 4, 16, torch.Generator().manual_seed(1))
    again = data.random_windows(split.train, 4, 16, torch.Generator().manual_seed(1))
    assert windows.dtype == torch.int64 and windows.shape == (4, 16)
    assert torch.equal(windows, again)
    flat = split.train.tolist()
    for row in windows.tolist():
        assert any(flat[i : i + 16] == row for i in range(len(flat) - 15))
    batches = data.heldout_windows(split.heldout, 3, 8, max_batches=2)
    assert [len(b) for b in batches] == [3, 3]
    assert torch.cat(batches).flatten().tolist() == split.heldout[:48].tolist()
    with pytest.raises(ValueError, match="fewer than one window"):
        data.random_windows(split.train[:5], 1, 16, torch.Generator())


# -- the loop --------------------------------------------------------------------------------


def test_learning_rate_schedule() -> None:
    """Linear warmup to the peak, cosine decay to a tenth of it at the last step."""
    rate = [loop.learning_rate(s, steps=100, lr=1.0, warmup=10) for s in range(1, 101)]
    assert rate[0] == pytest.approx(0.1) and rate[9] == pytest.approx(1.0)
    assert rate[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(rate[9:], rate[10:]))


def test_fit_rejects_bad_options() -> None:
    """Impossible options fail before any work, naming the option."""
    split = data.TokenSplit(train=np.arange(100, dtype=np.int32), heldout=np.arange(50))
    module = torch.nn.Linear(2, 2)
    for bad, match in [({"steps": 0}, "steps"), ({"lr": 0.0}, "lr"), ({"length": 0}, "length")]:
        options = {"steps": 1, "batch_size": 2, "length": 8, "lr": 1e-3, **bad}
        with pytest.raises(ValueError, match=match):
            loop.fit(module, lambda w: (w.float().mean(), {}), split, progress=False, **options)


def test_step_seconds_time_the_updates_alone(monkeypatch) -> None:
    """``step_seconds`` is the time of one update without the run's fixed costs: a loss that
    takes 20 ms per call and evaluations as long as 40 updates still give 20 ms. The loop reads
    a manual clock that only the loss moves, so a loaded machine cannot shift the figures."""
    split = data.TokenSplit(train=np.arange(100, dtype=np.int32), heldout=np.arange(200))
    module = torch.nn.Linear(2, 2)
    clock = ManualClock()
    monkeypatch.setattr(loop, "time", clock)

    def slow_loss(windows):
        clock.sleep(0.02)
        return module.weight.sum() * windows.float().mean(), {}

    options = {"batch_size": 2, "length": 8, "lr": 1e-3, "eval_every": 4, "eval_batches": 10}
    result = loop.fit(
        module, slow_loss, split, steps=loop.UNTIMED_STEPS + 8, progress=False, **options
    )
    assert result.step_seconds == pytest.approx(0.02)  # evaluations included would give ~0.1
    assert result.seconds > (loop.UNTIMED_STEPS + 8) * 0.02 + 3 * 10 * 0.02
    short = loop.fit(module, slow_loss, split, steps=loop.UNTIMED_STEPS, progress=False, **options)
    assert short.step_seconds == 0.0


# -- train-target ----------------------------------------------------------------------------


def test_training_lowers_heldout_loss(trained) -> None:
    """40 steps lower the held-out loss below its value before training; the folder holds the
    model, the tokenizer and the corpus, and nothing else is left beside it."""
    out, result = trained
    history = result.heldout_history
    assert history[0][0] == 0 and history[-1][0] == 40
    assert result.heldout_loss < history[0][1] - 0.5
    assert 0.0 < result.heldout_metrics["accuracy"] <= 1.0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "corpus"} <= names
    assert {p.name for p in (out / "corpus").iterdir()} >= {"train.npy", "heldout.npy"}
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]
    assert json.loads((out / "training.json").read_text())["heldout_loss"] == result.heldout_loss


def test_saved_model_loads_in_speculum_and_transformers(trained) -> None:
    """speculum decodes with the folder, and transformers' LlamaForCausalLM loads it unchanged
    with the same logits."""
    out, _ = trained
    (generation,) = speculum.generate(["def f(x):"], model=out, max_new_tokens=6)
    assert len(generation.token_ids) == 6

    ours = load_model(out)
    theirs = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.from_numpy(data.load_split(out / "corpus").heldout[:64].astype(np.int64))
    ids = ids.view(2, 32)
    with torch.no_grad():
        hidden, _ = ours(dense_batch(ids), None)
        torch.testing.assert_close(ours.logits(hidden), theirs(ids).logits)


def test_interrupted_run_resumes_to_the_same_parameters(text_files, tmp_path, monkeypatch):
    """Killed at step 25 (checkpoints every 8 steps, the last at 24, between evaluations at 20
    and 30): no model folder appears, and rerunning the same call ends with exactly the
    parameters and losses of an uninterrupted run, the training loss of steps 21 to 24 counted
    in the one reported at 30. Changed options are refused rather than mixed into the
    checkpoint."""
    options = {
        **_RUN,
        "files": text_files,
        "corpus_dir": tmp_path / "corpus",
        "steps": 30,
        "lr": 3e-3,
        "eval_every": 10,
        "checkpoint_every": 8,
        "progress": False,
    }
    whole = target.train_target(tmp_path / "whole", **options)

    steps = 0
    real_loss = target.next_token_loss

    def counted(model, windows):
        nonlocal steps
        steps += model.training
        if steps == die_at:
            raise RuntimeError("power cut")
        return real_loss(model, windows)

    monkeypatch.setattr(target, "next_token_loss", counted)
    out = tmp_path / "resumed"
    die_at = 25
    with pytest.raises(RuntimeError, match="power cut"):
        target.train_target(out, **options)
    assert not out.exists()
    assert not list(target.work_dir(out).rglob("config.json"))
    with pytest.raises(ValueError, match="other options"):
        target.train_target(out, **{**options, "lr": 1e-3})

    steps, die_at = 0, None
    resumed = target.train_target(out, **options)
    assert steps == 6  # steps 25 to 30: it resumed rather than started over
    assert resumed.heldout_history == whole.heldout_history
    assert resumed.history == whole.history
    expected = load_file(tmp_path / "whole" / "model.safetensors")
    found = load_file(out / "model.safetensors")
    assert expected.keys() == found.keys()
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name
    assert not target.work_dir(out).exists()


def test_time_based_checkpoints_save_about_every_minute(tmp_path: Path) -> None:
    """Without ``checkpoint_every``, a checkpoint is saved after the first update ending
    ``CHECKPOINT_SECONDS`` after the last save: with updates of 25 s (a fake clock), at steps 3
    and 6, so an interrupt at step 8 leaves step 6. With ``checkpoint_every`` the steps decide
    instead, and an impossible value is refused by name."""
    split = data.TokenSplit(train=np.arange(100, dtype=np.int32), heldout=np.arange(50))
    module = torch.nn.Linear(2, 2)
    now = 0.0

    def slow_loss(windows):
        nonlocal now
        if module.training:
            now += 25.0
            if now == 8 * 25.0:
                raise KeyboardInterrupt
        return module.weight.sum() * windows.float().mean(), {}

    path = tmp_path / "checkpoint.pt"
    options = {"batch_size": 2, "length": 8, "lr": 1e-3, "progress": False, "checkpoint": path}
    assert loop.CHECKPOINT_SECONDS == 60.0
    with pytest.raises(KeyboardInterrupt):
        loop.fit(module, slow_loss, split, steps=20, clock=lambda: now, **options)
    assert loop.saved_progress(path) == (6, 20)

    path.unlink()
    now = 0.0
    with pytest.raises(KeyboardInterrupt):
        loop.fit(
            module, slow_loss, split, steps=20, checkpoint_every=5, clock=lambda: now, **options
        )
    assert loop.saved_progress(path) == (5, 20)  # not 6: the minute no longer counts
    for bad in (0, 2.5):
        with pytest.raises(
            ValueError, match=f"checkpoint_every must be an integer >= 1, got {bad}"
        ):
            loop.fit(module, slow_loss, split, steps=20, checkpoint_every=bad, **options)


def _cli_train(out: Path, text_files: list[Path], *extra: str) -> list[str]:
    """``speculum train-target`` at test size into ``out`` (10 steps, evaluated at the last)."""
    argv = ["train-target", str(out), "--size", "test", "--steps", "10", "--batch-size", "4"]
    argv += ["--length", "17", "--vocab-size", "300", "--files", *map(str, text_files)]
    return [*argv, *extra]


@pytest.fixture
def counted_steps(monkeypatch):
    """Counts the training updates of ``train_target`` runs (``["steps"]``) and raises
    ``KeyboardInterrupt``, as Ctrl-C would, in the update numbered ``["die_at"]``."""
    seen = {"steps": 0, "die_at": None}
    real_loss = target.next_token_loss

    def counted(model, windows):
        seen["steps"] += model.training
        if seen["steps"] == seen["die_at"]:
            raise KeyboardInterrupt
        return real_loss(model, windows)

    monkeypatch.setattr(target, "next_token_loss", counted)
    return seen


def test_cli_interrupt_before_the_first_checkpoint(text_files, tmp_path, counted_steps, capsys):
    """Ctrl-C before any checkpoint: the message says nothing was saved and a rerun starts
    from step 0, and the rerun does all 10 updates (no "resuming" line)."""
    argv = _cli_train(tmp_path / "m", text_files, "--checkpoint-every", "8")
    counted_steps["die_at"] = 5
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert err.endswith(
        "speculum: interrupted; no checkpoint was saved yet, so rerunning the same command "
        "starts from step 0\n"
    )
    counted_steps.update(steps=0, die_at=None)
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert counted_steps["steps"] == 10
    assert "resuming" not in err


def test_cli_interrupt_after_a_checkpoint_resumes_there(
    text_files, tmp_path, counted_steps, capsys
):
    """Ctrl-C at step 7 with checkpoints every 4 steps: the message names step 4 and the
    checkpoint, the rerun says it resumes from step 4, does the 6 remaining updates and saves
    exactly the weights and losses of an uninterrupted run. Every run names its phases and
    shows a progress bar with the time left."""
    assert cli.main(_cli_train(tmp_path / "whole", text_files)) == 0
    err = capsys.readouterr().err
    assert "reading the corpus" in err and "training a 300-id tokenizer" in err
    assert "training a test model of" in err
    assert "10/10 [" in err and "<" in err  # tqdm's [elapsed<remaining]

    out = tmp_path / "resumed"
    argv = _cli_train(out, text_files, "--checkpoint-every", "4")
    counted_steps.update(steps=0, die_at=7)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert err.endswith(
        "speculum: interrupted; rerun the same command to resume from step 4 of 10 (the "
        f"checkpoint in {target.checkpoint_file(out)})\n"
    )
    counted_steps.update(steps=0, die_at=None)
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert f"resuming from step 4 of 10 ({target.checkpoint_file(out)})" in err
    assert counted_steps["steps"] == 6
    whole = json.loads((tmp_path / "whole" / "training.json").read_text())
    resumed = json.loads((out / "training.json").read_text())
    for key in ("train_loss", "heldout_loss", "heldout_history"):
        assert resumed[key] == whole[key], key
    expected = load_file(tmp_path / "whole" / "model.safetensors")
    found = load_file(out / "model.safetensors")
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name


def test_clear_errors(trained, text_files, tmp_path: Path) -> None:
    """A finished out_dir, an unknown size and an empty corpus are refused by name; none of
    them leaves a model folder behind."""
    out, _ = trained
    with pytest.raises(ValueError, match="already holds a finished model"):
        target.train_target(out, files=text_files, steps=1, progress=False, **_RUN)
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        target.train_target(tmp_path / "m", **{**_RUN, "size": "huge"})
    (tmp_path / "latin1.py").write_bytes(b"s = '\xe9'\n")
    with pytest.raises(ValueError, match="empty corpus"):
        target.train_target(
            tmp_path / "m", files=[tmp_path / "latin1.py"], steps=1, progress=False, **_RUN
        )
    assert not (tmp_path / "m").exists()


# -- command line ----------------------------------------------------------------------------


def test_cli_train_target(text_files, tmp_path: Path, capsys) -> None:
    """``speculum train-target`` trains, prints one ``key=value`` line, refuses to overwrite
    without ``--overwrite`` (status 2, one error line) and replaces with it."""
    argv = ["train-target", str(tmp_path / "m"), "--size", "test", "--steps", "3"]
    argv += ["--batch-size", "2", "--length", "17", "--vocab-size", "300", "--no-progress"]
    argv += ["--files", *map(str, text_files)]
    assert cli.main(argv) == 0
    assert "heldout_loss=" in capsys.readouterr().out
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("speculum: error: ")
    assert cli.main([*argv, "--overwrite"]) == 0
    assert (tmp_path / "m" / "model.safetensors").exists()


def test_cli_train_draft_forwards_options(tmp_path: Path, monkeypatch, capsys) -> None:
    """``speculum train-draft`` passes the options given (and only those) to ``train_draft``
    and prints its metrics; its errors exit with status 2."""
    seen = {}

    def train_draft(**kwargs):
        seen.update(kwargs)
        if kwargs["algorithm"] == "bad":
            raise ValueError("unknown algorithm 'bad'")
        return {"accuracy": 0.5, "steps": 7}

    fake = types.ModuleType("speculum.training.draft")
    fake.train_draft = train_draft
    monkeypatch.setitem(sys.modules, "speculum.training.draft", fake)
    argv = ["train-draft", "--target", "T", "--algorithm", "eagle3", "D", "--num-steps", "4"]
    assert cli.main([*argv, "--lr", "0.01", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == "accuracy=0.5, steps=7"
    assert seen == {
        "target_dir": Path("T"),
        "algorithm": "eagle3",
        "out_dir": Path("D"),
        "files": None,
        "overwrite": False,
        "progress": False,
        "save_dtype": None,
        "checkpoint_every": None,
        "num_steps": 4,
        "lr": 0.01,
    }
    assert cli.main(["train-draft", "--target", "T", "--algorithm", "bad", "D"]) == 2
    assert capsys.readouterr().err == "speculum: error: unknown algorithm 'bad'\n"
