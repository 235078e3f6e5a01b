"""Sandbox servers for the grader: start one per submission, keep a spare, fork them from a class template.

The server needs ~1.5 s to import torch. Started first thing (``attnlab grade`` calls
:func:`prestart` before it imports torch itself), it does so on the other core. Imports no
torch itself, so the CLI can start a server before it imports anything heavy.

Where ``bwrap`` (bubblewrap) is installed, the server runs in the OS sandbox of
:mod:`.bwrap` (an identity that owns nothing, nothing of attnlab but the runner, a fresh
read-only ``/dev``, no network, seccomp). Memory for the whole submission, all its
processes together, is capped by a cgroup when one can be created here (v2 with the memory
and pids controllers, or v1's ``memory`` and ``pids`` hierarchies, as root or where
delegated); otherwise by each process's ``RLIMIT_AS`` and ``RLIMIT_NPROC`` plus the tmpfs
caps. :attr:`Server.memory_fence` says which applied.

Without ``bwrap`` (mode ``none``) the server runs as a plain child process (``sandboxed =
False``): the process limits of :mod:`.server` still apply, the OS fences do not. Mode
``user`` (Gradescope without bwrap, root only) runs it as a fresh unprivileged uid in its
own session, every process of which is killed after each task and when it stops.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from attnlab.grading.sandbox import bwrap as _bwrap
from attnlab.grading.sandbox import seccomp, user
from attnlab.grading.sandbox.bwrap import HOW_TO_GET_BWRAP, bwrap_path
from attnlab.grading.sandbox.frames import write_frame

__all__ = ["Server", "SandboxUnavailable", "start", "prestart", "take", "start_failure", "HOW_TO_GET_BWRAP", "SANDBOX_MODES",
           "resolve_mode", "keep_spare", "spare", "class_template", "SpawnedServer", "bwrap_path"]

SANDBOX_MODES = ("auto", "bwrap", "user", "none")


class SandboxUnavailable(RuntimeError):
    """The sandbox asked for cannot run here."""


# --------------------------------------------------------------------------- #
# A cgroup for the whole submission
# --------------------------------------------------------------------------- #


@dataclass
class _Cgroup:
    dirs: list[Path] = field(default_factory=list)
    kind: str = ""

    def procs(self) -> list[int]:
        pids: set[int] = set()
        for d in self.dirs:
            try:
                pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(pids)

    def cpu_s(self) -> Optional[float]:
        """CPU seconds used by every process of the submission so far (v2 ``cpu.stat``'s
        usage_usec, v1 ``cpuacct.usage``), or None where this cgroup does not count CPU."""
        for d in self.dirs:
            try:
                if (d / "cpu.stat").exists() and self.kind == "cgroup v2":
                    for line in (d / "cpu.stat").read_text().splitlines():
                        if line.startswith("usage_usec "):
                            return int(line.split()[1]) / 1e6
                if (d / "cpuacct.usage").exists():
                    return int((d / "cpuacct.usage").read_text()) / 1e9
            except (OSError, ValueError):
                return None
        return None

    def enter(self) -> None:  # runs in the forked child, before exec
        for d in self.dirs:
            (d / "cgroup.procs").write_text("0")

    def add(self, pid: int) -> None:
        """Move the process ``pid`` (a host pid) in; raises OSError where it cannot."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        for _ in range(50):
            pids = self.procs()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass


def _own_cgroup(controller: str) -> Optional[str]:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if controller in ctrls.split(","):
                return path
    except OSError:
        pass
    return None


def _make_cgroup(memory_mb: int, max_procs: int) -> Optional[_Cgroup]:
    """A fresh cgroup capping memory and process count, or None where none can be made."""
    if os.environ.get("ATTNLAB_CGROUP") == "0":
        return None
    name = f"attnlab-grade-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    limit = str(memory_mb * 1024 * 1024)
    v2 = Path("/sys/fs/cgroup")
    try:  # cgroup v2: one folder, both controllers enabled for children
        if (v2 / "cgroup.controllers").exists():
            own = _own_cgroup("") or "/"
            base = v2 / own.lstrip("/")
            if {"memory", "pids"} <= set((base / "cgroup.subtree_control").read_text().split()):
                d = base / name
                d.mkdir()
                (d / "memory.max").write_text(limit)
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(max_procs))
                return _Cgroup([d], "cgroup v2")
    except OSError:
        pass
    made: list[Path] = []
    try:  # cgroup v1: the memory and pids hierarchies
        mem_own, pids_own = _own_cgroup("memory"), _own_cgroup("pids")
        if mem_own is None or pids_own is None:
            return None
        mem = v2 / "memory" / mem_own.lstrip("/") / name
        pids = v2 / "pids" / pids_own.lstrip("/") / name
        mem.mkdir()
        made.append(mem)
        (mem / "memory.limit_in_bytes").write_text(limit)
        pids.mkdir()
        made.append(pids)
        (pids / "pids.max").write_text(str(max_procs))
        cpu_own = _own_cgroup("cpuacct")  # CPU counted where it is spent, where the hierarchy is there
        if cpu_own is not None:
            for root in ("cpuacct", "cpu,cpuacct"):
                if (v2 / root / "cpuacct.usage").exists():
                    cpu = v2 / root / cpu_own.lstrip("/") / name
                    try:
                        cpu.mkdir()
                        made.append(cpu)
                    except OSError:
                        pass
                    break
        return _Cgroup(made, "cgroup v1")
    except OSError:
        for d in made:
            try:
                d.rmdir()
            except OSError:
                pass
        return None


# --------------------------------------------------------------------------- #
# The server
# --------------------------------------------------------------------------- #


def _fence(cgroup: Optional[_Cgroup], memory_mb: int, sandboxed: bool) -> str:
    """How a submission's memory is capped, in words (``extra_data.sandbox.memory``)."""
    if cgroup is not None:
        return f"{cgroup.kind}: {memory_mb} MB and a process cap for the whole submission"
    return "per-process RLIMIT_AS and RLIMIT_NPROC" + (" plus size-capped tmpfs" if sandboxed else "")


@dataclass
class Server:
    """A running sandbox server: the process, and what fences it."""

    proc: subprocess.Popen
    sandboxed: bool
    cgroup: Optional[_Cgroup]
    memory_mb: int
    ready: bool = False
    plan: Optional[_bwrap.Plan] = None
    uid: Optional[int] = None  # mode 'user': the server's own uid, every process of which dies with it
    root: str = ""  # the folder outside a sandbox's private /tmp that the server works in (its 'ready' says)

    @property
    def memory_fence(self) -> str:
        """How the submission's memory is capped, in words."""
        return _fence(self.cgroup, self.memory_mb, self.sandboxed)

    @property
    def identity(self) -> str:
        """Whom the submission's processes run as on the host, in words."""
        if self.uid is not None:
            return f"a fresh unprivileged uid ({self.uid}) in a session of its own, without an OS sandbox"
        return self.plan.identity if self.plan is not None else "the grader's own user, without an OS sandbox"

    @property
    def request_fd(self) -> int:
        """Where the grader writes requests (:mod:`.frames`)."""
        return self.proc.stdin.fileno()

    @property
    def reply_fd(self) -> int:
        """Where the server's replies come from."""
        return self.proc.stdout.fileno()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Kill the server and everything it started (the pid namespace dies with it)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if self.uid is not None:
            user.kill_uid(self.uid)
            if self.root:  # the folder it said it works in (before any learner code ran): gone too
                user.remove_as(self.uid, self.root)
        elif self.root and not self.sandboxed and os.path.basename(self.root).startswith("attnlab-sandbox-"):
            import shutil

            shutil.rmtree(self.root, ignore_errors=True)  # mode 'none': the grader's own user made it
        if self.cgroup is not None:
            self.cgroup.remove()


def start_failure(server, wait_s: float = 2.0, limit: int = 1500) -> str:
    """What a server that did not start wrote to its stderr (bwrap's or the interpreter's
    message), at most ``limit`` bytes, waiting up to ``wait_s`` for it to exit; '' if nothing."""
    proc = getattr(server, "proc", None)
    if proc is None or proc.stderr is None:
        return ""
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
    fd = proc.stderr.fileno()
    os.set_blocking(fd, False)
    chunks, left = [], limit
    try:
        while left > 0 and select.select([fd], [], [], 0.05)[0]:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError:
        pass
    text = b"".join(chunks).decode(errors="replace").strip()
    code = proc.poll()
    if code is not None and code != 0:
        text = (text + f" (exit status {code})").strip()
    return text


def resolve_mode(mode: str) -> Optional[str]:
    """The bwrap to use (None: run without it); raises SandboxUnavailable for mode 'bwrap'
    without bwrap, and for mode 'user' when this process is not root."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"sandbox: expected one of {SANDBOX_MODES}, got {mode!r}")
    if mode == "none":
        return None
    if mode == "user":
        if os.geteuid() != 0:
            raise SandboxUnavailable("sandbox 'user' runs the learner as a fresh unprivileged uid, which needs root")
        return None
    bwrap = bwrap_path()
    if bwrap is None and mode == "bwrap":
        raise SandboxUnavailable(f"bwrap (bubblewrap) was not found: {HOW_TO_GET_BWRAP}")
    return bwrap


def _seccomp_pipe() -> Optional[int]:
    """A pipe's read end holding the compiled filter, for bwrap's ``--seccomp`` (None: none here)."""
    program = seccomp.program_bytes()
    if not program:
        return None
    r, w = os.pipe()
    os.write(w, program)  # a few hundred bytes: the pipe holds them
    os.close(w)
    return r


def _server_argv(inside: bool) -> list[str]:
    here = Path(__file__).resolve().parent
    script = f"{_bwrap.RUNNER}/server.py" if inside else str(here / "server.py")
    return [sys.executable, "-I", "-B", script]


def _can_become_another_uid() -> None:
    """A root grader runs the learner (and bwrap) as a uid of its own: say so, by name, when the
    container took away what that needs (the fork would only say "Exception occurred in preexec_fn")."""
    lacking = _bwrap.lacking_capabilities()
    if lacking:
        caps = " and ".join(f"CAP_{c}" for c in lacking)
        flags = " ".join(f"--cap-add {c}" for c in lacking)
        raise SandboxUnavailable(
            f"this container drops {caps}, so root cannot run the learner as an unprivileged uid of its own; "
            f"give them back (Docker and Gradescope keep them by default; docker run {flags})")


def start(mode: str = "auto", memory_mb: int = 2048, max_procs: int = 64) -> Server:
    """Start a new server for one submission. ``mode``: 'auto' (bwrap where installed),
    'bwrap' (required), 'user' (no bwrap: a fresh unprivileged uid, root only) or 'none'.
    ``memory_mb``/``max_procs``: the submission's cgroup caps."""
    bwrap = resolve_mode(mode)
    if os.geteuid() == 0 and (bwrap is not None or mode == "user"):
        _can_become_another_uid()
    cgroup = _make_cgroup(memory_mb, max_procs) if bwrap is not None or mode == "user" else None
    # stderr: what bwrap or the interpreter says when the server cannot start (the server points its
    # own 2 to /dev/null once ready); read, bounded, only to say why a start failed (:func:`start_failure`)
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                 start_new_session=True)
    if bwrap is not None:
        seccomp_fd = _seccomp_pipe()
        plan = _bwrap.plan(bwrap, _server_argv(inside=True) + ["--sandboxed"], seccomp_fd=seccomp_fd)
        plan.enter_cgroup = cgroup.enter if cgroup is not None else None
        try:
            proc = subprocess.Popen(plan.argv, pass_fds=plan.pass_fds, preexec_fn=plan.preexec, **pipes)
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        return Server(proc, True, cgroup, memory_mb, plan=plan)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_")}
    env.update(OMP_NUM_THREADS="1", ATTNLAB_NATIVE="0", PYTHONDONTWRITEBYTECODE="1", TRITON_INTERPRET="1")
    if mode == "user":  # :mod:`.user`
        uid = _bwrap.unprivileged_uid()
        enter = cgroup.enter if cgroup is not None else None
        exposure = user.Exposure.for_python()

        def become() -> None:  # a session of its own (start_new_session), the cgroup, the paths, then the uid
            if enter is not None:
                enter()
            exposure.apply()  # where no mount namespace can be made the paths stay: the self-test says if that works
            _bwrap.drop_to(uid)

        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "ATTNLAB_NATIVE": "0",
               "TRITON_INTERPRET": "1"}  # nothing of the grader's environment (bwrap.plan says why the last)
        argv = [sys.executable, "-I", "-B", os.path.join(user.runner_copy(), "server.py"), "--sandboxed"]
        proc = subprocess.Popen(argv, env=env, cwd="/", preexec_fn=become, **pipes)
        return Server(proc, False, cgroup, memory_mb, uid=uid)
    proc = subprocess.Popen(_server_argv(inside=False), env=env, **pipes)
    return Server(proc, False, cgroup, memory_mb)


_pending: Optional[tuple[tuple, Server]] = None
_keep_spare = False


def spare() -> Optional[Server]:
    """The server started ahead (:func:`prestart`, :func:`keep_spare`), if any."""
    return _pending[1] if _pending is not None else None


def keep_spare(enabled: bool = True) -> None:
    """For a process that grades many submissions (a class folder, a test suite): after
    each :func:`take`, start the next server at once, so it imports torch while the
    current submission is graded (~2 s saved per submission). A spare holds no learner
    code until it is taken. Off by default; it dies with this process either way."""
    global _keep_spare
    _keep_spare = enabled


_spare_lock = threading.Lock()  # batch grading takes servers from several threads


def prestart(mode: str = "auto", memory_mb: int = 2048, max_procs: int = 64) -> None:
    """Start a server now, for the next :func:`take` with the same arguments."""
    with _spare_lock:
        _prestart(mode, memory_mb, max_procs)


def _prestart(mode: str, memory_mb: int, max_procs: int) -> None:
    global _pending
    if _pending is None:
        try:
            _pending = ((mode, memory_mb, max_procs, bwrap_path()), start(mode, memory_mb, max_procs))
        except (SandboxUnavailable, OSError):
            _pending = None


def take(mode: str = "auto", memory_mb: int = 2048, max_procs: int = 64):
    """The prestarted server if it matches and still runs, else a new one (forked from the
    class template inside :func:`class_template`). Each server serves one submission: the
    caller stops it when that submission is graded."""
    global _pending
    template = _template
    if template is not None and resolve_mode(mode) is not None:
        spawned = template.spawn(memory_mb, max_procs)
        if spawned is not None:
            return spawned
    server = None
    with _spare_lock:
        if _pending is not None:
            key, spare = _pending
            _pending = None
            if key == (mode, memory_mb, max_procs, bwrap_path()) and spare.alive():  # made the same way
                server = spare
            else:
                spare.stop()
    if server is None:
        server = start(mode, memory_mb, max_procs)
    if _keep_spare:
        prestart(mode, memory_mb, max_procs)
    return server


# --------------------------------------------------------------------------- #
# The class template: one pre-imported server that forks each submission's sandbox
# --------------------------------------------------------------------------- #


def _descendant_with_nspid(root: int, nspid: int) -> Optional[int]:
    """The host pid of the process below ``root`` whose pid in its own (second-level)
    namespace is ``nspid``: the template's fork, seen from the host."""
    children: dict[int, list[int]] = {}
    nspids: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            text = (proc / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        try:
            children.setdefault(int(fields["PPid"]), []).append(int(proc.name))
            nspids[int(proc.name)] = [int(x) for x in fields.get("NSpid", "").split()]
        except (KeyError, ValueError):
            continue
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        chain = nspids.get(pid, [])
        if len(chain) == 2 and chain[1] == nspid:
            return pid
        todo.extend(children.get(pid, []))
    return None


@dataclass
class SpawnedServer:
    """A submission's sandbox server forked from the class template (:mod:`.template`):
    the same channels and fences as a :class:`Server`, without an interpreter start."""

    host_pid: int  # the template's fork (the namespace's init and the server hang below it)
    pidfd: int
    request_fd: int
    reply_fd: int
    cgroup: Optional[_Cgroup]
    memory_mb: int
    sandboxed: bool = True
    identity: str = ""  # the template's (each fork maps its uid to itself)

    @property
    def memory_fence(self) -> str:
        return _fence(self.cgroup, self.memory_mb, self.sandboxed)

    def alive(self) -> bool:
        return self.pidfd >= 0 and not select.select([self.pidfd], [], [], 0)[0]

    def stop(self) -> None:
        """Kill the fork: its namespace's init dies with it (PR_SET_PDEATHSIG), and every
        process of the namespace with the init; the cgroup is emptied too."""
        if self.pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass
            os.close(self.pidfd)
            self.pidfd = -1
        for fd in (self.request_fd, self.reply_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.request_fd = self.reply_fd = -1
        if self.cgroup is not None:
            self.cgroup.remove()


class _Template:
    """The template process (in bwrap, as a server is) and the grader's end of its socket.
    (:mod:`.template` is its inside.)"""

    START_TIMEOUT_S = 90.0

    def __init__(self, bwrap: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-I", "-B", f"{_bwrap.RUNNER}/template.py", str(theirs.fileno()),
                json.dumps(_bwrap.tmp_roots())]
        self.plan = _bwrap.plan(bwrap, argv, template=True)
        self.proc = subprocess.Popen(self.plan.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                     start_new_session=True, preexec_fn=self.plan.preexec)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.problem = ""
        ours.settimeout(self.START_TIMEOUT_S)
        try:
            hello = ours.recv(512)
        except OSError as exc:
            hello = f"no answer ({exc})".encode()
        if hello != b"ready":
            self.problem = hello.decode(errors="replace").removeprefix("unsupported ") or "it exited"
            self.stop()
            return
        ours.settimeout(10.0)

    def spawn(self, memory_mb: int, max_procs: int) -> Optional[SpawnedServer]:
        """A new server for one submission, or None (the template is gone or broken: the
        caller starts a bwrap of its own)."""
        if self.problem or self.proc.poll() is not None:
            return None
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        cgroup = None
        pidfd = -1
        try:
            with self.lock:
                socket.send_fds(self.sock, [b"spawn"], [req_r, rep_w])
                answer = self.sock.recv(64)
            os.close(req_r)
            os.close(rep_w)
            req_r = rep_w = -1
            if len(answer) != 8:
                raise OSError(f"the template answered {answer[:40]!r}")
            (nspid,) = struct.unpack("<q", answer)
            host = _descendant_with_nspid(self.proc.pid, nspid)
            if host is None:
                raise OSError("the template's fork was not found under its bwrap")
            pidfd = os.pidfd_open(host)
            cgroup = _make_cgroup(memory_mb, max_procs)
            if cgroup is not None:
                cgroup.add(host)  # before it enters anything: all it starts is counted
            write_frame(req_w, b"go")
            return SpawnedServer(host, pidfd, req_w, rep_r, cgroup, memory_mb, identity=self.plan.identity)
        except OSError:
            for fd in (req_r, req_w, rep_r, rep_w, pidfd):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            if cgroup is not None:
                cgroup.remove()
            return None

    def stop(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


_template: Optional[_Template] = None


class class_template:
    """``with class_template(mode):`` the servers :func:`take` hands out are forked from one
    pre-imported template (:mod:`.template`) instead of one ``bwrap`` each; on leaving, the
    template and everything below it are stopped. Where the template cannot work here
    (no bwrap, or no nested user namespaces), ``reason`` says why and :func:`take` starts a
    ``bwrap`` per submission as before.

    Nested inside another ``class_template`` it starts nothing: the outer template serves
    both, and only the outer one stops it (a second template would replace the first, which
    then would never be stopped)."""

    def __init__(self, mode: str = "auto") -> None:
        self.mode = mode
        self.reason = ""
        self._nested = False

    def __enter__(self) -> "class_template":
        global _template
        if _template is not None:
            self._nested = True
            return self
        bwrap = resolve_mode(self.mode)
        if bwrap is None:
            self.reason = "no OS sandbox (bwrap) here"
            return self
        if os.environ.get("ATTNLAB_TEMPLATE") == "0":
            self.reason = "ATTNLAB_TEMPLATE=0"
            return self
        template = _Template(bwrap)
        if template.problem:
            self.reason = f"the template cannot make a sandbox per submission here: {template.problem}"
            return self
        _template = template
        return self

    @property
    def active(self) -> bool:
        return _template is not None

    @property
    def pid(self) -> Optional[int]:
        """The host pid of the template's ``bwrap`` (its process tree holds every sandbox it
        forked), or None when the template is not in use."""
        return _template.proc.pid if _template is not None else None

    def __exit__(self, *exc) -> None:
        global _template
        if self._nested:
            return
        if _template is not None:
            _template.stop()
            _template = None
