"""The class template: one sandboxed interpreter imports torch once and forks each
submission's sandbox server into namespaces of its own.

Why: grading a class, a fresh ``bwrap`` per submission costs one interpreter start and one
``import torch`` each, 2.6-3.4 s of CPU on a 2-core machine (measured for issue 15: 100
submissions took 200 s with ``--jobs 2``, ~150 s of it importing torch). Here the import
happens once; each submission costs a ``fork`` and a few system calls.

The isolation each submission gets is the per-submission ``bwrap``'s, rebuilt below the
template (:func:`_enter_namespaces`), and checked by the hostile suite through this path:

* The template itself runs in ``bwrap`` exactly as a per-submission server does (read-only
  system and Python, nothing of the host's files, no network, a new pid namespace, an
  unprivileged uid, no capabilities). It runs no learner code and reads only the grader's
  requests, on a socket no submission holds (each fork closes every descriptor but its two
  pipes before anything else).
* Each submission gets, before any of its code runs: a new **user** namespace (its uid mapped
  to itself, nothing else), new **mount**, **pid**, **network**, **IPC** and **UTS**
  namespaces; a fresh size-capped tmpfs on ``/tmp`` and ``/dev/shm`` (the template's, and
  other submissions', are not visible); an empty read-only tmpfs over ``/proc`` (the
  template's ``/proc`` shows the other submissions' processes; a new proc cannot be mounted
  under bwrap's read-only overmounts, and the learner can neither unmount it nor mount one
  of their own, mounts inherited into a less privileged namespace being locked by the
  kernel); every capability dropped from the effective, permitted, inheritable and bounding
  sets, and ``no_new_privs``.
* Inside, the layout is bwrap's: an init (pid 1, reaping, holding no learner code, which
  processes in its namespace cannot signal) and the sandbox server (:func:`.server.serve`)
  that forks one child per exercise and ``kill(-1)``-s the namespace after each. The
  init dies with the fork the template made (``PR_SET_PDEATHSIG``), and the whole
  namespace with the init; the grader moves that fork into the submission's cgroup
  before it enters anything, so memory and process caps hold for all of it.

Where a nested user namespace cannot be made (a kernel or container that forbids it), the
template says so when it starts and the grader falls back to one ``bwrap`` per submission
(:class:`.pool.class_template`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import struct
import sys
import traceback

try:  # a runner file (bound into the sandbox beside server.py); in the grader, a package module
    from . import frames, server
except ImportError:  # python -I puts no script folder on sys.path: the runner's own folder, only
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import frames  # type: ignore[no-redef]
    import server  # type: ignore[no-redef]

__all__ = ["serve_template", "TMP_BYTES"]

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
CAP_LAST = 63  # dropping past the kernel's last capability fails harmlessly (EINVAL)
TMP_BYTES = 64 * 1024 * 1024  # as bwrap.TMP_MB

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                       data.encode() if data else None), f"mount {target}")


def _drop_capabilities() -> None:
    """No capability left in any set, none to regain (no_new_privs)."""
    for cap in range(CAP_LAST + 1):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last one: ignored
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (Data * 2)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _enter_namespaces() -> None:
    """This process (a fresh fork of the template) gets its own user, mount, pid, network,
    IPC and UTS namespaces and private /tmp and /dev/shm. Runs before any learner code."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS),
           "unshare(mount, pid, net, ipc, uts)")
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    # A Python environment or checkout under /tmp (a fresh clone in CI, a venv made by mktemp)
    # is bound read-only on top of the template's /tmp: carry those mounts across the new /tmp,
    # staged in the new /dev/shm (the only other writable place) and moved back.
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMP_BYTES},mode=1777")
    kept = [(root, os.path.isdir(root)) for root in _tmp_roots()]
    if kept:
        os.mkdir("/dev/shm/.stage")
    for i, (root, is_dir) in enumerate(kept):
        _mount_point(f"/dev/shm/.stage/{i}", is_dir)
        _mount(root, f"/dev/shm/.stage/{i}", None, MS_BIND | MS_REC)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMP_BYTES},mode=1777")
    # a pty of one submission is not another's: a devpts instance of its own (/dev/ptmx links to pts/ptmx)
    _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    for i, (root, is_dir) in enumerate(kept):
        _mount_point(root, is_dir)
        _mount(f"/dev/shm/.stage/{i}", root, None, MS_MOVE)
        _mount("none", root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        (os.rmdir if is_dir else os.unlink)(f"/dev/shm/.stage/{i}")
    if kept:
        os.rmdir("/dev/shm/.stage")


def _mount_point(path: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()


_TMP_ROOTS: list[str] = []  # what the template's bwrap bound under /tmp (given on its command line)


def _tmp_roots() -> list[str]:
    """The Python roots and the interpreter that the grader bound under /tmp (:func:`.bwrap.bwrap_command`)."""
    return [r for r in _TMP_ROOTS if os.path.exists(r)]


def _hide_proc() -> None:
    """An empty read-only tmpfs over /proc (see the module's note)."""
    _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4096,mode=555")


def _init(server: int) -> None:
    """Pid 1 of the submission's namespace: reap until the server exits, then exit (the
    kernel then kills whatever is left in the namespace)."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        if pid == server:
            os._exit(0)


def _submission(request_fd: int, reply_fd: int) -> None:
    """The fork the template made for one submission. Waits for the grader's ``go`` (it has
    moved this process into the submission's cgroup by then), enters the namespaces, and
    runs bwrap's layout inside: an init, and the sandbox server."""
    read_frame, write_frame = frames.read_frame, frames.write_frame

    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if read_frame(request_fd, 16) != b"go":  # from the grader: trusted
        os._exit(2)
    try:
        _enter_namespaces()
    except OSError as exc:
        write_frame(reply_fd, f"failed {exc}".encode()[:500])
        os._exit(3)
    init = os.fork()
    if init != 0:  # this fork: wait for the namespace's init, then go
        os.close(request_fd)
        os.close(reply_fd)
        _, status = os.waitpid(init, 0)
        os._exit(0)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # pid 1 dies with the template's fork
    server_pid = os.fork()
    if server_pid != 0:
        os.close(request_fd)
        os.close(reply_fd)
        _drop_capabilities()
        _init(server_pid)
    try:
        status_fd = os.open("/proc/self/status", os.O_RDONLY)  # the server's own, before /proc is hidden
        _hide_proc()
        _drop_capabilities()
    except OSError as exc:  # the grader reads this instead of "ready", and says why the sandbox did not start
        write_frame(reply_fd, f"failed {exc}".encode()[:500])
        os._exit(3)
    server.serve(request_fd, reply_fd, sandboxed=True, status_fd=status_fd)
    os._exit(0)


def _probe() -> str:
    """'' when a fork can enter the namespaces here, else why not."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _enter_namespaces()
            _hide_proc()
            os.write(w, b"ok")
        except BaseException as exc:  # noqa: BLE001 (reported to the grader)
            os.write(w, str(exc).encode()[:300])
        os._exit(0)
    os.close(w)
    answer = os.read(r, 400).decode(errors="replace")
    os.close(r)
    os.waitpid(pid, 0)
    return "" if answer == "ok" else answer or "the probe died"


def serve_template(control_fd: int, tmp_roots: list[str] = ()) -> None:
    """The template's loop, on a SOCK_SEQPACKET socket from the grader: each ``spawn``
    message carries two pipe ends (the new server's request and reply channels) and is
    answered with the fork's pid in this namespace; the grader then sends ``go`` down the
    request pipe. ``tmp_roots``: what the grader bound under /tmp, to carry across each
    submission's new /tmp."""
    import torch

    _TMP_ROOTS[:] = list(tmp_roots)
    server.prepare()
    # the lazy parts of torch's CPU start (thread pools, the GEMM dispatch), once for all
    a = torch.randn(64, 64)
    (a @ a).exp().sum().item()

    control = socket.socket(fileno=control_fd)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    problem = _probe()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # from now on the kernel reaps the forks
    control.send(b"ready" if not problem else b"unsupported " + problem.encode()[:400])
    if problem:
        return
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 64, 2)
        except OSError:
            return
        if not msg:
            return  # the grader closed the socket
        if msg != b"spawn" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            control.send(b"error")
            continue
        pid = os.fork()
        if pid == 0:
            try:
                keep = set(fds)
                os.closerange(3, min(fds))
                for fd in range(min(fds) + 1, max(fds)):
                    if fd not in keep:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                os.closerange(max(fds) + 1, 1 << 16)
                _submission(*fds)
            except BaseException as exc:  # noqa: BLE001 (the grader reads it instead of "ready")
                try:
                    frames.write_frame(fds[1], f"failed {type(exc).__name__}: {exc}".encode()[:500])
                except OSError:
                    pass
            finally:
                os._exit(70)
        for fd in fds:
            os.close(fd)
        control.send(struct.pack("<q", pid))


if __name__ == "__main__":  # pragma: no cover (python -I -B template.py FD ROOTS-JSON, from pool.class_template)
    serve_template(int(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else [])
