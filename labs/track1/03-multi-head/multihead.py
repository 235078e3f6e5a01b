"""Lab 03: multi-head and grouped-query attention, and decoding with a KV cache.

Fill in each function below, in order (ex1, ex2, ...), replacing the
``raise NotImplementedError`` line. Then check your work:

    attnlab grade                      # in this folder: grades this file

Shapes: B batch, L queries, S keys, D model size, H query heads, Hkv key/value heads
(H a multiple of Hkv), E = D // H the size of one head. Weights act on the right
(``x @ W``), as in labs 01 and 02.

Rules of the lab, as before: from scratch (no torch.softmax / F.softmax /
Tensor.softmax, no scaled_dot_product_attention, no nn.MultiheadAttention; the grader
catches them), imports only from torch, math, typing and jaxtyping, keep the names and
signatures. ``softmax_last`` below is given: use it.
"""

from __future__ import annotations

import math  # noqa: F401
from typing import Optional

import torch
from jaxtyping import Bool, Float
from torch import Tensor


def softmax_last(scores: Float[Tensor, "... S"]) -> Float[Tensor, "... S"]:
    """Given: a stable softmax over the last dim; rows of all -inf give zeros."""
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(scores - m)
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def split_heads(x: Float[Tensor, "B L D"], H: int) -> Float[Tensor, "B H L E"]:
    """ex1: [B, L, D] -> [B, H, L, E] with E = D // H: head h gets features h*E .. (h+1)*E - 1."""
    raise NotImplementedError("TODO(ex1): view as [B, L, H, E], then transpose(1, 2)")


def merge_heads(x: Float[Tensor, "B H L E"]) -> Float[Tensor, "B L D"]:
    """ex2: the inverse of split_heads: [B, H, L, E] -> [B, L, H * E]."""
    raise NotImplementedError("TODO(ex2): transpose(1, 2), then reshape to [B, L, H * E]")


def multi_head_attention(
    x: Float[Tensor, "B L D"],
    W_Q: Float[Tensor, "D D"],
    W_K: Float[Tensor, "D D"],
    W_V: Float[Tensor, "D D"],
    W_O: Float[Tensor, "D D"],
    H: int,
    mask: Optional[Bool[Tensor, "..."]] = None,
) -> Float[Tensor, "B L D"]:
    """ex3: multi-head self-attention: project, split into H heads, attend in each head
    (scores scaled by 1 / sqrt(E), E the size of *one head*), merge, then the output
    projection ``@ W_O``. ``mask`` (True = attend) broadcasts to [B, H, L, L]."""
    raise NotImplementedError("TODO(ex3): project, split_heads, softmax_last(scores) @ V, merge_heads, @ W_O")


def repeat_kv(kv: Float[Tensor, "B Hkv S E"], groups: int) -> Float[Tensor, "B H S E"]:
    """ex4: grouped-query attention's sharing: query head h uses key/value head h // groups,
    so each key/value head is repeated ``groups`` times *in place* (0, 0, 1, 1, ...)."""
    raise NotImplementedError("TODO(ex4): repeat_interleave along dim 1")


def gqa_attention(
    q: Float[Tensor, "B H L E"],
    k: Float[Tensor, "B Hkv S E"],
    v: Float[Tensor, "B Hkv S Ev"],
) -> Float[Tensor, "B H L Ev"]:
    """ex5: attention where H query heads share Hkv key/value heads (SDPA's enable_gqa=True)."""
    raise NotImplementedError("TODO(ex5): repeat_kv k and v, then scaled scores, softmax_last, @ v")


def decode_step(
    q: Float[Tensor, "B H L E"],
    k_cache: Float[Tensor, "B H P E"],
    v_cache: Float[Tensor, "B H P Ev"],
    k_new: Float[Tensor, "B H L E"],
    v_new: Float[Tensor, "B H L Ev"],
) -> tuple[Float[Tensor, "B H L Ev"], Float[Tensor, "B H P+L E"], Float[Tensor, "B H P+L Ev"]]:
    """ex6: decoding with a KV cache. The L new tokens come after the P cached ones:
    append their keys and values to the cache, then attend causally. New query i sits at
    position P + i, so it sees keys 0 .. P + i (the causal mask aligned bottom-right).
    Returns (output, the new k cache, the new v cache)."""
    raise NotImplementedError("TODO(ex6): cat the caches, a causal mask with the offset P, attention")
