"""Which code the native kernels run: the switches, read once, and the plan of one call.

The process-wide switches come from the environment, read once (at the first call that needs
one) into one frozen :class:`Settings`:

==========================  ==========================================================
``ATTNLAB_NATIVE``          ``1`` (default) or ``0``: the native kernels, or the pure path
``ATTNLAB_NATIVE_ISA``      ``native`` or ``avx512-emulated``: which build is loaded
``ATTNLAB_BF16``            ``auto``, ``bf16``, ``bf16-emulated``, ``fp32``
``ATTNLAB_SGEMM``           ``auto``, ``avx512``, ``avx2``, ``avx512-emulated``, ``blas``
``ATTNLAB_DECODE``          ``auto``, ``stream``, ``gemm``: decoding's inner loop
``ATTNLAB_INT8_DOT``        ``auto``, ``int16``, ``float32``: an int8 cache's dot products
``ATTNLAB_HUGE_PAGES``      ``auto`` or ``off``: attnlab's caches on huge pages (memory.py)
==========================  ==========================================================

Code that wants another route for a while (tests, ``attnlab bench``'s forced rows) uses
:func:`forced`, not the environment: ``with routes.forced(bf16="fp32"): ...``. The routes of
a call are then decided from these settings by one function each
(:func:`attnlab.kernels.native.bf16_route`, :func:`~attnlab.kernels.native.sgemm_route`,
:func:`attnlab.kernels.decode.plan`), and :func:`explain` says in words what a call takes.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Iterator, Optional

__all__ = ["Settings", "CHOICES", "ENV", "settings", "reload", "forced", "explain"]

# every switch's choices, the default first
CHOICES: dict[str, tuple[str, ...]] = {
    "native": ("1", "0"),
    "isa": ("native", "avx512-emulated"),
    "bf16": ("auto", "bf16", "bf16-emulated", "fp32"),
    "sgemm": ("auto", "avx512", "avx2", "avx512-emulated", "blas"),
    "decode": ("auto", "stream", "gemm"),
    "int8_dot": ("auto", "int16", "float32"),
    "huge_pages": ("auto", "off"),
}
ENV = {"native": "ATTNLAB_NATIVE", "isa": "ATTNLAB_NATIVE_ISA", "bf16": "ATTNLAB_BF16", "sgemm": "ATTNLAB_SGEMM",
       "decode": "ATTNLAB_DECODE", "int8_dot": "ATTNLAB_INT8_DOT", "huge_pages": "ATTNLAB_HUGE_PAGES"}
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    """The switches of the native layer (the defaults: everything chosen from the CPU)."""

    native: str = "1"
    isa: str = "native"
    bf16: str = "auto"
    sgemm: str = "auto"
    decode: str = "auto"
    int8_dot: str = "auto"
    huge_pages: str = "auto"

    def source(self, name: str) -> str:
        """How a forced value reads in a route's reason: ``ATTNLAB_BF16=fp32``."""
        return f"{ENV[name]}={getattr(self, name)}"


def _checked(name: str, value: str) -> str:
    value = value.strip().lower() or CHOICES[name][0]
    if name == "native":
        value = "0" if value in _OFF else "1"
    if name == "huge_pages" and value in _OFF:
        value = "off"
    if value not in CHOICES[name]:
        raise ValueError(f"{ENV[name]} must be one of {', '.join(CHOICES[name])}, got {value!r}")
    return value


def _from_environment() -> Settings:
    return Settings(**{f.name: _checked(f.name, os.environ.get(ENV[f.name], "")) for f in fields(Settings)})


_lock = threading.Lock()
_current: Optional[Settings] = None


def settings() -> Settings:
    """The switches now: the environment's, read at the first call, unless :func:`forced` is active.

    Raises:
        ValueError: a variable holds a value that is not one of its choices (named, with them).
    """
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = _from_environment()
    return _current


def reload() -> Settings:
    """Read the environment again (for a program that set a variable after attnlab read them)."""
    global _current
    fresh = _from_environment()
    with _lock:
        _current = fresh
    return fresh


@contextmanager
def forced(**changes: str) -> Iterator[Settings]:
    """Run a block with some switches changed, e.g. ``forced(bf16="fp32", decode="stream")``; the
    settings before are restored after it. ``native`` and ``isa`` decide what is loaded, once: forced
    after the first load they change the names (the cache folder, the bench's machine line), not
    the library in use.

    Raises:
        ValueError: an unknown switch, or a value not among its choices.
    """
    global _current
    unknown = set(changes) - set(CHOICES)
    if unknown:
        raise ValueError(f"forced: the switches are {', '.join(CHOICES)}, got {', '.join(sorted(unknown))}")
    before = settings()
    new = replace(before, **{n: _checked(n, str(v)) for n, v in changes.items()})
    with _lock:
        _current = new
    try:
        yield new
    finally:
        with _lock:
            _current = before


def explain(query, key, value, *, cache: bool = False) -> str:
    """In words, what the native layer runs for these operands now: whether the native kernels
    take the call, the float32 GEMM or the bf16 route, and, for a decode call (``cache=True``:
    ``query (B, H, L, E)`` against a cache ``key``/``value`` ``(B, Hkv, S, E|Ev)``), its inner loop
    and the instructions of its dot products.

    Example: ``native kernels; float32 GEMM: avx2 (this CPU has avx2 and fma); decode: stream
    loop (4 rows per key/value head), dot products: float32 FMAs``.
    """
    import torch

    from attnlab.kernels import decode as _decode
    from attnlab.kernels import native as _native

    if _native.ops() is None:
        return f"the pure-PyTorch path ({_native.status().detail})"
    bf16 = torch.bfloat16 in (query.dtype, key.dtype)
    out_dtype = query.dtype  # decoding's output (a bf16 one lets the value pass round P: decode.bf16_values)
    if cache:  # decoding: the query reaches the kernel as float32
        query = query.float()
    if not cache:  # bfloat16 reaches the kernels as bf16, or widened to float32 (the bf16 route says)
        dtype = _native.operand_dtype(query.dtype)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if not _native.can_run(query, key, value, cache=cache):
        return "the pure-PyTorch path (the native kernels do not take these operands)"
    parts = ["native kernels"]
    if bf16:
        parts.append(str(_native.bf16_route()))
    gemm = _native.sgemm_route()
    parts.append(f"float32 GEMM: {gemm.name} ({gemm.reason})")
    if cache:
        plan = _decode.plan(query.shape[1] // key.shape[1] * query.shape[2], query.shape[-1], key.dtype,
                            out_dtype, value.shape[-1])
        parts.append(f"decode: {plan.loop} loop ({plan.rows} rows per key/value head), dot products: {plan.dots}")
    return "; ".join(parts)
