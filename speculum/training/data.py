"""Tokens for training: a byte-level BPE tokenizer, tokenized corpora and training windows.

A corpus folder (what :func:`prepare_corpus` writes, and what ``train-target`` ships inside a
finished model as ``corpus/``) holds:

- ``tokenizer.json``: the tokenizer (:func:`train_tokenizer`);
- ``train.npy`` and ``heldout.npy``: int32 token ids of every document of each side,
  concatenated, each document encoded as a prompt is (``<s>`` then the text) and followed by
  ``</s>`` (:func:`tokenize_files`);
- ``corpus.json``: the options it was built with and the files on each side.

:func:`load_split` reads the arrays back (``train-draft`` reuses a target's exact tokens this
way); :func:`tokenize_split` tokenizes any other set of text files with a given tokenizer.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import tokenizers
import torch
from jaxtyping import Int
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from torch import Tensor

from speculum.models.tokenizer import (
    BOS,
    EOS,
    TOKENIZER_FILE,
    Tokenizer,
    load_tokenizer,
    save_tokenizer,
)
from speculum.training.corpus import (
    installed_python_files,
    read_text,
    sample_files,
    shuffle_files,
    split_files,
)

__all__ = [
    "HELDOUT_FILE",
    "MANIFEST_FILE",
    "MIN_VOCAB_SIZE",
    "TRAIN_FILE",
    "TokenSplit",
    "announce",
    "heldout_windows",
    "load_split",
    "prepare_corpus",
    "random_windows",
    "special_id",
    "tokenize_files",
    "tokenize_split",
    "train_tokenizer",
]

TRAIN_FILE, HELDOUT_FILE, MANIFEST_FILE = "train.npy", "heldout.npy", "corpus.json"
#: The 256 byte tokens, ``<s>``, ``</s>`` and a few merges: below this BPE has nothing to learn.
MIN_VOCAB_SIZE = 300
#: Files tokenized per ``encode_batch`` call: enough for the Rust side to use every core,
#: few enough that a large corpus is never held as text all at once.
_CHUNK_FILES = 256


@attrs.define(frozen=True, eq=False)
class TokenSplit:
    """Token ids of the training and held-out documents (int32, documents concatenated)."""

    train: np.ndarray
    heldout: np.ndarray


def announce(message: str, *, enabled: bool) -> None:
    """Print ``message`` as one line on stderr when ``enabled``: the training commands name
    each long phase before it starts, so that no stretch of a run is silent."""
    if enabled:
        print(message, file=sys.stderr, flush=True)


def train_tokenizer(files: Sequence[Path], vocab_size: int, out_dir: Path) -> Tokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` ids on ``files``; save it as
    ``out_dir/tokenizer.json`` and return it.

    Ids 0 and 1 are the special tokens ``<s>`` and ``</s>``, then come the 256 byte tokens and
    the merges. The ByteLevel pre-tokenizer (GPT-2's split: words, number runs, whitespace
    runs such as indentation) and decoder make every string round-trip, except the literal text
    of a special token. As a Llama tokenizer does, encoding adds ``<s>`` in front. A corpus too
    small to yield ``vocab_size - 258`` merges gives a smaller vocabulary.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} ids (256 bytes, 2 special tokens, some merges); 4096-8192 suits "
            "a small code model"
        )
    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        # Every byte gets a token even if the corpus lacks it, so any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    read = 0

    def texts() -> Iterator[str]:
        nonlocal read
        for text in map(read_text, files):
            if text:
                read += 1
                yield text

    inner.train_from_iterator(texts(), trainer)
    if read == 0:
        raise ValueError(
            f"empty corpus: none of the {len(files)} files could be read as UTF-8 text, so the "
            "tokenizer learnt nothing; pass readable text files"
        )
    inner.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, inner.token_to_id(BOS))]
    )
    save_tokenizer(inner, out_dir)
    return load_tokenizer(out_dir)


def special_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of special ``token`` (``"<s>"``, ``"</s>"``), or a ``ValueError`` naming the fix."""
    found = tokenizer.inner.token_to_id(token)
    if found is None:
        raise ValueError(
            f"the tokenizer has no {token!r} token; train one with train_tokenizer or pass "
            "the separator id explicitly"
        )
    return found


def tokenize_files(tokenizer: Tokenizer, files: Sequence[Path], separator: int) -> np.ndarray:
    """int32 ids of ``files`` concatenated, each document encoded as a prompt is (with the
    tokenizer's ``<s>``, if it adds one) and followed by ``separator`` (the EOS id).

    Unreadable or non-UTF-8 files are skipped.
    """
    pieces: list[np.ndarray] = []
    end = np.array([separator], dtype=np.int32)
    for start in range(0, len(files), _CHUNK_FILES):
        texts = [t for t in map(read_text, files[start : start + _CHUNK_FILES]) if t is not None]
        for encoding in tokenizer.inner.encode_batch(texts, add_special_tokens=True):
            pieces += [np.asarray(encoding.ids, dtype=np.int32), end]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def tokenize_split(
    tokenizer: Tokenizer,
    files: Sequence[Path],
    separator: int,
    seed: int,
    heldout_fraction: float = 0.05,
) -> TokenSplit:
    """Split ``files`` by name (:func:`~speculum.training.corpus.split_files`) and tokenize
    each side (:func:`tokenize_files`).

    ``seed`` shuffles the documents within each side, so that the held-out windows, which are
    read from the start (:func:`heldout_windows`), cover many packages rather than the first
    few in alphabetical order. When the split leaves one side without tokens (a handful of
    files), the last ``heldout_fraction`` of all tokens is held out instead.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    train_files, heldout_files = split_files(shuffle_files(files, seed), heldout_fraction)
    train = tokenize_files(tokenizer, train_files, separator)
    heldout = tokenize_files(tokenizer, heldout_files, separator)
    if train.size == 0 and heldout.size == 0:
        raise ValueError(
            f"empty corpus: none of the {len(files)} files could be read as UTF-8 text; "
            "pass readable text files (--files F ...)"
        )
    if train.size == 0 or heldout.size == 0:
        tokens = np.concatenate([train, heldout])
        cut = len(tokens) - max(1, int(len(tokens) * heldout_fraction))
        train, heldout = tokens[:cut], tokens[cut:]
    return TokenSplit(train=train, heldout=heldout)


def random_windows(
    tokens: np.ndarray, batch_size: int, length: int, generator: torch.Generator
) -> Int[Tensor, "batch length"]:
    """``batch_size`` contiguous windows of ``length`` ids, int64, starting at uniformly drawn
    positions (drawn from ``generator``, a CPU generator, so runs replay on any device)."""
    if batch_size < 1 or length < 1:
        raise ValueError(f"batch_size and length must be >= 1, got {batch_size} and {length}")
    if len(tokens) < length:
        raise ValueError(
            f"the training tokens ({len(tokens)}) are fewer than one window of {length}; "
            "use a larger corpus (--max-bytes, more --files) or a shorter --length"
        )
    starts = torch.randint(0, len(tokens) - length + 1, (batch_size,), generator=generator)
    index = starts.numpy()[:, None] + np.arange(length)
    return torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))


def heldout_windows(
    tokens: np.ndarray, batch_size: int, length: int, max_batches: int
) -> list[Int[Tensor, "batch length"]]:
    """Non-overlapping windows of ``length`` ids read from the start of ``tokens``, in batches
    of ``batch_size`` rows (the last may be smaller), at most ``max_batches`` batches."""
    if batch_size < 1 or length < 1 or max_batches < 1:
        raise ValueError(
            "batch_size, length and max_batches must be >= 1, got "
            f"{batch_size}, {length} and {max_batches}"
        )
    count = min(len(tokens) // length, batch_size * max_batches)
    if count == 0:
        raise ValueError(
            f"the held-out tokens ({len(tokens)}) are fewer than one window of {length}; "
            "use a larger corpus (--max-bytes, more --files) or a shorter --length"
        )
    windows = torch.from_numpy(np.asarray(tokens[: count * length], dtype=np.int64))
    return list(windows.view(count, length).split(batch_size))


def load_split(corpus_dir: Path) -> TokenSplit:
    """The cached ``train.npy`` / ``heldout.npy`` of a corpus folder (see the module docstring;
    a finished ``train-target`` model keeps its own under ``MODEL/corpus``)."""
    corpus_dir = Path(corpus_dir)
    paths = [corpus_dir / TRAIN_FILE, corpus_dir / HELDOUT_FILE]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(
            f"no tokenized corpus in {corpus_dir}: {missing} missing; build it with "
            "prepare_corpus (speculum train-target writes one into MODEL/corpus)"
        )
    train, heldout = (np.load(p) for p in paths)
    return TokenSplit(train=train, heldout=heldout)


def prepare_corpus(
    out_dir: Path,
    *,
    max_bytes: int,
    vocab_size: int,
    seed: int,
    files: Sequence[Path] | None = None,
    progress: bool = False,
) -> tuple[Tokenizer, TokenSplit]:
    """The tokenizer and token split of a corpus folder, built on first use and reused after.

    The corpus is ``files`` (default: the interpreter's installed ``.py`` files), sampled down
    to ``max_bytes`` with ``seed`` (:func:`~speculum.training.corpus.sample_files`). The
    tokenizer is trained on the training side only when ``out_dir/tokenizer.json`` is missing,
    else loaded; the arrays are tokenized and cached when missing, else loaded. A folder built
    with other options is refused rather than silently reused. ``progress`` names each phase
    on stderr (:func:`announce`).
    """
    out_dir = Path(out_dir)
    options: dict[str, Any] = {
        "max_bytes": max_bytes,
        "vocab_size": vocab_size,
        "seed": seed,
        "files": None if files is None else sorted(str(f) for f in files),
    }
    manifest = out_dir / MANIFEST_FILE
    if manifest.is_file():
        built = json.loads(manifest.read_text())["options"]
        changed = {k: (built.get(k), v) for k, v in options.items() if built.get(k) != v}
        if changed:
            described = ", ".join(
                f"{k}: built {old!r}, now {new!r}" for k, (old, new) in changed.items()
            )
            raise ValueError(
                f"the corpus in {out_dir} was built with other options ({described}); pass "
                "the same options, or delete the folder to rebuild it"
            )
    sample: list[Path] | None = None
    if not (out_dir / TOKENIZER_FILE).is_file():
        sample = _sample(files, max_bytes, seed, progress)
        train_files, _ = split_files(sample)
        announce(
            f"training a {vocab_size}-id tokenizer on {len(train_files or sample)} files...",
            enabled=progress,
        )
        train_tokenizer(train_files or sample, vocab_size, out_dir)
    tokenizer = load_tokenizer(out_dir)
    if (out_dir / TRAIN_FILE).is_file() and (out_dir / HELDOUT_FILE).is_file():
        announce(f"reusing the tokenized corpus in {out_dir}", enabled=progress)
        return tokenizer, load_split(out_dir)
    sample = sample if sample is not None else _sample(files, max_bytes, seed, progress)
    announce(f"tokenizing {len(sample)} files...", enabled=progress)
    split = tokenize_split(tokenizer, sample, special_id(tokenizer, EOS), seed)
    _save_array(split.train, out_dir / TRAIN_FILE)
    _save_array(split.heldout, out_dir / HELDOUT_FILE)
    train_files, heldout_files = split_files(sample)
    record = {
        "options": options,
        "train_tokens": int(split.train.size),
        "heldout_tokens": int(split.heldout.size),
        "train_files": [str(f) for f in train_files],
        "heldout_files": [str(f) for f in heldout_files],
    }
    partial = manifest.with_name(manifest.name + ".partial")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, manifest)
    return tokenizer, split


def _sample(files: Sequence[Path] | None, max_bytes: int, seed: int, progress: bool) -> list[Path]:
    """The corpus sample of :func:`prepare_corpus`, announced first (reading it takes a while)."""
    described = "the .py files installed with this Python" if files is None else "the files given"
    announce(
        f"reading the corpus: up to {max_bytes / 1e6:.3g} MB of {described}...", enabled=progress
    )
    return sample_files(installed_python_files() if files is None else files, max_bytes, seed)


def _save_array(array: np.ndarray, path: Path) -> None:
    # Write then rename, so an interrupted run never leaves a truncated array that a later run
    # would load as the whole corpus.
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        np.save(handle, array)
    os.replace(partial, path)
