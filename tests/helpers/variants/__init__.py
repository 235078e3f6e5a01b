"""Each lab's buggy variants as data, one module per lab that has them (lab02 ... lab05;
lab 01's are in tests/grading/test_grading.py): ``LAB``, ``SEED``, ``VARIANTS``
(name -> (edits to the solution, [(exercise, code)])), ``NAMED`` and ``WALKTHROUGH``."""

from __future__ import annotations

import importlib

MODULES = ("lab02", "lab03", "lab04", "lab05")


def variant_data() -> dict:
    """Lab name -> its variants module."""
    mods = [importlib.import_module(f"{__name__}.{m}") for m in MODULES]
    return {m.LAB: m for m in mods}
