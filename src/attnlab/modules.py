"""``nn.Module`` wrappers around attnlab's attention: :class:`SelfAttention` (the lesson's
module, on the reference, with ``trace``), :class:`MultiHeadAttention` (through the front
door, :func:`attnlab.dispatch.attention`, or the reference when it must return the weights)
and :class:`KVCache` (decoding through :mod:`attnlab.decoding`)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab import decoding, dispatch, masks
from attnlab import functional as F_
from attnlab._validation import validate
from attnlab.kernels.memory import cache_zeros
from attnlab.trace import AttentionTrace

__all__ = ["SelfAttention", "MultiHeadAttention", "KVCache"]


class SelfAttention(nn.Module):
    """Single-head self-attention, the lesson's module.

    ``Q = x @ W_Q``, ``K = x @ W_K``, ``V = x @ W_V`` (plus biases when ``bias=True``),
    then ``softmax(Q @ K^T / sqrt(d_k)) @ V`` with attnlab's from-scratch reference.

    Parameters (shapes as in the lesson, inputs on the left so ``x @ W`` works):
        ``W_Q (d_model, d_k)``, ``W_K (d_model, d_k)``, ``W_V (d_model, d_v)``;
        with ``bias=True`` also ``b_Q (d_k,)``, ``b_K (d_k,)``, ``b_V (d_v,)``.

    The weights start as ``randn / sqrt(d_model)``, so unit-variance inputs give
    unit-variance Q, K, V. (The lesson draws plain ``randn``; use
    :meth:`from_weights` to load any weights you like.)

    Args:
        d_model: feature size of the input ``x``.
        d_k: query/key size (the scores are scaled by ``1 / sqrt(d_k)``).
        d_v: value (and output) size.
        bias: add learnable biases to the three projections.
    """

    def __init__(self, d_model: int, d_k: int, d_v: int, bias: bool = False) -> None:
        super().__init__()
        for name, n in (("d_model", d_model), ("d_k", d_k), ("d_v", d_v)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"SelfAttention: {name} must be a positive int, got {n!r}")
        self.d_model, self.d_k, self.d_v = d_model, d_k, d_v
        std = 1.0 / math.sqrt(d_model)
        self.W_Q = nn.Parameter(torch.randn(d_model, d_k) * std)
        self.W_K = nn.Parameter(torch.randn(d_model, d_k) * std)
        self.W_V = nn.Parameter(torch.randn(d_model, d_v) * std)
        if bias:
            self.b_Q = nn.Parameter(torch.zeros(d_k))
            self.b_K = nn.Parameter(torch.zeros(d_k))
            self.b_V = nn.Parameter(torch.zeros(d_v))
        else:
            self.register_parameter("b_Q", None)
            self.register_parameter("b_K", None)
            self.register_parameter("b_V", None)

    @classmethod
    def from_weights(
        cls,
        W_Q: Tensor,
        W_K: Tensor,
        W_V: Tensor,
        b_Q: Optional[Tensor] = None,
        b_K: Optional[Tensor] = None,
        b_V: Optional[Tensor] = None,
    ) -> "SelfAttention":
        """Build a module holding copies of the given weights.

        Args:
            W_Q: ``(d_model, d_k)``.
            W_K: ``(d_model, d_k)``.
            W_V: ``(d_model, d_v)``.
            b_Q: ``(d_k,)``, the query bias; give all three biases or none.
            b_K: ``(d_k,)``, the key bias.
            b_V: ``(d_v,)``, the value bias.

        The module takes the weights' dtype and device.
        """
        for name, w in (("W_Q", W_Q), ("W_K", W_K), ("W_V", W_V)):
            if not isinstance(w, Tensor):
                raise TypeError(f"SelfAttention.from_weights: {name} must be a torch.Tensor, got {type(w).__name__}")
            if w.dim() != 2:
                raise ValueError(f"SelfAttention.from_weights: {name} must be 2-D (d_model, d_out), "
                                 f"got shape {tuple(w.shape)}")
        d_model, d_k = W_Q.shape
        d_v = W_V.shape[1]
        if tuple(W_K.shape) != (d_model, d_k):
            raise ValueError(f"SelfAttention.from_weights: W_K must have W_Q's shape {(d_model, d_k)}, "
                             f"got {tuple(W_K.shape)}")
        if W_V.shape[0] != d_model:
            raise ValueError(f"SelfAttention.from_weights: W_V must be (d_model={d_model}, d_v), "
                             f"got {tuple(W_V.shape)}")
        biases = (b_Q, b_K, b_V)
        has_bias = [b is not None for b in biases]
        if any(has_bias) and not all(has_bias):
            raise ValueError("SelfAttention.from_weights: pass all three biases b_Q, b_K, b_V or none")
        if all(has_bias):
            for name, b, n in (("b_Q", b_Q, d_k), ("b_K", b_K, d_k), ("b_V", b_V, d_v)):
                if tuple(b.shape) != (n,):
                    raise ValueError(f"SelfAttention.from_weights: {name} must have shape ({n},), "
                                     f"got {tuple(b.shape)}")
        module = cls(d_model, d_k, d_v, bias=all(has_bias)).to(device=W_Q.device, dtype=W_Q.dtype)
        with torch.no_grad():
            module.W_Q.copy_(W_Q)
            module.W_K.copy_(W_K)
            module.W_V.copy_(W_V)
            if all(has_bias):
                module.b_Q.copy_(b_Q)
                module.b_K.copy_(b_K)
                module.b_V.copy_(b_V)
        return module

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x (..., T, d_model) -> Q (..., T, d_k), K (..., T, d_k), V (..., T, d_v)``."""
        self._check_input(x)
        Q = x @ self.W_Q  # (..., T, d_k)
        K = x @ self.W_K  # (..., T, d_k)
        V = x @ self.W_V  # (..., T, d_v)
        if self.b_Q is not None:
            Q, K, V = Q + self.b_Q, K + self.b_K, V + self.b_V
        return Q, K, V

    def forward(
        self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Attend over the sequence.

        Args:
            x: ``(B, T, d_model)`` (any leading dims work: ``(..., T, d_model)``).
            attn_mask: ``None`` or bool (``True`` = attend) / float (added), broadcastable
                to ``(B, T, T)``.
            is_causal: top-left causal mask (position ``i`` sees ``0..i``).

        Returns:
            ``(output (B, T, d_v), attn_weights (B, T, T))``.
        """
        return self._run(x, attn_mask, is_causal, record=None)

    def trace(
        self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False
    ) -> AttentionTrace:
        """Run :meth:`forward` and record every step: X, Q, K, V, scores, (masked_scores),
        scores_shifted, weights, output, each with its name, shape and a detached tensor.
        """
        trace = AttentionTrace()
        self._run(x, attn_mask, is_causal, record=trace.record)
        return trace

    def _run(self, x, attn_mask, is_causal, record):
        Q, K, V = self.project(x)
        if record is not None:
            for name, t in (("X", x), ("Q", Q), ("K", K), ("V", V)):
                record(name, t)
        validate(Q, K, V, attn_mask, 0.0, is_causal, None, False, fn="SelfAttention.forward")
        return F_.attention_with_weights(Q, K, V, attn_mask, 0.0, is_causal, None, False, record=record)

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"SelfAttention: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"SelfAttention: x must be (B, T, d_model={self.d_model}), got shape {tuple(x.shape)}")
        if x.dtype != self.W_Q.dtype:
            raise TypeError(f"SelfAttention: x.dtype must match the weights' {self.W_Q.dtype}, got {x.dtype} "
                            f"(convert x, or the module with .to({x.dtype}))")

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_k={self.d_k}, d_v={self.d_v}, bias={self.b_Q is not None}"


class KVCache:
    """Keys and values of the tokens decoded so far, for one :class:`MultiHeadAttention`.

    Holds ``(B, Hkv, T, head_dim)`` keys and values: with grouped-query attention only
    the key/value heads are stored. ``max_len`` preallocates (and caps) the cache;
    without it the cache grows as tokens arrive, doubling its capacity when full (so a
    token's append copies only itself, amortised, instead of the whole cache each step).
    :meth:`append` returns views of the cache's storage, no copies.

    Args:
        batch: B.
        num_kv_heads: Hkv.
        head_dim: the size of one head.
        max_len: capacity in tokens, or None to grow without a cap.
        dtype: of the stored tensors; ``torch.int8`` keeps each token's key and value per head as
            int8 with one float32 scale (:func:`attnlab.decoding.quantize`): :meth:`append` then
            returns dequantised float32 copies, and :class:`MultiHeadAttention`'s decode step reads
            the int8 rows in place (:meth:`stored`).
        device: where they are stored.
        smooth_keys: int8 only: divide each key channel by
            :func:`attnlab.decoding.channel_smoothing`'s factor, calibrated on the first
            :meth:`append` of at least ``attnlab.decoding.SMOOTHING_MIN_TOKENS`` tokens (the
            prompt), and multiply the query by it when decoding (:attr:`k_channel_scale`).
    """

    MIN_CAPACITY = 16  # the first allocation without max_len, in tokens

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, max_len: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None,
                 smooth_keys: bool = True) -> None:
        self.batch, self.num_kv_heads, self.head_dim, self.max_len = batch, num_kv_heads, head_dim, max_len
        capacity = max_len if max_len is not None else 0
        # on huge pages where Linux offers them (attnlab.kernels.memory: a decode step's page walks)
        self._k = cache_zeros((batch, num_kv_heads, capacity, head_dim), dtype, device)
        self._v = cache_zeros(self._k.shape, dtype, self._k.device)
        self.quantized = dtype == torch.int8
        self._ks = self._k.new_ones(batch, num_kv_heads, capacity, dtype=torch.float32) if self.quantized else None
        self._vs = torch.ones_like(self._ks) if self.quantized else None
        self.smooth_keys = bool(smooth_keys) and self.quantized
        # int8 with smoothing: (B, Hkv, head_dim) factors the stored keys were divided by (else None)
        self.k_channel_scale: Optional[Tensor] = None
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add ``(B, Hkv, T_new, head_dim)`` keys and values; return all of them so far."""
        expected = (self.batch, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expected:
                raise ValueError(f"KVCache.append: {name} must be (B={self.batch}, Hkv={self.num_kv_heads}, T, "
                                 f"head_dim={self.head_dim}), got {tuple(t.shape)}")
        new = k.shape[2]
        if self.max_len is not None and self.length + new > self.max_len:
            raise ValueError(f"KVCache.append: the cache is full: {self.length} + {new} tokens > max_len="
                             f"{self.max_len}; make a larger cache or start a new one")
        if self.length + new > self._k.shape[2]:  # only without max_len: grow geometrically
            self._grow(self.length + new)
        span = slice(self.length, self.length + new)
        if self.quantized:
            from attnlab.decoding import SMOOTHING_MIN_TOKENS, channel_smoothing, dequantize, quantize

            if self.length == 0 and self.smooth_keys and new >= SMOOTHING_MIN_TOKENS:
                self.k_channel_scale = channel_smoothing(k)  # (B, Hkv, head_dim), from the prompt's keys
            if self.k_channel_scale is not None:
                k = k.detach().to(torch.float32) / self.k_channel_scale[:, :, None, :]
            (self._k[:, :, span], self._ks[:, :, span]), (self._v[:, :, span], self._vs[:, :, span]) = \
                quantize(k), quantize(v)
            self.length += new
            k_all, v_all, ks, vs = self.stored()
            return dequantize(k_all, ks, self.k_channel_scale), dequantize(v_all, vs)
        self._k[:, :, span] = k.detach()
        self._v[:, :, span] = v.detach()
        self.length += new
        return self._k[:, :, : self.length], self._v[:, :, : self.length]

    def stored(self) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
        """Views of what is stored: ``(k, v, k_scale, v_scale)``, ``(B, Hkv, length, head_dim)`` and,
        for an int8 cache, ``(B, Hkv, length)`` float32 scales (else None)."""
        n = self.length
        if not self.quantized:
            return self._k[:, :, :n], self._v[:, :, :n], None, None
        return self._k[:, :, :n], self._v[:, :, :n], self._ks[:, :, :n], self._vs[:, :, :n]

    def _grow(self, needed: int) -> None:
        """Capacity ``max(needed, 2 x capacity, 16)``: ``log2(T)`` copies for ``T`` tokens."""
        capacity = max(needed, 2 * self._k.shape[2], self.MIN_CAPACITY)
        k = cache_zeros((self.batch, self.num_kv_heads, capacity, self.head_dim), self._k.dtype, self._k.device)
        v = cache_zeros(k.shape, k.dtype, k.device)
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v
        if self.quantized:
            ks = self._ks.new_ones(self.batch, self.num_kv_heads, capacity)
            vs = torch.ones_like(ks)
            ks[:, :, : self.length] = self._ks[:, :, : self.length]
            vs[:, :, : self.length] = self._vs[:, :, : self.length]
            self._ks, self._vs = ks, vs

    @property
    def capacity(self) -> int:
        """Tokens the cache can hold before it grows (``max_len`` when given)."""
        return self._k.shape[2]

    def reset(self) -> None:
        self.length = 0
        self.k_channel_scale = None  # the next prompt calibrates again


class MultiHeadAttention(nn.Module):
    """Multi-head attention with grouped-query heads, cross attention and a KV cache.

    ``Q = query @ W_q``, ``K = key @ W_k``, ``V = value @ W_v`` split into heads, attention
    per head (attnlab's own), heads merged and projected by ``out_proj``::

        query (B, L, d_model) -> Q (B, H, L, hd)      hd = d_model / H
        key   (B, S, kdim)    -> K (B, Hkv, S, hd)    Hkv = num_kv_heads (GQA when < H)
        value (B, S, vdim)    -> V (B, Hkv, S, hd)
        attention             -> (B, H, L, hd) -> merge -> (B, L, d_model) -> out_proj

    Query heads ``0..H/Hkv-1`` share key/value head 0 (SDPA's ``enable_gqa`` grouping).

    **Mask polarity: True = attend**, everywhere in attnlab, this module's ``attn_mask``
    and ``key_padding_mask`` included (``key_padding_mask[b, j] = True`` means key ``j``
    is a real token). ``torch.nn.MultiheadAttention`` uses the opposite, True = ignore,
    for both. Float masks are additive in both. Pass ``~mask`` for a bool mask written for
    torch's module; :meth:`from_torch` and :meth:`to_torch` move weights only, never masks.

    Args:
        d_model: embedding size (and output size); a multiple of ``num_heads``.
        num_heads: H.
        num_kv_heads: Hkv, a divisor of H (default H; 1 is multi-query attention).
        bias: biases in the four projections.
        dropout: attention-weight dropout, applied in training mode only.
        batch_first: inputs ``(B, L, E)`` (True) or ``(L, B, E)`` (False).
        kdim: the feature size of ``key`` (default ``d_model``).
        vdim: the feature size of ``value`` (default ``d_model``).
        sinks: a learnable attention sink per query head (``self.sinks``, ``(H,)``, zeros at
            first): a logit in each row's softmax denominator without a value, as gpt-oss's.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: Optional[int] = None, bias: bool = True,
                 dropout: float = 0.0, batch_first: bool = True, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, sinks: bool = False) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, n in (("d_model", d_model), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"MultiHeadAttention: {name} must be a positive int, got {n!r}")
        if d_model % num_heads:
            raise ValueError(f"MultiHeadAttention: d_model={d_model} must be a multiple of num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"MultiHeadAttention: num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MultiHeadAttention: dropout must be in [0, 1), got {dropout}")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim = d_model // num_heads
        self.kdim, self.vdim = kdim or d_model, vdim or d_model
        self.dropout, self.batch_first = dropout, batch_first
        kv_out = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(self.kdim, kv_out, bias=bias)
        self.v_proj = nn.Linear(self.vdim, kv_out, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None  # (H,)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"batch_first={self.batch_first}" + (", sinks=True" if self.sinks is not None else ""))

    # ------------------------------------------------------------------ forward
    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None,
                is_causal: bool = False, need_weights: bool = False, average_attn_weights: bool = True,
                kv_cache: Optional[KVCache] = None) -> tuple[Tensor, Optional[Tensor]]:
        """Attend from ``query`` to ``key``/``value`` (default: to ``query`` itself).

        Args:
            query: ``(B, L, d_model)`` (``(L, B, d_model)`` when not batch_first).
            key: ``(B, S, kdim)``; default ``query`` (self-attention).
            value: ``(B, S, vdim)``; default ``key``.
            attn_mask: bool (True = attend) or float (added): ``(L, S)`` or ``(B * H, L, S)``.
            key_padding_mask: ``(B, S)``, bool (True = real token) or float (added).
            is_causal: a causal mask, top-left aligned; with ``kv_cache`` bottom-right, so
                the new tokens see every cached one.
            need_weights: also return the attention weights (computed with the reference).
            average_attn_weights: average the weights over heads: ``(B, L, S)``, else
                ``(B, H, L, S)``.
            kv_cache: a :class:`KVCache` or an :class:`attnlab.decoding.PagedKVCache`; the
                new keys/values are appended and attention runs over everything cached
                (self-attention decoding). Without gradients, masks or weights, a decode step
                runs :mod:`attnlab.decoding`'s kernel on the cache in place.

        Returns:
            ``(output (B, L, d_model), weights or None)``.
        """
        key = query if key is None else key
        value = key if value is None else value
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        self._check(query, key, value)
        B, L, _ = query.shape
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(query).view(B, L, H, hd).transpose(1, 2)  # (B, H, L, hd)
        k = self.k_proj(key).view(B, key.shape[1], Hkv, hd).transpose(1, 2)  # (B, Hkv, S, hd)
        v = self.v_proj(value).view(B, value.shape[1], Hkv, hd).transpose(1, 2)  # (B, Hkv, S, hd)
        paged = None
        if isinstance(kv_cache, decoding.PagedKVCache):
            kv_cache.append(k, v)
            paged = kv_cache
            k, v = kv_cache.k_pages, kv_cache.v_pages  # read in place by the decode kernel, or made dense below
        elif kv_cache is not None and getattr(kv_cache, "quantized", False):
            kv_cache.append(k, v)
            dropout_p = self.dropout if self.training else 0.0
            if (attn_mask is None and key_padding_mask is None and L <= dispatch.DECODE_MAX_L and not need_weights
                    and dropout_p == 0 and not torch.is_grad_enabled()):  # a decode step on the int8 rows in place
                k8, v8, ks, vs = kv_cache.stored()
                out = decoding.decode_attention(q, k8, v8, is_causal=is_causal, causal_align="bottom_right",
                                                enable_gqa=Hkv != H, k_scale=ks, v_scale=vs,
                                                k_channel_scale=kv_cache.k_channel_scale, sinks=self.sinks)
                return self._finish(out, B, L), None
            k8, v8, ks, vs = kv_cache.stored()  # masks, weights or gradients: the dense path, dequantised
            k, v = decoding.dequantize(k8, ks, kv_cache.k_channel_scale), decoding.dequantize(v8, vs)
        elif kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, Hkv, cached + S, hd): views of the cache's storage
        S = paged.length if paged is not None else k.shape[2]
        gqa = Hkv != H
        dropout_p = self.dropout if self.training else 0.0
        # a decoder's causal step with nothing else to mask: bottom-right causality as a flag, so
        # the decode path runs without a mask tensor
        flag_causal = kv_cache is not None and is_causal and attn_mask is None and key_padding_mask is None
        if paged is not None:
            unmasked = attn_mask is None and key_padding_mask is None
            if (unmasked and L <= dispatch.DECODE_MAX_L and not need_weights and dropout_p == 0
                    and not torch.is_grad_enabled()):  # a decode step: the kernel reads the pages in place
                out = decoding.paged_decode_attention(q, paged, is_causal=is_causal, causal_align="bottom_right",
                                                      sinks=self.sinks)
                return self._finish(out, B, L), None
            k, v = paged.dense()  # masks, weights or gradients: the dense path below, on a copy
        mask = None if flag_causal else self._combined_mask(attn_mask, key_padding_mask, is_causal, B, L, S,
                                                            kv_cache is not None, q)
        if need_weights:
            w = F_.attention_weights(q, k, attn_mask=mask, enable_gqa=gqa, sinks=self.sinks)  # (B, H, L, S)
            if dropout_p > 0:
                w = F_.dropout_weights(w, dropout_p)
            v_full = F_.repeat_kv_heads(v, q) if gqa else v
            out = w @ v_full  # (B, H, L, hd)
            weights = w.mean(dim=1) if average_attn_weights else w
        else:
            out = dispatch.attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa,
                                     is_causal=flag_causal, causal_align="bottom_right", sinks=self.sinks)
            weights = None
        return self._finish(out, B, L), weights

    def _finish(self, out: Tensor, B: int, L: int) -> Tensor:
        """``(B, H, L, hd)`` heads -> merged -> ``out_proj`` -> ``(B, L, d_model)`` (or ``(L, B, d_model)``)."""
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.d_model))  # (B, L, d_model)
        return out.transpose(0, 1) if not self.batch_first else out

    def _check(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        layout = "(B, L, E)" if self.batch_first else "(L, B, E)"
        for name, t, dim in (("query", query, self.d_model), ("key", key, self.kdim), ("value", value, self.vdim)):
            if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != dim:
                raise ValueError(f"MultiHeadAttention: {name} must be {layout} with E={dim}, got "
                                 f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(f"MultiHeadAttention: key {tuple(key.shape)} and value {tuple(value.shape)} must "
                             f"share B and S, and B must match query {tuple(query.shape)}")

    def _combined_mask(self, attn_mask, key_padding_mask, is_causal, B, L, S, decoding, q) -> Optional[Tensor]:
        """All masks as one, broadcastable to (B, H, L, S): bool when every part is bool, else additive."""
        parts = []
        if attn_mask is not None:
            if attn_mask.dim() == 3:  # (B * H, L, S), as torch's module takes it
                attn_mask = attn_mask.view(B, self.num_heads, L, S)
            elif attn_mask.dim() != 2:
                raise ValueError(f"MultiHeadAttention: attn_mask must be (L, S) or (B * num_heads, L, S), got "
                                 f"{tuple(attn_mask.shape)}")
            parts.append(attn_mask)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (B, S):
                raise ValueError(f"MultiHeadAttention: key_padding_mask must be (B, S) = {(B, S)} (True = real "
                                 f"token), got {tuple(key_padding_mask.shape)}")
            parts.append(key_padding_mask[:, None, None, :])  # (B, 1, 1, S)
        if is_causal:
            parts.append(masks.causal(L, S, align="bottom_right" if decoding else "top_left", device=q.device))
        if not parts:
            return None
        if all(p.dtype == torch.bool for p in parts):
            return masks.both(*parts)
        total = None
        for p in parts:
            add = masks.to_additive(p, q.dtype) if p.dtype == torch.bool else p.to(q.dtype)
            total = add if total is None else total + add
        return total

    # ------------------------------------------------------------------ torch interop
    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> "MultiHeadAttention":
        """The same weights as a ``torch.nn.MultiheadAttention`` (outputs and weights match,
        given masks in attnlab's polarity: True = attend)."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"MultiHeadAttention.from_torch: expected nn.MultiheadAttention, got "
                            f"{type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("MultiHeadAttention.from_torch: add_bias_kv and add_zero_attn are not supported")
        E = module.embed_dim
        bias = module.in_proj_bias is not None
        ours = cls(E, module.num_heads, bias=bias, dropout=module.dropout, batch_first=module.batch_first,
                   kdim=module.kdim, vdim=module.vdim).to(module.out_proj.weight.dtype)
        with torch.no_grad():
            if module._qkv_same_embed_dim:
                wq, wk, wv = module.in_proj_weight.chunk(3)
            else:
                wq, wk, wv = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
            for proj, w in ((ours.q_proj, wq), (ours.k_proj, wk), (ours.v_proj, wv)):
                proj.weight.copy_(w)
            if bias:
                for proj, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), module.in_proj_bias.chunk(3)):
                    proj.bias.copy_(b)
            ours.out_proj.weight.copy_(module.out_proj.weight)
            if bias:
                ours.out_proj.bias.copy_(module.out_proj.bias)
        return ours

    def to_torch(self) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention`` with these weights (not for grouped-query heads).
        Remember its masks use True = ignore."""
        if self.num_kv_heads != self.num_heads:
            raise ValueError(f"MultiHeadAttention.to_torch: torch's module has no grouped-query heads "
                             f"(num_kv_heads={self.num_kv_heads} != num_heads={self.num_heads})")
        if self.sinks is not None:
            raise ValueError("MultiHeadAttention.to_torch: torch's module has no attention sinks (this one was "
                             "made with sinks=True)")
        bias = self.q_proj.bias is not None
        kdim = None if self.kdim == self.d_model else self.kdim
        vdim = None if self.vdim == self.d_model else self.vdim
        module = nn.MultiheadAttention(self.d_model, self.num_heads, dropout=self.dropout, bias=bias,
                                       kdim=kdim, vdim=vdim, batch_first=self.batch_first)
        module = module.to(self.q_proj.weight.dtype)
        with torch.no_grad():
            if module._qkv_same_embed_dim:
                module.in_proj_weight.copy_(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
            else:
                module.q_proj_weight.copy_(self.q_proj.weight)
                module.k_proj_weight.copy_(self.k_proj.weight)
                module.v_proj_weight.copy_(self.v_proj.weight)
            if bias:
                module.in_proj_bias.copy_(torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
                module.out_proj.bias.copy_(self.out_proj.bias)
            module.out_proj.weight.copy_(self.out_proj.weight)
        return module
