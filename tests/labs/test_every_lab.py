"""Every registered lab, one test each, with each lab's variants as data (helpers/variants/):
the solution scores 100 and the stub 0 with a pointer to its first exercise; each buggy
variant's mistakes are named, every named mistake by at least two variants; the walkthrough
is paired with its notebook and runs on the solution. A lab added to attnlab.labs is tested
here by adding its variants module."""

from __future__ import annotations

from collections import Counter

import pytest

from attnlab import labs, mistakes
from attnlab.grading import grade
from helpers.labtests import LABS, codes, run_walkthrough
from helpers.variants import variant_data

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

DATA = variant_data()
CASES = [(lab, name) for lab, data in DATA.items() for name in data.VARIANTS]


@pytest.mark.parametrize("lab", [lab.name for lab in labs.LABS])
def test_the_solution_scores_100_and_the_stub_0_with_where_to_start(lab):
    the_lab = labs.find_lab(lab)
    report = grade(LABS / lab / "solutions" / the_lab.file, seed=3)
    assert report.score == 100 and report.lab == lab, report.to_text()
    stub = grade(LABS / lab / the_lab.file, seed=3)
    first = the_lab.exercises()[0]
    assert stub.score == 0 and f"Start with {first.id}: {first.function}() in {the_lab.file}" in stub.to_text()


@pytest.mark.parametrize("lab,name", CASES, ids=[f"{lab[:2]}-{name}" for lab, name in CASES])
def test_each_mistake_is_named(graded_variants, lab, name):
    report = graded_variants(lab)[name]
    assert report.lab == lab
    for ex_id, code in DATA[lab].VARIANTS[name][1]:
        assert code in codes(report, ex_id), (ex_id, code, report.to_text())
        assert code in mistakes.CODES
    assert report.score < 100


@pytest.mark.parametrize("lab", list(DATA))
def test_every_named_mistake_has_two_variants(lab):
    counts = Counter(code for _, expect in DATA[lab].VARIANTS.values() for _, code in expect)
    assert DATA[lab].NAMED <= set(counts), DATA[lab].NAMED - set(counts)
    assert min(counts.values()) >= 2, counts


@pytest.mark.parametrize("lab", list(DATA))
def test_the_walkthrough_is_paired_and_runs_on_the_solution(lab, tmp_path):
    # (that a stub stops the walkthrough at ex1 is tested once, for lab 01: tests/labs/test_lab_notebook.py)
    file = labs.find_lab(lab).file
    text = run_walkthrough(lab, file, LABS / lab / "solutions" / file, tmp_path)
    for expected in DATA[lab].WALKTHROUGH:
        assert expected in text, expected
