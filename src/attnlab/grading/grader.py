"""Grade a learner's lab file safely, with feedback that names the mistake.

    report = grade("labs/track1/01-attention/attention.py")   # or grade() in a lab's folder
    print(report.to_text())
    json.dump(report.to_gradescope(), open("results.json", "w"))

The file's text is checked first (:mod:`.static`); then the submission gets its own
OS sandbox (:mod:`.sandbox`) in which every exercise runs in its own child process
(:mod:`.sandbox`); the checks and the float64 reference live in the lab's module (:mod:`attnlab.labs`), here,
in the grader's process, which trusts nothing the children send.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from attnlab.grading import errors, intake
from attnlab.grading.exercise import Exercise, Verdict, judge_outcome
from attnlab.grading.inputs import inputs_generator, seed_key
from attnlab import labs, mistakes
from attnlab.grading.sandbox import pool
from attnlab.grading.output import write_atomically, write_json
from attnlab.grading.sandbox import Limits, Outcome, Sandbox, clean_text, printable, submission_name
from attnlab.grading.static import check_source, describe, shape_digest
from attnlab.grading.submission import SubmissionBytes, Unreadable, read_submission

__all__ = ["not_graded", "grade", "GradeReport", "TestResult", "default_lab_path", "Limits", "write_atomically", "ResultsFile"]

PICTURE_MAX_ELEMENTS = 1 << 16
# The whole file's wall-clock backstop, this many times its CPU budget (total_timeout_s): a
# solution uses ~1.3 s of CPU in all (BENCHMARKS.md), so at 10x load it still finishes within
# 3x the default 60 s, while a submission that sleeps in every exercise is stopped at 3x.
TOTAL_WALL_FACTOR = 3.0


def default_lab_path() -> Path:
    """The lab file in the current folder (``attention.py``, ``masks.py``, ... : the one of
    :data:`attnlab.labs.LAB_FILES` that is there), what ``grade()`` with no path grades.

    Raises:
        attnlab.labs.NoLabFile: none is there, or more than one (the message says what to do).
    """
    return labs.lab_file_in(Path.cwd())[1]


@dataclass
class TestResult:
    exercise: Exercise
    check: str
    score: float
    max_score: float
    verdict: Verdict
    image: Optional[str] = None  # yours / reference / difference picture of a failed numeric check

    @property
    def name(self) -> str:
        return f"{self.exercise.id} {self.exercise.function}: {self.check.replace('_', ' ')}"

    def output(self) -> str:
        lines = [] if self.verdict.passed else [self.verdict.message.strip() or "failed"]
        if self.verdict.passed and self.verdict.message:
            lines.append(self.verdict.message)
        for f in self.verdict.findings:
            if f["message"] not in self.verdict.message:
                lines.append(f"-> [{f['code']}] {_indented(f['message'], 3)}")
        if self.image:
            lines.append(f"picture: {self.image}")
        return "\n".join(lines)


@dataclass
class GradeReport:
    path: Path
    results: list[TestResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    problem: str = ""  # a problem with the whole file (it does not import, ...)
    seed: int = 0  # the inputs' seed, for the instructor only: never in what the learner reads
    run_id: str = field(default_factory=lambda: secrets.token_hex(6))  # what the learner sees of this run
    sandboxed: bool = False  # ran inside the bwrap OS sandbox
    memory_fence: str = ""  # how the submission's memory was capped
    identity: str = ""  # whom its processes ran as on the host
    launcher: str = ""  # how its sandbox was made: 'bwrap', 'template' (class grading), 'user' or 'none'
    restarts: int = 0  # times the sandbox server had to be replaced (it was stopped or killed)
    pending: list = field(default_factory=list)  # exercises not graded yet (an interrupted run)
    environment_problem: str = ""  # the grader's installation lacks a module the lab allows (not scored)
    lab: str = "01-attention"  # which lab's checks graded it
    source_sha256: str = ""  # SHA-256 of the bytes that were checked and run (the one read)
    notes: list[str] = field(default_factory=list)  # how the submission was taken (a notebook, a zip, a name)
    shape_sha256: str = ""  # its syntax tree's shape: names, strings and comments aside (static.shape_digest)
    # how the file is named in what the learner reads: relative to the class folder or Gradescope's
    # submission/ (no absolute path of the grading machine reaches a learner); '' shows ``path``
    shown_as: str = ""

    @property
    def score(self) -> float:
        return sum(r.score for r in self.results)

    @property
    def max_score(self) -> float:
        return sum(r.max_score for r in self.results)

    def exercise_scores(self) -> dict[str, tuple[float, float]]:
        out: dict[str, tuple[float, float]] = {}
        for r in self.results:
            s, m = out.get(r.exercise.id, (0.0, 0.0))
            out[r.exercise.id] = (s + r.score, m + r.max_score)
        return out

    def first_unfinished(self) -> Optional[Exercise]:
        for r in self.results:
            if not r.verdict.passed:
                return r.exercise
        return None

    # ------------------------------------------------------------------ text
    def to_text(self, colour: bool = False) -> str:
        green, red, yellow, dim, bold, reset = (("\033[32m", "\033[31m", "\033[33m", "\033[2m", "\033[1m", "\033[0m")
                                                if colour else ("",) * 6)
        shown = printable(self.shown_as or self.path)  # a learner names the file: no escape sequence reaches a terminal
        lines = [f"{bold}attnlab grade{reset} (lab {self.lab}): {shown}", ""]
        lines += [f"{dim}note: {n}{reset}" for n in self.notes] + ([""] if self.notes else [])
        if self.problem:
            lines += [f"{red}{self.problem}{reset}", ""]
        by_ex: dict[str, list[TestResult]] = {}
        for r in self.results:
            by_ex.setdefault(r.exercise.id, []).append(r)
        whole_file = self.problem.strip()  # said once above: every exercise failing for it says no more
        stubs = 0
        for ex_id, rs in by_ex.items():
            ex = rs[0].exercise
            s, m = sum(r.score for r in rs), sum(r.max_score for r in rs)
            mark = f"{green}PASS{reset}" if s == m else (f"{yellow}PART{reset}" if s > 0 else f"{red}FAIL{reset}")
            lines.append(f"{mark} {ex_id:<5} {ex.function:<22} {s:>4g}/{m:<3g} {dim}{ex.title}{reset}")
            failed = [r for r in rs if not r.verdict.passed]
            if whole_file and failed and all(r.verdict.message.strip() == whole_file for r in failed):
                continue
            messages = list(dict.fromkeys(r.verdict.message.strip() or "failed" for r in failed))
            labelled = len(messages) > 1
            for r in failed:
                msg = r.verdict.message.strip() or "failed"
                if msg not in messages:
                    continue  # shown already (several checks failed for one reason)
                messages.remove(msg)
                label = f"{r.check.replace('_', ' ')}: " if labelled else ""
                if label and msg.lower().startswith(label.lower()):
                    label = ""  # the message names its check already ("large scores: ...")
                for i, line in enumerate(msg.splitlines()):
                    lines.append(f"      {label if i == 0 else ''}{line}")
            findings = {(f["code"], f["message"]): f for r in failed for f in r.verdict.findings}
            if findings and all(code == "not_implemented" for code, _ in findings):
                stubs += 1  # its TODO line is above; the hint comes once, after the list
                continue
            named: set[str] = set()
            for (code, message), _ in findings.items():
                if any(message in r.verdict.message for r in failed):
                    continue  # said above; its code gets its own line below
                named.add(code)
                lines.append(f"      {yellow}-> [{code}] {_indented(message, 9)}{reset}")
            for code in dict.fromkeys(code for code, _ in findings):  # every named mistake gets a '->' line
                if code not in named and code != "policy" and code in mistakes.CODES:
                    lines.append(f"      {yellow}-> [{code}] {mistakes.hint(code)}{reset}")
            for r in failed:
                if r.image:
                    lines.append(f"      {dim}picture: {r.image}{reset}")
        if whole_file and self.results and all(not r.verdict.passed for r in self.results):
            lines.append(f"      {dim}(no exercise ran: the problem above stops the whole file){reset}")
        if stubs:
            lines.append(f"{yellow}-> [not_implemented] {stubs} exercise{'s' if stubs > 1 else ''} still "
                         f"raise{'' if stubs > 1 else 's'} NotImplementedError: replace each raise line with your "
                         f"code, one exercise at a time{reset}")
        total = f"{self.score:g}/{self.max_score:g}"
        where = ("in the OS sandbox" if self.sandboxed else "as an unprivileged user of its own, without an OS "
                 "sandbox" if self.launcher == "user" else "not in an OS sandbox")
        lines += ["", f"{bold}Score: {total}{reset}   ({self.elapsed_s:.1f} s of grading, wall clock; run {self.run_id}; "
                      f"{where})"]
        nxt = self.first_unfinished()
        again = f"then run 'attnlab grade' again (graded: {shown})"
        if self.environment_problem:
            lines.append(f"Fix the installation above, {again}.")
        elif self.score == 0 and nxt is not None:
            lines.append(f"Start with {nxt.id}: {nxt.function}() in {printable(self.path.name)}, {again}.")
        elif nxt is not None:
            lines.append(f"Next: {nxt.id} {nxt.function}() in {printable(self.path.name)}, {again}.")
        else:
            lines.append(f"{green}All checks pass{reset} in {shown}.")
        return "\n".join(lines)

    # ------------------------------------------------------------------ JSON
    def to_gradescope(self) -> dict:
        """Gradescope's results.json: score, execution_time, output, tests[], extra_data."""
        tests = []
        results = list(self.results)
        for ex in self.pending:  # an interrupted run: what was not graded scores 0, visibly
            for check, points in ex.checks.items():
                results.append(TestResult(ex, check, 0.0, points,
                                          Verdict(False, "not graded: the grading run was interrupted")))
        for r in results:
            tests.append({
                "name": r.name,
                "score": r.score,
                "max_score": r.max_score,
                "output": r.output(),
                "tags": [r.exercise.id] + sorted({f["code"] for f in r.verdict.findings}),
                "visibility": "visible",
            })
        return {
            "score": self.score,
            "max_score": sum(r.max_score for r in results),
            "execution_time": round(self.elapsed_s, 3),
            "output": "".join(f"Note: {n}\n" for n in self.notes) + (self.problem + "\n" if self.problem else "")
            + f"Score {self.score:g}/{sum(r.max_score for r in results):g}",
            "visibility": "visible",
            "tests": tests,
            "extra_data": {
                "file": printable(self.shown_as or self.path),
                "lab": self.lab,
                "run": self.run_id,  # the seed is the instructor's: a learner who knows it knows the inputs
                "sha256": self.source_sha256,
                "sandbox": {"os_sandbox": self.sandboxed, "memory": self.memory_fence, "identity": self.identity,
                            "made_by": self.launcher, "server_restarts": self.restarts},
                "exercises": {k: {"score": s, "max_score": m} for k, (s, m) in self.exercise_scores().items()},
                "diagnostics": [{"test": r.name, **f} for r in self.results for f in r.verdict.findings],
                "images": {r.name: r.image for r in self.results if r.image},
            },
        }


def grade(path: Optional[os.PathLike] = None, *, limits: Limits = Limits(), total_timeout_s: float = 60.0,
          progress: Optional[Callable[[str], None]] = None, seed: Optional[int] = None,
          images_dir: Optional[os.PathLike] = None, sandbox: str = "auto", untrusted: bool = False,
          checkpoint: Optional[Callable[["GradeReport"], None]] = None, lab: "labs.Lab | str | None" = None,
          within: Optional[os.PathLike] = None, source: Optional[SubmissionBytes] = None,
          note: str = "", inputs_key: Optional[bytes] = None) -> GradeReport:
    """Grade a learner's file. Never raises because of the learner's code.

    Args:
        path: the learner's file (default: the lab file in the current folder,
            :func:`default_lab_path`).
        limits: per-exercise and per-submission limits (time, memory, output, processes).
        total_timeout_s: stop running exercises once they have used this much CPU time (or
            :data:`TOTAL_WALL_FACTOR` times as much wall-clock time); the rest fail as not run.
        progress: called with a short line before each exercise (e.g. to print progress).
        seed: seed of the inputs; None draws a fresh one from the OS's secrets (kept in
            ``report.seed`` for whoever graded, never in what the learner reads: they see
            ``report.run_id``). Inputs differ between runs, so answers cannot be precomputed.
        images_dir: save a yours / reference / |difference| picture there for each failed
            numeric check (when matplotlib is installed); None saves none.
        sandbox: 'auto' (the bwrap OS sandbox where installed, else process limits only),
            'bwrap' (required), 'user' (no bwrap: a fresh unprivileged uid, root only; what
            Gradescope falls back to, :mod:`.sandbox.user`) or 'none' (process limits only).
        untrusted: the file is someone else's: without the OS sandbox, refuse
            (:class:`~attnlab.grading.sandbox.pool.SandboxUnavailable`) unless ``sandbox='none'``.
        checkpoint: called with the report so far after each exercise (the CLI writes
            results.json there, so an interrupted run still leaves a valid one).
        lab: the lab: a :class:`attnlab.labs.Lab`, or its name or number (:data:`attnlab.labs.LABS`);
            default: from the file's folder or name (:func:`attnlab.labs.lab_for_path`).
        within: a folder ``path`` lies in (a class folder, Gradescope's ``submission/``): no
            symbolic link below it is followed (:func:`.submission.read_submission`).
        source: the submission's bytes when the caller has read them already (one read:
            :class:`.submission.SubmissionBytes`); the path is then not opened at all.
        note: how the caller chose this file in the learner's folder (another case, an LMS
            re-download, the only .py file: :func:`.intake.choose`), said in the report.
        inputs_key: the secret every exercise's inputs derive from, with the exercise's id and
            the submission's SHA-256 (:mod:`.inputs`); default: from ``seed``, every bit of it.
            A class passes an HMAC of its secret class key (:func:`.classroom.batch.learner_key`).

    Raises:
        SandboxUnavailable: ``sandbox='bwrap'``, or ``untrusted`` with ``sandbox='auto'``,
            and bwrap cannot be found.
        attnlab.labs.NoLabFile: no ``path`` and no lab file in the current folder.
    """
    t0 = time.perf_counter()
    if untrusted and sandbox == "auto" and pool.bwrap_path() is None:
        raise pool.SandboxUnavailable(
            f"refusing to grade someone else's code without the OS sandbox: {pool.HOW_TO_GET_BWRAP}; "
            "or pass --no-sandbox (sandbox='none') to run it with process limits only")
    if seed is None:
        seed = secrets.randbits(62)
    if inputs_key is None:
        inputs_key = seed_key(seed)
    path = Path(path) if path is not None else default_lab_path()
    # One read (:mod:`.submission`): these bytes, and only these, are checked, run, hashed and signed.
    try:
        read = read_submission(path, within=within, max_bytes=intake.read_cap(path)) if source is None else source
        problem = ""
    except Unreadable as exc:
        read, problem = None, str(exc)
    prepared = None
    if read is not None:  # a notebook's code cells, the file inside a zip: the Python to grade, from that one read
        try:
            hint = labs.find_lab(lab) if lab is not None else labs.lab_for_path(path, b"")
            prepared = intake.prepare(path.name, read.data, hint.file,
                                      tuple(f for f in labs.LAB_FILES if f != hint.file))
        except Unreadable as exc:
            problem = str(exc)
    the_lab = _lab(lab, path, prepared.source if prepared else b"")
    EXERCISES = the_lab.exercises()  # noqa: N806  (the lab's exercise list, in order)
    report = GradeReport(path=path, seed=seed, sandboxed=pool.resolve_mode(sandbox) is not None,
                         lab=the_lab.name, shown_as=_relative(path, within))
    if read is None or prepared is None:
        named = printable(report.shown_as or path)
        report.problem = (f"no file at {named}" if not os.path.lexists(path) and source is None
                          else f"could not read {named}: {clean_text(problem, 600)}")
        _fail_all(report, EXERCISES, Verdict(False, report.problem))
        report.elapsed_s = time.perf_counter() - t0
        return report
    source_bytes = prepared.source
    report.source_sha256 = read.sha256
    report.notes = ([note] if note else []) + prepared.notes
    if prepared.refused:  # a magic, a shell line, a cell that does not parse: refused before anything runs
        report.problem = ("the notebook has lines the grader cannot run as Python, so none of it was run:\n"
                          + "\n".join(prepared.refused[:6]))
        _fail_all(report, EXERCISES, Verdict(False, report.problem, [{"code": "policy", "message": r}
                                                                      for r in prepared.refused[:6]]))
        report.elapsed_s = time.perf_counter() - t0
        return report
    report = _graded(report, path, source_bytes, prepared, the_lab, EXERCISES, limits, total_timeout_s, progress,
                     inputs_key, images_dir, sandbox, checkpoint, t0)
    if prepared.lines is not None:  # a notebook: every 'line N' of its Python said as 'cell C, line M'
        _map_lines(report, prepared.lines, the_lab.file)
    return report


def _relative(path: Path, within: Optional[os.PathLike]) -> str:
    """``path`` as a learner may read it when it lies in a folder of the grader's (a class, Gradescope's
    submission/): relative to that folder; '' (the path itself) for a file the learner graded."""
    if within is None:
        return ""
    try:
        return str(Path(os.path.abspath(path)).relative_to(os.path.abspath(within)))
    except ValueError:
        return path.name


def _indented(message: str, width: int) -> str:
    """A finding's message with every line after the first indented by ``width``: a line break in it
    (a learner's error text) never starts a line of its own that could pass for a report line."""
    return message.replace("\n", "\n" + " " * width)


def _require_kernels(ex: Exercise, verdicts: dict, outcome: Outcome) -> None:
    """Grade what the rule names: a check of an exercise with :attr:`Exercise.kernels` passes only
    when each of those learner kernels was launched for it and the call ran no arithmetic of torch's
    outside them (only the allocation, views, copies and conversions of
    :data:`.sandbox.launchers.LAUNCHER_ATEN`, and no value handed to Python: a kernel that copies
    torch's answer is no kernel's answer); otherwise it is 0 as 'kernel_not_launched', whatever the values. And only what
    the learner's kernels stored is judged: an element of a returned tensor that none of their stores
    wrote last in that call, with the bytes it holds, reads as NaN (the child's record of each store,
    :func:`.sandbox.interpreter.unwritten`), so a check that reads it fails, and a failed check that
    names nothing else, where a whole tensor of the answer was no kernel's, is 'kernel_not_launched'."""
    if not ex.kernels:
        return
    missing = [k for k in ex.kernels if not outcome.launches.get(k)]
    unwritten = sum(r.get("unwritten", 0) for r in outcome.results if "value" in r)
    untouched = sum(r.get("untouched", 0) for r in outcome.results if "value" in r)
    computed = sorted({n for r in outcome.results for n in r.get("torch_compute", ())})
    if missing:
        message = (f"{ex.function}() answered without launching {', '.join(missing)}: this exercise's points are "
                   f"for the kernel{'s' if len(missing) > 1 else ''}, so an answer computed any other way scores 0")
    elif computed:
        message = (f"{ex.function}() computed with torch outside your kernels ({', '.join(computed[:4])}): this "
                   "exercise's points are for what the kernels compute; a launcher may only allocate, view, copy, "
                   "convert and launch (no arithmetic in torch, no value read into Python), so an answer torch "
                   "computed and a kernel copied scores 0")
    else:
        if unwritten:  # those elements read as NaN (interpreter.poison): a failed check says why, once
            note = (f"{unwritten} element{'s' if unwritten > 1 else ''} of what {ex.function}() returned "
                    f"{'were' if unwritten > 1 else 'was'} not stored by your kernels in that call, or changed after "
                    "they stored it: the grader reads those as NaN")
            failed = [v for v in {id(v): v for v in verdicts.values()}.values() if not v.passed]
            for i, v in enumerate(failed):
                if i == 0:
                    v.message += f"\n({note})"
                if untouched and not any(f["code"] not in _SYMPTOMS for f in v.findings):
                    v.findings = [{"code": "kernel_not_launched", "message": note}]  # no kernel's answer at all
        return
    for check, v in verdicts.items():  # a check failed only by the NaN of what no kernel stored says why, too
        if v.passed or not any(f["code"] not in _SYMPTOMS for f in v.findings):
            verdicts[check] = Verdict(False, message, [{"code": "kernel_not_launched", "message": message}])


def _map_lines(report: GradeReport, lines: "intake.LineMap", file_name: str) -> None:
    report.problem = lines.rewrite(report.problem, file_name)
    seen: set[int] = set()
    for r in report.results:
        if id(r.verdict) in seen:  # one Verdict stands for several checks (a failed call): rewritten once
            continue
        seen.add(id(r.verdict))
        r.verdict.message = lines.rewrite(r.verdict.message, file_name)
        r.verdict.findings = [{**f, "message": lines.rewrite(f.get("message", ""), file_name)}
                              for f in r.verdict.findings]


def _graded(report: GradeReport, path: Path, source_bytes: bytes, prepared: "intake.Prepared", the_lab: "labs.Lab",
            EXERCISES: list, limits: Limits, total_timeout_s: float, progress, inputs_key: bytes, images_dir,  # noqa: N803
            sandbox: str, checkpoint, t0: float) -> GradeReport:
    """The static check, then every exercise in the sandbox (what :func:`grade` does once the
    submission is read and prepared)."""

    # The from-scratch rule on the text, before any of it runs; the functions allowed torch's attention
    exempt = {ex.function for ex in EXERCISES if not ex.policy}
    static = check_source(source_bytes, path.name if prepared.kind == "py" else the_lab.file, the_lab.allowed_names,
                          the_lab.modules, the_lab.decorators, exempt)
    report.shape_sha256 = shape_digest(static.tree)
    missing = missing_modules(static.imports)
    if missing and not static.syntax_error:  # the grader's installation, not the learner's code
        return _environment_problem(report, EXERCISES, t0,
                                    f"the file imports {', '.join(missing)}, which is not installed where the grader "
                                    f"runs. Install it with: {install_command(missing)}, then grade again.")
    refused = static.refusals(exempt)
    if static.syntax_error:
        report.problem = f"could not import the file:\n{static.syntax_error}"
    elif refused:  # complete mediation: a violation anywhere refuses the whole file
        report.problem = ("[policy] the file breaks the rules of the lab, so none of it was run:\n"
                          + describe(refused) + f"\n{the_lab.rule}")
    if report.problem:
        _fail_all(report, EXERCISES, Verdict(False, report.problem, _policy_findings(refused)))
        report.elapsed_s = time.perf_counter() - t0
        return report

    # the copy in the sandbox is named like the learner's file, or like the lab's where that is not a
    # plain .py name (a notebook, 'attention (1).py'): tracebacks then say attention.py, not submission.py
    box_path = path if prepared.kind == "py" and submission_name(path) == path.name else path.with_name(the_lab.file)
    with Sandbox(box_path, limits, mode=sandbox, source=source_bytes) as box:
        if images_dir is not None and not box.sandboxed:
            # outside the OS sandbox the learner's processes may write where this process imports from:
            # every grader module is loaded before any learner code runs. In it (read-only binds, a
            # private /tmp) matplotlib waits until a picture is due: 0.19 s of a passing file's grade.
            from attnlab import viz

            viz.matplotlib_available()
        # First: does the file import at all? One child, so a broken file fails fast and once.
        first = box.run([], policy=True)
        report.sandboxed, report.memory_fence, report.launcher = box.sandboxed, box.memory_fence, box.launcher
        report.identity = box.identity
        if first.environment:  # the sandbox could not start here: nothing of the learner's ran
            return _environment_problem(report, EXERCISES, t0,
                                        f"the grader's OS sandbox could not start on this machine "
                                        f"({first.environment}), so your file was not graded. For the instructor: "
                                        f"'attnlab grade --self-test' says why; fix the grader's machine or "
                                        f"container, then grade again"
                                        + (" (or, knowingly, pass --seccomp-optional to grade without the filter)."
                                           if "seccomp" in first.environment else "."))
        if first.unfiltered:  # the instructor allowed it: every report says so
            report.notes.append(f"graded WITHOUT the seccomp filter: {first.unfiltered}; the instructor allowed "
                                "it (--seccomp-optional)")
        if first.status != "ok" or first.violations:
            report.problem = _whole_file_problem(first)
            _fail_all(report, EXERCISES, Verdict(False, report.problem, [{"code": "policy", "message": v}
                                                                         for v in first.violations[:6]]))
            report.elapsed_s = time.perf_counter() - t0
            return report
        report.pending = list(EXERCISES)
        tree = static.tree  # for reading tracebacks against the learner's own lines (errors.explain)
        names = (path.name, box_path.name, the_lab.file)
        cpu_used = first.cpu_s  # the total budget is CPU time too; wall clock only as a backstop
        judge = _Judge(report, the_lab, tree, names, static, images_dir is not None, t0, checkpoint)
        # One task at a time in the sandbox, as before; but exercise i+1 is sent before exercise i is
        # judged, so the judging (float64 references, the doctor's fits) runs on the other core while
        # the learner's child runs: 0.1-0.2 s of a lab's grade. Whether i+1 runs is decided as before,
        # on the CPU of every task finished so far (i's included).
        waiting = None  # (exercise, its context, its outcome): finished, not yet judged
        for i, ex in enumerate(EXERCISES):
            if cpu_used > total_timeout_s or time.perf_counter() - t0 > total_timeout_s * TOTAL_WALL_FACTOR:
                judge.done(waiting)
                waiting = None
                judge.skipped(ex, Verdict(False, f"not run: the total time limit ({total_timeout_s:g} s of CPU"
                                                 f", {total_timeout_s * TOTAL_WALL_FACTOR:g} s of wall clock) "
                                                 "was reached"))
                continue
            if progress:
                progress(f"{ex.id} {ex.function}")
            # the generator's whole state from the run's key, the exercise and these bytes (.inputs)
            calls, ctx = ex.prepare(inputs_generator(inputs_key, ex.id, report.source_sha256))
            # the recorder judges every exercise; compare_with_sdpa's allowance holds on its own call path only
            task = box.start(calls, policy=True, exempt=() if ex.policy else (ex.function,), traced=bool(ex.kernels),
                             limits=dataclasses.replace(limits, **ex.limits) if ex.limits else None)
            judge.done(waiting)  # the exercise before, while this one runs
            outcome = box.finish(task)
            cpu_used += outcome.cpu_s
            waiting = (ex, ctx, outcome)
        judge.done(waiting)
        report.restarts = box.restarts
    if images_dir is not None:
        _save_pictures(report, Path(images_dir))
    report.elapsed_s = time.perf_counter() - t0
    return report


class _Judge:
    """Judges each finished exercise into the report, in the exercises' order (:func:`_graded`)."""

    def __init__(self, report: GradeReport, the_lab, tree, names: tuple, static, pictures: bool, t0: float,
                 checkpoint) -> None:
        self.report, self.lab, self.tree, self.names, self.static = report, the_lab, tree, names, static
        self.pictures, self.t0, self.checkpoint = pictures, t0, checkpoint

    def done(self, waiting) -> None:
        """Judge ``(exercise, context, outcome)`` (nothing for None) and record its checks."""
        if waiting is None:
            return
        ex, ctx, outcome = waiting
        try:
            verdicts = judge_outcome(ex, ctx, outcome, self.lab.rule)
        except Exception as exc:  # a judge must never cost the learner their report
            verdicts = {c: Verdict(False, f"could not be checked: {type(exc).__name__}") for c in ex.checks}
        explained: dict[int, list] = {}  # one explanation per verdict object (a failed call shares one)
        for v in verdicts.values():
            if not v.passed and not v.findings:
                if id(v) not in explained:
                    try:  # the learner's file, parsed: a judge of it must never cost the report
                        explained[id(v)] = errors.explain(v.message, self.tree, self.names)
                    except Exception:
                        explained[id(v)] = []
                v.findings = explained[id(v)]
        _require_kernels(ex, verdicts, outcome)
        _share_within(verdicts)
        _blame_upstream(self.report, ex, verdicts, self.static)
        for check, points in ex.checks.items():
            v = verdicts.get(check) or Verdict(False, "not checked")
            _keep_arrays_for_pictures(v, self.pictures)
            self.report.results.append(TestResult(ex, check, points if v.passed else 0.0, points, _clean(v)))
        self._recorded(ex)

    def skipped(self, ex: Exercise, verdict: Verdict) -> None:
        """Record an exercise that was not run, every check failed with ``verdict``."""
        _fail_all(self.report, [ex], verdict)
        self._recorded(ex)

    def _recorded(self, ex: Exercise) -> None:
        self.report.pending.remove(ex)  # only now: an interruption before leaves it listed as not graded
        self.report.elapsed_s = time.perf_counter() - self.t0
        if self.checkpoint:
            self.checkpoint(self.report)


_SYMPTOMS = ("unknown", "shape_error")
# findings about an exercise's own code (what it keeps, what it calls), not about the values it
# returns: an upstream mistake cannot cause them
_STRUCTURAL = ("scores_materialized", "policy", "not_implemented", "memory_limit")


def _share_within(verdicts: dict[str, Verdict]) -> None:
    """One function, one diagnosis: a failed check of an exercise that found no named mistake
    of its own (nothing, or only a symptom) takes what its sibling checks named: the inverted
    mask that one check names also explains the zeros another returns."""
    named = [f for v in verdicts.values() if not v.passed for f in v.findings if f["code"] not in _SYMPTOMS]
    if not named:
        return
    unique = list({f["code"]: f for f in named}.values())
    for v in verdicts.values():
        if not v.passed and all(f["code"] in _SYMPTOMS for f in v.findings):
            v.findings = unique


def _blame_upstream(report: GradeReport, ex: Exercise, verdicts: dict[str, Verdict], static) -> None:
    """An exercise whose function calls the learner's own function of an earlier exercise that
    was found wrong (``self_attention`` calling ``attention_scores``) fails *because of* it, most
    likely: its failed checks name the earlier exercise's mistakes and say to fix that first,
    instead of a diagnosis of their own that would describe the same bug as another (Q and K
    swapped in ex1 looks like transposed scores from ex8's side)."""
    reach = static.reachable(ex.function) - {ex.function}
    upstream: dict[str, list[dict]] = {}
    for r in report.results:
        if r.exercise.function in reach and r.exercise is not ex and not r.verdict.passed and r.verdict.findings:
            found = upstream.setdefault(f"{r.exercise.id} {r.exercise.function}()", [])
            found += [f for f in r.verdict.findings if f["code"] not in {g["code"] for g in found}
                      and f["code"] not in ("policy", "not_implemented")]
    upstream = {k: v for k, v in upstream.items() if v}
    if not upstream:
        return
    where = " and ".join(upstream)
    codes = ", ".join(sorted({f["code"] for v in upstream.values() for f in v}))
    noted = False
    for v in {id(v): v for v in verdicts.values()}.values():  # one Verdict may stand for several checks
        if v.passed or any(f["code"] in _STRUCTURAL for f in v.findings):
            continue  # a check of the exercise's own structure (what it saves, how much memory) stands
        if not noted:  # said once per exercise, under its first failed check
            v.message += (f"\n(this builds on your {where}, which failed with [{codes}]: fix that first, then grade "
                          "again)")
            noted = True
        v.findings = [f for found in upstream.values() for f in found]


# what installs each module a lab's files may import (the static check's allow-list)
_INSTALL = {"jaxtyping": "pip install 'attnlab[lab]'  (or: pip install jaxtyping)",
            "triton": "pip install 'attnlab[triton]'  (or: pip install triton; lab 05 runs it on the CPU)"}


def missing_modules(modules) -> list[str]:
    """The modules of ``modules`` that cannot be imported where the grader runs."""
    import importlib.util

    return sorted(m for m in modules if importlib.util.find_spec(m) is None)


def install_command(modules: list[str]) -> str:
    return "; ".join(_INSTALL.get(m, f"pip install {m}") for m in modules)


def _keep_arrays_for_pictures(v: Verdict, pictures: bool) -> None:
    """A failed check's tensors are kept only for a picture that will be drawn, and only when small
    enough to draw (:data:`PICTURE_MAX_ELEMENTS`): a learner's answers of ~60 MB per exercise
    must not pile up in the grader's memory, times the class's ``--jobs``."""
    if v.arrays is None:
        return
    if not pictures or v.passed or any(a.numel() > PICTURE_MAX_ELEMENTS for a in v.arrays):
        v.arrays = None
    else:
        v.arrays = tuple(a.detach().clone() for a in v.arrays)  # not views of a learner's larger answer


def _clean(v: Verdict) -> Verdict:
    """Learner text (messages built from its errors and output) made safe to print and store."""
    v.message = clean_text(v.message)
    v.findings = [{**f, "message": clean_text(f.get("message", ""), 1000)} for f in v.findings]
    return v


def _policy_findings(violations) -> list[dict]:
    return [{"code": "policy", "message": str(v)} for v in list(violations)[:6]]


def _save_pictures(report: GradeReport, folder: Path) -> None:
    from attnlab import viz

    due = [r for r in report.results if not r.verdict.passed and r.verdict.arrays is not None]
    if not due or not viz.matplotlib_available():
        return
    for r in due:
        arrays = r.verdict.arrays
        folder.mkdir(parents=True, exist_ok=True)
        mine, reference = arrays
        if mine.numel() > PICTURE_MAX_ELEMENTS or reference.numel() > PICTURE_MAX_ELEMENTS:
            continue  # a picture of a huge tensor tells nothing and costs the grader
        if mine.dtype == torch.bool or reference.dtype == torch.bool:
            mine, reference = mine.double(), reference.double()
        path = folder / f"{r.exercise.id}-{r.check}.png"
        try:
            viz.save(viz.compare(mine, reference, name=f"{r.exercise.function}: {r.check}"), str(path))
        except Exception:  # a picture must never cost the learner their report
            continue
        r.image = str(path)


def _whole_file_problem(o: Outcome) -> str:
    if o.status == "import_error":
        return f"could not import the file:\n{o.traceback or o.message}"
    if o.violations:
        return f"[policy] policy violation while importing the file: it reached {', '.join(o.violations)}"
    text = f"importing the file failed: {o.message}"
    return text + (f"\nit printed:\n{o.output}" if o.output else "")


def _lab(lab: "labs.Lab | str | None", path: Path, source: Optional[bytes] = None) -> "labs.Lab":
    """The lab to grade ``path`` with: the one given (an object, or a name looked up), else the file's."""
    if isinstance(lab, labs.Lab):
        return lab
    return labs.find_lab(lab) if lab is not None else labs.lab_for_path(path, source)


def not_graded(path: os.PathLike, why: str, *, lab: "labs.Lab | str | None" = None, seed: Optional[int] = None) -> GradeReport:
    """The report of a file that was not graded because of the grader's environment (no
    sandbox can run here): every check 0 points, and ``why`` for the instructor, never as the
    learner's mistake. Runs none of the file's code."""
    path = Path(path)
    the_lab = _lab(lab, path)
    report = GradeReport(path=path, seed=secrets.randbelow(2**31) if seed is None else seed, lab=the_lab.name,
                         shown_as=Path(path).name)  # Gradescope's: its folders are the grading machine's
    return _environment_problem(report, the_lab.exercises(), time.perf_counter(), why)


def _environment_problem(report: GradeReport, exercises: list[Exercise], t0: float, why: str) -> GradeReport:
    """End ``report`` with a problem of the grader's installation or machine, not the learner's
    (no points, and it says so: the class status 'grader environment')."""
    report.environment_problem = f"not a mistake in your code: {why}"
    report.problem = report.environment_problem
    _fail_all(report, exercises, Verdict(False, report.problem))
    report.elapsed_s = time.perf_counter() - t0
    return report


def _fail_all(report: GradeReport, exercises: list[Exercise], verdict: Verdict) -> None:
    for ex in exercises:
        for check, points in ex.checks.items():
            report.results.append(TestResult(ex, check, 0.0, points, verdict))


def supports_colour(stream=sys.stdout) -> bool:
    return stream.isatty() and os.environ.get("NO_COLOR") is None and os.environ.get("TERM") != "dumb"


class ResultsFile:
    """Gradescope's results.json at ``path``, kept valid through a grading run.

    :meth:`start` writes a report in which every exercise is pending ("grading did not
    finish") before anything runs; :meth:`checkpoint` (pass it as ``grade(checkpoint=...)``)
    rewrites it after each exercise, so a run killed at any moment leaves a valid file.
    """

    def __init__(self, path: Optional[os.PathLike]):
        self.path = Path(path) if path is not None else None
        self.latest: Optional[GradeReport] = None

    def start(self, path: Path, lab: "labs.Lab", seed: Optional[int]) -> None:
        self.checkpoint(GradeReport(path=path, seed=seed or 0, pending=list(lab.exercises()),
                                    problem="grading did not finish", lab=lab.name))

    def checkpoint(self, report: GradeReport) -> None:
        self.latest = report
        if self.path is not None:
            write_json(self.path, report.to_gradescope())
