"""Lab 03 (labs/track1/03-multi-head): solutions score 100, stubs 0 with where to start, each
named mistake named by at least two buggy variants, grading under 5 s, the walkthrough runs."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from attnlab import mistakes
from attnlab.grading import grade
from helpers.labtests import codes, grade_variants, run_walkthrough

pytestmark = [pytest.mark.sandbox, pytest.mark.subprocess]

LAB = Path(__file__).resolve().parents[2] / "labs/track1/03-multi-head"

SPLIT = "return x.view(B, L, H, D // H).transpose(1, 2)  # [B, L, H, E] -> [B, H, L, E]"
MERGE = "return x.transpose(1, 2).reshape(B, L, H * E)  # [B, L, H, E] -> [B, L, D]"
OUT_PROJ = "return merge_heads(softmax_last(scores) @ v) @ W_O"
MHA_SCALE = ("    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, L, L]")
REPEAT = "return kv.repeat_interleave(groups, dim=1)"
GQA_REPEAT = "k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # [B, H, S, E]"
CACHE_MASK = "mask = torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=P)  # query i sees keys 0 .. P + i"
CACHE_CAT = "k = torch.cat([k_cache, k_new], dim=2)  # [B, H, P + L, E]"

# one mistake per exercise in each variant (ex3 calls split/merge_heads, so those stay right there)
VARIANTS = {
    "A": ([(SPLIT, "return x.reshape(B, H, L, D // H)"),
           (MERGE, "return x.reshape(B, L, H * E)"),
           (REPEAT, "return kv.repeat(1, groups, 1, 1)"),
           (CACHE_MASK, "mask = torch.ones(L, P + L, dtype=torch.bool).tril()")],
          [("ex1", "heads_mixed"), ("ex2", "heads_mixed"), ("ex4", "gqa_group_mapping"), ("ex6", "causal_alignment")]),
    "B": ([(OUT_PROJ, "return merge_heads(softmax_last(scores) @ v)"),
           (GQA_REPEAT, "k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)"),
           (CACHE_MASK, "mask = torch.ones(L, P + L, dtype=torch.bool)")],
          [("ex3", "missing_out_proj"), ("ex5", "gqa_group_mapping"), ("ex6", "causal_alignment")]),
    "C": ([(MHA_SCALE, "    scores = q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])"),
           (CACHE_CAT, "k = torch.cat([k_new, k_cache], dim=2)"),
           ("v = torch.cat([v_cache, v_new], dim=2)", "v = torch.cat([v_new, v_cache], dim=2)")],
          [("ex3", "wrong_scale"), ("ex6", "kv_cache_order")]),
    "D": ([(MHA_SCALE, "    scores = q @ k.transpose(-2, -1) / math.sqrt(W_Q.shape[0])"),
           (REPEAT, "return torch.cat([kv] * groups, dim=1)"),
           (CACHE_CAT, "k = torch.cat((k_new, k_cache), 2)"),
           ("v = torch.cat([v_cache, v_new], dim=2)", "v = torch.cat((v_new, v_cache), 2)")],
          [("ex3", "wrong_scale"), ("ex4", "gqa_group_mapping"), ("ex6", "kv_cache_order")]),
    "E": ([(OUT_PROJ, "y = merge_heads(softmax_last(scores) @ v)\n    return y"),
           (GQA_REPEAT, "k, v = torch.cat([k] * groups, 1), torch.cat([v] * groups, 1)")],
          [("ex3", "missing_out_proj"), ("ex5", "gqa_group_mapping")]),
    "F": ([(SPLIT, "return x.view(B, L, D // H, H).permute(0, 3, 1, 2)"),
           (MERGE, "return x.view(B, L, H * E)")],
          [("ex1", "heads_mixed"), ("ex2", "heads_mixed")]),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return grade_variants("03-multi-head", "multihead.py", VARIANTS, tmp_path_factory.mktemp("variants"), seed=5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_mistake_is_named(graded, name):
    report = graded[name]
    assert report.lab == "03-multi-head"
    for ex_id, code in VARIANTS[name][1]:
        assert code in codes(report, ex_id), (ex_id, code, report.to_text())
        assert code in mistakes.CODES


def test_every_named_mistake_has_two_variants():
    counts = Counter(code for _, expect in VARIANTS.values() for _, code in expect)
    assert {"heads_mixed", "gqa_group_mapping", "causal_alignment", "missing_out_proj", "wrong_scale",
            "kv_cache_order"} <= set(counts)
    assert min(counts.values()) >= 2, counts


def test_solutions_full_marks_stubs_zero_with_a_pointer_and_fast():
    t0 = time.perf_counter()
    report = grade(LAB / "solutions/multihead.py", seed=3)
    assert report.score == 100, report.to_text()
    assert time.perf_counter() - t0 < 5.0 or report.elapsed_s < 5.0
    stub = grade(LAB / "multihead.py", seed=3)
    assert stub.score == 0 and "Start with ex1: split_heads() in multihead.py" in stub.to_text()


def test_walkthrough_is_paired_and_runs_on_the_solutions(tmp_path):
    # (that a stub stops the walkthrough at ex1 is tested once, for lab 01: tests/labs/test_lab_notebook.py)
    text = run_walkthrough("03-multi-head", "multihead.py", LAB / "solutions/multihead.py", tmp_path)
    assert "head 1 of position 0: [4.0, 5.0, 6.0, 7.0]" in text and "[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]" in text
    assert "cache length: 7" in text and "max |cached decoding - full causal forward|" in text
