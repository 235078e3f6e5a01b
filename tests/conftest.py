import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Deterministic, unhurried property tests: CI runs on a shared 2-core machine.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=40,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("large", parent=settings.get_profile("default"), max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Under pytest-xdist ('make test': two workers on two cores) each worker's torch takes one thread.
# Two workers of two threads each left torch's parallel regions waiting on descheduled threads: in
# CI's run on two workers (2026-12-03, 2-core AVX2 EPYC) the doctor's seed test took 50-88 s, under
# 13 s in one process. Tests of thread counts set their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))

# Triton kernels (attnlab.triton, lab 05) run on the CPU through Triton's interpreter, which is
# chosen when @triton.jit decorates a kernel: set before any test imports one. Nothing else reads it.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def bwrap():
    """The real sandbox: a failure in CI without bwrap ('make test' installs it), else a skip."""
    from helpers.procs import needs_sandbox

    needs_sandbox()


@pytest.fixture
def gen():
    """A seeded generator, so every test draws the same numbers on every run."""
    return torch.Generator().manual_seed(1234)


def pytest_configure(config):
    """One fuzz seed for the whole run, set before pytest-xdist starts its workers (they inherit it)."""
    from helpers.ci import fuzz_seed

    fuzz_seed()


def pytest_report_header(config):
    from helpers.ci import FUZZ_SEED_VARIABLE, fuzz_seed

    return f"fuzz seed: {fuzz_seed()} (replay: {FUZZ_SEED_VARIABLE}={fuzz_seed()})"


def pytest_terminal_summary(terminalreporter):
    from helpers import parity_stats

    if parity_stats.COUNT["cases"]:
        terminalreporter.write_line(parity_stats.summary())


def pytest_sessionfinish(session):
    """Under pytest-xdist ('make test' runs two workers) each worker hands its parity statistics
    to the controller, which prints the one summary."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        from helpers import parity_stats

        workeroutput["parity_stats"] = parity_stats.export()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from helpers import parity_stats

    data = getattr(node, "workeroutput", {}).get("parity_stats")
    if data:
        parity_stats.merge(data)


def _become_subreaper() -> None:
    """Orphans of this test process's descendants (a sandbox whose grader was killed, a
    learner's double-forked daemon) are re-parented to this process instead of pid 1, so
    the leftover checks can look at this process's own tree only (tests/procs.own_processes)
    and pass while other gradings and test runs share the machine."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        PR_SET_CHILD_SUBREAPER = 36  # noqa: N806  (linux/prctl.h)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def pytest_configure(config):
    _become_subreaper()
    # the suite grades hundreds of submissions in one process: keep the next sandbox
    # server importing torch while the current one grades (attnlab.grading.sandbox.pool.keep_spare)
    from attnlab.grading.sandbox import pool

    pool.keep_spare(True)


@pytest.fixture
def force_routes():
    """Force native-layer route switches for one test, ``force_routes(bf16="fp32")``
    (:func:`attnlab.kernels.routes.forced`), in place of the environment, which is read once."""
    import contextlib

    from attnlab.kernels import routes

    with contextlib.ExitStack() as stack:
        yield lambda **switches: stack.enter_context(routes.forced(**switches))

