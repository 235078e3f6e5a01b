"""Ring (sequence-parallel) attention on torch.distributed.

Each of W ranks holds a slice of the sequence: ``query``, ``key``, ``value`` of shape
``(B, H, L/W, E)``. Key/value blocks travel around the ring (rank r sends to r+1 and
receives from r-1, with ``batch_isend_irecv``); at every step a rank attends its
queries to the block it holds, with attnlab's tiled kernel, while the next block is
already in flight. The partial results merge exactly with their log-sum-exps::

    lse = log2(2^lse_a + 2^lse_b)
    out = out_a * 2^(lse_a - lse) + out_b * 2^(lse_b - lse)

the same algebra as the online softmax inside one process (with the native kernel the
block is folded straight into the saved ``(out, lse)`` state). The backward pass sends
the key/value blocks around again, together with their gradient accumulators, which
arrive back at their owner after W steps (Liu et al., 2023, "Ring Attention").

Memory: the ring runs one group of heads at a time (heads are independent), so a
message is about ``MESSAGE_BYTES`` and a rank holds two sets of messages on top of its
share of the output and the gradients.

Layouts (``W`` ranks, the sequence cut into chunks):

* ``"contiguous"``: rank r owns positions ``[r L/W, (r+1) L/W)``. With a causal mask
  the last rank does W times the work of the first.
* ``"zigzag"``: the sequence is cut into 2W chunks and rank r owns chunks r and
  2W-1-r, so every rank does the same causal work.

Use :func:`shard_sequence` and :func:`gather_sequence` to move between a full
sequence and a rank's slice.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from attnlab import kernels, tiled
from attnlab._validation import compute_dtype, validate

__all__ = ["ring_attention", "shard_sequence", "gather_sequence", "positions", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def positions(rank: int, world: int, local_len: int, layout: str = "contiguous") -> Tensor:
    """The absolute sequence positions of rank ``rank``'s ``local_len`` rows."""
    _check_layout(layout)
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
    _check_layout(layout)
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
    _check_layout(layout)
    world = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    n = local.shape[dim]
    full = torch.cat(parts, dim=dim)
    order = torch.cat([positions(r, world, n, layout) for r in range(world)]).to(local.device)
    return full.index_select(dim, torch.argsort(order))


# --------------------------------------------------------------------------- #
# The ring
# --------------------------------------------------------------------------- #


def _chunks(rank: int, world: int, local_len: int, layout: str, is_causal: bool) -> list[tuple[int, slice]]:
    """This rank's rows as ``(chunk index, row slice)``: what decides causal visibility between blocks.

    Without a causal mask one chunk covers everything (its index is unused).
    """
    if not is_causal:
        return [(0, slice(0, local_len))]
    if layout == "contiguous":
        return [(rank, slice(0, local_len))]
    c = local_len // 2
    return [(rank, slice(0, c)), (2 * world - 1 - rank, slice(c, local_len))]


def _pairs(q_chunks, k_chunks, is_causal: bool):
    """``(q rows, k rows, causal)`` for every chunk pair with something to compute.

    Equal-length chunks: an earlier key chunk is fully visible, the same chunk is the
    top-left causal diagonal, a later one is hidden and skipped (no mask is built).
    """
    for qi, qs in q_chunks:
        for kj, ks in k_chunks:
            if not is_causal or kj < qi:
                yield qs, ks, False
            elif kj == qi:
                yield qs, ks, True


def _exchange(tensors: list[Tensor], group, send_to: int, recv_from: int,
              into: Optional[list[Tensor]] = None) -> tuple[list, list[Tensor]]:
    """Start sending ``tensors`` to ``send_to`` and receiving the same shapes from ``recv_from``
    (into ``into`` when given, else into new tensors)."""
    received = into if into is not None else [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, recv_from, group) for r in received]
    return dist.batch_isend_irecv(ops), received


def _exchange_now(tensors: list[Tensor], group, send_to: int, recv_from: int, rank: int,
                  into: list[Tensor]) -> list[Tensor]:
    """Send ``tensors`` on and receive the same shapes from ``recv_from`` into ``into``, waiting for both."""
    requests, received = _exchange(tensors, group, send_to, recv_from, into)
    _wait(requests, rank, recv_from)
    return received


# Seconds this process spent blocked on the ring's messages (the part of communication that
# compute did not hide); attnlab ring and attnlab bench --ring report it as a share of the time.
COMM_WAIT_S = [0.0]


def _wait(requests: list, rank: int, recv_from: int) -> None:
    t0 = time.perf_counter()
    try:
        for req in requests:
            req.wait()
        COMM_WAIT_S[0] += time.perf_counter() - t0
    except RuntimeError as exc:
        raise RuntimeError(f"ring_attention: rank {rank} got nothing from rank {recv_from} within the process "
                           f"group's timeout (did a rank die or hang?): {str(exc).splitlines()[0]}") from None


# Each head group's key/value tensors travel as messages of about this size: the ring's memory
# per rank is a few messages on top of this rank's share of out, dQ, dK and dV.
MESSAGE_BYTES = 2 * 2**20


def _head_groups(Nb: int, rows: int, width: int, itemsize: int) -> list[slice]:
    """Consecutive head ranges whose ``(heads, rows, width)`` key block is about MESSAGE_BYTES.

    Heads are independent, so the ring runs one group after another: only one group's blocks
    are ever in flight, and a head range of a contiguous ``(Nb, S, E)`` tensor is contiguous
    (it can be sent as it is and received in place).
    """
    per_head = max(1, rows * width * itemsize)
    size = max(1, min(Nb, MESSAGE_BYTES // per_head))
    return [slice(h, min(Nb, h + size)) for h in range(0, Nb, size)]


class _Buffers:
    """Two sets of message buffers, used in turn (one is received into while the other is read),
    allocated once per pass for the largest head group: the ring allocates nothing per step,
    so its peak memory is what it holds, not what the allocator kept from earlier steps."""

    def __init__(self, like: list[Tensor], heads: int) -> None:
        self.sets = [[t.new_empty(heads, *t.shape[1:]) for t in like] for _ in range(2)]

    def take(self, step: int, heads: int) -> list[Tensor]:
        return [t[:heads] for t in self.sets[step % 2]]


def _ranks(group) -> tuple[int, int, int, int]:
    """``(rank, world, next rank, previous rank)``, the last two as global ranks for P2P ops."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    return rank, world, nxt, prv


class _Ring(torch.autograd.Function):
    """Forward: for each head group, K/V blocks go once around the ring; each rank folds every
    block into its (out, lse) state in place. Backward: K/V go around again with their dK/dV
    accumulators, which reach their owner after W steps."""

    @staticmethod
    def forward(ctx, query, key, value, group, is_causal, scale, layout_name, enable_gqa, bq, bk, batch):
        rank, world, send_to, recv_from = _ranks(group)
        dtype = compute_dtype(query.dtype)
        layout = kernels.Layout(batch, query, key, enable_gqa)
        q4 = layout.queries(query.to(dtype))  # (Nb, r, Lr, E)
        k3 = layout.keys(key.to(dtype)).contiguous()  # (Nb, Sr, E)
        v3 = layout.keys(value.to(dtype)).contiguous()  # (Nb, Sr, Ev)
        Nb, Lr, Sr = q4.shape[0], q4.shape[2], k3.shape[1]
        scale_f = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        q_chunks = _chunks(rank, world, Lr, layout_name, is_causal)
        out = q4.new_zeros(*q4.shape[:3], v3.shape[-1])  # (Nb, r, Lr, Ev), normalised
        lse = q4.new_full(q4.shape[:3], float("-inf"))  # (Nb, r, Lr), base 2: no key seen yet
        groups = _head_groups(Nb, Sr, max(k3.shape[-1], v3.shape[-1]), k3.element_size())
        heads = max(g.stop - g.start for g in groups)
        kv_bufs = _Buffers([k3, v3], heads) if world > 1 else None
        for g in groups:
            k_cur, v_cur = k3[g], v3[g]  # (Nb_g, Sr, E), (Nb_g, Sr, Ev)
            q_g, out_g, lse_g = q4[g], out[g], lse[g]
            for step in range(world):
                src = (rank - step) % world  # whose block this rank holds now
                pending = None
                if step < world - 1:  # the next block travels while this one is computed
                    pending = _exchange([k_cur, v_cur], group, send_to, recv_from,
                                        kv_bufs.take(step, g.stop - g.start))
                for qs, ks, diag in _pairs(q_chunks, _chunks(src, world, Sr, layout_name, is_causal), is_causal):
                    tiled.forward_into(q_g[:, :, qs], k_cur[:, ks], v_cur[:, ks], out_g[:, :, qs], lse_g[:, :, qs],
                                        diag, scale_f * kernels.LOG2E, bq, bk)
                if pending is not None:
                    _wait(pending[0], rank, recv_from)
                    k_cur, v_cur = pending[1]
        ctx.save_for_backward(q4, k3, v3, out, lse)
        ctx.meta = (group, is_causal, scale_f, layout_name, bq, bk, groups, query.shape, key.shape, value.shape,
                    layout)
        return out.reshape(*layout.batch, Lr, v3.shape[-1]).to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q4, k3, v3, out, lse = ctx.saved_tensors
        group, is_causal, scale, layout_name, bq, bk, groups, q_shape, k_shape, v_shape, layout = ctx.meta
        rank, world, send_to, recv_from = _ranks(group)
        dout = grad_out.to(q4.dtype).reshape(out.shape)
        Lr, Sr = q4.shape[2], k3.shape[1]
        q_chunks = _chunks(rank, world, Lr, layout_name, is_causal)
        dq = torch.zeros_like(q4)
        dk, dv = torch.empty_like(k3), torch.empty_like(v3)  # filled by the ring: every row arrives
        heads = max(g.stop - g.start for g in groups)
        kv_bufs = _Buffers([k3, v3], heads) if world > 1 else None
        grad_bufs = _Buffers([dk, dv], heads) if world > 1 else None
        for g in groups:
            n_g = g.stop - g.start
            q_g, out_g, lse_g, dout_g, dq_g = q4[g], out[g], lse[g], dout[g], dq[g]
            delta_g = (dout_g * out_g).sum(dim=-1)  # D_i = rowsum(dO_i * O_i), once per group, not per block
            k_cur, v_cur = k3[g], v3[g]  # read only: they are the saved inputs
            # this block's dK, dV so far: the own block's accumulators start in the result's own rows,
            # which are free until the finished gradient comes back to them at the last step
            dk_cur, dv_cur = dk[g].zero_(), dv[g].zero_()
            for step in range(world):
                src = (rank - step) % world
                # the next K/V block travels while this one is computed
                kv_next = None
                if step < world - 1:
                    kv_next = _exchange([k_cur, v_cur], group, send_to, recv_from, kv_bufs.take(step, n_g))
                for qs, ks, diag in _pairs(q_chunks, _chunks(src, world, Sr, layout_name, is_causal), is_causal):
                    # FlashAttention-2's tile backward with the *final* out and lse: exact per block
                    tiled.backward_blocks(dout_g[:, :, qs], q_g[:, :, qs], k_cur[:, ks], v_cur[:, ks], out_g[:, :, qs],
                                    lse_g[:, :, qs], layout, None, diag, scale, bq, bk,
                                    accumulate_into=(dq_g[:, :, qs], dk_cur[:, ks], dv_cur[:, ks]),
                                    delta=delta_g[:, :, qs])
                if step < world - 1:
                    # pass dK/dV on with their block and take the next block's (the ranks before added
                    # their parts); milliseconds on this link against ~1 s of compute per step, so it
                    # is not overlapped
                    _wait(kv_next[0], rank, recv_from)
                    k_cur, v_cur = kv_next[1]
                    dk_cur, dv_cur = _exchange_now([dk_cur, dv_cur], group, send_to, recv_from, rank,
                                                   grad_bufs.take(step, n_g))
                elif world > 1:
                    # block src = rank + 1 is complete: back to its owner; this rank's own comes from rank - 1
                    requests = dist.batch_isend_irecv([
                        dist.P2POp(dist.isend, dk_cur, send_to, group), dist.P2POp(dist.isend, dv_cur, send_to, group),
                        dist.P2POp(dist.irecv, dk[g], recv_from, group), dist.P2POp(dist.irecv, dv[g], recv_from, group)])
                    _wait(requests, rank, recv_from)
                # (one rank: dk[g], dv[g] already hold the result)
        dq_u = dq.reshape(*layout.batch, *q_shape[-2:]).sum_to_size(q_shape)
        dk_u = dk.reshape(*layout.kv_batch, *k_shape[-2:]).sum_to_size(k_shape)
        dv_u = dv.reshape(*layout.kv_batch, *v_shape[-2:]).sum_to_size(v_shape)
        dt = grad_out.dtype
        return dq_u.to(dt), dk_u.to(dt), dv_u.to(dt), None, None, None, None, None, None, None, None


def ring_attention(query: Tensor, key: Tensor, value: Tensor, *, group: Optional[dist.ProcessGroup] = None,
                   is_causal: bool = False, scale: Optional[float] = None, layout: str = "contiguous",
                   enable_gqa: bool = False, block_q: Optional[int] = None, block_k: Optional[int] = None) -> Tensor:
    """Attention over a sequence split across the ranks of ``group`` (default: the world).

    Args:
        query: this rank's ``(B, H, L/W, E)`` slice (see :func:`shard_sequence`).
        key: ``(B, Hkv, L/W, E)``, the same positions.
        value: ``(B, Hkv, L/W, Ev)``.
        group: the process group (gloo on CPU, NCCL on GPU); must be initialised.
        is_causal: causal over the *whole* sequence (absolute positions).
        scale: default ``1 / sqrt(E)``.
        layout: ``"contiguous"`` or ``"zigzag"`` (balanced causal work); as sharded.
        enable_gqa: grouped-query heads, as in SDPA.
        block_q, block_k: tile sizes of the local tiled kernel.

    Returns:
        This rank's ``(B, H, L/W, Ev)`` slice of the output. Differentiable (the backward
        pass runs its own ring).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (gloo on CPU)")
    _check_layout(layout)
    batch = validate(query, key, value, None, 0.0, is_causal, scale, enable_gqa, fn="ring_attention")
    if query.dim() != 4:
        raise ValueError(f"ring_attention: query must be (B, H, L/W, E), got {tuple(query.shape)}")
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(f"ring_attention: every rank must hold as many query as key rows (self-attention), got "
                         f"query {tuple(query.shape)} and key {tuple(key.shape)}")
    if layout == "zigzag" and query.shape[-2] % 2:
        raise ValueError(f"ring_attention: the zigzag layout needs an even local length, got {query.shape[-2]}")
    bq = kernels.block_size(block_q, tiled.DEFAULT_BLOCK_Q, "block_q", "ring_attention")
    bk = kernels.block_size(block_k, tiled.DEFAULT_BLOCK_K, "block_k", "ring_attention")
    return _Ring.apply(query, key, value, group, is_causal, scale, layout, enable_gqa, bq, bk, batch)


# --------------------------------------------------------------------------- #
# Launching ranks on this machine (attnlab ring, tests)
# --------------------------------------------------------------------------- #


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    """One rank: ring attention forward+backward on seeded inputs, checked against one process."""
    import os
    from datetime import timedelta

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(cfg.get("threads", 1))
    if "message_bytes" in cfg:  # tests: many head groups at small sizes
        global MESSAGE_BYTES
        MESSAGE_BYTES = cfg["message_bytes"]
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg.get("timeout", 30)))
    try:
        dtype = getattr(torch, cfg.get("dtype", "float32"))
        B, H, Hkv, L, E = cfg["B"], cfg["H"], cfg.get("Hkv", cfg["H"]), cfg["L"], cfg["E"]
        g = torch.Generator().manual_seed(cfg.get("seed", 0))
        q, gout = torch.randn(B, H, L, E, generator=g, dtype=dtype), None
        k = torch.randn(B, Hkv, L, E, generator=g, dtype=dtype)
        v = torch.randn(B, Hkv, L, E, generator=g, dtype=dtype)
        gout = torch.randn(B, H, L, E, generator=g, dtype=dtype)
        if cfg.get("nan_query"):  # one query row of NaN: it must propagate as in one process
            q[0, 0, L // 3] = float("nan")
        if cfg.get("die_rank") == rank:
            os._exit(3)  # a rank that dies before the ring starts
        layout, causal, gqa = cfg["layout"], cfg["causal"], Hkv != H
        ql, kl, vl = (shard_sequence(t, rank, world, layout).requires_grad_(True) for t in (q, k, v))
        gl = shard_sequence(gout, rank, world, layout)  # an input, as in the one-process measurement
        # warm-up in this process (gloo's buffers, the native kernel's library, MKL's state), as the
        # one-process measurement warms up before its baseline: the peak then counts the ring itself
        tiny = [torch.randn(B, n, 2 * world * 4, E, dtype=dtype, generator=g) for n in (H, Hkv, Hkv)]
        tq, tk, tv = (shard_sequence(t, rank, world, layout).requires_grad_(True) for t in tiny)
        ring_attention(tq, tk, tv, is_causal=causal, layout=layout, enable_gqa=gqa).sum().backward()
        del tiny, tq, tk, tv
        base = _vm_hwm_bytes()
        COMM_WAIT_S[0] = 0.0
        t0 = time.perf_counter()
        out = ring_attention(ql, kl, vl, is_causal=causal, layout=layout, enable_gqa=gqa)
        out.backward(gl)
        elapsed = time.perf_counter() - t0
        result = {"rank": rank, "time_s": elapsed, "peak_extra_bytes": max(0, _vm_hwm_bytes() - base),
                  "comm_wait_s": COMM_WAIT_S[0]}
        kv_bytes = (kl.numel() + vl.numel()) * kl.element_size()
        result["bytes_sent"] = (world - 1) * kv_bytes + (world - 1) * 2 * kv_bytes + kv_bytes
        if cfg.get("check", True):  # gather the slices; rank 0 compares with one process
            gathered = {n: gather_sequence(t, layout) for n, t in
                        (("output", out.detach()), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}
            if rank == 0:
                qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
                ref = tiled.flash_attention(qf, kf, vf, is_causal=causal, enable_gqa=gqa)
                ref.backward(gout)
                expected = {"output": ref.detach(), "dq": qf.grad, "dk": kf.grad, "dv": vf.grad}
                result["max_abs_diff"] = {n: float((gathered[n] - expected[n]).nan_to_num(0.0).abs().max())
                                          for n in expected}
                result["same_nans"] = {n: torch.equal(gathered[n].isnan(), expected[n].isnan()) for n in expected}
                # NaN only where one process has it too (a causally skipped block keeps its grads finite)
                result["nans_within"] = all(bool((gathered[n].isnan() <= expected[n].isnan()).all()) for n in expected)
                result["nans"] = {n: int(gathered[n].isnan().sum()) for n in expected}
        queue.put(result)
    except Exception as exc:  # reported to the launcher, never a hang
        queue.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run_ring(world: int, cfg: dict, timeout_s: float = 300.0, fresh: bool = False) -> list[dict]:
    """Spawn ``world`` ranks on 127.0.0.1 (gloo) running :func:`_worker`; their reports, by rank.

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
        ctx.set_forkserver_preload(["attnlab.distributed"])
    results: "mp.Queue" = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, results)) for r in range(world)]
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
