"""Lab 03, a second solution written independently of the instructor's: einops-style
permutes instead of transpose, einsum for the products, expand + reshape for the shared
key/value heads, the cache's mask from index comparisons."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def softmax_last(scores: Tensor) -> Tensor:
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(scores - m)
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def split_heads(x: Tensor, H: int) -> Tensor:
    B, L, D = x.shape
    E = D // H
    return x.reshape(B, L, H, E).permute(0, 2, 1, 3)


def merge_heads(x: Tensor) -> Tensor:
    B, H, L, E = x.shape
    return x.permute(0, 2, 1, 3).reshape(B, L, H * E)


def multi_head_attention(x: Tensor, W_Q: Tensor, W_K: Tensor, W_V: Tensor, W_O: Tensor, H: int,
                         mask: Optional[Tensor] = None) -> Tensor:
    q = split_heads(x @ W_Q, H)
    k = split_heads(x @ W_K, H)
    v = split_heads(x @ W_V, H)
    head_dim = q.shape[-1]
    scores = torch.einsum("bhle,bhse->bhls", q, k) / math.sqrt(head_dim)
    if mask is not None:
        scores = torch.where(mask, scores, torch.full_like(scores, float("-inf")))
    heads = torch.einsum("bhls,bhse->bhle", softmax_last(scores), v)
    return merge_heads(heads) @ W_O


def repeat_kv(kv: Tensor, groups: int) -> Tensor:
    B, Hkv, S, E = kv.shape
    return kv[:, :, None, :, :].expand(B, Hkv, groups, S, E).reshape(B, Hkv * groups, S, E)


def gqa_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    groups = q.size(1) // k.size(1)
    k = repeat_kv(k, groups)
    v = repeat_kv(v, groups)
    scores = torch.einsum("bhle,bhse->bhls", q, k) * q.size(-1) ** -0.5
    return torch.einsum("bhls,bhsv->bhlv", softmax_last(scores), v)


def decode_step(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Tensor,
                v_new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    k = torch.cat((k_cache, k_new), dim=-2)
    v = torch.cat((v_cache, v_new), dim=-2)
    P, L, S = k_cache.size(-2), q.size(-2), k.size(-2)
    position = torch.arange(L)[:, None] + P  # where each new query sits in the sequence
    visible = torch.arange(S)[None, :] <= position
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~visible, float("-inf"))
    return softmax_last(scores) @ v, k, v
