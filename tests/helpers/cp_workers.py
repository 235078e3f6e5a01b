"""Context-parallel cases for tests/distributed: each rank's work (module level, so that
attnlab.distributed.testing.run_ranks's ranks can import it) and the one-process float64 golden."""

from __future__ import annotations

import torch

from attnlab import flex
from attnlab.distributed import positions, shard_sequence, ulysses_attention, ring_attention


def mask_mod(name: str, L: int):
    """None, or a mask_mod over absolute positions of a sequence of ``L``: ``document`` (three packed
    documents of uneven lengths, causal inside each) or ``sliding`` (a causal window of L/4)."""
    if name == "document":
        return flex.document_mask(flex.document_ids([L // 4 + 1, L // 2 - 3, L - (L // 4 + 1) - (L // 2 - 3)]))
    if name == "sliding":
        return flex.sliding_window(max(1, L // 4))
    return None


def keep(name: str, L: int):
    """(L, L) bool of :func:`mask_mod` (None without one)."""
    mod = mask_mod(name, L)
    if mod is None:
        return None
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return mod(torch.tensor(0), torch.tensor(0), i, j).expand(L, L)


def inputs(B=1, H=4, Hkv=2, L=32, E=8, sinks=False, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, L, E, generator=g, dtype=dtype) for n in (H, Hkv, Hkv))
    do = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    s = torch.randn(H, generator=g, dtype=dtype) * 2 if sinks else None
    return q, k, v, do, s


def golden(q, k, v, do, causal=False, mask="", sinks=None):
    """One process, float64, torch's softmax (an oracle): (out, dq, dk, dv, dsinks)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s_leaf = sinks.detach().double().requires_grad_() if sinks is not None else None
    qq, kk, vv = leaves
    H, Hkv, L = qq.shape[1], kk.shape[1], qq.shape[2]
    kk, vv = kk.repeat_interleave(H // Hkv, 1), vv.repeat_interleave(H // Hkv, 1)
    s = qq @ kk.transpose(-2, -1) / qq.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    k_ = keep(mask, L)
    if k_ is not None:
        s = s.masked_fill(~k_, float("-inf"))
    if s_leaf is not None:
        p = torch.softmax(torch.cat([s, s_leaf[:, None, None].expand(*s.shape[:-1], 1)], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    out = p @ vv
    grads = torch.autograd.grad(out, leaves + ([s_leaf] if s_leaf is not None else []), do.double())
    return (out.detach(), *grads[:3], grads[3] if s_leaf is not None else None)


def attend(rank, world, scheme, q, k, v, do, causal=False, mask="", sinks=None, layout="contiguous"):
    """One rank: its shards through ``scheme`` (``ulysses`` or ``ring``), forward and backward with its
    shard of ``do``; returns its (out, dq, dk, dv) shards and its share of the sinks' gradient."""
    shards = [shard_sequence(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
    s_leaf = sinks.clone().requires_grad_() if sinks is not None else None
    fn = ulysses_attention if scheme == "ulysses" else ring_attention
    kw = dict(is_causal=causal, layout=layout, enable_gqa=q.shape[1] != k.shape[1], sinks=s_leaf)
    mod = mask_mod(mask, q.shape[2])
    if mod is not None:
        kw["mask_mod"] = mod
    out = fn(*shards, **kw)
    out.backward(shard_sequence(do, rank, world, layout))
    return (out.detach(), *(t.grad for t in shards), s_leaf.grad if s_leaf is not None else None)


def assemble(parts, world, layout="contiguous"):
    """The whole sequence from each rank's shard (dim 2), in position order."""
    n = parts[0].shape[2]
    order = torch.cat([positions(r, world, n, layout) for r in range(world)])
    return torch.cat(parts, dim=2).index_select(2, torch.argsort(order))


# ---------------------------------------------------------------- the harness's own failures
def dies(rank, world):
    """Rank 1 exits before the collective; the others wait in it."""
    import os

    import torch.distributed as dist
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


def hangs(rank, world):
    """Rank 0 waits in an all-reduce that rank 1 never joins (it sleeps)."""
    import time

    import torch.distributed as dist
    if rank == 1:
        time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def raises(rank, world):
    if rank == 1:
        raise ValueError("a shard of the wrong length")
    return rank


def sums(rank, world):
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def refusals(rank, world):
    """Each bad call's error message, on every rank."""
    out = []
    q = torch.randn(1, 3, 8, 4)  # 3 heads over 2 ranks
    for call in (lambda: ulysses_attention(q, q, q), lambda: ulysses_attention(
            torch.randn(1, 4, 8, 4), torch.randn(1, 4, 8, 4), torch.randn(1, 4, 8, 4), is_causal=True,
            mask_mod=flex.causal_mask), lambda: ulysses_attention(torch.randn(1, 4, 8, 4), torch.randn(1, 4, 6, 4),
                                                                  torch.randn(1, 4, 6, 4))):
        try:
            call()
            out.append("")
        except (ValueError, TypeError, RuntimeError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def attend_usp(rank, world, wr, wu, q, k, v, do, causal=False, mask="", sinks=None, layout="contiguous"):
    """One rank of a (wr, wu) mesh through context_parallel_attention; as :func:`attend`."""
    from torch.distributed.device_mesh import init_device_mesh

    from attnlab.distributed import context_parallel_attention, usp_shard

    mesh = init_device_mesh("cpu", (wr, wu), mesh_dim_names=("ring", "ulysses"))
    r, u = rank // wu, rank % wu
    shards = [usp_shard(t, r, wr, u, wu, layout).requires_grad_() for t in (q, k, v)]
    s_leaf = sinks.clone().requires_grad_() if sinks is not None else None
    kw = dict(is_causal=causal, layout=layout, enable_gqa=q.shape[1] != k.shape[1], sinks=s_leaf)
    mod = mask_mod(mask, q.shape[2])
    if mod is not None:
        kw["mask_mod"] = mod
    out = context_parallel_attention(*shards, mesh=mesh, **kw)
    out.backward(usp_shard(do, r, wr, u, wu, layout))
    return (out.detach(), *(t.grad for t in shards), s_leaf.grad if s_leaf is not None else None)


def assemble_usp(parts, wr, wu, layout="contiguous"):
    """The whole sequence from the (wr, wu) mesh's rows, rank r * wu + u holding piece u of ring chunk r."""
    n = parts[0].shape[2]
    order = torch.cat([positions(r, wr, n * wu, layout)[u * n:(u + 1) * n] for r in range(wr) for u in range(wu)])
    return torch.cat(parts, dim=2).index_select(2, torch.argsort(order))
