"""Attention masks, materialised as bool matrices (``True`` = this query may attend to this key).

Legend: ``L`` = number of queries (rows), ``S`` = number of keys (columns).
Every mask here follows SDPA's polarity: ``True`` means *take part*.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["causal"]

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
