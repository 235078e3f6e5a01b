"""The learner's and the instructor's paths around the labs (issue 22): ``attnlab grade`` in a
``labs get`` folder grades that folder's file, a class is found from what is on disk (its lab,
names in any script), and a user's mistake on the command line ends in one line, exit 2,
never a traceback."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.cli import main
from attnlab.grading import batch, launch

ROOT = Path(__file__).resolve().parents[1]
TRACK = ROOT / "labs" / "track1"
SOLUTION_01 = TRACK / "01-attention" / "solutions" / "attention.py"
SOLUTION_02 = TRACK / "02-masks" / "solutions" / "masks.py"
STUB_02 = TRACK / "02-masks" / "masks.py"


def _sandbox_or_skip() -> None:
    if launch.bwrap_path() is None:
        if os.environ.get("CI"):
            pytest.fail("bwrap is missing: 'make test' installs bubblewrap", pytrace=False)
        pytest.skip("bwrap is not installed (make test installs it)")


# --------------------------------------------------------------------------- grade with no path
def test_grade_with_no_path_grades_the_lab_file_of_this_folder(tmp_path, monkeypatch, capsys):
    """A lab 02 folder made by 'labs get', outside the clone, with the solution in it: 100/100 of
    lab 02 shows it graded this folder's masks.py (the old default graded the clone's lab 01 stub: 0)."""
    _sandbox_or_skip()
    folder = tmp_path / "my lab"
    assert main(["labs", "get", "02", str(folder)]) == 0
    shutil.copyfile(SOLUTION_02, folder / "masks.py")
    monkeypatch.chdir(folder)
    capsys.readouterr()
    assert main(["grade", "--no-images", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == f"grading {folder / 'masks.py'} (lab 02-masks)"  # the first line
    out = captured.out.strip().splitlines()
    assert out[0] == f"attnlab grade (lab 02-masks): {folder / 'masks.py'}"
    assert out[-1] == f"All checks pass in {folder / 'masks.py'}."  # the last line names it too
    assert "Score: 100/100" in captured.out


def test_grade_with_no_path_in_a_stub_folder_says_where_to_start(tmp_path, monkeypatch, capsys):
    _sandbox_or_skip()
    assert main(["labs", "get", "01", str(tmp_path / "l1")]) == 0
    monkeypatch.chdir(tmp_path / "l1")
    capsys.readouterr()
    assert main(["grade", "--no-images", "--seed", "3"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("Start with ex1: project_qkv() in attention.py, then run 'attnlab grade' again")
    assert str(tmp_path / "l1" / "attention.py") in out[-1]


def test_grade_with_no_path_and_no_lab_file_explains(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["grade"]) == 2
    err = capsys.readouterr().err
    assert "no lab file in" in err and "attention.py, masks.py, multihead.py, flash.py" in err
    assert "attnlab labs get 01" in err
    (tmp_path / "attention.py").write_text("")
    (tmp_path / "masks.py").write_text("")
    assert main(["grade"]) == 2
    assert "more than one lab's file (attention.py, masks.py)" in capsys.readouterr().err


def test_lab_file_in_finds_each_labs_own_file(tmp_path):
    for lab in labs.LABS:
        folder = tmp_path / lab.name
        folder.mkdir()
        (folder / lab.file).write_text("")
        assert labs.lab_file_in(folder) == (lab, folder / lab.file)


# --------------------------------------------------------------------------- a class from what is on disk
def _make(folder: Path, entries: dict[str, Path]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in entries.items():
        target = folder / name
        if name.endswith(".py"):
            shutil.copyfile(source, target)
        else:
            target.mkdir()
            shutil.copyfile(source, target / source.name)
    return folder


def test_names_in_any_script_are_graded_with_plain_collision_free_folders(tmp_path):
    cls = _make(tmp_path / "c", {"José": SOLUTION_02, "zoë.py": STUB_02, "Li Wei": SOLUTION_02,
                                 "Li_Wei": SOLUTION_02, "李伟": SOLUTION_02, "a*b": SOLUTION_02})
    subs, skipped = batch.find_submissions(cls, "masks.py")
    names = {s.learner: s.folder for s in subs}
    assert set(names) == {"José", "zoë", "Li Wei", "Li_Wei", "李伟"}
    folders = list(names.values())
    assert len(set(f.lower() for f in folders)) == len(folders)  # no two learners share a folder
    assert all(f.isascii() and "/" not in f and " " not in f for f in folders)
    assert names["Li_Wei"] == "Li_Wei" and names["José"].startswith("Jose-") and names["zoë"].startswith("zoe-")
    assert [(s.name, s.reason) for s in skipped] == [
        ("a*b", "the name has the character '*' (U+002A): rename it using letters, digits, spaces and "
                "\".,'\u2019-_@+()\" only")]


def test_a_class_of_lab_02_is_found_to_be_lab_02(tmp_path):
    cls = _make(tmp_path / "c", {"ann": SOLUTION_02, "bob.py": STUB_02})
    plan = batch.plan_class(cls)
    assert plan.lab.name == "02-masks" and [s.learner for s in plan.submissions] == ["ann", "bob"]


def test_a_class_that_mixes_labs_or_is_empty_is_refused(tmp_path, capsys):
    mixed = _make(tmp_path / "mixed", {"ann": SOLUTION_02, "bob": SOLUTION_01, "cat": SOLUTION_02})
    with pytest.raises(batch.ClassRefused, match=r"mix labs \(lab 01-attention: 1 \(bob\); lab 02-masks: 2"):
        batch.plan_class(mixed)
    assert batch.plan_class(mixed, lab="02").lab.name == "02-masks"  # --lab chooses
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (mixed, empty):
        out = tmp_path / f"out-{folder.name}"
        assert main(["grade", str(folder), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("--lab" in err)
        assert not out.exists()  # refused before anything was written
    assert "the folder is empty" in str(pytest.raises(batch.ClassRefused, batch.plan_class, empty).value)
    # lab 01 asked for a lab 02 class: nobody to grade, and the skip reasons say why
    with pytest.raises(batch.ClassRefused, match="another lab's file; see --lab"):
        batch.plan_class(_make(tmp_path / "two", {"ann": SOLUTION_02}), lab="01")


def test_out_inside_the_class_folder_is_refused(tmp_path):
    cls = _make(tmp_path / "c", {"ann": SOLUTION_02})
    for out in (cls / "graded", cls, tmp_path):
        with pytest.raises(batch.ClassRefused, match="must be outside the class folder"):
            batch.plan_class(cls, out)


def test_grades_csv_keeps_real_names_and_quotes_formulas(tmp_path):
    rows = [batch.Row("José", 10, 100, {"ex1": 10}, [], 1, 0.5, "graded", folder="Jose-abc"),
            batch.Row("=HYPERLINK(1)", 0, 100, {}, [], 2, 0.5, "graded", folder="HYPERLINK_1")]
    exercises = labs.find_lab("02").exercises()
    batch.write_csv(rows, tmp_path / "g.csv", exercises)
    read = list(csv.DictReader((tmp_path / "g.csv").open(encoding="utf-8")))
    assert [(r["learner"], r["folder"]) for r in read] == [("'=HYPERLINK(1)", "HYPERLINK_1"), ("José", "Jose-abc")]


def test_a_unicode_class_is_graded_end_to_end(tmp_path, capsys):
    _sandbox_or_skip()
    cls = _make(tmp_path / "class", {"José": SOLUTION_02, "zoë.py": STUB_02, "Li Wei": SOLUTION_02})
    out = tmp_path / "graded"
    assert main(["grade", str(cls), "--out", str(out), "--seed", "5", "--jobs", "2"]) == 0
    captured = capsys.readouterr()
    assert "graded 3 learners of lab 02-masks" in captured.out
    rows = {r["learner"]: r for r in csv.DictReader((out / "grades.csv").open(encoding="utf-8"))}
    assert {k: v["total"] for k, v in rows.items()} == {"José": "100", "Li Wei": "100", "zoë": "0"}
    for r in rows.values():
        assert (out / r["folder"] / "results.json").is_file()
    assert "José" in (out / "report.html").read_text(encoding="utf-8")


def test_one_learner_in_a_class_is_singular(tmp_path, capsys):
    _sandbox_or_skip()
    cls = _make(tmp_path / "class", {"ann.py": SOLUTION_02})
    assert main(["grade", str(cls), "--out", str(tmp_path / "o"), "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "graded 1 learner of lab 02-masks" in out and "1 learners" not in out


# --------------------------------------------------------------------------- no traceback, ever
BAD_COMMANDS = [
    (["grade", "--json", "/nonexistent/dir/r.json", str(SOLUTION_01)], "/nonexistent"),
    (["grade", "nosuch.py"], "no file or folder 'nosuch.py'"),
    (["grade", "--timeout", "-1"], "--timeout"),
    (["grade", "--timeout", "nan"], "--timeout"),
    (["grade", "--lab", "99", str(SOLUTION_01)], "no lab '99'"),
    (["grade", str(SOLUTION_01), "--out", "x"], "--out and --resume are for a folder"),
    (["grade", "--bogus-flag"], "usage: attnlab grade"),
    (["explain", "--out", "/nonexistent/x.html"], "does not exist"),
    (["explain", "--out", "."], "is a folder"),
    (["explain", "--out", "x.html", "--seq-len", "5000"], "--seq-len 5000"),
    (["plot", "example", "--out", "/nonexistent/x.png"], "does not exist"),
    (["plot", "example", "--out", "x.jpg"], "must end in .png or .svg"),
    (["example", "--seq-len", "100000"], "the worked example is for small sizes"),
    (["example", "--seq-len", "-4"], "--seq-len"),
    (["example", "--dtype", "int8"], "--dtype"),
    (["labs", "get", "01", "/proc/nope"], "cannot put the lab in /proc/nope"),
    (["labs", "get", "99"], "no lab '99'"),
    (["labs", "get"], "usage: attnlab labs get"),
    (["bench", "--seq-lens", "-5"], "--seq-lens"),
    (["bench", "--csv", "/nonexistent/b.csv"], "does not exist"),
    (["bench", "--plot", "/nonexistent/b.png"], "does not exist"),
    (["bench", "--max-memory-gb", "0"], "--max-memory-gb"),
    (["bench", "--warmup", "-1"], "--warmup"),
    (["autograder", "--out", "/nonexistent/a.zip"], "does not exist"),
    (["autograder", "--out", "a.zip", "--lab", "99"], "no lab '99'"),
    (["autograder", "--out", "a.zip", "--test", "/nonexistent.py"], "--test"),
    (["autograder", "--out", "a.zip", "--wheel", "/nonexistent.whl"], "--wheel"),
    (["doctor", "nosuch_module_xyz:fn"], "cannot import nosuch_module_xyz"),
    (["doctor", "garbage"], "expected MODULE:FUNCTION"),
    (["doctor", "/nonexistent.py:fn"], "no such file"),
    (["ring", "--seq-len", "1001"], "does not split into 2 equal parts"),
    (["ring", "--world", "0"], "--world"),
    (["ring", "--heads", "8", "--kv-heads", "3"], "--kv-heads 3 must divide --heads 8"),
    (["ring", "--seq-len", "100000000", "--heads", "64"], "choose smaller sizes"),
    (["masks", "show", "causal", "--L", "-3"], "--L"),
    (["masks", "show", "causal", "--L", "100000"], "at most 200"),
    (["masks"], "attnlab masks show"),
    (["nosuchcommand"], "invalid choice"),
]


@pytest.mark.parametrize("argv,expect", BAD_COMMANDS, ids=[" ".join(a)[:60] for a, _ in BAD_COMMANDS])
def test_a_bad_value_gets_one_clear_line_and_exit_2(argv, expect, tmp_path, monkeypatch, capsys):
    """In-process: any exception would fail this test; the message names the argument."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert expect in captured.err, captured.err
    last = [line for line in captured.err.splitlines() if line.strip()][-1]
    assert last.startswith("attnlab"), last  # the last line is the message, named by its command
    assert not list(tmp_path.iterdir())  # nothing was written before the refusal


def test_the_installed_command_prints_no_traceback(tmp_path):
    """The same through the console script, as a user runs it (two of the cases above)."""
    exe = Path(sys.executable).with_name("attnlab")
    for argv in (["grade", "nosuch.py"], ["example", "--seq-len", "100000"]):
        run = subprocess.run([str(exe), *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert run.returncode == 2 and "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr


def test_a_missing_extra_is_named_before_any_work(monkeypatch, tmp_path, capsys):
    """Without matplotlib, explain/plot/bench --plot say which extra to install, before running."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    for argv, extra in ((["explain", "--out", "x.html"], "viz"), (["plot", "example", "--out", "x.png"], "viz"),
                        (["bench", "--plot", "x.png", "--seq-lens", "64"], "bench")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"pip install 'attnlab[{extra}]'" in err and "matplotlib" in err
        assert "estimated duration" not in err  # bench stopped before its run


def test_labs_get_warns_when_jaxtyping_is_missing(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jaxtyping" else real(name, *a))
    assert main(["labs", "get", "01", str(tmp_path / "l")]) == 0
    assert "jaxtyping, which is not installed here; before you start: pip install 'attnlab[lab]'" in \
        capsys.readouterr().err


def test_every_command_has_an_example_in_its_help(capsys):
    from attnlab.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for name in commands:
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        assert "example" in text and f"attnlab {name}" in text.split("example", 1)[1], name
