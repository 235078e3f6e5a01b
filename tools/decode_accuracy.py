"""Each decode route's error against float64 at long caches, beside torch's: BENCHMARKS.md's
"decode accuracy" table (issue 49).

    python tools/decode_accuracy.py                       # S = 4k .. 512k, 2 threads
    python tools/decode_accuracy.py --lengths 4096,131072 --threads 1

q (1, 32, 1, 128) against a GQA cache (1, 8, S, 128) of N(0, 1) values, seed 0. The error is
max |out - golden| / max |golden|, the golden in float64 from the same cache values.
Routes: the contiguous cache (decode_attention), the same kernel with one task per head
(chunk = S: the behaviour before MAX_CHUNK), a paged cache (paged_decode_attention, pages of 16)
and torch's SDPA (enable_gqa, float32). (A bf16 cache takes bf16 queries at the public API, whose
bf16 output rounding, ~4e-3, would hide the kernel's arithmetic: not in the table.) Needs about 20 bytes a key a head at the
largest S (5.5 GB at 512k).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from attnlab.decoding import PagedKVCache, decode_attention, paged_decode_attention
from attnlab.kernels import decode as kernel

H, HKV, E = 32, 8, 128
LOG2E = 1.4426950408889634


def golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 attention, one key/value head at a time."""
    r = H // HKV
    out = torch.empty(1, H, 1, E, dtype=torch.float64)
    for h in range(HKV):
        s = q[0, h * r:(h + 1) * r, 0].double() @ k[0, h].double().T / E ** 0.5
        p = (s - s.amax(-1, keepdim=True)).exp()
        out[0, h * r:(h + 1) * r, 0] = (p / p.sum(-1, keepdim=True)) @ v[0, h].double()
    return out


def errors(S: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, 1, E, generator=g)
    k, v = torch.randn(1, HKV, S, E, generator=g), torch.randn(1, HKV, S, E, generator=g)
    ref = golden(q, k, v)

    def err(out: torch.Tensor, against: torch.Tensor = ref) -> float:
        return (out.double() - against).abs().max().item() / against.abs().max().item()

    row = {"contiguous fp32": err(decode_attention(q, k, v, enable_gqa=True))}
    whole, _, _ = kernel.forward(q.reshape(HKV, H // HKV, 1, E), k.reshape(HKV, S, E), v.reshape(HKV, S, E),
                                 Hkv=HKV, S=S, scale2=E ** -0.5 * LOG2E, chunk=S)
    row["one task per head (before)"] = err(whole.reshape(1, H, 1, E))
    cache = PagedKVCache(1, HKV, E, page_size=16)
    cache.append(k, v)
    row["paged fp32"] = err(paged_decode_attention(q, cache))
    del cache
    row["torch SDPA fp32"] = err(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,16384,65536,131072,262144,524288")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = {S: errors(S) for S in (int(x) for x in args.lengths.split(","))}
    names = list(next(iter(rows.values())))
    print(f"| S | {' | '.join(names)} |")
    print("| ---: |" + " ---: |" * len(names))
    for S, row in rows.items():
        print(f"| {S:,} | " + " | ".join(f"{row[n]:.1e}" for n in names) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
