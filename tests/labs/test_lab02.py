"""Lab 02 (labs/track1/02-masks), what only it has: the lab is picked from the file's folder,
its functions or --lab (the rest is tests/labs/test_every_lab.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from attnlab import labs
from attnlab.cli import main

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

LAB = Path(__file__).resolve().parents[2] / "labs/track1/02-masks"


def test_the_lab_is_picked_from_the_folder_or_by_lab(tmp_path, capsys):
    copy = tmp_path / "mine.py"
    shutil.copy(LAB / "solutions/masks.py", copy)
    # a neutral name: the lab whose functions it defines
    assert labs.lab_for_path(copy).name == "02-masks"
    neutral = tmp_path / "other.py"
    neutral.write_text("def helper(x):\n    return x\n")
    assert labs.lab_for_path(neutral).name == "01-attention"  # nothing to go by: lab 01 unless told
    assert main(["grade", str(copy), "--lab", "02", "--no-images", "--seed", "1"]) == 0
    assert "(lab 02-masks)" in capsys.readouterr().out
    assert main(["grade", str(copy), "--lab", "7"]) == 2
    assert "no lab '7'" in capsys.readouterr().err


