"""What the grader prints and writes (issue 32 item 4): a whole-file problem once with its line,
a stub's hint once, the line an endless loop was running, too small a --memory-mb named before
anything runs, the class report's whole reasons, its link to each learner's own page, and
identical or near-identical submissions flagged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.cli import main
from attnlab.grading import grade
from attnlab.grading.classroom import batch
from attnlab.grading.classroom.report import render_report
from attnlab.grading.static import check_source, shape_digest

REPO = Path(__file__).resolve().parents[2]
SOLUTION = REPO / "labs" / "track1" / "01-attention" / "solutions" / "attention.py"
STUB = REPO / "labs" / "track1" / "01-attention" / "attention.py"

pytestmark = pytest.mark.subprocess


def test_a_syntax_error_is_said_once_with_its_line(tmp_path):
    f = tmp_path / "attention.py"
    f.write_text("def project_qkv(X, W_Q, W_K, W_V):\n    return X\n\ndef attention_scores(Q, K)\n    return Q\n")
    text = grade(f, sandbox="none", seed=1).to_text()
    assert text.count("SyntaxError") == 1 and "def attention_scores(Q, K)" in text and "^" in text, text
    assert "no exercise ran" in text


def test_a_stub_gives_its_hint_once(tmp_path):
    text = grade(STUB, sandbox="none", seed=1).to_text()
    assert text.count("[not_implemented]") == 1 and "12 exercises still raise NotImplementedError" in text
    assert text.count("TODO(ex") == 12 and len(text.splitlines()) < 35, text


def test_an_endless_loop_says_which_line_was_running(tmp_path):
    f = tmp_path / "attention.py"
    f.write_text("def project_qkv(X, W_Q, W_K, W_V):\n    n = 0\n    while n >= 0:\n        n += 1\n"
                 "    return X, X, X\n")
    report = grade(f, sandbox="none", seed=1, lab="01", total_timeout_s=3)
    ex1 = next(r for r in report.results if r.exercise.id == "ex1")
    assert "did not finish within" in ex1.verdict.message
    assert "when the budget ran out it was running line" in ex1.verdict.message, ex1.verdict.message
    assert "of attention.py, in project_qkv():" in ex1.verdict.message


@pytest.mark.parametrize("value,ok", [("1", False), ("127", False), ("128", True)])
def test_too_small_a_memory_cap_is_named_not_blamed_on_the_machine(value, ok, capsys, tmp_path):
    code = main(["grade", str(tmp_path / "none.py"), "--memory-mb", value, "--no-sandbox"])
    err = capsys.readouterr().err
    if ok:
        assert "--memory-mb" not in err
    else:
        assert code == 2 and f"{value} MB is too small for the sandbox to start" in err and "Traceback" not in err


def test_similar_submissions_are_flagged_by_their_shape():
    text = SOLUTION.read_text()
    renamed = text.replace("weights", "probs").replace("# ", "# note: ")
    changed = text.replace("/ math.sqrt(Q.shape[-1])", "* 0.5")
    shapes = [shape_digest(check_source(t).tree) for t in (text, renamed, changed)]
    assert shapes[0] == shapes[1] != shapes[2]
    rows = [batch.Row(n, 100, 100, {}, [], 0, 1.0, "graded", sha256=n, shape=s)
            for n, s in (("ann", shapes[0]), ("bob", shapes[1]), ("cy", shapes[2]), ("stubby", "stub"))]
    rows.append(batch.Row("sam", 0, 100, {}, [], 0, 1.0, "graded", sha256="x", shape="stub"))
    batch.flag_similar(rows, stub_shape="stub")  # two learners who handed in the untouched stub are not a match
    assert [r.similar for r in rows] == [["bob"], ["ann"], [], [], []]
    page = render_report(batch.ClassResult(rows, [], Path("."), 1.0, labs.LABS[0]))
    assert "Identical or near-identical submissions" in page and "<li>ann, bob</li>" in page


@pytest.mark.sandbox
def test_the_class_report_links_each_learner_to_their_feedback_and_keeps_whole_reasons(tmp_path, bwrap):
    cls = tmp_path / "class"
    for learner, body in (("ann", SOLUTION.read_text()), ("bob", SOLUTION.read_text().replace("weights", "w")),
                          ("cy", "def project_qkv(X, W_Q, W_K, W_V)\n    return X\n")):
        (cls / learner).mkdir(parents=True)
        (cls / learner / "attention.py").write_text(body)
    out = tmp_path / "out"
    result = batch.grade_class(cls, out, seed=2)
    page = (out / "report.html").read_text()
    for r in result.rows:
        assert f"<a href='{r.folder}/feedback.html'>{r.learner}</a>" in page
        feedback = (out / r.folder / "feedback.html").read_text()
        assert f"{r.learner}: {r.total:g}/{r.max_total:g}" in feedback and "attnlab grade (lab 01-attention)" in feedback
    cy = next(r for r in result.rows if r.learner == "cy")
    # the whole reason, not its first line ('could not import the file:' alone was all it kept)
    assert "could not import the file:\nSyntaxError: expected &#x27;:&#x27; (line 1)" in page
    assert "def project_qkv(X, W_Q, W_K, W_V)" in page
    assert "SyntaxError" in cy.problem and "def project_qkv" in cy.problem
    assert next(r for r in result.rows if r.learner == "ann").similar == ["bob"]
    assert "ann" in (out / "grades.csv").read_text().splitlines()[2]  # bob's row: similar_to ann


def test_failures_no_code_names_are_grouped_by_how_they_fail():
    """Issue 48 item 8: three learners fail ex3 the same way with no named mistake (other numbers,
    other quoted names), one fails it another way, one names its mistake: the report shows one group
    of three, one of one, and nothing for the named one."""
    from types import SimpleNamespace

    from attnlab.grading.exercise import Verdict
    from attnlab.grading.grader import TestResult

    lab = labs.LABS[0]
    ex = {e.id: e for e in lab.exercises()}["ex3"]
    first, second = list(ex.checks)[:2]

    def report(*verdicts):
        return SimpleNamespace(results=[TestResult(ex, c, 0.0, ex.checks[c], v) for c, v in zip((first, second), verdicts)])

    ok = Verdict(True)
    same = [report(Verdict(False, f"values differ by up to {d} at 'row {i}'\nmore"), ok)
            for i, d in ((1, 0.25), (7, 3e-2), (2, 1.5e+3))]
    other = report(Verdict(False, "expected a tensor, got None"), Verdict(False, "expected a tensor, got None"))
    named = report(Verdict(False, "values differ by up to 9", [{"code": "wrong_scale", "message": "x"}]), ok)
    sigs = [batch._unnamed(r) for r in (*same, other, named)]
    assert sigs[0].keys() == sigs[1].keys() == sigs[2].keys() == {f"ex3 {first}: values differ by up to # at '...'"}
    assert list(sigs[3]) == [f"ex3 {first}, {second}: expected a tensor, got None"] and sigs[4] == {}
    rows = [batch.Row(name, 50, 100, {}, [], 0, 1.0, "graded", unnamed=s)
            for name, s in zip(("ann", "bob", "cy", "dee", "eve"), sigs)]
    page = render_report(batch.ClassResult(rows, [], Path("."), 1.0, lab))
    section = page.split("id='unnamed'")[1].split("<h2")[0]
    assert section.count("<tr><td><code>") == 2, section
    three = section.index("3 (60%)")
    assert three < section.index("1 (20%)") and "values differ by up to # at &#x27;...&#x27;" in section
    assert "row 1" in section  # the example: the first learner's own message
