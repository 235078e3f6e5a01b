"""Lab 03, solution "d" (the fourth independent one, written from the brief alone): an explicit
Python loop over the heads that slices each head's features out of the projected tensor,
attends in that head and joins the head outputs with torch.cat; grouped-query attention
indexes key/value head h // group inside the loop, and the KV cache is a torch.cat along the
sequence with a causal mask built from the torch.arange positions of the queries and keys."""

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
    B, L, D = x.shape
    E = D // H
    return x.view(B, L, H, E).transpose(1, 2)


def merge_heads(x: Float[Tensor, "B H L E"]) -> Float[Tensor, "B L D"]:
    """ex2: the inverse of split_heads: [B, H, L, E] -> [B, L, H * E]."""
    H = x.shape[1]
    pieces = []
    for h in range(H):
        pieces.append(x[:, h])  # [B, L, E]: head h's features
    return torch.cat(pieces, dim=-1)


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
    B, L, D = x.shape
    E = D // H
    Q = x @ W_Q
    K = x @ W_K
    V = x @ W_V
    if mask is not None:
        mask = mask.expand(B, H, L, L)
    outputs = []
    for h in range(H):
        start, end = h * E, (h + 1) * E
        q_h = Q[:, :, start:end]
        k_h = K[:, :, start:end]
        v_h = V[:, :, start:end]
        scores = q_h @ k_h.transpose(-2, -1) / math.sqrt(E)  # [B, L, L]
        if mask is not None:
            scores = scores.masked_fill(~mask[:, h], float("-inf"))
        weights = softmax_last(scores)
        outputs.append(weights @ v_h)
    concat = torch.cat(outputs, dim=-1)  # [B, L, D]
    return concat @ W_O


def repeat_kv(kv: Float[Tensor, "B Hkv S E"], groups: int) -> Float[Tensor, "B H S E"]:
    """ex4: grouped-query attention's sharing: query head h uses key/value head h // groups,
    so each key/value head is repeated ``groups`` times *in place* (0, 0, 1, 1, ...)."""
    Hkv = kv.shape[1]
    heads = []
    for h in range(Hkv * groups):
        g = h // groups
        heads.append(kv[:, g:g + 1])
    return torch.cat(heads, dim=1)


def gqa_attention(
    q: Float[Tensor, "B H L E"],
    k: Float[Tensor, "B Hkv S E"],
    v: Float[Tensor, "B Hkv S Ev"],
) -> Float[Tensor, "B H L Ev"]:
    """ex5: attention where H query heads share Hkv key/value heads (SDPA's enable_gqa=True)."""
    H = q.shape[-3]
    Hkv = k.shape[-3]
    group = H // Hkv
    E = q.shape[-1]
    outs = []
    for h in range(H):
        q_h = q[..., h, :, :]
        k_h = k[..., h // group, :, :]
        v_h = v[..., h // group, :, :]
        scores = q_h @ k_h.transpose(-2, -1) / math.sqrt(E)
        outs.append(softmax_last(scores) @ v_h)
    return torch.stack(outs, dim=-3)


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
    P = k_cache.shape[2]
    L = q.shape[2]
    keys = torch.cat([k_cache, k_new], dim=2)
    values = torch.cat([v_cache, v_new], dim=2)
    q_pos = P + torch.arange(L, device=q.device)
    k_pos = torch.arange(P + L, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # [L, P + L]
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = softmax_last(scores) @ values
    return out, keys, values
