"""The int8 KV cache's accuracy against float32 and bfloat16 caches (BENCHMARKS.md, "int8 KV cache").

    .venv/bin/python benchmarks/int8_accuracy.py [--seq-len 8192] [--outlier 20]

One decode step, q (1, 32, 1, 128) float32 against a GQA cache (1, 8, S, 128), keys and values
N(0, 1) with (or without) two key channels scaled by --outlier, as LLM keys have them. Each row
is the error of attnlab's decode output against float64 SDPA on the exact keys and values:

* float32: the cache as it is;
* bfloat16: keys and values rounded to bfloat16 (the query stays float32);
* int8, per token: one scale per token and head (``decoding.quantize``);
* int8, smoothed: the key channels divided by ``decoding.channel_smoothing``'s factors first,
  the query multiplied by them (what ``KVCache`` and ``PagedKVCache`` do by default).

A measurement, not a test (tests/kernels/test_decoding.py holds the checks).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from attnlab.decoding import channel_smoothing, decode_attention, quantize


def errors(out: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs error, relative RMS error) of ``out`` against the float64 ``want``."""
    d = out.double() - want
    return d.abs().max().item(), (d.pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--outlier", type=float, default=20.0)
    args = p.parse_args()
    print("| cache | keys | max abs error | relative RMS error |\n|---|---|---|---|")
    for outlier in (True, False):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 32, 1, 128, generator=g)
        k, v = (torch.randn(1, 8, args.seq_len, 128, generator=g) for _ in range(2))
        if outlier:
            k[..., [5, 77]] *= args.outlier
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
        (k8, ks), (v8, vs) = quantize(k), quantize(v)
        lam = channel_smoothing(k)  # (1, 8, 128)
        k8s, kss = quantize(k / lam[..., None, :])
        rows = {
            "float32": decode_attention(q, k, v, enable_gqa=True),
            "bfloat16": decode_attention(q, k.bfloat16().float(), v.bfloat16().float(), enable_gqa=True),
            "int8, per token": decode_attention(q, k8, v8, enable_gqa=True, k_scale=ks, v_scale=vs),
            "int8, smoothed": decode_attention(q, k8s, v8, enable_gqa=True, k_scale=kss, v_scale=vs,
                                               k_channel_scale=lam),
        }
        keys = f"two outlier channels ({args.outlier:g}x)" if outlier else "Gaussian"
        for name, out in rows.items():
            top, rms = errors(out, want)
            print(f"| {name} | {keys} | {top:.1e} | {rms:.1e} |")


if __name__ == "__main__":
    main()
