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


# ---------------------------------------------------------------- ex1 - ex3, ex7: the forward
@triton.jit
def attn_fwd_kernel(Q, K, V, O, LSE, H, Hkv, L, S, scale, E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """One program per (query tile, batch * head): the online softmax over the key tiles."""
    raise NotImplementedError("TODO(ex1): load the query tile, loop over key tiles with the online softmax, store O and lse")


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
    raise NotImplementedError("TODO(ex4): D = rowsum(dO * O) for this query tile")


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
    their query tiles, accumulated in float32 and written once. Under CAUSAL, the query tiles
    wholly before the key tile's first key never see it: start at the tile that holds that key."""
    raise NotImplementedError("TODO(ex5): dK and dV of this key tile, over the group's query heads and their query tiles")


@triton.jit
def bwd_dq_kernel(Q, K, V, DO, LSE, D, DQ, H, Hkv, L, S, scale, E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """dQ of one query tile of one (batch, head), over the key tiles it sees (under CAUSAL, stop
    after the diagonal tile, as the forward does)."""
    raise NotImplementedError("TODO(ex5): dQ of this query tile, over the key tiles it sees")


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
        raise NotImplementedError("TODO(ex6): o, lse = flash_forward(...); save q, k, v, o, lse and is_causal on ctx")

    @staticmethod
    def backward(ctx, do):
        raise NotImplementedError("TODO(ex6): flash_backward with what forward saved; dq, dk, dv in the inputs' "
                                  "dtypes, then None for is_causal")


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
