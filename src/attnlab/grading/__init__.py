"""Grade a learner's ``attention.py`` safely, with feedback that names the mistake.

    from attnlab.grading import grade
    report = grade("labs/track1/01-attention/attention.py")
    print(report.to_text())
    json.dump(report.to_gradescope(), open("results.json", "w"))

Modules: :mod:`.grader` (the run and the report), :mod:`.sandbox` (child processes
with limits), :mod:`.checks` (the exercises, the float64 reference, named
mistakes), :mod:`.policy` (the from-scratch rule), :mod:`.launch` (starts the
sandbox server early, without importing torch).

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
