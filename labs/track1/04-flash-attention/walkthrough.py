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
# # Lab 04: FlashAttention from scratch, step by step
#
# This notebook runs **your** `flash.py` (imported from this folder). A cell that raises
# `NotImplementedError` tells you which exercise comes next; `attnlab grade flash.py` scores
# it, names each mistake, and checks that your forward never builds an [L, S] tensor.

# %%
import importlib.util
import math

import torch
import torch.nn.functional as F

if importlib.util.find_spec("jaxtyping") is None:  # the lab's file annotates shapes with it
    raise SystemExit("flash.py imports jaxtyping, which is not installed: pip install 'attnlab[lab]', "
                     "then run this again")

import flash as lab  # noqa: E402

torch.manual_seed(0)

# %% [markdown]
# ## ex1: the online softmax
# One row of scores arrives 4 at a time. The running max `m_i` only grows; each time it does,
# the running sum `l_i` (accumulated under the old max) is multiplied by `exp(m_old - m_new)`.

# %%
x = torch.tensor([[1.0, 0.5, 2.0, 0.0, 3.0, 1.0, 6.0, 2.0, 1.0, 0.0, 0.5, 4.0]])
for stop in (4, 8, 12):
    m_i, l_i = lab.online_softmax_stats(x[:, :stop], 4)
    print(f"running max after each block ({stop} seen): m_i = {m_i.item():.1f}, l_i = {l_i.item():.4f}")
m_i, l_i = lab.online_softmax_stats(x, 4)
print("exp(x - m_i) / l_i == softmax:", torch.allclose(torch.exp(x - m_i[:, None]) / l_i[:, None], F.softmax(x, -1)))

# %% [markdown]
# ## ex2: the tiled forward
# Each block of queries streams over blocks of keys with its own `m_i`, `l_i` and `acc`.
# Under `is_causal` (query i sees keys 0 .. i) some tiles are skipped, some need no mask, and
# the diagonal ones are masked inside:

# %%
L = S = 64
bq = bk = 16
for qs in range(0, L, bq):
    row = ""
    for ks in range(0, S, bk):
        row += "." if ks > qs + bq - 1 else ("#" if lab.causal_block_mask(qs, qs + bq, ks, ks + bk) is None else "\\")
    print(f"queries {qs:2d}-{qs + bq - 1:2d}: {row}")
print("# full tile, \\ diagonal tile (masked inside), . skipped")

# %%
q, k, v = torch.randn(2, 4, 100, 32), torch.randn(2, 4, 120, 32), torch.randn(2, 4, 120, 16)
for causal in (False, True):
    o, lse = lab.flash_forward(q, k, v, causal, 32, 16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    scores = q @ k.transpose(-2, -1) / math.sqrt(32)
    if causal:
        scores = scores.masked_fill(~torch.ones(100, 120, dtype=torch.bool).tril(), float("-inf"))
    print(f"is_causal={causal}: max |tiled - SDPA| = {(o - ref).abs().max().item():.2e}, "
          f"max |lse - logsumexp| = {(lse - scores.logsumexp(-1)).abs().max().item():.2e}")

# %% [markdown]
# ## ex3: no [L, S] tensor
# At L = S = 4096 one float32 [L, S] tensor is 64 MB; the grader gives your forward 32 MB.
# Your forward's largest temporary is one tile:

# %%
print("one 256 x 256 tile of scores:", 256 * 256 * 4 // 1024, "KB; the whole [4096, 4096]:", 4096 * 4096 * 4 >> 20, "MB")

# %% [markdown]
# ## ex4 and ex5: the backward, and one autograd Function
# The backward rebuilds each tile's weights from `lse` (`P = exp(scores - lse)`) instead of
# keeping them, and needs `D = rowsum(dO * O)` for `dS = P * (dP - D)`.

# %%
q, k, v = (torch.randn(1, 2, 50, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
do = torch.randn(1, 2, 50, 16, dtype=torch.float64)
for causal in (False, True):
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    expected = torch.autograd.grad(ref, (q, k, v), do)
    o, dq, dk, dv, saved = lab.attention_and_grads(q, k, v, do, causal)
    worst = max((a - b).abs().max().item() for a, b in zip((dq, dk, dv), expected))
    print(f"is_causal={causal}: max |gradient - autograd| = {worst:.2e}; saved shapes: {saved}")
