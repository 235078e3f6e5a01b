"""Process helpers for the grader's tests: which processes belong to the spare sandbox
server (started ahead, no learner code in it), so that leftover checks can ignore it, and
the two ways of making a submission's sandbox that the hostile and fence tests run."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from attnlab.grading.sandbox import pool
from helpers.ci import cannot_run


def process_tree(root: int) -> set[int]:
    """``root`` and its descendants, from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, []))
    return tree


def own_processes(*marks: str, ignore: frozenset = frozenset()) -> list[str]:
    """Processes of this test process's own tree (conftest makes it a subreaper, so orphans
    of its sandboxes are still in it) whose command line holds one of ``marks``, but the
    spare server (no learner code has run in it) and ``ignore``: what a leftover check may
    count without seeing another grading that shares the machine."""
    me = os.getpid()
    skip = spare_tree() | set(ignore) | {me}
    found = []
    for pid in sorted(process_tree(me) - skip):
        try:
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmd or cmd.startswith(m) for m in marks):
            found.append(f"{pid}: {cmd[:120]}")
    return found


def spare_tree() -> set[int]:
    """Pids of the spare server's process tree (bwrap, its init, the server)."""
    spare = pool.spare()
    return process_tree(spare.proc.pid) if spare is not None else set()


@contextmanager
def made_by(how: str):
    """``how`` = 'bwrap': sandboxes as for one file (a bwrap each); 'template': inside
    pool.class_template, as class grading makes them. Yields the template's own processes
    (its bwrap, that bwrap's init, the template: all that may be left of it after a
    submission), empty for 'bwrap'. Where the template cannot run: a failure in CI, else a skip."""
    if how == "bwrap" or pool.bwrap_path() is None:
        yield frozenset()
        return
    with pool.class_template("bwrap") as template:
        if not template.active:
            cannot_run(f"the class template cannot run here: {template.reason}")
        own = frozenset(process_tree(template.pid))
        assert len(own) == 3, own
        yield own


def needs_sandbox() -> None:
    """Skip where bwrap is missing, but fail under CI: 'make test' installs bubblewrap, and the
    grader's tests must run against the real sandbox there."""
    if pool.bwrap_path() is None:
        cannot_run("bwrap is not installed (make test installs bubblewrap)")


def crippled_bwrap(folder: Path) -> Path:
    """A bwrap that passes the old probe (`bwrap --ro-bind / / --unshare-all true`) but cannot
    run the grader's full sandbox, as in a container that allows only part of it."""
    real = pool.bwrap_path()
    fake = folder / "bwrap"
    fake.write_text(f'#!/bin/sh\nif [ "$*" = "--ro-bind / / --unshare-all true" ]; then exec {real} "$@"; fi\n'
                    'echo "bwrap: setting up uid map: Permission denied" >&2\nexit 1\n')
    fake.chmod(0o755)
    return fake


# A learner's file that spends CPU time: burn(s) works for s seconds of its own CPU (as the scheduler
# counts it) and returns 42; ignore_the_signals(s) first ignores the budget's signals and lifts
# RLIMIT_CPU's soft limit to the hard one (tests/grading: test_default_deny, test_grading_load)
BURN = '''
import os, time

def burn(seconds):
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass
    return 42

def ignore_the_signals(seconds):
    import resource, signal
    signal.signal(signal.SIGPROF, signal.SIG_IGN)
    signal.signal(signal.SIGXCPU, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
    return burn(seconds)
'''
