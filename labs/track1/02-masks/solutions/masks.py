"""Lab 02: attention masks (solutions).

The reference solutions (for the grader and the walkthrough's tests).

Conventions (SDPA's): a bool mask is True where a query may attend to a key and
False where it may not; it is applied to the scores, before softmax, as -inf.
``nn.MultiheadAttention``'s ``key_padding_mask`` says the opposite (True = ignore):
ex6 converts one into the other.

Rules of the lab, as in lab 01: build it from scratch (no torch.softmax / F.softmax /
Tensor.softmax, no scaled_dot_product_attention, no nn.MultiheadAttention; the grader
catches them), import only from torch, math, typing and jaxtyping, keep the names and
signatures. Shapes: B batch, L queries, S keys, E query/key size, Ev value size.
"""

from __future__ import annotations

import math  # noqa: F401
from typing import Optional

import torch  # noqa: F401
from jaxtyping import Bool, Float, Int
from torch import Tensor


def causal_mask(L: int, S: int) -> Bool[Tensor, "L S"]:
    """ex1: SDPA's ``is_causal`` mask, aligned top-left.

    Query i may see keys 0..i: True where j <= i, also when L != S (then the last
    queries of a tall mask see every key, and the last keys of a wide one nobody).
    """
    return torch.ones(L, S, dtype=torch.bool).tril()


def decoding_mask(L: int, S: int) -> Bool[Tensor, "L S"]:
    """ex2: the causal mask of a KV cache, aligned bottom-right.

    The L new queries are the *last* L positions of a sequence of S (S >= L, the cache
    holds the S - L earlier ones): query i sits at position i + (S - L) and sees keys
    0..i + (S - L). When L == S it equals ``causal_mask``.
    """
    return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)


def padding_mask(lengths: Int[Tensor, "B"], S: int) -> Bool[Tensor, "B 1 1 S"]:
    """ex3: hide the padding *keys* of each sequence.

    Sequence b has ``lengths[b]`` real tokens, then padding. True for real keys
    (j < lengths[b]); shape [B, 1, 1, S] so it broadcasts over heads and queries.
    """
    return (torch.arange(S) < lengths[:, None])[:, None, None, :]


def combine_masks(a: Bool[Tensor, "..."], b: Bool[Tensor, "..."]) -> Bool[Tensor, "..."]:
    """ex4: a key is visible only where both masks allow it (they broadcast)."""
    return a & b


def masked_softmax(scores: Float[Tensor, "... L S"], mask: Bool[Tensor, "... L S"]) -> Float[Tensor, "... L S"]:
    """ex5: softmax over the keys with the mask applied first.

    Masked scores become -inf *before* the softmax, so each row of visible keys sums to
    1. A row whose keys are all masked gives zeros, never NaN. Subtract the row max.
    """
    s = scores.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # an empty row: no -inf - -inf
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def from_key_padding_mask(key_padding_mask: Bool[Tensor, "B S"]) -> Bool[Tensor, "B 1 1 S"]:
    """ex6: convert ``nn.MultiheadAttention``'s ``key_padding_mask`` (True = ignore this
    key) into an SDPA mask (True = attend), shaped [B, 1, 1, S]."""
    return (~key_padding_mask)[:, None, None, :]


def masked_attention(
    Q: Float[Tensor, "B H L E"],
    K: Float[Tensor, "B H S E"],
    V: Float[Tensor, "B H S Ev"],
    mask: Optional[Bool[Tensor, "..."]] = None,
) -> Float[Tensor, "B H L Ev"]:
    """ex7: softmax(Q K^T / sqrt(E) with the mask) V, as SDPA with ``attn_mask=mask``.

    Use your ``masked_softmax``; fully masked rows give 0.
    """
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask is None:
        mask = torch.ones_like(scores, dtype=torch.bool)
    return masked_softmax(scores, mask.expand_as(scores)) @ V
