"""How long `attnlab grade` takes, wall clock, process start-up included.

    .venv/bin/python benchmarks/grading_time.py [--runs 7]

    .venv/bin/python benchmarks/grading_time.py --labs [--runs 3]   (every lab's solution and stubs)

Prints a Markdown table (median, min, max over the runs) for the solutions, the
untouched stubs, and a file whose every exercise raises, each graded in the bwrap
OS sandbox and with ``--no-sandbox`` (process limits only), the two interleaved run
by run, so the sandbox's overhead is measured on the same machine state. A
benchmark, not a test: the machine is shared, so read the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAB = Path(__file__).resolve().parents[1] / "labs/track1/01-attention"


def time_once(path: Path, *flags: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "attnlab", "grade", str(path), "--no-colour", "--no-images", *flags],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def time_grade(path: Path, runs: int) -> tuple[list[float], list[float]]:
    """(in the sandbox, without it), interleaved."""
    boxed, bare = [], []
    for _ in range(runs):
        boxed.append(time_once(path, "--untrusted"))
        bare.append(time_once(path, "--no-sandbox"))
    return boxed, bare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--labs", action="store_true",
                        help="instead: each lab's solution and stubs, in the sandbox (the issue's < 5 s per lab)")
    args = parser.parse_args()
    if args.labs:
        labs_table(args.runs)
        return
    with tempfile.TemporaryDirectory() as tmp:
        raising = Path(tmp, "attention.py")
        text = (LAB / "solutions/attention.py").read_text()
        raising.write_text(text.replace('    """ex', '    raise RuntimeError("broken")\n    """ex'))
        cases = [("solutions (100/100)", LAB / "solutions/attention.py"), ("stubs (0/100)", LAB / "attention.py"),
                 ("every exercise raises", raising)]
        print(f"`attnlab grade`, wall clock incl. process start, {args.runs} runs, {os.cpu_count()} CPUs\n")
        print("| submission | sandbox: median s | min s | max s | no sandbox: median s | overhead s |")
        print("|---|---|---|---|---|---|")
        for name, path in cases:
            t, u = time_grade(path, args.runs)
            m, n = statistics.median(t), statistics.median(u)
            print(f"| {name} | {m:.2f} | {min(t):.2f} | {max(t):.2f} | {n:.2f} | {m - n:+.2f} |")


def labs_table(runs: int) -> None:
    """Every lab of track 1: its solution and its stubs, graded in the sandbox, ``runs`` times."""
    from attnlab import labs

    print(f"`attnlab grade`, each lab, in the sandbox, wall clock incl. process start, {runs} runs\n")
    print("| lab | solution: median s | min s | max s | stubs: median s |")
    print("|---|---|---|---|---|")
    for lab in labs.LABS:
        folder = LAB.parent / lab.name
        solution = [time_once(folder / "solutions" / lab.file, "--untrusted") for _ in range(runs)]
        stubs = [time_once(folder / lab.file, "--untrusted") for _ in range(runs)]
        print(f"| {lab.name} | {statistics.median(solution):.2f} | {min(solution):.2f} | {max(solution):.2f} | "
              f"{statistics.median(stubs):.2f} |")


if __name__ == "__main__":
    main()
