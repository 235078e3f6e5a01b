"""Lab 01, solution "c" (the third independent one): broadcasting and explicit reductions.

Every product is written as an unsqueeze, an elementwise multiply and a sum over the shared
axis (no ``@``, no einsum); the softmax uses ``amax`` and ``masked_fill`` guards; both masks
are filled in by Python loops (row by row for the causal one, sequence by sequence for the
padding one), and ``apply_mask`` clones the scores and assigns ``-inf`` by boolean indexing.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


# ---------------------------------------------------------------- ex1 - ex4: the four steps
def _project(X: Tensor, W: Tensor) -> Tensor:
    # [B, T, d, 1] * [d, n] -> [B, T, d, n], summed over d
    return (X.unsqueeze(-1) * W).sum(dim=-2)


def project_qkv(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
) -> tuple[Float[Tensor, "B T d_k"], Float[Tensor, "B T d_k"], Float[Tensor, "B T d_v"]]:
    """ex1: Q, K, V by multiply-and-sum over the model dim."""
    Q = _project(X, W_Q)
    K = _project(X, W_K)
    V = _project(X, W_V)
    return Q, K, V


def attention_scores(Q: Float[Tensor, "B T d_k"], K: Float[Tensor, "B S d_k"]) -> Float[Tensor, "B T S"]:
    """ex2: every query against every key, [B, T, 1, d_k] * [B, 1, S, d_k] summed over d_k."""
    d_k = Q.size(-1)
    dots = (Q.unsqueeze(-2) * K.unsqueeze(-3)).sum(dim=-1)
    return dots / math.sqrt(d_k)


def stable_softmax(scores: Float[Tensor, "... N"], dim: int = -1) -> Float[Tensor, "... N"]:
    """ex3: shift by the max along ``dim``; slices with nothing but -inf come out as zeros."""
    peak = scores.amax(dim=dim, keepdim=True)
    peak = peak.masked_fill(torch.isinf(peak), 0.0)
    expd = torch.exp(scores - peak)
    denom = expd.sum(dim=dim, keepdim=True)
    denom = denom.masked_fill(denom == 0, 1.0)
    return expd / denom


def attend(weights: Float[Tensor, "B T S"], V: Float[Tensor, "B S d_v"]) -> Float[Tensor, "B T d_v"]:
    """ex4: [B, T, S, 1] * [B, 1, S, d_v] summed over S."""
    return (weights.unsqueeze(-1) * V.unsqueeze(-3)).sum(dim=-2)


# ---------------------------------------------------------------- ex5 - ex7: masks
def causal_mask(T: int) -> Bool[Tensor, "T T"]:
    """ex5: True on and below the diagonal, filled in one row at a time."""
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        mask[i, : i + 1] = True
    return mask


def padding_mask(lengths: Int[Tensor, " B"], T: int) -> Bool[Tensor, "B 1 T"]:
    """ex6: one row per sequence, its first lengths[b] positions True."""
    mask = torch.zeros(len(lengths), 1, T, dtype=torch.bool)
    for b, n in enumerate(lengths.tolist()):
        mask[b, 0, :n] = True
    return mask


def apply_mask(scores: Float[Tensor, "B T S"], mask: Bool[Tensor, "... T S"]) -> Float[Tensor, "B T S"]:
    """ex7: a copy of the scores with -inf wherever the (broadcast) mask is False."""
    masked = scores.clone()
    hidden = ~mask.expand_as(masked)
    masked[hidden] = float("-inf")
    return masked


# ---------------------------------------------------------------- ex8 - ex9: put together
def self_attention(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
    mask: Optional[Bool[Tensor, "... T T"]] = None,
) -> tuple[Float[Tensor, "B T d_v"], Float[Tensor, "B T T"]]:
    """ex8: project, score, mask, softmax over the keys, attend."""
    Q, K, V = project_qkv(X, W_Q, W_K, W_V)
    logits = attention_scores(Q, K)
    if mask is not None:
        logits = apply_mask(logits, mask)
    probs = stable_softmax(logits, dim=-1)
    out = attend(probs, V)
    return out, probs


def compare_with_sdpa(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
    mask: Optional[Bool[Tensor, "... T T"]] = None,
) -> float:
    """ex9: the largest absolute gap between my layer and torch's SDPA."""
    Q, K, V = project_qkv(X, W_Q, W_K, W_V)
    reference = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    mine, _ = self_attention(X, W_Q, W_K, W_V, mask=mask)
    gap = (mine - reference).abs().max()
    return float(gap)


# ---------------------------------------------------------------- the lesson's exercises
def exercise_1_shapes() -> dict[str, tuple[int, ...]]:
    """ex10: X [1, 3, 6], W [6, 2]; worked out by hand."""
    B, T, d_k, d_v = 1, 3, 2, 2
    return {
        "Q": (B, T, d_k),
        "K": (B, T, d_k),
        "V": (B, T, d_v),
        "scores": (B, T, T),
        "attn_weights": (B, T, T),
        "output": (B, T, d_v),
    }


def naive_softmax(scores: Float[Tensor, "... N"], dim: int = -1) -> Float[Tensor, "... N"]:
    """exp(x) / sum(exp(x)), without the max shift. Given: it is meant to overflow."""
    e = torch.exp(scores)
    return e / e.sum(dim=dim, keepdim=True)


def exercise_2(unscaled: Float[Tensor, "... N"], d_k: int = 64) -> dict[str, Tensor]:
    """ex11: the naive softmax, the stable one, and the stable one of the scaled scores."""
    scaled = unscaled / math.sqrt(d_k)
    return {"naive": naive_softmax(unscaled), "stable": stable_softmax(unscaled), "scaled": stable_softmax(scaled)}


EXERCISE_2_ANSWER = "B"


def exercise_3_first_row(
    X: Float[Tensor, "B T d"], W_Q: Float[Tensor, "d d_k"], W_K: Float[Tensor, "d d_k"], W_V: Float[Tensor, "d d_v"]
) -> Float[Tensor, "B T"]:
    """ex12: query 0's row of the weights, in every batch element."""
    _, probs = self_attention(X, W_Q, W_K, W_V)
    return probs.select(dim=1, index=0)


EXERCISE_3_ANSWER = "A"
