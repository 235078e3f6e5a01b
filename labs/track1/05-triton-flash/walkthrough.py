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
import warnings

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on the CPU

if importlib.util.find_spec("triton") is None:
    raise SystemExit("flash_triton.py imports triton, which is not installed: pip install 'attnlab[triton]' "
                     "(no GPU needed), then run this again")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flash_triton as lab  # noqa: E402

torch.manual_seed(0)


warnings.filterwarnings("ignore", message="To exit: use")  # Jupyter's note on the SystemExit below


def written(exercise, fn, *args):
    """``fn(*args)``; where your file still raises NotImplementedError (directly, or inside a kernel,
    which Triton's interpreter wraps), stop here with that one line instead of a traceback."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        todo = exc if isinstance(exc, NotImplementedError) else exc.__cause__
        if isinstance(todo, NotImplementedError):
            raise SystemExit(f"{exercise} is not written yet ({todo}): fill it in flash_triton.py, "
                             "then run this cell again") from None
        raise

# %% [markdown]
# ## ex1: the forward kernel
# One program per (query tile, batch x head): `tl.program_id(0)` is the query tile, `(1)` the
# head. It loads its 16 query rows once, then walks the key tiles with the online softmax
# (`m_i`, `l_i`, `acc`), and stores O and `lse = m_i + log(l_i)`.

# %%
q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
o, lse = written("ex1", lab.flash_forward, q, k, v)
print("max |O - SDPA| =", (o - F.scaled_dot_product_attention(q, k, v)).abs().max().item())
print("max |lse - logsumexp| =", (lse - (q @ k.transpose(-2, -1) / 4).logsumexp(-1)).abs().max().item())

# %% [markdown]
# ### One program, tile by tile
# The state one program carries down its row of tiles, for its first query row: the tile's own
# max, the running max `m_i`, the rescale `alpha = exp(m_old - m_new)` of what was summed before,
# the running sum `l_i`, and the first two columns of `acc`. Nothing is normalised until the end:
# `O = acc / l_i` and `lse = m_i + log(l_i)`. The last line compares that with your kernel's O.

# %%
def trace_program(q, k, v, row=0, BK=lab.BLOCK_K):
    """The online softmax of one query row over the key tiles, in float64, printed tile by tile."""
    qr = q[0, 0, row].double() / q.shape[-1] ** 0.5
    m_i, l_i, acc = float("-inf"), 0.0, torch.zeros(v.shape[-1], dtype=torch.float64)
    print(f"{'keys':>9} {'tile max':>9} {'m_i':>8} {'alpha':>8} {'l_i':>9}  acc[:2]")
    for start in range(0, k.shape[2], BK):
        s = k[0, 0, start:start + BK].double() @ qr  # this tile's scores
        m_new = max(m_i, s.max().item())
        alpha = torch.exp(torch.tensor(m_i - m_new)).item()
        p = torch.exp(s - m_new)
        l_i = l_i * alpha + p.sum().item()
        acc = acc * alpha + p @ v[0, 0, start:start + BK].double()
        m_i = m_new
        print(f"{start:>4}-{start + len(s) - 1:<4} {s.max().item():9.4f} {m_i:8.4f} {alpha:8.4f} {l_i:9.4f}  "
              f"{acc[0].item():.4f} {acc[1].item():.4f}")
    yours, _ = lab.flash_forward(q, k, v)
    print(f"O = acc / l_i: {[round(x, 6) for x in (acc[:2] / l_i).tolist()]}   your kernel's O: "
          f"{[round(x, 6) for x in yours[0, 0, row, :2].tolist()]}")


# keys that grow tile by tile, so the running max rises and alpha < 1 rescales what came before
trace_program(torch.randn(1, 1, 16, 16), torch.randn(1, 1, 64, 16) * torch.linspace(0.5, 2.5, 64)[:, None],
              torch.randn(1, 1, 64, 16))

# %% [markdown]
# ## ex2-ex3: causal tiles and ragged edges
# Under `CAUSAL` a query tile stops at its own diagonal tile and masks inside it. With L = 37
# and S = 45 the last tiles are partial: every load and store needs `mask=` (and `other=0.0`),
# and keys past S need a score of -inf.

# %%
def tile_grid(L, S, pid_q, BQ=lab.BLOCK_Q, BK=lab.BLOCK_K):
    """The (query tile, key tile) grid under is_causal, and what program ``pid_q`` does with each tile
    of its row: '##' loaded whole, '\\' the diagonal tile, loaded and masked inside, '..' skipped."""
    print(f"program pid_q = {pid_q}: queries {pid_q * BQ}..{min(L, (pid_q + 1) * BQ) - 1}, is_causal")
    print(" " * 14 + "".join(f"{f'keys {ks}-{min(S, ks + BK) - 1}':>13}" for ks in range(0, S, BK)))
    for qt in range(0, L, BQ):
        cells = []
        for ks in range(0, S, BK):
            if ks > qt + BQ - 1:
                cell = ".."  # wholly after every query of this tile: never loaded
            elif ks + BK - 1 <= qt:
                cell = "##"  # wholly at or before the tile's first query: no mask needed
            else:
                cell = "\\\\"  # the diagonal crosses it: loaded, masked inside
            cells.append(f"{cell:>13}" if qt // BQ == pid_q else f"{'(' + cell + ')':>13}")
        print(f"rows {qt:>2}-{min(L, qt + BQ) - 1:<3}  " + "".join(cells) + ("   <- this program" if qt // BQ == pid_q else ""))


tile_grid(48, 48, pid_q=1)

# %%
q, k, v = torch.randn(1, 3, 37, 16), torch.randn(1, 3, 45, 16), torch.randn(1, 3, 45, 16)
for causal in (False, True):
    o, _ = written("ex2-ex3", lab.flash_forward, q, k, v, causal)
    print(f"is_causal={causal}: max |O - SDPA| =",
          (o - F.scaled_dot_product_attention(q, k, v, is_causal=causal)).abs().max().item())

# %% [markdown]
# ## ex4-ex6: the backward and the autograd.Function
# `D = rowsum(dO * O)` first, then dK/dV (one program per key tile, looping over the query tiles
# and the query heads of its group: each program owns its rows, so no atomics) and dQ (one
# program per query tile).

# %%
q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
out = written("ex4-ex6", lab.triton_attention, q, k, v, True)
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
o, _ = written("ex7", lab.flash_forward, q, k, v, True)
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
print("GQA: max |O - SDPA| =", (o - ref).abs().max().item())

# %% [markdown]
# Now grade it: `attnlab grade flash_triton.py` in this folder. The grader runs the same
# interpreter in its sandbox, on shapes chosen to catch each mistake (a NaN past every tensor's
# end, a float16 case whose dV is past float16's range).
