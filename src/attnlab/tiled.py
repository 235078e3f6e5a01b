"""Tiled (flash-style) attention: the exact result, block by block, in O(L·E) memory.

The reference builds the whole ``(L, S)`` score matrix. Here the keys are visited
one block at a time and the softmax is computed *online* (Milakov & Gimelshein
2018; FlashAttention, Dao et al. 2022; FlashAttention-2, Dao 2023): each query row
keeps a running maximum ``m_i``, a running sum ``l_i`` of exponentials and an
accumulator ``acc`` of exponential-weighted values. When a new block raises the
maximum, the old sum and accumulator are rescaled by ``exp(m_old - m_new)``, so the
result equals softmax(QK^T)V exactly, up to rounding. The backward pass recomputes
each score block from Q, K, the output and the log-sum-exp ``lse = m_i + log l_i``
instead of storing the ``(L, S)`` probabilities.

The functions here are the readable version. Where :func:`attnlab.kernels.native.can_run`
says so (float32 on the CPU, or bfloat16 on the bf16 route; finite inputs) the forward and
backward run the same loops as compiled C++ (``csrc/flash.cpp``, built by
:mod:`attnlab.kernels.native`), one cache-sized tile per task; :func:`native_status` says which.
Causality is an offset in both: keys ``0..i + offset`` are visible to query ``i`` (0 top-left,
``S - L`` bottom-right), and tiles past it are skipped.

Arithmetic is done in base 2 (``exp2``, with ``log2(e)`` folded into the query
scale): same result, and ``exp2`` is cheaper than ``exp`` on the CPU.

Layout inside this module: the leading dims are flattened to ``Nb`` rows of
key/value heads, and the ``r = H / Hkv`` query heads that share a key/value head
are stacked along the query axis, so every block is one batched matmul::

    q4 (Nb, r, L, E)    k3 (Nb, S, E)    v3 (Nb, S, Ev)

so grouped-query attention never repeats K or V.

This module never imports the reference (:mod:`attnlab.functional`): the two are
independent implementations checked against each other and against torch.

The tiles themselves (forward, backward, native or eager) are the kernel layer's dense tile
source, :mod:`attnlab.kernels.dense`, which the ring uses too; this module is the public
function and its ``torch.autograd.Function``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from attnlab._validation import compute_dtype, default_scale, validate, validate_sinks
from attnlab.kernels import LOG2E, Layout, block_size, dense, finite_inputs, lse_absorbed, needs_natural_units
from attnlab.kernels import native as _native
from attnlab.kernels import sinks as _sinks
from attnlab.kernels.dense import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

__all__ = ["flash_attention", "native_status", "DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K"]



def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    enable_gqa: bool = False,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    causal_align: str = "top_left",
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Attention computed block by block with an online softmax; SDPA's semantics, no dropout.

    Args:
        query: ``(..., L, E)``, e.g. ``(B, H, L, E)``.
        key: ``(..., S, E)``, e.g. ``(B, Hkv, S, E)``.
        value: ``(..., S, Ev)``.
        attn_mask: ``None``, bool (``True`` = attend) or float (added), broadcastable to
            ``(..., L, S)``; it is read one ``(block_q, block_k)`` tile at a time, never
            expanded to ``(..., L, S)``. A float mask that requires grad is refused
            (use :func:`attnlab.functional.scaled_dot_product_attention`).
        is_causal: top-left aligned: query ``i`` sees keys ``0..i``. Key blocks entirely
            above the diagonal are skipped. For ``L = 2, S = 3``::

                # . .
                # # .

        scale: default ``1 / sqrt(E)``.
        causal_align: with ``is_causal``, ``"top_left"`` (SDPA's meaning, above) or
            ``"bottom_right"`` (the last query sees every key, as in a KV cache: query ``i``
            sees keys ``0..i + S - L``; :func:`attnlab.masks.causal`'s ``align``). The
            alignment is an offset the kernels skip and mask tiles by, never a dense mask.
            For ``L = 2, S = 3``::

                # # .
                # # #

        enable_gqa: query heads ``h`` use key/value head ``h // (H // Hkv)``; K and V are
            not repeated (unless their head counts differ, e.g. ``H = Hk = 6, Hv = 3``:
            then each is repeated up to ``H``).
        block_q: the query tile (default 256, the best measured here); any positive int, the lengths
            need not be multiples.
        block_k: the key tile (default 256), likewise.
        sinks: ``(H,)``, a logit per query head in each row's softmax denominator, without a value
            (gpt-oss's attention sinks; :mod:`attnlab.kernels.sinks`), with a gradient. The kernels
            run as without it; the sink is folded into their ``(out, lse)`` after, and their
            backward, given those, computes the gradients with it.

    Returns:
        ``(..., L, Ev)`` in the query's dtype. Rows whose keys are all masked are 0.
        NaN and inf propagate as in torch's MATH backend (such calls run the pure code);
        ``E == 0`` gives the mean of the values, as torch does.
    """
    batch = validate(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, fn="flash_attention")
    validate_sinks(sinks, query, "flash_attention")
    if any(t.is_meta for t in (query, key, value)):  # shapes only: the reference's rules (the alignment moves no shape)
        from attnlab import functional

        return functional.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale,
                                                       enable_gqa=enable_gqa, sinks=sinks)
    bq = block_size(block_q, DEFAULT_BLOCK_Q, "block_q")
    bk = block_size(block_k, DEFAULT_BLOCK_K, "block_k")
    if enable_gqa and key.shape[-3] != value.shape[-3]:
        # K and V grouped differently (e.g. H = Hk = 6, Hv = 3): the layout shares one group
        # size, so each is repeated up to the query heads (torch accepts this; rare in models)
        H = query.shape[-3]
        key = key.repeat_interleave(H // key.shape[-3], dim=-3)  # (..., H, S, E)
        value = value.repeat_interleave(H // value.shape[-3], dim=-3)  # (..., H, S, Ev)
    if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad:
        raise ValueError("flash_attention: gradients for a float attn_mask are not supported by the tiled path; "
                         "detach the mask, or use attnlab.functional.scaled_dot_product_attention")
    if causal_align not in ("top_left", "bottom_right"):
        raise ValueError(f"flash_attention: causal_align must be 'top_left' or 'bottom_right', got {causal_align!r}")
    offset = key.shape[-2] - query.shape[-2] if is_causal and causal_align == "bottom_right" else 0
    if torch.compiler.is_compiling():  # one op to Dynamo: the kernels' data-dependent choices stay inside it
        return torch.ops.attnlab.flash_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, bq, bk,
                                                 offset, sinks)[0]
    return _FlashAttention.apply(query, key, value, attn_mask, is_causal, scale, enable_gqa, bq, bk, batch, offset,
                                 sinks)


# ----------------------------------------------------------------------------- the forward and backward, once
@dataclass
class _Saved:
    """What the backward needs of the forward: the kernels' operands on the layout, their
    ``(out4, lse2)`` (with the sinks folded in), and the route taken. ``lse2`` is base 2, or
    natural-units ``(m_i, l_i)`` pairs ``(Nb, r, L, 2)`` where ``natural`` (masks too large for base 2)."""

    q4: Tensor  # (Nb, r, L, E)
    k3: Tensor  # (Nb, S, E)
    v3: Tensor  # (Nb, S, Ev)
    out4: Tensor  # (Nb, r, L, Ev)
    lse2: Tensor  # (Nb, r, L), or (Nb, r, L, 2)
    mask: Optional[Tensor]
    layout: Layout
    natural: bool
    no_features: bool  # E == 0
    scale: float
    shapes: tuple
    sink_rows: Optional[Tensor] = None  # (Nb, r, L)
    sink_dtype: Optional[torch.dtype] = None


def _operands(query, key, value, attn_mask, enable_gqa, batch):
    """The layout, ``q4, k3, v3`` in the kernels' dtype, the mask as they read it, the scale's
    ``E`` handled, and whether the pure path needs natural units: the forward's first steps, which
    the compiled backward repeats instead of saving them."""
    dtype = _native.operand_dtype(query.dtype)  # bfloat16 stays bfloat16 on the bf16 route
    layout = Layout(batch, query, key, enable_gqa)
    q4 = layout.queries(query.to(dtype))  # (Nb, r, L, E)
    k3 = layout.keys(key.to(dtype))  # (Nb, S, E)
    v3 = layout.keys(value.to(dtype))  # (Nb, S, Ev)
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.to(compute_dtype(dtype))
    if query.shape[-1] == 0:  # every score is 0 (an empty dot product), whatever the scale: softmax is uniform
        q4, k3 = q4.new_zeros(*q4.shape[:-1], 1), k3.new_zeros(*k3.shape[:-1], 1)
    return layout, q4, k3, v3, mask, needs_natural_units(mask)


def _widen_if(q4, k3, v3, mask, natural: bool):
    """bf16 operands the pure code runs (natural units, or non-finite inputs) as float32, as before."""
    if q4.dtype == torch.bfloat16 and (natural or not finite_inputs(q4, k3, v3, mask)):
        return dense.widened(q4, k3, v3)
    return q4, k3, v3


def _forward(query, key, value, attn_mask, is_causal, scale, enable_gqa, bq, bk, batch, offset,
             sinks) -> tuple[Tensor, _Saved]:
    """``(out (..., L, Ev) in the query's dtype, what the backward needs)``."""
    layout, q4, k3, v3, mask, natural = _operands(query, key, value, attn_mask, enable_gqa, batch)
    L, E, S = query.shape[-2], query.shape[-1], key.shape[-2]
    scale_f = default_scale(scale, E) if E else 1.0
    q4, k3, v3 = _widen_if(q4, k3, v3, mask, natural)
    if q4.shape[0] * q4.shape[1] * L == 0 or S == 0 or v3.shape[-1] == 0:
        out4 = q4.new_zeros(layout.Nb, layout.r, L, v3.shape[-1])
        lse2 = q4.new_full((layout.Nb, layout.r, L), float("-inf"))
    elif natural:
        out4, lse2 = dense.forward_eager(q4, k3, v3, layout, mask, is_causal, scale_f, bq, bk, natural=True,
                                         offset=offset)
    else:
        out4, lse2 = dense.forward(q4, k3, v3, layout, mask, is_causal, scale_f * LOG2E, bq, bk, offset)
        if lse_absorbed(lse2):
            natural = True
            q4, k3, v3 = dense.widened(q4, k3, v3)
            out4, lse2 = dense.forward_eager(q4, k3, v3, layout, mask, is_causal, scale_f, bq, bk, natural=True,
                                             offset=offset)
    saved = _Saved(q4, k3, v3, out4, lse2, mask, layout, natural, E == 0, scale_f,
                   (query.shape, key.shape, value.shape))
    if sinks is not None:  # folded into (out, lse): the backward then computes the sink's gradients too
        _fold_sinks(saved, sinks)
    return saved.out4.reshape(*layout.batch, L, v3.shape[-1]).to(query.dtype), saved


def _fold_sinks(saved: _Saved, sinks: Tensor) -> None:
    saved.sink_rows = _sinks.rows(sinks, saved.layout, saved.out4.shape[2], saved.lse2.dtype)  # (Nb, r, L)
    saved.sink_dtype = sinks.dtype
    if saved.lse2.dim() == saved.out4.dim():  # the pure path's natural (m_i, l_i), kept apart: (Nb, r, L, 2)
        saved.out4, saved.lse2 = _sinks.absorb_pairs(saved.out4, saved.lse2, saved.sink_rows)
    else:
        saved.out4, saved.lse2 = _sinks.absorb(saved.out4, saved.lse2, saved.sink_rows, base2=not saved.natural)


def _backward(saved: _Saved, grad_out: Tensor, is_causal: bool, bq: int, bk: int, offset: int):
    """``(dq, dk, dv, dsinks or None)`` in ``grad_out``'s dtype (dsinks in the sinks')."""
    q4, k3, v3, out4, lse2, layout = saved.q4, saved.k3, saved.v3, saved.out4, saved.lse2, saved.layout
    q_shape, k_shape, v_shape = saved.shapes
    dout4 = grad_out.to(q4.dtype).reshape(out4.shape).contiguous()  # (a compiled graph's may be strided)
    if q4.shape[0] * q4.shape[1] * q4.shape[2] == 0 or k3.shape[1] == 0 or v3.shape[-1] == 0:
        dq4, dk3, dv3 = (torch.zeros_like(t, dtype=out4.dtype) for t in (q4, k3, v3))
    elif saved.natural:
        dq4, dk3, dv3 = dense.backward_eager(*dense.widened(dout4, q4, k3, v3), out4, lse2, layout, saved.mask,
                                             is_causal, saved.scale, bq, bk, natural=True, offset=offset)
    else:
        dq4, dk3, dv3 = dense.backward(dout4, q4, k3, v3, out4, lse2, layout, saved.mask, is_causal, saved.scale,
                                       bq, bk, offset=offset)
    if saved.no_features:  # E == 0: q and k have no elements, so no gradient either
        dq4, dk3 = dq4[..., :0], dk3[..., :0]
    # undo the layout, then sum over whatever broadcasting expanded
    dq = dq4.reshape(*layout.batch, *q_shape[-2:]).sum_to_size(q_shape)
    dk = dk3.reshape(*layout.kv_batch, *k_shape[-2:]).sum_to_size(k_shape)
    dv = dv3.reshape(*layout.kv_batch, *v_shape[-2:]).sum_to_size(v_shape)
    dsinks = None
    if saved.sink_rows is not None:
        per_row = (_sinks.grad_rows_pairs(dout4, out4, lse2, saved.sink_rows) if lse2.dim() == out4.dim()
                   else _sinks.grad_rows(dout4, out4, lse2, saved.sink_rows, base2=not saved.natural))  # (Nb, r, L)
        dsinks = _sinks.to_heads(per_row, layout, q_shape[-3]).to(saved.sink_dtype)  # (H,): H = query.shape[-3]
    dtype = grad_out.dtype
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), dsinks


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale, enable_gqa, bq, bk, batch, offset, sinks=None):
        out, saved = _forward(query, key, value, attn_mask, is_causal, scale, enable_gqa, bq, bk, batch, offset, sinks)
        tensors = (saved.q4, saved.k3, saved.v3, saved.out4, saved.lse2)
        ctx.save_for_backward(*tensors, saved.mask if saved.mask is not None else torch.empty(0))
        ctx.has_mask = saved.mask is not None
        saved.q4 = saved.k3 = saved.v3 = saved.out4 = saved.lse2 = saved.mask = None  # kept by save_for_backward
        ctx.saved, ctx.args = saved, (is_causal, bq, bk, offset)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved
        saved.q4, saved.k3, saved.v3, saved.out4, saved.lse2, mask = ctx.saved_tensors
        saved.mask = mask if ctx.has_mask else None
        dq, dk, dv, dsinks = _backward(saved, grad_out, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks


# ----------------------------------------------------------------------------- the op torch.compile sees
# Under torch.compile, flash_attention is one custom op: its kernels choose routes from the data
# (non-finite inputs, lse absorbed), which Dynamo cannot trace (4 graph breaks on Tensor.item()).
# The op returns, beside the output, what the backward needs that the inputs do not give: the
# kernels' (out4, lse2) and the route (natural units or not); its backward op rebuilds the rest from
# the inputs and runs the eager path's backward (issue 50: before, it ran the forward again).
@torch.library.custom_op("attnlab::flash_attention", mutates_args=())
def _flash_attention_op(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                        scale: Optional[float], enable_gqa: bool, block_q: int, block_k: int, offset: int,
                        sinks: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out (..., L, Ev), out4 (Nb, r, L, Ev), lse2 (Nb, r, L, 2), flags (2,))``: the forward, its
    arguments already checked and tiled; ``flags``: whether it ran in natural units, and whether
    ``lse2`` holds ``(m_i, l_i)`` pairs (else ``lse2[..., 0]`` is the lse); out4 and lse2 in the
    compute dtype (float32; float64 for float64)."""
    batch = validate(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, fn="flash_attention")
    with torch.no_grad():
        out, saved = _forward(query, key, value, attn_mask, is_causal, scale, enable_gqa, block_q, block_k, batch,
                              offset, sinks)
    cdtype = compute_dtype(query.dtype)
    lse2 = saved.lse2 if saved.lse2.dim() == saved.out4.dim() else torch.stack([saved.lse2,
                                                                               torch.zeros_like(saved.lse2)], -1)
    pairs = saved.lse2.dim() == saved.out4.dim()
    return (out.clone(), saved.out4.to(cdtype, copy=True), lse2.to(cdtype),  # no output aliases another
            torch.tensor([saved.natural, pairs]))


@_flash_attention_op.register_fake
def _(query, key, value, attn_mask, is_causal, scale, enable_gqa, block_q, block_k, offset, sinks):
    batch = validate(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, fn="flash_attention")
    layout = Layout(batch, query, key, enable_gqa)
    cdtype, L, Ev = compute_dtype(query.dtype), query.shape[-2], value.shape[-1]
    return (query.new_empty((*batch, L, Ev)), query.new_empty((layout.Nb, layout.r, L, Ev), dtype=cdtype),
            query.new_empty((layout.Nb, layout.r, L, 2), dtype=cdtype), torch.empty(2, dtype=torch.bool))


def _op_setup_context(ctx, inputs, output) -> None:
    query, key, value, attn_mask, *args, sinks = inputs
    _, out4, lse2, flags = output
    ctx.save_for_backward(query, key, value, attn_mask, sinks, out4, lse2, flags)
    ctx.args = args


@torch.library.custom_op("attnlab::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor], is_causal: bool, scale: Optional[float],
                                 enable_gqa: bool, block_q: int, block_k: int, offset: int,
                                 sinks: Optional[Tensor], out4: Tensor, lse2: Tensor,
                                 flags: Tensor) -> list[Tensor]:
    """[dq, dk, dv, dsinks] from the forward op's saved (out4, lse2, flags): the operands rebuilt
    from the inputs as the forward built them, then the eager path's backward (an op too, so that
    AOTAutograd does not trace the kernels' data-dependent choices); dsinks is empty without sinks."""
    batch = validate(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, fn="flash_attention")
    layout, q4, k3, v3, mask, _ = _operands(query, key, value, attn_mask, enable_gqa, batch)
    is_natural, pairs = (bool(f) for f in flags)
    q4, k3, v3 = _widen_if(q4, k3, v3, mask, is_natural)
    E = query.shape[-1]
    lse2 = lse2 if pairs else lse2[..., 0].contiguous()  # (Nb, r, L, 2) or (Nb, r, L)
    saved = _Saved(q4, k3, v3, out4, lse2, mask, layout, is_natural, E == 0, default_scale(scale, E) if E else 1.0,
                   (query.shape, key.shape, value.shape))
    if sinks is not None:
        saved.sink_rows = _sinks.rows(sinks, layout, query.shape[-2], saved.lse2.dtype)
        saved.sink_dtype = sinks.dtype
    dq, dk, dv, dsinks = _backward(saved, grad_out, is_causal, block_q, block_k, offset)
    return [dq, dk, dv, dsinks if dsinks is not None else query.new_empty(0)]


@_flash_attention_backward_op.register_fake
def _(grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa, block_q, block_k, offset, sinks, out4,
      lse2, flags):
    return [torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            torch.empty_like(sinks) if sinks is not None else query.new_empty(0)]


def _op_backward(ctx, grad_out: Tensor, *_unused):
    """(dq, dk, dv, None for the rest, dsinks) through :func:`_flash_attention_backward_op`."""
    query, key, value, attn_mask, sinks, out4, lse2, flags = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.attnlab.flash_attention_backward(grad_out, query, key, value, attn_mask,
                                                                    *ctx.args, sinks, out4, lse2, flags)
    return dq, dk, dv, None, None, None, None, None, None, None, dsinks if sinks is not None else None


_flash_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def native_status() -> _native.NativeStatus:
    """Whether the tiled path runs attnlab's compiled kernels (building them on first call), and why not if not.

    The compiled forward and backward cover float32, bfloat16 (on the route
    ``status.bf16`` names: bf16 GEMMs where the CPU has ``avx512_bf16``, else computed in
    float32; ``ATTNLAB_BF16`` forces one) and float16 (computed in float32) on the CPU, with or
    without a bool or float ``attn_mask`` (the backward also needs as many key/value heads,
    batch included, as torch has threads, or GQA groups); other calls, or
    ``ATTNLAB_NATIVE=0``, run the pure-PyTorch code, which is the readable version.
    """
    return _native.status()
