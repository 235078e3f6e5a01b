"""The machine's own facts and limits, measured in the same run as the kernels: its CPU line
and its read bandwidth."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

__all__ = ["read_bandwidth", "machine_line"]


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
    return (f"{cpu} ({' '.join(flags) or 'no AVX2'}), {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, Python {sys.version.split()[0]}; {_native.status()}")
