"""The decode kernel: a few query rows against a long KV cache, split across threads (flash-decoding).

Package-internal: :mod:`attnlab.decoding` is the public door. On the kernel layer's layout
(:mod:`.layout`), with the cache given either as dense views or as pages::

    q4 (Nb, r, L, E)      the r query heads of each key/value head's group, L <= a few rows
    dense:  k (Nb, S, E)        v (Nb, S, Ev)         views of a cache's storage work
    paged:  k (P, page, Hkv, E) v (P, page, Hkv, Ev)  with table (B, max_pages): vLLM's layout

:func:`forward` returns ``(out (Nb, r, L, Ev), lse2 (Nb, r, L))`` in float32. The keys are
cut into chunks; each chunk's partial result is computed with the online softmax
(:mod:`.online`) and the chunks are joined with the log-sum-exp merge (:func:`.merge_`), in
C++ (``csrc/decode.cpp``) or, without the native library, in PyTorch here
(:func:`forward_eager`, the readable version). Which keys a row sees::

    causal "none":          keys 0 .. S_b - 1
    causal "top_left":      keys 0 .. i            (SDPA's is_causal)
    causal "bottom_right":  keys 0 .. S_b - L + i  (new tokens after a cache of S_b - L)

``S_b`` is ``seqlens[b]`` (FlashAttention's ``cache_seqlens``) or ``S``. There is no backward.

Two inner loops (:func:`loop`, ``$ATTNLAB_DECODE`` forces one): ``"stream"`` reads each K and V
row once, as stored, into the few rows' dot products and AXPYs (a decode step: ``r * L`` up to
:data:`STREAM_MAX_ROWS`); ``"gemm"`` widens a block and runs two BLAS GEMMs (many rows: chunked
prefill, speculative decoding). An int8 cache (``k_scale``, ``v_scale``: a float32 scale per
token and head) takes either: the streaming loop scales its dot products and AXPYs, the GEMM loop
dequantises each block into its scratch (at Lq = 64 the streaming loop took 1.6x the GEMM loop's
time on the 2-core AVX2 EPYC, 2026-12-03). The streaming loop's int8 dot products run on integers
against the query rounded to int16 (:func:`int8_dot`, ``$ATTNLAB_INT8_DOT`` forces a route); a
bfloat16 cache's on ``vdpbf16ps`` where the bf16 route is on (:func:`bf16_dot`, ``$ATTNLAB_BF16``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import Tensor

from attnlab.kernels import native as _native
from attnlab.kernels import routes as _routes
from attnlab._validation import compute_dtype
from attnlab.kernels import online
from attnlab.kernels.numerics import merge_

__all__ = ["forward", "forward_eager", "choose_chunk", "loop", "plan", "DecodePlan", "CAUSAL", "BLOCK_K", "MIN_CHUNK", "MAX_CHUNK", "STREAM_MAX_ROWS",
           "STREAM_BLOCK_K", "LOOPS", "dequantize", "int8_dot", "int16_rounded", "INT8_DOTS", "INT8_DOT_CODES",
           "bf16_dot", "BF16_DOT_CODES"]

Causal = Literal["none", "top_left", "bottom_right"]
CAUSAL = {"none": 0, "top_left": 1, "bottom_right": 2}
BLOCK_K = 256  # keys per GEMM inside a chunk: flash.cpp's default tile (BENCHMARKS.md, "Tile size")
# The smallest chunk: below ~256 keys a chunk's fixed cost (its state, its share of the merge)
# outweighs its GEMMs. With 8 key/value heads on 2 threads, S = 32768 measured 21.5 ms at
# 4 chunks per thread (chunks of 2048) (2026-12-01, the 2-core Zen 4 EPYC, BENCHMARKS.md "Decoding").
MIN_CHUNK = 256
# The largest chunk: one task's keys share one float32 accumulator, whose error grows with their
# number (q (1, 32, 1, 128) against 8 key/value heads of S = 131072 on 2 threads: one task per head,
# 9.9e-6 of the output's largest value off float64, torch's SDPA 1.1e-5). csrc/decode.cpp caps its
# own choice the same way; the measurement with the cap is in BENCHMARKS.md ("decode accuracy").
MAX_CHUNK = 16384
TASKS_PER_THREAD = 4  # enough tasks that the threads finish together when chunks differ (causal, seqlens)
# The streaming loop serves up to this many rows (r * L) per key/value head; above it the block's
# GEMMs win (their packing is shared by many rows). q (1, 32, Lq, 128) against S = 32768, 2 threads,
# the 2-core AVX2 EPYC (2026-12-03, after the streaming loop's register tiles): at 32 rows (Lq = 8)
# stream / gemm = 38-40 / 41-44 ms in fp32 and bf16, 37 / 40 ms int8; at 48 rows 54-56 / 51-52 ms.
STREAM_MAX_ROWS = 32
STREAM_BLOCK_K = 64  # keys per online-softmax step in the streaming loop: its scores stay in L1
LOOPS = _routes.CHOICES["decode"]
INT8_DOTS = _routes.CHOICES["int8_dot"]
INT8_DOT_CODES = {"float32": 0, "int16": 1}  # what csrc/decode.cpp's decode_forward takes as int8_dot
BF16_DOT_CODES = {"float32": 0, "vdpbf16ps": 1}  # and as bf16_dot's bit 0 (the scores)
BF16_VALUES_BIT = 2  # bf16_dot's bit 1: the value pass on vdpbf16ps too (DecodePlan.bf16_values)
BF16_LANES_BIT = 4  # bit 2: the scores with the rows across a zmm's lanes (DecodePlan.bf16_lanes)
INT8_LANES_BIT = 2  # int8_dot's bit 1: the int16 dot products with the rows across lanes (DecodePlan.int8_lanes)
LANE_ROWS = 16  # csrc/decode_lanes.h: rows a zmm's lanes hold
# csrc/decode.cpp's decode_forward takes its integers as one list, ``plan``, in this order
PLAN_FIELDS = ("Hkv", "S", "causal", "chunk", "block_k", "mode", "sgemm", "int8_dot", "bf16_dot")


def loop(rows: int) -> str:
    """The inner loop a call of ``rows = r * L`` rows per key/value head takes: ``$ATTNLAB_DECODE``
    (:mod:`attnlab.kernels.routes`: ``auto``, the default; ``stream`` or ``gemm`` force one), else
    ``stream`` up to :data:`STREAM_MAX_ROWS` rows and ``gemm`` above (float and int8 caches alike)."""
    choice = _routes.settings().decode
    if choice != "auto":
        return choice
    return "stream" if rows <= STREAM_MAX_ROWS else "gemm"


@dataclass(frozen=True)
class DecodePlan:
    """Every shape-dependent choice of one decode call, made once by :func:`plan` and passed to
    the kernel: ``rows`` per key/value head (``r * L``), the inner ``loop``, and the dot products
    of an int8 cache (``int8_dot``) and of a bf16 one (``bf16_dot``)."""

    rows: int
    loop: str
    int8_dot: str
    bf16_dot: str
    cache_dtype: torch.dtype
    bf16_values: bool = False  # the value pass on vdpbf16ps too, P~ rounded to bf16 (:func:`bf16_values`)
    bf16_lanes: bool = False  # the scores with the rows across a zmm's lanes (:func:`bf16_lanes`)
    int8_lanes: bool = False  # an int8 cache's int16 dot products the same way (:func:`int8_lanes`)

    @property
    def bf16_code(self) -> int:
        """What ``csrc/decode.cpp``'s ``decode_forward`` takes as ``bf16_dot``."""
        return (BF16_DOT_CODES[self.bf16_dot] | (BF16_VALUES_BIT if self.bf16_values else 0)
                | (BF16_LANES_BIT if self.bf16_lanes else 0))

    def codes(self, *, Hkv: int, S: int, causal: int, chunk: int, block_k: int, sgemm: int) -> list[int]:
        """``decode_forward``'s ``plan``: this route's codes with the call's shape, in
        :data:`PLAN_FIELDS`' order (``causal``: :data:`CAUSAL`'s code; ``chunk`` 0: the kernel's
        choice; ``sgemm``: the float32 GEMM route's code)."""
        named = dict(Hkv=Hkv, S=S, causal=causal, chunk=chunk, block_k=block_k,
                     mode=1 if self.loop == "stream" else 0, sgemm=sgemm,
                     int8_dot=INT8_DOT_CODES[self.int8_dot] | (INT8_LANES_BIT if self.int8_lanes else 0),
                     bf16_dot=self.bf16_code)
        return [int(named[field]) for field in PLAN_FIELDS]

    @property
    def dots(self) -> str:
        """The instructions of the key dot products, in words."""
        if self.cache_dtype == torch.int8:
            words = {"int16": "int16 x int8 in integers (vpmaddwd, or vpdpwssd where built)",
                     "float32": "int8 widened to float32 FMAs"}[self.int8_dot]
            return words + (", the rows across a zmm's lanes" if self.int8_lanes else "")
        if self.cache_dtype == torch.bfloat16:
            words = {"vdpbf16ps": "vdpbf16ps on the stored bf16", "float32": "bf16 widened to float32 FMAs"}[
                self.bf16_dot]
            words += ", the rows across a zmm's lanes" if self.bf16_lanes else ""
            return words + (", values on vdpbf16ps (P rounded to bf16)" if self.bf16_values else "")
        return "float32 FMAs"


def plan(rows: int, E: int, cache_dtype: torch.dtype, out_dtype: torch.dtype = torch.float32,
         Ev: Optional[int] = None) -> DecodePlan:
    """The route of a decode call: ``rows`` query rows per key/value head, head sizes ``E`` and
    ``Ev`` (default ``E``), the cache's dtype and the output's; from the settings
    (:mod:`attnlab.kernels.routes`) and the build; decided once for each combination of these (the
    choices asked the library and the settings six times a call: 3.7 of a 16-key bf16 call's ~115 us,
    q (1, 32, 4, 128) on the 2-core Zen 4, 2026-12-05)."""
    return _plan_of(rows, E, E if Ev is None else Ev, cache_dtype, out_dtype, _routes.settings(), _native.ops(),
                    _native.cpu_features())


@functools.lru_cache(maxsize=64)
def _plan_of(rows: int, E: int, Ev: int, cache_dtype: torch.dtype, out_dtype: torch.dtype, settings: object,
             library: object, flags: frozenset[str]) -> DecodePlan:
    mode = loop(rows)
    bf16 = cache_dtype == torch.bfloat16
    dot = bf16_dot(E, mode) if bf16 else "float32"
    idot = int8_dot(E, mode) if cache_dtype == torch.int8 else "float32"
    return DecodePlan(rows, mode, idot, dot, cache_dtype, bf16 and bf16_values(Ev, dot, out_dtype),
                      bf16 and bf16_lanes(rows, E, dot), int8_lanes(rows, E, idot))


def int8_dot(E: int, mode: str) -> str:
    """How the native streaming loop takes an int8 cache's dot products for head size ``E`` on loop
    ``mode``: ``$ATTNLAB_INT8_DOT`` (``auto``, the default; ``int16`` or ``float32`` force one).

    ``"int16"``: each query row rounded to int16 on a scale of its own (:func:`int16_rounded`), the
    key rows' int8 values multiplied in integers (``vpmaddwd``; ``vpdpwssd`` where the build has
    AVX512_VNNI: the same exact sums in half the instructions), one scale per row and key applied
    to the exact int32 sum. ``"float32"``: each int8 element widened to float32 for an FMA. The
    int16 route needs the streaming loop, ``E`` a multiple of 16 and at most 512 (its int32 sums
    stay exact), and the native kernels; ``auto`` takes it where the build has AVX2.

    The rounding is at most half of ``amax / 32767`` per query element, 1/258 of what the int8
    keys' own rounding allows; results agree with the float32 route to a few 1e-5 of the output's
    largest value (2.9e-5 at S = 4096, 4.0e-5 at S = 32768: ``q (1, 32, 1, 128)``, Gaussian). On the 2-core AVX2 EPYC it took
    int8 decoding from 0.79-0.88x bf16's time to 0.64-0.75x at ``Lq = 1`` (one thread, CPU time,
    old and new builds alternated; BENCHMARKS.md, "int8 dot products on integers").
    """
    choice = _routes.settings().int8_dot
    if mode != "stream" or E % 16 or E > 512 or _native.ops() is None or choice == "float32":
        return "float32"
    if choice == "int16" or "avx2" in _native.sgemm_routes_built():
        return "int16"
    return "float32"


def bf16_dot(E: int, mode: str) -> str:
    """How the native streaming loop takes a bfloat16 cache's dot products for head size ``E`` on
    loop ``mode``: ``"vdpbf16ps"`` (the query's bf16 rows against each key row as stored, 16
    elements an instruction: AVX512_BF16) where the native kernels' bf16 route is ``bf16``
    (:func:`attnlab.kernels.native.bf16_route`: ``$ATTNLAB_BF16``, ``auto`` on a CPU with
    ``avx512_bf16``), ``mode`` is ``"stream"`` and ``E`` a multiple of 16; else ``"float32"`` (each
    key element widened for an FMA).

    The route gives the float32 route's answers to float32's rounding: each pair of bf16 products is
    exact in float32 and summed with one rounding each, as an FMA chain is. The kernel takes it only
    for a query whose values are bf16 already (a bf16 query widened: no rounding), with no denormal
    (the instruction reads those as zero) and ``|q * scale|`` below ``2^64`` (so that key denormals,
    read as zero, move a score by less than ``E * 2^-62``); for any other query the call runs on the
    float32 route. Measured on a Zen 5 in BENCHMARKS.md ("Decoding at the memory's speed").
    The kernel checks this choice and refuses one its build cannot run.
    """
    if mode != "stream" or E % 16 or not _native.decode_dot_bits() & 1:
        return "float32"
    return "vdpbf16ps" if _native.bf16_route().name == "bf16" else "float32"


def bf16_lanes(rows: int, E: int, dot: str) -> bool:
    """Whether a bfloat16 cache's scores on ``vdpbf16ps`` (``dot``, :func:`bf16_dot`'s answer) hold
    the ``rows`` query rows of a key/value head across one zmm's lanes (``csrc/decode_lanes.h``:
    each key's pair of elements broadcast into the instruction, no reductions): for 9 to
    :data:`LANE_ROWS` rows (fewer waste lanes; the row-major ``bdots2`` takes them), ``E % 4 == 0``,
    where the build has 512-bit ``vdpbf16ps`` (:func:`attnlab.kernels.native.decode_dot_bits`' bit
    2). Same sums as ``bdots2`` in another order. Measured in BENCHMARKS.md ("the streaming loop on
    512 bits")."""
    return dot == "vdpbf16ps" and 8 < rows <= LANE_ROWS and E % 4 == 0 and bool(_native.decode_dot_bits() & 4)


def int8_lanes(rows: int, E: int, dot: str) -> bool:
    """Whether an int8 cache's integer dot products (``dot``, :func:`int8_dot`'s answer ``"int16"``)
    hold the ``rows`` query rows of a key/value head across one zmm's lanes, as :func:`bf16_lanes`
    does for bf16 (``csrc/decode_lanes.h``'s ``lane_idots8``: 512-bit ``vpdpwssd``, the same exact
    int32 sums, the same scores to the bit): 9 to :data:`LANE_ROWS` rows, ``E % 32 == 0``, where
    the build has AVX512BW (:func:`attnlab.kernels.native.decode_dot_bits`' bit 3)."""
    return dot == "int16" and 8 < rows <= LANE_ROWS and E % 32 == 0 and bool(_native.decode_dot_bits() & 8)


def bf16_values(Ev: int, dot: str, out_dtype: torch.dtype) -> bool:
    """Whether the native streaming loop runs a bfloat16 cache's value pass on ``vdpbf16ps`` too:
    where its scores take it (``dot``, :func:`bf16_dot`'s answer), ``Ev`` is a multiple of 32 and
    the output is bfloat16 (a bfloat16 query). P~ is then rounded to bf16 before its product with
    V, as torch's bf16 kernel rounds P before its P V GEMM; a float32 output keeps float32 weights.
    Measured in BENCHMARKS.md ("a bf16 value pass on vdpbf16ps")."""
    return out_dtype == torch.bfloat16 and Ev % 32 == 0 and dot == "vdpbf16ps"


def int16_rounded(q: Tensor) -> Tensor:
    """``q (..., E)`` float32 as the int16 route uses it: each row rounded to int16 on the scale
    ``amax / 32767`` (``amax`` its largest magnitude; half to even), returned dequantised in
    float64 (``qi * qs``), so that a reference over it is exact. The same float32 operations as
    ``quantize_rows`` in ``csrc/decode.cpp``."""
    q = q.float()
    amax = q.abs().amax(-1, keepdim=True)
    safe = torch.where(amax == 0, torch.ones_like(amax), amax)
    qi = torch.round(q * (torch.tensor(32767.0) / safe)).clamp(-32767, 32767)
    qs = torch.where(amax == 0, torch.zeros_like(amax), amax / torch.tensor(32767.0))
    return qi.double() * qs.double()


def choose_chunk(S: int, Nb: int, threads: int, page: int = 1) -> int:
    """Keys per chunk: about ``TASKS_PER_THREAD`` tasks per thread over the ``Nb`` heads, at least
    ``MIN_CHUNK`` and at most ``MAX_CHUNK`` (accuracy), a whole number of pages."""
    splits = max(1, math.ceil(TASKS_PER_THREAD * threads / max(Nb, 1)))
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, math.ceil(S / splits)))
    return math.ceil(chunk / page) * page


def forward(q4: Tensor, k: Tensor, v: Tensor, *, Hkv: int, S: int, scale2: float, causal: Causal = "none",
            table: Optional[Tensor] = None, seqlens: Optional[Tensor] = None,
            chunk: Optional[int] = None, k_scale: Optional[Tensor] = None,
            v_scale: Optional[Tensor] = None, out_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, bool]:
    """``(out, lse2, nonfinite)`` for ``q4`` against the cache (see the module doc);
    ``scale2 = scale * log2(e)``; ``k_scale``, ``v_scale``: an int8 cache's scales, ``(Nb, S)``
    dense or ``(P, page, Hkv)`` paged; ``out_dtype``: what the caller turns ``out`` into (a
    bfloat16 output lets a bf16 cache's value pass round P to bf16: :func:`bf16_values`).

    Runs ``csrc/decode.cpp`` when the native library is loaded (K/V in float32, bfloat16,
    float16 or int8, read as stored), else :func:`forward_eager`. The native kernel flags NaN or
    inf scores as it computes them (``nonfinite``) instead of re-reading the cache first, and a NaN
    or inf output (values') or NaN or +inf ``lse2`` as it merges. The caller (:mod:`attnlab.decoding`)
    then reruns the call on the pure path, which propagates them as torch's MATH backend does (and
    whose own results this returns with ``nonfinite`` False).
    """
    int8 = k.dtype == torch.int8
    if int8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError("decode: an int8 cache needs k_scale and v_scale, and only an int8 cache takes them")
    route = plan(q4.shape[1] * q4.shape[2], q4.shape[-1], k.dtype, out_dtype, v.shape[-1])
    mode = route.loop
    native = _native.ops() is not None and q4.device.type == k.device.type == v.device.type == "cpu" and (
        _native.can_run(q4, k, v, cache=True) or (int8 and q4.dtype == torch.float32 and v.dtype == torch.int8
                                                  and 0 not in (q4.shape[-1], v.shape[-1])))
    if native:
        # chunk 0: the kernel splits every head's own keys into about TASKS_PER_THREAD tasks per thread
        codes = route.codes(Hkv=Hkv, S=S, causal=CAUSAL[causal], chunk=chunk or 0,
                            block_k=STREAM_BLOCK_K if mode == "stream" else BLOCK_K, sgemm=_native.sgemm_route().code)
        args = (q4.contiguous(), k, v, table, seqlens, k_scale, v_scale, scale2, codes)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args[:7]):
            out, lse2, nonfinite = _native.ops().decode_forward(*args)  # its autograd refuses a backward by name
        else:
            # no gradient asked for: the op below its autograd layer, as that layer's own no-grad
            # path calls it (torch._library.autograd), without the Python around it (7 of a 16-key
            # call's ~40 us in the op: q (1, 32, 4, 128), 2-core Zen 4, 2026-12-05)
            with torch._C._AutoDispatchBelowAutograd():
                out, lse2, nonfinite = _native.ops().decode_forward(*args)
        return out, lse2, bool(nonfinite)
    page = k.shape[1] if table is not None else 1
    chunk = chunk or choose_chunk(S, q4.shape[0], torch.get_num_threads(), page)
    if int8:  # the readable version: the cache dequantised, then the float path
        k, v = dequantize(k, k_scale), dequantize(v, v_scale)
    k3, v3 = (gather(k, table, S), gather(v, table, S)) if table is not None else (k[:, :S], v[:, :S])
    dtype = compute_dtype(k.dtype)  # float16/bfloat16 in float32, float64 as it is
    out, lse2 = forward_eager(q4.to(dtype), k3.to(dtype), v3.to(dtype), Hkv=Hkv, scale2=scale2, causal=causal,
                              seqlens=seqlens, chunk=chunk)
    return out, lse2, False  # the pure path propagates NaN and inf itself


def dequantize(x: Tensor, scale: Tensor) -> Tensor:
    """An int8 cache's float32 values: ``x * scale`` with one scale per row (token and head):
    ``x (Nb, S, E)`` with ``scale (Nb, S)``, or pages ``(P, page, Hkv, E)`` with ``(P, page, Hkv)``."""
    return x.to(torch.float32) * scale[..., None]


def gather(pages: Tensor, table: Tensor, S: int) -> Tensor:
    """A paged cache's first ``S`` rows per head as a dense ``(B * Hkv, S, E)`` tensor (a copy:
    the pure path's readable version; the native kernel reads the pages in place)."""
    P, page, Hkv, E = pages.shape
    B = table.shape[0]
    n_pages = math.ceil(S / page) if S else 0
    rows = pages[table[:, :n_pages].reshape(-1)]  # (B * n_pages, page, Hkv, E)
    rows = rows.view(B, n_pages * page, Hkv, E)[:, :S]  # (B, S, Hkv, E)
    return rows.permute(0, 2, 1, 3).reshape(B * Hkv, S, E)  # (B * Hkv, S, E)


def visible_keys(Nb: int, r: int, L: int, S: int, Hkv: int, causal: Causal, seqlens: Optional[Tensor],
                 device) -> Tensor:
    """``(Nb, r * L)`` int64: row ``a = h * L + i`` of head ``nb`` sees keys ``0 .. limit - 1``."""
    S_b = (seqlens.clamp(max=S).repeat_interleave(Hkv) if seqlens is not None
           else torch.full((Nb,), S, dtype=torch.int64, device=device))  # (Nb,)
    i = torch.arange(L, device=device).repeat(r)  # (r * L,) query position of each row
    if causal == "none":
        return S_b[:, None].expand(Nb, r * L)
    shift = S_b[:, None] - L if causal == "bottom_right" else torch.zeros_like(S_b)[:, None]
    return torch.minimum(S_b[:, None], shift + i[None, :] + 1).clamp(min=0)


def forward_eager(q4: Tensor, k3: Tensor, v3: Tensor, *, Hkv: int, scale2: float, causal: Causal = "none",
                  seqlens: Optional[Tensor] = None, chunk: Optional[int] = None,
                  block_k: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """The decode forward in PyTorch: chunks of keys, each through the online softmax, joined by
    the log-sum-exp merge; every key block is visited (hidden keys as -inf), so NaN and inf
    propagate as in torch's MATH backend. ``k3 (Nb, S, E)``, ``v3 (Nb, S, Ev)``, any float dtype."""
    Nb, r, L, E = q4.shape
    S, Ev = k3.shape[1], v3.shape[2]
    n = r * L
    chunk = chunk or choose_chunk(S, Nb, torch.get_num_threads())
    block_k = block_k or BLOCK_K
    q = (q4.to(k3.dtype) * scale2).reshape(Nb, n, E)  # (Nb, r*L, E): the group's rows, scale folded in
    limit = visible_keys(Nb, r, L, S, Hkv, causal, seqlens, q.device)  # (Nb, n)
    # keys past a sequence's length do not exist (FlashAttention's cache_seqlens): their rows
    # may hold anything, so their values are zeroed, not only their weights
    exists = (torch.arange(S, device=q.device)[None, :] < seqlens.clamp(max=S).repeat_interleave(Hkv)[:, None]
              if seqlens is not None else None)  # (Nb, S)
    out = q.new_zeros(Nb, n, Ev)
    lse2 = q.new_full((Nb, n), float("-inf"))
    for c0 in range(0, S, chunk):
        m_i, l_i, acc = online.start((Nb, n), Ev, q)
        for j0 in range(c0, min(S, c0 + chunk), block_k):
            j1 = min(S, c0 + chunk, j0 + block_k)
            s = torch.bmm(q, k3[:, j0:j1].transpose(1, 2))  # (Nb, n, bk)
            cols = torch.arange(j0, j1, device=q.device)
            s.masked_fill_(cols[None, None, :] >= limit[:, :, None], float("-inf"))
            v = v3[:, j0:j1] if exists is None else v3[:, j0:j1].masked_fill(~exists[:, j0:j1, None], 0.0)
            m_i, l_i, acc = online.update(m_i, l_i, acc, s, v)
        o, l = online.finish(m_i, l_i, acc)  # (Nb, n, Ev), (Nb, n): this chunk's partial result
        merge_(out, lse2, o, l)
    return out.reshape(Nb, r, L, Ev), lse2.reshape(Nb, r, L)
