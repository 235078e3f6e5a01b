import json

import pytest
import torch

from attnlab import doctor, mistakes
from attnlab.cli import main
from helpers.mutants import BUGGY, CORRECT, FITTED


@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_implementations_raise_no_alarm(name):
    report = doctor.diagnose(CORRECT[name])
    assert report.ok, str(report)
    assert report.findings == [] and report.max_abs_error < 1e-4


@pytest.mark.parametrize("code,name,fn", BUGGY, ids=[f"{c}-{n}" for c, n, _ in BUGGY])
def test_each_mutant_is_named_first(code, name, fn):
    report = doctor.diagnose(fn)
    assert not report.ok
    assert report.findings[0].code == code, str(report)


@pytest.mark.parametrize("code,name,fn,words", FITTED, ids=[f"{c}-{n}" for c, n, _, _ in FITTED])
def test_continuous_mistakes_are_fitted_and_the_number_is_named(code, name, fn, words):
    report = doctor.diagnose(fn)
    assert report.findings[0].code == code and words in report.findings[0].message, str(report)


def test_every_code_has_two_mutants_and_a_hint():
    codes = [c for c, _, _ in BUGGY]
    for code in mistakes.DOCTOR_CODES:  # the forward's (the backward's: tests/core/test_doctor_backward.py)
        assert codes.count(code) >= 2, code
        assert len(doctor.CODES[code]) > 20


def test_two_bugs_are_both_named():
    from helpers.mutants import variant
    fn = variant(scale_fn=lambda scale, q, k, v: 1.0,
                 mask_fn=lambda s, keep: (s if keep is None else s.masked_fill(keep, float("-inf")), None))
    codes = [f.code for f in doctor.diagnose(fn).findings]
    assert codes[:2] == ["missing_scale", "mask_polarity"]


def test_report_text_and_dict():
    _, _, fn = next(b for b in BUGGY if b[1] == "no_scale")
    report = doctor.diagnose(fn)
    text = str(report)
    assert "[missing_scale]" in text and "1/sqrt(d_k)" in text
    d = report.to_dict()
    assert d["ok"] is False and d["findings"][0]["code"] == "missing_scale" and d["max_abs_error"] > 0.01


def test_self_attention_adapter():
    import math

    def lab_style(X, W_Q, W_K, W_V, mask=None):
        Q, K, V = X @ W_Q, X @ W_K, X @ W_V
        s = Q @ K.transpose(-2, -1)  # forgot the scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        w = torch.softmax(s, -1)
        return w @ V, w

    assert doctor.diagnose(doctor.adapt_self_attention(lab_style)).findings[0].code == "missing_scale"

    def lab_ok(X, W_Q, W_K, W_V, mask=None):
        Q, K, V = X @ W_Q, X @ W_K, X @ W_V
        s = Q @ K.transpose(-2, -1) / math.sqrt(K.shape[-1])
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        w = torch.nan_to_num(torch.softmax(s, -1))
        return w @ V, w

    assert doctor.diagnose(doctor.adapt_self_attention(lab_ok)).ok


def test_cli_doctor(tmp_path, capsys, monkeypatch):
    (tmp_path / "myattn.py").write_text(
        "import torch\n"
        "def attn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):\n"
        "    return torch.softmax(q @ k.transpose(-2, -1), -1) @ v\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["doctor", "myattn:attn", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["findings"][0]["code"] == "missing_scale"
    assert main(["doctor", "attnlab.functional:scaled_dot_product_attention"]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["doctor", "nosuchmodule:fn"]) == 2
    assert "cannot import" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_diagnosis_does_not_depend_on_the_probe_seed(seed):
    first_codes = {name: [f.code for f in doctor.diagnose(fn, seed=seed).findings][:1] for _, name, fn in BUGGY}
    wrong = [(name, first_codes[name], code) for code, name, _ in BUGGY if first_codes[name] != [code]]
    assert wrong == []
    assert all(doctor.diagnose(fn, seed=seed).ok for fn in CORRECT.values())


def test_json_max_error_is_null_when_not_finite():
    _, _, fn = next(b for b in BUGGY if b[1] == "torch_softmax_nan")
    d = doctor.diagnose(fn).to_dict()
    assert d["max_abs_error"] is None and json.dumps(d)


def _is_message(node) -> bool:
    import ast

    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp):  # "..." + "..."
        return _is_message(node.left)
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and " " in node.value


def test_one_vocabulary_for_the_doctor_and_the_grader():
    """Every code the lab's checks or the grader can emit is a named mistake of
    attnlab.mistakes (walked from their source: string literals in a code position)."""
    import ast
    from pathlib import Path

    import importlib

    from attnlab import labs, mistakes

    emitted = set()
    modules = [importlib.import_module(lab.checks) for lab in labs.LABS] + [importlib.import_module(m) for m in (
        "attnlab.grading.grader", "attnlab.grading.exercise")]
    assert len(modules) >= 3  # every lab's checks, and the grader
    for module in modules:
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):  # {"code": "...", ...}
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and k.value == "code" and isinstance(v, ast.Constant):
                        emitted.add(v.value)
            if isinstance(node, ast.Tuple) and len(node.elts) == 3 and isinstance(node.elts[0], ast.Constant) \
                    and isinstance(node.elts[0].value, str) and _is_message(node.elts[1]):
                emitted.add(node.elts[0].value)  # (code, message, wrong answer) in a check's mistakes list
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "mistake" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                emitted.add(node.args[0].value)  # mistake(code, message, wrong answer): checks.mistake
    emitted.discard("_")
    assert len(emitted) >= 15, emitted
    assert emitted <= set(mistakes.CODES), emitted - set(mistakes.CODES)
    assert set(doctor.CODES) <= set(mistakes.CODES) and all(len(h) > 20 for h in mistakes.CODES.values())
    with pytest.raises(KeyError, match="attnlab.mistakes.CODES"):
        mistakes.hint("made_up")
    from attnlab.grading.exercise import mistake

    with pytest.raises(KeyError, match="attnlab.mistakes.CODES"):  # the labs' checks cannot name one outside it
        mistake("made_up", "a message", None)


def test_grouped_heads_are_probed_where_the_function_takes_enable_gqa():
    """The doctor probes enable_gqa only where the function takes it, and says what it left out."""
    from helpers.mutants import torch_sdpa

    assert "gqa" in doctor.capabilities_of(CORRECT["gqa_interleave"])
    assert "gqa" not in doctor.capabilities_of(torch_sdpa)
    report = doctor.diagnose(torch_sdpa)
    assert report.ok and "enable_gqa (grouped key/value heads)" in report.not_probed
    assert "Not probed: enable_gqa" in str(report) and report.to_dict()["not_probed"] == report.not_probed
    assert doctor.diagnose(CORRECT["gqa_interleave"]).not_probed == []
