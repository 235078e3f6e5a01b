"""The labs of track 1, and how a learner gets them: ``attnlab labs`` / ``attnlab labs get NAME``.

A lab is one module of this package (``lab01_attention``, ``lab02_masks``, ``lab03_multihead``,
``lab04_flash``, ``lab05_triton``: its :class:`Lab` as ``LAB``, its exercises as ``EXERCISES``, written in
:mod:`attnlab.grading.exercise`) plus one folder of materials (``labs/track1/NN-name/``).
Adding a lab is adding both and naming the module in :data:`LAB_MODULES`; nothing under
``attnlab.grading`` changes.

A lab is a folder with a brief (``README.md``), the stubs the learner fills in
(``attention.py``, ``TODO(exN)`` markers) and a walkthrough notebook (``walkthrough.py``, paired
with ``walkthrough.ipynb``); its ``solutions/`` stay with the grader and are never copied
out. The materials are read from attnlab's own checkout (``labs/`` beside ``src/``) or, in an
installed wheel, from ``<prefix>/share/attnlab/labs`` where the wheel puts them, so
``pip install attnlab`` alone is enough to start.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["Lab", "LABS", "LAB_MODULES", "LAB_FILES", "labs_root", "find_lab", "get_lab", "get_solution",
           "lab_for_path", "lab_for_source", "lab_file_in", "NoLabFile"]


@dataclass(frozen=True)
class Lab:
    """One lab: its materials' folder (``labs/track1/<name>/``) and its module here
    (``attnlab.labs.labNN_*``, which defines this object as ``LAB`` and its checks as ``EXERCISES``).
    The grader, the class report, the Gradescope bundle and ``labs get`` read only this."""

    name: str  # the folder under labs/track1/
    title: str
    covers: str
    file: str = "attention.py"  # the learner's file (stubs), graded by attnlab grade
    module: str = ""  # the module whose EXERCISES grade it (its own __name__)
    needs: tuple[str, ...] = ("jaxtyping",)  # imports of the stubs beyond torch: the 'lab' extra
    # names beyond the shared tensor arithmetic (attnlab.grading.static.COMMON_ATTRIBUTES) that
    # this lab's files may use as attributes or from-imports: the static check's allow-list
    allowed_names: tuple[str, ...] = ()
    # modules beyond torch/math/typing/jaxtyping this lab's file may import, each with the only
    # names it may use from them (lab 05: triton.jit, triton.language's kernel operations): the
    # static check's allow-list for them, deny by default
    modules: tuple[tuple[str, tuple[str, ...]], ...] = ()
    decorators: tuple[str, ...] = ()  # beyond the shared ones (lab 05: triton.jit)
    extra: str = "lab"  # the pip extra that installs `needs`
    rule: str = "This lab builds attention from scratch: torch's softmax and SDPA are the oracles, not the answer"

    @property
    def files(self) -> tuple[str, ...]:
        """What ``labs get`` copies: the brief, the stubs, the walkthrough; never solutions/."""
        return ("README.md", self.file, "walkthrough.py", "walkthrough.ipynb")

    @property
    def checks(self) -> str:
        """The module of the lab's checks (the name this field had before the labs were a package)."""
        return self.module

    def exercises(self) -> list:
        """The lab's :class:`attnlab.grading.exercise.Exercise` list, in report order."""
        return importlib.import_module(self.module).EXERCISES


# the registered labs, in order; a lab is one module of this package plus one folder of materials
LAB_MODULES = ("lab01_attention", "lab02_masks", "lab03_multihead", "lab04_flash", "lab05_triton")
LABS: tuple[Lab, ...] = ()  # filled below, once Lab exists for the lab modules to use


def labs_root() -> Optional[Path]:
    """Where the lab folders are: the checkout's ``labs/track1`` or the installed copy."""
    checkout = Path(__file__).resolve().parents[3] / "labs" / "track1"
    if checkout.is_dir():
        return checkout
    installed = Path(sys.prefix) / "share" / "attnlab" / "labs" / "track1"
    return installed if installed.is_dir() else None


def find_lab(name: "str | Lab") -> Lab:
    """The lab called ``name`` (its full name, or its number: ``01``, ``1``); a :class:`Lab` is itself."""
    if isinstance(name, Lab):
        return name
    for lab in LABS:
        if name in (lab.name, lab.name.split("-")[0], lab.name.split("-")[0].lstrip("0")):
            return lab
    raise KeyError(f"no lab {name!r}; the labs are: {', '.join(lab.name for lab in LABS)} (see 'attnlab labs')")




class NoLabFile(LookupError):
    """No lab file (or more than one) in a folder; the message says what to do."""


def lab_file_in(folder: os.PathLike) -> tuple[Lab, Path]:
    """The lab file a learner is working on in ``folder`` (``attnlab grade`` with no path):
    the one of :data:`LAB_FILES` that is there.

    Raises:
        NoLabFile: none is there, or several are (the message lists them and says how to choose).
    """
    folder = Path(folder)
    present = [(lab, folder / lab.file) for lab in LABS if (folder / lab.file).is_file()]
    if len(present) == 1:
        return present[0]
    if present:
        raise NoLabFile(f"{folder} holds more than one lab's file ({', '.join(p.name for _, p in present)}); "
                        f"say which to grade, e.g. 'attnlab grade {present[0][1].name}'")
    hint = ("start a lab with 'attnlab labs get 01' and run 'attnlab grade' inside its folder, "
            "or pass the file: 'attnlab grade path/to/attention.py'")
    raise NoLabFile(f"no lab file in {folder} (looked for {', '.join(LAB_FILES)}): {hint}")


def lab_for_source(source: bytes) -> Optional[Lab]:
    """The lab whose exercises' functions a file defines most of (None when it defines none,
    or the file does not parse): how a ``DIR/<learner>.py`` submission names its lab."""
    import ast

    from attnlab.grading.static import parse  # one lock for every parse (CPython 3.11's parser and threads)

    try:
        tree = parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    best, best_n = None, 0
    for lab in LABS:
        n = len(defined & {ex.function for ex in lab.exercises()})
        if n > best_n:
            best, best_n = lab, n
    return best


def lab_for_path(path: os.PathLike, source: Optional[bytes] = None) -> Lab:
    """The lab a learner's file belongs to: by its folder's name (``.../02-masks/masks.py``),
    else by its file name (``masks.py``: each lab's is its own), else by the functions it
    defines, else lab 01."""
    path = Path(path)
    for lab in LABS:
        if path.parent.name == lab.name or (path.parent.name == "solutions" and path.parent.parent.name == lab.name):
            return lab
    for lab in LABS:
        if path.name == lab.file:
            return lab
    if source is None:  # the grader passes the bytes it read once; it never reads the path again
        try:
            from attnlab.grading.submission import read_submission

            source = read_submission(path).data
        except OSError:
            source = b""
    found = lab_for_source(source) if source else None
    return found if found is not None else LABS[0]


def get_lab(name: str, dest: Optional[os.PathLike] = None) -> Path:
    """Copy a lab's brief, stubs and walkthrough (never its solutions) into ``dest``
    (default ``./<lab name>``); refuses to overwrite a file that is already there."""
    lab = find_lab(name)
    root = labs_root()
    if root is None or not (root / lab.name).is_dir():
        raise FileNotFoundError(f"the materials of lab {lab.name} are not installed (looked in the checkout's "
                                f"labs/ and in {Path(sys.prefix) / 'share' / 'attnlab'}); reinstall attnlab")
    dest = Path(dest) if dest is not None else Path.cwd() / lab.name
    sources = [root / lab.name / f for f in lab.files if (root / lab.name / f).is_file()]
    clashes = [str(dest / s.name) for s in sources if (dest / s.name).exists()]
    if clashes:
        raise FileExistsError(f"not overwriting {', '.join(clashes)}: choose another folder or move them away")
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for s in sources:
            shutil.copyfile(s, dest / s.name)
    except OSError as exc:  # a folder that cannot be made here (/proc/..., read-only, a file in the way)
        raise OSError(f"cannot put the lab in {dest}: {exc.strerror or exc}; choose a folder you can write") from None
    return dest


def get_solution(name: str, dest: Optional[os.PathLike] = None) -> Path:
    """Copy a lab's solution (for instructors: ``attnlab labs get NN --solution``) into ``dest``
    (default ``./<lab name>-solution``) as ``<lab file>``; refuses to overwrite a file. The
    wheel ships the solutions under ``share/attnlab/labs/.../solutions`` for this; ``labs get``
    without ``--solution`` never copies them."""
    lab = find_lab(name)
    root = labs_root()
    source = root / lab.name / "solutions" / lab.file if root is not None else None
    if source is None or not source.is_file():
        raise FileNotFoundError(f"the solution of lab {lab.name} is not installed (looked in the checkout's labs/ and "
                                f"in {Path(sys.prefix) / 'share' / 'attnlab'}); reinstall attnlab")
    dest = Path(dest) if dest is not None else Path.cwd() / f"{lab.name}-solution"
    target = dest / lab.file
    if target.exists():
        raise FileExistsError(f"not overwriting {target}: choose another folder or move it away")
    try:
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    except OSError as exc:
        raise OSError(f"cannot put the solution in {dest}: {exc.strerror or exc}; choose a folder you can write") from None
    return target


LABS = tuple(importlib.import_module(f"{__name__}.{m}").LAB for m in LAB_MODULES)
LAB_FILES = tuple(lab.file for lab in LABS)  # each lab's file name is its own: attention.py, masks.py, ...
