"""The kernels of the backward corpus (tests/corpus/backward.py lists them as cases).

Every kernel has torch SDPA's signature plus ``sinks``::

    fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, sinks=None)

The buggy ones are mostly ``torch.autograd.Function``s whose forward is right (a stable softmax, an
online softmax over key blocks, or a base-2 online softmax, all in the inputs' float32) and whose
hand-written backward has one mistake. The backwards come in three styles, as engineers write them:
whole matrices (``_bw_matrix``), a loop over key blocks (``_bw_tiled``, FlashAttention-2's dK/dV loop)
and grouped einsums (``_bw_einsum``). A few are plain autograd code whose mistake only shows in the
gradients. The correct ones wrap torch's SDPA and attnlab's public functions, or are written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

NEG_INF = float("-inf")
LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- the call, as SDPA checks it


def _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks):
    """SDPA's checks; returns the softmax scale."""
    if dropout_p != 0.0:
        raise ValueError("dropout not supported")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal may not both be given")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("query, key and value must be 4-D: (B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev)")
    H, Hkv = query.shape[1], key.shape[1]
    if value.shape[1] != Hkv or (H != Hkv and not enable_gqa) or H % Hkv:
        raise ValueError(f"{H} query heads on {Hkv} key/value heads: enable_gqa=True and Hkv dividing H needed")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise ValueError("attn_mask: only a bool mask (True = attend) is supported")
    if sinks is not None and tuple(sinks.shape) != (H,):
        raise ValueError(f"sinks must have shape (H,) = ({H},), got {tuple(sinks.shape)}")
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


def _causal(L: int, S: int, device, offset: int = 0) -> Tensor:
    """Query i sees keys j <= i + offset (offset 0: SDPA's top-left alignment)."""
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(offset)


def _heads(x: Tensor, g: int) -> Tensor:
    """Key/value heads repeated up to the query heads: head h reads key/value head h // g."""
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _masked(s: Tensor, keep: Optional[Tensor]) -> Tensor:
    return s if keep is None else s.masked_fill(~keep, NEG_INF)


def _group_sum(x: Tensor, g: int) -> Tensor:
    """(B, H, S, X) per query head -> (B, Hkv, S, X): the sum over each group of g query heads."""
    B, H = x.shape[:2]
    return x.reshape(B, H // g, g, *x.shape[2:]).sum(2)


# --------------------------------------------------------------------------- forwards (all right)


def _fwd_dense(q, k, v, keep, scale, sinks):
    """Whole-matrix forward with a stable softmax; returns (O, natural lse)."""
    g = q.shape[1] // k.shape[1]
    s = _masked(scale * q @ _heads(k, g).transpose(-1, -2), keep)
    m = s.amax(-1)
    if sinks is not None:
        sink = sinks.to(s.dtype).view(1, -1, 1)
        m = torch.maximum(m, sink)
    l = torch.exp(s - m[..., None]).sum(-1)
    if sinks is not None:
        l = l + torch.exp(sink - m)
    lse = m + torch.log(l)
    return torch.exp(s - lse[..., None]) @ _heads(v, g), lse


def _fwd_online(q, k, v, keep, scale, sinks, block=4):
    """FlashAttention-2's forward: an online softmax over key blocks; returns (O, natural lse)."""
    B, H, L, _ = q.shape
    g, S = H // k.shape[1], k.shape[-2]
    if sinks is None:  # the running max and sum start at the sink's logit (ROCm/aiter#1576)
        m, l = q.new_full((B, H, L), NEG_INF), q.new_zeros(B, H, L)
    else:
        m, l = sinks.to(q.dtype).view(1, H, 1).expand(B, H, L).clone(), q.new_ones(B, H, L)
    acc = q.new_zeros(B, H, L, v.shape[-1])
    for j in range(0, S, block):
        kj, vj = _heads(k[:, :, j:j + block], g), _heads(v[:, :, j:j + block], g)
        s = _masked(scale * q @ kj.transpose(-1, -2), None if keep is None else keep[..., j:j + block])
        m_new = torch.maximum(m, s.amax(-1))
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # nothing seen yet
        alpha, p = torch.exp(m - m_use), torch.exp(s - m_use[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ vj
        m = m_new
    return acc / l[..., None], m + torch.log(l)


def _fwd_base2(q, k, v, keep, scale, sinks, block=4):
    """The Triton tutorial's forward: scores in base 2 (exp2), lse saved as m2 + log2(l)."""
    B, H, L, _ = q.shape
    g, S = H // k.shape[1], k.shape[-2]
    qk_scale = scale * LOG2E
    if sinks is None:
        m2, l = q.new_full((B, H, L), NEG_INF), q.new_zeros(B, H, L)
    else:
        m2, l = (sinks.to(q.dtype) * LOG2E).view(1, H, 1).expand(B, H, L).clone(), q.new_ones(B, H, L)
    acc = q.new_zeros(B, H, L, v.shape[-1])
    for j in range(0, S, block):
        kj, vj = _heads(k[:, :, j:j + block], g), _heads(v[:, :, j:j + block], g)
        s2 = _masked(qk_scale * q @ kj.transpose(-1, -2), None if keep is None else keep[..., j:j + block])
        m_new = torch.maximum(m2, s2.amax(-1))
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha, p = torch.exp2(m2 - m_use), torch.exp2(s2 - m_use[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ vj
        m2 = m_new
    return acc / l[..., None], m2 + torch.log2(l)  # lse in base 2 ... and the backward reads it as natural


def _fwd_max_only(q, k, v, keep, scale, sinks):
    """Right output, but the row statistic saved for the backward is the row max m alone (not m + log l)."""
    o, lse = _fwd_dense(q, k, v, keep, scale, sinks)
    g = q.shape[1] // k.shape[1]
    m = _masked(scale * q @ _heads(k, g).transpose(-1, -2), keep).amax(-1)
    if sinks is not None:
        m = torch.maximum(m, sinks.to(m.dtype).view(1, -1, 1))
    return o, m


# --------------------------------------------------------------------------- the Function around a backward


@dataclass
class Saved:
    """What the forward leaves the backward: inputs, O, the row statistic, the masks, the scale."""
    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor
    lse: Tensor                # (B, H, L)
    sinks: Optional[Tensor]    # (H,)
    mask: Optional[Tensor]     # the caller's bool attn_mask
    causal: bool
    scale: float

    @property
    def g(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    @property
    def keep(self) -> Optional[Tensor]:
        """The forward's mask: top-left causal or the bool attn_mask."""
        return _causal(self.q.shape[-2], self.k.shape[-2], self.q.device) if self.causal else self.mask


def _kv(sv: Saved):
    return _heads(sv.k, sv.g), _heads(sv.v, sv.g)


def _scores(sv: Saved, k: Tensor, keep: Optional[Tensor] = None) -> Tensor:
    return _masked(sv.scale * sv.q @ k.transpose(-1, -2), sv.keep if keep is None else keep)


def _sink_grad(sv: Saved, d: Tensor) -> Optional[Tensor]:
    """d sink_h = - sum over (b, i) of p_sink * D_i, p_sink = exp(sink_h - lse_i)."""
    if sv.sinks is None:
        return None
    p_sink = torch.exp(sv.sinks.to(sv.lse.dtype).view(1, -1, 1) - sv.lse)
    return -(p_sink * d).sum((0, 2)).to(sv.sinks.dtype)


def _kernel(name: str, backward: Callable, forward: Callable = _fwd_dense) -> Callable:
    """An SDPA-signature kernel: ``forward`` saves (O, lse); ``backward(saved, dO) -> (dq, dk, dv, dsinks)``."""

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, mask, causal, scale):
            keep = _causal(q.shape[-2], k.shape[-2], q.device) if causal else mask
            o, lse = forward(q, k, v, keep, scale, sinks)
            ctx.save_for_backward(q, k, v, o, lse, sinks)
            ctx.mask, ctx.causal, ctx.scale = mask, causal, scale
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse, sinks = ctx.saved_tensors
            sv = Saved(q, k, v, o, lse, sinks, ctx.mask, ctx.causal, ctx.scale)
            dq, dk, dv, dsinks = backward(sv, do.contiguous())
            return dq, dk, dv, dsinks, None, None, None

    Fn.__name__ = Fn.__qualname__ = f"_{name}_Function"

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, sinks=None):
        scale = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)
        return Fn.apply(query, key, value, sinks, attn_mask, bool(is_causal), scale)

    attention.__name__ = attention.__qualname__ = name
    attention.__doc__ = f"SDPA's signature plus sinks; forward {forward.__name__}, backward {backward.__name__}."
    return attention


# --------------------------------------------------------------------------- the right backwards, three styles


def _bw_matrix(sv: Saved, do: Tensor):
    """FlashAttention-2's backward on whole (L, S) matrices."""
    k, v = _kv(sv)
    p = torch.exp(_scores(sv, k) - sv.lse[..., None])
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    d = (do * sv.o).sum(-1)
    ds = p * (dp - d[..., None])
    dq = sv.scale * ds @ k
    dk = sv.scale * ds.transpose(-1, -2) @ sv.q
    return dq, _group_sum(dk, sv.g), _group_sum(dv, sv.g), _sink_grad(sv, d)


def _tile(sv: Saved, j: int, block: int, scaled: bool = True):
    """Key block j:j+block: (k_j, v_j per query head, masked scores s_j)."""
    kj, vj = _heads(sv.k[:, :, j:j + block], sv.g), _heads(sv.v[:, :, j:j + block], sv.g)
    keep = sv.keep
    s = sv.q @ kj.transpose(-1, -2)
    s = _masked(sv.scale * s if scaled else s, None if keep is None else keep[..., j:j + block])
    return kj, vj, s


def _bw_tiled(sv: Saved, do: Tensor, block: int = 4):
    """FlashAttention-2's backward as a loop over key blocks (dK_j, dV_j per block, dQ accumulated)."""
    d = (do * sv.o).sum(-1)  # the preprocess kernel
    dq, dks, dvs = torch.zeros_like(sv.q), [], []
    for j in range(0, sv.k.shape[-2], block):
        kj, vj, s = _tile(sv, j, block)
        p = torch.exp(s - sv.lse[..., None])
        dvs.append(_group_sum(p.transpose(-1, -2) @ do, sv.g))
        ds = p * (do @ vj.transpose(-1, -2) - d[..., None])
        dq += sv.scale * ds @ kj
        dks.append(_group_sum(sv.scale * ds.transpose(-1, -2) @ sv.q, sv.g))
    return dq, torch.cat(dks, 2), torch.cat(dvs, 2), _sink_grad(sv, d)


def _grouped(sv: Saved, do: Tensor):
    """Query-side tensors viewed per group, (B, Hkv, g, L, X), and the masked scores per group."""
    B, H, L, _ = sv.q.shape
    Hkv, S = sv.k.shape[1], sv.k.shape[-2]
    q5, do5, o5 = (t.reshape(B, Hkv, sv.g, L, t.shape[-1]) for t in (sv.q, do, sv.o))
    s = sv.scale * torch.einsum("bkgle,bkse->bkgls", q5, sv.k)
    if sv.keep is not None:
        s = s.masked_fill(~sv.keep.expand(B, H, L, S).reshape(B, Hkv, sv.g, L, S), NEG_INF)
    return q5, do5, o5, s, sv.lse.reshape(B, Hkv, sv.g, L)


def _bw_einsum(sv: Saved, do: Tensor):
    """FlashAttention-2's backward in grouped einsums: dK/dV sum over the group inside the einsum."""
    q5, do5, o5, s, lse5 = _grouped(sv, do)
    p = torch.exp(s - lse5[..., None])
    dv = torch.einsum("bkgls,bkgld->bksd", p, do5)
    dp = torch.einsum("bkgld,bksd->bkgls", do5, sv.v)
    delta = torch.einsum("bkgld,bkgld->bkgl", do5, o5)
    ds = p * (dp - delta[..., None])
    dq = sv.scale * torch.einsum("bkgls,bkse->bkgle", ds, sv.k)
    dk = sv.scale * torch.einsum("bkgls,bkgle->bkse", ds, q5)
    return dq.reshape(sv.q.shape), dk, dv, _sink_grad(sv, delta.reshape(sv.lse.shape))


# --------------------------------------------------------------------------- backward_scale


def _bw_ds_unscaled(sv, do):
    k, v = _kv(sv)
    p = torch.exp(_scores(sv, k) - sv.lse[..., None])
    d = (do * sv.o).sum(-1)
    ds = p * (do @ v.transpose(-1, -2) - d[..., None])
    dv = p.transpose(-1, -2) @ do
    dq = ds @ k  # MISTAKE: dS = dL/d(scores) is taken for dL/d(QK^T): the scale's chain rule is lost
    dk = ds.transpose(-1, -2) @ sv.q
    return dq, _group_sum(dk, sv.g), _group_sum(dv, sv.g), _sink_grad(sv, d)


def _bw_dk_unscaled(sv, do, block=4):
    d = (do * sv.o).sum(-1)
    dq, dks, dvs = torch.zeros_like(sv.q), [], []
    for j in range(0, sv.k.shape[-2], block):
        kj, vj, s = _tile(sv, j, block)
        p = torch.exp(s - sv.lse[..., None])
        dvs.append(_group_sum(p.transpose(-1, -2) @ do, sv.g))
        ds = p * (do @ vj.transpose(-1, -2) - d[..., None])
        dq += sv.scale * ds @ kj
        dks.append(_group_sum(ds.transpose(-1, -2) @ sv.q, sv.g))  # MISTAKE: softmax_scale lost for dK
    return dq, torch.cat(dks, 2), torch.cat(dvs, 2), _sink_grad(sv, d)


def _bw_dq_unscaled(sv, do):
    q5, do5, o5, s, lse5 = _grouped(sv, do)
    p = torch.exp(s - lse5[..., None])
    dv = torch.einsum("bkgls,bkgld->bksd", p, do5)
    delta = torch.einsum("bkgld,bkgld->bkgl", do5, o5)
    ds = p * (torch.einsum("bkgld,bksd->bkgls", do5, sv.v) - delta[..., None])
    dq = torch.einsum("bkgls,bkse->bkgle", ds, sv.k)  # MISTAKE: dQ without the scale (dK has it)
    dk = sv.scale * torch.einsum("bkgls,bkgle->bkse", ds, q5)
    return dq.reshape(sv.q.shape), dk, dv, _sink_grad(sv, delta.reshape(sv.lse.shape))


def _bw_dq_scale_twice(sv, do):
    k, v = _kv(sv)
    k_scaled = k * sv.scale  # K pre-scaled once for the logit recompute
    p = torch.exp(_masked(sv.q @ k_scaled.transpose(-1, -2), sv.keep) - sv.lse[..., None])
    d = (do * sv.o).sum(-1)
    ds = p * (do @ v.transpose(-1, -2) - d[..., None])
    dq = sv.scale * ds @ k_scaled  # MISTAKE: the pre-scaled K already carries the scale: scale^2 in dQ
    dk = sv.scale * ds.transpose(-1, -2) @ sv.q
    return dq, _group_sum(dk, sv.g), _group_sum(p.transpose(-1, -2) @ do, sv.g), _sink_grad(sv, d)


def _bw_p_unscaled(sv, do, block=4):
    d = (do * sv.o).sum(-1)
    dq, dks, dvs = torch.zeros_like(sv.q), [], []
    for j in range(0, sv.k.shape[-2], block):
        kj, vj, s = _tile(sv, j, block, scaled=False)  # MISTAKE: P = exp(Q K^T - lse), the scale left out
        p = torch.exp(s - sv.lse[..., None])
        dvs.append(_group_sum(p.transpose(-1, -2) @ do, sv.g))
        ds = p * (do @ vj.transpose(-1, -2) - d[..., None])
        dq += sv.scale * ds @ kj
        dks.append(_group_sum(sv.scale * ds.transpose(-1, -2) @ sv.q, sv.g))
    return dq, torch.cat(dks, 2), torch.cat(dvs, 2), _sink_grad(sv, d)


def _bw_dv_scaled(sv, do):
    q5, do5, o5, s, lse5 = _grouped(sv, do)
    p = torch.exp(s - lse5[..., None])
    dv = sv.scale * torch.einsum("bkgls,bkgld->bksd", p, do5)  # MISTAKE: the scale belongs to dS, not to dV
    delta = torch.einsum("bkgld,bkgld->bkgl", do5, o5)
    ds = p * (torch.einsum("bkgld,bksd->bkgls", do5, sv.v) - delta[..., None])
    dq = sv.scale * torch.einsum("bkgls,bkse->bkgle", ds, sv.k)
    dk = sv.scale * torch.einsum("bkgls,bkgle->bkse", ds, q5)
    return dq.reshape(sv.q.shape), dk, dv, _sink_grad(sv, delta.reshape(sv.lse.shape))


# --------------------------------------------------------------------------- backward_d_term, softmax_backward


def _bw_d_missing(sv, do, block=4):
    d = (do * sv.o).sum(-1)  # computed by the preprocess (the sink's gradient reads it) ...
    dq, dks, dvs = torch.zeros_like(sv.q), [], []
    for j in range(0, sv.k.shape[-2], block):
        kj, vj, s = _tile(sv, j, block)
        p = torch.exp(s - sv.lse[..., None])
        dvs.append(_group_sum(p.transpose(-1, -2) @ do, sv.g))
        ds = p * (do @ vj.transpose(-1, -2))  # MISTAKE: ... but dS = P * dP, without "- D"
        dq += sv.scale * ds @ kj
        dks.append(_group_sum(sv.scale * ds.transpose(-1, -2) @ sv.q, sv.g))
    return dq, torch.cat(dks, 2), torch.cat(dvs, 2), _sink_grad(sv, d)


def _bw_d_rowsum_do(sv, do):
    k, v = _kv(sv)
    p = torch.exp(_scores(sv, k) - sv.lse[..., None])
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    d = do.sum(-1)  # MISTAKE: D = rowsum(dO), without O
    ds = p * (dp - d[..., None])
    dq = sv.scale * ds @ k
    dk = sv.scale * ds.transpose(-1, -2) @ sv.q
    return dq, _group_sum(dk, sv.g), _group_sum(dv, sv.g), _sink_grad(sv, d)


def d_detached_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, sinks=None):
    """Plain autograd; the log-sum-exp detached "like the max", which drops D from the softmax's gradient."""
    if sinks is not None:
        raise ValueError("sinks not supported by this kernel")
    scale = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)
    g = query.shape[1] // key.shape[1]
    keep = _causal(query.shape[-2], key.shape[-2], query.device) if is_causal else attn_mask
    s = _masked(scale * query @ _heads(key, g).transpose(-1, -2), keep)
    lse = torch.logsumexp(s, -1, keepdim=True).detach()  # MISTAKE: the normalizer has a gradient; the max has none
    return torch.exp(s - lse) @ _heads(value, g)


def _bw_softmax_no_p(sv, do):
    q5, do5, o5, s, lse5 = _grouped(sv, do)
    p = torch.exp(s - lse5[..., None])
    dv = torch.einsum("bkgls,bkgld->bksd", p, do5)
    delta = torch.einsum("bkgld,bkgld->bkgl", do5, o5)
    dp = torch.einsum("bkgld,bksd->bkgls", do5, sv.v)
    ds = dp - delta[..., None]  # MISTAKE: the softmax's Jacobian needs P * (dP - D)
    ds = ds.masked_fill(torch.isinf(s), 0.0)  # masked keys get no gradient
    dq = sv.scale * torch.einsum("bkgls,bkse->bkgle", ds, sv.k)
    dk = sv.scale * torch.einsum("bkgls,bkgle->bkse", ds, q5)
    return dq.reshape(sv.q.shape), dk, dv, _sink_grad(sv, delta.reshape(sv.lse.shape))


def _bw_softmax_saved_p_unmasked(sv, do):
    k, v = _kv(sv)
    p = torch.exp(_scores(sv, k) - sv.lse[..., None])  # saved P: masked keys are exactly 0 here
    dv = p.transpose(-1, -2) @ do
    d = (do * sv.o).sum(-1)
    ds = do @ v.transpose(-1, -2) - d[..., None]  # MISTAKE: dS = dP - D, not P * (dP - D); masked keys get it too
    dq, dk = sv.scale * ds @ k, sv.scale * ds.transpose(-1, -2) @ sv.q
    return dq, _group_sum(dk, sv.g), _group_sum(dv, sv.g), _sink_grad(sv, d)


def _bw_scale_recomputed(sv, do):
    k, v = _kv(sv)
    scale = 1.0 / math.sqrt(sv.q.shape[-1])  # MISTAKE: the forward honoured scale=, the backward recomputes it
    p = torch.exp(_masked(scale * sv.q @ k.transpose(-1, -2), sv.keep) - sv.lse[..., None])
    dv = p.transpose(-1, -2) @ do
    d = (do * sv.o).sum(-1)
    ds = p * (do @ v.transpose(-1, -2) - d[..., None])
    dq, dk = scale * ds @ k, scale * ds.transpose(-1, -2) @ sv.q
    return dq, _group_sum(dk, sv.g), _group_sum(dv, sv.g), _sink_grad(sv, d)


def _bw_gqa_fold_repeat(sv, do):
    k, v = _kv(sv)  # the forward's repeat_interleave: query head h reads key/value head h // g
    p = torch.exp(_scores(sv, k) - sv.lse[..., None])
    d = (do * sv.o).sum(-1)
    ds = p * (do @ v.transpose(-1, -2) - d[..., None])
    dq = sv.scale * ds @ k
    B, H, S, E = sv.k.shape[0], sv.q.shape[1], sv.k.shape[2], sv.k.shape[3]
    Hkv = sv.k.shape[1]

    def fold(x):  # MISTAKE: folded as repeat's layout (head h -> h % Hkv), not repeat_interleave's
        return x.reshape(B, H // Hkv, Hkv, S, x.shape[-1]).sum(1)

    return dq, fold(sv.scale * ds.transpose(-1, -2) @ sv.q), fold(p.transpose(-1, -2) @ do), _sink_grad(sv, d)


def _bw_sink_full_lse_p_keys(sv, do):
    k, v = _kv(sv)
    s = _scores(sv, k)
    lse_keys = torch.logsumexp(s, -1)  # MISTAKE: P normalised over the keys alone...
    p = torch.exp(s - lse_keys[..., None])
    d = (do * sv.o).sum(-1)
    ds = p * (do @ v.transpose(-1, -2) - d[..., None])
    dq, dk = sv.scale * ds @ k, sv.scale * ds.transpose(-1, -2) @ sv.q
    return dq, _group_sum(dk, sv.g), _group_sum(p.transpose(-1, -2) @ do, sv.g), _sink_grad(sv, d)  # ...sink: full


# --------------------------------------------------------------------------- backward_mask


def _bw_mask_causal_dropped(sv, do, block=4):
    d = (do * sv.o).sum(-1)
    dq, dks, dvs = torch.zeros_like(sv.q), [], []
    for j in range(0, sv.k.shape[-2], block):
        kj, vj = _heads(sv.k[:, :, j:j + block], sv.g), _heads(sv.v[:, :, j:j + block], sv.g)
        s = sv.scale * sv.q @ kj.transpose(-1, -2)
        if sv.mask is not None:  # MISTAKE: P is rebuilt with the attn_mask only: the causal mask is never applied
            s = s.masked_fill(~sv.mask[..., j:j + block], NEG_INF)
        p = torch.exp(s - sv.lse[..., None])
        dvs.append(_group_sum(p.transpose(-1, -2) @ do, sv.g))
        ds = p * (do @ vj.transpose(-1, -2) - d[..., None])
        dq += sv.scale * ds @ kj
        dks.append(_group_sum(sv.scale * ds.transpose(-1, -2) @ sv.q, sv.g))
    return dq, torch.cat(dks, 2), torch.cat(dvs, 2), _sink_grad(sv, d)


def _bw_with_keep(keep_of: Callable) -> Callable:
    """The whole-matrix backward with P rebuilt under ``keep_of(saved)`` instead of the forward's mask."""

    def backward(sv, do):
        k, v = _kv(sv)
        p = torch.exp(_scores(sv, k, keep=keep_of(sv)) - sv.lse[..., None])
        d = (do * sv.o).sum(-1)
        ds = p * (do @ v.transpose(-1, -2) - d[..., None])
        dq, dk = sv.scale * ds @ k, sv.scale * ds.transpose(-1, -2) @ sv.q
        return dq, _group_sum(dk, sv.g), _group_sum(p.transpose(-1, -2) @ do, sv.g), _sink_grad(sv, d)

    return backward


def _keep_causal_only(sv):  # MISTAKE: the backward knows ctx.causal but not the bool attn_mask
    return _causal(sv.q.shape[-2], sv.k.shape[-2], sv.q.device) if sv.causal else _no_mask(sv)


def _keep_bottom_right(sv):  # MISTAKE: the backward's causal mask is bottom-right (j <= i + S - L)
    L, S = sv.q.shape[-2], sv.k.shape[-2]
    return _causal(L, S, sv.q.device, offset=S - L) if sv.causal else sv.mask


def _keep_always_causal(sv):  # MISTAKE: the backward ignores ctx.causal and always masks causally
    tril = _causal(sv.q.shape[-2], sv.k.shape[-2], sv.q.device)
    return tril if sv.mask is None else sv.mask & tril


def _no_mask(sv):
    return torch.ones(sv.q.shape[-2], sv.k.shape[-2], dtype=torch.bool, device=sv.q.device)


# --------------------------------------------------------------------------- gqa_grad_sum, gqa_group_mapping


def _bw_gqa_first_head(sv, do):
    k, v = _kv(sv)
    p = torch.exp(_scores(sv, k) - sv.lse[..., None])
    d = (do * sv.o).sum(-1)
    ds = p * (do @ v.transpose(-1, -2) - d[..., None])
    dq = sv.scale * ds @ k
    dk_heads, dv_heads = sv.scale * ds.transpose(-1, -2) @ sv.q, p.transpose(-1, -2) @ do
    # MISTAKE: one query head per key/value head (the group's first), the others' gradients dropped
    return dq, dk_heads[:, ::sv.g], dv_heads[:, ::sv.g], _sink_grad(sv, d)


def _bw_gqa_mean(sv, do, block=4):
    B, H, L, E = sv.q.shape
    d = (do * sv.o).sum(-1)
    dq, dks, dvs = torch.zeros_like(sv.q), [], []
    for j in range(0, sv.k.shape[-2], block):
        kj, vj, s = _tile(sv, j, block)
        p = torch.exp(s - sv.lse[..., None])
        ds = p * (do @ vj.transpose(-1, -2) - d[..., None])
        dq += sv.scale * ds @ kj
        dk_j, dv_j = sv.scale * ds.transpose(-1, -2) @ sv.q, p.transpose(-1, -2) @ do
        # MISTAKE: the group's query heads averaged, not summed
        dks.append(dk_j.reshape(B, H // sv.g, sv.g, -1, E).mean(2))
        dvs.append(dv_j.reshape(B, H // sv.g, sv.g, -1, dv_j.shape[-1]).mean(2))
    return dq, torch.cat(dks, 2), torch.cat(dvs, 2), _sink_grad(sv, d)


def _bw_gqa_modulo(sv, do):
    H, Hkv = sv.q.shape[1], sv.k.shape[1]
    kv_of = torch.arange(H, device=sv.q.device) % Hkv  # MISTAKE: the forward used h // (H // Hkv)
    k, v = sv.k[:, kv_of], sv.v[:, kv_of]
    p = torch.exp(_scores(sv, k) - sv.lse[..., None])
    d = (do * sv.o).sum(-1)
    ds = p * (do @ v.transpose(-1, -2) - d[..., None])
    dq = sv.scale * ds @ k
    dk = torch.zeros_like(sv.k).index_add_(1, kv_of, sv.scale * ds.transpose(-1, -2) @ sv.q)
    dv = torch.zeros_like(sv.v).index_add_(1, kv_of, p.transpose(-1, -2) @ do)
    return dq, dk, dv, _sink_grad(sv, d)


# --------------------------------------------------------------------------- sink_grad


def _bw_sink_zero(sv, do):
    dq, dk, dv, dsinks = _bw_matrix(sv, do)
    return dq, dk, dv, None if sv.sinks is None else torch.zeros_like(sv.sinks)  # MISTAKE: placeholder left in


def _bw_sink_sign(sv, do):
    dq, dk, dv, _ = _bw_einsum(sv, do)
    if sv.sinks is None:
        return dq, dk, dv, None
    delta = torch.einsum("bhld,bhld->bhl", do, sv.o)
    p_sink = torch.exp(sv.sinks.view(1, -1, 1) - sv.lse)
    return dq, dk, dv, (p_sink * delta).sum((0, 2))  # MISTAKE: + sum(p_sink * D): the sign flipped


def _bw_sink_no_psink(sv, do):
    dq, dk, dv, _ = _bw_tiled(sv, do)
    d = (do * sv.o).sum(-1)
    return dq, dk, dv, None if sv.sinks is None else -d.sum((0, 2))  # MISTAKE: -sum D, p_sink left out


def _bw_sink_mean(sv, do):
    dq, dk, dv, _ = _bw_matrix(sv, do)
    if sv.sinks is None:
        return dq, dk, dv, None
    d = (do * sv.o).sum(-1)
    p_sink = torch.exp(sv.sinks.view(1, -1, 1) - sv.lse)
    return dq, dk, dv, -(p_sink * d).mean((0, 2))  # MISTAKE: averaged over the rows, a sum is needed


def _bw_sink_lse_keys(sv, do):
    k, v = _kv(sv)
    s = _scores(sv, k)
    lse = torch.logsumexp(s, -1)  # MISTAKE: the row statistic recomputed over the keys alone, the sink left out
    p = torch.exp(s - lse[..., None])
    d = (do * sv.o).sum(-1)
    ds = p * (do @ v.transpose(-1, -2) - d[..., None])
    dq, dk = sv.scale * ds @ k, sv.scale * ds.transpose(-1, -2) @ sv.q
    dsinks = None if sv.sinks is None else -(torch.exp(sv.sinks.view(1, -1, 1) - lse) * d).sum((0, 2))
    return dq, _group_sum(dk, sv.g), _group_sum(p.transpose(-1, -2) @ do, sv.g), dsinks


# --------------------------------------------------------------------------- low_precision


def _tf32(x: Tensor) -> Tensor:
    """float32 rounded to TF32's 10-bit mantissa (round to nearest), as tensor cores read a tl.dot operand."""
    i = x.contiguous().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32)


def _bf16(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def _bw_tf32(sv, do, block=4):
    d = (do * sv.o).sum(-1)
    dq, dks, dvs = torch.zeros_like(sv.q), [], []
    t = _tf32  # MISTAKE: every tl.dot of the backward in TF32 (allow_tf32 / the default input_precision)
    for j in range(0, sv.k.shape[-2], block):
        kj, vj = _heads(sv.k[:, :, j:j + block], sv.g), _heads(sv.v[:, :, j:j + block], sv.g)
        keep = sv.keep
        s = _masked(sv.scale * (t(sv.q) @ t(kj).transpose(-1, -2)), None if keep is None else keep[..., j:j + block])
        p = torch.exp(s - sv.lse[..., None])
        dvs.append(_group_sum(t(p).transpose(-1, -2) @ t(do), sv.g))
        ds = p * (t(do) @ t(vj).transpose(-1, -2) - d[..., None])
        dq += sv.scale * (t(ds) @ t(kj))
        dks.append(_group_sum(sv.scale * (t(ds).transpose(-1, -2) @ t(sv.q)), sv.g))
    return dq, torch.cat(dks, 2), torch.cat(dvs, 2), _sink_grad(sv, d)


def _bw_bf16(sv, do):
    b = _bf16  # MISTAKE: P and dS go into their matmuls as bfloat16 (copied from a bf16 kernel; fp32 accumulate)
    k, v = _kv(sv)
    p = torch.exp(_scores(sv, k) - sv.lse[..., None])
    dv = b(p).transpose(-1, -2) @ do
    d = (do * sv.o).sum(-1)
    ds = p * (do @ v.transpose(-1, -2) - d[..., None])
    dq = sv.scale * (b(ds) @ k)
    dk = sv.scale * (b(ds).transpose(-1, -2) @ sv.q)
    return dq, _group_sum(dk, sv.g), _group_sum(dv, sv.g), _sink_grad(sv, d)


# --------------------------------------------------------------------------- grad_missing


def _with_sink_column(s: Tensor, sinks: Optional[Tensor]) -> Tensor:
    if sinks is None:
        return s
    B, H, L, _ = s.shape
    return torch.cat([s, sinks.to(s.dtype).view(1, H, 1, 1).expand(B, H, L, 1)], -1)


def key_detached(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, sinks=None):
    """Plain autograd; the keys enter through a detached copy (a cached K), so no gradient reaches key."""
    scale = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)
    g, S = query.shape[1] // key.shape[1], key.shape[-2]
    keep = _causal(query.shape[-2], S, query.device) if is_causal else attn_mask
    k_cache = key.detach()  # MISTAKE: the graph is severed at K
    s = _masked(scale * query @ _heads(k_cache, g).transpose(-1, -2), keep)
    p = torch.softmax(_with_sink_column(s, sinks), -1)[..., :S]
    return p @ _heads(value, g)


def _bw_value_none(sv, do):
    dq, dk, dv, dsinks = _bw_einsum(sv, do)
    return dq, dk, None, dsinks  # MISTAKE: dv computed, None returned in its slot


# --------------------------------------------------------------------------- correct kernels


def torch_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False, sinks=None):
    """torch's own SDPA; it has no sinks."""
    if sinks is not None:
        raise ValueError("sinks: torch.nn.functional.scaled_dot_product_attention has no attention sinks")
    _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=0.0,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def torch_sdpa_sink_key(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, sinks=None):
    """torch's SDPA with the sink as one more key: zero key and value, its logit put in by a float mask."""
    _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)
    if sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    B, H, L, _ = query.shape
    S = key.shape[-2]
    keep = _causal(L, S, query.device) if is_causal else attn_mask
    bias = query.new_zeros(B, H, L, S)
    if keep is not None:
        bias = bias.masked_fill(~keep, NEG_INF)
    bias = torch.cat([bias, sinks.to(query.dtype).view(1, H, 1, 1).expand(B, H, L, 1)], -1)
    key = torch.cat([key, key.new_zeros(*key.shape[:2], 1, key.shape[-1])], 2)  # score 0, plus the sink
    value = torch.cat([value, value.new_zeros(*value.shape[:2], 1, value.shape[-1])], 2)  # carries no value
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale, enable_gqa=enable_gqa)


def attnlab_functional(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, sinks=None):
    from attnlab.functional import scaled_dot_product_attention

    if dropout_p != 0.0:
        raise ValueError("dropout not supported")
    return scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale,
                                        enable_gqa=enable_gqa, sinks=sinks)


def attnlab_tiled(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, sinks=None):
    from attnlab.tiled import flash_attention

    if dropout_p != 0.0:
        raise ValueError("dropout not supported (attnlab.tiled.flash_attention has no dropout)")
    return flash_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa=enable_gqa, sinks=sinks)


def attnlab_dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, sinks=None):
    from attnlab.dispatch import attention

    if dropout_p != 0.0:
        raise ValueError("dropout not supported")
    return attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa=enable_gqa, sinks=sinks)


def einsum_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, sinks=None):
    """Plain autograd in grouped einsums; the sink is a column of the softmax that is dropped after it."""
    scale = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)
    B, H, L, E = query.shape
    Hkv, S = key.shape[1], key.shape[-2]
    q5 = query.reshape(B, Hkv, H // Hkv, L, E)
    s = scale * torch.einsum("bkgle,bkse->bkgls", q5, key).reshape(B, H, L, S)
    keep = _causal(L, S, query.device) if is_causal else attn_mask
    p = torch.softmax(_with_sink_column(_masked(s, keep), sinks), -1)[..., :S]
    out = torch.einsum("bkgls,bksd->bkgld", p.reshape(B, Hkv, H // Hkv, L, S), value)
    return out.reshape(B, H, L, value.shape[-1])


def chunked_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, sinks=None):
    """Plain autograd over key chunks with an online softmax (the running max detached: it cancels)."""
    scale = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)
    B, H, L, _ = query.shape
    g, S, chunk = H // key.shape[1], key.shape[-2], 3
    keep = _causal(L, S, query.device) if is_causal else attn_mask
    if sinks is None:
        m, l = query.new_full((B, H, L, 1), NEG_INF), query.new_zeros(B, H, L, 1)
    else:
        m = sinks.detach().to(query.dtype).view(1, H, 1, 1).expand(B, H, L, 1)
        l = torch.exp(sinks.to(query.dtype).view(1, H, 1, 1) - m)  # = 1, with the sink's gradient
    acc = query.new_zeros(B, H, L, value.shape[-1])
    for j in range(0, S, chunk):
        s = scale * query @ _heads(key[:, :, j:j + chunk], g).transpose(-1, -2)
        s = _masked(s, None if keep is None else keep[..., j:j + chunk])
        m_new = torch.maximum(m, s.detach().amax(-1, keepdim=True))
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha, p = torch.exp(m - m_use), torch.exp(s - m_use)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ _heads(value[:, :, j:j + chunk], g)
        m = m_new
    return acc / l


# --------------------------------------------------------------------------- the kernels, by name

BUGGY = {
    "ds_unscaled": _kernel("ds_unscaled", _bw_ds_unscaled),
    "dk_unscaled": _kernel("dk_unscaled", _bw_dk_unscaled, _fwd_online),
    "dq_unscaled": _kernel("dq_unscaled", _bw_dq_unscaled),
    "dq_scale_twice": _kernel("dq_scale_twice", _bw_dq_scale_twice, _fwd_online),
    "p_unscaled": _kernel("p_unscaled", _bw_p_unscaled, _fwd_online),
    "dv_scaled": _kernel("dv_scaled", _bw_dv_scaled),
    "d_missing": _kernel("d_missing", _bw_d_missing, _fwd_online),
    "d_rowsum_do": _kernel("d_rowsum_do", _bw_d_rowsum_do),
    "d_detached_lse": d_detached_lse,
    "softmax_no_p": _kernel("softmax_no_p", _bw_softmax_no_p, _fwd_online),
    "softmax_saved_p_unmasked": _kernel("softmax_saved_p_unmasked", _bw_softmax_saved_p_unmasked),
    "scale_recomputed": _kernel("scale_recomputed", _bw_scale_recomputed, _fwd_online),
    "gqa_fold_repeat": _kernel("gqa_fold_repeat", _bw_gqa_fold_repeat),
    "sink_full_lse_p_keys": _kernel("sink_full_lse_p_keys", _bw_sink_full_lse_p_keys, _fwd_online),
    "mask_causal_dropped": _kernel("mask_causal_dropped", _bw_mask_causal_dropped, _fwd_online),
    "mask_bool_dropped": _kernel("mask_bool_dropped", _bw_with_keep(_keep_causal_only)),
    "mask_bottom_right": _kernel("mask_bottom_right", _bw_with_keep(_keep_bottom_right), _fwd_online),
    "mask_always_causal": _kernel("mask_always_causal", _bw_with_keep(_keep_always_causal)),
    "gqa_first_head": _kernel("gqa_first_head", _bw_gqa_first_head),
    "gqa_mean": _kernel("gqa_mean", _bw_gqa_mean, _fwd_online),
    "gqa_modulo": _kernel("gqa_modulo", _bw_gqa_modulo),
    "lse_base2": _kernel("lse_base2", _bw_tiled, _fwd_base2),
    "lse_max_only": _kernel("lse_max_only", _bw_matrix, _fwd_max_only),
    "sink_zero": _kernel("sink_zero", _bw_sink_zero),
    "sink_sign": _kernel("sink_sign", _bw_sink_sign, _fwd_online),
    "sink_no_psink": _kernel("sink_no_psink", _bw_sink_no_psink, _fwd_online),
    "sink_mean": _kernel("sink_mean", _bw_sink_mean),
    "sink_lse_keys": _kernel("sink_lse_keys", _bw_sink_lse_keys, _fwd_online),
    "tf32_backward": _kernel("tf32_backward", _bw_tf32, _fwd_online),
    "bf16_backward": _kernel("bf16_backward", _bw_bf16),
    "key_detached": key_detached,
    "value_grad_none": _kernel("value_grad_none", _bw_value_none, _fwd_online),
}

CORRECT = {
    "torch_sdpa": torch_sdpa,
    "torch_sdpa_sink_key": torch_sdpa_sink_key,
    "attnlab_functional": attnlab_functional,
    "attnlab_tiled": attnlab_tiled,
    "attnlab_dispatch": attnlab_dispatch,
    "einsum_attention": einsum_attention,
    "chunked_attention": chunked_attention,
    "fa2_matrix": _kernel("fa2_matrix", _bw_matrix),
    "fa2_tiled": _kernel("fa2_tiled", _bw_tiled, _fwd_online),
    "fa2_einsum": _kernel("fa2_einsum", _bw_einsum),
}
