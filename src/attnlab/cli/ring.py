"""``attnlab ring``: ring (sequence-parallel) attention over local ranks, checked against one process."""

from __future__ import annotations

import argparse

from attnlab.cli._args import UsageError, positive_int

HELP = """\
Spawn --world ranks on 127.0.0.1 (torch.distributed, gloo), run ring attention
forward+backward on a sharded sequence, check outputs and gradients against one
process (on rank 0), and print time, per-rank peak extra memory and bytes sent.

examples:
  attnlab ring
  attnlab ring --world 4 --seq-len 16384 --causal --layout zigzag
  attnlab ring --heads 8 --kv-heads 2 --causal
"""


def add(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("ring", help="run ring (sequence-parallel) attention over local ranks and check it",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=positive_int, default=2, help="ranks (default: 2)")
    p.add_argument("--seq-len", type=positive_int, default=4096, help="full sequence length L (default: 4096)")
    p.add_argument("--batch", type=positive_int, default=1, help="B (default: 1)")
    p.add_argument("--heads", type=positive_int, default=8, help="H (default: 8)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="Hkv for GQA (default: H)")
    p.add_argument("--dim", type=positive_int, default=64, help="E (default: 64)")
    p.add_argument("--causal", action="store_true", help="causal over the whole sequence")
    p.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default: 1)")
    p.add_argument("--no-check", action="store_true", help="skip the single-process check on rank 0")
    p.set_defaults(func=run)
    return p


# More ranks than this on one machine only measure the scheduler (each rank is a process).
MAX_LOCAL_WORLD = 64


def run(args: argparse.Namespace) -> int:
    parts = args.world if args.layout == "contiguous" else 2 * args.world
    if args.world > MAX_LOCAL_WORLD:
        raise UsageError(f"--world {args.world}: at most {MAX_LOCAL_WORLD} local ranks (each one is a process)")
    if args.seq_len % parts:
        raise UsageError(f"--seq-len {args.seq_len} does not split into {parts} equal parts ({args.layout}); "
                         f"use a multiple of {parts}")
    kv = args.kv_heads or args.heads
    if args.heads % kv:
        raise UsageError(f"--kv-heads {kv} must divide --heads {args.heads} (grouped-query attention)")
    need = 12 * args.batch * args.heads * args.seq_len * args.dim * 4  # q, k, v, out and grads, float32, one process
    if need > 8 * 2**30:
        raise UsageError(f"--batch {args.batch} --heads {args.heads} --seq-len {args.seq_len} --dim {args.dim} would "
                         f"need ~{need / 2**30:.0f} GiB in the checking process; choose smaller sizes")
    from attnlab.bench.ranks import run_ring

    cfg = dict(B=args.batch, H=args.heads, Hkv=kv, L=args.seq_len, E=args.dim, causal=args.causal,
               layout=args.layout, threads=args.threads, check=not args.no_check, timeout=600)
    print(f"ring attention: {args.world} ranks (gloo, 127.0.0.1), L={args.seq_len}, B={args.batch}, "
          f"H={args.heads}, E={args.dim}, {'causal' if args.causal else 'not causal'}, {args.layout}", flush=True)
    reports = run_ring(args.world, cfg, timeout_s=3600, fresh=True)  # it reports each rank's peak memory
    failed = [r for r in reports if "error" in r]
    for r in reports:
        if "error" in r:
            print(f"  rank {r['rank']}: FAILED: {r['error']}")
        else:
            print(f"  rank {r['rank']}: {r['time_s']:.2f} s forward+backward, peak +{r['peak_extra_bytes'] / 2**20:.1f} "
                  f"MiB, sent {r['bytes_sent'] / 2**20:.1f} MiB, waited on messages {r['comm_wait_s']:.2f} s "
                  f"({100 * r['comm_wait_s'] / r['time_s']:.1f}%)")
    diffs = next((r["max_abs_diff"] for r in reports if "max_abs_diff" in r), None)
    if diffs:
        print("  max |ring - one process|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    return 1 if failed else 0
