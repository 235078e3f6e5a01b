"""The fixed cost of one decode call: ``decode_attention`` on a cache so short that the arithmetic is small.

    .venv/bin/python benchmarks/decode_call_cost.py [--keys 16] [--calls 2000] [--rounds 7]

q (1, 32, Lq = 4, 128) against a GQA cache of 8 key/value heads and ``--keys`` keys, float32 and
bfloat16, on 2 threads: the wall time of one call, as the mean over ``--calls`` calls in a loop,
the best and the median of ``--rounds`` rounds (issue 49 measures its "fixed cost per call" this
way). torch's SDPA on the same tensors is timed in the same rounds, interleaved. To compare two
versions of attnlab, run the script with each on ``PYTHONPATH``, alternated. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from attnlab.decoding import decode_attention


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=16)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, q (1, 32, 4, 128), "
          f"cache (1, 8, {args.keys}, 128), {args.calls} calls a round, {args.rounds} rounds")
    print("| dtype | attnlab us a call (best, median) | torch SDPA us a call (best, median) |")
    print("|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 32, 4, 128, generator=g).to(dtype)  # (B, H, Lq, E)
        k, v = (torch.randn(1, 8, args.keys, 128, generator=g).to(dtype) for _ in range(2))  # (B, Hkv, S, E)
        ours = lambda: decode_attention(q, k, v, enable_gqa=True)  # noqa: E731
        theirs = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        for fn in (ours, theirs):
            _per_call_us(fn, 50)  # warm: the library loaded, the allocator's pools filled
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for _ in range(args.rounds):
            times["ours"].append(_per_call_us(ours, args.calls))
            times["theirs"].append(_per_call_us(theirs, args.calls))
        cells = [f"{min(t):.1f}, {statistics.median(t):.1f}" for t in (times["ours"], times["theirs"])]
        print(f"| {str(dtype).removeprefix('torch.')} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
