"""The ``attnlab`` command line: ``attnlab <command> --help`` explains each command.

One module per command (``example``, ``doctor``, ``grade``, ``labs``, ``autograder``,
``bench``, ``pictures`` for plot/explain, ``ring``, ``masks``), each with ``add(sub)``
(its parser, with examples in ``--help``) and ``run(args)`` (parse, call the library,
print). Argument types shared by all of them are in :mod:`attnlab.cli._args`: every value
is checked there or at the top of ``run``, so a user's mistake ends in one line on stderr
and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from typing import Optional, Sequence

import attnlab
from attnlab.cli import autograder, bench, doctor, example, grade, labs, masks, pictures, ring
from attnlab.cli._args import UsageError

__all__ = ["main", "build_parser"]

_COMMANDS = (example, doctor, grade, labs, autograder, bench, pictures, ring, masks)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Learn, check and run self-attention, built from scratch and verified against PyTorch.",
        epilog="examples:\n  attnlab example\n  attnlab labs get 01 && cd 01-attention && attnlab grade\n"
               "  attnlab doctor mypkg.attn:sdpa\n\nRun 'attnlab <command> --help' for the options of each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"attnlab {attnlab.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for command in _COMMANDS:
        command.add(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace):
    """The deepest subparser the command line reached (``labs get``, ``masks show``), so that its
    own usage line is printed with an error, not the top-level one."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    chosen = action.choices.get(args.command)
    for dest in ("labs_command", "masks_command"):
        name = getattr(args, dest, None)
        if chosen is not None and name:
            nested = next((a for a in chosen._actions if isinstance(a, argparse._SubParsersAction)), None)  # noqa
            if nested is not None and name in nested.choices:
                chosen = nested.choices[name]
    return chosen


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``attnlab`` command: ``argv`` (default: the process's own arguments) parsed and run;
    the exit status returned."""
    if argv is None:  # the console script: this process ends when main returns
        _exit_now(_main(list(sys.argv[1:])))
    return _main(list(argv))


def _exit_now(code: object) -> None:
    """End the console script's process with ``code`` without Python's finalization, whose last
    garbage collection walks every object torch made: 0.6-0.9 s after `import torch` on the 2-core
    EPYC (2026-12-04), a fifth of `attnlab grade`. (Freezing the collector instead made nanobind,
    under triton, print its "leaked instances" at exit.) What an orderly exit does for attnlab runs
    first: the atexit handlers (a sandbox's folder removed), then the streams flushed."""
    atexit._run_exitfuncs()  # noqa: SLF001 (the one way to run them, then skip the rest of finalization)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left (`attnlab example | head`), a closed stream
            pass
    os._exit(code if isinstance(code, int) else 0)


def _main(argv: list[str]) -> int:
    parser = build_parser()
    try:  # argparse ends a bad command line (and --help) with SystemExit: main() returns its status
        args, extra = parser.parse_known_args(argv)
        if extra:
            target = _subparser(parser, argv, args) if getattr(args, "command", None) else parser
            target.error(f"unrecognized arguments: {' '.join(extra)}")  # exits 2 with that command's usage
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if args.command in _GRADER_COMMANDS:  # learner text reaches this terminal: the output boundary
        from attnlab.grading.output import guarded_streams

        with guarded_streams():
            return _run(args)
    return _run(args)


# the commands that print what learners wrote (names, messages, source lines)
_GRADER_COMMANDS = ("grade", "autograder")


def _run(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"attnlab {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `attnlab example | head`: the reader left, that is fine
        sys.stderr.close()
        return 0
    except MemoryError:  # sizes a user asked for that this machine cannot hold: theirs to change, not a crash
        print(f"attnlab {args.command}: out of memory: the sizes asked for do not fit in this machine's memory; "
              "try smaller ones", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
