"""Lab 02: attention masks.

Fill in each function below, in order (ex1, ex2, ...), replacing the
``raise NotImplementedError`` line. Then check your work:

    attnlab grade                      # in this folder: grades this file

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
    raise NotImplementedError("TODO(ex1): torch.ones(L, S, dtype=torch.bool).tril()")


def decoding_mask(L: int, S: int) -> Bool[Tensor, "L S"]:
    """ex2: the causal mask of a KV cache, aligned bottom-right.

    The L new queries are the *last* L positions of a sequence of S (S >= L, the cache
    holds the S - L earlier ones): query i sits at position i + (S - L) and sees keys
    0..i + (S - L). When L == S it equals ``causal_mask``.
    """
    raise NotImplementedError("TODO(ex2): tril with the diagonal moved by S - L")


def padding_mask(lengths: Int[Tensor, "B"], S: int) -> Bool[Tensor, "B 1 1 S"]:
    """ex3: hide the padding *keys* of each sequence.

    Sequence b has ``lengths[b]`` real tokens, then padding. True for real keys
    (j < lengths[b]); shape [B, 1, 1, S] so it broadcasts over heads and queries.
    """
    raise NotImplementedError("TODO(ex3): (torch.arange(S) < lengths[:, None]) reshaped to [B, 1, 1, S]")


def combine_masks(a: Bool[Tensor, "..."], b: Bool[Tensor, "..."]) -> Bool[Tensor, "..."]:
    """ex4: a key is visible only where both masks allow it (they broadcast)."""
    raise NotImplementedError("TODO(ex4): a & b")


def masked_softmax(scores: Float[Tensor, "... L S"], mask: Bool[Tensor, "... L S"]) -> Float[Tensor, "... L S"]:
    """ex5: softmax over the keys with the mask applied first.

    Masked scores become -inf *before* the softmax, so each row of visible keys sums to
    1. A row whose keys are all masked gives zeros, never NaN. Subtract the row max.
    """
    raise NotImplementedError("TODO(ex5): fill -inf where ~mask, stable softmax, zeros for empty rows")


def from_key_padding_mask(key_padding_mask: Bool[Tensor, "B S"]) -> Bool[Tensor, "B 1 1 S"]:
    """ex6: convert ``nn.MultiheadAttention``'s ``key_padding_mask`` (True = ignore this
    key) into an SDPA mask (True = attend), shaped [B, 1, 1, S]."""
    raise NotImplementedError("TODO(ex6): invert it and add the head and query dims")


def masked_attention(
    Q: Float[Tensor, "B H L E"],
    K: Float[Tensor, "B H S E"],
    V: Float[Tensor, "B H S Ev"],
    mask: Optional[Bool[Tensor, "..."]] = None,
) -> Float[Tensor, "B H L Ev"]:
    """ex7: softmax(Q K^T / sqrt(E) with the mask) V, as SDPA with ``attn_mask=mask``.

    Use your ``masked_softmax``; fully masked rows give 0.
    """
    raise NotImplementedError("TODO(ex7): scores, masked_softmax, then @ V")
