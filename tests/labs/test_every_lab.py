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


def test_lab05_s_walkthrough_on_the_stub_stops_at_ex1_with_one_line(tmp_path):
    """Issue 48 item 7: on the stub it ended in a 30-line Triton traceback; now the first unfinished
    kernel stops it with one line naming the exercise and the TODO."""
    from nbclient.exceptions import CellExecutionError

    lab = "05-triton-flash"
    file = labs.find_lab(lab).file
    with pytest.raises(CellExecutionError) as caught:
        run_walkthrough(lab, file, LABS / lab / file, tmp_path)
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(caught.value))  # IPython colours the exception's name
    assert "To exit" not in text, text[-1500:]
    assert "SystemExit: ex1 is not written yet (TODO(ex1):" in text, text[-1500:]
    assert "InterpreterError" not in text and "triton/runtime" not in text, text[-1500:]


def test_lab05_s_trace_of_one_program_ends_at_the_kernel_s_own_output(tmp_path):
    """The walkthrough's tile-by-tile trace (m_i, l_i, acc of one row, in float64) is the algorithm the
    kernel runs: its O equals the solution kernel's, and the running max rises (some alpha < 1)."""
    import re

    lab = "05-triton-flash"
    file = labs.find_lab(lab).file
    text = run_walkthrough(lab, file, LABS / lab / "solutions" / file, tmp_path)
    line = next(x for x in text.splitlines() if x.startswith("O = acc / l_i:"))
    traced, kernel = (eval(part) for part in re.findall(r"\[[^\]]*\]", line))  # noqa: S307 (our own output)
    assert all(abs(a - b) < 1e-5 for a, b in zip(traced, kernel)), line
    rows = [x.split() for x in text.splitlines() if re.match(r"^\s*\d+-\d+\s", x)]
    alphas = [float(r[3]) for r in rows]
    assert len(rows) == 4 and alphas[0] == 0.0 and min(alphas[1:]) < 1.0, rows
