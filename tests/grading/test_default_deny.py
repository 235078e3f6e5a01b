"""Issue 30: the grader by default-deny. One hostile test per attack class of the third
hostile round, each shown to fail on the code before this issue (the commit message and the
closing note say how): the rule on everything that runs, one read of the submission, no
link or FIFO followed, no reachable unfiltered process, an allow-list seccomp filter, CPU
counted where it is spent, and total functions on hostile input."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.grading import Limits, grade
from attnlab.grading.static import check_source
from helpers import procs

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

TRACK = Path(__file__).resolve().parents[2] / "labs" / "track1"
STUB = (TRACK / "01-attention/attention.py").read_text()
SOLUTION = (TRACK / "01-attention/solutions/attention.py").read_text()
NAMES = labs.find_lab("01").allowed_names
FAST = Limits(timeout_s=2.0)

# ------------------------------------------------------------------ 1. the rule on everything that runs
# Each runs torch's softmax (or file code that could) at import, outside every exercise's function.
IMPORT_TIME = {
    "module_level_call": '''
def make():
    return torch.softmax
SM = make()
def stable_softmax(x, dim=-1):
    return SM(x, dim)
''',
    "class_body": '''
def make():
    return torch.softmax
class Holder:
    sm = make()
''',
    "decorator": '''
def deco(f):
    return torch.softmax
@deco
def stable_softmax(x, dim=-1):
    return x
''',
    "default_argument": '''
def make():
    return torch.softmax
def stable_softmax(x, dim=-1, sm=make()):
    return sm(x, dim)
''',
    "default_with_the_violation_itself": '''
def stable_softmax(x, dim=-1, sm=torch.softmax):
    return sm(x, dim)
''',
    "module_getattr": '''
def __getattr__(name):
    return torch.softmax
''',
    "set_name_hook": '''
class Hook:
    def __set_name__(self, owner, name):
        torch.softmax(torch.zeros(2), 0)
class Owner:
    h = Hook()
''',
    "init_subclass_hook": '''
class Base:
    def __init_subclass__(cls):
        torch.softmax(torch.zeros(2), 0)
class Child(Base):
    pass
''',
    "lambda_alias_called_at_import": '''
f = lambda: torch.zeros(2)
y = f()
''',
    "renamed_main_guard": '''
__name__ = "__main__"
def make():
    return torch.softmax
if __name__ == "__main__":
    SM = make()
''',
    "dict_decorator_runs_a_static_keys": '''
@dict
class C:
    @staticmethod
    def keys():
        return []
''',
}


@pytest.mark.parametrize("name", sorted(IMPORT_TIME))
def test_code_that_runs_at_import_costs_the_whole_file(name):
    report = check_source(STUB + "\n" + IMPORT_TIME[name], "attention.py", NAMES)
    assert report.module_level(), (name, [str(v) for v in report.violations])


def test_honest_module_level_code_still_passes():
    honest = '''
NEG = float("-inf")
SCALE = 1 / math.sqrt(64)
class Function(torch.autograd.Function):
    """docs"""
    @staticmethod
    def forward(ctx, x):
        return x
if __name__ == "__main__":
    print(stable_softmax(torch.zeros(3)))
'''
    report = check_source(STUB + "\n" + honest, "attention.py", NAMES + ("autograd", "Function"))
    assert report.violations == [], [str(v) for v in report.violations]


def test_a_stub_that_runs_softmax_at_import_scores_nothing(tmp_path):
    """The round's 43/100: an empty stub whose module-level call reached torch's softmax."""
    path = tmp_path / "attention.py"
    path.write_text(SOLUTION.replace("def stable_softmax(", "def _unused_(") + '''

def make():
    return getattr(torch, "softmax")
SM = make()
def stable_softmax(x, dim=-1):
    return SM(x, dim)
''')
    report = grade(path, limits=FAST, sandbox="none")
    assert report.score == 0, report.to_text()
    assert "module level" in report.problem and "make" in report.problem, report.problem


def test_a_deeply_nested_file_is_refused_not_a_traceback(tmp_path):
    source = STUB + "\nX = " + "+".join(["1"] * 1500) + "\n"
    report = check_source(source, "attention.py", NAMES)  # the walk is iterative: no RecursionError
    assert report.syntax_error == "" and report.violations == []
    deeper = STUB + "\nX = " + "(" * 5000 + "1" + ")" * 5000 + "\n"
    refused = check_source(deeper, "attention.py", NAMES)
    assert refused.syntax_error, "5000 nested parentheses are beyond the parser: refused with a reason"
    path = tmp_path / "attention.py"
    path.write_text(STUB + "\ndef f():\n    return " + "+".join(["1"] * 1500) + "\n")
    graded = grade(path, limits=FAST, sandbox="none")
    assert graded.max_score > 0 and json.dumps(graded.to_gradescope())


# ------------------------------------------------------------------ 2. one read of the submission
def test_a_file_swapped_after_the_check_is_not_what_runs(tmp_path, monkeypatch):
    """The static check and the sandbox see the same bytes: a stub swapped for an unchecked
    file while it is being checked still runs as the stub."""
    from attnlab.grading import grader

    path = tmp_path / "attention.py"
    path.write_text(STUB)
    cheat = SOLUTION.replace("def stable_softmax(x", "def stable_softmax_unused(x") + \
        "\n\ndef stable_softmax(x, dim=-1):\n    return torch.softmax(x, dim)\n"
    real = grader.check_source

    def check_then_swap(source, *args, **kwargs):
        report = real(source, *args, **kwargs)
        path.write_text(cheat)  # the learner's swap, between the check and the run
        return report

    monkeypatch.setattr(grader, "check_source", check_then_swap)
    report = grade(path, limits=FAST, sandbox="none", seed=1)
    monkeypatch.setattr(grader, "check_source", real)
    path.write_text(STUB)
    stub = grade(path, limits=FAST, sandbox="none", seed=1)
    assert report.score == stub.score < 50, report.to_text()
    assert report.source_sha256 == stub.source_sha256


def test_a_fifo_swapped_in_does_not_hang_the_class(tmp_path):
    import threading

    from attnlab.grading.classroom import batch

    cls = tmp_path / "class"
    for name in ("ada", "bob"):
        (cls / name).mkdir(parents=True)
        (cls / name / "attention.py").write_text(SOLUTION)
    plan = batch.plan_class(cls, tmp_path / "out")
    (cls / "bob" / "attention.py").unlink()
    os.mkfifo(cls / "bob" / "attention.py")  # after the plan looked: a reader that opens it blocks
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", batch.grade_class(
        cls, tmp_path / "out", sandbox="none", limits=FAST, plan=plan, jobs=1)), daemon=True)
    t.start()
    t.join(300)  # a backstop against the hang itself; nothing here measures speed
    assert not t.is_alive(), "the class hung on a FIFO"
    rows = {r.learner: r for r in done["r"].rows}
    assert rows["ada"].total == 100 and rows["bob"].status == "could not be read", rows["bob"]
    assert "FIFO" in rows["bob"].problem
    assert (tmp_path / "out" / "grades.csv").is_file() and (tmp_path / "out" / "report.html").is_file()


def test_a_file_swapped_after_grading_is_graded_again_on_resume(tmp_path, monkeypatch):
    from attnlab.grading.classroom import batch

    cls = tmp_path / "class"
    (cls / "ada").mkdir(parents=True)
    sub = cls / "ada" / "attention.py"
    sub.write_text(SOLUTION)
    real = batch.grade

    def grade_then_swap(*args, **kwargs):
        report = real(*args, **kwargs)
        sub.write_text(STUB)  # after the grading, before the row is signed
        return report

    monkeypatch.setattr(batch, "grade", grade_then_swap)
    first = batch.grade_class(cls, tmp_path / "out", sandbox="none", limits=FAST, seed=3)
    assert first.rows[0].total == 100
    monkeypatch.setattr(batch, "grade", real)
    again = batch.grade_class(cls, tmp_path / "out", sandbox="none", limits=FAST, seed=3, resume=True)
    assert again.rows[0].total < 50, "the signed row covered bytes that were never graded"


def test_gradescope_mode_follows_no_link_to_the_solution(tmp_path, monkeypatch):
    """run_autograder runs as root: a submission that links to the bundle's root-only solution
    must not be opened through the link."""
    from attnlab.grading.classroom import autograder

    secret = tmp_path / "source" / "solution.py"
    secret.parent.mkdir()
    secret.write_text(SOLUTION)
    os.chmod(secret, 0o600)
    root = tmp_path / "autograder"
    (root / "submission" / "sub").mkdir(parents=True)
    os.symlink(secret, root / "submission" / "attention.py")
    monkeypatch.setattr(autograder, "choose_sandbox", lambda: ("none", "a test: process limits only"))
    data = autograder.run_gradescope(root, "01")
    assert data["score"] == 0 and "symbolic link" in data["output"], data["output"]
    (root / "submission" / "attention.py").unlink()
    os.symlink(secret.parent, root / "submission" / "linked")  # a linked folder, found by the .py search
    (root / "submission" / "sub").rmdir()
    data = autograder.run_gradescope(root, "01")
    assert data["score"] == 0, data["output"]


def test_an_alias_at_module_level_runs_nothing_and_reaches_what_it_names():
    source = STUB + '''
def cheat(x, dim=-1):
    return torch.softmax(x, dim)
stable_softmax = cheat
'''
    report = check_source(source, "attention.py", NAMES)
    assert not report.module_level(), [str(v) for v in report.violations]
    assert [v.function for v in report.refusals()] == ["cheat"]


# ------------------------------------------------------------------ 4. CPU counted where it is spent
SPREAD = procs.BURN + '''
def spread(n, each):
    """The answer is right, but n double-forked orphans did the work: each under the per-process
    limits, the sum far over the task's budget."""
    import signal
    parent = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])  # each orphan says it is done
    for _ in range(n):
        if os.fork() == 0:
            if os.fork() == 0:  # the grandchild, orphaned at once: not in its parent's rusage
                burn(each)
                os.kill(parent, signal.SIGRTMIN)
            os._exit(0)
    for _ in range(n):
        signal.sigwaitinfo([signal.SIGRTMIN])
    return 42
'''


@contextmanager
def _box(tmp_path, mode):
    """A sandbox for SPREAD: mode 'none', a bwrap of its own, or a fork of the class template."""
    from attnlab.grading.sandbox import Sandbox
    from helpers.procs import made_by, needs_sandbox

    path = tmp_path / "attention.py"
    path.write_text(SPREAD)
    if mode != "none":
        needs_sandbox()
    with made_by(mode if mode != "none" else "bwrap"):
        with Sandbox(path, Limits(timeout_s=2.0), mode="bwrap" if mode != "none" else "none") as box:
            yield box


MODES = ["none", "bwrap", "template"]


@pytest.mark.parametrize("mode", MODES)
def test_work_spread_over_orphans_is_counted(tmp_path, mode):
    from attnlab.grading.sandbox import Call

    with _box(tmp_path, mode) as box:
        honest = box.run([Call("spread", (2, 0.3))], policy=False)
        spread = box.run([Call("spread", (4, 1.0))], policy=False)
    assert honest.status == "ok" and honest.results[0]["value"] == 42 and honest.cpu_s >= 0.5, honest
    assert spread.status == "timeout", (spread.status, spread.cpu_s, spread.results)
    assert spread.cpu_s > 2.0


@pytest.mark.parametrize("mode", MODES)
def test_ignoring_the_cpu_signals_buys_no_time(tmp_path, mode):
    from attnlab.grading.sandbox import Call

    with _box(tmp_path, mode) as box:
        outcome = box.run([Call("ignore_the_signals", (2.7,))], policy=False)
    assert outcome.status == "timeout", (outcome.status, outcome.cpu_s, outcome.message)


# ------------------------------------------------------------------ 3. every reachable process filtered
PID1 = '''
import os

def pid1():
    out = {"parent": os.getppid()}
    status = open("/proc/1/status").read()
    out["seccomp"] = [line.split()[1] for line in status.splitlines() if line.startswith("Seccomp:")]
    try:
        with open("/proc/1/mem", "r+b") as f:
            out["mem"] = "opened"
    except OSError as exc:
        out["mem"] = type(exc).__name__
    out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    return repr(out)
'''


def test_pid_1_of_the_sandbox_is_the_filtered_server(tmp_path):
    """bwrap's own init was pid 1: unfiltered, dumpable, holding the grader's pipes (its memory
    was written through /proc/1/mem). Now the server is pid 1, filtered and not dumpable."""
    from attnlab.grading.sandbox import Call, Sandbox
    from helpers.procs import needs_sandbox

    needs_sandbox()
    path = tmp_path / "attention.py"
    path.write_text(PID1)
    with Sandbox(path, Limits(timeout_s=5.0), mode="bwrap") as box:
        outcome = box.run([Call("pid1")], policy=False)
    got = eval(outcome.results[0]["value"])  # noqa: S307 (our own repr of a dict)
    assert got["parent"] == 1, got  # the learner's child hangs right below the server
    assert got["seccomp"] == ["2"], got  # pid 1 runs under the filter
    assert got["mem"] == "PermissionError", got
    assert got["pids"][:1] == [1] and len(got["pids"]) == 2, got  # the server and this child: nothing else



# ------------------------------------------------------------------ 7. why a sandbox did not start; no leftovers
def test_a_sandbox_that_cannot_start_says_why(tmp_path, monkeypatch):
    """The round's Gradescope image said only 'the sandbox server closed the channel'."""
    import sys

    from attnlab.grading.sandbox import Call, Sandbox, pool

    def failing(inside):
        return [sys.executable, "-c", "import sys; sys.stderr.write('bwrap: no permission to make a namespace'); "
                                      "sys.exit(3)"]

    monkeypatch.setattr(pool, "_server_argv", failing)
    path = tmp_path / "attention.py"
    path.write_text("def f():\n    return 1\n")
    with Sandbox(path, Limits(timeout_s=2.0), mode="none") as box:
        outcome = box.run([Call("f")], policy=False)
    assert "no permission to make a namespace" in outcome.environment, outcome
    assert "exit status 3" in outcome.environment


@pytest.mark.parametrize("mode", ["none", "user"])
def test_a_killed_server_leaves_no_folder_behind(tmp_path, monkeypatch, mode):
    from attnlab.grading.sandbox import Call, Sandbox

    if mode == "user" and os.geteuid() != 0:
        from helpers.ci import cannot_run

        cannot_run("mode 'user' needs root (Gradescope and CI run as root)")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # mode 'none': the server's folder goes there
    (tmp_path / "tmp").mkdir()
    path = tmp_path / "attention.py"
    path.write_text("import os\n\ndef where():\n    return os.getcwd()\n")
    with Sandbox(path, Limits(timeout_s=2.0), mode=mode) as box:
        cwd = box.run([Call("where")], policy=False).results[0]["value"]
        root = os.path.dirname(cwd)  # the server's own folder (each task's folder is inside it)
        assert os.path.basename(root).startswith("attnlab-sandbox-"), cwd
        assert os.path.isdir(root)
    assert not os.path.exists(root), f"{root} was left behind"


# ------------------------------------------------------------------ 5. limits counted per host uid
def test_inotify_is_refused_so_no_learner_exhausts_the_shared_uid(tmp_path):
    """Template forks share one host uid, and the kernel counts inotify instances per uid (128):
    one learner took them all from the next. The allow-list has no inotify (nor fanotify)."""
    from attnlab.grading.sandbox import Call, Sandbox
    from helpers.procs import made_by, needs_sandbox

    needs_sandbox()
    path = tmp_path / "attention.py"
    path.write_text('''
import ctypes, os

def take_all():
    libc = ctypes.CDLL(None, use_errno=True)
    made = [libc.inotify_init1(0) for _ in range(200)]
    return [sum(1 for fd in made if fd >= 0), os.strerror(ctypes.get_errno())]
''')
    with made_by("template"), Sandbox(path, Limits(timeout_s=5.0), mode="bwrap") as box:
        outcome = box.run([Call("take_all")], policy=False)
    assert outcome.results[0]["value"] == [0, "Function not implemented"], outcome.results


PIPES = '''
import fcntl, os, select

def take_pipe_pages():
    out = []
    for make in (os.pipe, lambda: fcntl.fcntl(1, 1031, 1 << 20), select.epoll):  # 1031: F_SETPIPE_SZ
        try:
            got = make()
            out.append("made")
        except OSError as exc:
            out.append(exc.errno)
    return out + [fcntl.fcntl(1, 1032)]  # F_GETPIPE_SZ of the pipe the server gave it
'''


@pytest.mark.parametrize("mode", ["template", "bwrap"])
def test_no_learner_can_hold_the_shared_uids_pipe_pages(tmp_path, mode):
    """The kernel counts pipe pages (fs.pipe-user-pages-soft) and epoll watches per host uid,
    and template forks share one: one learner's thousands of 1 MiB pipes left the next one
    8 KiB pipes. The learner's own process can make no pipe, resize none, and make no epoll."""
    import errno

    from attnlab.grading.sandbox import Call, Sandbox
    from helpers.procs import made_by, needs_sandbox

    needs_sandbox()
    path = tmp_path / "attention.py"
    path.write_text(PIPES)
    with made_by(mode), Sandbox(path, Limits(timeout_s=5.0), mode="bwrap") as box:
        outcome = box.run([Call("take_pipe_pages")], policy=False)
    assert outcome.results[0]["value"] == [errno.EPERM, errno.EPERM, errno.EPERM, 65536], outcome.results


SHARED_OBJECTS = '''
import ctypes, errno, fcntl, os, resource, struct, threading

def reach_shared_objects():
    out = {}
    f = open(os.__file__, "rb")  # the read-only standard library every sandbox shares
    libc = ctypes.CDLL(None, use_errno=True)
    def attempt(name, call):
        try:
            call()
            out[name] = "done"
        except OSError as exc:
            out[name] = exc.errno
    attempt("flock", lambda: fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB))
    attempt("F_SETLK", lambda: fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB))
    attempt("F_GETLK", lambda: fcntl.fcntl(f, fcntl.F_GETLK, struct.pack("hhllhh", fcntl.F_RDLCK, 0, 0, 0, 0, 0)))
    attempt("F_OFD_SETLK", lambda: fcntl.fcntl(f, 37, struct.pack("hhllhh", fcntl.F_RDLCK, 0, 0, 0, 0, 0)))
    attempt("F_SETLEASE", lambda: fcntl.fcntl(f, 1024, fcntl.F_RDLCK))
    attempt("F_NOTIFY", lambda: fcntl.fcntl(os.open("/", os.O_RDONLY), 1026, 1))
    attempt("prlimit_parent", lambda: resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE))
    def clone_parent():  # clone(CLONE_PARENT | SIGCHLD): the child exits at once
        pid = libc.syscall(56, 0x00008000 | 17, 0, 0, 0, 0)
        if pid == 0:
            os._exit(0)
        if pid < 0:
            raise OSError(ctypes.get_errno(), "clone")
    attempt("clone_parent", clone_parent)
    # what a learner's code does need still works: its own limits, fcntl's flags, threads
    out["own_limits"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 0
    out["F_GETFL"] = fcntl.fcntl(f, fcntl.F_GETFL) >= 0
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    out["thread"] = True
    return out
'''


@pytest.mark.parametrize("mode", ["template", "bwrap"])
def test_no_learner_reaches_a_kernel_object_another_learner_shares(tmp_path, mode):
    """Issue 47: flock on the read-only standard library (locks live on the inode, across mount
    and user namespaces) carried one learner's 64-bit token to another. The learner layer refuses
    locks, leases and notify, prlimit64 of another pid and clone with CLONE_PARENT."""
    import errno
    import platform

    from attnlab.grading.sandbox import Call, Sandbox
    from helpers.procs import made_by, needs_sandbox

    needs_sandbox()
    path = tmp_path / "attention.py"
    path.write_text(SHARED_OBJECTS)
    with made_by(mode), Sandbox(path, Limits(timeout_s=5.0), mode="bwrap") as box:
        outcome = box.run([Call("reach_shared_objects")], policy=False)
    got = outcome.results[0]["value"]
    refused = ["flock", "F_SETLK", "F_GETLK", "F_OFD_SETLK", "F_SETLEASE", "F_NOTIFY", "prlimit_parent"]
    if platform.machine() == "x86_64":  # the clone call above is x86-64's number
        refused.append("clone_parent")
    assert {k: got[k] for k in refused} == {k: errno.EPERM for k in refused}, got
    assert got["own_limits"] and got["F_GETFL"] and got["thread"], got


REWRITE = '''
VERSION = "checked"

def rewrite():
    with open(__file__, "w") as f:  # the copy in the sandbox: the learner's uid can write it
        f.write('VERSION = "rewritten"\\ndef which():\\n    return VERSION\\n')
    return "wrote"

def which():
    return VERSION
'''


@pytest.mark.parametrize("mode", ["template", "bwrap"])
def test_an_exercise_that_rewrites_the_submission_changes_nothing_the_next_one_runs(tmp_path, mode):
    """Issue 47: each exercise's child imported the sandbox's copy of the file again, which the
    learner's uid could write: one child rewrote it and the later exercises ran a file nobody
    checked. The zygote compiles the bytes it was sent once; every child runs that code object."""
    from attnlab.grading.sandbox import Call, Sandbox
    from helpers.procs import made_by, needs_sandbox

    needs_sandbox()
    path = tmp_path / "attention.py"
    path.write_text(REWRITE)
    with made_by(mode), Sandbox(path, Limits(timeout_s=5.0), mode="bwrap") as box:
        wrote = box.run([Call("rewrite")], policy=False)
        after = box.run([Call("which")], policy=False)
    assert wrote.results[0]["value"] == "wrote", wrote  # the write itself is not what is refused
    assert after.results[0]["value"] == "checked", after.results


SIGNALS = '''
import os, signal

def queue_signals():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
    for _ in range(2000):
        os.kill(os.getpid(), signal.SIGRTMIN)  # each one queued while the uid's count allows
    got = 0
    while signal.sigtimedwait([signal.SIGRTMIN], 0) is not None:
        got += 1
    return got
'''


@pytest.mark.parametrize("mode", ["template", "bwrap"])
def test_no_learner_can_hold_the_shared_uids_queued_signals(tmp_path, mode):
    """Queued real-time signals are counted per host uid too (RLIMIT_SIGPENDING, about 95k here):
    one learner could hold them all. Its own limit (server.SIGPENDING, 64) bounds its share."""
    from attnlab.grading.sandbox import Call, Sandbox
    from helpers.procs import made_by, needs_sandbox

    needs_sandbox()
    path = tmp_path / "attention.py"
    path.write_text(SIGNALS)
    with made_by(mode), Sandbox(path, Limits(timeout_s=5.0), mode="bwrap") as box:
        outcome = box.run([Call("queue_signals")], policy=False)
    assert outcome.results[0]["value"] == 64, outcome.results


# ------------------------------------------------------------------ 6. total functions on hostile input
@pytest.mark.parametrize("name", ["grades.csv", "report.html", "Skipped.txt"])
def test_a_learner_named_like_the_gradebook_does_not_replace_it(tmp_path, name):
    from attnlab.grading.classroom import batch

    cls = tmp_path / "class"
    for learner in (name, "ada"):
        (cls / learner).mkdir(parents=True)
        (cls / learner / "attention.py").write_text(SOLUTION)
    result = batch.grade_class(cls, tmp_path / "out", sandbox="none", limits=FAST)
    assert (tmp_path / "out" / "grades.csv").is_file() and (tmp_path / "out" / "report.html").is_file()
    assert (tmp_path / "out" / "skipped.txt").is_file()
    rows = {r.learner: r for r in result.rows}
    assert rows[name].total == 100 and rows[name].folder.lower() != name.lower(), rows[name]
    assert (tmp_path / "out" / rows[name].folder / "results.json").is_file()


def test_learner_text_is_capped_in_bytes_and_stored_as_utf8(tmp_path):
    path = tmp_path / "attention.py"
    path.write_text(SOLUTION.replace('def stable_softmax(', 'def stable_softmax_(') +
                    '\ndef stable_softmax(x, dim=-1):\n    raise ValueError("\U0001F600" * 100000)\n')
    report = grade(path, limits=FAST, sandbox="none")
    text = json.dumps(report.to_gradescope(), ensure_ascii=False)
    assert "\U0001F600" in text
    assert len(text.encode()) < 200_000, len(text.encode())


def test_a_file_name_with_escape_sequences_is_printed_escaped(tmp_path):
    path = tmp_path / "a\x1b[2J\x1b]0;pwned\x07.py"
    path.write_text(SOLUTION)
    report = grade(path, limits=FAST, sandbox="none", lab="01")
    text = report.to_text() + json.dumps(report.to_gradescope())
    assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J" in text


def test_failed_checks_keep_no_tensors_unless_pictures_are_drawn(tmp_path):
    path = tmp_path / "attention.py"
    path.write_text(SOLUTION.replace("return weights @ V", "return weights @ V + 1"))
    report = grade(path, limits=FAST, sandbox="none")
    failed = [r for r in report.results if not r.verdict.passed]
    assert failed and all(r.verdict.arrays is None for r in failed)


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_the_learner_layer_is_a_valid_program_for_each_architecture(arch):
    """Every jump of the written-out learner layer lands inside it and it ends in a return, on
    both architectures (only this machine's is loaded by the test above: an out-of-range jump is
    EINVAL, and the server then runs the learner without the layer)."""
    from attnlab.grading.sandbox import seccomp

    prog = seccomp._learner_program(arch)  # noqa: SLF001 (the program itself is what is checked)
    jumps = (0x15, 0x45, 0x35)  # JEQ, JSET, JGE with a constant
    for i, (code, jt, jf, _) in enumerate(prog):
        if code in jumps:
            assert i + 1 + max(jt, jf) < len(prog), (arch, i)
    assert prog[-1][0] == 0x06 and len(prog) < 4096
