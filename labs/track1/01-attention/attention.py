"""Lab 01: self-attention from scratch.

Fill in each function below, in order (ex1, ex2, ...), replacing the
``raise NotImplementedError`` line. Then check your work:

    attnlab grade                      # grades this file, explains each failed check
    attnlab grade --json results.json  # the same, as Gradescope's results.json

Rules of the lab:
* Build it from scratch: no torch.softmax / F.softmax / Tensor.softmax / log_softmax,
  no scaled_dot_product_attention, no nn.MultiheadAttention. The grader catches them.
  The one exception is ``compare_with_sdpa`` (ex9), which *measures* you against SDPA.
* Keep the names and signatures: the grader calls them.
* Work on any batch size and with T != S, d_k != d_v: the grader's inputs are unequal
  on purpose, so that a shape mistake cannot hide.

Shapes (as in the lesson): B batch, T positions (queries), S positions (keys; S = T
in self-attention), d model size, d_k query/key size, d_v value size.
"""

from __future__ import annotations

import math  # noqa: F401  (you will want math.sqrt)
from typing import Optional

import torch  # noqa: F401
from jaxtyping import Bool, Float, Int
from torch import Tensor


# ---------------------------------------------------------------- ex1 - ex4: the four steps
def project_qkv(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
) -> tuple[Float[Tensor, "B T d_k"], Float[Tensor, "B T d_k"], Float[Tensor, "B T d_v"]]:
    """ex1: project every position into a query, a key and a value.

    Returns (Q, K, V) with Q = X @ W_Q of shape [B, T, d_k], K of [B, T, d_k], V of [B, T, d_v].
    """
    raise NotImplementedError("TODO(ex1): return X @ W_Q, X @ W_K, X @ W_V")


def attention_scores(Q: Float[Tensor, "B T d_k"], K: Float[Tensor, "B S d_k"]) -> Float[Tensor, "B T S"]:
    """ex2: the scaled dot product of every query with every key.

    scores[b, i, j] = Q[b, i] . K[b, j] / sqrt(d_k). Transpose only the last two dims of K
    (K.T would reverse all three).
    """
    raise NotImplementedError("TODO(ex2): Q @ K^T over the last two dims, divided by sqrt(d_k)")


def stable_softmax(scores: Float[Tensor, "... N"], dim: int = -1) -> Float[Tensor, "... N"]:
    """ex3: softmax along ``dim`` that never overflows.

    Subtract the maximum along ``dim`` before exp. A slice whose entries are all -inf
    (every key masked) must give zeros, not NaN. Every other slice sums to 1.
    """
    raise NotImplementedError("TODO(ex3): exp(x - max) / sum(exp(x - max)); all -inf slices give 0")


def attend(weights: Float[Tensor, "B T S"], V: Float[Tensor, "B S d_v"]) -> Float[Tensor, "B T d_v"]:
    """ex4: each position's output is the weighted sum of all values."""
    raise NotImplementedError("TODO(ex4): weights @ V")


# ---------------------------------------------------------------- ex5 - ex7: masks
def causal_mask(T: int) -> Bool[Tensor, "T T"]:
    """ex5: a [T, T] bool mask, True where position i may attend to position j (j <= i).

    For T = 3:   [[ True, False, False],
                  [ True,  True, False],
                  [ True,  True,  True]]
    """
    raise NotImplementedError("TODO(ex5): True on and below the diagonal")


def padding_mask(lengths: Int[Tensor, " B"], T: int) -> Bool[Tensor, "B 1 T"]:
    """ex6: a [B, 1, T] bool mask, True for real tokens (position j < lengths[b]) and False
    for padding. The middle 1 broadcasts over the query rows of [B, T, T] scores.

    lengths = [3, 1], T = 4  ->  [[[ True,  True,  True, False]],
                                  [[ True, False, False, False]]]
    """
    raise NotImplementedError("TODO(ex6): compare torch.arange(T) with the lengths")


def apply_mask(scores: Float[Tensor, "B T S"], mask: Bool[Tensor, "... T S"]) -> Float[Tensor, "B T S"]:
    """ex7: masked scores: -inf wherever ``mask`` is False (True = attend), unchanged elsewhere.

    ``mask`` broadcasts against ``scores`` ([T, S], [B, 1, S], [B, T, S], ...).
    """
    raise NotImplementedError("TODO(ex7): -inf where the mask is False")


# ---------------------------------------------------------------- ex8 - ex9: put together
def self_attention(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
    mask: Optional[Bool[Tensor, "... T T"]] = None,
) -> tuple[Float[Tensor, "B T d_v"], Float[Tensor, "B T T"]]:
    """ex8: the whole layer, from your ex1-ex7: project, score, mask (if given), softmax, attend.

    Returns (output [B, T, d_v], weights [B, T, T]). A query whose keys are all masked
    gets an all-zero row of weights and an all-zero output.
    """
    raise NotImplementedError("TODO(ex8): chain ex1-ex4, applying the mask before softmax")


def compare_with_sdpa(
    X: Float[Tensor, "B T d"],
    W_Q: Float[Tensor, "d d_k"],
    W_K: Float[Tensor, "d d_k"],
    W_V: Float[Tensor, "d d_v"],
    mask: Optional[Bool[Tensor, "... T T"]] = None,
) -> float:
    """ex9: max |your self_attention output - torch's scaled_dot_product_attention| as a float.

    The one place where torch.nn.functional.scaled_dot_product_attention is allowed: call
    it on your Q, K, V with ``attn_mask=mask``, and call your ``self_attention`` by its name (the
    grader checks that the number measures it). Expect below 1e-5 in float32.
    """
    raise NotImplementedError("TODO(ex9): compare with torch.nn.functional.scaled_dot_product_attention")


# ---------------------------------------------------------------- the lesson's exercises
def exercise_1_shapes() -> dict[str, tuple[int, ...]]:
    """ex10, lesson exercise 1: X has shape [1, 3, 6]; W_Q, W_K and W_V have shape [6, 2].

    Return the shapes as tuples, under the keys "Q", "K", "V", "scores", "attn_weights"
    and "output". Work them out by hand first, then check with your functions.
    """
    raise NotImplementedError("TODO(ex10): a dict of six shapes")


def naive_softmax(scores: Float[Tensor, "... N"], dim: int = -1) -> Float[Tensor, "... N"]:
    """exp(x) / sum(exp(x)), without the max shift. Given: it is meant to overflow."""
    e = torch.exp(scores)
    return e / e.sum(dim=dim, keepdim=True)


def exercise_2(unscaled: Float[Tensor, "... N"], d_k: int = 64) -> dict[str, Tensor]:
    """ex11, lesson exercise 2: d_k = 64 and the unscaled scores reach magnitude 500.

    Return {"naive": naive_softmax(unscaled), "stable": your stable_softmax(unscaled),
    "scaled": your stable_softmax of the scores divided by sqrt(d_k)}, then set
    EXERCISE_2_ANSWER below.
    """
    raise NotImplementedError("TODO(ex11): the three softmaxes")


# ex11: what happens to the naive softmax, and what does the stable one give? One letter:
#   "A": both give the same probabilities, since the shift cancels out
#   "B": naive overflows (exp(500) = inf in float32) and gives NaN; stable gives a finite
#        distribution, nearly one-hot on the largest score
#   "C": naive gives all zeros; stable gives a uniform distribution
EXERCISE_2_ANSWER = "?"


def exercise_3_first_row(
    X: Float[Tensor, "B T d"], W_Q: Float[Tensor, "d d_k"], W_K: Float[Tensor, "d d_k"], W_V: Float[Tensor, "d d_v"]
) -> Float[Tensor, "B T"]:
    """ex12, lesson exercise 3: row 0 of the attention weights (no mask), for every batch
    element: shape [B, T]. Then set EXERCISE_3_ANSWER below."""
    raise NotImplementedError("TODO(ex12): row 0 of the weights from your self_attention")


# ex12: what does row 0 of the attention weights represent? One letter:
#   "A": how much position 0 (the first query) attends to each position, itself included;
#        a distribution that sums to 1
#   "B": how much every position attends to position 0
#   "C": the output vector of position 0
EXERCISE_3_ANSWER = "?"
