"""How long `attnlab grade` takes, wall clock, process start-up included.

    .venv/bin/python benchmarks/grading_time.py [--runs 7]

Prints a Markdown table (median, min, max over the runs) for the solutions, the
untouched stubs, and a file whose every exercise raises. A benchmark, not a test:
the machine is shared, so read the median.
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


def time_grade(path: Path, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "attnlab", "grade", str(path), "--no-colour"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raising = Path(tmp, "attention.py")
        text = (LAB / "solutions/attention.py").read_text()
        raising.write_text(text.replace('    """ex', '    raise RuntimeError("broken")\n    """ex'))
        cases = [("solutions (100/100)", LAB / "solutions/attention.py"), ("stubs (0/100)", LAB / "attention.py"),
                 ("every exercise raises", raising)]
        print(f"`attnlab grade`, wall clock incl. process start, {args.runs} runs, {os.cpu_count()} CPUs\n")
        print("| submission | median s | min s | max s |\n|---|---|---|---|")
        for name, path in cases:
            t = time_grade(path, args.runs)
            print(f"| {name} | {statistics.median(t):.2f} | {min(t):.2f} | {max(t):.2f} |")


if __name__ == "__main__":
    main()
