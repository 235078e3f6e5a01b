"""attnlab's reference attention: SDPA's semantics, written from scratch.

Legend (one layout everywhere in attnlab)::

    B    batch            L   number of queries     E   query/key feature size
    H    query heads      S   number of keys        Ev  value feature size
    Hkv  key/value heads (H when not grouped)

Tensors are laid out like ``torch.nn.functional.scaled_dot_product_attention``:
``query (..., L, E)``, ``key (..., S, E)``, ``value (..., S, Ev)``, output
``(..., L, Ev)``. The leading dimensions ``...`` broadcast, typically ``(B, H)``.

The computation is the textbook one, nothing fused::

    scores  = query @ key^T * scale            # (..., L, S)
    scores  = scores + mask                    # bool mask: -inf where False
    weights = stable_softmax(scores, dim=-1)   # rows sum to 1; all-masked rows are 0
    output  = dropout(weights) @ value         # (..., L, Ev)

This module never calls torch's SDPA, softmax or attention helpers: those are
the oracles attnlab is tested against (see :mod:`attnlab.testing`).

Semantics that match torch's SDPA exactly (MATH backend):

* bool ``attn_mask``: ``True`` = the key takes part. Float ``attn_mask``: added to
  the scores (its dtype must be bool, float32 or the query's dtype).
* ``is_causal=True`` is aligned top-left: query ``i`` sees keys ``0..i`` also when
  ``L != S`` (see :func:`attnlab.masks.causal` for a picture).
* a query row whose keys are all masked outputs zeros, with finite gradients.
* float16/bfloat16 inputs are computed in float32 and the output cast back.
* ``dropout_p > 0`` draws the same random numbers as torch, so the same seed drops
  the same weights; the values then agree to rounding (measured: at most 3.6e-7 in
  float32, 8.9e-16 in float64), not bit for bit, because the softmax before it is
  computed in a different order.
* ``enable_gqa=True`` maps query head ``h`` onto key/value head ``h // (H // Hkv)``,
  i.e. ``repeat_interleave`` on dim -3.

Deviations, all of them errors where torch would also fail, only clearer:
bad input raises ``TypeError``/``ValueError`` naming the argument, instead of
torch's ``RuntimeError``/``IndexError`` from deep inside a matmul.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from attnlab import masks
from attnlab._validation import compute_dtype as _compute_dtype
from attnlab._validation import default_scale
from attnlab._validation import validate as _validate
from attnlab._validation import validate_sinks
from attnlab.softmax import shift_by_max, stable_softmax

__all__ = ["scaled_dot_product_attention", "attention_weights"]
# Package-internal API (for attnlab.modules; not for users): attention_with_weights (the
# validated computation, with the weights and an optional step recorder), dropout_weights and
# repeat_kv_heads (grouped-query attention's key/value heads repeated up to the query heads).

Recorder = Callable[[str, Tensor], None]
"""Called as ``record(step_name, tensor)`` at each step of the computation (tracing)."""



def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    enable_gqa: bool = False,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Scaled dot-product attention with exactly the signature and results of torch's SDPA.

    ``softmax(query @ key^T * scale + mask) @ value``, from scratch.

    Args:
        query: ``(..., L, E)``, e.g. ``(B, H, L, E)``.
        key: ``(..., S, E)``, e.g. ``(B, Hkv, S, E)``.
        value: ``(..., S, Ev)``, e.g. ``(B, Hkv, S, Ev)``.
        attn_mask: ``None``, or a tensor that broadcasts to the scores ``(..., L, S)``
            without enlarging them. Bool: ``True`` = attend. Float (float32 or the
            query's dtype): added to the scores, so ``-inf`` masks.
        dropout_p: probability of dropping each attention weight, in ``[0, 1]``.
            Applied whenever it is > 0 (SDPA has no ``training`` flag); kept weights
            are scaled by ``1 / (1 - dropout_p)``.
        is_causal: mask with a top-left aligned causal mask (query ``i`` sees keys
            ``0..i``). May not be combined with ``attn_mask``. For ``L = 2, S = 3``::

                # . .
                # # .

        scale: factor applied to ``query @ key^T``; default ``1 / sqrt(E)`` with ``E``
            the query's last dimension. Zero and negative values are allowed.
        enable_gqa: group query heads onto key/value heads (dim -3): ``H`` must be a
            multiple of ``Hkv``; query heads ``0..H/Hkv-1`` share key/value head 0.
        sinks: attnlab's addition, not SDPA's: ``(H,)``, a logit per query head that joins each
            row's softmax denominator and carries no value (gpt-oss's attention sinks); it
            has a gradient. A row whose keys are all masked then outputs 0 with the sink's
            weight 1.

    Returns:
        ``(..., L, Ev)`` in the query's dtype, where ``...`` is the broadcast of the
        three inputs' leading dimensions.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: shapes that do not fit, ``is_causal`` with ``attn_mask``,
            ``dropout_p`` outside ``[0, 1]``, head counts that do not divide.
    """
    _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
              fn="scaled_dot_product_attention")
    validate_sinks(sinks, query, "scaled_dot_product_attention")
    output, _ = attention_with_weights(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                       sinks=sinks)
    return output


def attention_weights(
    query: Tensor,
    key: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    enable_gqa: bool = False,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """The ``(..., L, S)`` softmax weights that SDPA computes but does not return.

    Same arguments and semantics as :func:`scaled_dot_product_attention` (without
    ``value`` and dropout). Each row sums to 1, except fully masked rows, which are 0.

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``.
        attn_mask: ``None`` or bool/float, broadcastable to ``(..., L, S)``.
        is_causal: top-left causal mask; not together with ``attn_mask``.
        scale: default ``1 / sqrt(E)``.
        enable_gqa: group query heads onto key heads (dim -3).
        sinks: ``(H,)``, as in :func:`scaled_dot_product_attention`: rows then sum to less than 1.

    Returns:
        ``(..., L, S)`` in the query's dtype.
    """
    _validate(query, key, None, attn_mask, 0.0, is_causal, scale, enable_gqa, fn="attention_weights")
    validate_sinks(sinks, query, "attention_weights")
    compute_dtype = _compute_dtype(query.dtype)
    q, k = query.to(compute_dtype), key.to(compute_dtype)
    if enable_gqa:
        k = repeat_kv_heads(k, q)
    weights = _softmax_weights(q, k, attn_mask, is_causal, scale, None,
                               None if sinks is None else sinks.to(compute_dtype))
    return weights.to(query.dtype)


# --------------------------------------------------------------------------- #
# The computation. Inputs are already validated.
# --------------------------------------------------------------------------- #


def attention_with_weights(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    record: Optional[Recorder] = None,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Validated inputs -> ``(output (..., L, Ev), weights (..., L, S))``, weights before dropout.

    ``record``, when given, is called with each intermediate step (used by tracing). ``sinks``
    ``(H,)``: a logit per query head in each row's softmax, without a value.
    """
    compute_dtype = _compute_dtype(query.dtype)
    q, k, v = query.to(compute_dtype), key.to(compute_dtype), value.to(compute_dtype)
    if enable_gqa:
        k, v = repeat_kv_heads(k, q), repeat_kv_heads(v, q)
    weights = _softmax_weights(q, k, attn_mask, is_causal, scale, record,
                               None if sinks is None else sinks.to(compute_dtype))  # (..., L, S)
    dropped = dropout_weights(weights, dropout_p) if dropout_p > 0 else weights
    output = (dropped @ v).to(query.dtype)  # (..., L, Ev)
    if record is not None:
        record("output", output)
    return output, weights.to(query.dtype)


def _softmax_weights(
    q: Tensor,
    k: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    record: Optional[Recorder] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """``stable_softmax(q @ k^T * scale + mask)`` in ``q``'s dtype: ``(..., L, S)``. With ``sinks``
    ``(H,)`` each row's softmax runs over its scores and its head's sink, whose weight is dropped."""
    L, E, S = q.shape[-2], q.shape[-1], k.shape[-2]
    scores = q @ k.transpose(-2, -1)  # (..., L, S)
    if E > 0:  # E == 0: every score is an empty dot product, 0 whatever the scale (as torch)
        scores = scores * default_scale(scale, E)
    if record is not None:
        record("scores", scores)

    if is_causal:
        attn_mask = masks.causal(L, S, align="top_left", device=q.device)  # (L, S)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            # -inf, not a large negative number: exp(-inf) is exactly 0 and fully
            # masked rows are detected (and zeroed) by stable_softmax.
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
        if record is not None:
            record("masked_scores", scores)

    if record is not None:
        record("scores_shifted", shift_by_max(scores, dim=-1))
    if sinks is not None:  # one more column per row: the sink's logit, which carries no value
        column = sinks[:, None, None].expand(*scores.shape[:-1], 1)  # (..., H, L, 1)
        weights = stable_softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]  # (..., L, S)
    else:
        weights = stable_softmax(scores, dim=-1)  # (..., L, S)
    if record is not None:
        record("weights", weights)
    return weights


def dropout_weights(weights: Tensor, p: float) -> Tensor:
    """Dropout as ``torch.nn.functional.dropout(weights, p, training=True)`` computes it.

    Same random stream (one ``bernoulli_(1 - p)`` draw over a tensor shaped like
    ``weights``) and the same order of operations, so a fixed seed drops exactly the
    weights torch's SDPA drops (the weights themselves differ from torch's by rounding).
    """
    if p == 1.0:
        return weights * torch.zeros((), dtype=weights.dtype, device=weights.device)  # no draw
    keep = torch.empty_like(weights).bernoulli_(1.0 - p)  # (..., L, S): 1 = keep
    keep.div_(1.0 - p)
    return weights * keep


def repeat_kv_heads(kv: Tensor, q: Tensor) -> Tensor:
    """``kv (..., Hkv, S, D) -> (..., H, S, D)`` for queries ``q (..., H, L, E)``: equal to
    ``repeat_interleave(H // Hkv, dim=-3)`` (query head h uses key/value head h // (H / Hkv)),
    as one expand and reshape. Package-internal (attnlab.modules uses it)."""
    H, Hkv = q.shape[-3], kv.shape[-3]
    if H == Hkv:
        return kv
    r = H // Hkv
    expanded = kv.unsqueeze(-3).expand(*kv.shape[:-2], r, *kv.shape[-2:])  # (..., Hkv, r, S, D)
    return expanded.reshape(*kv.shape[:-3], H, *kv.shape[-2:])  # (..., H, S, D)
