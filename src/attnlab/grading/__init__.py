"""Grade a learner's lab file safely, with feedback that names the mistake.

    from attnlab.grading import grade
    report = grade("labs/track1/01-attention/attention.py")
    print(report.to_text())
    json.dump(report.to_gradescope(), open("results.json", "w"))

Learner code is hostile, and it runs arbitrary code. Packages and modules, one concept each:
:mod:`.grader` (the run of one file and its report), :mod:`.sandbox` (the sandbox that runs
the file: the runner inside it, the OS fences, what may cross; its ``__init__`` is the map),
:mod:`.static` (the from-scratch rule as an allow-list on the file's text, before it runs),
:mod:`.exercise` (the framework each lab's checks are written in: no lab lives under
``grading``; the labs are :mod:`attnlab.labs`, a module each), :mod:`.classroom` (a class,
its report, Gradescope).

Names are loaded lazily, so ``import attnlab.grading.sandbox.pool`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["grade", "GradeReport", "TestResult", "Limits", "Sandbox", "default_lab_path", "supports_colour"]

_LAZY = {"grade": "grader", "GradeReport": "grader", "TestResult": "grader", "default_lab_path": "grader",
         "supports_colour": "grader", "Limits": "sandbox.client", "Sandbox": "sandbox.client"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"attnlab.grading.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'attnlab.grading' has no attribute {name!r}")
