"""The submission's bytes, read once: what is checked, run, hashed and signed is this one read.

A learner controls the file at the path, and may swap it between two looks at it (a checked
stub for an unchecked one, a FIFO that blocks the reader, a symbolic link to the solution
kept root-only in a Gradescope bundle). So the grader never looks twice and never follows:

* :func:`read_submission` opens the path once, ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO opens
  without blocking and is then refused), each folder between ``within`` and the file opened
  ``O_NOFOLLOW | O_DIRECTORY`` from the one before, so no symbolic link anywhere below
  ``within`` is followed, and a root grader opens only a real file inside the folder it was
  given;
* ``fstat`` on that descriptor must show a regular file of at most :data:`MAX_SOURCE_BYTES`,
  before anything is read; then at most one byte more than the cap is read, so a file that grows
  is refused as well. A file with several hard links is read like any other (issue 61: an
  instructor's ``cp -al`` backup beside the class folder gave every honest file 2 links, and each
  was refused): this one read is the copy that is checked and run, and a learner cannot make a
  link on the grading machine to a file they could not read;
* the bytes come back with their SHA-256 (:class:`SubmissionBytes`): the static check, the
  sandbox's copy, the class gradebook's hash and the signed resume row all use these bytes
  and this digest, and nothing reads the path again.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

__all__ = ["MAX_SOURCE_BYTES", "SubmissionBytes", "Unreadable", "read_submission", "digest", "printable"]

MAX_SOURCE_BYTES = 1 << 20  # a submission file (the largest honest lab file is ~20 KB)
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


class Unreadable(OSError):
    """The submission cannot be read as a submission; ``str()`` says why, for the learner."""


@dataclass(frozen=True)
class SubmissionBytes:
    """One read of a submission: its bytes and their SHA-256 (hex)."""

    data: bytes
    sha256: str


def digest(data: bytes) -> str:
    """The SHA-256 of ``data``, hex: what the gradebook keeps and signs."""
    return hashlib.sha256(data).hexdigest()


def _open_beneath(path: Path, within: Optional[Path]) -> int:
    """A descriptor of ``path``, no link followed: below ``within`` (each folder opened
    ``O_NOFOLLOW | O_DIRECTORY`` from the last), or just the last component when ``within`` is None."""
    if within is None:
        return os.open(path, _FLAGS)
    try:  # the names as given (abspath does not resolve links): each one is opened without following
        given = Path(os.path.abspath(path)).relative_to(Path(os.path.abspath(within))).parts
    except ValueError:
        given = ()
    if not given or ".." in given:
        raise Unreadable(f"{path} is not inside {within}")
    fd = os.open(within, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in given[:-1]:
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(given[-1], _FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


def read_submission(path: os.PathLike, within: Optional[os.PathLike] = None,
                    max_bytes: int = MAX_SOURCE_BYTES) -> SubmissionBytes:
    """Read the submission at ``path`` once (see the module's docstring).

    Args:
        path: the learner's file.
        within: a folder ``path`` lies in (a class folder, Gradescope's ``submission/``): no link
            below it is followed. None: only the file itself must not be a link.
        max_bytes: the size cap, checked on the descriptor before reading.

    Raises:
        Unreadable: a symbolic link, a FIFO, a device, a folder, a file over the cap, or one that
            cannot be opened; the message says which.
    """
    path = Path(path)
    try:
        fd = _open_beneath(path, Path(within) if within is not None else None)
    except Unreadable:
        raise
    except OSError as exc:
        if exc.errno in (getattr(os, "ELOOP", 40), getattr(os, "ENOTDIR", 20)) and (path.is_symlink() or within):
            raise Unreadable(f"{path.name} is (or lies under) a symbolic link, which the grader does not follow: "
                             "submit the file itself") from None
        raise Unreadable(f"could not open {path.name}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise Unreadable(f"{path.name} is {kind}, not a regular file")
        if st.st_size > max_bytes:
            raise Unreadable(f"{path.name} is {st.st_size:,} bytes; a lab file is at most {max_bytes:,}")
        os.set_blocking(fd, True)
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise Unreadable(f"{path.name} is larger than {max_bytes:,} bytes (it grew while it was read)")
        return SubmissionBytes(data, digest(data))
    finally:
        os.close(fd)


def printable(path: Any) -> str:
    """A path (a learner names their file and folder) as it may be printed: the output
    boundary's :func:`attnlab.grading.output.sanitise`."""
    from attnlab.grading.output import sanitise

    return sanitise(path)
