"""``attnlab autograder``: pack the grader as a Gradescope autograder zip, and try one first."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from attnlab.cli._args import UsageError, output_file

HELP = """\
Write a Gradescope autograder bundle for one lab: setup.sh (installs bubblewrap,
CPU-only torch and this attnlab from its wheel into /autograder/venv), run_autograder
(grades /autograder/submission/<the lab's file> into /autograder/results/results.json),
pinned requirements.txt and the wheel.

--test FILE runs the bundle on FILE in a simulated Gradescope root on this machine
(offline: the bundle's wheel, this environment's torch), and prints the score, so you
can try a solution and a stub before you upload.

examples:
  attnlab autograder --lab 01 --out autograder-01.zip
  attnlab autograder --lab 02 --out autograder-02.zip --test labs/track1/02-masks/solutions/masks.py
"""


def add(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("autograder", help="pack the grader as a Gradescope autograder zip (and try it)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=output_file(".zip"), metavar="ZIP",
                   help="the zip to write, e.g. autograder.zip")
    p.add_argument("--lab", default="01", metavar="NAME", help="which lab (default: 01; see 'attnlab labs')")
    p.add_argument("--wheel", default=None, metavar="WHL",
                   help="the attnlab wheel to bundle (default: built from this checkout, or packed from the "
                        "installed attnlab)")
    p.add_argument("--test", default=None, metavar="FILE",
                   help="then run the bundle on this submission in a simulated Gradescope root and print the score")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from attnlab import labs
    from attnlab.grading.classroom import autograder

    try:
        lab = labs.find_lab(args.lab)
    except KeyError as exc:
        raise UsageError(f"--lab: {exc.args[0]}") from None
    if args.wheel is not None and not Path(args.wheel).is_file():
        raise UsageError(f"--wheel {args.wheel!r}: no such file (leave --wheel out: the installed attnlab is packed)")
    if args.test is not None and not Path(args.test).is_file():
        raise UsageError(f"--test {args.test!r}: no such file; give a submission's {lab.file}")
    try:
        path = autograder.build_bundle(args.out, wheel=args.wheel, lab=lab)
    except (RuntimeError, ValueError, OSError, subprocess.CalledProcessError) as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {path}: the autograder of lab {lab.name} (learners submit {lab.file}). Upload it on Gradescope "
          f"as the assignment's autograder (see docs/instructors.md)")
    if args.test is None:
        return 0
    with tempfile.TemporaryDirectory(prefix="attnlab-gradescope-") as work:
        try:
            data = autograder.try_bundle(path, args.test, work,
                                         progress=lambda t: print(f"  {t} ...", file=sys.stderr, flush=True))
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            print(f"attnlab autograder --test: the bundle did not work here: {exc}", file=sys.stderr)
            return 1
    print(f"simulated Gradescope run of {args.test}: score {data['score']:g}/{data['max_score']:g}")
    for t in data.get("tests", []):
        print(f"  {t['score']:>4g}/{t['max_score']:<3g} {t['name']}")
    print("\nwhat the learner reads on Gradescope (the submission's output, then each failed test's):")
    print("  " + data.get("output", "").replace("\n", "\n  "))
    for t in data.get("tests", []):
        if t.get("score", 0) < t.get("max_score", 0) and t.get("output"):
            print(f"  [{t['name']}]\n    " + str(t["output"]).replace("\n", "\n    "))
    return 0
