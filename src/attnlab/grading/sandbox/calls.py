"""One call of the learner's function inside the sandbox, and the evidence it leaves: part of the runner.

Split from :mod:`.server` (which loads the submission, forks the children and sends the
message): what one call returns (:func:`portable`), what it changed in place, what its kernels
stored, loaded and touched (lab 05, :mod:`.interpreter`), and what torch functions it reached
(:mod:`.recorder`). Imports the standard library, torch and the runner's siblings, never
attnlab. Everything here runs after learner code has run, so it calls nothing of the value's
own and is evidence for the grader, never a fence.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

try:  # inside the sandbox these are plain modules beside this file; in the grader, a package
    from . import harness, launchers, protocol
except ImportError:
    import harness  # type: ignore[no-redef]
    import launchers  # type: ignore[no-redef]
    import protocol  # type: ignore[no-redef]

__all__ = ["MAX_TEXT", "Done", "call_one", "cap", "interpreter", "portable", "trim_traceback"]

MAX_TEXT = 4000  # characters of learner text kept per message field


def trim_traceback(exc: BaseException, learner_file: str, limit: int = 4) -> str:
    """The last few frames, learner frames only when there are any, no runner internals."""
    frames_ = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames_ if f.filename == learner_file]
    shown = (mine or frames_)[-limit:]
    lines = [f'  File "{os.path.basename(f.filename)}", line {f.lineno}, in {f.name}\n    {f.line}' for f in shown]
    head = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return "\n".join(["Traceback (most recent call last):", *lines, head]) if lines else head


def cap(text: str) -> str:
    """Learner text at most :data:`MAX_TEXT` characters (the grader caps it again, in bytes)."""
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT // 2] + " [...] " + text[-MAX_TEXT // 2:]


_type, _repr = type, repr
_TYPE_NAME = type.__dict__["__name__"].__get__  # the class's own name, whatever its metaclass says
_MRO = type.__dict__["__mro__"].__get__


def portable(value: Any, depth: int = 0) -> Any:
    """Learner return values -> what :func:`protocol.encode_message` sends: exact JSON types built
    here and :class:`protocol.Frozen` bytes for tensors. Only the value's exact type is looked at
    (``type(v) is list``, never ``isinstance``, which asks the object's ``__class__``), and nothing
    of the value's own is called: a subclass (of str, dict, torch.Tensor...) is unsupported, so no
    method the learner wrote or rebound runs once their function has returned (issue 61)."""
    import torch

    kind = _type(value)
    if depth > 5:
        return {"__unsupported__": "nested too deeply"}
    if kind is torch.Tensor:
        frozen = protocol.freeze(value)
        return frozen if _type(frozen) is protocol.Frozen else {"__unsupported__": frozen[:100]}
    if value is None or kind is bool or kind is int or kind is float:
        return value
    if kind is str:
        return value[:MAX_TEXT]
    if kind is tuple or kind is list:
        return {"__seq__": [portable(v, depth + 1) for v in value[:64]], "__tuple__": kind is tuple}
    if kind is dict:
        items = []
        for k, v in dict.items(value):
            if len(items) == 64:
                break
            key = (k[:200] if _type(k) is str else _repr(k)[:200] if _type(k) in (int, bool, float)
                   else f"<{_TYPE_NAME(_type(k))[:60]}>")  # a key of the learner's own type: named, never called
            items.append((key, portable(v, depth + 1)))
        return {"__dict__": dict(items)}
    if torch.Tensor in _MRO(kind):
        return {"__unsupported__": f"{_TYPE_NAME(kind)[:60]} (a subclass of torch.Tensor: return a plain tensor)"}
    return {"__unsupported__": _TYPE_NAME(kind)[:100]}


class Done(Exception):
    """The learner called sys.exit: the message so far is replaced, and no further call runs."""


def _inputs(fn: Any, call: dict) -> list:
    """(name, tensor, its bytes) of each tensor argument of ``call``, to see afterwards whether the
    learner's function changed it in place (``scores.masked_fill_(...)`` on the caller's scores):
    the bytes of :func:`protocol.freeze`, compared as bytes, so no method the learner may have
    rebound is called to decide it."""
    import inspect

    import torch

    try:
        names = list(inspect.signature(fn).bind_partial(*call["args"], **call["kwargs"]).arguments)
    except (TypeError, ValueError):
        names = []
    given = list(call["args"]) + list(call["kwargs"].values())
    out = []
    for i, arg in enumerate(given):
        if _type(arg) is torch.Tensor:  # the grader's own arguments
            name = names[i] if i < len(names) and _type(names[i]) is str else f"argument {i + 1}"
            out.append((name[:40], arg, protocol.freeze(arg)))
    return out


def _changed(tensor: Any, before: "protocol.Frozen") -> bool:
    return not before == protocol.freeze(tensor)


def _frozen_in(value: Any) -> list:
    """The :class:`protocol.Frozen` tensors of a :func:`portable` value (our own structure)."""
    if _type(value) is protocol.Frozen:
        return [value]
    if _type(value) is dict:
        inner = value.get("__seq__", value.get("__dict__"))
        items = inner if _type(inner) is list else list(inner.values()) if _type(inner) is dict else []
        return [f for item in items for f in _frozen_in(item)]
    return []


def _forbidden_reached(recorder: Any, call: dict, ran: tuple) -> list:
    """The torch functions of ``call["forbid"]`` (by their last name) the call reached since ``ran``."""
    forbid = frozenset(call["forbid"])
    return sorted({n for n in recorder.functions.names[ran[1]:] if n.rsplit(".", 1)[-1] in forbid})[:8]


def call_one(module: Any, call: dict, path: str, message: dict, stores: bool = False,
              recorder: Any = None) -> None:
    """One call's result (a value or an error) appended to ``message``; raises Done on sys.exit."""
    fn = getattr(module, call["function"], None)
    if fn is None:
        message["results"].append({"error": f"{os.path.basename(path)} has no {call['function']!r}",
                                   "traceback": ""})
        return
    if not callable(fn):  # a constant such as EXERCISE_2_ANSWER
        message["results"].append({"value": portable(fn)})
        return
    ran = None
    try:
        before = _inputs(fn, call)
        if stores:
            interpreter().forget_stores()
            interpreter().forget_nan_loads()
        watch = recorder is not None and call.get("watch_nan")
        if recorder is not None:  # never left on from a call that raised
            recorder.kernels.nan_watch = None
        if watch:  # before `ran`: what it dispatches to find the NaN is not the call's
            recorder.kernels.watch_nan(call["args"], launchers.moves_data)
        ran = (len(recorder.kernels.names), len(recorder.functions.names)) if recorder is not None else (0, 0)
        if call.get("harness") == "autograd":  # the grader's own steps around the learner's Function (harness.py)
            value = harness.autograd(fn, tuple(call["args"]), str(call["function"])[:60], module)
        elif call.get("forbid"):  # a call that may not reach autograd runs with no graph to reach (harness.py)
            with harness.no_grad():
                value = fn(*call["args"], **call["kwargs"])
        elif call.get("plant"):  # a difference planted in the function this one must measure (harness.py)
            value = harness.planted(module, fn, call["plant"], call["args"], call["kwargs"], recorder)
        else:
            value = fn(*call["args"], **call["kwargs"])
        if stores and recorder is not None:  # lab 05: what the call ran outside its kernels (evidence, like the rest)
            computed = launchers.outside_kernels(recorder.kernels.names[ran[0]:], recorder.functions.names[ran[1]:])
            computed = (interpreter().foreign_arguments() + computed)[:8]
        elif recorder is not None and call.get("forbid"):  # e.g. lab 04's backward: no autograd computing it
            computed = _forbidden_reached(recorder, call, ran)
        if watch:
            recorder.kernels.nan_watch = None
        result = {"value": portable(value)}
        if watch:
            result["nan_loads"] = recorder.kernels.nan_reads
        if recorder is not None and (stores or call.get("forbid")) and computed:
            result["torch_compute"] = computed
        if stores:  # lab 05: the elements of the answer its kernels did not store read as NaN (interpreter.poison)
            interp, missed, untouched = interpreter(), 0, 0
            for f in _frozen_in(result["value"]):
                mask = interp.unwritten(f.address, f.shape, f.stride, f.itemsize, f.data)
                missed += int(mask.sum())
                untouched += bool(mask.size) and bool(mask.all())
                f.data = interp.poison(f.dtype, f.data, f.itemsize, mask)
            result["unwritten"], result["untouched"] = missed, untouched
            result["nan_loads"] = interpreter().nan_loads()
            result["slices"] = interpreter().touched()
        changed = [name for name, tensor, frozen in before if _changed(tensor, frozen)]
        if changed:  # evidence for the mistake 'mutates_input', like the recorders: never a fence
            result["mutated"] = changed[:8]
        message["results"].append(result)
    except SystemExit as exc:
        message.clear()
        message.update({"status": "exit", "message": f"called sys.exit({exc.code!r})"[:200], "results": [],
                        "violations": []})
        raise Done() from None
    except MemoryError as exc:
        message["results"].append({"error": cap(f"MemoryError: {exc}"), "traceback": cap(trim_traceback(exc, path)),
                                   "memory": True})
    except Exception as exc:
        # Triton's interpreter wraps what a kernel raised (InterpreterError from the kernel's own
        # exception): report the kernel's, at its line, as any other function's
        if type(exc).__name__ == "InterpreterError" and type(exc).__module__.startswith("triton") \
                and isinstance(exc.__cause__, Exception):
            exc = exc.__cause__
        # capped here, in the child: a message of megabytes would be refused whole by the grader
        text = cap("".join(traceback.format_exception_only(type(exc), exc)).strip())
        result = {"error": text, "traceback": cap(trim_traceback(exc, path)),
                  "memory": "can't allocate memory" in text or "alloc" in text.lower() and "memory" in text.lower()}
        if stores:  # lab 05: the (batch, head) slices its kernels reached before it raised (out of bounds, say)
            result["slices"] = interpreter().touched()
        if recorder is not None and call.get("forbid") and ran is not None:  # reached before it raised (no graph
            reached = _forbidden_reached(recorder, call, ran)  # under no_grad: autograd.grad raises, still named)
            if reached:
                result["torch_compute"] = reached
        message["results"].append(result)


def interpreter():
    """The runner's :mod:`.interpreter` (a package module here, a file beside this one in the sandbox)."""
    try:
        from . import interpreter
    except ImportError:
        import interpreter  # type: ignore[no-redef]
    return interpreter
