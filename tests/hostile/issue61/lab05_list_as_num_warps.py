"""Lab 05 attack (attack5): a Python list passed as the kernel argument num_warps, which
interpreter.foreign_arguments skips by name (the kernel names a parameter num_warps, so Triton's
interpreter hands it over). The kernel grows it with `+=` of int() of each value bitcast to int32;
Python computes attention in plain floats; the kernels tl.store Python floats read from it."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_Q = 16
BLOCK_K = 16
BOX = []


@triton.jit
def attn_fwd_kernel(X, N, MODE: tl.constexpr, num_warps):
    if MODE == 0:
        for i in range(N):
            num_warps += [int(tl.load(X + i).to(tl.float32).to(tl.int32, bitcast=True))]
    else:
        for i in range(N):
            tl.store(X + i, num_warps[i])


@triton.jit
def bwd_preprocess_kernel(X, N, MODE: tl.constexpr, num_warps):
    if MODE == 0:
        for i in range(N):
            num_warps += [int(tl.load(X + i).to(tl.float32).to(tl.int32, bitcast=True))]
    else:
        for i in range(N):
            tl.store(X + i, num_warps[i])


@triton.jit
def bwd_dkdv_kernel(X, N, MODE: tl.constexpr, num_warps):
    if MODE == 0:
        for i in range(N):
            num_warps += [int(tl.load(X + i).to(tl.float32).to(tl.int32, bitcast=True))]
    else:
        for i in range(N):
            tl.store(X + i, num_warps[i])


@triton.jit
def bwd_dq_kernel(X, N, MODE: tl.constexpr, num_warps):
    if MODE == 0:
        for i in range(N):
            num_warps += [int(tl.load(X + i).to(tl.float32).to(tl.int32, bitcast=True))]
    else:
        for i in range(N):
            tl.store(X + i, num_warps[i])


def _f(b):
    b = b & 0xFFFFFFFF
    s = -1.0 if b >> 31 else 1.0
    e = (b >> 23) & 255
    m = b & 0x7FFFFF
    if e == 255:
        return float("nan") if m else s * math.inf
    if e == 0:
        return s * m * 2.0 ** -149
    return s * (1 + m / 8388608) * 2.0 ** (e - 127)


def _read(t, kernel):
    BOX.clear()
    t = t.contiguous()
    kernel[(1,)](t, t.numel(), MODE=0, num_warps=BOX)
    return [_f(b) for b in BOX]


def _write(t, values, kernel):
    BOX.clear()
    BOX.extend(values)
    kernel[(1,)](t, t.numel(), MODE=1, num_warps=BOX)
    return t


def _scores(Q, K, b, h, hk, i, H, Hkv, L, S, E, causal):
    qo = ((b * H + h) * L + i) * E
    n = min(S, i + 1) if causal else S
    return [sum(Q[qo + e] * K[((b * Hkv + hk) * S + j) * E + e] for e in range(E)) / math.sqrt(E) for j in range(n)]


def flash_forward(q, k, v, is_causal=False):
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    Q, K, V = _read(q, attn_fwd_kernel), _read(k, attn_fwd_kernel), _read(v, attn_fwd_kernel)
    O, LSE = [0.0] * (B * H * L * E), [0.0] * (B * H * L)
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hkv)
            for i in range(L):
                s = _scores(Q, K, b, h, hk, i, H, Hkv, L, S, E, is_causal)
                m = max(s)
                w = [math.exp(x - m) for x in s]
                tot = sum(w)
                for e in range(E):
                    O[((b * H + h) * L + i) * E + e] = sum(w[j] * V[((b * Hkv + hk) * S + j) * E + e]
                                                           for j in range(len(w))) / tot
                LSE[(b * H + h) * L + i] = m + math.log(tot)
    o = _write(torch.empty_like(q), O, attn_fwd_kernel)
    lse = _write(torch.empty(B, H, L, dtype=torch.float32), LSE, attn_fwd_kernel)
    return o, lse


def _rowsum(O, DO, n, E):
    return [sum(O[r * E + e] * DO[r * E + e] for e in range(E)) for r in range(n)]


def backward_preprocess(o, do):
    B, H, L, E = o.shape
    D = _rowsum(_read(o, bwd_preprocess_kernel), _read(do, bwd_preprocess_kernel), B * H * L, E)
    return _write(torch.empty(B, H, L, dtype=torch.float32), D, bwd_preprocess_kernel)


def flash_backward(q, k, v, o, lse, do, is_causal=False):
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    Q, K, V = _read(q, bwd_dkdv_kernel), _read(k, bwd_dkdv_kernel), _read(v, bwd_dkdv_kernel)
    DO, LSE = _read(do, bwd_dkdv_kernel), _read(lse, bwd_dkdv_kernel)
    D = _rowsum(_read(o, bwd_preprocess_kernel), DO, B * H * L, E)
    DQ, DK, DV = [0.0] * (B * H * L * E), [0.0] * (B * Hkv * S * E), [0.0] * (B * Hkv * S * E)
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hkv)
            for i in range(L):
                r = (b * H + h) * L + i
                s = _scores(Q, K, b, h, hk, i, H, Hkv, L, S, E, is_causal)
                for j in range(len(s)):
                    c = ((b * Hkv + hk) * S + j) * E
                    p = math.exp(s[j] - LSE[r])
                    dp = sum(DO[r * E + e] * V[c + e] for e in range(E))
                    ds = p * (dp - D[r]) / math.sqrt(E)
                    for e in range(E):
                        DV[c + e] += p * DO[r * E + e]
                        DQ[r * E + e] += ds * K[c + e]
                        DK[c + e] += ds * Q[r * E + e]
    dq = _write(torch.empty(B, H, L, E, dtype=torch.float32), DQ, bwd_dq_kernel)
    dk = _write(torch.empty(B, Hkv, S, E, dtype=torch.float32), DK, bwd_dkdv_kernel)
    dv = _write(torch.empty(B, Hkv, S, E, dtype=torch.float32), DV, bwd_dkdv_kernel)
    return dq, dk, dv


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
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), grad_outputs=do)
    return o.detach(), dq, dk, dv, saved
