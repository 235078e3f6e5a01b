"""The native forwards as differentiable torch ops (issue 50, item 3): ``torch.library``'s
autograd registrations for ``attnlab_native::flash_forward`` and ``block_sparse_forward``, whose
backwards are the native ``flash_backward_`` and ``block_sparse_backward_`` (FlashAttention-2's,
P recomputed from lse); ``decode_forward``'s refuses by name (decoding has no backward). A model
that calls an op itself, or a graph ``torch.compile`` or ``torch.export`` kept it in, trains
through it. (The other ops write into tensors they are given: no autograd applies.)

Legend as in ``csrc/flash.cpp``: ``q4`` (Nb, r, L, E), ``k3`` (Nb, S, E), ``v3`` (Nb, S, Ev);
``out`` (Nb, r, L, Ev) and ``lse2`` (Nb, r, L) are float32, lse2 in base 2 (``scale2`` is the
softmax scale times log2(e)).

A gradient reaching ``lse2`` is honoured: d lse2 / d s'_ij = P_ij / ln 2 for the natural scaled
scores s' = scale * q.k, so it enters the kernel's ``delta`` (D_i = rowsum(dO_i * O_i)) as
``delta - g_lse2 / ln 2``, the form the kernel documents.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["register"]

_LN2 = math.log(2.0)
_registered = False


def _setup_context(ctx, inputs, output) -> None:
    q4, k3, v3, mask, mask_offsets, scale2, is_causal, causal_offset, block_q, block_k, *rest = inputs
    out, lse2 = output
    ctx.save_for_backward(q4, k3, v3, mask, mask_offsets, out, lse2)
    ctx.args = (scale2, is_causal, causal_offset, block_q, block_k, *rest)


def _backward(ctx, grad_out: Tensor, grad_lse2: Tensor):
    """(dq4, dk3, dv3, None for every other input); the gradients in the inputs' dtypes."""
    q4, k3, v3, mask, mask_offsets, out, lse2 = ctx.saved_tensors
    scale2, is_causal, causal_offset, block_q, block_k, *rest = ctx.args
    f32 = torch.float32
    dout = (grad_out if grad_out is not None else torch.zeros_like(out)).to(q4.dtype).contiguous()
    delta = (dout.to(f32) * out).sum(dim=-1)  # D_i = rowsum(dO_i * O_i), (Nb, r, L)
    if grad_lse2 is not None:
        delta = delta - grad_lse2.to(f32) / _LN2
    dq, dk, dv = (torch.zeros_like(t, dtype=f32) for t in (q4, k3, v3))
    torch.ops.attnlab_native.flash_backward_(dout, q4, k3, v3, lse2, delta.contiguous(), dq, dk, dv, mask,
                                             mask_offsets, scale2 * _LN2, is_causal, causal_offset, block_q,
                                             block_k, *rest)
    return (dq.to(q4.dtype), dk.to(k3.dtype), dv.to(v3.dtype)) + (None,) * (7 + len(rest))


def _setup_block_sparse(ctx, inputs, output) -> None:
    q4, k3, v3, row_ptr, cols, bit_idx, bits, plane_of_head, table, row_of_head, cap, scale2, *rest = inputs
    out, lse2 = output
    ctx.save_for_backward(q4, k3, v3, out, lse2, row_ptr, cols, bit_idx, bits, plane_of_head, table, row_of_head)
    ctx.args = (cap, scale2, *rest)


def _backward_block_sparse(ctx, grad_out: Tensor, grad_lse2: Tensor):
    """(dq4, dk3, dv3, None for the plan, dtable (a score mod's bias table), None for the rest)."""
    q4, k3, v3, out, lse2, row_ptr, cols, bit_idx, bits, plane_of_head, table, row_of_head = ctx.saved_tensors
    cap, scale2, block_q, block_k, *rest = ctx.args
    f32 = torch.float32
    dout = (grad_out if grad_out is not None else torch.zeros_like(out)).to(q4.dtype).contiguous()
    delta = (dout.to(f32) * out.to(f32)).sum(dim=-1)  # D_i = rowsum(dO_i * O_i), (Nb, r, L)
    if grad_lse2 is not None:
        delta = delta - grad_lse2.to(f32) / _LN2
    dq, dk, dv = (torch.zeros_like(t, dtype=f32) for t in (q4, k3, v3))
    dtable = torch.zeros_like(table) if table is not None and ctx.needs_input_grad[8] else None
    torch.ops.attnlab_native.block_sparse_backward_(dout, q4, k3, v3, lse2, delta.contiguous(), dq, dk, dv, row_ptr,
                                                    cols, bit_idx, bits, plane_of_head, table, row_of_head, cap,
                                                    dtable, scale2 * _LN2, block_q, block_k, *rest)
    return (dq.to(q4.dtype), dk.to(k3.dtype), dv.to(v3.dtype), None, None, None, None, None, dtable) \
        + (None,) * (5 + len(rest))


def _setup_nothing(ctx, inputs, output) -> None:
    pass


def _decode_has_no_backward(ctx, *grads):
    raise RuntimeError("attnlab_native::decode_forward has no backward: decoding runs without gradients; for "
                       "training use attnlab.tiled.flash_attention (or attnlab.dispatch.attention)")


def register() -> bool:
    """Registers the ops' autograd, once per process (after the library is loaded)."""
    global _registered
    if not _registered:
        torch.library.register_autograd("attnlab_native::flash_forward", _backward, setup_context=_setup_context)
        torch.library.register_autograd("attnlab_native::block_sparse_forward", _backward_block_sparse,
                                        setup_context=_setup_block_sparse)
        torch.library.register_autograd("attnlab_native::decode_forward", _decode_has_no_backward,
                                        setup_context=_setup_nothing)
        _registered = True
    return _registered
