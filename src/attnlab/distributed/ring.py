"""Ring (sequence-parallel) attention on torch.distributed (package-internal: use :mod:`attnlab.distributed`).

Each of W ranks holds a slice of the sequence: ``query``, ``key``, ``value`` of shape
``(B, H, L/W, E)``. Key/value blocks travel around the ring (rank r sends to r+1 and
receives from r-1, with ``batch_isend_irecv``); at every step a rank attends its
queries to the block it holds, with attnlab's tiled kernel, while the next block is
already in flight. The partial results merge exactly with their log-sum-exps::

    lse = log2(2^lse_a + 2^lse_b)
    out = out_a * 2^(lse_a - lse) + out_b * 2^(lse_b - lse)

the same algebra as the online softmax inside one process (with the native kernel the
block is folded straight into the saved ``(out, lse)`` state). Any FlexAttention mask_mod
over absolute positions works too (``mask_mod=``: packed documents, sliding windows): each
step then runs the block-sparse kernels over that step's block plan. The backward pass sends
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

Use :func:`attnlab.distributed.shard_sequence` and :func:`attnlab.distributed.gather_sequence`
to move between a full sequence and a rank's slice.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from attnlab import kernels
from attnlab.kernels import block_sparse, dense, mask_blocks, native
from attnlab.kernels import sinks as sinks_
from attnlab._validation import compute_dtype, default_scale, validate, validate_sinks
from attnlab.distributed.layout import check_layout, positions

__all__ = ["ring_attention"]


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
                  into: list[Tensor], stats: Optional[dict] = None) -> list[Tensor]:
    """Send ``tensors`` on and receive the same shapes from ``recv_from`` into ``into``, waiting for both."""
    requests, received = _exchange(tensors, group, send_to, recv_from, into)
    _wait(requests, rank, recv_from, stats)
    return received


def _wait(requests: list, rank: int, recv_from: int, stats: Optional[dict] = None) -> None:
    """Wait for the requests; ``stats["comm_wait_s"]`` (when given) adds the seconds this rank was
    blocked on messages, the part of communication that compute did not hide."""
    t0 = time.perf_counter()
    try:
        for req in requests:
            req.wait()
        if stats is not None:
            stats["comm_wait_s"] = stats.get("comm_wait_s", 0.0) + time.perf_counter() - t0
    except RuntimeError as exc:
        raise RuntimeError(f"ring_attention: rank {rank} got nothing from rank {recv_from} within the process "
                           f"group's timeout (did a rank die or hang?): {str(exc).splitlines()[0]}") from None


# Each head group's key/value tensors travel as messages of about this size (ring_attention's
# message_bytes): the ring's memory per rank is a few messages on top of this rank's share of
# out, dQ, dK and dV.
MESSAGE_BYTES = 2 * 2**20


def _head_groups(Nb: int, rows: int, width: int, itemsize: int, message_bytes: int = MESSAGE_BYTES) -> list[slice]:
    """Consecutive head ranges whose ``(heads, rows, width)`` key block is about MESSAGE_BYTES.

    Heads are independent, so the ring runs one group after another: only one group's blocks
    are ever in flight, and a head range of a contiguous ``(Nb, S, E)`` tensor is contiguous
    (it can be sent as it is and received in place).
    """
    per_head = max(1, rows * width * itemsize)
    size = max(1, min(Nb, message_bytes // per_head))
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


class _CausalSteps:
    """What a rank computes at one ring step with ``is_causal`` (or no mask): the chunk pairs
    of :func:`_pairs`, through the tiled kernels (dense tiles; the diagonal chunk causal)."""

    def __init__(self, rank: int, world: int, Lr: int, Sr: int, layout_name: str, is_causal: bool, scale: float,
                 bq: int, bk: int, layout: kernels.Layout) -> None:
        self.world, self.Sr, self.layout_name, self.is_causal = world, Sr, layout_name, is_causal
        self.scale, self.bq, self.bk, self.layout = scale, bq, bk, layout
        self.q_chunks = _chunks(rank, world, Lr, layout_name, is_causal)

    def _pairs(self, src: int):
        return _pairs(self.q_chunks, _chunks(src, self.world, self.Sr, self.layout_name, self.is_causal),
                      self.is_causal)

    def forward(self, src, g, q_g, k_cur, v_cur, out_g, lse_g) -> None:
        for qs, ks, diag in self._pairs(src):
            dense.forward_into(q_g[:, :, qs], k_cur[:, ks], v_cur[:, ks], out_g[:, :, qs], lse_g[:, :, qs],
                               diag, self.scale * kernels.LOG2E, self.bq, self.bk)

    def backward(self, src, g, dout_g, q_g, k_cur, v_cur, out_g, lse_g, delta_g, dq_g, dk_cur, dv_cur) -> None:
        for qs, ks, diag in self._pairs(src):
            # FlashAttention-2's tile backward with the *final* out and lse: exact per block
            dense.backward(dout_g[:, :, qs], q_g[:, :, qs], k_cur[:, ks], v_cur[:, ks], out_g[:, :, qs],
                                  lse_g[:, :, qs], self.layout, None, diag, self.scale, self.bq, self.bk,
                                  accumulate_into=(dq_g[:, :, qs], dk_cur[:, ks], dv_cur[:, ks]),
                                  delta=delta_g[:, :, qs])


class _MaskedSteps:
    """What a rank computes at one ring step with a ``mask_mod`` over absolute positions: the
    blocks of its (query chunk, key chunk) pair (:mod:`attnlab.kernels.mask_blocks`), built once
    per source rank, so empty blocks (and pairs with none visible) are skipped and the time
    follows the mask's density. float32 with finite inputs on every rank runs the native
    block-sparse kernels; otherwise the pair's element mask runs the kernel layer's online
    softmax and tile backward (:mod:`attnlab.kernels.block_sparse` decides nothing else)."""

    BLOCK = 128  # the blocks' size, attnlab.flex's default

    def __init__(self, rank: int, world: int, Lr: int, Sr: int, layout_name: str, mask_mod, scale: float,
                 B: int, H: int, native: bool) -> None:
        self.scale, self.B, self.H, self.native = scale, B, H, native
        self.q_pos = positions(rank, world, Lr, layout_name)
        self.world, self.Sr, self.layout_name, self.mask_mod = world, Sr, layout_name, mask_mod
        self._blocks: dict[int, mask_blocks.MaskBlocks] = {}

    def blocks(self, src: int) -> mask_blocks.MaskBlocks:
        """The blocks of this rank's queries against rank ``src``'s keys (local indices)."""
        if src not in self._blocks:
            q_pos, k_pos, mod = self.q_pos, positions(src, self.world, self.Sr, self.layout_name), self.mask_mod

            def local(b, h, q_idx, kv_idx):
                return mod(b, h, q_pos[q_idx], k_pos[kv_idx])

            self._blocks[src] = mask_blocks.of_mask_mod(local, len(q_pos), self.Sr, self.BLOCK)
        return self._blocks[src]

    def forward(self, src, g, q_g, k_cur, v_cur, out_g, lse_g) -> None:
        part = block_sparse.forward_rows(q_g, k_cur, v_cur, self.blocks(src), g, self.B, self.H, self.scale,
                                         self.native)
        if part is not None:
            kernels.merge_(out_g, lse_g, *part)

    def backward(self, src, g, dout_g, q_g, k_cur, v_cur, out_g, lse_g, delta_g, dq_g, dk_cur, dv_cur) -> None:
        block_sparse.backward_rows_(dout_g, q_g, k_cur, v_cur, lse_g, delta_g, dq_g, dk_cur, dv_cur, self.blocks(src),
                                    g, self.B, self.H, self.scale, self.native)


class _Ring(torch.autograd.Function):
    """Forward: for each head group, K/V blocks go once around the ring; each rank folds every
    block into its (out, lse) state in place. Backward: K/V go around again with their dK/dV
    accumulators, which reach their owner after W steps."""

    @staticmethod
    def forward(ctx, query, key, value, group, is_causal, scale, layout_name, enable_gqa, bq, bk, batch,
                mask_mod, message_bytes, stats, sinks=None):
        rank, world, send_to, recv_from = _ranks(group)
        dtype = compute_dtype(query.dtype)
        layout = kernels.Layout(batch, query, key, enable_gqa)
        q4 = layout.queries(query.to(dtype))  # (Nb, r, Lr, E)
        k3 = layout.keys(key.to(dtype)).contiguous()  # (Nb, Sr, E)
        v3 = layout.keys(value.to(dtype)).contiguous()  # (Nb, Sr, Ev)
        Nb, Lr, Sr = q4.shape[0], q4.shape[2], k3.shape[1]
        scale_f = default_scale(scale, query.shape[-1])
        if mask_mod is None:
            steps = _CausalSteps(rank, world, Lr, Sr, layout_name, is_causal, scale_f, bq, bk, layout)
        else:
            steps = _MaskedSteps(rank, world, Lr, Sr, layout_name, mask_mod, scale_f, query.shape[0],
                                 query.shape[1], _native_everywhere(q4, k3, v3, group))
        out = q4.new_zeros(*q4.shape[:3], v3.shape[-1])  # (Nb, r, Lr, Ev), normalised
        lse = q4.new_full(q4.shape[:3], float("-inf"))  # (Nb, r, Lr), base 2: no key seen yet
        groups = _head_groups(Nb, Sr, max(k3.shape[-1], v3.shape[-1]), k3.element_size(), message_bytes)
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
                steps.forward(src, g, q_g, k_cur, v_cur, out_g, lse_g)
                if pending is not None:
                    _wait(pending[0], rank, recv_from, stats)
                    k_cur, v_cur = pending[1]
        sink_rows = None
        if sinks is not None:  # once, after the whole ring: the backward's steps then use (out', lse')
            sink_rows = sinks_.rows(sinks, layout, Lr, lse.dtype)  # (Nb, r, Lr)
            out, lse = sinks_.absorb(out, lse, sink_rows, base2=True)
        ctx.sinks = (sinks.dtype, sinks.shape[0], sink_rows) if sinks is not None else None
        ctx.save_for_backward(q4, k3, v3, out, lse)
        ctx.meta = (group, steps, groups, query.shape, key.shape, value.shape, layout, stats)
        return out.reshape(*layout.batch, Lr, v3.shape[-1]).to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q4, k3, v3, out, lse = ctx.saved_tensors
        group, steps, groups, q_shape, k_shape, v_shape, layout, stats = ctx.meta
        rank, world, send_to, recv_from = _ranks(group)
        dout = grad_out.to(q4.dtype).reshape(out.shape)
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
                steps.backward(src, g, dout_g, q_g, k_cur, v_cur, out_g, lse_g, delta_g, dq_g, dk_cur, dv_cur)
                if step < world - 1:
                    # pass dK/dV on with their block and take the next block's (the ranks before added
                    # their parts); milliseconds on this link against ~1 s of compute per step, so it
                    # is not overlapped
                    _wait(kv_next[0], rank, recv_from, stats)
                    k_cur, v_cur = kv_next[1]
                    dk_cur, dv_cur = _exchange_now([dk_cur, dv_cur], group, send_to, recv_from, rank,
                                                   grad_bufs.take(step, n_g), stats)
                elif world > 1:
                    # block src = rank + 1 is complete: back to its owner; this rank's own comes from rank - 1
                    requests = dist.batch_isend_irecv([
                        dist.P2POp(dist.isend, dk_cur, send_to, group), dist.P2POp(dist.isend, dv_cur, send_to, group),
                        dist.P2POp(dist.irecv, dk[g], recv_from, group), dist.P2POp(dist.irecv, dv[g], recv_from, group)])
                    _wait(requests, rank, recv_from, stats)
                # (one rank: dk[g], dv[g] already hold the result)
        dq_u = dq.reshape(*layout.batch, *q_shape[-2:]).sum_to_size(q_shape)
        dk_u = dk.reshape(*layout.kv_batch, *k_shape[-2:]).sum_to_size(k_shape)
        dv_u = dv.reshape(*layout.kv_batch, *v_shape[-2:]).sum_to_size(v_shape)
        dt = grad_out.dtype
        dsinks = None
        if ctx.sinks is not None:  # this rank's rows' share (the sink is replicated: sum it over the group)
            sink_dtype, H, sink_rows = ctx.sinks
            dsinks = sinks_.to_heads(sinks_.grad_rows(dout, out, lse, sink_rows, base2=True), layout, H).to(sink_dtype)
        return (dq_u.to(dt), dk_u.to(dt), dv_u.to(dt), None, None, None, None, None, None, None, None, None, None,
                None, dsinks)


def _native_everywhere(q4: Tensor, k3: Tensor, v3: Tensor, group) -> bool:
    """Whether every rank can run the native block-sparse kernels (:func:`attnlab.kernels.native.can_run`
    on each): one all-reduce, so that all ranks take the same path."""
    ok = native.can_run(q4, k3, v3)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def ring_attention(query: Tensor, key: Tensor, value: Tensor, *, group: Optional[dist.ProcessGroup] = None,
                   is_causal: bool = False, scale: Optional[float] = None, layout: str = "contiguous",
                   enable_gqa: bool = False, block_q: Optional[int] = None, block_k: Optional[int] = None,
                   mask_mod=None, message_bytes: int = MESSAGE_BYTES, stats: Optional[dict] = None,
                   sinks: Optional[Tensor] = None) -> Tensor:
    """Attention over a sequence split across the ranks of ``group`` (default: the world).

    Args:
        query: this rank's ``(B, H, L/W, E)`` slice (see :func:`attnlab.distributed.shard_sequence`).
        key: ``(B, Hkv, L/W, E)``, the same positions.
        value: ``(B, Hkv, L/W, Ev)``.
        group: the process group (gloo on CPU, NCCL on GPU); must be initialised.
        is_causal: causal over the *whole* sequence (absolute positions).
        scale: default ``1 / sqrt(E)``.
        layout: ``"contiguous"`` or ``"zigzag"`` (balanced causal work); as sharded.
        enable_gqa: grouped-query heads, as in SDPA.
        block_q: tile sizes of the local tiled kernel.
        block_k: as ``block_q``.
        mask_mod: a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over *absolute*
            positions of the whole sequence (e.g. :func:`attnlab.flex.document_mask` for packed
            documents, :func:`attnlab.flex.sliding_window`), instead of ``is_causal``. At each step a
            rank builds the block plan of its (query chunk, key chunk) pair and skips the empty
            blocks, so the time follows the mask's density. It is evaluated with ``b, h``
            broadcast (a mask that differs by batch or head is not supported here).
        message_bytes: about how large each message of key/value heads is (the ring's memory per
            rank is a few messages on top of its share of the results).
        stats: a dict; ``stats["comm_wait_s"]`` gets the seconds this rank waited on messages.
        sinks: ``(H,)``, a logit per query head in each row's softmax denominator, without a
            value (gpt-oss's attention sinks), the same on every rank; folded in once the ring has
            gone round. Its gradient on each rank is that rank's rows' share: sum it over the
            group, as for any parameter replicated across a sequence split.

    Returns:
        This rank's ``(B, H, L/W, Ev)`` slice of the output. Differentiable (the backward
        pass runs its own ring).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (gloo on CPU)")
    check_layout(layout)
    batch = validate(query, key, value, None, 0.0, is_causal, scale, enable_gqa, fn="ring_attention")
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"ring_attention: mask_mod must be a callable mask_mod(b, h, q_idx, kv_idx), got "
                        f"{type(mask_mod).__name__}")
    if mask_mod is not None and is_causal:
        raise ValueError("ring_attention: pass either is_causal=True or a mask_mod (fold causality into it, e.g. "
                         "attnlab.flex.and_masks(attnlab.flex.causal_mask, ...)), not both")
    if isinstance(message_bytes, bool) or not isinstance(message_bytes, int) or message_bytes < 1:
        raise ValueError(f"ring_attention: message_bytes must be a positive int, got {message_bytes!r}")
    if query.dim() != 4:
        raise ValueError(f"ring_attention: query must be (B, H, L/W, E), got {tuple(query.shape)}")
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(f"ring_attention: every rank must hold as many query as key rows (self-attention), got "
                         f"query {tuple(query.shape)} and key {tuple(key.shape)}")
    if layout == "zigzag" and query.shape[-2] % 2:
        raise ValueError(f"ring_attention: the zigzag layout needs an even local length, got {query.shape[-2]}")
    validate_sinks(sinks, query, "ring_attention")
    bq = kernels.block_size(block_q, dense.DEFAULT_BLOCK_Q, "block_q", "ring_attention")
    bk = kernels.block_size(block_k, dense.DEFAULT_BLOCK_K, "block_k", "ring_attention")
    return _Ring.apply(query, key, value, group, is_causal, scale, layout, enable_gqa, bq, bk, batch, mask_mod,
                       message_bytes, stats, sinks)
