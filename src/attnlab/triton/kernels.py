"""attnlab's Triton kernels (package-internal: :mod:`attnlab.triton` is the door).

FlashAttention-2 in Triton, the same algorithm as the C++ kernels (:mod:`attnlab.kernels`) and
lab 05's solution: one program per (query tile, batch x head) keeps the online-softmax state
``m_i``, ``l_i``, ``acc`` over the key tiles and stores O and the natural-log ``lse``; the
backward recomputes P from ``lse``, with ``D = rowsum(dO * O)`` from a preprocess kernel, dK and
dV in one program per key tile (it loops over the query heads of its group and their query
tiles, so no atomics) and dQ in one program per query tile. Grouped heads are index arithmetic:
query head ``h`` reads key/value head ``h // (H // Hkv)``; nothing is repeated.

Shapes, in the kernels' pointer arithmetic::

    q (B, H, L, E)    k (B, Hkv, S, E)    v (B, Hkv, S, Ev)    o (B, H, L, Ev)    lse (B, H, L)

``E`` and ``Ev`` are padded to powers of two inside a program (``E_P``, ``EV_P``), masked on
load and store; ``L`` and ``S`` need not be multiples of the tiles. Causality is an offset:
query ``i`` sees keys ``j <= i + offset`` (0: SDPA's top-left; ``S - L``: bottom-right).
``UPCAST``: the operands of ``tl.dot`` are widened to float32 first (Triton's CPU interpreter
computes bf16 dots wrongly, triton issue 11584; on a GPU the dots run in the inputs' dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__: list[str] = []  # package-internal


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """tl.dot with float32 accumulation. ``b`` is an input tile; ``a`` an input tile or a float32
    intermediate (P, dS), rounded to ``b``'s dtype for the tensor cores on a GPU, as FlashAttention
    does. Float32 operands at IEEE precision (not TF32: SDPA's float32 answer). ``UPCAST`` (the CPU
    interpreter, whose half dots are wrong): both widened, P and dS kept in float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if b.dtype == tl.float32:
        return tl.dot(a.to(tl.float32), b, input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def fwd_kernel(Q, K, V, O, LSE, sq_b, sq_h, sq_l, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_l,
               H, Hkv, L, S, E, Ev, scale, offset,
               E_P: tl.constexpr, EV_P: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, CAUSAL: tl.constexpr,
               UPCAST: tl.constexpr):
    """One query tile of one (batch, head): the online softmax over the key tiles it sees."""
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // (H // Hkv)  # the group's key/value head
    rows = pid_q * BQ + tl.arange(0, BQ)  # (BQ,)
    e = tl.arange(0, E_P)
    ev = tl.arange(0, EV_P)
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_l + e[None, :],
                mask=(rows[:, None] < L) & (e[None, :] < E), other=0.0)  # (BQ, E_P)
    m_i = tl.full([BQ], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, EV_P], tl.float32)
    stop = S
    if CAUSAL:  # the key tiles wholly after this query tile's last row are never visited
        stop = tl.minimum(S, tl.maximum(0, (pid_q + 1) * BQ + offset))
    for start in range(0, stop, BK):
        cols = start + tl.arange(0, BK)  # (BK,)
        k = tl.load(K + b * sk_b + hk * sk_h + cols[:, None] * sk_s + e[None, :],
                    mask=(cols[:, None] < S) & (e[None, :] < E), other=0.0)  # (BK, E_P)
        s = _dot(q, tl.trans(k), UPCAST) * scale  # (BQ, BK)
        seen = cols[None, :] < S
        if CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing: no -inf - -inf
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)  # rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * sv_b + hk * sv_h + cols[:, None] * sv_s + ev[None, :],
                    mask=(cols[:, None] < S) & (ev[None, :] < Ev), other=0.0)  # (BK, EV_P)
        acc = acc * alpha[:, None] + _dot(p, v, UPCAST)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that saw no key is 0, as SDPA's
    tl.store(O + b * so_b + h * so_h + rows[:, None] * so_l + ev[None, :], out.to(O.dtype.element_ty),
             mask=(rows[:, None] < L) & (ev[None, :] < Ev))
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(LSE + bh * L + rows, lse, mask=rows < L)


@triton.jit
def bwd_preprocess_kernel(O, DO, D, L, Ev, EV_P: tl.constexpr, BQ: tl.constexpr):
    """D = rowsum(dO * O) for one query tile of one (batch, head); O and dO contiguous."""
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_q * BQ + tl.arange(0, BQ)
    ev = tl.arange(0, EV_P)
    where = bh * L * Ev + rows[:, None] * Ev + ev[None, :]
    inside = (rows[:, None] < L) & (ev[None, :] < Ev)
    o = tl.load(O + where, mask=inside, other=0.0).to(tl.float32)
    do = tl.load(DO + where, mask=inside, other=0.0).to(tl.float32)
    tl.store(D + bh * L + rows, tl.sum(o * do, 1), mask=rows < L)


@triton.jit
def bwd_dkdv_kernel(Q, K, V, DO, LSE, D, DK, DV, H, Hkv, L, S, E, Ev, scale, offset,
                    E_P: tl.constexpr, EV_P: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                    CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """dK and dV of one key tile of one (batch, key/value head): over the query heads of its
    group and their query tiles, in float32, written once (no atomics). Every tensor contiguous."""
    pid_k = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    r = H // Hkv
    cols = pid_k * BK + tl.arange(0, BK)
    e = tl.arange(0, E_P)
    ev = tl.arange(0, EV_P)
    k = tl.load(K + bhk * S * E + cols[:, None] * E + e[None, :], mask=(cols[:, None] < S) & (e[None, :] < E),
                other=0.0)
    v = tl.load(V + bhk * S * Ev + cols[:, None] * Ev + ev[None, :], mask=(cols[:, None] < S) & (ev[None, :] < Ev),
                other=0.0)
    dk = tl.zeros([BK, E_P], tl.float32)
    dv = tl.zeros([BK, EV_P], tl.float32)
    first = 0
    if CAUSAL:  # query rows before this tile's first key minus the offset see none of it
        first = tl.maximum(0, pid_k * BK - offset) // BQ * BQ
    for g in range(0, r):
        h = hk * r + g
        bh = b * H + h
        for start in range(first, L, BQ):
            rows = start + tl.arange(0, BQ)
            q = tl.load(Q + bh * L * E + rows[:, None] * E + e[None, :],
                        mask=(rows[:, None] < L) & (e[None, :] < E), other=0.0)
            do = tl.load(DO + bh * L * Ev + rows[:, None] * Ev + ev[None, :],
                         mask=(rows[:, None] < L) & (ev[None, :] < Ev), other=0.0)
            lse = tl.load(LSE + bh * L + rows, mask=rows < L, other=0.0)
            d = tl.load(D + bh * L + rows, mask=rows < L, other=0.0)
            s = _dot(q, tl.trans(k), UPCAST) * scale  # (BQ, BK)
            seen = (rows[:, None] < L) & (cols[None, :] < S)
            if CAUSAL:
                seen = seen & (cols[None, :] <= rows[:, None] + offset)
            lse_safe = tl.where(lse == float("-inf"), 0.0, lse)  # a row with no key has P = 0 everywhere
            p = tl.where(seen, tl.exp(s - lse_safe[:, None]), 0.0)  # P from the saved lse
            dv += _dot(tl.trans(p), do, UPCAST)
            dp = _dot(do, tl.trans(v), UPCAST)  # (BQ, BK)
            ds = p * (dp - d[:, None])
            dk += _dot(tl.trans(ds), q, UPCAST) * scale
    tl.store(DK + bhk * S * E + cols[:, None] * E + e[None, :], dk, mask=(cols[:, None] < S) & (e[None, :] < E))
    tl.store(DV + bhk * S * Ev + cols[:, None] * Ev + ev[None, :], dv, mask=(cols[:, None] < S) & (ev[None, :] < Ev))


@triton.jit
def bwd_dq_kernel(Q, K, V, DO, LSE, D, DQ, H, Hkv, L, S, E, Ev, scale, offset,
                  E_P: tl.constexpr, EV_P: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, CAUSAL: tl.constexpr,
                  UPCAST: tl.constexpr):
    """dQ of one query tile of one (batch, head), over the key tiles it sees, in float32."""
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    bhk = b * Hkv + h // (H // Hkv)
    rows = pid_q * BQ + tl.arange(0, BQ)
    e = tl.arange(0, E_P)
    ev = tl.arange(0, EV_P)
    q = tl.load(Q + bh * L * E + rows[:, None] * E + e[None, :], mask=(rows[:, None] < L) & (e[None, :] < E),
                other=0.0)
    do = tl.load(DO + bh * L * Ev + rows[:, None] * Ev + ev[None, :], mask=(rows[:, None] < L) & (ev[None, :] < Ev),
                 other=0.0)
    lse = tl.load(LSE + bh * L + rows, mask=rows < L, other=0.0)
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    d = tl.load(D + bh * L + rows, mask=rows < L, other=0.0)
    dq = tl.zeros([BQ, E_P], tl.float32)
    stop = S
    if CAUSAL:
        stop = tl.minimum(S, tl.maximum(0, (pid_q + 1) * BQ + offset))
    for start in range(0, stop, BK):
        cols = start + tl.arange(0, BK)
        k = tl.load(K + bhk * S * E + cols[:, None] * E + e[None, :], mask=(cols[:, None] < S) & (e[None, :] < E),
                    other=0.0)
        v = tl.load(V + bhk * S * Ev + cols[:, None] * Ev + ev[None, :],
                    mask=(cols[:, None] < S) & (ev[None, :] < Ev), other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * scale
        seen = (rows[:, None] < L) & (cols[None, :] < S)
        if CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None] + offset)
        p = tl.where(seen, tl.exp(s - lse_safe[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), UPCAST)
        ds = p * (dp - d[:, None])
        dq += _dot(ds, k, UPCAST) * scale
    tl.store(DQ + bh * L * E + rows[:, None] * E + e[None, :], dq, mask=(rows[:, None] < L) & (e[None, :] < E))


@triton.jit
def decode_kernel(Q, K, V, O, LSE, sq_b, sq_h, sq_l, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                  H, Hkv, L, S, E, Ev, scale, offset, chunk,
                  E_P: tl.constexpr, EV_P: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, CAUSAL: tl.constexpr,
                  UPCAST: tl.constexpr):
    """Flash-decoding: the few query rows (L <= BQ) of one (batch, head) against one chunk of the
    cache's keys; O (B*H, n_chunks, BQ, EV_P) and LSE (B*H, n_chunks, BQ) hold each chunk's
    partial result, which the caller joins with the log-sum-exp merge."""
    pid_c = tl.program_id(0)
    bh = tl.program_id(1)
    n_chunks = tl.num_programs(0)
    b = bh // H
    h = bh % H
    hk = h // (H // Hkv)
    rows = tl.arange(0, BQ)
    e = tl.arange(0, E_P)
    ev = tl.arange(0, EV_P)
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_l + e[None, :],
                mask=(rows[:, None] < L) & (e[None, :] < E), other=0.0)
    m_i = tl.full([BQ], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, EV_P], tl.float32)
    for start in range(pid_c * chunk, tl.minimum(S, (pid_c + 1) * chunk), BK):
        cols = start + tl.arange(0, BK)
        inside = cols < tl.minimum(S, (pid_c + 1) * chunk)
        k = tl.load(K + b * sk_b + hk * sk_h + cols[:, None] * sk_s + e[None, :],
                    mask=inside[:, None] & (e[None, :] < E), other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * scale
        seen = inside[None, :] & (rows[:, None] < L)
        if CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * sv_b + hk * sv_h + cols[:, None] * sv_s + ev[None, :],
                    mask=inside[:, None] & (ev[None, :] < Ev), other=0.0)
        acc = acc * alpha[:, None] + _dot(p, v, UPCAST)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    base = (bh * n_chunks + pid_c) * BQ
    tl.store(O + (base + rows[:, None]) * EV_P + ev[None, :], out)
    tl.store(LSE + base + rows, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i))))
