"""Ready-made mask_mods and score_mods (FlexAttention's conventions).

A **mask_mod** ``(b, h, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` may see key
``kv_idx`` (True = attend); give it to :func:`attnlab.flex.create_block_mask`. A
**score_mod** ``(score, b, h, q_idx, kv_idx) -> score`` changes a score after the scale;
give it to :func:`attnlab.flex.flex_attention`. The indices are int64 tensors that
broadcast against each other, so the mods are written with tensor operations.

The pictures below show which keys (columns) each query (rows) sees, for 6 positions.

:func:`alibi`, :func:`softcap` and :func:`relative_bias` also carry a :class:`NativeForm`
(attribute ``native_form``): what attnlab's native kernels need to run them without calling
the Python function (package-internal; any other score_mod runs the pure path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from attnlab.kernels.mask_blocks import EMPTY, FULL, PARTIAL

__all__ = ["causal_mask", "sliding_window", "document_mask", "document_mask_from_lengths", "prefix_lm",
           "and_masks", "or_masks", "noop_mask", "alibi", "softcap", "relative_bias", "document_ids"]


# Block kinds from block coordinates (``mask_mod.block_kinds(bq, bk, nq, nk) -> (nq, nk) uint8``):
# what create_block_mask uses instead of calling the mod on every element. EMPTY and FULL must be
# exact over the block's whole index range; PARTIAL means "not known: evaluate the block".


def _ranges(bq: int, bk: int, nq: int, nk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """First and last query of each block row ``(nq, 1)``, first and last key of each block column ``(1, nk)``."""
    q0 = (torch.arange(nq) * bq)[:, None]
    k0 = (torch.arange(nk) * bk)[None, :]
    return q0, q0 + bq - 1, k0, k0 + bk - 1


def _kinds(full: Tensor, empty: Tensor) -> Tensor:
    return torch.where(full, FULL, torch.where(empty, EMPTY, PARTIAL)).to(torch.uint8)


def _band_kinds(lo: float, hi: float):
    """Blocks of ``lo <= q_idx - kv_idx <= hi``: full when every difference in the block is inside."""
    def block_kinds(bq: int, bk: int, nq: int, nk: int) -> Tensor:
        q0, q1, k0, k1 = _ranges(bq, bk, nq, nk)
        d_min, d_max = q0 - k1, q1 - k0
        return _kinds((d_min >= lo) & (d_max <= hi), (d_max < lo) | (d_min > hi))
    return block_kinds


def _combine(parts, every: bool):
    """and (``every``) / or of known block kinds."""
    def block_kinds(bq: int, bk: int, nq: int, nk: int) -> Tensor:
        kinds = [p(bq, bk, nq, nk) for p in parts]
        if every:
            full = torch.stack([k == FULL for k in kinds]).all(0)
            empty = torch.stack([k == EMPTY for k in kinds]).any(0)
        else:
            full = torch.stack([k == FULL for k in kinds]).any(0)
            empty = torch.stack([k == EMPTY for k in kinds]).all(0)
        return _kinds(full, empty & ~full)
    return block_kinds


def noop_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Every query sees every key."""
    return torch.ones_like(q_idx - kv_idx, dtype=torch.bool)


noop_mask.block_kinds = lambda bq, bk, nq, nk: torch.full((nq, nk), FULL, dtype=torch.uint8)


def causal_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Query i sees keys 0..i (top-left)::

        # . . . . .
        # # . . . .
        # # # . . .
        # # # # . .
        # # # # # .
        # # # # # #
    """
    return q_idx >= kv_idx


causal_mask.block_kinds = _band_kinds(0, math.inf)


def sliding_window(window: int):
    """Causal attention to the last ``window`` keys, itself included (Mistral's, Gemma's local
    layers). ``sliding_window(3)``::

        # . . . . .
        # # . . . .
        # # # . . .
        . # # # . .
        . . # # # .
        . . . # # #
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window: window must be a positive int, got {window!r}")

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    mask_mod.__name__ = f"sliding_window_{window}"
    mask_mod.block_kinds = _band_kinds(0, window - 1)
    return mask_mod


def document_ids(lengths: Sequence[int]) -> Tensor:
    """``(sum(lengths),)`` int64: the document of each position of a packed sequence."""
    lengths = torch.as_tensor(list(lengths), dtype=torch.int64)
    if (lengths < 0).any():
        raise ValueError(f"document_ids: lengths must be >= 0, got {lengths.tolist()}")
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def document_mask(doc_ids: Tensor, causal: bool = True):
    """Packed sequences: a query sees only keys of its own document (and, with ``causal``,
    not the future). ``doc_ids`` is ``(S,)`` or ``(B, S)`` int. For documents of 2 and 4::

        # . . . . .
        # # . . . .
        . . # . . .
        . . # # . .
        . . # # # .
        . . # # # #
    """
    doc_ids = torch.as_tensor(doc_ids)
    if doc_ids.dim() not in (1, 2) or doc_ids.is_floating_point():
        raise ValueError(f"document_mask: doc_ids must be an int tensor (S,) or (B, S), got "
                         f"{doc_ids.dtype} {tuple(doc_ids.shape)}")

    def mask_mod(b, h, q_idx, kv_idx):
        ids = doc_ids if doc_ids.dim() == 1 else doc_ids[b.view(-1)[0]]
        same = ids[q_idx] == ids[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    if doc_ids.dim() == 1 and doc_ids.numel() and bool((doc_ids[1:] >= doc_ids[:-1]).all()):
        # packed in order: a block's documents are the range from its first to its last position's
        def same_doc(bq: int, bk: int, nq: int, nk: int) -> Tensor:
            q0, q1, k0, k1 = (t.clamp(max=doc_ids.numel() - 1) for t in _ranges(bq, bk, nq, nk))
            dq0, dq1, dk0, dk1 = doc_ids[q0], doc_ids[q1], doc_ids[k0], doc_ids[k1]
            return _kinds((dq0 == dq1) & (dk0 == dk1) & (dq0 == dk0), (dq1 < dk0) | (dk1 < dq0))
        mask_mod.block_kinds = _combine([same_doc, causal_mask.block_kinds], True) if causal else same_doc
    return mask_mod


def document_mask_from_lengths(lengths: Sequence[int], causal: bool = True):
    """:func:`document_mask` for documents of these lengths, packed in order."""
    return document_mask(document_ids(lengths), causal)


def prefix_lm(prefix: Union[int, Tensor]):
    """Prefix-LM: the first ``prefix`` positions see each other both ways; the rest is causal.
    ``prefix_lm(3)``::

        # # # . . .
        # # # . . .
        # # # . . .
        # # # # . .
        # # # # # .
        # # # # # #
    """
    n = torch.as_tensor(prefix)

    def mask_mod(b, h, q_idx, kv_idx):
        limit = n if n.dim() == 0 else n[b]
        return (kv_idx < limit) | (q_idx >= kv_idx)

    if n.dim() == 0:
        def prefix_keys(bq: int, bk: int, nq: int, nk: int) -> Tensor:
            _, _, k0, k1 = _ranges(bq, bk, nq, nk)
            return _kinds((k1 < n).expand(nq, nk), (k0 >= n).expand(nq, nk))
        mask_mod.block_kinds = _combine([prefix_keys, causal_mask.block_kinds], False)
    return mask_mod


class MaskModError(TypeError, RuntimeError):
    """A combinator got something that is not a mask_mod (a TypeError; also a RuntimeError,
    which torch raises there)."""


def _check_mods(fn: str, mods) -> None:
    for i, m in enumerate(mods):
        if not callable(m):
            raise MaskModError(f"{fn}: every argument must be a callable mask_mod(b, h, q_idx, kv_idx); argument "
                               f"{i} is {type(m).__name__} {m!r}")


def and_masks(*mods):
    """Attend where every mask_mod attends (with none: everywhere, as torch's)."""
    _check_mods("and_masks", mods)

    def mask_mod(b, h, q_idx, kv_idx):
        out = torch.ones((), dtype=torch.bool)
        for m in mods:
            out = out & m(b, h, q_idx, kv_idx)
        return out
    if all(getattr(m, "block_kinds", None) for m in mods):
        mask_mod.block_kinds = _combine([m.block_kinds for m in mods], True) if mods else noop_mask.block_kinds
    return mask_mod


def or_masks(*mods):
    """Attend where any mask_mod attends (with none: nowhere, as torch's)."""
    _check_mods("or_masks", mods)

    def mask_mod(b, h, q_idx, kv_idx):
        out = torch.zeros((), dtype=torch.bool)
        for m in mods:
            out = out | m(b, h, q_idx, kv_idx)
        return out
    if mods and all(getattr(m, "block_kinds", None) for m in mods):
        mask_mod.block_kinds = _combine([m.block_kinds for m in mods], False)
    return mask_mod


@dataclass(frozen=True)
class NativeForm:
    """A score_mod as the native kernels run it (package-internal, for :mod:`attnlab.kernels.block_sparse`):
    ``cap * tanh(s / cap)`` when ``cap > 0``, then ``+ table[h, clamp(q_idx - kv_idx) + n - 1]``
    for a relative ``table (H or 1, 2n - 1)``, or ``+ slopes[h] * (kv_idx - q_idx)`` for ALiBi."""

    cap: float = 0.0
    table: Optional[Tensor] = None
    slopes: Optional[Tensor] = None


def native_form(score_mod) -> Optional[NativeForm]:
    """The score_mod's :class:`NativeForm` when the kernels can run it (None for no score_mod
    gives an empty form), else None."""
    if score_mod is None:
        return NativeForm()
    form = getattr(score_mod, "native_form", None)
    if not isinstance(form, NativeForm):
        return None
    if form.table is not None and not bool(torch.isfinite(form.table).all()):
        return None  # inf/NaN in the table: the pure path propagates them as torch does
    return form


def alibi_slopes(H: int) -> Tensor:
    """ALiBi's per-head slopes ``2^(-8 (h + 1) / H)`` (Press et al. 2022), ``(H,)``."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])


def alibi(H: int):
    """ALiBi: ``score + slope[h] * (kv_idx - q_idx)``, a linear penalty with distance."""
    slopes = alibi_slopes(H)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes.to(score.dtype)[h] * (kv_idx - q_idx).to(score.dtype)

    score_mod.native_form = NativeForm(slopes=slopes)
    return score_mod


def softcap(cap: float):
    """Tanh soft-capping (Gemma 2): ``cap * tanh(score / cap)``, scores stay in ``(-cap, cap)``."""
    if not cap > 0:
        raise ValueError(f"softcap: cap must be > 0, got {cap!r}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    score_mod.native_form = NativeForm(cap=float(cap))
    return score_mod


def relative_bias(table: Tensor):
    """A learned relative-position bias: ``score + table[h, q_idx - kv_idx + (n - 1)]`` with
    ``table (H, 2n - 1)`` (or ``(2n - 1,)`` shared by the heads), ``n`` the longest distance
    plus one. Its gradient flows into ``table`` (``table.requires_grad_()``)."""
    if table.dim() not in (1, 2) or table.shape[-1] % 2 == 0:
        raise ValueError(f"relative_bias: table must be (H, 2n - 1) or (2n - 1,), got {tuple(table.shape)}")
    n = (table.shape[-1] + 1) // 2

    def score_mod(score, b, h, q_idx, kv_idx):
        rel = (q_idx - kv_idx).clamp(-(n - 1), n - 1) + (n - 1)
        bias = table[rel] if table.dim() == 1 else table[h, rel]
        return score + bias.to(score.dtype)

    score_mod.native_form = NativeForm(table=table)
    return score_mod
