"""Attention masks, materialised as bool matrices (``True`` = this query may attend to this key).

Legend: ``L`` = number of queries (rows), ``S`` = number of keys (columns).
Every mask here follows SDPA's polarity: ``True`` means *take part*.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["causal", "padding", "sliding_window", "both", "either", "to_additive", "to_bool", "render"]

Align = Literal["top_left", "bottom_right"]


def causal(
    L: int,
    S: int,
    *,
    align: Align = "top_left",
    device: torch.device | str | None = None,
) -> Tensor:
    """Causal mask of shape ``(L, S)``.

    ``align="top_left"`` is what ``is_causal=True`` means in SDPA (and in attnlab):
    query ``i`` sees keys ``0..i``, whatever ``S`` is. ``align="bottom_right"`` lines
    the last query up with the last key, which is what a decoder with a KV cache
    needs: query ``i`` sees keys ``0..i + (S - L)``. The two agree when ``L == S``.

    For ``L = 3, S = 5`` (``#`` = attend, ``.`` = masked)::

        top_left        bottom_right
        # . . . .       # # # . .
        # # . . .       # # # # .
        # # # . .       # # # # #

    For ``L = 4, S = 2``, top_left gives every row at least key 0, while
    bottom_right leaves the first two rows empty (SDPA then outputs 0 there)::

        top_left   bottom_right
        # .        . .
        # #        . .
        # #        # .
        # #        # #

    Args:
        L: number of queries, >= 0.
        S: number of keys, >= 0.
        align: ``"top_left"`` (SDPA's ``is_causal``) or ``"bottom_right"``.
        device: where to build the mask.

    Returns:
        Bool tensor ``(L, S)``.
    """
    for name, n in (("L", L), ("S", S)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"causal: {name} must be an int >= 0, got {n!r}")
    if align == "top_left":
        offset = 0
    elif align == "bottom_right":
        offset = S - L
    else:
        raise ValueError(f"causal: align must be 'top_left' or 'bottom_right', got {align!r}")
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(diagonal=offset)  # (L, S)


def padding(lengths: Tensor, S: int, *, device: torch.device | str | None = None) -> Tensor:
    """Key padding mask of shape ``(B, 1, 1, S)``: key ``j`` of sequence ``b`` is real when
    ``j < lengths[b]``. The two 1s broadcast over heads and queries of ``(B, H, L, S)`` scores.

    ``lengths = [3, 1], S = 4``::

        b=0: # # # .
        b=1: # . . .

    Args:
        lengths: ``(B,)`` integer tensor (or a list of ints), each in ``[0, S]``.
        S: number of keys.
    """
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(f"padding: lengths must be a 1-D integer tensor (B,), got {tuple(lengths.shape)} "
                         f"{lengths.dtype}")
    if isinstance(S, bool) or not isinstance(S, int) or S < 0:
        raise ValueError(f"padding: S must be an int >= 0, got {S!r}")
    if lengths.numel() and (lengths.min() < 0 or lengths.max() > S):
        raise ValueError(f"padding: every length must be in [0, S={S}], got {lengths.tolist()}")
    keep = torch.arange(S, device=lengths.device) < lengths[:, None]  # (B, S)
    return keep[:, None, None, :]  # (B, 1, 1, S)


def sliding_window(
    L: int,
    S: int,
    window: int,
    *,
    align: Align = "top_left",
    device: torch.device | str | None = None,
) -> Tensor:
    """Causal sliding-window mask ``(L, S)``: each query sees its own position and the
    ``window - 1`` keys before it (``i - window < j <= i``, shifted by ``S - L`` with
    ``align="bottom_right"``).

    ``L = S = 5, window = 2``::

        # . . . .
        # # . . .
        . # # . .
        . . # # .
        . . . # #

    Args:
        L, S: numbers of queries and keys.
        window: how many keys each query sees at most, >= 1.
        align: as in :func:`causal`.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window: window must be an int >= 1, got {window!r}")
    near = causal(L, S, align=align, device=device)  # j <= i (+ offset)
    offset = 0 if align == "top_left" else S - L
    return near & ~torch.ones(L, S, dtype=torch.bool, device=device).tril(diagonal=offset - window)  # (L, S)


def both(*masks: Tensor) -> Tensor:
    """Attend only where *every* bool mask attends (logical and, broadcast).

    ``both(causal(3, 3), padding([2], 3))`` for one sequence of length 2::

        # . .
        # # .
        # # .
    """
    _check_bool(masks, "both")
    out = masks[0]
    for m in masks[1:]:
        out = out & m
    return out


def either(*masks: Tensor) -> Tensor:
    """Attend where *any* bool mask attends (logical or, broadcast)."""
    _check_bool(masks, "either")
    out = masks[0]
    for m in masks[1:]:
        out = out | m
    return out


def _check_bool(masks: tuple, fn: str) -> None:
    if not masks:
        raise ValueError(f"{fn}: give at least one mask")
    for i, m in enumerate(masks):
        if not isinstance(m, Tensor) or m.dtype != torch.bool:
            raise TypeError(f"{fn}: mask {i} must be a bool tensor (True = attend), got "
                            f"{m.dtype if isinstance(m, Tensor) else type(m).__name__}; convert float masks with "
                            f"to_bool")


def to_additive(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Bool mask -> additive float mask: 0 where True (attend), ``-inf`` where False.

    ``[True, False]`` -> ``[0., -inf]``. SDPA treats both forms the same way.
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"to_additive: mask must be a bool tensor, got "
                        f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}")
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(~mask, float("-inf"))


def to_bool(mask: Tensor) -> Tensor:
    """Additive float mask -> bool mask: True where the entry is not ``-inf``.

    Finite values (biases) are kept as "attend": the bool form cannot carry them.
    """
    if not isinstance(mask, Tensor) or not mask.is_floating_point():
        raise TypeError(f"to_bool: mask must be a float tensor, got "
                        f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}")
    return mask != float("-inf")


def render(mask: Tensor) -> str:
    """A 2-D bool mask as text, ``#`` = attend, ``.`` = masked, one row per query."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"render: expected a 2-D bool tensor, got {getattr(mask, 'shape', type(mask).__name__)}")
    return "\n".join(" ".join("#" if x else "." for x in row) for row in mask.tolist())
