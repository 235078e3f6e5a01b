"""The machine's own facts and limits, measured in the same run as the kernels: its CPU line,
its read bandwidth and its float32 FMA peak."""

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
from typing import Optional

import torch

__all__ = ["read_bandwidth", "machine_line", "fma_peak"]

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
    lib.fma_gflops.restype = ctypes.c_double
    lib.fma_gflops.argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_float)]
    return lib


def fma_peak(seconds: float = 0.3, repeats: int = 3) -> Optional[float]:
    """GFLOP/s of one thread running independent vector FMA chains (the best of ``repeats`` runs
    of about ``seconds`` each): the ceiling of any float32 GEMM on one core. None where it cannot
    be built (no C compiler, no AVX2 + FMA). 102.7 on the 2-core AVX2 EPYC of 2026-12-03
    (2 ymm FMAs per cycle at ~3.2 GHz)."""
    lib = _fma_library()
    if lib is None:
        return None
    sink = ctypes.c_float()
    probe = lib.fma_gflops(1_000_000, ctypes.byref(sink))
    if probe <= 0:
        return None
    iters = max(1_000_000, int(seconds * probe * 1e9 / (12 * 2 * 16)))  # ~`seconds` at the probe's rate
    return max(lib.fma_gflops(iters, ctypes.byref(sink)) for _ in range(repeats))


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
