"""The dense tile source of the kernel layer: FlashAttention's forward and backward over every
key block (up to the causal offset), native or eager inside. Package-internal: the tiled path
(:mod:`attnlab.tiled`), the ring (:mod:`attnlab.distributed`) and the tests use it.

Layout: the leading dims are flattened to ``Nb`` rows of key/value heads, and the ``r = H / Hkv``
query heads that share a key/value head are stacked along the query axis, so every block is one
batched matmul and grouped-query attention never repeats K or V::

    q4 (Nb, r, L, E)    k3 (Nb, S, E)    v3 (Nb, S, Ev)

* :func:`forward` ``-> (out (Nb, r, L, Ev), lse2 (Nb, r, L))``, base-2 lse, -inf on empty rows;
* :func:`forward_into`: continue a saved ``(out, lse2)`` state with more keys, in place (the ring);
* :func:`backward`: FlashAttention-2's backward, adding into given tensors when asked (the ring);
* :func:`forward_eager`, :func:`backward_eager`: the same in pure PyTorch, the readable version
  and the fallback where :func:`attnlab.kernels.native.can_run` says no (:func:`native_ops`).

Causality is an offset: keys ``0..i + offset`` are visible to query ``i`` (0: top-left, SDPA's
``is_causal``; ``S - L``: bottom-right), and tiles past it are skipped.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnlab.kernels import native as _native
from attnlab.kernels import online
from attnlab.kernels.layout import Layout, dense_rows
from attnlab.kernels.numerics import LOG2E, merge_

__all__: list[str] = []  # package-internal

DEFAULT_BLOCK_Q = 256  # the best measured tiles on the 2-core EPYC (BENCHMARKS.md, "tile sizes")
DEFAULT_BLOCK_K = 256


# --------------------------------------------------------------------------- #
# Layout: (..., L, E) <-> (Nb, r, L, E)
# --------------------------------------------------------------------------- #


def _causal_tile(i0: int, i1: int, j0: int, j1: int, r: int, device, offset: int = 0) -> Optional[Tensor]:
    """``(r * bq, bk)`` bool, True = attend (key j <= query i + offset: 0 top-left, S - L
    bottom-right); None when the tile is all True."""
    if j1 - 1 <= i0 + offset:
        return None  # the whole tile is on or below the diagonal
    rows = torch.arange(i0, i1, device=device).repeat(r)  # query positions, r heads stacked
    cols = torch.arange(j0, j1, device=device)
    return cols[None, :] <= rows[:, None] + offset


def _key_blocks(i0: int, i1: int, S: int, bk: int, is_causal: bool, offset: int = 0) -> range:
    """Key blocks that tile ``[i0, i1)`` needs: with is_causal the ones right of query
    ``i1 - 1 + offset`` are skipped."""
    end = min(S, max(0, i1 + offset)) if is_causal else S
    return range(0, end, bk)


# --------------------------------------------------------------------------- #
# Forward and backward
# --------------------------------------------------------------------------- #


def _masked_scores(q_tile: Tensor, kT: Tensor, j0: int, j1: int, mask_tile: Optional[Tensor],
                   causal: Optional[Tensor], mask_scale: float = LOG2E) -> Tensor:
    """Scores of one tile in base 2: ``(Nb, r * bq, bk)`` (q_tile is pre-scaled by scale * log2(e)).

    ``kT`` is K transposed as a view, ``(Nb, E, S)``: no copy of K (a contiguous copy measured
    a few percent faster but doubled the forward's extra memory).
    """
    s = torch.bmm(q_tile, kT[:, :, j0:j1])  # (Nb, r*bq, bk)
    if mask_tile is not None:
        if mask_tile.dtype == torch.bool:
            s.masked_fill_(~mask_tile, float("-inf"))
        else:
            s.add_(mask_tile, alpha=mask_scale)  # the mask is in natural-log units (mask_scale 1: natural mode)
    if causal is not None:
        s.masked_fill_(~causal, float("-inf"))
    return s


def forward(q4: Tensor, k3: Tensor, v3: Tensor, layout: Layout, mask: Optional[Tensor], is_causal: bool,
             scale2: float, bq: int, bk: int, offset: int = 0) -> tuple[Tensor, Tensor]:
    """``(out (Nb, r, L, Ev), lse2 (Nb, r, L))``; lse2 is the base-2 log-sum-exp (-inf on empty rows).

    Runs attnlab's native C++ kernel (:mod:`attnlab.kernels.native`, the same algorithm one cache-sized
    tile per task; the mask read in place) for float32 on the CPU, and
    :func:`forward_eager` otherwise. Both are checked against each other and against torch.
    """
    ops = native_ops(mask, q4, k3, v3)
    if ops is not None:
        m, offsets = _native_mask(mask, layout, q4.shape[2], k3.shape[1])
        return ops.flash_forward(dense_rows(q4), dense_rows(k3), dense_rows(v3), m, offsets, scale2, is_causal,
                                 offset, bq, bk, q4.dtype == torch.bfloat16 and _emulated(), _native.sgemm_route().code)
    return forward_eager(*widened(q4, k3, v3), layout, mask, is_causal, scale2, bq, bk, offset=offset)


def widened(*tensors: Tensor) -> tuple[Tensor, ...]:
    """bf16 operands (the bf16 route) as float32, for the pure code; others as they are."""
    return tuple(t.float() if t.dtype == torch.bfloat16 else t for t in tensors)


def forward_into(q4: Tensor, k3: Tensor, v3: Tensor, out: Tensor, lse2: Tensor, is_causal: bool, scale2: float,
                  bq: int, bk: int) -> None:
    """Continue the online softmax held in ``(out (Nb, r, L, Ev), lse2 (Nb, r, L))`` with more keys, in place.

    ``out`` is normalised and ``lse2`` is base 2 (-inf: no key seen yet), as :func:`forward` returns
    them; afterwards they describe attention over the old keys and ``k3``/``v3`` together. This is
    how the ring merges blocks: the native kernel resumes from ``m_i = lse2, l_i = 1, acc = out``
    with no partial output; the pure path computes one and merges it (:func:`_merge_`).
    """
    ops = native_ops(None, q4, k3, v3)
    if ops is not None and out.dtype == lse2.dtype == torch.float32 and (out.stride(-1) == 1 or out.shape[-1] == 1):
        ops.flash_forward_(dense_rows(q4), dense_rows(k3), dense_rows(v3), out, lse2, None, None, scale2,
                           is_causal, 0, bq, bk)
        return
    o, l = forward_eager(q4, k3, v3, None, None, is_causal, scale2, bq, bk)  # no mask: the layout is unused
    merge_(out, lse2, o, l)


def native_ops(mask: Optional[Tensor], q4: Tensor, k3: Tensor, v3: Tensor):
    """The native ops when they cover this call (:func:`attnlab.kernels.native.can_run`), else None."""
    return _native.ops() if _native.can_run(q4, k3, v3, mask) else None


def _emulated() -> bool:
    """The bf16 route with its GEMMs widened to float32 (``ATTNLAB_BF16=bf16-emulated``)."""
    return _native.bf16_route().name == "bf16-emulated"


def _native_mask(mask: Optional[Tensor], layout: Layout, L: int, S: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The mask as the native kernels read it, without copying it: the broadcast view
    ``(*batch, L, S)`` and, per query head ``p = nb * r + h`` (the order of ``Layout.queries``),
    the element offset of its ``(L, S)`` plane, ``(Nb * r,)`` int64."""
    if mask is None:
        return None, None
    view = mask.expand(*layout.batch, L, S)  # strides 0 where the mask broadcasts
    offsets = torch.zeros((), dtype=torch.int64)
    n = len(layout.batch)
    for d, (size, stride) in enumerate(zip(view.shape[:n], view.stride()[:n])):
        offsets = offsets + torch.arange(size, dtype=torch.int64).view([size if i == d else 1 for i in range(n)]) * stride
    return view, offsets.expand(layout.batch).reshape(-1).contiguous()


def forward_eager(q4: Tensor, k3: Tensor, v3: Tensor, layout: Layout, mask: Optional[Tensor], is_causal: bool,
                   scale2: float, bq: int, bk: int, natural: bool = False, offset: int = 0) -> tuple[Tensor, Tensor]:
    """The forward in pure PyTorch, batched over heads: the readable version, and the fallback.

    ``natural=True``: scores, state and lse in natural-log units (``scale2`` is then the plain
    scale, ``exp`` replaces ``exp2``), for masks that overflow in base 2 (:func:`attnlab.kernels.needs_natural_units`).
    """
    exp, log, mask_scale = (torch.exp, torch.log, 1.0) if natural else (torch.exp2, torch.log2, LOG2E)
    Nb, r, L, _ = q4.shape
    S, Ev = k3.shape[1], v3.shape[2]
    out = q4.new_empty(Nb, r, L, Ev)
    # natural mode keeps (m_i, l_i) apart: next to a max of -3.4e38, log(l_i) would be absorbed
    lse2 = q4.new_empty(Nb, r, L, 2) if natural else q4.new_empty(Nb, r, L)
    kT = k3.transpose(1, 2)  # (Nb, E, S), a view
    for i0 in range(0, L, bq):
        i1 = min(L, i0 + bq)
        n = r * (i1 - i0)
        q_tile = (q4[:, :, i0:i1] * scale2).reshape(Nb, n, -1)  # (Nb, r*bq, E), scale folded in once
        m_i, l_i, acc = online.start((Nb, n), Ev, q4)  # (Nb, n, 1), (Nb, n, 1), (Nb, n, Ev)
        for j0 in _key_blocks(i0, i1, S, bk, is_causal, offset):
            j1 = min(S, j0 + bk)
            mt = layout.mask_tile(mask, i0, i1, j0, j1, L, S) if mask is not None else None
            ct = _causal_tile(i0, i1, j0, j1, r, q4.device, offset) if is_causal else None
            s = _masked_scores(q_tile, kT, j0, j1, mt, ct, mask_scale)  # (Nb, n, bk), ours to overwrite
            m_i, l_i, acc = online.update(m_i, l_i, acc, s, v3[:, j0:j1], exp)
        o, lse = online.finish(m_i, l_i, acc, log)  # (Nb, n, Ev), (Nb, n): 0 and -inf for rows with no key
        out[:, :, i0:i1] = o.reshape(Nb, r, i1 - i0, Ev)
        if natural:
            lse2[:, :, i0:i1] = torch.cat([m_i, l_i], dim=-1).reshape(Nb, r, i1 - i0, 2)
        else:
            lse2[:, :, i0:i1] = lse.reshape(Nb, r, i1 - i0)
    return out, lse2


def backward(dout: Tensor, q4: Tensor, k3: Tensor, v3: Tensor, out: Tensor, lse2: Tensor, layout: Layout,
              mask: Optional[Tensor], is_causal: bool, scale: float, bq: int, bk: int,
              accumulate_into: Optional[tuple[Tensor, Tensor, Tensor]] = None,
              delta: Optional[Tensor] = None, offset: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-2's backward: recompute P one tile at a time from lse; never an (L, S) tensor.

    ``accumulate_into=(dq, dk, dv)`` adds the gradients into those tensors (views work) instead
    of allocating new ones, and ``delta`` (``(Nb, r, L)``, see below) can be passed in when it is
    already known: the ring's backward sums many blocks this way.

    Runs the native kernel (one task per key/value head and chunk of its keys: with fewer
    key/value heads than threads the keys are cut so every thread works) for float32 and
    the bf16 route on the CPU, and :func:`backward_eager` otherwise.
    """
    ops = native_ops(mask, q4, k3, v3)
    f32 = torch.float32
    if ops is not None and dout.dtype == q4.dtype and out.dtype == f32:
        if accumulate_into is None:  # float32 gradients, on the bf16 route too
            dq, dk, dv = (torch.zeros_like(t, dtype=f32) for t in (q4, k3, v3))
        else:
            dq, dk, dv = accumulate_into
        if all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (dq, dk, dv)):
            if delta is None:
                delta = (dout * out).sum(dim=-1, dtype=f32)  # D_i = rowsum(dO_i * O_i), (Nb, r, L)
            m, offsets = _native_mask(mask, layout, q4.shape[2], k3.shape[1])
            ops.flash_backward_(dense_rows(dout), dense_rows(q4), dense_rows(k3), dense_rows(v3), lse2, delta,
                                dq, dk, dv, m, offsets, scale, is_causal, offset, bq, bk,
                                q4.dtype == torch.bfloat16 and _emulated(), _native.sgemm_route().code)
            return dq, dk, dv
        accumulate_into = (dq, dk, dv)
    return backward_eager(*widened(dout, q4, k3, v3), out, lse2, layout, mask, is_causal, scale, bq, bk,
                           accumulate_into, delta, offset=offset)


def backward_eager(dout: Tensor, q4: Tensor, k3: Tensor, v3: Tensor, out: Tensor, lse2: Tensor, layout: Layout,
                    mask: Optional[Tensor], is_causal: bool, scale: float, bq: int, bk: int,
                    accumulate_into: Optional[tuple[Tensor, Tensor, Tensor]] = None,
                    delta: Optional[Tensor] = None, natural: bool = False,
                    offset: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The backward in pure PyTorch, batched over heads: the readable version, and the fallback.

    ``natural=True``: ``lse2`` holds ``(m_i, l_i)`` in natural-log units, as
    :func:`forward_eager` saved them then, and ``P = exp(s - m_i) / l_i``.
    """
    Nb, r, L, E = q4.shape
    S = k3.shape[1]
    exp, mask_scale = (torch.exp, 1.0) if natural else (torch.exp2, LOG2E)
    scale2 = scale if natural else scale * LOG2E
    kT = k3.transpose(1, 2)  # (Nb, E, S), a view
    if accumulate_into is None:
        dq, dk, dv = torch.zeros_like(q4), torch.zeros_like(k3), torch.zeros_like(v3)
    else:
        dq, dk, dv = accumulate_into
    # D_i = rowsum(dO_i * O_i): the softmax-Jacobian term, one number per query row
    if delta is None:
        delta = (dout * out).sum(dim=-1)  # (Nb, r, L)
    # empty rows have lse = -inf: shifting by +inf makes their P exactly 0
    if natural:
        m_all, l_all = lse2[..., 0], lse2[..., 1]
        lse2 = torch.where(m_all == float("-inf"), torch.full_like(m_all, float("inf")), m_all)
        inv_l = 1.0 / torch.where(l_all == 0, torch.ones_like(l_all), l_all)  # (Nb, r, L)
    else:
        lse2 = torch.where(lse2 == float("-inf"), torch.full_like(lse2, float("inf")), lse2)
    for i0 in range(0, L, bq):
        i1 = min(L, i0 + bq)
        n = r * (i1 - i0)
        q_tile = q4[:, :, i0:i1].reshape(Nb, n, E)
        q_scaled = q_tile * scale2
        do_tile = dout[:, :, i0:i1].reshape(Nb, n, -1)  # (Nb, n, Ev)
        lse_tile = lse2[:, :, i0:i1].reshape(Nb, n, 1)
        inv_l_tile = inv_l[:, :, i0:i1].reshape(Nb, n, 1) if natural else None
        d_tile = delta[:, :, i0:i1].reshape(Nb, n, 1)
        dq_tile = torch.zeros_like(q_tile)
        for j0 in _key_blocks(i0, i1, S, bk, is_causal, offset):
            j1 = min(S, j0 + bk)
            mt = layout.mask_tile(mask, i0, i1, j0, j1, L, S) if mask is not None else None
            ct = _causal_tile(i0, i1, j0, j1, r, q4.device, offset) if is_causal else None
            p = exp(_masked_scores(q_scaled, kT, j0, j1, mt, ct, mask_scale).sub_(lse_tile))  # P_ij (Nb, n, bk)
            if natural:
                p.mul_(inv_l_tile)  # P_ij = exp(s - m_i) / l_i
            online.backward_tile(p, q_tile, k3[:, j0:j1], v3[:, j0:j1], do_tile, d_tile, scale,
                                 dq_tile, dk[:, j0:j1], dv[:, j0:j1])
        dq[:, :, i0:i1] += dq_tile.reshape(Nb, r, i1 - i0, E)
    return dq, dk, dv
