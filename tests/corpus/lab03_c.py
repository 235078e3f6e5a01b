"""Lab 03, solution "c" (a third independent one, written from the brief alone), in the style
of a fused QKV projection and flatten/unflatten: heads split with ``unflatten`` + ``swapaxes`` and
merged with ``swapaxes`` + ``flatten``, Q, K and V from one ``x @ cat([W_Q, W_K, W_V])`` cut
with ``chunk``, the queries scaled before the product, the mask added as a -inf bias,
``repeat_kv`` an index with ``arange // groups``, GQA done without repeating by grouping the
query heads under their key/value head (``unflatten`` of the head dim), and the cache's causal
mask the *blocked* entries, ``triu(P + 1)``.
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
    per_position = x.unflatten(-1, (H, x.shape[-1] // H))  # [B, L, H, E]
    return per_position.swapaxes(1, 2)


def merge_heads(x: Float[Tensor, "B H L E"]) -> Float[Tensor, "B L D"]:
    """ex2: the inverse of split_heads: [B, H, L, E] -> [B, L, H * E]."""
    per_position = x.swapaxes(1, 2)  # [B, L, H, E]
    return per_position.flatten(start_dim=2)


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
    W_QKV = torch.cat([W_Q, W_K, W_V], dim=1)  # [D, 3D]
    q, k, v = (split_heads(t, H) for t in (x @ W_QKV).chunk(3, dim=-1))
    head_size = q.shape[-1]
    q = q * head_size ** -0.5
    scores = q @ k.mT  # [B, H, L, L]
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
        scores = scores + bias.masked_fill(mask.logical_not(), float("-inf"))
    heads = softmax_last(scores) @ v
    return merge_heads(heads) @ W_O


def repeat_kv(kv: Float[Tensor, "B Hkv S E"], groups: int) -> Float[Tensor, "B H S E"]:
    """ex4: grouped-query attention's sharing: query head h uses key/value head h // groups,
    so each key/value head is repeated ``groups`` times *in place* (0, 0, 1, 1, ...)."""
    n_heads = kv.shape[1] * groups
    source = torch.arange(n_heads, device=kv.device) // groups  # the kv head of each query head
    return kv[:, source]


def gqa_attention(
    q: Float[Tensor, "B H L E"],
    k: Float[Tensor, "B Hkv S E"],
    v: Float[Tensor, "B Hkv S Ev"],
) -> Float[Tensor, "B H L Ev"]:
    """ex5: attention where H query heads share Hkv key/value heads (SDPA's enable_gqa=True)."""
    n_kv = k.shape[1]
    grouped = q.unflatten(1, (n_kv, -1))  # [B, Hkv, G, L, E]: query heads under their kv head
    grouped = grouped * q.shape[-1] ** -0.5
    scores = grouped @ k.unsqueeze(2).mT  # [B, Hkv, G, L, S]
    out = softmax_last(scores) @ v.unsqueeze(2)  # [B, Hkv, G, L, Ev]
    return out.flatten(1, 2)


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
    P, L = k_cache.shape[-2], q.shape[-2]
    keys = torch.cat((k_cache, k_new), dim=-2)
    values = torch.cat((v_cache, v_new), dim=-2)
    future = torch.ones(L, P + L, dtype=torch.bool, device=q.device).triu(P + 1)
    scores = (q * q.shape[-1] ** -0.5) @ keys.mT
    scores = scores.masked_fill(future, float("-inf"))
    return softmax_last(scores) @ values, keys, values
