"""Grade a learner's lab file safely, with feedback that names the mistake.

    from attnlab.grading import grade
    report = grade("labs/track1/01-attention/attention.py")
    print(report.to_text())
    json.dump(report.to_gradescope(), open("results.json", "w"))

Learner code is hostile until proven otherwise. Modules: :mod:`.grader` (the run and
the report), :mod:`.launch` (the bwrap OS sandbox of one submission and its cgroup,
started early, without importing torch), :mod:`.sandbox` (child processes with limits,
and the validation of everything they send back), :mod:`.static` (the from-scratch
rule on the file's text, before it runs), :mod:`.policy` (the call recorders inside
the child, a second layer), :mod:`.checks` (the exercises, the float64 reference,
named mistakes).

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
