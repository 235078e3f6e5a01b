"""The corpus of realistic mistakes (issue 32): for every lab, two independent solutions and
the ways learners break them, as data; issue 48 added a third solution (``c``) per lab, each
written by an independent author from the brief alone.

Each lab's module (``lab01`` ... ``lab04``) holds ``LAB`` (its name), ``SOLUTIONS`` (label ->
the solution's path, relative to the repository) and ``MUTANTS``: :class:`Mutant` edits, each
with the exercise whose check must name it and the code it must be named by
(:data:`attnlab.mistakes.CODES`). ``SDPA`` lists the functions with SDPA's signature, each
with the adapter that lets the doctor probe it (:mod:`attnlab.doctor`).

tests/labs/test_mistake_corpus.py grades every mutant with the real grader (and runs the
doctor on the SDPA-signature ones); each code is also shown failing with its detection
removed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULES = ("lab01", "lab02", "lab03", "lab04", "lab05")


@dataclass(frozen=True)
class Mutant:
    """One realistic mistake: ``old`` replaced by ``new`` (each edit once) in solution
    ``solution``, named ``code`` by exercise ``exercise``. ``edits`` holds further
    (old, new) pairs of the same mistake (a mistake repeated in two places)."""

    solution: str
    name: str
    old: str
    new: str
    exercise: str
    code: str
    edits: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.solution}-{self.name}"

    def apply(self, text: str) -> str:
        for old, new in ((self.old, self.new), *self.edits):
            if text.count(old) != 1:
                raise AssertionError(f"mutant {self.id}: {old!r} occurs {text.count(old)} times in the solution "
                                     "(an edit must apply exactly once, or it tests nothing)")
            text = text.replace(old, new)
        return text


def M(solution: str, name: str, old: str, new: str, exercise: str, code: str, *edits: tuple[str, str]) -> Mutant:
    """A :class:`Mutant`, written on one line in the lab modules."""
    return Mutant(solution, name, old, new, exercise, code, tuple(edits))


def lab_modules() -> list:
    return [importlib.import_module(f"{__name__}.{m}") for m in MODULES]


def solution_text(module, label: str) -> str:
    return (REPO / module.SOLUTIONS[label]).read_text()
