"""Context-parallel attentions with one fault each, planted for `attnlab doctor --context-parallel`
(tests/distributed/test_cp_doctor.py): module-level, so that run_ranks' ranks can import them.

``gathered`` is a context-parallel attention of its own (all-gather the keys and values, attend the
local queries over them, reduce the key/value gradients back): right as written; its flags plant the
faults. The others wrap attnlab's ring and Ulysses."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from attnlab.distributed import positions, ring_attention, ulysses_attention


class _Gather(torch.autograd.Function):
    """(B, Hkv, n, E) per rank -> (B, Hkv, W * n, E) in rank order; backward: the sum over ranks, sliced."""

    @staticmethod
    def forward(ctx, x, reduce):
        ctx.reduce, ctx.n = reduce, x.shape[2]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        if ctx.reduce:
            dist.all_reduce(g)
        r = dist.get_rank()
        return g[:, :, r * ctx.n:(r + 1) * ctx.n], None


def gathered(query, key, value, *, group=None, is_causal=False, layout="contiguous", sinks=None, enable_gqa=False,
             local_positions=False, rank_order=False, drop_next=False, base2=False, reduce=True):
    W, r, n = dist.get_world_size(), dist.get_rank(), query.shape[2]
    k, v = _Gather.apply(key, reduce), _Gather.apply(value, reduce)
    owner = torch.arange(W).repeat_interleave(n)
    if local_positions:
        qpos, kpos = torch.arange(n), torch.arange(n).repeat(W)
    elif rank_order:
        qpos, kpos = torch.arange(r * n, (r + 1) * n), torch.arange(W * n)
    else:
        qpos, kpos = positions(r, W, n, layout), torch.cat([positions(j, W, n, layout) for j in range(W)])
    keep = (qpos[:, None] >= kpos[None, :]) if is_causal else torch.ones(n, W * n, dtype=torch.bool)
    if drop_next:
        keep = keep & (owner[None, :] != (r + 1) % W)
    g = query.shape[1] // key.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (query @ k.transpose(-2, -1) / math.sqrt(query.shape[-1])).masked_fill(~keep, float("-inf"))
    if base2:  # per-shard partials merged with exp2
        parts, lses = [], []
        for j in range(W):
            sj = s.masked_fill(owner[None, :] != j, float("-inf"))
            lse = torch.logsumexp(sj, dim=-1, keepdim=True)
            parts.append(torch.exp(sj - lse).nan_to_num(0.0) @ v)
            lses.append(lse)
        if sinks is not None:  # the sink: one more term of the merge
            lses.append(sinks.view(1, -1, 1, 1).expand_as(lses[0]))
        lse = torch.cat(lses, dim=-1)
        w = torch.exp2(lse - torch.logsumexp(lse * math.log(2.0), dim=-1, keepdim=True) / math.log(2.0)).nan_to_num(0.0)
        return sum(w[..., j:j + 1] * parts[j] for j in range(W))
    cols = [s] + ([sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)] if sinks is not None else [])
    lse = torch.logsumexp(torch.cat(cols, dim=-1), dim=-1, keepdim=True)
    return torch.exp(s - lse) @ v


def causal_offset(query, key, value, **kw):
    return gathered(query, key, value, local_positions=True, **kw)


def zigzag_in_rank_order(query, key, value, **kw):
    return gathered(query, key, value, rank_order=True, **kw)


def ring_one_step_short(query, key, value, **kw):
    return gathered(query, key, value, drop_next=True, **kw)


def merged_in_base_2(query, key, value, **kw):
    return gathered(query, key, value, base2=True, **kw)


def grads_not_reduced(query, key, value, **kw):
    return gathered(query, key, value, reduce=False, **kw)


def sinks_dropped(query, key, value, *, sinks=None, **kw):
    return ring_attention(query, key, value, **kw)


def sinks_per_rank(query, key, value, *, sinks=None, **kw):
    extra = math.log(dist.get_world_size())
    return ring_attention(query, key, value, sinks=None if sinks is None else sinks + extra, **kw)


def heads_gathered_strided(query, key, value, **kw):
    o = ulysses_attention(query, key, value, **kw)
    H, W = o.shape[1], dist.get_world_size()
    per = H // W
    return o[:, [(h % per) * W + h // per for h in range(H)]]


def plain(query, key, value, *, group=None, is_causal=False):
    """A right function that takes no layout=, sinks= or enable_gqa=: probed on what it takes."""
    return ring_attention(query, key, value, group=group, is_causal=is_causal)


_USP_GROUPS: list = []


def usp_2x2(query, key, value, *, group=None, is_causal=False, sinks=None, enable_gqa=False):
    """attnlab's USP on a 2 x 2 mesh of 4 ranks (rank g: ring chunk g // 2, Ulysses piece g % 2), which holds
    the contiguous layout's rows of rank g: no layout= here (a zigzag USP shard is not shard_sequence's)."""
    from attnlab.distributed import context_parallel_attention

    if not _USP_GROUPS:  # every rank makes every group, in the same order
        uly = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        ring = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        g = dist.get_rank()
        _USP_GROUPS.extend([uly[g // 2], ring[g % 2]])
    return context_parallel_attention(query, key, value, groups=tuple(_USP_GROUPS), is_causal=is_causal,
                                      sinks=sinks, enable_gqa=enable_gqa)
