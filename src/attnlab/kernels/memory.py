"""Storage for attnlab's own key/value caches, on transparent huge pages where Linux offers them.

A decode step reads its whole cache once, and each 4 KiB page it touches needs a translation:
at S = 32768 keys of 8 bf16 heads of 128 the step crosses 32,768 pages, and in a virtual machine
each miss in the TLB is a two-level walk. Asked for as 2 MiB pages (``madvise(MADV_HUGEPAGE)``,
before the first touch), the same cache needs 64 translations where it needed 32,768. q (1, 32, 4,
128) against (1, 8, 32768, 128) bf16, 2 threads, 2-core EPYC Zen 4 VM (THP ``madvise`` mode),
2026-12-05, the same step on both caches alternated in one process, three rounds: median
9.49-9.85 -> 8.89-9.01 ms (BENCHMARKS.md, "Decoding").

:func:`cache_zeros` and :func:`cache_empty` are what :class:`attnlab.modules.KVCache`,
:class:`attnlab.decoding.PagedKVCache` and the transformers cache allocate with: CPU tensors of at
least :data:`HUGE_PAGE` bytes are placed on a 2 MiB boundary of a slightly larger buffer and that
range is advised; anything else (another device, a small cache, a kernel with THP ``never``, a
platform without ``madvise``, ``ATTNLAB_HUGE_PAGES=off``) gets torch's own allocation. Either way
the tensor is contiguous and holds the same values.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from typing import Optional, Sequence

import torch
from torch import Tensor

from attnlab.kernels import routes as _routes

__all__ = ["HUGE_PAGE", "cache_zeros", "cache_empty", "huge_pages_offered", "huge_page_bytes"]

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page, and the smallest tensor worth one
_MADV_HUGEPAGE = 14  # <sys/mman.h>
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.lru_cache(maxsize=1)
def huge_pages_offered() -> Optional[str]:
    """The kernel's transparent huge page mode when it grants them on request (``"always"`` or
    ``"madvise"``), else None (not Linux, THP ``never``, or the mode unreadable)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    mode = text[text.find("[") + 1:text.find("]")] if "[" in text else ""
    return mode if mode in ("always", "madvise") else None


@functools.lru_cache(maxsize=1)
def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _advise(address: int, length: int) -> bool:
    """``madvise(address, length, MADV_HUGEPAGE)``; False where it is missing or refuses."""
    fn = _madvise()
    return fn is not None and fn(address, length, _MADV_HUGEPAGE) == 0


def cache_empty(shape: Sequence[int], dtype: torch.dtype, device: Optional[torch.device | str] = None) -> Tensor:
    """An uninitialised contiguous tensor of ``shape`` for a key/value cache: on CPU, from
    :data:`HUGE_PAGE` bytes on, its pages advised as huge before anything touches them (the module's
    docstring says why and when); else ``torch.empty``."""
    shape = tuple(int(s) for s in shape)
    # None: torch's default device (torch.set_default_device), as torch.empty takes it
    device = torch.device(device) if device is not None else torch.get_default_device()
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if (device.type != "cpu" or nbytes < HUGE_PAGE or _routes.settings().huge_pages == "off"
            or huge_pages_offered() is None):
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8, device=device)
    start = -raw.data_ptr() % HUGE_PAGE  # bytes to the buffer's first 2 MiB boundary
    # whole huge pages only: madvise rounds nothing, and a partial one at the end stays 4 KiB pages
    _advise(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return raw[start:start + nbytes].view(dtype).view(shape)


def cache_zeros(shape: Sequence[int], dtype: torch.dtype, device: Optional[torch.device | str] = None) -> Tensor:
    """:func:`cache_empty`, zero-filled (the fill is the pages' first touch, after the advice)."""
    return cache_empty(shape, dtype, device).zero_()


def huge_page_bytes(t: Tensor) -> int:
    """How many bytes of the mapping that holds ``t``'s first element are backed by huge pages
    (``AnonHugePages`` of its entry in ``/proc/self/smaps``); 0 where that cannot be read. For
    tests: it says whether the advice took, not where each byte lies."""
    address = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0] if line.strip() else ""
                if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return 0
