"""Lab 05 judges a legitimate rounding of an operand against a reference with that rounding (issue 48).

Triton's fused-attention tutorial and FlashAttention-2 cast P to dO's dtype for dV += P^T dO, with a
float32 accumulator. With float16 inputs that is right (2.4e-6 of dV's largest value), yet it lost
ex5's fp32_accumulators check (4 points, 96/100) against a reference with P unrounded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab.grading import grade

SOLUTION = (Path(__file__).resolve().parents[2] / "labs/track1/05-triton-flash/solutions/flash_triton.py").read_text()
DV = "            dv += tl.dot(tl.trans(p), do.to(tl.float32))\n"


@pytest.mark.slow
def test_the_tutorials_float16_p_for_dv_scores_100(tmp_path):
    assert SOLUTION.count(DV) == 1
    path = tmp_path / "flash_triton.py"
    path.write_text(SOLUTION.replace(DV, "            dv += tl.dot(tl.trans(p.to(do.dtype)), do)\n"))
    report = grade(path, lab="05", sandbox="none", seed=1)
    assert report.score == 100, report.to_text()
