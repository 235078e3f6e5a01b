"""Ulysses (DeepSpeed-Ulysses) context parallelism on torch.distributed: heads scattered, sequence gathered.

Each of W ranks holds a slice of the sequence, ``(B, H, L/W, E)``, as for the ring. An all-to-all
turns that into ``(B, H/W, L, E)``: every rank gets the *whole* sequence of its ``H/W`` heads, runs
attnlab's kernels on it (heads are independent, so nothing else is exchanged), and a second
all-to-all turns the output back into the rank's sequence slice ``(B, H, L/W, Ev)``. The backward
is the same two exchanges transposed (:class:`_AllToAll`; gloo has ``all_to_all`` since torch 2.12,
pytorch PR #165435).

Per layer a rank sends about ``3 (W-1)/W`` of its q, k, v slice and ``(W-1)/W`` of its output
slice, whatever W: the volume per rank falls as ``1/W`` of the sequence, while the ring's stays one
key/value slice per step for W steps. Ulysses is capped by the heads (``H % W == 0``).

Grouped heads: key/value heads are scattered with their query heads when ``Hkv % W == 0``;
otherwise each is repeated (``repeat_interleave``) to the smallest count that ``W`` divides and
that divides ``H``, as DeepSpeed does, and the repeats' gradients are summed back by autograd.

Legend: B batch, H query heads, Hkv key/value heads, L the whole sequence, W ranks, E/Ev head sizes.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from attnlab._validation import validate, validate_sinks
from attnlab.distributed.layout import check_layout, positions

__all__ = ["ulysses_attention", "kv_heads_for"]


def kv_heads_for(H: int, Hkv: int, world: int) -> int:
    """The key/value head count Ulysses scatters: ``Hkv`` when ``world`` divides it, else the
    smallest multiple of ``Hkv`` that ``world`` divides and that divides ``H`` (each head then
    repeated in place). Raises ``ValueError`` when there is none (``H % world != 0``)."""
    if H % world:
        raise ValueError(f"ulysses_attention: the {H} query heads do not split over {world} ranks (H % W != 0); "
                         f"Ulysses scatters whole heads: use a world size that divides H, or the ring")
    n = Hkv
    while n % world or H % n:
        n += Hkv
        if n > H:  # never: H itself is a multiple of Hkv and of world
            raise ValueError(f"ulysses_attention: no key/value head count for H={H}, Hkv={Hkv}, W={world}")
    return n


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all`` with its transpose as the backward. torch's own differentiable one
    (``torch.distributed.nn.functional.all_to_all``) falls back on gloo to ``scatter`` with a group's
    rank where a global one is due, and fails on any subgroup (USP's Ulysses groups), torch 2.13."""

    @staticmethod
    def forward(ctx, group, *parts: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        out = [torch.empty_like(p) for p in parts]
        dist.all_to_all(out, [p.contiguous() for p in parts], group=group)  # part j to rank j, out[j] from it
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        back = [torch.empty_like(g) for g in grads]
        dist.all_to_all(back, [g.contiguous() for g in grads], group=ctx.group)  # each gradient to its source
        return (None, *back)


def seq_to_heads(x: Tensor, world: int, group) -> Tensor:
    """(B, N, L/W, F) sequence slice -> (B, N/W, L, F) all of the sequence for this rank's N/W heads,
    the sequence in the order of the ranks' slices."""
    B, N, Lw, F = x.shape
    parts = list(x.reshape(B, world, N // world, Lw, F).unbind(1))  # W x (B, N/W, L/W, F): heads for rank j
    got = _AllToAll.apply(group, *parts)  # from rank j: its slice
    return torch.cat(got, dim=2)  # (B, N/W, W * L/W, F)


def heads_to_seq(y: Tensor, world: int, group) -> Tensor:
    """The transpose of :func:`seq_to_heads`: (B, N/W, L, F) -> (B, N, L/W, F)."""
    B, n, L, F = y.shape
    parts = y.reshape(B, n, world, L // world, F).unbind(2)  # slice j for rank j
    got = _AllToAll.apply(group, *parts)  # rank j's heads, my slice
    return torch.cat(got, dim=1)  # (B, W * N/W, L/W, F)


def _natural(x: Tensor, world: int, layout: str) -> tuple[Tensor, Optional[Tensor]]:
    """The gathered sequence (in rank order) put in position order; and the permutation to undo it."""
    if layout == "contiguous":
        return x, None
    order = torch.cat([positions(r, world, x.shape[2] // world, layout) for r in range(world)]).to(x.device)
    inverse = torch.argsort(order)
    return x.index_select(2, inverse), order


def ulysses_attention(query: Tensor, key: Tensor, value: Tensor, *, group: Optional[dist.ProcessGroup] = None,
                      is_causal: bool = False, scale: Optional[float] = None, layout: str = "contiguous",
                      enable_gqa: bool = False, mask_mod: Optional[Callable] = None,
                      sinks: Optional[Tensor] = None) -> Tensor:
    """Attention over a sequence split across the ranks of ``group``, by heads (DeepSpeed-Ulysses).

    Takes every argument :func:`attnlab.distributed.ring_attention` takes, with the same meanings,
    so the two are interchangeable on the same shards.

    Args:
        query: this rank's ``(B, H, L/W, E)`` slice (:func:`attnlab.distributed.shard_sequence`).
        key: ``(B, Hkv, L/W, E)``, the same positions.
        value: ``(B, Hkv, L/W, Ev)``.
        group: the process group (gloo on CPU); must be initialised. ``H`` must be a multiple of
            its size ``W``.
        is_causal: causal over the whole sequence (absolute positions).
        scale: default ``1 / sqrt(E)``.
        layout: ``"contiguous"`` or ``"zigzag"``, as sharded.
        enable_gqa: grouped-query heads, as in SDPA.
        mask_mod: a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over absolute positions and
            *global* head indices (packed documents, sliding windows), instead of ``is_causal``.
        sinks: ``(H,)``, a logit per query head, the same on every rank. Its gradient on each rank
            is that rank's heads' share (the other heads' entries are 0): sum it over the group,
            as for any parameter replicated across a sequence split (the ring's rule too).

    Returns:
        This rank's ``(B, H, L/W, Ev)`` slice of the output, differentiable.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ulysses_attention: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (gloo on CPU)")
    check_layout(layout)
    validate(query, key, value, None, 0.0, is_causal, scale, enable_gqa, fn="ulysses_attention")
    if query.dim() != 4:
        raise ValueError(f"ulysses_attention: query must be (B, H, L/W, E), got {tuple(query.shape)}")
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(f"ulysses_attention: every rank must hold as many query as key rows (self-attention), got "
                         f"query {tuple(query.shape)} and key {tuple(key.shape)}")
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"ulysses_attention: mask_mod must be a callable mask_mod(b, h, q_idx, kv_idx), got "
                        f"{type(mask_mod).__name__}")
    if mask_mod is not None and is_causal:
        raise ValueError("ulysses_attention: pass either is_causal=True or a mask_mod (fold causality into it, e.g. "
                         "attnlab.flex.and_masks(attnlab.flex.causal_mask, ...)), not both")
    if layout == "zigzag" and query.shape[-2] % 2:
        raise ValueError(f"ulysses_attention: the zigzag layout needs an even local length, got {query.shape[-2]}")
    validate_sinks(sinks, query, "ulysses_attention")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    B, H, Lw, E = query.shape
    Hkv = key.shape[1]
    n_kv = kv_heads_for(H, Hkv, world)
    if n_kv != Hkv:  # DeepSpeed's rule: repeat each key/value head in place, so the groups stay neighbours
        key, value = key.repeat_interleave(n_kv // Hkv, dim=1), value.repeat_interleave(n_kv // Hkv, dim=1)
    q = seq_to_heads(query, world, group)  # (B, H/W, L, E)
    k, v = seq_to_heads(key, world, group), seq_to_heads(value, world, group)  # (B, n_kv/W, L, E/Ev)
    q, order = _natural(q, world, layout)
    k, _ = _natural(k, world, layout)
    v, _ = _natural(v, world, layout)
    first = rank * (H // world)  # this rank's first global query head
    mine = sinks[first:first + H // world] if sinks is not None else None
    out = _local(q, k, v, is_causal, scale, enable_gqa or n_kv != H, mask_mod, first, mine)  # (B, H/W, L, Ev)
    if order is not None:
        out = out.index_select(2, order)  # back to the ranks' order
    return heads_to_seq(out, world, group)


def _local(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: Optional[float], gqa: bool,
           mask_mod: Optional[Callable], first: int, sinks: Optional[Tensor]) -> Tensor:
    """Attention on this rank's heads over the whole sequence, with attnlab's front door."""
    from attnlab import dispatch, flex

    block = None
    if mask_mod is not None:
        def mod(b, h, q_idx, kv_idx):  # the mask_mod sees global head indices
            return mask_mod(b, h + first, q_idx, kv_idx)
        L = q.shape[2]
        block = flex.create_block_mask(mod, None, q.shape[1], L, L)
    return dispatch.attention(q, k, v, attn_mask=block, is_causal=is_causal, scale=scale, enable_gqa=gqa,
                              sinks=sinks)
