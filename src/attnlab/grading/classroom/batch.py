"""Grading a whole class: ``attnlab grade DIR --out OUTDIR [--jobs N]``.

Each submission is graded by :func:`attnlab.grading.grade` in its own OS sandbox (a fresh
sandbox server per submission: nothing one learner's code does survives into another's
grading), ``jobs`` at a time. The servers are forked from one pre-imported template
(:mod:`attnlab.grading.sandbox.template`: torch is imported once per class, not once per learner,
each fork getting namespaces, a /tmp and a cgroup of its own); where nested user namespaces
are not allowed, each gets a ``bwrap`` of its own instead (``ClassResult.sandboxes`` says which).

What comes out, in ``OUTDIR``:

* ``grades.csv``: one row per learner, sorted: learner, total, max, points per exercise,
  named mistakes, seed, seconds, status (``graded`` / ``timed out`` / ``could not be read``), run;
* ``<learner>/results.json``: Gradescope's schema, as ``attnlab grade FILE --json`` writes it, and
  ``<learner>/feedback.html``: all a learner's folder holds (what they may read);
* ``.attnlab/`` (0700): the instructor's state, never in a learner's folder: the class key, the
  rows' signing key and each learner's signed row (``rows/<learner>.json``, with their seed);
* ``report.html``: one self-contained page (:mod:`attnlab.grading.classroom.report`);
* ``skipped.txt``: what in ``DIR`` was not a submission, and why.

Layouts recognised (:func:`find_submissions`): ``DIR/<learner>/`` holding the lab's file
(``attention.py``; ``masks.py`` for lab 02), chosen by :func:`attnlab.grading.intake.choose`
(another case, an LMS re-download, a notebook, the only .py file, a zip archive; the report
says which was taken), and ``DIR/<learner>.py`` (``.ipynb``, ``.zip``). Hidden entries, symbolic
links, other files, empty folders, another lab's submissions (in a mixed class: the lab most
learners hold is graded) and a learner present twice are skipped with a reason.

Inputs no learner can know in advance: each learner's inputs derive from an HMAC-SHA256 of the
class's secret key (``OUT/.attnlab/class-key``, 0600, made on the first run into ``OUT`` and kept
with the gradebook like the resume key) over the class seed and the learner's name
(:func:`learner_key`), with each exercise's id and the SHA-256 of the bytes graded
(:mod:`attnlab.grading.inputs`): a regrade of changed bytes draws new inputs. Without ``seed`` a
class seed is drawn for each run; with it, a rerun of the same bytes into the same ``OUT`` (the
same key) gives the same inputs and grades, and into another ``OUT`` other ones. A short seed per
learner (:func:`learner_seed`) is in grades.csv, for the instructor; a learner's results.json and
feedback page show a run id, never a seed.
``resume``: learners whose row an earlier run into the same ``out`` wrote are not graded again;
each row is signed (HMAC-SHA256 with a key kept in ``out/.attnlab``, over the row and the
submission's content), so a planted or stale row is graded anew, and ``out`` must lie outside
the class folder.
"""

from __future__ import annotations

import csv
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
import unicodedata
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from attnlab import labs
from attnlab.grading import intake
from attnlab.grading.classroom import names
from attnlab.grading.grader import GradeReport, grade
from attnlab.grading.output import sanitise, write_atomically, write_json, write_text
from attnlab.grading.sandbox import Limits, pool, printable
from attnlab.grading.submission import read_submission

__all__ = ["Submission", "Skipped", "Row", "ClassResult", "ClassPlan", "ClassRefused", "find_submissions",
           "grade_class", "plan_class", "infer_lab", "learner_seed", "learner_key", "private_dir", "PRIVATE_DIR", "ROWS_DIR", "name_problem", "folder_name", "identity", "class_key", "CLASS_KEY_FILE", "SUBMISSION_FILE",
           "STATUSES"]

SUBMISSION_FILE = "attention.py"
STATUSES = ("graded", "timed out", "could not be read", "grader environment", "grader error")
# what a learner's name may hold besides letters and digits (any script's): the usual punctuation of names
NAME_PUNCTUATION = " .,'\u2019-_@+()"


class ClassRefused(ValueError):
    """A class folder that would grade nobody, or that mixes labs: the message says why and what to do."""


@dataclass(frozen=True)
class Submission:
    learner: str  # the learner's name as in DIR (NFC), kept in grades.csv
    path: Path
    folder: str = ""  # the learner's output folder under OUT: plain ASCII, unique in the class
    how: str = ""  # how the file was chosen in the learner's folder (attnlab.grading.intake), '' for the lab's file


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


@dataclass
class Row:
    """One learner's line of the gradebook."""

    learner: str
    total: float
    max_total: float
    exercises: dict[str, float]  # exercise id -> points
    mistakes: list[str]  # named mistake codes (attnlab.mistakes), sorted
    seed: int
    seconds: float
    status: str  # one of STATUSES; 'grader environment': a module the lab needs is missing where it runs
    messages: dict[str, str] = field(default_factory=dict)  # mistake code -> one message that named it
    folder: str = ""  # where under OUT its results.json and feedback.html are
    problem: str = ""  # why a file could not be read: the whole reason, bounded
    sha256: str = ""  # the graded bytes' SHA-256 (identical submissions share it)
    shape: str = ""  # the syntax tree's shape (grading.static.shape_digest): near-identical ones share it
    similar: list[str] = field(default_factory=list)  # the other learners with the same or near-identical file
    run: str = ""  # the run id the learner's report shows (the seed above is never shown to them)
    # failures no code names: signature (:func:`failure_signature`) -> one message of it
    unnamed: dict[str, str] = field(default_factory=dict)


@dataclass
class ClassResult:
    rows: list[Row]
    skipped: list[Skipped]
    out: Path
    seconds: float
    lab: "labs.Lab"  # the lab graded (the object: the report reads its exercises, no lookup by name)
    sandboxes: str = ""  # how each submission's sandbox was made, in words


@dataclass
class ClassPlan:
    """What :func:`grade_class` would grade, found before any grading: the lab, the submissions, what is skipped."""

    lab: "labs.Lab"
    submissions: list[Submission]
    skipped: list[Skipped]


def name_problem(name: str) -> Optional[str]:
    """Why ``name`` cannot be a learner's name (None when it can): which character, and how to rename."""
    if not name:
        return "the name is empty"
    if len(name) > 100:
        return f"the name is {len(name)} characters long (at most 100): shorten the folder's name"
    if not name[0].isalnum():
        return (f"the name begins with {name[0]!r}: rename it to begin with a letter or a digit")
    for ch in name:
        if ch.isalnum() or ch in NAME_PUNCTUATION or unicodedata.category(ch).startswith("M"):
            continue
        return (f"the name has the character {ch!r} (U+{ord(ch):04X}): rename it using letters, digits, spaces "
                f"and {NAME_PUNCTUATION.strip()!r} only")
    return None


# the gradebook's own names in OUT: no learner's folder may take one (a learner named
# 'grades.csv' turned the gradebook into a folder), whatever the case
RESERVED_NAMES = frozenset({"grades.csv", "report.html", "skipped.txt", ".attnlab-resume-key", ".attnlab-class-key",
                            "learners"})


def folder_name(learner: str) -> str:
    """A plain-ASCII folder name for a learner's outputs: accents dropped, other characters
    as '_', and a short hash of the real name when anything changed (so 'Li Wei' and
    'Li_Wei' get different folders) or when it is one of the gradebook's own names
    (:data:`RESERVED_NAMES`: 'grades.csv' becomes 'grades.csv-1a2b3c')."""
    ascii_ = unicodedata.normalize("NFKD", learner).encode("ascii", "ignore").decode()
    plain = re.sub(r"[^A-Za-z0-9._@+-]+", "_", ascii_).strip("._-") or "learner"
    if plain == learner and plain.lower() not in RESERVED_NAMES and not plain.lower().startswith(".grades"):
        return plain
    return f"{plain[:80]}-{zlib.crc32(learner.encode()) & 0xFFFFFF:06x}"


SUFFIXES = (".py", ".ipynb", ".zip")  # what a DIR/<learner>.<suffix> submission may be


def identity(learner: str) -> str:
    """Who a name stands for, to the eye (:func:`.names.identity`: NFKC, case-folded, invisible code
    points removed, look-alikes folded by Unicode's skeleton, an LMS copy's `` (N)`` dropped). Two
    entries of one class with the same identity are one learner twice."""
    return names.identity(learner)


def find_submissions(folder: os.PathLike, file: str = SUBMISSION_FILE,
                     exclude: "dict[str, str] | None" = None) -> tuple[list[Submission], list[Skipped]]:
    """The submissions in ``folder`` (sorted by learner) and what was skipped, with why;
    ``file`` is the lab's file name: inside a learner's folder the rule of
    :func:`attnlab.grading.intake.choose` picks it (another case, an LMS re-download, a
    notebook, the only .py file, a zip archive). ``exclude``: entry name -> the reason it is
    skipped (another lab's submissions in a mixed class).

    Total: an entry that cannot be examined is skipped with why; another lab's file (by name,
    or by the functions it defines) is skipped as such; entries that are one learner
    (:func:`identity`) are all skipped, none graded."""
    folder = Path(folder)
    skipped: list[Skipped] = []
    candidates: list[tuple[str, str, Path, str]] = []  # (entry name, learner, path, how)
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        try:
            why, found = _examine(entry, folder, file, exclude or {})
        except Exception as exc:  # one learner's entry never ends the class
            why, found = f"could not be examined ({type(exc).__name__})", None
        if found is None:
            skipped.append(Skipped(printable(entry.name), why))
        else:
            candidates.append((entry.name, *found))
    by_identity: dict[str, list[tuple[str, str, Path, str]]] = {}
    for c in candidates:
        by_identity.setdefault(identity(c[1]), []).append(c)
    subs: list[Submission] = []
    folders: set[str] = set()
    for group in by_identity.values():
        if len(group) > 1:
            names = ", ".join(printable(c[0]) for c in group)
            for c in group:
                skipped.append(Skipped(printable(c[0]), f"one learner under {len(group)} entries ({names}: the same "
                                                        "name after Unicode normalisation, case or an LMS copy's "
                                                        "'(N)'): none is graded; keep one and grade again"))
            continue
        _, learner, path, how = group[0]
        base = folder_name(learner)
        out_name, n = base, 2
        while out_name.lower() in folders:  # case-insensitive file systems too
            out_name, n = f"{base}-{n}", n + 1
        folders.add(out_name.lower())
        subs.append(Submission(learner, path, out_name, how))
    return sorted(subs, key=lambda s: s.learner), sorted(skipped, key=lambda s: s.name)


def _examine(entry: Path, folder: Path, file: str, exclude: dict[str, str]) -> tuple[str, "tuple[str, Path, str] | None"]:
    """One entry of a class folder: ``(why it is skipped, None)`` or ``('', (learner, path, how))``."""
    name = entry.name
    if name.startswith("."):
        return "hidden", None
    if name in exclude:
        return exclude[name], None
    if entry.is_symlink():
        return "a symbolic link (not followed)", None
    others = tuple(f for f in labs.LAB_FILES if f != file)
    how = ""
    if entry.is_dir():
        choice = intake.choose(entry, file, others)
        if choice.path is None:
            return choice.why, None
        learner, path, how = name, choice.path, choice.how
    elif entry.is_file() and entry.suffix.lower() in SUFFIXES:
        learner, path = entry.stem, entry
    else:
        return f"not a .py, .ipynb or .zip file, nor a folder with {file}", None
    learner = unicodedata.normalize("NFC", learner)
    problem = name_problem(learner)
    if problem:
        return problem, None
    if how or not entry.is_dir():  # not the lab's file by name: is it another lab's by what it holds?
        other = _other_lab_by_content(path, folder, file, others)
        if other:
            return other, None
    return "", (learner, path, how)


def _other_lab_by_content(path: Path, folder: Path, file: str, others: tuple[str, ...]) -> str:
    """Why ``path`` is another lab's file by what it holds ('' when it is not, or cannot be read:
    grading then says why): a zip holding only another lab's file, or Python that defines
    another lab's functions. One bounded read that follows no link; nothing of it runs."""
    try:
        data = read_submission(path, within=folder, max_bytes=intake.read_cap(path)).data
        source = intake.prepare(path.name, data, file, others).source
    except intake.OtherLabFile as exc:
        return str(exc)
    except OSError:
        return ""
    lab = labs.lab_for_source(source)
    if lab is not None and lab.file != file:
        return (f"{path.name} defines lab {lab.name}'s functions: another lab's file; grade it with --lab "
                f"{lab.name.split('-')[0]}")
    return ""


def infer_lab(folder: os.PathLike) -> dict[str, list[str]]:
    """Which lab each entry of a class folder belongs to: lab name -> entries. A learner's
    folder counts for the lab whose file it holds; a ``<learner>.py`` for the lab whose
    functions it defines (:func:`attnlab.labs.lab_for_source`)."""
    return {lab.name: entries for lab, entries in _entries_by_lab(folder).items()}


def _entries_by_lab(folder: os.PathLike) -> "dict[labs.Lab, list[str]]":
    """:func:`infer_lab` with the :class:`~attnlab.labs.Lab` objects as keys."""
    by_lab: "dict[labs.Lab, list[str]]" = {}
    for entry in sorted(Path(folder).iterdir(), key=lambda p: p.name):
        if entry.name.startswith(".") or entry.is_symlink():
            continue
        found = None
        if entry.is_dir():
            held = [lab for lab in labs.LABS if any(intake.is_variant(p.name, lab.file, (".py", ".ipynb"))
                                                    for p in _files(entry))]
            found = held[0] if len(held) == 1 else None
        elif entry.is_file() and entry.suffix.lower() in (".py", ".ipynb"):
            found = _lab_of_file(entry, folder)
        if found is not None:
            by_lab.setdefault(found, []).append(entry.name)
    return by_lab


def _files(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if not p.is_symlink() and p.is_file()]
    except OSError:
        return []


def _lab_of_file(entry: Path, folder: os.PathLike) -> "labs.Lab | None":
    """The lab whose functions a DIR/<learner>.py (or .ipynb) defines: one bounded read that
    follows no link and opens no FIFO, and nothing of it runs. None for what cannot be read."""
    try:
        data = read_submission(entry, within=folder, max_bytes=intake.read_cap(entry)).data
        return labs.lab_for_source(intake.prepare(entry.name, data).source)
    except Exception:  # total: grading says why this learner's file cannot be read
        return None


def plan_class(folder: os.PathLike, out: Optional[os.PathLike] = None, *,
               lab: "labs.Lab | str | None" = None) -> ClassPlan:
    """Find a class's lab and submissions before grading anything.

    Raises:
        ClassRefused: ``folder`` is not a folder, the folders mix labs (without ``lab``), or no
            submission would be graded; the message says why and what to do.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ClassRefused(f"{folder} is not a folder of submissions")
    exclude: dict[str, str] = {}
    if lab is not None:
        the_lab = labs.find_lab(lab)
    else:
        by_lab = _entries_by_lab(folder)
        # a mixed class: the lab most learners hold is graded; the others are skipped, each saying its lab
        # and the command that grades it
        ranked = sorted(by_lab.items(), key=lambda item: (-len(item[1]), labs.LABS.index(item[0])))
        the_lab = ranked[0][0] if ranked else labs.LABS[0]
        for other, entries in ranked[1:]:
            for name in entries:
                exclude[name] = (f"a lab {other.name} submission, not lab {the_lab.name} (most of this class): grade "
                                 f"those with 'attnlab grade {printable(folder)} --lab {other.name.split('-')[0]} "
                                 f"--out OUT-{other.name.split('-')[0]}'")
    submissions, skipped = find_submissions(folder, the_lab.file, exclude)
    if not submissions:
        why = "; ".join(f"{s.name}: {s.reason}" for s in skipped[:5]) or "the folder is empty"
        raise ClassRefused(f"nothing to grade in {folder} for lab {the_lab.name} ({why}). A class folder holds "
                           f"DIR/<learner>/{the_lab.file} (or a notebook, a zip, another spelling of it) or "
                           f"DIR/<learner>.py (.ipynb, .zip); for another lab pass --lab NAME (see 'attnlab labs')")
    if out is not None:
        o, f = Path(out).resolve(), folder.resolve()
        if o == f or f in o.parents or o in f.parents:
            raise ClassRefused(f"--out {out} must be outside the class folder {folder} (and not contain it): "
                               f"learners must not be able to plant or read the grader's files")
    return ClassPlan(the_lab, submissions, skipped)


def learner_key(key: bytes, seed: int, learner: str) -> bytes:
    """The secret one learner's inputs derive from (:mod:`attnlab.grading.inputs`, with each
    exercise and the submission's digest): HMAC-SHA256 of the class's secret ``key`` over the class
    ``seed`` and the learner's name, all 256 bits of it."""
    return hmac.new(key, f"inputs:{seed}:{learner}".encode("utf-8", "surrogateescape"), hashlib.sha256).digest()


def learner_seed(key: bytes, seed: int, learner: str) -> int:
    """The inputs' seed of one learner: HMAC-SHA256 of the class's secret ``key`` over the class
    ``seed`` and the learner's name, as a 62-bit integer. The same for the same key and seed,
    different per learner, and not computable without the key (which no learner sees)."""
    digest = hmac.new(key, f"{seed}:{learner}".encode("utf-8", "surrogateescape"), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") >> 2


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")


def failure_signature(exercise: str, failed: list) -> str:
    """How one exercise failed without a named mistake, the same for every learner who failed it the
    same way: the exercise, its failed checks, and the first failed check's first line with numbers
    and quoted text blanked ("ex4 dk, dv: dk differs from the reference by up to #"). ``failed``: the
    exercise's failed :class:`attnlab.grading.grader.TestResult`, in report order."""
    first = next((line.strip() for line in failed[0].verdict.message.splitlines() if line.strip()), "failed")
    how = _QUOTED.sub("'...'", _NUMBER.sub("#", first))[:160]
    return f"{exercise} {', '.join(r.check for r in failed)}: {how}"


def _unnamed(report: GradeReport) -> dict[str, str]:
    """signature -> one message, for each exercise whose failed checks name no mistake at all."""
    by_exercise: dict[str, list] = {}
    for r in report.results:
        by_exercise.setdefault(r.exercise.id, []).append(r)
    out: dict[str, str] = {}
    for ex_id, results in by_exercise.items():
        failed = [r for r in results if not r.verdict.passed]
        if failed and not any(r.verdict.findings for r in failed):
            out[failure_signature(ex_id, failed)] = failed[0].verdict.message.strip()[:400]
    return out


def _row(learner: str, report: GradeReport, lab: "labs.Lab", folder: str = "") -> Row:
    exercise_list = lab.exercises()
    exercises: dict[str, float] = {ex.id: 0.0 for ex in exercise_list}
    for ex_id, (score, _) in report.exercise_scores().items():
        exercises[ex_id] = score
    messages: dict[str, str] = {}
    for r in report.results:
        for f in r.verdict.findings:
            messages.setdefault(f["code"], f.get("message", ""))
    problem = report.problem
    if report.environment_problem:
        status = "grader environment"
    elif problem.startswith(("no file", "could not read", "could not import", "the file breaks",
                             "[policy] the file breaks")):
        status = "could not be read"
    elif any("total time limit" in r.verdict.message or "did not finish within" in r.verdict.message
             for r in report.results):  # the messages of grader.grade and the sandbox's time limits
        status = "timed out"
    else:
        status = "graded"
    return Row(learner, report.score, report.max_score or sum(ex.max_score for ex in exercise_list),
               exercises, sorted(messages), report.seed, round(report.elapsed_s, 2), status, messages,
               folder or learner, problem.strip()[:PROBLEM_CHARS] if status != "graded" and problem else "",
               report.source_sha256, report.shape_sha256, run=report.run_id,
               unnamed=_unnamed(report) if status in ("graded", "timed out") else {})


PROBLEM_CHARS = 2000  # of a whole-file problem kept in the gradebook (a SyntaxError with its line is ~200)


def flag_similar(rows: list[Row], stub_shape: str = "") -> None:
    """Mark each row with the learners whose submission is byte-identical or near-identical
    (the same :func:`~attnlab.grading.static.shape_digest`: only names, strings, comments and
    docstrings differ). The lab's own stub (``stub_shape``), which everyone starts from, is
    not a match."""
    by_key: dict[str, list[Row]] = {}
    for r in rows:
        key = r.shape or r.sha256
        if key and key != stub_shape:
            by_key.setdefault(key, []).append(r)
    for group in by_key.values():
        if len(group) > 1:
            for r in group:
                r.similar = sorted(o.learner for o in group if o is not r)


PRIVATE_DIR = ".attnlab"  # in OUT (0700): the instructor's state; a learner is handed only their own folder
KEY_FILE = f"{PRIVATE_DIR}/resume-key"  # the HMAC key of this gradebook's rows
CLASS_KEY_FILE = f"{PRIVATE_DIR}/class-key"  # the key learners' inputs are derived from (learner_key)
ROWS_DIR = f"{PRIVATE_DIR}/rows"  # each learner's signed row, with their seed: never in their folder
_OLD_NAMES = {KEY_FILE: ".attnlab-resume-key", CLASS_KEY_FILE: ".attnlab-class-key"}  # before issue 61


def private_dir(out: Path) -> Path:
    """OUT's private part (:data:`PRIVATE_DIR`, 0700), made when missing."""
    path = Path(out) / PRIVATE_DIR
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _resume_key(out: Path, name: str = KEY_FILE) -> bytes:
    """The key ``name`` of this OUT (the rows' signing key, the class key), made on the first run (0600)."""
    private_dir(out)
    path = out / name
    old = out / _OLD_NAMES.get(name, name)
    if not path.exists() and old.is_file() and not old.is_symlink():  # a gradebook made before: its key moves in
        os.replace(old, path)
    try:
        key = path.read_bytes()
        if len(key) == 32:
            return key
    except OSError:
        pass
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def class_key(out: os.PathLike) -> bytes:
    """The secret class key of the gradebook in ``out`` (:data:`CLASS_KEY_FILE`, 0600, made on the
    first run): with the class seed, it decides every learner's inputs (:func:`learner_seed`)."""
    return _resume_key(Path(out), CLASS_KEY_FILE)


def _signature(key: bytes, row: dict, source_digest: str) -> str:
    """HMAC-SHA256 over the row and the SHA-256 of the bytes that were graded (the one read,
    :attr:`GradeReport.source_sha256`): a row.json that the grader did not write, or one for
    other bytes than the file now holds, does not verify."""
    body = json.dumps({"row": row, "source": source_digest}, sort_keys=True, ensure_ascii=False).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def _source_digest(path: Path, within: Optional[Path] = None) -> str:
    """The SHA-256 of the submission as it is now (one read, as the grader reads it); '' if unreadable."""
    try:
        return read_submission(path, within=within, max_bytes=intake.read_cap(path)).sha256
    except OSError:
        return ""


def _done_row(out: Path, sub: Submission, key: bytes, within: Optional[Path] = None) -> Optional[Row]:
    """A learner finished by an earlier run (their row is written last, after results.json),
    trusted only when its signature verifies with this OUT's key for this submission's content."""
    try:
        data = json.loads(_row_path(out, sub).read_text(encoding="utf-8"))
        signature = data.pop("hmac")
        current = _source_digest(sub.path, within)
        if not current or not hmac.compare_digest(str(signature), _signature(key, data, current)):
            return None
        row = Row(**data)
        return row if row.learner == sub.learner else None
    except (OSError, ValueError, TypeError):
        return None


def _row_path(out: Path, sub: Submission) -> Path:
    """Where the learner's signed row lives: OUT's private part, never their own folder."""
    return Path(out) / ROWS_DIR / f"{sub.folder}.json"


def grade_class(folder: os.PathLike, out: os.PathLike, *, jobs: int = 2, seed: Optional[int] = None,
                resume: bool = False, limits: Limits = Limits(), total_timeout_s: float = 60.0,
                sandbox: str = "auto", progress: Optional[Callable[[int, int, str], None]] = None,
                lab: "labs.Lab | str | None" = None, plan: Optional[ClassPlan] = None) -> ClassResult:
    """Grade every submission in ``folder`` into ``out`` (see the module docstring);
    ``plan``: :func:`plan_class`'s answer when the caller has it already (not found again).

    Raises :class:`~attnlab.grading.sandbox.pool.SandboxUnavailable` when ``sandbox='auto'`` and
    bwrap is missing: other people's code is never run without the OS sandbox unless
    ``sandbox='none'`` says so.
    """
    t0 = time.perf_counter()
    if sandbox == "auto" and pool.bwrap_path() is None:
        raise pool.SandboxUnavailable(f"refusing to grade a class without the OS sandbox: "
                                        f"{pool.HOW_TO_GET_BWRAP}; or pass --no-sandbox")
    plan = plan if plan is not None else plan_class(folder, out, lab=lab)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    the_lab, submissions, skipped = plan.lab, plan.submissions, plan.skipped
    write_text(out / "skipped.txt", "".join(f"{s.name}: {s.reason}\n" for s in skipped))
    base = seed if seed is not None else secrets.randbelow(2**31)
    key = _resume_key(out)
    secret = class_key(out)
    (private_dir(out) / "rows").mkdir(mode=0o700, exist_ok=True)
    rows: dict[str, Row] = {}
    todo = []
    for sub in submissions:
        done = _done_row(out, sub, key, Path(folder)) if resume else None
        if done is not None:
            rows[sub.learner] = done
        else:
            todo.append(sub)
    lock = threading.Lock()
    finished = [len(rows)]

    def one(sub: Submission) -> None:
        try:
            graded(sub)
        except Exception as exc:  # one learner's grading must never stop the class
            row = Row(sub.learner, 0.0, sum(ex.max_score for ex in the_lab.exercises()), {}, [], 0, 0.0,
                      "grader error", {}, sub.folder, f"the grader failed on this submission: {type(exc).__name__}")
            with lock:
                rows[sub.learner] = row
                finished[0] += 1
                if progress:
                    progress(finished[0], len(submissions), f"{sub.learner}: grader error")

    def graded(sub: Submission) -> None:
        folder_out = out / sub.folder
        folder_out.mkdir(exist_ok=True)
        _row_path(out, sub).unlink(missing_ok=True)
        (folder_out / "row.json").unlink(missing_ok=True)  # where an earlier attnlab kept it, seed and all
        results = folder_out / "results.json"

        def checkpoint(report: GradeReport) -> None:
            write_json(results, report.to_gradescope())

        report = grade(sub.path, limits=limits, total_timeout_s=total_timeout_s, seed=learner_seed(secret, base, sub.learner),
                       inputs_key=learner_key(secret, base, sub.learner), sandbox=sandbox, untrusted=sandbox != "none",
                       checkpoint=checkpoint, lab=the_lab, within=folder,
                       note=f"graded {sub.how}" if sub.how else "")
        checkpoint(report)
        write_feedback(folder_out / "feedback.html", sub.learner, report)
        row = _row(sub.learner, report, the_lab, sub.folder)
        # signed over the digest of the bytes that were graded, never over a second read
        signed = {**asdict(row), "hmac": _signature(key, asdict(row), report.source_sha256)}
        write_atomically(_row_path(out, sub), json.dumps(signed, ensure_ascii=False) + "\n")
        with lock:
            rows[sub.learner] = row
            finished[0] += 1
            if progress:
                progress(finished[0], len(submissions), f"{sub.learner} {row.total:g}/{row.max_total:g}")

    # one pre-imported template forks each submission's sandbox (its own namespaces, cgroup,
    # /tmp): torch is imported once, not once per learner; where it cannot work here, one
    # bwrap per submission, the next one importing torch while the current one grades
    with pool.class_template(sandbox) as template:
        if template.active:
            sandboxes = ("one OS sandbox per submission (own user, mount, pid, network and IPC namespaces, "
                         "private /tmp, its own cgroup), forked from a pre-imported template")
        elif sandbox == "none":
            sandboxes = "no OS sandbox (--no-sandbox): process limits only"
        else:
            sandboxes = f"one bwrap OS sandbox per submission, each importing torch ({template.reason})"
            pool.keep_spare(True)
        try:
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as workers:
                for future in [workers.submit(one, sub) for sub in todo]:
                    future.result()
        finally:
            pool.keep_spare(False)
    ordered = [rows[s.learner] for s in submissions if s.learner in rows]
    flag_similar(ordered, _stub_shape(the_lab))
    write_csv(ordered, out / "grades.csv", the_lab.exercises())
    from attnlab.grading.classroom.report import write_report

    result = ClassResult(ordered, skipped, out, time.perf_counter() - t0, the_lab, sandboxes)
    write_report(result, out / "report.html")
    return result


def _stub_shape(lab: "labs.Lab") -> str:
    """The shape of the lab's stub file (every learner starts from it), '' where it is not here."""
    from attnlab.grading.static import check_source, shape_digest

    root = labs.labs_root()
    stub = root / lab.name / lab.file if root is not None else None
    try:
        return shape_digest(check_source(stub.read_bytes()).tree) if stub is not None else ""
    except OSError:
        return ""


def write_feedback(path: Path, learner: str, report: GradeReport) -> None:
    """The learner's own page: what ``attnlab grade`` prints them (and Gradescope shows them),
    escaped, for the class report to link to."""
    import html

    text = html.escape(report.to_text())
    write_text(path, "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
                           "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src "
                           "'unsafe-inline'\"><title>feedback: " + html.escape(learner) + "</title><style>body{font:14px/"
                           "1.45 system-ui,sans-serif;margin:2em auto;max-width:60em;padding:0 1em}pre{white-space:"
                           "pre-wrap;overflow-wrap:anywhere;font:13px/1.4 ui-monospace,monospace}</style></head><body>"
                           f"<h1>{html.escape(learner)}: {report.score:g}/{report.max_score:g}</h1>"
                           "<p>What this learner reads (attnlab grade's report, as Gradescope shows it).</p>"
                           f"<pre>{text}</pre><p><a href='../report.html'>back to the class</a></p></body></html>\n")


def write_csv(rows: list[Row], path: Path, exercises: list) -> None:
    """The gradebook: one row per learner, sorted; points per exercise as columns."""
    ex_ids = [ex.id for ex in exercises]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["learner", "total", "max", *ex_ids, "mistakes", "seed", "seconds", "status", "folder",
                    "similar_to", "run"])
        for r in sorted(rows, key=lambda r: r.learner):
            w.writerow([csv_cell(r.learner), f"{r.total:g}", f"{r.max_total:g}",
                        *(f"{r.exercises.get(e, 0):g}" for e in ex_ids), " ".join(r.mistakes), r.seed,
                        f"{r.seconds:.2f}", r.status, csv_cell(r.folder or r.learner),
                        csv_cell(" ".join(r.similar)), r.run])
    os.replace(tmp, path)


def csv_cell(text: str) -> str:
    """A cell a spreadsheet shows as text, sanitised (:func:`attnlab.grading.output.sanitise`):
    one that begins with = + - @, a tab or a CR gets a leading apostrophe (OWASP's advice
    against formula injection)."""
    return "'" + sanitise(text) if text[:1] in ("=", "+", "-", "@", "\t", "\r") else sanitise(text)
