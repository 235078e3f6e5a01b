"""Lab 05, a second solution written independently of the instructor's: scores in base 2
(exp2, the query pre-scaled by scale * log2(e), as Triton's fused-attention tutorial does),
pointers advanced through the loops instead of recomputed, K loaded already transposed,
the causal forward as two passes of one inner function (the tiles wholly below the diagonal
unmasked, then the diagonal tile masked), and the backward written transposed (S^T = K Q^T)
with the scale applied once after each loop."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_Q = 16  # query rows per program (given)
BLOCK_K = 16  # keys per step of a program's loop (given)

# log2(e) = 1.4426950408889634 scales scores into base 2 (exp(x) = exp2(x * log2(e))), and
# ln(2) = 0.6931471805599453 brings the log-sum-exp back (ln(y) = log2(y) * ln(2))


# ---------------------------------------------------------------- ex1 - ex3, ex7: the forward
@triton.jit
def _attend(qs, kt_ptrs, v_ptrs, m, denom, out, lo, hi, offs_q, offs_k, S, E: tl.constexpr, BK: tl.constexpr,
            DIAGONAL: tl.constexpr):
    """Key tiles [lo, hi) into the running state (m, denom, out), base 2."""
    kt_ptrs += lo * E
    v_ptrs += lo * E
    for start in range(lo, hi, BK):
        cols = start + offs_k
        kt = tl.load(kt_ptrs, mask=cols[None, :] < S, other=0.0).to(tl.float32)  # (E, BK)
        x = tl.dot(qs, kt)
        ok = cols[None, :] < S
        if DIAGONAL:
            ok = ok & (offs_q[:, None] >= cols[None, :])
        x = tl.where(ok, x, float("-inf"))
        m_next = tl.maximum(m, tl.max(x, 1))
        base = tl.where(m_next == float("-inf"), 0.0, m_next)
        w = tl.exp2(x - base[:, None])
        corr = tl.exp2(m - base)
        denom = denom * corr + tl.sum(w, 1)
        vt = tl.load(v_ptrs, mask=cols[:, None] < S, other=0.0).to(tl.float32)  # (BK, E)
        out = out * corr[:, None] + tl.dot(w, vt)
        m = m_next
        kt_ptrs += BK * E
        v_ptrs += BK * E
    return m, denom, out


@triton.jit
def attn_fwd_kernel(Q, K, V, O, LSE, H, Hkv, L, S, scale, E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                    CAUSAL: tl.constexpr):
    q_start = tl.program_id(0) * BQ
    head = tl.program_id(1)
    group = H // Hkv
    kv_head = (head // H) * Hkv + (head % H) // group  # ex7
    offs_q = q_start + tl.arange(0, BQ)
    offs_k = tl.arange(0, BK)
    offs_e = tl.arange(0, E)
    q_ptrs = Q + head * L * E + offs_q[:, None] * E + offs_e[None, :]
    kt_ptrs = K + kv_head * S * E + offs_k[None, :] * E + offs_e[:, None]
    v_ptrs = V + kv_head * S * E + offs_k[:, None] * E + offs_e[None, :]
    qs = tl.load(q_ptrs, mask=offs_q[:, None] < L, other=0.0).to(tl.float32) * (scale * 1.4426950408889634)
    m = tl.zeros([BQ], tl.float32) - float("inf")
    denom = tl.zeros([BQ], tl.float32)
    out = tl.zeros([BQ, E], tl.float32)
    if CAUSAL:
        # the tiles wholly below the diagonal need no mask; then the diagonal tile
        full = tl.minimum(q_start, S)
        m, denom, out = _attend(qs, kt_ptrs, v_ptrs, m, denom, out, 0, full, offs_q, offs_k, S, E, BK, False)
        m, denom, out = _attend(qs, kt_ptrs, v_ptrs, m, denom, out, full, tl.minimum(q_start + BQ, S), offs_q,
                                offs_k, S, E, BK, True)
    else:
        m, denom, out = _attend(qs, kt_ptrs, v_ptrs, m, denom, out, 0, S, offs_q, offs_k, S, E, BK, False)
    safe = tl.where(denom > 0.0, denom, 1.0)
    o_ptrs = O + head * L * E + offs_q[:, None] * E + offs_e[None, :]
    tl.store(o_ptrs, (out / safe[:, None]).to(O.dtype.element_ty), mask=offs_q[:, None] < L)
    tl.store(LSE + head * L + offs_q, (m + tl.log2(safe)) * 0.6931471805599453, mask=offs_q < L)


def flash_forward(q, k, v, is_causal=False):
    """Given: launch attn_fwd_kernel; returns (o (B, H, L, E), lse (B, H, L) float32)."""
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(B, H, L, dtype=torch.float32)
    grid = (triton.cdiv(L, BLOCK_Q), B * H)
    attn_fwd_kernel[grid](q, k, v, o, lse, H, Hkv, L, S, 1.0 / math.sqrt(E), E=E, BQ=BLOCK_Q, BK=BLOCK_K,
                          CAUSAL=is_causal)
    return o, lse


# ---------------------------------------------------------------- ex4: the backward's preprocess
@triton.jit
def bwd_preprocess_kernel(O, DO, D, L, E: tl.constexpr, BQ: tl.constexpr):
    offs_q = tl.program_id(0) * BQ + tl.arange(0, BQ)
    offs_e = tl.arange(0, E)
    base = tl.program_id(1) * L * E
    inside = offs_q[:, None] < L
    o = tl.load(O + base + offs_q[:, None] * E + offs_e[None, :], mask=inside, other=0.0)
    do = tl.load(DO + base + offs_q[:, None] * E + offs_e[None, :], mask=inside, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(D + tl.program_id(1) * L + offs_q, delta, mask=offs_q < L)


def backward_preprocess(o, do):
    """Given: launch bwd_preprocess_kernel; returns D (B, H, L) float32."""
    B, H, L, E = o.shape
    d = torch.empty(B, H, L, dtype=torch.float32)
    bwd_preprocess_kernel[(triton.cdiv(L, BLOCK_Q), B * H)](o.contiguous(), do.contiguous(), d, L, E=E, BQ=BLOCK_Q)
    return d


# ---------------------------------------------------------------- ex5: dK, dV and dQ, no atomics
@triton.jit
def bwd_dkdv_kernel(Q, K, V, DO, LSE, D, DK, DV, H, Hkv, L, S, scale, E: tl.constexpr, BQ: tl.constexpr,
                    BK: tl.constexpr, CAUSAL: tl.constexpr):
    k_start = tl.program_id(0) * BK
    kv_head = tl.program_id(1)
    group = H // Hkv
    offs_k = k_start + tl.arange(0, BK)
    offs_q = tl.arange(0, BQ)
    offs_e = tl.arange(0, E)
    kv_rows = kv_head * S * E + offs_k[:, None] * E + offs_e[None, :]
    k = tl.load(K + kv_rows, mask=offs_k[:, None] < S, other=0.0).to(tl.float32)  # (BK, E)
    v = tl.load(V + kv_rows, mask=offs_k[:, None] < S, other=0.0).to(tl.float32)
    dk_acc = tl.zeros([BK, E], dtype=tl.float32)
    dv_acc = tl.zeros([BK, E], dtype=tl.float32)
    q_lo = 0
    if CAUSAL:
        q_lo = k_start - k_start % BQ  # the first query tile that sees a key of this tile
    for j in range(0, group):
        head = (kv_head // Hkv) * H + (kv_head % Hkv) * group + j  # ex7
        qt_ptrs = Q + head * L * E + (q_lo + offs_q)[None, :] * E + offs_e[:, None]  # (E, BQ)
        do_ptrs = DO + head * L * E + (q_lo + offs_q)[:, None] * E + offs_e[None, :]  # (BQ, E)
        for start in range(q_lo, L, BQ):
            rows = start + offs_q
            qt = tl.load(qt_ptrs, mask=rows[None, :] < L, other=0.0).to(tl.float32)
            do = tl.load(do_ptrs, mask=rows[:, None] < L, other=0.0).to(tl.float32)
            lse2 = tl.load(LSE + head * L + rows, mask=rows < L, other=0.0) * 1.4426950408889634
            delta = tl.load(D + head * L + rows, mask=rows < L, other=0.0)
            xt = tl.dot(k, qt) * (scale * 1.4426950408889634)  # (BK, BQ): S^T in base 2
            keep = (offs_k[:, None] < S) & (rows[None, :] < L)
            if CAUSAL:
                keep = keep & (offs_k[:, None] <= rows[None, :])
            pt = tl.where(keep, tl.exp2(xt - lse2[None, :]), 0.0)
            dv_acc += tl.dot(pt, do)
            dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            dk_acc += tl.dot(dst, tl.trans(qt))
            qt_ptrs += BQ * E
            do_ptrs += BQ * E
    dk_acc = dk_acc * scale
    tl.store(DK + kv_rows, dk_acc, mask=offs_k[:, None] < S)
    tl.store(DV + kv_rows, dv_acc, mask=offs_k[:, None] < S)


@triton.jit
def bwd_dq_kernel(Q, K, V, DO, LSE, D, DQ, H, Hkv, L, S, scale, E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                  CAUSAL: tl.constexpr):
    q_start = tl.program_id(0) * BQ
    head = tl.program_id(1)
    kv_head = (head // H) * Hkv + (head % H) // (H // Hkv)  # ex7
    offs_q = q_start + tl.arange(0, BQ)
    offs_k = tl.arange(0, BK)
    offs_e = tl.arange(0, E)
    rows = head * L * E + offs_q[:, None] * E + offs_e[None, :]
    q = tl.load(Q + rows, mask=offs_q[:, None] < L, other=0.0).to(tl.float32)
    do = tl.load(DO + rows, mask=offs_q[:, None] < L, other=0.0).to(tl.float32)
    lse2 = tl.load(LSE + head * L + offs_q, mask=offs_q < L, other=0.0) * 1.4426950408889634
    delta = tl.load(D + head * L + offs_q, mask=offs_q < L, other=0.0)
    dq_acc = tl.zeros([BQ, E], dtype=tl.float32)
    kt_ptrs = K + kv_head * S * E + offs_k[None, :] * E + offs_e[:, None]  # (E, BK)
    vt_ptrs = V + kv_head * S * E + offs_k[None, :] * E + offs_e[:, None]
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, q_start + BQ)
    for start in range(0, hi, BK):
        cols = start + offs_k
        kt = tl.load(kt_ptrs, mask=cols[None, :] < S, other=0.0).to(tl.float32)
        vt = tl.load(vt_ptrs, mask=cols[None, :] < S, other=0.0).to(tl.float32)
        x = tl.dot(q, kt) * (scale * 1.4426950408889634)
        keep = (offs_q[:, None] < L) & (cols[None, :] < S)
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_q[:, None])
        p = tl.where(keep, tl.exp2(x - lse2[:, None]), 0.0)
        dp = tl.dot(do, vt)
        ds = p * (dp - delta[:, None])
        dq_acc += tl.dot(ds, tl.trans(kt))
        kt_ptrs += BK * E
        vt_ptrs += BK * E
    dq_acc = dq_acc * scale
    tl.store(DQ + rows, dq_acc, mask=offs_q[:, None] < L)


def flash_backward(q, k, v, o, lse, do, is_causal=False):
    """Given: D, then the dK/dV and dQ kernels; returns (dq, dk, dv) in float32."""
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    d = backward_preprocess(o, do)
    dq = torch.zeros(B, H, L, E, dtype=torch.float32)
    dk = torch.zeros(B, Hkv, S, E, dtype=torch.float32)
    dv = torch.zeros(B, Hkv, S, E, dtype=torch.float32)
    scale = 1.0 / math.sqrt(E)
    bwd_dkdv_kernel[(triton.cdiv(S, BLOCK_K), B * Hkv)](q, k, v, do, lse, d, dk, dv, H, Hkv, L, S, scale, E=E,
                                                         BQ=BLOCK_Q, BK=BLOCK_K, CAUSAL=is_causal)
    bwd_dq_kernel[(triton.cdiv(L, BLOCK_Q), B * H)](q, k, v, do, lse, d, dq, H, Hkv, L, S, scale, E=E, BQ=BLOCK_Q,
                                                    BK=BLOCK_K, CAUSAL=is_causal)
    return dq, dk, dv


# ---------------------------------------------------------------- ex6: one autograd Function
class TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        o, lse = flash_forward(q, k, v, is_causal=is_causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        grads = flash_backward(q, k, v, o, lse, grad_out, is_causal=ctx.is_causal)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v))) + (None,)


def triton_attention(q, k, v, is_causal=False):
    """Given: SDPA's answer through TritonAttention (enable_gqa=True's meaning when Hkv < H)."""
    return TritonAttention.apply(q, k, v, is_causal)


def attention_and_grads(q, k, v, do, is_causal=False):
    """Given (the walkthrough calls it): the output, dq, dk, dv and the shapes the Function saved.
    The grader takes the same steps itself, through TritonAttention."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = triton_attention(q, k, v, is_causal)
    saved = [list(t.shape) for t in o.grad_fn.saved_tensors]
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), grad_outputs=do)
    return o.detach(), dq, dk, dv, saved
