"""Lab 04 (labs/track1/04-flash-attention): solutions score 100, stubs 0 with where to start, each
named mistake named by at least two buggy variants (the forward that builds [L, S] among them,
caught by the memory cap), grading under 5 s, the walkthrough runs."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from attnlab import labs

from attnlab import mistakes
from attnlab.grading import grade
from attnlab.grading.static import check_source
from helpers.labtests import codes, grade_variants, run_walkthrough

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

LAB = Path(__file__).resolve().parents[2] / "labs/track1/04-flash-attention"

EX1_SUM = "        l_i = l_i * torch.exp(m_i - m_safe) + torch.exp(chunk - m_safe[:, None]).sum(dim=-1)"
ACC = "            acc = acc * alpha[..., None] + p @ v[:, :, ks:ke]"
L_SUM = "            l_i = l_i * alpha + p.sum(dim=-1)"
LSE = "        lse[:, :, qs:qe] = m_i + torch.log(l_i)"
K_STOP = "        k_stop = min(S, qe) if is_causal else S"
FWD_SCORES = "            s = q_i @ k[:, :, ks:ke].transpose(-2, -1)  # [B, H, bq, bk]\n"
BWD_SCORES = "            s = (q_i @ k_j.transpose(-2, -1)) * scale  # [B, H, bq, bk]\n"
MASKING = ("            if is_causal:\n                mask = causal_block_mask(qs, qe, ks, ke)\n"
           "                if mask is not None:\n                    s = s.masked_fill(~mask, float(\"-inf\"))\n")
DIAG = "    return cols <= rows"
D_TERM = "            ds = p * (dp - D[:, :, qs:qe, None])"
DQ = "            dq[:, :, qs:qe] += (ds @ k_j) * scale"
DK = "            dk[:, :, ks:ke] += (ds.transpose(-2, -1) @ q_i) * scale"
SAVE = "        ctx.save_for_backward(q, k, v, o, lse)"
UNPACK = ("        q, k, v, o, lse = ctx.saved_tensors", "        q, k, v, o, lse = ctx.saved_tensors[:5]")

# one mistake per exercise in each variant
VARIANTS = {
    "A": ([(EX1_SUM, "        l_i = l_i + torch.exp(chunk - m_safe[:, None]).sum(dim=-1)"),
           (ACC, "            acc = acc + p @ v[:, :, ks:ke]"),
           (D_TERM, "            ds = p * dp")],
          [("ex1", "online_rescale"), ("ex2", "online_rescale"), ("ex4", "backward_d_term")]),
    "B": ([(EX1_SUM, "        l_i = l_i * torch.exp(m_safe - m_i) + torch.exp(chunk - m_safe[:, None]).sum(dim=-1)"),
           (L_SUM, "            l_i = l_i + p.sum(dim=-1)"),
           ("    D = (do * o).sum(dim=-1)  # [B, H, L]", "    D = torch.zeros_like(lse)  # [B, H, L]")],
          [("ex1", "online_rescale"), ("ex2", "online_rescale"), ("ex4", "backward_d_term")]),
    "C": ([(LSE, "        lse[:, :, qs:qe] = m_i + torch.log2(l_i)"),
           (DQ, "            dq[:, :, qs:qe] += ds @ k_j"), (DK, "            dk[:, :, ks:ke] += ds.transpose(-2, -1) @ q_i")],
          [("ex2", "lse_saved"), ("ex4", "missing_scale")]),
    "D": ([(LSE, "        lse[:, :, qs:qe] = m_i"),
           (DQ, "            dq[:, :, qs:qe] += torch.matmul(ds, k_j)"),
           (DK, "            dk[:, :, ks:ke] += torch.matmul(ds.transpose(-2, -1), q_i)"),
           (SAVE, "        ctx.save_for_backward(q, k, v, o, lse, q @ k.transpose(-2, -1))"), UNPACK],
          [("ex2", "lse_saved"), ("ex4", "missing_scale"), ("ex5", "scores_materialized")]),
    "E": ([(FWD_SCORES + MASKING, FWD_SCORES), (BWD_SCORES + MASKING, BWD_SCORES)],
          [("ex2", "causal_block_skip"), ("ex4", "causal_block_skip")]),
    "F": ([(K_STOP, "        k_stop = min(S, qs) if is_causal else S"),
           (FWD_SCORES, "            s = (q * scale @ k.transpose(-2, -1))[:, :, qs:qe, ks:ke]  # [B, H, bq, bk]\n")],
          [("ex2", "causal_block_skip"), ("ex3", "scores_materialized")]),
    "G": ([(DIAG, "    return cols < rows"),
           ("    scale = 1.0 / math.sqrt(E)\n    o = torch.empty",
            "    scale = 1.0 / math.sqrt(E)\n    scores = q @ k.transpose(-2, -1)  # [B, H, L, S]: never used\n"
            "    o = torch.empty")],
          [("ex2", "off_by_one"), ("ex3", "scores_materialized")]),
    "H": ([(DIAG, "    return rows - cols >= 1"),
           (LSE, "        lse[:, :, qs:qe] = (m_i + torch.log(l_i)) / math.log(2)"),
           (SAVE, "        p = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - lse[..., None])\n"
                  "        ctx.save_for_backward(q, k, v, o, lse, p)"), UNPACK],
          [("ex2", "off_by_one"), ("ex2", "lse_saved"), ("ex5", "scores_materialized")]),
    # every tile computed, the future ones masked to -inf: right answers, but the work (and 0 x NaN)
    # of the tiles it should skip
    "I": ([(K_STOP, "        k_stop = S")], [("ex2", "causal_block_skip")]),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return grade_variants("04-flash-attention", "flash.py", VARIANTS, tmp_path_factory.mktemp("variants"), seed=5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_mistake_is_named(graded, name):
    report = graded[name]
    assert report.lab == "04-flash-attention"
    for ex_id, code in VARIANTS[name][1]:
        assert code in codes(report, ex_id), (ex_id, code, report.to_text())
        assert code in mistakes.CODES
    assert report.score < 100


def test_every_named_mistake_has_two_variants():
    counts = Counter(code for _, expect in VARIANTS.values() for _, code in expect)
    # the list: accumulator not rescaled, lse not saved / wrong base, causal blocks, the D term
    assert {"online_rescale", "lse_saved", "causal_block_skip", "backward_d_term", "scores_materialized"} <= set(counts)
    assert min(counts.values()) >= 2, counts


def test_the_memory_check_fails_the_forward_that_builds_the_scores_and_only_it(graded):
    for name in ("F", "G"):
        ex3 = [r for r in graded[name].results if r.exercise.id == "ex3"]
        assert [r.score for r in ex3] == [0.0], graded[name].to_text()
        assert "ran out of its 32 MB" in ex3[0].verdict.message
    for name in ("C", "D", "E"):  # tiled forwards, right without is_causal, wrong elsewhere: ex3 passes
        assert [r.score for r in graded[name].results if r.exercise.id == "ex3"] == [15.0]


def test_a_loop_that_computes_the_future_tiles_loses_only_the_skipping_check(graded):
    failed = [(r.exercise.id, r.check) for r in graded["I"].results if r.score < r.max_score]
    assert failed == [("ex2", "skips_future_tiles")], graded["I"].to_text()


def test_solutions_full_marks_stubs_zero_with_a_pointer_and_fast():
    t0 = time.perf_counter()
    report = grade(LAB / "solutions/flash.py", seed=3)
    assert report.score == 100, report.to_text()
    assert time.perf_counter() - t0 < 5.0 or report.elapsed_s < 5.0
    stub = grade(LAB / "flash.py", seed=3)
    assert stub.score == 0 and "Start with ex1: online_softmax_stats() in flash.py" in stub.to_text()


def test_a_banned_call_inside_the_autograd_function_costs_the_exercises_that_reach_it():
    source = (LAB / "solutions/flash.py").read_text().replace(
        "        o, lse = flash_forward(q, k, v, is_causal)\n",
        "        o, lse = flash_forward(q, k, v, is_causal)\n        o = torch.softmax(o, dim=-1)\n")
    report = check_source(source, "flash.py", labs.find_lab("04").allowed_names)
    assert [v.function for v in report.violations] == ["TiledAttention"]
    assert report.for_exercise("attention_and_grads", allow_attention=False)
    assert not report.for_exercise("flash_forward", allow_attention=False)
    assert not report.module_level()


def test_walkthrough_is_paired_and_runs_on_the_solutions(tmp_path):
    text = run_walkthrough("04-flash-attention", "flash.py", LAB / "solutions/flash.py", tmp_path)
    assert "running max after each block" in text and "max |tiled - SDPA|" in text
    assert "max |gradient - autograd|" in text
