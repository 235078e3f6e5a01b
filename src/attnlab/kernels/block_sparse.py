"""The block-sparse tile source of the kernel layer: the native kernels behind
:func:`attnlab.flex.flex_attention` and the ring's masked steps (package-internal).

``csrc/block_sparse.cpp`` runs attnlab's online-softmax forward and FlashAttention-2 backward
over the blocks a :class:`~attnlab.flex.BlockMask` keeps: empty blocks are never visited, full
blocks get no mask work, partial blocks read their packed bits. Grouped heads are not
repeated: the ``r = H / Hkv`` query heads of a key/value head share its K and V, as in
:mod:`attnlab.tiled`::

    q4 (Nb, r, L, E)    k3 (Nb, S, E)    v3 (Nb, S, Ev)      Nb = B * Hkv

:func:`attention` is used when the kernels cover a call (:func:`covers`, that is
:func:`attnlab.kernels.native.can_run`) and its ``score_mod`` is None or one of
:mod:`attnlab.flex.mods`' ``alibi``, ``softcap``, ``relative_bias`` (their
:class:`~attnlab.flex.mods.NativeForm`, which flex reads off the score_mod; the relative table
gets its gradient); anything else runs the pure path of :mod:`attnlab.flex.attention`, which is
also the oracle these kernels are tested against. The block mask and the form are read by their
attributes only: the kernel layer imports nothing of flex.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from attnlab.kernels import native as _native
from attnlab.kernels import online
from attnlab.kernels.layout import dense_rows
from attnlab.kernels.mask_blocks import MaskBlocks
from attnlab.kernels.numerics import LOG2E, lse_absorbed

if TYPE_CHECKING:  # read by attribute only: the kernel layer does not import flex
    from attnlab.flex.block_mask import BlockMask
    from attnlab.flex.mods import NativeForm

__all__: list[str] = []  # package-internal

LN2 = math.log(2.0)


def covers(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """The native kernels can run this call (:func:`attnlab.kernels.native.can_run`)."""
    return _native.can_run(q, k, v)


def _bias_table(form: "Optional[NativeForm]", H: int, L: int, S: int) -> Optional[Tensor]:
    """``(rows, 2n - 1)`` float32 bias indexed by ``q_idx - kv_idx + n - 1``: the relative table
    itself (differentiable), or ALiBi's ``-slope_h * d`` for every distance ``d`` (n = max(L, S))."""
    if form is None:
        return None
    if form.table is not None:
        t = form.table.to(torch.float32)
        return (t.unsqueeze(0) if t.dim() == 1 else t).contiguous()
    if form.slopes is not None:
        n = max(L, S, 1)
        d = torch.arange(-(n - 1), n, dtype=torch.float32)  # q_idx - kv_idx
        return (-form.slopes.to(torch.float32).view(-1, 1) * d).contiguous()  # (H, 2n - 1)
    return None


def _full_rows(nq: int, nk: int) -> tuple[Tensor, Tensor, Tensor]:
    """Compressed rows of a mask with every block full (no block_mask given)."""
    row_ptr = torch.arange(nq + 1, dtype=torch.int64) * nk
    cols = torch.arange(nk, dtype=torch.int64).repeat(nq)
    return row_ptr, cols, torch.full((nq * nk,), -1, dtype=torch.int64)


def _plan(block_mask: "Optional[BlockMask]", B: int, H: int, L: int, S: int,
          block: int) -> tuple[tuple[Tensor, ...], int, int]:
    """``(row_ptr, cols, bit_idx, bits, plane_of_head), bq, bk`` for the kernels.

    ``plane_of_head (B * H,)``: the mask plane of query head ``b * H + h``, which is also head
    ``nb * r + g`` of the ``(Nb, r)`` layout (``nb = b * Hkv + h // r``, ``g = h % r``).
    """
    if block_mask is None:
        bq = bk = block
        rows = _full_rows(math.ceil(L / bq), math.ceil(S / bk))
        bits = torch.zeros(0, bq, -(-bk // 8), dtype=torch.uint8)
        planes = torch.zeros(B * H, dtype=torch.int64)
        return (*rows, bits, planes), bq, bk
    bq, bk = block_mask.BLOCK_SIZE
    Bm, Hm = block_mask.kinds.shape[:2]
    b = torch.arange(B, dtype=torch.int64).view(B, 1) * (Bm > 1)  # (B, 1); 0 where the mask broadcasts
    h = torch.arange(H, dtype=torch.int64).view(1, H) * (Hm > 1)  # (1, H)
    planes = (b * Hm + h).reshape(-1).contiguous()  # (B * H,)
    return (*block_mask.compressed_rows(), block_mask.bits.contiguous(), planes), bq, bk


def _group_plan(blocks: "MaskBlocks", B: int, H: int, heads: slice, r: int) -> tuple[tuple[Tensor, ...], int, int]:
    """The plan of ``blocks`` for the query heads of key/value rows ``heads`` of ``(Nb, r)``
    (query heads ``heads.start * r .. heads.stop * r`` in the order ``b * H + h``)."""
    plan, bq, bk = _plan(blocks, B, H, blocks.Q_LEN, blocks.KV_LEN, blocks.BLOCK_SIZE[0])
    row_ptr, cols, bit_idx, bits, planes = plan
    return (row_ptr, cols, bit_idx, bits, planes[heads.start * r:heads.stop * r].contiguous()), bq, bk


def forward_rows(q4: Tensor, k3: Tensor, v3: Tensor, blocks: "MaskBlocks", heads: slice, B: int, H: int,
                 scale: float, native: bool) -> Optional[tuple[Tensor, Tensor]]:
    """One (query chunk, key chunk) pair under ``blocks`` (the ring's masked step):
    ``(out (Nb_g, r, L, Ev), lse2 (Nb_g, r, L))``, base 2, for the caller to merge
    (:func:`attnlab.kernels.merge_`), or None when no block is visible.

    ``q4 (Nb_g, r, L, E)``, ``k3 (Nb_g, S, E)``, ``v3 (Nb_g, S, Ev)`` are rows ``heads`` of
    ``(Nb, r)`` for a ``(B, H)`` call; ``blocks`` broadcasts over batch and heads. ``native``:
    the native kernels (:func:`covers`), else :func:`forward_eager` on the element mask.
    """
    if blocks.is_empty():
        return None
    if native:
        plan, bq, bk = _group_plan(blocks, B, H, heads, q4.shape[1])
        return _native.ops().block_sparse_forward(q4, k3, v3, *plan, None, None, 0.0, scale * LOG2E, bq, bk)
    return forward_eager(q4, k3, v3, blocks.element_mask()[0, 0], scale)


def backward_rows_(dout4: Tensor, q4: Tensor, k3: Tensor, v3: Tensor, lse2: Tensor, delta: Tensor, dq: Tensor,
                   dk: Tensor, dv: Tensor, blocks: "MaskBlocks", heads: slice, B: int, H: int, scale: float,
                   native: bool) -> None:
    """FlashAttention-2's backward of :func:`forward_rows` with the *final* ``lse2`` and
    ``delta = rowsum(dO * O)`` (both ``(Nb_g, r, L)``), adding into ``dq (Nb_g, r, L, E)``,
    ``dk (Nb_g, S, E)``, ``dv (Nb_g, S, Ev)``."""
    if blocks.is_empty():
        return
    if native:
        plan, bq, bk = _group_plan(blocks, B, H, heads, q4.shape[1])
        _native.ops().block_sparse_backward_(dense_rows(dout4), q4, k3, v3, lse2, dense_rows(delta), dq, dk, dv,
                                             *plan, None, None, 0.0, None, scale, bq, bk)
    else:
        backward_eager(dout4, q4, k3, v3, lse2, delta, dq, dk, dv, blocks.element_mask()[0, 0], scale)


def forward_eager(q4: Tensor, k3: Tensor, v3: Tensor, mask: Tensor, scale: float,
                  block: int = 256) -> tuple[Tensor, Tensor]:
    """``(out (Nb, r, L, Ev), lse2 (Nb, r, L))`` of ``q4`` against ``k3, v3`` under the bool
    ``mask (L, S)``, through :mod:`attnlab.kernels.online` one key block at a time (base 2):
    the eager form of the native forward, for float64 and non-finite inputs."""
    Nb, r, L, E = q4.shape
    S, Ev = k3.shape[1], v3.shape[2]
    q = (q4 * (scale * LOG2E)).reshape(Nb, r * L, E)  # (Nb, r*L, E): the group's rows
    rows = mask.repeat(r, 1)  # (r*L, S): the same mask for every head of the group
    m_i, l_i, acc = online.start((Nb, r * L), Ev, q)
    for j0 in range(0, S, block):
        j1 = min(S, j0 + block)
        s = torch.bmm(q, k3[:, j0:j1].transpose(1, 2)).masked_fill_(~rows[:, j0:j1], float("-inf"))
        m_i, l_i, acc = online.update(m_i, l_i, acc, s, v3[:, j0:j1])
    o, lse2 = online.finish(m_i, l_i, acc)
    return o.reshape(Nb, r, L, Ev), lse2.reshape(Nb, r, L)


def backward_eager(dout4, q4, k3, v3, lse2, delta, dq, dk, dv, mask: Tensor, scale: float, block: int = 256) -> None:
    """FlashAttention-2's backward of :func:`forward_eager` with the final ``lse2`` and ``delta``,
    adding into ``dq (Nb, r, L, E)``, ``dk (Nb, S, E)``, ``dv (Nb, S, Ev)``."""
    Nb, r, L, E = q4.shape
    S = k3.shape[1]
    q = q4.reshape(Nb, r * L, E)
    q2 = q * (scale * LOG2E)
    do = dout4.reshape(Nb, r * L, -1)
    d = delta.reshape(Nb, r * L, 1)
    shift = torch.where(torch.isneginf(lse2), torch.full_like(lse2, float("inf")), lse2).reshape(Nb, r * L, 1)
    rows = mask.repeat(r, 1)
    dq_rows = torch.zeros_like(q)
    for j0 in range(0, S, block):
        j1 = min(S, j0 + block)
        s = torch.bmm(q2, k3[:, j0:j1].transpose(1, 2)).masked_fill_(~rows[:, j0:j1], float("-inf"))
        p = torch.exp2(s - shift)  # P_ij from the final lse
        online.backward_tile(p, q, k3[:, j0:j1], v3[:, j0:j1], do, d, scale, dq_rows, dk[:, j0:j1], dv[:, j0:j1])
    dq += dq_rows.reshape(dq.shape)


def _last_dim_dense(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


class _BlockSparse(torch.autograd.Function):
    """Native forward and backward. Inputs ``q (B, H, L, E)``, ``k (B, Hkv, S, E)``,
    ``v (B, Hkv, S, Ev)``; outputs ``out (B, H, L, Ev)`` and ``lse2 (B, H, L)`` (base 2)."""

    @staticmethod
    def forward(ctx, q, k, v, table, plan, mod, bq, bk, scale):
        B, H, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[-1]
        r = H // Hkv
        q4 = _last_dim_dense(q.reshape(B * Hkv, r, L, E))  # (Nb, r, L, E): heads h = g * r + j share K, V of g
        k3 = _last_dim_dense(k.reshape(B * Hkv, S, E))  # (Nb, S, E)
        v3 = _last_dim_dense(v.reshape(B * Hkv, S, Ev))  # (Nb, S, Ev)
        row_of_head, cap = mod
        emulated = q4.dtype == torch.bfloat16 and _native.bf16_route().name == "bf16-emulated"
        out4, lse2 = _native.ops().block_sparse_forward(q4, k3, v3, *plan, table, row_of_head, cap,
                                                        scale * LOG2E, bq, bk, emulated, _native.sgemm_route().code)
        ctx.emulated, ctx.dtypes = emulated, (q.dtype, k.dtype, v.dtype)
        ctx.save_for_backward(q4, k3, v3, out4, lse2, table, row_of_head, *plan)
        ctx.shapes, ctx.blocks, ctx.scale, ctx.cap = (q.shape, k.shape, v.shape), (bq, bk), scale, cap
        return out4.view(B, H, L, Ev), lse2.view(B, H, L)

    @staticmethod
    def backward(ctx, dout, dlse2):
        q4, k3, v3, out4, lse2, table, row_of_head, *plan = ctx.saved_tensors
        q_shape, k_shape, v_shape = ctx.shapes
        dout4 = torch.zeros_like(out4) if dout is None else dout.reshape(out4.shape).contiguous()
        delta = (dout4 * out4).sum(dim=-1)  # D_i = rowsum(dO_i * O_i), (Nb, r, L)
        if dlse2 is not None:  # lse2 = lse / ln 2 and d lse / d s = P: fold it into D_i
            delta = delta - dlse2.reshape(delta.shape) * LOG2E
        # float32 gradients; dO in the operands' dtype (bf16 on the bf16 route, for its GEMMs)
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q4, k3, v3))
        dtable = torch.zeros_like(table) if table is not None and ctx.needs_input_grad[3] else None
        _native.ops().block_sparse_backward_(dout4.to(q4.dtype), q4, k3, v3, lse2, delta.contiguous(), dq, dk, dv,
                                             *plan, table, row_of_head, ctx.cap, dtable, ctx.scale, *ctx.blocks,
                                             ctx.emulated, _native.sgemm_route().code)
        dq_t, dk_t, dv_t = ctx.dtypes
        return (dq.view(q_shape).to(dq_t), dk.view(k_shape).to(dk_t), dv.view(v_shape).to(dv_t), dtable, None, None,
                None, None, None)


def attention(q: Tensor, k: Tensor, v: Tensor, block_mask: "Optional[BlockMask]", scale: float,
              block: int, form: "Optional[NativeForm]" = None) -> Optional[tuple[Tensor, Tensor]]:
    """``(out (B, H, L, Ev), lse (B, H, L))`` (natural-log lse) from the native kernels, or None
    when a row's log-sum-exp is too large for their base-2 arithmetic
    (:func:`attnlab.kernels.lse_absorbed`): the caller then runs the pure path.

    ``q (B, H, L, E)``, ``k (B, Hkv, S, E)``, ``v (B, Hkv, S, Ev)``, float32; ``block`` is the
    tile size used when ``block_mask`` is None (every block full); ``form`` the score mod
    (:func:`native_form`).
    """
    B, H, L, _ = q.shape
    S = k.shape[2]
    plan, bq, bk = _plan(block_mask, B, H, L, S, block)
    table = _bias_table(form, H, L, S)
    row_of_head = None
    if table is not None:  # query head b * H + h reads row h, or row 0 of a shared table
        if table.shape[0] not in (1, H):
            raise ValueError(f"flex_attention: the score_mod's bias table has {table.shape[0]} rows; "
                             f"expected 1 or one per query head (H={H})")
        heads = torch.arange(H, dtype=torch.int64) * (table.shape[0] > 1)
        row_of_head = heads.repeat(B).contiguous()  # (B * H,)
    cap = form.cap if form is not None else 0.0
    out, lse2 = _BlockSparse.apply(q, k, v, table, plan, (row_of_head, cap), bq, bk, scale)
    if lse_absorbed(lse2.detach()):
        return None
    return out, lse2 * LN2
