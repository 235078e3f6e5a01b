"""Nothing worth having inside the sandbox, and an identity that owns nothing on the host.

These tests run learner code through :class:`Sandbox` directly, with no static check and no
call recorder: the code runs anything it likes, as a submission that got past both would.
"""

from __future__ import annotations

import os
import stat
import textwrap
from pathlib import Path

import pytest

from attnlab.grading.sandbox import Call, Limits, Sandbox, bwrap, pool
from helpers.procs import made_by, needs_sandbox, process_tree

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

LIMITS = Limits(timeout_s=20.0)

SEARCH = '''
import os, sys

CODE = ("doctor.py", "mistakes.py", "lab01_attention.py", "lab02_masks.py", "lab03_multihead.py", "lab04_flash.py",
        "self-attention-lesson.txt")  # attnlab's own file names (a generic one, static.py, is everywhere)

def search():
    """Every place under / that holds attnlab's code, labs or solutions; what import finds."""
    hits, seen = [], 0
    for top, dirs, files in os.walk("/", onerror=lambda e: None):
        if top.startswith(("/proc", "/sys")) or os.path.basename(top).startswith("attnlab-sandbox-"):
            dirs[:] = []  # the runner's own working folder holds the submission's copy
            continue
        for name in dirs:
            seen += 1
            path = os.path.join(top, name)
            if name in ("track1", "solutions") or (name.lower() == "attnlab" and any(
                    f.endswith(".py") for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))):
                hits.append(path)  # a package folder named attnlab, or the labs' folders
        for name in files:
            seen += 1
            if name in CODE or name.lower().startswith("attnlab"):
                hits.append(os.path.join(top, name))
    try:
        import attnlab  # noqa: F401
        imported = "imported"
    except ImportError as exc:
        imported = type(exc).__name__
    packages = [p for p in sys.path if os.path.isfile(os.path.join(p, "attnlab", "__init__.py"))]
    return repr({"hits": sorted(hits)[:20], "seen": seen, "import": imported, "runner": sorted(os.listdir("/runner")),
                 "path": packages})
'''


def run(tmp_path: Path, code: str, function: str) -> object:
    path = tmp_path / "attention.py"
    path.write_text(textwrap.dedent(code))
    with Sandbox(path, LIMITS, mode="bwrap") as box:
        outcome = box.run([Call(function)], policy=False)
    assert outcome.status == "ok" and "value" in outcome.results[0], (outcome.status, outcome.message,
                                                                      outcome.results)
    return eval(outcome.results[0]["value"])  # noqa: S307 (the repr of a dict of lists, from our own code)


@pytest.mark.parametrize("how", ["bwrap", "template"])
def test_nothing_of_attnlab_is_inside_the_sandbox(tmp_path, how):
    """Arbitrary code walks the whole file tree: it finds the runner's six files and nothing else
    of attnlab (no reference, doctor, solutions, lab materials), and cannot import attnlab. The
    walk is shown to work: it finds the runner (named ``/runner/*.py``) and thousands of files."""
    needs_sandbox()
    with made_by(how):
        found = run(tmp_path, SEARCH, "search")
    assert found["runner"] == sorted(bwrap.RUNNER_FILES)
    assert found["seen"] > 1000, found["seen"]  # the walk saw the system and the Python installation
    assert found["import"] == "ModuleNotFoundError"
    # the install's metadata may be there (no code of attnlab's: the dist-info's file list, the
    # editable install's .pth naming a folder that is not bound, the console script's three
    # lines, make's stamp); nothing else may
    metadata = (".dist-info", ".pth", "/bin/attnlab", "/.attnlab-installed")
    assert [h for h in found["hits"] if h.startswith("/runner/")] == []  # the runner's names are not attnlab's
    assert [h for h in found["hits"] if not h.endswith(metadata)] == [], found["hits"]
    assert found["path"] == []


def test_a_wheel_installed_attnlab_is_covered(monkeypatch, tmp_path):
    """Where attnlab sits inside a folder the sandbox binds (a wheel in site-packages), the
    command line covers its folder with an empty read-only tmpfs."""
    site = tmp_path / "site-packages"
    (site / "attnlab").mkdir(parents=True)
    monkeypatch.setattr(bwrap, "python_roots", lambda: [str(site)])
    import importlib.util

    class Spec:
        submodule_search_locations = [str(site / "attnlab")]

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: Spec() if name == "attnlab" else None)
    argv = bwrap.plan("/usr/bin/bwrap", ["true"]).argv
    i = argv.index(str(site / "attnlab"))
    assert argv[i - 1] == "--tmpfs" and argv[i + 1:i + 3] == ["--remount-ro", str(site / "attnlab")]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert str(site / "attnlab") not in bwrap.plan("/usr/bin/bwrap", ["true"]).argv


DEVICES = '''
import os

def devices():
    out = {}
    for what, act in [("chmod_null", lambda: os.chmod("/dev/null", 0)),
                      ("chown_zero", lambda: os.chown("/dev/zero", os.getuid(), os.getgid())),
                      ("new_file", lambda: open("/dev/planted", "w").close()),
                      ("mknod", lambda: os.mknod("/tmp/null2", 0o666 | 0o020000, os.makedev(1, 3)))]:
        try:
            act()
            out[what] = "done"
        except OSError as exc:
            out[what] = exc.strerror
    with open("/dev/null", "w") as f:  # the devices a lab's process needs still work
        out["write_null"] = f.write("x")
    with open("/dev/urandom", "rb") as f:
        out["urandom"] = len(f.read(8))
    return repr(out)
'''


@pytest.mark.parametrize("how", ["bwrap", "template"])
def test_host_devices_cannot_be_changed(tmp_path, how):
    """The learner cannot chmod, chown or add to /dev (the host's inodes stay as they were),
    nor make a device node; /dev/null and /dev/urandom still work."""
    needs_sandbox()
    before = {name: os.stat(f"/dev/{name}") for name in ("null", "zero")}
    with made_by(how):
        got = run(tmp_path, DEVICES, "devices")
    assert got["chmod_null"] == "Operation not permitted", got  # the kernel: not the owner
    # chown and mknod are not on the seccomp allow-list: refused before the kernel looks
    assert got["chown_zero"] == got["mknod"] == "Function not implemented", got
    assert got["new_file"] == "Read-only file system", got
    assert got["write_null"] == 1 and got["urandom"] == 8
    for name, st in before.items():
        now = os.stat(f"/dev/{name}")
        assert (stat.S_IMODE(now.st_mode), now.st_uid, now.st_gid) == (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
    assert not os.path.exists("/dev/planted")


IDENTITY = '''
import os, time

def who():
    return repr((os.getuid(), os.getgid(), os.getgroups()))
'''


@pytest.mark.parametrize("how", ["bwrap", "template"])
def test_under_root_the_sandbox_is_a_fresh_unprivileged_uid(tmp_path, how):
    """A root grader (Gradescope, CI, a container) runs every sandbox process as a fresh uid
    that owns nothing: seen from the host, no process of the submission is uid 0, and each
    sandbox has a uid of its own."""
    needs_sandbox()
    if os.geteuid() != 0:  # a user namespace maps to nobody but the grader's own user
        plan = bwrap.plan(pool.bwrap_path(), ["true"])
        assert plan.uid is None and plan.stage is None and "own user" in plan.identity
        return
    path = tmp_path / "attention.py"
    path.write_text(textwrap.dedent(IDENTITY))
    uids = []
    with made_by(how):
        for _ in range(2):
            with Sandbox(path, LIMITS, mode="bwrap") as box:
                outcome = box.run([Call("who")], policy=False)
                assert outcome.status == "ok", outcome.message
                inside = eval(outcome.results[0]["value"])  # noqa: S307
                assert inside[:2] == (bwrap.UID, bwrap.UID)
                host = set()
                for pid in process_tree(os.getpid()):
                    try:
                        text = Path(f"/proc/{pid}/status").read_text()
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    except OSError:
                        continue
                    if b"/runner/" in cmd:  # bwrap, its init, the server (the template: its forks)
                        host.add(int(next(l for l in text.splitlines() if l.startswith("Uid:")).split()[1]))
                assert host, "no process of the sandbox was found"
                assert all(u >= 1 << 30 for u in host), host
                uids.append(host)
    if how == "bwrap":
        assert uids[0] != uids[1]  # one uid per sandbox


def test_without_a_mount_namespace_the_identity_says_what_it_is(monkeypatch):
    """A root grader that cannot make a mount namespace (a container without CAP_SYS_ADMIN):
    with every bind source open to others, bwrap still runs as a fresh uid, unstaged; with
    one under a 0700 folder, it runs as the grader's uid, and the plan says so."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(bwrap, "can_stage", lambda: False)
    monkeypatch.setattr(bwrap, "blocker", lambda p: None)
    plan = bwrap.plan("/usr/bin/bwrap", ["true"])
    assert plan.uid is not None and plan.uid >= 1 << 30 and plan.stage is None and "fresh" in plan.identity
    assert bwrap.STAGE not in " ".join(plan.argv)
    monkeypatch.setattr(bwrap, "blocker", lambda p: "/root" if p.startswith("/") else None)
    plan = bwrap.plan("/usr/bin/bwrap", ["true"])
    assert plan.uid is None and plan.stage is None and "the grader's own uid" in plan.identity
    monkeypatch.setattr(bwrap, "can_stage", lambda: True)
    plan = bwrap.plan("/usr/bin/bwrap", ["true"])
    assert plan.uid is not None and plan.stage == bwrap.STAGE and bwrap.STAGE in " ".join(plan.argv)


WARMED = '''
import sys

def warmed():
    return repr({name: name in sys.modules for name in ("triton", "triton.compiler.code_generator")})


def overflow_checks():
    from triton.runtime import interpreter
    options = interpreter.interpreter_builder.options
    return repr({"sanitize_overflow": options.sanitize_overflow, "debug": options.debug})
'''


@pytest.mark.parametrize("how", ["bwrap", "template"])
def test_triton_s_interpreter_is_warmed_in_the_zygote_before_any_child(tmp_path, how):
    """Every exercise of lab 05 runs in a fresh fork: the zygote has already run one trusted kernel
    through Triton's interpreter (interpreter.warm_triton_interpreter), so no child imports the modules a
    first launch needs again. A module that only a launch imports is already there for the
    learner's first call (without the warm-up: False, shown by removing the call)."""
    needs_sandbox()
    with made_by(how):
        found = run(tmp_path, WARMED, "warmed")
    assert found == {"triton": True, "triton.compiler.code_generator": True}, found


@pytest.mark.parametrize("how", ["bwrap", "template"])
def test_the_zygote_drops_triton_s_dead_overflow_checks(tmp_path, how):
    """The learner's child runs Triton's interpreter without the integer-overflow checks it would
    build and throw away (interpreter.drop_dead_overflow_checks; with the call removed the child finds
    sanitize_overflow True). That they are dead: tests/kernels/test_triton.py's
    test_the_interpreter_s_overflow_checks_change_nothing_without_debug."""
    needs_sandbox()
    with made_by(how):
        found = run(tmp_path, WARMED, "overflow_checks")
    assert found == {"sanitize_overflow": False, "debug": False}, found


NO_KERNELS = '''
import sys

def loaded():
    prefix = "tri" + "ton"  # the word itself is what makes the server prepare the interpreter
    return repr(sorted({name.split(".")[0] for name in sys.modules if name.startswith(prefix)}))
'''


def test_a_file_that_does_not_name_triton_gets_a_server_without_it(tmp_path):
    """A server of its own imports Triton and its interpreter at ``load`` only for a file that names
    Triton (lab 05): labs 01-04 skip 0.2-0.3 s of start and 74 MB in each child's fork. Before, every
    server imported it ([] here failed then); the same code with the word in a comment gets it."""
    needs_sandbox()
    assert run(tmp_path, NO_KERNELS, "loaded") == []
    assert run(tmp_path, NO_KERNELS + "# triton\n", "loaded") == ["triton"]
