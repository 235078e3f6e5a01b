"""The seccomp filter on every process that runs learner code: an **allow-list** of the system
calls CPython, torch and the labs make; everything else is refused.

Installed by bwrap on the sandbox server from its ``exec`` (``--seccomp``), and again by each
exercise's child after its limits and before the learner's file is imported (:func:`install`);
a filter cannot be removed, and every process the learner starts inherits it.

* :data:`ALLOWED`: the calls measured by tracing the sandbox server through the grading of
  every lab's solution and stub (``tools/trace_syscalls.py``: 53 calls, from the interpreter's
  start and ``import torch`` to each exercise's child), plus the ordinary calls that glibc,
  CPython and torch make for the same work on other systems and kernels (``statx`` for
  ``stat``, ``clone`` for ``fork``, signal delivery, thread exit, ``madvise``...), in groups
  (:data:`EXTRA`). Each other call answers ``ENOSYS`` (so glibc falls back where it can):
  ``io_uring_setup`` and the rest of io_uring, ``socket`` (there is no network anyway),
  ``inotify_init`` and ``fanotify_init`` (counted per host uid: one learner could exhaust
  them for the next), System V IPC, ``mknod``, ``chown``, the ``set*id`` family...
* :data:`DENIED`: named and refused with ``EPERM`` (as before, so the refusals read as
  refusals): ``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_getfd`` (another process's
  memory or descriptors); ``unshare``, ``setns``, ``clone`` with any ``CLONE_NEW*`` flag
  (namespaces); ``mount`` and the new mount API, ``umount2``, ``pivot_root``, ``chroot``;
  ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*``, the kernel keyring;
* ``clone3`` answers ``ENOSYS``: its flags live in memory a filter cannot read, and glibc
  then falls back to ``clone``, whose flags it can;
* every x32 system call, and any call from another architecture: ``EPERM``.

A second, narrower layer goes on the learner's own process only (:func:`install_learner_layer`,
after :func:`install` in each exercise's child): no new pipes (``pipe``, ``pipe2``), no resizing
of a pipe (``fcntl(F_SETPIPE_SZ)``) and no epoll instance (``epoll_create``, ``epoll_create1``),
no file lock, lease or change notification (``flock``; ``fcntl``'s ``F_*LK*``, ``F_OFD_*``,
``F_SETLEASE``/``F_GETLEASE``, ``F_NOTIFY``: locks live on inodes, which the read-only binds
of every sandbox share, and one learner read another's token through them), no ``prlimit64``
of another process, and no ``clone`` with ``CLONE_PARENT`` (a sibling outside its count),
each ``EPERM``. The kernel counts pipe pages (``fs.pipe-user-pages-soft``) and epoll watches
(``fs.epoll.max_user_watches``) per *host* uid, and the class template's forks share one: one
learner holding thousands of pipe pages left the next one 8 KiB pipes. The server needs pipes
and epoll (its channel and its children's), a learner's exercise needs neither, and so what one
submission holds of those counts is the handful of pipes its server made for it.

Two routes build the same rules (:func:`route`; ``ATTNLAB_SECCOMP=libseccomp|bpf`` forces one,
and the grader passes its choice to the sandbox, whose environment is cleared):

* ``libseccomp`` (the default where ``libseccomp.so.2`` loads: Debian and Ubuntu install it
  with apt and systemd): the rules are given by name to libseccomp through ctypes (as
  PyPI's ``pyseccomp`` does), which resolves the numbers for this architecture, refuses other
  architectures' calls (x32 included) and compiles the program; :func:`program_bytes`
  exports it for bwrap's ``--seccomp``;
* ``bpf``: the program written out here as classic BPF from the tables :data:`_NR` (x86-64 and
  aarch64, resolved with libseccomp when they were written), for a system without
  libseccomp; where the architecture is neither, :func:`install` says it did nothing.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from typing import Any, Callable

__all__ = ["install", "install_learner_layer", "LEARNER_DENIED", "LEARNER_FCNTL_DENIED", "CLONE_PARENT", "program_bytes", "route", "ROUTES", "ALLOWED", "MEASURED", "EXTRA", "DENIED", "NAMESPACE_FLAGS"]

ROUTES = ("libseccomp", "bpf")

# linux/audit.h
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# the calls measured by tools/trace_syscalls.py (every lab's solution and stub, the server's whole life)
MEASURED = tuple("""access arch_prctl brk chdir clock_nanosleep clone close dup2 epoll_create1 execve exit_group fcntl fstat futex getcwd getdents64 getpid getrandom getrusage gettid ioctl kill lseek mbind mkdir mmap mprotect munmap newfstatat open openat pidfd_open pipe2 prctl pread64 prlimit64 pselect6 read readlink rmdir rseq rt_sigaction sched_getaffinity sched_setaffinity seccomp set_robust_list set_tid_address setsid sysinfo timer_create timer_settime uname unlink wait4 write""".split())
# the same work's calls elsewhere (other glibc, CPython and kernel versions), by what they are for
EXTRA = {
    # setitimer: the server's budget signal where libc has no timer_create (server._budget_signal)
    "signals": "rt_sigreturn rt_sigprocmask rt_sigsuspend rt_sigpending rt_sigtimedwait sigaltstack tgkill tkill restart_syscall alarm getitimer setitimer pause",
    "threads and time": "exit sched_yield nanosleep clock_gettime clock_getres gettimeofday time membarrier get_robust_list sched_getparam sched_getscheduler sched_get_priority_max sched_get_priority_min getcpu",
    "memory": "madvise mremap msync mincore mlock munlock get_mempolicy set_mempolicy",
    "files (as glibc and CPython ask for them on other systems)": "stat lstat statx fstatfs statfs faccessat faccessat2 readlinkat getdents lseek pwrite64 readv writev preadv pwritev dup dup3 pipe fcntl flock fsync fdatasync ftruncate truncate unlinkat mkdirat rename renameat renameat2 fchdir umask close_range fadvise64 openat2 utimensat chmod fchmod fchmodat",
    "processes": "fork vfork wait4 waitid getppid getpgid getpgrp getsid setpgid getuid geteuid getgid getegid getgroups getresuid getresgid getrlimit setrlimit getrusage times exit_group pidfd_send_signal",
    "waiting": "poll ppoll select pselect6 epoll_create epoll_ctl epoll_wait epoll_pwait epoll_pwait2 eventfd eventfd2",
}
ALLOWED = tuple(sorted((set(MEASURED) | {n for group in EXTRA.values() for n in group.split()}) - {"clone"}))  # clone: below

# linux/audit.h
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# System call numbers (asm/unistd_64.h on x86-64, asm-generic/unistd.h on aarch64; resolved with
# libseccomp's seccomp_syscall_resolve_name_arch when written): refused ones, then allowed ones.
_NR = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438, "unshare": 272,
        "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "add_key": 248, "request_key": 249, "keyctl": 250,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "clone": 56, "clone3": 435,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438, "unshare": 97,
        "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "add_key": 217, "request_key": 218, "keyctl": 219,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "clone": 220, "clone3": 435,
    },
}
_NR_ALLOWED = {
    "x86_64": {
        "chmod": 90, "fchmod": 91, "fchmodat": 268,
        "access": 21, "alarm": 37, "arch_prctl": 158, "brk": 12, "chdir": 80, "clock_getres": 229,
        "clock_gettime": 228, "clock_nanosleep": 230, "close": 3, "close_range": 436, "dup": 32, "dup2": 33,
        "dup3": 292, "epoll_create": 213, "epoll_create1": 291, "epoll_ctl": 233, "epoll_pwait": 281,
        "epoll_pwait2": 441, "epoll_wait": 232, "eventfd": 284, "eventfd2": 290, "execve": 59, "exit": 60,
        "exit_group": 231, "faccessat": 269, "faccessat2": 439, "fadvise64": 221, "fchdir": 81, "fcntl": 72,
        "fdatasync": 75, "flock": 73, "fork": 57, "fstat": 5, "fstatfs": 138, "fsync": 74, "ftruncate": 77,
        "futex": 202, "get_mempolicy": 239, "get_robust_list": 274, "getcpu": 309, "getcwd": 79, "getdents": 78,
        "getdents64": 217, "getegid": 108, "geteuid": 107, "getgid": 104, "getgroups": 115, "getitimer": 36,
        "getpgid": 121, "getpgrp": 111, "getpid": 39, "getppid": 110, "getrandom": 318, "getresgid": 120,
        "getresuid": 118, "getrlimit": 97, "getrusage": 98, "getsid": 124, "gettid": 186, "gettimeofday": 96,
        "getuid": 102, "ioctl": 16, "kill": 62, "lseek": 8, "lstat": 6, "madvise": 28, "mbind": 237,
        "membarrier": 324, "mincore": 27, "mkdir": 83, "mkdirat": 258, "mlock": 149, "mmap": 9, "mprotect": 10,
        "mremap": 25, "msync": 26, "munlock": 150, "munmap": 11, "nanosleep": 35, "newfstatat": 262, "open": 2,
        "openat": 257, "openat2": 437, "pause": 34, "pidfd_open": 434, "pidfd_send_signal": 424, "pipe": 22,
        "pipe2": 293, "poll": 7, "ppoll": 271, "prctl": 157, "pread64": 17, "preadv": 295, "prlimit64": 302,
        "pselect6": 270, "pwrite64": 18, "pwritev": 296, "read": 0, "readlink": 89, "readlinkat": 267, "readv": 19,
        "rename": 82, "renameat": 264, "renameat2": 316, "restart_syscall": 219, "rmdir": 84, "rseq": 334,
        "rt_sigaction": 13, "rt_sigpending": 127, "rt_sigprocmask": 14, "rt_sigreturn": 15, "rt_sigsuspend": 130,
        "rt_sigtimedwait": 128, "sched_get_priority_max": 146, "sched_get_priority_min": 147,
        "sched_getaffinity": 204, "sched_getparam": 143, "sched_getscheduler": 145, "sched_setaffinity": 203,
        "sched_yield": 24, "seccomp": 317, "select": 23, "set_mempolicy": 238, "set_robust_list": 273,
        "set_tid_address": 218, "setitimer": 38, "setpgid": 109, "setrlimit": 160, "setsid": 112, "sigaltstack": 131,
        "stat": 4, "statfs": 137, "statx": 332, "sysinfo": 99, "tgkill": 234, "time": 201, "timer_create": 222,
        "timer_settime": 223, "times": 100,
        "tkill": 200, "truncate": 76, "umask": 95, "uname": 63, "unlink": 87, "unlinkat": 263, "utimensat": 280,
        "vfork": 58, "wait4": 61, "waitid": 247, "write": 1, "writev": 20,
    },
    "aarch64": {
        "fchmod": 52, "fchmodat": 53,
        "brk": 214, "chdir": 49, "clock_getres": 114, "clock_gettime": 113, "clock_nanosleep": 115, "close": 57,
        "close_range": 436, "dup": 23, "dup3": 24, "epoll_create1": 20, "epoll_ctl": 21, "epoll_pwait": 22,
        "epoll_pwait2": 441, "eventfd2": 19, "execve": 221, "exit": 93, "exit_group": 94, "faccessat": 48,
        "faccessat2": 439, "fadvise64": 223, "fchdir": 50, "fcntl": 25, "fdatasync": 83, "flock": 32, "fstat": 80,
        "fstatfs": 44, "fsync": 82, "ftruncate": 46, "futex": 98, "get_mempolicy": 236, "get_robust_list": 100,
        "getcpu": 168, "getcwd": 17, "getdents64": 61, "getegid": 177, "geteuid": 175, "getgid": 176,
        "getgroups": 158, "getitimer": 102, "getpgid": 155, "getpid": 172, "getppid": 173, "getrandom": 278,
        "getresgid": 150, "getresuid": 148, "getrlimit": 163, "getrusage": 165, "getsid": 156, "gettid": 178,
        "gettimeofday": 169, "getuid": 174, "ioctl": 29, "kill": 129, "lseek": 62, "madvise": 233, "mbind": 235,
        "membarrier": 283, "mincore": 232, "mkdirat": 34, "mlock": 228, "mmap": 222, "mprotect": 226, "mremap": 216,
        "msync": 227, "munlock": 229, "munmap": 215, "nanosleep": 101, "newfstatat": 79, "openat": 56,
        "openat2": 437, "pidfd_open": 434, "pidfd_send_signal": 424, "pipe2": 59, "ppoll": 73, "prctl": 167,
        "pread64": 67, "preadv": 69, "prlimit64": 261, "pselect6": 72, "pwrite64": 68, "pwritev": 70, "read": 63,
        "readlinkat": 78, "readv": 65, "renameat": 38, "renameat2": 276, "restart_syscall": 128, "rseq": 293,
        "rt_sigaction": 134, "rt_sigpending": 136, "rt_sigprocmask": 135, "rt_sigreturn": 139, "rt_sigsuspend": 133,
        "rt_sigtimedwait": 137, "sched_get_priority_max": 125, "sched_get_priority_min": 126,
        "sched_getaffinity": 123, "sched_getparam": 121, "sched_getscheduler": 120, "sched_setaffinity": 122,
        "sched_yield": 124, "seccomp": 277, "set_mempolicy": 237, "set_robust_list": 99, "set_tid_address": 96,
        "setitimer": 103, "setpgid": 154, "setrlimit": 164, "setsid": 157, "sigaltstack": 132, "statfs": 43,
        "statx": 291, "sysinfo": 179, "tgkill": 131, "timer_create": 107, "timer_settime": 110, "times": 153, "tkill": 130, "truncate": 45, "umask": 166,
        "uname": 160, "unlinkat": 35, "utimensat": 88, "wait4": 260, "waitid": 95, "write": 64, "writev": 66,
    },
}
DENIED = tuple(n for n in _NR["x86_64"] if n not in ("clone", "clone3"))
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (linux/sched.h); clone's low
# byte is the exit signal (CLONE_NEWTIME exists only for clone3 and unshare, both refused)
NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

# linux/filter.h, linux/seccomp.h
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_X32_BIT = 0x40000000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def _program(arch: str) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions; ``seccomp_data``: nr at 0, arch at 4, args at 16."""
    nr = _NR[arch]
    deny = _RET_ERRNO | errno.EPERM
    prog = [(_LD_W_ABS, 0, 0, 4),                      # A = arch
            (_JEQ_K, 1, 0, _AUDIT_ARCH[arch]),         # the expected one: go on
            (_RET_K, 0, 0, deny),                      # another architecture's call
            (_LD_W_ABS, 0, 0, 0)]                      # A = nr
    if arch == "x86_64":
        prog += [(_JGE_K, 0, 1, _X32_BIT), (_RET_K, 0, 0, deny)]  # x32 calls
    for name in DENIED:
        prog += [(_JEQ_K, 0, 1, nr[name]), (_RET_K, 0, 0, deny)]
    prog += [(_JEQ_K, 0, 1, nr["clone3"]), (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]
    for n in _NR_ALLOWED[arch].values():
        prog += [(_JEQ_K, 0, 1, n), (_RET_K, 0, 0, _RET_ALLOW)]
    prog += [(_JEQ_K, 0, 4, nr["clone"]),
             (_LD_W_ABS, 0, 0, 16),                    # A = low 32 bits of args[0]: clone's flags
             (_JSET_K, 0, 1, NAMESPACE_FLAGS),
             (_RET_K, 0, 0, deny),
             (_RET_K, 0, 0, _RET_ALLOW),
             (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]  # not on the list
    return prog


# the learner layer (module docstring): call numbers as in _NR; aarch64 has no pipe nor epoll_create
LEARNER_DENIED = ("pipe", "pipe2", "epoll_create", "epoll_create1", "flock")
_NR_LEARNER = {
    "x86_64": {"pipe": 22, "pipe2": 293, "epoll_create": 213, "epoll_create1": 291, "flock": 73, "fcntl": 72,
               "prlimit64": 302, "clone": 56},
    "aarch64": {"pipe2": 59, "epoll_create1": 20, "flock": 32, "fcntl": 25, "prlimit64": 261, "clone": 220},
}
_F_SETPIPE_SZ = 1031  # F_LINUX_SPECIFIC_BASE (1024) + 7, linux/fcntl.h
# fcntl's commands that reach a kernel object other processes share (linux/fcntl.h, asm-generic/fcntl.h):
# record locks F_GETLK/SETLK/SETLKW (5-7), open-file-description locks F_OFD_* (36-38), leases
# F_SETLEASE/GETLEASE (1024, 1025) and F_NOTIFY (1026). Locks live on the inode, across mount and
# user namespaces: on the read-only standard library every sandbox shares, one learner read another's
# token through them bit by bit. None is needed by a learner's exercise (issue 47).
LEARNER_FCNTL_DENIED = (_F_SETPIPE_SZ, 5, 6, 7, 36, 37, 38, 1024, 1025, 1026)
CLONE_PARENT = 0x00008000  # linux/sched.h: a child of the caller's parent, outside its own count


def _learner_program(arch: str) -> list[tuple[int, int, int, int]]:
    """The learner layer as (code, jt, jf, k): everything else is left to the filter below it.
    ``seccomp_data``: nr at 0, arch at 4, args[i] at 16 + 8 i (low 32 bits first)."""
    nr = _NR_LEARNER[arch]
    deny = _RET_ERRNO | errno.EPERM
    prog = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 1, 0, _AUDIT_ARCH[arch]), (_RET_K, 0, 0, deny),
            (_LD_W_ABS, 0, 0, 0)]                      # A = nr
    for name in LEARNER_DENIED:
        if name in nr:
            prog += [(_JEQ_K, 0, 1, nr[name]), (_RET_K, 0, 0, deny)]
    # fcntl: the shared-object commands refused, the rest allowed
    prog += [(_JEQ_K, 0, 2 * len(LEARNER_FCNTL_DENIED) + 2, nr["fcntl"]),
             (_LD_W_ABS, 0, 0, 24)]                    # A = low 32 bits of args[1]: fcntl's cmd
    for cmd in LEARNER_FCNTL_DENIED:
        prog += [(_JEQ_K, 0, 1, cmd), (_RET_K, 0, 0, deny)]
    prog += [(_RET_K, 0, 0, _RET_ALLOW)]
    # prlimit64: only on itself (pid 0, all 64 bits); another pid (the server, a sibling) refused
    prog += [(_JEQ_K, 0, 6, nr["prlimit64"]),
             (_LD_W_ABS, 0, 0, 16),                    # A = low 32 bits of args[0]: the pid
             (_JEQ_K, 0, 3, 0),
             (_LD_W_ABS, 0, 0, 20),                    # A = high 32 bits of args[0]
             (_JEQ_K, 0, 1, 0),
             (_RET_K, 0, 0, _RET_ALLOW),
             (_RET_K, 0, 0, deny)]
    # clone with CLONE_PARENT: a sibling of the learner's process, outside what it is counted on
    prog += [(_JEQ_K, 0, 3, nr["clone"]),
             (_LD_W_ABS, 0, 0, 16),                    # A = low 32 bits of args[0]: clone's flags
             (_JSET_K, 0, 1, CLONE_PARENT),
             (_RET_K, 0, 0, deny),
             (_RET_K, 0, 0, _RET_ALLOW)]               # clone without it, and every other call
    return prog


def _bpf_bytes() -> bytes:
    """The written-out program (``struct sock_filter`` records); empty where the architecture
    is not one written here."""
    arch = platform.machine()
    if arch not in _NR:
        return b""
    return b"".join(struct.pack("=HBBI", *ins) for ins in _program(arch))


def _bpf_install() -> str:
    """Install the written-out program on this process; sets ``no_new_privs`` first."""
    arch = platform.machine()
    if arch not in _NR:
        return f"no seccomp filter: system call numbers for {arch} are not written here"
    _load_program(_program(arch))
    return f"seccomp filter (bpf, {arch}): an allow-list of {len(_NR_ALLOWED[arch]) + 1} calls"


def _load_program(prog: list[tuple[int, int, int, int]]) -> None:
    """Install one classic-BPF program on this process (``no_new_privs`` first)."""
    _load_raw(b"".join(struct.pack("=HBBI", *ins) for ins in prog))


class _SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _load_raw(raw: bytes) -> None:
    """Install one program of ``struct sock_filter`` records (8 bytes each) on this process."""
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = _SockFprog(len(raw) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def install_learner_layer() -> str:
    """Stack the learner layer (module docstring) on this process, over :func:`install`'s
    filter: filters only add up, and the strictest answer wins. Returns what was done, in words."""
    arch = platform.machine()
    if arch not in _NR_LEARNER:
        return f"no learner layer: system call numbers for {arch} are not written here"
    _load_program(_learner_program(arch))
    return ("learner layer: no new pipe, pipe resize or epoll instance; no lock, lease or notify (flock, fcntl); "
            "no prlimit64 of another process; no clone with CLONE_PARENT")


# --------------------------------------------------------------------------- libseccomp
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_FLTATR_ACT_BADARCH = 2
_SCMP_CMP_MASKED_EQ = 7


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _errno(e: int) -> int:
    return _RET_ERRNO | (e & 0xFFFF)  # SCMP_ACT_ERRNO(e)


def _libseccomp() -> "ctypes.CDLL | None":
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _context(lib: ctypes.CDLL) -> int:
    """The rules of the module's docstring, by name, in a new libseccomp filter context."""
    ctx = lib.seccomp_init(_errno(errno.ENOSYS))  # what is not on the list
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init")

    def add(action: int, name: str, cmps: list = ()) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a call of this architecture: nothing to refuse
            return
        arr = (_ArgCmp * max(1, len(cmps)))(*cmps)
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr if cmps else None)
        if rc != 0:
            raise OSError(-rc, f"seccomp_rule_add({name})")

    try:
        rc = lib.seccomp_attr_set(ctx, _SCMP_FLTATR_ACT_BADARCH, _errno(errno.EPERM))
        if rc != 0:
            raise OSError(-rc, "seccomp_attr_set(ACT_BADARCH)")
        for name in DENIED:
            add(_errno(errno.EPERM), name)
        # clone3 answers ENOSYS: the default action already (libseccomp refuses a rule that repeats it)
        for name in ALLOWED:
            add(_SCMP_ACT_ALLOW, name)
        for bit in range(32):  # clone with any CLONE_NEW* flag: one masked comparison per flag
            flag = 1 << bit
            if NAMESPACE_FLAGS & flag:
                add(_errno(errno.EPERM), "clone", [_ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag)])
        # and clone without any: (flags & NAMESPACE_FLAGS) == 0
        add(_SCMP_ACT_ALLOW, "clone", [_ArgCmp(0, _SCMP_CMP_MASKED_EQ, NAMESPACE_FLAGS, 0)])
    except BaseException:
        lib.seccomp_release(ctx)
        raise
    return ctx


def route() -> str:
    """The route this process uses: ``ATTNLAB_SECCOMP`` when set, else libseccomp where it loads."""
    forced = os.environ.get("ATTNLAB_SECCOMP", "")
    if forced in ROUTES:
        return forced
    return "libseccomp" if _libseccomp() is not None else "bpf"


def _via_libseccomp(how: str, use: Callable) -> Any:
    """``use(lib, ctx)`` on a libseccomp context holding the rules (released after), or None
    where the route is ``bpf`` or libseccomp does not load."""
    lib = _libseccomp() if (how or route()) == "libseccomp" else None
    if lib is None:
        return None
    ctx = _context(lib)
    try:
        return use(lib, ctx)
    finally:
        lib.seccomp_release(ctx)


def _export(lib: ctypes.CDLL, ctx: int) -> bytes:
    r, w = os.pipe()  # the program is a few hundred bytes: the pipe holds it before it is read
    try:
        rc = lib.seccomp_export_bpf(ctx, w)
        os.close(w)
        w = -1
        if rc != 0:
            raise OSError(-rc, "seccomp_export_bpf")
        chunks = []
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def _load(lib: ctypes.CDLL, ctx: int) -> str:
    rc = lib.seccomp_load(ctx)  # sets no_new_privs first (libseccomp's default)
    if rc != 0:
        raise OSError(-rc, "seccomp_load")
    return f"seccomp filter (libseccomp): an allow-list of {len(ALLOWED) + 1} calls"


def program_bytes(how: str = "") -> bytes:
    """The compiled filter (``struct sock_filter`` records), as bwrap's ``--seccomp FD`` reads
    it; empty where it cannot be built here. ``how``: a route of :data:`ROUTES` (default: :func:`route`)."""
    exported = _via_libseccomp(how, _export)
    return _bpf_bytes() if exported is None else exported


_COMPILED: dict[str, tuple[bytes, bytes]] = {}


def compiled(how: str = "") -> tuple[bytes, bytes]:
    """Both layers as programs (:func:`install`'s filter, then the learner layer), compiled once per
    route in the process that forks (the sandbox's server) and cached: building them took each
    child 7 ms (4.6 of libseccomp's context, 2.5 of the layer; the 2-core EPYC, 2026-12-04),
    loading them takes it a tenth of one. :func:`install_compiled` loads them. An empty program:
    none for this architecture. Raises OSError where libseccomp cannot export its program."""
    how = how or route()
    if how not in _COMPILED:
        arch = platform.machine()
        learner = b"".join(struct.pack("=HBBI", *ins) for ins in _learner_program(arch)) if arch in _NR_LEARNER \
            else b""
        _COMPILED[how] = (program_bytes(how), learner)
    return _COMPILED[how]


def install_compiled(programs: tuple[bytes, bytes]) -> None:
    """Load :func:`compiled`'s programs on this process, in order (``no_new_privs`` first): the same
    filters as :func:`install` then :func:`install_learner_layer`."""
    for raw in programs:
        if raw:
            _load_raw(raw)


def install(how: str = "") -> str:
    """Install the filter on this process (and so on everything it starts); returns what was done,
    in words. ``how``: a route of :data:`ROUTES` (default: :func:`route`); libseccomp falls back
    to the written-out program where it does not load."""
    done = _via_libseccomp(how, _load)
    return _bpf_install() if done is None else done
