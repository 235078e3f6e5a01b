"""Block masks: which (query block, key block) tiles an attention variant needs, computed once.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (``True`` = attend, FlexAttention's convention)
says which key each query may see. :func:`create_block_mask` evaluates it chunk by chunk
and sorts every ``(BLOCK_SIZE x BLOCK_SIZE)`` tile into

* **empty**: nothing visible, the kernels skip it;
* **full**: everything visible, no mask work at all;
* **partial**: its bits are kept, packed 8 to a byte, and applied to the scores.

Building it never holds an ``L x S`` tensor: ``mask_mod`` is called on one row of blocks
and at most :data:`CHUNK_KEYS` keys at a time (its index tensors broadcast to at most
``BLOCK_SIZE x CHUNK_KEYS``), so ``L = 65536`` builds in bounded memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["BlockMask", "create_block_mask", "EMPTY", "PARTIAL", "FULL", "CHUNK_KEYS", "MaskMod"]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
EMPTY, PARTIAL, FULL = 0, 1, 2
CHUNK_KEYS = 8192  # keys per mask_mod call: one row of blocks x 8192 keys = 1M bools at 128-row blocks
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _pack(bits: Tensor) -> Tensor:
    """``(..., n)`` bool with ``n % 8 == 0`` -> ``(..., n // 8)`` uint8, bit k of byte j = bits[8j + k]."""
    return (bits.view(*bits.shape[:-1], -1, 8).to(torch.uint8) * _BIT_WEIGHTS).sum(-1, dtype=torch.uint8)


def _unpack(packed: Tensor) -> Tensor:
    """The inverse of :func:`_pack`."""
    return ((packed.unsqueeze(-1) & _BIT_WEIGHTS) != 0).flatten(-2)


@dataclass
class BlockMask:
    """The blocks of a mask. Shapes: ``kinds (Bm, Hm, nq, nk)`` uint8 (EMPTY / PARTIAL / FULL),
    ``partial_index (Bm, Hm, nq, nk)`` int64 (row in ``bits``, -1 elsewhere), ``bits
    (n_partial, bq, bk // 8)`` uint8 packed. ``Bm``/``Hm`` are 1 where ``B``/``H`` was None
    (the mask broadcasts over batch or heads)."""

    kinds: Tensor
    partial_index: Tensor
    bits: Tensor
    Q_LEN: int
    KV_LEN: int
    BLOCK_SIZE: tuple[int, int]
    mask_mod: Optional[MaskMod] = None
    _rows: Optional[tuple[Tensor, Tensor, Tensor]] = field(default=None, repr=False, compare=False)

    def compressed_rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """The non-empty blocks as compressed rows, as the native kernels read them
        (package-internal, for :mod:`attnlab.flex.kernels`; computed once per mask).

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

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.kinds.shape[0], self.kinds.shape[1], self.Q_LEN, self.KV_LEN)

    def density(self) -> float:
        """The fraction of blocks that are computed (full or partial)."""
        return float((self.kinds != EMPTY).float().mean()) if self.kinds.numel() else 0.0

    def counts(self) -> dict[str, int]:
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
        return _unpack(self.bits[int(self.partial_index[b, h, i, j])])[:, :bk]

    def to_dense(self) -> Tensor:
        """``(Bm, Hm, Q_LEN, KV_LEN)`` bool: for tests and pictures of small masks only."""
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

    def __str__(self) -> str:
        """A picture of the blocks of batch 0, head 0 (``#`` full, ``+`` partial, ``.`` empty)."""
        Bm, Hm, nq, nk = self.kinds.shape
        c = self.counts()
        head = (f"BlockMask(Q_LEN={self.Q_LEN}, KV_LEN={self.KV_LEN}, BLOCK_SIZE={self.BLOCK_SIZE}, "
                f"shape=({Bm}, {Hm}, {nq}, {nk}) blocks, density={self.density():.3f}: {c['full']} full, "
                f"{c['partial']} partial, {c['empty']} empty)")
        if nq == 0 or nk == 0:
            return head
        step_q, step_k = max(1, math.ceil(nq / 32)), max(1, math.ceil(nk / 64))
        rows = []
        for i in range(0, nq, step_q):
            row = ""
            for j in range(0, nk, step_k):
                kinds = self.kinds[0, 0, i:i + step_q, j:j + step_k]
                row += "#" if bool((kinds == FULL).all()) else "." if bool((kinds == EMPTY).all()) else "+"
            rows.append("  " + row)
        legend = "  (# full, + partial, . empty" + (f"; one character per {step_q}x{step_k} blocks" if
                                                    step_q > 1 or step_k > 1 else "") + ")"
        return "\n".join([head, *rows, legend])

    __repr__ = __str__


def _block_size(BLOCK_SIZE) -> tuple[int, int]:
    if isinstance(BLOCK_SIZE, int):
        BLOCK_SIZE = (BLOCK_SIZE, BLOCK_SIZE)
    bq, bk = BLOCK_SIZE
    for name, v in (("BLOCK_SIZE[0]", bq), ("BLOCK_SIZE[1]", bk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 8 or v % 8:
            raise ValueError(f"create_block_mask: {name} must be a positive multiple of 8, got {v!r}")
    return bq, bk


def create_block_mask(mask_mod: MaskMod, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device=None, BLOCK_SIZE=128) -> BlockMask:
    """Evaluate ``mask_mod`` block by block (FlexAttention's ``create_block_mask``).

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend), called with int64
            index tensors that broadcast: ``b (1, 1, 1)``, ``h (1, 1, 1)``, ``q_idx (bq, 1)``,
            ``kv_idx (1, n)``. It must use tensor operations (``&``, ``|``, ``torch.where``, indexing).
        B, H: batch and head counts the mask depends on; None when it does not (broadcast).
        Q_LEN, KV_LEN: number of queries and keys.
        device: accepted for torch's signature; attnlab's block masks live on the CPU.
        BLOCK_SIZE: int or ``(q_block, kv_block)``, multiples of 8 (default 128).

    Returns:
        A :class:`BlockMask`; ``print`` it for a picture of its blocks and its density.
    """
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask: mask_mod must be callable, got {type(mask_mod).__name__}")
    for name, v in (("B", B), ("H", H)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"create_block_mask: {name} must be None or a positive int, got {v!r}")
    for name, v in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"create_block_mask: {name} must be an int >= 0, got {v!r}")
    bq, bk = _block_size(BLOCK_SIZE)
    Bm, Hm = B or 1, H or 1
    nq, nk = math.ceil(Q_LEN / bq), math.ceil(KV_LEN / bk)
    kinds = torch.zeros(Bm, Hm, nq, nk, dtype=torch.uint8)
    partial_index = torch.full((Bm, Hm, nq, nk), -1, dtype=torch.int64)
    packed: list[Tensor] = []
    chunk_blocks = max(1, CHUNK_KEYS // bk)
    for b in range(Bm):
        for h in range(Hm):
            b_idx = torch.full((1, 1), b, dtype=torch.int64)
            h_idx = torch.full((1, 1), h, dtype=torch.int64)
            for i in range(nq):
                q_idx = torch.arange(i * bq, (i + 1) * bq, dtype=torch.int64)[:, None]  # (bq, 1)
                q_valid = q_idx < Q_LEN
                for j0 in range(0, nk, chunk_blocks):
                    j1 = min(nk, j0 + chunk_blocks)
                    kv_idx = torch.arange(j0 * bk, j1 * bk, dtype=torch.int64)[None, :]  # (1, n)
                    valid = q_valid & (kv_idx < KV_LEN)  # (bq, n): padding past the lengths
                    # indices past the ends are clamped for the call (a mod may index a table)
                    keep = torch.as_tensor(mask_mod(b_idx, h_idx, q_idx.clamp(max=max(Q_LEN - 1, 0)),
                                                    kv_idx.clamp(max=max(KV_LEN - 1, 0))))
                    keep = keep.to(torch.bool).expand(bq, (j1 - j0) * bk) & valid
                    blocks = keep.view(bq, j1 - j0, bk).transpose(0, 1)  # (nb, bq, bk)
                    vblocks = valid.view(bq, j1 - j0, bk).transpose(0, 1)
                    n_on = blocks.sum((1, 2))
                    full = n_on == vblocks.sum((1, 2))
                    for jj in range(j1 - j0):
                        if n_on[jj] == 0:
                            continue  # EMPTY
                        if full[jj] and bool(vblocks[jj].all()):
                            kinds[b, h, i, j0 + jj] = FULL
                        else:
                            kinds[b, h, i, j0 + jj] = PARTIAL
                            partial_index[b, h, i, j0 + jj] = len(packed)
                            packed.append(_pack(blocks[jj]))
    bits = torch.stack(packed) if packed else torch.zeros(0, bq, bk // 8, dtype=torch.uint8)
    return BlockMask(kinds, partial_index, bits, Q_LEN, KV_LEN, (bq, bk), mask_mod)
