"""Intake: which file in a learner's folder is the submission, and its Python source.

One rule for ``attnlab grade DIR`` and the Gradescope bundle (:func:`choose`), in order:

1. the lab's file, exactly (``attention.py``);
2. the lab's file in another case (``Attention.py``);
3. an LMS re-download of it (``attention (1).py``, ``attention-2.py``, ``attention_3.py``);
4. a notebook of that name (``attention.ipynb``, same variants);
5. the only ``.py`` file (else the only ``.ipynb``), unless it is another lab's file;
6. a ``.zip`` archive (the only one), in which the same rules choose.

The chosen file is read once (:func:`attnlab.grading.submission.read_submission`) and turned
into Python (:func:`prepare`):

* a notebook is parsed here as bounded JSON; its code cells are joined, line numbers map back
  to ``cell N, line M`` (:class:`LineMap`). Magics (``%``) and shell lines (``!``) are refused
  with their cell and line, like any construct the lab's rule refuses; top-level statements
  other than imports, definitions and constants (the cells that try things out) are left out
  and said so, since the grader runs only what the exercises call;
* a zip archive is read in memory: no member path outside the archive's folder, no links,
  no zip inside it, at most :data:`ZIP_MAX_MEMBERS` members, and the chosen member read up to
  the submission's own size cap, whatever its header claims.

Every function here is total on hostile input: a folder, archive or notebook it cannot use is
a reason (:class:`Choice.why`, :class:`~attnlab.grading.submission.Unreadable`), never another
exception; learner trees are descended at most :data:`MAX_DEPTH` folders. Another lab's file,
by its name in any spelling (:func:`other_lab_file`), is never taken for this lab's
(:class:`OtherLabFile`). Nothing here runs the learner's code.
"""

from __future__ import annotations

import ast
import io
import json
import re
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from attnlab.grading.submission import MAX_SOURCE_BYTES, Unreadable

__all__ = ["Choice", "choose", "Prepared", "LineMap", "prepare", "read_cap", "ZIP_MAX_MEMBERS", "ZIP_MAX_BYTES", "is_variant",
           "other_lab_file", "OtherLabFile", "MAX_DEPTH"]

ZIP_MAX_MEMBERS = 500  # a lab folder zipped with its walkthrough and checkpoints holds a few dozen
ZIP_MAX_BYTES = 8 << 20  # the archive itself: a lab's files with a notebook's outputs are well under
MAX_DEPTH = 8  # folders below a learner's own that are searched (an LMS export nests one or two)


class OtherLabFile(Unreadable):
    """The submission is another lab's file (``file``: that lab's file name), not this lab's."""

    def __init__(self, message: str, file: str) -> None:
        super().__init__(message)
        self.file = file


@dataclass(frozen=True)
class Choice:
    """The submission chosen in a folder: ``path`` (None: nothing to grade), and ``how`` it was
    chosen in words ('' when it is the lab's file exactly), or ``why`` there is none."""

    path: Optional[Path]
    how: str = ""
    why: str = ""


def is_variant(name: str, file: str, suffixes: tuple[str, ...] = (".py",)) -> Optional[str]:
    """How ``name`` is the lab's ``file`` (``attention.py``) under another spelling: 'exact',
    'case', 'lms' (a re-download: ``attention (1).py``) or None."""
    stem = Path(file).stem
    for suffix in suffixes:
        if name == stem + suffix:
            return "exact"
        if name.lower() == (stem + suffix).lower():
            return "case"
        if re.fullmatch(rf"{re.escape(stem)}\s*(?:\(\d{{1,3}}\)|[-_ ]\d{{1,3}})\s*{re.escape(suffix)}", name,
                        flags=re.IGNORECASE):
            return "lms"
    return None


_HOW = {"case": "named like the lab's file in another case", "lms": "an LMS re-download of the lab's file"}


def other_lab_file(name: str, other_files: tuple[str, ...]) -> Optional[str]:
    """The other lab's file that ``name`` is, in any spelling (:func:`is_variant`, ``.py`` or
    ``.ipynb``), or None."""
    for other in other_files:
        if is_variant(name, other, (".py", ".ipynb")):
            return other
    return None


def _other_lab_reason(names: list[str], other: str) -> str:
    from attnlab import labs

    lab = next((lab for lab in labs.LABS if lab.file == other), None)
    which = f"lab {lab.name}'s {other}" if lab is not None else other
    return (f"it holds {', '.join(names)}: another lab's file ({which}); grade it with --lab "
            f"{lab.name.split('-')[0] if lab is not None else 'NN'}")


def _regular(p: Path) -> bool:
    try:
        return stat.S_ISREG(p.lstat().st_mode)
    except OSError:
        return False


def choose(folder: Path, file: str, other_files: tuple[str, ...] = (), depth: int = 0) -> Choice:
    """The learner's submission in ``folder`` for a lab whose file is ``file`` (rules in the
    module's docstring); ``other_files``: the other labs' files, never taken for this one (in
    any spelling). Looks only (``lstat``): a link is never taken, and the one read refuses what
    is not a regular file. Total: any folder gives a :class:`Choice`."""
    if depth > MAX_DEPTH:
        return Choice(None, why=f"its files are nested more than {MAX_DEPTH} folders deep: put the lab's file "
                                "at the top of the learner's folder")
    try:
        entries = sorted((p for p in folder.iterdir() if not p.name.startswith(".")), key=lambda p: p.name)
    except (OSError, ValueError) as exc:
        return Choice(None, why=f"the folder cannot be listed ({getattr(exc, 'strerror', None) or type(exc).__name__})")
    files = [p for p in entries if _regular(p)]
    if not entries:
        return Choice(None, why="the folder is empty")
    for kind in ("exact", "case", "lms"):
        hits = [p for p in files if is_variant(p.name, file) == kind]
        if len(hits) == 1:
            return Choice(hits[0], "" if kind == "exact" else f"{hits[0].name}: {_HOW[kind]} ({file})")
        if len(hits) > 1:
            names = ", ".join(p.name for p in hits)
            return Choice(None, why=f"it holds {len(hits)} files that could be {file} ({names}): keep one")
    notebooks = [p for p in files if is_variant(p.name, file, (".ipynb",))]
    if len(notebooks) == 1:
        return Choice(notebooks[0], f"{notebooks[0].name}: the notebook of the lab's file (its code cells)")
    others = [p for p in files if other_lab_file(p.name, other_files)]
    files = [p for p in files if p not in others]
    py = [p for p in files if p.suffix.lower() == ".py"]
    if others and not py:
        return Choice(None, why=_other_lab_reason([p.name for p in others], other_lab_file(others[0].name, other_files)))
    if len(py) == 1:
        return Choice(py[0], f"{py[0].name}: the folder's only .py file")
    if len(py) > 1:
        names = ", ".join(p.name for p in py[:5]) + (", ..." if len(py) > 5 else "")
        return Choice(None, why=f"it holds {len(py)} .py files and none is {file} ({names}): rename the one to "
                                "grade")
    ipynb = [p for p in files if p.suffix.lower() == ".ipynb"]
    if len(ipynb) == 1:
        return Choice(ipynb[0], f"{ipynb[0].name}: the folder's only notebook (its code cells)")
    zips = [p for p in files if p.suffix.lower() == ".zip"]
    if len(zips) == 1:
        return Choice(zips[0], f"{zips[0].name}: a zip archive (the same rules choose inside it)")
    subfolders = [p for p in entries if p.is_dir() and not p.is_symlink()]
    if not files and not others and len(subfolders) == 1:  # an export that nests the learner's files down
        inner = choose(subfolders[0], file, other_files, depth + 1)
        if inner.path is not None:
            return Choice(inner.path, f"{subfolders[0].name}/{inner.how or inner.path.name}")
        return Choice(None, why=f"{subfolders[0].name}/: {inner.why}")
    if not files:
        return Choice(None, why="the folder holds no file (only folders or links)")
    names = ", ".join(p.name for p in files[:5]) + (", ..." if len(files) > 5 else "")
    return Choice(None, why=f"no {file}, .py, .ipynb or .zip file in it (it holds {names})")


# --------------------------------------------------------------------------- notebooks
@dataclass
class LineMap:
    """Line ``n`` (1-based) of the Python made from a notebook is ``cell c, line m`` of it."""

    cells: list[tuple[int, int]] = field(default_factory=list)

    def where(self, line: int) -> Optional[str]:
        if 1 <= line <= len(self.cells):
            c, m = self.cells[line - 1]
            return f"cell {c}, line {m}"
        return None

    def rewrite(self, text: str, file_name: str) -> str:
        """Every ``line N`` of the Python in ``text`` (tracebacks of ``file_name``, the static
        check's and the parser's messages) as ``cell C, line M``, in one pass."""
        def one(m: re.Match) -> str:
            where = self.where(int(m.group(2)))
            return f"{m.group(1) or ''}{where}" if where else m.group(0)

        return re.sub(rf'(File "{re.escape(file_name)}", )?\bline (\d+)\b', one, text)


@dataclass
class Prepared:
    """The Python to grade: ``source`` (bytes), what it was made from (``kind``: 'py',
    'ipynb'), the notebook's :class:`LineMap`, lines ``refused`` before anything runs
    (magics, shell lines, a cell that does not parse), and ``notes`` for the learner."""

    source: bytes
    kind: str = "py"
    lines: Optional[LineMap] = None
    refused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


_KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)


def _constant(node: ast.AST) -> bool:
    """A constant: a literal (``EXERCISE_2_ANSWER = "B"``), ``float("-inf")``, a dotted name
    (``math.pi``, ``torch.float32``), or arithmetic of those: what a module's constants are.
    (The static check still judges it as import-time code.)"""
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            if not (isinstance(n.func, ast.Name) and n.func.id in ("float", "int") and not n.keywords
                    and all(isinstance(a, ast.Constant) for a in n.args)):
                return False
        elif not isinstance(n, (ast.Constant, ast.Name, ast.Attribute, ast.Load, ast.UnaryOp, ast.BinOp, ast.operator,
                                ast.unaryop, ast.Tuple, ast.List, ast.Dict, ast.Set)):
            return False
    return True


def _kept(node: ast.stmt) -> bool:
    if isinstance(node, _KEPT):
        return True
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _constant(node.value):
        return True
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _environment_line(node: ast.stmt) -> bool:
    """The environment set-up of the labs' own walkthroughs: ``import os`` and
    ``os.environ["NAME"] = "value"`` (lab 05's ``TRITON_INTERPRET``). The grader sets each lab's
    environment itself; in a notebook these lines are left out rather than refused."""
    if isinstance(node, ast.Import):
        return all(a.name == "os" and a.asname is None for a in node.names)
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript):
        t = node.targets[0]
        return (isinstance(t.value, ast.Attribute) and t.value.attr == "environ" and isinstance(t.value.value, ast.Name)
                and t.value.value.id == "os" and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str))
    return False


def notebook_to_python(data: bytes) -> Prepared:
    """The code cells of a notebook (its JSON, at most the submission's size) as Python."""
    from attnlab.grading.static import parse

    try:
        nb = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Unreadable(f"the notebook is not valid JSON ({type(exc).__name__}): save it again from Jupyter, or "
                         "submit the .py file") from None
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if not isinstance(cells, list):
        raise Unreadable("the notebook has no list of cells: save it again from Jupyter, or submit the .py file")
    out_lines: list[str] = []
    line_map = LineMap()
    refused: list[str] = []
    left_out: list[int] = []
    environment: list[int] = []
    for c, cell in enumerate(cells, start=1):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        text = "".join(s for s in src if isinstance(s, str)) if isinstance(src, list) else src
        if not isinstance(text, str):
            continue
        lines = text.splitlines()
        for m, line in enumerate(lines, start=1):
            bare = line.strip()
            if bare.startswith(("%", "!")) or "get_ipython(" in bare:
                what = "a shell line" if bare.startswith("!") else "an IPython magic"
                refused.append(f"cell {c}, line {m}: {what} ({bare[:60]}) is not Python; the grader runs plain "
                               "Python only: delete it, or move it to a cell you do not submit")
        if any(r.startswith(f"cell {c},") for r in refused):
            continue
        try:
            tree = parse(text)
        except (SyntaxError, ValueError) as exc:
            refused.append(f"cell {c}, line {getattr(exc, 'lineno', 0) or 1}: {type(exc).__name__}: "
                           f"{getattr(exc, 'msg', exc)}")
            continue
        except (RecursionError, MemoryError):
            refused.append(f"cell {c}: too deeply nested to parse")
            continue
        for node in tree.body:
            if _environment_line(node):
                environment.append(c)
                continue
            if not _kept(node):
                left_out.append(c)
                continue
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            for m in range(start, node.end_lineno + 1):
                out_lines.append(lines[m - 1])
                line_map.cells.append((c, m))
            out_lines.append("")
            line_map.cells.append((c, node.end_lineno))
    notes = []
    if environment:
        numbers = sorted(set(environment))
        notes.append(f"the environment lines of cell{'s' if len(numbers) > 1 else ''} "
                     f"{', '.join(str(c) for c in numbers[:8])} (import os, os.environ[...] = ...) are left out: the "
                     "grader sets each lab's environment itself")
    if left_out:
        numbers = sorted(set(left_out))
        shown = ("cell " if len(numbers) == 1 else "cells ") + ", ".join(str(c) for c in numbers[:8])
        notes.append(f"from the notebook, the grader takes the imports, definitions and constants of its code cells; "
                     f"the other top-level statements ({shown}: calls, prints, experiments) are left out")
    return Prepared(("\n".join(out_lines) + "\n").encode(), "ipynb", line_map, refused, notes)


# --------------------------------------------------------------------------- zip archives
_ZIP_MAGIC = b"PK\x03\x04"


def _zip_member(data: bytes, file: str, other_files: tuple[str, ...]) -> tuple[str, bytes]:
    """``(member name, its bytes)``: the member the rules choose inside a zip archive. Total:
    whatever the archive holds (flags, methods, CRCs, names, sizes), anything wrong is
    :class:`Unreadable` with why."""
    try:
        return _zip_member_unchecked(data, file, other_files)
    except Unreadable:
        raise
    except Exception as exc:  # zipfile's errors for a hostile archive: BadZipFile, NotImplementedError, ...
        why = "it is encrypted" if "encrypted" in str(exc) or "password" in str(exc) else f"{type(exc).__name__}: {exc}"
        raise Unreadable(f"the zip archive cannot be read ({why}): zip the lab's file again, without a password")\
            from None


def _zip_member_unchecked(data: bytes, file: str, other_files: tuple[str, ...]) -> tuple[str, bytes]:
    archive = zipfile.ZipFile(io.BytesIO(data))
    infos = archive.infolist()
    if len(infos) > ZIP_MAX_MEMBERS:
        raise Unreadable(f"the zip archive has {len(infos)} members (at most {ZIP_MAX_MEMBERS}): submit the lab's "
                         f"file ({file}) alone")
    usable = []
    for info in infos:
        name = info.filename
        parts = Path(name).parts
        if name.startswith(("/", "\\")) or ".." in parts or re.match(r"^[A-Za-z]:", name):
            raise Unreadable(f"the zip archive has a member outside its folder ({name!r}): zip the lab's file again")
        if stat.S_ISLNK(info.external_attr >> 16):
            continue  # a link is never followed, in an archive either
        if info.is_dir() or not parts or "__MACOSX" in parts or parts[-1].startswith("."):
            continue
        if len(parts) > 3:
            continue
        usable.append(info)
    pick = None
    for kind in ("exact", "case", "lms"):
        hits = [i for i in usable if is_variant(Path(i.filename).name, file) == kind]
        if len(hits) > 1:
            raise Unreadable(f"the zip archive holds {len(hits)} files that could be {file}: keep one")
        if hits:
            pick = hits[0]
            break
    if pick is None:
        others = [i for i in usable if other_lab_file(Path(i.filename).name, other_files)]
        notebooks = [i for i in usable if is_variant(Path(i.filename).name, file, (".ipynb",))]
        py = [i for i in usable if i.filename.lower().endswith(".py") and i not in others]
        zips = [i for i in usable if i.filename.lower().endswith(".zip")]
        if len(notebooks) == 1:
            pick = notebooks[0]
        elif len(py) == 1:
            pick = py[0]
        elif others and not py:
            other = other_lab_file(Path(others[0].filename).name, other_files) or ""
            raise OtherLabFile(f"the zip archive {_other_lab_reason([i.filename for i in others], other)}", other)
        elif zips:
            raise Unreadable(f"the zip archive holds a zip archive inside it ({zips[0].filename}), which is not "
                             f"opened: zip the lab's file ({file}) itself")
        else:
            raise Unreadable(f"the zip archive holds no {file} and not exactly one .py file")
    with archive.open(pick) as member:  # read up to the cap, whatever the header says the size is
        body = member.read(MAX_SOURCE_BYTES + 1)
    if len(body) > MAX_SOURCE_BYTES:
        raise Unreadable(f"{pick.filename} in the zip archive is larger than {MAX_SOURCE_BYTES:,} bytes")
    if body[:4] == _ZIP_MAGIC:
        raise Unreadable(f"{pick.filename} in the zip archive is a zip archive inside it, which is not opened: zip "
                         f"the lab's file ({file}) itself")
    return pick.filename, body


def read_cap(path: Path) -> int:
    """The most bytes the one read takes: a lab file's cap, or :data:`ZIP_MAX_BYTES` for a
    notebook (its outputs are kept in it) or an archive."""
    return ZIP_MAX_BYTES if Path(path).suffix.lower() in (".ipynb", ".zip") else MAX_SOURCE_BYTES


def prepare(name: str, data: bytes, file: str = "attention.py", other_files: tuple[str, ...] = ()) -> Prepared:
    """The Python to grade from a submission's bytes (one read): a ``.py`` file as it is, a
    notebook's code cells, or the file the rules choose inside a zip archive (never a zip in it).

    Raises:
        Unreadable: a notebook that is not one, an archive that cannot be read or breaks the
            rules above; the message says why. :class:`OtherLabFile` (an Unreadable): the
            archive holds only another lab's file. Nothing else, whatever the bytes.
    """
    try:
        suffix = Path(name).suffix.lower()
        if suffix == ".zip" or data[:4] == _ZIP_MAGIC:
            member, body = _zip_member(data, file, other_files)
            inner = prepare(member, body, file, other_files)
            inner.notes.insert(0, f"graded {member} from the zip archive {name}")
            return inner
        if suffix == ".ipynb":
            made = notebook_to_python(data)
            if len(made.source) > MAX_SOURCE_BYTES:
                raise Unreadable(f"the notebook's code is larger than {MAX_SOURCE_BYTES:,} bytes")
            return made
        return Prepared(data)
    except Unreadable:
        raise
    except Exception as exc:  # a parser's failure on hostile bytes is that learner's reason, never a traceback
        raise Unreadable(f"the submission could not be read ({type(exc).__name__}): submit the lab's file "
                         f"({file}) as plain Python") from None
