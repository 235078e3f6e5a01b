"""attnlab's Triton kernels: its GPU route, and lab 05's reference.

FlashAttention-2's forward and backward (:func:`flash_attention`) and flash-decoding for a few
rows against a long cache (:func:`decode_attention`), written from scratch in Triton
(:mod:`attnlab.triton.kernels`), with SDPA's meaning: ``is_causal`` top-left (query ``i`` sees
keys ``0..i``), a row that sees no key gives 0, ``scale`` default ``1 / sqrt(E)``, ``enable_gqa``
with query head ``h`` reading key/value head ``h // (H // Hkv)``.

On a GPU the kernels are compiled by Triton; :func:`attnlab.dispatch.attention` takes this
route for CUDA tensors when triton is installed (``impl="triton"`` forces it). On the CPU they
run under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported): slow,
exact, for tests and for grading lab 05 on machines without a GPU. The interpreter computes
bf16 ``tl.dot`` wrongly (triton issue 11584), so there the operands are widened to float32
first; float32 dots use IEEE precision (not TF32), as SDPA's float32 does.

    q (B, H, L, E)    k (B, Hkv, S, E)    v (B, Hkv, S, Ev)    ->    (B, H, L, Ev)

``pip install 'attnlab[triton]'`` installs triton.
"""

from __future__ import annotations

import math
import os
from typing import Literal, NamedTuple, Optional

import torch
from torch import Tensor

from attnlab._validation import default_scale, validate

__all__ = ["flash_attention", "decode_attention", "available", "why_unavailable", "tiles", "Tiles", "GPU_TILES",
           "BLOCK_Q", "BLOCK_K", "DECODE_MAX_L"]

BLOCK_Q = 16  # query rows per program under the interpreter, and decode's: tl.dot's smallest tile
BLOCK_K = 16  # keys per step of a program's loop, likewise
DECODE_MAX_L = 16  # decode_attention's rows: one tile


class Tiles(NamedTuple):
    """One launch's tile shape and Triton settings: ``BQ`` query rows per program, ``BK`` keys
    per step (the backward's dK/dV programs own ``BK`` keys and step over ``BQ`` rows), and
    ``num_warps``, ``num_stages`` as Triton takes them."""

    BQ: int
    BK: int
    num_warps: int
    num_stages: int


# The interpreter: its time grows with a tile's area, and 16 is tl.dot's smallest.
INTERPRETED_TILES = Tiles(BLOCK_Q, BLOCK_K, 4, 1)
# A GPU, per (operand class, stage): "half64" is 16-bit operands with E, Ev <= 64, "half128" and
# "half256" up to 128 and 256, "wide" float32 up to 128, "wide256" float32 up to 256, "huge" wider
# heads. Measured on an H200 (torch 2.11, triton 3.6) by tools/gpu_sweep.py at (4, 16, 4096, E):
# the fastest of its candidates (BENCHMARKS.md, "attnlab.triton on a GPU"); the 256 classes are
# those Triton fits into the 227 KiB of shared memory (the 64-wide ones asked for 256-417 KiB).
GPU_TILES: dict[tuple[str, str], Tiles] = {
    ("half64", "fwd"): Tiles(128, 64, 8, 3), ("half64", "bwd"): Tiles(64, 64, 4, 2),
    ("half128", "fwd"): Tiles(64, 64, 4, 3), ("half128", "bwd"): Tiles(64, 64, 4, 2),
    ("half256", "fwd"): Tiles(64, 64, 4, 3), ("half256", "bwd"): Tiles(32, 32, 4, 2),
    ("wide", "fwd"): Tiles(128, 64, 8, 3), ("wide", "bwd"): Tiles(32, 32, 4, 2),
    ("wide256", "fwd"): Tiles(32, 32, 4, 1), ("wide256", "bwd"): Tiles(16, 16, 4, 1),
    ("huge", "fwd"): Tiles(16, 16, 4, 1), ("huge", "bwd"): Tiles(16, 16, 4, 1),
}


def _tile_class(dtype: torch.dtype, width: int) -> str:
    half = dtype in (torch.float16, torch.bfloat16)
    for limit, klass in ((64, "half64"), (128, "half128"), (256, "half256")) if half else ((128, "wide"),
                                                                                           (256, "wide256")):
        if width <= limit:
            return klass
    return "huge"


def tiles(query: Tensor, value: Tensor, stage: Literal["fwd", "bwd"]) -> Tiles:
    """The tiles :func:`flash_attention`'s ``stage`` launches with for these operands:
    :data:`INTERPRETED_TILES` under the interpreter, else :data:`GPU_TILES`' entry for the class
    of ``query`` ``(B, H, L, E)`` and ``value`` ``(B, Hkv, S, Ev)``."""
    if interpreted() or query.device.type != "cuda":
        return INTERPRETED_TILES
    return GPU_TILES[(_tile_class(query.dtype, max(_pow2(query.shape[-1]), _pow2(value.shape[-1]))), stage)]


def interpreted() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): how CPU tensors are served."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() == "1"


def why_unavailable(*tensors: Tensor) -> Optional[str]:
    """Why the Triton kernels cannot run on these tensors here, or None when they can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: pip install 'attnlab[triton]'"
    devices = {t.device.type for t in tensors}
    if devices <= {"cuda"}:
        return None
    if devices <= {"cpu"}:
        return None if interpreted() else ("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before "
                                           "triton is imported (slow; for tests and lab 05)")
    return f"the tensors must all be on one CUDA device, or on the CPU under TRITON_INTERPRET=1; got {sorted(devices)}"


def available(*tensors: Tensor) -> bool:
    """Whether :func:`flash_attention` can run on these tensors here."""
    return why_unavailable(*tensors) is None


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _flags(dtype: torch.dtype) -> dict:
    # the interpreter's bf16/fp16 dots are wrong: widen them there (a GPU runs them as they are)
    return {"UPCAST": interpreted() and dtype in (torch.bfloat16, torch.float16)}


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    # the interpreter rounds float32 -> bfloat16 toward zero (Triton's debugging guide: it does not
    # support bfloat16 arithmetic), one ulp off SDPA: there the kernels store float32 and torch rounds
    return torch.float32 if interpreted() else dtype


def _check(fn: str, query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale, enable_gqa: bool) -> None:
    validate(query, key, value, None, 0.0, is_causal, scale, enable_gqa, fn=fn)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"{fn}: query, key and value must be 4-D (B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev), "
                         f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[0] != query.shape[0] or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"{fn}: key and value must share query's batch and each other's heads and length, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    why = why_unavailable(query, key, value)
    if why:
        raise RuntimeError(f"{fn}: {why}")


def _check_align(fn: str, causal_align: str) -> None:
    if causal_align not in ("top_left", "bottom_right"):
        raise ValueError(f"{fn}: causal_align must be 'top_left' or 'bottom_right', got {causal_align!r}")


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, offset):
        from attnlab.triton import kernels
        import triton

        B, H, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = torch.empty(B, H, L, Ev, dtype=_store_dtype(q.dtype), device=q.device)
        lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
        t = tiles(q, v, "fwd")
        grid = (triton.cdiv(L, t.BQ), B * H)
        kernels.fwd_kernel[grid](q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                 *o.stride()[:3], H, Hkv, L, S, E, Ev, scale, offset, E_P=_pow2(E), EV_P=_pow2(Ev),
                                 BQ=t.BQ, BK=t.BK, CAUSAL=is_causal, num_warps=t.num_warps, num_stages=t.num_stages,
                                 **_flags(q.dtype))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.meta = (is_causal, scale, offset)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        from attnlab.triton import kernels
        import triton

        q, k, v, o, lse = ctx.saved_tensors
        is_causal, scale, offset = ctx.meta
        B, H, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
        do = do.contiguous().to(o.dtype)
        D = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
        kernels.bwd_preprocess_kernel[(triton.cdiv(L, BLOCK_Q), B * H)](o, do, D, L, Ev, EV_P=_pow2(Ev), BQ=BLOCK_Q)
        dk = torch.zeros(B, Hkv, S, E, dtype=torch.float32, device=q.device)
        dv = torch.zeros(B, Hkv, S, Ev, dtype=torch.float32, device=q.device)
        dq = torch.zeros(B, H, L, E, dtype=torch.float32, device=q.device)
        t = tiles(q, v, "bwd")
        common = dict(E_P=_pow2(E), EV_P=_pow2(Ev), BQ=t.BQ, BK=t.BK, CAUSAL=is_causal, num_warps=t.num_warps,
                      num_stages=t.num_stages, **_flags(q.dtype))
        kernels.bwd_dkdv_kernel[(triton.cdiv(S, t.BK), B * Hkv)](q, k, v, do, lse, D, dk, dv, H, Hkv, L, S, E, Ev,
                                                                 scale, offset, **common)
        kernels.bwd_dq_kernel[(triton.cdiv(L, t.BQ), B * H)](q, k, v, do, lse, D, dq, H, Hkv, L, S, E, Ev, scale,
                                                             offset, **common)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def flash_attention(query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False, scale: Optional[float] = None,
                    enable_gqa: bool = False, *,
                    causal_align: Literal["top_left", "bottom_right"] = "top_left") -> Tensor:
    """SDPA's answer through attnlab's Triton kernels, forward and backward.

    Args:
        query: ``(B, H, L, E)``, float32, float16 or bfloat16.
        key: ``(B, Hkv, S, E)``; ``Hkv == H``, or a divisor of ``H`` with ``enable_gqa``.
        value: ``(B, Hkv, S, Ev)``.
        is_causal: query ``i`` sees keys ``0..i`` (top-left, SDPA's).
        scale: default ``1 / sqrt(E)``.
        enable_gqa: grouped heads: query head ``h`` reads key/value head ``h // (H // Hkv)``.
        causal_align: ``"top_left"`` (SDPA's) or ``"bottom_right"`` (query ``i`` sees keys
            ``0..S - L + i``: new tokens after a cache); a row that sees no key gives 0.

    Returns:
        ``(B, H, L, Ev)`` in the query's dtype; differentiable (the backward's kernels).

    Raises:
        RuntimeError: triton is missing, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    fn = "attnlab.triton.flash_attention"
    _check(fn, query, key, value, is_causal, scale, enable_gqa)
    _check_align(fn, causal_align)
    offset = key.shape[2] - query.shape[2] if causal_align == "bottom_right" else 0
    return _FlashAttention.apply(query, key, value, bool(is_causal), default_scale(scale, query.shape[-1]), offset)


def decode_attention(query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False,
                     scale: Optional[float] = None, *, enable_gqa: bool = False,
                     causal_align: Literal["top_left", "bottom_right"] = "top_left", chunk: int = 256) -> Tensor:
    """A few query rows (``L <= 16``) against a long cache: flash-decoding, each program one
    chunk of ``chunk`` keys of one (batch, head), the chunks joined by the log-sum-exp merge.
    :func:`attnlab.decoding.decode_attention`'s meaning; no backward.

    Args:
        query: ``(B, H, L, E)``, ``L <= 16``.
        key: ``(B, Hkv, S, E)``.
        value: ``(B, Hkv, S, Ev)``.
        is_causal: hide keys after each query's position, aligned by ``causal_align``.
        scale: default ``1 / sqrt(E)``.
        enable_gqa: grouped heads, as in :func:`flash_attention`.
        causal_align: ``"top_left"`` (query ``i`` sees keys ``0..i``) or ``"bottom_right"``
            (``0..S - L + i``: new tokens after a cache).
        chunk: keys per program.

    Returns:
        ``(B, H, L, Ev)`` in the query's dtype.
    """
    fn = "attnlab.triton.decode_attention"
    _check(fn, query, key, value, is_causal, scale, enable_gqa)
    if query.shape[2] > DECODE_MAX_L:
        raise ValueError(f"{fn}: at most {DECODE_MAX_L} query rows, got L={query.shape[2]}; use flash_attention")
    _check_align(fn, causal_align)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{fn}: chunk must be a positive int, got {chunk!r}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise ValueError(f"{fn}: decoding has no backward; call it under torch.no_grad(), or use flash_attention")
    from attnlab.triton import kernels

    B, H, L, E = query.shape
    Hkv, S, Ev = key.shape[1], key.shape[2], value.shape[3]
    if S == 0 or L == 0:
        return query.new_zeros(B, H, L, Ev)
    chunk = max(BLOCK_K, math.ceil(chunk / BLOCK_K) * BLOCK_K)
    n_chunks = math.ceil(S / chunk)
    EV_P = _pow2(Ev)
    parts = torch.empty(B * H, n_chunks, BLOCK_Q, EV_P, dtype=torch.float32, device=query.device)
    lses = torch.empty(B * H, n_chunks, BLOCK_Q, dtype=torch.float32, device=query.device)
    offset = S - L if causal_align == "bottom_right" else 0
    kernels.decode_kernel[(n_chunks, B * H)](query, key, value, parts, lses, *query.stride()[:3], *key.stride()[:3],
                                             *value.stride()[:3], H, Hkv, L, S, E, Ev,
                                             default_scale(scale, E), offset, chunk, E_P=_pow2(E), EV_P=EV_P,
                                             BQ=BLOCK_Q, BK=BLOCK_K, CAUSAL=bool(is_causal), **_flags(query.dtype))
    # the log-sum-exp merge of the chunks: M = max lse_c, w_c = exp(lse_c - M), O = sum w_c O_c / sum w_c
    m = lses.amax(dim=1, keepdim=True)  # (B*H, 1, BQ)
    w = torch.where(torch.isneginf(lses), torch.zeros_like(lses), torch.exp(lses - torch.where(torch.isneginf(m), 0.0,
                                                                                               m)))
    total = w.sum(dim=1)  # (B*H, BQ)
    out = (w[..., None] * parts).sum(dim=1) / torch.where(total == 0, 1.0, total)[..., None]  # (B*H, BQ, EV_P)
    return out[:, :L, :Ev].reshape(B, H, L, Ev).to(query.dtype)
