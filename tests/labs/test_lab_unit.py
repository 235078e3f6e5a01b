"""A lab is one unit: one module in attnlab/labs/ plus one folder of materials. Every folder
of labs/track1 has its module and its data-files entry; a lab defined only in a test (the
tiny fixture lab, tests/helpers/tiny_lab.py) is graded end to end through grade(), its own
rule text included, with nothing under attnlab.grading knowing it."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.grading import grade
from helpers import tiny_lab

REPO = Path(__file__).resolve().parents[2]


def test_every_lab_folder_has_a_module_and_data_files():
    folders = sorted(p.name for p in (REPO / "labs" / "track1").iterdir() if p.is_dir())
    assert folders == sorted(lab.name for lab in labs.LABS)
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    for lab in labs.LABS:
        module = importlib.import_module(lab.module)
        assert module.LAB is lab and module.__name__.startswith("attnlab.labs.lab"), lab
        assert lab.rule and lab.rule != labs.LABS[0].rule or lab is labs.LABS[0], lab.name  # its own rule
        shipped = data[f"share/attnlab/labs/track1/{lab.name}"]
        assert sorted(shipped) == sorted(f"labs/track1/{lab.name}/{f}" for f in lab.files), lab.name
        # the solution ships apart (for 'labs get NN --solution' only), never among what a learner gets
        assert data[f"share/attnlab/labs/track1/{lab.name}/solutions"] == [f"labs/track1/{lab.name}/solutions/{lab.file}"]


def test_no_module_under_grading_belongs_to_a_lab():
    grading = REPO / "src" / "attnlab" / "grading"
    for path in grading.rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m.startswith("attnlab.labs.lab") for m in imported), path  # only the registry
        assert not path.name.startswith("lab0"), path


@pytest.mark.subprocess  # even mode 'none' runs the file in a server process of its own
@pytest.mark.parametrize("sandbox", ["none", pytest.param("bwrap", marks=pytest.mark.sandbox)])
def test_a_lab_added_in_a_test_is_graded_end_to_end(tmp_path, sandbox, request):
    if sandbox == "bwrap":
        request.getfixturevalue("bwrap")
    folder = tmp_path / "99-tiny"
    folder.mkdir()
    right, wrong, cheat = (folder / n for n in ("tiny.py", "wrong.py", "cheat.py"))
    right.write_text("import math\n\ndef scale(scores, d_k):\n    return scores / math.sqrt(d_k)\n")
    wrong.write_text("def scale(scores, d_k):\n    return scores / d_k\n")
    cheat.write_text("import torch\n\ndef scale(scores, d_k):\n    return torch.softmax(scores, -1)\n")
    got = {p.name: grade(p, lab=tiny_lab.LAB, sandbox=sandbox, seed=3) for p in (right, wrong, cheat)}
    assert got["tiny.py"].score == 100 and got["tiny.py"].lab == "99-tiny", got["tiny.py"].to_text()
    assert got["wrong.py"].score == 0
    assert "you divided by d_k" in got["wrong.py"].to_text()
    assert got["cheat.py"].score == 0
    assert "This tiny lab scales scores by hand" in got["cheat.py"].to_text(), got["cheat.py"].to_text()


@pytest.mark.subprocess
def test_a_lab_added_in_a_test_grades_a_whole_class(tmp_path):
    """Class mode passes the Lab object from the plan to every row and the report: the tiny
    lab is registered nowhere, so a lookup by its name anywhere on the way would fail."""
    from attnlab.grading.classroom import batch

    cls = tmp_path / "class"
    for learner, body in (("ann", "import math\n\ndef scale(scores, d_k):\n    return scores / math.sqrt(d_k)\n"),
                          ("bob", "def scale(scores, d_k):\n    return scores / d_k\n")):
        (cls / learner).mkdir(parents=True)
        (cls / learner / "tiny.py").write_text(body)
    result = batch.grade_class(cls, tmp_path / "out", sandbox="none", seed=1, lab=tiny_lab.LAB)
    assert result.lab is tiny_lab.LAB
    scores = {r.learner: (r.total, r.max_total, set(r.exercises)) for r in result.rows}
    ids = {ex.id for ex in tiny_lab.LAB.exercises()}
    assert scores == {"ann": (100, 100, ids), "bob": (0, 100, ids)}, scores
    page = (tmp_path / "out" / "report.html").read_text()
    assert "lab 99-tiny" in page and all(f"<td>{i}</td>" in page for i in ids)
