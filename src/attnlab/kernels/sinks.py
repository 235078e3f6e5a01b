"""Attention sinks: a learnable logit per query head in each row's softmax denominator (gpt-oss).

With a sink ``s_h`` the weights of row ``i`` of head ``h`` are
``p_ij = exp(x_ij) / (sum_j exp(x_ij) + exp(s_h))``: the sink takes part in the softmax and
carries no value. The kernels need not know: from the result without a sink, ``out`` and its
log-sum-exp ``lse``, the result with one is exact::

    lse'  = logaddexp(lse, s)          # the denominator with the sink, in log units
    out'  = out * exp(lse - lse')      # each weight shrinks by the same factor
    p_sink = exp(s - lse')             # the weight the sink took (1 for a row with no key)

and FlashAttention's backward, given ``(out', lse')`` instead of ``(out, lse)``, recomputes the
weights ``p' = exp(x - lse')`` and ``D' = rowsum(dO * out')``, which are the gradients' with the
sink; the sink's own gradient is ``ds_h = -sum over rows of p_sink * D'``. A fully masked row
(``lse = -inf``) gets ``out' = 0``, ``lse' = s`` and ``p_sink = 1``, as a softmax over the sink
alone gives.

These helpers work on the kernel layer's layout (:class:`~attnlab.kernels.Layout`: rows
``(Nb, r, L)``), in base 2 (the kernels' ``lse2``) or natural units; the argument itself is
checked by :func:`attnlab._validation.validate_sinks`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.kernels.layout import Layout
from attnlab.kernels.numerics import LOG2E

__all__ = ["rows", "absorb", "grad_rows", "absorb_pairs", "grad_rows_pairs", "to_heads"]


def rows(sinks: Tensor, layout: Layout, L: int, dtype: torch.dtype) -> Tensor:
    """Each query row's sink on the layout: ``(H,) -> (Nb, r, L)``, in ``dtype``."""
    per_row = sinks.to(dtype)[:, None, None].expand(*layout.batch, L, 1)  # (..., H, L, 1)
    return layout.queries(per_row)[..., 0]  # (Nb, r, L)


def absorb(out: Tensor, lse: Tensor, sink: Tensor, base2: bool) -> tuple[Tensor, Tensor]:
    """``(out', lse')``: the result with the sink from the result without it.

    Args:
        out: ``(Nb, r, L, Ev)``, normalised without the sink.
        lse: ``(Nb, r, L)``, its log-sum-exp (``-inf`` for a row with no key).
        sink: ``(Nb, r, L)``, each row's sink logit (natural units, as the user gives it).
        base2: ``lse`` (and the returned ``lse'``) in base 2, as the native kernels keep it.
    """
    s = sink * LOG2E if base2 else sink
    both = torch.logaddexp2(lse, s) if base2 else torch.logaddexp(lse, s)  # (Nb, r, L)
    shrink = torch.exp2(lse - both) if base2 else torch.exp(lse - both)  # 0 for a row with no key
    return out * shrink[..., None].to(out.dtype), both


def grad_rows(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor, base2: bool) -> Tensor:
    """Each row's ``ds = -p_sink * rowsum(dO * out')``: ``(Nb, r, L)``, from ``absorb``'s results."""
    s = sink * LOG2E if base2 else sink
    p_sink = torch.exp2(s - lse) if base2 else torch.exp(s - lse)  # (Nb, r, L)
    wide = torch.promote_types(out.dtype, torch.float32)  # D in float32 at least (bfloat16 outputs)
    D = (dout.to(wide) * out.to(wide)).sum(-1)  # (Nb, r, L)
    return -(p_sink.to(D.dtype) * D)


def absorb_pairs(out: Tensor, ml: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`absorb` for the natural-units state the pure path keeps when a mask is too large for
    base 2 (Hugging Face's ``finfo.min`` masks, rows masked with -1e9): ``ml (Nb, r, L, 2)`` holds
    ``(m_i, l_i)`` apart, the weights being ``exp(s - m_i) / l_i``. Returns ``(out', (m', l'))``."""
    m, l = ml[..., 0], ml[..., 1]  # (Nb, r, L) each
    m_new = torch.maximum(m, sink)
    kept = l * torch.exp(m - m_new)  # the row's old denominator on the new max (0 for a row with no key)
    l_new = kept + torch.exp(sink - m_new)
    return out * (kept / l_new)[..., None].to(out.dtype), torch.stack([m_new, l_new], dim=-1)


def grad_rows_pairs(dout: Tensor, out: Tensor, ml: Tensor, sink: Tensor) -> Tensor:
    """:func:`grad_rows` from :func:`absorb_pairs`' results: ``(Nb, r, L)``."""
    p_sink = torch.exp(sink - ml[..., 0]) / ml[..., 1]  # (Nb, r, L)
    wide = torch.promote_types(out.dtype, torch.float32)
    D = (dout.to(wide) * out.to(wide)).sum(-1)
    return -(p_sink.to(D.dtype) * D)


def to_heads(per_row: Tensor, layout: Layout, H: int) -> Tensor:
    """``(Nb, r, L) -> (H,)``: the rows of each query head summed (over batch and queries)."""
    heads = per_row.reshape(*layout.batch, per_row.shape[-1])  # (..., H, L): the layout undone
    return heads.sum(-1).reshape(-1, H).sum(0)  # (H,)
