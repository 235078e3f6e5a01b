"""Grade a learner's lab file safely, with feedback that names the mistake.

    from attnlab.grading import grade
    report = grade("labs/track1/01-attention/attention.py")
    print(report.to_text())
    json.dump(report.to_gradescope(), open("results.json", "w"))

Learner code is hostile until proven otherwise. Modules: :mod:`.grader` (the run and
the report), :mod:`.launch` (the bwrap OS sandbox of one submission and its cgroup,
started early, without importing torch), :mod:`.sandbox` (child processes with CPU-time
budgets, and the validation of everything they send back), :mod:`.protocol` (what may
cross from a child: safetensors and bounded JSON, checked before anything is allocated),
:mod:`.seccomp` (the filter every child runs under), :mod:`.static` (the from-scratch
rule on the file's text, before it runs), :mod:`.policy` (the call recorders inside
the child, a second layer, evidence and not a fence), :mod:`.checks` and the
``labNN_*`` modules (each lab's exercises, float64 references, named mistakes),
:mod:`.batch`, :mod:`.report` and :mod:`.autograder` (a class, its report, Gradescope).

Names are loaded lazily, so ``import attnlab.grading.launch`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["grade", "GradeReport", "TestResult", "Limits", "Sandbox", "default_lab_path", "supports_colour"]

_LAZY = {"grade": "grader", "GradeReport": "grader", "TestResult": "grader", "default_lab_path": "grader",
         "supports_colour": "grader", "Limits": "sandbox", "Sandbox": "sandbox"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"attnlab.grading.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'attnlab.grading' has no attribute {name!r}")
