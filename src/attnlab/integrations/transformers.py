"""``attn_implementation="attnlab"`` for Hugging Face transformers: one import.

    import attnlab.integrations.transformers  # registers "attnlab"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnlab")
    model.set_attn_implementation("attnlab")  # or switch an existing model

Importing this module registers two functions under the name ``"attnlab"``:

* **the mask function** (``AttentionMaskInterface``). Registering only the attention function
  is a trap: transformers then passes ``attention_mask=None`` for an implementation it does
  not know, silently dropping padding and sliding windows. Ours returns ``None`` where a
  plain causal (or unmasked) call needs no mask, as SDPA's does, and otherwise an
  :class:`attnlab.flex.BlockMask` built from transformers' own ``mask_function`` (causal,
  sliding window, chunked, padding, packed sequences, bidirectional), block by block: no
  dense ``L x S`` mask is ever materialised.
* **the attention function** (``AttentionInterface``), which routes each call:

  ====================================  =============================================
  the call                              runs on
  ====================================  =============================================
  no mask (causal or not)               :func:`attnlab.dispatch.attention` (the tiled
                                        path, or the reference for small calls)
  a BlockMask from the mask function    :func:`attnlab.dispatch.attention`, which runs
                                        :func:`attnlab.flex.flex_attention` (native
                                        block-sparse kernels; ``softcap`` natively)
  a mask tensor given by the caller     :func:`attnlab.dispatch.attention`, as above
  dropout > 0 (training) or             attnlab's reference
  ``output_attentions=True``            (:mod:`attnlab.functional`), mask made dense
  ====================================  =============================================

  The front door's rules are the modules' too (:mod:`attnlab.dispatch`).

Shapes, as transformers passes them: ``query (B, H, L, E)``, ``key``/``value (B, Hkv, S, E)``;
the function returns ``(B, L, H, Ev)`` and the attention weights ``(B, H, L, S)`` or None.

Supported transformers: :data:`SUPPORTED` (``attnlab[hf]`` installs it); another version is
refused on import with the range and the command that installs a supported one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from attnlab import dispatch, flex, functional

__all__ = ["SUPPORTED", "attnlab_attention_forward", "attnlab_mask", "register", "check_version"]

SUPPORTED = (5, 6)  # transformers >= 5.0, < 6: AttentionInterface / AttentionMaskInterface as used here
_INSTALL = "pip install 'attnlab[hf]'"


def check_version(version: Optional[str] = None) -> None:
    """Raise ImportError, naming the supported range and the install command, unless
    transformers (``version``, default the installed one) is a supported major version."""
    if version is None:
        try:
            import transformers
        except ImportError as exc:
            raise ImportError(f"attnlab.integrations.transformers needs Hugging Face transformers "
                              f">={SUPPORTED[0]}.0,<{SUPPORTED[1]}: {_INSTALL}") from exc
        version = transformers.__version__
    major = int(version.split(".")[0])
    if not SUPPORTED[0] <= major < SUPPORTED[1]:
        raise ImportError(f"attnlab.integrations.transformers supports transformers >={SUPPORTED[0]}.0,"
                          f"<{SUPPORTED[1]}, found {version}: {_INSTALL}")


check_version()  # on import: before transformers' own imports can fail in a less helpful way
from transformers import AttentionInterface  # noqa: E402  (after the version check, which names the fix)
from transformers.masking_utils import (AttentionMaskInterface, _ignore_causal_mask_sdpa,  # noqa: E402
                                        and_masks, padding_mask_function, prepare_padding_mask)


def attnlab_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Callable = None, attention_mask: Optional[Tensor] = None,
                 local_size: Optional[int] = None, allow_is_causal_skip: bool = True,
                 allow_is_bidirectional_skip: bool = False, **kwargs) -> Optional[flex.BlockMask]:
    """transformers' mask hook for ``"attnlab"``: None where no mask is needed, else a BlockMask.

    Args (as transformers passes them): ``batch_size``, ``q_length``/``kv_length`` (the
    lengths in this call), ``q_offset``/``kv_offset`` (positions of the first query/key:
    a KV cache's offset), ``mask_function(b, h, q_idx, kv_idx) -> bool`` (True = attend),
    ``attention_mask (B, kv_offset + kv_length)`` the 2-D padding mask (1 = real token),
    ``local_size`` a sliding window when the layer has one.

    Returns None when SDPA's would (a plain causal call without padding runs with
    ``is_causal``; an unmasked bidirectional one without a mask), else an
    :class:`attnlab.flex.BlockMask` of shape ``(batch_size or 1, 1, q_length, kv_length)``.
    """
    padding_mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)  # (B, kv_length) or None
    if allow_is_causal_skip and _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset,
                                                         local_size):
        return None
    if allow_is_bidirectional_skip and padding_mask is None and local_size is None:
        return None
    if padding_mask is not None:
        mask_function = and_masks(mask_function, padding_mask_function(padding_mask))
        padding_mask = padding_mask.cpu()

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # transformers' mask functions take absolute positions; attnlab.flex indexes from 0
        return mask_function(b, h, q_idx + q_offset, kv_idx + kv_offset)

    per_batch = attention_mask is not None  # the padding differs per sequence
    return flex.create_block_mask(mask_mod, batch_size if per_batch else None, None, q_length, kv_length,
                                  BLOCK_SIZE=_block(q_length, kv_length))


def _block(q_length: int, kv_length: int) -> int:
    """128 as FlexAttention's default; smaller for short calls (decoding one token at a time)."""
    return 128 if min(q_length, kv_length) >= 128 else 8 * max(1, -(-min(q_length, kv_length) // 8))


def attnlab_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                              attention_mask: Optional[Any], dropout: float = 0.0, scaling: Optional[float] = None,
                              is_causal: Optional[bool] = None, **kwargs) -> tuple[Tensor, Optional[Tensor]]:
    """transformers' attention hook for ``"attnlab"``.

    Args:
        module: the attention layer (its ``is_causal`` and ``num_key_value_groups`` are read).
        query: ``(B, H, L, E)``.
        key, value: ``(B, Hkv, S, E)`` / ``(B, Hkv, S, Ev)``, ``H`` a multiple of ``Hkv``.
        attention_mask: None, an :class:`attnlab.flex.BlockMask` from :func:`attnlab_mask`, or a
            bool (True = attend) / additive float tensor broadcastable to ``(B, H, L, S)``.
        dropout: attention dropout probability (training).
        scaling: the score scale (default ``1 / sqrt(E)``).
        is_causal: overrides ``module.is_causal``.
        kwargs: ``softcap`` (tanh soft-capping), ``output_attentions``, ``s_aux`` (gpt-oss's
            attention sinks, ``(H,)``: attnlab's ``sinks``), and what :data:`ACCEPTED_KWARGS` lists
            as already in the mask or not about attention; anything else (``position_bias``, an
            unknown name) is refused by name.

    Returns:
        ``(output (B, L, H, Ev), weights (B, H, L, S) or None)``.
    """
    _refuse_what_is_not_implemented(kwargs)
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    want_weights = bool(kwargs.get("output_attentions", False))
    gqa = query.shape[1] != key.shape[1]
    L, S = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    block_mask = attention_mask if isinstance(attention_mask, flex.BlockMask) else None
    dense_mask = attention_mask if isinstance(attention_mask, Tensor) else None
    if attention_mask is not None and block_mask is None and dense_mask is None:
        raise TypeError(f"attn_implementation='attnlab': attention_mask must be None, a Tensor or an "
                        f"attnlab.flex.BlockMask, got {type(attention_mask).__name__}")
    # SDPA's rule: no mask and a causal layer -> is_causal, except when decoding one query
    top_left_causal = attention_mask is None and causal and L > 1
    if top_left_causal and S > L:  # an empty static cache's prefill: the later keys are all masked
        key, value = key[:, :, :L], value[:, :, :L]

    weights = None
    if dropout > 0.0 or want_weights or (softcap is not None and block_mask is None):
        mask = _dense(block_mask, dense_mask, query.shape[0])
        if softcap is not None:
            if block_mask is None:  # soft-capping needs a mask the flex path can read: make one
                block_mask = _as_block_mask(mask, top_left_causal, query.shape[0], L, key.shape[2])
        if dropout > 0.0 or want_weights:
            out = functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                          is_causal=top_left_causal, scale=scaling,
                                                          enable_gqa=gqa, sinks=sinks)
            if want_weights:
                weights = functional.attention_weights(query, key, attn_mask=mask, is_causal=top_left_causal,
                                                       scale=scaling, enable_gqa=gqa, sinks=sinks)
            if softcap is not None:
                raise NotImplementedError("attn_implementation='attnlab': softcap with dropout or "
                                          "output_attentions is not supported; use 'eager'")
            return out.transpose(1, 2).contiguous(), weights
    # the one front door: flex for a BlockMask (and the soft cap), else the tiled path or, for
    # small calls, the reference, by dispatch's own rule
    score_mod = flex.softcap(softcap) if softcap is not None else None
    out = dispatch.attention(query, key, value, block_mask if block_mask is not None else dense_mask,
                             is_causal=top_left_causal and block_mask is None,  # else it is in the BlockMask
                             scale=scaling, enable_gqa=gqa, score_mod=score_mod, sinks=sinks)
    return out.transpose(1, 2).contiguous(), weights  # (B, L, H, Ev)


# What transformers passes to an attention function besides q, k, v, the mask, dropout, scaling and
# is_causal (its models, 5.24: 493 calls read), and what attnlab does with each. Implemented: softcap,
# output_attentions, s_aux (gpt-oss's sinks; "sinks" too). In the mask already: sliding_window (the mask function's window: attnlab_mask
# builds the BlockMask from it, and returns None only where SDPA's would) and the packed-sequence
# arguments (position_ids, cu_seq_lens_*, max_length_*: the mask function separates the sequences).
# Not about attention: the rest of TransformersKwargs.
ACCEPTED_KWARGS = frozenset({
    "softcap", "output_attentions", "s_aux", "sinks", "sliding_window", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
    "max_length_q", "max_length_k", "num_items_in_batch", "output_hidden_states", "output_router_logits",
    "use_cache", "cache_position", "past_key_values", "past_key_value", "return_dict", "deterministic"})
# not implemented, with what to do instead
REFUSED_KWARGS = {
    "position_bias": "position_bias (T5-style biases)",
}


def _refuse_what_is_not_implemented(kwargs: dict) -> None:
    """Every argument attnlab does not implement is refused by name, never dropped: gpt-oss's
    ``s_aux`` was once dropped silently (its logits 45% off eager's, its sinks without a gradient)."""
    for name, value in kwargs.items():
        if value is None:
            continue  # transformers passes absent options as None
        if name in REFUSED_KWARGS:
            raise NotImplementedError(f"attn_implementation='attnlab' does not implement {REFUSED_KWARGS[name]} "
                                      f"(the argument {name!r}); use attn_implementation='eager' for this model")
        if name not in ACCEPTED_KWARGS:
            raise NotImplementedError(f"attn_implementation='attnlab' got the argument {name!r}, which it does not "
                                      f"implement (it takes {', '.join(sorted(ACCEPTED_KWARGS))}); use "
                                      "attn_implementation='eager' for this model, or report the model")


def _dense(block_mask: Optional[flex.BlockMask], mask: Optional[Tensor], B: int) -> Optional[Tensor]:
    """The call's mask as a dense tensor, for the reference (training dropout, output_attentions)."""
    if block_mask is None:
        return mask
    return block_mask.element_mask()  # (Bm, 1, L, S) bool: Bm = B with padding, else 1


def _as_block_mask(mask: Optional[Tensor], causal: bool, B: int, L: int, S: int) -> flex.BlockMask:
    """A BlockMask for a call that came with a dense mask or none (for the soft-capped flex path).

    A bool mask (True = attend) or a float mask of 0 / large negative values (transformers'
    eager style) converts; an additive float mask with other values (a bias) cannot be a
    block mask and is refused rather than silently dropped.
    """
    if mask is None:
        mod = flex.causal_mask if causal else flex.noop_mask
        return flex.create_block_mask(mod, None, None, L, S, BLOCK_SIZE=_block(L, S))
    if mask.dtype == torch.bool:
        keep = mask
    else:
        hidden = mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | hidden).all()):
            raise NotImplementedError("attn_implementation='attnlab': softcap with an additive float attention "
                                      "mask (a bias) is not supported; use attn_implementation='eager'")
        keep = ~hidden
    keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))  # (Bm, Hm, L or 1, S or 1)
    keep = keep.expand(keep.shape[0], keep.shape[1], L, S)
    Bm, Hm = keep.shape[:2]

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[b, h, q_idx, kv_idx]

    return flex.create_block_mask(mask_mod, Bm if Bm > 1 else None, Hm if Hm > 1 else None, L, S,
                                  BLOCK_SIZE=_block(L, S))


def register(name: str = "attnlab") -> None:
    """Register the attention and mask functions under ``name`` (done once on import)."""
    AttentionInterface.register(name, attnlab_attention_forward)
    AttentionMaskInterface.register(name, attnlab_mask)


register()
