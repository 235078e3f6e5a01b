"""Lab 05: FlashAttention in Triton. Fill in every TODO(exN); `attnlab grade` grades this file.

Shapes: B batch, H query heads, Hkv key/value heads (H a multiple of Hkv), L queries, S keys,
E the head size (a power of two here). Every tensor the kernels see is contiguous:

    q, o, do (B, H, L, E)    k, v (B, Hkv, S, E)    lse, d (B, H, L)

A kernel is one program of a grid; tl.program_id(0) and (1) say which. ``m_i``, ``l_i``, ``acc``
and ``lse`` are the online-softmax state of the FlashAttention-2 paper, in natural units.

Solution "c" (third independent one): a base-2 online softmax (log2(e) folded into the scale,
lse converted back to natural units), the forward's key loop in a helper run in two stages under
CAUSAL (the tiles before the diagonal unmasked, then the diagonal tile masked), and the backward
in base 2 as well.
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
def fwd_inner(q_tile, k_base, v_base, out, run_sum, run_max, q_rows, cols, lo, hi, S, qk_scale,
              E: tl.constexpr, BK: tl.constexpr, DIAG: tl.constexpr):
    """The online softmax, in base 2, over the key tiles starting at lo, lo + BK, ... below hi;
    DIAG masks key j > query i (the diagonal tile)."""
    for start in range(lo, hi, BK):
        keys = start + tl.arange(0, BK)
        key_ok = keys < S
        kv_off = keys[:, None] * E + cols[None, :]
        k_tile = tl.load(k_base + kv_off, mask=key_ok[:, None], other=0.0)
        v_tile = tl.load(v_base + kv_off, mask=key_ok[:, None], other=0.0)
        scores = tl.dot(q_tile, tl.trans(k_tile)) * qk_scale
        keep = key_ok[None, :]
        if DIAG:
            keep = keep & (keys[None, :] <= q_rows[:, None])
        scores = tl.where(keep, scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        shrink = tl.exp2(run_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        run_sum = run_sum * shrink + tl.sum(weights, axis=1)
        out = out * shrink[:, None] + tl.dot(weights.to(v_tile.dtype), v_tile)
        run_max = new_max
    return out, run_sum, run_max


@triton.jit
def attn_fwd_kernel(Q, K, V, O, LSE, H, Hkv, L, S, scale, E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """One program per (query tile, batch * head): the online softmax over the key tiles."""
    tile = tl.program_id(0)
    head_flat = tl.program_id(1)
    batch = head_flat // H
    head = head_flat % H
    kv_flat = batch * Hkv + head // (H // Hkv)
    q_rows = tile * BQ + tl.arange(0, BQ)
    cols = tl.arange(0, E)
    row_ok = q_rows < L
    q_off = head_flat * L * E + q_rows[:, None] * E + cols[None, :]
    q_tile = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
    k_base = K + kv_flat * S * E
    v_base = V + kv_flat * S * E
    qk_scale = scale * 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
    run_max = tl.full([BQ], float("-inf"), tl.float32)
    run_sum = tl.zeros([BQ], tl.float32)
    out = tl.zeros([BQ, E], tl.float32)
    if CAUSAL:
        diag = tile * BQ
        # stage 1: the key tiles wholly before the diagonal, no causal mask needed
        out, run_sum, run_max = fwd_inner(q_tile, k_base, v_base, out, run_sum, run_max, q_rows, cols, 0,
                                          tl.minimum(diag, S), S, qk_scale, E, BK, False)
        # stage 2: the diagonal tile, masked inside; the tiles after it are never loaded
        out, run_sum, run_max = fwd_inner(q_tile, k_base, v_base, out, run_sum, run_max, q_rows, cols, diag,
                                          tl.minimum(diag + BQ, S), S, qk_scale, E, BK, True)
    else:
        out, run_sum, run_max = fwd_inner(q_tile, k_base, v_base, out, run_sum, run_max, q_rows, cols, 0, S, S,
                                          qk_scale, E, BK, False)
    out = out / run_sum[:, None]
    log_se = (run_max + tl.log2(run_sum)) * 0.6931471805599453  # back to natural units: ln(2)
    tl.store(O + q_off, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + head_flat * L + q_rows, log_se, mask=row_ok)


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
    tile = tl.program_id(0)
    head_flat = tl.program_id(1)
    q_rows = tile * BQ + tl.arange(0, BQ)
    row_ok = q_rows < L
    off = head_flat * L * E + q_rows[:, None] * E + tl.arange(0, E)[None, :]
    o_tile = tl.load(O + off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    do_tile = tl.load(DO + off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o_tile * do_tile, axis=1)
    tl.store(D + head_flat * L + q_rows, delta, mask=row_ok)


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
    ktile = tl.program_id(0)
    kv_flat = tl.program_id(1)
    batch = kv_flat // Hkv
    kv_head = kv_flat % Hkv
    group = H // Hkv
    keys = ktile * BK + tl.arange(0, BK)
    cols = tl.arange(0, E)
    key_ok = keys < S
    kv_off = kv_flat * S * E + keys[:, None] * E + cols[None, :]
    k_tile = tl.load(K + kv_off, mask=key_ok[:, None], other=0.0)
    v_tile = tl.load(V + kv_off, mask=key_ok[:, None], other=0.0)
    qk_scale = scale * 1.4426950408889634
    dk_acc = tl.zeros([BK, E], tl.float32)
    dv_acc = tl.zeros([BK, E], tl.float32)
    # under CAUSAL the query tiles wholly before this key tile see none of its keys
    first = 0
    if CAUSAL:
        first = (ktile * BK) // BQ * BQ
    for g in range(0, group):
        head_flat = batch * H + kv_head * group + g
        for qstart in range(first, L, BQ):
            q_rows = qstart + tl.arange(0, BQ)
            row_ok = q_rows < L
            q_off = head_flat * L * E + q_rows[:, None] * E + cols[None, :]
            q_tile = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
            do_tile = tl.load(DO + q_off, mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + head_flat * L + q_rows, mask=row_ok, other=0.0)
            delta = tl.load(D + head_flat * L + q_rows, mask=row_ok, other=0.0)
            scores = tl.dot(q_tile, tl.trans(k_tile))
            probs = tl.exp2(scores * qk_scale - lse[:, None] * 1.4426950408889634)
            keep = row_ok[:, None] & key_ok[None, :]
            if CAUSAL:
                keep = keep & (keys[None, :] <= q_rows[:, None])
            probs = tl.where(keep, probs, 0.0)
            dv_acc += tl.dot(tl.trans(probs).to(do_tile.dtype), do_tile)
            dprobs = tl.dot(do_tile, tl.trans(v_tile))
            dscores = probs * (dprobs - delta[:, None])
            dk_acc += tl.dot(tl.trans(dscores).to(q_tile.dtype), q_tile)
    dk_acc = dk_acc * scale
    tl.store(DK + kv_off, dk_acc, mask=key_ok[:, None])
    tl.store(DV + kv_off, dv_acc, mask=key_ok[:, None])


@triton.jit
def bwd_dq_kernel(Q, K, V, DO, LSE, D, DQ, H, Hkv, L, S, scale, E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """dQ of one query tile of one (batch, head), over the key tiles it sees."""
    tile = tl.program_id(0)
    head_flat = tl.program_id(1)
    batch = head_flat // H
    head = head_flat % H
    group = H // Hkv
    kv_flat = batch * Hkv + head // group
    q_rows = tile * BQ + tl.arange(0, BQ)
    cols = tl.arange(0, E)
    row_ok = q_rows < L
    q_off = head_flat * L * E + q_rows[:, None] * E + cols[None, :]
    q_tile = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
    do_tile = tl.load(DO + q_off, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + head_flat * L + q_rows, mask=row_ok, other=0.0)
    delta = tl.load(D + head_flat * L + q_rows, mask=row_ok, other=0.0)
    qk_scale = scale * 1.4426950408889634
    lse2 = lse * 1.4426950408889634
    dq_acc = tl.zeros([BQ, E], tl.float32)
    last = S
    if CAUSAL:
        last = tl.minimum((tile + 1) * BQ, S)
    for kstart in range(0, last, BK):
        keys = kstart + tl.arange(0, BK)
        key_ok = keys < S
        kv_off = kv_flat * S * E + keys[:, None] * E + cols[None, :]
        k_tile = tl.load(K + kv_off, mask=key_ok[:, None], other=0.0)
        v_tile = tl.load(V + kv_off, mask=key_ok[:, None], other=0.0)
        scores = tl.dot(q_tile, tl.trans(k_tile))
        probs = tl.exp2(scores * qk_scale - lse2[:, None])
        keep = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            keep = keep & (keys[None, :] <= q_rows[:, None])
        probs = tl.where(keep, probs, 0.0)
        dprobs = tl.dot(do_tile, tl.trans(v_tile))
        dscores = probs * (dprobs - delta[:, None])
        dq_acc += tl.dot(dscores.to(k_tile.dtype), k_tile)
    dq_acc = dq_acc * scale
    tl.store(DQ + q_off, dq_acc, mask=row_ok[:, None])


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
