"""``flex_attention``: attention with a ``score_mod`` and a ``BlockMask``, forward and backward.

Float32 calls on the CPU without a ``score_mod``, or with :mod:`attnlab.flex.mods`' ``alibi``,
``softcap`` or ``relative_bias``, run the native block-sparse kernels
(:mod:`attnlab.kernels.block_sparse`, ``csrc/block_sparse.cpp``). The rest runs the pure-PyTorch path
below, the oracle those kernels are tested against: it visits the query blocks one at a time, and for each the
key blocks its block mask does not mark empty; full blocks get no mask work, partial ones
their stored bits. The softmax is online (running max ``m_i``, sum ``l_i``, accumulator
``acc``, in natural-log units). Without a ``score_mod`` the backward is FlashAttention-2's
(:class:`_MaskedFlex`: each visited tile's ``P`` recomputed from the saved log-sum-exp).
With one, each query block is wrapped in activation checkpointing, so the forward keeps
nothing but its inputs and the backward recomputes one block at a time through autograd:
arbitrary Python ``score_mod`` s work, and gradients reach the tensors they close over (a
relative-position bias table, say). Memory: O(block x S) at a time, never ``L x S``.

Shapes: ``query (B, H, L, E)``, ``key (B, Hkv, S, E)``, ``value (B, Hkv, S, Ev)``; the
output is ``(B, H, L, Ev)`` and the log-sum-exp ``(B, H, L)`` (natural log; -inf for a
row that sees no key, whose output is 0).
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attnlab._validation import default_scale, describe_signature, require_tensors, takes_arguments, validate_sinks
from attnlab.kernels import block_sparse as kernels  # the block-sparse tile source
from attnlab.kernels import native, online
from attnlab.kernels import sinks as sinks_
from attnlab.flex import mods
from attnlab.flex.block_mask import EMPTY, FULL, BlockMask
from attnlab.kernels.mask_blocks import unpack_bits

__all__ = ["flex_attention", "ScoreMod", "AuxRequest", "AuxOutput"]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
DEFAULT_BLOCK = 128  # query and key block when no BlockMask sets them


class AuxRequest(NamedTuple):
    """torch's request for flex_attention's auxiliary outputs (``return_aux=``)."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """torch's auxiliary outputs: each None unless requested. ``lse (B, H, L)`` natural-log
    log-sum-exp; ``max_scores (B, H, L)`` the row max of the scores after the scale, the
    score_mod and the mask (natural units; -inf for a row that sees no key)."""

    lse: Optional[Tensor] = None
    max_scores: Optional[Tensor] = None


# torch's FlexKernelOptions: BLOCK_M / BLOCK_N set the tile without a block mask; the rest tune
# Triton kernels (or are flags attnlab's CPU kernels need not), ignored with a note once each
_TILE_OPTIONS = ("BLOCK_M", "BLOCK_N")
_noted: set = set()


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: Optional[ScoreMod] = None,
                   block_mask: Optional[BlockMask] = None, scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: Optional[dict] = None, *,
                   return_aux: Optional[AuxRequest] = None, sinks: Optional[Tensor] = None):
    """FlexAttention's ``flex_attention``, from scratch, with a backward on the CPU.

    Args:
        query: ``(B, H, L, E)``.
        key: ``(B or 1, Hkv, S, E)``; ``Hkv == H`` unless ``enable_gqa``. A key/value batch of
            1 broadcasts against the query's (as a view; the native kernels copy it when
            ``Hkv > 1``).
        value: ``(B or 1, Hkv, S, Ev)``, the key's batch.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, called on each tile's
            scores ``(B, H, bq, bk)`` with broadcastable int64 indices ``b (B, 1, 1, 1)``,
            ``h (1, H, 1, 1)``, ``q_idx (1, 1, bq, 1)``, ``kv_idx (1, 1, 1, bk)``. Applied
            after the scale, before the mask (as torch's).
        block_mask: from :func:`attnlab.flex.create_block_mask` for ``(Q_LEN, KV_LEN) = (L, S)``;
            None attends everywhere.
        scale: default ``1 / sqrt(E)``.
        enable_gqa: query head ``h`` uses key/value head ``h // (H // Hkv)``.
        return_lse: also return the log-sum-exp ``(B, H, L)`` (natural log); torch's older
            spelling of ``return_aux=AuxRequest(lse=True)``.
        kernel_options: torch's ``FlexKernelOptions``. ``BLOCK_M`` and ``BLOCK_N`` set the query
            and key tile when there is no block mask (a block mask's ``BLOCK_SIZE`` decides
            otherwise); the other keys tune torch's Triton kernels and are ignored, with a
            one-time note each.
        return_aux: :class:`AuxRequest` ``(lse, max_scores)``: return ``(output, AuxOutput)``.
        sinks: attnlab's addition (torch's flex_attention has none): ``(H,)``, a logit per query head
            in each row's softmax denominator, without a value (gpt-oss's attention sinks), with a
            gradient. The lse returned then includes it (``logaddexp(lse, sink)``); max_scores do not.

    Returns:
        ``(B, H, L, Ev)`` in the query's dtype; ``(output, lse)`` with ``return_lse``;
        ``(output, AuxOutput)`` with ``return_aux``.
    """
    _validate(query, key, value, score_mod, block_mask, scale, enable_gqa)
    if return_lse and return_aux is not None:
        raise ValueError("flex_attention: pass return_lse or return_aux, not both (return_lse is torch's older "
                         "spelling of return_aux=AuxRequest(lse=True))")
    if return_aux is not None and not isinstance(return_aux, AuxRequest):
        raise TypeError(f"flex_attention: return_aux must be an attnlab.flex.AuxRequest(lse=..., max_scores=...), "
                        f"got {type(return_aux).__name__}")
    tile = _tile_options(kernel_options)
    B, H, L, E = query.shape
    if key.shape[0] != B:  # a key/value batch of 1: broadcast, as views
        key, value = key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])
    validate_sinks(sinks, query, "flex_attention")
    out, lse = _attention(query, key, value, score_mod, block_mask, scale, tile)
    if sinks is not None:  # folded into (out, lse); the gradients flow back through lse's (every route has one)
        out, lse = _with_sinks(out, lse, sinks)
    if return_aux is not None:
        max_scores = _max_scores(query, key, value, score_mod, block_mask, scale, tile) if return_aux.max_scores \
            else None
        return out, AuxOutput(lse if return_aux.lse else None, max_scores)
    return (out, lse) if return_lse else out


def _tile_options(kernel_options: Optional[dict]) -> tuple[int, int]:
    """``(bq, bk)`` for calls without a block mask, from ``BLOCK_M``/``BLOCK_N``."""
    if kernel_options is None:
        return DEFAULT_BLOCK, DEFAULT_BLOCK
    if not isinstance(kernel_options, dict):
        raise TypeError(f"flex_attention: kernel_options must be a dict (torch's FlexKernelOptions), got "
                        f"{type(kernel_options).__name__}")
    for name in sorted(set(kernel_options) - set(_TILE_OPTIONS) - _noted):
        _noted.add(name)
        warnings.warn(f"flex_attention: kernel_options[{name!r}] tunes torch's Triton kernels; attnlab's CPU kernels "
                      f"ignore it", UserWarning, stacklevel=3)
    sizes = []
    for name in _TILE_OPTIONS:
        v = kernel_options.get(name, DEFAULT_BLOCK)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"flex_attention: kernel_options[{name!r}] must be a positive int, got {v!r}")
        sizes.append(v)
    return sizes[0], sizes[1]


def _attention(query: Tensor, key: Tensor, value: Tensor, score_mod, block_mask: Optional[BlockMask],
               scale: Optional[float], tile: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``(out (B, H, L, Ev), lse (B, H, L))``: the native kernels where they apply, else the pure path."""
    B, H, L, E = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    scale_f = default_scale(scale, E)
    form = mods.native_form(score_mod)
    square = block_mask is not None or tile[0] == tile[1]  # the native plan takes one tile size without a mask
    operand = native.operand_dtype(query.dtype)  # bfloat16 stays bfloat16 on the bf16 route
    q, k, v = query.to(operand), key.to(operand), value.to(operand)
    if form is not None and square and kernels.covers(q, k, v):  # the native block-sparse kernels
        result = kernels.attention(q, k, v, block_mask, scale_f, tile[0], form)
        if result is not None:
            out, lse = result
            return out.to(query.dtype), lse
    dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)  # the pure path: half types in float32 (no copy otherwise)
    if Hkv != H:  # GQA: each query head's key/value head, (B, H, S, E)
        k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    bq, bk = block_mask.BLOCK_SIZE if block_mask is not None else tile
    if score_mod is None:  # masks only: FlashAttention-2's backward, one tile at a time
        plans = [_row_plan(block_mask, i, B, H, min(L, i0 + bq) - i0, S, bk) for i, i0 in enumerate(range(0, L, bq))]
        out, lse = _MaskedFlex.apply(q, k, v, plans, scale_f, bq, bk)
        return out.to(query.dtype), lse
    outs, lses = [], []
    for i, i0 in enumerate(range(0, L, bq)):
        i1 = min(L, i0 + bq)
        plan = _row_plan(block_mask, i, B, H, i1 - i0, S, bk)
        args = (q[:, :, i0:i1], k, v)
        fn = _QueryBlock(score_mod, plan, scale_f, i0, bk)
        if torch.is_grad_enabled() and (any(t.requires_grad for t in (query, key, value))
                                        or _mod_needs_grad(score_mod)):
            o, lse = checkpoint(fn, *args, use_reentrant=False)
        else:
            o, lse = fn(*args)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs, dim=2) if outs else q.new_zeros(B, H, 0, value.shape[-1])
    lse = torch.cat(lses, dim=2) if lses else q.new_zeros(B, H, 0)
    return out.to(query.dtype), lse


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out (B, H, L, Ev), lse (B, H, L))`` with each head's sink in the denominator
    (:func:`attnlab.kernels.sinks.absorb`, natural units, its gradients left to autograd)."""
    return sinks_.absorb(out, lse, sinks.to(lse.dtype)[None, :, None].expand_as(lse), base2=False)


def _max_scores(query: Tensor, key: Tensor, value: Tensor, score_mod, block_mask: Optional[BlockMask],
                scale: Optional[float], tile: tuple[int, int]) -> Tensor:
    """``(B, H, L)`` float32 (float64 for float64 inputs): each row's largest score after the scale,
    the score_mod and the mask, natural units; -inf where a row sees no key. One extra pass over
    the visited tiles, without gradients (torch marks it non-differentiable)."""
    B, H, L, E = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    scale_f = default_scale(scale, E)
    bq, bk = block_mask.BLOCK_SIZE if block_mask is not None else tile
    out = query.new_full((B, H, L), float("-inf"), dtype=dtype)
    with torch.no_grad():
        q, k = query.to(dtype), key.to(dtype)
        if Hkv != H:
            k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, E)
        b_idx, h_idx = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
        for i, i0 in enumerate(range(0, L, bq)):
            i1 = min(L, i0 + bq)
            q_idx = torch.arange(i0, i1).view(1, 1, i1 - i0, 1)
            for j0, j1, tile_mask in _row_plan(block_mask, i, B, H, i1 - i0, S, bk):
                s = (q[:, :, i0:i1] @ k[:, :, j0:j1].transpose(-2, -1)) * scale_f  # (B, H, n, bk)
                if score_mod is not None:
                    s = score_mod(s, b_idx, h_idx, q_idx, torch.arange(j0, j1).view(1, 1, 1, j1 - j0))
                if tile_mask is not None:
                    s = s.masked_fill(~tile_mask, float("-inf"))
                out[:, :, i0:i1] = torch.maximum(out[:, :, i0:i1], s.amax(dim=-1))
    return out


class _MaskedFlex(torch.autograd.Function):
    """Block-sparse attention without a score_mod: the forward keeps only ``(out, lse)``; the
    backward recomputes each visited tile's ``P = exp(s - lse)`` (FlashAttention-2), so no
    autograd graph of the tiles is ever held. Shapes as in :func:`flex_attention`, with K and
    V already at the query's head count."""

    @staticmethod
    def forward(ctx, q, k, v, plans, scale, bq, bk):
        outs, lses = [], []
        with torch.no_grad():
            for i, plan in enumerate(plans):
                i0 = i * bq
                o, lse = _QueryBlock(None, plan, scale, i0, bk)(q[:, :, i0:i0 + bq], k, v)
                outs.append(o)
                lses.append(lse)
        B, H, L = q.shape[:3]
        out = torch.cat(outs, dim=2) if outs else q.new_zeros(B, H, 0, v.shape[-1])
        lse = torch.cat(lses, dim=2) if lses else q.new_zeros(B, H, 0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.scale, ctx.bq = plans, scale, bq
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, bq = ctx.scale, ctx.bq
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dout = dout.to(q.dtype) if dout is not None else torch.zeros_like(out)
        delta = (dout * out).sum(dim=-1, keepdim=True)  # D_i = rowsum(dO_i * O_i), (B, H, L, 1)
        # rows that saw no key have lse = -inf: shifting by +inf makes their P exactly 0
        shift = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse).unsqueeze(-1)
        for i, plan in enumerate(ctx.plans):
            i0 = i * bq
            i1 = min(q.shape[2], i0 + bq)
            qi, doi, di, si = q[:, :, i0:i1], dout[:, :, i0:i1], delta[:, :, i0:i1], shift[:, :, i0:i1]
            dli = dlse[:, :, i0:i1].unsqueeze(-1) if dlse is not None else None
            dqi = torch.zeros_like(qi)
            for j0, j1, tile in plan:
                s = (qi @ k[:, :, j0:j1].transpose(-2, -1)) * scale  # (B, H, n, bk)
                if tile is not None:
                    s = s.masked_fill(~tile, float("-inf"))
                p = torch.exp(s - si)  # P_ij; with dlse (the lse is an output too): d lse / d s = P
                online.backward_tile(p, qi, k[:, :, j0:j1], v[:, :, j0:j1], doi, di, scale, dqi,
                                     dk[:, :, j0:j1], dv[:, :, j0:j1], dli)
            dq[:, :, i0:i1] = dqi
        return dq, dk, dv, None, None, None, None


def _mod_needs_grad(score_mod) -> bool:
    """A score_mod closing over a tensor that requires grad (a bias table) needs checkpointing too."""
    cells = getattr(score_mod, "__closure__", None) or ()
    for c in cells:
        try:
            v = c.cell_contents
        except ValueError:
            continue
        if isinstance(v, Tensor) and v.requires_grad:
            return True
    return False


def _row_plan(block_mask: Optional[BlockMask], i: int, B: int, H: int, rows: int, S: int,
              bk: int) -> list[tuple[int, int, Optional[Tensor]]]:
    """For query block ``i``: ``(j0, j1, tile_mask)`` per key block to visit, where
    ``tile_mask`` is None for full blocks (no mask work) or ``(Bm, Hm, rows, j1 - j0)`` bool."""
    plan = []
    for j, j0 in enumerate(range(0, S, bk)):
        j1 = min(S, j0 + bk)
        if block_mask is None:
            plan.append((j0, j1, None))
            continue
        kinds = block_mask.kinds[:, :, i, j]  # (Bm, Hm)
        if bool((kinds == EMPTY).all()):
            continue  # skipped: nothing in this block is visible to anyone
        if bool((kinds == FULL).all()):
            plan.append((j0, j1, None))
            continue
        Bm, Hm = kinds.shape
        tile = torch.zeros(Bm, Hm, rows, j1 - j0, dtype=torch.bool)
        for b in range(Bm):
            for h in range(Hm):
                kind = int(kinds[b, h])
                if kind == FULL:
                    tile[b, h] = True
                elif kind != EMPTY:
                    tile[b, h] = unpack_bits(block_mask.bits[int(block_mask.partial_index[b, h, i, j])])[:rows, :j1 - j0]
        plan.append((j0, j1, tile))
    return plan


class _QueryBlock:
    """One query block's online softmax over its key blocks (a callable for checkpointing)."""

    def __init__(self, score_mod, plan, scale: float, i0: int, bk: int) -> None:
        self.score_mod, self.plan, self.scale, self.i0, self.bk = score_mod, plan, scale, i0, bk

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, H, n, _ = q.shape
        m_i, l_i, acc = online.start((B, H, n), v.shape[-1], q)  # (B, H, n, 1), (B, H, n, 1), (B, H, n, Ev)
        b_idx = torch.arange(B).view(B, 1, 1, 1)
        h_idx = torch.arange(H).view(1, H, 1, 1)
        q_idx = torch.arange(self.i0, self.i0 + n).view(1, 1, n, 1)
        for j0, j1, tile in self.plan:
            s = (q @ k[:, :, j0:j1].transpose(-2, -1)) * self.scale  # (B, H, n, bk)
            if self.score_mod is not None:
                s = self.score_mod(s, b_idx, h_idx, q_idx, torch.arange(j0, j1).view(1, 1, 1, j1 - j0))
            owned = tile is not None or self.score_mod is None  # else s is the score_mod's own tensor
            if tile is not None:
                s = s.masked_fill(~tile, float("-inf"))
            m_i, l_i, acc = online.update(m_i, l_i, acc, s, v[:, :, j0:j1], torch.exp, inplace=owned)
        return online.finish(m_i, l_i, acc, torch.log)  # natural units; rows with no key: 0 and -inf


def _validate(query, key, value, score_mod, block_mask, scale, enable_gqa) -> None:
    fn = "flex_attention"
    require_tensors(fn, query=query, key=key, value=value)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (B, H, L/S, E), got shape {tuple(t.shape)}")
    if not query.is_floating_point() or key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"{fn}: query, key and value must share one floating dtype, got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    B, H, L, E = query.shape
    if key.shape[0] not in (1, B) or value.shape[0] != key.shape[0]:
        raise ValueError(f"{fn}: the key/value batch must be the query's or 1 (it broadcasts), and the same for "
                         f"both: query {B}, key {key.shape[0]}, value {value.shape[0]}")
    if key.shape[-1] != E:
        raise ValueError(f"{fn}: key's last dim must equal query's E={E}, got key {tuple(key.shape)}")
    if value.shape[2] != key.shape[2] or value.shape[1] != key.shape[1]:
        raise ValueError(f"{fn}: value must match key in heads and length: key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)}")
    Hkv = key.shape[1]
    if Hkv != H and not enable_gqa:
        raise ValueError(f"{fn}: query has {H} heads and key {Hkv}: pass enable_gqa=True for grouped heads")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{fn}: the query heads ({H}) must be a multiple of the key/value heads ({Hkv})")
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"{fn}: score_mod must be callable, got {type(score_mod).__name__}")
    if score_mod is not None and not takes_arguments(score_mod, 5):
        raise TypeError(f"{fn}: score_mod must take five arguments, score_mod(score, b, h, q_idx, kv_idx) -> score "
                        f"(FlexAttention's signature), got {describe_signature(score_mod)}; a mask belongs in "
                        "create_block_mask's mask_mod(b, h, q_idx, kv_idx)")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"{fn}: block_mask must be an attnlab.flex.BlockMask (from attnlab.flex."
                            f"create_block_mask), got {type(block_mask).__name__}")
        if (block_mask.Q_LEN, block_mask.KV_LEN) != (L, key.shape[2]):
            raise ValueError(f"{fn}: block_mask was made for (Q_LEN, KV_LEN) = ({block_mask.Q_LEN}, "
                             f"{block_mask.KV_LEN}), the inputs have ({L}, {key.shape[2]})")
        Bm, Hm = block_mask.kinds.shape[:2]
        if Bm not in (1, B) or Hm not in (1, H):
            raise ValueError(f"{fn}: block_mask was made for B={Bm}, H={Hm}; the inputs have B={B}, H={H}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"{fn}: scale must be None or a real number, got {type(scale).__name__}")
