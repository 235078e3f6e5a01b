"""Lab 04: FlashAttention from scratch: the online softmax, the tiled forward, the backward.

Fill in each function below, in order (ex1, ex2, ...), replacing the
``raise NotImplementedError`` line. Then check your work:

    attnlab grade                      # in this folder: grades this file

Shapes: B batch, H heads, L queries, S keys, E query/key size, Ev value size. The
online-softmax state is named as in the FlashAttention-2 paper: ``m_i`` the running maximum
of each query row's scores, ``l_i`` the running sum of exp(score - m_i), ``acc`` the running
unnormalised output, ``lse`` = m_i + log(l_i) the log-sum-exp saved for the backward.

Rules of the lab, as before: from scratch (no torch.softmax / F.softmax / Tensor.softmax /
logsumexp helpers of attention, no scaled_dot_product_attention; the grader catches them),
imports only from torch, math, typing and jaxtyping, keep the names and signatures. The
forward must never build an [L, S] tensor: ex3 runs it at L = S = 4096 with 32 MB to spare.
``safe_max``, ``causal_block_mask`` and ``attention_and_grads`` are given.
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
    raise NotImplementedError("TODO(ex1): stream over blocks of columns, rescale l_i when m_i grows")


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
    raise NotImplementedError("TODO(ex2): per query block, stream over key blocks keeping m_i, l_i, acc; return (o, lse)")


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
    """ex4: the backward, tile by tile, recomputing P = exp(scores - lse) instead of storing
    it: dV += P^T dO, dP = dO V^T, dS = P * (dP - D) with D = rowsum(dO * O), dQ += dS K * scale,
    dK += dS^T Q * scale."""
    raise NotImplementedError("TODO(ex4): D = rowsum(dO * O); per tile recompute P = exp(S - lse), then dV, dP, dS, dQ, dK")


class TiledAttention(torch.autograd.Function):
    """ex5: the forward and backward above as one autograd Function. The forward saves the
    inputs, the output and lse ([B, H, L]): never the [L, S] weights."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        raise NotImplementedError("TODO(ex5): o, lse = flash_forward(...); ctx.save_for_backward(q, k, v, o, lse)")

    @staticmethod
    def backward(ctx, do):
        raise NotImplementedError("TODO(ex5): flash_backward with what forward saved; return None for is_causal")


def tiled_attention(q: Float[Tensor, "B H L E"], k: Float[Tensor, "B H S E"], v: Float[Tensor, "B H S Ev"],
                    is_causal: bool = False) -> Float[Tensor, "B H L Ev"]:
    """ex5: SDPA's answer, differentiable, through TiledAttention (given)."""
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
