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
# # Lab 03: heads, groups and a KV cache, step by step
#
# This notebook runs **your** `multihead.py` (imported from this folder). A cell that raises
# `NotImplementedError` tells you which exercise comes next; `attnlab grade multihead.py`
# scores it and names each mistake.

# %%
import importlib.util
import torch
import torch.nn.functional as F

if importlib.util.find_spec("jaxtyping") is None:  # the lab's file annotates shapes with it
    raise SystemExit("multihead.py imports jaxtyping, which is not installed: pip install 'attnlab[lab]', "
                     "then run this again")

import multihead as lab  # noqa: E402

torch.manual_seed(0)

# %% [markdown]
# ## ex1 and ex2: splitting and merging heads
# Model size D = 12, H = 3 heads of E = 4. Head 1 must hold features 4..7 of every position.

# %%
x = torch.arange(2 * 5 * 12, dtype=torch.float32).view(2, 5, 12)
heads = lab.split_heads(x, 3)
print(heads.shape, "head 1 of position 0:", heads[0, 1, 0].tolist())
print("merge(split(x)) == x:", torch.equal(lab.merge_heads(heads), x))

# %% [markdown]
# ## ex3: the multi-head layer against `nn.MultiheadAttention`
# torch's layer applies its weights on the left (`W x`), ours on the right (`x @ W`): copy
# the transposes in.

# %%
D, H = 12, 3
W_Q, W_K, W_V, W_O = (torch.randn(D, D) / D ** 0.5 for _ in range(4))
mha = torch.nn.MultiheadAttention(D, H, bias=False, batch_first=True)
with torch.no_grad():
    mha.in_proj_weight.copy_(torch.cat([W_Q.T, W_K.T, W_V.T]))
    mha.out_proj.weight.copy_(W_O.T)
xs = torch.randn(2, 5, D)
theirs, _ = mha(xs, xs, xs, need_weights=False)
mine = lab.multi_head_attention(xs, W_Q, W_K, W_V, W_O, H)
print("max |yours - nn.MultiheadAttention|:", (mine - theirs).abs().max().item())

# %% [markdown]
# ## ex4 and ex5: grouped-query attention
# 6 query heads over 2 key/value heads: query heads 0-2 use head 0, 3-5 use head 1.

# %%
kv = torch.arange(2).float().view(1, 2, 1, 1).expand(1, 2, 1, 1)
print("key/value head of each query head:", lab.repeat_kv(kv, 3).flatten().tolist())
q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 5)
diff = (lab.gqa_attention(q, k, v) - F.scaled_dot_product_attention(q, k, v, enable_gqa=True)).abs().max()
print("max |yours - SDPA(enable_gqa=True)|:", diff.item())

# %% [markdown]
# ## ex6: decoding with a KV cache equals the full causal forward
# Process 4 tokens, then 2 more with the cache, then 1: the outputs match one causal pass.

# %%
qf, kf, vf = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 3)
full = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
k_cache, v_cache = kf[:, :, :0], vf[:, :, :0]
outs = []
for start, end in ((0, 4), (4, 6), (6, 7)):
    out, k_cache, v_cache = lab.decode_step(qf[:, :, start:end], k_cache, v_cache, kf[:, :, start:end],
                                            vf[:, :, start:end])
    outs.append(out)
print("cache length:", k_cache.shape[2])
print("max |cached decoding - full causal forward|:", (torch.cat(outs, dim=2) - full).abs().max().item())
