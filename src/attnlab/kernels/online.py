"""The online softmax and FlashAttention-2's backward, one tile at a time, written once in PyTorch.

Every pure-PyTorch path of attnlab runs its tiles through these three functions: the tiled
path (:mod:`attnlab.tiled`, base 2, the ``(Nb, r * bq, bk)`` layout of :mod:`.layout`) and
flex's (:mod:`attnlab.flex.attention`, natural units, ``(B, H, bq, bk)`` tiles, a
``score_mod`` applied before each update). Which tiles a query block visits, and how their
scores are masked, is the caller's; the arithmetic of the running state is here. The native
kernels (``csrc/``) run the same steps in C++.

State of a block of query rows, any leading dims::

    m_i (..., n, 1)   running row max          l_i (..., n, 1)   running sum of exp(s - m_i)
    acc (..., n, Ev)  running sum of exp(s - m_i) V

Scores ``s (..., n, bk)`` come in the state's units: base 2 (``exp = torch.exp2``, the scale
multiplied by ``log2(e)``) or natural (``exp = torch.exp``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["start", "update", "finish", "backward_tile"]

Exp = Callable[..., Tensor]


def start(rows: tuple[int, ...], Ev: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The empty state of ``rows = (..., n)`` query rows: ``m_i = -inf``, ``l_i = 0``, ``acc = 0``."""
    return like.new_full((*rows, 1), float("-inf")), like.new_zeros((*rows, 1)), like.new_zeros((*rows, Ev))


def _mm_add_(out: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """``out += alpha * a @ b`` in place (one fused ``baddbmm_`` for 3-D operands)."""
    if out.dim() == a.dim() == b.dim() == 3:
        return out.baddbmm_(a, b, alpha=alpha)
    return out.add_(torch.matmul(a, b), alpha=alpha)


def update(m_i: Tensor, l_i: Tensor, acc: Tensor, s: Tensor, v: Tensor, exp: Exp = torch.exp2,
           inplace: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """One key block into the state: ``(m_i, l_i, acc)`` after the scores ``s (..., n, bk)``
    and the values ``v (..., bk, Ev)``.

    ``m_new = max(m_i, rowmax(s))``; the old sum and accumulator are rescaled by
    ``alpha = exp(m_i - m_new)``. A row still all ``-inf`` keeps the shift 0 (no ``-inf - -inf``).
    With ``inplace`` and without autograd the scores' and the state's storage is reused (the
    caller owns ``s``); with autograd (a ``score_mod`` that needs gradients), or scores the
    caller does not own (a ``score_mod``'s return value), every step is out of place.
    """
    m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
    shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    if not inplace or (torch.is_grad_enabled() and any(t.requires_grad for t in (s, v, acc, l_i))):
        p = exp(s - shift)  # P~ = exp(s - m_new)
        alpha = exp(m_i - shift)
        return m_new, alpha * l_i + p.sum(dim=-1, keepdim=True), alpha * acc + p @ v
    p = exp(s.sub_(shift), out=s)  # in place over the scores
    alpha = exp(m_i.sub_(shift))  # the old max is not needed again
    l_i.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))  # l_i = alpha * l_i + rowsum(P~)
    _mm_add_(acc.mul_(alpha), p, v)  # acc = alpha * acc + P~ V_j
    return m_new, l_i, acc


def finish(m_i: Tensor, l_i: Tensor, acc: Tensor, log: Exp = torch.log2) -> tuple[Tensor, Tensor]:
    """``(out (..., n, Ev), lse (..., n))``: ``O_i = acc / l_i`` (0 for rows that saw no key, as
    SDPA gives) and ``lse = m_i + log(l_i)`` (``-inf`` there), in the state's units."""
    out = acc / torch.where(l_i == 0, torch.ones_like(l_i), l_i)
    return out, (m_i + log(l_i)).squeeze(-1)


def backward_tile(p: Tensor, q: Tensor, k: Tensor, v: Tensor, do: Tensor, delta: Tensor, scale: float,
                  dq: Tensor, dk: Tensor, dv: Tensor, dlse: Optional[Tensor] = None) -> None:
    """FlashAttention-2's backward for one tile, adding into ``dq (..., n, E)``, ``dk (..., bk, E)``
    and ``dv (..., bk, Ev)`` (views of the caller's gradients work).

    ``p (..., n, bk)`` is the tile's recomputed ``P_ij = exp(s - lse)`` (overwritten: it becomes
    ``dS``); ``delta (..., n, 1)`` is ``D_i = rowsum(dO_i * O_i)``; ``dlse (..., n, 1)``, when
    the log-sum-exp is an output too, adds ``P`` times its gradient to ``dS``.
    """
    _mm_add_(dv, p.transpose(-2, -1), do)  # dV_j += P^T dO_i
    dp = torch.matmul(do, v.transpose(-2, -1))  # dP = dO_i V_j^T
    ds = p.mul_(dp.sub_(delta) if dlse is None else dp.sub_(delta).add_(dlse))  # dS = P * (dP - D_i [+ dlse])
    _mm_add_(dq, ds, k, alpha=scale)  # dQ_i += scale * dS K_j
    _mm_add_(dk, ds.transpose(-2, -1), q, alpha=scale)  # dK_j += scale * dS^T Q_i
