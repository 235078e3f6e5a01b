"""Packed variable-length sequences in FlashAttention-2's layout, with no padding computed."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from attnlab.flex.attention import flex_attention
from attnlab.flex.block_mask import create_block_mask

__all__ = ["varlen_attention"]


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     scale: Optional[float] = None, is_causal: bool = False, block_size: int = 128) -> Tensor:
    """Attention over sequences packed one after another (FlashAttention-2's ``varlen`` layout).

    Args:
        q: ``(total_q, H, E)``: the sequences' queries one after another.
        k, v: ``(total_k, Hkv, E)``, ``(total_k, Hkv, Ev)``.
        cu_seqlens_q, cu_seqlens_k: ``(n + 1,)`` int cumulative lengths, starting at 0
            (sequence i is ``q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]``).
        max_seqlen_q, max_seqlen_k: accepted for FlashAttention's signature (checked when given).
        scale: default ``1 / sqrt(E)``.
        is_causal: within each sequence, aligned bottom-right as FlashAttention-2 (>= 2.1)
            does: query i of a sequence with ``Lq`` queries and ``Lk`` keys sees keys
            ``0 .. i + Lk - Lq`` (top-left and bottom-right agree when ``Lq == Lk``).

    Returns:
        ``(total_q, H, Ev)``. Blocks that span two sequences only are skipped (a block mask
        of the documents); no padding is computed.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"varlen_attention: {name} must be (total, heads, dim), got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    cq, ck = (torch.as_tensor(c, dtype=torch.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    if cq.dim() != 1 or ck.shape != cq.shape or int(cq[0]) != 0 or int(ck[0]) != 0:
        raise ValueError(f"varlen_attention: cu_seqlens_q and cu_seqlens_k must be (n + 1,) and start at 0, got "
                         f"{cq.tolist()} and {ck.tolist()}")
    if int(cq[-1]) != q.shape[0] or int(ck[-1]) != k.shape[0]:
        raise ValueError(f"varlen_attention: the cumulative lengths end at {int(cq[-1])} and {int(ck[-1])}, "
                         f"but q has {q.shape[0]} rows and k {k.shape[0]}")
    lq, lk = cq.diff(), ck.diff()
    if (lq < 0).any() or (lk < 0).any():
        raise ValueError("varlen_attention: cu_seqlens must not decrease")
    for name, given, real in (("max_seqlen_q", max_seqlen_q, lq), ("max_seqlen_k", max_seqlen_k, lk)):
        if given is not None and real.numel() and given < int(real.max()):
            raise ValueError(f"varlen_attention: {name}={given} is below the longest sequence ({int(real.max())})")
    doc_q = torch.repeat_interleave(torch.arange(len(lq)), lq)  # (total_q,) document of each query
    doc_k = torch.repeat_interleave(torch.arange(len(lk)), lk)
    pos_q = torch.arange(q.shape[0]) - cq[:-1].repeat_interleave(lq)  # position inside its sequence
    pos_k = torch.arange(k.shape[0]) - ck[:-1].repeat_interleave(lk)
    offset = (lk - lq).repeat_interleave(lq)  # bottom-right alignment per sequence

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_q[q_idx] == doc_k[kv_idx]
        if is_causal:
            same = same & (pos_q[q_idx] + offset[q_idx] >= pos_k[kv_idx])
        return same

    block_mask = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[0], BLOCK_SIZE=block_size)
    out = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                         block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)  # (total_q, H, Ev)
