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
# # Lab 05: FlashAttention in Triton, on a CPU
#
# This notebook runs **your** `flash_triton.py` (imported from this folder) through Triton's
# interpreter: `TRITON_INTERPRET=1` must be set before triton is imported, and then every
# `@triton.jit` kernel runs on the CPU, one program of the grid at a time, with NumPy. It is
# slow (keep L and S under a few hundred) and exact. A cell that raises `NotImplementedError`
# tells you which exercise comes next; `attnlab grade flash_triton.py` scores the file and
# names each mistake.

# %%
import importlib.util
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on the CPU

if importlib.util.find_spec("triton") is None:
    raise SystemExit("flash_triton.py imports triton, which is not installed: pip install 'attnlab[triton]' "
                     "(no GPU needed), then run this again")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flash_triton as lab  # noqa: E402

torch.manual_seed(0)

# %% [markdown]
# ## ex1: the forward kernel
# One program per (query tile, batch x head): `tl.program_id(0)` is the query tile, `(1)` the
# head. It loads its 16 query rows once, then walks the key tiles with the online softmax
# (`m_i`, `l_i`, `acc`), and stores O and `lse = m_i + log(l_i)`.

# %%
q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
o, lse = lab.flash_forward(q, k, v)
print("max |O - SDPA| =", (o - F.scaled_dot_product_attention(q, k, v)).abs().max().item())
print("max |lse - logsumexp| =", (lse - (q @ k.transpose(-2, -1) / 4).logsumexp(-1)).abs().max().item())

# %% [markdown]
# ## ex2-ex3: causal tiles and ragged edges
# Under `CAUSAL` a query tile stops at its own diagonal tile and masks inside it. With L = 37
# and S = 45 the last tiles are partial: every load and store needs `mask=` (and `other=0.0`),
# and keys past S need a score of -inf.

# %%
q, k, v = torch.randn(1, 3, 37, 16), torch.randn(1, 3, 45, 16), torch.randn(1, 3, 45, 16)
for causal in (False, True):
    o, _ = lab.flash_forward(q, k, v, causal)
    print(f"is_causal={causal}: max |O - SDPA| =",
          (o - F.scaled_dot_product_attention(q, k, v, is_causal=causal)).abs().max().item())

# %% [markdown]
# ## ex4-ex6: the backward and the autograd.Function
# `D = rowsum(dO * O)` first, then dK/dV (one program per key tile, looping over the query tiles
# and the query heads of its group: each program owns its rows, so no atomics) and dQ (one
# program per query tile).

# %%
q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
out = lab.triton_attention(q, k, v, True)
grads = torch.autograd.grad(out.sum(), (q, k, v))
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
    print(f"max |{name} - torch| =", (a - b).abs().max().item())

# %% [markdown]
# ## ex7: grouped heads
# Four query heads over two key/value heads: query head h reads key/value head h // 2, by index
# arithmetic in the kernels (nothing is repeated in memory).

# %%
q = torch.randn(1, 4, 33, 16)
k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
o, _ = lab.flash_forward(q, k, v, True)
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
print("GQA: max |O - SDPA| =", (o - ref).abs().max().item())

# %% [markdown]
# Now grade it: `attnlab grade flash_triton.py` in this folder. The grader runs the same
# interpreter in its sandbox, on shapes chosen to catch each mistake (a NaN past every tensor's
# end, a float16 case whose dV is past float16's range).
