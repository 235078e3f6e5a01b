"""Lab 02, a second solution written independently of the instructor's: masks from index
comparisons, torch.where for every fill, einsum for the products, the empty rows found with
.any() rather than by guarding the max."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def causal_mask(L: int, S: int) -> Tensor:
    q = torch.arange(L).unsqueeze(1)  # [L, 1]
    k = torch.arange(S).unsqueeze(0)  # [1, S]
    return k <= q


def decoding_mask(L: int, S: int) -> Tensor:
    offset = S - L  # the cached keys before the first new query
    q = torch.arange(L).unsqueeze(1) + offset
    k = torch.arange(S).unsqueeze(0)
    return k <= q


def padding_mask(lengths: Tensor, S: int) -> Tensor:
    real = torch.arange(S).unsqueeze(0) < lengths.unsqueeze(1)  # [B, S]
    return real.view(-1, 1, 1, S)


def combine_masks(a: Tensor, b: Tensor) -> Tensor:
    return torch.logical_and(a, b)


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    neg = torch.full_like(scores, float("-inf"))
    s = torch.where(mask, scores, neg)
    any_visible = mask.any(dim=-1, keepdim=True)
    top = torch.where(any_visible, s.max(dim=-1, keepdim=True).values, torch.zeros_like(scores[..., :1]))
    e = torch.exp(s - top)
    z = e.sum(dim=-1, keepdim=True)
    return torch.where(any_visible, e / torch.where(any_visible, z, torch.ones_like(z)), torch.zeros_like(e))


def from_key_padding_mask(key_padding_mask: Tensor) -> Tensor:
    keep = torch.logical_not(key_padding_mask)
    return keep.unsqueeze(1).unsqueeze(2)


def masked_attention(Q: Tensor, K: Tensor, V: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    E = Q.shape[-1]
    scores = torch.einsum("bhle,bhse->bhls", Q, K) / math.sqrt(E)
    if mask is None:
        mask = torch.ones(scores.shape, dtype=torch.bool)
    weights = masked_softmax(scores, mask.expand(scores.shape))
    return torch.einsum("bhls,bhsv->bhlv", weights, V)
