"""What a test needs from the machine, said once: fail under CI (``make test`` installs bwrap,
chromium and the rest, so a missing one there is a broken set-up, never a green run), else skip."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

__all__ = ["cannot_run", "chromium", "fuzz_seed", "FUZZ_SEED_VARIABLE"]

FUZZ_SEED_VARIABLE = "ATTNLAB_FUZZ_SEED"


def fuzz_seed() -> int:
    """The seed of the fuzz tiers that draw new examples each run (tests/grading/test_fuzz_judge.py):
    ``ATTNLAB_FUZZ_SEED`` when set (a replay), else drawn once per run by the controller
    (tests/conftest.py sets the variable before the workers start, and prints it in the header)."""
    value = os.environ.get(FUZZ_SEED_VARIABLE)
    if value is None:
        import secrets

        value = str(secrets.randbelow(2**32))
        os.environ[FUZZ_SEED_VARIABLE] = value
    return int(value)


def cannot_run(reason: str, *, module: bool = False) -> NoReturn:
    """A test (``module=True``: a whole module) that cannot run here: a failure in CI, else a skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run this check", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


def chromium() -> str:
    """Headless Chromium's path, for the tests that open a page."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        cannot_run("chromium is not installed (make test installs Debian's chromium when apt-get is usable as root)")
    return browser
