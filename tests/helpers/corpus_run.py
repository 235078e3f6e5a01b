"""Grading the mistake corpus (tests/corpus/) with the real grader: each mutant written to its
own file and graded in a sandbox forked from one class template, two at a time, as class
grading does."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from attnlab import labs
from attnlab.grading import grade
from attnlab.grading.sandbox import pool
from corpus import Mutant, solution_text


def write_mutants(module, mutants: list[Mutant], root: Path) -> dict[str, Path]:
    """Each mutant applied to its solution, as ``root/<id>/<lab file>``."""
    lab = labs.find_lab(module.LAB)
    paths = {}
    for m in mutants:
        folder = root / m.id
        folder.mkdir(parents=True)
        (folder / lab.file).write_text(m.apply(solution_text(module, m.solution)))
        paths[m.id] = folder / lab.file
    return paths


def grade_files(paths: dict[str, Path], lab_name: str, seed: int = 5) -> dict:
    """``id -> GradeReport`` for every file, graded as lab ``lab_name``."""
    lab = labs.find_lab(lab_name)
    with pool.class_template("auto"), ThreadPoolExecutor(max_workers=2) as workers:
        reports = workers.map(lambda path: grade(path, lab=lab, seed=seed), paths.values())
        return dict(zip(paths, reports))


def codes_by_exercise(report) -> dict[str, set[str]]:
    """Exercise id -> the codes its checks named."""
    out: dict[str, set[str]] = {}
    for r in report.results:
        out.setdefault(r.exercise.id, set()).update(f["code"] for f in r.verdict.findings)
    return out
