"""The from-scratch policy: record every torch call and flag the forbidden ones.

The recorders are on in every child that runs learner code, from before the file's module body
until the answers are bytes (:func:`.protocol.freeze`). Where an exercise allows torch's
attention (``compare_with_sdpa``), the allowance belongs to a call path, not to a function: a
forbidden call counts only when some learner frame on the stack is outside the exempt functions
(:meth:`Policy.exempt_here`), so ``self_attention`` reaching SDPA *through* ``compare_with_sdpa``
is a violation even while ``compare_with_sdpa`` is the exercise being graded. And what the file
rebinds on torch (``torch.Tensor.detach = f``) is reported as a violation of its own
(:meth:`Policy.patched`): evidence, like every record made in the learner's process.

Two recorders run together. :class:`FunctionRecorder` (a ``TorchFunctionMode``)
sees Python-level torch functions and ``Tensor`` methods under any alias
(``torch.softmax``, ``F.softmax``, ``x.softmax``, ``torch.special.softmax``,
``F.multi_head_attention_forward``...). :class:`KernelRecorder` (a
``TorchDispatchMode``) sees the ATen kernels underneath, so a route that never
touches a Python name (a saved C function, ``torch.ops.aten._softmax``) is caught
too.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.functional
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BANNED_FRAGMENTS", "FunctionRecorder", "KernelRecorder", "banned", "Policy"]

# Substrings of function / kernel names that attention code must not reach.
BANNED_FRAGMENTS = ("softmax", "scaled_dot_product", "multi_head_attention", "multiheadattention",
                    "flash_attention", "efficient_attention", "flex_attention", "transformer_encoder",
                    "transformerencoder", "transformerdecoder", "transformer_decoder")


def banned(names: list[str]) -> list[str]:
    """The distinct forbidden names among ``names``, sorted."""
    return sorted({n for n in names if any(b in n.lower() for b in BANNED_FRAGMENTS)})


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


_ADD = torch._C.TensorBase.add  # taken before any learner code runs


class FunctionRecorder(TorchFunctionMode):
    """Records the name of every torch function and Tensor method called inside it. ``offset``: a
    tensor the grader plants for one call (``sandbox/harness.planted``), added to what an exempt call of
    torch's SDPA returns, so that a measurement against SDPA must have used SDPA's answer."""

    def __init__(self, policy: Optional["Policy"] = None) -> None:
        super().__init__()
        self.names: list[str] = []
        self.policy = policy
        self.offset: Any = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        exempt = self.policy is not None and self.policy.exempt_here(name)
        if not exempt:
            self.names.append(name)
        out = func(*args, **(kwargs or {}))
        if exempt and self.offset is not None and "scaled_dot_product_attention" in name:
            out = _ADD(out, self.offset)
        return out


class KernelRecorder(TorchDispatchMode):
    """Records the name of every ATen kernel dispatched inside it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ so that torch.compile skips it; the wrapper
        # imports torch._dynamo on first use (~1 s). Nothing here is compiled.
        return False

    def __init__(self, policy: Optional["Policy"] = None) -> None:
        super().__init__()
        self.names: list[str] = []
        self.policy = policy
        # for one call (Call.watch_nan): which ATen kernels only allocate, view, copy or convert; every other
        # kernel that receives a float tensor holding NaN counts in nan_reads (lab 04's skip case: the NaN lie
        # at keys no query sees, so a loop that skips their tiles computes on none of them)
        self.nan_watch: Optional[Callable[[str], bool]] = None
        self.nan_reads = 0
        # tensors this large (the call's whole K or V, or a view of all of it) are not a tile: an op on the whole
        # sequence is the untiled forward, which the memory cap names (ex3), not a visit of one tile too many
        self.nan_whole = 0

    def watch_nan(self, args: tuple, moves: Callable[[str], bool]) -> None:
        """Count, from now, the kernels for which ``moves(name)`` is false that receive a NaN tile:
        ``nan_whole`` is the size of the smallest argument that holds NaN (the call's V), and a tensor that
        large is the whole sequence."""
        held = [t.numel() for t in _float_tensors(args) if bool(_ISNAN(t).any())]
        self.nan_watch, self.nan_reads, self.nan_whole = moves, 0, min(held, default=0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if self.policy is None or not self.policy.exempt_here(name):
            self.names.append(name)
        if self.nan_watch is not None and not self.nan_watch(name):
            self.nan_reads += sum(1 for t in _float_tensors(args)
                                  if (not self.nan_whole or t.numel() < self.nan_whole) and bool(_ISNAN(t).any()))
        return func(*args, **(kwargs or {}))


_ISNAN = torch.isnan


_AS_FLOAT = {2: torch.float16, 4: torch.float32, 8: torch.float64}


def _float_tensors(args) -> list:
    """The floating-point tensors among a kernel's arguments (one level into lists and tuples), and the
    integer ones read as the float of their width (NaN's bits in an int64 view are still NaN's)."""
    out = []
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_floating_point():
                out.append(t)
            elif t.dtype != torch.bool and not t.is_complex() and t.element_size() in _AS_FLOAT:
                try:
                    out.append(t.view(_AS_FLOAT[t.element_size()]))
                except RuntimeError:  # a view the layout does not allow: not ours to read
                    pass
    return out


# What a file may not rebind: torch's namespaces whose functions and methods the grader's child and
# torch itself call. For the modules, an entry replaced or deleted (a lazily imported submodule adds
# one, harmlessly); for torch.Tensor, any change at all.
_WATCHED = (("torch", torch, False), ("torch.nn.functional", torch.nn.functional, False),
            ("torch.Tensor", torch.Tensor, True))
_getframe = sys._getframe


def _snapshot() -> list[dict]:
    return [dict(vars(obj)) for _, obj, _ in _WATCHED]


class Policy:
    """Both recorders at once: ``with Policy() as p: ...; p.violations()``.

    ``path``: the learner's file (its frames are the learner's); ``exempt``: the functions in
    whose call path torch's attention is allowed (every learner frame on the stack must be one of
    them, or a function nested in one); ``judged=False``: nothing is a violation (the sandbox's
    own tests), though everything is still recorded."""

    def __init__(self, path: str = "", exempt: tuple = (), judged: bool = True) -> None:
        self.path, self.exempt, self.judged = path, frozenset(exempt), judged
        self.functions = FunctionRecorder(self if self.exempt else None)
        self.kernels = KernelRecorder(self if self.exempt else None)
        self.before = _snapshot()

    def exempt_here(self, name: str) -> bool:
        """Whether a call of ``name`` (a forbidden one) is allowed where it is made now: every
        learner frame on the stack belongs to an exempt function, and there is at least one."""
        if not banned([name]):
            return False
        frame, codes = _getframe(1), []
        while frame is not None:
            code = frame.f_code
            if code.co_filename == self.path:
                if getattr(code, "co_qualname", code.co_name).split(".")[0] not in self.exempt:
                    return False
                codes.append(code)
            frame = frame.f_back
        # an exempt function re-entered (through an alias of itself) answers for another exercise: not exempt
        return bool(codes) and len(codes) == len(set(codes))

    def patched(self) -> list[str]:
        """What the file rebound on torch since this policy was made (evidence, never a fence)."""
        out = []
        for (label, obj, strict), before in zip(_WATCHED, self.before):
            now = vars(obj)
            for key, value in before.items():
                if now.get(key, _MISSING) is not value:
                    out.append(f"{label}.{key} (rebound by the file)")
            if strict:
                out += [f"{label}.{key} (added by the file)" for key in now if key not in before]
        return sorted(out)[:16]

    def __enter__(self) -> "Policy":
        self.kernels.__enter__()
        self.functions.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.functions.__exit__(*exc)
        self.kernels.__exit__(*exc)

    def violations(self) -> list[str]:
        if not self.judged:
            return []
        return banned(self.functions.names + self.kernels.names) + self.patched()


_MISSING = object()
