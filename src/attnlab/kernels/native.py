"""attnlab's native kernels (``csrc/``): built once with this machine's C++ compiler, and loaded.

The kernels (``csrc/flash.cpp``) run the same online softmax as
:func:`attnlab.tiled`'s eager forward and the same FlashAttention-2 backward as
its eager backward, one cache-sized tile at a time so that the row passes
read scores still in cache; see the comment at the top of that file for why.
``csrc/block_sparse.cpp`` runs them over the blocks an :class:`attnlab.flex.BlockMask`
keeps (used through :mod:`attnlab.kernels.block_sparse`); ``csrc/decode.cpp`` is the decode kernel
(:mod:`attnlab.kernels.decode`); ``csrc/kernels.h`` holds what they share and
``csrc/bf16_gemm.h`` the bf16 route's GEMM (:func:`bf16_route`).

It is compiled with ``torch.utils.cpp_extension`` on first use (20-70 s measured on 2 cores; ``make demo``
and ``make test`` build it ahead) into ``~/.cache/attnlab/`` (``$ATTNLAB_CACHE_DIR``
overrides), under a key made of the source's hash, torch's and Python's versions and the CPU's
instruction set (see :func:`_cache_dir`), so a stale build, or one made for another CPU, is
never loaded. ``ATTNLAB_NATIVE=0`` turns it off. Without a compiler, or if the build
fails, the tiled path uses its pure-PyTorch forward (same results, slower) and says so once
with a warning; :func:`status` tells which is in use and why.

Run ``python -m attnlab.kernels.native`` to build it and print the status.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from attnlab._validation import compute_dtype
from attnlab.kernels import routes
from attnlab.kernels.numerics import finite_inputs

__all__ = ["can_run", "NativeStatus", "Bf16Route", "SgemmRoute", "status", "ops", "bf16_route", "sgemm_route",
           "operand_dtype", "BF16_CHOICES", "SGEMM_CHOICES", "SGEMM_CODES", "sgemm_routes_built", "cache_root",
           "build_isa", "ISA_CHOICES", "decode_dot_products", "decode_dot_bits"]

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "flash.cpp", _CSRC / "block_sparse.cpp", _CSRC / "decode.cpp")
_HEADERS = (_CSRC / "kernels.h", _CSRC / "bf16_gemm.h", _CSRC / "sgemm.h", _CSRC / "decode_sources.h",
            _CSRC / "decode_dots.h", _CSRC / "decode_bf16.h", _CSRC / "decode_lanes.h", _CSRC / "decode_values.h",
            _CSRC / "decode_stream.h",
            *sorted((_CSRC / "isa").glob("*.h")))
_NAME = "attnlab_native"
# -march=native: the build runs on the machine that uses it; -fopenmp: at::parallel_for's
# pragmas (the library resolves to the libgomp torch has already loaded, so one thread pool)
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
# ATTNLAB_NATIVE_ISA=avx512-emulated: the kernels' AVX-512 source on portable stand-ins for its
# instructions (csrc/isa/avx512_emulated.h), so that it runs, and is tested, on a CPU without AVX-512.
# -O1: a test build is built more often than it runs long. On the 2-core AVX2 EPYC (2026-12-03) the
# build took 54 s of CPU against 107 s at -O3, and its test's 1519 cases 88 s against 73 s.
_EMULATE_AVX512_FLAGS = ["-DATTNLAB_EMULATE_AVX512", "-Wno-psabi", "-O1"]
ISA_CHOICES = routes.CHOICES["isa"]


def build_isa() -> str:
    """Which build of the native kernels this process loads: ``$ATTNLAB_NATIVE_ISA``, read once
    (:mod:`attnlab.kernels.routes`).

    ``native`` (the default) compiles for this CPU's instructions (``-march=native``).
    ``avx512-emulated`` compiles the kernels' AVX-512 branches (the row pass, the 6 x 64 zmm GEMM
    tile, the ``vdpbf16ps`` bf16 GEMM) with each AVX-512 instruction written out in portable C++
    (``csrc/isa/avx512_emulated.h``): a test build (its times are not the CPU's) that lets an AVX2-only CPU run
    the AVX-512 source (``tests/kernels/test_avx512_emulated.py``). On a CPU with AVX-512F but not
    AVX512_BF16 only the bf16 instructions are emulated; on one with both the two builds are the same
    code. Each has its own cache folder.
    """
    return routes.settings().isa


def _cflags() -> list[str]:
    return _CFLAGS + (_EMULATE_AVX512_FLAGS if build_isa() == "avx512-emulated" else [])


@dataclass(frozen=True)
class Bf16Route:
    """How the native kernels compute bfloat16 inputs, and why.

    ``"bf16"``: the GEMMs take bf16 operands on the CPU's bf16 instructions (``csrc/bf16_gemm.h``),
    float32 results; P and dS are rounded to bf16 for their GEMMs, as torch's kernel does.
    ``"bf16-emulated"``: the same operands and roundings, the GEMMs widened to float32 (the route
    of a build without AVX512_BF16, forced to test it anywhere). ``"fp32"``: the inputs are
    converted to float32 and run as float32 (faster where the CPU has no bf16 instructions).
    """

    name: str
    reason: str

    def __str__(self) -> str:
        return f"bfloat16 route: {self.name} ({self.reason})"


BF16_CHOICES = routes.CHOICES["bf16"]


@dataclass(frozen=True)
class SgemmRoute:
    """Which float32 GEMM the native kernels' tiles run on, and why (``csrc/sgemm.h``).

    ``"avx512"``: attnlab's micro-kernel, 6 x 64 tiles of zmm (AVX-512 builds);
    ``"avx2"``: the same, 6 x 16 tiles of ymm; ``"avx512-emulated"``: the AVX-512 tile walk with
    each 16-lane vector a pair of ymm, so that its logic is tested on an AVX2-only CPU (slow, a
    test route); ``"blas"``: MKL's sgemm through torch, the route before issue 33.
    ``code`` is the number the C++ ops take (``SgemmRoute`` in ``sgemm.h``).
    """

    name: str
    reason: str

    @property
    def code(self) -> int:
        return SGEMM_CODES[self.name]

    def __str__(self) -> str:
        return f"float32 GEMM: {self.name} ({self.reason})"


SGEMM_CHOICES = routes.CHOICES["sgemm"]
SGEMM_CODES = {"blas": 0, "avx2": 1, "avx512": 2, "avx512-emulated": 3}


@dataclass(frozen=True)
class NativeStatus:
    """Whether the native kernel is in use, and why not when it is not; which bf16 route runs."""

    available: bool
    detail: str  # where it was loaded from, or the reason it is not used
    bf16: Optional[Bf16Route] = None
    sgemm: Optional[SgemmRoute] = None
    decode_dots: Optional[str] = None  # decode_dot_products(): the decode loop's dot-product instructions

    def __str__(self) -> str:
        state = "native C++ forward and backward" if self.available else "pure-PyTorch forward and backward"
        routes = "".join(f"; {r}" for r in (self.sgemm, self.bf16, self.decode_dots) if r is not None)
        return f"tiled path: {state} ({self.detail}){routes}"


_lock = threading.Lock()
_state: Optional[tuple[Optional[Any], NativeStatus]] = None


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The instruction-set flags of this CPU (``/proc/cpuinfo``, read once: every bf16 route choice
    asks), or an empty set off Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cache_root() -> Path:
    """attnlab's cache folder: ``$ATTNLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnlab``, else
    ``~/.cache/attnlab`` (the native build, and the bench's FMA-peak loop, live below it)."""
    return Path(os.environ.get("ATTNLAB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "attnlab"))


def _cache_dir() -> Path:
    """The build folder: keyed by the source, the flags, torch, Python, and the CPU.

    ``-march=native`` compiles for this CPU's instructions, so the key includes torch's view
    of the CPU (``get_cpu_capability``, e.g. AVX512) and a hash of every instruction-set
    flag: a cache shared between machines (an NFS home on a cluster) gets one build per
    kind of CPU, never one built for instructions another CPU lacks (SIGILL).
    """
    root = cache_root()
    key = hashlib.sha256()
    for source in (*_SOURCES, *_HEADERS):
        key.update(source.read_bytes())
    key.update(" ".join(_cflags() + _LDFLAGS).encode())
    key.update(f"{torch.__version__} {sys.version_info[:2]} {platform.machine()}".encode())
    key.update(f"{torch.backends.cpu.get_cpu_capability()} {' '.join(sorted(cpu_features()))}".encode())
    return Path(root) / f"native-{key.hexdigest()[:16]}"


_FEATURES_FILE = "cpu-features.txt"  # the flags of the CPU a build was made on


def _built_for_this_cpu(build_dir: Path) -> bool:
    """A build may be loaded only when it records the CPU it was built on and this CPU has
    every flag that one had (a library with no record is rebuilt, not trusted)."""
    try:
        built = frozenset((build_dir / _FEATURES_FILE).read_text().split())
    except OSError:
        return False
    return built <= cpu_features()


def _load() -> tuple[Optional[Any], NativeStatus]:
    if routes.settings().native == "0":
        return None, NativeStatus(False, "turned off by ATTNLAB_NATIVE=0")
    if platform.system() != "Linux":
        return None, NativeStatus(False, f"the native kernel is built on Linux only, this is {platform.system()}")
    build_dir = _cache_dir()
    library = build_dir / f"{_NAME}.so"
    try:
        if library.exists() and _built_for_this_cpu(build_dir):
            torch.ops.load_library(str(library))
        else:
            build_dir.mkdir(parents=True, exist_ok=True)
            # measured: 22.6 s on a 2-core AVX-512 EPYC (2026-12-01), 68 s on another 2-core machine (issue 22)
            print(f"attnlab: building the native tiled kernel into {build_dir} (once, 20-70 s)...",
                  file=sys.stderr, flush=True)
            from torch.utils import cpp_extension  # imported only to build: it is slow to import

            cpp_extension.load(name=_NAME, sources=[str(s) for s in _SOURCES], extra_cflags=_cflags(), extra_ldflags=_LDFLAGS,
                               build_directory=str(build_dir), is_python_module=False, verbose=False)
            (build_dir / _FEATURES_FILE).write_text(" ".join(sorted(cpu_features())) + "\n")
        namespace = torch.ops.attnlab_native
        for op in ("flash_forward", "flash_forward_", "flash_backward_", "block_sparse_forward",
                   "block_sparse_backward_", "decode_forward", "bf16_units", "sgemm_route_built", "tile_gemm_",
                   "tile_gemm_bf16_", "decode_dot_instructions"):
            getattr(namespace, op)  # all registered
        from attnlab.kernels import fake

        fake.register()  # shapes and dtypes for tracing (torch.compile, torch.export)
        from attnlab.kernels import op_autograd

        op_autograd.register()  # flash_forward differentiable as a torch op
    except Exception as exc:  # no compiler, no ninja, a failed build: the pure path still works
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        warnings.warn(f"attnlab: the native tiled kernel is not available ({reason}); the tiled path uses its "
                      f"pure-PyTorch code (same results, ~1.3x slower). Set ATTNLAB_NATIVE=0 to silence this.",
                      RuntimeWarning, stacklevel=3)
        return None, NativeStatus(False, f"build or load failed: {reason}")
    built = " (the avx512-emulated test build: ATTNLAB_NATIVE_ISA)" if build_isa() == "avx512-emulated" else ""
    return namespace, NativeStatus(True, f"loaded from {library}{built}")


def _get() -> tuple[Optional[Any], NativeStatus]:
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
    return _state


def ops() -> Optional[Any]:
    """The compiled ops, or None: ``flash_forward(q4, k3, v3, mask, mask_offsets, scale2, is_causal, causal_offset,
    block_q, block_k)
    -> (out, lse2)`` and ``flash_forward_(q4, k3, v3, out, lse2, scale2, is_causal, block_q, block_k)``,
    which continues the softmax state held in ``(out, lse2)`` in place, and ``flash_backward_(dout,
    q4, k3, v3, lse2, delta, dq, dk, dv, scale, is_causal, block_q, block_k)``, which adds the
    gradients into ``dq, dk, dv`` (see the C++ source); ``block_sparse_forward`` and
    ``block_sparse_backward_``, the same over the blocks of a block mask (``csrc/block_sparse.cpp``)."""
    return _get()[0]


def status() -> NativeStatus:
    """Loads (building if needed) the native kernel and says whether the tiled path uses it,
    and which bfloat16 route (:func:`bf16_route`) it takes now."""
    loaded = _get()[1]
    if not loaded.available:
        return NativeStatus(loaded.available, loaded.detail, bf16_route())
    return NativeStatus(loaded.available, loaded.detail, bf16_route(), sgemm_route(), decode_dot_products())


@functools.lru_cache(maxsize=4)
def _dot_bits_of(library) -> int:
    return int(library.decode_dot_instructions())


def decode_dot_bits() -> int:
    """The loaded build's decode dot-product instructions as bits (``csrc/decode.cpp``'s
    ``decode_dot_instructions``: bit 0 ``vdpbf16ps``, bit 1 ``vpdpwssd``, bit 2 ``vdpbf16ps`` on 512
    bits with AVX-512's float vectors: the bf16 lane kernel's, bit 3 512-bit int16 pairs: the int8
    lane kernel's), asked once; 0 without the native kernels."""
    native = ops()
    return _dot_bits_of(native) if native is not None else 0


def decode_dot_products() -> str:
    """Which instructions the loaded build's streaming decode loop has for a cache's dot products,
    in words: ``vdpbf16ps`` for bf16 caches (taken on the ``bf16`` route, :func:`bf16_route`) and
    ``vpdpwssd`` for int8 ones (AVX512_VNNI), or what runs without them (bf16 widened to float32;
    int8 on ``vpmaddwd`` and ``vpaddd`` with AVX2). Asked of the library
    (``decode_dot_instructions``): the build, not the CPU's flags, decides."""
    bits = decode_dot_bits()
    if bits & 1:
        bf16 = ("on vdpbf16ps" + (" (512 bits)" if bits & 4 else "")) if bf16_route().name == "bf16" else \
            "widened to float32 (vdpbf16ps is built: ATTNLAB_BF16=bf16 takes it)"
    else:
        bf16 = "widened to float32"
    int8 = "on vpdpwssd" if bits & 2 else "without vpdpwssd"
    return f"decode dot products: bf16 caches {bf16}, int8 caches {int8}"


_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def can_run(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, *, cache: bool = False) -> bool:
    """Whether the native kernels take this call: the one answer for the tiled path, flex, the
    ring and decoding (each then asks :func:`ops` for them).

    * on the CPU, with the library loaded;
    * ``q``, ``k``, ``v`` in one dtype: float32, or bfloat16 where :func:`bf16_route` is not
      ``fp32`` (callers hand bfloat16 on only then: :func:`operand_dtype`); with ``cache=True``
      (decoding: ``q`` float32 against a KV cache read as stored) ``k`` and ``v`` may be float32,
      bfloat16 or float16;
    * ``E`` and ``Ev`` above 0 (an empty dimension leaves BLAS nothing to do: the pure path);
    * ``mask`` None, or bool or float32 on the CPU (read in place);
    * no NaN or inf (:func:`attnlab.kernels.finite_inputs`): the native row pass would treat a
      NaN row as masked, so those go to the pure code, which propagates them as torch does.
      Decoding skips this read (``cache=True``): its kernel flags non-finite scores as it goes and
      the caller reruns the call on the pure path.
    """
    if q.device.type != "cpu" or k.device.type != "cpu" or v.device.type != "cpu":
        return False
    if cache:
        if not (q.dtype == torch.float32 and k.dtype == v.dtype and k.dtype in _CACHE_DTYPES):
            return False
    elif not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.bfloat16)):
        return False
    elif q.dtype == torch.bfloat16 and bf16_route().name == "fp32":
        return False
    if 0 in (q.shape[-1], v.shape[-1]):
        return False
    if mask is not None and (mask.device.type != "cpu" or mask.dtype not in (torch.bool, torch.float32)):
        return False
    if not cache and not finite_inputs(q, k, v, mask):
        return False
    return ops() is not None


def operand_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the native kernels get a call's inputs in: bfloat16 itself on the bf16 route
    (:func:`bf16_route`), else float32 for half types, else the dtype (the tiled path and
    attnlab.flex both ask here)."""
    if dtype == torch.bfloat16 and bf16_route().name != "fp32":
        return dtype
    return compute_dtype(dtype)


def bf16_route() -> Bf16Route:
    """The bfloat16 route the native kernels take now: ``$ATTNLAB_BF16`` (``auto``, the default;
    ``bf16``, ``bf16-emulated`` or ``fp32`` force one) and this CPU's flags.

    ``auto`` takes ``bf16`` where the CPU has ``avx512_bf16`` (Zen 4, Sapphire Rapids and later)
    and the build uses it: 0.48-0.53x torch's bf16 kernel time forward there (BENCHMARKS.md,
    "bfloat16"); elsewhere ``fp32``, today's float32 compute, which a widened bf16 GEMM cannot beat.
    """
    return _bf16_route_of(routes.settings().bf16, ops(), cpu_features())


# The routes are functions of the settings, the loaded library and the CPU's flags, asked by every
# call of the kernels: decided once per combination (a decode call of 16 keys spent 4 of its ~115 us
# asking the library for its bf16 units again: q (1, 32, 4, 128), bf16, 2-core Zen 4, 2026-12-05).
@functools.lru_cache(maxsize=16)
def _bf16_route_of(choice: str, native: Optional[Any], flags: frozenset[str]) -> Bf16Route:
    if choice == "fp32":
        return Bf16Route("fp32", "forced by ATTNLAB_BF16=fp32")
    if native is None:
        return Bf16Route("fp32", "the native kernels are not in use")
    units = bool(native.bf16_units())
    if choice == "bf16-emulated":
        return Bf16Route("bf16-emulated", "forced by ATTNLAB_BF16=bf16-emulated: bf16 operands, GEMMs widened to float32")
    if choice == "bf16":
        if units:
            return Bf16Route("bf16", "forced by ATTNLAB_BF16=bf16")
        return Bf16Route("bf16-emulated", "forced by ATTNLAB_BF16=bf16, but this build has no AVX512_BF16: "
                                          "its GEMMs widen to float32")
    if units and "avx512_bf16" in flags:
        return Bf16Route("bf16", "this CPU has avx512_bf16")
    return Bf16Route("fp32", "this CPU has no avx512_bf16, so float32 GEMMs are the faster route")


_built_routes: list[str] = []


def sgemm_routes_built() -> list[str]:
    """The float32 GEMM routes the loaded build has, by name (:data:`SGEMM_CODES` order; asked of
    the library once: each call of the kernels reads them). Empty without the native kernels."""
    native = ops()
    if native is not None and not _built_routes:
        _built_routes.extend(name for name, code in SGEMM_CODES.items() if native.sgemm_route_built(code))
    return list(_built_routes)


def sgemm_route() -> SgemmRoute:
    """The float32 GEMM route of the native kernels' tiles now: ``$ATTNLAB_SGEMM`` (``auto``, the
    default; ``avx512``, ``avx2``, ``avx512-emulated`` or ``blas`` force one) and this build.

    ``auto`` takes attnlab's micro-kernel of the widest ISA the build has (``avx512``, else
    ``avx2``), else ``blas``. On the 2-core AVX2 EPYC (BENCHMARKS.md, "float32 GEMM") the ``avx2``
    route and MKL ran the tile products at 80-95% of the FMA peak both; MKL takes its AVX2 code
    on AMD's AVX-512 CPUs too, which the ``avx512`` route is for (not yet measured on one).
    A forced route the build lacks falls back to the one below it (``avx512`` ->
    ``avx512-emulated``), and says so.
    """
    return _sgemm_route_of(routes.settings().sgemm, ops(), build_isa())


@functools.lru_cache(maxsize=16)
def _sgemm_route_of(choice: str, native: Optional[Any], isa: str) -> SgemmRoute:
    if native is None:
        return SgemmRoute("blas", "the native kernels are not in use")
    built = set(sgemm_routes_built())
    if choice == "blas":
        return SgemmRoute("blas", "forced by ATTNLAB_SGEMM=blas")
    if choice != "auto":
        if choice in built:
            return SgemmRoute(choice, f"forced by ATTNLAB_SGEMM={choice}")
        if choice == "avx512" and "avx512-emulated" in built:
            return SgemmRoute("avx512-emulated", "forced by ATTNLAB_SGEMM=avx512, but this build has no AVX-512: "
                                                 "its tile walk runs on pairs of ymm")
        return SgemmRoute("blas", f"forced by ATTNLAB_SGEMM={choice}, but this build has no AVX2 + FMA")
    if "avx512" in built:
        if isa == "avx512-emulated":
            return SgemmRoute("avx512", "the avx512-emulated build: AVX-512 source, its instructions emulated")
        return SgemmRoute("avx512", "this CPU has avx512f")
    if "avx2" in built:
        return SgemmRoute("avx2", "this CPU has avx2 and fma")
    return SgemmRoute("blas", "this CPU has no AVX2 + FMA")


if __name__ == "__main__":
    print(status())
