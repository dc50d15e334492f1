"""The training corpus every machine has: the ``.py`` files installed with the running interpreter.

The standard library and site-packages hold hundreds of megabytes of real Python (this project's
own dependencies, torch and numpy, among them), so a code model can be trained with no download.
Test folders are left out: they are dominated by fixtures and generated data.

Sampling and splitting hash a file's *name relative to the interpreter folder that holds it*
(``json/decoder.py``, ``numpy/linalg/_linalg.py``), not its absolute path, so the same
interpreter installed under another prefix yields the same sample and the same split. Files
outside those folders (a user's own ``--files``) are named by their path as given.
"""

from __future__ import annotations

import functools
import hashlib
import os
import site
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "EXCLUDED_DIRS",
    "installed_python_files",
    "interpreter_roots",
    "read_text",
    "sample_files",
    "shuffle_files",
    "split_files",
]

#: Directory names whose contents are never part of the corpus.
EXCLUDED_DIRS = frozenset({"test", "tests", "testing", "idle_test", "__pycache__"})


def interpreter_roots() -> list[Path]:
    """The standard library and site-packages folders of the running interpreter, deduplicated
    (``site.getsitepackages()`` and ``sysconfig``'s purelib/platlib usually overlap)."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], *site.getsitepackages(), paths["purelib"], paths["platlib"]]
    roots: list[Path] = []
    for candidate in candidates:
        root = Path(candidate).absolute()
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


def installed_python_files(roots: Sequence[Path] | None = None) -> list[Path]:
    """Every ``.py`` file under ``roots`` (default: :func:`interpreter_roots`), sorted.

    Paths with a directory named ``test``, ``tests``, ``testing``, ``idle_test`` or
    ``__pycache__`` below their root are excluded (the root's own location does not count, so a
    virtual environment under ``/home/tests/`` still has a corpus). A file reachable from two
    roots (site-packages inside the standard library's folder) is listed once.
    """
    roots = interpreter_roots() if roots is None else [Path(r) for r in roots]
    found: set[Path] = set()
    for root in roots:
        for folder, dirs, names in os.walk(root):
            # Pruning in place stops os.walk from descending into excluded folders at all.
            dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
            found.update(Path(folder, n) for n in names if n.endswith(".py"))
    if not found:
        raise ValueError(
            f"no .py files under {[str(r) for r in roots]}: this interpreter has no readable "
            "standard library or site-packages; pass the text files to train on explicitly "
            "(--files F ...)"
        )
    return sorted(found)


def _name(path: Path) -> str:
    """``path`` relative to the deepest interpreter root holding it, else the path as given."""
    absolute = Path(path).absolute()
    best: Path | None = None
    for root in _cached_roots():
        if absolute.is_relative_to(root) and (best is None or len(root.parts) > len(best.parts)):
            best = root
    return Path(path).as_posix() if best is None else absolute.relative_to(best).as_posix()


@functools.cache
def _cached_roots() -> tuple[Path, ...]:
    # The roots of a running interpreter do not change; computing them once keeps naming
    # thousands of files cheap.
    return tuple(interpreter_roots())


def _hash(*parts: str) -> int:
    """A 64-bit blake2b hash of ``parts``, the same on every machine and Python run (unlike
    ``hash``, which is salted per process)."""
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def read_text(path: Path) -> str | None:
    """The UTF-8 text of ``path``, or ``None`` when it cannot be read or is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def shuffle_files(files: Iterable[Path], seed: int) -> list[Path]:
    """``files`` without duplicates, in the order of a hash of ``(seed, name)``: a shuffle that
    is the same on every machine and never depends on which other files are present."""
    return sorted({Path(f) for f in files}, key=lambda f: (_hash(str(seed), _name(f)), str(f)))


def sample_files(files: Iterable[Path], max_bytes: int, seed: int) -> list[Path]:
    """A deterministic sample of about ``max_bytes`` of text from ``files``.

    Files are ordered by a hash of ``(seed, name)`` (the name relative to its interpreter root,
    see the module docstring) and taken in that order until their UTF-8 text reaches
    ``max_bytes`` (the last file taken may overshoot). Files that cannot be read as UTF-8, or
    are empty or blank (most ``__init__.py``), are skipped: they would add only separators.
    The sample is returned in the hash order.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    ordered = shuffle_files(files, seed)
    taken: list[Path] = []
    total = 0
    for path in ordered:
        if total >= max_bytes:
            break
        text = read_text(path)
        if text is None or not text.strip():
            continue
        taken.append(path)
        total += len(text.encode("utf-8"))
    if not taken:
        raise ValueError(
            f"empty corpus: none of the {len(ordered)} files given is readable, non-empty UTF-8 "
            "text; pass existing text files (--files F ...) or leave --files out to use the "
            "interpreter's installed .py files"
        )
    return taken


def split_files(
    files: Iterable[Path], heldout_fraction: float = 0.05
) -> tuple[list[Path], list[Path]]:
    """``(train, heldout)``: a file is held out when a blake2b hash of its name falls in the
    first ``heldout_fraction`` of the hash range.

    The side a file lands on depends on its name alone, never on the other files, so adding or
    removing files (a bigger sample, another seed) never moves a held-out file into training.
    Order within each side is kept.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    cut = heldout_fraction * 2**64
    train: list[Path] = []
    heldout: list[Path] = []
    for path in files:
        (heldout if _hash("split", _name(path)) < cut else train).append(path)
    return train, heldout
