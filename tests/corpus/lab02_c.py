"""Lab 02, solution "c" (the third independent one): causal masks as the complement of a
strict upper triangle (``~ones.triu(d)``), padding by comparing lengths viewed as
[B, 1, 1, 1] against an arange, ``torch.logical_and`` / ``logical_not``, and a masked softmax
that adds a float bias (0 or -inf) to the scores, clamps an empty row's max and the row sums,
with ``torch.matmul`` and ``K.mT`` on a pre-scaled Q for the attention."""

from __future__ import annotations

import math
from typing import Optional

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


def causal_mask(L: int, S: int) -> Bool[Tensor, "L S"]:
    """ex1: True where j <= i (top-left): everything but the strict upper triangle."""
    future = torch.ones(L, S, dtype=torch.bool).triu(diagonal=1)
    return ~future


def decoding_mask(L: int, S: int) -> Bool[Tensor, "L S"]:
    """ex2: query i sits at position i + S - L: hide the keys after it."""
    shift = S - L
    ahead = torch.ones(L, S, dtype=torch.bool).triu(diagonal=shift + 1)
    return ~ahead


def padding_mask(lengths: Int[Tensor, "B"], S: int) -> Bool[Tensor, "B 1 1 S"]:
    """ex3: key j of sequence b is real while j < lengths[b]."""
    key_pos = torch.arange(S, device=lengths.device)
    return lengths.view(-1, 1, 1, 1) > key_pos


def combine_masks(a: Bool[Tensor, "..."], b: Bool[Tensor, "..."]) -> Bool[Tensor, "..."]:
    """ex4: visible only where both allow it."""
    return torch.logical_and(a, b)


def masked_softmax(scores: Float[Tensor, "... L S"], mask: Bool[Tensor, "... L S"]) -> Float[Tensor, "... L S"]:
    """ex5: add a bias of -inf on the hidden keys, then a stable softmax."""
    bias = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    bias = bias.masked_fill(mask.logical_not(), -math.inf)
    biased = scores + bias
    row_max = biased.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
    e = torch.exp(biased - row_max)
    z = e.sum(dim=-1, keepdim=True)
    return e / z.clamp(min=torch.finfo(scores.dtype).tiny)


def from_key_padding_mask(key_padding_mask: Bool[Tensor, "B S"]) -> Bool[Tensor, "B 1 1 S"]:
    """ex6: True = ignore becomes True = attend, with the head and query dims."""
    attend = key_padding_mask.logical_not()
    return attend.unsqueeze(1).unsqueeze(2)


def masked_attention(
    Q: Float[Tensor, "B H L E"],
    K: Float[Tensor, "B H S E"],
    V: Float[Tensor, "B H S Ev"],
    mask: Optional[Bool[Tensor, "..."]] = None,
) -> Float[Tensor, "B H L Ev"]:
    """ex7: softmax(Q K^T / sqrt(E) with the mask) V."""
    scale = 1.0 / math.sqrt(Q.size(-1))
    scores = torch.matmul(Q * scale, K.mT)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device)
    weights = masked_softmax(scores, mask)
    return torch.matmul(weights, V)
