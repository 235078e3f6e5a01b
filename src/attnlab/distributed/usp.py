"""USP (unified sequence parallelism): Ulysses inside a group of ranks, the ring across groups.

Ulysses is capped by the heads (``W <= H``) and the ring sends a key/value slice per step whatever
``W``; USP (Fang and Zhao, 2024) puts the ``W = Wr · Wu`` ranks on a 2-D mesh: an all-to-all inside
each Ulysses group of ``Wu`` ranks gives each rank the ring chunk of its group for ``H/Wu`` heads,
and :func:`~attnlab.distributed.ring_attention` runs across the ``Wr`` groups on those heads. The
degenerate meshes are the two schemes exactly: ``(1, W)`` is Ulysses, ``(W, 1)`` the ring.

Sharding (:func:`usp_shard`): the sequence is cut into the ring's ``Wr`` chunks (its layout,
``"contiguous"`` or ``"zigzag"``), and ring chunk ``r`` into ``Wu`` consecutive pieces, one per rank
of the Ulysses group; rank ``(r, u)`` holds piece ``u`` of chunk ``r``.

Legend: B batch, H query heads, Hkv key/value heads, L the whole sequence, Wr x Wu ranks, E/Ev head sizes.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist
from torch import Tensor

from attnlab._validation import validate, validate_sinks
from attnlab.distributed.layout import check_layout, shard_sequence
from attnlab.distributed.ring import ring_attention
from attnlab.distributed.ulysses import heads_to_seq, kv_heads_for, seq_to_heads

__all__ = ["context_parallel_attention", "usp_shard", "usp_groups"]


def usp_shard(x: Tensor, ring_rank: int, ring_world: int, ulysses_rank: int, ulysses_world: int,
              layout: str = "contiguous", dim: int = -2) -> Tensor:
    """Rank ``(ring_rank, ulysses_rank)``'s rows of a whole sequence ``x`` (see the module doc)."""
    chunk = shard_sequence(x, ring_rank, ring_world, layout, dim)
    return shard_sequence(chunk, ulysses_rank, ulysses_world, "contiguous", dim)


def usp_groups(mesh=None, groups: Optional[tuple] = None) -> tuple:
    """``(ulysses_group, ring_group)`` from a 2-D ``DeviceMesh`` (dims named ``"ring"`` and
    ``"ulysses"``, or else taken in the order (ring, ulysses)) or from ``groups`` itself."""
    if (mesh is None) == (groups is None):
        raise ValueError("context_parallel_attention: pass mesh= (a 2-D DeviceMesh, dims (ring, ulysses)) or "
                         "groups=(ulysses_group, ring_group), one of them")
    if groups is not None:
        if not isinstance(groups, (tuple, list)) or len(groups) != 2:
            raise ValueError(f"context_parallel_attention: groups must be (ulysses_group, ring_group), got {groups!r}")
        return tuple(groups)
    if getattr(mesh, "ndim", None) != 2:
        raise ValueError(f"context_parallel_attention: mesh must be a 2-D DeviceMesh (ring, ulysses), got "
                         f"{getattr(mesh, 'ndim', type(mesh).__name__)} dims")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if set(names) == {"ring", "ulysses"}:
        return mesh.get_group("ulysses"), mesh.get_group("ring")
    return mesh.get_group(1), mesh.get_group(0)


def context_parallel_attention(query: Tensor, key: Tensor, value: Tensor, *, mesh=None,
                               groups: Optional[tuple] = None, is_causal: bool = False,
                               scale: Optional[float] = None, layout: str = "contiguous", enable_gqa: bool = False,
                               mask_mod: Optional[Callable] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """Attention over a sequence split across a 2-D mesh of ranks: Ulysses inside, the ring across (USP).

    Args:
        query: this rank's ``(B, H, L/W, E)`` rows (:func:`usp_shard`).
        key: ``(B, Hkv, L/W, E)``, the same positions.
        value: ``(B, Hkv, L/W, Ev)``.
        mesh: a 2-D ``torch.distributed.device_mesh.DeviceMesh`` of shape ``(Wr, Wu)``, dims named
            ``("ring", "ulysses")`` (or in that order). ``H`` must be a multiple of ``Wu``.
        groups: instead of ``mesh``, ``(ulysses_group, ring_group)`` process groups.
        is_causal: as :func:`~attnlab.distributed.ring_attention` (absolute positions).
        scale: as the ring.
        layout: the ring's layout of its ``Wr`` chunks.
        enable_gqa: as the ring.
        mask_mod: as the ring (absolute positions; evaluated with ``b, h`` broadcast).
        sinks: ``(H,)``, the same on every rank; each rank's gradient is its share (sum over all ranks).

    Returns:
        This rank's ``(B, H, L/W, Ev)`` rows of the output, differentiable.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (gloo on CPU)")
    check_layout(layout)
    validate(query, key, value, None, 0.0, is_causal, scale, enable_gqa, fn="context_parallel_attention")
    if query.dim() != 4 or query.shape[-2] != key.shape[-2]:
        raise ValueError(f"context_parallel_attention: query and key must be (B, H, L/W, E) slices of the same "
                         f"positions, got query {tuple(query.shape)} and key {tuple(key.shape)}")
    validate_sinks(sinks, query, "context_parallel_attention")
    ulysses_group, ring_group = usp_groups(mesh, groups)
    wu, u = dist.get_world_size(ulysses_group), dist.get_rank(ulysses_group)
    H, Hkv = query.shape[1], key.shape[1]
    n_kv = kv_heads_for(H, Hkv, wu)
    if n_kv != Hkv:
        key, value = key.repeat_interleave(n_kv // Hkv, dim=1), value.repeat_interleave(n_kv // Hkv, dim=1)
    q = seq_to_heads(query, wu, ulysses_group)  # (B, H/Wu, L/Wr, E): the ring chunk, this rank's heads
    k, v = seq_to_heads(key, wu, ulysses_group), seq_to_heads(value, wu, ulysses_group)
    first = u * (H // wu)
    mine = sinks[first:first + H // wu] if sinks is not None else None
    out = ring_attention(q, k, v, group=ring_group, is_causal=is_causal, scale=scale, layout=layout,
                         enable_gqa=enable_gqa or n_kv != H, mask_mod=mask_mod, sinks=mine)
    return heads_to_seq(out, wu, ulysses_group)
