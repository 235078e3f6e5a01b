"""A seccomp filter for the process that runs learner code: no ptrace, no reaching into other
processes, no new namespaces, no mounts.

Installed by each exercise's child after its limits and before the learner's file is
imported (:func:`install`); a filter cannot be removed, and every process the learner
starts inherits it. It refuses, with ``EPERM``:

* ``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_getfd``: reading or taking another
  process's memory or file descriptors (the sandbox server's reply pipe, say);
* ``unshare``, ``setns``, and ``clone`` with any ``CLONE_NEW*`` flag: nested user (and other)
  namespaces, inside which a learner had root and could mount a tmpfs of any size;
* ``mount``, ``umount2``, ``pivot_root``, ``chroot`` and the new mount API (``fsopen``,
  ``fsmount``, ``open_tree``, ``move_mount``, ``fsconfig``, ``fspick``, ``mount_setattr``);
* ``bpf``, ``perf_event_open``, ``userfaultfd``, the kernel keyring (``add_key``,
  ``request_key``, ``keyctl``): kernel surface no lab needs;
* every x32 system call, and any call from another architecture.

``clone3`` answers ``ENOSYS``: its flags live in memory a filter cannot read, and glibc then
falls back to ``clone``, whose flags it can. Threads and ``fork`` work as before.

Two routes build the same rules (:func:`route`; ``ATTNLAB_SECCOMP=libseccomp|bpf`` forces one,
and the grader passes its choice to the sandbox, whose environment is cleared):

* ``libseccomp`` (the default where ``libseccomp.so.2`` loads: Debian and Ubuntu install it
  with apt and systemd): the rules are given by name to libseccomp through ctypes (as
  PyPI's ``pyseccomp`` does), which resolves the numbers for this architecture, refuses other
  architectures' calls (x32 included) and compiles the program; :func:`program_bytes`
  exports it for bwrap's ``--seccomp``;
* ``bpf``: the program written out here as classic BPF (x86-64 and aarch64 numbers), for a
  system without libseccomp; where the architecture is neither, :func:`install` says it did
  nothing.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from typing import Any, Callable

__all__ = ["install", "program_bytes", "route", "ROUTES", "DENIED", "NAMESPACE_FLAGS"]

ROUTES = ("libseccomp", "bpf")

# linux/audit.h
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# asm/unistd_64.h (x86-64) and asm-generic/unistd.h (aarch64)
_NR = {
    "x86_64": {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
               "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
               "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
               "mount_setattr": 442, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "add_key": 248,
               "request_key": 249, "keyctl": 250, "clone": 56, "clone3": 435},
    "aarch64": {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
                "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
                "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
                "mount_setattr": 442, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "add_key": 217,
                "request_key": 218, "keyctl": 219, "clone": 220, "clone3": 435},
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
    prog += [(_JEQ_K, 0, 1, nr["clone3"]), (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),
             (_JEQ_K, 0, 3, nr["clone"]),
             (_LD_W_ABS, 0, 0, 16),                    # A = low 32 bits of args[0]: clone's flags
             (_JSET_K, 0, 1, NAMESPACE_FLAGS),
             (_RET_K, 0, 0, deny),
             (_RET_K, 0, 0, _RET_ALLOW)]
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
    prog = _program(arch)
    raw = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class _SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
    return f"seccomp filter (bpf, {arch}): no ptrace, process_vm_*, pidfd_getfd, namespaces or mounts"


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
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
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
        add(_errno(errno.ENOSYS), "clone3")
        for bit in range(32):  # clone with any CLONE_NEW* flag: one masked comparison per flag
            flag = 1 << bit
            if NAMESPACE_FLAGS & flag:
                add(_errno(errno.EPERM), "clone", [_ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag)])
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
    return "seccomp filter (libseccomp): no ptrace, process_vm_*, pidfd_getfd, namespaces or mounts"


def program_bytes(how: str = "") -> bytes:
    """The compiled filter (``struct sock_filter`` records), as bwrap's ``--seccomp FD`` reads
    it; empty where it cannot be built here. ``how``: a route of :data:`ROUTES` (default: :func:`route`)."""
    exported = _via_libseccomp(how, _export)
    return _bpf_bytes() if exported is None else exported


def install(how: str = "") -> str:
    """Install the filter on this process (and so on everything it starts); returns what was done,
    in words. ``how``: a route of :data:`ROUTES` (default: :func:`route`); libseccomp falls back
    to the written-out program where it does not load."""
    done = _via_libseccomp(how, _load)
    return _bpf_install() if done is None else done
