"""Lab 01, solution "d" (the fourth independent one, written from the brief alone): every product
is a torch.bmm against a batched transpose (the weights expanded over the batch), the masks come
from torch.arange comparisons, masking is a torch.where against a -inf tensor, the softmax goes
through a log-sum-exp (scores minus their max, minus the log of the summed exponentials, then
exp), and each later function is built by composing the earlier ones."""

from __future__ import annotations

import math
from typing import Optional

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


# ---------------------------------------------------------------- ex1 - ex4: the four steps
def batched_project(X: Float[Tensor, "B T d"], W: Float[Tensor, "d e"]) -> Float[Tensor, "B T e"]:
    """X @ W for every batch element, as one bmm with W repeated over the batch."""
    return torch.bmm(X, W.unsqueeze(0).expand(X.shape[0], -1, -1))


def project_qkv(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
) -> tuple[Float[Tensor, "B T d_k"], Float[Tensor, "B T d_k"], Float[Tensor, "B T d_v"]]:
    """ex1: Q, K, V, each a batched product of X with its projection."""
    Q = batched_project(X, W_Q)
    K = batched_project(X, W_K)
    V = batched_project(X, W_V)
    return Q, K, V


def attention_scores(Q: Float[Tensor, "B T d_k"], K: Float[Tensor, "B S d_k"]) -> Float[Tensor, "B T S"]:
    """ex2: Q K^T over the batch (K transposed in its last two dims), over sqrt(d_k)."""
    d_k = Q.shape[-1]
    return torch.bmm(Q, K.transpose(1, 2)) / math.sqrt(d_k)


def stable_softmax(scores: Float[Tensor, "... N"], dim: int = -1) -> Float[Tensor, "... N"]:
    """ex3: exp(x - logsumexp(x)), with logsumexp = max + log(sum(exp(x - max)));
    an all -inf slice gives zeros."""
    peak = scores.amax(dim=dim, keepdim=True)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    shifted = scores - peak
    log_total = torch.log(torch.exp(shifted).sum(dim=dim, keepdim=True))
    log_total = torch.where(torch.isinf(log_total), torch.zeros_like(log_total), log_total)
    return torch.exp(shifted - log_total)


def attend(weights: Float[Tensor, "B T S"], V: Float[Tensor, "B S d_v"]) -> Float[Tensor, "B T d_v"]:
    """ex4: the weighted sum of the values, one bmm."""
    return torch.bmm(weights, V)


# ---------------------------------------------------------------- ex5 - ex7: masks
def causal_mask(T: int) -> Bool[Tensor, "T T"]:
    """ex5: True where key j <= query i."""
    query = torch.arange(T).unsqueeze(1)
    key = torch.arange(T).unsqueeze(0)
    return key <= query


def padding_mask(lengths: Int[Tensor, " B"], T: int) -> Bool[Tensor, "B 1 T"]:
    """ex6: True where position j < lengths[b], shaped [B, 1, T]."""
    positions = torch.arange(T, device=lengths.device).unsqueeze(0)
    real = positions < lengths.unsqueeze(1)
    return real.unsqueeze(1)


def apply_mask(scores: Float[Tensor, "B T S"], mask: Bool[Tensor, "... T S"]) -> Float[Tensor, "B T S"]:
    """ex7: keep the scores where the mask is True, -inf elsewhere."""
    minus_inf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    return torch.where(mask, scores, minus_inf)


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
    scores = attention_scores(Q, K)
    if mask is not None:
        scores = apply_mask(scores, mask)
    weights = stable_softmax(scores, dim=-1)
    output = attend(weights, V)
    return output, weights


def compare_with_sdpa(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
    mask: Optional[Bool[Tensor, "... T T"]] = None,
) -> float:
    """ex9: the largest absolute gap between self_attention and torch's SDPA."""
    Q, K, V = project_qkv(X, W_Q, W_K, W_V)
    mine, _ = self_attention(X, W_Q, W_K, W_V, mask)
    theirs = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    return (mine - theirs).abs().max().item()


# ---------------------------------------------------------------- the lesson's exercises
def exercise_1_shapes() -> dict[str, tuple[int, ...]]:
    """ex10: the shapes, read off a run of the layer on X [1, 3, 6] and W [6, 2]."""
    X = torch.zeros(1, 3, 6)
    W = torch.zeros(6, 2)
    Q, K, V = project_qkv(X, W, W, W)
    scores = attention_scores(Q, K)
    output, weights = self_attention(X, W, W, W)
    return {
        "Q": tuple(Q.shape),
        "K": tuple(K.shape),
        "V": tuple(V.shape),
        "scores": tuple(scores.shape),
        "attn_weights": tuple(weights.shape),
        "output": tuple(output.shape),
    }


def naive_softmax(scores: Float[Tensor, "... N"], dim: int = -1) -> Float[Tensor, "... N"]:
    """exp(x) / sum(exp(x)), without the max shift. Given: it is meant to overflow."""
    e = torch.exp(scores)
    return e / e.sum(dim=dim, keepdim=True)


def exercise_2(unscaled: Float[Tensor, "... N"], d_k: int = 64) -> dict[str, Tensor]:
    """ex11: the naive softmax, the stable one, and the stable one of the scaled scores."""
    return {
        "naive": naive_softmax(unscaled),
        "stable": stable_softmax(unscaled),
        "scaled": stable_softmax(unscaled / math.sqrt(d_k)),
    }


EXERCISE_2_ANSWER = "B"


def exercise_3_first_row(
    X: Float[Tensor, "B T d"], W_Q: Float[Tensor, "d d_k"], W_K: Float[Tensor, "d d_k"], W_V: Float[Tensor, "d d_v"]
) -> Float[Tensor, "B T"]:
    """ex12: query 0's row of the weights, for every batch element."""
    _, weights = self_attention(X, W_Q, W_K, W_V)
    return weights[:, 0, :]


EXERCISE_3_ANSWER = "A"
