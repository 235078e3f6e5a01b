"""Argument checks shared by every attention implementation (reference and tiled).

They run at the public boundary and raise ``TypeError``/``ValueError`` that name the
argument and show expected vs actual, for anything SDPA would reject or get wrong.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

__all__ = ["validate", "compute_dtype", "default_scale", "validate_sinks"]

_REDUCED_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16/bfloat16 are computed in float32 (as SDPA's MATH backend does); others as they are."""
    return torch.float32 if dtype in _REDUCED_PRECISION else dtype


def default_scale(scale: Optional[float], E: int) -> float:
    """The score scale SDPA uses: ``scale`` when given, else ``1 / sqrt(E)``. With ``E = 0`` every
    score is an empty sum, 0 at any scale (torch's own factor is ``inf`` there): 1.0, not a
    division by zero."""
    if scale is not None:
        return float(scale)
    return 1.0 / math.sqrt(E) if E else 1.0


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def broadcast_shapes(*shapes) -> torch.Size:
    """``torch.broadcast_shapes`` for concrete shapes, raising ``RuntimeError`` the same way.
    torch's imports torch.fx's symbolic shapes, and with them sympy, on first use: 0.97 s of
    CPU measured here, paid by every grading process and sandbox child that validates."""
    ndim = max([0, *(len(s) for s in shapes)])  # (max's default= is not traceable by Dynamo)
    out = [1] * ndim
    for s in shapes:
        for i, d in enumerate(s, start=ndim - len(s)):
            if d != 1:
                if out[i] not in (1, d):
                    raise RuntimeError(f"shape mismatch: {tuple(s)} does not broadcast with the others at dim {i}")
                out[i] = d
    return torch.Size(out)


def _type_name(x) -> str:
    module = type(x).__module__
    return type(x).__name__ if module == "builtins" else f"{module.split('.')[0]}.{type(x).__name__}"


def takes_arguments(fn, n: int) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments (True where its signature
    cannot be read: a builtin, a compiled function)."""
    import inspect

    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def describe_signature(fn) -> str:
    """``name(a, b)``: a callable as its signature reads, for an error message."""
    import inspect

    try:
        return f"{getattr(fn, '__name__', type(fn).__name__)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def require_tensors(fn: str, **named) -> None:
    """``TypeError`` naming the first argument that is not a torch.Tensor (a NumPy array gets
    the conversion to use)."""
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {_type_name(t)}"
                            + (": convert it with torch.from_numpy(x) (or torch.as_tensor(x))"
                               if type(t).__module__.startswith("numpy") else ""))


def validate(
    query: Tensor,
    key: Tensor,
    value: Optional[Tensor],
    attn_mask: Optional[Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    *,
    fn: str,
) -> torch.Size:
    """Raise a clear ``TypeError``/``ValueError`` for anything SDPA would reject (or get wrong).

    Returns the broadcast leading (batch/head) shape of the output, ``...`` in ``(..., L, Ev)``
    (with ``enable_gqa``, the query's head count in the head position).
    """
    named = [("query", query), ("key", key)] + ([("value", value)] if value is not None else [])
    require_tensors(fn, **dict(named))
    if not query.is_floating_point():
        raise TypeError(f"{fn}: query must have a floating dtype (float16/bfloat16/float32/float64), "
                        f"got {query.dtype}")
    for name, t in named[1:]:
        if t.dtype != query.dtype:
            raise TypeError(f"{fn}: query, key and value must share one dtype: expected {name}.dtype "
                            f"{query.dtype} (query's), got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but query is on {query.device}; "
                             f"move them to one device")
    for name, t in named:
        if t.dim() < 2:
            raise ValueError(f"{fn}: {name} must be at least 2-D (..., {'L' if name == 'query' else 'S'}, "
                             f"{'Ev' if name == 'value' else 'E'}), got shape {_shape(t)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"{fn}: key's last dim must equal query's E={query.shape[-1]}: expected key "
                         f"(..., S, {query.shape[-1]}), got {_shape(key)}")
    if value is not None and value.shape[-2] != key.shape[-2]:
        raise ValueError(f"{fn}: value must have as many rows as key (S={key.shape[-2]}): expected value "
                         f"(..., {key.shape[-2]}, Ev), got {_shape(value)}")

    if not isinstance(is_causal, bool):
        raise TypeError(f"{fn}: is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"{fn}: enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"{fn}: scale must be None or a real number, got {type(scale).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{fn}: dropout_p must be a float in [0, 1], got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{fn}: dropout_p must be in [0, 1], got {dropout_p}")

    # Leading (batch/head) dims after grouping must broadcast.
    kv_batch = [("key", key.shape[:-2])] + ([("value", value.shape[:-2])] if value is not None else [])
    if enable_gqa:
        for name, t in named:
            if t.dim() < 3:
                raise ValueError(f"{fn}: enable_gqa=True needs a head dim: {name} must be at least 3-D "
                                 f"(..., H, L/S, E), got shape {_shape(t)}")
        H = query.shape[-3]
        for name, t in named[1:]:
            Hkv = t.shape[-3]
            if Hkv == 0 or H % Hkv != 0:
                raise ValueError(f"{fn}: with enable_gqa=True the query heads (dim -3) must be a multiple of "
                                 f"the {name} heads: query has H={H} ({_shape(query)}), {name} has "
                                 f"Hkv={Hkv} ({_shape(t)})")
        kv_batch = [(name, (*s[:-1], H)) for name, s in kv_batch]
    try:
        batch = broadcast_shapes(query.shape[:-2], *(s for _, s in kv_batch))
    except RuntimeError:
        shapes = ", ".join(f"{n} {_shape(t)}" for n, t in named)
        hint = (" (different head counts need enable_gqa=True)"
                if not enable_gqa and all(t.dim() >= 3 for _, t in named) else "")
        raise ValueError(f"{fn}: the leading (batch/head) dims of query, key and value must broadcast; "
                         f"got {shapes}{hint}") from None

    if attn_mask is None:
        return batch
    if is_causal:
        raise ValueError(f"{fn}: pass either attn_mask or is_causal=True, not both "
                         f"(fold the causal mask into attn_mask, e.g. with attnlab.masks.causal)")
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"{fn}: attn_mask must be None or a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise TypeError(f"{fn}: attn_mask must be bool (True = attend) or float (added to the scores) "
                        f"with dtype float32 or the query's {query.dtype}, got {attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise ValueError(f"{fn}: attn_mask is on {attn_mask.device} but query is on {query.device}")
    scores_shape = (*batch, query.shape[-2], key.shape[-2])
    try:
        fits = broadcast_shapes(attn_mask.shape, scores_shape) == torch.Size(scores_shape)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{fn}: attn_mask must broadcast to the scores' shape (..., L, S) = {scores_shape} "
                         f"without enlarging it, got {_shape(attn_mask)}")
    return batch


def validate_sinks(sinks: object, query: Tensor, fn: str) -> "Optional[Tensor]":
    """``sinks`` as given when it is a floating tensor of shape ``(H,)`` on the query's device, with
    ``H = query.shape[-3]``; None for None. Raises TypeError/ValueError naming the argument."""
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor):
        raise TypeError(f"{fn}: sinks must be a tensor of shape (H,) (one logit per query head) or None, "
                        f"got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"{fn}: sinks must be a floating-point tensor, got {sinks.dtype}")
    if query.dim() < 3:
        raise ValueError(f"{fn}: sinks need a head dimension: query must be (..., H, L, E), got {tuple(query.shape)}")
    H = query.shape[-3]
    if tuple(sinks.shape) != (H,):
        raise ValueError(f"{fn}: sinks must have shape (H,) = ({H},), one logit per query head, "
                         f"got {tuple(sinks.shape)}")
    if sinks.device != query.device:
        raise ValueError(f"{fn}: sinks are on {sinks.device}, query on {query.device}: put them on one device")
    return sinks
