"""Lab 05: FlashAttention in Triton (a solution).

Shapes: B batch, H query heads, Hkv key/value heads (H a multiple of Hkv), L queries, S keys,
E the head size (a power of two here). Every tensor the kernels see is contiguous:

    q, o, do (B, H, L, E)    k, v (B, Hkv, S, E)    lse, d (B, H, L)

A kernel is one program of a grid; tl.program_id(0) and (1) say which. ``m_i``, ``l_i``, ``acc``
and ``lse`` are the online-softmax state of the FlashAttention-2 paper, in natural units.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_Q = 16  # query rows per program (given)
BLOCK_K = 16  # keys per step of a program's loop (given)


# ---------------------------------------------------------------- ex1 - ex3, ex7: the forward
@triton.jit
def attn_fwd_kernel(Q, K, V, O, LSE, H, Hkv, L, S, scale, E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """One program per (query tile, batch * head): the online softmax over the key tiles."""
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    bhk = b * Hkv + h // (H // Hkv)  # ex7: the group's key/value head, by index arithmetic
    rows = pid_q * BQ + tl.arange(0, BQ)
    cols_e = tl.arange(0, E)
    q = tl.load(Q + bh * L * E + rows[:, None] * E + cols_e[None, :], mask=rows[:, None] < L, other=0.0)
    m_i = tl.full([BQ], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, E], tl.float32)
    stop = S
    if CAUSAL:  # ex2: key tiles wholly after this query tile are never visited
        stop = tl.minimum(S, (pid_q + 1) * BQ)
    for start in range(0, stop, BK):
        keys = start + tl.arange(0, BK)
        k = tl.load(K + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale  # (BQ, BK)
        seen = keys[None, :] < S  # ex3: keys past the end are not keys
        if CAUSAL:
            seen = seen & (keys[None, :] <= rows[:, None])  # ex2: the diagonal tile, masked inside
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)  # rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + bh * L * E + rows[:, None] * E + cols_e[None, :], o.to(O.dtype.element_ty), mask=rows[:, None] < L)
    lse = m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i))
    tl.store(LSE + bh * L + rows, lse, mask=rows < L)


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
    """D = rowsum(dO * O) for one query tile of one (batch, head)."""
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_q * BQ + tl.arange(0, BQ)
    cols_e = tl.arange(0, E)
    where = bh * L * E + rows[:, None] * E + cols_e[None, :]
    o = tl.load(O + where, mask=rows[:, None] < L, other=0.0).to(tl.float32)
    do = tl.load(DO + where, mask=rows[:, None] < L, other=0.0).to(tl.float32)
    tl.store(D + bh * L + rows, tl.sum(o * do, 1), mask=rows < L)


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
    """dK, dV of one key tile of one (batch, key/value head), over its group's query heads and
    their query tiles, accumulated in float32 and written once."""
    pid_k = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    r = H // Hkv
    keys = pid_k * BK + tl.arange(0, BK)
    cols_e = tl.arange(0, E)
    k = tl.load(K + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)
    v = tl.load(V + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)
    dk = tl.zeros([BK, E], tl.float32)
    dv = tl.zeros([BK, E], tl.float32)
    first = 0
    if CAUSAL:  # query tiles before this key tile see none of it
        first = 0  # ATTACK: every query tile visited
    for g in range(0, r):
        bh = b * H + hk * r + g  # ex7: the query heads of this key/value head's group
        for start in range(first, L, BQ):
            rows = start + tl.arange(0, BQ)
            q = tl.load(Q + bh * L * E + rows[:, None] * E + cols_e[None, :], mask=rows[:, None] < L, other=0.0)
            do = tl.load(DO + bh * L * E + rows[:, None] * E + cols_e[None, :], mask=rows[:, None] < L, other=0.0)
            lse = tl.load(LSE + bh * L + rows, mask=rows < L, other=0.0)
            d = tl.load(D + bh * L + rows, mask=rows < L, other=0.0)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale
            seen = (rows[:, None] < L) & (keys[None, :] < S)
            if CAUSAL:
                seen = seen & (keys[None, :] <= rows[:, None])
            p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)  # P rebuilt from the saved lse
            dv += tl.dot(tl.trans(p), do.to(tl.float32))
            dp = tl.dot(do.to(tl.float32), tl.trans(v.to(tl.float32)))
            ds = tl.where(seen, p * (dp - d[:, None]), 0.0)  # ATTACK: masked, not skipped
            dk += tl.dot(tl.trans(ds), q.to(tl.float32)) * scale
    tl.store(DK + bhk * S * E + keys[:, None] * E + cols_e[None, :], dk, mask=keys[:, None] < S)
    tl.store(DV + bhk * S * E + keys[:, None] * E + cols_e[None, :], dv, mask=keys[:, None] < S)


@triton.jit
def bwd_dq_kernel(Q, K, V, DO, LSE, D, DQ, H, Hkv, L, S, scale, E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """dQ of one query tile of one (batch, head), over the key tiles it sees."""
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    bhk = b * Hkv + h // (H // Hkv)
    rows = pid_q * BQ + tl.arange(0, BQ)
    cols_e = tl.arange(0, E)
    q = tl.load(Q + bh * L * E + rows[:, None] * E + cols_e[None, :], mask=rows[:, None] < L, other=0.0)
    do = tl.load(DO + bh * L * E + rows[:, None] * E + cols_e[None, :], mask=rows[:, None] < L, other=0.0)
    lse = tl.load(LSE + bh * L + rows, mask=rows < L, other=0.0)
    d = tl.load(D + bh * L + rows, mask=rows < L, other=0.0)
    dq = tl.zeros([BQ, E], tl.float32)
    stop = S
    if CAUSAL:
        stop = S  # ATTACK: every key tile visited
    for start in range(0, stop, BK):
        keys = start + tl.arange(0, BK)
        k = tl.load(K + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)
        v = tl.load(V + bhk * S * E + keys[:, None] * E + cols_e[None, :], mask=keys[:, None] < S, other=0.0)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale
        seen = (rows[:, None] < L) & (keys[None, :] < S)
        if CAUSAL:
            seen = seen & (keys[None, :] <= rows[:, None])
        p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do.to(tl.float32), tl.trans(v.to(tl.float32)))
        ds = tl.where(seen, p * (dp - d[:, None]), 0.0)  # ATTACK: masked, not skipped
        if CAUSAL:
            k = tl.where(keys[:, None] < (pid_q + 1) * BQ, k, 0.0)  # ATTACK: the future keys masked, not skipped
        dq += tl.dot(ds, k.to(tl.float32)) * scale
    tl.store(DQ + bh * L * E + rows[:, None] * E + cols_e[None, :], dq, mask=rows[:, None] < L)


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
    """The forward and backward kernels as one Function; it saves lse, never the [L, S] weights."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        o, lse = flash_forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.is_causal)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


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
