"""Fake (meta) kernels of the native ops (``torch.ops.attnlab_native``): each says what the op
returns, shapes and dtypes only, without running it, so that tracing (``torch.compile``'s
FakeTensors, ``torch.export``) sees the native kernels as torch ops instead of breaking the
graph at them (issue 50, item 3).

Legend: ``Nb`` key/value heads times batch, ``r`` query heads per key/value head, ``L`` queries,
``S`` keys, ``E`` the query/key size, ``Ev`` the value size. ``q4`` (Nb, r, L, E), ``k3`` (Nb, S, E),
``v3`` (Nb, S, Ev), as in ``csrc/flash.cpp``.

The ops that write into tensors they are given (``flash_forward_``, ``flash_backward_``,
``block_sparse_backward_``, ``tile_gemm_``, ``tile_gemm_bf16_``) return nothing: their fakes do nothing, as their
schemas (``Tensor(a!)``) already tell the tracer what they mutate.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["register", "FAKED"]

# the native ops with tensor arguments, each with a fake below
FAKED = ("flash_forward", "flash_forward_", "flash_backward_", "block_sparse_forward", "block_sparse_backward_",
         "decode_forward", "tile_gemm_", "tile_gemm_bf16_")


def _forward(q4: Tensor, v3: Tensor) -> tuple[Tensor, Tensor]:
    """(out (Nb, r, L, Ev), lse2 (Nb, r, L)), float32 whatever the inputs' dtype (bf16 in, fp32 out)."""
    Nb, r, L, _ = q4.shape
    return q4.new_empty((Nb, r, L, v3.shape[-1]), dtype=torch.float32), q4.new_empty((Nb, r, L), dtype=torch.float32)


def flash_forward(q4, k3, v3, mask, mask_offsets, scale2, is_causal, causal_offset, block_q, block_k,
                  bf16_emulated=False, sgemm=0):
    return _forward(q4, v3)


def block_sparse_forward(q4, k3, v3, row_ptr, cols, bit_idx, bits, plane_of_head, table, row_of_head, cap, scale2,
                         block_q, block_k, bf16_emulated=False, sgemm=0):
    return _forward(q4, v3)


def decode_forward(q4, k, v, table, seqlens, k_scale, v_scale, scale2, plan):
    """(out (Nb, r, L, Ev) in q4's dtype, lse2 (Nb, r, L), whether a non-finite value was seen: a 0-d bool)."""
    Nb, r, L, _ = q4.shape
    return (q4.new_empty((Nb, r, L, v.shape[-1])), q4.new_empty((Nb, r, L)),
            q4.new_empty((), dtype=torch.bool))


def _writes_in_place(*args, **kwargs) -> None:
    return None


_FAKES = {"flash_forward": flash_forward, "block_sparse_forward": block_sparse_forward,
          "decode_forward": decode_forward, "flash_forward_": _writes_in_place, "flash_backward_": _writes_in_place,
          "block_sparse_backward_": _writes_in_place, "tile_gemm_": _writes_in_place,
          "tile_gemm_bf16_": _writes_in_place}
_registered: Optional[bool] = None


def register() -> bool:
    """Registers every fake, once per process (after the library is loaded); True when done."""
    global _registered
    if _registered is None:
        for name in FAKED:
            torch.library.register_fake(f"attnlab_native::{name}", _FAKES[name])
        _registered = True
    return _registered
