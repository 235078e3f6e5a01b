"""The machine's own facts and limits, measured in the same run as the kernels: its CPU line,
its read bandwidth, its float32 FMA peak and (where the CPU has AVX512_BF16) its bf16 dot-product
peak."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

import torch

__all__ = ["read_bandwidth", "machine_line", "fma_peak", "bf16_peak", "compute_peak", "peaks_for"]

_FMA_SOURCE = Path(__file__).parent / "csrc" / "fma_peak.c"


def _fma_library() -> Optional[ctypes.CDLL]:
    """``csrc/fma_peak.c`` built with this machine's C compiler (``-march=native``) into the
    attnlab cache, keyed by the source and the CPU's flags; None without a compiler."""
    from attnlab.kernels import native as _native

    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    key = hashlib.sha256(_FMA_SOURCE.read_bytes() + " ".join(sorted(_native.cpu_features())).encode()).hexdigest()
    root = _native.cache_root()
    library = root / f"bench-fma-{key[:16]}" / "fma_peak.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        built = subprocess.run([compiler, "-O2", "-march=native", "-shared", "-fPIC", str(_FMA_SOURCE), "-o",
                                str(library)], capture_output=True, text=True)
        if built.returncode != 0:
            return None
    lib = ctypes.CDLL(str(library))
    for fn in (lib.fma_gflops, lib.bf16_gflops):
        fn.restype = ctypes.c_double
        fn.argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_float)]
    return lib


def _loop_peak(name: str, flops_per_iter: int, seconds: float, repeats: int) -> Optional[float]:
    """The best of ``repeats`` runs of ``fma_peak.c``'s loop ``name`` (GFLOP/s of one thread), each
    sized from a short probe to take about ``seconds``; None where the loop does not build or
    reports nothing (the CPU or the build lacks its instructions)."""
    lib = _fma_library()
    if lib is None:
        return None
    loop, sink = getattr(lib, name), ctypes.c_float()
    probe = loop(1_000_000, ctypes.byref(sink))
    if probe <= 0:
        return None
    iters = max(1_000_000, int(seconds * probe * 1e9 / flops_per_iter))  # ~`seconds` at the probe's rate
    return max(loop(iters, ctypes.byref(sink)) for _ in range(repeats))


def fma_peak(seconds: float = 0.3, repeats: int = 3) -> Optional[float]:
    """GFLOP/s of one thread running independent vector FMA chains (the best of ``repeats`` runs
    of about ``seconds`` each): the ceiling of any float32 GEMM on one core. None where it cannot
    be built (no C compiler, no AVX2 + FMA). 102.7 on the 2-core AVX2 EPYC of 2026-12-03
    (2 ymm FMAs per cycle at ~3.2 GHz)."""
    return _loop_peak("fma_gflops", 12 * 2 * 16, seconds, repeats)


def bf16_peak(seconds: float = 0.3, repeats: int = 3) -> Optional[float]:
    """GFLOP/s of one thread running independent 512-bit ``vdpbf16ps`` chains (64 flops an
    instruction; the best of ``repeats`` runs of about ``seconds``): the ceiling of a bf16 GEMM
    on one core. None where the CPU or the build lacks AVX512_BF16, or nothing builds. 234.4 on
    the 2-core Zen 4 of 2026-12-05 (one instruction a cycle at ~3.67 GHz: twice its FMA peak)."""
    return _loop_peak("bf16_gflops", 16 * 64, seconds, repeats)


def compute_peak(dtype: torch.dtype) -> tuple[str, Optional[float]]:
    """``(name, GFLOP/s a thread)``: the arithmetic peak that bounds attention in ``dtype`` here:
    bf16 on ``vdpbf16ps`` where the CPU has it (:func:`bf16_peak`), float64 half the FMA peak
    (half the lanes), everything else the float32 FMA peak (:func:`fma_peak`; float16 and bf16
    without the instruction are computed in float32). The value is None where it cannot be measured."""
    if dtype == torch.bfloat16:
        peak = bf16_peak()
        if peak is not None:
            return "vdpbf16ps peak", peak
    fma = fma_peak()
    if dtype == torch.float64:
        return "float64 FMA peak", fma / 2 if fma is not None else None
    return "FMA peak", fma


def peaks_for(dtypes: Iterable[str]) -> dict[str, tuple[str, Optional[float]]]:
    """:func:`compute_peak` for each dtype named (``"float32"``, ``"bfloat16"``, ...), each peak
    measured once."""
    return {name: compute_peak(getattr(torch, name)) for name in dict.fromkeys(dtypes)}


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """GB/s at which torch's threads read a ``mib`` MiB float32 tensor (``sum``, median of
    ``repeats``): the ceiling a decode step that reads its cache once can reach here."""
    t = torch.ones(mib * 2**20 // 4)
    t.sum()  # pages faulted in, threads started
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - t0)
    return t.numel() * 4 / statistics.median(times) / 1e9


def machine_line() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from attnlab.kernels import native as _native

    # the flags that choose code paths (attnlab's row passes, torch's and oneDNN's GEMMs)
    flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in _native.cpu_features()]
    emulated = ("; NOTE: ATTNLAB_NATIVE_ISA=avx512-emulated, attnlab's times below are of a test build, not this CPU's "
                "speed" if _native.build_isa() == "avx512-emulated" else "")
    from attnlab.kernels import memory, routes

    # whether attnlab's own caches sit on huge pages here (a decode step's page walks: kernels/memory.py)
    mode = memory.huge_pages_offered()
    huge = ("off (ATTNLAB_HUGE_PAGES=off)" if routes.settings().huge_pages == "off"
            else f"on (transparent huge pages: {mode})" if mode else "no (the kernel offers no transparent huge pages)")
    return (f"{cpu} ({' '.join(flags) or 'no AVX2'}), {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, Python {sys.version.split()[0]}; {_native.status()}; "
            f"attnlab's caches on huge pages: {huge}{emulated}")
