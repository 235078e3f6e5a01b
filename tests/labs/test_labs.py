"""attnlab labs: the list, and 'labs get' copying a lab without its solutions."""

from __future__ import annotations

import zipfile

import pytest

from attnlab import labs
from attnlab.cli import main

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]


def test_labs_lists_each_lab_with_what_it_covers(capsys):
    assert main(["labs"]) == 0
    out = capsys.readouterr().out
    assert "01-attention" in out and "covers:" in out and "attnlab labs get" in out
    # the track: five labs, each listed with what it covers, each folder with its file and solution
    assert [lab.name for lab in labs.LABS] == ["01-attention", "02-masks", "03-multi-head", "04-flash-attention",
                                               "05-triton-flash"]
    assert out.count("covers:") == 5 and "05-triton-flash" in out
    for lab in labs.LABS:
        folder = labs.labs_root() / lab.name
        assert all((folder / f).is_file() for f in lab.files) and (folder / "solutions" / lab.file).is_file()
        assert lab.exercises() and sum(ex.max_score for ex in lab.exercises()) == 100


def test_get_copies_brief_stubs_and_walkthrough_but_never_solutions(tmp_path, capsys):
    assert main(["labs", "get", "01", str(tmp_path / "mine")]) == 0
    copied = sorted(p.name for p in (tmp_path / "mine").iterdir())
    assert copied == sorted(labs.find_lab("01").files)
    assert "TODO(ex1)" in (tmp_path / "mine" / "attention.py").read_text()
    assert not list((tmp_path / "mine").rglob("solutions"))
    assert "attnlab grade" in capsys.readouterr().out
    assert main(["labs", "get", "01-attention", str(tmp_path / "mine")]) == 2  # never overwrites
    assert "not overwriting" in capsys.readouterr().err
    assert main(["labs", "get", "99", str(tmp_path / "x")]) == 2
    assert "no lab '99'" in capsys.readouterr().err
    # each lab names its own file: lab 04's is flash.py
    assert main(["labs", "get", "04", str(tmp_path / "four")]) == 0
    out = capsys.readouterr().out
    assert "fill in flash.py" in out and f"cd {tmp_path / 'four'}\n  attnlab grade\n" in out
    assert sorted(p.name for p in (tmp_path / "four").iterdir()) == sorted(labs.find_lab("04").files)


def test_the_wheel_carries_the_lab_materials_and_the_solution_apart(tmp_path):
    """The materials 'labs get' copies, and the solution only 'labs get NN --solution' copies (the
    sandbox covers <prefix>/share/attnlab: tests/tools/test_wheel_journeys.py)."""
    from attnlab.grading.classroom import autograder

    wheel = autograder.build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for lab in labs.LABS:
        shipped = [n for n in names if f"/share/attnlab/labs/track1/{lab.name}/" in n and "/solutions/" not in n]
        assert sorted(n.rsplit("/", 1)[1] for n in shipped) == sorted(lab.files), lab.name
        solutions = [n for n in names if f"/share/attnlab/labs/track1/{lab.name}/solutions/" in n]
        assert [n.rsplit("/", 1)[1] for n in solutions] == [lab.file], lab.name
