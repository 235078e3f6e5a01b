"""What a test needs from the machine, said once: fail under CI (``make test`` installs bwrap,
chromium and the rest, so a missing one there is a broken set-up, never a green run), else skip."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

__all__ = ["cannot_run", "chromium"]


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
