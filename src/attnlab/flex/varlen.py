"""Packed variable-length sequences, FlashAttention-2's ``varlen`` interface, on attnlab's kernels.

FlashAttention's layout (``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding``):
the sequences of a batch are packed one after another, no padding::

    q (total_q, H, E)   k (total_k, Hkv, E)   v (total_k, Hkv, Ev)
    cu_seqlens_q (batch + 1,): sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]

Query ``i`` and key ``j`` of a sequence with ``Lq`` queries and ``Lk`` keys are aligned
bottom-right (FlashAttention >= 2.1): ``i`` stands at position ``i + Lk - Lq``. With
``window_size = (left, right)`` (``-1``: unbounded) it sees keys ``j`` with
``i + Lk - Lq - left <= j <= i + Lk - Lq + right``; ``causal=True`` sets ``right = 0``.
``Lq = 3, Lk = 5``, ``causal=True``, and ``window_size=(1, 0)``::

    causal        window (1, 0)
    # # # . .     . # # . .
    # # # # .     . . # # .
    # # # # #     . . . # #

The functions here build an attnlab.flex BlockMask of the sequences (blocks that span two
sequences, or fall outside a window, are skipped) and run :func:`attnlab.flex.flex_attention`,
forward and backward.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from attnlab._validation import default_scale
from attnlab.flex.attention import flex_attention
from attnlab._validation import require_tensors
from attnlab.flex.block_mask import create_block_mask

__all__ = ["varlen_attention", "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "unpad_input", "pad_input"]

FN = "varlen_attention"


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     scale: Optional[float] = None, is_causal: bool = False, block_size: int = 128,
                     softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                     softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
                     deterministic: bool = False, return_attn_probs: bool = False,
                     block_table: Optional[Tensor] = None, sinks: Optional[Tensor] = None):
    """Attention over sequences packed one after another (FlashAttention-2's ``varlen`` layout).

    Args:
        q: ``(total_q, H, E)``: the sequences' queries one after another.
        k: ``(total_k, Hkv, E)``; ``H`` a multiple of ``Hkv`` (GQA).
        v: ``(total_k, Hkv, Ev)``.
        cu_seqlens_q: ``(batch + 1,)`` int cumulative lengths, starting at 0.
        cu_seqlens_k: as ``cu_seqlens_q``.
        max_seqlen_q: FlashAttention's; checked when given.
        max_seqlen_k: as ``max_seqlen_q``.
        scale: the score scale, default ``1 / sqrt(E)``.
        softmax_scale: the same argument under FlashAttention's name (give one of the two).
        is_causal: FlashAttention's ``causal``: bottom-right aligned in each sequence.
        block_size: the BlockMask's block (speed only).
        window_size: ``(left, right)`` local attention, ``-1`` unbounded (see the module doc).
        softcap: ``> 0``: scores become ``softcap * tanh(score / softcap)`` (after the scale).
        alibi_slopes: ``(H,)`` or ``(batch, H)`` float: ``-slope * |i + Lk - Lq - j|`` is added
            to the score of query ``i`` and key ``j`` (after the soft cap).
        dropout_p: must be 0 (attnlab has no attention dropout: ``NotImplementedError``).
        deterministic: accepted; attnlab's backward is deterministic.
        return_attn_probs: also return ``softmax_lse (H, total_q)`` float32 (natural log; ``+inf``
            for a row that sees no key, as FlashAttention's) and ``S_dmask (batch, H,
            max_seqlen_q, max_seqlen_k)``, the attention probabilities (0 outside each sequence;
            FlashAttention rounds these dims up and encodes dropout there: for tests only).
        block_table: FlashAttention's paged KV cache: ``NotImplementedError`` (see
            :class:`attnlab.decoding.PagedKVCache`).
        sinks: attnlab's addition: ``(H,)``, a logit per query head in each row's softmax
            denominator, without a value (gpt-oss's attention sinks), with a gradient; the
            ``softmax_lse`` and probabilities returned then include it.

    Returns:
        ``(total_q, H, Ev)`` in q's dtype, or ``(out, softmax_lse, S_dmask)``.
    """
    _refuse(dropout_p, block_table)
    scale = _one_scale(scale, softmax_scale)
    if any(isinstance(t, Tensor) and t.is_meta for t in (q, k, v)):  # shapes only: nothing about the lengths is read
        require_tensors(FN, q=q, k=k, v=v)
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device="meta")
        if not return_attn_probs:
            return out
        n = cu_seqlens_q.numel() - 1 if isinstance(cu_seqlens_q, Tensor) else 0
        return (out, torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device="meta"),
                torch.empty(n, q.shape[1], max_seqlen_q or 0, max_seqlen_k or 0, dtype=q.dtype, device="meta"))
    cq, ck = _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    left, right = _window(window_size, is_causal)
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or softcap < 0:
        raise ValueError(f"{FN}: softcap must be a float >= 0 (0: off), got {softcap!r}")
    seqs = _Sequences(cq, ck)
    slopes = _slopes(alibi_slopes, seqs.n, q.shape[1])
    mask_mod = seqs.mask_mod(left, right)
    score_mod = seqs.score_mod(float(softcap), slopes)
    block_mask = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[0], BLOCK_SIZE=block_size)
    out, lse = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                              score_mod=score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=q.shape[1] != k.shape[1], return_lse=True, sinks=sinks)
    out = out[0].transpose(0, 1)  # (total_q, H, Ev)
    if not return_attn_probs:
        return out
    lse = lse[0].detach().float()  # (H, total_q)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)  # FlashAttention's empty rows
    return out, lse, seqs.probabilities(q, k, lse, mask_mod, score_mod, scale)


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None):
    """FlashAttention-2's ``flash_attn_varlen_func``, same signature and meaning, on attnlab's
    kernels: ``q (total_q, H, E)``, ``k, v (total_k, Hkv, E / Ev)``; see :func:`varlen_attention`."""
    return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                            max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, is_causal=causal,
                            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                            deterministic=deterministic, return_attn_probs=return_attn_probs, block_table=block_table)


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False):
    """FlashAttention-2's ``flash_attn_varlen_qkvpacked_func``: ``qkv (total, 3, H, E)``."""
    if not isinstance(qkv, Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"flash_attn_varlen_qkvpacked_func: qkv must be (total, 3, nheads, headdim), got "
                         f"{tuple(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                    return_attn_probs: bool = False):
    """FlashAttention-2's ``flash_attn_varlen_kvpacked_func``: ``kv (total_k, 2, Hkv, E)``."""
    if not isinstance(kv, Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"flash_attn_varlen_kvpacked_func: kv must be (total_k, 2, nheads_k, headdim), got "
                         f"{tuple(kv.shape) if isinstance(kv, Tensor) else type(kv).__name__}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def unpad_input(hidden_states: Tensor, attention_mask: Tensor, unused_mask: Optional[Tensor] = None):
    """FlashAttention's ``bert_padding.unpad_input``: the tokens a padding mask keeps, packed.

    Args:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)`` bool or int, 1 = a real token.
        unused_mask: ``(batch, seqlen)``, 1 = allocated but unused (kept, not counted as used).

    Returns:
        ``(hidden_states (total_nnz, ...), indices (total_nnz,) int64 into the flattened
        (batch * seqlen), cu_seqlens (batch + 1,) int32, max_seqlen_in_batch int,
        seqused (batch,) int32)``.
    """
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() < 2:
        raise ValueError("unpad_input: hidden_states must be (batch, seqlen, ...)")
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"unpad_input: attention_mask must be (batch, seqlen) = {tuple(hidden_states.shape[:2])}, got "
                         f"{tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else attention_mask!r}")
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)  # (batch,)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])  # (batch * seqlen, ...)
    return flat[indices], indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """FlashAttention's ``bert_padding.pad_input``: ``(total_nnz, ...)`` back to ``(batch, seqlen, ...)``,
    zeros where no token was kept (differentiable)."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)  # (batch * seqlen, ...)
    return out.view(batch, seqlen, *hidden_states.shape[1:])


# --------------------------------------------------------------------------- #


def _refuse(dropout_p, block_table) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p < 0:
        raise ValueError(f"{FN}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p > 0:
        raise NotImplementedError(f"{FN}: dropout_p={dropout_p}: attnlab's attention has no dropout; pass 0.0")
    if block_table is not None:
        raise NotImplementedError(f"{FN}: block_table (a paged KV cache) is not supported here; for decoding from "
                                  f"pages use attnlab.decoding.PagedKVCache and paged_decode_attention")


def _one_scale(scale, softmax_scale) -> Optional[float]:
    if scale is not None and softmax_scale is not None:
        raise ValueError(f"{FN}: pass scale or softmax_scale (one argument, two names), not both")
    return softmax_scale if softmax_scale is not None else scale


def _window(window_size, causal: bool) -> tuple[float, float]:
    """``(left, right)`` with ``inf`` for unbounded; ``causal`` sets ``right = 0``, as FlashAttention does."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window_size)):
        raise ValueError(f"{FN}: window_size must be (left, right) ints >= -1 (-1: unbounded), got {window_size!r}")
    left, right = (math.inf if w == -1 else w for w in window_size)
    return left, (min(right, 0) if causal else right)


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple[Tensor, Tensor]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"{FN}: {name} must be (total, heads, dim), got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    cq, ck = (torch.as_tensor(c, dtype=torch.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    if cq.dim() != 1 or ck.shape != cq.shape or int(cq[0]) != 0 or int(ck[0]) != 0:
        raise ValueError(f"{FN}: cu_seqlens_q and cu_seqlens_k must be (n + 1,) and start at 0, got "
                         f"{cq.tolist()} and {ck.tolist()}")
    if int(cq[-1]) != q.shape[0] or int(ck[-1]) != k.shape[0]:
        raise ValueError(f"{FN}: the cumulative lengths end at {int(cq[-1])} and {int(ck[-1])}, "
                         f"but q has {q.shape[0]} rows and k {k.shape[0]}")
    lq, lk = cq.diff(), ck.diff()
    if (lq < 0).any() or (lk < 0).any():
        raise ValueError(f"{FN}: cu_seqlens must not decrease")
    for name, given, real in (("max_seqlen_q", max_seqlen_q, lq), ("max_seqlen_k", max_seqlen_k, lk)):
        if given is not None and real.numel() and given < int(real.max()):
            raise ValueError(f"{FN}: {name}={given} is below the longest sequence ({int(real.max())})")
    return cq, ck


def _slopes(alibi_slopes, n: int, H: int) -> Optional[Tensor]:
    """``(n, H)`` float32 slopes, or None."""
    if alibi_slopes is None:
        return None
    s = torch.as_tensor(alibi_slopes, dtype=torch.float32)
    if s.shape == (H,):
        return s.expand(n, H)
    if s.shape == (n, H):
        return s
    raise ValueError(f"{FN}: alibi_slopes must be (nheads,) = ({H},) or (batch, nheads) = ({n}, {H}), got "
                     f"{tuple(s.shape)}")


class _Sequences:
    """Per-token tables of a packed batch: the sequence of each query and key, and the aligned
    positions (a query's position is shifted by ``Lk - Lq``: bottom-right)."""

    def __init__(self, cq: Tensor, ck: Tensor) -> None:
        self.cq, self.ck = cq, ck
        lq, lk = cq.diff(), ck.diff()
        self.n = lq.numel()
        self.max_q, self.max_k = (int(lq.max()) if self.n else 0), (int(lk.max()) if self.n else 0)
        self.doc_q = torch.repeat_interleave(torch.arange(self.n), lq)  # (total_q,)
        self.doc_k = torch.repeat_interleave(torch.arange(self.n), lk)  # (total_k,)
        self.pos_q = (torch.arange(int(cq[-1])) - cq[:-1].repeat_interleave(lq)
                      + (lk - lq).repeat_interleave(lq))  # (total_q,) i + Lk - Lq
        self.pos_k = torch.arange(int(ck[-1])) - ck[:-1].repeat_interleave(lk)  # (total_k,) j

    def mask_mod(self, left: float, right: float):
        doc_q, doc_k, pos_q, pos_k = self.doc_q, self.doc_k, self.pos_q, self.pos_k
        windowed = left != math.inf or right != math.inf

        def mask_mod(b, h, q_idx, kv_idx):
            keep = doc_q[q_idx] == doc_k[kv_idx]
            if windowed:
                d = pos_q[q_idx] - pos_k[kv_idx]  # i + Lk - Lq - j
                if right != math.inf:
                    keep = keep & (d >= -right)
                if left != math.inf:
                    keep = keep & (d <= left)
            return keep

        if doc_q.numel() and doc_k.numel():
            mask_mod.block_kinds = self._block_kinds(windowed)
        return mask_mod

    def _block_kinds(self, windowed: bool):
        """Blocks from the sequences alone: empty where the block's sequences differ; full
        where one sequence covers it (then partial if a window cuts it: evaluated)."""
        doc_q, doc_k = self.doc_q, self.doc_k

        def block_kinds(bq: int, bk: int, nq: int, nk: int) -> Tensor:
            q0 = (torch.arange(nq) * bq).clamp(max=doc_q.numel() - 1)
            q1 = (torch.arange(nq) * bq + bq - 1).clamp(max=doc_q.numel() - 1)
            k0 = (torch.arange(nk) * bk).clamp(max=doc_k.numel() - 1)
            k1 = (torch.arange(nk) * bk + bk - 1).clamp(max=doc_k.numel() - 1)
            dq0, dq1 = doc_q[q0][:, None], doc_q[q1][:, None]
            dk0, dk1 = doc_k[k0][None, :], doc_k[k1][None, :]
            one = (dq0 == dq1) & (dk0 == dk1) & (dq0 == dk0)
            empty = (dq1 < dk0) | (dk1 < dq0)
            full = one & (not windowed)
            return torch.where(full, 2, torch.where(empty, 0, 1)).to(torch.uint8)
        return block_kinds

    def score_mod(self, softcap: float, slopes: Optional[Tensor]):
        if softcap == 0 and slopes is None:
            return None
        doc_q, pos_q, pos_k = self.doc_q, self.pos_q, self.pos_k

        def score_mod(score, b, h, q_idx, kv_idx):
            if softcap > 0:
                score = softcap * torch.tanh(score / softcap)
            if slopes is not None:
                score = score - slopes[doc_q[q_idx], h] * (pos_q[q_idx] - pos_k[kv_idx]).abs()
            return score
        return score_mod

    def probabilities(self, q: Tensor, k: Tensor, lse: Tensor, mask_mod, score_mod, scale) -> Tensor:
        """``S_dmask (batch, H, max_seqlen_q, max_seqlen_k)``: ``exp(score - lse)`` of each sequence's
        visible pairs, 0 elsewhere (dense per sequence: for tests, as FlashAttention's)."""
        H, E = q.shape[1], q.shape[2]
        scale_f = default_scale(scale, E)
        out = torch.zeros(self.n, H, self.max_q, self.max_k, dtype=torch.float32)
        kk = k.detach().float().repeat_interleave(H // k.shape[1], dim=1)  # (total_k, H, E)
        h_idx = torch.arange(H).view(H, 1, 1)
        with torch.no_grad():
            for b in range(self.n):
                q0, q1, k0, k1 = (int(t) for t in (self.cq[b], self.cq[b + 1], self.ck[b], self.ck[b + 1]))
                if q1 == q0 or k1 == k0:
                    continue
                qi = torch.arange(q0, q1).view(1, -1, 1)
                ki = torch.arange(k0, k1).view(1, 1, -1)
                s = (q[q0:q1].detach().float().transpose(0, 1) @ kk[k0:k1].permute(1, 2, 0)) * scale_f  # (H, Lq, Lk)
                if score_mod is not None:
                    s = score_mod(s, torch.tensor(0), h_idx, qi, ki)
                s = s.masked_fill(~mask_mod(torch.tensor(0), h_idx, qi, ki), float("-inf"))
                out[b, :, :q1 - q0, :k1 - k0] = torch.exp(s - lse[:, q0:q1, None])
        return out
