"""The only code that runs inside the sandbox: load the submission, call its functions, send the results.

It is bound into the sandbox with its siblings (:data:`.bwrap.RUNNER_FILES`) and nothing else
of attnlab: no reference, no doctor, no solutions, no grader. It imports only the standard
library, torch (and jaxtyping, which the labs' files import). Every reference value and
every diagnosis is computed in the grader's process, from the raw values sent back.

**The learner's code can run anything here.** The static allow-list (:mod:`..static`)
and the call recorder (:mod:`.recorder`) are evidence for the report, not fences: a
submission that gets past both still finds nothing worth having in this process, cannot
write anything the grader trusts (the grader parses only the bounded formats of
:mod:`.protocol`), and is held by the OS fences (:mod:`.bwrap`), the per-child limits set
below and the seccomp filter (:mod:`.seccomp`).

The zygote (:func:`serve`) imports torch once, then forks one child per task:

* on ``load`` the zygote compiles the bytes it received, once, before any learner code has run
  (:func:`_load`): the checked bytes all the way to the use. Each child runs that code object
  in a fresh module; the copy on disk (for tracebacks and ``inspect``, served from a linecache
  entry made from the same bytes) is never read back as code, so nothing a learner's child
  writes reaches the next exercise;
* the child sets its limits (memory, CPU time, file size, processes, no core dumps), installs
  the seccomp filter, runs the learner's code object, makes the calls, and writes exactly one
  message (:func:`protocol.encode_message`) on a pipe, then ``_exit``-s;
* the zygote enforces the wall-clock backstop on the child's exit, caps its pipes, and kills
  every other process of the sandbox (``kill(-1)`` in its pid namespace) afterwards.

Run as ``python -I -B server.py [--sandboxed]``; requests come on fd 0, replies go to fd 1
(:mod:`.frames`). Requests are the grader's own (trusted), in the same safetensors + JSON
format as the answers (:func:`protocol.encode_request`), so no attnlab class is needed here.
"""

from __future__ import annotations

import ctypes
import io
import json
import math
import os
import re
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace
from typing import Any, Optional

try:  # inside the sandbox these are plain modules beside this file; in the grader, a package
    from . import calls, frames, harness, protocol, seccomp
    from .calls import MAX_TEXT, Done as _Done, cap as _cap, interpreter as _interpreter, trim_traceback as _trim_traceback
except ImportError:  # python -I puts no script folder on sys.path: the runner's own folder, only
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import calls  # type: ignore[no-redef]
    import frames  # type: ignore[no-redef]
    import harness  # type: ignore[no-redef]
    import protocol  # type: ignore[no-redef]
    import seccomp  # type: ignore[no-redef]
    from calls import MAX_TEXT, Done as _Done, cap as _cap, interpreter as _interpreter  # type: ignore[no-redef]
    from calls import trim_traceback as _trim_traceback  # type: ignore[no-redef]

__all__ = ["serve", "submission_name", "warm_triton_interpreter", "drop_dead_overflow_checks", "MAX_RESULT_BYTES",
           "MAX_TEXT", "SUBMISSION_NAME"]

MAX_RESULT_BYTES = 64 * 1024 * 1024  # one child's message
# what the child prints when its CPU budget runs out (SIGPROF), before it ends: the learner's line it was
# running. Learner-controlled output like any other, so the grader shows it as evidence, never trusts it.
STUCK_MARK = "@@attnlab-stuck-at:"
SUBMISSION_NAME = "submission.py"  # the copy's name inside the sandbox when the learner's own is not plain
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,60}\.py$")


def submission_name(path: "os.PathLike | str") -> str:
    """The name the submission's copy gets inside the sandbox: the learner's own file name
    (so tracebacks say masks.py in lab 02), or :data:`SUBMISSION_NAME` when it is not plain."""
    name = os.path.basename(os.fspath(path))
    return name if _PLAIN_NAME.match(name) else SUBMISSION_NAME


def _vm_kb(status_fd: Optional[int] = None) -> int:
    """VmSize of this process (or of the server whose /proc status ``status_fd`` holds open:
    under the class template /proc is hidden, and a child's VmSize at fork is its server's)."""
    if status_fd is None:
        with open("/proc/self/status", "rb") as f:
            text = f.read()
    else:
        text = os.pread(status_fd, 1 << 16, 0)
    for line in text.splitlines():
        if line.startswith(b"VmSize:"):
            return int(line.split()[1])
    return 0


class _Sigevent(ctypes.Structure):
    """glibc's ``struct sigevent`` on 64-bit Linux (64 bytes): the value, the signal, how to notify."""
    _fields_ = [("sigev_value", ctypes.c_void_p), ("sigev_signo", ctypes.c_int), ("sigev_notify", ctypes.c_int),
                ("_pad", ctypes.c_int * 12)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval_s", ctypes.c_long), ("interval_ns", ctypes.c_long), ("value_s", ctypes.c_long),
                ("value_ns", ctypes.c_long)]


_CLOCK_PROCESS_CPUTIME_ID, _SIGEV_SIGNAL = 2, 0


def _timer_calls() -> Any:
    """libc's timer_create and timer_settime (glibc 2.34 on: in libc itself; before: librt), or
    None. Looked up in the zygote (prepare) so that no child pays for it."""
    global _TIMER_CALLS
    if _TIMER_CALLS is None:
        _TIMER_CALLS = False
        if ctypes.sizeof(ctypes.c_void_p) == 8 and ctypes.sizeof(_Sigevent) == 64:
            for name in (None, "librt.so.1"):
                try:
                    lib = ctypes.CDLL(name, use_errno=True)
                    _TIMER_CALLS = (lib.timer_create, lib.timer_settime)
                    break
                except (OSError, AttributeError):
                    continue
    return _TIMER_CALLS or None


_TIMER_CALLS: Any = None


def _budget_signal(seconds: float) -> str:
    """SIGPROF once this process has used ``seconds`` of CPU, as the scheduler counts it: a POSIX
    timer on CLOCK_PROCESS_CPUTIME_ID. ITIMER_PROF (setitimer) counts CPU by sampling it at each
    timer tick, and under load the sampling overcharged a busy process: sharing one core with two
    processes that each spin 2 ms and sleep 1.5 ms, its 1 s signal came at 0.80-0.83 s of the
    process's real CPU, the POSIX timer's at 1.002-1.004 s (2-core AVX2 EPYC, 2026-12-03; five
    children each, pinned with taskset). A learner's budget then shrank by a fifth on a busy
    grading machine. Returns which clock was set; ITIMER_PROF where timer_create is missing."""
    calls = _timer_calls()
    if calls is not None:
        create, settime = calls
        event = _Sigevent(sigev_signo=signal.SIGPROF, sigev_notify=_SIGEV_SIGNAL)
        timer = ctypes.c_void_p()
        whole = int(seconds)
        spec = _Itimerspec(0, 0, whole, min(999_999_999, int(round((seconds - whole) * 1e9))))
        if create(_CLOCK_PROCESS_CPUTIME_ID, ctypes.byref(event), ctypes.byref(timer)) == 0:
            if settime(timer, 0, ctypes.byref(spec), None) == 0:
                return "cpu-clock"
    signal.setitimer(signal.ITIMER_PROF, seconds)
    return "itimer"


SIGPENDING = 64  # queued signals a learner's process may hold: a handful (tools/trace_syscalls.py: none sent)


def _set_limits(limits: SimpleNamespace, sandboxed: bool, vm_kb: Optional[int] = None) -> None:
    vm_kb = _vm_kb() if vm_kb is None else vm_kb
    cap = vm_kb * 1024 + limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    file_cap = limits.file_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_cap, file_cap))
    # The budget is CPU time, so a loaded machine does not shrink it: SIGPROF a little before
    # timeout_s of this process's CPU (all its threads; 50 ms, or 5% of a short budget, so that its
    # handler, _stuck, can say which line was running), counted as the scheduler counts it
    # (_budget_signal). Whatever the exit, a task whose processes used more CPU than the budget is
    # a timeout (_run_task's count, and the grader's).
    clock = _budget_signal(max(limits.timeout_s - 0.05, 0.95 * limits.timeout_s))
    # RLIMIT_CPU is the fence a learner cannot lift (SIGPROF can be ignored; the hard limit is
    # SIGKILL), soft = hard. The kernel checks it against CPU sampled at each timer tick, which under
    # load overcharged a busy process by up to 36% (_budget_signal's measurement; the SIGKILL of a
    # 1 s limit came at 0.74-0.83 s of real CPU): so it sits at twice the budget and a second, past
    # where honest work is stopped by the budget's own signal
    cpu = math.ceil(2 * limits.timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Queued signals count per host uid above the submission's own user namespace (shared by the
    # class template's forks); a learner's share is bounded by its own limit. The labs queue none.
    # (the budget's POSIX timer holds one entry of that count: its signal's, allocated up front)
    pending = SIGPENDING + (clock == "cpu-clock")
    resource.setrlimit(resource.RLIMIT_SIGPENDING, (pending, pending))
    if sandboxed:  # outside a sandbox of its own uid the count would include the user's other processes
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))


class _RefuseAttnlab:
    """A meta-path finder, for ``--no-sandbox`` runs only (inside the sandbox attnlab is not
    there at all): the learner's process cannot import attnlab by name. Evidence, not a fence."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "attnlab" or name.startswith("attnlab."):
            raise ImportError("attnlab cannot be imported by a lab submission")
        return None


def _stuck(frame, path: str) -> None:
    """SIGPROF: the CPU budget is spent. Say which of the learner's lines was running (the
    innermost frame in their file), then end as SIGPROF would have (the grader reads that exit as
    the timeout; RLIMIT_CPU's SIGKILL stays the fence if this handler is replaced)."""
    import linecache

    f = frame
    while f is not None and f.f_code.co_filename != path:
        f = f.f_back
    if f is not None:
        code = linecache.getline(path, f.f_lineno).strip()[:160]
        line = f"\n{STUCK_MARK}{f.f_lineno}:{f.f_code.co_name}:{code}\n"
        try:
            os.write(2, line.encode("utf-8", "replace"))
        except OSError:
            pass
    signal.signal(signal.SIGPROF, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPROF)


# what 'load' compiled: (the code object, None) or (None, the SyntaxError or ValueError); the
# children inherit it through fork
_LOADED: "tuple[Optional[Any], Optional[BaseException]]" = (None, None)


def _load(source: bytes, path: str) -> None:
    """Write the submission to ``path`` (for tracebacks and ``inspect``), register those bytes'
    lines in ``linecache`` (an entry with no mtime, never checked against the file again), and
    compile them once into :data:`_LOADED`: the children run this code object, never the file."""
    import linecache

    global _LOADED
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(source)
    text = source.decode("utf-8", "replace")
    linecache.cache[path] = (len(source), None, text.splitlines(keepends=True), path)
    try:
        _LOADED = (compile(source, path, "exec", dont_inherit=True), None)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:  # reported by each child as at import
        _LOADED = (None, exc)


def _child_main(result_fd: int, path: str, task: dict, sandboxed: bool, workdir: str,
                vm_kb: Optional[int] = None) -> None:
    """Entry point of the forked child. Sends exactly one message (bytes), then exits."""
    import types

    import torch

    os.chdir(workdir)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True, errors="replace")
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True, errors="replace")
    torch.set_num_threads(1)
    # Python ignores SIGXFSZ (writes past RLIMIT_FSIZE would just fail): restore the default,
    # so writing a huge file ends the child and is reported as such.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    _set_limits(task["limits"], sandboxed, vm_kb)
    signal.signal(signal.SIGPROF, lambda signum, frame: _stuck(frame, path))
    unfiltered = ""
    try:  # before any learner code: no ptrace, pidfd_getfd, process_vm_*, namespaces or mounts
        if task["programs"] is not None:  # compiled by the zygote (seccomp.compiled)
            seccomp.install_compiled(task["programs"])
        else:
            seccomp.install(task["seccomp"])
            seccomp.install_learner_layer()  # pipes and epoll are counted per host uid: none for the learner
    except OSError as exc:  # fail closed: no learner code runs without the filter unless the instructor said so
        unfiltered = f"the sandbox's seccomp filter could not be installed here ({exc.strerror or exc})"[:300]
        if not getattr(task["limits"], "seccomp_optional", False):
            _send(result_fd, {"status": "no_filter", "message": unfiltered, "results": [], "violations": []})
    if not sandboxed:
        sys.meta_path.insert(0, _RefuseAttnlab)
    try:
        from . import recorder as _recorder
    except ImportError:
        import recorder as _recorder  # type: ignore[no-redef]
    # on in every child that runs learner code; the answers are bytes before it is switched off
    recorder = _recorder.Policy(path, exempt=task["exempt"], judged=task["policy"])

    message: dict = {"status": "ok", "results": [], "violations": []}
    if unfiltered:  # allowed by the instructor (Limits.seccomp_optional): said in every report
        message["unfiltered"] = unfiltered
    launches = _interpreter().count_launches(path)
    harness.capture()  # before any learner code
    try:
        recorder.__enter__()  # before the import: module-level code is watched too
        code, error = _LOADED
        module = types.ModuleType("learner_submission")  # fresh for every child
        module.__file__ = path
        try:
            if error is not None:
                raise error
            exec(code, module.__dict__)  # the code object 'load' compiled from the checked bytes
        except BaseException as exc:  # SyntaxError, ImportError, SystemExit at import...
            message = {"status": "import_error", "message": _cap("".join(
                traceback.format_exception_only(type(exc), exc)).strip()),
                "traceback": _cap(_trim_traceback(exc, path)), "results": [], "violations": []}
            raise _Done() from None
        stores = task.get("traced", False) and _interpreter().recording()  # lab 05's exercises with kernels
        for call in task["calls"]:
            calls.call_one(module, call, path, message, stores, recorder)
    except _Done:
        pass
    finally:
        try:
            recorder.__exit__(None, None, None)
            message["violations"] = recorder.violations()
        except Exception:  # the learner popped the recorders off the stack
            message["violations"] = ["the grader's call recorder (it was removed or tampered with)"]
        if launches:
            message["launches"] = dict(launches)
    _send(result_fd, message)


def _send(result_fd: int, message: dict) -> None:
    """Write the child's one message and end the child (no atexit handler the learner registered runs)."""
    try:
        payload = protocol.encode_message(message)  # safetensors + JSON: the grader parses nothing else
    except Exception as exc:
        payload = protocol.encode_message({"status": "protocol", "message": f"could not send the result back: "
                                                                            f"{exc}"[:500],
                                           "results": [], "violations": []})
    sys.stdout.flush()
    data = memoryview(payload)
    while data:
        data = data[os.write(result_fd, data):]
    os.close(result_fd)
    os._exit(0)


# --------------------------------------------------------------------------- #
# The zygote: a server process that has imported torch and forks one child per task
# --------------------------------------------------------------------------- #


def _kill_leftovers(child: int, sandboxed: bool) -> None:
    """Everything the child started dies. In the sandbox's pid namespace ``kill(-1)``
    reaches every process but this server and the namespace's init; in a sandbox of its own
    uid (Gradescope without bwrap) every process of that uid but this one; else only the
    child's session (a daemon that made its own session survives: no sandbox)."""
    if sandboxed:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    else:
        try:
            os.killpg(child, signal.SIGKILL)
        except OSError:
            pass


def _reap(sandboxed: bool) -> None:
    """Wait for every process left below this server (the leftovers just killed, orphans that were
    reparented here), so their CPU time is in this server's ``RUSAGE_CHILDREN``. In the sandbox every
    one of them was killed, so this ends; outside one (mode ``none``: a daemon in a session of its
    own may live on) it waits at most a second."""
    until = time.monotonic() + (30.0 if sandboxed else 1.0)
    while time.monotonic() < until:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            time.sleep(0.005)  # killed, not reaped yet


def _drain(fds: dict[int, bytearray], caps: dict[int, int], until: float) -> None:
    """Read what is left in the pipes, up to their caps, until EOF or ``until``."""
    for fd in list(fds):
        os.set_blocking(fd, False)
    while fds and time.monotonic() < until:
        ready, _, _ = select.select(list(fds), [], [], max(0.0, until - time.monotonic()))
        if not ready:
            break
        for fd in ready:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk or len(fds[fd]) >= caps[fd]:
                fds.pop(fd)
                continue
            fds[fd] += chunk[: caps[fd] - len(fds[fd])]


def _run_task(task: dict, path: str, private_fds: tuple[int, ...], sandboxed: bool, root: str,
              status_fd: Optional[int] = None) -> tuple[dict, bytes, bytes]:
    """Fork a child for one task and watch it: its exit, its time, its pipes' sizes."""
    limits = task["limits"]
    vm_kb = _vm_kb(status_fd) if status_fd is not None else None  # the child's at fork: /proc is hidden
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # every descendant ends up reaped here: see _reap
    timeout = float(limits.timeout_s)
    backstop = timeout * limits.wall_factor  # wall clock: only for what burns no CPU (sleeping, blocked)
    workdir = tempfile.mkdtemp(prefix="task-", dir=root)
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.close(r)
            os.close(out_r)
            for fd in private_fds:
                os.close(fd)
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            _child_main(w, path, task, sandboxed, workdir, vm_kb)
        finally:
            os._exit(70)
    os.close(w)
    os.close(out_w)
    pidfd = os.pidfd_open(pid)
    bufs = {r: bytearray(), out_r: bytearray()}
    caps = {r: MAX_RESULT_BYTES, out_r: limits.output_kb * 1024}
    open_fds = dict(bufs)
    status, exited = "ok", False
    while True:
        left = t0 + backstop - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        watch = list(open_fds) + ([] if exited else [pidfd])
        if not watch:
            break
        ready, _, _ = select.select(watch, [], [], left)
        for fd in ready:
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.pop(fd)
                continue
            bufs[fd] += chunk
            if len(bufs[fd]) > caps[fd]:
                status = "too_big" if fd == r else "output_flood"
        if status != "ok" or exited:
            break
    if not exited:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _kill_leftovers(pid, sandboxed)  # a grandchild holding the pipes, a daemon: gone now
    if status == "ok":
        _drain({fd: bufs[fd] for fd in open_fds}, caps, time.monotonic() + 1.0)
    for fd in (r, out_r, pidfd):
        os.close(fd)
    _, wstatus, _ = os.wait4(pid, 0)
    code = os.WEXITSTATUS(wstatus) if os.WIFEXITED(wstatus) else -os.WTERMSIG(wstatus)
    _reap(sandboxed)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the CPU of the child and of every process it started, orphans included (this server is their
    # reaper: pid 1 of the sandbox, or a child subreaper), not the child's own rusage alone
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    shutil.rmtree(workdir, ignore_errors=True)
    payload = bytes(bufs[r]) if status == "ok" else b""
    output = bytes(bufs[out_r][: caps[out_r]])
    return {"status": status, "code": code, "elapsed": time.monotonic() - t0, "cpu": cpu_s}, payload, output


# Every floating-point argument sits at the start of a larger buffer whose tail is NaN: a kernel
# that reads past a tensor's end (lab 05's loads without mask=) reads NaN, the same on every run,
# instead of whatever the allocator left there. 64 KiB of float32: past any tile's overreach.
GUARD_ELEMENTS = 16384


def _guarded(value):
    if isinstance(value, tuple):
        return tuple(_guarded(v) for v in value)
    if isinstance(value, list):
        return [_guarded(v) for v in value]
    if isinstance(value, dict):
        return {k: _guarded(v) for k, v in value.items()}
    import torch

    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0:
        buffer = torch.full((value.numel() + GUARD_ELEMENTS,), float("nan"), dtype=value.dtype)
        buffer[:value.numel()] = value.reshape(-1)
        return buffer[:value.numel()].view(value.shape)
    return value


def _task(request: dict) -> dict:
    """A ``run`` request as the child uses it: the calls (tensors guarded), limits as attributes."""
    calls = [{"function": c["function"], "args": _guarded(tuple(c["args"])), "kwargs": _guarded(c["kwargs"]),
              "harness": str(c.get("harness", "")), "forbid": [str(n) for n in c.get("forbid", [])][:8],
              "plant": _guarded(tuple(c.get("plant", ())))[:3], "watch_nan": bool(c.get("watch_nan", False))}
             for c in request["calls"]]
    route = str(request.get("seccomp", ""))
    try:
        programs = seccomp.compiled(route) if route in seccomp.ROUTES or not route else None
    except OSError:  # the child tries again itself, and runs no learner code where that fails too
        programs = None
    return {"calls": calls, "policy": bool(request["policy"]), "exempt": tuple(request.get("exempt", ())),
            "traced": bool(request.get("traced", False)),
            "limits": SimpleNamespace(**request["limits"]),
            "seccomp": route, "programs": programs}


def prepare(interpreter: bool = True) -> None:
    """What every child would otherwise import or warm up itself: done once, in the zygote.
    ``interpreter``: Triton's interpreter too (the class template, which serves every lab);
    a server of its own prepares it at ``load``, for a file that uses Triton (:func:`_prepare_for`)."""
    import torch

    try:  # the labs' files import it
        import jaxtyping  # noqa: F401
    except ImportError:
        pass
    if interpreter:
        _prepare_interpreter()
    try:
        from . import recorder  # noqa: F401
    except ImportError:
        import recorder  # type: ignore[no-redef] # noqa: F401
    _interpreter()  # every child asks it whether kernels are counted (it imports only os and sys)
    _timer_calls()
    torch.set_num_threads(1)
    # the lazy parts of torch's CPU start (the GEMM dispatch, the first kernels), once, not in each child
    a = torch.randn(64, 64)
    (a @ a).exp().sum().item()


def _prepare_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":  # lab 05's file imports it (0.2 s, 74 MB once, not per child)
        _interpreter().prepare_interpreter()


def _prepare_for(source: bytes) -> None:
    """At ``load``, before any of the file runs: Triton's interpreter for a file that names Triton.
    Importing it costs the server 0.2-0.3 s and every child's fork 74 MB more, which labs 01-04 never
    use (their import allow-lists refuse triton); a file that reached Triton without its name in
    the text (no static rule lets it) would run unguarded kernels whose launches are not counted, so
    an exercise that requires a kernel fails (:func:`.interpreter.count_launches`)."""
    if b"triton" in source:
        _prepare_interpreter()


def serve(request_fd: int = 0, reply_fd: int = 1, sandboxed: bool = False, status_fd: Optional[int] = None) -> None:
    """The zygote's loop. Requests (:func:`protocol.decode_request`, from the grader) are
    ``load`` (the submission's source) and ``run`` (fork a child for a task); each ``run`` is
    answered with three frames: a JSON header, the child's message bytes, its captured output.
    ``status_fd``: this server's /proc status, opened before /proc was hidden (the class
    template, :mod:`.template`); the children close it before the learner's code runs."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        # not dumpable: a learner's process of the same uid cannot ptrace this server, read or write
        # its memory through /proc/<pid>/mem, or take its fds
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
        # every orphan of a task is reparented here (pid 1 of bwrap's namespace is this server
        # anyway: --as-pid-1), so its CPU is counted when it is reaped (_reap)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    # as pid 1 a signal from inside the namespace reaches this server only where it has a handler:
    # Python's SIGINT handler would let a learner raise KeyboardInterrupt here
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        prepare(interpreter=False)
    except BaseException as exc:  # noqa: BLE001 (the grader reads this instead of "ready")
        frames.write_frame(reply_fd, f"failed {type(exc).__name__}: {exc}".encode()[:500])
        raise
    # the protocol gets private fds; 0/1/2 point to /dev/null so nothing stray lands on it
    request_fd, reply_fd = os.dup(request_fd), os.dup(reply_fd)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    private = (request_fd, reply_fd) + ((status_fd,) if status_fd is not None else ())
    # close every descriptor it was started with but its own: a learner finds none to use
    for fd in range(3, 1024):
        if fd not in private:
            try:
                os.close(fd)
            except OSError:
                pass
    root = tempfile.mkdtemp(prefix="attnlab-sandbox-", dir="/tmp" if sandboxed else None)
    path = os.path.join(root, "submission", SUBMISSION_NAME)  # renamed by each 'load' to the learner's file name
    frames.write_frame(reply_fd, b"ready " + root.encode())
    try:
        while True:
            try:
                req = protocol.decode_request(frames.read_frame(request_fd, protocol.MAX_REQUEST_BYTES))
            except EOFError:
                return
            if req["op"] == "load":
                path = os.path.join(root, "submission", submission_name(req["name"]))
                source = req["source"].numpy().tobytes()
                _prepare_for(source)
                _load(source, path)
                frames.write_frame(reply_fd, b"loaded")
                continue
            header, payload, output = _run_task(_task(req), path, private, sandboxed, root, status_fd)
            frames.write_frame(reply_fd, json.dumps(header).encode())
            frames.write_frame(reply_fd, payload)
            frames.write_frame(reply_fd, output)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":  # python -I -B server.py [--sandboxed]
    serve(sandboxed="--sandboxed" in sys.argv[1:])
