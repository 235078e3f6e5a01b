"""Train an attention layer on one long sequence split across ranks: ring attention, Ulysses or USP.

Runs unchanged under torchrun, on one machine or several (gloo: CPUs; nccl works the same way):

    torchrun --standalone --nproc-per-node=2 examples/ring_train.py --mask document
    # two machines, 2 ranks each (run on both, --node-rank 0 and 1):
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29400 --rdzv-id=job1 examples/ring_train.py --mask sliding

    # Ulysses (heads scattered, the sequence gathered) or USP (Ulysses in pairs, the ring across):
    torchrun --standalone --nproc-per-node=4 examples/ring_train.py --cp ulysses --mask document
    torchrun --standalone --nproc-per-node=4 examples/ring_train.py --cp usp --ulysses-size 2

and without torchrun, ``--single`` trains the same model in one process (the reference).

The model: x (1, L, D) -> q, k, v projections -> attention over the whole sequence -> output
projection; the loss is the mean square of the output. Each rank holds L / W positions
(attnlab.distributed.shard_sequence; usp_shard for USP); attention is attnlab's ring_attention
(--cp ring), ulysses_attention or context_parallel_attention (USP), with a FlexAttention
mask_mod over absolute positions (packed documents, a sliding window) or causal; the weight
gradients of the ranks' positions are summed (all_reduce) before each SGD step. Rank 0 prints
the losses and, with --out, writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from attnlab import flex, tiled
from attnlab.distributed import context_parallel_attention, ring_attention, shard_sequence, ulysses_attention, usp_shard


def masks(L: int):
    """The masks this script names, over absolute positions of a sequence of L."""
    return {"causal": None,
            "document": flex.document_mask(flex.document_ids([L // 4, L // 2, L - L // 4 - L // 2])),
            "sliding": flex.sliding_window(max(1, L // 8))}


def model(args):
    g = torch.Generator().manual_seed(args.seed)
    D, H, Hkv, E = args.dim, args.heads, args.kv_heads or args.heads, args.dim // args.heads
    params = {"wq": torch.randn(D, H * E, generator=g) / D ** 0.5, "wk": torch.randn(D, Hkv * E, generator=g) / D ** 0.5,
              "wv": torch.randn(D, Hkv * E, generator=g) / D ** 0.5, "wo": torch.randn(H * E, D, generator=g) / D ** 0.5}
    x = torch.randn(1, args.seq_len, D, generator=g)  # (B, L, D): the same on every rank (seeded)
    return params, x, (H, Hkv, E)


def heads(t, n, E):
    """(B, L, n * E) -> (B, n, L, E)"""
    return t.view(t.shape[0], t.shape[1], n, E).transpose(1, 2)


def step_loss(params, x, shape, attend):
    """Mean square of the layer's output over x's positions; ``attend(q, k, v)`` is the attention."""
    H, Hkv, E = shape
    q, k, v = heads(x @ params["wq"], H, E), heads(x @ params["wk"], Hkv, E), heads(x @ params["wv"], Hkv, E)
    o = attend(q, k, v)  # (B, H, L_local, E)
    out = o.transpose(1, 2).reshape(x.shape[0], x.shape[1], H * E) @ params["wo"]  # (B, L_local, D)
    return out.square().sum()


def _context_parallel(args, x, shape, mask_mod, rank: int, world: int):
    """This rank's positions of ``x`` (1, L, D) -> (1, L / W, D), and its attention over the whole sequence."""
    kw = dict(is_causal=mask_mod is None, mask_mod=mask_mod, layout=args.layout, enable_gqa=shape[0] != shape[1])
    if args.cp == "usp":  # a (W / U, U) mesh: Ulysses inside each group of U ranks, the ring across the groups
        from torch.distributed.device_mesh import init_device_mesh

        wu = args.ulysses_size
        mesh = init_device_mesh("cpu", (world // wu, wu), mesh_dim_names=("ring", "ulysses"))
        x_local = usp_shard(x, rank // wu, world // wu, rank % wu, wu, args.layout, dim=1)
        return x_local, lambda q, k, v: context_parallel_attention(q, k, v, mesh=mesh, **kw)
    scheme = ulysses_attention if args.cp == "ulysses" else ring_attention
    return shard_sequence(x, rank, world, args.layout, dim=1), lambda q, k, v: scheme(q, k, v, **kw)


def train(args) -> list[float]:
    distributed = not args.single
    if distributed:
        dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(args.seed)
    params, x, shape = model(args)
    for p in params.values():
        p.requires_grad_(True)
    mask_mod = masks(args.seq_len)[args.mask]
    L, D = args.seq_len, args.dim
    if distributed:
        x_local, attend = _context_parallel(args, x, shape, mask_mod, rank, world)
    else:
        x_local = x
        block_mask = flex.create_block_mask(mask_mod, None, None, L, L) if mask_mod is not None else None

        def attend(q, k, v):
            if block_mask is None:
                return tiled.flash_attention(q, k, v, is_causal=True, enable_gqa=shape[0] != shape[1])
            return flex.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=shape[0] != shape[1])
    losses = []
    for step in range(args.steps):
        loss = step_loss(params, x_local, shape, attend) / (L * D)  # this rank's share of the mean
        for p in params.values():
            p.grad = None
        loss.backward()
        total = loss.detach().clone()
        if distributed:  # the sequence is split: sum the ranks' losses and weight gradients
            dist.all_reduce(total)
            for p in params.values():
                dist.all_reduce(p.grad)
        with torch.no_grad():
            for p in params.values():
                p -= args.lr * p.grad
        losses.append(float(total))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    if distributed:
        dist.destroy_process_group()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "world": world, "mask": args.mask, "cp": args.cp}, f)
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--dim", type=int, default=64, help="model width D (heads x head size)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="GQA key/value heads (default 2)")
    p.add_argument("--mask", choices=["causal", "document", "sliding"], default="document")
    p.add_argument("--layout", choices=["contiguous", "zigzag"], default="zigzag")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cp", choices=["ring", "ulysses", "usp"], default="ring",
                   help="the context-parallel scheme (default ring); ulysses needs --heads divisible by the ranks")
    p.add_argument("--ulysses-size", type=int, default=2, help="USP: ranks per Ulysses group (default 2)")
    p.add_argument("--single", action="store_true", help="one process, no torch.distributed (the reference)")
    p.add_argument("--out", help="rank 0 writes the losses here as JSON")
    args = p.parse_args(argv)
    if not args.single and "RANK" not in os.environ:
        p.error("run it with torchrun (see the examples above), or pass --single for one process")
    if args.dim % args.heads or args.heads % (args.kv_heads or args.heads):
        p.error("--dim must be a multiple of --heads, and --heads of --kv-heads")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not args.single and args.cp == "ulysses" and args.heads % world:
        p.error(f"--cp ulysses scatters whole heads: --heads ({args.heads}) must be a multiple of the ranks ({world})")
    if not args.single and args.cp == "usp" and (world % args.ulysses_size or args.heads % args.ulysses_size):
        p.error(f"--cp usp: --ulysses-size ({args.ulysses_size}) must divide the ranks ({world}) and --heads")
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
