"""The blocks of a mask, built from a ``mask_mod`` a bounded chunk at a time (package-internal).

The block-sparse tile source (:mod:`attnlab.kernels.block_sparse`) visits only the
``(bq x bk)`` tiles a mask needs. This module sorts every tile into

* **empty**: nothing visible, the kernels skip it;
* **full**: everything visible, no mask work at all;
* **partial**: its bits are kept, packed 8 to a byte, and applied to the scores.

It is the kernel layer's, so that every caller builds plans the same way:
:func:`attnlab.flex.create_block_mask` wraps :class:`MaskBlocks` in torch's
``BlockMask`` API, and the ring builds one per (query chunk, key chunk) pair with
:func:`build` directly (it imports nothing of flex). Shapes::

    kinds          (Bm, Hm, nq, nk) uint8   EMPTY / PARTIAL / FULL
    partial_index  (Bm, Hm, nq, nk) int64   row of a partial block in ``bits``, -1 elsewhere
    bits           (n_partial, bq, ceil(bk / 8)) uint8, packed (bit k of byte j = column 8j + k)

``Bm`` / ``Hm`` are 1 where the mask broadcasts over batch or heads.

Building never holds an ``L x S`` tensor: ``mask_mod`` is called on a chunk of at most
:data:`CHUNK_ELEMENTS` elements (rows of blocks by at most :data:`CHUNK_KEYS` keys), and
every block of a chunk is classified at once. A mod that knows its blocks' kinds from the
block coordinates (``mask_mod.block_kinds``, attnlab.flex's own mods) has only the blocks
on an edge evaluated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

__all__: list[str] = []  # package-internal

EMPTY, PARTIAL, FULL = 0, 1, 2
CHUNK_KEYS = 8192  # keys per mask_mod call: one row of blocks x 8192 keys = 1M bools at 128-row blocks
# elements per mask_mod call. A chunk whose int64 temporaries stay in cache evaluates 3-4x faster:
# (q >= k) & (q - k < w) took 4.5 ns per element over 4 Mi elements, 1.5 over 1 Mi, 1.0 over
# 128 Ki (2026-12-01, the 2-core Zen 4 EPYC); below that the per-call overhead grows.
CHUNK_ELEMENTS = 1 << 20
BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def pack_bits(bits: Tensor) -> Tensor:
    """``(..., n)`` bool -> ``(..., ceil(n / 8))`` uint8, bit k of byte j = bits[8j + k] (padding: 0)."""
    pad = -bits.shape[-1] % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(*bits.shape[:-1], pad)], dim=-1)
    return (bits.reshape(*bits.shape[:-1], -1, 8).to(torch.uint8) * BIT_WEIGHTS).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: Tensor) -> Tensor:
    """The inverse of :func:`pack_bits`: ``(..., m)`` uint8 -> ``(..., 8 m)`` bool."""
    return ((packed.unsqueeze(-1) & BIT_WEIGHTS) != 0).flatten(-2)


@dataclass
class MaskBlocks:
    """The blocks of a mask (shapes in the module's docstring), as the kernels read them."""

    kinds: Tensor
    partial_index: Tensor
    bits: Tensor
    Q_LEN: int
    KV_LEN: int
    BLOCK_SIZE: tuple[int, int]
    _rows: Optional[tuple[Tensor, Tensor, Tensor]] = field(default=None, repr=False, compare=False, kw_only=True)

    def compressed_rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """The non-empty blocks as compressed rows, as the native kernels read them (computed once).

        Returns ``row_ptr (Bm * Hm * nq + 1,)``, ``cols (nnz,)`` and ``bit_idx (nnz,)``, all
        int64: the blocks of plane ``p = b * Hm + h``, query block ``i`` are entries
        ``row_ptr[p * nq + i] .. row_ptr[p * nq + i + 1]``, with key block ``cols[e]``
        (ascending) and its tile in :attr:`bits` (``bit_idx[e]``), or -1 for a full block.
        """
        if self._rows is None:
            Bm, Hm, nq, nk = self.kinds.shape
            visited = (self.kinds != EMPTY).reshape(Bm * Hm * nq, nk)  # (rows, nk)
            counts = visited.sum(dim=1)
            row_ptr = torch.zeros(Bm * Hm * nq + 1, dtype=torch.int64)
            torch.cumsum(counts, dim=0, out=row_ptr[1:])
            rows, cols = visited.nonzero(as_tuple=True)  # row-major: ascending key blocks in each row
            bit_idx = self.partial_index.reshape(Bm * Hm * nq, nk)[rows, cols]
            self._rows = (row_ptr, cols.contiguous(), bit_idx.contiguous())
        return self._rows

    def is_empty(self) -> bool:
        """Nothing is visible anywhere (the kernels have no block to visit)."""
        return not bool((self.kinds != EMPTY).any())

    def density(self) -> float:
        """The fraction of blocks that are computed (full or partial)."""
        return float((self.kinds != EMPTY).float().mean()) if self.kinds.numel() else 0.0

    def counts(self) -> dict[str, int]:
        """How many blocks of each kind: ``{"empty": n, "partial": n, "full": n}``."""
        return {name: int((self.kinds == k).sum()) for name, k in (("empty", EMPTY), ("partial", PARTIAL),
                                                                   ("full", FULL))}

    def tile(self, b: int, h: int, i: int, j: int) -> Optional[Tensor]:
        """The ``(bq, bk)`` bool tile of block ``(i, j)`` (True = attend); None when it is full."""
        kind = int(self.kinds[b, h, i, j])
        bq, bk = self.BLOCK_SIZE
        if kind == FULL:
            return None
        if kind == EMPTY:
            return torch.zeros(bq, bk, dtype=torch.bool)
        return unpack_bits(self.bits[int(self.partial_index[b, h, i, j])])[:, :bk]

    def element_mask(self) -> Tensor:
        """``(Bm, Hm, Q_LEN, KV_LEN)`` bool, True = attend, from the stored blocks: for the eager
        paths, tests and pictures of small masks."""
        Bm, Hm, nq, nk = self.kinds.shape
        bq, bk = self.BLOCK_SIZE
        out = torch.zeros(Bm, Hm, nq * bq, nk * bk, dtype=torch.bool)
        for b in range(Bm):
            for h in range(Hm):
                for i in range(nq):
                    for j in range(nk):
                        t = self.tile(b, h, i, j)
                        out[b, h, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk] = True if t is None else t
        return out[..., :self.Q_LEN, :self.KV_LEN]


class _Builder:
    """Sorts the blocks of ``(Bm, Hm)`` planes into kinds, a bounded chunk at a time.

    Each chunk is ``R`` rows of query blocks by up to :data:`CHUNK_KEYS` keys (at most
    :data:`CHUNK_ELEMENTS` elements): one ``mask_mod`` call, then ``any`` / ``all`` over each
    block's rows and columns at once; only the partial blocks are packed. A block that runs
    past ``Q_LEN`` or ``KV_LEN`` is never full (its padding does not attend), as in torch.
    """

    def __init__(self, mask_mod, Bm, Hm, Q_LEN, KV_LEN, bq, bk, separate_full_blocks: bool) -> None:
        self.mod, self.Q_LEN, self.KV_LEN, self.bq, self.bk = mask_mod, Q_LEN, KV_LEN, bq, bk
        self.separate = separate_full_blocks
        self.nq, self.nk = math.ceil(Q_LEN / bq), math.ceil(KV_LEN / bk)
        self.kinds = torch.zeros(Bm, Hm, self.nq, self.nk, dtype=torch.uint8)
        self.partial_index = torch.full((Bm, Hm, self.nq, self.nk), -1, dtype=torch.int64)
        # the partial blocks' bits, in one buffer that doubles when full, not a list of small
        # tensors (one run with the list grew the peak by 2.1 GiB for a sliding window at
        # L = 65536, this buffer by 71 MiB; a later run of the list did not repeat it, so the
        # cause is not pinned down; the buffer allocates less either way; 2026-12-01)
        self.bits = torch.zeros(64, bq, -(-bk // 8), dtype=torch.uint8)
        self.count = 0
        # blocks wholly inside (Q_LEN, KV_LEN): the only ones that can be full
        self.rows_inside = (torch.arange(1, self.nq + 1) * bq <= Q_LEN)  # (nq,)
        self.cols_inside = (torch.arange(1, self.nk + 1) * bk <= KV_LEN)  # (nk,)

    def _call(self, b: int, h: int, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The mod's bools at these (broadcasting) indices, False past the lengths; indices past
        the ends are clamped for the call (a mod may index a table with them)."""
        b_idx = torch.full((1, 1), b, dtype=torch.int64)
        h_idx = torch.full((1, 1), h, dtype=torch.int64)
        beyond = bool(q_idx.max() >= self.Q_LEN) or bool(kv_idx.max() >= self.KV_LEN)
        if beyond:
            q_idx, kv_idx = q_idx.clamp(max=max(self.Q_LEN - 1, 0)), kv_idx.clamp(max=max(self.KV_LEN - 1, 0))
        keep = torch.as_tensor(self.mod(b_idx, h_idx, q_idx, kv_idx))
        if keep.dtype != torch.bool:
            raise TypeError(f"create_block_mask: mask_mod must return a bool tensor (True = attend), got dtype "
                            f"{keep.dtype}: compare instead (q_idx >= kv_idx), or combine bools with & and |; a "
                            "float belongs in a score_mod")
        keep = keep.expand(torch.broadcast_shapes(q_idx.shape, kv_idx.shape, keep.shape))
        return keep & (q_idx < self.Q_LEN) & (kv_idx < self.KV_LEN) if beyond else keep

    def _store(self, b: int, h: int, rows: Tensor, cols: Tensor, any_on: Tensor, all_on: Tensor, blocks) -> None:
        """Record the kinds of the blocks at ``(rows, cols)`` from whether any / all of each
        attends, and pack the partial ones (``blocks(mask) -> (n, bq, bk)`` gives their bits)."""
        all_on = all_on & self.rows_inside[rows] & self.cols_inside[cols]
        full = all_on if self.separate else torch.zeros_like(all_on)
        partial = any_on & ~full
        self.kinds[b, h, rows, cols] = torch.where(full, FULL, torch.where(partial, PARTIAL, EMPTY)).to(torch.uint8)
        n = int(partial.sum())
        if n:
            if self.count + n > self.bits.shape[0]:
                grown = self.bits.new_zeros(max(2 * self.bits.shape[0], self.count + n), *self.bits.shape[1:])
                grown[:self.count] = self.bits[:self.count]
                self.bits = grown
            self.bits[self.count:self.count + n] = pack_bits(blocks(partial))
            self.partial_index[b, h, rows[partial], cols[partial]] = torch.arange(self.count, self.count + n)
            self.count += n

    def every_element(self, b: int, h: int) -> None:
        """A plain mask_mod: called on every element, a chunk of rows of blocks at a time."""
        bq, bk = self.bq, self.bk
        blocks_per_call = max(1, min(self.nk, CHUNK_KEYS // bk, CHUNK_ELEMENTS // (bq * bk)))
        rows_per_call = max(1, CHUNK_ELEMENTS // (bq * bk * blocks_per_call))
        for i0 in range(0, self.nq, rows_per_call):
            i1 = min(self.nq, i0 + rows_per_call)
            q_idx = torch.arange(i0 * bq, i1 * bq, dtype=torch.int64)[:, None]  # (R * bq, 1)
            for j0 in range(0, self.nk, blocks_per_call):
                j1 = min(self.nk, j0 + blocks_per_call)
                kv_idx = torch.arange(j0 * bk, j1 * bk, dtype=torch.int64)[None, :]  # (1, C * bk)
                keep = self._call(b, h, q_idx, kv_idx).reshape(i1 - i0, bq, j1 - j0, bk)  # (R, bq, C, bk)
                rows = torch.arange(i0, i1).repeat_interleave(j1 - j0)  # (R * C,) block coordinates
                cols = torch.arange(j0, j1).repeat(i1 - i0)
                # any / all as max / min of the bytes: 6x faster than bool any/all here (0.26 against
                # 1.7 ms for 4 Mi elements, 2026-12-01, the 2-core Zen 4 EPYC)
                bytes_ = keep.contiguous().view(torch.uint8)
                any_on = bytes_.amax(dim=3).amax(dim=1).reshape(-1).bool()  # (R * C,)
                all_on = bytes_.amin(dim=3).amin(dim=1).reshape(-1).bool()

                def blocks(partial, keep=keep, rows=rows, cols=cols, i0=i0, j0=j0):
                    return keep[rows[partial] - i0, :, cols[partial] - j0, :]  # (n, bq, bk), the partial ones only
                self._store(b, h, rows, cols, any_on, all_on, blocks)

    def candidates(self, b: int, h: int, kinds: Tensor) -> None:
        """A mod that knows its block kinds (``mask_mod.block_kinds``, attnlab.flex's own mods):
        ``kinds (nq, nk)`` is exact for EMPTY and FULL, and PARTIAL means "look": only those
        blocks, and full ones past the lengths, are evaluated, a bounded batch at a time."""
        bq, bk = self.bq, self.bk
        edge = ~(self.rows_inside[:, None] & self.cols_inside[None, :])  # (nq, nk)
        full = (kinds == FULL) & ~edge
        self.kinds[b, h] = torch.where(full, FULL if self.separate else PARTIAL, EMPTY).to(torch.uint8)
        if not self.separate:  # every non-empty block is partial: evaluate the full ones too
            full = torch.zeros_like(full)
        look_rows, look_cols = ((kinds == PARTIAL) | ((kinds == FULL) & ~full)).nonzero(as_tuple=True)
        per_call = max(1, CHUNK_ELEMENTS // (bq * bk))
        for start in range(0, look_rows.numel(), per_call):
            rows, cols = look_rows[start:start + per_call], look_cols[start:start + per_call]
            q_idx = (rows * bq)[:, None, None] + torch.arange(bq)[None, :, None]  # (n, bq, 1)
            kv_idx = (cols * bk)[:, None, None] + torch.arange(bk)[None, None, :]  # (n, 1, bk)
            keep = self._call(b, h, q_idx, kv_idx)  # (n, bq, bk)
            self._store(b, h, rows, cols, keep.any(dim=2).any(dim=1), keep.all(dim=2).all(dim=1),
                        lambda partial, keep=keep: keep[partial])


def build(mask_mod: MaskMod, Bm: int, Hm: int, Q_LEN: int, KV_LEN: int, bq: int, bk: int,
          separate_full_blocks: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """``(kinds, partial_index, bits)`` of ``mask_mod`` over ``(Bm, Hm, Q_LEN, KV_LEN)`` in
    ``(bq, bk)`` blocks (arguments already checked by the caller). ``separate_full_blocks=False``
    stores every non-empty block as partial, as torch's argument of that name."""
    builder = _Builder(mask_mod, Bm, Hm, Q_LEN, KV_LEN, bq, bk, separate_full_blocks)
    analytic = getattr(mask_mod, "block_kinds", None)
    candidates = analytic(bq, bk, builder.nq, builder.nk) if analytic is not None else None
    for b in range(Bm):
        for h in range(Hm):
            if candidates is not None:
                builder.candidates(b, h, candidates)
            else:
                builder.every_element(b, h)
    return builder.kinds, builder.partial_index, builder.bits[:builder.count].clone()


def of_mask_mod(mask_mod: MaskMod, Q_LEN: int, KV_LEN: int, block: int) -> MaskBlocks:
    """The :class:`MaskBlocks` of a mask_mod that broadcasts over batch and heads, in square
    ``block`` tiles: what the ring builds for each (query chunk, key chunk) pair."""
    kinds, partial_index, bits = build(mask_mod, 1, 1, Q_LEN, KV_LEN, block, block)
    return MaskBlocks(kinds, partial_index, bits, Q_LEN, KV_LEN, (block, block))
