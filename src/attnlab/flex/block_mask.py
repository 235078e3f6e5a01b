"""Block masks: which (query block, key block) tiles an attention variant needs, computed once.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (``True`` = attend, FlexAttention's convention)
says which key each query may see. :func:`create_block_mask` evaluates it chunk by chunk
and sorts every ``(BLOCK_SIZE x BLOCK_SIZE)`` tile into

* **empty**: nothing visible, the kernels skip it;
* **full**: everything visible, no mask work at all;
* **partial**: its bits are kept, packed 8 to a byte, and applied to the scores.

Building it never holds an ``L x S`` tensor: ``mask_mod`` is called on a bounded chunk at a
time (rows of blocks by at most :data:`CHUNK_KEYS` keys, :data:`CHUNK_ELEMENTS` elements),
and every block of a chunk is classified at once (``any`` / ``all`` over its rows and
columns), so peak memory follows the chunk, not ``L``. attnlab's own mods
(:mod:`attnlab.flex.mods`) know their blocks' kinds from the block coordinates
(``mask_mod.block_kinds``): only the blocks on an edge are evaluated then. The building is
the kernel layer's (:mod:`attnlab.kernels.mask_blocks`, which the ring uses too); this module
adds torch's API and its argument checks.

:class:`BlockMask` also has torch's attributes and methods, with torch's meanings
(``torch.nn.attention.flex_attention.BlockMask``, 2.13): ``kv_num_blocks``/``kv_indices``
(the partial blocks of each query block row), ``full_kv_num_blocks``/``full_kv_indices``,
their ``q_*`` transposes, ``seq_lengths``, ``to_dense()`` (the ``(B, H, nq, nk)`` int32 block
map), ``sparsity()``, ``numel()``, ``to_string()``, ``as_tuple()``, indexing,
``from_kv_blocks``, ``_adjust`` and ``.to``; :func:`create_mask` gives the element mask.
"""

from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from attnlab._validation import describe_signature, takes_arguments
from attnlab.kernels import mask_blocks
from attnlab.kernels.mask_blocks import (CHUNK_ELEMENTS, CHUNK_KEYS, EMPTY, FULL, PARTIAL, MaskBlocks, pack_bits)

__all__ = ["BlockMask", "create_block_mask", "create_mask", "EMPTY", "PARTIAL", "FULL", "CHUNK_KEYS", "CHUNK_ELEMENTS",
           "MaskMod"]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# the block building, the kinds and the bit packing are the kernel layer's (attnlab.kernels.mask_blocks)


@dataclass
class BlockMask(MaskBlocks):
    """The blocks of a mask (:class:`attnlab.kernels.mask_blocks.MaskBlocks`, with torch's API). Shapes: ``kinds (Bm, Hm, nq, nk)`` uint8 (EMPTY / PARTIAL / FULL),
    ``partial_index (Bm, Hm, nq, nk)`` int64 (row in ``bits``, -1 elsewhere), ``bits
    (n_partial, bq, ceil(bk / 8))`` uint8 packed. ``Bm``/``Hm`` are 1 where ``B``/``H`` was None
    (the mask broadcasts over batch or heads).

    torch's view of the same blocks (computed on first use, int32, as torch's
    ``create_block_mask`` builds them: ``partial`` = some but not all of a block attends)::

        kv_num_blocks (Bm, Hm, nq)       partial blocks per query block row
        kv_indices    (Bm, Hm, nq, nk)   their key block indices first (ascending), then the rest
        full_kv_num_blocks, full_kv_indices   the same for full blocks
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices   the same per key block column
    """

    mask_mod: Optional[MaskMod] = None
    _ordered: dict = field(default_factory=dict, repr=False, compare=False)
    # built by from_kv_blocks without full blocks: torch's full_* attributes are then None (issue 63)
    _no_full: bool = field(default=False, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.kinds.shape[0], self.kinds.shape[1], self.Q_LEN, self.KV_LEN)

    # ------------------------------------------------------------------ torch's attributes
    @property
    def seq_lengths(self) -> tuple[int, int]:
        """``(Q_LEN, KV_LEN)``; assignable, as torch's (decoding loops set it on a sliced mask)."""
        return (self.Q_LEN, self.KV_LEN)

    @seq_lengths.setter
    def seq_lengths(self, value: tuple[int, int]) -> None:
        self.Q_LEN, self.KV_LEN = (int(v) for v in value)

    def _blocks(self, name: str) -> tuple[Tensor, Tensor]:
        if name not in self._ordered:
            kind = FULL if name.startswith("full_") else PARTIAL
            dense = self.kinds == kind  # (Bm, Hm, nq, nk)
            self._ordered[name] = _dense_to_ordered(dense.transpose(-2, -1) if "q_" in name else dense)
        return self._ordered[name]

    kv_num_blocks = property(lambda self: self._blocks("kv")[0],
                             doc="``(Bm, Hm, nq)`` int32: partial blocks in each query block row")
    kv_indices = property(lambda self: self._blocks("kv")[1],
                          doc="``(Bm, Hm, nq, nk)`` int32: their key blocks first, then the others")
    full_kv_num_blocks = property(lambda self: None if self._no_full else self._blocks("full_kv")[0],
                                  doc="``(Bm, Hm, nq)`` int32: full blocks (None, as torch's, where "
                                      "``from_kv_blocks`` was given none)")
    full_kv_indices = property(lambda self: None if self._no_full else self._blocks("full_kv")[1],
                               doc="``(Bm, Hm, nq, nk)`` int32")
    q_num_blocks = property(lambda self: self._blocks("q_")[0], doc="``(Bm, Hm, nk)``: partial blocks per key block")
    q_indices = property(lambda self: self._blocks("q_")[1], doc="``(Bm, Hm, nk, nq)`` int32")
    full_q_num_blocks = property(lambda self: None if self._no_full else self._blocks("full_q_")[0],
                                 doc="``(Bm, Hm, nk)`` int32")
    full_q_indices = property(lambda self: None if self._no_full else self._blocks("full_q_")[1],
                              doc="``(Bm, Hm, nk, nq)`` int32")
    # torch's deterministic-backward metadata: attnlab's backward is deterministic without it
    dq_write_order = dq_write_order_full = dq_kv_order = dq_kv_order_spt = None

    def to_dense(self) -> Tensor:
        """torch's meaning: the ``(Bm, Hm, nq, nk)`` int32 block map, 1 where a block is computed
        (partial or full). The element mask is :func:`create_mask` (or :meth:`element_mask`)."""
        return (self.kinds != EMPTY).to(torch.int32)

    def numel(self) -> int:
        """The elements of :attr:`shape`, sparsity not counted (torch's)."""
        return math.prod(self.shape)

    def sparsity(self) -> float:
        """torch's: the percentage of the ``numel()`` elements whose blocks are skipped
        (computed blocks count whole, padding included)."""
        blocks = int(self.kv_num_blocks.sum()) + int(self._blocks("full_kv")[0].sum())  # torch counts these
        computed = blocks * self.BLOCK_SIZE[0] * self.BLOCK_SIZE[1]
        return 100 * (1 - computed / self.numel()) if self.numel() else 0.0

    def to_string(self, grid_size: Union[int, tuple[int, int]] = (20, 20), limit: int = 4) -> str:
        """torch's picture of the block map, one per (batch, head) up to ``limit``: ``█`` computed,
        ``░`` partly, space skipped, each cell a group of blocks; ``grid_size=-1``: every block."""
        dense = self.to_dense()
        *batch, rows, cols = dense.shape
        if grid_size == -1:
            max_rows, max_cols = rows, cols
        elif isinstance(grid_size, int):
            max_rows = max_cols = grid_size
        else:
            max_rows, max_cols = grid_size
        row_step, col_step = max(1, -(-rows // max_rows)), max(1, -(-cols // max_cols))
        out = []
        for n, index in enumerate(itertools.product(*[range(d) for d in batch])):
            if n == limit:
                out += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                        "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
                break
            vis = f"{index}\n"
            plane = dense[index]
            for r in range(0, rows, row_step):
                for c in range(0, cols, col_step):
                    share = plane[r:r + row_step, c:c + col_step].float().mean().item()
                    vis += ("█" if share == 1 else " " if share == 0 else "░") * 2
                vis += "\n"
            out.append(vis)
        return "\n".join(out)

    def as_tuple(self, flatten: bool = True) -> tuple[Any, ...]:
        """torch's tuple: seq_lengths, the eight block tensors, the four dQ-order fields (None
        here), BLOCK_SIZE and mask_mod; ``flatten`` spreads the two pairs."""
        lengths = self.seq_lengths if flatten else (self.seq_lengths,)
        block = self.BLOCK_SIZE if flatten else (self.BLOCK_SIZE,)
        return (*lengths, self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices,
                self.dq_write_order, self.dq_write_order_full, self.dq_kv_order, self.dq_kv_order_spt,
                *block, self.mask_mod)

    def __getitem__(self, index) -> "BlockMask":
        """torch's indexing over (batch, head, query block): an int keeps its dim (length 1), as
        torch's does; ``seq_lengths`` stay; the new mask's ``mask_mod`` raises if called (set
        your own, e.g. one offset for decoding). The stored bits are shared, so attnlab's
        kernels can run the sliced mask."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"BlockMask: index over at most (batch, head, query block), got {len(index)} entries")
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        sizes = self.kinds.shape[:3]
        index = tuple((slice(i + n, i + n + 1) if -n <= i < 0 else slice(i, i + 1)) if isinstance(i, int) else i
                      for i, n in zip(padded, sizes))
        return BlockMask(self.kinds[index], self.partial_index[index], self.bits, self.Q_LEN, self.KV_LEN,
                         self.BLOCK_SIZE, _sliced_mask_mod, _no_full=self._no_full)

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """torch's: the blocks cut to ``(new_q_len, new_kv_len)``, with torch's own recount of
        each row's blocks (``_adjust_num_blocks_and_indices``: it keeps the entries whose block
        index is below the old count, clamped to the new column count), so the result equals
        torch's block for block. A block that changes kind gets all-attend bits (it was full)
        or none (it was empty)."""
        bq, bk = self.BLOCK_SIZE
        rows, cols = -(-new_q_len // bq), -(-new_kv_len // bk)
        maps, ordered = [], {}
        for name in ("kv", "full_kv"):
            num, idx = self._blocks(name)
            idx, num = idx[:, :, :rows, :cols], num[:, :, :rows]
            num = torch.where(num < cols, num, cols)
            num = (idx < num[..., None]).sum(-1).to(torch.int32)  # torch's recount, as it is written
            ordered[name] = (num.contiguous(), idx.contiguous())  # kept as torch has them (an entry may be >= cols)
            maps.append(_ordered_to_dense(num, idx, cols).bool())
        partial, full = maps
        kinds = torch.where(full, FULL, torch.where(partial, PARTIAL, EMPTY)).to(torch.uint8)
        old = self.kinds[:, :, :rows, :cols]
        partial_index = torch.where(kinds == PARTIAL, self.partial_index[:, :, :rows, :cols], -1)
        bits = self.bits
        changed = ((kinds == PARTIAL) & (old != PARTIAL)).nonzero().tolist()
        if changed:
            extra = torch.stack([pack_bits(torch.full((bq, bk), bool(old[b, h, i, j] == FULL))) for b, h, i, j in changed])
            for n, (b, h, i, j) in enumerate(changed):
                partial_index[b, h, i, j] = bits.shape[0] + n
            bits = torch.cat([bits, extra])
        adjusted = BlockMask(kinds, partial_index, bits, new_q_len, new_kv_len, self.BLOCK_SIZE, self.mask_mod,
                             _no_full=self._no_full)
        adjusted._ordered.update(ordered)
        return adjusted

    def to(self, device) -> "BlockMask":
        """attnlab's block masks live on the CPU: ``.to("cpu")`` returns the mask; another
        device raises ``NotImplementedError``."""
        if torch.device(device).type != "cpu":
            raise NotImplementedError(f"BlockMask.to: attnlab's block masks and kernels run on the CPU only, got "
                                      f"device {device!r}")
        return self

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Optional[Tensor] = None,
                       full_kv_indices: Optional[Tensor] = None, BLOCK_SIZE=128, mask_mod: Optional[MaskMod] = None,
                       seq_lengths: Optional[tuple[int, int]] = None, compute_q_blocks: bool = True,
                       **dq_order) -> "BlockMask":
        """torch's constructor from the kv block lists. The partial blocks' bits come from
        ``mask_mod`` (None: every element of a partial block attends, as torch's ``noop_mask``),
        evaluated on those blocks only. ``compute_q_blocks`` is accepted (attnlab derives the
        ``q_*`` views on use); torch's dQ write-order arguments raise ``NotImplementedError``."""
        if any(v is not None and v is not False for v in dq_order.values()):
            raise NotImplementedError(f"BlockMask.from_kv_blocks: attnlab does not take {sorted(dq_order)} "
                                      f"(its backward is deterministic without them)")
        if kv_indices.dim() < 2:
            raise RuntimeError("BlockMask must have at least 2 dimensions")
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("BlockMask.from_kv_blocks: give full_kv_num_blocks and full_kv_indices together, or neither")
        bq, bk = _block_size(BLOCK_SIZE, "BlockMask.from_kv_blocks")
        nq, nk = kv_indices.shape[-2:]
        Q_LEN, KV_LEN = seq_lengths if seq_lengths is not None else (nq * bq, nk * bk)
        partial = _ordered_to_dense(kv_num_blocks, kv_indices, nk)  # (..., nq, nk)
        full = (_ordered_to_dense(full_kv_num_blocks, full_kv_indices, nk) if full_kv_num_blocks is not None
                else torch.zeros_like(partial))
        partial, full = (t.reshape(-1, *t.shape[-3:]) if t.dim() >= 3 else t.reshape(1, 1, nq, nk)
                         for t in (partial, full))  # (Bm, Hm, nq, nk)
        kinds = torch.where(full.bool(), FULL, torch.where(partial.bool(), PARTIAL, EMPTY)).to(torch.uint8)
        mod = mask_mod if mask_mod is not None else _noop
        partial_index = torch.full(kinds.shape, -1, dtype=torch.int64)
        packed = []
        for b, h, i, j in (kinds == PARTIAL).nonzero().tolist():
            q_idx = torch.arange(i * bq, (i + 1) * bq)[:, None]
            kv_idx = torch.arange(j * bk, (j + 1) * bk)[None, :]
            valid = (q_idx < Q_LEN) & (kv_idx < KV_LEN)
            keep = torch.as_tensor(mod(torch.tensor(b), torch.tensor(h), q_idx.clamp(max=max(Q_LEN - 1, 0)),
                                       kv_idx.clamp(max=max(KV_LEN - 1, 0)))).to(torch.bool).expand(bq, bk) & valid
            partial_index[b, h, i, j] = len(packed)
            packed.append(pack_bits(keep))
        bits = torch.stack(packed) if packed else torch.zeros(0, bq, -(-bk // 8), dtype=torch.uint8)
        return cls(kinds, partial_index, bits, int(Q_LEN), int(KV_LEN), (bq, bk), mask_mod,
                   _no_full=full_kv_num_blocks is None)

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


def _block_size(BLOCK_SIZE, fn: str = "create_block_mask") -> tuple[int, int]:
    """``(q_block, kv_block)`` from an int or a pair of positive ints (torch takes any, 4 included)."""
    if isinstance(BLOCK_SIZE, int) and not isinstance(BLOCK_SIZE, bool):
        BLOCK_SIZE = (BLOCK_SIZE, BLOCK_SIZE)
    if not isinstance(BLOCK_SIZE, (tuple, list)) or len(BLOCK_SIZE) != 2:
        raise ValueError(f"{fn}: BLOCK_SIZE must be an int or a (q_block, kv_block) pair, got {BLOCK_SIZE!r}")
    bq, bk = BLOCK_SIZE
    for name, v in (("BLOCK_SIZE[0]", bq), ("BLOCK_SIZE[1]", bk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{fn}: {name} must be a positive int, got {v!r}")
    return bq, bk


def _noop(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return torch.ones_like(q_idx - kv_idx, dtype=torch.bool)


def _sliced_mask_mod(b, h, q_idx, kv_idx):
    raise RuntimeError("this BlockMask was sliced (block_mask[...]), so its mask_mod no longer matches its blocks; "
                       "set block_mask.mask_mod to one for the slice (e.g. with the query offset added)")


def _dense_to_ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """torch's ``(num_blocks, indices)`` of a 0/1 block map: the count per row, and the present
    columns first (ascending), then the absent ones, int32."""
    dense = dense.to(torch.int32)
    return (dense.sum(-1).to(torch.int32).contiguous(),
            torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32).contiguous())


def _ordered_to_dense(num_blocks: Tensor, indices: Tensor, n_cols: int) -> Tensor:
    """The inverse: ``(..., rows, n_cols)`` int32, 1 at the first ``num_blocks`` indices of each row."""
    present = torch.arange(indices.shape[-1]) < num_blocks.unsqueeze(-1).to(torch.int64)
    dense = torch.zeros(*indices.shape[:-1], n_cols + 1, dtype=torch.int32)
    dense.scatter_(-1, torch.where(present, indices.to(torch.int64), n_cols), 1)  # absent ones: the spare column
    return dense[..., :n_cols]


def create_mask(mod_fn: Callable, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                device=None) -> Tensor:
    """torch's ``create_mask``: the element mask ``(B or 1, H or 1, Q_LEN, KV_LEN)`` bool
    (True = attend) of a mask_mod, or of a score_mod (five arguments: where its score is not -inf).

    The mod is called once on broadcasting int64 indices ``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``,
    ``q_idx (1, 1, Q_LEN, 1)``, ``kv_idx (1, 1, 1, KV_LEN)``: an ``L x S`` tensor, for small masks.
    """
    if not callable(mod_fn):
        raise TypeError(f"create_mask: mod_fn must be a callable mask_mod or score_mod, got {type(mod_fn).__name__}")
    if device is not None and torch.device(device).type != "cpu":
        raise NotImplementedError(f"create_mask: attnlab builds masks on the CPU only, got device {device!r}")
    B, H = B or 1, H or 1
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q_idx = torch.arange(Q_LEN).view(1, 1, Q_LEN, 1)
    kv_idx = torch.arange(KV_LEN).view(1, 1, 1, KV_LEN)
    if _arity(mod_fn) == 5:  # a score_mod: masked where it gives -inf
        out = mod_fn(torch.zeros(B, H, Q_LEN, KV_LEN), b, h, q_idx, kv_idx)
        return ~torch.isneginf(torch.as_tensor(out)).expand(B, H, Q_LEN, KV_LEN)
    return torch.as_tensor(mod_fn(b, h, q_idx, kv_idx)).to(torch.bool).expand(B, H, Q_LEN, KV_LEN).clone()


def _arity(fn: Callable) -> int:
    """Positional parameters without defaults (torch tells mask_mods from score_mods this way)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 4
    return sum(p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params)


def create_block_mask(mask_mod: MaskMod, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device=None, BLOCK_SIZE=128, _compile: bool = False, separate_full_blocks: bool = True,
                      compute_dq_write_order: bool = False, dq_kv_order: bool = True) -> BlockMask:
    """Evaluate ``mask_mod`` block by block (FlexAttention's ``create_block_mask``).

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend), called with int64
            index tensors that broadcast: ``b (1, 1, 1)``, ``h (1, 1, 1)``, ``q_idx (bq, 1)``,
            ``kv_idx (1, n)``. It must use tensor operations (``&``, ``|``, ``torch.where``, indexing).
        B: the batch count the mask depends on; None when it does not (broadcast).
        H: the head count the mask depends on; None when it does not (broadcast).
        Q_LEN: the number of queries.
        KV_LEN: the number of keys.
        device: None or a CPU device (attnlab's block masks live on the CPU; another device
            raises ``NotImplementedError``).
        BLOCK_SIZE: int or ``(q_block, kv_block)``, positive (default 128).
        _compile: accepted and ignored (nothing is compiled here).
        separate_full_blocks: torch's: False stores every non-empty block as partial (its bits
            applied), True (default) keeps full blocks apart.
        compute_dq_write_order: torch's deterministic-backward metadata; attnlab's
            backward is deterministic without it, and ``compute_dq_write_order=True`` raises
            ``NotImplementedError``.
        dq_kv_order: torch's too; accepted, unused.

    Returns:
        A :class:`BlockMask`; ``print`` it for a picture of its blocks and its density.
    """
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask: mask_mod must be callable, got {type(mask_mod).__name__}")
    if not takes_arguments(mask_mod, 4):
        raise TypeError(f"create_block_mask: mask_mod must take four arguments, mask_mod(b, h, q_idx, kv_idx) -> bool "
                        f"(FlexAttention's signature), got {describe_signature(mask_mod)}")
    for name, v in (("B", B), ("H", H)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"create_block_mask: {name} must be None or a positive int, got {v!r}")
    for name, v in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"create_block_mask: {name} must be an int >= 0, got {v!r}")
    if device is not None and torch.device(device).type != "cpu":
        raise NotImplementedError(f"create_block_mask: attnlab's block masks live on the CPU, got device {device!r}")
    if compute_dq_write_order:
        raise NotImplementedError("create_block_mask: compute_dq_write_order is not needed by attnlab (its backward is "
                                  "deterministic without it) and not supported")
    bq, bk = _block_size(BLOCK_SIZE)
    kinds, partial_index, bits = mask_blocks.build(mask_mod, B or 1, H or 1, Q_LEN, KV_LEN, bq, bk,
                                                   separate_full_blocks)
    return BlockMask(kinds, partial_index, bits, Q_LEN, KV_LEN, (bq, bk), mask_mod)
