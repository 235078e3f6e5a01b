"""Grading a whole class: ``attnlab grade DIR --out OUTDIR [--jobs N]``.

Each submission is graded by :func:`attnlab.grading.grade` in its own OS sandbox (a fresh
sandbox server per submission: nothing one learner's code does survives into another's
grading), ``jobs`` at a time. The servers are forked from one pre-imported template
(:mod:`attnlab.grading.template`: torch is imported once per class, not once per learner,
each fork getting namespaces, a /tmp and a cgroup of its own); where nested user namespaces
are not allowed, each gets a ``bwrap`` of its own instead (``ClassResult.sandboxes`` says which).

What comes out, in ``OUTDIR``:

* ``grades.csv``: one row per learner, sorted: learner, total, max, points per exercise,
  named mistakes, seed, seconds, status (``graded`` / ``timed out`` / ``could not be read``);
* ``<learner>/results.json``: Gradescope's schema, as ``attnlab grade FILE --json`` writes it;
* ``report.html``: one self-contained page (:mod:`attnlab.grading.report`);
* ``skipped.txt``: what in ``DIR`` was not a submission, and why.

Layouts recognised (:func:`find_submissions`): ``DIR/<learner>/attention.py`` (the lab's
file: ``masks.py`` for lab 02) and ``DIR/<learner>.py``. Hidden entries, symbolic links, other files, folders without an
``attention.py`` and a learner present twice are skipped with a reason.

Seeds: with ``seed`` each learner's inputs come from ``crc32(f"{seed}:{learner}")``, so a
rerun with the same seed gives the same grades; without, a seed is drawn and recorded.
``resume``: learners whose ``results.json`` is complete are not graded again.
"""

from __future__ import annotations

import csv
import json
import os
import re
import secrets
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from attnlab.grading import launch
from attnlab import labs
from attnlab.grading.grader import GradeReport, grade
from attnlab.grading.sandbox import Limits

__all__ = ["Submission", "Skipped", "Row", "ClassResult", "find_submissions", "grade_class", "learner_seed",
           "SUBMISSION_FILE"]

SUBMISSION_FILE = "attention.py"
_LEARNER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}$")  # a name that is safe as a folder and in a CSV


@dataclass(frozen=True)
class Submission:
    learner: str
    path: Path


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


@dataclass
class Row:
    """One learner's line of the gradebook."""

    learner: str
    total: float
    max_total: float
    exercises: dict[str, float]  # exercise id -> points
    mistakes: list[str]  # named mistake codes (attnlab.mistakes), sorted
    seed: int
    seconds: float
    status: str  # graded | timed out | could not be read | grader environment (a module the lab needs is missing)
    messages: dict[str, str] = field(default_factory=dict)  # mistake code -> one message that named it


@dataclass
class ClassResult:
    rows: list[Row]
    skipped: list[Skipped]
    out: Path
    seconds: float
    lab: str = "01-attention"
    sandboxes: str = ""  # how each submission's sandbox was made, in words


def find_submissions(folder: os.PathLike, file: str = SUBMISSION_FILE) -> tuple[list[Submission], list[Skipped]]:
    """The submissions in ``folder`` (sorted by learner) and what was skipped, with why;
    ``file`` is the lab's file name inside a learner's folder."""
    folder = Path(folder)
    found: dict[str, Submission] = {}
    skipped: list[Skipped] = []
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        name = entry.name
        if name.startswith("."):
            skipped.append(Skipped(name, "hidden"))
            continue
        if entry.is_symlink():
            skipped.append(Skipped(name, "a symbolic link (not followed)"))
            continue
        if entry.is_dir():
            learner, path = name, entry / file
            if path.is_symlink() or not path.is_file():
                skipped.append(Skipped(name, f"a folder without a regular {file}"))
                continue
        elif entry.is_file() and entry.suffix == ".py":
            learner, path = entry.stem, entry
        else:
            skipped.append(Skipped(name, f"not a .py file nor a folder with {file}"))
            continue
        if not _LEARNER.match(learner):
            skipped.append(Skipped(name, "the learner's name has characters other than letters, digits, ._@+-"))
        elif learner in found:
            skipped.append(Skipped(name, f"learner {learner!r} has another submission ({found[learner].path.name})"))
        else:
            found[learner] = Submission(learner, path)
    return sorted(found.values(), key=lambda s: s.learner), skipped


def learner_seed(seed: int, learner: str) -> int:
    """The inputs' seed of one learner: the same for the same class seed, different per learner."""
    return zlib.crc32(f"{seed}:{learner}".encode()) & 0x7FFFFFFF


def _row(learner: str, report: GradeReport) -> Row:
    exercise_list = labs.find_lab(report.lab).exercises()
    exercises: dict[str, float] = {ex.id: 0.0 for ex in exercise_list}
    for ex_id, (score, _) in report.exercise_scores().items():
        exercises[ex_id] = score
    messages: dict[str, str] = {}
    for r in report.results:
        for f in r.verdict.findings:
            messages.setdefault(f["code"], f.get("message", ""))
    problem = report.problem
    if report.environment_problem:
        status = "grader environment"
    elif problem.startswith(("no file", "could not read", "could not import", "the file breaks")):
        status = "could not be read"
    elif any("total time limit" in r.verdict.message or "did not finish within" in r.verdict.message
             for r in report.results):  # the messages of grader.grade and the sandbox's time limits
        status = "timed out"
    else:
        status = "graded"
    return Row(learner, report.score, report.max_score or sum(ex.max_score for ex in exercise_list),
               exercises, sorted(messages), report.seed, round(report.elapsed_s, 2), status, messages)


def _done_row(out: Path, learner: str) -> Optional[Row]:
    """A learner finished by an earlier run (``row.json`` is written last, after results.json)."""
    try:
        data = json.loads((out / learner / "row.json").read_text())
        return Row(**data)
    except (OSError, ValueError, TypeError):
        return None


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def grade_class(folder: os.PathLike, out: os.PathLike, *, jobs: int = 2, seed: Optional[int] = None,
                resume: bool = False, limits: Limits = Limits(), total_timeout_s: float = 60.0,
                sandbox: str = "auto", progress: Optional[Callable[[int, int, str], None]] = None,
                lab: Optional[str] = None) -> ClassResult:
    """Grade every submission in ``folder`` into ``out`` (see the module docstring).

    Raises :class:`~attnlab.grading.launch.SandboxUnavailable` when ``sandbox='auto'`` and
    bwrap is missing: other people's code is never run without the OS sandbox unless
    ``sandbox='none'`` says so.
    """
    t0 = time.perf_counter()
    if sandbox == "auto" and launch.bwrap_path() is None:
        raise launch.SandboxUnavailable(f"refusing to grade a class without the OS sandbox: "
                                        f"{launch.HOW_TO_GET_BWRAP}; or pass --no-sandbox")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    the_lab = labs.find_lab(lab) if lab is not None else labs.LABS[0]
    submissions, skipped = find_submissions(folder, the_lab.file)
    _write_atomically(out / "skipped.txt", "".join(f"{s.name}: {s.reason}\n" for s in skipped))
    base = seed if seed is not None else secrets.randbelow(2**31)
    rows: dict[str, Row] = {}
    todo = []
    for sub in submissions:
        done = _done_row(out, sub.learner) if resume else None
        if done is not None:
            rows[sub.learner] = done
        else:
            todo.append(sub)
    lock = threading.Lock()
    finished = [len(rows)]

    def one(sub: Submission) -> None:
        folder_out = out / sub.learner
        folder_out.mkdir(exist_ok=True)
        (folder_out / "row.json").unlink(missing_ok=True)
        results = folder_out / "results.json"

        def checkpoint(report: GradeReport) -> None:
            _write_atomically(results, json.dumps(report.to_gradescope(), indent=2) + "\n")

        report = grade(sub.path, limits=limits, total_timeout_s=total_timeout_s, seed=learner_seed(base, sub.learner),
                       sandbox=sandbox, untrusted=sandbox != "none", checkpoint=checkpoint, lab=the_lab.name)
        checkpoint(report)
        row = _row(sub.learner, report)
        _write_atomically(folder_out / "row.json", json.dumps(asdict(row)) + "\n")
        with lock:
            rows[sub.learner] = row
            finished[0] += 1
            if progress:
                progress(finished[0], len(submissions), f"{sub.learner} {row.total:g}/{row.max_total:g}")

    # one pre-imported template forks each submission's sandbox (its own namespaces, cgroup,
    # /tmp): torch is imported once, not once per learner; where it cannot work here, one
    # bwrap per submission, the next one importing torch while the current one grades
    with launch.class_template(sandbox) as template:
        if template.active:
            sandboxes = ("one OS sandbox per submission (own user, mount, pid, network and IPC namespaces, "
                         "private /tmp, its own cgroup), forked from a pre-imported template")
        elif sandbox == "none":
            sandboxes = "no OS sandbox (--no-sandbox): process limits only"
        else:
            sandboxes = f"one bwrap OS sandbox per submission, each importing torch ({template.reason})"
            launch.keep_spare(True)
        try:
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                for future in [pool.submit(one, sub) for sub in todo]:
                    future.result()
        finally:
            launch.keep_spare(False)
    ordered = [rows[s.learner] for s in submissions if s.learner in rows]
    write_csv(ordered, out / "grades.csv", the_lab.exercises())
    from attnlab.grading.report import write_report

    result = ClassResult(ordered, skipped, out, time.perf_counter() - t0, the_lab.name, sandboxes)
    write_report(result, out / "report.html")
    return result


def write_csv(rows: list[Row], path: Path, exercises: list) -> None:
    """The gradebook: one row per learner, sorted; points per exercise as columns."""
    ex_ids = [ex.id for ex in exercises]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["learner", "total", "max", *ex_ids, "mistakes", "seed", "seconds", "status"])
        for r in sorted(rows, key=lambda r: r.learner):
            w.writerow([r.learner, f"{r.total:g}", f"{r.max_total:g}", *(f"{r.exercises.get(e, 0):g}" for e in ex_ids),
                        " ".join(r.mistakes), r.seed, f"{r.seconds:.2f}", r.status])
    os.replace(tmp, path)
