"""attnlab grade: stubs score 0, solutions full marks, each mistake is named, and no
learner misbehaviour crashes the grader or passes a check."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.grading import Limits, grade
from attnlab.grading.sandbox import pool
from attnlab.labs.lab01_attention import EXERCISES

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

LAB = Path(__file__).resolve().parents[2] / "labs/track1/01-attention"
SOLUTION = (LAB / "solutions/attention.py").read_text()
FAST = Limits(timeout_s=1.5)


@pytest.fixture(scope="module", autouse=True)
def class_template():
    """These tests are about what the grader concludes, not how the sandbox is made (the hostile
    suite and the fence tests run every case both ways): their submissions are forked from one
    class template, as class grading does, instead of importing torch once per grade()."""
    with pool.class_template("auto"):
        yield


def make_variant(tmp_path: Path, *edits: tuple[str, str], text: str = SOLUTION) -> Path:
    """The solution with each (old, new) edit applied; every old snippet must be present."""
    for old, new in edits:
        assert old in text, f"the solution no longer contains {old!r}: update the variant"
        text = text.replace(old, new)
    path = tmp_path / "attention.py"
    path.write_text(text)
    return path


def scores(report) -> dict[str, tuple[float, float]]:
    return report.exercise_scores()


def exercise_text(report, ex_id: str) -> str:
    return "\n".join(r.output() for r in report.results if r.exercise.id == ex_id)


def codes(report, ex_id: str) -> set[str]:
    return {f["code"] for r in report.results if r.exercise.id == ex_id for f in r.verdict.findings}


# ------------------------------------------------------------------ the two ends
def test_untouched_stubs_score_zero_and_say_where_to_start():
    report = grade(LAB / "attention.py")
    assert report.score == 0 and report.max_score == 100
    text = report.to_text()
    assert "Start with ex1: project_qkv()" in text
    assert "not implemented yet: TODO(ex1)" in text
    assert all(c == {"not_implemented"} for c in (codes(report, ex.id) for ex in EXERCISES if ex.id != "ex11"))


def test_solutions_score_full_marks():
    report = grade(LAB / "solutions/attention.py")
    assert report.score == report.max_score == 100, report.to_text()
    assert f"All checks pass in {report.path}." in report.to_text()


def test_points_add_up_to_100():
    assert sum(ex.max_score for ex in EXERCISES) == 100


# ------------------------------------------------------------------ named mistakes
SCORES_LINE = "return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])"
MUTANTS = [
    # (id, edits, exercise that must fail, code it must name, words the learner reads)
    ("missing_scale", [(SCORES_LINE, "return Q @ K.transpose(-2, -1)")], "ex2", "missing_scale",
     "forgot the 1/sqrt(d_k) scale"),
    ("divide_by_dk", [(SCORES_LINE, "return Q @ K.transpose(-2, -1) / Q.shape[-1]")], "ex2", "wrong_scale",
     "divided by d_k"),
    ("K.T_on_3d", [(SCORES_LINE, "return Q @ K.T / math.sqrt(Q.shape[-1])")], "ex2", "wrong_transpose",
     "K.transpose(-2, -1)"),
    ("transposed_scores", [(SCORES_LINE, "return K @ Q.transpose(-2, -1) / math.sqrt(Q.shape[-1])")], "ex2",
     "wrong_transpose", "transposed"),
    ("naive_softmax", [("    m = scores.amax(dim=dim, keepdim=True)\n"
                        "    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)\n"
                        "    e = torch.exp(scores - m)", "    e = torch.exp(scores)")],
     "ex3", "unstable_softmax", "subtract each row's max"),
    ("nan_on_empty_rows", [("    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)\n", ""),
                           ("    return e / torch.where(total == 0, torch.ones_like(total), total)",
                            "    return e / total")], "ex3", "fully_masked_nan", "NaN"),
    ("softmax_over_queries", [("weights = stable_softmax(scores, dim=-1)", "weights = stable_softmax(scores, dim=-2)")],
     "ex8", "softmax_dim", "dim=-2"),
    ("queries_as_values", [("return attend(weights, V), weights", "return attend(weights, Q), weights")],
     "ex8", "value_swapped", "multiply Q instead of V"),
    ("mask_polarity", [("return scores.masked_fill(~mask, NEG_INF)", "return scores.masked_fill(mask, NEG_INF)")],
     "ex7", "mask_polarity", "True = attend"),
    ("mask_with_zero", [("return scores.masked_fill(~mask, NEG_INF)", "return scores.masked_fill(~mask, 0.0)")],
     "ex7", "mask_fill_zero", "use -inf"),
    ("mask_with_1e9", [("return scores.masked_fill(~mask, NEG_INF)", "return scores.masked_fill(~mask, -1e9)")],
     "ex7", "mask_fill_finite", "float('-inf')"),
    ("causal_upper", [("return torch.ones(T, T, dtype=torch.bool).tril()",
                       "return torch.ones(T, T, dtype=torch.bool).triu()")], "ex5", "causal_future", "future"),
    ("causal_no_diagonal", [("return torch.ones(T, T, dtype=torch.bool).tril()",
                             "return torch.ones(T, T, dtype=torch.bool).tril(-1)")], "ex5", "off_by_one",
     "attend to itself"),
    ("padding_off_by_one", [("return (torch.arange(T) < lengths[:, None])[:, None, :]",
                             "return (torch.arange(T) <= lengths[:, None])[:, None, :]")], "ex6", "off_by_one",
     "use <, not <="),
    ("padding_inverted", [("return (torch.arange(T) < lengths[:, None])[:, None, :]",
                           "return (torch.arange(T) >= lengths[:, None])[:, None, :]")], "ex6", "mask_polarity",
     "True must mean a real token"),
    ("first_column", [("return weights[:, 0, :]", "return weights[:, :, 0]")], "ex12", "wrong_axis", "column 0"),
    # continuous slips: the check fits the number and says it
    ("times_sqrt_dk", [(SCORES_LINE, "return Q @ K.transpose(-2, -1) * math.sqrt(Q.shape[-1])")], "ex2",
     "wrong_scale", "you multiplied by sqrt(d_k) instead of dividing"),
    ("scale_by_three", [(SCORES_LINE, "return Q @ K.transpose(-2, -1) / 3")], "ex2", "wrong_scale",
     "0.6667 times the reference's"),
    ("causal_plus_one", [("return torch.ones(T, T, dtype=torch.bool).tril()",
                          "return torch.ones(T, T, dtype=torch.bool).tril(diagonal=1)")], "ex5", "off_by_one",
     "lets position i see i+1"),
    ("causal_minus_two", [("return torch.ones(T, T, dtype=torch.bool).tril()",
                           "return torch.ones(T, T, dtype=torch.bool).tril(-2)")], "ex5", "off_by_one",
     "off by -2"),
    ("mask_after_softmax", [("        scores = apply_mask(scores, mask)\n    weights = stable_softmax(scores, dim=-1)",
                             "        pass\n    weights = stable_softmax(scores, dim=-1)\n"
                             "    if mask is not None:\n        weights = weights * mask")],
     "ex8", "mask_after_softmax", "after softmax"),
]


@pytest.mark.parametrize("name,edits,ex_id,code,words", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_each_mistake_is_named(tmp_path, name, edits, ex_id, code, words):
    report = grade(make_variant(tmp_path, *edits), limits=FAST)
    got, total = scores(report)[ex_id]
    assert got < total, report.to_text()
    assert code in codes(report, ex_id), report.to_text()
    assert words in exercise_text(report, ex_id), report.to_text()
    assert report.score < 100


# ------------------------------------------------------------------ the from-scratch policy
SOFTMAX_BODY = "    m = scores.amax(dim=dim, keepdim=True)"


@pytest.mark.parametrize("call", [
    "return torch.softmax(scores, dim)",
    "return scores.softmax(dim)",
    "return torch.nn.functional.softmax(scores, dim=dim)",
    "return torch.special.softmax(scores, dim)",
    "return torch.log_softmax(scores, dim).exp()",
    "sm = getattr(torch, 'soft' + 'max'); return sm(scores, dim)",
    "return torch.ops.aten._softmax(scores, dim, False)",
])
def test_policy_catches_softmax_under_any_alias(tmp_path, call):
    path = make_variant(tmp_path, (SOFTMAX_BODY, f"    {call}\n{SOFTMAX_BODY}"))
    report = grade(path, limits=FAST)
    text = exercise_text(report, "ex3")
    assert "the file breaks the rules of the lab, so none of it was run" in report.problem, report.to_text()
    assert "softmax" in text and "in stable_softmax()" in text  # the line of the call is named
    # complete mediation: a violation anywhere refuses the whole file (issue 47), ex1 included
    assert report.score == 0 and scores(report)["ex1"] == (0, 8), report.to_text()


def test_policy_catches_sdpa_and_multihead_attention(tmp_path):
    sdpa = make_variant(tmp_path, ("    return attend(weights, V), weights",
                                   "    return torch.nn.functional.scaled_dot_product_attention("
                                   "X @ W_Q, X @ W_K, X @ W_V, attn_mask=mask), weights"))
    report = grade(sdpa, limits=FAST)
    assert scores(report)["ex8"][0] == 0 and "scaled_dot_product" in exercise_text(report, "ex8")
    mha = make_variant(tmp_path, ("    return weights @ V",
                                  "    m = torch.nn.MultiheadAttention(V.shape[-1], 1, batch_first=True)\n"
                                  "    m(V, V, V)\n    return weights @ V"))
    report = grade(mha, limits=FAST)
    assert scores(report)["ex4"][0] == 0 and "multi_head_attention" in exercise_text(report, "ex4")


def test_monkeypatching_torch_or_the_grader_does_not_pass(tmp_path):
    cheat = (
        "import torch.testing, attnlab.labs.lab01_attention as _c, attnlab.testing as _t\n"
        "torch.allclose = lambda *a, **k: True\n"
        "torch.equal = lambda *a, **k: True\n"
        "torch.testing.assert_close = lambda *a, **k: None\n"
        "_c.close = lambda *a, **k: True\n"
        "_t.max_abs_diff = lambda *a, **k: 0.0\n"
    )
    path = make_variant(tmp_path, ("NEG_INF = float(\"-inf\")", "NEG_INF = float(\"-inf\")\n" + cheat),
                        (SCORES_LINE, "return Q @ K.transpose(-2, -1) * 0"))
    report = grade(path, limits=FAST)
    assert scores(report)["ex2"][0] < 10 and report.score < 100


# ------------------------------------------------------------------ misbehaving code
BAD = [
    ("hang", "def attention_scores(Q, K):\n    while True:\n        pass\n", "ex2", "did not finish within 1.5 s"),
    ("sys_exit", "def attend(weights, V):\n    raise SystemExit(3)\n", "ex4", "called sys.exit(3)"),
    ("forbidden_import", "def causal_mask(T):\n    import os\n    os._exit(0)\n", "ex5",
     "import of 'os': a submission may import only torch"),
    ("huge_allocation", "def padding_mask(lengths, T):\n    return torch.empty(10**12)\n", "ex6",
     "memory"),
    ("exception", "def apply_mask(scores, mask):\n    raise ValueError('oops: a learner bug')\n", "ex7",
     "ValueError: oops: a learner bug"),
    ("print_flood", "def project_qkv(X, W_Q, W_K, W_V):\n    while True:\n        print('x' * 1000)\n", "ex1",
     "printed more than 256 KB"),
    ("returns_garbage", "def attend(weights, V):\n    return range(3)\n", "ex4", "an object of type range"),
    ("returns_huge", "def attend(weights, V):\n    return torch.zeros(30_000_000)\n", "ex4", "returned more than 64 MB"),
]


@pytest.mark.parametrize("name,code,ex_id,words", BAD, ids=[b[0] for b in BAD])
def test_misbehaving_code_is_a_clear_failed_check(tmp_path, name, code, ex_id, words):
    # the bad definition comes last, so it replaces the good one
    path = make_variant(tmp_path)
    path.write_text(path.read_text() + "\n\n" + code)
    report = grade(path, limits=FAST)
    got, total = scores(report)[ex_id]
    assert got == 0, report.to_text()
    assert words in exercise_text(report, ex_id), exercise_text(report, ex_id)
    others = [s for k, (s, m) in scores(report).items() if k == "ex1" and ex_id != "ex1"]
    if name == "forbidden_import":  # the rule, broken anywhere, refuses the whole file (issue 47)
        assert report.score == 0 and "none of it was run" in report.problem
    else:
        assert all(s > 0 for s in others)  # one bad function does not sink the rest


def test_syntax_error_fails_every_check_with_the_line(tmp_path):
    path = make_variant(tmp_path, ("def attend(", "def attend(:"))
    report = grade(path, limits=FAST)
    assert report.score == 0
    assert "SyntaxError" in report.problem and "line" in report.problem
    assert "SyntaxError" in report.to_text()


def test_endless_loop_at_import(tmp_path):
    path = make_variant(tmp_path)
    path.write_text(path.read_text() + "\nwhile True:\n    pass\n")
    report = grade(path, limits=FAST)
    assert report.score == 0 and "did not finish" in report.problem


def test_learner_code_runs_in_a_child_in_an_empty_folder(tmp_path, monkeypatch):
    """torch alone can write files: the static check refuses torch.save (not on the lab's list),
    and the same code run straight in the sandbox writes only inside it."""
    from attnlab.grading.sandbox import Call, Sandbox
    from attnlab.grading.static import check_source

    monkeypatch.chdir(tmp_path)
    sub = tmp_path / "sub"
    sub.mkdir()
    code = ("import torch\n\ndef write():\n    torch.save(torch.zeros(1), 'marker.pt')\n"
            "    torch.save(torch.zeros(1), '../marker.pt')\n    return 1\n")
    assert any(".save" in v.message for v in check_source(code).violations)
    path = sub / "attention.py"
    path.write_text(code)
    with Sandbox(path, FAST) as box:
        outcome = box.run([Call("write")], policy=False)
    assert outcome.status == "ok" and outcome.results[0]["value"] == 1, outcome
    assert not (tmp_path / "marker.pt").exists() and not (sub / "marker.pt").exists()
    assert not list(tmp_path.rglob("marker.pt"))


def test_json_follows_gradescope_schema(tmp_path):
    path = make_variant(tmp_path, (SCORES_LINE, "return Q @ K.transpose(-2, -1)"))
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "attnlab", "grade", str(path), "--json", str(out), "--no-colour"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "forgot the 1/sqrt(d_k) scale" in proc.stdout and "\033[" not in proc.stdout
    data = json.loads(out.read_text())
    assert set(data) >= {"score", "execution_time", "output", "tests", "extra_data"}
    assert data["score"] == sum(t["score"] for t in data["tests"]) < 100
    for t in data["tests"]:
        assert set(t) == {"name", "score", "max_score", "output", "tags", "visibility"}
        assert 0 <= t["score"] <= t["max_score"]
    failed = [t for t in data["tests"] if t["name"] == "ex2 attention_scores: values"][0]
    assert failed["score"] == 0 and "missing_scale" in failed["tags"]
    assert any(d["code"] == "missing_scale" for d in data["extra_data"]["diagnostics"])
    # a picture of yours vs the reference for the failed numeric check, named in both reports
    picture = data["extra_data"]["images"]["ex2 attention_scores: values"]
    assert (tmp_path / picture).stat().st_size > 10_000 and f"picture: {picture}" in failed["output"]
    assert f"picture: {picture}" in proc.stdout


def test_json_is_written_even_when_everything_fails(tmp_path):
    bad = tmp_path / "attention.py"
    bad.write_text("def broken(:\n")
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "attnlab", "grade", str(bad), "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    data = json.loads(out.read_text())
    assert data["score"] == 0 and len(data["tests"]) == sum(len(ex.checks) for ex in EXERCISES)
    assert "SyntaxError" in data["output"]


def test_missing_file(tmp_path):
    report = grade(tmp_path / "nope.py")
    assert report.score == 0 and "no file" in report.problem


def test_a_missing_lab_dependency_is_named_with_its_install_command_not_scored_as_a_mistake(monkeypatch, capsys):
    """Installed from the wheel without the 'lab' extra, jaxtyping is missing: the report must
    say so and how to fix it, not 'Score 0 ... Start with ex1' as if the learner had erred."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jaxtyping" else real(name, *a))
    path = LAB / "solutions/attention.py"
    report = grade(path, seed=1)
    assert "jaxtyping" in report.environment_problem and "pip install 'attnlab[lab]'" in report.environment_problem
    text = report.to_text()
    assert "not a mistake in your code" in text and "Start with" not in text and "Fix the installation" in text
    assert main(["grade", str(path), "--no-images"]) == 2
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert grade(path, seed=1).score == 100  # with it installed, the same file is fine


def test_a_nan_layer_cannot_claim_parity(tmp_path):
    """self_attention returning NaN and compare_with_sdpa claiming 0.0 earned ex9's points
    ('inf > inf' is False); now ex9 fails and says why."""
    bad = tmp_path / "attention.py"
    bad.write_text((LAB / "solutions/attention.py").read_text() + '''

def self_attention(X, W_Q, W_K, W_V, mask=None):
    Q = X @ W_Q
    return Q[..., :1] * float("nan") + (X @ W_V), Q @ Q.transpose(-2, -1) * float("nan")


def compare_with_sdpa(X, W_Q, W_K, W_V, mask=None):
    return 0.0
''')
    report = grade(bad, seed=3)
    ex9 = [r for r in report.results if r.exercise.id == "ex9"]
    assert ex9 and all(r.score == 0 for r in ex9), report.to_text()
    assert "returns NaN or inf" in ex9[0].verdict.message
