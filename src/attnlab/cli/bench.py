"""``attnlab bench``: attnlab's attention timed against torch's SDPA backends."""

from __future__ import annotations

import argparse
import sys
import time

from attnlab.cli._args import DTYPES, UsageError, choices, ints, need_module, non_negative_int, output_file, \
    positive_float, positive_int

HELP = """\
Time attnlab vs torch's SDPA, or a suite below (docs/cli.md, BENCHMARKS.md); examples:
  attnlab bench --seq-lens 4096 --impls tiled,flash --dtypes float32 --threads 2
  attnlab bench --decode --seq-lens 4096,32768 --dtypes float32,bfloat16
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
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="attnlab bench [options]")
    p.add_argument("--seq-lens", type=ints(1), default=DEFAULT_LENS, metavar="L,...",
                   help="sequence lengths L = S (default: 512,...,16384)")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B", help="batch size (default: 1)")
    p.add_argument("--heads", type=positive_int, default=8, metavar="H", help="heads (default: 8)")
    p.add_argument("--dim", type=positive_int, default=64, metavar="E", help="head size (default: 64)")
    p.add_argument("--impls", type=choices(["reference", "tiled", "sinks", "flex", "math", "flash", "torchflex"]),
                   default=["reference", "tiled", "math", "flash"], metavar="NAME,...",
                   help="reference,tiled,sinks,flex,math,flash,torchflex")
    p.add_argument("--modes", type=choices(["fwd", "fwd+bwd"]), default=["fwd", "fwd+bwd"], metavar="MODE,...",
                   help="fwd,fwd+bwd (default: both)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both", metavar="WHICH",
                   help="both, yes or no (default: both)")
    p.add_argument("--mask", type=_mask_arg, default="none", metavar="KIND",
                   help="none, padding, sliding:W, document:N, prefix:P, causal")
    p.add_argument("--dtypes", type=choices(DTYPES), default=["float32", "bfloat16"], metavar="DTYPE,...",
                   help="(default: float32,bfloat16)")
    p.add_argument("--repeats", type=positive_int, default=5, metavar="N", help="timed runs per configuration (default: 5)")
    p.add_argument("--warmup", type=non_negative_int, default=1, metavar="N", help="untimed runs first (default: 1)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N", help="torch threads (default: torch's choice)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    p.add_argument("--max-memory-gb", type=positive_float, default=8.0, metavar="GB",
                   help="skip what needs more (default: 8)")
    p.add_argument("--csv", metavar="PATH", type=output_file(".csv"), help="write every result as CSV")
    p.add_argument("--plot", metavar="PATH", type=output_file(".png"),
                   help="GFLOP/s against L as a PNG (matplotlib)")
    p.add_argument("--ring", action="store_true",
                   help="instead: ring attention, 2 ranks against 1 process")
    p.add_argument("--cp", action="store_true",
                   help="instead: ring, Ulysses, USP on 2, 4 ranks; bytes sent")
    p.add_argument("--ring-layout", choices=["contiguous", "zigzag"], default="contiguous", metavar="LAYOUT",
                   help="with --ring: contiguous or zigzag")
    p.add_argument("--ring-masks", type=choices(["causal", "sliding", "document"]), default=None, metavar="M,...",
                   help="with --ring: causal,sliding,document")
    p.add_argument("--transformers", action="store_true",
                   help="instead: small Hugging Face models, sdpa vs attnlab")
    p.add_argument("--generate", action="store_true",
                   help="instead: HF generation per token, sdpa vs attnlab")
    p.add_argument("--compile", action="store_true",
                   help="instead: a model step, eager vs torch.compile")
    p.add_argument("--decode", action="store_true",
                   help="instead: one decode step against a GQA cache, GB/s")
    p.add_argument("--lq", type=positive_int, default=1, metavar="N", help="with --decode: query rows (default: 1)")
    p.add_argument("--gemm", action="store_true",
                   help="instead: float32 GEMM routes against the FMA peak")
    p.add_argument("--peers", action="store_true",
                   help="instead: OpenVINO and ONNX Runtime attention, fwd")
    p.add_argument("--bf16", action="store_true",
                   help="instead: bfloat16 routes against torch's bf16")
    p.add_argument("--block-mask", action="store_true",
                   help="instead: building block masks, time and memory")
    p.add_argument("--density", action="store_true",
                   help="instead: flex's time against its mask's density")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", metavar="D",
                   help="cuda: attnlab.triton vs torch flash and flex, on a GPU")
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


def _run_gpu(args: argparse.Namespace, causals: list[bool]) -> int:
    import torch

    from attnlab.bench import gpu

    why = gpu.why_no_gpu()
    if why:
        raise UsageError(f"--device cuda: {why}")
    lens = args.seq_lens if args.seq_lens != DEFAULT_LENS else [1024, 4096, 16384]
    dtypes = [d for d in args.dtypes if d in ("bfloat16", "float16")] or ["bfloat16", "float16"]
    rows = gpu.gpu_benchmark(lens, dtypes=dtypes, modes=args.modes, causals=causals, B=args.batch, H=args.heads,
                             E=args.dim, repeats=args.repeats, progress=_progress())
    _end_progress()
    print(gpu.GPU_HEADER + "\n")
    print(gpu.gpu_table(rows, torch.cuda.get_device_name()))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.plot:
        need_module("matplotlib", "bench", "--plot")  # before the run, not after it
    if args.transformers or args.generate:
        need_module("transformers", "hf", "--generate" if args.generate else "--transformers")
    import torch

    from attnlab import bench

    if args.threads:
        torch.set_num_threads(args.threads)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.device == "cuda":
        return _run_gpu(args, causals)
    if args.cp:
        from attnlab.bench import cp

        L = args.seq_lens[0] if args.seq_lens != DEFAULT_LENS else 4096
        rows = cp.cp_benchmark(L, B=args.batch, H=args.heads, Hkv=args.heads, E=args.dim, progress=_progress())
        _end_progress()
        print(f"machine: {bench.machine_line()}\n\n{cp.CP_HEADER}\n")
        print(cp.cp_table(rows))
        return 0
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
    if args.generate:
        lens = args.seq_lens if args.seq_lens != DEFAULT_LENS else list(bench.GENERATE_LENS)
        rows = bench.generation_benchmark(lens, repeats=args.repeats if args.repeats != 5 else 2,
                                          progress=_progress())
        _end_progress()
        print(f"machine: {bench.machine_line()}\n")
        print(bench.GENERATE_HEADER + "\n")
        print(bench.generation_table(rows))
        return 0
    if args.compile:
        lens = args.seq_lens if args.seq_lens != DEFAULT_LENS else list(bench.COMPILE_LENS)
        rows = bench.compile_benchmark(lens, B=args.batch, repeats=args.repeats, progress=_progress())
        _end_progress()
        print(f"machine: {bench.machine_line()}\n")
        print(bench.COMPILE_HEADER + "\n")
        print(bench.compile_table(rows))
        return 0
    if args.decode:
        lens = args.seq_lens if args.seq_lens != DEFAULT_LENS else [4096, 32768]
        rows = bench.decode_benchmark(lens, dtypes=args.dtypes, B=args.batch, repeats=args.repeats, L=args.lq,
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
    if args.gemm:
        L = args.seq_lens[0] if args.seq_lens != DEFAULT_LENS else 4096
        result = bench.gemm_benchmark(E=args.dim, L=L, H=args.heads, repeats=args.repeats, progress=_progress())
        _end_progress()
        print(f"machine: {bench.machine_line()}\n")
        print(bench.GEMM_HEADER + "\n")
        print(bench.gemm_table(result))
        return 0
    if args.peers:
        missing = bench.missing_peers()
        if len(missing) == len(bench.PEERS):
            raise UsageError("--peers needs OpenVINO or ONNX Runtime, and neither is installed here: "
                             "pip install 'attnlab[peers]'")
        lens = args.seq_lens if args.seq_lens != DEFAULT_LENS else [4096]
        result = bench.peers_benchmark(lens, B=args.batch, H=args.heads, E=args.dim, causals=causals,
                                       repeats=args.repeats, progress=_progress())
        _end_progress()
        print(f"machine: {bench.machine_line()}\n")
        print(bench.PEERS_HEADER + "\n")
        print(bench.peers_table(result))
        return 0
    if args.bf16:
        rows = bench.bf16_benchmark(modes=args.modes, repeats=args.repeats, progress=_progress(),
                                    causals={"both": (True, False), "yes": (True,), "no": (False,)}[args.causal])
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
    print(bench.markdown_table(results, bench.peaks_for(args.dtypes), threads=torch.get_num_threads()))
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
