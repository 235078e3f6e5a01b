"""`attnlab doctor --context-parallel` (issue 64, item 4): each planted fault (tests/helpers/cp_faults.py)
named by its code, and attnlab's ring, Ulysses and USP paths with no alarm."""

from __future__ import annotations

import pytest

from attnlab.doctor import diagnose_context_parallel
from attnlab.distributed import ring_attention, ulysses_attention
from helpers import cp_faults

pytestmark = [pytest.mark.subprocess]


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention, cp_faults.gathered])
def test_right_context_parallel_attention_raises_no_alarm(fn):
    report = diagnose_context_parallel(fn, world=2)
    assert report.ok and not report.findings, str(report)
    assert report.probes_run == 4 and report.not_probed == []


@pytest.mark.parametrize("fault,code", [
    (cp_faults.sinks_dropped, "cp_sinks"), (cp_faults.sinks_per_rank, "cp_sinks"),
    (cp_faults.causal_offset, "cp_causal_offset"), (cp_faults.zigzag_in_rank_order, "cp_layout"),
    (cp_faults.ring_one_step_short, "cp_missing_shard"), (cp_faults.merged_in_base_2, "cp_lse_merge"),
    (cp_faults.heads_gathered_strided, "cp_heads"), (cp_faults.grads_not_reduced, "cp_grad_reduce"),
])
def test_each_planted_fault_is_named_by_its_code(fault, code):
    report = diagnose_context_parallel(fault, world=2)
    assert not report.ok and [f.code for f in report.findings] == [code], str(report)


def test_four_ranks_name_the_one_step_short_ring_too():
    report = diagnose_context_parallel(cp_faults.ring_one_step_short, world=4)
    assert [f.code for f in report.findings] == ["cp_missing_shard"], str(report)


def test_a_function_without_layout_or_sinks_is_probed_on_what_it_takes():
    report = diagnose_context_parallel(cp_faults.plain, world=2)
    assert report.ok and report.probes_run == 1, str(report)
    assert len(report.not_probed) == 3 and "zigzag" in report.not_probed[0]


def test_usp_on_a_two_by_two_mesh_raises_no_alarm():
    report = diagnose_context_parallel(cp_faults.usp_2x2, world=4)
    assert report.ok and report.probes_run == 3, str(report)  # no layout=: the zigzag probe is left out
