"""Local ranks for ring attention: the launcher behind ``attnlab ring``, ``attnlab bench --ring``
and the tests (not library code: it spawns processes and injects faults).

:func:`run_ring` starts ``world`` ranks on 127.0.0.1 (gloo); each runs :func:`worker`:
seeded inputs, ring attention forward+backward, and, on rank 0, the comparison with one
process. Fault hooks for the tests: ``die_rank`` (a rank that exits before the ring, or before it
joins the group with ``die_at="join"``) and
``nan_query`` (a NaN query row); ``message_bytes`` makes many head groups at small sizes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from attnlab import tiled
from attnlab.distributed import gather_sequence, ring_attention, shard_sequence

__all__ = ["run_ring", "worker", "named_mask"]


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    """One rank: ring attention forward+backward on seeded inputs, checked against one process
    (``cfg``: B, H, Hkv, L, E, causal, layout, dtype, threads, timeout, seed, check, and the
    fault hooks of the module doc)."""
    import os
    from datetime import timedelta

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(cfg.get("threads", 1))
    ring_kw = {"message_bytes": cfg["message_bytes"]} if "message_bytes" in cfg else {}  # many head groups
    try:  # joining the group is inside: a peer that dies while the mesh connects is a reported error
        if cfg.get("die_rank") == rank and cfg.get("die_at") == "join":
            os._exit(3)  # a rank that dies before it joins the group
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfg.get("timeout", 30)))
        dtype = getattr(torch, cfg.get("dtype", "float32"))
        B, H, Hkv, L, E = cfg["B"], cfg["H"], cfg.get("Hkv", cfg["H"]), cfg["L"], cfg["E"]
        g = torch.Generator().manual_seed(cfg.get("seed", 0))
        q, gout = torch.randn(B, H, L, E, generator=g, dtype=dtype), None
        k = torch.randn(B, Hkv, L, E, generator=g, dtype=dtype)
        v = torch.randn(B, Hkv, L, E, generator=g, dtype=dtype)
        gout = torch.randn(B, H, L, E, generator=g, dtype=dtype)
        sinks = (torch.randn(H, generator=g, dtype=dtype) * 2).requires_grad_() if cfg.get("sinks") else None
        if sinks is not None:
            ring_kw["sinks"] = sinks
        if cfg.get("nan_query"):  # one query row of NaN: it must propagate as in one process
            q[0, 0, L // 3] = float("nan")
        if cfg.get("die_rank") == rank and cfg.get("die_at", "ring") == "ring":
            os._exit(3)  # a rank that dies after joining, before the ring starts
        layout, causal, gqa = cfg["layout"], cfg["causal"], Hkv != H
        mask_mod = named_mask(cfg["mask"], L) if cfg.get("mask") else None
        if mask_mod is not None:
            ring_kw["mask_mod"] = mask_mod
        ql, kl, vl = (shard_sequence(t, rank, world, layout).requires_grad_(True) for t in (q, k, v))
        gl = shard_sequence(gout, rank, world, layout)  # an input, as in the one-process measurement
        # warm-up in this process (gloo's buffers, the native kernel's library, MKL's state), as the
        # one-process measurement warms up before its baseline: the peak then counts the ring itself
        tiny = [torch.randn(B, n, 2 * world * 4, E, dtype=dtype, generator=g) for n in (H, Hkv, Hkv)]
        tq, tk, tv = (shard_sequence(t, rank, world, layout).requires_grad_(True) for t in tiny)
        tiny_kw = {**ring_kw, "mask_mod": named_mask(cfg["mask"], tq.shape[2] * world)} if mask_mod else ring_kw
        ring_attention(tq, tk, tv, is_causal=causal, layout=layout, enable_gqa=gqa, **tiny_kw).sum().backward()
        if sinks is not None:
            sinks.grad = None  # the warm-up's
        del tiny, tq, tk, tv
        base = _vm_hwm_bytes()
        stats: dict = {}
        t0 = time.perf_counter()
        out = ring_attention(ql, kl, vl, is_causal=causal, layout=layout, enable_gqa=gqa, stats=stats, **ring_kw)
        out.backward(gl)
        elapsed = time.perf_counter() - t0
        result = {"rank": rank, "time_s": elapsed, "peak_extra_bytes": max(0, _vm_hwm_bytes() - base),
                  "comm_wait_s": stats.get("comm_wait_s", 0.0)}
        kv_bytes = (kl.numel() + vl.numel()) * kl.element_size()
        result["bytes_sent"] = (world - 1) * kv_bytes + (world - 1) * 2 * kv_bytes + kv_bytes
        if cfg.get("check", True):  # gather the slices; rank 0 compares with one process
            gathered = {n: gather_sequence(t, layout) for n, t in
                        (("output", out.detach()), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}
            if sinks is not None:  # each rank holds its rows' share of the replicated sinks' gradient
                dist.all_reduce(sinks.grad, group=None)
                gathered["dsinks"] = sinks.grad
            if rank == 0:
                qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
                sf = sinks.detach().clone().requires_grad_(True) if sinks is not None else None
                if mask_mod is None:
                    ref = tiled.flash_attention(qf, kf, vf, is_causal=causal, enable_gqa=gqa, sinks=sf)
                else:  # one process's flex_attention with the same mask
                    from attnlab import flex

                    ref = flex.flex_attention(qf, kf, vf, block_mask=flex.create_block_mask(mask_mod, None, None, L, L),
                                              enable_gqa=gqa, sinks=sf)
                ref.backward(gout)
                expected = {"output": ref.detach(), "dq": qf.grad, "dk": kf.grad, "dv": vf.grad}
                if sf is not None:
                    expected["dsinks"] = sf.grad
                result["max_abs_diff"] = {n: (float((gathered[n] - expected[n]).nan_to_num(0.0).abs().max())
                                                 if expected[n].numel() else 0.0)  # E = 0: dq, dk are empty
                                          for n in expected}
                result["same_nans"] = {n: torch.equal(gathered[n].isnan(), expected[n].isnan()) for n in expected}
                # NaN only where one process has it too (a causally skipped block keeps its grads finite)
                result["nans_within"] = all(bool((gathered[n].isnan() <= expected[n].isnan()).all()) for n in expected)
                result["nans"] = {n: int(gathered[n].isnan().sum()) for n in expected}
        queue.put(result)
    except Exception as exc:  # reported to the launcher, never a hang
        queue.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a dead peer's group may not tear down cleanly: the report is sent
                pass


def named_mask(name: str, L: int):
    """The masks the launcher and the benchmarks name, over absolute positions of a sequence of
    ``L``: ``document`` (packed documents of L/4, L/2 - 3, L/4 + 3, causal inside each),
    ``sliding`` (a causal window of L/8), ``sliding:W``, ``causal`` (as a mask_mod)."""
    from attnlab import flex

    if name == "document":
        return flex.document_mask(flex.document_ids([L // 4, L // 2 - 3, L - L // 4 - (L // 2 - 3)]))
    if name == "sliding":
        return flex.sliding_window(max(1, L // 8))
    if name.startswith("sliding:"):
        return flex.sliding_window(int(name.split(":", 1)[1]))
    if name == "causal":
        return flex.causal_mask
    raise ValueError(f"named_mask: unknown mask {name!r} (document, sliding, sliding:W, causal)")


def run_ring(world: int, cfg: dict, timeout_s: float = 300.0, fresh: bool = False) -> list[dict]:
    """Spawn ``world`` ranks on 127.0.0.1 (gloo) running :func:`worker`; their reports, by rank.

    ``fresh``: each rank a new interpreter ('spawn'), for memory measurements (a fork's peak
    RSS starts from its parent's); else forks of a fork server that imported torch once.

    A rank that dies shows up as ``{"rank": r, "error": "exited with code ..."}``; the others
    report the timeout error ring_attention raised.
    """
    import multiprocessing as mp
    import queue as queue_mod
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a fork server that has imported torch and this module once: each rank is a fork of it
    # (~0.1 s) instead of a fresh interpreter importing torch (2.6-3.4 s of CPU each here);
    # clean like 'spawn' (the server is single-threaded and holds no state of the caller's)
    ctx = mp.get_context("spawn" if fresh else "forkserver")
    if not fresh:
        ctx.set_forkserver_preload(["attnlab.bench.ranks"])
    results: "mp.Queue" = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, cfg, results)) for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(reports) < world and time.monotonic() < deadline:
        try:
            rep = results.get(timeout=0.5)
            reports[rep["rank"]] = rep
        except queue_mod.Empty:
            for r, p in enumerate(procs):
                if r not in reports and p.exitcode not in (None, 0):
                    reports[r] = {"rank": r, "error": f"exited with code {p.exitcode}"}
    for r, p in enumerate(procs):
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            reports.setdefault(r, {"rank": r, "error": "killed: no report before the launcher's timeout"})
        reports.setdefault(r, {"rank": r, "error": f"exited with code {p.exitcode} without a report"})
    return [reports[r] for r in range(world)]
