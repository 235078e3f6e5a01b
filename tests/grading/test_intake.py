"""Intake (issue 32 item 3): which file in a learner's folder is graded, one rule for class
grading and the Gradescope bundle; notebooks by their code cells, cell and line kept; zip
archives read in memory under limits; an empty folder said to be empty; a mixed class graded
by its majority lab, the others skipped with their lab and the command that grades them."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import zipfile
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.grading import grade, intake
from attnlab.grading.classroom import autograder, batch
from attnlab.grading.submission import Unreadable

REPO = Path(__file__).resolve().parents[2]
SOLUTION = REPO / "labs" / "track1" / "01-attention" / "solutions" / "attention.py"
STUB = REPO / "labs" / "track1" / "01-attention" / "attention.py"
MASKS = REPO / "labs" / "track1" / "02-masks" / "solutions" / "masks.py"
OTHERS = tuple(f for f in labs.LAB_FILES if f != "attention.py")


def _notebook(path: Path, cells: list[str], kind: str = "code") -> Path:
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
          "cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# my lab\n"]}]
          + [{"cell_type": kind, "metadata": {}, "execution_count": None, "outputs": [],
              "source": [line + "\n" for line in c.splitlines()]} for c in cells]}
    path.write_text(json.dumps(nb))
    return path


def _solution_cells() -> list[str]:
    return SOLUTION.read_text().split("\n\n\n")


@pytest.mark.parametrize("name,kind", [("attention.py", "exact"), ("Attention.py", "case"), ("ATTENTION.PY", "case"),
                                       ("attention (1).py", "lms"), ("attention(2).py", "lms"),
                                       ("attention-3.py", "lms"), ("attention_1.py", "lms"),
                                       ("my_attention.py", None), ("attention.py.bak", None),
                                       ("attention (1234).py", None)])
def test_the_lab_files_other_spellings(name, kind):
    assert intake.is_variant(name, "attention.py") == kind


def test_one_rule_chooses_in_a_folder(tmp_path):
    cases = {
        "exact": (["attention.py", "notes.py"], "attention.py", ""),
        "case": (["Attention.py"], "Attention.py", "another case"),
        "lms": (["attention (1).py", "README.md"], "attention (1).py", "LMS re-download"),
        "notebook": (["attention.ipynb", "helper.py", "other.py"], "attention.ipynb", "notebook"),
        "only_py": (["mine.py", "data.txt"], "mine.py", "only .py"),
        "zip": (["sub.zip"], "sub.zip", "zip"),
    }
    for case, (files, want, how) in cases.items():
        folder = tmp_path / case
        folder.mkdir()
        for f in files:
            (folder / f).write_text("x = 1\n")
        choice = intake.choose(folder, "attention.py", OTHERS)
        assert choice.path == folder / want and how in choice.how, (case, choice)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert intake.choose(empty, "attention.py").why == "the folder is empty"
    two = tmp_path / "two"
    two.mkdir()
    for f in ("a.py", "b.py"):
        (two / f).write_text("")
    assert "2 .py files and none is attention.py" in intake.choose(two, "attention.py").why
    other = tmp_path / "other"
    other.mkdir()
    (other / "masks.py").write_text("")
    assert "another lab's file" in intake.choose(other, "attention.py", OTHERS).why
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "attention.py").symlink_to(SOLUTION)
    assert intake.choose(linked, "attention.py", OTHERS).path is None  # a link is never taken


def test_a_notebook_is_graded_by_its_code_cells_with_cells_and_lines(tmp_path):
    cells = _solution_cells()
    cells.insert(3, "X = torch.randn(1, 4, 8)\nprint(X.shape)")  # an experiment: left out, and said so
    nb = _notebook(tmp_path / "attention.ipynb", cells)
    report = grade(nb, lab="01", sandbox="none", seed=1)
    assert report.score == 100, report.to_text()
    assert "left out" in report.to_text() and "(cell 5: calls" in report.to_text()  # (cell 1 is markdown)
    # a mistake in a cell: its traceback says the cell and the line
    broken = [c.replace("return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])", "return Q @ K.T") for c in cells]
    report = grade(_notebook(tmp_path / "broken.ipynb", broken), lab="01", sandbox="none", seed=1)
    cell = next(i for i, c in enumerate(broken, start=2) if "def attention_scores" in c)
    text = report.to_text()
    assert f'File "attention.py", cell {cell}, line ' in text and "[wrong_transpose]" in text, text
    assert "submission.py" not in text and "NameError" not in text


def test_magics_and_shell_lines_are_refused_with_their_cell(tmp_path):
    cells = _solution_cells()
    cells.insert(1, "!pip install jaxtyping\n%matplotlib inline")
    report = grade(_notebook(tmp_path / "attention.ipynb", cells), lab="01", sandbox="none", seed=1)
    assert report.score == 0 and "none of it was run" in report.problem
    assert "cell 3, line 1: a shell line (!pip install jaxtyping)" in report.problem
    assert "cell 3, line 2: an IPython magic (%matplotlib inline)" in report.problem


@pytest.mark.parametrize("body,why", [(b"{not json", "not valid JSON"), (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
                                      (b'{"cells": 3}', "no list of cells")])
def test_a_broken_notebook_is_said_to_be_broken(body, why):
    with pytest.raises(Unreadable, match=why):
        intake.prepare("attention.ipynb", body)


def _zip(members: dict, links: tuple[str, ...] = ()) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        for name in links:
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            z.writestr(info, "/etc/passwd")
    return buf.getvalue()


def test_a_zip_is_read_in_memory_under_limits():
    solution = SOLUTION.read_bytes()
    got = intake.prepare("ann.zip", _zip({"lab/Attention.py": solution, "lab/notes.md": "hi"}))
    assert got.source == solution and "graded lab/Attention.py from the zip archive ann.zip" in got.notes
    with pytest.raises(Unreadable, match="outside its folder"):
        intake.prepare("x.zip", _zip({"../attention.py": solution}))
    with pytest.raises(Unreadable, match="outside its folder"):
        intake.prepare("x.zip", _zip({"/etc/attention.py": solution}))
    # a link member is never followed: with the real file beside it, the real one is taken
    got = intake.prepare("x.zip", _zip({"real/attention.py": solution}, links=("attention.py",)))
    assert got.source == solution
    with pytest.raises(Unreadable, match="members"):
        intake.prepare("x.zip", _zip({f"f{i}.txt": "" for i in range(intake.ZIP_MAX_MEMBERS + 1)}))
    # a member that inflates past the cap is stopped at the cap, whatever its header says
    with pytest.raises(Unreadable, match="larger than"):
        intake.prepare("x.zip", _zip({"attention.py": b"#" * (intake.MAX_SOURCE_BYTES + 10)}))
    with pytest.raises(Unreadable, match="cannot be read"):
        intake.prepare("x.zip", b"PK\x03\x04 not really a zip")
    with pytest.raises(Unreadable, match="another lab's file"):
        intake.prepare("x.zip", _zip({"masks.py": "x = 1"}), "attention.py", OTHERS)


def test_notebook_and_zip_are_graded_from_the_command_line(tmp_path, capsys):
    from attnlab.cli import main

    nb = _notebook(tmp_path / "attention.ipynb", _solution_cells())
    assert main(["grade", str(nb), "--no-sandbox", "--seed", "1", "--no-images"]) == 0
    archive = tmp_path / "hand-in.zip"
    archive.write_bytes(_zip({"attention.py": SOLUTION.read_bytes()}))
    assert main(["grade", str(archive), "--lab", "01", "--no-sandbox", "--seed", "1", "--no-images"]) == 0
    out = capsys.readouterr().out
    assert out.count("Score: 100/100") == 2 and "from the zip archive hand-in.zip" in out


@pytest.mark.sandbox
def test_a_messy_class_is_graded_whole(tmp_path, bwrap):
    """An LMS export as it comes: a capitalised name, a re-download, a notebook, a zip, the only
    .py file, an empty folder, a stub, and one learner of another lab."""
    cls = tmp_path / "class"
    for learner, name, src in (("ann", "attention.py", SOLUTION), ("Ned", "Attention.py", SOLUTION),
                               ("olga", "attention (1).py", SOLUTION), ("mo", "my_attention.py", SOLUTION),
                               ("sam", "attention.py", STUB), ("zed", "masks.py", MASKS)):
        (cls / learner).mkdir(parents=True)
        shutil.copy(src, cls / learner / name)
    (cls / "hank").mkdir()
    _notebook(cls / "hank" / "attention.ipynb", _solution_cells())
    (cls / "ivy").mkdir()
    (cls / "ivy" / "submission.zip").write_bytes(_zip({"work/attention.py": SOLUTION.read_bytes()}))
    (cls / "empty").mkdir()
    result = batch.grade_class(cls, tmp_path / "out", seed=3)
    assert result.lab.name == "01-attention"
    scores = {r.learner: r.total for r in result.rows}
    assert scores == {"ann": 100, "Ned": 100, "olga": 100, "mo": 100, "hank": 100, "ivy": 100, "sam": 0}, scores
    skipped = {s.name: s.reason for s in result.skipped}
    assert skipped["empty"] == "the folder is empty"
    assert "a lab 02-masks submission" in skipped["zed"] and "--lab 02" in skipped["zed"]
    ned = json.loads((tmp_path / "out" / "Ned" / "results.json").read_text())
    assert "Note: graded Attention.py: named like the lab's file in another case" in ned["output"]
    olga = json.loads((tmp_path / "out" / "olga" / "results.json").read_text())
    assert "an LMS re-download" in olga["output"]


def test_gradescope_takes_the_same_rule(tmp_path):
    sub = tmp_path / "submission"
    sub.mkdir()
    shutil.copy(SOLUTION, sub / "attention (2).py")
    path, how = autograder.choose_submission(sub, "attention.py")
    assert path == sub / "attention (2).py" and "LMS re-download" in how
    (sub / "attention.py").write_text("x = 1\n")
    assert autograder.choose_submission(sub, "attention.py") == (sub / "attention.py", "")
    os.remove(sub / "attention.py")
    os.remove(sub / "attention (2).py")
    assert autograder.find_submission(sub, "attention.py") == sub / "attention.py"  # nothing: graded as 'no file'
