"""Where each rank's rows sit in the whole sequence: the layouts the context-parallel schemes share
(package-internal; the public names are re-exported by :mod:`attnlab.distributed`).

* ``"contiguous"``: rank r owns positions ``[r L/W, (r+1) L/W)``. With a causal mask the last
  rank does W times the work of the first (the ring).
* ``"zigzag"``: the sequence is cut into 2W chunks and rank r owns chunks r and 2W-1-r, so every
  rank does the same causal work.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LAYOUTS", "check_layout", "positions", "shard_sequence", "gather_sequence"]

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def positions(rank: int, world: int, local_len: int, layout: str = "contiguous") -> Tensor:
    """The absolute sequence positions of rank ``rank``'s ``local_len`` rows."""
    check_layout(layout)
    if layout == "contiguous":
        return torch.arange(rank * local_len, (rank + 1) * local_len)
    c = local_len // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])


def shard_sequence(x: Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = -2) -> Tensor:
    """Rank ``rank``'s slice of a full sequence ``x`` along ``dim`` (default -2, the L of ``(B, H, L, E)``).

    Raises ``ValueError`` when the length does not split evenly: L must be a multiple of
    W (contiguous) or of 2W (zigzag).
    """
    check_layout(layout)
    L = x.shape[dim]
    parts = world if layout == "contiguous" else 2 * world
    if L % parts:
        raise ValueError(f"shard_sequence: a sequence of length {L} does not split evenly into {parts} "
                         f"{'slices' if layout == 'contiguous' else 'zigzag chunks (2 x world)'}; pad it to a "
                         f"multiple of {parts}")
    if not 0 <= rank < world:
        raise ValueError(f"shard_sequence: rank must be in [0, {world}), got {rank}")
    idx = positions(rank, world, L // world, layout).to(x.device)
    return x.index_select(dim, idx)


def gather_sequence(local: Tensor, layout: str = "contiguous", dim: int = -2,
                    group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The full sequence from every rank's slice (an all-gather, then the layout undone)."""
    check_layout(layout)
    world = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    n = local.shape[dim]
    full = torch.cat(parts, dim=dim)
    order = torch.cat([positions(r, world, n, layout) for r in range(world)]).to(local.device)
    return full.index_select(dim, torch.argsort(order))
