"""Frames on a pipe: a length (8 bytes, little-endian), then the bytes. Package-internal,
shared by the grader (:mod:`.sandbox`, :mod:`.launch`) and the servers in the sandbox
(:mod:`.sandbox`, :mod:`.template`); no torch, so :mod:`.launch` stays light. Reads on the
grader's side take a deadline: a stuck or hostile server cannot block it.
"""

from __future__ import annotations

import os
import select
import struct
import time
from typing import Optional

__all__ = ["Deadline", "write_frame", "read_exact", "read_frame"]


class Deadline(Exception):
    """A read did not complete in time."""


def write_frame(fd: int, data: bytes) -> None:
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd: int, n: int, deadline: Optional[float]) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Deadline()
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the sandbox server closed the channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, limit: int, deadline: Optional[float] = None) -> bytes:
    (n,) = struct.unpack("<Q", read_exact(fd, 8, deadline))
    if n > limit:
        raise ValueError(f"a frame of {n} bytes is over the limit of {limit}")
    return read_exact(fd, n, deadline)
