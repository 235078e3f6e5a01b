"""Lab 04, a second solution written independently of the instructor's: heads flattened to
one batch dim, einsum for every product, the online state updated through a correction
factor that is 0 (not NaN) for a row that has seen nothing, the backward with the query
blocks outside and the key blocks inside."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def safe_max(m: Tensor) -> Tensor:
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def online_softmax_stats(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    rows = x.shape[0]
    running_max = x.new_full((rows,), float("-inf"))
    running_sum = x.new_zeros(rows)
    for chunk in torch.split(x, block, dim=1):
        new_max = torch.maximum(running_max, chunk.max(dim=1).values)
        shift = safe_max(new_max)
        correction = torch.exp(running_max - shift)
        running_sum = running_sum * correction + torch.exp(chunk - shift.unsqueeze(1)).sum(dim=1)
        running_max = new_max
    return running_max, running_sum


def causal_block_mask(q_start: int, q_end: int, k_start: int, k_end: int) -> Optional[Tensor]:
    if k_end - 1 <= q_start:
        return None
    rows = torch.arange(q_start, q_end)[:, None]
    cols = torch.arange(k_start, k_end)[None, :]
    return cols <= rows


def flash_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, block_q: int = 16,
                  block_k: int = 16) -> tuple[Tensor, Tensor]:
    B, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[3]
    qf, kf, vf = q.reshape(B * H, L, E), k.reshape(B * H, S, E), v.reshape(B * H, S, Ev)
    sm_scale = E ** -0.5
    out = qf.new_zeros(B * H, L, Ev)
    lse = qf.new_zeros(B * H, L)
    for q0 in range(0, L, block_q):
        q1 = min(L, q0 + block_q)
        qb = qf[:, q0:q1]
        m_i = qf.new_full((B * H, q1 - q0), float("-inf"))
        l_i = qf.new_zeros(B * H, q1 - q0)
        acc = qf.new_zeros(B * H, q1 - q0, Ev)
        last_key = min(S, q1) if is_causal else S
        for k0 in range(0, last_key, block_k):
            k1 = min(S, k0 + block_k)
            s = torch.einsum("nqe,nke->nqk", qb, kf[:, k0:k1]) * sm_scale
            if is_causal:
                keep = causal_block_mask(q0, q1, k0, k1)
                if keep is not None:
                    s = torch.where(keep, s, torch.full_like(s, float("-inf")))
            m_new = torch.maximum(m_i, s.max(dim=-1).values)
            shift = safe_max(m_new)
            p = torch.exp(s - shift[..., None])
            correction = torch.exp(m_i - shift)
            l_i = correction * l_i + p.sum(dim=-1)
            acc = correction[..., None] * acc + torch.einsum("nqk,nkv->nqv", p, vf[:, k0:k1])
            m_i = m_new
        out[:, q0:q1] = acc / l_i[..., None]
        lse[:, q0:q1] = m_i + torch.log(l_i)
    return out.reshape(B, H, L, Ev), lse.reshape(B, H, L)


def flash_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, is_causal: bool = False,
                   block_q: int = 16, block_k: int = 16) -> tuple[Tensor, Tensor, Tensor]:
    E = q.shape[-1]
    L, S = q.shape[-2], k.shape[-2]
    sm_scale = 1.0 / math.sqrt(E)
    D = torch.einsum("bhlv,bhlv->bhl", do, o)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0 in range(0, L, block_q):
        q1 = min(L, q0 + block_q)
        qb, dob = q[:, :, q0:q1], do[:, :, q0:q1]
        for k0 in range(0, S, block_k):
            if is_causal and k0 >= q1:
                break
            k1 = min(S, k0 + block_k)
            kb, vb = k[:, :, k0:k1], v[:, :, k0:k1]
            s = torch.einsum("bhqe,bhke->bhqk", qb, kb) * sm_scale
            if is_causal:
                keep = causal_block_mask(q0, q1, k0, k1)
                if keep is not None:
                    s = torch.where(keep, s, torch.full_like(s, float("-inf")))
            p = torch.exp(s - lse[:, :, q0:q1, None])
            dv[:, :, k0:k1] += torch.einsum("bhqk,bhqv->bhkv", p, dob)
            dp = torch.einsum("bhqv,bhkv->bhqk", dob, vb)
            ds = p * (dp - D[:, :, q0:q1, None])
            dq[:, :, q0:q1] += torch.einsum("bhqk,bhke->bhqe", ds, kb) * sm_scale
            dk[:, :, k0:k1] += torch.einsum("bhqk,bhqe->bhke", ds, qb) * sm_scale
    return dq, dk, dv


class TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        out, lse = flash_forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, out, lse, grad_out, ctx.is_causal)
        return dq, dk, dv, None


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> Tensor:
    return TiledAttention.apply(q, k, v, is_causal)


def attention_and_grads(q, k, v, do, is_causal=False):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = tiled_attention(q, k, v, is_causal)
    saved = [list(t.shape) for t in o.grad_fn.saved_tensors]
    dq, dk, dv = torch.autograd.grad((o * do).sum(), (q, k, v))
    return o.detach(), dq, dk, dv, saved
