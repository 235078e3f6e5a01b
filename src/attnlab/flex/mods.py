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

__all__ = ["causal_mask", "sliding_window", "document_mask", "document_mask_from_lengths", "prefix_lm",
           "and_masks", "or_masks", "noop_mask", "alibi", "softcap", "relative_bias", "document_ids"]


def noop_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Every query sees every key."""
    return torch.ones_like(q_idx - kv_idx, dtype=torch.bool)


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
    return mask_mod


def or_masks(*mods):
    """Attend where any mask_mod attends (with none: nowhere, as torch's)."""
    _check_mods("or_masks", mods)

    def mask_mod(b, h, q_idx, kv_idx):
        out = torch.zeros((), dtype=torch.bool)
        for m in mods:
            out = out | m(b, h, q_idx, kv_idx)
        return out
    return mask_mod


@dataclass(frozen=True)
class NativeForm:
    """A score_mod as the native kernels run it (package-internal, for :mod:`attnlab.flex.kernels`):
    ``cap * tanh(s / cap)`` when ``cap > 0``, then ``+ table[h, clamp(q_idx - kv_idx) + n - 1]``
    for a relative ``table (H or 1, 2n - 1)``, or ``+ slopes[h] * (kv_idx - q_idx)`` for ALiBi."""

    cap: float = 0.0
    table: Optional[Tensor] = None
    slopes: Optional[Tensor] = None


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
