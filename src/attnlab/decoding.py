"""Decoding: a few new query tokens against a long KV cache, at the memory bandwidth's pace.

    from attnlab.decoding import decode_attention, PagedKVCache, paged_decode_attention

    out = decode_attention(q, k_cache, v_cache, enable_gqa=True)   # q (B, H, 1, E), k (B, Hkv, S, E)

    cache = PagedKVCache(batch=1, num_kv_heads=8, head_dim=128, page_size=16)
    cache.append(k_new, v_new)                                     # (B, Hkv, T, E)
    out = paged_decode_attention(q, cache, is_causal=True, causal_align="bottom_right")

:func:`decode_attention` has SDPA's meaning (``is_causal`` is top-left, as SDPA's) without a
tensor mask or dropout; ``causal_align="bottom_right"`` lines the last query up with the last
key, what a decoder with a cache needs (speculative decoding, chunked prefill)::

    L = 2, S = 5       top_left      bottom_right
                       # . . . .     # # # # .
                       # # . . .     # # # # #

How it is fast (``csrc/decode.cpp``; :mod:`attnlab.kernels.decode`): the query heads of a GQA
group are the rows of one task, so each K/V row is read once; the keys are split into chunks
across threads and the chunks' partial results joined by the log-sum-exp merge; bfloat16 and
float16 caches are read as stored, never copied to float32; NaN and inf are caught from the
small output instead of re-reading the cache each step (such a call is redone on the pure path,
which propagates them as torch's MATH backend does).

**int8 caches** (``KVCache``/``PagedKVCache`` with ``dtype=torch.int8``, or ``decode_attention``'s
``k_scale``/``v_scale``): each cached key and value row (one token, one head) is stored as int8
with one float32 scale, ``row ~ scale * int8``, ``scale = max|row| / 127`` (symmetric, as ONNX
Runtime's and vLLM's int8 caches); the kernel reads the int8 rows and applies the scales inside
its dot products and AXPYs (:func:`quantize` makes them). LLM keys have a few outlier channels,
which set a per-token scale and leave the other channels ~3 bits; the caches therefore divide
each key channel by a factor ``lambda >= 1`` before quantizing (:func:`channel_smoothing`,
calibrated on the prompt) and multiply the query by it instead, as QServe's SmoothAttention
does: ``q . k = (q * lambda) . (k / lambda)``, exact, and the query stays float32.

There is **no backward**: decoding needs no gradients, and a call whose inputs require grad
is refused (train with :func:`attnlab.flash_attention`).
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch
from torch import Tensor

from attnlab._validation import compute_dtype, default_scale, validate, validate_sinks
from attnlab.kernels import LOG2E, Layout
from attnlab.kernels import decode as kernel
from attnlab.kernels import sinks as _sinks
from attnlab.kernels.memory import cache_zeros

__all__ = ["decode_attention", "paged_decode_attention", "PagedKVCache", "quantize", "dequantize",
           "channel_smoothing", "SMOOTHING_MIN_TOKENS"]

Align = Literal["top_left", "bottom_right"]


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(int8 values, float32 scales)`` of ``x (..., D)``: one scale per row of ``D`` (a token's
    key or value in one head), ``scale = max|row| / 127`` (1 for a row of zeros), values
    ``round(row / scale)`` in ``[-127, 127]``; ``scale[..., None] * values`` is the row again,
    within half a step."""
    x = x.detach().to(torch.float32)
    amax = x.abs().amax(dim=-1)  # (...,)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    values = torch.round(x / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return values, scale


def dequantize(values: Tensor, scale: Tensor, channel_scale: Optional[Tensor] = None) -> Tensor:
    """The float32 rows an int8 cache stands for: ``scale[..., None] * values``, times
    ``channel_scale[..., None, :]`` (``(..., E)``, one factor per channel: :func:`channel_smoothing`)
    for keys that were divided by it before :func:`quantize`."""
    rows = kernel.dequantize(values, scale)
    return rows if channel_scale is None else rows * channel_scale[..., None, :]


SMOOTHING_MIN_TOKENS = 16  # fewer tokens than this say too little about which channels are outliers


def channel_smoothing(k: Tensor) -> Tensor:
    """Per-channel factors ``lambda (..., E)`` that flatten the outlier channels of keys
    ``k (..., S, E)`` before int8 quantization (QServe's SmoothAttention, with the query kept in
    float32): ``lambda_e = max(1, amax_e / median(amax))``, ``amax_e = max_s |k[..., s, e]|``.

    Only channels larger than the median are divided (``lambda >= 1``), so a later token can never
    be blown up by a small factor. On keys with two channels 20x the rest the int8 decode error
    falls 8.5x (max) and 9x (RMS), below a bfloat16 cache's; on Gaussian keys it is unchanged
    (``benchmarks/int8_accuracy.py``, BENCHMARKS.md "int8 KV cache: accuracy")."""
    amax = k.detach().to(torch.float32).abs().amax(dim=-2)  # (..., E)
    median = amax.median(dim=-1, keepdim=True).values  # (..., 1)
    ratio = torch.where(median > 0, amax / median.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    return ratio.clamp_min(1.0)


def decode_attention(query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False, scale: Optional[float] = None,
                     *, enable_gqa: bool = False, causal_align: Align = "top_left",
                     cache_seqlens: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
                     v_scale: Optional[Tensor] = None, k_channel_scale: Optional[Tensor] = None,
                     sinks: Optional[Tensor] = None) -> Tensor:
    """Attention of a few queries over a KV cache; SDPA's semantics, no mask, no dropout, no backward.

    Args:
        query: ``(..., L, E)``, e.g. ``(B, H, L, E)`` with ``L`` small (1 per generated token).
        key: ``(..., S, E)``, e.g. ``(B, Hkv, S, E)``: may be a view of a larger cache.
        value: ``(..., S, Ev)``.
        is_causal: hide keys after each query's position (aligned by ``causal_align``).
        scale: default ``1 / sqrt(E)``.
        enable_gqa: query head ``h`` uses key/value head ``h // (H // Hkv)``; nothing is repeated.
        causal_align: ``"top_left"`` (SDPA's ``is_causal``: query ``i`` sees keys ``0..i``) or
            ``"bottom_right"`` (query ``i`` sees keys ``0..S_b - L + i``).
        cache_seqlens: ``(B,)`` ints, FlashAttention's ``flash_attn_with_kvcache`` meaning: batch
            ``b`` has ``cache_seqlens[b]`` keys, later rows of its K/V are not read (4-D inputs).
        k_scale: for an int8 ``key``: ``(..., S)`` float32, one scale per row (:func:`quantize`).
        v_scale: for an int8 ``value``: ``(..., S)`` float32, likewise.
        k_channel_scale: for an int8 ``key`` whose rows were divided per channel before
            quantizing: ``(..., E)`` float32 (``key``'s dims without ``S``; :func:`channel_smoothing`),
            so that a key row stands for ``k_scale * int8 * k_channel_scale``.
        sinks: ``(H,)``, a logit per query head in each row's softmax denominator, without a
            value (gpt-oss's attention sinks; :mod:`attnlab.kernels.sinks`), folded into the
            kernel's ``(out, lse)``.

    Returns:
        ``(..., L, Ev)`` in the query's dtype; a row that sees no key is 0, as in SDPA.
    """
    fn = "decode_attention"
    if key.dtype == torch.int8 if isinstance(key, Tensor) else False:
        _check_int8(fn, key, value, k_scale, v_scale)
        if k_channel_scale is not None:
            expected = tuple(key.shape[:-2]) + (key.shape[-1],)
            if (not isinstance(k_channel_scale, Tensor) or k_channel_scale.dtype != torch.float32
                    or tuple(k_channel_scale.shape) != expected):
                got = (f"{k_channel_scale.dtype} {tuple(k_channel_scale.shape)}" if isinstance(k_channel_scale, Tensor)
                       else type(k_channel_scale).__name__)
                raise ValueError(f"{fn}: k_channel_scale must be float32 of shape {expected} (one factor per key "
                                 f"channel: attnlab.decoding.channel_smoothing), got {got}")
        # the checks of SDPA's shapes on zero-stride float stand-ins: nothing is read or copied
        stand_in = torch.zeros((), dtype=query.dtype if isinstance(query, Tensor) else torch.float32,
                               device=key.device)
        batch = validate(query, stand_in.expand(key.shape), stand_in.expand(value.shape), None, 0.0, is_causal,
                         scale, enable_gqa, fn=fn)
    else:
        if k_scale is not None or v_scale is not None or k_channel_scale is not None:
            raise ValueError(f"{fn}: k_scale, v_scale and k_channel_scale are for an int8 key and value (a quantized "
                             f"cache), got "
                             f"key {key.dtype if isinstance(key, Tensor) else type(key).__name__}")
        batch = validate(query, key, value, None, 0.0, is_causal, scale, enable_gqa, fn=fn)
    _check_align(causal_align, fn)
    validate_sinks(sinks, query, fn)
    _refuse_grad(fn, query, key, value, *(() if sinks is None else (sinks,)))
    if torch.compiler.is_compiling():  # one op to Dynamo: the kernel's data-dependent choices stay inside it
        return torch.ops.attnlab.decode_attention(query, key, value, is_causal, scale, enable_gqa, causal_align,
                                                  cache_seqlens, k_scale, v_scale, k_channel_scale, sinks)
    if any(t.is_meta for t in (query, key, value)):  # shapes only: the reference's rules (no cache is read)
        from attnlab import functional

        if key.dtype == torch.int8:
            key, value = (torch.empty(t.shape, dtype=query.dtype, device="meta") for t in (key, value))
        return functional.scaled_dot_product_attention(query, key, value, None, 0.0, is_causal, scale,
                                                       enable_gqa=enable_gqa, sinks=sinks)
    L, E, S = query.shape[-2], query.shape[-1], key.shape[-2]
    if enable_gqa and key.shape[-3] != value.shape[-3]:
        H = query.shape[-3]  # K and V grouped differently: each is repeated up to the query heads
        key = key.repeat_interleave(H // key.shape[-3], dim=-3)  # (..., H, S, E)
        if k_channel_scale is not None:
            k_channel_scale = k_channel_scale.repeat_interleave(H // k_channel_scale.shape[-2], dim=-2)  # (..., H, E)
        if k_scale is not None:
            k_scale = k_scale.repeat_interleave(H // k_scale.shape[-2], dim=-2)  # (..., H, S)
            v_scale = v_scale.repeat_interleave(H // v_scale.shape[-2], dim=-2)
        value = value.repeat_interleave(H // value.shape[-3], dim=-3)  # (..., H, S, Ev)
    layout = Layout(batch, query, key, enable_gqa)
    seqlens = _seqlens(cache_seqlens, query, key, layout, fn)
    dtype = compute_dtype(query.dtype)
    q4 = layout.queries(query.to(dtype))  # (Nb, r, L, E)
    k3, v3 = layout.keys(key), layout.keys(value)  # (Nb, S, E), (Nb, S, Ev): views where they can be
    scales = (layout.keys(k_scale[..., None])[..., 0], layout.keys(v_scale[..., None])[..., 0]) if k_scale is not None \
        else (None, None)  # (Nb, S) each: the rows' scales on the layout of k3, v3
    if k_channel_scale is not None:  # q . (k / lambda * lambda) = (q * lambda) . (k / lambda): scale the query
        q4 = q4 * layout.keys(k_channel_scale[..., None, :]).unsqueeze(1)  # (Nb, r, L, E) * (Nb, 1, 1, E)
    out4, lse2 = _run(q4, k3, v3, None, Hkv=_kv_heads(layout, seqlens), S=S, scale=_scale(scale, E),
                      is_causal=is_causal, align=causal_align, seqlens=seqlens, scales=scales, out_dtype=query.dtype)
    if sinks is not None:
        out4, _ = _sinks.absorb(out4, lse2, _sinks.rows(sinks, layout, L, lse2.dtype), base2=True)
    return out4.reshape(*layout.batch, L, value.shape[-1]).to(query.dtype)


# Under torch.compile, decode_attention is one custom op (its route choices read the data: 5 graph
# breaks on Tensor.item() and the library's loading); it has no backward, as eager has none.
@torch.library.custom_op("attnlab::decode_attention", mutates_args=())
def _decode_attention_op(query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: Optional[float],
                         enable_gqa: bool, causal_align: str, cache_seqlens: Optional[Tensor],
                         k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                         k_channel_scale: Optional[Tensor], sinks: Optional[Tensor]) -> Tensor:
    """``(..., L, Ev)``: :func:`decode_attention`, arguments already checked."""
    return decode_attention(query, key, value, is_causal, scale, enable_gqa=enable_gqa, causal_align=causal_align,
                            cache_seqlens=cache_seqlens, k_scale=k_scale, v_scale=v_scale,
                            k_channel_scale=k_channel_scale, sinks=sinks)


@_decode_attention_op.register_fake
def _(query, key, value, is_causal, scale, enable_gqa, causal_align, cache_seqlens, k_scale, v_scale,
      k_channel_scale, sinks):
    stand_in = query.new_zeros(())  # the shapes of an int8 cache, checked as floats (nothing is read)
    batch = validate(query, stand_in.expand(key.shape), stand_in.expand(value.shape), None, 0.0, is_causal, scale,
                     enable_gqa, fn="decode_attention")
    return query.new_empty((*batch, query.shape[-2], value.shape[-1]))


def paged_decode_attention(query: Tensor, cache: "PagedKVCache", is_causal: bool = False,
                           scale: Optional[float] = None, *, causal_align: Align = "top_left",
                           sinks: Optional[Tensor] = None) -> Tensor:
    """:func:`decode_attention` over a :class:`PagedKVCache`, read page by page in place.

    Args:
        query: ``(B, H, L, E)``, ``H`` a multiple of the cache's ``num_kv_heads`` (GQA).
        cache: the keys and values, ``cache.length`` of them per sequence.
        is_causal: as in :func:`decode_attention`; a decoder whose new
            tokens are the cache's last ``L`` wants ``is_causal=True, causal_align="bottom_right"``.
        scale: as in :func:`decode_attention`.
        causal_align: as in :func:`decode_attention`.
        sinks: ``(H,)``, as in :func:`decode_attention`.

    Returns:
        ``(B, H, L, head_dim)`` in the query's dtype.
    """
    fn = "paged_decode_attention"
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"{fn}: cache must be an attnlab.decoding.PagedKVCache, got {type(cache).__name__}")
    if not isinstance(query, Tensor) or query.dim() != 4:
        raise ValueError(f"{fn}: query must be (B, H, L, E), got "
                         f"{tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__}")
    B, H, L, E = query.shape
    Hkv = cache.num_kv_heads
    if B != cache.batch or E != cache.head_dim or H % Hkv:
        raise ValueError(f"{fn}: query must be (B={cache.batch}, H (a multiple of {Hkv}), L, E={cache.head_dim}), "
                         f"got {tuple(query.shape)}")
    if cache.quantized:
        if not query.is_floating_point() or query.device != cache.device:
            raise TypeError(f"{fn}: query must be a float tensor on {cache.device} (the cache is int8), got "
                            f"{query.dtype} on {query.device}")
    elif query.dtype != cache.dtype or query.device != cache.device:
        raise TypeError(f"{fn}: query must be {cache.dtype} on {cache.device} like the cache, got {query.dtype} "
                        f"on {query.device}")
    validate(query, query, None, None, 0.0, is_causal, scale, False, fn=fn)  # is_causal and scale
    _check_align(causal_align, fn)
    validate_sinks(sinks, query, fn)
    _refuse_grad(fn, query, *(() if sinks is None else (sinks,)))
    q4 = query.to(compute_dtype(query.dtype)).reshape(B * Hkv, H // Hkv, L, E)  # (Nb, r, L, E)
    if cache.k_channel_scale is not None:  # keys stored divided by lambda: the query carries it
        q4 = q4 * cache.k_channel_scale.reshape(B * Hkv, 1, 1, E)
    out4, lse2 = _run(q4, cache.k_pages, cache.v_pages, cache.block_table, Hkv=Hkv, S=cache.length,
                      scale=_scale(scale, E), is_causal=is_causal, align=causal_align, seqlens=None,
                      scales=(cache.k_scales, cache.v_scales), out_dtype=query.dtype)
    if sinks is not None:  # (Nb, r, L): query head h = nb % Hkv * r + j of batch nb // Hkv
        sink_rows = sinks.to(lse2.dtype).reshape(1, Hkv, H // Hkv, 1).expand(B, Hkv, H // Hkv, L)
        out4, _ = _sinks.absorb(out4, lse2, sink_rows.reshape(B * Hkv, H // Hkv, L), base2=True)
    return out4.reshape(B, H, L, E).to(query.dtype)


class PagedKVCache:
    """A KV cache in fixed-size pages with a block table, as vLLM keeps them.

    The pages of every sequence live in one pool, ``k_pages`` and ``v_pages``
    ``(num_pages, page_size, Hkv, head_dim)``; ``block_table[b, p]`` is the pool page that holds
    tokens ``p * page_size .. (p + 1) * page_size - 1`` of sequence ``b``. Pages are handed out as
    tokens arrive, so sequences' pages interleave in the pool and nothing is ever moved; the
    decode kernel follows the table (:func:`paged_decode_attention`).

    Args:
        batch: B, the sequences (they grow together: :meth:`append` takes all of them).
        num_kv_heads: Hkv.
        head_dim: the size of one head.
        page_size: tokens per page (default 16, vLLM's).
        num_pages: the pool's size; None grows it by doubling when it is full (new pages only:
            the table's page numbers stay valid).
        dtype: of the stored keys and values; ``torch.int8`` keeps each token's key and value per
            head as int8 with one float32 scale (:func:`quantize`), in ``k_scales`` and
            ``v_scales`` ``(num_pages, page_size, Hkv)``: a quarter of float32's memory and reads.
        device: where they are stored.
        smooth_keys: int8 only: divide each key channel by :func:`channel_smoothing`'s factor,
            calibrated on the first :meth:`append` when it brings at least
            :data:`SMOOTHING_MIN_TOKENS` tokens (a prompt; with fewer, the cache stays unsmoothed),
            and multiply the query by it when decoding (``k_channel_scale``, ``(B, Hkv, head_dim)``).
    """

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, *, page_size: int = 16,
                 num_pages: Optional[int] = None, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, smooth_keys: bool = True) -> None:
        for name, n in (("batch", batch), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("page_size", page_size)) + ((("num_pages", num_pages),) if num_pages is not None else ()):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {n!r}")
        self.batch, self.num_kv_heads, self.head_dim, self.page_size = batch, num_kv_heads, head_dim, page_size
        self.max_pages = num_pages
        self.dtype = dtype
        pool = num_pages if num_pages is not None else batch
        # on huge pages where Linux offers them (attnlab.kernels.memory: a decode step's page walks)
        self.k_pages = cache_zeros((pool, page_size, num_kv_heads, head_dim), dtype, device)
        self.v_pages = cache_zeros(self.k_pages.shape, dtype, self.k_pages.device)
        self.device = self.k_pages.device
        self.quantized = dtype == torch.int8
        # int8: one float32 scale per token and head, beside its row (None otherwise)
        self.k_scales = (torch.ones(pool, page_size, num_kv_heads, dtype=torch.float32, device=self.device)
                         if self.quantized else None)
        self.v_scales = torch.ones_like(self.k_scales) if self.quantized else None
        self.smooth_keys = bool(smooth_keys) and self.quantized
        self.k_channel_scale: Optional[Tensor] = None  # (B, Hkv, head_dim), once calibrated
        self.block_table = torch.zeros(batch, 0, dtype=torch.int64, device=self.device)
        self.pages_used = 0
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> None:
        """Add ``(B, Hkv, T, head_dim)`` keys and values for every sequence."""
        expected = (self.batch, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expected:
                raise ValueError(f"PagedKVCache.append: {name} must be (B={self.batch}, Hkv={self.num_kv_heads}, T, "
                                 f"head_dim={self.head_dim}), got "
                                 f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"PagedKVCache.append: k and v must have the same T, got {k.shape[2]} and {v.shape[2]}")
        T = k.shape[2]
        self._reserve(self.length + T)
        pos = torch.arange(self.length, self.length + T, device=self.device)  # (T,)
        pages = self.block_table[:, pos // self.page_size]  # (B, T)
        offsets = (pos % self.page_size).expand(self.batch, T)  # (B, T)
        if self.quantized:
            if self.length == 0 and self.smooth_keys and T >= SMOOTHING_MIN_TOKENS:
                self.k_channel_scale = channel_smoothing(k)  # (B, Hkv, E), from the prompt's keys
            if self.k_channel_scale is not None:
                k = k.detach().to(torch.float32) / self.k_channel_scale[:, :, None, :]
            for t, rows, scales in ((k, self.k_pages, self.k_scales), (v, self.v_pages, self.v_scales)):
                values, scale = quantize(t.transpose(1, 2))  # (B, T, Hkv, E), (B, T, Hkv)
                rows[pages, offsets] = values
                scales[pages, offsets] = scale
        else:
            self.k_pages[pages, offsets] = k.detach().transpose(1, 2).to(self.dtype)  # (B, T, Hkv, E)
            self.v_pages[pages, offsets] = v.detach().transpose(1, 2).to(self.dtype)
        self.length += T

    def _reserve(self, tokens: int) -> None:
        """Pages for ``tokens`` per sequence: new ones are taken in turn, sequence by sequence."""
        need = math.ceil(tokens / self.page_size)
        have = self.block_table.shape[1]
        if need <= have:
            return
        new = (need - have) * self.batch
        if self.pages_used + new > self.k_pages.shape[0]:
            if self.max_pages is not None:
                raise ValueError(f"PagedKVCache.append: the pool is full: {tokens} tokens per sequence need "
                                 f"{need * self.batch} pages of {self.page_size}, num_pages={self.max_pages}; "
                                 f"make a larger pool")
            grown = max(self.pages_used + new, 2 * self.k_pages.shape[0])
            extra = grown - self.k_pages.shape[0]
            self.k_pages, self.v_pages = (_grown_pool(t, grown) for t in (self.k_pages, self.v_pages))
            if self.quantized:
                self.k_scales = torch.cat([self.k_scales, self.k_scales.new_ones(extra, *self.k_scales.shape[1:])])
                self.v_scales = torch.cat([self.v_scales, self.v_scales.new_ones(extra, *self.v_scales.shape[1:])])
        ids = torch.arange(self.pages_used, self.pages_used + new, device=self.device)
        # page t of the new ones goes to sequence t % B: sequences' pages interleave in the pool
        self.block_table = torch.cat([self.block_table, ids.view(need - have, self.batch).T], dim=1)
        self.pages_used += new

    def dense(self) -> tuple[Tensor, Tensor]:
        """The cached keys and values as dense ``(B, Hkv, length, head_dim)`` tensors (copies;
        float32, dequantised, for an int8 cache)."""
        shape = (self.batch, self.num_kv_heads, self.length, self.head_dim)
        k, v = self.k_pages, self.v_pages
        if self.quantized:
            k, v = dequantize(k, self.k_scales), dequantize(v, self.v_scales)
        k = kernel.gather(k, self.block_table, self.length).view(shape)
        if self.k_channel_scale is not None:
            k = k * self.k_channel_scale[:, :, None, :]
        return k, kernel.gather(v, self.block_table, self.length).view(shape)

    def reset(self) -> None:
        """Forget every token and page (the pool's memory is kept)."""
        self.block_table = self.block_table[:, :0]
        self.pages_used = 0
        self.length = 0
        self.k_channel_scale = None  # the next prompt calibrates again


# --------------------------------------------------------------------------- #


def _grown_pool(pages: Tensor, pool: int) -> Tensor:
    """``pages`` (P, page, Hkv, E) copied into a new zeroed pool of ``pool`` pages (cache_zeros)."""
    grown = cache_zeros((pool, *pages.shape[1:]), pages.dtype, pages.device)
    grown[: pages.shape[0]] = pages
    return grown


def _check_int8(fn: str, key: Tensor, value: Tensor, k_scale, v_scale) -> None:
    """An int8 key and value come with float32 scales, one per row: ``(..., S)``."""
    if not isinstance(value, Tensor) or value.dtype != torch.int8:
        raise TypeError(f"{fn}: an int8 key needs an int8 value (a quantized cache), got value "
                        f"{value.dtype if isinstance(value, Tensor) else type(value).__name__}")
    for name, sc, t in (("k_scale", k_scale, key), ("v_scale", v_scale, value)):
        if not isinstance(sc, Tensor):
            raise TypeError(f"{fn}: an int8 cache needs {name}, a float32 tensor of shape {tuple(t.shape[:-1])} "
                            f"(one scale per row: attnlab.decoding.quantize makes them), got {type(sc).__name__}")
        if sc.dtype != torch.float32 or tuple(sc.shape) != tuple(t.shape[:-1]):
            raise ValueError(f"{fn}: {name} must be float32 of shape {tuple(t.shape[:-1])}, got {sc.dtype} "
                             f"{tuple(sc.shape)}")


def _check_align(align: str, fn: str) -> None:
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"{fn}: causal_align must be 'top_left' or 'bottom_right', got {align!r}")


def _refuse_grad(fn: str, *tensors: Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError(f"{fn}: decoding has no backward, and an input requires grad; call it under "
                         f"torch.no_grad() (or detach), or train with attnlab.flash_attention")


def _scale(scale: Optional[float], E: int) -> float:
    return default_scale(scale, E)


def _kv_heads(layout: Layout, seqlens: Optional[Tensor]) -> int:
    """Key/value heads per batch entry, so that head ``nb`` belongs to batch ``nb // Hkv``."""
    return layout.Nb // seqlens.numel() if seqlens is not None else 1


def _seqlens(cache_seqlens, query: Tensor, key: Tensor, layout: Layout, fn: str) -> Optional[Tensor]:
    if cache_seqlens is None:
        return None
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"{fn}: cache_seqlens needs 4-D (B, H, L, E) inputs, got query {tuple(query.shape)}")
    B = layout.batch[0]
    if (not isinstance(cache_seqlens, Tensor) or cache_seqlens.shape != (B,) or cache_seqlens.is_floating_point()
            or cache_seqlens.dtype == torch.bool):
        raise ValueError(f"{fn}: cache_seqlens must be a (B={B},) integer tensor, got "
                         f"{tuple(cache_seqlens.shape) if isinstance(cache_seqlens, Tensor) else type(cache_seqlens).__name__}")
    if bool((cache_seqlens < 0).any()) or bool((cache_seqlens > key.shape[-2]).any()):
        raise ValueError(f"{fn}: cache_seqlens must be in [0, S={key.shape[-2]}], got {cache_seqlens.tolist()}")
    return cache_seqlens.to(device="cpu", dtype=torch.int64).contiguous()


def _run(q4: Tensor, k: Tensor, v: Tensor, table: Optional[Tensor], *, Hkv: int, S: int, scale: float,
         is_causal: bool, align: Align, seqlens: Optional[Tensor],
         scales: tuple[Optional[Tensor], Optional[Tensor]] = (None, None),
         out_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``(out (Nb, r, L, Ev), lse2 (Nb, r, L))``: the kernel, and the pure path when its result is
    not finite; ``scales``: an int8 cache's ``(k_scale, v_scale)``; ``out_dtype``: the caller's
    output dtype (the kernel's route may depend on it: ``attnlab.kernels.decode.plan``)."""
    causal = align if is_causal else "none"
    Nb, r, L, _ = q4.shape
    if scales[0] is not None and (Nb * r * L == 0 or S == 0 or v.shape[-1] == 0 or q4.shape[-1] == 0):
        k, v, scales = kernel.dequantize(k, scales[0]), kernel.dequantize(v, scales[1]), (None, None)
    if Nb * r * L == 0 or S == 0 or v.shape[-1] == 0 or q4.shape[-1] == 0:
        return _degenerate(q4, k, v, table, Hkv, S, scale, causal, seqlens)
    out, lse2, nonfinite = kernel.forward(q4, k, v, Hkv=Hkv, S=S, scale2=scale * LOG2E, causal=causal,
                                          table=table, seqlens=seqlens, k_scale=scales[0], v_scale=scales[1],
                                          out_dtype=out_dtype)
    # nonfinite: the native kernel saw a NaN or inf score or output (the pure path propagates them
    # itself, as torch's MATH does). int8 values are finite: the hidden-values check has nothing to find.
    if not nonfinite and (scales[0] is not None or
                                                  not _hidden_values_infinite(v, table, S, L, causal, seqlens)):
        return out, lse2
    if scales[0] is not None:  # a rerun on the pure path: the cache dequantised, only now
        k, v = kernel.dequantize(k, scales[0]), kernel.dequantize(v, scales[1])
    # NaN or inf somewhere: the pure path visits every key, so they propagate as torch's MATH does
    k3, v3 = _dense(k, v, table, S)
    dtype = compute_dtype(k3.dtype)
    return kernel.forward_eager(q4.to(dtype), k3.to(dtype), v3.to(dtype), Hkv=Hkv, scale2=scale * LOG2E,
                                causal=causal, seqlens=seqlens)


def _dense(k: Tensor, v: Tensor, table: Optional[Tensor], S: int) -> tuple[Tensor, Tensor]:
    if table is None:
        return k[:, :S], v[:, :S]
    return kernel.gather(k, table, S), kernel.gather(v, table, S)


def _degenerate(q4, k, v, table, Hkv, S, scale, causal, seqlens) -> tuple[Tensor, Tensor]:
    """Empty shapes; ``E == 0`` (every score 0: the mean of the visible values, as torch gives).
    ``(out, lse2)`` as :func:`_run`'s (``Ev == 0``: lse2 as if every visible key scored 0)."""
    Nb, r, L, E = q4.shape
    Ev = v.shape[-1]
    if Nb * r * L == 0 or S == 0:
        return q4.new_zeros(Nb, r, L, Ev), q4.new_full((Nb, r, L), float("-inf"))
    k3, v3 = _dense(k, v, table, S)
    dtype = compute_dtype(v3.dtype)
    zeros_q, zeros_k = q4.new_zeros(Nb, r, L, 1, dtype=dtype), k3.new_zeros(Nb, S, 1, dtype=dtype)
    if Ev == 0:
        v3 = v3.new_zeros(Nb, S, 1)  # for lse2 only: the output has no column
        out, lse2 = kernel.forward_eager(zeros_q, zeros_k, v3.to(dtype), Hkv=Hkv, scale2=LOG2E, causal=causal,
                                         seqlens=seqlens)
        return out[..., :0], lse2
    return kernel.forward_eager(zeros_q, zeros_k, v3.to(dtype), Hkv=Hkv, scale2=LOG2E, causal=causal, seqlens=seqlens)


def _hidden_values_infinite(v: Tensor, table: Optional[Tensor], S: int, L: int, causal: str,
                            seqlens: Optional[Tensor]) -> bool:
    """With top-left causality the kernel never reads values after key ``L - 1``; torch multiplies
    their zero weights, so an inf or NaN there makes its output NaN: look at those rows only then."""
    if causal != "top_left" or L >= S:
        return False
    _, v3 = _dense(v, v, table, S)
    if seqlens is None:
        return not bool(torch.isfinite(v3[:, L:].sum()))
    Hkv = v3.shape[0] // seqlens.numel()
    return any(not bool(torch.isfinite(v3[b * Hkv:(b + 1) * Hkv, L:int(n)].sum())) for b, n in enumerate(seqlens))
