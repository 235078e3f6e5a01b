"""Numerically stable softmax, written from scratch.

``softmax(x)_j = exp(x_j) / sum_k exp(x_k)`` overflows as soon as one entry is
larger than ~88 in float32 (``exp(89) = inf``).  Subtracting the row maximum
``m`` first changes nothing mathematically, because ``exp(x_j - m) / sum_k
exp(x_k - m)`` has the factor ``exp(-m)`` in both numerator and denominator,
and after the shift every exponent is <= 0, so nothing overflows.

attnlab's softmax differs from ``torch.softmax`` in exactly one, deliberate
place: a slice where *every* entry is ``-inf`` (an attention row whose keys are
all masked) gives zeros instead of NaN, with a zero gradient.  This is what
SDPA's MATH backend does for fully masked rows.  ``+inf`` and NaN still
propagate as in ``torch.softmax``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["stable_softmax", "shift_by_max"]

_REDUCED_PRECISION = (torch.float16, torch.bfloat16)


def shift_by_max(x: Tensor, dim: int = -1) -> Tensor:
    """Return ``x - max(x, dim)``, the exponent that stable softmax feeds to ``exp``.

    The maximum of a slice whose entries are all ``-inf`` is replaced by 0, so such a
    slice stays all ``-inf`` (and later gives ``exp = 0``) instead of turning into
    ``-inf - (-inf) = NaN``.

    The maximum is detached: the softmax does not depend on the shift, so its true
    derivative with respect to the shift is exactly zero. Letting autograd
    differentiate through ``amax`` would only add rounding noise.

    Args:
        x: any floating tensor, shape ``(..., N, ...)``.
        dim: the dimension to normalise over.

    Returns:
        A tensor of ``x``'s shape and dtype; every non-empty slice along ``dim`` has
        maximum 0, unless it is all ``-inf`` or holds ``+inf``/NaN.
    """
    m = x.detach().amax(dim=dim, keepdim=True)  # (..., 1, ...)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    return x - m


def stable_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax along ``dim`` that neither overflows nor turns fully masked slices into NaN.

    Args:
        x: floating tensor of any shape ``(..., N, ...)``; float16 and bfloat16 are
            computed in float32 and cast back (as torch does).
        dim: the dimension whose entries should sum to one.

    Returns:
        Tensor of ``x``'s shape and dtype. Each slice along ``dim`` sums to 1, except:

        * a slice whose entries are all ``-inf`` gives all zeros (gradient 0);
        * a slice holding ``+inf`` or NaN gives NaN, exactly like ``torch.softmax``;
        * an empty dimension (``N == 0``) gives an empty tensor.

    Example:
        >>> stable_softmax(torch.tensor([1000.0, 1001.0, 999.0, 1002.0]))
        tensor([0.0321, 0.0871, 0.0118, 0.8689])
        >>> stable_softmax(torch.tensor([float("-inf"), float("-inf")]))
        tensor([0., 0.])
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"stable_softmax: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"stable_softmax: x must be a floating tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError("stable_softmax: x must have at least one dimension, got a 0-d tensor")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"stable_softmax: dim={dim} is out of range for x of shape {tuple(x.shape)}")
    if x.shape[dim] == 0:
        return x.clone()  # nothing to normalise; amax would refuse an empty dim

    in_dtype = x.dtype
    if in_dtype in _REDUCED_PRECISION:
        x = x.float()  # exp and the row sum lose too much in 8-10 bit mantissas
    e = torch.exp(shift_by_max(x, dim))  # (..., N, ...), every entry in [0, 1]
    total = e.sum(dim=dim, keepdim=True)  # (..., 1, ...); 0 only for all -inf slices
    # Dividing an all-zero slice by 1 instead of 0 yields zeros, not 0/0 = NaN.
    total = torch.where(total == 0, torch.ones_like(total), total)
    return (e / total).to(in_dtype)
