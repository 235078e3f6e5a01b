"""The OS sandbox of one submission: the ``bwrap`` command line, the identity it runs as, its seccomp filter.

What a submission's processes see and are (:func:`plan`):

* new user, pid, network, IPC, UTS and cgroup namespaces (``--unshare-all``), so no
  network at all (not even loopback to the host), and every process the submission
  starts lives in a pid namespace that dies with the server (``--die-with-parent``
  plus the namespace's init: nothing outlives its grading); no nested user namespaces
  (``--disable-userns`` where bwrap has it, and the seccomp filter);
* **an identity that owns nothing on the host.** When the grader runs as root (Gradescope,
  CI, containers), bwrap itself is started as a fresh unprivileged uid and gid, drawn at
  random from ``[2**30, 2**31)`` for each sandbox, with no supplementary groups: the
  sandbox's uid 65534 maps to that uid, which owns no host file and no device node (a
  ``chmod /dev/null`` inside is ``EPERM``). The grader's own user otherwise (a learner on
  their laptop: a user namespace cannot map to anybody else);
* the system (``/usr``, the dynamic loader's cache), the Python installation and the
  virtual environment's ``site-packages`` bound **read-only**, and the runner
  (:data:`RUNNER_FILES`, at ``/runner``): **nothing of attnlab** (where attnlab is
  installed inside a bound ``site-packages``, an empty read-only tmpfs covers its folder),
  not ``$HOME``, not the output folder, not other submissions, not ``/etc`` beyond the
  loader's files;
* a fresh ``/dev`` (bwrap's: ``null``, ``zero``, ``full``, ``random``, ``urandom``, ``tty``
  and a new devpts instance), read-only; ``/tmp`` and ``/dev/shm`` are private, size-capped
  tmpfs, the only writable places: whatever the submission writes is gone when its grading ends;
* the environment cleared (no secrets in environment variables), all capabilities dropped,
  a new session (no terminal to write into);
* the seccomp filter of :mod:`.seccomp` on every process in the sandbox (``--seccomp``) except
  the class template's, which must still make each submission's namespaces (its forks install
  it before any learner code: :mod:`.server`).

Bind sources under a folder the unprivileged uid cannot enter (a fresh clone in a 0700
``mktemp -d``) are staged first, as root, in a private mount namespace of the process that
becomes bwrap: each one is held open, a tmpfs is mounted over ``/tmp`` there, and each is bound
from its descriptor into it (:data:`STAGE`); bwrap binds them from there. Nothing of the
host's mount table or of its ``/tmp`` changes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import secrets
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

__all__ = ["bwrap_path", "python_roots", "hidden_package", "hidden_paths", "runner_files", "plan", "Plan", "HOW_TO_GET_BWRAP",
           "TMP_MB", "UID", "RUNNER", "RUNNER_FILES", "tmp_roots", "unprivileged_uid", "drop_to", "mount", "blocker", "can_stage"]

HOW_TO_GET_BWRAP = ("install bubblewrap (Debian/Ubuntu: 'sudo apt-get install bubblewrap'; Fedora: "
                    "'sudo dnf install bubblewrap'); it needs user namespaces, which most Linux desktops allow. "
                    "macOS has no bwrap: grade other people's code in a Linux VM or on Gradescope")

TMP_MB = 64  # size of the private /tmp and /dev/shm: learner files, the submission copy
UID = 65534  # "nobody" inside the sandbox
RUNNER = "/runner"  # where the runner's files are, inside
# what is bound there, read-only: the server and what it imports, nothing else of attnlab
RUNNER_FILES = ("server.py", "protocol.py", "frames.py", "seccomp.py", "recorder.py", "template.py",
                "interpreter.py", "launchers.py", "harness.py", "calls.py")
STAGE = "/tmp/attnlab-stage"  # under a private tmpfs on /tmp, in the mount namespace of the process that becomes bwrap
_UID_RANGE = (1 << 30, 1 << 31)  # unassigned on any distribution (useradd stops at 60000; systemd's dynamic range < 2**17)

_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_RDONLY, _MS_REMOUNT = 0x20000, 4096, 16384, 1 << 18, 1, 32


def bwrap_path() -> Optional[str]:
    """The ``bwrap`` executable, or None. ``ATTNLAB_BWRAP`` overrides the lookup ('' = none)."""
    if "ATTNLAB_BWRAP" in os.environ:
        value = os.environ["ATTNLAB_BWRAP"]
        return value if value and os.access(value, os.X_OK) else None
    return shutil.which("bwrap")


@lru_cache(maxsize=8)
def _bwrap_options(bwrap: str) -> frozenset[str]:
    """The options this bwrap knows (``--disable-userns`` arrived in 0.8)."""
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(w for w in text.split() if w.startswith("--"))


def hidden_package() -> Optional[str]:
    """attnlab's own package folder, when it lies inside a folder the sandbox binds (a wheel
    in ``site-packages``): covered by an empty tmpfs inside. None for a checkout's ``src/``."""
    spec = importlib.util.find_spec("attnlab")
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = os.path.realpath(list(spec.submodule_search_locations)[0])
    return pkg if any(pkg.startswith(r + os.sep) for r in python_roots()) else None


def hidden_paths() -> list[str]:
    """What of a bound folder the sandbox covers with an empty tmpfs: attnlab's package
    (:func:`hidden_package`) and its data under ``<prefix>/share/attnlab``, where a wheel
    puts the labs' materials and their solutions (``attnlab labs get NN --solution``)."""
    paths = [p for p in (hidden_package(),) if p is not None]
    for prefix in {sys.prefix, sys.base_prefix}:
        share = os.path.realpath(os.path.join(prefix, "share", "attnlab"))
        if os.path.isdir(share) and any(share.startswith(r + os.sep) for r in python_roots()):
            paths.append(share)
    return sorted(set(paths))


def python_roots() -> list[str]:
    """Folders the server's Python needs, read-only: the installation and the venv's
    site-packages. Never attnlab's package, the current folder, or a checkout's root (it
    holds ``labs/.../solutions``)."""
    import sysconfig

    roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p and os.path.isdir(p):
            roots.add(os.path.realpath(p))
    # site-packages folders a .pth file added (an environment layered on another one)
    for entry in sys.path:
        if os.path.basename(entry.rstrip(os.sep)) in ("site-packages", "dist-packages") and os.path.isdir(entry):
            roots.add(os.path.realpath(entry))
    # drop a root that lies inside another one
    ordered = sorted(roots, key=len)
    kept: list[str] = []
    for r in ordered:
        if not any(r == k or r.startswith(k + os.sep) for k in kept):
            kept.append(r)
    return kept


def runner_files() -> dict[str, str]:
    """``{name inside /runner: host path}``: the runner, and nothing else of the package."""
    here = Path(__file__).resolve().parent
    return {name: str(here / name) for name in RUNNER_FILES}


def unprivileged_uid() -> int:
    """A fresh uid (and gid) for one sandbox: unassigned, so it owns no host file."""
    return _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0])


# capability numbers (linux/capability.h) of what becoming another uid needs
_CAPS = {"SETGID": 6, "SETUID": 7}


def lacking_capabilities(names: tuple[str, ...] = ("SETUID", "SETGID")) -> list[str]:
    """Which of ``names`` this process's effective set lacks (a container started with
    ``--cap-drop``): without CAP_SETUID and CAP_SETGID a root grader cannot :func:`drop_to` a uid,
    and the fork would fail with nothing but "Exception occurred in preexec_fn"."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("CapEff:"))
        eff = int(line.split()[1], 16)
    except (OSError, StopIteration, ValueError, IndexError):
        return []  # no /proc: nothing known, the start itself says what fails
    return [n for n in names if not eff >> _CAPS[n] & 1]


def drop_to(uid: int) -> None:
    """This process (root) becomes ``uid``:``uid`` with no supplementary groups, for good."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


_libc = ctypes.CDLL(None, use_errno=True)


def mount(source: Optional[str], target: str, fstype: Optional[str], flags: int, data: Optional[str] = None) -> None:
    """mount(2), raising OSError; package-internal (the staging here, :mod:`.user`'s exposure)."""
    if _libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                   flags, data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


@dataclass
class Plan:
    """How to start one sandbox: the command line, and what the forked process does before
    it execs bwrap (:meth:`preexec`: the cgroup, the staged binds, the identity)."""

    argv: list[str]
    uid: Optional[int] = None  # the host uid bwrap runs as; None: the grader's own
    stage: Optional[str] = None  # where the staged binds go, in bwrap's private mount namespace (root only)
    staged: list[tuple[str, str]] = field(default_factory=list)  # (host path, name under stage)
    pass_fds: tuple[int, ...] = ()
    enter_cgroup: Optional[Callable[[], None]] = None
    identity: str = "the grader's own user (a user namespace maps to nobody else)"

    def preexec(self) -> None:  # in the forked child, before exec: no learner code is anywhere near
        if self.enter_cgroup is not None:
            self.enter_cgroup()
        if self.stage is not None:
            if _libc.unshare(_CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
            mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates to the host
            # each source held by an O_PATH descriptor (of this namespace's copy of its mount)
            # before anything is mounted over /tmp
            held = [os.open(source, os.O_PATH | os.O_CLOEXEC) for source, _ in self.staged]
            # a private tmpfs over /tmp, in this namespace only: the host's /tmp gets no stage folder
            mount("tmpfs", "/tmp", "tmpfs", 0, "size=65536,mode=755")
            os.mkdir(self.stage)
            for fd, (source, name) in zip(held, self.staged):
                target = os.path.join(self.stage, name)
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.mkdir(target)
                else:
                    open(target, "w").close()
                mount(f"/proc/self/fd/{fd}", target, None, _MS_BIND | _MS_REC)
                os.close(fd)
        if self.uid is not None:
            drop_to(self.uid)


def blocker(path: str) -> Optional[str]:
    """The topmost folder above ``path`` that other users cannot enter, or None (package-internal)."""
    parts = Path(path).parts
    for i in range(1, len(parts)):
        folder = str(Path(*parts[:i]))
        try:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return folder
        except OSError:
            return None
    return None


@lru_cache(maxsize=1)
def can_stage() -> bool:
    """Whether this (root) process may make a mount namespace of its own: a container without
    CAP_SYS_ADMIN may not, while bwrap still runs there through a user namespace."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _libc.unshare(_CLONE_NEWNS) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _root_identity() -> tuple[Optional[int], Optional[str], str]:
    """For a root grader: ``(uid bwrap runs as, stage, in words)``. A fresh uid, its bind sources
    staged where a mount namespace can be made; unstaged where every source is open to other
    users anyway; else (a source under a 0700 folder, no mount namespace) the grader's own uid,
    as before this design, and it says so."""
    uid = unprivileged_uid()
    fresh = f"a fresh unprivileged uid ({uid}) that owns nothing on the host"
    if can_stage():
        return uid, STAGE, fresh
    sources = python_roots() + [sys.executable, os.path.realpath(sys.executable)] + list(runner_files().values())
    if all(blocker(p) is None for p in sources):
        return uid, None, fresh
    return None, None, ("the grader's own uid, root: no mount namespace can be made here to stage the Python "
                        "installation, which lies under a folder other users cannot enter")


def plan(bwrap: str, inside: list[str], *, template: bool = False, seccomp_fd: Optional[int] = None) -> Plan:
    """The sandbox described above, running ``inside`` (paths as the sandbox sees them: the
    runner is at :data:`RUNNER`). ``template``: the class template's (nested user namespaces
    stay possible for its forks, no seccomp at this level)."""
    result = Plan(argv=[])
    if os.geteuid() == 0:
        result.uid, result.stage, result.identity = _root_identity()

    def source(host: str) -> str:
        """Where bwrap finds ``host``: itself, or its staged copy when bwrap runs unprivileged."""
        if result.stage is None:
            return host
        name = str(len(result.staged))
        result.staged.append((host, name))
        return os.path.join(result.stage, name)

    options = _bwrap_options(bwrap)
    cmd = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
           "--uid", str(UID), "--gid", str(UID), "--hostname", "attnlab-sandbox"]
    if not template and "--disable-userns" in options:
        cmd += ["--disable-userns"]
    if not template and "--as-pid-1" in options:
        # the server itself is pid 1: bwrap's own init would otherwise be a process in the
        # sandbox with no seccomp filter, dumpable, holding the grader's request and reply pipes
        cmd += ["--as-pid-1"]
    # the private, writable places first: a checkout or venv under /tmp is then bound on top
    size = str(TMP_MB * 1024 * 1024)
    cmd += ["--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
            "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev"]  # a fresh /dev, read-only: no file there for one submission to leave another
    cmd += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/" + top)
        if p.is_symlink():
            cmd += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            cmd += ["--ro-bind", str(p), str(p)]
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"):
        if os.path.exists(f):
            cmd += ["--ro-bind", f, f]
    roots = python_roots()
    for root in roots:
        if not root.startswith("/usr/"):
            cmd += ["--ro-bind", source(root), root]
    for exe in {sys.executable, os.path.realpath(sys.executable)}:
        if not any(exe.startswith(r + os.sep) for r in roots) and not exe.startswith("/usr/"):
            cmd += ["--ro-bind", source(exe), exe]
    for hidden in hidden_paths():
        cmd += ["--perms", "0555", "--size", "4096", "--tmpfs", hidden, "--remount-ro", hidden]
    for name, host in runner_files().items():
        cmd += ["--ro-bind", source(host), f"{RUNNER}/{name}"]
    if seccomp_fd is not None and not template:
        cmd += ["--seccomp", str(seccomp_fd)]
        result.pass_fds = (seccomp_fd,)
    cmd += ["--chdir", "/tmp", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "OMP_NUM_THREADS", "1",
            "--setenv", "ATTNLAB_NATIVE", "0",
            # lab 05's Triton kernels run in Triton's interpreter (NumPy, in this process): nothing is
            # compiled, so no compiler, cache directory or launcher is needed, and none is given
            "--setenv", "TRITON_INTERPRET", "1",
            "--remount-ro", "/",  # the skeleton bwrap built (mount points' parents) is read-only too
            "--"]
    result.argv = cmd + inside
    return result


def tmp_roots() -> list[str]:
    """What :func:`plan` binds under /tmp (the class template carries these across each
    submission's new /tmp), as JSON-ready paths inside the sandbox."""
    roots = [r for r in python_roots() if r.startswith("/tmp/")]
    for exe in {sys.executable, os.path.realpath(sys.executable)}:
        if exe.startswith("/tmp/") and not any(exe.startswith(r + os.sep) for r in roots):
            roots.append(exe)
    return roots

