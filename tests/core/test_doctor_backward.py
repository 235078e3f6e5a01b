"""The doctor for backward passes (issue 50, item 4): `attnlab doctor --backward` and `--grad-test`.

The corpus (tests/corpus/backward.py, written from the brief alone by an independent author) holds
kernels rebuilt from public bug reports, each with the code a reader of the report would name, and
correct kernels (torch's math, attnlab's paths, an einsum one, a chunked one). The doctor must name
at least 90% of the bugs by their code, raise no alarm on a correct kernel, and spend at most 60 s
of CPU on one kernel.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import torch

from attnlab import mistakes
from attnlab.doctor import audit_gradient_test, backward_capabilities, diagnose_backward
from attnlab.testing import assert_close_to_sdpa
from corpus.backward import CASES, GRAD_TESTS

BUGS = [c for c in CASES if c.expected]
CORRECT = [c for c in CASES if not c.expected]
_results: dict[str, tuple[list[str], float]] = {}


def _diagnose(case) -> tuple[list[str], float]:
    if case.name not in _results:
        start = time.process_time()
        report = diagnose_backward(case.fn)
        _results[case.name] = ([f.code for f in report.findings], time.process_time() - start)
    return _results[case.name]


def test_the_corpus_is_what_the_issue_asks():
    assert len(BUGS) >= 25 and len(CORRECT) >= 6
    assert all(c.source.startswith("https://github.com/") for c in BUGS), [c.name for c in BUGS]
    assert {c.expected for c in BUGS} <= set(mistakes.BACKWARD_CODES)
    # every backward code the doctor can fit has a kernel in the corpus
    assert set(mistakes.BACKWARD_CODES) - {"shape_error", "unknown", "grad_test_blind"} <= {c.expected for c in BUGS}
    assert sum(t.expected == "grad_test_blind" for t in GRAD_TESTS) >= 2
    assert sum(t.expected is None for t in GRAD_TESTS) >= 2


@pytest.mark.parametrize("case", CORRECT, ids=lambda c: c.name)
def test_no_alarm_on_a_correct_kernel(case):
    codes, cpu = _diagnose(case)
    assert codes == [], (case.name, codes)
    assert cpu <= 60, cpu


def test_at_least_90_percent_of_the_bugs_are_named_by_their_code():
    named, missed = [], []
    for case in BUGS:
        codes, cpu = _diagnose(case)
        assert cpu <= 60, (case.name, cpu)
        # named: the expected code is the doctor's first finding (its most likely root cause)
        (named if codes[:1] == [case.expected] else missed).append((case.name, case.expected, codes))
    rate = len(named) / len(BUGS)
    assert rate >= 0.9, f"{len(named)}/{len(BUGS)} named; missed: {missed}"
    # every code in the corpus is named at least once
    assert {e for _, e, _ in named} == {c.expected for c in BUGS}, missed


def test_each_bug_is_at_least_flagged():
    # the 10% the rate allows may be named otherwise, but never pass as correct
    for case in BUGS:
        codes, _ = _diagnose(case)
        assert codes, f"{case.name} ({case.note}) passed the backward doctor"


@pytest.mark.parametrize("test", GRAD_TESTS, ids=lambda t: t.name)
def test_a_gradient_test_that_cannot_fail_is_named(test):
    codes = [f.code for f in audit_gradient_test(test.loss, test.shape, atol=test.atol, rtol=test.rtol)]
    assert codes == ([test.expected] if test.expected else []), (test.name, test.note, codes)


def test_capabilities_follow_the_signature():
    def sdpa_like(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        ...

    def with_everything(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                        sinks=None):
        ...

    assert backward_capabilities(sdpa_like) == {"causal", "mask", "scale"}
    assert backward_capabilities(with_everything) == {"causal", "mask", "scale", "gqa", "sinks"}


def test_testing_checks_gradients_by_default():
    # a kernel whose forward is right and whose backward is wrong fails attnlab.testing's default check
    case = next(c for c in BUGS if c.expected == "backward_d_term")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    with pytest.raises(AssertionError, match="dquery|dkey"):
        assert_close_to_sdpa(case.fn, q, k, v)
    good = CORRECT[0]
    assert_close_to_sdpa(good.fn, q, k, v)


def test_a_forward_mistake_is_named_first():
    def no_scale_forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        from attnlab.functional import scaled_dot_product_attention
        return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                            scale=1.0)

    report = diagnose_backward(no_scale_forward)
    assert not report.ok and report.findings[0].code == "missing_scale"
    assert "the forward is already wrong" in report.findings[0].message


def test_a_function_that_fails_is_a_finding_not_a_crash():
    def broken(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        raise RuntimeError("boom")

    report = diagnose_backward(broken)
    assert not report.ok and {f.code for f in report.findings} == {"shape_error"}
    assert not math.isfinite(report.max_abs_error)


@pytest.mark.subprocess
def test_the_cli(tmp_path):
    (tmp_path / "kern.py").write_text(
        "from attnlab.functional import scaled_dot_product_attention as sdpa\n"
        "def good(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):\n"
        "    return sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)\n"
        "def loss(out):\n"
        "    return out.mean()\n")
    run = [sys.executable, "-m", "attnlab", "doctor"]
    ok = subprocess.run(run + [f"{tmp_path}/kern.py:good", "--backward", "--json"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    blind = subprocess.run(run + [f"{tmp_path}/kern.py:loss", "--grad-test", "--atol", "1e-5"], capture_output=True,
                           text=True)
    assert blind.returncode == 1 and "[grad_test_blind]" in blind.stdout, blind.stdout + blind.stderr
    bad = subprocess.run(run + [f"{tmp_path}/kern.py:loss", "--grad-test", "--shape", "1,2"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "B,H,L,E" in bad.stderr and "Traceback" not in bad.stderr


def test_the_corpus_codes_cover_the_issue_s_list():
    # the issue's list: a missing scale in dS, the wrong D term, a causal mask missing in the backward,
    # GQA gradients not summed, a wrong sink gradient, a gradient test that cannot fail
    wanted = {"backward_scale", "backward_d_term", "backward_mask", "gqa_grad_sum", "sink_grad"}
    assert wanted <= {c.expected for c in BUGS}


def _with_backward(grads_of):
    """An SDPA-signature kernel with attnlab's forward and a backward ``grads_of(dq, dk, dv)`` that
    gets the right gradients and returns its own."""
    from attnlab.functional import scaled_dot_product_attention

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return scaled_dot_product_attention(q, k, v)

        @staticmethod
        def backward(ctx, do):
            leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
            with torch.enable_grad():
                right = torch.autograd.grad(scaled_dot_product_attention(*leaves), leaves, do)
            return grads_of(*right)

    def kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        if attn_mask is not None or is_causal or scale is not None:
            raise ValueError("plain attention only")
        return Fn.apply(query, key, value)

    return kernel


def test_the_right_backward_through_the_helper_passes():
    assert diagnose_backward(_with_backward(lambda dq, dk, dv: (dq, dk, dv))).ok


@pytest.mark.parametrize("what", ["nan", "inf", "shape"])
def test_non_finite_or_misshapen_gradients_never_pass(what):
    def grads(dq, dk, dv):
        if what == "shape":
            return dq, dk.sum(-1), dv
        dq = dq.clone()
        dq[0, 0, 0, 0] = math.nan if what == "nan" else math.inf
        return dq, dk, dv

    report = diagnose_backward(_with_backward(grads))
    assert not report.ok and report.findings, report
    if what == "shape":
        assert report.findings[0].code == "shape_error" and "gradient" in report.findings[0].message


def test_no_alarm_on_attnlab_s_triton_kernels_under_the_interpreter():
    at = pytest.importorskip("attnlab.triton", reason="make test installs triton (the dev extra)")
    assert at.interpreted(), "tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported"

    def triton_kernels(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
        if attn_mask is not None or dropout_p:
            raise ValueError("attnlab.triton.flash_attention takes no attn_mask and no dropout")
        return at.flash_attention(query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    report = diagnose_backward(triton_kernels)
    assert report.ok, report
