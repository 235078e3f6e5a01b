"""One front door to attnlab's attention implementations, with explicit choice.

    from attnlab.dispatch import attention, use_impl

    out = attention(q, k, v, is_causal=True)                 # impl="auto"
    out = attention(q, k, v, is_causal=True, impl="tiled")   # exactly the tiled path
    with use_impl("reference"):
        out = attention(q, k, v)                             # the reference, in this block

``impl``:

* ``"reference"``: :func:`attnlab.functional.scaled_dot_product_attention`, the readable
  reference (and the only oracle); materialises the ``(..., L, S)`` scores.
* ``"tiled"``: :func:`attnlab.tiled.flash_attention`, O(L·E) memory. It has no dropout,
  no gradient for a float mask: asking for it with those raises ``ValueError``; it never
  falls back silently. (Under GQA with different key and value head counts it repeats
  them to the query heads: correct, but without GQA's memory saving.)
* ``"flex"``: :func:`attnlab.flex.flex_attention`, block-sparse: what runs when ``attn_mask``
  is an :class:`attnlab.flex.BlockMask` or a ``score_mod`` is given (FlexAttention's meaning:
  ``score_mod(score, b, h, q_idx, kv_idx)``), under ``auto`` too. It takes no tensor mask,
  no ``is_causal`` (causality is a mask_mod), no dropout, 4-D inputs only.
* ``"decode"``: :func:`attnlab.decoding.decode_attention`, a few queries against a long KV
  cache (GQA groups read K/V once, keys split across threads); no tensor mask, no dropout,
  no backward (inputs that require grad are refused).
* ``"triton"``: :func:`attnlab.triton.flash_attention` (or its decode kernel for a decode
  step), attnlab's Triton kernels: the route for CUDA tensors when triton is installed; on the
  CPU only under ``TRITON_INTERPRET=1`` (tests). 4-D inputs, no tensor mask, no dropout.
* ``"auto"``: the Triton kernels for CUDA tensors where triton is installed and the call fits
  them; flex for a BlockMask or a score_mod; the decode path for a decode step
  (``L <= DECODE_MAX_L`` queries against ``S >= DECODE_MIN_S`` keys) it can run (no tensor
  mask, no dropout, no gradient needed); else the tiled path when it supports the call and
  the score matrix is large (``L * S >= AUTO_TILED_MIN_SCORES``) or it is a decode step;
  otherwise the reference. All meet the same parity tolerances against torch's SDPA.

``causal_align="bottom_right"`` (with ``is_causal=True``) lines the last query up with the
last key, as a decoder with a cache needs; every implementation honours it: the decode path
and the tiled path as an offset (they skip and mask tiles by it, no ``(L, S)`` mask), the
reference through :func:`attnlab.masks.causal`'s bool mask beside the scores it builds anyway.

The reference module does not import the tiled one, nor the other way round: they
are independent implementations, checked against each other and against torch.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Iterator, Literal, Optional, Union

import torch
from torch import Tensor

from attnlab import functional, masks, tiled
from attnlab._validation import require_tensors, validate_sinks

__all__ = ["attention", "use_impl", "IMPLS", "AUTO_TILED_MIN_SCORES", "DECODE_MAX_L", "DECODE_MIN_S", "choose_impl"]

if TYPE_CHECKING:  # flex is imported lazily at run time (it is the heavier package)
    from attnlab.flex import BlockMask
    from attnlab.flex.attention import ScoreMod  # score_mod(score, b, h, q_idx, kv_idx) -> score

Align = Literal["top_left", "bottom_right"]
# a tensor mask (bool: True = attend, or float: added) or, for flex, a BlockMask
Mask = Union[Tensor, "BlockMask", None]

Impl = Literal["auto", "reference", "tiled", "flex", "decode", "triton"]
IMPLS = ("auto", "reference", "tiled", "flex", "decode", "triton")
AUTO_TILED_MIN_SCORES = 512 * 512
# Decode steps: q (1, 32, 1, 128) against k, v (1, 8, S, 128) with GQA on the 2-core Zen 4 EPYC
# (2026-12-01, BENCHMARKS.md "Decoding"): the reference took 1.3 / 8.2 / 22 / 152 / 938 ms at
# S = 64 / 256 / 1024 / 4096 / 32768 (it repeats K and V to the query heads, then materialises
# the scores), the tiled path 0.34 / 0.32 / 1.3 / 32 / 200 ms; without GQA (32 key/value heads)
# the two were even at S = 256 (0.87 against 0.75 ms). The decode path (issue 24) then took
# 2.8 / 21 ms at S = 4096 / 32768 in float32, against the tiled path's 7.1 / 82. Up to 64 rows
# (chunked prefill, speculative decoding) it still wins: q (1, 32, Lq, 128) against S = 32768 on the
# 2-core AVX2 EPYC (2026-12-02), decode / tiled / torch SDPA = 73 / 153 / 134 ms at Lq = 16,
# 120 / 190 / 183 at Lq = 32, 226 / 295 / 380 at Lq = 64.
DECODE_MAX_L = 64
DECODE_MIN_S = 256

_default: contextvars.ContextVar[str] = contextvars.ContextVar("attnlab_impl", default="auto")


@contextlib.contextmanager
def use_impl(impl: Impl) -> Iterator[None]:
    """Within the block, ``attention(...)`` without an ``impl`` argument uses ``impl``."""
    _check_impl(impl)
    token = _default.set(impl)
    try:
        yield
    finally:
        _default.reset(token)


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention: impl must be one of {IMPLS}, got {impl!r}")


def _tiled_unsupported(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                       enable_gqa: bool) -> Optional[str]:
    """Why the tiled path cannot run this call, or None."""
    if dropout_p > 0:
        return f"dropout_p={dropout_p} (the tiled path has no dropout)"
    if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad:
        return "a float attn_mask that requires grad"
    return None


def _flex_unsupported(query: Tensor, attn_mask: Mask, dropout_p: float, is_causal: bool) -> Optional[str]:
    """Why flex cannot run this call, or None."""
    from attnlab import flex

    if attn_mask is not None and not isinstance(attn_mask, flex.BlockMask):
        return "a tensor attn_mask (flex takes a BlockMask: attnlab.flex.create_block_mask)"
    if is_causal and attn_mask is not None:  # SDPA's rule: one or the other
        return ("is_causal=True with a BlockMask: pass either, not both (fold causality into the mask_mod: "
                "and_masks(flex.causal_mask, ...))")
    if dropout_p > 0:
        return f"dropout_p={dropout_p} (flex has no dropout)"
    if query.dim() != 4:
        return f"{query.dim()}-D inputs (flex takes (B, H, L, E))"
    return None


def _causal_mod(L: int, S: int, align: str):
    """is_causal as a mask_mod: query i sees keys j <= i (top-left, SDPA's), or j <= i + S - L (bottom-right)."""
    from attnlab import flex

    if align == "top_left":
        return flex.causal_mask
    offset = S - L

    def bottom_right_causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return bottom_right_causal


def _decode_unsupported(query: Tensor, key: Tensor, value: Tensor, attn_mask: Mask, dropout_p: float) -> Optional[str]:
    """Why the decode path cannot run this call, or None."""
    if attn_mask is not None:
        return "an attn_mask (the decode path takes is_causal, with causal_align)"
    if dropout_p > 0:
        return f"dropout_p={dropout_p} (the decode path has no dropout)"
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (query, key, value)):
        return "inputs that require grad (decoding has no backward; use impl='tiled' to train)"
    return None


def _triton_unsupported(query: Tensor, key: Tensor, value: Tensor, attn_mask, dropout_p: float) -> Optional[str]:
    """Why attnlab's Triton kernels cannot run this call (None when they can)."""
    from attnlab import triton as _triton

    if attn_mask is not None:
        return "a tensor mask or a BlockMask (only is_causal)"
    if dropout_p:
        return "dropout"
    if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (query, key, value)):
        return "inputs that are not 4-D (B, H, L, E)"
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {query.dtype}"
    return _triton.why_unavailable(query, key, value)


# the kernels that have no attention sinks yet (issue 50): a call with sinks runs on the CPU paths instead
_SINKS_NOT_YET = "sinks (its kernels have none yet: the reference, tiled, flex and decode paths do)"


@torch.compiler.assume_constant_result
def _default_impl() -> str:
    """The implementation :func:`use` set (``"auto"`` otherwise). Dynamo cannot trace a context
    variable's ``get``, so a compiled call takes the one in force when it was traced: after
    changing it, ``torch.compiler.reset()`` before calling the compiled function again."""
    return _default.get()


def choose_impl(query: Tensor, key: Tensor, value: Tensor, attn_mask: Mask = None, dropout_p: float = 0.0, *,
                enable_gqa: bool = False, impl: Optional[Impl] = None, is_causal: bool = False,
                score_mod: Optional[ScoreMod] = None, causal_align: str = "top_left",
                sinks: Optional[Tensor] = None) -> str:
    """The implementation :func:`attention` will run for these arguments: "reference", "tiled",
    "flex" or "decode". Raises ``ValueError`` when ``impl`` names one that cannot run them."""
    from attnlab import flex

    chosen = impl if impl is not None else _default_impl()
    _check_impl(chosen)
    if chosen == "triton":
        # a score_mod the kernels would not run is refused, never dropped (it ran without it: issue 63)
        why = (_SINKS_NOT_YET if sinks is not None else "a score_mod (its kernels run none yet)"
               if score_mod is not None else _triton_unsupported(query, key, value, attn_mask, dropout_p))
        if why:
            raise ValueError(f"attention: impl='triton' was requested but it cannot run {why}; use impl='auto'")
        return "triton"
    if (chosen == "auto" and isinstance(query, Tensor) and query.device.type == "cuda" and score_mod is None
            and sinks is None and _triton_unsupported(query, key, value, attn_mask, dropout_p) is None):
        return "triton"  # (triton is imported only for CUDA tensors: a CPU call never pays its import)
    flex_call = isinstance(attn_mask, flex.BlockMask) or score_mod is not None
    if flex_call or chosen == "flex":
        if flex_call and chosen not in ("auto", "flex"):
            raise ValueError(f"attention: impl={chosen!r} cannot take a BlockMask or a score_mod; "
                             f"use impl='flex' or impl='auto'")
        why_not = _flex_unsupported(query, attn_mask, dropout_p, is_causal)
        if why_not:
            raise ValueError(f"attention: flex cannot run {why_not}")
        return "flex"
    if chosen == "reference":
        return "reference"
    decode_why_not = _decode_unsupported(query, key, value, attn_mask, dropout_p)
    if chosen == "decode":
        if decode_why_not:
            raise ValueError(f"attention: impl='decode' was requested but it cannot run {decode_why_not}; "
                             f"use impl='tiled' or impl='auto'")
        return "decode"
    why_not = _tiled_unsupported(query, key, value, attn_mask, dropout_p, enable_gqa)
    if chosen == "tiled":
        if why_not:
            raise ValueError(f"attention: impl='tiled' was requested but it cannot run {why_not}; "
                             f"use impl='reference' or impl='auto'")
        return "tiled"
    if query.dim() < 2 or key.dim() < 2:
        return "reference"
    L, S = query.shape[-2], key.shape[-2]
    decode_step = L <= DECODE_MAX_L and S >= DECODE_MIN_S
    if decode_step and decode_why_not is None:
        return "decode"
    large = L * S >= AUTO_TILED_MIN_SCORES or decode_step
    return "tiled" if (why_not is None and large) else "reference"


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    enable_gqa: bool = False,
    impl: Optional[Impl] = None,
    score_mod: Optional[ScoreMod] = None,
    causal_align: Align = "top_left",
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """SDPA's signature and semantics, run by the implementation ``impl`` picks (see the module doc).

    Args:
        query: as in
            :func:`attnlab.functional.scaled_dot_product_attention`; shapes
            ``(..., L, E)``, ``(..., S, E)``, ``(..., S, Ev)``. ``attn_mask`` may also be an
            :class:`attnlab.flex.BlockMask` (then flex runs it).
        key: as in SDPA.
        value: as in SDPA.
        attn_mask: as in SDPA.
        dropout_p: as in SDPA.
        is_causal: as in SDPA.
        scale: as in SDPA.
        enable_gqa: as in SDPA.
        impl: ``"auto"``, ``"reference"``, ``"tiled"``, ``"flex"`` or ``"decode"``; default: the innermost
            :func:`use_impl`, else ``"auto"``.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (flex runs it).
        causal_align: with ``is_causal``: ``"top_left"`` (SDPA's meaning) or ``"bottom_right"``
            (query ``i`` sees keys ``0..S - L + i``: new tokens after a KV cache).
        sinks: ``(H,)``, a learnable logit per query head in each row's softmax denominator,
            without a value (gpt-oss's attention sinks); the reference, tiled, flex and decode
            paths take it, the Triton kernels refuse it (``"auto"`` then picks a CPU path).

    Returns:
        ``(..., L, Ev)`` in the query's dtype.
    """
    if causal_align not in ("top_left", "bottom_right"):
        raise ValueError(f"attention: causal_align must be 'top_left' or 'bottom_right', got {causal_align!r}")
    if (causal_align == "bottom_right" and isinstance(query, Tensor) and isinstance(key, Tensor)
            and query.dim() >= 2 and key.dim() >= 2 and query.shape[-2] == key.shape[-2]):
        causal_align = "top_left"  # L == S: the two alignments are one mask
    require_tensors("attention", query=query, key=key, value=value)
    validate_sinks(sinks, query, "attention")
    which = choose_impl(query, key, value, attn_mask, dropout_p, enable_gqa=enable_gqa, impl=impl,
                        causal_align=causal_align,
                        is_causal=is_causal, score_mod=score_mod, sinks=sinks)
    if which == "triton":
        from attnlab import triton as _triton

        if query.shape[-2] <= _triton.DECODE_MAX_L and not any(t.requires_grad for t in (query, key, value)) \
                and (causal_align == "bottom_right" or key.shape[-2] >= DECODE_MIN_S):
            return _triton.decode_attention(query, key, value, is_causal, scale, enable_gqa=enable_gqa,
                                            causal_align=causal_align)
        return _triton.flash_attention(query, key, value, is_causal, scale, enable_gqa=enable_gqa,
                                       causal_align=causal_align)
    if which == "decode":
        from attnlab import decoding

        return decoding.decode_attention(query, key, value, is_causal, scale, enable_gqa=enable_gqa,
                                         causal_align=causal_align, sinks=sinks)
    if is_causal and causal_align == "bottom_right" and which != "flex" and attn_mask is not None:
        raise ValueError("attention: pass either attn_mask or is_causal=True, not both")
    if which == "tiled":  # the alignment is an offset the kernels skip and mask tiles by
        return tiled.flash_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa=enable_gqa,
                                     causal_align=causal_align, sinks=sinks)
    if is_causal and causal_align == "bottom_right" and which == "reference":
        # the reference builds its (L, S) scores anyway: the written-out mask is its readable version
        if isinstance(query, Tensor) and isinstance(key, Tensor) and query.dim() >= 2 and key.dim() >= 2:
            attn_mask = masks.causal(query.shape[-2], key.shape[-2], align="bottom_right", device=query.device)
            is_causal = False
    if which == "flex":
        from attnlab import flex

        if is_causal:  # SDPA's is_causal on the flex route: its causal mask_mod, aligned as asked
            attn_mask = flex.create_block_mask(_causal_mod(query.shape[-2], key.shape[-2], causal_align), None, None,
                                               query.shape[-2], key.shape[-2])
        return flex.flex_attention(query, key, value, score_mod=score_mod, block_mask=attn_mask, scale=scale,
                                   enable_gqa=enable_gqa, sinks=sinks)
    return functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                   enable_gqa=enable_gqa, sinks=sinks)
