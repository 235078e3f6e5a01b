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
# # Lab 02: attention masks, step by step
#
# This notebook runs **your** `masks.py` (imported from this folder). Run it top to bottom
# after each exercise: a cell that raises `NotImplementedError` tells you which exercise
# comes next; `attnlab grade masks.py` gives the score and names each mistake.
#
# Convention (SDPA's): `True` = this query may attend to this key. Masks are applied to the
# scores, before the softmax, as `-inf`.

# %%
import importlib.util
import torch
import torch.nn.functional as F

if importlib.util.find_spec("jaxtyping") is None:  # the lab's file annotates shapes with it
    raise SystemExit("masks.py imports jaxtyping, which is not installed: pip install 'attnlab[lab]', "
                     "then run this again")

import masks as lab  # noqa: E402


def show(m):
    """# = attend, . = masked"""
    for row in m.int().tolist():
        print(" ".join("#" if x else "." for x in row))


# %% [markdown]
# ## ex1: the causal mask, top-left
# Query `i` sees keys `0..i`. With more keys than queries (`L = 3`, `S = 5`) the last two keys
# are seen by nobody: this is what SDPA's `is_causal=True` does.

# %%
show(lab.causal_mask(3, 5))

# %% [markdown]
# ## ex2: the causal mask of a KV cache, bottom-right
# Decoding with a cache of 2 earlier tokens: the 3 new queries are positions 2, 3, 4, so the
# diagonal moves right by `S - L = 2`.

# %%
show(lab.decoding_mask(3, 5))

# %% [markdown]
# ## ex3 and ex4: padding on the keys, combined with the cache's mask
# Two sequences of 5 and 3 real tokens. Padding hides *keys* (shape `[B, 1, 1, S]`): a real
# query never attends to a padding token. Combining masks is `&`: a key is visible only where
# every mask allows it.

# %%
pad = lab.padding_mask(torch.tensor([5, 3]), 5)
print(pad.shape)
both = lab.combine_masks(pad, lab.decoding_mask(3, 5))
print("sequence 1 (3 real tokens):")
show(both[1, 0])

# %% [markdown]
# ## ex5: the masked softmax
# Masked keys get exactly 0 weight and every other row sums to 1; a row with no visible key
# gives zeros, not NaN.

# %%
scores = torch.randn(3, 5)
mask = torch.tensor([[True, True, False, False, False],
                     [False, False, False, False, False],
                     [True, True, True, True, True]])
w = lab.masked_softmax(scores, mask)
print(w)
print("row sums:", w.sum(-1))

# %% [markdown]
# ## ex6: `nn.MultiheadAttention` says the opposite
# Its `key_padding_mask` is True where a key is **ignored**. Converted to SDPA's convention:

# %%
kpm = torch.tensor([[False, False, False, True, True]])  # the last two keys are padding
print(lab.from_key_padding_mask(kpm))

# %% [markdown]
# ## ex7: masked attention against SDPA

# %%
g = torch.Generator().manual_seed(0)
Q, K, V = (torch.randn(2, 4, 3, 8, generator=g) for _ in range(3))
K, V = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 4, 5, 6, generator=g)
mine = lab.masked_attention(Q, K, V, both)
theirs = F.scaled_dot_product_attention(Q, K, V, attn_mask=both)
print("max |yours - torch SDPA|:", (mine - theirs).abs().max().item())
