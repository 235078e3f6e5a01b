"""Argument types shared by the ``attnlab`` commands.

Every value a user types is checked here, while argparse parses it, so that a bad value
ends in one line that names the argument, says what was wrong and how to fix it (exit 2),
before any work starts and never with a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable, Iterable

DTYPES = ["float32", "float64", "float16", "bfloat16"]  # attnlab.example.DTYPES, without importing torch


class UsageError(Exception):
    """A user's mistake found after parsing (a path, a size): printed as one line, exit 2."""


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "learner")`` -> ``1 learner``; ``plural(3, "learner")`` -> ``3 learners``."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def ints(min_value: int) -> Callable[[str], list[int]]:
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


def choices(allowed: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated subset of ``allowed``."""
    allowed = list(allowed)

    def parse(text: str) -> list[str]:
        values = [x for x in text.split(",") if x]
        bad = [x for x in values if x not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or text!r}: choose from {','.join(allowed)}")
        return values

    return parse


def int_at_least(min_value: int) -> Callable[[str], int]:
    """An argparse type: one integer >= min_value."""
    what = "a positive integer" if min_value == 1 else f"an integer >= {min_value}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < min_value:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)

def seed(text: str) -> int:
    """An argparse type: a seed torch's generators take, 0 <= seed < 2**63."""
    value = int_at_least(0)(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"expected a seed below 2**63 ({2**63 - 1}), got {value}")
    return value


# the smallest --memory-mb a sandbox starts with: the whole submission gets twice it, and the server's
# torch alone took 128-160 MB (--memory-mb 64 was killed at start, 80 graded; 2026-12-02, torch 2.13)
MIN_MEMORY_MB = 128


def memory_mb(text: str) -> int:
    """An argparse type: --memory-mb, an integer the sandbox can start with."""
    value = int_at_least(1)(text)
    if value < MIN_MEMORY_MB:
        raise argparse.ArgumentTypeError(
            f"{value} MB is too small for the sandbox to start: its torch alone takes about 150 MB (the whole "
            f"submission may use twice --memory-mb); use {MIN_MEMORY_MB} or more (default 1024)")
    return value
non_negative_int = int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def output_file(*suffixes: str) -> Callable[[str], str]:
    """An argparse type: a file this command may create: its folder exists and is writable,
    it is not a folder itself, and it ends in one of ``suffixes`` (any when none)."""

    def parse(text: str) -> str:
        path = Path(text)
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name inside it, "
                                             f"e.g. {path / ('out' + (suffixes[0] if suffixes else ''))}")
        if suffixes and not text.lower().endswith(suffixes):
            raise argparse.ArgumentTypeError(f"{text!r} must end in {' or '.join(suffixes)}")
        check_writable_folder(path.parent if str(path.parent) else Path("."), for_what=text)
        return text

    return parse


def check_writable_folder(folder: Path, for_what: str) -> None:
    """Raise ``argparse.ArgumentTypeError`` unless ``folder`` exists and can be written."""
    if not folder.exists():
        raise argparse.ArgumentTypeError(f"cannot write {for_what!r}: the folder {str(folder)!r} does not exist "
                                         f"(create it with: mkdir -p {folder})")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {for_what!r}: {str(folder)!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {for_what!r}: the folder {str(folder)!r} is not writable")


def new_folder(text: str) -> str:
    """An argparse type: a folder this command may create or fill (its parent must exist)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    if not path.exists():
        parent = path.resolve().parent
        try:
            check_writable_folder(parent, for_what=text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"cannot create the folder {text!r}: {str(parent)!r} does not exist "
                                             f"or is not writable") from None
    elif not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"the folder {text!r} is not writable")
    return text


def add_example_options(p: argparse.ArgumentParser) -> None:
    """The worked example's options, shared by ``example``, ``plot example`` and ``explain``."""
    p.add_argument("--seed", type=seed, default=42, help="random seed for X and the weights (default: 42)")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B", help="batch size B (default: 1)")
    p.add_argument("--seq-len", type=positive_int, default=4, metavar="T", help="sequence length T (default: 4)")
    p.add_argument("--d-model", type=positive_int, default=8, metavar="d", help="embedding size d (default: 8)")
    p.add_argument("--d-k", type=positive_int, default=4, help="query/key size d_k (default: 4)")
    p.add_argument("--d-v", type=positive_int, default=4, help="value size d_v (default: 4)")
    p.add_argument("--causal", action="store_true", help="apply a causal mask (position i sees 0..i)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="compute dtype (default: float32)")


# The worked example keeps every step (X, Q, K, V, scores, shifted scores, weights, output)
# and prints each one: 8 tensors, the largest of them B x T x T. Past this many elements a
# printout is unreadable anyway, and at T = 100000 the scores alone would be 40 GB.
EXAMPLE_MAX_ELEMENTS = 4_000_000


def example_config(args: argparse.Namespace):
    """The :class:`attnlab.example.ExampleConfig` of parsed example options, refused with a
    :class:`UsageError` when it would allocate more than the example is for (checked before
    attnlab.example, and torch with it, is imported: the refusal comes at once)."""
    elements = args.batch * (2 * args.seq_len * args.seq_len
                             + args.seq_len * (args.d_model + 2 * args.d_k + 2 * args.d_v))
    if elements > EXAMPLE_MAX_ELEMENTS:
        raise UsageError(
            f"--batch {args.batch} --seq-len {args.seq_len} --d-model {args.d_model} would keep {elements:,} numbers "
            f"(~{elements * 8 / 2**30:.1f} GiB) to print; the worked example is for small sizes (at most "
            f"{EXAMPLE_MAX_ELEMENTS:,}, e.g. --seq-len 1000). For timing large sizes use 'attnlab bench'.")
    from attnlab.example import ExampleConfig

    return ExampleConfig(seed=args.seed, batch=args.batch, seq_len=args.seq_len, d_model=args.d_model,
                         d_k=args.d_k, d_v=args.d_v, causal=args.causal, dtype=args.dtype)


def need_module(module: str, extra: str, command: str) -> None:
    """Raise :class:`UsageError` naming ``pip install 'attnlab[extra]'`` when ``module`` is missing,
    before a command starts work that would need it."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{command} needs {module}, which is not installed here: pip install 'attnlab[{extra}]' "
                         f"(or: pip install {module})")
