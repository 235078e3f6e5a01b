"""``attnlab bench --cp``: the ring, Ulysses and USP on loopback gloo, 1 thread a rank, with the bytes
each rank sends (benchmark plumbing: it spawns ranks through :func:`attnlab.distributed.testing.run_ranks`).

Each scheme runs forward+backward on the same seeded inputs ``(B, H, L, E)`` float32, causal,
contiguous layout, after one warm-up; the time is the slowest rank's, the median of ``repeats``. The
bytes are worked out from the shapes (what each exchange moves), not sniffed off the wire:

* ring: ``W - 1`` steps of a key/value slice forward; the backward sends K, V, dK and dV;
* Ulysses: ``(W-1)/W`` of q, k, v and of the output forward; the same again, transposed, backward;
* USP on ``(Wr, Wu)``: Ulysses' volume inside a group of ``Wu``, then the ring's over ``Wr`` chunks
  on ``H/Wu`` heads.
"""

from __future__ import annotations

import time

import torch

from attnlab.distributed import (context_parallel_attention, kv_heads_for, ring_attention, shard_sequence,
                                 ulysses_attention, usp_shard)
from attnlab.distributed.testing import run_ranks

__all__ = ["cp_benchmark", "cp_table", "bytes_per_rank", "CP_HEADER"]

CP_HEADER = ("forward+backward, float32, causal, contiguous layout; W ranks x 1 thread on loopback gloo; "
             "MB: what one rank sends per layer (forward+backward), from the shapes")


def bytes_per_rank(scheme: str, W: int, B: int, H: int, Hkv: int, L: int, E: int, itemsize: int = 4,
                   mesh: tuple = (1, 1)) -> int:
    """What one rank sends for one layer's forward+backward under ``scheme`` (see the module doc)."""
    n = B * L // W  # this rank's rows
    if scheme == "ring":
        return int(3 * (W - 1) * 2 * Hkv * n * E * itemsize)  # K, V forward; K, V, dK, dV backward
    if scheme == "ulysses":
        hp = kv_heads_for(H, Hkv, W)
        return int(2 * (W - 1) / W * n * (2 * H * E + 2 * hp * E) * itemsize)  # q, k, v, o; and their grads
    wr, wu = mesh
    hp = kv_heads_for(H, Hkv, wu)
    inside = 2 * (wu - 1) / wu * n * (2 * H * E + 2 * hp * E) * itemsize
    across = 3 * (wr - 1) * 2 * (hp // wu) * (n * wu) * E * itemsize  # the ring on the gathered chunk, H'/Wu heads
    return int(inside + across)


def _rank(rank: int, world: int, scheme: str, cfg: dict) -> float:
    """One rank: warm-up, then the median seconds of ``repeats`` forward+backward runs (barrier-synced)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, E = cfg["B"], cfg["H"], cfg["Hkv"], cfg["L"], cfg["E"]
    q, k, v = (torch.randn(B, n, L, E, generator=g) for n in (H, Hkv, Hkv))
    kw = dict(is_causal=True, enable_gqa=H != Hkv)
    if scheme == "usp":
        from torch.distributed.device_mesh import init_device_mesh

        wr, wu = cfg["mesh"]
        mesh = init_device_mesh("cpu", (wr, wu), mesh_dim_names=("ring", "ulysses"))
        parts = [usp_shard(t, rank // wu, wr, rank % wu, wu) for t in (q, k, v)]

        def attend(a, b, c):
            return context_parallel_attention(a, b, c, mesh=mesh, **kw)
    else:
        parts = [shard_sequence(t, rank, world) for t in (q, k, v)]
        fn = ring_attention if scheme == "ring" else ulysses_attention

        def attend(a, b, c):
            return fn(a, b, c, **kw)
    times = []
    for i in range(cfg["repeats"] + 1):
        leaves = [p.clone().requires_grad_() for p in parts]
        dist.barrier()
        t0 = time.perf_counter()
        attend(*leaves).sum().backward()
        dist.barrier()
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def cp_benchmark(L: int = 4096, *, B: int = 1, H: int = 8, Hkv: int = 8, E: int = 64, worlds=(2, 4),
                 repeats: int = 3, progress=None) -> list[dict]:
    """One row per (scheme, W): seconds and MB per rank; USP on (W/2, 2) meshes from W = 4."""
    cfg = dict(B=B, H=H, Hkv=Hkv, L=L, E=E, repeats=repeats)
    rows = []
    plans = [(W, scheme, mesh) for W in worlds for scheme, mesh in
             [("ring", (W, 1)), ("ulysses", (1, W))] + ([("usp", (W // 2, 2))] if W >= 4 else [])]
    for done, (W, scheme, mesh) in enumerate(plans):
        if progress:  # progress(done, total, text), as the other suites'
            progress(done, len(plans), f"{scheme} on {W} ranks")
        seconds = max(run_ranks(_rank, W, args=(scheme, {**cfg, "mesh": mesh}), timeout=600))
        rows.append(dict(scheme=scheme, W=W, mesh=mesh, L=L, seconds=seconds,
                         mb=bytes_per_rank(scheme, W, B, H, Hkv, L, E, mesh=mesh) / 1e6))
    return rows


def cp_table(rows: list[dict]) -> str:
    lines = ["| scheme | W | mesh (ring x Ulysses) | L | s fwd+bwd | x ring's time | MB sent per rank |",
             "|---|---|---|---|---|---|---|"]
    ring = {r["W"]: r["seconds"] for r in rows if r["scheme"] == "ring"}
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['W']} | {r['mesh'][0]} x {r['mesh'][1]} | {r['L']} | {r['seconds']:.3f} | "
                     f"{r['seconds'] / ring[r['W']]:.2f} | {r['mb']:.1f} |")
    return "\n".join(lines)
