"""Every Python block of the README and of the guides in docs/ runs as written, each in a fresh interpreter in an empty
folder; a block whose first line is ``# run with: <command>`` is saved under the file name the
command names and run with that command (``torchrun`` is this environment's)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess]

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCKS = [b for page in PAGES for b in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)]
LAUNCHER = re.compile(r"^# run with: (.+)$", re.M)


def _ids() -> list[str]:
    out = []
    for i, block in enumerate(BLOCKS):
        first = next((line for line in block.splitlines() if line.startswith(("from attnlab", "import attnlab"))),
                     block.splitlines()[0])
        out.append(f"{i}:{first[:40]}")
    return out


def test_the_readme_has_its_blocks():
    assert len(BLOCKS) >= 8  # a parse that found nothing must not pass


@pytest.mark.parametrize("block", BLOCKS, ids=_ids())
def test_a_readme_block_runs_as_written(block, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    first = block.splitlines()[0]
    launcher = LAUNCHER.match(first)
    if launcher:
        argv = shlex.split(launcher.group(1))
        script = next(a for a in argv if a.endswith(".py"))
        (tmp_path / script).write_text(block)
        if argv[0] == "torchrun":  # this environment's launcher, as a user's PATH would give it
            argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
        elif argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
    else:
        (tmp_path / "block.py").write_text(block)
        argv = [sys.executable, "block.py"]
    run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, f"$ {' '.join(argv)}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"


def test_a_block_that_cannot_run_alone_fails_here(tmp_path):
    """The check is not vacuous: a block using a name it never defines (as the README's
    assert_close_to_sdpa block once did with my_attention) fails."""
    (tmp_path / "block.py").write_text("from attnlab.testing import assert_close_to_sdpa\n"
                                       "assert_close_to_sdpa(my_attention, q, k, v)\n")
    run = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "NameError" in run.stderr
