"""Lab 02, solution "d" (the fourth independent one, written from the brief alone): masks are
boolean tensors built with torch.ones and torch.tril, each diagonal offset computed in a named
variable, combined with &; the masked softmax fills -inf with masked_fill, subtracts the row max
and divides exp by its sum, guarding empty rows explicitly with torch.where; attention is two
torch.einsum contractions."""

from __future__ import annotations

import math
from typing import Optional

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


def causal_mask(L: int, S: int) -> Bool[Tensor, "L S"]:
    """ex1: top-left causal mask, True where key j <= query i."""
    everything = torch.ones(L, S, dtype=torch.bool)
    top_left_offset = 0
    return torch.tril(everything, diagonal=top_left_offset)


def decoding_mask(L: int, S: int) -> Bool[Tensor, "L S"]:
    """ex2: bottom-right causal mask, query i at position i + (S - L)."""
    everything = torch.ones(L, S, dtype=torch.bool)
    cache_len = S - L
    return torch.tril(everything, diagonal=cache_len)


def padding_mask(lengths: Int[Tensor, "B"], S: int) -> Bool[Tensor, "B 1 1 S"]:
    """ex3: True for the real keys j < lengths[b], shaped [B, 1, 1, S]."""
    batch = lengths.shape[0]
    key_positions = torch.arange(S, device=lengths.device)
    is_real_key = key_positions[None, :] < lengths[:, None]
    return is_real_key.reshape(batch, 1, 1, S)


def combine_masks(a: Bool[Tensor, "..."], b: Bool[Tensor, "..."]) -> Bool[Tensor, "..."]:
    """ex4: visible only where both masks allow it."""
    return a & b


def masked_softmax(scores: Float[Tensor, "... L S"], mask: Bool[Tensor, "... L S"]) -> Float[Tensor, "... L S"]:
    """ex5: -inf where the mask is False, a max-shifted softmax, zeros for empty rows."""
    filled = scores.masked_fill(~mask, float("-inf"))
    row_max = filled.amax(dim=-1, keepdim=True)
    empty_row = torch.isneginf(row_max)
    shift = torch.where(empty_row, torch.zeros_like(row_max), row_max)
    exps = torch.exp(filled - shift)
    row_sum = exps.sum(dim=-1, keepdim=True)
    denom = torch.where(empty_row, torch.ones_like(row_sum), row_sum)
    return exps / denom


def from_key_padding_mask(key_padding_mask: Bool[Tensor, "B S"]) -> Bool[Tensor, "B 1 1 S"]:
    """ex6: True = ignore (nn.MultiheadAttention) into True = attend (SDPA), [B, 1, 1, S]."""
    batch, S = key_padding_mask.shape
    attend = ~key_padding_mask
    return attend.reshape(batch, 1, 1, S)


def masked_attention(
    Q: Float[Tensor, "B H L E"],
    K: Float[Tensor, "B H S E"],
    V: Float[Tensor, "B H S Ev"],
    mask: Optional[Bool[Tensor, "..."]] = None,
) -> Float[Tensor, "B H L Ev"]:
    """ex7: softmax(Q K^T / sqrt(E) with the mask) V, as SDPA with attn_mask=mask."""
    E = Q.shape[-1]
    scale = 1.0 / math.sqrt(E)
    scores = torch.einsum("...le,...se->...ls", Q, K) * scale
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device)
    weights = masked_softmax(scores, mask)
    return torch.einsum("...ls,...sv->...lv", weights, V)
