"""``attnlab bench``: attnlab's attention timed against torch's SDPA backends."""

from __future__ import annotations

import argparse
import sys
import time

from attnlab.cli._args import DTYPES, UsageError, choices, ints, need_module, non_negative_int, output_file, \
    positive_float, positive_int

HELP = """\
Time attnlab's reference and tiled attention against torch SDPA's MATH and
FLASH_ATTENTION backends: forward and forward+backward, causal and not, per dtype,
over sequence lengths. Each configuration is warmed up, then the implementations are
timed in interleaved rounds; the median, GFLOP/s and the ratio to torch's fastest
backend in the same run are reported. Peak memory is measured with each
configuration in a fresh process. Configurations too big for --max-memory-gb are
skipped (the O(L^2) ones at long lengths). The first line of the output says whether
the tiled path ran its native C++ kernels or its pure-PyTorch code (ATTNLAB_NATIVE=0
forces the latter, to compare the two). Before it starts, it prints a rough estimate
of how long the run will take; a bar with the time left follows on a terminal.

The full default matrix takes a long time on a small machine; narrow it down:

examples:
  attnlab bench --seq-lens 4096 --impls tiled,flash --dtypes float32 --threads 2
  attnlab bench --seq-lens 1024,2048 --csv bench.csv --plot bench.png
  attnlab bench --seq-lens 4096 --impls tiled,flash --causal no --mask padding
  attnlab bench --ring --seq-lens 8192
  attnlab bench --ring --ring-masks causal,sliding,document --ring-layout zigzag --seq-lens 16384
  attnlab bench --decode --seq-lens 4096,32768 --dtypes float32,bfloat16
  attnlab bench --bf16 --repeats 3
  attnlab bench --block-mask --seq-lens 65536
"""

DEFAULT_LENS = [512, 1024, 2048, 4096, 8192, 16384]


def _mask_arg(text: str) -> str:
    from attnlab.bench import parse_mask

    try:
        return parse_mask(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="time attnlab's attention against torch's SDPA backends",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=ints(1), default=DEFAULT_LENS, metavar="L,...",
                   help="sequence lengths (L = S) (default: 512,1024,2048,4096,8192,16384)")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B", help="batch size (default: 1)")
    p.add_argument("--heads", type=positive_int, default=8, metavar="H", help="heads (default: 8)")
    p.add_argument("--dim", type=positive_int, default=64, metavar="E", help="head size (default: 64)")
    p.add_argument("--impls", type=choices(["reference", "tiled", "flex", "math", "flash", "torchflex"]),
                   default=["reference", "tiled", "math", "flash"], metavar="NAME,...",
                   help="reference,tiled,flex (attnlab), math,flash (torch SDPA backends), torchflex (torch's "
                        "flex_attention under torch.compile; forward only on the CPU, its compile time reported "
                        "apart) (default: all but flex and torchflex, which are for --mask variants)")
    p.add_argument("--modes", type=choices(["fwd", "fwd+bwd"]), default=["fwd", "fwd+bwd"], metavar="MODE,...",
                   help="fwd,fwd+bwd (default: both)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both", help="(default: both)")
    p.add_argument("--mask", type=_mask_arg, default="none", metavar="KIND",
                   help="padding: every implementation gets a (B, 1, 1, L) bool key-padding attn_mask hiding the "
                        "last L/4 keys. sliding:W, document:N, prefix:P, causal: an attention variant; the 'flex' "
                        "implementation (attnlab.flex) gets its block mask, the others the same mask as a dense "
                        "(L, L) bool tensor. Causal configurations are skipped with a mask (SDPA takes one or "
                        "the other) (default: none)")
    p.add_argument("--dtypes", type=choices(DTYPES), default=["float32", "bfloat16"], metavar="DTYPE,...",
                   help="(default: float32,bfloat16)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed runs per configuration (default: 5)")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed runs first (default: 1)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs (one process each)")
    p.add_argument("--max-memory-gb", type=positive_float, default=8.0,
                   help="skip configurations estimated to need more (default: 8)")
    p.add_argument("--csv", metavar="PATH", type=output_file(".csv"), help="write every result as CSV")
    p.add_argument("--plot", metavar="PATH", type=output_file(".png"),
                   help="write GFLOP/s against L as a PNG (needs matplotlib)")
    p.add_argument("--ring", action="store_true",
                   help="instead: ring attention, 2 ranks x 1 thread against 1 process x 2 threads, "
                        "forward+backward float32 (default lengths 8192,16384)")
    p.add_argument("--ring-layout", choices=["contiguous", "zigzag"], default="contiguous")
    p.add_argument("--ring-masks", type=choices(["causal", "sliding", "document"]), default=None, metavar="MASK,...",
                   help="with --ring: time the ring with these masks instead (causal, sliding: a window of L/8, "
                        "document: packed documents), 2 ranks, at the first --seq-lens L (default 16384)")
    p.add_argument("--transformers", action="store_true",
                   help="instead: forward+backward of small Hugging Face models, attn_implementation 'sdpa' "
                        "against 'attnlab': Llama-style (GQA) at L=1024 and Mistral-style (sliding window 1024) "
                        "at L=4096 (needs pip install 'attnlab[hf]')")
    p.add_argument("--decode", action="store_true",
                   help="instead: one decode step, q (1, 32, 1, 128) against a GQA cache (1, 8, S, 128), "
                        "attnlab against torch's SDPA, with GB/s of the cache's K/V (default S: 4096,32768; "
                        "--seq-lens sets them, --dtypes the dtypes)")
    p.add_argument("--bf16", action="store_true",
                   help="instead: bfloat16 causal attention at (1,8,4096,64), (2,16,2048,128) and (1,32,4096,128) "
                        "with 8 key/value heads, attnlab's bf16 route and fp32 route against torch's SDPA, fwd and "
                        "fwd+bwd (--modes narrows them)")
    p.add_argument("--block-mask", action="store_true",
                   help="instead: seconds and peak memory of building causal, sliding-window, document and prefix-LM "
                        "block masks at the first --seq-lens L (default 65536), attnlab's own mods and plain Python "
                        "mods against torch's compiled create_block_mask, each in a fresh process")
    p.add_argument("--density", action="store_true",
                   help="instead: attnlab.flex's time against its block mask's density d (0.5, 0.25, 0.1, 0.05), "
                        "relative to d x its time on full attention, at the first --seq-lens L (default 8192), "
                        "float32; band masks of whole blocks and sliding windows (partial diagonal blocks)")
    p.set_defaults(func=run)
    return p


def _progress():
    """A progress callback drawing a bar with the time left, on a terminal only."""
    started = time.perf_counter()
    width = 30

    def progress(done: int, total: int, text: str) -> None:
        if not sys.stderr.isatty():
            return
        filled = int(width * done / max(total, 1))
        elapsed = time.perf_counter() - started
        left = f" ~{elapsed / done * (total - done):.0f} s left" if done else ""
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}{left} {text:<45}", end="", file=sys.stderr,
              flush=True)

    return progress


def _end_progress() -> None:
    if sys.stderr.isatty():
        print(file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.plot:
        need_module("matplotlib", "bench", "--plot")  # before the run, not after it
    if args.transformers:
        need_module("transformers", "hf", "--transformers")
    import torch

    from attnlab import bench

    if args.threads:
        torch.set_num_threads(args.threads)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.ring and args.ring_masks:
        L = args.seq_lens[0] if args.seq_lens != DEFAULT_LENS else 16384
        print(f"machine: {bench.machine_line()}\n")
        print(bench.RING_MASK_HEADER + "\n")
        rows = bench.ring_masks_benchmark(L, args.ring_masks, B=args.batch, H=args.heads, E=args.dim,
                                          layout=args.ring_layout)
        print(bench.ring_masks_table(rows))
        return 0
    if args.ring:
        lens = args.seq_lens if args.seq_lens != DEFAULT_LENS else [8192, 16384]
        print(f"machine: {bench.machine_line()}\n")
        print(bench.RING_HEADER)
        for causal in causals:
            rows = bench.ring_benchmark(lens, B=args.batch, H=args.heads, E=args.dim, causal=causal,
                                        layout=args.ring_layout)
            print("\n".join(bench.ring_table(rows, causal)), flush=True)
        return 0
    if args.transformers:
        rows = bench.transformers_benchmark(repeats=args.repeats, B=args.batch, progress=_progress())
        _end_progress()
        print(f"machine: {bench.machine_line()}\n")
        print(bench.transformers_table(rows))
        return 0
    if args.decode:
        lens = args.seq_lens if args.seq_lens != DEFAULT_LENS else [4096, 32768]
        rows = bench.decode_benchmark(lens, dtypes=args.dtypes, B=args.batch, repeats=args.repeats,
                                      progress=_progress())
        _end_progress()
        print(f"machine: {bench.machine_line()}\n")
        print(bench.DECODE_HEADER + "\n")
        print(bench.decode_table(rows))
        return 0
    if args.block_mask:
        L = args.seq_lens[0] if args.seq_lens != DEFAULT_LENS else 65536
        rows = bench.block_mask_benchmark(L, progress=_progress())
        _end_progress()
        print(f"machine: {bench.machine_line()}\n")
        print(bench.BLOCK_MASK_HEADER + "\n")
        print(bench.block_mask_table(rows))
        return 0
    if args.bf16:
        rows = bench.bf16_benchmark(modes=args.modes, repeats=args.repeats, progress=_progress())
        _end_progress()
        print(f"machine: {bench.machine_line()}\n")
        print(bench.BF16_HEADER + "\n")
        print(bench.bf16_table(rows))
        return 0
    if args.density:
        L = args.seq_lens[0] if args.seq_lens != DEFAULT_LENS else 8192
        rows = bench.density_sweep(L, B=args.batch, H=args.heads, E=args.dim, repeats=args.repeats,
                                   modes=args.modes, progress=_progress())
        _end_progress()
        print(f"machine: {bench.machine_line()}\n")
        print(bench.density_table(rows, L, args.batch, args.heads, args.dim))
        return 0

    options = dict(B=args.batch, H=args.heads, E=args.dim, repeats=args.repeats, warmup=args.warmup,
                   memory=not args.no_memory, max_memory_gb=args.max_memory_gb, mask=args.mask)
    estimate = bench.estimate_seconds(args.seq_lens, args.impls, args.modes, causals, args.dtypes, **options)
    print(f"estimated duration: about {bench.format_duration(estimate)} (a rough guess from each configuration's "
          f"FLOPs; narrow --seq-lens, --impls or --dtypes to shorten it)", file=sys.stderr, flush=True)
    results = bench.run_benchmarks(args.seq_lens, args.impls, args.modes, causals, args.dtypes,
                                   progress=_progress(), **options)
    _end_progress()
    print(f"machine: {bench.machine_line()}\n")
    print(bench.markdown_table(results))
    if args.csv:
        bench.write_csv(results, args.csv)
        print(f"\nCSV written to {args.csv}")
    if args.plot:
        try:
            bench.plot(results, args.plot)
        except RuntimeError as exc:
            raise UsageError(str(exc)) from None
        print(f"plot written to {args.plot}")
    return 0
