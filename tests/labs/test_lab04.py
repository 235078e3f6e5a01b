"""Lab 04 (labs/track1/04-flash-attention), what only it has: the memory cap that catches the
forward that builds [L, S], the skipping check, the banned call inside the autograd.Function
(the rest is tests/labs/test_every_lab.py, its variants in tests/helpers/variants/lab04.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab import labs

from attnlab.grading.static import check_source

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

LAB = Path(__file__).resolve().parents[2] / "labs/track1/04-flash-attention"


@pytest.fixture
def graded(graded_variants):
    return graded_variants("04-flash-attention")  # tests/labs/conftest.py, its variants as data


def test_the_memory_check_fails_the_forward_that_builds_the_scores_and_only_it(graded):
    for name in ("F", "G"):
        ex3 = [r for r in graded[name].results if r.exercise.id == "ex3"]
        assert [r.score for r in ex3] == [0.0], graded[name].to_text()
        assert "ran out of its 32 MB" in ex3[0].verdict.message
    for name in ("C", "D", "E"):  # tiled forwards, right without is_causal, wrong elsewhere: ex3 passes
        assert [r.score for r in graded[name].results if r.exercise.id == "ex3"] == [15.0]


def test_a_loop_that_computes_the_future_tiles_loses_only_the_skipping_check(graded):
    for name in ("I", "I2"):  # I2 cleans V's NaN first (v.nan_to_num()): scored 100 before the NaN were counted
        failed = [(r.exercise.id, r.check) for r in graded[name].results if r.score < r.max_score]
        assert failed == [("ex2", "skips_future_tiles")], graded[name].to_text()
    assert "the NaN was cleaned" in graded["I2"].to_text()  # a whole-V op is the untiled forward's, not counted


def test_a_banned_call_inside_the_autograd_function_refuses_the_file():
    source = (LAB / "solutions/flash.py").read_text().replace(
        "        o, lse = flash_forward(q, k, v, is_causal)\n",
        "        o, lse = flash_forward(q, k, v, is_causal)\n        o = torch.softmax(o, dim=-1)\n")
    report = check_source(source, "flash.py", labs.find_lab("04").allowed_names)
    assert [v.function for v in report.violations] == ["TiledAttention"]
    assert [v.function for v in report.refusals()] == ["TiledAttention"] and not report.module_level()


