"""The one layout of attnlab's kernels: the user's ``(..., L, E)`` as ``Nb`` key/value heads.

The leading dims are flattened to ``Nb`` rows of key/value heads, and the ``r = H / Hkv``
query heads that share a key/value head are stacked along the query axis, so every block is
one batched matmul and grouped-query attention never repeats K or V::

    q4 (Nb, r, L, E)    k3 (Nb, S, E)    v3 (Nb, S, Ev)    out (Nb, r, L, Ev)    lse2 (Nb, r, L)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["Layout", "dense_rows"]


class Layout:
    """How the user's broadcast leading dims map onto ``Nb`` key/value heads x ``r`` query heads."""

    def __init__(self, batch: torch.Size, query: Tensor, key: Tensor, enable_gqa: bool) -> None:
        self.batch = tuple(batch)  # output's leading dims (with H when grouped)
        grouped = enable_gqa and len(batch) >= 1 and query.shape[-3] != key.shape[-3]
        if grouped:
            self.H, self.Hkv = batch[-1], key.shape[-3]
            self.kv_batch = (*batch[:-1], self.Hkv)
        else:
            self.H = self.Hkv = 1
            self.kv_batch = self.batch
        self.r = self.H // self.Hkv
        self.Nb = math.prod(self.kv_batch)

    def queries(self, t: Tensor) -> Tensor:
        """``(..., L, E) -> (Nb, r, L, E)`` (a copy only where broadcasting expanded it)."""
        L, E = t.shape[-2:]
        return t.expand(*self.batch, L, E).reshape(self.Nb, self.r, L, E)

    def keys(self, t: Tensor) -> Tensor:
        """``(..., S, E) -> (Nb, S, E)``."""
        S, E = t.shape[-2:]
        return t.expand(*self.kv_batch, S, E).reshape(self.Nb, S, E)

    def mask_tile(self, mask: Tensor, i0: int, i1: int, j0: int, j1: int, L: int, S: int) -> Tensor:
        """The ``[i0:i1, j0:j1]`` tile of the broadcast mask as ``(Nb, r * bq, bk)``."""
        full = mask.expand(*self.batch, L, S)  # a view: nothing is allocated
        tile = full[..., i0:i1, j0:j1]
        return tile.reshape(self.Nb, self.r * (i1 - i0), j1 - j0)


def dense_rows(t: Tensor) -> Tensor:
    """``t`` itself when its rows are dense and do not overlap (views from the ring qualify), else a copy."""
    rows, width = t.shape[-2], t.shape[-1]
    if (t.stride(-1) == 1 or width == 1) and (rows == 1 or t.stride(-2) >= width):
        return t
    return t.clone(memory_format=torch.contiguous_format)
