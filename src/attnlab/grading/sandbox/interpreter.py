"""Triton's interpreter as the learner's child runs it (lab 05): part of the runner.

Imports the standard library, torch and triton, never attnlab (:mod:`.server` loads it like
:mod:`.recorder`). What is done here is done once in the zygote (:func:`prepare_interpreter`) or
in the child before any learner code runs (:func:`count_launches`); all of it is evidence for the
grader or speed, never a fence.
"""

from __future__ import annotations

import os
import sys


MAX_KERNELS = 32  # kernel names a child reports launches of (lab 05's file has four)


def count_launches(path: str) -> dict:
    """Count each launch, under Triton's interpreter, of a ``@triton.jit`` kernel whose code was
    compiled from the learner's file (``path``), by the kernel's name: the evidence that an
    exercise's answer came from the learner's kernel (lab 05), which the grader checks against
    the exercise's kernels (:attr:`attnlab.grading.exercise.Exercise.kernels`). Installed before
    the learner's code runs; empty where Triton's interpreter is not in use."""
    counts: dict = {}
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton.runtime.interpreter" not in sys.modules:
        return counts  # the zygote did not prepare Triton (a file without it): nothing to count, and no import
    from triton.runtime import interpreter
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        code = getattr(getattr(self, "fn", None), "__code__", None)
        learner = code is not None and code.co_filename == path and not kwargs.get("warmup")
        if learner:
            name = str(self.fn.__name__)[:100]
            if name in counts or len(counts) < MAX_KERNELS:
                counts[name] = counts.get(name, 0) + 1
            _foreign_arguments(name, self.fn, args, kwargs)
        outer = _LEARNER[0]
        _LEARNER[0] = outer or learner  # a launch inside a learner's launch is theirs too
        try:
            return run(self, *args, **kwargs)
        finally:
            _LEARNER[0] = outer

    interpreter.InterpretedFunction.run = counted
    _record_stores()
    return counts


# ------------------------------------------------------------------ causal evidence (issue 61)
# A launch counted is not an answer made: a kernel launched once on a one-element tensor, beside
# torch's answer, was counted. So every store of a learner's kernel in the running call is recorded
# (the addresses of its active lanes and the bytes written there), and an answer counts only where
# each of its elements is at an address one of those stores wrote last with the bytes it holds now
# (:func:`unwritten`): a dummy launch, a partial write, and torch writing after the kernel all leave
# elements that fail.
_LEARNER = [False]  # a learner's kernel is running
_STORES: list = []  # (addresses uint64 (n,), bytes uint8 (n, itemsize)) of each learner store of this call


def _record_stores() -> bool:
    """Wrap the interpreter's masked store (outermost, after :func:`guard_pointers`) to record what
    a learner's kernel writes. True when installed."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = type(interpreter.interpreter_builder)
    store = getattr(builder, "create_masked_store", None)
    if store is None:
        return False
    if getattr(store, "attnlab_record", False):
        return True

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        out = store(self, ptrs, value, mask, cache_policy)  # raises first for a store out of bounds
        if _LEARNER[0]:
            itemsize = np.dtype(_np_dtype(ptrs.get_element_ty())).itemsize
            addrs = np.asarray(ptrs.data).reshape(-1).astype(np.uint64)
            data = np.ascontiguousarray(np.broadcast_to(np.asarray(value.data), np.asarray(ptrs.data).shape))
            rows = data.reshape(-1).view(np.uint8).reshape(-1, data.dtype.itemsize)
            active = (np.ones(addrs.shape, dtype=bool) if mask is None
                      else np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).reshape(-1))
            if rows.shape[1] == itemsize:
                _STORES.append((addrs[active], rows[active]))
        return out

    create_masked_store.attnlab_record = True
    builder.create_masked_store = create_masked_store
    return True


def recording() -> bool:
    """Whether this child records its learner kernels' stores (Triton's interpreter is in use)."""
    interpreter = sys.modules.get("triton.runtime.interpreter")  # never imported here: labs 01-04 pay nothing
    builder = getattr(interpreter, "interpreter_builder", None)
    return builder is not None and getattr(getattr(type(builder), "create_masked_store", None), "attnlab_record",
                                           False)


def forget_stores() -> None:
    """A new call starts: what earlier calls' kernels wrote is not its answer."""
    _STORES.clear()
    _FOREIGN.clear()
    _LAUNCHES.clear()
    _TOUCHED.clear()


# A kernel takes tensors, numbers and dtypes. Under the interpreter it takes anything, and a list or an
# object passed in is a road from the kernel's values out to Python (issue 61's third attacker appended
# each loaded value to a list, and its launcher computed attention on them); the static rule refuses
# such a road inside the kernel (grading/kernel_rules.py), and this reports one at the launch: evidence.
_FOREIGN: list = []  # "attn_fwd_kernel's argument 9: list" for this call


def _foreign_arguments(kernel: str, fn, args: tuple, kwargs: dict) -> None:
    import torch
    from triton.language import core

    plain = (torch.Tensor, int, float, bool, type(None), core.dtype, core.constexpr)
    grid = kwargs.get("grid")
    # a grid is numbers: a function there runs in Python with tl's functions patched in (a fourth attacker
    # loaded and stored every value from one), before and instead of any kernel
    if not (type(grid) is int or type(grid) in (tuple, list) and all(type(g) is int for g in grid)):
        if len(_FOREIGN) < 8:
            _FOREIGN.append(f"{kernel}'s grid: {type(grid).__name__[:40]} (a grid is a tuple of ints)")
    # what the kernel receives: every parameter bound, defaults included (a fifth attacker's list came as a
    # default, another as an argument named num_warps, which a check by name skipped)
    import inspect

    try:
        params = inspect.signature(fn).parameters
        bound = inspect.signature(fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
        bound.apply_defaults()
        received = list(bound.arguments.items())
    except (TypeError, ValueError):
        received = [*enumerate(args), *kwargs.items()]
    for where, arg in received:
        inner = arg.value if type(arg) is core.constexpr else arg  # a constexpr wraps a number, or nothing
        if type(arg) in plain and type(inner) in plain:
            continue
        if len(_FOREIGN) < 8:
            _FOREIGN.append(f"{kernel}'s argument {where}: {type(inner).__name__[:40]}")


def foreign_arguments() -> list:
    """What this call's learner kernels were passed besides tensors, numbers and dtypes."""
    return list(_FOREIGN)


def unwritten(address: int, shape: list, stride: list, itemsize: int, data: bytes) -> "np.ndarray":
    """Which elements of a returned tensor (its first element's ``address``, ``shape``, ``stride`` in
    elements, ``itemsize``, and its elements' bytes now in row-major order, ``data``) were not written
    last, with exactly these bytes, by a store of the learner's kernels in this call: a bool array, one
    per element in row-major order."""
    import numpy as np

    n = len(data) // itemsize if itemsize else 0
    if n == 0:
        return np.zeros(0, dtype=bool)
    stores = [(a, v) for a, v in _STORES if v.shape[1] == itemsize and len(a)]
    if not stores:
        return np.ones(n, dtype=bool)
    offsets = np.zeros(1, dtype=np.int64)
    for size, step in zip(shape, stride):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * step).reshape(-1)
    addrs = (np.int64(address) + offsets * itemsize).astype(np.uint64)
    written = np.concatenate([a for a, _ in stores])
    values = np.concatenate([v for _, v in stores])
    # the last store to each address: unique over the reversed order keeps each address's last write
    rev = written[::-1]
    unique, first_in_rev = np.unique(rev, return_index=True)
    last = len(written) - 1 - first_in_rev
    pos = np.minimum(np.searchsorted(unique, addrs), len(unique) - 1)
    found = unique[pos] == addrs
    now = np.frombuffer(data, dtype=np.uint8).reshape(n, itemsize)
    same = np.all(values[last[pos]] == now, axis=1)
    return ~(found & same)


# a quiet NaN in each float dtype a message carries, little-endian: what an element no kernel stored reads as
NAN_BYTES = {"F32": b"\x00\x00\xc0\x7f", "F64": b"\x00" * 6 + b"\xf8\x7f", "F16": b"\x00\x7e", "BF16": b"\xc0\x7f"}


def poison(dtype: str, data: bytes, itemsize: int, mask: "np.ndarray") -> bytes:
    """``data`` with the elements ``mask`` marks set to NaN (float dtypes; others as they are): the
    grader judges only what the learner's kernels stored, so an element they did not store cannot
    pass a check by holding the right value (torch's answer, or stale memory that held it)."""
    import numpy as np

    if dtype not in NAN_BYTES or not mask.any():
        return data
    rows = np.frombuffer(bytearray(data), dtype=np.uint8).reshape(-1, itemsize).copy()
    rows[mask] = np.frombuffer(NAN_BYTES[dtype], dtype=np.uint8)
    return rows.tobytes()


def warm_triton_interpreter() -> bool:
    """Run one small trusted kernel through Triton's interpreter (``TRITON_INTERPRET=1``) in the
    zygote, so that no child pays for the interpreter's first launch (its lazy imports and caches)
    again: every exercise of lab 05 runs in a fresh fork. True when the kernel ran.

    Measured on the 2-core AVX2 EPYC (2026-12-03), forking a child per exercise from a process
    that had imported triton, as the zygote does. The lab 05 solution's 7 exercises took 3.37-4.17 s
    of CPU in all, median 3.82 s, without the warm-up, and 2.78-3.88 s, median 3.63 s, with it.
    The exercises with the least work show it best: ex1 went from 0.21-0.29 s to 0.13-0.15 s and
    ex4 from 0.12-0.20 s to 0.05-0.09 s."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def warm(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(X + i[:, None] * N + i[None, :], mask=i[:, None] < N, other=0.0)
        s = tl.dot(x, tl.trans(x)) * 0.5
        m = tl.max(s, 1)
        p = tl.where(i[None, :] <= i[:, None], tl.exp(s - m[:, None]), 0.0)
        l = tl.sum(p, 1)
        o = tl.dot(p.to(tl.float16), x.to(tl.float16)) / l[:, None] + tl.log(l)[:, None]
        tl.store(Y + i[:, None] * N + i[None, :], o, mask=i[:, None] < N)

    try:
        warm[(1,)](torch.ones(16, 16), torch.empty(16, 16), 16)
    except Exception:  # noqa: BLE001 (only a warm-up: the learner's kernels still run without it)
        return False
    return True


def drop_dead_overflow_checks() -> bool:
    """Stop Triton's interpreter from building integer-overflow checks that it then throws away.
    With ``sanitize_overflow`` set (the interpreter's default) every integer ``+``, ``-`` and ``*``
    of a kernel is also done in int64 and compared against int32's range, to feed a
    ``device_assert`` that returns at once unless the options' ``debug`` is set, which the
    interpreter's never is: the answer, and whether anything is raised, are the same without the
    checks. Only done where ``debug`` is off. True when it was done.

    Measured on the 2-core AVX2 EPYC (2026-12-03), lab 05's solution, its 7 exercises run twice
    in one process, the second time timed: 2.27-2.44 s of CPU with the checks, 1.49-1.74 s
    without (cProfile put 0.61 s of ex7's 1.74 s in the checks of its multiplications alone)."""
    import dataclasses

    try:
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder
        if builder.options.debug or not builder.options.sanitize_overflow:
            return False
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):  # another Triton: its interpreter as it comes
        return False
    return True


def _np_dtype(tt) -> "np.dtype":
    """numpy's dtype for the elements of a Triton (block or scalar) type, as Triton's interpreter
    stores them: bf16 as uint16 and fp8 as uint8 (their bits), pointers as uint64. Our own map,
    from the type's name and width, not the interpreter's private one."""
    import numpy as np
    import triton.language as tl

    tt = tt.element_ty if isinstance(tt, tl.block_type) else tt
    if isinstance(tt, tl.pointer_type):
        return np.dtype(np.uint64)
    name, bits = tt.name, tt.primitive_bitwidth
    if name == "int1":
        return np.dtype(bool)
    if name in ("fp16", "fp32", "fp64"):
        return np.dtype(f"float{bits}")
    if name == "bf16" or name.startswith("fp8"):
        return np.dtype(f"uint{bits}")
    return np.dtype(name)  # int8 .. int64, uint8 .. uint64: numpy's names


def poison_masked_loads() -> bool:
    """A masked load without ``other=`` reads NaN in its masked-off lanes (float tensors), where
    Triton's interpreter would give 0.0: on a GPU those lanes are undefined (whatever the registers
    held), so a kernel that relies on them being 0 is wrong there, and the grader must see it here
    (``load_mask``). Loads with ``other=`` and loads without a mask are as before. True when done."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = type(interpreter.interpreter_builder)
    original = getattr(builder, "create_masked_load", None)
    if original is None or getattr(original, "attnlab_poison", False):
        return False

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        if other is None:
            dtype_tt = ptrs.get_element_ty()
            dtype_np = _np_dtype(dtype_tt)
            if np.issubdtype(dtype_np, np.floating):
                other = interpreter.TensorHandle(np.full_like(ptrs.data, np.nan, dtype=dtype_np), dtype_tt)
        return original(self, ptrs, mask, other, cache_policy, is_volatile)

    create_masked_load.attnlab_poison = True
    builder.create_masked_load = create_masked_load
    return True


def prepare_interpreter() -> None:
    """What the zygote does for lab 05 once: import triton, drop the dead overflow checks, poison
    masked loads, guard every pointer, and warm the interpreter up (in that order: the warm-up runs
    as children will)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return
    drop_dead_overflow_checks()
    poison_masked_loads()
    guard_pointers()
    warm_triton_interpreter()


class OutOfBounds(IndexError):
    """A kernel's load or store reached memory outside every tensor passed to it: raised inside the
    kernel, at its line, before the interpreter writes there (which corrupted the child's heap:
    SIGSEGV, or glibc's 'double free or corruption')."""


OutOfBounds.__module__ = "builtins"  # the learner reads 'OutOfBounds: ...', not the runner's module name


_extents: list = []  # (first byte, end byte) of each tensor storage of the running launch


def _record_extents(init):
    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        found = []

        def walk(arg):
            if isinstance(arg, (tuple, list)):
                for a in arg:
                    walk(a)
            elif hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                found.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

        walk(args_hst)
        walk(list(kwargs_hst.values()))
        _extents[:] = found
        if _LEARNER[0]:
            _record_launch(self, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    return init_args_hst


def _outside(ptrs, mask, dtype_np):
    """How many active lanes of ``ptrs`` point outside every recorded tensor storage."""
    import numpy as np

    addrs = np.asarray(ptrs.data).reshape(-1).astype(np.uint64)
    active = np.ones(addrs.shape, dtype=bool) if mask is None else np.asarray(mask.data).reshape(-1).astype(bool)
    addrs = addrs[active]
    if addrs.size == 0 or not _extents:
        return 0
    size = np.uint64(np.dtype(dtype_np).itemsize)
    inside = np.zeros(addrs.shape, dtype=bool)
    for lo, hi in _extents:
        inside |= (addrs >= np.uint64(lo)) & (addrs + size <= np.uint64(hi))
    return int((~inside).sum())


# NaN values the learner's kernels loaded (mask-true lanes) since forget_nan_loads: where the grader's inputs
# hold NaN only at keys no query sees (lab 05's skip case), a kernel that loads one visited a tile it must skip,
# whatever it did with the values after (a ninth road: V's loads masked, K's NaN scores dropped by tl.where)
_NAN_LOADS = [0]


def _count_nan_loads(out, mask) -> None:
    import numpy as np

    data = np.asarray(out.data)
    if np.issubdtype(data.dtype, np.integer) and data.dtype.itemsize in (2, 4, 8):  # NaN's bits in an int load
        data = data.view(np.dtype(f"float{8 * data.dtype.itemsize}"))
    if not np.issubdtype(data.dtype, np.floating):
        return
    nan = np.isnan(data)
    if mask is not None:
        nan &= np.broadcast_to(np.asarray(mask.data).astype(bool), nan.shape)
    _NAN_LOADS[0] += int(nan.sum())


def forget_nan_loads() -> None:
    _NAN_LOADS[0] = 0


def nan_loads() -> int:
    """How many NaN values (mask-true lanes) the learner's kernels loaded since :func:`forget_nan_loads`."""
    return _NAN_LOADS[0]


def guard_pointers() -> bool:
    """Every load and store of a kernel under the interpreter is checked against the storages of
    the tensors passed to that launch: one that reaches outside raises :class:`OutOfBounds` in the
    kernel, with its line (the grader names it ``store_mask`` or ``load_mask``). Loads past a
    tensor's end but inside the grader's NaN guard stay allowed (they read NaN). True when done."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    fn_class, builder = getattr(interpreter, "GridExecutor", None), type(interpreter.interpreter_builder)
    init = getattr(fn_class, "_init_args_hst", None)
    load, store = getattr(builder, "create_masked_load", None), getattr(builder, "create_masked_store", None)
    if init is None or load is None or store is None or getattr(store, "attnlab_guard", False):
        return False

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        _touch(self, ptrs, mask, 0)  # before the bounds check: what it reached on the way there says why
        n = _outside(ptrs, mask, _np_dtype(ptrs.get_element_ty()))
        if n:
            raise OutOfBounds(f"tl.load reads outside every tensor passed to the kernel ({n} lanes of this load): "
                              "load with mask= (rows < L, keys < S) and other=0.0")
        out = load(self, ptrs, mask, other, cache_policy, is_volatile)
        _count_nan_loads(out, mask)
        return out

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        _touch(self, ptrs, mask, 1)
        n = _outside(ptrs, mask, _np_dtype(ptrs.get_element_ty()))
        if n:
            raise OutOfBounds(f"tl.store writes outside every tensor passed to the kernel ({n} lanes of this "
                              "store): store with mask= (rows < L)")
        return store(self, ptrs, value, mask, cache_policy)

    create_masked_store.attnlab_guard = True
    fn_class._init_args_hst = _record_extents(init)
    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
    return True


# ------------------------------------------------------------------ the (batch, head) each program reaches (issue 62)
# A pointer offset computed with another tensor's sizes, without the batch, or at the wrong head (lse read at head
# 0, D at the key/value head, K at the query head under GQA) reads or writes another (batch, head)'s rows: values
# no bug model of the arithmetic explains. So each learner load and store (its active lanes) is mapped to the
# tensor arguments it falls in, and the index of the (batch, head) slice it reached there (an element's flat index
# // the elements of one slice, prod(shape[2:])), with the first and last element of that slice reached, is kept per
# (launch, program along grid axis 1, argument, load or store): a last tile read unmasked reaches only the next
# slice's first rows, which the grader names load_mask, not an offset. The grader knows which slices each program owns (lab 05's launchers put batch x head on axis 1) and names
# what went elsewhere (:mod:`attnlab.grading.offsets`). Evidence for a name, never a grade.
MAX_LAUNCHES = 16  # learner launches described per call (lab 05's calls make at most 4)
MAX_TOUCHED = 1024  # (launch, program, argument, kind) keys per call (lab 05's largest call, ex7's GQA backward: ~300)
MAX_SLICES = 16  # slice indices kept per key (a program owns at most H / Hkv = 2 of a tensor's)
_LAUNCHES: list = []  # [kernel, grid (3 ints or []), [[name, shape...], ...]] of each learner launch of this call
# (name, first byte, end byte, end of its storage, bytes of one slice, of one element) of the running launch's tensor
# arguments: a read past a tensor's end inside its storage (the grader's NaN guard) is that tensor's, at a slice
# past its last, so an offset that runs off the end is seen where it went
_SPANS: list = []
_TOUCHED: dict = {}  # (launch, pid along axis 1, name, 0 load / 1 store) -> {slice: (first, last) element reached}


def _record_launch(executor, args: list, kwargs: dict) -> None:
    """What the grader needs to know of a learner launch: its kernel, its grid, and the name and
    shape of each contiguous tensor argument of 3 or more dimensions (B, H, ...)."""
    _SPANS.clear()
    if len(_LAUNCHES) >= MAX_LAUNCHES:
        return
    names = list(getattr(executor, "arg_names", ()))
    grid = getattr(executor, "grid", None)
    grid = list(grid) + [1] * (3 - len(grid)) if type(grid) in (tuple, list) and 0 < len(grid) <= 3 and all(
        type(g) is int for g in grid) else []
    described = []
    named = [(names[i], a) for i, a in enumerate(args) if i < len(names)] + list(kwargs.items())
    for name, arg in named:
        if hasattr(arg, "untyped_storage") and arg.dim() >= 3 and arg.is_contiguous() and arg.numel():
            first, size = arg.data_ptr(), arg.element_size()
            storage = arg.untyped_storage()
            tail = max(first + arg.numel() * size, storage.data_ptr() + storage.nbytes())
            _SPANS.append((str(name)[:40], first, first + arg.numel() * size, tail, arg[0, 0].numel() * size, size))
            described.append([str(name)[:40], *[int(n) for n in arg.shape[:4]]])
    _LAUNCHES.append([str(getattr(getattr(executor, "fn", None), "__name__", "?"))[:100], grid, described[:32]])


FAR = 64  # how far past its base tensor an access is still read as that tensor's: 64 of its sizes (_owners)


def _owners(addrs):
    """(n,) the index in :data:`_SPANS` of the tensor each address of one access is read as, -1 for
    none. One access is one base pointer's: the tensor that holds its lowest address (or whose
    storage's tail, the grader's NaN guard, does) is its base, and every lane from there up to
    :data:`FAR` of that tensor's sizes on is the base's, at a slice past its end where it ran over
    (a tile stored unmasked past O runs over a small tensor that lies after it, and on). A lane below
    the base, or past that, is the tensor's that holds it, else the nearest that starts below it (an
    offset with the wrong strides lands many slices past its tensor's end, a missing mask a few rows)."""
    import numpy as np

    owner = np.full(addrs.shape, -1, dtype=np.int64)
    for n, (_, first, end, _, _, _) in enumerate(_SPANS):
        owner[(owner < 0) & (addrs >= first) & (addrs < end)] = n
    for n, (_, first, end, tail, _, _) in enumerate(_SPANS):
        owner[(owner < 0) & (addrs >= end) & (addrs < tail)] = n
    held = np.flatnonzero(owner >= 0)
    if held.size:
        base = int(owner[held[np.argmin(addrs[held])]])
        _, first, end, _, _, _ = _SPANS[base]
        owner[(addrs >= first) & (addrs < first + FAR * (end - first))] = base
    outside = owner < 0
    if outside.any():
        best = np.full(addrs.shape, -1, dtype=np.int64)
        for n in sorted(range(len(_SPANS)), key=lambda n: _SPANS[n][1]):  # a later start is a nearer one
            _, first, end, _, _, _ = _SPANS[n]
            best[outside & (addrs >= first) & (addrs < first + FAR * (end - first))] = n
        owner[outside] = best[outside]
    return owner


def _touch(builder, ptrs, mask, kind: int) -> None:
    if not _LEARNER[0] or not _SPANS or len(_LAUNCHES) > MAX_LAUNCHES:
        return
    import numpy as np

    shape = np.asarray(ptrs.data).shape
    addrs = np.asarray(ptrs.data).reshape(-1).astype(np.int64)
    if mask is not None:
        addrs = addrs[np.broadcast_to(np.asarray(mask.data).astype(bool), shape).reshape(-1)]
    if addrs.size == 0:
        return
    pid = int(builder.grid_idx[1]) if getattr(builder, "grid_idx", None) else 0
    owner = _owners(addrs)
    for n, (name, first, end, tail, per_slice, size) in enumerate(_SPANS):
        inside = addrs[owner == n] - first
        if not inside.size:
            continue
        key = (len(_LAUNCHES) - 1, pid, name, kind)
        seen = _TOUCHED.get(key)
        if seen is None:
            if len(_TOUCHED) >= MAX_TOUCHED:
                continue
            seen = _TOUCHED[key] = {}
        slices, which = np.unique(inside // per_slice, return_inverse=True)
        at = (inside % per_slice) // size  # the element of its slice each lane reached
        first_at, last_at = np.full(slices.shape, per_slice, dtype=np.int64), np.zeros(slices.shape, dtype=np.int64)
        np.minimum.at(first_at, which.reshape(-1), at)
        np.maximum.at(last_at, which.reshape(-1), at)
        for sl, lo, hi in zip(slices.tolist(), first_at.tolist(), last_at.tolist()):
            if sl in seen or len(seen) < MAX_SLICES:
                old = seen.get(sl, (lo, hi))
                seen[sl] = (min(old[0], lo), max(old[1], hi))


def touched() -> dict:
    """The learner's launches of this call and the (batch, head) slices each program reached:
    ``{"launches": [[kernel, grid, [[name, *shape], ...]], ...], "touched": [[launch, pid, name,
    kind, [[slice, first, last element of it reached], ...]], ...]}`` (kind 0 a load, 1 a store)."""
    return {"launches": [list(x) for x in _LAUNCHES[:MAX_LAUNCHES]],
            "touched": [[*key, sorted([sl, lo, hi] for sl, (lo, hi) in seen.items())[:MAX_SLICES]]
                        for key, seen in list(_TOUCHED.items())[:MAX_TOUCHED]]}
