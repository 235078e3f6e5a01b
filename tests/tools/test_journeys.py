"""The learner's and the instructor's paths around the labs (issue 22): ``attnlab grade`` in a
``labs get`` folder grades that folder's file, a class is found from what is on disk (its lab,
names in any script), and a user's mistake on the command line ends in one line, exit 2,
never a traceback."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.cli import main
from attnlab.grading.classroom import batch
from attnlab.grading.sandbox import pool
from helpers.procs import crippled_bwrap, needs_sandbox

pytestmark = [pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parents[2]
TRACK = ROOT / "labs" / "track1"
SOLUTION_01 = TRACK / "01-attention" / "solutions" / "attention.py"
SOLUTION_02 = TRACK / "02-masks" / "solutions" / "masks.py"
STUB_02 = TRACK / "02-masks" / "masks.py"


# --------------------------------------------------------------------------- grade with no path
def test_grade_with_no_path_grades_the_lab_file_of_this_folder(tmp_path, monkeypatch, capsys):
    """A lab 02 folder made by 'labs get', outside the clone, with the solution in it: 100/100 of
    lab 02 shows it graded this folder's masks.py (the old default graded the clone's lab 01 stub: 0)."""
    needs_sandbox()
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
    needs_sandbox()
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


def test_a_mixed_class_grades_its_majority_and_an_empty_one_is_refused(tmp_path, capsys):
    mixed = _make(tmp_path / "mixed", {"ann": SOLUTION_02, "bob": SOLUTION_01, "cat": SOLUTION_02})
    plan = batch.plan_class(mixed)  # the lab most learners hold; the others skipped with their lab and command
    assert plan.lab.name == "02-masks" and [s.learner for s in plan.submissions] == ["ann", "cat"]
    (bob,) = [s for s in plan.skipped if s.name == "bob"]
    assert "a lab 01-attention submission" in bob.reason and "--lab 01 --out" in bob.reason
    assert batch.plan_class(mixed, lab="01").lab.name == "01-attention"  # --lab chooses
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (empty,):
        out = tmp_path / f"out-{folder.name}"
        assert main(["grade", str(folder), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("--lab" in err)
        assert not out.exists()  # refused before anything was written
    assert "the folder is empty" in str(pytest.raises(batch.ClassRefused, batch.plan_class, empty).value)
    # lab 01 asked for a lab 02 class: nobody to grade, and the skip reasons say why
    with pytest.raises(batch.ClassRefused, match=r"another lab.s file \(lab 02-masks.s masks.py\); grade it with --lab 02"):
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
    needs_sandbox()
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
    needs_sandbox()
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


# --------------------------------------------------------------------------- the small things
def _report(lab: str, checks: list[tuple[str, str, list[dict]]]):
    from attnlab.grading.exercise import Verdict
    from attnlab.grading.grader import GradeReport, TestResult

    ex = labs.find_lab(lab).exercises()[0]
    report = GradeReport(path=Path("x.py"), lab=lab)
    for check, message, findings in checks:
        report.results.append(TestResult(ex, check, 0.0, 1.0, Verdict(False, message, findings)))
    return report.to_text()


def test_a_check_that_names_itself_is_not_labelled_twice():
    text = _report("01", [("large_scores", "large scores: NaN in row 0", []), ("dim_argument", "dim: wrong", [])])
    assert "large scores: NaN in row 0" in text and "large scores: large scores:" not in text
    assert "dim argument: dim: wrong" in text  # a label the message lacks is still given


def test_every_named_mistake_gets_an_arrow_line_in_labs_02_and_03():
    from attnlab import mistakes

    for lab, code in (("02", "mask_polarity"), ("03", "heads_mixed")):
        message = "True means attend here"
        text = _report(lab, [("values", f"mask: {message}", [{"code": code, "message": message}])])
        assert f"-> [{code}] {mistakes.hint(code)}" in text, text
    # a finding whose text was not shown keeps its own message
    text = _report("01", [("values", "differs", [{"code": "missing_scale", "message": "forgot the scale"}])])
    assert "-> [missing_scale] forgot the scale" in text and text.count("-> [missing_scale]") == 1


def test_the_transpose_hint_names_the_learners_own_transpose():
    from attnlab.labs.lab01_attention import _transpose_hint  # noqa: PLC2701  (the check's own helper, tested here)

    err = "RuntimeError: The size of tensor a (5) must match the size of tensor b (7)"
    swapped = _transpose_hint(err, "  line 20, in attention_scores\n    return Q @ K.transpose(0, 1)")[0]["message"]
    assert "K.transpose(0, 1) swaps the batch and position dims" in swapped and "K.T" not in swapped
    dot_t = _transpose_hint(err, "  line 20, in attention_scores\n    return Q @ K.T / 2")[0]["message"]
    assert "K.T reverses all three dims" in dot_t
    assert _transpose_hint("ValueError: something else", "K.T") == []


def test_the_comparison_picture_uses_one_colour_scale():
    pytest.importorskip("matplotlib")  # the dev environment has it (attnlab[viz])
    import torch

    from attnlab import viz

    ref = torch.linspace(-1, 1, 12).reshape(3, 4)
    fig = viz.compare(2 * ref, ref)  # a 2x error must look darker, not the same
    yours, reference = (ax.images[0].get_clim() for ax in fig.axes[:2] if ax.images)
    assert yours == reference == (-2.0, 2.0)


def doctors_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """The signature the doctor documents: no enable_gqa."""
    from attnlab.functional import scaled_dot_product_attention

    return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def unscaled(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    from attnlab.functional import scaled_dot_product_attention

    return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=1.0)


def test_assert_close_to_sdpa_reads_the_signature_and_says_where_it_failed():
    import torch

    from attnlab.testing import assert_close_to_sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    assert assert_close_to_sdpa(doctors_signature, q, k, v, is_causal=True).ok()  # was a TypeError
    with pytest.raises(AssertionError) as failed:
        assert_close_to_sdpa(unscaled, q, k, v)
    text = str(failed.value)
    assert "worst output at index [" in text and "float64 reference" in text and "x the tolerance" in text
    assert f"attnlab doctor {__name__}:unscaled" in text
    with pytest.raises(TypeError, match="enable_gqa=True was asked, but doctors_signature"):
        assert_close_to_sdpa(doctors_signature, q, k[:, :1], v[:, :1], enable_gqa=True)


# --------------------------------------------------------------------------- the teacher's report
def _chromium() -> str:
    from helpers.ci import chromium

    return chromium()


def _dom(browser: str, url: str, width: int) -> str:
    import tempfile

    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-background-networking", f"--window-size={width},900"]
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([browser, *flags, f"--user-data-dir={profile}", "--dump-dom", url],
                              capture_output=True, text=True, timeout=120).stdout


def test_the_class_report_lists_every_learner_sorts_and_fits_a_phone(tmp_path):
    import re

    from attnlab.grading.classroom.report import write_report

    def row(name, total, status="graded", mistakes=(), problem=""):
        return batch.Row(name, total, 100, {"ex1": total / 10}, list(mistakes), 1, 0.5, status, folder=name,
                         problem=problem)

    rows = [row("Zoë Ångström", 40, mistakes=["mask_polarity", "off_by_one"]), row("amir", 100),
            row("Li Wei", 0, "could not be read", problem="could not import the file: SyntaxError at line 3"),
            row("<b>mallory</b>", 70, mistakes=["missing_scale"])]
    result = batch.ClassResult(rows, [batch.Skipped("notes.txt", "not a .py file")], tmp_path, 12.0, labs.find_lab("02-masks"),
                               "one OS sandbox per submission")
    page = tmp_path / "report.html"
    write_report(result, page)
    text = page.read_text(encoding="utf-8")
    assert "<b>mallory</b>" not in text and "&lt;b&gt;mallory&lt;/b&gt;" in text  # learner text is escaped
    assert "Li Wei</b> (could not be read):<div class='ex'>could not import the file: SyntaxError at line 3</div>" in text
    assert not re.search(r"(src|href)\s*=\s*[\"']?https?:", text)  # nothing fetched
    browser = _chromium()
    for width in (1280, 390):
        dom = _dom(browser, page.as_uri(), width)
        assert 'data-overflow="no"' in dom, f"the page is wider than {width} px"
        assert dom.count("<tr data-name=") == 4
    by_score = _dom(browser, page.as_uri() + "#sort=score-desc", 390)
    assert 'data-sorted="score-desc"' in by_score  # the script ran under the page's CSP
    order = re.findall(r"<tr data-name=\"([^\"]+)\"", by_score)
    assert order == ["amir", "&lt;b&gt;mallory&lt;/b&gt;", "zoë ångström", "li wei"]


def test_the_notebook_extra_installs_a_way_to_open_the_notebooks():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith(("jupyterlab", "notebook>")) for d in extras["notebook"])
    assert "attnlab[walkthrough]" in extras["notebook"]  # and what runs them headless


@pytest.mark.parametrize("lab", labs.LABS, ids=lambda lab: lab.name)
def test_a_walkthrough_without_its_labs_imports_says_what_to_install(lab, monkeypatch):
    """Its first code cell, up to the import of the lab's file, with one of the lab's own imports
    (``lab.needs``: jaxtyping, or triton for lab 05) missing: one message with the lab's install
    command (SystemExit), not a ModuleNotFoundError traceback."""
    import importlib.util

    text = (TRACK / lab.name / "walkthrough.py").read_text()
    head = text[:text.index(f"import {lab.file[:-3]} as lab")]
    real = importlib.util.find_spec
    for missing in lab.needs:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
        with pytest.raises(SystemExit, match=re.escape(f"pip install 'attnlab[{lab.extra}]'")) as stop:
            exec(compile(head, "walkthrough.py", "exec"), {})
        assert missing in str(stop.value)


def test_a_lab_02_bundle_is_tried_before_upload(tmp_path, capsys):
    """attnlab autograder --lab 02 --test FILE: the bundle's own setup.sh and run_autograder,
    in a simulated Gradescope root, grade lab 02's solution 100 (a lab 01 bundle would give 0)."""
    needs_sandbox()
    bundle = tmp_path / "autograder-02.zip"
    assert main(["autograder", "--lab", "02", "--out", str(bundle), "--test", str(SOLUTION_02)]) == 0
    out = capsys.readouterr().out
    assert "the autograder of lab 02-masks (learners submit masks.py)" in out
    assert f"simulated Gradescope run of {SOLUTION_02}: score 100/100" in out
    import zipfile

    run = zipfile.ZipFile(bundle).read("run_autograder").decode()
    assert '--gradescope "$ROOT" --lab "02-masks"' in run  # the lab's file (masks.py) comes from the lab


def test_the_library_default_is_the_lab_file_here_too(tmp_path, monkeypatch):
    from attnlab.grading.grader import default_lab_path

    monkeypatch.chdir(tmp_path)
    with pytest.raises(labs.NoLabFile):
        default_lab_path()  # never the clone's lab 01 stub
    (tmp_path / "flash.py").write_text("")
    assert default_lab_path() == tmp_path / "flash.py"


def test_the_sandbox_copy_keeps_the_learners_file_name():
    from attnlab.grading.sandbox import SUBMISSION_NAME, submission_name

    assert submission_name("/x/02-masks/masks.py") == "masks.py"  # tracebacks say masks.py, not attention.py
    assert submission_name("/x/Zoë's file.py") == SUBMISSION_NAME == "submission.py"


def test_a_lab_02_traceback_names_masks_py(tmp_path):
    needs_sandbox()
    from attnlab.grading import grade

    target = tmp_path / "masks.py"
    target.write_text(SOLUTION_02.read_text() + "\n\ndef causal_mask(L, S):\n    return 1 // 0\n")
    report = grade(target, seed=1)
    text = report.to_text()
    assert 'masks.py", line' in text and "attention.py" not in text, text[:3000]


def test_resume_trusts_only_rows_the_grader_signed(tmp_path):
    """A row planted in OUT (the stub recorded as 100, a =HYPERLINK cell), or the row of
    an earlier version of the submission, is graded anew; a signed row of the same file is kept."""
    needs_sandbox()
    cls = _make(tmp_path / "class", {"ann.py": STUB_02, "bob.py": SOLUTION_02})
    out = tmp_path / "out"
    first = batch.grade_class(cls, out, seed=4, jobs=2)
    assert {r.learner: r.total for r in first.rows} == {"ann": 0, "bob": 100}
    row = json.loads((out / batch.ROWS_DIR / "ann.json").read_text())
    forged = {**row, "total": 100.0, "learner": "ann", "mistakes": ["=HYPERLINK(\"http://x\")"]}
    (out / batch.ROWS_DIR / "ann.json").write_text(json.dumps(forged))  # the old signature does not cover this
    seen = []
    again = batch.grade_class(cls, out, seed=4, jobs=2, resume=True,
                              progress=lambda done, total, text: seen.append(text))
    assert {r.learner: r.total for r in again.rows} == {"ann": 0, "bob": 100}
    assert [t.split()[0] for t in seen] == ["ann"]  # bob's signed row was kept, ann's forged one regraded
    (cls / "bob.py").write_text(STUB_02.read_text())  # bob changed the file: his old row no longer applies
    third = batch.grade_class(cls, out, seed=4, jobs=2, resume=True)
    assert {r.learner: r.total for r in third.rows} == {"ann": 0, "bob": 0}
    assert "HYPERLINK" not in (out / "grades.csv").read_text()


# --------------------------------------------------------------------------- a sandbox that cannot start
def test_the_self_test_tries_the_exact_sandbox(tmp_path, monkeypatch, capsys):
    needs_sandbox()
    from attnlab.grading.sandbox import self_test

    ok, why = self_test("bwrap")
    assert ok and "the OS sandbox works here" in why
    fake = crippled_bwrap(tmp_path)
    assert subprocess.run([str(fake), "--ro-bind", "/", "/", "--unshare-all", "true"]).returncode == 0  # old probe
    monkeypatch.setenv("ATTNLAB_BWRAP", str(fake))
    pool.keep_spare(False)  # no spare server started with the real bwrap may answer for the fake one
    try:
        ok, why = self_test("bwrap")
        assert not ok and "failed to start" in why
        assert main(["grade", "--self-test"]) == 1
        assert "failed to start" in capsys.readouterr().err
    finally:
        pool.keep_spare(True)


def test_a_sandbox_that_cannot_start_is_the_graders_problem_not_the_learners(tmp_path, monkeypatch):
    needs_sandbox()
    from attnlab.grading import grade

    monkeypatch.setenv("ATTNLAB_BWRAP", str(crippled_bwrap(tmp_path)))
    pool.keep_spare(False)
    try:
        report = grade(SOLUTION_01, sandbox="bwrap", seed=1)
    finally:
        pool.keep_spare(True)
    assert report.score == 0 and report.environment_problem
    assert "not a mistake in your code" in report.problem and "--self-test" in report.problem
    assert "Fix the installation above" in report.to_text()
    row = batch._row("ann", report, labs.LABS[0])  # noqa: SLF001  (the gradebook's status of this report)
    assert row.status == "grader environment"
