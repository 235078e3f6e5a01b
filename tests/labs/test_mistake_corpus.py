"""The corpus of realistic mistakes (tests/corpus/, issues 32 and 48): every lab's four
solutions score full marks; every mutant of them is graded by the real grader (sandboxed, two
at a time from one class template) and named by its expected code in the exercise it breaks,
with no other code anywhere in the report; the doctor names the mutants of the functions with
SDPA's signature; and every code is shown to fail with its detection removed."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from attnlab import doctor, labs, mistakes
from attnlab.grading.sandbox import pool
from corpus import lab_modules, solution_text
from helpers.corpus_run import codes_by_exercise, grade_files, write_mutants

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

MODULES = {m.LAB: m for m in lab_modules()}
CASES = [(lab, m.id) for lab, mod in MODULES.items() for m in mod.MUTANTS]
SYMPTOMS = {"unknown", "shape_error"}


@pytest.fixture(scope="module", autouse=True)
def one_template():
    """One class template for the whole module (grade_files' own nests inside it): the
    detections ablated below live in this process, not in the template, so every grading here
    can fork from the same one instead of starting ~70 (one per code and lab)."""
    with pool.class_template("auto"):
        yield


def _mutant(lab: str, mutant_id: str):
    return next(m for m in MODULES[lab].MUTANTS if m.id == mutant_id)


@pytest.mark.parametrize("lab,label", [(lab, label) for lab, mod in MODULES.items() for label in mod.SOLUTIONS])
def test_each_solution_scores_full_marks(lab, label, tmp_path):
    path = tmp_path / labs.find_lab(lab).file
    path.write_text(solution_text(MODULES[lab], label))
    report = grade_files({label: path}, lab)[label]
    assert report.score == 100, report.to_text()


def test_the_corpus_is_four_solutions_by_25_mistakes_per_lab_in_the_vocabulary():
    """The instructor's solution and three independent ones per lab (issue 32's ``b``, issue 48's
    ``c`` and ``d``, each written from the brief alone), each with at least 25 named mutants."""
    for lab, mod in MODULES.items():
        assert len(mod.SOLUTIONS) >= 4, lab
        per_solution = Counter(m.solution for m in mod.MUTANTS)
        assert set(per_solution) == set(mod.SOLUTIONS) and min(per_solution.values()) >= 25, (lab, per_solution)
        ids = [m.id for m in mod.MUTANTS]
        assert len(ids) == len(set(ids)), lab
        for m in mod.MUTANTS:
            assert m.code in mistakes.CODES and m.code not in SYMPTOMS, m
            assert m.exercise in {ex.id for ex in labs.find_lab(lab).exercises()}, m
            m.apply(solution_text(mod, m.solution))  # every edit applies exactly once


# the mistakes the issue names, each in the corpus: (lab, mutant name, code)
NAMED_IN_THE_ISSUE = [
    ("04-flash-attention", "stale_max", "online_rescale"), ("04-flash-attention", "lse_without_max", "lse_saved"),
    ("04-flash-attention", "dq_dk_without_scale", "backward_scale"),
    ("02-masks", "attention_sqrt_Ev", "wrong_scale"), ("02-masks", "decoding_L_minus_S", "causal_alignment"),
    ("01-attention", "sum_without_keepdim", "keepdim"), ("01-attention", "padding_query_side", "padding_query_side"),
    ("01-attention", "fill_zero", "mask_fill_zero"), ("01-attention", "causal_hides_diagonal", "off_by_one"),
    ("01-attention", "causal_triu", "causal_future"), ("01-attention", "times_sqrt_d_k", "wrong_scale"),
    ("03-multi-head", "repeat_tiles", "gqa_group_mapping"),
    # issue 34's ten for lab 05
    ("05-triton-flash", "stale_max", "online_rescale"), ("05-triton-flash", "l_not_rescaled", "online_rescale"),
    ("05-triton-flash", "diagonal_unmasked", "causal_block_skip"),
    ("05-triton-flash", "diagonal_skipped", "causal_block_skip"),
    ("05-triton-flash", "key_mask_drops_last_key", "off_by_one"), ("05-triton-flash", "v_loaded_without_mask", "load_mask"),
    ("05-triton-flash", "lse_log2", "lse_saved"), ("05-triton-flash", "D_without_O", "backward_d_term"),
    ("05-triton-flash", "dk_without_scale", "backward_scale"),
    ("05-triton-flash", "dkdv_accumulated_in_input_dtype", "accumulate_dtype"),
    ("05-triton-flash", "gqa_modulo_heads", "gqa_group_mapping"),
]


@pytest.mark.parametrize("lab,name,code", NAMED_IN_THE_ISSUE)
def test_the_mistakes_the_issue_names_are_in_the_corpus(lab, name, code):
    assert any(m.name == name and m.code == code for m in MODULES[lab].MUTANTS), (lab, name)


@pytest.mark.parametrize("lab,mutant_id", CASES, ids=[f"{lab[:2]}-{i}" for lab, i in CASES])
def test_each_mutant_is_named_by_its_code_and_no_other(lab, mutant_id, tmp_path):
    """Each mutant graded in its own test (forked from the module's template): a lab's mutants
    graded together in one fixture kept one worker busy for 144 s on lab 05 while the other
    waited, and graded the lab again wherever its tests landed on both workers."""
    m = _mutant(lab, mutant_id)
    report = grade_files(write_mutants(MODULES[lab], [m], tmp_path), lab)[mutant_id]
    by_exercise = codes_by_exercise(report)
    assert report.score < 100, report.to_text()
    assert by_exercise.get(m.exercise) == {m.code}, (m, by_exercise, report.to_text())
    others = set().union(*by_exercise.values()) - {m.code}
    assert not others, (m, by_exercise, report.to_text())
    text = report.to_text()
    assert f"[{m.code}]" in text  # the learner reads the code and its hint
    assert mistakes.CODES[m.code].split(":")[0][:40] in text or m.code in text


# --------------------------------------------------------------------------- the doctor
def _adapters(module_globals: dict) -> dict:
    """exercise id -> (an SDPA-signature adapter of the learner's function, its capabilities)."""
    return {
        "01-attention": {"ex8": (doctor.adapt_self_attention(module_globals.get("self_attention")),
                                 doctor.SELF_ATTENTION_CAPABILITIES)},
        "02-masks": {"ex7": (lambda q, k, v, attn_mask=None, **kw: module_globals["masked_attention"](q, k, v, attn_mask),
                             frozenset({"rect", "mask"}))},
        "03-multi-head": {"ex5": (lambda q, k, v, **kw: module_globals["gqa_attention"](q, k, v),
                                  frozenset({"rect", "gqa"}))},
        "04-flash-attention": {"ex2": (lambda q, k, v, is_causal=False, **kw: module_globals["tiled_attention"](
            q, k, v, is_causal), frozenset({"rect", "causal"}))},
        # lab 05's kernels take power-of-two head sizes only, which the doctor's probes do not keep to
        "05-triton-flash": {},
    }


DOCTOR_CASES = [(lab, m.id) for lab, mod in MODULES.items() for m in mod.MUTANTS
                if m.code in mistakes.DOCTOR_CODES and m.exercise in _adapters({})[lab]]


def test_the_doctor_cases_cover_every_lab():
    assert {lab for lab, _ in DOCTOR_CASES} == set(MODULES) - {"05-triton-flash"} and len(DOCTOR_CASES) >= 30


@pytest.mark.parametrize("lab,mutant_id", DOCTOR_CASES, ids=[f"{lab[:2]}-{i}" for lab, i in DOCTOR_CASES])
def test_the_doctor_names_the_sdpa_signature_mutants(lab, mutant_id):
    """The mutant's own SDPA-like function, probed in this process (test code: trusted)."""
    m = _mutant(lab, mutant_id)
    namespace: dict = {"__name__": f"corpus_{lab[:2]}"}
    exec(compile(m.apply(solution_text(MODULES[lab], m.solution)), f"{mutant_id}.py", "exec"), namespace)
    fn, caps = _adapters(namespace)[lab][m.exercise]
    with torch.no_grad():
        report = doctor.diagnose(fn, capabilities=caps)
    codes = [f.code for f in report.findings]
    assert codes and codes[0] == m.code and set(codes) - SYMPTOMS <= {m.code}, (m, str(report))


@pytest.mark.parametrize("lab,label", [(lab, label) for lab, mod in MODULES.items() for label in mod.SOLUTIONS])
def test_the_doctor_passes_the_solutions(lab, label):
    namespace: dict = {"__name__": f"corpus_{lab[:2]}"}
    exec(compile(solution_text(MODULES[lab], label), f"{label}.py", "exec"), namespace)
    for fn, caps in _adapters(namespace)[lab].values():
        report = doctor.diagnose(fn, capabilities=caps)
        assert report.ok, str(report)


# --------------------------------------------------------------------------- each code's detection removed
# Where a code can come from: the labs' checks, the framework, the grader, the doctor. Ablating a
# code re-executes these modules with the code's string literal replaced by "unknown" (their
# detections of it removed, nothing else changed), then restores them.
# (in import order: the labs last, so they take the framework's re-executed functions)
DETECTING_MODULES = ["attnlab.grading.errors", "attnlab.grading.offsets", "attnlab.grading.exercise",
                     "attnlab.bugmodels.flash_backward", "attnlab.bugmodels.flash_fits",
                     "attnlab.bugmodels.sdpa_forward", "attnlab.doctor.analysis", "attnlab.labs.lab01_attention", "attnlab.labs.lab02_masks",
                     "attnlab.labs.lab03_multihead", "attnlab.labs.lab04_flash", "attnlab.labs.lab05_triton"]


class _Ablated:
    """The detecting modules re-executed with one code's literal replaced; on exit each module's
    namespace gets its original objects back (the same classes and functions as before, so
    nothing that imported them earlier sees a difference)."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.saved: dict[str, dict] = {}

    def __enter__(self):
        literal = f'"{self.code}"'
        for name in DETECTING_MODULES:
            module = sys.modules[name]
            self.saved[name] = dict(module.__dict__)
            source = Path(module.__file__).read_text()
            exec(compile(source.replace(literal, '"unknown"'), module.__file__, "exec"), module.__dict__)
        return self

    def __exit__(self, *exc) -> None:
        for name, namespace in self.saved.items():
            module = sys.modules[name]
            module.__dict__.clear()
            module.__dict__.update(namespace)


_ORIGINAL_TENSOR_VERDICT = __import__("attnlab.grading.exercise", fromlist=["x"]).tensor_verdict
CODES_IN_CORPUS = sorted({m.code for mod in MODULES.values() for m in mod.MUTANTS})


@pytest.mark.slow
@pytest.mark.parametrize("code", CODES_IN_CORPUS)
def test_each_code_fails_with_its_detection_removed(code, tmp_path):
    """With the code's detections removed, no mutant is named by it: the corpus test above would
    fail (and it passes only because those detections exist). One mutant per exercise that names
    the code stands for that exercise's check (the literal is removed from every detecting module
    at once, so a second mutant of the same exercise shows nothing new): 104 gradings, not 272."""
    for name in DETECTING_MODULES:
        __import__(name)
    still = []
    with _Ablated(code):
        for lab, mod in MODULES.items():
            mine = list({m.exercise: m for m in reversed(mod.MUTANTS) if m.code == code}.values())
            if not mine:
                continue
            reports = grade_files(write_mutants(mod, mine, tmp_path / lab[:2]), lab)
            still += [i for i, r in reports.items() if code in set().union(*codes_by_exercise(r).values())]
    assert not still, still
    from attnlab.grading import exercise

    assert exercise.tensor_verdict is _ORIGINAL_TENSOR_VERDICT  # restored: the same objects as before
