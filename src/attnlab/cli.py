"""The ``attnlab`` command line: ``attnlab <command> --help`` explains each command."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import attnlab

EXAMPLE_HELP = """\
Reproduce the lesson's worked example: draw X, W_Q, W_K, W_V with the given seed,
run attnlab's from-scratch self-attention step by step, print every intermediate
tensor with its name and shape (projections, scores, max-shifted scores, weights,
output), then check the output against torch's own scaled_dot_product_attention
(MATH backend) and print the largest absolute difference.

With the defaults (seed 42, B=1, T=4, d=8, d_k=d_v=4, float32) the numbers are the
lesson's, which it rounds to 4 decimals.

examples:
  attnlab example
  attnlab example --causal --seq-len 6
  attnlab example --json > example.json
"""


DOCTOR_HELP = """\
Call an attention function on designed inputs (unequal sizes, large scores, bool and
float masks, causal with L != S, fully masked rows, dropout) and compare it with
torch's SDPA. When it is wrong, name the mistake, most likely first, with a hint:

  missing_scale  wrong_scale  unstable_softmax  softmax_dim  wrong_transpose
  value_swapped  mask_polarity  mask_after_softmax  causal_alignment
  fully_masked_nan  dropout_scale  shape_error  unknown

The function must take torch SDPA's signature:
  fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None)
(or the lab's self_attention signature, with --self-attention).
It runs in this process: only check code you trust (graders use 'attnlab grade').

exit status: 0 no problem found, 1 problems found, 2 the function could not be loaded.

examples:
  attnlab doctor mypkg.attention:sdpa
  attnlab doctor labs/track1/01-attention/attention.py:self_attention --self-attention --json
"""


GRADE_HELP = """\
Grade a learner's file for one of the labs in labs/track1/ (attnlab labs lists them;
the lab comes from the file's folder or name, --lab overrides).

Safety. Learner code never runs inside the grader. Where bubblewrap ('bwrap') is
installed, each submission gets its own OS sandbox: no network, its own process
namespace (everything it starts dies when its grading ends), a read-only view of
the system and Python and nothing else of this machine (not your home folder, not
the output folder, not other submissions, not the solutions), a private size-capped
/tmp, and, where a cgroup can be made, one memory and process cap for the whole
submission. Inside it each exercise runs in its own child process with a time limit,
a memory limit, a cap on printed output and an empty working folder.

Without bwrap (macOS, some containers): grading your OWN file still runs, with the
process limits only, and says so once. Grading someone else's code (--untrusted)
refuses to run without the sandbox unless you also pass --no-sandbox. Get bwrap with
'sudo apt-get install bubblewrap' (Debian/Ubuntu) or 'sudo dnf install bubblewrap'.

The from-scratch rule is checked twice: on the file's text before anything runs
(imports only from torch, math, typing, jaxtyping; no eval/exec/open/__import__,
no dunder or private attributes; no softmax, SDPA or nn.MultiheadAttention outside
compare_with_sdpa; a violation costs the exercises that reach it, with the line),
and by call recorders while it runs. Inputs come from a seed drawn per run (printed,
and stored in results.json); --seed reproduces a run. The reference is computed here,
in float64. results.json is written atomically, before the first exercise and after
each one, so even an interrupted run leaves a valid file.

A failed check says why, and names the mistake when it recognises one
(e.g. "you forgot the 1/sqrt(d_k) scale").

A whole class: 'attnlab grade DIR --out OUTDIR [--jobs N]'. DIR holds one submission
per learner, as DIR/<learner>/attention.py or DIR/<learner>.py; anything else (hidden
entries, symbolic links, other files, folders without attention.py, a learner present
twice) is skipped and listed with the reason. Each submission gets its own sandbox
(bwrap is required; --no-sandbox overrides), N at a time, forked from one template that
imports torch once (its own user, mount, pid, network and IPC namespaces, /tmp and
cgroup: as isolated as a bwrap of its own, and ~3x faster: 100 submissions in ~70 s on
2 cores); where nested user namespaces are not allowed it falls back to one bwrap per
submission (ATTNLAB_TEMPLATE=0 forces that) and the summary says so. OUTDIR gets grades.csv (one
row per learner: total, points per exercise, named mistakes, seed, seconds, status),
<learner>/results.json (Gradescope's schema), report.html (score distribution, pass
rate per exercise, the class's mistakes ranked, the slowest submissions) and
skipped.txt. --seed N gives the same grades on every rerun; --resume skips learners
an earlier run finished. 'attnlab autograder --out autograder.zip' packs the same
grader for Gradescope.

exit status: 0 full marks, 1 some checks failed, 2 bad arguments, no sandbox for
untrusted code, or a module the lab needs (jaxtyping) missing here, 130 interrupted.

examples:
  attnlab grade
  attnlab grade my_attention.py --json results.json
  attnlab grade student/attention.py --untrusted --json results.json --seed 7
"""


BENCH_HELP = """\
Time attnlab's reference and tiled attention against torch SDPA's MATH and
FLASH_ATTENTION backends: forward and forward+backward, causal and not, per dtype,
over sequence lengths. Each configuration is warmed up, then the implementations are
timed in interleaved rounds; the median, GFLOP/s and the ratio to torch's fastest
backend in the same run are reported. Peak memory is measured with each
configuration in a fresh process. Configurations too big for --max-memory-gb are
skipped (the O(L^2) ones at long lengths). The first line of the output says whether
the tiled path ran its native C++ kernels or its pure-PyTorch code (ATTNLAB_NATIVE=0
forces the latter, to compare the two).

The full default matrix takes a long time on a small machine; narrow it down:

examples:
  attnlab bench --seq-lens 4096 --impls tiled,flash --dtypes float32 --threads 2
  attnlab bench --csv bench.csv --plot bench.png
  attnlab bench --seq-lens 4096 --impls tiled,flash --causal no --mask padding
"""


def _ints(min_value: int):
    """An argparse type: comma-separated integers, each >= min_value."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values or min(values) < min_value:
            raise argparse.ArgumentTypeError(f"expected integers >= {min_value}, got {text!r}")
        return values

    return parse


_int_list = _ints(1)
_lengths_list = _ints(0)


def _choices(allowed):
    allowed = list(allowed)

    def parse(text: str) -> list[str]:
        values = [x for x in text.split(",") if x]
        bad = [x for x in values if x not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or text!r}: choose from {','.join(allowed)}")
        return values

    return parse


def _load_function(target: str):
    """'pkg.mod:fn' or 'path/to/file.py:fn' -> the function."""
    import importlib
    import importlib.util
    from pathlib import Path

    module_name, sep, func_name = target.rpartition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"expected MODULE:FUNCTION (e.g. mypkg.attn:sdpa), got {target!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"cannot import {module_name}: no such file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # like `python -m`: modules beside you import
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import {module_name}: {exc}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no function {func_name!r}")
    return fn


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


DTYPES = ["float32", "float64", "float16", "bfloat16"]  # attnlab.example.DTYPES, without importing torch


def _add_example_options(p: argparse.ArgumentParser) -> None:
    """The worked example's options, shared by `example`, `plot example` and `explain`."""
    p.add_argument("--seed", type=int, default=42, help="random seed for X and the weights (default: 42)")
    p.add_argument("--batch", type=_positive_int, default=1, metavar="B", help="batch size B (default: 1)")
    p.add_argument("--seq-len", type=_positive_int, default=4, metavar="T", help="sequence length T (default: 4)")
    p.add_argument("--d-model", type=_positive_int, default=8, metavar="d", help="embedding size d (default: 8)")
    p.add_argument("--d-k", type=_positive_int, default=4, help="query/key size d_k (default: 4)")
    p.add_argument("--d-v", type=_positive_int, default=4, help="value size d_v (default: 4)")
    p.add_argument("--causal", action="store_true", help="apply a causal mask (position i sees 0..i)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="compute dtype (default: float32)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Learn, check and run self-attention, built from scratch and verified against PyTorch.",
        epilog="Run 'attnlab <command> --help' for the options of each command.",
    )
    parser.add_argument("--version", action="version", version=f"attnlab {attnlab.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")

    ex = sub.add_parser("example", help="print the lesson's worked example, step by step, and its parity with torch",
                        description=EXAMPLE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_example_options(ex)
    ex.add_argument("--json", action="store_true",
                    help="print one JSON object instead: keys X, Q, K, V, scores, scores_shifted, weights, "
                         "output (nested lists; -inf as the string \"-Infinity\"), config, max_abs_diff_vs_sdpa")
    ex.set_defaults(func=_cmd_example)

    doc = sub.add_parser("doctor", help="probe your attention function and name what is wrong with it",
                         description=DOCTOR_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    doc.add_argument("target", metavar="MODULE:FUNCTION",
                     help="the function to check, e.g. mypkg.attn:sdpa or path/to/file.py:my_attention")
    doc.add_argument("--self-attention", action="store_true",
                     help="the function has the lab's signature self_attention(X, W_Q, W_K, W_V, mask=None)")
    doc.add_argument("--json", action="store_true",
                     help='print {"ok": ..., "max_abs_error": ..., "findings": [{"code": ..., "message": ...}]}')
    doc.set_defaults(func=_cmd_doctor)

    gr = sub.add_parser("grade", help="grade a lab submission safely and explain each failed check",
                        description=GRADE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    gr.add_argument("path", nargs="?", default=None,
                    help="the learner's attention.py (default: labs/track1/01-attention/attention.py), or a folder "
                         "of submissions (a class: needs --out)")
    gr.add_argument("--lab", metavar="NAME", default=None,
                    help="which lab's checks (e.g. 02-masks or 02; default: from the file's folder or name, "
                         "else 01-attention; see 'attnlab labs')")
    gr.add_argument("--out", metavar="OUTDIR", default=None,
                    help="with a folder: where grades.csv, report.html and <learner>/results.json go")
    gr.add_argument("--jobs", type=_positive_int, default=2, metavar="N",
                    help="with a folder: submissions graded at once (default: 2)")
    gr.add_argument("--resume", action="store_true",
                    help="with a folder: keep the learners an earlier run into --out finished")
    gr.add_argument("--json", metavar="RESULTS_JSON", default=None,
                    help="also write Gradescope's results.json to this path ('-' for stdout, no text report)")
    gr.add_argument("--timeout", type=float, default=5.0, metavar="S", help="time limit per exercise (default: 5)")
    gr.add_argument("--total-timeout", type=float, default=60.0, metavar="S",
                    help="time limit for the whole file (default: 60)")
    gr.add_argument("--memory-mb", type=_positive_int, default=1024, metavar="MB",
                    help="memory an exercise may allocate (default: 1024)")
    gr.add_argument("--no-colour", "--no-color", action="store_true", help="plain text even on a terminal")
    gr.add_argument("--images", default="attnlab-grade-images", metavar="DIR",
                    help="where to save a yours/reference/difference picture for each failed numeric check "
                         "(default: ./attnlab-grade-images; needs matplotlib)")
    gr.add_argument("--no-images", action="store_true", help="save no pictures")
    gr.add_argument("--seed", type=int, default=None, metavar="N",
                    help="seed of the inputs (default: drawn per run and printed; pass it to reproduce a run)")
    gr.add_argument("--untrusted", action="store_true",
                    help="the file is someone else's: refuse to run it without the bwrap OS sandbox")
    gr.add_argument("--no-sandbox", action="store_true",
                    help="run without the OS sandbox, with process limits only (trusted code, or no bwrap here)")
    gr.set_defaults(func=_cmd_grade)

    la = sub.add_parser("labs", help="list the labs, or copy one to start it: attnlab labs get 01",
                        description="List the labs of track 1 and what each covers; 'attnlab labs get NAME [DIR]' "
                                    "copies a lab's brief, stubs and walkthrough (never its solutions) into DIR "
                                    "(default ./NAME), so you can start from 'pip install attnlab' alone.")
    la_sub = la.add_subparsers(dest="labs_command")
    lg = la_sub.add_parser("get", help="copy a lab's brief, stubs and walkthrough into a folder")
    lg.add_argument("name", help="the lab's name or number (e.g. 01-attention or 01)")
    lg.add_argument("dir", nargs="?", default=None, help="where to put it (default: ./NAME)")
    la.set_defaults(func=_cmd_labs)

    ag = sub.add_parser("autograder", help="pack the grader as a Gradescope autograder zip",
                        description="Write a Gradescope autograder bundle: setup.sh (installs bubblewrap, CPU-only "
                                    "torch and this attnlab from its wheel into /autograder/venv), run_autograder "
                                    "(grades /autograder/submission/attention.py into "
                                    "/autograder/results/results.json), pinned requirements.txt and the wheel.")
    ag.add_argument("--out", required=True, metavar="ZIP", help="the zip to write, e.g. autograder.zip")
    ag.add_argument("--wheel", default=None, metavar="WHL",
                    help="the attnlab wheel to bundle (default: built from this source checkout)")
    ag.set_defaults(func=_cmd_autograder)

    be = sub.add_parser("bench", help="time attnlab's attention against torch's SDPA backends",
                        description=BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    be.add_argument("--seq-lens", type=_int_list, default=[512, 1024, 2048, 4096, 8192, 16384], metavar="L,...",
                    help="sequence lengths (L = S) (default: 512,1024,2048,4096,8192,16384)")
    be.add_argument("--batch", type=_positive_int, default=1, metavar="B", help="batch size (default: 1)")
    be.add_argument("--heads", type=_positive_int, default=8, metavar="H", help="heads (default: 8)")
    be.add_argument("--dim", type=_positive_int, default=64, metavar="E", help="head size (default: 64)")
    be.add_argument("--impls", type=_choices(["reference", "tiled", "flex", "math", "flash", "torchflex"]),
                    default=["reference", "tiled", "math", "flash"], metavar="NAME,...",
                    help="reference,tiled,flex (attnlab), math,flash (torch SDPA backends), torchflex (torch's "
                         "flex_attention under torch.compile; forward only on the CPU, its compile time reported "
                         "apart) (default: all but flex and torchflex, which are for --mask variants)")
    be.add_argument("--modes", type=_choices(["fwd", "fwd+bwd"]), default=["fwd", "fwd+bwd"], metavar="MODE,...",
                    help="fwd,fwd+bwd (default: both)")
    be.add_argument("--causal", choices=["both", "yes", "no"], default="both", help="(default: both)")
    be.add_argument("--mask", type=_mask_arg, default="none", metavar="KIND",
                    help="padding: every implementation gets a (B, 1, 1, L) bool key-padding attn_mask hiding the "
                         "last L/4 keys. sliding:W, document:N, prefix:P, causal: an attention variant; the 'flex' "
                         "implementation (attnlab.flex) gets its block mask, the others the same mask as a dense "
                         "(L, L) bool tensor. Causal configurations are skipped with a mask (SDPA takes one or "
                         "the other) (default: none)")
    be.add_argument("--dtypes", type=_choices(DTYPES), default=["float32", "bfloat16"], metavar="DTYPE,...",
                    help="(default: float32,bfloat16)")
    be.add_argument("--repeats", type=_positive_int, default=5, help="timed runs per configuration (default: 5)")
    be.add_argument("--warmup", type=int, default=1, help="untimed runs first (default: 1)")
    be.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's choice)")
    be.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs (one process each)")
    be.add_argument("--max-memory-gb", type=float, default=8.0,
                    help="skip configurations estimated to need more (default: 8)")
    be.add_argument("--csv", metavar="PATH", help="write every result as CSV")
    be.add_argument("--plot", metavar="PATH", help="write GFLOP/s against L as a PNG (needs matplotlib)")
    be.add_argument("--ring", action="store_true",
                    help="instead: ring attention, 2 ranks x 1 thread against 1 process x 2 threads, "
                         "forward+backward float32 (default lengths 8192,16384)")
    be.add_argument("--ring-layout", choices=["contiguous", "zigzag"], default="contiguous")
    be.add_argument("--transformers", action="store_true",
                    help="instead: forward+backward of small Hugging Face models, attn_implementation 'sdpa' "
                         "against 'attnlab': Llama-style (GQA) at L=1024 and Mistral-style (sliding window 1024) "
                         "at L=4096 (needs pip install 'attnlab[hf]')")
    be.add_argument("--density", action="store_true",
                    help="instead: attnlab.flex's time against its block mask's density d (0.5, 0.25, 0.1, 0.05), "
                         "relative to d x its time on full attention, at the first --seq-lens L (default 8192), "
                         "float32; band masks of whole blocks and sliding windows (partial diagonal blocks)")
    be.set_defaults(func=_cmd_bench)

    pl = sub.add_parser("plot", help="draw the worked example's four panels to a PNG or SVG",
                        description="Draw the lesson's four panels (X -> Q, K, V; scores with the mask; weights; "
                                    "output) with the real numbers of a run. Needs matplotlib.",
                        epilog="example:\n  attnlab plot example --out steps.png --causal",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    pl.add_argument("what", choices=["example"], help="what to draw")
    pl.add_argument("--out", required=True, help="output file, .png or .svg")
    _add_example_options(pl)
    pl.set_defaults(func=_cmd_plot)

    exp = sub.add_parser("explain", help="write one offline HTML page that walks through the worked example",
                         description="Write a self-contained HTML page (inline CSS, JS and SVG; nothing is fetched) "
                                     "with each step's matrix, heatmap, shape and a text equivalent, and a "
                                     "checkbox for the causal mask. Up to 64 positions (a warning above).",
                         epilog="example:\n  attnlab explain --out explain.html",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    exp.add_argument("--out", required=True, help="the HTML file to write")
    _add_example_options(exp)
    exp.set_defaults(func=_cmd_explain)

    ri = sub.add_parser("ring", help="run ring (sequence-parallel) attention over local ranks and check it",
                        description="Spawn --world ranks on 127.0.0.1 (torch.distributed, gloo), run ring attention "
                                    "forward+backward on a sharded sequence, check outputs and gradients against "
                                    "one process (on rank 0), and print time, per-rank peak extra memory and bytes "
                                    "sent.",
                        epilog="example:\n  attnlab ring --world 4 --seq-len 16384 --causal --layout zigzag",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ri.add_argument("--world", type=_positive_int, default=2, help="ranks (default: 2)")
    ri.add_argument("--seq-len", type=_positive_int, default=4096, help="full sequence length L (default: 4096)")
    ri.add_argument("--batch", type=_positive_int, default=1, help="B (default: 1)")
    ri.add_argument("--heads", type=_positive_int, default=8, help="H (default: 8)")
    ri.add_argument("--kv-heads", type=_positive_int, default=None, help="Hkv for GQA (default: H)")
    ri.add_argument("--dim", type=_positive_int, default=64, help="E (default: 64)")
    ri.add_argument("--causal", action="store_true", help="causal over the whole sequence")
    ri.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous")
    ri.add_argument("--threads", type=_positive_int, default=1, help="torch threads per rank (default: 1)")
    ri.add_argument("--no-check", action="store_true", help="skip the single-process check on rank 0")
    ri.set_defaults(func=_cmd_ring)

    ma = sub.add_parser("masks", help="print attention masks as matrices (# = attend, . = masked)",
                        description="Print a mask as a matrix: one row per query, one column per key, "
                                    "'#' = attend (True), '.' = masked.",
                        epilog="examples:\n  attnlab masks show causal --L 4 --S 6\n"
                               "  attnlab masks show causal --L 4 --S 6 --align bottom_right\n"
                               "  attnlab masks show sliding_window --L 6 --S 6 --window 3\n"
                               "  attnlab masks show padding --lengths 3,1 --S 4",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ma_sub = ma.add_subparsers(dest="masks_command", metavar="show")
    show = ma_sub.add_parser("show", help="print one mask")
    show.add_argument("kind", choices=["causal", "sliding_window", "padding"])
    show.add_argument("--L", type=int, default=4, help="queries (default: 4)")
    show.add_argument("--S", type=int, default=None, help="keys (default: L)")
    show.add_argument("--align", choices=["top_left", "bottom_right"], default="top_left",
                      help="causal alignment (default: top_left, SDPA's is_causal)")
    show.add_argument("--window", type=_positive_int, default=2, help="sliding window size (default: 2)")
    show.add_argument("--lengths", type=_lengths_list, default=[3, 1],
                      help="padding: real lengths (default: 3,1)")
    ma.set_defaults(func=_cmd_masks)
    return parser


def _cmd_example(args: argparse.Namespace) -> int:
    from attnlab.example import format_example, run_example

    result = run_example(_example_config(args))
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(format_example(result))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from attnlab import doctor

    try:
        fn = _load_function(args.target)
    except Exception as exc:  # the user's module may fail to import in any way
        print(f"attnlab doctor: {exc}", file=sys.stderr)
        return 2
    if args.self_attention:
        fn = doctor.adapt_self_attention(fn)
    report = doctor.diagnose(fn)
    print(json.dumps(report.to_dict()) if args.json else str(report))
    return 0 if report.ok else 1


def _cmd_grade(args: argparse.Namespace) -> int:
    from attnlab.grading import launch

    mode = "none" if args.no_sandbox else "auto"
    if args.lab is not None:
        from attnlab import labs

        try:
            labs.find_lab(args.lab)
        except KeyError as exc:
            print(f"attnlab grade: --lab: {exc.args[0]}", file=sys.stderr)
            return 2
    if args.path is not None and Path(args.path).is_dir():
        return _cmd_grade_class(args, mode)
    if args.out or args.resume:
        print("attnlab grade: --out and --resume are for a folder of submissions; for one file use --json",
              file=sys.stderr)
        return 2
    if args.untrusted and not args.no_sandbox and launch.bwrap_path() is None:
        print(f"attnlab grade: refusing to run untrusted code without the OS sandbox: {launch.HOW_TO_GET_BWRAP}. "
              "Or pass --no-sandbox to run it with process limits only.", file=sys.stderr)
        return 2
    launch.prestart(mode, args.memory_mb * 2)  # the sandbox server imports torch while this process does the same
    import signal

    from attnlab import labs
    from attnlab.grading import GradeReport, Limits, grade, supports_colour

    if mode == "auto" and launch.bwrap_path() is None:
        print(f"note: bwrap was not found, so this file runs with process limits only, NOT in an OS sandbox; "
              f"fine for your own code. To grade other people's code safely, {launch.HOW_TO_GET_BWRAP}.",
              file=sys.stderr)
    to_stdout = args.json == "-"
    progress = None
    if not to_stdout and sys.stderr.isatty():
        progress = lambda text: print(f"\rgrading {text:<40}", end="", file=sys.stderr, flush=True)  # noqa: E731
    limits = Limits(timeout_s=args.timeout, memory_mb=args.memory_mb, submission_memory_mb=args.memory_mb * 2)
    json_path = None if to_stdout or not args.json else Path(args.json)
    path = Path(args.path) if args.path else None
    latest = {"report": None}

    def checkpoint(report) -> None:
        latest["report"] = report
        if json_path is not None:
            _write_atomically(json_path, json.dumps(report.to_gradescope(), indent=2) + "\n")

    if json_path is not None:  # a valid results.json exists from the start, even if this process is killed
        lab = labs.find_lab(args.lab) if args.lab else labs.lab_for_path(path or Path("attention.py"))
        first = GradeReport(path=path or Path("attention.py"), seed=args.seed or 0, pending=list(lab.exercises()),
                            problem="grading did not finish")
        checkpoint(first)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        report = grade(path, limits=limits, total_timeout_s=args.total_timeout, progress=progress,
                       images_dir=None if args.no_images else args.images, seed=args.seed, sandbox=mode,
                       untrusted=args.untrusted, checkpoint=checkpoint, lab=args.lab)
    except KeyboardInterrupt:
        report = latest["report"]
        if report is not None:
            report.problem = "grading was interrupted"
            checkpoint(report)
        print("\nattnlab grade: interrupted" + (f"; {json_path} holds the checks graded so far"
                                                if json_path else ""), file=sys.stderr)
        return 130
    except launch.SandboxUnavailable as exc:
        print(f"attnlab grade: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    if progress:
        print("\r" + " " * 50 + "\r", end="", file=sys.stderr, flush=True)
    if args.json:
        text = json.dumps(report.to_gradescope(), indent=2)
        if to_stdout:
            print(text)
        else:
            _write_atomically(json_path, text + "\n")
    if not to_stdout:
        print(report.to_text(colour=supports_colour() and not args.no_colour))
        if args.json:
            print(f"results written to {args.json}")
    if report.environment_problem:
        return 2  # the installation, not the learner's code
    return 0 if report.score == report.max_score else 1


def _cmd_grade_class(args: argparse.Namespace, mode: str) -> int:
    import time

    from attnlab.grading import Limits, batch, launch

    if args.out is None:
        print(f"attnlab grade: {args.path} is a folder: pass --out OUTDIR for the gradebook, the report and each "
              f"learner's results.json", file=sys.stderr)
        return 2
    if args.json:
        print("attnlab grade: --json is for one file; a folder's results.json files go under --out", file=sys.stderr)
        return 2
    limits = Limits(timeout_s=args.timeout, memory_mb=args.memory_mb, submission_memory_mb=args.memory_mb * 2)
    started = time.perf_counter()
    tty = sys.stderr.isatty()

    def progress(done: int, total: int, text: str) -> None:
        elapsed = time.perf_counter() - started
        left = elapsed / max(done, 1) * (total - done)
        line = f"[{'#' * int(30 * done / max(total, 1)):<30}] {done}/{total}  ~{left:.0f} s left  last: {text}"
        print(("\r" + line[:110].ljust(110)) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    try:
        result = batch.grade_class(args.path, args.out, jobs=args.jobs, seed=args.seed, resume=args.resume,
                                   limits=limits, total_timeout_s=args.total_timeout, sandbox=mode,
                                   progress=progress, lab=args.lab)
    except launch.SandboxUnavailable as exc:
        print(f"attnlab grade: {exc}", file=sys.stderr)
        return 2
    if tty:
        print(file=sys.stderr)
    out = Path(args.out)
    n = len(result.rows)
    mean = sum(r.total for r in result.rows) / n if n else 0.0
    statuses = {s: sum(1 for r in result.rows if r.status == s) for s in ("graded", "timed out", "could not be read")}
    print(f"graded {n} learners in {result.seconds:.0f} s (mean {mean:.1f}; "
          + ", ".join(f"{k}: {v}" for k, v in statuses.items() if v) + f"); skipped {len(result.skipped)}"
          + (f" (see {out / 'skipped.txt'})" if result.skipped else ""))
    print(f"sandboxes: {result.sandboxes}")
    print(f"gradebook: {out / 'grades.csv'}\nreport:    {out / 'report.html'}\nper learner: {out}/<learner>/results.json")
    return 0


def _cmd_labs(args: argparse.Namespace) -> int:
    import importlib.util

    from attnlab import labs

    if getattr(args, "labs_command", None) == "get":
        try:
            dest = labs.get_lab(args.name, args.dir)
        except (KeyError, FileNotFoundError, FileExistsError) as exc:
            print(f"attnlab labs get: {exc.args[0] if exc.args else exc}", file=sys.stderr)
            return 2
        lab = labs.find_lab(args.name)
        print(f"copied lab {lab.name} into {dest}: read README.md, fill in {lab.file}, then run "
              f"'attnlab grade {dest / lab.file}'")
        missing = [m for m in lab.needs if importlib.util.find_spec(m) is None]
        if missing:
            print(f"note: the lab's files import {', '.join(missing)}, which is not installed here: "
                  f"pip install 'attnlab[lab]'", file=sys.stderr)
        return 0
    for lab in labs.LABS:
        print(f"{lab.name}  {lab.title}\n    covers: {lab.covers}")
    print("\nstart one with: attnlab labs get NAME [DIR]; grade it with: attnlab grade DIR/FILE (the file the lab "
          "names: attention.py, masks.py, multihead.py, flash.py)")
    return 0


def _cmd_autograder(args: argparse.Namespace) -> int:
    import subprocess

    from attnlab.grading import autograder

    try:
        path = autograder.build_bundle(args.out, wheel=args.wheel)
    except (RuntimeError, ValueError, OSError, subprocess.CalledProcessError) as exc:
        print(f"attnlab autograder: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}: upload it as the assignment's autograder on Gradescope (setup.sh, run_autograder, "
          f"requirements.txt, the attnlab wheel)")
    return 0


def _write_atomically(path: Path, text: str) -> None:
    """Write to a temporary file beside ``path``, then rename it over ``path``: a reader
    sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _mask_arg(text: str) -> str:
    from attnlab.bench import parse_mask

    try:
        return parse_mask(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from attnlab import bench

    if args.threads:
        torch.set_num_threads(args.threads)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.ring:
        lens = args.seq_lens if args.seq_lens != [512, 1024, 2048, 4096, 8192, 16384] else [8192, 16384]
        print(f"machine: {bench.machine_line()}\n")
        print("| L | causal | layout | 2 ranks x 1 thread s | 1 process x 2 threads s | ratio | ring peak +MiB/rank "
              "| one process peak +MiB | sent MiB/rank | waiting on messages |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for causal in causals:
            for row in bench.ring_benchmark(lens, B=args.batch, H=args.heads, E=args.dim, causal=causal,
                                            layout=args.ring_layout):
                print(f"| {row['L']} | {'yes' if causal else 'no'} | {row['layout']} | {row['ring_s']:.2f} | "
                      f"{row['single_s']:.2f} | {row['ratio']:.2f} | {row['ring_peak_mib']:.1f} | "
                      f"{row['single_peak_mib']:.1f} | {row['sent_mib_per_rank']:.1f} | "
                      f"{100 * row['comm_wait_share']:.1f}% |"
                      + (f" errors: {row['errors']}" if row["errors"] else ""), flush=True)
        return 0
    width = 30

    def progress(done: int, total: int, text: str) -> None:
        if not sys.stderr.isatty():
            return
        filled = int(width * done / max(total, 1))
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text:<45}", end="", file=sys.stderr,
              flush=True)

    if args.transformers:
        rows = bench.transformers_benchmark(repeats=args.repeats, B=args.batch, progress=progress)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        print(f"machine: {bench.machine_line()}\n")
        print("| model | L | sliding window | sdpa ms | attnlab ms | x sdpa |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['family']} | {r['L']} | {r['window'] or '-'} | {r['sdpa_ms']:.0f} | {r['attnlab_ms']:.0f} "
                  f"| {r['ratio']:.2f} |")
        return 0
    if args.density:
        L = args.seq_lens[0] if args.seq_lens != [512, 1024, 2048, 4096, 8192, 16384] else 8192
        rows = bench.density_sweep(L, B=args.batch, H=args.heads, E=args.dim, repeats=args.repeats,
                                   modes=args.modes, progress=progress)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        print(f"machine: {bench.machine_line()}\n")
        print(f"attnlab.flex, L={L}, B={args.batch}, H={args.heads}, E={args.dim}, float32; ratio = time / "
              f"(density x time of full attention); 1.0 = proportional to the blocks visited\n")
        print("| mask | density | full blocks | partial blocks | mode | median ms | full attention ms | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['mask']} | {r['density']:.3f} | {r['full']} | {r['partial']} | {r['mode']} | {r['ms']:.1f} "
                  f"| {r['full_ms']:.1f} | {r['ratio']:.2f} |")
        return 0

    results = bench.run_benchmarks(args.seq_lens, args.impls, args.modes, causals, args.dtypes, B=args.batch,
                                   H=args.heads, E=args.dim, repeats=args.repeats, warmup=args.warmup,
                                   memory=not args.no_memory, max_memory_gb=args.max_memory_gb, progress=progress,
                                   mask=args.mask)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"machine: {bench.machine_line()}\n")
    print(bench.markdown_table(results))
    if args.csv:
        bench.write_csv(results, args.csv)
        print(f"\nCSV written to {args.csv}")
    if args.plot:
        try:
            bench.plot(results, args.plot)
        except RuntimeError as exc:
            print(f"attnlab bench: {exc}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    return 0


def _example_config(args: argparse.Namespace):
    from attnlab.example import ExampleConfig

    return ExampleConfig(seed=args.seed, batch=args.batch, seq_len=args.seq_len, d_model=args.d_model,
                         d_k=args.d_k, d_v=args.d_v, causal=args.causal, dtype=args.dtype)


def _cmd_plot(args: argparse.Namespace) -> int:
    from attnlab import viz
    from attnlab.example import run_example

    if not args.out.lower().endswith((".png", ".svg")):
        print(f"attnlab plot: --out must end in .png or .svg, got {args.out!r}", file=sys.stderr)
        return 2
    try:
        fig = viz.steps(run_example(_example_config(args)).trace)
    except ImportError as exc:
        print(f"attnlab plot: {exc}", file=sys.stderr)
        return 2
    viz.save(fig, args.out)
    print(f"wrote {args.out}")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    try:
        from attnlab.viz.explain import explain_html

        page = explain_html(_example_config(args))
    except ImportError as exc:
        print(f"attnlab explain: {exc}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote {args.out} ({len(page) // 1024} KB); open it in any browser, no network needed")
    return 0


def _cmd_ring(args: argparse.Namespace) -> int:
    from attnlab.distributed import run_ring

    cfg = dict(B=args.batch, H=args.heads, Hkv=args.kv_heads or args.heads, L=args.seq_len, E=args.dim,
               causal=args.causal, layout=args.layout, threads=args.threads, check=not args.no_check,
               timeout=600)
    parts = args.world if args.layout == "contiguous" else 2 * args.world
    if args.seq_len % parts:
        print(f"attnlab ring: --seq-len {args.seq_len} does not split into {parts} equal parts "
              f"({args.layout}); use a multiple of {parts}", file=sys.stderr)
        return 2
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


def _cmd_masks(args: argparse.Namespace) -> int:
    from attnlab import masks

    if getattr(args, "masks_command", None) != "show":
        print("usage: attnlab masks show {causal,sliding_window,padding} [options]; see --help", file=sys.stderr)
        return 2
    S = args.S if args.S is not None else args.L
    try:
        if args.kind == "causal":
            m = masks.causal(args.L, S, align=args.align)
            title = f"causal, L={args.L}, S={S}, align={args.align}"
        elif args.kind == "sliding_window":
            m = masks.sliding_window(args.L, S, args.window, align=args.align)
            title = f"sliding_window, L={args.L}, S={S}, window={args.window}, align={args.align}"
        else:
            pad = masks.padding(args.lengths, S)  # (B, 1, 1, S)
            print(f"padding, lengths={args.lengths}, S={S} (one row per sequence)")
            print(masks.render(pad[:, 0, 0, :]))
            return 0
    except ValueError as exc:
        print(f"attnlab masks: {exc}", file=sys.stderr)
        return 2
    print(title)
    print(masks.render(m))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `attnlab example | head`: the reader left, that is fine
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
