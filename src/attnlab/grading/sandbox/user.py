"""Mode ``user``: where bwrap cannot run (a Gradescope container, usually), a root grader runs
the learner as a fresh unprivileged uid of its own instead.

What that uid gets, and why it is enough for one submission in a container of its own:

* **an identity that owns nothing**: a uid and gid drawn at random from ``[2**30, 2**31)``
  (:func:`.bwrap.unprivileged_uid`), no supplementary groups. It can write only where
  everyone can (``/tmp``); it cannot write the results folder, signal or ptrace the grader
  (another uid), or read what is not world-readable;
* **its own session and process group**, and after each task the server ``kill(-1)``-s every
  process of that uid; when the submission is done :func:`kill_uid` does the same from outside,
  so a daemon is gone before the grader writes ``results.json`` (last, from the parent);
* **the runner only**: the server runs from a fresh copy of the runner's files
  (:func:`runner_copy`), so it never needs to read attnlab's package, which
  :func:`attnlab.grading.classroom.autograder.run_gradescope` makes unreadable to other
  users while it grades, with the bundle and the results folder;
* the process limits and the seccomp filter of :mod:`.server` on every child, and a cgroup
  where one can be made.

It is weaker than bwrap (no namespaces: the learner sees the process list and the network,
and reads what is world-readable), which is why it is used only when the exact bwrap sandbox
fails its self-test, and only as root. Where the Python installation lies under a folder
other users cannot enter (``/root/.pyenv``, a clone in a 0700 ``mktemp -d``),
:class:`Exposure` binds it back into a traversable skeleton in a private mount namespace of
the server, where the kernel allows one (it does not change the host).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from attnlab.grading.sandbox import bwrap as _bwrap

__all__ = ["kill_uid", "remove_as", "runner_copy", "Exposure"]

_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20000, 4096, 16384, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)


def kill_uid(uid: int) -> None:
    """Every process of ``uid`` dies: a fork that becomes ``uid`` and sends ``kill(-1)``
    (which reaches every process of that uid but the sender), until none is left."""
    pid = os.fork()
    if pid == 0:
        try:
            _bwrap.drop_to(uid)
            for _ in range(50):
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    break  # none left
                time.sleep(0.01)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def remove_as(uid: int, path: str) -> None:
    """Remove the folder ``path`` that ``uid``'s server made (its ``/tmp/attnlab-sandbox-*``, left
    when the server is killed), as ``uid`` itself: root never deletes on the learner's behalf, so a
    link planted in it leads nowhere the learner could not go anyway."""
    if not os.path.isabs(path) or os.path.dirname(path) != "/tmp" or \
            not os.path.basename(path).startswith("attnlab-sandbox-"):
        return
    pid = os.fork()
    if pid == 0:
        try:
            _bwrap.drop_to(uid)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


_copy: Optional[str] = None


def runner_copy() -> str:
    """A folder of this process's own (root-owned, 0755) holding the runner's files (0644):
    all that the server needs of attnlab. Removed when this process exits."""
    global _copy
    if _copy is None or not os.path.isdir(_copy):
        folder = tempfile.mkdtemp(prefix="attnlab-runner-")
        for name, host in _bwrap.runner_files().items():
            shutil.copyfile(host, os.path.join(folder, name))
            os.chmod(os.path.join(folder, name), 0o644)
        os.chmod(folder, 0o755)
        atexit.register(shutil.rmtree, folder, True)
        _copy = folder
    return _copy


class Exposure:
    """The Python installation made reachable for the unprivileged uid, without changing the
    host: each folder above it that others cannot enter is covered, in a private mount
    namespace of the server, by a 0755 tmpfs holding only the needed paths, bound back."""

    def __init__(self, paths: list[str]) -> None:
        self.by_blocker: dict[str, list[str]] = {}
        paths = [os.path.realpath(p) for p in paths]
        paths = [p for p in dict.fromkeys(paths) if not any(p != q and p.startswith(q + os.sep) for q in paths)]
        for p in paths:
            b = _bwrap.blocker(p)
            if b is not None:
                self.by_blocker.setdefault(b, []).append(p)
        # a blocker inside another one is covered by the outer one's skeleton
        for b in sorted(self.by_blocker, key=len, reverse=True):
            outer = next((o for o in self.by_blocker if o != b and b.startswith(o + os.sep)), None)
            if outer is not None:
                self.by_blocker[outer] += self.by_blocker.pop(b)

    @staticmethod
    def for_python() -> "Exposure":
        exe = [sys.executable, os.path.realpath(sys.executable)]
        return Exposure(_bwrap.python_roots() + exe)

    def apply(self) -> str:
        """In the forked child, as root, before it drops to the uid: '' when done (or not
        needed), else why not (no mount namespaces here: the paths stay as they are)."""
        if not self.by_blocker:
            return ""
        if _libc.unshare(_CLONE_NEWNS) != 0:
            return f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
        _bwrap.mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        for blocker, paths in sorted(self.by_blocker.items()):
            held = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in paths if os.path.exists(p)]
            _bwrap.mount("tmpfs", blocker, "tmpfs", 0, "size=65536,mode=755")
            for p, fd in held:
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.makedirs(p, mode=0o755, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
                    open(p, "a").close()
                _bwrap.mount(f"/proc/self/fd/{fd}", p, None, _MS_BIND | _MS_REC)
                os.close(fd)
        return ""
