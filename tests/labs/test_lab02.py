"""Lab 02 (labs/track1/02-masks): solutions score 100, stubs 0 with where to start, and each
named mistake is named by at least two different buggy variants, in under 5 s a grading."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from attnlab import labs, mistakes
from attnlab.cli import main
from attnlab.grading import grade
from helpers.labtests import codes, grade_variants, run_walkthrough

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

LAB = Path(__file__).resolve().parents[2] / "labs/track1/02-masks"

EX1 = "return torch.ones(L, S, dtype=torch.bool).tril()"
EX2 = "return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)"
EX3 = "return (torch.arange(S) < lengths[:, None])[:, None, None, :]"
EX4 = "return a & b"
EX5_GUARD = "    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # an empty row: no -inf - -inf\n"
EX5_DIV = "return e / torch.where(total == 0, torch.ones_like(total), total)"
EX6 = "return (~key_padding_mask)[:, None, None, :]"
EX7 = "scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])"
EX5_BODY = ('''    s = scores.masked_fill(~mask, float("-inf"))\n''' + "    m = s.amax(dim=-1, keepdim=True)\n" + EX5_GUARD
            + "    e = torch.exp(s - m)\n    total = e.sum(dim=-1, keepdim=True)\n    " + EX5_DIV)
SOFTMAX_THEN_MASK = ("    m = scores.amax(dim=-1, keepdim=True)\n    e = torch.exp(scores - m)\n"
                     "    w = e / e.sum(dim=-1, keepdim=True)\n    return {}")

# each variant: edits, and the (exercise, code) each must name; every code at least twice overall
VARIANTS = {
    "A": ([(EX1, "return ~torch.ones(L, S, dtype=torch.bool).tril()"),
           (EX2, "return torch.ones(L, S, dtype=torch.bool).tril()"),
           (EX3, "return (torch.arange(S) < lengths[:, None])[:, None, :, None]"),
           (EX4, "return a | b"),
           (EX5_BODY, SOFTMAX_THEN_MASK.format("w * mask")),
           (EX6, "return key_padding_mask[:, None, None, :]")],
          [("ex1", "mask_polarity"), ("ex2", "causal_alignment"), ("ex3", "padding_query_side"),
           ("ex4", "mask_combined_or"), ("ex5", "mask_after_softmax"), ("ex6", "mask_polarity")]),
    "B": ([(EX1, "return torch.ones(L, S, dtype=torch.bool).triu()"),
           (EX2, "return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L + 1)"),
           (EX3, "return (torch.arange(S) <= lengths[:, None])[:, None, None, :]"),
           (EX4, "return torch.logical_or(a, b)"),
           (EX5_GUARD, ""), (EX5_DIV, "return e / total")],
          [("ex1", "causal_alignment"), ("ex2", "off_by_one"), ("ex3", "off_by_one"), ("ex4", "mask_combined_or"),
           ("ex5", "fully_masked_nan")]),
    "C": ([(EX1, "return torch.ones(L, S, dtype=torch.bool).tril(-1)"),
           (EX2, "return ~torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)"),
           (EX3, "return (torch.arange(S) < lengths[:, None]).unsqueeze(1).unsqueeze(-1)"),
           (EX5_BODY, SOFTMAX_THEN_MASK.format("torch.where(mask, w, torch.zeros_like(w))")),
           (EX6, "return key_padding_mask.unsqueeze(1).unsqueeze(1)")],
          [("ex1", "off_by_one"), ("ex2", "mask_polarity"), ("ex3", "padding_query_side"),
           ("ex5", "mask_after_softmax"), ("ex6", "mask_polarity")]),
    "D": ([(EX1, "return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)"),
           (EX3, "return (torch.arange(S) >= lengths[:, None])[:, None, None, :]"),
           (EX5_DIV, "return e / total"), (EX5_GUARD, ""),
           (EX7, "scores = Q @ K.transpose(-2, -1)")],
          [("ex1", "causal_alignment"), ("ex3", "mask_polarity"), ("ex5", "fully_masked_nan")]),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return grade_variants("02-masks", "masks.py", VARIANTS, tmp_path_factory.mktemp("variants"), seed=11)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_mistake_is_named(graded, name):
    report = graded[name]
    assert report.lab == "02-masks"
    for ex_id, code in VARIANTS[name][1]:
        assert code in codes(report, ex_id), (ex_id, code, report.to_text())
        assert code in mistakes.CODES


def test_every_named_mistake_has_two_variants():
    from collections import Counter

    counts = Counter(code for _, expect in VARIANTS.values() for _, code in expect)
    assert {"mask_polarity", "off_by_one", "causal_alignment", "mask_after_softmax", "fully_masked_nan",
            "padding_query_side", "mask_combined_or"} <= set(counts)
    assert min(counts.values()) >= 2, counts


def test_solutions_full_marks_stubs_zero_with_a_pointer_and_fast():
    t0 = time.perf_counter()
    report = grade(LAB / "solutions/masks.py", seed=3)
    elapsed = time.perf_counter() - t0
    assert report.score == 100 and report.lab == "02-masks", report.to_text()
    assert elapsed < 5.0 or report.elapsed_s < 5.0  # grading a lab takes under 5 s (sandbox start included)
    stub = grade(LAB / "masks.py", seed=3)
    assert stub.score == 0 and "Start with ex1: causal_mask() in masks.py" in stub.to_text()


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


def test_labs_lists_two_labs(capsys):
    assert main(["labs"]) == 0
    out = capsys.readouterr().out
    assert "01-attention" in out and "02-masks" in out


def test_walkthrough_is_paired_and_runs_on_the_solutions(tmp_path):
    # (that a stub stops the walkthrough at ex1 is tested once, for lab 01: tests/labs/test_lab_notebook.py)
    text = run_walkthrough("02-masks", "masks.py", LAB / "solutions/masks.py", tmp_path)
    assert "# # # . ." in text and "max |yours - torch SDPA|" in text
