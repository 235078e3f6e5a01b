"""The numerics shared by every kernel: base-2 arithmetic, the log-sum-exp merge, when the
fast paths' assumptions hold.

Scores are kept in base 2 (``exp2``, with ``log2(e)`` folded into the query scale: the same
result, and ``exp2`` is cheaper than ``exp`` on the CPU), so ``lse2 = m_i + log2(l_i)``; an
empty row has ``lse2 = -inf`` and output 0.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["LOG2E", "merge_", "finite_inputs", "lse_absorbed", "needs_natural_units", "block_size"]

LOG2E = math.log2(math.e)


def merge_(out: Tensor, lse2: Tensor, o: Tensor, l: Tensor) -> None:
    """Merge a partial attention ``(o, l)`` into ``(out, lse2)``, in place (disjoint keys, base-2 lse)."""
    new = torch.logaddexp2(lse2, l)  # (Nb, r, L); -inf where neither saw a key
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp2(lse2 - safe).unsqueeze(-1)).add_(o.mul_(torch.exp2(l - safe).unsqueeze(-1)))
    lse2.copy_(new)

def finite_inputs(q4: Tensor, k3: Tensor, v3: Tensor, mask: Optional[Tensor]) -> bool:
    """No NaN or inf in the inputs (-inf allowed in a float mask: it masks).

    The native row pass treats a NaN row as fully masked (its vector max drops NaNs), so
    non-finite inputs run the pure code. One sum per input: O(L·E), ~1% of the attention at
    L = 4096, E = 64; a sum that overflows only sends a finite call to the pure code too.
    """
    if not all(bool(torch.isfinite(t.sum())) for t in (q4, k3, v3) if t.numel()):
        return False
    if mask is not None and mask.is_floating_point() and mask.numel():
        top = mask.max()  # NaN if any is NaN; +inf if any is +inf
        return bool(top < float("inf"))  # False for NaN and +inf
    return True


def lse_absorbed(lse2: Tensor) -> bool:
    """Some row's log-sum-exp is so large that ``m_i + log2(l_i)`` lost ``log2(l_i)``.

    That happens when a row's every visible score is huge, e.g. a row masked with -1e4 or
    -1e9 instead of -inf: its max is ~-1.4e9, whose float32 spacing (128) swallows
    ``log2(l_i) <= log2(S)``, so the backward's ``P = 2^(s - lse)`` would be 1 instead of
    ``1/l_i``. Past ``|lse| > 2^-10 / eps`` (8192 in float32), the call is redone in natural
    units with ``m_i`` and ``l_i`` kept apart (:func:`attnlab.tiled`'s eager path, ``natural=True``).
    Ordinary attention scores stay far below that.
    """
    if lse2.numel() == 0:
        return False
    limit = 2.0 ** -10 / torch.finfo(lse2.dtype).eps
    return bool(((lse2.abs() > limit) & torch.isfinite(lse2)).any())


def needs_natural_units(mask: Optional[Tensor]) -> bool:
    """A float mask so large that ``mask * log2(e)`` overflows (beyond +-2.36e38 in float32,
    e.g. Hugging Face's ``finfo.min`` masks).

    In base 2 such a row would come out as fully masked (0). torch adds the mask in natural
    units, where ``score + finfo.min`` rounds to ``finfo.min`` for every key, so a row that is
    all ``finfo.min`` gets uniform weights; such calls run the pure code in natural units,
    which rounds exactly as torch does (``natural=True`` below).
    """
    if mask is None or not mask.is_floating_point() or mask.numel() == 0:
        return False
    limit = torch.finfo(mask.dtype).max / LOG2E  # also above: finfo.max would become +inf, then NaN
    return bool(mask.min() < -limit) or bool(mask.max() > limit)

def block_size(value: Optional[int], default: int, name: str, fn: str = "flash_attention") -> int:
    """A tile size: ``default`` for None, else a positive int (ValueError names ``fn`` and ``name``)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{fn}: {name} must be a positive int, got {value!r}")
    return value
