"""Every ```python block of README.md and docs/*.md runs as written, on the CPU, in a fresh folder.

Each block is a complete example (its own imports, a model folder it writes itself, no
placeholder paths), so a reader can paste it into a file and run it. Examples that need a GPU or
several processes are fenced as ``console`` or ``text`` instead and are not collected here. A
block runs as its own ``python`` process with an empty temporary folder as the working directory,
so it cannot lean on the test suite's imports or on files another block wrote.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: A fenced block opened by a line that is exactly ```python and closed by the next ``` line.
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
#: The longest one example may take: each runs in a few seconds on the CPU.
_TIMEOUT_S = 120


def python_blocks() -> list[tuple[str, int, int, str]]:
    """``(file relative to the repository, block index in the file, line, code)`` of every
    ```python block of README.md and docs/*.md."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for index, match in enumerate(_PYTHON_BLOCK.finditer(text)):
            line = text.count("\n", 0, match.start()) + 2  # the block's first line of code
            found.append((path.relative_to(ROOT).as_posix(), index, line, match.group(1)))
    return found


BLOCKS = python_blocks()


def test_the_docs_have_python_examples() -> None:
    """The extraction finds the blocks (a changed fence style would otherwise pass vacuously)."""
    assert any(name == "README.md" for name, *_ in BLOCKS)
    assert len({name for name, *_ in BLOCKS}) >= 5


@pytest.mark.parametrize(
    ("name", "index", "line", "code"), BLOCKS, ids=[f"{b[0]}#{b[1]}" for b in BLOCKS]
)
def test_python_block_runs_as_written(name, index, line, code, tmp_path: Path) -> None:
    """The block exits with status 0 when run as a script in an empty folder."""
    script = tmp_path / "example.py"
    script.write_text(code)
    work = tmp_path / "work"
    work.mkdir()
    # The checkout's speculum, whether or not it is installed; a reader's environment has no
    # test-only settings, so the suite's type-checking switch is not passed on.
    env = {k: v for k, v in os.environ.items() if k != "SPECULUM_TYPECHECK"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    # The folders an example makes with tempfile go under pytest's, which cleans them up.
    env["TMPDIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{name}, block {index} (line {line}) failed:\n{done.stdout}\n{done.stderr}"
    )
