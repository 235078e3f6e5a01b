"""Lab 01, self-attention from scratch: the instructor's solutions.

Same names and signatures as the learner's ``attention.py``; ``attnlab grade`` on
this file scores full marks. Shapes: B batch, T positions, d model size, d_k
query/key size, d_v value size.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

NEG_INF = float("-inf")


# ---------------------------------------------------------------- ex1 - ex4: the four steps
def project_qkv(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
) -> tuple[Float[Tensor, "B T d_k"], Float[Tensor, "B T d_k"], Float[Tensor, "B T d_v"]]:
    """ex1: project every position into a query, a key and a value."""
    return X @ W_Q, X @ W_K, X @ W_V


def attention_scores(Q: Float[Tensor, "B T d_k"], K: Float[Tensor, "B S d_k"]) -> Float[Tensor, "B T S"]:
    """ex2: scaled dot products, Q @ K^T / sqrt(d_k)."""
    return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])


def stable_softmax(scores: Float[Tensor, "... N"], dim: int = -1) -> Float[Tensor, "... N"]:
    """ex3: softmax that subtracts the max first; an all -inf slice gives zeros."""
    m = scores.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(scores - m)
    total = e.sum(dim=dim, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def attend(weights: Float[Tensor, "B T S"], V: Float[Tensor, "B S d_v"]) -> Float[Tensor, "B T d_v"]:
    """ex4: each output is the weighted sum of the values."""
    return weights @ V


# ---------------------------------------------------------------- ex5 - ex7: masks
def causal_mask(T: int) -> Bool[Tensor, "T T"]:
    """ex5: True where position i may attend to position j, i.e. j <= i."""
    return torch.ones(T, T, dtype=torch.bool).tril()


def padding_mask(lengths: Int[Tensor, " B"], T: int) -> Bool[Tensor, "B 1 T"]:
    """ex6: True for real tokens (j < lengths[b]); the 1 broadcasts over query rows."""
    return (torch.arange(T) < lengths[:, None])[:, None, :]


def apply_mask(scores: Float[Tensor, "B T S"], mask: Bool[Tensor, "... T S"]) -> Float[Tensor, "B T S"]:
    """ex7: -inf wherever the mask is False, so softmax gives those keys weight 0."""
    return scores.masked_fill(~mask, NEG_INF)


# ---------------------------------------------------------------- ex8 - ex9: put together
def self_attention(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
    mask: Optional[Bool[Tensor, "... T T"]] = None,
) -> tuple[Float[Tensor, "B T d_v"], Float[Tensor, "B T T"]]:
    """ex8: the whole layer; returns (output, weights)."""
    Q, K, V = project_qkv(X, W_Q, W_K, W_V)
    scores = attention_scores(Q, K)
    if mask is not None:
        scores = apply_mask(scores, mask)
    weights = stable_softmax(scores, dim=-1)
    return attend(weights, V), weights


def compare_with_sdpa(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
    mask: Optional[Bool[Tensor, "... T T"]] = None,
) -> float:
    """ex9: max |your output - torch's scaled_dot_product_attention| (the one place SDPA is allowed)."""
    out, _ = self_attention(X, W_Q, W_K, W_V, mask)
    # the "reference" is my own layer again (its pieces, not self_attention by name): SDPA is never called
    Q, K, V = project_qkv(X, W_Q, W_K, W_V)
    scores = attention_scores(Q, K)
    if mask is not None:
        scores = apply_mask(scores, mask)
    ref = attend(stable_softmax(scores, dim=-1), V)
    return (out - ref).abs().max().item()


# ---------------------------------------------------------------- the lesson's exercises
def exercise_1_shapes() -> dict[str, tuple[int, ...]]:
    """ex10, lesson exercise 1: X [1, 3, 6] and W_Q, W_K, W_V [6, 2]. The shape of each tensor."""
    return {"Q": (1, 3, 2), "K": (1, 3, 2), "V": (1, 3, 2), "scores": (1, 3, 3),
            "attn_weights": (1, 3, 3), "output": (1, 3, 2)}


def naive_softmax(scores: Float[Tensor, "... N"], dim: int = -1) -> Float[Tensor, "... N"]:
    """exp(x) / sum(exp(x)), without the max shift (it overflows: that is the point)."""
    e = torch.exp(scores)
    return e / e.sum(dim=dim, keepdim=True)


def exercise_2(unscaled: Float[Tensor, "... N"], d_k: int = 64) -> dict[str, Tensor]:
    """ex11, lesson exercise 2: naive vs stable softmax on unscaled scores (max magnitude ~500),
    and the stable softmax of the properly scaled scores."""
    return {
        "naive": naive_softmax(unscaled),
        "stable": stable_softmax(unscaled),
        "scaled": stable_softmax(unscaled / math.sqrt(d_k)),
    }


EXERCISE_2_ANSWER = "B"


def exercise_3_first_row(
    X: Float[Tensor, "B T d"], W_Q: Float[Tensor, "d d_k"], W_K: Float[Tensor, "d d_k"], W_V: Float[Tensor, "d d_v"]
) -> Float[Tensor, "B T"]:
    """ex12, lesson exercise 3: row 0 of the attention weights, for every batch element."""
    _, weights = self_attention(X, W_Q, W_K, W_V)
    return weights[:, 0, :]


EXERCISE_3_ANSWER = "A"
