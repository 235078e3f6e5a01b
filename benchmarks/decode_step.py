"""One decode step through MultiHeadAttention + KVCache, against the same step written with torch's SDPA.

    .venv/bin/python benchmarks/decode_step.py [--lengths 4096 32768] [--runs 20]

The step: one token x (1, 1, d_model) with d_model = 4096, H = 32 query heads, Hkv = 8
key/value heads (head_dim 128), a cache already holding S tokens; q/k/v projections, the
cache append, attention over S + 1 keys, the output projection. attnlab's step is
``MultiHeadAttention(x, is_causal=True, kv_cache=cache)``, with a preallocated ``KVCache`` and
with a ``PagedKVCache`` (pages of 16); torch's uses the same weights,
the same preallocated cache tensors and ``F.scaled_dot_product_attention(enable_gqa=True)``.
Prints median milliseconds over the runs (interleaved) and the ratio. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from attnlab.decoding import PagedKVCache
from attnlab.modules import KVCache, MultiHeadAttention

D, H, HKV = 4096, 32, 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    m = MultiHeadAttention(D, H, num_kv_heads=HKV, bias=False).eval()
    hd = D // H
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| S | attnlab module step ms (KVCache) | (PagedKVCache) | torch SDPA step ms | ratio (KVCache) | ratio (paged) |")
    print("|---|---|---|---|---|---|")
    for S in args.lengths:
        prefill = torch.randn(1, HKV, S, hd)
        cache = KVCache(1, HKV, hd, max_len=S + args.runs + 2)
        cache.append(prefill, prefill)
        paged = PagedKVCache(1, HKV, hd, page_size=16)
        paged.append(prefill, prefill)
        kbuf = torch.zeros(1, HKV, S + args.runs + 2, hd)
        vbuf = torch.zeros_like(kbuf)
        kbuf[:, :, :S] = prefill
        vbuf[:, :, :S] = prefill
        n = [S]
        x = torch.randn(1, 1, D)
        ours, ours_paged, theirs = [], [], []
        with torch.no_grad():
            for _ in range(args.runs):
                t0 = time.perf_counter()
                m(x, is_causal=True, kv_cache=cache)
                ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                m(x, is_causal=True, kv_cache=paged)
                ours_paged.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                q = m.q_proj(x).view(1, 1, H, hd).transpose(1, 2)
                k = m.k_proj(x).view(1, 1, HKV, hd).transpose(1, 2)
                v = m.v_proj(x).view(1, 1, HKV, hd).transpose(1, 2)
                kbuf[:, :, n[0]:n[0] + 1] = k
                vbuf[:, :, n[0]:n[0] + 1] = v
                n[0] += 1
                o = F.scaled_dot_product_attention(q, kbuf[:, :, :n[0]], vbuf[:, :, :n[0]], enable_gqa=True)
                m.out_proj(o.transpose(1, 2).reshape(1, 1, D))
                theirs.append(time.perf_counter() - t0)
                cache.length -= 1  # the same S for every run
                paged.length -= 1
                n[0] -= 1
        a, p, b = (statistics.median(t) * 1e3 for t in (ours, ours_paged, theirs))
        print(f"| {S} | {a:.2f} | {p:.2f} | {b:.2f} | {a / b:.2f}x | {p / b:.2f}x |")


if __name__ == "__main__":
    main()
