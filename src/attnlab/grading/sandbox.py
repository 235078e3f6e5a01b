"""Run learner code in child processes with limits; bring back only validated data.

Learner code is hostile until proven otherwise. Three layers keep it away from the grader:

1. **An OS sandbox per submission** (:mod:`.launch`): a server process (the
   "zygote") runs inside ``bwrap`` with no network, its own pid namespace, a read-only
   view of the system and the Python environment and nothing else of the host, a
   private size-capped ``/tmp``, and a cgroup capping the whole submission's memory
   and processes where one can be made. It imports torch once and forks one child per
   exercise, so a child starts in milliseconds.
2. **Limits per child**, set by the child before learner code runs: ``RLIMIT_AS``
   (memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (files in the private ``/tmp``),
   ``RLIMIT_NPROC`` (in the sandbox), no core dumps, stdin from ``/dev/null``,
   stdout/stderr into a pipe the zygote reads with a cap (a print flood is stopped),
   a fresh empty working folder. The zygote enforces the wall-clock limit on the
   child's *exit*, not on the pipes closing, and afterwards kills every other process
   of the sandbox (``kill(-1)`` in its pid namespace), so a grandchild that keeps a
   pipe open or a daemon that ignores SIGTERM is gone before the next exercise.
3. **A parent that trusts nothing.** Every read from the zygote has a deadline; on
   a deadline or a broken frame the parent kills the whole sandbox (and starts a new
   one for the next exercise). Results come back over a pipe the parent created as one
   safetensors file with the message as bounded JSON in its metadata
   (:mod:`.protocol`: no pickle, no zip; every size is checked against the bytes
   received before anything is allocated), and are then validated field by field
   (:func:`validate_message`): known keys and types only, capped in elements and bytes. Learner text is stripped of
   control characters and lone surrogates and capped (:func:`clean_text`).

Without ``bwrap`` layer 1 is missing (``Sandbox.sandboxed`` is False): the grader
says so, and refuses other people's code unless told otherwise (:mod:`.grader`).
"""

from __future__ import annotations

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from attnlab.grading import launch, seccomp
from attnlab.grading.frames import Deadline, read_frame, write_frame
from attnlab.grading.protocol import BadPayload, bounded_json, decode_message, encode_message

__all__ = ["Limits", "Call", "Outcome", "Sandbox", "Unsupported", "validate_message", "clean_text", "self_test",
           "MAX_RESULT_BYTES", "MAX_ELEMENTS"]

MAX_RESULT_BYTES = 64 * 1024 * 1024  # one child's message
MAX_ELEMENTS = 1 << 23  # tensor elements in one message, all tensors together
MAX_TEXT = 4000  # characters of learner text kept per message field
MAX_SOURCE_BYTES = 1 << 20  # a submission file
START_TIMEOUT_S = 90.0  # the server imports torch; on a loaded 2-core machine that took up to ~10 s
GRACE_S = 3.0  # parent's deadline beyond the zygote's own
SUBMISSION_NAME = "submission.py"  # the copy's name inside the sandbox when the learner's own is not plain
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,60}\.py$")


def submission_name(path: os.PathLike) -> str:
    """The name the submission's copy gets inside the sandbox: the learner's own file name
    (so tracebacks say masks.py in lab 02), or :data:`SUBMISSION_NAME` when it is not plain."""
    name = os.path.basename(os.fspath(path))
    return name if _PLAIN_NAME.match(name) else SUBMISSION_NAME


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0  # CPU time of the task's process, per task (a budget that load does not shrink)
    # the wall-clock backstop, this many times timeout_s: it stops what uses no CPU (a sleep, a
    # blocked read) and leaves a task its whole CPU budget up to 10x oversubscription
    wall_factor: float = 10.0
    memory_mb: int = 1024  # per process, on top of what the child has mapped at start
    output_kb: int = 256  # stdout + stderr
    show_output_chars: int = 1500  # how much of the output a report quotes
    submission_memory_mb: int = 2048  # all processes of the submission together (cgroup, where available)
    max_procs: int = 64  # processes of the submission together (cgroup or RLIMIT_NPROC)
    file_mb: int = 16  # largest file a child may write (in its private /tmp)


@dataclass(frozen=True)
class Call:
    """``module.function(*args, **kwargs)`` in the child; ``doctor=True`` also runs the
    doctor's self-attention probes on that function."""

    function: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    doctor: bool = False


@dataclass
class Outcome:
    """What one task did. ``status``: ok | error | import_error | exit | crash | timeout | memory |
    output_flood | protocol."""

    status: str
    results: list[dict] = field(default_factory=list)  # one per call: {"value"} or {"error", "traceback"}
    message: str = ""
    traceback: str = ""
    violations: list[str] = field(default_factory=list)
    output: str = ""
    elapsed_s: float = 0.0
    probes: Optional[list[dict]] = None
    cpu_s: float = 0.0  # CPU time of the task's process (what the time budget counts)
    environment: str = ""  # set when the sandbox itself could not start here: the grader's problem, not the learner's


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def clean_text(text: Any, limit: int = MAX_TEXT) -> str:
    """Learner text made safe to print and to store: no control characters (escape
    sequences, carriage returns, bidi overrides), no lone surrogates, at most ``limit``
    characters (the middle is cut)."""
    if not isinstance(text, str):
        text = str(text)
    text = _SURROGATE.sub("\ufffd", text)
    text = _CONTROL.sub(lambda m: "" if m.group() == "\r" else "\ufffd", text.replace("\r\n", "\n"))
    if len(text) > limit:
        text = text[: limit // 2] + "\n[... trimmed ...]\n" + text[-limit // 2:]
    return text


# --------------------------------------------------------------------------- #
# Child side (runs in the forked process)
# --------------------------------------------------------------------------- #


def _trim_traceback(exc: BaseException, learner_file: str, limit: int = 4) -> str:
    """The last few frames, learner frames only when there are any, no grader internals."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if f.filename == learner_file]
    shown = (mine or frames)[-limit:]
    lines = [f'  File "{Path(f.filename).name}", line {f.lineno}, in {f.name}\n    {f.line}' for f in shown]
    head = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return "\n".join(["Traceback (most recent call last):", *lines, head]) if lines else head


def _portable(value: Any, depth: int = 0) -> Any:
    """Learner return values -> what :func:`.protocol.encode_message` sends (JSON and dense tensors)."""
    if depth > 5:
        return {"__unsupported__": "nested too deeply"}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone().contiguous()
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    if isinstance(value, str):
        return value[:MAX_TEXT]
    if isinstance(value, (tuple, list)):
        return {"__seq__": [_portable(v, depth + 1) for v in value[:64]], "__tuple__": isinstance(value, tuple)}
    if isinstance(value, dict):
        return {"__dict__": {str(k)[:200]: _portable(v, depth + 1) for k, v in list(value.items())[:64]}}
    return {"__unsupported__": type(value).__name__[:100]}


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


def _set_limits(limits: Limits, sandboxed: bool, vm_kb: Optional[int] = None) -> None:
    vm_kb = _vm_kb() if vm_kb is None else vm_kb
    cap = vm_kb * 1024 + limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    file_cap = limits.file_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_cap, file_cap))
    # The budget is CPU time, so a loaded machine does not shrink it: SIGPROF after exactly
    # timeout_s of this process's CPU (all its threads), and RLIMIT_CPU a second later as the
    # fence a learner cannot lift (SIGPROF can be ignored; the hard limit is SIGKILL).
    signal.setitimer(signal.ITIMER_PROF, limits.timeout_s)
    cpu = math.ceil(limits.timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if sandboxed:  # outside the sandbox the count would include all of the user's processes
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))


class _RefuseAttnlab:
    """A meta-path finder: the learner's process cannot import attnlab (its reference
    would answer every exercise). The static check refuses the import too."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "attnlab" or name.startswith("attnlab."):
            raise ImportError("attnlab cannot be imported by a lab submission")
        return None


def _child_main(result_fd: int, path: str, calls: list[Call], policy: bool, limits: Limits, workdir: str,
                sandboxed: bool, vm_kb: Optional[int] = None) -> None:
    """Entry point of the forked child. Sends exactly one message (bytes), then exits."""
    import importlib.util

    from attnlab import doctor
    from attnlab.grading.policy import Policy

    os.chdir(workdir)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True, errors="replace")
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True, errors="replace")
    torch.set_num_threads(1)
    # Python ignores SIGXFSZ (writes past RLIMIT_FSIZE would just fail): restore the default,
    # so writing a huge file ends the child and is reported as such.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    _set_limits(limits, sandboxed, vm_kb)
    try:  # before any learner code: no ptrace, pidfd_getfd, process_vm_*, namespaces or mounts
        seccomp.install()
    except OSError:  # a kernel without seccomp: the OS sandbox and the limits still hold
        pass
    wants_probes = any(c.doctor for c in calls)
    probes = doctor.build_probes(doctor.SELF_ATTENTION_CAPABILITIES) if wants_probes else None
    run_probes, adapt = doctor.run_probes, doctor.adapt_self_attention
    # attnlab's own modules leave the learner's view (they hold the reference)
    for name in [n for n in sys.modules if n == "attnlab" or n.startswith("attnlab.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _RefuseAttnlab)

    message: dict = {"status": "ok", "results": [], "violations": []}
    recorder = Policy() if policy else None
    try:
        if recorder is not None:
            recorder.__enter__()  # before the import: module-level code is watched too
        spec = importlib.util.spec_from_file_location("learner_submission", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:  # SyntaxError, ImportError, SystemExit at import...
            message = {"status": "import_error", "message": "".join(
                traceback.format_exception_only(type(exc), exc)).strip(),
                "traceback": _trim_traceback(exc, path), "results": [], "violations": []}
            raise _Done() from None
        for call in calls:
            fn = getattr(module, call.function, None)
            if fn is None:
                message["results"].append({"error": f"{os.path.basename(path)} has no {call.function!r}",
                                           "traceback": ""})
                continue
            if not callable(fn):  # a constant such as EXERCISE_2_ANSWER
                message["results"].append({"value": _portable(fn)})
                continue
            try:
                value = fn(*call.args, **call.kwargs)
                message["results"].append({"value": _portable(value)})
            except SystemExit as exc:
                message = {"status": "exit", "message": f"called sys.exit({exc.code!r})"[:200], "results": [],
                           "violations": []}
                raise _Done() from None
            except MemoryError as exc:
                message["results"].append({"error": f"MemoryError: {exc}", "traceback": _trim_traceback(exc, path),
                                           "memory": True})
            except Exception as exc:
                text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                message["results"].append({"error": text, "traceback": _trim_traceback(exc, path),
                                           "memory": "can't allocate memory" in text or "alloc" in text.lower()
                                           and "memory" in text.lower()})
            if call.doctor:
                results = run_probes(adapt(fn), probes)
                message["probes"] = [{"output": r.output, "error": r.error, "varied": r.varied} for r in results]
    except _Done:
        pass
    finally:
        if recorder is not None:
            try:
                recorder.__exit__(None, None, None)
                message["violations"] = recorder.violations()
            except Exception:  # the learner popped the grader's recorders off the stack
                message["violations"] = ["the grader's call recorder (it was removed or tampered with)"]
    try:
        payload = encode_message(message)  # safetensors + JSON: the grader parses nothing else
    except Exception as exc:
        payload = encode_message({"status": "protocol", "message": f"could not send the result back: {exc}"[:500],
                                  "results": [], "violations": []})
    sys.stdout.flush()
    data = memoryview(payload)
    while data:
        data = data[os.write(result_fd, data):]
    os.close(result_fd)
    os._exit(0)  # skip atexit handlers the learner may have registered


class _Done(Exception):
    pass


# --------------------------------------------------------------------------- #
# The zygote: a server process that has imported torch and forks one child per task
# --------------------------------------------------------------------------- #


def _kill_leftovers(child: int, sandboxed: bool) -> None:
    """Everything the child started dies. In the sandbox's pid namespace ``kill(-1)``
    reaches every process but this server and the namespace's init; outside, only the
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


def _run_task(req: dict, channel_fds: tuple[int, ...], sandboxed: bool, root: str,
              status_fd: Optional[int] = None) -> tuple[dict, bytes, bytes]:
    """Fork a child for one task and watch it: its exit, its time, its pipes' sizes."""
    limits: Limits = req["limits"]
    vm_kb = _vm_kb(status_fd) if status_fd is not None else None  # the child's at fork: /proc is hidden
    timeout = float(req["timeout_s"])
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
            for fd in channel_fds:
                os.close(fd)
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            _child_main(w, req["path"], req["calls"], req["policy"], limits, workdir, sandboxed, vm_kb)
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
    _, wstatus, usage = os.wait4(pid, 0)
    code = os.WEXITSTATUS(wstatus) if os.WIFEXITED(wstatus) else -os.WTERMSIG(wstatus)
    cpu_s = usage.ru_utime + usage.ru_stime
    shutil.rmtree(workdir, ignore_errors=True)
    payload = bytes(bufs[r]) if status == "ok" else b""
    output = bytes(bufs[out_r][: caps[out_r]])
    return {"status": status, "code": code, "elapsed": time.monotonic() - t0, "cpu": cpu_s}, payload, output


def serve(request_fd: int = 0, reply_fd: int = 1, sandboxed: bool = False, status_fd: Optional[int] = None) -> None:
    """The zygote's loop. Requests (pickled, from the grader: trusted) are ``load`` (the
    submission's source) and ``run`` (fork a child for a task); each ``run`` is answered
    with three frames: a JSON header, the child's message bytes, its captured output.
    ``status_fd``: this server's /proc status, opened before /proc was hidden (the class
    template, :mod:`.template`); the children close it before the learner's code runs."""
    import pickle

    import attnlab.doctor  # noqa: F401

    try:  # not dumpable: a learner's process of the same uid cannot ptrace this server or take its fds
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass
    import attnlab.grading.policy  # noqa: F401

    try:  # the lab imports it; importing it once here saves every child the time
        import jaxtyping  # noqa: F401
    except ImportError:
        pass

    # the protocol gets private fds; 0/1/2 point to /dev/null so nothing stray lands on it
    request_fd, reply_fd = os.dup(request_fd), os.dup(reply_fd)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    root = tempfile.mkdtemp(prefix="attnlab-sandbox-", dir="/tmp" if sandboxed else None)
    path = os.path.join(root, "submission", SUBMISSION_NAME)  # renamed by each 'load' to the learner's file name
    write_frame(reply_fd, b"ready " + root.encode())
    try:
        while True:
            try:
                req = pickle.loads(read_frame(request_fd, 1 << 24))  # from the grader itself: trusted
            except EOFError:
                return
            if req["op"] == "load":
                path = os.path.join(root, "submission", submission_name(req.get("name", SUBMISSION_NAME)))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(req["source"])
                write_frame(reply_fd, b"loaded")
                continue
            private = (request_fd, reply_fd) + ((status_fd,) if status_fd is not None else ())
            header, payload, output = _run_task({**req, "path": path}, private, sandboxed, root, status_fd)
            write_frame(reply_fd, json.dumps(header).encode())
            write_frame(reply_fd, payload)
            write_frame(reply_fd, output)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- #
# Parent side: validation of what comes back
# --------------------------------------------------------------------------- #

_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64}
_STATUSES = {"ok", "import_error", "exit", "protocol"}


class BadMessage(ValueError):
    """The child's message is not what a child of this grader sends."""


def _check_tensor(t: torch.Tensor, budget: list[int]) -> None:
    if t.layout != torch.strided or t.is_sparse or t.device.type != "cpu":
        raise BadMessage("a tensor that is not a dense CPU tensor")
    if t.dtype not in _DTYPES:
        raise BadMessage(f"a tensor of dtype {t.dtype}")
    if t.dim() > 8:
        raise BadMessage(f"a tensor with {t.dim()} dims")
    # numel of the storage, not of the view: a stride-0 view can claim any size
    need = t.numel() * t.element_size()
    if not t.is_contiguous() or t.storage_offset() != 0 or t.untyped_storage().nbytes() != need:
        raise BadMessage(f"a tensor of shape {list(t.shape)} whose storage does not back it "
                         f"({t.untyped_storage().nbytes()} bytes for {need}); the grader sends only dense copies")
    budget[0] -= t.numel()
    if budget[0] < 0:
        raise BadMessage(f"more than {MAX_ELEMENTS} tensor elements")


def _check_value(v: Any, budget: list[int], depth: int = 0) -> None:
    if depth > 6:
        raise BadMessage("a value nested too deeply")
    if v is None or isinstance(v, (bool, int, float)):
        return
    if isinstance(v, str):
        if len(v) > MAX_TEXT * 2:
            raise BadMessage("a string that is too long")
        return
    if isinstance(v, torch.Tensor):
        return _check_tensor(v, budget)
    if isinstance(v, dict) and set(v) == {"__seq__", "__tuple__"} and isinstance(v["__seq__"], list) \
            and isinstance(v["__tuple__"], bool) and len(v["__seq__"]) <= 64:
        for item in v["__seq__"]:
            _check_value(item, budget, depth + 1)
        return
    if isinstance(v, dict) and set(v) == {"__dict__"} and isinstance(v["__dict__"], dict) and len(v["__dict__"]) <= 64:
        for k, item in v["__dict__"].items():
            if not isinstance(k, str) or len(k) > 200:
                raise BadMessage("a dict key that is not a short string")
            _check_value(item, budget, depth + 1)
        return
    if isinstance(v, dict) and set(v) == {"__unsupported__"} and isinstance(v["__unsupported__"], str):
        return
    raise BadMessage(f"a value of type {type(v).__name__} in an unknown shape")


def _check_str(v: Any, what: str) -> None:
    if not isinstance(v, str) or len(v) > MAX_TEXT * 4:
        raise BadMessage(f"{what} is not a string of reasonable length")


def validate_message(msg: Any, n_calls: int, n_probes: Optional[int]) -> None:
    """Raise :class:`BadMessage` unless ``msg`` is exactly what :func:`_child_main` sends
    for ``n_calls`` calls (and ``n_probes`` doctor probes, when the task ran them)."""
    if not isinstance(msg, dict) or not set(msg) <= {"status", "results", "violations", "message", "traceback",
                                                      "probes"}:
        raise BadMessage("the message is not a dict of the known fields")
    if msg.get("status") not in _STATUSES:
        raise BadMessage(f"unknown status {str(msg.get('status'))[:40]!r}")
    for key in ("message", "traceback"):
        if key in msg:
            _check_str(msg[key], key)
    violations = msg.get("violations", [])
    if not isinstance(violations, list) or len(violations) > 64:
        raise BadMessage("violations is not a short list")
    for v in violations:
        _check_str(v, "a violation")
    results = msg.get("results", [])
    if not isinstance(results, list) or len(results) > n_calls or (msg["status"] == "ok" and len(results) != n_calls):
        raise BadMessage(f"expected {n_calls} results")
    budget = [MAX_ELEMENTS]
    for r in results:
        if not isinstance(r, dict):
            raise BadMessage("a result that is not a dict")
        if set(r) == {"value"}:
            _check_value(r["value"], budget)
        elif "error" in r and set(r) <= {"error", "traceback", "memory"}:
            _check_str(r["error"], "an error")
            _check_str(r.get("traceback", ""), "a traceback")
            if not isinstance(r.get("memory", False), bool):
                raise BadMessage("a memory flag that is not a bool")
        else:
            raise BadMessage("a result with unknown fields")
    if "probes" in msg:
        probes = msg["probes"]
        if n_probes is None or not isinstance(probes, list) or len(probes) != n_probes:
            raise BadMessage("unexpected doctor probes")
        for p in probes:
            if not isinstance(p, dict) or set(p) != {"output", "error", "varied"} or not isinstance(p["varied"], bool):
                raise BadMessage("a probe result of an unknown shape")
            if p["output"] is not None:
                if not isinstance(p["output"], torch.Tensor):
                    raise BadMessage("a probe output that is not a tensor")
                _check_tensor(p["output"], budget)
            if p["error"] is not None:
                _check_str(p["error"], "a probe error")


# --------------------------------------------------------------------------- #
# Parent side: the sandbox of one submission
# --------------------------------------------------------------------------- #


class Sandbox:
    """Runs tasks on one submission in children of its own sandbox server.

    ``mode``: 'auto' (bwrap where installed), 'bwrap' (required: raises
    :class:`~attnlab.grading.launch.SandboxUnavailable` without it) or 'none'. Use it as
    a context manager, or call :meth:`close`: the server and everything the submission
    started die then.
    """

    def __init__(self, path: os.PathLike, limits: Limits = Limits(), mode: str = "auto") -> None:
        self.path = Path(path)
        self.limits = limits
        self.mode = mode
        with open(self.path, "rb") as f:
            self.source = f.read(MAX_SOURCE_BYTES + 1)
        if len(self.source) > MAX_SOURCE_BYTES:
            raise ValueError(f"{self.path} is larger than {MAX_SOURCE_BYTES // 1024} KB")
        self._server: Optional[launch.Server] = None
        self.restarts = 0  # servers started after the first (the learner stopped or killed one)
        self._starts = 0
        self.sandboxed = launch.resolve_mode(mode) is not None
        self.memory_fence = ""
        self.launcher = ""  # 'template' (forked from the class template), 'bwrap' or 'none'

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def processes(self) -> Optional[list[int]]:
        """Host pids of every process of this submission (the server included), from its
        cgroup; None where no cgroup could be made."""
        if self._server is None or self._server.cgroup is None:
            return None
        return self._server.cgroup.procs()

    def _server_ready(self) -> launch.Server:
        if self._server is not None and self._server.alive():
            return self._server
        if self._server is not None:
            self._server.stop()
        if self._starts:
            self.restarts += 1
        self._starts += 1
        server = launch.take(self.mode, self.limits.submission_memory_mb, self.limits.max_procs)
        self._server = server
        deadline = time.monotonic() + START_TIMEOUT_S
        hello = read_frame(server.reply_fd, 4096, deadline)
        if not hello.startswith(b"ready"):
            raise EOFError("the sandbox server did not start")
        write_frame(server.request_fd, _pickle({"op": "load", "source": self.source,
                                                "name": submission_name(self.path)}))
        if read_frame(server.reply_fd, 64, deadline) != b"loaded":
            raise EOFError("the sandbox server did not take the submission")
        self.sandboxed = server.sandboxed
        self.memory_fence = server.memory_fence
        self.launcher = ("template" if isinstance(server, launch.SpawnedServer)
                         else "bwrap" if server.sandboxed else "none")
        return server

    def run(self, calls: list[Call], *, policy: bool = True, timeout_s: Optional[float] = None,
            limits: Optional[Limits] = None) -> Outcome:
        """Run ``calls`` on the learner's module in a fresh child; never raises for the learner's sake.
        ``limits``: this task's own (an exercise with a tighter memory cap); default the sandbox's."""
        limits = self.limits if limits is None else limits
        timeout = limits.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        try:
            server = self._server_ready()
        except (EOFError, OSError, ValueError, Deadline) as exc:
            first_start = self._starts <= 1  # no learner code has run yet: this machine cannot make the sandbox
            self.close()
            what = "did not start in time" if isinstance(exc, Deadline) else f"failed to start: {exc}"
            return Outcome("protocol", message=f"the sandbox {what}", elapsed_s=time.perf_counter() - t0,
                           environment=f"the sandbox {what}" if first_start else "")
        try:
            req = {"op": "run", "calls": calls, "policy": policy, "limits": limits, "timeout_s": timeout}
            write_frame(server.request_fd, _pickle(req))
            deadline = time.monotonic() + timeout * limits.wall_factor + GRACE_S
            fd = server.reply_fd
            header_bytes = read_frame(fd, 4096, deadline)
            payload = read_frame(fd, MAX_RESULT_BYTES, deadline)
            raw_output = read_frame(fd, self.limits.output_kb * 1024, deadline)
        except Deadline:
            self.close()  # a stopped or stuck server: the whole sandbox goes, a new one serves what follows
            return Outcome("timeout", message=f"did not finish within {timeout * limits.wall_factor:g} s of wall-clock "
                                              "time, and the sandbox stopped "
                                              "answering (was the grader's server stopped or killed?)",
                           elapsed_s=time.perf_counter() - t0)
        except (EOFError, OSError, ValueError) as exc:
            self.close()
            return Outcome("protocol", message=f"the sandbox server stopped: {clean_text(exc, 300)} "
                                               "(did your code kill it?)", elapsed_s=time.perf_counter() - t0)
        elapsed = time.perf_counter() - t0
        output = self._show(raw_output)
        try:  # the server is in the sandbox: its header is as untrusted as the child's bytes
            header = bounded_json(header_bytes, max_bytes=4096, max_depth=1, max_nodes=16)
        except BadPayload:
            header = None
        if not isinstance(header, dict) or header.get("status") not in {"ok", "timeout", "too_big", "output_flood"} \
                or not isinstance(header.get("code"), int) or isinstance(header.get("code"), bool):
            self.close()
            return Outcome("protocol", message="the sandbox server sent a malformed header", elapsed_s=elapsed)
        status = header["status"]
        cpu_s = header.get("cpu") if isinstance(header.get("cpu"), float) and header["cpu"] >= 0 else 0.0
        if status == "timeout":  # the wall-clock backstop: it waited without using its CPU budget
            return Outcome("timeout", message=f"did not finish within {timeout * limits.wall_factor:g} s of "
                                              f"wall-clock time, using {cpu_s:.1f} s of CPU (waiting on something "
                                              "that never comes? a sleep?)", output=output, elapsed_s=elapsed,
                           cpu_s=cpu_s)
        if status == "too_big":
            return Outcome("protocol", message=f"returned more than {MAX_RESULT_BYTES // 2**20} MB of data",
                           output=output, elapsed_s=elapsed)
        if status == "output_flood":
            return Outcome("output_flood", message=f"printed more than {self.limits.output_kb} KB; "
                                                   "remove the print() calls in loops", output=output,
                           elapsed_s=elapsed)
        if payload and header["code"] == 0:
            n_probes = None
            if any(c.doctor for c in calls):
                from attnlab import doctor

                n_probes = len(doctor.build_probes(doctor.SELF_ATTENTION_CAPABILITIES))
            outcome = self._decode(payload, output, elapsed, len(calls), n_probes)
        else:
            outcome = self._failure(header["code"], output, elapsed, timeout, cpu_s)
        outcome.cpu_s = cpu_s
        return outcome

    def _show(self, data: bytes) -> str:
        text = data.decode("utf-8", errors="replace")
        return clean_text(text, self.limits.show_output_chars)

    def _decode(self, payload: bytes, output: str, elapsed: float, n_calls: int,
                n_probes: Optional[int]) -> Outcome:
        try:
            msg = decode_message(payload)  # bounded JSON + safetensors: no pickle, no zip
            validate_message(msg, n_calls, n_probes)
        except Exception as exc:
            return Outcome("protocol", message=f"the child's answer was refused: {clean_text(exc, 300)}",
                           output=output, elapsed_s=elapsed)
        results = []
        for r in msg.get("results", []):
            if "value" in r:
                results.append({"value": _restore(r["value"])})
            else:
                results.append({"error": clean_text(r["error"]), "traceback": clean_text(r.get("traceback", "")),
                                "memory": r.get("memory", False)})
        probes = msg.get("probes")
        if probes is not None:
            probes = [{**p, "error": None if p["error"] is None else clean_text(p["error"], 500)} for p in probes]
        return Outcome(msg["status"], results=results, message=clean_text(msg.get("message", "")),
                       traceback=clean_text(msg.get("traceback", "")),
                       violations=[clean_text(v, 200) for v in msg.get("violations", [])],
                       output=output, elapsed_s=elapsed, probes=probes)

    def _failure(self, exitcode: int, output: str, elapsed: float, timeout: float = 0.0,
                 cpu_s: float = 0.0) -> Outcome:
        if exitcode < 0:
            sig = -exitcode
            if sig in (signal.SIGPROF, signal.SIGXCPU) or (sig == signal.SIGKILL and timeout and cpu_s >= timeout):
                return Outcome("timeout", message=f"did not finish within {timeout:g} s of CPU time (an endless "
                                                  f"loop?)", output=output, elapsed_s=elapsed)
            if sig == signal.SIGXFSZ:
                return Outcome("crash", message=f"wrote a file larger than {self.limits.file_mb} MB",
                               output=output, elapsed_s=elapsed)
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            if sig == signal.SIGKILL:
                return Outcome("crash", message="was killed (SIGKILL): the submission's memory or process limit, "
                                                "or your code killed itself", output=output, elapsed_s=elapsed)
            return Outcome("crash", message=f"crashed with {name}", output=output, elapsed_s=elapsed)
        return Outcome("exit", message=f"the process exited (code {exitcode}) before returning a result: "
                                       "sys.exit/os._exit/exit() in your code?", output=output, elapsed_s=elapsed)


def _pickle(obj: Any) -> bytes:
    import pickle

    return pickle.dumps(obj)


def _restore(value: Any) -> Any:
    """Undo :func:`_portable`'s container encoding."""
    if isinstance(value, dict):
        if "__seq__" in value:
            items = [_restore(v) for v in value["__seq__"]]
            return tuple(items) if value.get("__tuple__") else items
        if "__dict__" in value:
            return {k: _restore(v) for k, v in value["__dict__"].items()}
        if "__unsupported__" in value:
            return Unsupported(clean_text(value["__unsupported__"], 100))
    if isinstance(value, str):
        return clean_text(value)
    return value


@dataclass(frozen=True)
class Unsupported:
    """A return value the child could not send (an object of this type name)."""

    type_name: str


def self_test(mode: str = "bwrap", limits: Limits = Limits()) -> tuple[bool, str]:
    """Start the exact sandbox the grader uses (``mode``: 'bwrap' or 'auto'), run one trivial
    task in it and check its answer: ``(True, how it is fenced)`` or ``(False, why not)``.
    This, not a simpler ``bwrap ... true``, is what decides whether grading here is sandboxed."""
    folder = tempfile.mkdtemp(prefix="attnlab-self-test-")
    try:
        path = Path(folder) / "self_test.py"
        path.write_text("def answer():\n    return 42\n")
        try:
            with Sandbox(path, limits, mode=mode) as box:
                outcome = box.run([Call("answer")], policy=False)
                fence, sandboxed = box.memory_fence, box.sandboxed
        except launch.SandboxUnavailable as exc:
            return False, str(exc)
        if outcome.status != "ok" or not outcome.results or outcome.results[0].get("value") != 42:
            return False, outcome.environment or outcome.message or f"the test task ended with {outcome.status}"
        if mode != "none" and not sandboxed:
            return False, "the task ran, but not in the OS sandbox"
        return True, f"the OS sandbox works here ({fence or 'no memory fence'})"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
