# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 01: self-attention from scratch, step by step
#
# This notebook walks through the lab with **your** `attention.py` (it imports it from
# this folder). Run it top to bottom after each exercise: a cell that raises
# `NotImplementedError` tells you which exercise comes next. `attnlab grade` gives the
# score and explains each failed check.
#
# Shapes, as in the lesson: `B` batch, `T` positions, `d` model size, `d_k` query/key
# size, `d_v` value size.

# %%
import importlib.util
import math

import torch

if importlib.util.find_spec("jaxtyping") is None:  # the lab's file annotates shapes with it
    raise SystemExit("attention.py imports jaxtyping, which is not installed: pip install 'attnlab[lab]', "
                     "then run this again")

import attention as lab  # noqa: E402

torch.set_printoptions(precision=4, sci_mode=False)

# %% [markdown]
# ## The lesson's worked example (seed 42)
# `X` is `[1, 4, 8]`; the three projections are `[8, 4]`. The draws happen in the
# lesson's order, so the numbers below are the lesson's.

# %%
torch.manual_seed(42)
X = torch.randn(1, 4, 8)
W_Q, W_K, W_V = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4)

# %% [markdown]
# ## ex1: projections
# Every position becomes a query, a key and a value.

# %%
Q, K, V = lab.project_qkv(X, W_Q, W_K, W_V)
print("Q", tuple(Q.shape), "K", tuple(K.shape), "V", tuple(V.shape))
print(Q)
assert Q.shape == (1, 4, 4) and V.shape == (1, 4, 4)

# %% [markdown]
# ## ex2: scaled scores
# `scores[i, j]` says how much query `i` matches key `j`. Dividing by `sqrt(d_k)` keeps
# the dot products from growing with `d_k`.

# %%
scores = lab.attention_scores(Q, K)
print(scores)
assert torch.allclose(scores, Q @ K.transpose(-2, -1) / math.sqrt(4))

# %% [markdown]
# ## ex3: stable softmax
# Naive `exp(x) / sum(exp(x))` overflows for scores near 1000. Subtracting the row
# maximum first changes nothing mathematically and keeps every exponent <= 0.

# %%
big = torch.tensor([1000.0, 1001.0, 999.0, 1002.0])
print("naive :", lab.naive_softmax(big))
print("stable:", lab.stable_softmax(big))
weights = lab.stable_softmax(scores)
print(weights)
print("row sums:", weights.sum(-1))
assert torch.isfinite(lab.stable_softmax(big)).all()

# %% [markdown]
# ## ex4: the weighted sum of values

# %%
output = lab.attend(weights, V)
print(output)
assert output.shape == (1, 4, 4)

# %% [markdown]
# ## ex5 - ex7: masks
# `True` means *attend*. A causal mask lets position `i` see `0..i`; a padding mask hides
# the padding at the end of short sequences; `apply_mask` turns `False` into `-inf`.

# %%
print(lab.causal_mask(4))
print(lab.padding_mask(torch.tensor([4, 2]), 4))
print(lab.apply_mask(scores, lab.causal_mask(4)))

# %% [markdown]
# ## ex8: the whole layer, and ex9: parity with PyTorch

# %%
out, w = lab.self_attention(X, W_Q, W_K, W_V, mask=lab.causal_mask(4))
print(w)
assert torch.equal(w[0].triu(1), torch.zeros(4, 4))
diff = lab.compare_with_sdpa(X, W_Q, W_K, W_V)
print(f"max |yours - torch SDPA| = {diff:.2e}")
assert diff < 1e-5

# %% [markdown]
# ## The lesson's exercises
# **Exercise 1**: the shapes for `X [1, 3, 6]` and `W [6, 2]`. Check your answer by
# running your own functions on tensors of those shapes.

# %%
answer = lab.exercise_1_shapes()
X1 = torch.randn(1, 3, 6)
W1 = [torch.randn(6, 2) for _ in range(3)]
Q1, K1, V1 = lab.project_qkv(X1, *W1)
out1, w1 = lab.self_attention(X1, *W1)
measured = {"Q": Q1.shape, "K": K1.shape, "V": V1.shape, "scores": lab.attention_scores(Q1, K1).shape,
            "attn_weights": w1.shape, "output": out1.shape}
for key in measured:
    print(f"{key:>12}: yours {answer[key]}, measured {tuple(measured[key])}")
assert all(tuple(measured[k]) == tuple(answer[k]) for k in measured)

# %% [markdown]
# **Exercise 2**: `d_k = 64` and unscaled scores up to 500.

# %%
unscaled = torch.tensor([500.0, 480.0, -500.0, 0.0])
result = lab.exercise_2(unscaled, d_k=64)
for key, value in result.items():
    print(f"{key:>7}: {value}")
print("your answer:", lab.EXERCISE_2_ANSWER)

# %% [markdown]
# **Exercise 3**: row 0 of the weights.

# %%
row0 = lab.exercise_3_first_row(X, W_Q, W_K, W_V)
print(row0, "sum:", row0.sum(-1))
print("your answer:", lab.EXERCISE_3_ANSWER)
