"""Run learner code in a child process with limits; bring back only tensors.

The grader never imports learner code itself. Each task runs in a fresh child,
forked from a server process (the "zygote", :func:`serve`) that has already
imported torch, so a child starts in milliseconds. The grader keeps the time
limit: past it, the child is killed. In the child:

* ``RLIMIT_AS`` caps memory (what the child already maps plus ``memory_mb``);
* stdout and stderr go to a file capped by ``RLIMIT_FSIZE`` (a print flood kills
  the child with SIGXFSZ); stdin is ``/dev/null``;
* ``RLIMIT_CPU`` backs up the parent's wall-clock timeout;
* the working directory is a fresh, empty temporary folder;
* the from-scratch policy recorders (:mod:`attnlab.grading.policy`) watch the calls.

The child sends its results (through the zygote) as bytes written by ``torch.save``; the parent loads
them with ``torch.load(weights_only=True)``, which accepts tensors, numbers,
strings and containers and nothing executable. So whatever learner code does in
its own process (monkeypatching torch or the grader included), it can only hand
back data, and the parent judges that data against its own float64 reference.
"""

from __future__ import annotations

import io
import os
import resource
import shutil
import select
import signal
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from attnlab.grading import launch

__all__ = ["Limits", "Call", "Outcome", "Sandbox"]

MAX_RESULT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0  # wall clock, per task
    memory_mb: int = 1024  # on top of what the child has mapped at start
    output_kb: int = 256  # stdout + stderr
    show_output_chars: int = 1500  # how much of the output a report quotes


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
    """Learner return values -> what torch.load(weights_only=True) accepts."""
    if depth > 5:
        return {"__unsupported__": "nested too deeply"}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone().contiguous()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return {"__seq__": [_portable(v, depth + 1) for v in value], "__tuple__": isinstance(value, tuple)}
    if isinstance(value, dict):
        return {"__dict__": {str(k): _portable(v, depth + 1) for k, v in value.items()}}
    return {"__unsupported__": type(value).__name__}


def _set_limits(limits: Limits) -> None:
    vm_kb = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                vm_kb = int(line.split()[1])
    cap = vm_kb * 1024 + limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    out_cap = limits.output_kb * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (out_cap, out_cap))
    cpu = int(limits.timeout_s) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _child_main(result_fd: int, path: str, calls: list[Call], policy: bool, limits: Limits, workdir: str) -> None:
    """Entry point of the forked child. Sends exactly one message (bytes), then exits."""
    import importlib.util

    from attnlab.grading.policy import Policy

    os.chdir(workdir)
    out_fd = os.open(os.path.join(workdir, ".output"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    torch.set_num_threads(1)
    # Python ignores SIGXFSZ (writes past RLIMIT_FSIZE would just fail): restore the default,
    # so a print flood ends the child and is reported as such.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    _set_limits(limits)

    message: dict = {"status": "ok", "results": [], "violations": []}
    recorder = Policy() if policy else None
    try:
        if recorder is not None:
            recorder.__enter__()  # before the import: module-level code is watched too
        sys.path.insert(0, str(Path(path).parent))
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
                message["results"].append({"error": f"attention.py has no {call.function!r}", "traceback": ""})
                continue
            if not callable(fn):  # a constant such as EXERCISE_2_ANSWER
                message["results"].append({"value": _portable(fn)})
                continue
            try:
                value = fn(*call.args, **call.kwargs)
                message["results"].append({"value": _portable(value)})
            except SystemExit as exc:
                message = {"status": "exit", "message": f"called sys.exit({exc.code!r})", "results": [],
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
                from attnlab import doctor

                probes = doctor.build_probes(doctor.SELF_ATTENTION_CAPABILITIES)
                results = doctor.run_probes(doctor.adapt_self_attention(fn), probes)
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
    buf = io.BytesIO()
    try:
        torch.save(message, buf)
    except Exception as exc:
        buf = io.BytesIO()
        torch.save({"status": "protocol", "message": f"could not send the result back: {exc}",
                    "results": [], "violations": []}, buf)
    sys.stdout.flush()
    data = memoryview(buf.getvalue())
    while data:
        data = data[os.write(result_fd, data):]
    os.close(result_fd)
    os._exit(0)  # skip atexit handlers the learner may have registered


class _Done(Exception):
    pass


# --------------------------------------------------------------------------- #
# The zygote: a server process that has imported torch and forks one child per task
# --------------------------------------------------------------------------- #


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the sandbox server closed the channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, limit: int = MAX_RESULT_BYTES + 4096) -> bytes:
    (n,) = struct.unpack("<Q", _read_exact(fd, 8))
    if n > limit:
        raise ValueError(f"frame of {n} bytes is over the limit")
    return _read_exact(fd, n)


def serve(request_fd: int = 0, reply_fd: int = 1) -> None:
    """The zygote's loop: for each request fork a child, report its pid, its result and how it ended."""
    import pickle

    import attnlab.doctor  # noqa: F401

    try:  # the lab imports it; importing it once here saves every child the time
        import jaxtyping  # noqa: F401
    except ImportError:
        pass

    # the protocol gets private fds; 0/1/2 point to /dev/null so nothing stray lands on it
    request_fd, reply_fd = os.dup(request_fd), os.dup(reply_fd)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    _write_frame(reply_fd, b"ready")
    while True:
        try:
            req = pickle.loads(_read_frame(request_fd))  # from the grader itself: trusted
        except EOFError:
            return
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.close(request_fd)
            os.close(reply_fd)
            _child_main(w, **req)
            os._exit(0)  # not reached
        os.close(w)
        _write_frame(reply_fd, str(pid).encode())
        data, too_big = bytearray(), False
        while True:
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            if len(data) + len(chunk) > MAX_RESULT_BYTES:
                too_big = True
                os.kill(pid, signal.SIGKILL)
                break
            data += chunk
        os.close(r)
        _, status = os.waitpid(pid, 0)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        _write_frame(reply_fd, f"{code} {int(too_big)}".encode())
        _write_frame(reply_fd, bytes(data))


# --------------------------------------------------------------------------- #
# Parent side
# --------------------------------------------------------------------------- #


class Sandbox:
    """Runs tasks in children forked from a torch-preloaded server process (the zygote).

    Call ``Sandbox.start()`` (or :func:`attnlab.grading.launch.start`) early: the
    server imports torch while the caller carries on.
    """

    @staticmethod
    def start() -> None:
        launch.start()

    @staticmethod
    def stop() -> None:
        launch.stop()

    @staticmethod
    def _channel() -> tuple[int, int]:
        server = launch.start()
        if not server.ready:
            if _read_frame(server.stdout.fileno()) != b"ready":
                raise RuntimeError("the sandbox server did not start")
            server.ready = True
        return server.stdin.fileno(), server.stdout.fileno()

    def __init__(self, path: Path, limits: Limits = Limits()) -> None:
        self.path = Path(path).resolve()
        self.limits = limits
        Sandbox.start()

    def run(self, calls: list[Call], *, policy: bool = True, timeout_s: Optional[float] = None) -> Outcome:
        """Run ``calls`` on the learner's module in a fresh child; never raises for the learner's sake."""
        import pickle

        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        workdir = tempfile.mkdtemp(prefix="attnlab-grade-")
        t0 = time.perf_counter()
        try:
            to_server, from_server = Sandbox._channel()
            req = dict(path=str(self.path), calls=calls, policy=policy, limits=self.limits, workdir=workdir)
            _write_frame(to_server, pickle.dumps(req))
            pid = int(_read_frame(from_server))
            timed_out = False
            ready, _, _ = select.select([from_server], [], [], timeout)
            if not ready:
                timed_out = True
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            code_text, too_big = _read_frame(from_server).decode().split()
            payload = _read_frame(from_server)
            elapsed = time.perf_counter() - t0
            output = self._read_output(workdir)
            if timed_out:
                return self._failure("timeout", None, output, elapsed, timeout)
            if too_big == "1":
                return self._failure("protocol", None, output, elapsed, timeout)
            if payload:
                return self._decode(payload, output, elapsed)
            return self._failure(None, int(code_text), output, elapsed, timeout)
        except (EOFError, OSError, ValueError) as exc:  # the server itself broke: restart it next time
            Sandbox.stop()
            return Outcome("protocol", message=f"the sandbox failed: {exc}", elapsed_s=time.perf_counter() - t0)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    def _read_output(self, workdir: str) -> str:
        try:
            data = Path(workdir, ".output").read_bytes()
        except OSError:
            return ""
        text = data.decode("utf-8", errors="replace")
        n = self.limits.show_output_chars
        return text if len(text) <= n else text[: n // 2] + "\n[... output trimmed ...]\n" + text[-n // 2:]

    def _decode(self, payload: bytes, output: str, elapsed: float) -> Outcome:
        try:
            msg = torch.load(io.BytesIO(payload), weights_only=True)
        except Exception as exc:
            return Outcome("protocol", message=f"the child's answer could not be read safely: {exc}",
                           output=output, elapsed_s=elapsed)
        if not isinstance(msg, dict) or "status" not in msg:
            return Outcome("protocol", message="the child's answer is malformed", output=output, elapsed_s=elapsed)
        results = [{**r, "value": _restore(r["value"])} if "value" in r else r for r in msg.get("results", [])]
        return Outcome(msg["status"], results=results, message=msg.get("message", ""),
                       traceback=msg.get("traceback", ""), violations=list(msg.get("violations", [])),
                       output=output, elapsed_s=elapsed, probes=msg.get("probes"))

    def _failure(self, status: Optional[str], exitcode: Optional[int], output: str, elapsed: float,
                 timeout: float) -> Outcome:
        if status == "timeout":
            return Outcome("timeout", message=f"did not finish within {timeout:g} s (an endless loop?)",
                           output=output, elapsed_s=elapsed)
        if status == "protocol":
            return Outcome("protocol", message=f"returned more than {MAX_RESULT_BYTES // 2**20} MB of data",
                           output=output, elapsed_s=elapsed)
        if exitcode is not None and exitcode < 0:
            sig = -exitcode
            if sig == signal.SIGXFSZ:
                return Outcome("output_flood", message=f"printed more than {self.limits.output_kb} KB; "
                                                       "remove the print() calls in loops", output=output,
                               elapsed_s=elapsed)
            if sig == signal.SIGXCPU:
                return Outcome("timeout", message="used up its CPU time (an endless loop?)", output=output,
                               elapsed_s=elapsed)
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            return Outcome("crash", message=f"crashed with {name}", output=output, elapsed_s=elapsed)
        return Outcome("exit", message=f"the process exited (code {exitcode}) before returning a result: "
                                       "sys.exit/os._exit/exit() in your code?", output=output, elapsed_s=elapsed)


def _restore(value: Any) -> Any:
    """Undo :func:`_portable`'s container encoding."""
    if isinstance(value, dict):
        if "__seq__" in value:
            items = [_restore(v) for v in value["__seq__"]]
            return tuple(items) if value.get("__tuple__") else items
        if "__dict__" in value:
            return {k: _restore(v) for k, v in value["__dict__"].items()}
        if "__unsupported__" in value:
            return Unsupported(value["__unsupported__"])
    return value


@dataclass(frozen=True)
class Unsupported:
    """A return value the child could not send (an object of this type name)."""

    type_name: str
