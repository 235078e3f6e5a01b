"""The OS sandbox on its own: raw hostile code (os, signal, socket, ctypes), run
straight through :class:`attnlab.grading.Sandbox`, without the static check that
would refuse it. What must hold: the parent neither hangs nor crashes, what comes back
is validated, nothing of the host is visible or writable, and nothing survives.
"""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from attnlab.grading.sandbox import bwrap, pool
from attnlab.grading.sandbox.protocol import encode_message
from attnlab.grading.sandbox import (MAX_ELEMENTS, BadMessage, Call, Limits, Sandbox, clean_text,
                                     validate_message)
from helpers.ci import cannot_run
from helpers.procs import made_by

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LIMITS = Limits(timeout_s=2.0)

needs_bwrap = pytest.mark.usefixtures("bwrap")  # tests/conftest.py: a failure in CI, else a skip


VISIBLE_PIDS = """
import ctypes


def capabilities():
    # (effective, permitted, inheritable) words of capget, and no_new_privs
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("e", ctypes.c_uint32), ("p", ctypes.c_uint32), ("i", ctypes.c_uint32)]

    libc = ctypes.CDLL(None)
    data = (Data * 2)()
    libc.capget(ctypes.byref(Header(0x20080522, 0)), ctypes.byref(data))
    return [(d.e, d.p, d.i) for d in data], libc.prctl(39, 0, 0, 0, 0)

def visible_pids():
    # every pid this process can signal or at least see (EPERM), found without /proc (hidden
    # under the class template)
    seen = []
    for p in range(1, 4097):
        try:
            os.kill(p, 0)
            seen.append(p)
        except ProcessLookupError:
            pass
        except PermissionError:
            seen.append(p)
    return seen

"""


def sandbox_for(tmp_path: Path, code: str, limits: Limits = LIMITS, name: str = "attention.py") -> Sandbox:
    path = tmp_path / name
    path.write_text("import os, signal, socket, sys, time, io\nimport torch\n\n" + VISIBLE_PIDS + textwrap.dedent(code))
    return Sandbox(path, limits, mode="bwrap")


@pytest.fixture(params=["bwrap", "template"])
def launcher(request):
    """The fence tests run on both ways of making a submission's sandbox: a bwrap of its own,
    and a fork of the class template (pool.class_template, what class grading uses)."""
    with made_by(request.param):
        yield request.param


def error_of(outcome) -> str:
    assert outcome.status == "ok", (outcome.status, outcome.message)
    return outcome.results[0].get("error", "")


# --------------------------------------------------------------------------- the view of the host
@needs_bwrap
def test_the_host_is_not_there(tmp_path, monkeypatch, launcher):
    monkeypatch.setenv("HOSTILE_TEST_SECRET", "ENV-SECRET-123")
    home = tmp_path / "home"
    home.mkdir()
    (home / "secret.txt").write_text("HOME-SECRET-456")
    monkeypatch.setenv("HOME", str(home))
    with sandbox_for(tmp_path, f"""
        def attack():
            seen = {{
                "uid": os.getuid(),
                "env": dict(os.environ),
                "home": os.path.exists({str(home)!r}),
                "root": sorted(os.listdir("/")),
                "root_home": sorted(os.listdir("/root")) if os.path.isdir("/root") else [],
                "repo_labs": os.path.exists({str(REPO / "labs")!r}),
                "tests": os.path.exists({str(HERE)!r}),
                "shadow": os.path.exists("/etc/shadow"),
                "passwd": os.path.exists("/etc/passwd"),
                "own_folder": os.path.exists({str(tmp_path)!r}),
                "proc": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
                "pids": visible_pids(),
                "caps": capabilities(),
                "mount": ctypes.CDLL(None).mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None),
                "net": sorted(os.listdir("/sys/class/net")) if os.path.exists("/sys/class/net") else [],
            }}
            raise ValueError(repr(seen))
        """) as box:
        seen = eval(error_of(box.run([Call("attack")], policy=False)).split(": ", 1)[1])
        assert box.launcher == launcher
    assert seen["uid"] == bwrap.UID and seen["uid"] != 0
    assert seen["caps"][0] == [(0, 0, 0), (0, 0, 0)] and seen["mount"] == -1, seen["caps"]  # no capability left
    assert "HOSTILE_TEST_SECRET" not in seen["env"] and seen["env"]["HOME"] == "/tmp"
    assert not any([seen["home"], seen["repo_labs"], seen["tests"], seen["shadow"], seen["passwd"],
                    seen["own_folder"]])
    assert "home" not in seen["root"] and "work" in seen["root"] if str(REPO).startswith("/work/") else True
    # of root's home only the Python installation can be there (pyenv), when Python lives in it
    python_parts = {Path(p).relative_to("/root").parts[0] for p in bwrap.python_roots() if p.startswith("/root/")}
    assert set(seen["root_home"]) <= python_parts, seen["root_home"]
    assert max(seen["pids"]) < 10  # its own pid namespace: the init, the server, this child
    # under bwrap /proc shows that namespace; under the template /proc is an empty tmpfs (the
    # template's /proc would show the other submissions' processes)
    assert seen["proc"] == (seen["pids"] if launcher == "bwrap" else [])


@needs_bwrap
def test_writes_go_nowhere_and_network_is_absent(tmp_path, launcher):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    target = tmp_path / "planted.txt"
    with sandbox_for(tmp_path, f"""
        def attack():
            out = []
            for path in [{str(target)!r}, {str(REPO / "src" / "planted.txt")!r}, "/usr/planted.txt"]:
                try:
                    open(path, "w").write("x")
                    out.append("wrote " + path)
                except OSError as exc:
                    out.append(type(exc).__name__)
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"stolen")
                out.append("connected")
            except OSError as exc:
                out.append("no network: " + type(exc).__name__)
            raise ValueError(repr(out))
        """) as box:
        err = error_of(box.run([Call("attack")], policy=False))
    # inside, only the private tmpfs is writable: a checkout under /tmp shows its parent folders
    # there (bwrap makes them to mount the package), so a write into them can succeed inside;
    # what matters is that nothing lands on the host, and that the system is read-only
    assert "wrote /usr/planted.txt" not in err and "connected" not in err and "no network" in err
    assert not target.exists() and not (REPO / "src" / "planted.txt").exists()
    with pytest.raises(OSError):
        listener.accept()
    listener.close()


# --------------------------------------------------------------------------- processes
@needs_bwrap
def test_a_daemon_that_ignores_sigterm_dies_with_the_exercise(tmp_path, launcher):
    with sandbox_for(tmp_path, """
        def attack():
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    while True:
                        time.sleep(0.05)
                        open("/tmp/daemon-was-here", "w").write("x")
                os._exit(0)
            time.sleep(0.3)
            return 1.0

        def look():
            return os.path.exists("/tmp/daemon-was-here"), len(visible_pids())
        """) as box:
        assert box.run([Call("attack")], policy=False).results[0]["value"] == 1.0
        time.sleep(0.3)  # killed processes are reaped by the namespace's init, asynchronously
        procs_after = box.processes()
        seen = box.run([Call("look")], policy=False).results[0]["value"]
    # the file the daemon wrote during the first exercise is there, but the daemon is gone: only
    # the server (pid 1 under bwrap, --as-pid-1; below the template's init there) and this child remain
    assert seen == (True, 2 if launcher == "bwrap" else 3), seen
    if procs_after is not None:  # the cgroup: bwrap's (or the template fork's) processes and the server only
        assert len(procs_after) <= 3, procs_after


@needs_bwrap
def test_a_stopped_server_costs_one_exercise_and_is_replaced(tmp_path, launcher):
    with sandbox_for(tmp_path, """
        def stop_the_server():
            os.kill(os.getppid(), signal.SIGSTOP)
            while True:
                pass

        def kill_the_server():
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(5)

        def fine():
            return 2.0
        """) as box:
        t0 = time.perf_counter()
        stopped = box.run([Call("stop_the_server")], policy=False)
        assert stopped.status == "timeout" and time.perf_counter() - t0 < LIMITS.timeout_s * LIMITS.wall_factor + 6
        assert box.run([Call("fine")], policy=False).results[0]["value"] == 2.0
        killed = box.run([Call("kill_the_server")], policy=False)
        if launcher == "bwrap":  # the server is pid 1 of the namespace: nothing inside can stop or kill it
            assert killed.status == "ok", killed
        else:
            assert killed.status == "protocol" and "server stopped" in killed.message
        assert box.run([Call("fine")], policy=False).results[0]["value"] == 2.0
        assert box.restarts == (0 if launcher == "bwrap" else 2) and box.launcher == launcher


@needs_bwrap
def test_two_submissions_at_once_cannot_reach_each_other(tmp_path, launcher):
    """Class grading runs submissions side by side (under the template, forks of one process).
    While A holds files in its /tmp and /dev/shm, a pty, an abstract socket and a daemon, B sees
    none of it (and /dev itself is read-only), and B's kill(-1) reaches only its own namespace: A finishes with its answer."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = sandbox_for(tmp_path / "a", """
        def plant():
            open("/tmp/planted-by-a", "w").write("a")
            open("/dev/shm/planted-by-a", "w").write("a")
            try:  # /dev is read-only: no file there for another submission to find
                open("/dev/planted-by-a", "w").write("a")
            except OSError:
                pass
            master, _ = os.openpty()  # a pty of A's own devpts instance
            os.write(master, b"TOKEN-OF-A")
            try:  # the seccomp allow-list has no socket() at all; were it there, B must still not reach it
                s = socket.socket(socket.AF_UNIX)
                s.bind("\\0attnlab-planted-by-a")
                s.listen(1)
            except OSError:
                pass
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            time.sleep(3.0)  # B looks meanwhile
            return float(len(visible_pids()))
        """, Limits(timeout_s=8.0))
    b = sandbox_for(tmp_path / "b", """
        def look():
            try:
                socket.socket(socket.AF_UNIX).connect("\\0attnlab-planted-by-a")
                reached = True
            except OSError:
                reached = False
            ptys = sorted(n for n in os.listdir("/dev/pts") if n != "ptmx")
            return repr((sorted(os.listdir("/tmp")), sorted(os.listdir("/dev/shm")), reached, visible_pids(),
                         sorted(os.listdir("/dev")), ptys))

        def kill_all():
            os.kill(-1, signal.SIGKILL)  # everything it can reach: its own server included

        def ready():
            return 1.0
        """, Limits(timeout_s=8.0))
    with a, b:
        assert b.run([Call("ready")], policy=False).status == "ok"  # B's server is up before A plants anything
        results = {}
        thread = threading.Thread(target=lambda: results.setdefault("a", a.run([Call("plant")], policy=False)))
        thread.start()
        time.sleep(1.5)
        looked = b.run([Call("look")], policy=False)
        seen = eval(looked.results[0]["value"]) if looked.results and "value" in looked.results[0] else looked
        # B's kill(-1): its own server goes under the template; under bwrap the server is pid 1, out of reach
        assert b.run([Call("kill_all")], policy=False).status == ("ok" if launcher == "bwrap" else "protocol")
        thread.join()
        assert a.launcher == b.launcher == launcher
    assert isinstance(seen, tuple), seen
    tmp_listing, shm_listing, reached, pids, dev_listing, ptys = seen
    assert not [n for n in tmp_listing + shm_listing + dev_listing if "planted" in n] and not reached
    assert ptys == [], ptys  # A's pty is in A's devpts instance, not in B's
    assert max(pids) < 10, pids  # its own namespace only
    # [init,] server, A, daemon
    assert results["a"].status == "ok" and results["a"].results[0]["value"] == (3.0 if launcher == "bwrap" else 4.0), \
        results["a"]


@needs_bwrap
def test_crashes_and_exits_are_named(tmp_path):
    with sandbox_for(tmp_path, """
        def segfault():
            import ctypes
            ctypes.string_at(0)

        def leave():
            os._exit(0)
        """) as box:
        crashed = box.run([Call("segfault")], policy=False).message
        assert crashed.startswith("crashed with SIGSEGV: memory outside its tensors"), crashed
        assert "exited (code 0)" in box.run([Call("leave")], policy=False).message


@needs_bwrap
def test_memory_is_capped_for_the_whole_submission(tmp_path, launcher):
    limits = Limits(timeout_s=9.0, memory_mb=1024, submission_memory_mb=1536)
    with sandbox_for(tmp_path, """
        def hog():
            # no clock: each child says when its memory is resident (a queued signal), and the
            # parent waits until each one has said so or died; three alive then would be 2100 MB
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
            kids = []
            for _ in range(3):
                pid = os.fork()
                if pid == 0:
                    x = b"\x01" * (700 * 2**20)  # written, so resident; each under the per-process cap
                    os.kill(os.getppid(), signal.SIGRTMIN)
                    while True:
                        time.sleep(1)
                kids.append(pid)
            ready, dead = set(), set()
            while len(ready | dead) < 3:
                info = signal.sigtimedwait([signal.SIGRTMIN], 0.05)
                if info is not None:
                    ready.add(info.si_pid)
                for pid in kids:
                    if pid not in dead and os.waitpid(pid, os.WNOHANG)[0] == pid:
                        dead.add(pid)
            alive = 0
            for pid in kids:
                if pid not in dead and os.waitpid(pid, os.WNOHANG)[0] == 0:
                    alive += 1
                    os.kill(pid, signal.SIGKILL)
            return alive
        """, limits) as box:
        outcome = box.run([Call("hog")], policy=False)
        fence = box.memory_fence
    if not fence.startswith("cgroup"):
        cannot_run(f"no cgroup here (not root, none delegated): {fence}")  # CI runs as root with cgroups
    # three 700 MB processes do not fit in 1536 MB: the cgroup kills at least one
    assert outcome.status != "ok" or outcome.results[0]["value"] < 3, outcome


# --------------------------------------------------------------------------- forged messages
def forged(msg) -> bytes:
    """A message in the protocol's own format (safetensors + JSON), or raw bytes as they are."""
    return msg if isinstance(msg, bytes) else encode_message(msg)


def raw_safetensors(header: dict, data: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


def _pickled_zip() -> bytes:  # what the grader used to accept: torch.save's zip (now never parsed)
    buf = io.BytesIO()
    torch.save({"status": "ok", "results": [{"value": 1.0}], "violations": []}, buf)
    return buf.getvalue()


MESSAGE = json.dumps({"status": "ok", "results": [{"value": {"__tensor__": "t0"}}], "violations": []})


@needs_bwrap
@pytest.mark.parametrize("message,words", [
    ({"status": "ok", "results": [5]}, "not a dict"),
    (raw_safetensors({"__metadata__": {"message": MESSAGE},  # 10^12 elements claimed, 1 byte sent
                      "t0": {"dtype": "BOOL", "shape": [10**12], "data_offsets": [0, 1]}}, b"\0"), "tensor elements"),
    (raw_safetensors({"__metadata__": {"message": MESSAGE},
                      "t0": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}, b"\0" * 16), "bytes at"),
    ({"status": "ok", "results": [{"value": {"__seq__": 5, "__tuple__": True}}]}, "unknown shape"),
    ({"status": "passed", "results": []}, "unknown status"),
    ({"status": "ok", "results": [{"value": 1.0}], "violations": [], "admin": True}, "known fields"),
    (raw_safetensors({"__metadata__": {"message": "[" * 4000 + "]" * 4000}}), "nested deeper"),
    (raw_safetensors({"__metadata__": {"message": "[" + "[[[[[[0]]]]]]," * 16000 + "0]"}}), "more than"),
    (_pickled_zip(), "header of"),
    (struct.pack("<Q", 1 << 62) + b"{}", "header of"),
])
def test_a_forged_message_is_refused_not_trusted(tmp_path, message, words):
    payload = forged(message)
    with sandbox_for(tmp_path, f"""
        def attack():
            data = {payload!r}
            for fd in range(3, 64):
                try:
                    os.write(fd, data)
                except OSError:
                    pass
            os._exit(0)
        """) as box:
        outcome = box.run([Call("attack")], policy=False)
    assert outcome.status == "protocol" and words in outcome.message, outcome.message


def test_validation_checks_storage_not_the_view():
    ok = {"status": "ok", "results": [{"value": torch.zeros(3, 4)}], "violations": []}
    validate_message(ok, 1)
    for bad in (torch.zeros(1).expand(10**9), torch.zeros(10)[2:], torch.zeros(4, 4).t(), torch.zeros(10)[:5]):
        with pytest.raises(BadMessage):
            validate_message({"status": "ok", "results": [{"value": bad}]}, 1)
    with pytest.raises(BadMessage, match="elements"):
        validate_message({"status": "ok", "results": [{"value": torch.zeros(MAX_ELEMENTS + 1, dtype=torch.bool)}]},
                         1)


def test_a_changed_input_list_is_validated_like_every_other_field():
    """'mutated' (the inputs a call changed in place, for the mistake 'mutates_input') crosses only as
    a short list of short strings, and only beside a value."""
    ok = {"status": "ok", "results": [{"value": torch.zeros(2), "mutated": ["scores"]}], "violations": []}
    validate_message(ok, 1)
    for bad in ("scores", ["x"] * 9, [3], ["x" * 100_000], {"a": 1}):
        with pytest.raises(BadMessage):
            validate_message({"status": "ok", "results": [{"value": torch.zeros(2), "mutated": bad}]}, 1)
    with pytest.raises(BadMessage):
        validate_message({"status": "ok", "results": [{"error": "E", "mutated": ["scores"]}]}, 1)


def test_a_corrupted_heap_is_said_as_memory_outside_the_tensors_without_glibc_s_text(tmp_path):
    """A child that dies of SIGABRT after glibc's heap message (what a Triton store past a tensor's end
    did under the interpreter) is reported as memory written outside its tensors; glibc's lines and
    the packages' warnings with their paths are left out of what the learner reads, their own kept."""
    path = tmp_path / "crash.py"
    path.write_text(textwrap.dedent("""
        import os, sys
        def attack():
            print("my own line")
            sys.stderr.write("/x/site-packages/triton/runtime/interpreter.py:1144: RuntimeWarning: NaN\\n")
            sys.stderr.write("double free or corruption (out)\\n")
            sys.stdout.flush(); sys.stderr.flush()
            os.abort()
    """))
    with Sandbox(path, Limits(timeout_s=20)) as box:
        outcome = box.run([Call("attack")], policy=False)
    assert outcome.status == "crash" and "SIGABRT" in outcome.message, outcome
    assert "outside its tensors" in outcome.message, outcome.message
    assert "my own line" in outcome.output and "double free" not in outcome.output, outcome.output
    assert "site-packages" not in outcome.output, outcome.output


def test_learner_text_is_made_safe():
    text = "a\x1b[2Jb\rc\x07d\ud800e\u202ef\ng"
    cleaned = clean_text(text)
    assert "\x1b" not in cleaned and "\r" not in cleaned and "\x07" not in cleaned and "\u202e" not in cleaned
    cleaned.encode("utf-8")  # no lone surrogate left
    assert cleaned.startswith("a") and "\ng" in cleaned
    assert len(clean_text("x" * 100_000)) < 4100


# --------------------------------------------------------------------------- seccomp, not dumpable
REACH = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def attempt(fn):
        r = fn()
        return "ok" if r != -1 else os.strerror(ctypes.get_errno())

    def reach():
        server = os.getppid()
        pidfd = os.pidfd_open(server)
        out = {
            "unshare_user": attempt(lambda: libc.unshare(0x10000000)),   # CLONE_NEWUSER: root in a nested ns
            "clone_newns": attempt(lambda: libc.syscall(56, 0x00020000 | 17, 0, 0, 0, 0)),  # clone(CLONE_NEWNS)
            "ptrace_server": attempt(lambda: libc.ptrace(16, server, 0, 0)),  # PTRACE_ATTACH
            "pidfd_getfd": attempt(lambda: libc.syscall(438, pidfd, 3, 0)),   # the server's fds
            "mount": attempt(lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
        }
        pid = os.fork()  # ordinary forks and threads still work
        if pid == 0:
            os._exit(7)
        out["fork"] = os.WEXITSTATUS(os.waitpid(pid, 0)[1])
        return str(sorted(out.items()))
"""


@needs_bwrap
def test_learner_code_cannot_reach_other_processes_or_make_namespaces(tmp_path, launcher):
    """The pidfd_getfd attack (the server's reply pipe taken, a forged header written) and the
    nested user namespace (root inside, a tmpfs of any size) both need calls the child's
    seccomp filter refuses; the server is not dumpable either."""
    with sandbox_for(tmp_path, REACH) as box:
        outcome = box.run([Call("reach")], policy=False)
    assert outcome.status == "ok" and "value" in outcome.results[0], (outcome.message, outcome.results)
    got = dict(eval(outcome.results[0]["value"]))  # noqa: S307  (our own repr of a list of pairs)
    assert got.pop("fork") == 7
    assert got == {k: "Operation not permitted" for k in got}, got


@pytest.mark.parametrize("how", ["libseccomp", "bpf"])
def test_the_filter_refuses_what_it_lists_and_nothing_a_lab_needs(how):
    """Without a sandbox, in a child of this test, on each route (libseccomp, the written-out
    program): before the filter a nested user namespace can be made and clone(CLONE_NEWNS)
    runs (the checks are not vacuous), after it each of the denied calls is EPERM and clone3
    ENOSYS; threads, fork and torch still run."""
    import subprocess
    import sys

    from attnlab.grading.sandbox import seccomp

    if how == "libseccomp" and seccomp._libseccomp() is None:  # noqa: SLF001
        cannot_run("libseccomp.so.2 is not installed here (Debian: apt-get install libseccomp2)")
    code = textwrap.dedent("""
        import ctypes, os, sys, threading, torch
        from attnlab.grading.sandbox import seccomp
        libc = ctypes.CDLL(None, use_errno=True)

        def attempts():
            out = {}
            for name, call in [("unshare", lambda: libc.unshare(0x10000000)),
                               ("clone_newns", lambda: libc.syscall(56, 0x00020000 | 17, 0, 0, 0, 0)),
                               ("clone3", lambda: libc.syscall(435, 0, 0)),
                               ("ptrace", lambda: libc.ptrace(0, 0, 0, 0)),  # PTRACE_TRACEME: harmless either way
                               ("mount", lambda: libc.mount(b"none", b"/nonexistent", b"tmpfs", 0, None)),
                               ("keyctl", lambda: libc.syscall(250, 0, 0, 0, 0, 0))]:
                pid = os.fork()
                if pid == 0:
                    r = call()  # a clone that ran returns twice (0 in its child): both lines say ok
                    os.write(1, f"{name}={'ok' if r >= 0 else ctypes.get_errno()}\\n".encode())
                    os._exit(0)
                os.waitpid(pid, 0)
        attempts()
        print("--", seccomp.install(sys.argv[1]), flush=True)
        attempts()
        t = threading.Thread(target=lambda: None); t.start(); t.join()
        torch.set_num_threads(2)
        print("torch", bool((torch.ones(256, 256) @ torch.ones(256, 256)).sum() == 256 ** 3), flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    before, after = run.stdout.split("--", 1)
    got_before = dict(line.split("=") for line in before.split())
    got_after = dict(line.split("=") for line in after.splitlines()[1:] if "=" in line)
    assert f"({how}" in after.splitlines()[0]
    assert got_before["unshare"] == got_before["clone_newns"] == got_before["ptrace"] == "ok", got_before
    assert got_after == {"unshare": "1", "clone_newns": "1", "clone3": "38", "ptrace": "1", "mount": "1",
                         "keyctl": "1"}, got_after  # EPERM; ENOSYS for clone3
    assert "torch True" in run.stdout


# --------------------------------------------------------------------------- one template at a time
@needs_bwrap
def test_a_nested_class_template_shares_the_outer_one_and_only_the_outer_stops_it(tmp_path):
    """A class_template inside another starts no second template and stops nothing when it is
    left; a submission graded after it still forks from the outer one; leaving the outer one
    leaves no process of the template behind."""
    from helpers.procs import process_tree

    with made_by("template") as own:
        outer = next(p for p in own if process_tree(p) == own)  # the template's bwrap
        with pool.class_template("auto") as inner:
            assert inner.active and inner.pid == outer
            assert process_tree(outer) == own  # no second template
        assert pool.class_template().active and process_tree(outer) == own  # still running
        with sandbox_for(tmp_path, "def attack():\n    return 1.0\n") as box:
            assert box.run([Call("attack")], policy=False).results[0]["value"] == 1.0
    assert not pool.class_template().active

    def running() -> list[int]:  # not counting zombies (conftest makes this process their subreaper)
        alive = []
        for p in own:
            try:
                state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                alive.append(p)
        return alive

    deadline = time.monotonic() + 10  # a backstop: the init and the template die with their bwrap
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(), own
