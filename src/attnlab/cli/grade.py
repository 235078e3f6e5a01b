"""``attnlab grade``: grade one learner's file, or a whole class's folder."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from attnlab.grading.submission import printable
from attnlab.cli._args import UsageError, memory_mb, new_folder, output_file, plural, positive_float, positive_int, seed

HELP = """\
Grade a lab file (default: the one in this folder), a notebook, a zip, or a class's folder
(with --out), each submission in its own OS sandbox (bubblewrap; without it your own file runs
with process limits only); failed checks name the mistake.
In full (the sandbox, the class layouts, the report, exit statuses): docs/cli.md, docs/instructors.md.

examples:
  attnlab grade                                    # the lab file in this folder
  attnlab grade attention.ipynb --json results.json
  attnlab grade submissions/ --out graded/ --jobs 2
  attnlab grade --self-test                        # does the OS sandbox work here?
"""


def add(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("grade", help="grade a lab submission safely and explain each failed check",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="attnlab grade [PATH] [options]")
    p.add_argument("path", nargs="?", default=None,
                   help="a file (default: the lab file here) or a class folder")
    p.add_argument("--lab", metavar="NAME", default=None,
                   help="which lab (02-masks or 02; default: from the file)")
    p.add_argument("--out", metavar="OUTDIR", type=new_folder, default=None,
                   help="a class's gradebook, report and feedback")
    p.add_argument("--jobs", type=positive_int, default=2, metavar="N",
                   help="a class: submissions at once (default: 2)")
    p.add_argument("--resume", action="store_true",
                   help="a class: keep what a run into --out finished")
    p.add_argument("--json", metavar="RESULTS_JSON", default=None,
                   help="also write Gradescope's results.json ('-': stdout)")
    p.add_argument("--timeout", type=positive_float, default=5.0, metavar="S",
                   help="CPU seconds per exercise (default: 5)")
    p.add_argument("--total-timeout", type=positive_float, default=60.0, metavar="S",
                   help="CPU seconds for the file (default: 60)")
    p.add_argument("--memory-mb", type=memory_mb, default=1024, metavar="MB",
                   help="memory per exercise, >= 128 (default: 1024)")
    p.add_argument("--no-colour", "--no-color", action="store_true", help="plain text even on a terminal")
    p.add_argument("--images", default="attnlab-grade-images", metavar="DIR",
                   help="pictures of failed checks (default: ./attnlab-grade-images)")
    p.add_argument("--no-images", action="store_true", help="save no pictures")
    p.add_argument("--seed", type=seed, default=None, metavar="N",
                   help="the inputs' seed (default: fresh each run; a class's also take OUT's secret key)")
    p.add_argument("--untrusted", action="store_true",
                   help="someone else's file: only inside the OS sandbox")
    p.add_argument("--no-sandbox", action="store_true",
                   help="process limits only (trusted code, or no bwrap)")
    p.add_argument("--seccomp-optional", action="store_true",
                   help="grade without seccomp where it fails (said in reports)")
    p.add_argument("--self-test", action="store_true",
                   help="check that the OS sandbox works here, or say why")
    p.add_argument("--gradescope", metavar="ROOT", default=None,
                   help="what the bundle's run_autograder runs (with --lab)")
    p.set_defaults(func=run)
    return p


def _resolve(args: argparse.Namespace):
    """The lab and the file (or folder) to grade, checked before any work: UsageError otherwise."""
    from attnlab import labs

    lab = None
    if args.lab is not None:
        try:
            lab = labs.find_lab(args.lab)
        except KeyError as exc:
            raise UsageError(f"--lab: {exc.args[0]}") from None
    if args.path is None:
        try:
            found_lab, path = labs.lab_file_in(Path.cwd())
        except labs.NoLabFile as exc:
            raise UsageError(str(exc)) from None
        return lab or found_lab, path
    path = Path(args.path)
    if not path.exists():
        raise UsageError(f"no file or folder {args.path!r}: give the path of the learner's file (e.g. attention.py) "
                         f"or of a class's folder")
    if path.is_dir():
        return lab, path
    if not path.is_file():
        raise UsageError(f"{args.path!r} is not a regular file")
    return lab or labs.lab_for_path(path), path


def run(args: argparse.Namespace) -> int:
    from attnlab.grading.sandbox import pool

    if args.self_test:
        from attnlab.grading.sandbox import self_test

        ok, why = self_test("bwrap")
        print(f"attnlab grade --self-test: {why}", file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    if args.gradescope is not None:
        return _run_gradescope(args)
    mode = "none" if args.no_sandbox else "auto"
    if (args.path is None or Path(args.path).is_file()) and not (args.untrusted and not args.no_sandbox
                                                                 and pool.bwrap_path() is None):
        # one file: the sandbox's server starts now, first, and imports torch on the other core while
        # this process does (finding the lab imports attnlab.labs, and torch with it: 2.0 s here)
        pool.prestart(mode, args.memory_mb * 2)
    lab, path = _resolve(args)
    if path.is_dir():
        return _run_class(args, mode, lab, path)
    if args.out or args.resume:
        raise UsageError("--out and --resume are for a folder of submissions; for one file use --json")
    if args.json not in (None, "-"):
        try:
            output_file()(args.json)  # the folder exists and is writable, before any grading
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"--json: {exc}") from None
    if args.untrusted and not args.no_sandbox and pool.bwrap_path() is None:
        raise UsageError(f"refusing to run untrusted code without the OS sandbox: {pool.HOW_TO_GET_BWRAP}. "
                         "Or pass --no-sandbox to run it with process limits only.")
    pool.prestart(mode, args.memory_mb * 2)  # started above already (a no-op then)
    from attnlab.grading import Limits, grade, supports_colour
    from attnlab.grading.grader import ResultsFile
    from attnlab.grading.output import sanitise_data, write_atomically

    if mode == "auto" and pool.bwrap_path() is None:
        print(f"note: bwrap was not found, so this file runs with process limits only, NOT in an OS sandbox; "
              f"fine for your own code. To grade other people's code safely, {pool.HOW_TO_GET_BWRAP}.",
              file=sys.stderr)
    to_stdout = args.json == "-"
    if not to_stdout:
        print(f"grading {printable(path)} (lab {lab.name})", file=sys.stderr, flush=True)
        if args.seed is not None:
            print(f"note: --seed {args.seed} gives the same inputs to anyone who passes it; without it each run draws "
                  "fresh ones", file=sys.stderr)
    progress = None
    if not to_stdout and sys.stderr.isatty():
        progress = lambda text: print(f"\rgrading {text:<40}", end="", file=sys.stderr, flush=True)  # noqa: E731
    limits = Limits(timeout_s=args.timeout, memory_mb=args.memory_mb, submission_memory_mb=args.memory_mb * 2,
                    seccomp_optional=args.seccomp_optional)
    results = ResultsFile(None if to_stdout or not args.json else args.json)
    if results.path is not None:  # a valid results.json exists from the start, even if this process is killed
        results.start(path, lab, args.seed)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        report = grade(path, limits=limits, total_timeout_s=args.total_timeout, progress=progress,
                       images_dir=None if args.no_images else args.images, seed=args.seed, sandbox=mode,
                       untrusted=args.untrusted, checkpoint=results.checkpoint, lab=lab)
    except KeyboardInterrupt:
        if results.latest is not None:
            results.latest.problem = "grading was interrupted"
            results.checkpoint(results.latest)
        print("\nattnlab grade: interrupted" + (f"; {results.path} holds the checks graded so far"
                                                if results.path else ""), file=sys.stderr)
        return 130
    except pool.SandboxUnavailable as exc:
        raise UsageError(str(exc)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    if progress:
        print("\r" + " " * 50 + "\r", end="", file=sys.stderr, flush=True)
    if args.json:
        text = json.dumps(sanitise_data(report.to_gradescope()), indent=2, ensure_ascii=False)  # every string
        if to_stdout:
            print(text)
        else:
            write_atomically(results.path, text + "\n")
    if not to_stdout:
        print(report.to_text(colour=supports_colour() and not args.no_colour))
        if args.json:
            print(f"results written to {args.json}")
        in_all = process_seconds()
        if in_all is not None:  # the command's own wall time: Python, torch and the sandbox's start included
            print(f"attnlab grade took {in_all:.1f} s in all (wall clock, start-up included)", file=sys.stderr)
    if report.environment_problem:
        return 2  # the installation, not the learner's code
    return 0 if report.score == report.max_score else 1


def process_seconds() -> "float | None":
    """Wall-clock seconds since this process started (Linux's /proc), None where unknown."""
    import os

    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _run_class(args: argparse.Namespace, mode: str, lab, folder: Path) -> int:
    from attnlab.grading import Limits
    from attnlab.grading.classroom import batch
    from attnlab.grading.sandbox import pool

    if args.out is None:
        raise UsageError(f"{folder} is a folder: pass --out OUTDIR for the gradebook, the report and each "
                         f"learner's results.json")
    if args.json:
        raise UsageError("--json is for one file; a folder's results.json files go under --out")
    try:
        plan = batch.plan_class(folder, args.out, lab=lab)
    except batch.ClassRefused as exc:
        raise UsageError(str(exc)) from None
    limits = Limits(timeout_s=args.timeout, memory_mb=args.memory_mb, submission_memory_mb=args.memory_mb * 2,
                    seccomp_optional=args.seccomp_optional)
    started = time.perf_counter()
    tty = sys.stderr.isatty()
    print(f"grading {plural(len(plan.submissions), 'learner')} of lab {plan.lab.name} from {printable(folder)}"
          + (f" ({plural(len(plan.skipped), 'entry', 'entries')} skipped)" if plan.skipped else ""),
          file=sys.stderr, flush=True)
    if args.seed is not None:
        print(f"note: --seed {args.seed} reproduces these inputs only together with {printable(args.out)}'s secret class "
              f"key ({batch.CLASS_KEY_FILE}): keep it with the gradebook, and never give it to learners",
              file=sys.stderr)

    def progress(done: int, total: int, text: str) -> None:
        elapsed = time.perf_counter() - started
        left = elapsed / max(done, 1) * (total - done)
        line = f"[{'#' * int(30 * done / max(total, 1)):<30}] {done}/{total}  ~{left:.0f} s left  last: {text}"
        print(("\r" + line[:110].ljust(110)) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    try:
        result = batch.grade_class(folder, args.out, jobs=args.jobs, seed=args.seed, resume=args.resume,
                                   limits=limits, total_timeout_s=args.total_timeout, sandbox=mode,
                                   progress=progress, plan=plan)
    except pool.SandboxUnavailable as exc:
        raise UsageError(str(exc)) from None
    if tty:
        print(file=sys.stderr)
    out = Path(args.out)
    n = len(result.rows)
    mean = sum(r.total for r in result.rows) / n if n else 0.0
    statuses = {s: [r for r in result.rows if r.status == s] for s in batch.STATUSES}
    print(f"graded {plural(n, 'learner')} of lab {result.lab.name} in {result.seconds:.0f} s (mean {mean:.1f}; "
          + ", ".join(f"{k}: {len(v)}" for k, v in statuses.items() if v) + f"); skipped {len(result.skipped)}"
          + (f" (see {out / 'skipped.txt'})" if result.skipped else ""))
    for s in result.skipped[:10]:
        print(f"  skipped {s.name}: {s.reason}")
    if len(result.skipped) > 10:
        print(f"  ... and {len(result.skipped) - 10} more in {out / 'skipped.txt'}")
    twice = [s.name for s in result.skipped if s.reason.startswith("one learner under")]
    if twice:
        print(f"NOT GRADED: {plural(len(twice), 'entry', 'entries')} name one learner more than once ({', '.join(twice[:6])}"
              f"{', ...' if len(twice) > 6 else ''}): keep one entry per learner and grade again")
    unread = statuses.get("could not be read") or []
    if unread:
        print("could not be read: " + ", ".join(r.learner for r in unread))
    print(f"sandboxes: {result.sandboxes}")
    print(f"gradebook: {out / 'grades.csv'}\nreport:    {out / 'report.html'}\nper learner: {out}/<folder>/results.json")
    return 0


def _run_gradescope(args: argparse.Namespace) -> int:
    from attnlab.grading.classroom import autograder

    root = Path(args.gradescope)
    if not root.is_dir():
        raise UsageError(f"--gradescope {args.gradescope!r}: no such folder (Gradescope's is /autograder)")
    if args.lab is None:
        raise UsageError("--gradescope needs --lab (the bundle's run_autograder passes it)")
    try:
        data = autograder.run_gradescope(root, args.lab)
    except KeyError as exc:
        raise UsageError(f"--lab: {exc.args[0]}") from None
    print(f"{data['output']}\nwritten: {root / 'results' / 'results.json'} ({data['extra_data']['sandbox']['chosen']})")
    return 0
