"""Grading a class folder (attnlab grade DIR --out OUT) and the Gradescope autograder bundle.

A generated class: two solutions (both layouts), a stub, two buggy variants, three hostile
members from tests/hostile (one overwrites a neighbour's file, one rewrites its own folder,
one hangs every exercise) and entries that are not submissions. Graded once with the real
OS sandbox (module fixture); the tests read the gradebook, the per-learner JSON, the report
page (in headless Chromium) and check that the hostile members changed nothing of anyone else's.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.grading import Limits
from attnlab.grading.sandbox import bwrap, pool
from attnlab.grading.classroom import autograder, batch
from helpers.ci import cannot_run, chromium
from helpers.make_class import SOLUTION, STUB, hostile  # the class generator of the throughput benchmark

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

SCORES_LINE = "return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])"
LIMITS = Limits(timeout_s=2.0)
TOTAL_S = 6.0  # the hanging member is stopped here

if pool.bwrap_path() is None:
    cannot_run("bwrap is not installed (make test installs bubblewrap): class grading runs sandboxed", module=True)


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def make_class(root: Path) -> Path:
    cls = root / "class"
    for learner, text in (("alice", SOLUTION), ("carol", STUB)):
        (cls / learner).mkdir(parents=True)
        (cls / learner / "attention.py").write_text(text)
    (cls / "bob.py").write_text(SOLUTION)
    (cls / "dave.py").write_text(SOLUTION.replace(SCORES_LINE, "return Q @ K.transpose(-2, -1)"))
    (cls / "erin.py").write_text(SOLUTION.replace("return scores.masked_fill(~mask, NEG_INF)",
                                                  "return scores.masked_fill(mask, NEG_INF)"))
    for learner, name in (("mallory", "fp_neighbour"), ("trent", "write_own_folder"), ("hang", "hang_every_exercise")):
        (cls / learner).mkdir()
        (cls / learner / "attention.py").write_text(hostile(name, cls / learner, cls / "alice" / "attention.py"))
    (cls / "notes.txt").write_text("not a submission\n")
    (cls / ".hidden").mkdir()
    (cls / "empty").mkdir()
    (cls / "link.py").symlink_to(cls / "alice" / "attention.py")
    return cls


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    cls = make_class(root)
    before = digest(cls)
    seen = []
    result = batch.grade_class(cls, root / "out", jobs=2, seed=7, limits=LIMITS, total_timeout_s=TOTAL_S,
                               progress=lambda done, total, text: seen.append((done, total, text)))
    return root, cls, before, result, seen


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_the_gradebook_has_every_learner_sorted_with_points_mistakes_and_status(graded):
    root, cls, before, result, seen = graded
    rows = read_csv(root / "out" / "grades.csv")
    by = {r["learner"]: r for r in rows}
    assert [r["learner"] for r in rows] == ["alice", "bob", "carol", "dave", "erin", "hang", "mallory", "trent"]
    assert by["alice"]["total"] == by["bob"]["total"] == "100"
    assert by["trent"]["total"] == "0"  # its module-level torch.save is not on the lab's allow-list: refused unrun
    assert by["carol"]["total"] == "0" and by["mallory"]["total"] == "0"
    assert float(by["dave"]["total"]) < 100 and "missing_scale" in by["dave"]["mistakes"].split()
    assert float(by["erin"]["total"]) < 100 and "mask_polarity" in by["erin"]["mistakes"].split()
    assert by["hang"]["status"] == "timed out" and by["alice"]["status"] == "graded"
    assert {"ex1", "ex12", "seed", "seconds"} <= set(rows[0])
    assert float(by["dave"]["ex2"]) < float(by["alice"]["ex2"]) == 10  # partial credit on the scale
    assert len({r["seed"] for r in rows}) == len(rows)  # one seed per learner
    assert [t for _, total, t in seen if total == 8] and seen[-1][0] == 8  # progress for every learner


def test_each_learner_gets_gradescope_results_json(graded):
    root, cls, before, result, seen = graded
    for r in read_csv(root / "out" / "grades.csv"):
        data = json.loads((root / "out" / r["learner"] / "results.json").read_text())
        assert data["score"] == float(r["total"]) and data["extra_data"]["run"] == r["run"]
        assert "seed" not in data["extra_data"] and r["seed"] not in json.dumps(data)  # the seed is the instructor's
        assert data["tests"] and data["extra_data"]["sandbox"]["os_sandbox"] is True
        # every sandbox was forked from the class template (torch imported once for the class); a file
        # the static check refused whole never needed one
        refused_unrun = "none of it was run" in data["output"]
        assert data["extra_data"]["sandbox"]["made_by"] == ("" if refused_unrun else "template"), data["output"]
    assert "pre-imported template" in result.sandboxes


def test_a_learner_whose_exercises_time_out_is_marked_timed_out():
    from attnlab.grading.grader import GradeReport, TestResult
    from attnlab.grading.exercise import Verdict
    from attnlab.labs import LABS
    from attnlab.labs.lab01_attention import EXERCISES

    ex = EXERCISES[0]
    for message, status in (("did not finish within 2 s (an endless loop?)", "timed out"),
                            ("not run: the total time limit (10 s) was reached", "timed out"),
                            ("returned the wrong shape", "graded")):
        report = GradeReport(path=Path("x.py"), results=[TestResult(ex, "c", 0.0, 1.0, Verdict(False, message))])
        assert batch._row("x", report, LABS[0]).status == status
    report = GradeReport(path=Path("x.py"), problem="could not import the file:\nSyntaxError")
    assert batch._row("x", report, LABS[0]).status == "could not be read"


def test_what_is_not_a_submission_is_skipped_with_a_reason(graded):
    root, cls, before, result, seen = graded
    skipped = {s.name: s.reason for s in result.skipped}
    assert set(skipped) == {"notes.txt", ".hidden", "empty", "link.py"}
    assert "symbolic link" in skipped["link.py"] and skipped["empty"] == "the folder is empty"
    assert "link.py: a symbolic link" in (root / "out" / "skipped.txt").read_text()


def test_hostile_members_changed_nothing_of_anyone_else(graded):
    root, cls, before, result, seen = graded
    assert digest(cls) == before  # alice's file (mallory's target), trent's own folder: untouched
    assert not list(Path("/tmp").glob("*classtoken*"))


def test_same_seed_same_grades_from_a_bwrap_per_submission_too(graded, tmp_path, monkeypatch):
    """The same seed and class key give the same grades; and the fallback where the class template
    cannot run grades alike: here the template's bwrap too is made with --disable-userns, as a
    container that forbids nested user namespaces would, so the template's forks cannot make their own."""
    root, cls, before, result, seen = graded
    small = tmp_path / "again"
    small.mkdir()
    (tmp_path / "out" / batch.PRIVATE_DIR).mkdir(parents=True)
    shutil.copy2(root / "out" / batch.CLASS_KEY_FILE, tmp_path / "out" / batch.CLASS_KEY_FILE)
    for name in ("dave.py", "erin.py"):
        (small / name).write_text((cls / name).read_text())
    plain = bwrap.plan
    monkeypatch.setattr(bwrap, "plan", lambda exe, inside, template=False, seccomp_fd=None:
                        plain(exe, inside, template=False, seccomp_fd=seccomp_fd))
    again = batch.grade_class(small, tmp_path / "out", jobs=2, seed=7, limits=LIMITS, total_timeout_s=TOTAL_S)
    assert "one bwrap OS sandbox per submission" in again.sandboxes, again.sandboxes
    assert "cannot make a sandbox per submission here" in again.sandboxes and "unshare" in again.sandboxes
    assert {json.loads((tmp_path / "out" / r.learner / "results.json").read_text())["extra_data"]["sandbox"][
        "made_by"] for r in again.rows} == {"bwrap"}
    first = {r.learner: r for r in result.rows}
    for r in again.rows:
        assert (r.total, r.exercises, r.mistakes, r.seed) == (first[r.learner].total, first[r.learner].exercises,
                                                             first[r.learner].mistakes, first[r.learner].seed)


def test_resume_grades_only_the_unfinished(graded):
    root, cls, before, result, seen = graded
    out = root / "out"
    (out / batch.ROWS_DIR / "dave.json").unlink()  # as if the run had stopped while grading dave
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/results.json")}
    calls = []
    again = batch.grade_class(cls, out, jobs=2, seed=7, limits=LIMITS, total_timeout_s=TOTAL_S, resume=True,
                              progress=lambda done, total, text: calls.append(text))
    assert len(calls) == 1 and calls[0].startswith("dave")
    changed = {p.parent.name for p, t in stamps.items() if p.stat().st_mtime_ns != t}
    assert changed == {"dave"}
    assert [r.learner for r in again.rows] == [r.learner for r in result.rows]


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]


def test_report_page_in_headless_chromium(graded):
    root, *_ = graded
    browser = chromium()
    page = root / "out" / "report.html"
    text = page.read_text()
    assert not re.search(r"(src|href)\s*=\s*[\"']?https?:|url\(|<script[^>]*src", text)  # no network
    # one inline script (the learner table's sorting), allowed by its hash and nothing else
    scripts = re.findall(r"<script>(.*?)</script>", text, re.S)
    assert len(scripts) == 1 and text.count("<script") == 1
    digest_b64 = __import__("base64").b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
    assert f"script-src 'sha256-{digest_b64}'" in text and "unsafe-inline'; img" not in text.split("style-src")[0]
    dom = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={tempfile.mkdtemp()}", "--dump-dom",
                          page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert "8 learners graded" in dom and "Score distribution" in dom and "<svg" in dom
    assert dom.find("missing_scale", dom.index("Named mistakes")) > 0 and "mask_polarity" in dom
    assert dom.count("<tr data-name=") == 8 and dom.index("id=\"learners\"") < dom.index("Score distribution")
    assert "Slowest submissions" in dom and "hang" in dom and "link.py" in dom
    assert "the scores are not scaled" in dom  # the shared explanation of the mistake


def test_cli_grades_a_folder_and_says_what_it_wrote(tmp_path, capsys):
    cls = tmp_path / "c"
    cls.mkdir()
    (cls / "amy.py").write_text(SOLUTION)
    (cls / "ben.py").write_text(STUB)
    (cls / "readme.md").write_text("x")
    assert main(["grade", str(cls)]) == 2
    assert "--out" in capsys.readouterr().err
    code = main(["grade", str(cls), "--out", str(tmp_path / "o"), "--jobs", "2", "--seed", "3", "--timeout", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "2 learners" in out and "grades.csv" in out and "report.html" in out and "skipped 1" in out
    assert [r["total"] for r in read_csv(tmp_path / "o" / "grades.csv")] == ["100", "0"]


# --------------------------------------------------------------------------- the autograder bundle
@pytest.fixture(scope="module")
def gradescope(tmp_path_factory):
    """The bundle unpacked under a root laid out like Gradescope's, set up offline: the
    environment sees this one's packages (torch, numpy, jaxtyping) through a .pth file and
    gets attnlab from the bundled wheel."""
    root = tmp_path_factory.mktemp("gradescope")
    bundle = root / "autograder.zip"
    assert main(["autograder", "--out", str(bundle)]) == 0
    simulated = autograder.SimulatedRoot(bundle, root)
    setup = simulated.setup()
    return root, simulated.source, simulated.env, simulated.names, setup


def test_the_bundle_installs_offline_from_its_wheel(gradescope):
    root, source, env, names, setup = gradescope
    assert {"setup.sh", "run_autograder", "requirements.txt", "README.txt"} <= names
    assert any(n.startswith("attnlab-") and n.endswith(".whl") for n in names)
    assert "torch==" in (source / "requirements.txt").read_text()
    assert setup.returncode == 0, setup.stdout[-2000:] + setup.stderr[-2000:]
    venv_python = Path(env["ATTNLAB_VENV"]) / "bin" / "python"
    where = subprocess.run([str(venv_python), "-c", "import attnlab; print(attnlab.__file__)"], capture_output=True,
                           text=True, env=env).stdout
    assert str(Path(env["ATTNLAB_VENV"])) in where  # attnlab came from the bundle's wheel, not this checkout


@pytest.mark.parametrize("kind,expect", [("solution", 100), ("stub", 0), ("hostile", 0)])
def test_run_autograder_grades_the_submission(gradescope, kind, expect):
    root, source, env, names, setup = gradescope
    assert setup.returncode == 0, setup.stderr[-2000:]
    sub = root / "autograder" / "submission"
    results = root / "autograder" / "results" / "results.json"
    if sub.exists():
        for p in sub.iterdir():
            p.unlink()
    sub.mkdir(parents=True, exist_ok=True)
    results.unlink(missing_ok=True)
    text = {"solution": SOLUTION, "stub": STUB,
            "hostile": hostile("fp_rewrite_results", sub, sub / "x.py").replace("@RESULTS@", str(results))}[kind]
    (sub / "attention.py").write_text(text)
    before = digest(source)
    run = subprocess.run(["bash", str(source / "run_autograder")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(results.read_text())
    assert data["score"] == expect and data["max_score"] == 100
    assert digest(source) == before
