"""``attnlab labs`` / ``attnlab labs get NAME [DIR]``: the labs, and a lab's materials copied out."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from attnlab.cli._args import UsageError

HELP = """\
List the labs of track 1 and what each covers. 'attnlab labs get NAME [DIR]' copies a
lab's brief, stubs and walkthrough (never its solutions) into DIR (default ./NAME), so
you can start from 'pip install attnlab' alone. Then, inside DIR, 'attnlab grade'
grades the file you are filling in.

examples:
  attnlab labs
  attnlab labs get 01
  attnlab labs get 02-masks ~/attention-labs/02
"""


def add(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("labs", help="list the labs, or copy one to start it: attnlab labs get 01",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p_sub = p.add_subparsers(dest="labs_command", metavar="get")
    g = p_sub.add_parser("get", help="copy a lab's brief, stubs and walkthrough into a folder",
                         description="Copy a lab's brief, stubs and walkthrough (never its solutions) into a folder.",
                         epilog="examples:\n  attnlab labs get 01\n  attnlab labs get 03-multi-head my-lab-03\n"
                                "  attnlab labs get 01 --solution instructor-01   (the solution, for instructors)",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("name", help="the lab's name or number (e.g. 01-attention or 01)")
    g.add_argument("dir", nargs="?", default=None, help="where to put it (default: ./NAME)")
    g.add_argument("--solution", action="store_true",
                   help="for instructors: copy the lab's solution instead (a warning says so; never hand it out)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from attnlab import labs

    if getattr(args, "labs_command", None) == "get":
        try:
            lab = labs.find_lab(args.name)
        except KeyError as exc:
            raise UsageError(exc.args[0]) from None
        if args.solution:
            try:
                path = labs.get_solution(args.name, args.dir)
            except OSError as exc:
                raise UsageError(str(exc.args[0]) if len(exc.args) == 1 else str(exc)) from None
            print(f"copied the SOLUTION of lab {lab.name} to {path}", file=sys.stdout)
            print(f"warning: {path.name} is the instructor's solution: it scores 100. Keep it away from learners "
                  f"(not in a shared folder or a repository they can read).", file=sys.stderr)
            return 0
        try:
            dest = labs.get_lab(args.name, args.dir)
        except OSError as exc:  # get_lab's own messages: not installed, not overwriting, cannot be made
            raise UsageError(str(exc.args[0]) if len(exc.args) == 1 else str(exc)) from None
        here = Path.cwd()
        shown = dest.relative_to(here) if dest.is_relative_to(here) else dest
        print(f"copied lab {lab.name} into {shown}: read README.md, fill in {lab.file}, then grade it:\n"
              f"  cd {shown}\n  attnlab grade")
        missing = [m for m in lab.needs if importlib.util.find_spec(m) is None]
        if missing:
            print(f"note: the lab's files import {', '.join(missing)}, which is not installed here; before you "
                  f"start: pip install 'attnlab[{lab.extra}]'", file=sys.stderr)
        if importlib.util.find_spec("jupytext") is None or importlib.util.find_spec("jupyterlab") is None:
            print("note: to open the walkthrough notebook: pip install 'attnlab[notebook]', then "
                  "jupyter lab walkthrough.ipynb", file=sys.stderr)
        return 0
    for lab in labs.LABS:
        print(f"{lab.name}  {lab.title}\n    file: {lab.file}\n    covers: {lab.covers}")
    print("\nstart one with: attnlab labs get NAME [DIR]; then, in that folder, grade it with: attnlab grade")
    return 0
