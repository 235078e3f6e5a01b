"""Grades do not depend on the machine's load (issue 23): each exercise's budget is CPU time
of its own process, with a wall-clock backstop several times longer that only stops what
waits. With 7x more runnable processes than cores and the tightest per-exercise limit the
tests use, every lab's solution gets full marks with every check passing (as on an idle
machine), and an endless loop is still stopped, by its CPU budget."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.grading import Limits, grade
from helpers import procs
from helpers.procs import needs_sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

TRACK = Path(__file__).resolve().parents[2] / "labs" / "track1"
TIGHTEST = Limits(timeout_s=1.5)  # tests/grading/test_grading.py's FAST: the smallest per-exercise limit the tests use
LOAD = 7  # runnable processes per core


def _spin() -> None:
    os.setsid()  # a session of its own: with sched_autogroup each session gets a fair share, as the sandbox does
    while True:
        pass


def _spin_and_sleep() -> None:
    """Busy 2 ms, asleep 1.5 ms, for ever: what other gradings' processes look like to the
    scheduler (each waits on pipes and children), and what made the kernel's tick-sampled CPU
    count overcharge a busy process sharing its core (the server's _budget_signal)."""
    import time

    os.setsid()
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.002:
            pass
        time.sleep(0.0015)


@contextmanager
def loaded_core(graders: int, spinners: "int | None" = None, target=_spin):
    """LOAD runnable processes per core, the ``graders`` gradings included, on one core.

    The calling thread is pinned to one of its cores first: the spinners and the graders'
    sandboxes (started from it, or from threads it starts) inherit that, so the load is LOAD x on
    that core and the rest of the machine is left to whatever else runs (the suite's other xdist
    worker: with the load spread over both of 2 cores it was starved for these two tests' ~110 s,
    2026-12-03)."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {max(allowed)})
    ctx = multiprocessing.get_context("fork")
    count = max(1, LOAD - graders) if spinners is None else spinners
    spinners = [ctx.Process(target=target, daemon=True) for _ in range(count)]
    try:
        for p in spinners:
            p.start()
        yield len(spinners)
    finally:
        for p in spinners:
            if p.pid is not None:
                p.kill()
                p.join()
        os.sched_setaffinity(0, allowed)


def test_every_labs_solution_gets_full_marks_at_7x_oversubscription(tmp_path):
    needs_sandbox()
    files = []
    for lab in labs.LABS:
        (tmp_path / lab.name).mkdir()
        files.append(shutil.copy(TRACK / lab.name / "solutions" / lab.file, tmp_path / lab.name / lab.file))
    with loaded_core(len(files)), ThreadPoolExecutor(len(files)) as pool:
        reports = list(pool.map(lambda f: grade(f, limits=TIGHTEST, seed=11, untrusted=True), files))
    for report in reports:
        failed = [r.name for r in report.results if not r.verdict.passed]
        assert report.score == report.max_score and not failed, (report.lab, failed, report.to_text()[-2000:])


def test_slow_honest_work_passes_and_an_endless_loop_is_stopped_under_load(tmp_path):
    """One submission, graded at 7x load with the tightest budget (1.5 s of CPU):

    * ``project_qkv`` first does 0.3-0.5 s of CPU (12M Python additions, once per exercise):
      about 3 s of wall clock at this load. A wall-clock limit failed it (shown with
      ``Limits(timeout_s=1.5, wall_factor=1.0)``: "ex1 did not finish within 1.5 s of
      wall-clock time, using 0.3 s of CPU"); the CPU budget does not.
    * ``attention_scores`` spins forever: still stopped, by its CPU budget.
    """
    needs_sandbox()
    submission = tmp_path / "attention.py"
    submission.write_text((TRACK / "01-attention/solutions/attention.py").read_text() + '''

_project_qkv = project_qkv
_first = [True]  # each exercise runs in a fresh process: the slow work happens once per exercise


def project_qkv(X, W_Q, W_K, W_V):
    if _first:
        _first.pop()
        s = 0
        for i in range(12_000_000):  # honest but slow work
            s += i
    return _project_qkv(X, W_Q, W_K, W_V)


def attention_scores(Q, K):
    while True:
        pass
''')
    with loaded_core(1):
        report = grade(submission, limits=TIGHTEST, seed=11, untrusted=True)
    by_ex = {}
    for r in report.results:
        by_ex.setdefault(r.exercise.id, []).append(r)
    assert all(r.verdict.passed for r in by_ex["ex1"]), report.to_text()[-2000:]
    assert not any(r.verdict.passed for r in by_ex["ex2"])
    assert "did not finish within 1.5 s of CPU time" in by_ex["ex2"][0].verdict.message
    independent = [r for ex in ("ex3", "ex4", "ex5", "ex6", "ex7", "ex10", "ex11") for r in by_ex[ex]]
    assert all(r.verdict.passed for r in independent), [r.name for r in independent if not r.verdict.passed]


def test_a_loaded_core_does_not_shrink_the_cpu_budget_and_ignoring_it_is_still_a_timeout(tmp_path):
    """Beside two processes that spin and sleep on the same core, a task that needs 85% of its
    1 s budget of CPU passes, and one that ignores the budget's signals to run 1.6 s is a timeout.
    With the budget's signal from ITIMER_PROF, whose count the kernel samples at each tick, the
    first was stopped as a timeout at 0.75-0.84 s of real CPU under this load, and RLIMIT_CPU's
    SIGKILL at the budget's whole second ended the second at 0.81-0.85 s, read as a crash (seen in
    CI as 1.90 s of a 2 s budget, with the grader's threshold at 1.9 s)."""
    from attnlab.grading.sandbox import Call, Sandbox

    needs_sandbox()
    path = tmp_path / "attention.py"
    path.write_text(procs.BURN)
    with loaded_core(1, spinners=2, target=_spin_and_sleep), \
            Sandbox(path, Limits(timeout_s=1.0), mode="bwrap") as box:
        honest = box.run([Call("burn", (0.85,))], policy=False)
        ignoring = box.run([Call("ignore_the_signals", (1.6,))], policy=False)
    assert honest.status == "ok" and honest.results[0]["value"] == 42, (honest.status, honest.cpu_s, honest.message)
    assert 0.85 <= honest.cpu_s < 1.0, honest.cpu_s
    assert ignoring.status == "timeout", (ignoring.status, ignoring.cpu_s, ignoring.message)
    assert ignoring.cpu_s > 1.0, ignoring.cpu_s
