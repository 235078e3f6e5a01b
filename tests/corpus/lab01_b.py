"""Lab 01, a second solution written independently of the instructor's: einsum for every
product, masks from index comparisons, torch.where for the fills, the softmax's empty
slices handled by clamping the denominator. The mistake corpus (tests/corpus/lab01.py)
breaks it in the ways learners do."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def project_qkv(X: Tensor, W_Q: Tensor, W_K: Tensor, W_V: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    Q = torch.einsum("btd,dk->btk", X, W_Q)
    K = torch.einsum("btd,dk->btk", X, W_K)
    V = torch.einsum("btd,dv->btv", X, W_V)
    return Q, K, V


def attention_scores(Q: Tensor, K: Tensor) -> Tensor:
    d_k = Q.size(-1)
    return torch.einsum("bik,bjk->bij", Q, K) * d_k ** -0.5


def stable_softmax(scores: Tensor, dim: int = -1) -> Tensor:
    top = scores.max(dim=dim, keepdim=True).values
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    exps = (scores - top).exp()
    denom = exps.sum(dim=dim, keepdim=True)
    return exps / denom.clamp(min=torch.finfo(denom.dtype).tiny)


def attend(weights: Tensor, V: Tensor) -> Tensor:
    return torch.einsum("...ts,...sv->...tv", weights, V)


def causal_mask(T: int) -> Tensor:
    i = torch.arange(T)
    return i[:, None] >= i[None, :]


def padding_mask(lengths: Tensor, T: int) -> Tensor:
    positions = torch.arange(T).unsqueeze(0)  # [1, T]
    return (positions < lengths.unsqueeze(1)).unsqueeze(1)  # [B, 1, T]


def apply_mask(scores: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, scores, torch.full_like(scores, float("-inf")))


def self_attention(X: Tensor, W_Q: Tensor, W_K: Tensor, W_V: Tensor,
                   mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    Q, K, V = project_qkv(X, W_Q, W_K, W_V)
    scores = attention_scores(Q, K)
    if mask is not None:
        scores = apply_mask(scores, mask)
    weights = stable_softmax(scores, dim=-1)
    return attend(weights, V), weights


def compare_with_sdpa(X: Tensor, W_Q: Tensor, W_K: Tensor, W_V: Tensor, mask: Optional[Tensor] = None) -> float:
    mine, _ = self_attention(X, W_Q, W_K, W_V, mask)
    Q, K, V = project_qkv(X, W_Q, W_K, W_V)
    theirs = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    return float((mine - theirs).abs().max())


def exercise_1_shapes() -> dict[str, tuple[int, ...]]:
    B, T, d_k, d_v = 1, 3, 2, 2
    return {"Q": (B, T, d_k), "K": (B, T, d_k), "V": (B, T, d_v), "scores": (B, T, T),
            "attn_weights": (B, T, T), "output": (B, T, d_v)}


def naive_softmax(scores: Tensor, dim: int = -1) -> Tensor:
    e = torch.exp(scores)
    return e / e.sum(dim=dim, keepdim=True)


def exercise_2(unscaled: Tensor, d_k: int = 64) -> dict[str, Tensor]:
    return {"naive": naive_softmax(unscaled), "stable": stable_softmax(unscaled),
            "scaled": stable_softmax(unscaled / math.sqrt(d_k))}


EXERCISE_2_ANSWER = "B"


def exercise_3_first_row(X: Tensor, W_Q: Tensor, W_K: Tensor, W_V: Tensor) -> Tensor:
    weights = self_attention(X, W_Q, W_K, W_V)[1]
    return weights[:, 0]


EXERCISE_3_ANSWER = "A"
