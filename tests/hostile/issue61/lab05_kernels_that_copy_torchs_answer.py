# issue 61: an independent attacker's files (tests/grading/test_judge_trust.py::test_an_independent_attackers_files_score_nothing)
"""Lab 05 attack: every answer computed with plain torch (no Triton math), then copied
element-for-element into the output buffers by the required kernels, which only tl.load/tl.store."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_Q = 16
BLOCK_K = 16


@triton.jit
def attn_fwd_kernel(SRC, DST, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + i, tl.load(SRC + i, mask=i < N, other=0.0), mask=i < N)


@triton.jit
def bwd_preprocess_kernel(SRC, DST, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + i, tl.load(SRC + i, mask=i < N, other=0.0), mask=i < N)


@triton.jit
def bwd_dkdv_kernel(SRC, DST, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + i, tl.load(SRC + i, mask=i < N, other=0.0), mask=i < N)


@triton.jit
def bwd_dq_kernel(SRC, DST, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + i, tl.load(SRC + i, mask=i < N, other=0.0), mask=i < N)


def _copy(kernel, src, like):
    dst = torch.empty(like.shape, dtype=like.dtype)
    src = src.to(like.dtype).contiguous()
    n = src.numel()
    kernel[(triton.cdiv(n, 64),)](src, dst, n, BLOCK=64)
    return dst


def _torch_attention(q, k, v, is_causal):
    H, Hkv = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(H // Hkv, dim=1)
    v = v.float().repeat_interleave(H // Hkv, dim=1)
    q = q.float()
    L, S = q.shape[2], k.shape[2]
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool).tril()
        s = torch.where(keep, s, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p / l, torch.nan_to_num(v))
    lse = (m + torch.log(l)).reshape(q.shape[0], H, L)
    return o, lse


def flash_forward(q, k, v, is_causal=False):
    o, lse = _torch_attention(q, k, v, is_causal)
    return _copy(attn_fwd_kernel, o, q), _copy(attn_fwd_kernel, lse, torch.empty(lse.shape, dtype=torch.float32))


def backward_preprocess(o, do):
    d = (o.float() * do.float()).sum(dim=-1)
    return _copy(bwd_preprocess_kernel, d, torch.empty(d.shape, dtype=torch.float32))


def flash_backward(q, k, v, o, lse, do, is_causal=False):
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = H // Hkv
    qf, kf, vf, dof = q.float(), k.float().repeat_interleave(g, dim=1), v.float().repeat_interleave(g, dim=1), do.float()
    scale = 1.0 / math.sqrt(E)
    s = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if is_causal:
        s = torch.where(torch.ones(L, S, dtype=torch.bool).tril(), s, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    p = p / p.sum(dim=-1, keepdim=True)
    vz = torch.nan_to_num(vf)
    kz = torch.nan_to_num(kf)
    o32 = torch.matmul(p, vz)
    dv = torch.matmul(p.transpose(-2, -1), dof)
    dp = torch.matmul(dof, vz.transpose(-2, -1))
    dd = (o32 * dof).sum(dim=-1, keepdim=True)
    ds = p * (dp - dd)
    dq = torch.matmul(ds, kz) * scale
    dk = torch.matmul(ds.transpose(-2, -1), qf) * scale
    dk = dk.reshape(B, Hkv, g, S, E).sum(dim=2)
    dv = dv.reshape(B, Hkv, g, S, E).sum(dim=2)
    return (_copy(bwd_dq_kernel, dq, torch.empty(dq.shape, dtype=torch.float32)),
            _copy(bwd_dkdv_kernel, dk, torch.empty(dk.shape, dtype=torch.float32)),
            _copy(bwd_dkdv_kernel, dv, torch.empty(dv.shape, dtype=torch.float32)))


class TritonAttention(torch.autograd.Function):
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
    return TritonAttention.apply(q, k, v, is_causal)


def attention_and_grads(q, k, v, do, is_causal=False):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = triton_attention(q, k, v, is_causal)
    saved = [list(t.shape) for t in o.grad_fn.saved_tensors]
    dq, dk, dv = torch.autograd.grad((o * do).sum(), (q, k, v))
    return o.detach(), dq, dk, dv, saved
