"""The grader's side of the sandbox: run tasks on one submission, bring back only validated data.

A :class:`Sandbox` holds one submission's sandbox server (:mod:`.pool`, in the OS sandbox of
:mod:`.bwrap`) and sends it tasks: a list of :class:`Call` s, run in a fresh child of the
server with the limits of :class:`Limits` (CPU time, memory, output, files, processes).
The learner's process can run anything, so this side trusts nothing it gets back:

* every read from the server has a deadline; on a deadline or a broken frame the whole
  sandbox is killed (and a new one serves the next exercise);
* the server's header is bounded JSON; the child's message is one safetensors file with
  the message as bounded JSON in its metadata (:mod:`.protocol`: no pickle, no zip; every
  size is checked against the bytes received before anything is allocated), then validated
  field by field (:func:`validate_message`): known keys and types only, capped in elements
  and bytes. Learner text is stripped of control characters and lone surrogates and capped
  (:func:`clean_text`);
* references and diagnoses are computed here, in the grader, by each exercise's judge (lab 01
  sends the doctor's probes as plain calls and analyses the answers): the sandbox knows no
  lab and no doctor.

Without ``bwrap`` the OS fences are missing (``Sandbox.sandboxed`` is False): the grader
says so, and refuses other people's code unless told otherwise (:mod:`..grader`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from attnlab.grading.sandbox import pool, seccomp
from attnlab.grading.sandbox.frames import Deadline, read_frame, write_frame
from attnlab.grading.sandbox.protocol import BadPayload, bounded_json, decode_message, encode_request
from attnlab.grading.submission import MAX_SOURCE_BYTES, printable
from attnlab.grading.sandbox.server import MAX_RESULT_BYTES, MAX_TEXT, STUCK_MARK, SUBMISSION_NAME, submission_name

__all__ = ["Limits", "Call", "Outcome", "Sandbox", "Unsupported", "validate_message", "clean_text", "printable",
           "self_test",
           "MAX_RESULT_BYTES", "MAX_ELEMENTS", "MAX_SOURCE_BYTES", "SUBMISSION_NAME", "submission_name", "BadMessage"]

MAX_ELEMENTS = 1 << 23  # tensor elements in one message, all tensors together
START_TIMEOUT_S = 90.0  # the server imports torch; on a loaded 2-core machine that took up to ~10 s
GRACE_S = 3.0  # parent's deadline beyond the zygote's own


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
    # where the seccomp filter cannot be installed, learner code does not run (fail closed) unless the
    # instructor allows it here (attnlab grade --seccomp-optional); every report then says so
    seccomp_optional: bool = False


@dataclass(frozen=True)
class Call:
    """``module.function(*args, **kwargs)`` in the child. The sandbox knows no lab and no doctor:
    an exercise's ``prepare`` makes every call it needs (lab 01 adds the doctor's probes as
    plain calls), and its ``judge`` reads the answers."""

    function: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    # "autograd": the child runs the grader's own steps around the learner's Function named ``function``
    # (sandbox/harness.py: apply, its node's saved shapes, autograd.grad), not a learner function reporting them
    harness: str = ""
    # torch functions (by their last name: "grad", "backward") the call may not reach; what it reached is
    # reported in the result's "torch_compute", as lab 05's arithmetic outside its kernels is
    forbid: tuple = ()
    # ("self_attention", delta): for this call the module's ``self_attention`` returns its own answer plus
    # ``delta`` (sandbox/harness.py: planted), so that a function that reports on it (lab 01's ex9) must
    # have measured it: a planted difference only a real measurement finds
    plant: tuple = ()
    # count, in the result's "nan_loads", the torch kernels past allocation, views, copies and conversions that
    # received a tensor holding NaN (recorder.KernelRecorder.nan_watch): lab 04's skip case
    watch_nan: bool = False


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
    cpu_s: float = 0.0  # CPU time of the task's process (what the time budget counts)
    environment: str = ""  # set when the sandbox itself could not start here: the grader's problem, not the learner's
    launches: dict[str, int] = field(default_factory=dict)  # kernel name -> launches of the learner's kernels (lab 05)
    unfiltered: str = ""  # why the child ran without its seccomp filter (Limits.seccomp_optional allowed it)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def clean_text(text: Any, limit: int = MAX_TEXT) -> str:
    """Learner text made safe to print and to store: no control characters (escape
    sequences, carriage returns, bidi overrides), no lone surrogates, at most ``limit``
    characters and at most ``limit`` bytes of UTF-8 (the middle is cut): a cap in characters
    alone let 4000 four-byte characters become 24 KB of ``\\u`` escapes per field."""
    if not isinstance(text, str):
        text = str(text)
    text = _SURROGATE.sub("\ufffd", text)
    text = _CONTROL.sub(lambda m: "" if m.group() == "\r" else "\ufffd", text.replace("\r\n", "\n"))
    if len(text) > limit or len(text.encode()) > limit:
        half = max(0, limit // 2 - 12)
        head = text.encode()[:half].decode(errors="ignore")
        tail = text.encode()[-half:].decode(errors="ignore") if half else ""
        text = head + "\n[... trimmed ...]\n" + tail
    return text


# --------------------------------------------------------------------------- #
# Child side (runs in the forked process)
# --------------------------------------------------------------------------- #


# --------------------------------------------------------------------------- #
# Parent side: validation of what comes back
# --------------------------------------------------------------------------- #

_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64}
_STATUSES = {"ok", "import_error", "exit", "protocol", "no_filter"}


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


def validate_message(msg: Any, n_calls: int) -> None:
    """Raise :class:`BadMessage` unless ``msg`` is exactly what the runner's child
    (:mod:`.server`) sends for ``n_calls`` calls."""
    if not isinstance(msg, dict) or not set(msg) <= {"status", "results", "violations", "message", "traceback",
                                                     "launches", "unfiltered"}:
        raise BadMessage("the message is not a dict of the known fields")
    launches = msg.get("launches", {})
    if not isinstance(launches, dict) or len(launches) > 64 or not all(
            isinstance(k, str) and len(k) <= 100 and type(n) is int and 0 < n < 2**31 for k, n in launches.items()):
        raise BadMessage("launches is not a short map of kernel names to counts")
    if msg.get("status") not in _STATUSES:
        raise BadMessage(f"unknown status {str(msg.get('status'))[:40]!r}")
    for key in ("message", "traceback", "unfiltered"):
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
        if "slices" in r:
            _check_slices(r["slices"])
        if "value" in r and set(r) <= {"value", "mutated", "unwritten", "untouched", "torch_compute", "nan_loads",
                                       "slices"}:
            _check_value(r["value"], budget)
            for key in ("unwritten", "untouched", "nan_loads"):
                if type(r.get(key, 0)) is not int or not 0 <= r.get(key, 0) < 2**40:
                    raise BadMessage(f"{key} is not a count")
            computed = r.get("torch_compute", [])
            if not isinstance(computed, list) or len(computed) > 8:
                raise BadMessage("torch_compute is not a short list")
            for name in computed:
                _check_str(name, "a kernel's name")
            mutated = r.get("mutated", [])
            if not isinstance(mutated, list) or len(mutated) > 8:
                raise BadMessage("a list of changed inputs that is not a short list")
            for name in mutated:
                _check_str(name, "an input's name")
        elif "error" in r and set(r) <= {"error", "traceback", "memory", "torch_compute", "slices"}:
            _check_str(r["error"], "an error")
            _check_str(r.get("traceback", ""), "a traceback")
            if not isinstance(r.get("memory", False), bool):
                raise BadMessage("a memory flag that is not a bool")
            computed = r.get("torch_compute", [])  # what a call that raised reached first (Call.forbid)
            if not isinstance(computed, list) or len(computed) > 8:
                raise BadMessage("torch_compute is not a short list")
            for name in computed:
                _check_str(name, "a function's name")
        else:
            raise BadMessage("a result with unknown fields")


def _small_int(x: Any, limit: int = 2**31) -> bool:
    return type(x) is int and 0 <= x < limit


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_name(name: Any, limit: int) -> None:
    """A kernel's or an argument's name is a Python identifier (what the interpreter reports): no line
    breaks or marks that could fake a report line (issue 62's attacker forged a record)."""
    if not (isinstance(name, str) and len(name) <= limit and _IDENTIFIER.fullmatch(name)):
        raise BadMessage("a name in slices that is not an identifier")


def _check_slices(slices: Any) -> None:
    """The (batch, head) slices a call's kernels reached (:func:`.interpreter.touched`): exactly
    that shape, bounded, ints and short names."""
    if not isinstance(slices, dict) or set(slices) != {"launches", "touched"}:
        raise BadMessage("slices is not {launches, touched}")
    launches, touched = slices["launches"], slices["touched"]
    if not isinstance(launches, list) or len(launches) > 16 or not isinstance(touched, list) or len(touched) > 1024:
        raise BadMessage("slices is not two short lists")
    for launch in launches:
        if not (isinstance(launch, list) and len(launch) == 3 and isinstance(launch[1], list)
                and len(launch[1]) in (0, 3) and all(_small_int(g) for g in launch[1])
                and isinstance(launch[2], list) and len(launch[2]) <= 32):
            raise BadMessage("a launch that is not [kernel, grid, tensors]")
        _check_name(launch[0], 100)
        for t in launch[2]:
            if not (isinstance(t, list) and 4 <= len(t) <= 5 and all(_small_int(n) for n in t[1:])):
                raise BadMessage("a tensor that is not [name, shape...]")
            _check_name(t[0], 40)
    for t in touched:
        if not (isinstance(t, list) and len(t) == 5 and _small_int(t[0], len(launches)) and _small_int(t[1])
                and t[3] in (0, 1) and type(t[3]) is int and isinstance(t[4], list) and len(t[4]) <= 16
                and all(isinstance(x, list) and len(x) == 3 and all(_small_int(n) for n in x) for x in t[4])):
            raise BadMessage("a touch that is not [launch, program, name, kind, slices]")
        _check_name(t[2], 40)


# --------------------------------------------------------------------------- #
# Parent side: the sandbox of one submission
# --------------------------------------------------------------------------- #


_STUCK = re.compile(re.escape(STUCK_MARK) + r"(\d{1,7}):(\w{1,100}):([^\n]{0,160})\n?")


def stuck_at(output: str, file_name: str) -> tuple[str, str]:
    """``(output without the marker, where it was stuck)``: the line the child said it was
    running when its CPU budget ran out (:data:`.server.STUCK_MARK`), as ' when the budget ran
    out it was running line N of FILE, in f(): `code`', or '' when it said nothing. The child
    is the learner's process: this is what it printed, shown as such."""
    found = list(_STUCK.finditer(output))
    if not found:
        return output, ""
    line, func, code = found[-1].groups()
    rest = _STUCK.sub("", output).strip("\n")
    return rest, (f"; when the budget ran out it was running line {line} of {file_name}, in {func}(): "
                  f"{code.strip()}")


@dataclass
class Task:
    """A task :meth:`Sandbox.start` sent: what :meth:`Sandbox.finish` needs to wait for it."""

    calls: list
    limits: Limits
    timeout: float
    t0: float
    server: Any = None
    deadline: float = 0.0
    outcome: Optional[Outcome] = None  # decided at the start (the sandbox did not start)


class Sandbox:
    """Runs tasks on one submission in children of its own sandbox server.

    ``mode``: 'auto' (bwrap where installed), 'bwrap' (required: raises
    :class:`~attnlab.grading.sandbox.pool.SandboxUnavailable` without it), 'user' or 'none'. Use it as
    a context manager, or call :meth:`close`: the server and everything the submission
    started die then.
    """

    def __init__(self, path: os.PathLike, limits: Limits = Limits(), mode: str = "auto",
                 source: Optional[bytes] = None) -> None:
        """``source``: the submission's bytes, read once by the caller (the grader checks these
        same bytes first); without it the path is read here, once (:func:`.submission.read_submission`)."""
        from attnlab.grading.submission import read_submission

        self.path = Path(path)
        self.limits = limits
        self.mode = mode
        self.source = read_submission(self.path).data if source is None else bytes(source)
        if len(self.source) > MAX_SOURCE_BYTES:
            raise ValueError(f"{self.path} is larger than {MAX_SOURCE_BYTES // 1024} KB")
        self._server: Optional[pool.Server] = None
        self._cpu0: Optional[float] = None  # the submission's cgroup CPU when the current task started
        self.restarts = 0  # servers started after the first (the learner stopped or killed one)
        self._starts = 0
        self.sandboxed = pool.resolve_mode(mode) is not None
        self.memory_fence = ""
        self.identity = ""  # whom its processes run as on the host, in words
        self.launcher = ""  # 'template' (forked from the class template), 'bwrap', 'user' or 'none'

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

    def _server_ready(self) -> pool.Server:
        if self._server is not None and self._server.alive():
            return self._server
        if self._server is not None:
            self._server.stop()
        if self._starts:
            self.restarts += 1
        self._starts += 1
        server = pool.take(self.mode, self.limits.submission_memory_mb, self.limits.max_procs)
        self._server = server
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            hello = read_frame(server.reply_fd, 4096, deadline)
        except EOFError as exc:  # it died before a word: its stderr says why (bwrap's message, a traceback)
            why = pool.start_failure(server)
            raise EOFError(f"{exc}" + (f"; it said: {clean_text(why, 1500)}" if why else "")) from None
        if not hello.startswith(b"ready"):
            raise EOFError(f"the sandbox server did not start ({clean_text(hello.decode(errors='replace'), 300)})")
        if isinstance(server, pool.Server) and not server.sandboxed:  # said before any learner code ran
            server.root = hello[len(b"ready "):].decode(errors="replace")[:300]
        write_frame(server.request_fd, encode_request("load", source=self.source, name=submission_name(self.path)))
        if read_frame(server.reply_fd, 64, deadline) != b"loaded":
            raise EOFError("the sandbox server did not take the submission")
        self.sandboxed = server.sandboxed
        self.memory_fence = server.memory_fence
        self.identity = server.identity
        self.launcher = ("template" if isinstance(server, pool.SpawnedServer)
                         else "bwrap" if server.sandboxed else "user" if getattr(server, "uid", None) else "none")
        return server

    def run(self, calls: list[Call], *, policy: bool = True, timeout_s: Optional[float] = None,
            limits: Optional[Limits] = None, exempt: tuple[str, ...] = (), traced: bool = False) -> Outcome:
        """Run ``calls`` on the learner's module in a fresh child; never raises for the learner's sake.
        ``limits``: this task's own (an exercise with a tighter memory cap); default the sandbox's.
        The call recorder is on in every child; ``policy=False`` judges nothing it records (the
        sandbox's own tests), ``exempt``: the learner functions in whose call path (every learner
        frame) torch's attention is allowed (:class:`.recorder.Policy`); ``traced``: the answers are
        judged as what the learner's Triton kernels stored (lab 05: :func:`.interpreter.unwritten`)."""
        return self.finish(self.start(calls, policy=policy, timeout_s=timeout_s, limits=limits, exempt=exempt,
                                      traced=traced))

    def start(self, calls: list[Call], *, policy: bool = True, timeout_s: Optional[float] = None,
              limits: Optional[Limits] = None, exempt: tuple[str, ...] = (), traced: bool = False) -> "Task":
        """Send ``calls`` to a fresh child and return at once; :meth:`finish` waits for its outcome.
        The grader's own work (judging the task before, preparing the next) runs meanwhile on the
        other core. One task at a time: finish it before the next start. Never raises for the
        learner's sake (a sandbox that cannot start is the outcome :meth:`finish` returns)."""
        limits = self.limits if limits is None else limits
        timeout = limits.timeout_s if timeout_s is None else timeout_s
        task = Task(list(calls), limits, timeout, time.perf_counter())
        try:
            server = self._server_ready()
        except (EOFError, OSError, ValueError, Deadline, subprocess.SubprocessError) as exc:
            first_start = self._starts <= 1  # no learner code has run yet: this machine cannot make the sandbox
            self.close()
            what = "did not start in time" if isinstance(exc, Deadline) else f"failed to start: {exc}"
            task.outcome = Outcome("protocol", message=f"the sandbox {what}", elapsed_s=time.perf_counter() - task.t0,
                                   environment=f"the sandbox {what}" if first_start else "")
            return task
        try:
            task_limits = {**dataclasses.asdict(limits), "timeout_s": float(timeout)}
            wire = [{"function": c.function, "args": tuple(c.args), "kwargs": dict(c.kwargs), "harness": c.harness,
                     "forbid": list(c.forbid), "plant": tuple(c.plant),
                     "watch_nan": c.watch_nan} for c in task.calls]
            self._cpu0 = self._cgroup_cpu(server)  # before the task starts
            write_frame(server.request_fd, encode_request("run", calls=wire, policy=policy, exempt=list(exempt), traced=traced,
                                                          limits=task_limits,
                                                          seccomp=seccomp.route()))  # its environment is cleared
        except (EOFError, OSError, ValueError) as exc:
            self.close()
            task.outcome = Outcome("protocol", message=f"the sandbox server stopped: {clean_text(exc, 300)} "
                                                       "(did your code kill it?)", elapsed_s=time.perf_counter() - task.t0)
            return task
        task.server = server
        task.deadline = time.monotonic() + timeout * limits.wall_factor + GRACE_S
        return task

    def finish(self, task: "Task") -> Outcome:
        """The outcome of a task :meth:`start` sent (waiting for it); never raises for the learner's sake."""
        if task.outcome is not None:
            return task.outcome
        server, sent, limits, timeout, t0 = task.server, task.calls, task.limits, task.timeout, task.t0
        try:
            # the grader's own work since the start (judging the task before) is not the task's: at least
            # a grace period from now, so an answer already waiting is read, not taken for a stuck server
            deadline = max(task.deadline, time.monotonic() + GRACE_S)
            fd = server.reply_fd
            over = self._watch_cpu(server, fd, timeout, deadline)
            if over is not None:  # the cgroup counted more than the budget: stopped now, not at the backstop
                self.close()
                return Outcome("timeout", message=f"did not finish within {timeout:g} s of CPU time, counted for "
                                                  f"all its processes together ({over:.1f} s; an endless loop, or "
                                                  "work spread over several processes?)",
                               elapsed_s=time.perf_counter() - t0, cpu_s=over)
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
        cg = self._cgroup_cpu(server)
        if cg is not None and self._cpu0 is not None:
            cpu_s = max(cpu_s, cg - self._cpu0)  # the cgroup's count, where there is one, is the grader's own
        own_budget = header["code"] in (-signal.SIGPROF, -signal.SIGXCPU)  # the child's own CPU ran out: _failure says
        if status == "ok" and cpu_s > timeout and not own_budget:  # over the budget, whatever its exit status
            return Outcome("timeout", message=f"did not finish within {timeout:g} s of CPU time: its processes "
                                              f"used {cpu_s:.1f} s together (work spread over several processes, "
                                              "or the CPU limit's signals ignored?)", output=output,
                           elapsed_s=elapsed, cpu_s=cpu_s)
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
            outcome = self._decode(payload, output, elapsed, len(sent))
        else:
            outcome = self._failure(header["code"], output, elapsed, timeout)
        outcome.cpu_s = cpu_s
        return outcome

    @staticmethod
    def _cgroup_cpu(server) -> Optional[float]:
        cgroup = getattr(server, "cgroup", None)
        return cgroup.cpu_s() if cgroup is not None else None

    def _watch_cpu(self, server, fd: int, timeout: float, deadline: float) -> Optional[float]:
        """Wait until the server's answer starts (or the deadline), reading the submission's cgroup
        CPU meanwhile; returns the CPU used when it passes the budget by a second first (the
        throttle), else None. Without a cgroup that counts CPU it only waits (the server's own
        count, of the whole process tree, decides afterwards)."""
        import select

        if self._cpu0 is None:
            return None
        while time.monotonic() < deadline:
            if select.select([fd], [], [], min(0.2, max(0.0, deadline - time.monotonic())))[0]:
                return None
            used = self._cgroup_cpu(server)
            if used is not None and used - self._cpu0 > timeout + 1.0:
                return used - self._cpu0
        return None

    def _show(self, data: bytes) -> str:
        text = data.decode("utf-8", errors="replace")
        return clean_text(text, self.limits.show_output_chars)

    def _decode(self, payload: bytes, output: str, elapsed: float, n_calls: int) -> Outcome:
        try:
            msg = decode_message(payload)  # bounded JSON + safetensors: no pickle, no zip
            validate_message(msg, n_calls)
        except Exception as exc:
            return Outcome("protocol", message=f"the child's answer was refused: {clean_text(exc, 300)}",
                           output=output, elapsed_s=elapsed)
        if msg["status"] == "no_filter":  # nothing of the learner's ran: the grading machine's problem
            why = clean_text(msg.get("message", ""), 300)
            return Outcome("protocol", message=why, output=output, elapsed_s=elapsed, environment=why)
        results = []
        for r in msg.get("results", []):
            if "value" in r:
                results.append({"value": _restore(r["value"])})
                if r.get("mutated"):  # the learner's function changed these inputs in place
                    results[-1]["mutated"] = [clean_text(name, 40) for name in r["mutated"]]
                for key in ("unwritten", "untouched", "nan_loads"):  # lab 05: what its kernels did not store, loaded NaN
                    if key in r:
                        results[-1][key] = r[key]
                if "slices" in r:  # lab 05: the (batch, head) slices its kernels reached
                    results[-1]["slices"] = _clean_slices(r["slices"])
                if r.get("torch_compute"):  # lab 05: torch's arithmetic the call ran outside the kernels
                    results[-1]["torch_compute"] = [clean_text(n, 60) for n in r["torch_compute"]]
            else:
                results.append({"error": clean_text(r["error"]), "traceback": clean_text(r.get("traceback", "")),
                                "memory": r.get("memory", False)})
                if "slices" in r:  # lab 05: what its kernels reached before it raised
                    results[-1]["slices"] = _clean_slices(r["slices"])
                if r.get("torch_compute"):  # Call.forbid: what the call reached before it raised
                    results[-1]["torch_compute"] = [clean_text(n, 60) for n in r["torch_compute"]]
        return Outcome(msg["status"], results=results, message=clean_text(msg.get("message", "")),
                       traceback=clean_text(msg.get("traceback", "")),
                       violations=[clean_text(v, 200) for v in msg.get("violations", [])],
                       output=output, elapsed_s=elapsed,
                       launches={clean_text(k, 100): n for k, n in msg.get("launches", {}).items()},
                       unfiltered=clean_text(msg.get("unfiltered", ""), 300))

    def _failure(self, exitcode: int, output: str, elapsed: float, timeout: float = 0.0) -> Outcome:
        if exitcode < 0:
            sig = -exitcode
            # SIGPROF: the budget's own signal. RLIMIT_CPU's SIGKILL sits well past the budget (the
            # server's _set_limits), so a task it ended used more CPU than the budget and was taken
            # for a timeout above, by that count, before it came here
            if sig in (signal.SIGPROF, signal.SIGXCPU):
                output, where = stuck_at(output, submission_name(self.path))
                return Outcome("timeout", message=f"did not finish within {timeout:g} s of CPU time (an endless "
                                                  f"loop?){where}", output=output, elapsed_s=elapsed)
            if sig == signal.SIGXFSZ:
                return Outcome("crash", message=f"wrote a file larger than {self.limits.file_mb} MB",
                               output=output, elapsed_s=elapsed)
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            if sig == signal.SIGKILL:
                return Outcome("crash", message="was killed (SIGKILL): the submission's memory or process limit, "
                                                "or your code killed itself", output=output, elapsed_s=elapsed)
            if sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS):  # the heap or a page gone wrong
                return Outcome("crash", message=f"crashed with {name}: memory outside its tensors was written or "
                                                "read (a kernel's store or load past a tensor's end?)",
                               output=_without_runtime_noise(output), elapsed_s=elapsed)
            return Outcome("crash", message=f"crashed with {name}", output=output, elapsed_s=elapsed)
        return Outcome("exit", message=f"the process exited (code {exitcode}) before returning a result: "
                                       "sys.exit/os._exit/exit() in your code?", output=output, elapsed_s=elapsed)


# what the C library and the packages print as a process dies of a corrupted heap: not the learner's
_RUNTIME_NOISE = re.compile(r"^(?:.*(?:double free|free\(\)|malloc\(\)|realloc\(\)|munmap_chunk|corrupted "
                            r"(?:size|double-linked)|malloc_consolidate).*|.*site-packages/.*|\s+val = .*)$")


def _without_runtime_noise(output: str) -> str:
    """A crashed child's output less glibc's heap messages and the packages' warnings with their paths."""
    return "\n".join(line for line in output.splitlines() if not _RUNTIME_NOISE.match(line)).strip()


def _clean_slices(slices: dict) -> dict:
    """A validated slices record with every name through the one sanitiser."""
    return {"launches": [[clean_text(k, 100), list(g), [[clean_text(t[0], 40), *t[1:]] for t in ts]]
                         for k, g, ts in slices["launches"]],
            "touched": [[a, p, clean_text(n, 40), kind, [list(x) for x in reached]]
                        for a, p, n, kind, reached in slices["touched"]]}


def _restore(value: Any) -> Any:
    """Undo the runner's container encoding (:func:`.server._portable`)."""
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
    """Start the exact sandbox the grader uses (``mode``: 'bwrap', 'user' or 'auto'), run one trivial
    task in it and check its answer: ``(True, how it is fenced)`` or ``(False, why not)``.
    This, not a simpler ``bwrap ... true``, is what decides whether grading here is sandboxed."""
    folder = tempfile.mkdtemp(prefix="attnlab-self-test-")
    try:
        path = Path(folder) / "self_test.py"
        path.write_text("def answer():\n    return 42\n")
        try:
            with Sandbox(path, limits, mode=mode) as box:
                outcome = box.run([Call("answer")], policy=False)
                fence, sandboxed, launcher, identity = box.memory_fence, box.sandboxed, box.launcher, box.identity
        except pool.SandboxUnavailable as exc:
            return False, str(exc)
        if outcome.status != "ok" or not outcome.results or outcome.results[0].get("value") != 42:
            return False, outcome.environment or outcome.message or f"the test task ended with {outcome.status}"
        if mode == "user":
            if launcher != "user":
                return False, "the task ran, but not as a user of its own"
            return True, f"the learner runs as a fresh unprivileged uid here ({fence or 'no memory fence'})"
        if mode != "none" and not sandboxed:
            return False, "the task ran, but not in the OS sandbox"
        return True, f"the OS sandbox works here ({fence or 'no memory fence'}; as {identity})"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
