"""What the tests of every lab share: grading buggy variants, reading the named mistakes,
running a lab's walkthrough notebook (tests/labs/test_every_lab.py)."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import jupytext
from nbclient import NotebookClient

from attnlab.grading import grade
from attnlab.grading.sandbox import pool

LABS = Path(__file__).resolve().parents[2] / "labs" / "track1"


def grade_variants(lab: str, file: str, variants: dict, root: Path, seed: int) -> dict:
    """Each variant (``name -> ([(old, new), ...], expectations)``) applied to the lab's solution,
    written to ``root/<name>/<lab>/<file>`` (the lab's folder name, so the grader picks it)
    and graded; returns ``name -> GradeReport``."""
    solution = (LABS / lab / "solutions" / file).read_text()
    paths = {}
    for name, (edits, _) in variants.items():
        text = solution
        for old, new in edits:
            assert old in text, old  # an edit that no longer applies would test nothing
            text = text.replace(old, new)
        folder = root / name / lab
        folder.mkdir(parents=True)
        (folder / file).write_text(text)
        paths[name] = folder / file
    # two sandboxes at once, forked from one class template, as class grading does
    with pool.class_template("auto"), ThreadPoolExecutor(max_workers=2) as workers:
        reports = workers.map(lambda path: grade(path, seed=seed), paths.values())
        return dict(zip(paths, reports))


def codes(report, ex_id: str) -> set[str]:
    """The named mistakes an exercise's checks reported."""
    return {f["code"] for r in report.results if r.exercise.id == ex_id for f in r.verdict.findings}


def run_walkthrough(lab: str, file: str, learner_file: Path, folder: Path) -> str:
    """Check the walkthrough's .py and .ipynb are paired, run it on ``learner_file`` and
    return the text of every output (raises CellExecutionError where a cell fails)."""
    from_py = jupytext.read(LABS / lab / "walkthrough.py")
    from_ipynb = nbformat.read(LABS / lab / "walkthrough.ipynb", as_version=4)
    assert [(c.cell_type, c.source) for c in from_py.cells] == [(c.cell_type, c.source) for c in from_ipynb.cells], \
        f"walkthrough.py and walkthrough.ipynb differ: run `jupytext --sync labs/track1/{lab}/walkthrough.py`"
    shutil.copy(LABS / lab / "walkthrough.ipynb", folder / "walkthrough.ipynb")
    shutil.copy(learner_file, folder / file)
    nb = nbformat.read(folder / "walkthrough.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
