"""Peak resident memory of one step, measured in this process (``VmHWM`` over a baseline)."""

from __future__ import annotations

from typing import Callable

__all__ = ["peak_rss_growth"]


def _proc_status_bytes(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field_name} in /proc/self/status")


def _release_freed_heap() -> None:
    """Hand memory that was freed but kept by glibc's allocator back to the system, so the
    baseline is what is live: otherwise a step that reuses temporaries freed before it (a
    block mask's construction, say) reads as needing almost nothing (0.1 MiB measured for a
    forward+backward that allocates ~200 MiB)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the measurement is an upper bound on reuse, as before


def peak_rss_growth(step: Callable[[], object]) -> int:
    """How far ``step()`` raises this process's peak resident memory above its current one, in bytes.

    Uses the peak of *this* address space (``VmHWM``, reset through ``/proc/self/clear_refs``)
    rather than ``ru_maxrss``, which Linux carries over from the parent across fork and
    exec, so a child of a big process would read that parent's size as its own.
    """
    _release_freed_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    baseline = _proc_status_bytes("VmRSS")
    step()
    return max(0, _proc_status_bytes("VmHWM") - baseline)
