"""Grade a learner's ``attention.py`` safely, with feedback that names the mistake.

    report = grade("labs/track1/01-attention/attention.py")
    print(report.to_text())
    json.dump(report.to_gradescope(), open("results.json", "w"))

Every exercise runs in its own sandboxed child process (:mod:`.sandbox`); the
checks and the float64 reference live in :mod:`.checks`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from attnlab.grading.checks import EXERCISES, Exercise, Verdict, judge_outcome
from attnlab.grading.sandbox import Limits, Outcome, Sandbox

__all__ = ["grade", "GradeReport", "TestResult", "default_lab_path", "Limits"]

LAB_RELATIVE = Path("labs/track1/01-attention/attention.py")


def default_lab_path() -> Path:
    """The lab's ``attention.py``: under the current folder, else in attnlab's own checkout."""
    here = Path.cwd() / LAB_RELATIVE
    if here.is_file():
        return here
    repo = Path(__file__).resolve().parents[3] / LAB_RELATIVE
    return repo if repo.is_file() else here


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
                lines.append(f"-> [{f['code']}] {f['message']}")
        if self.image:
            lines.append(f"picture: {self.image}")
        return "\n".join(lines)


@dataclass
class GradeReport:
    path: Path
    results: list[TestResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    problem: str = ""  # a problem with the whole file (it does not import, ...)

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
        lines = [f"{bold}attnlab grade{reset}: {self.path}", ""]
        if self.problem:
            lines += [f"{red}{self.problem}{reset}", ""]
        by_ex: dict[str, list[TestResult]] = {}
        for r in self.results:
            by_ex.setdefault(r.exercise.id, []).append(r)
        for ex_id, rs in by_ex.items():
            ex = rs[0].exercise
            s, m = sum(r.score for r in rs), sum(r.max_score for r in rs)
            mark = f"{green}PASS{reset}" if s == m else (f"{yellow}PART{reset}" if s > 0 else f"{red}FAIL{reset}")
            lines.append(f"{mark} {ex_id:<5} {ex.function:<22} {s:>4g}/{m:<3g} {dim}{ex.title}{reset}")
            failed = [r for r in rs if not r.verdict.passed]
            messages = list(dict.fromkeys(r.verdict.message.strip() or "failed" for r in failed))
            labelled = len(messages) > 1
            for r in failed:
                msg = r.verdict.message.strip() or "failed"
                if msg not in messages:
                    continue  # shown already (several checks failed for one reason)
                messages.remove(msg)
                label = f"{r.check.replace('_', ' ')}: " if labelled else ""
                for i, line in enumerate(msg.splitlines()):
                    lines.append(f"      {label if i == 0 else ''}{line}")
            findings = {(f["code"], f["message"]): f for r in failed for f in r.verdict.findings}
            for (code, message), _ in findings.items():
                if not any(message in r.verdict.message for r in failed):
                    lines.append(f"      {yellow}-> [{code}] {message}{reset}")
            for r in failed:
                if r.image:
                    lines.append(f"      {dim}picture: {r.image}{reset}")
        total = f"{self.score:g}/{self.max_score:g}"
        lines += ["", f"{bold}Score: {total}{reset}   ({self.elapsed_s:.1f} s)"]
        nxt = self.first_unfinished()
        if self.score == 0 and nxt is not None:
            lines.append(f"Start with {nxt.id}: {nxt.function}() in {self.path.name}, then run 'attnlab grade' again.")
        elif nxt is not None:
            lines.append(f"Next: {nxt.id} {nxt.function}().")
        else:
            lines.append(f"{green}All checks pass.{reset}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ JSON
    def to_gradescope(self) -> dict:
        """Gradescope's results.json: score, execution_time, output, tests[], extra_data."""
        tests = []
        for r in self.results:
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
            "max_score": self.max_score,
            "execution_time": round(self.elapsed_s, 3),
            "output": (self.problem + "\n" if self.problem else "") + f"Score {self.score:g}/{self.max_score:g}",
            "visibility": "visible",
            "tests": tests,
            "extra_data": {
                "file": str(self.path),
                "exercises": {k: {"score": s, "max_score": m} for k, (s, m) in self.exercise_scores().items()},
                "diagnostics": [{"test": r.name, **f} for r in self.results for f in r.verdict.findings],
                "images": {r.name: r.image for r in self.results if r.image},
            },
        }


def grade(path: Optional[os.PathLike] = None, *, limits: Limits = Limits(), total_timeout_s: float = 60.0,
          progress: Optional[Callable[[str], None]] = None, seed: int = 0,
          images_dir: Optional[os.PathLike] = None) -> GradeReport:
    """Grade a learner's file. Never raises because of the learner's code.

    Args:
        path: the learner's ``attention.py`` (default: the lab's).
        limits: per-exercise limits (time, memory, output).
        total_timeout_s: stop running exercises after this long; the rest fail as not run.
        progress: called with a short line before each exercise (e.g. to print progress).
        seed: base seed of the inputs.
        images_dir: save a yours / reference / |difference| picture there for each failed
            numeric check (when matplotlib is installed); None saves none.
    """
    t0 = time.perf_counter()
    Sandbox.start()
    path = Path(path) if path is not None else default_lab_path()
    report = GradeReport(path=path)
    if not path.is_file():
        report.problem = f"no file at {path}"
        _fail_all(report, EXERCISES, Verdict(False, f"no file at {path}"))
        report.elapsed_s = time.perf_counter() - t0
        return report

    sandbox = Sandbox(path, limits)
    # First: does the file import at all? One child, so a broken file fails fast and once.
    first = sandbox.run([], policy=True)
    if first.status != "ok" or first.violations:
        report.problem = _whole_file_problem(first)
        _fail_all(report, EXERCISES, Verdict(False, report.problem))
        report.elapsed_s = time.perf_counter() - t0
        return report

    for i, ex in enumerate(EXERCISES):
        if time.perf_counter() - t0 > total_timeout_s:
            _fail_all(report, [ex], Verdict(False, f"not run: the total time limit ({total_timeout_s:g} s) was reached"))
            continue
        if progress:
            progress(f"{ex.id} {ex.function}")
        calls, ctx = ex.prepare(torch.Generator().manual_seed(seed * 1000 + i))
        outcome = sandbox.run(calls, policy=ex.policy)
        verdicts = judge_outcome(ex, ctx, outcome)
        for check, points in ex.checks.items():
            v = verdicts[check]
            report.results.append(TestResult(ex, check, points if v.passed else 0.0, points, v))
    if images_dir is not None:
        _save_pictures(report, Path(images_dir))
    report.elapsed_s = time.perf_counter() - t0
    return report


def _save_pictures(report: GradeReport, folder: Path) -> None:
    from attnlab import viz

    if not viz.matplotlib_available():
        return
    for r in report.results:
        arrays = r.verdict.arrays
        if r.verdict.passed or arrays is None:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        mine, reference = arrays
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
        return f"policy violation while importing the file: it reached {', '.join(o.violations)}"
    text = f"importing the file failed: {o.message}"
    return text + (f"\nit printed:\n{o.output}" if o.output else "")


def _fail_all(report: GradeReport, exercises: list[Exercise], verdict: Verdict) -> None:
    for ex in exercises:
        for check, points in ex.checks.items():
            report.results.append(TestResult(ex, check, 0.0, points, verdict))


def supports_colour(stream=sys.stdout) -> bool:
    return stream.isatty() and os.environ.get("NO_COLOR") is None and os.environ.get("TERM") != "dumb"
