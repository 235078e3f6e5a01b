"""Ulysses over 2 and 4 gloo ranks (attnlab.distributed.testing.run_ranks) against one process in
float64: every output and gradient, sinks included, for causal, packed documents of uneven lengths,
a sliding window, GQA with Hkv divisible by W and not, and the zigzag layout."""

from __future__ import annotations

import pytest
import torch

from attnlab.distributed.testing import run_ranks
from helpers.cp_workers import assemble, attend, golden, inputs

pytestmark = [pytest.mark.subprocess]

CASES = {  # name: (world, H, Hkv, causal, mask, sinks, layout)
    "causal_w2": (2, 4, 2, True, "", False, "contiguous"),
    "causal_w4_gqa_replicated": (4, 4, 2, True, "", False, "contiguous"),  # Hkv = 2 < W = 4: repeated to 4
    "document_w2": (2, 4, 4, False, "document", False, "contiguous"),
    "document_w4_sinks": (4, 8, 4, False, "document", True, "contiguous"),
    "sliding_w2_zigzag": (2, 4, 2, False, "sliding", False, "zigzag"),
    "sinks_causal_w2": (2, 4, 1, True, "", True, "zigzag"),  # MQA: one key/value head repeated to 2
    "plain_w4": (4, 4, 4, False, "", False, "zigzag"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_ulysses_equals_one_process(case):
    world, H, Hkv, causal, mask, sinks, layout = CASES[case]
    q, k, v, do, s = inputs(H=H, Hkv=Hkv, L=32, sinks=sinks)
    ranks = run_ranks(attend, world, args=("ulysses", q, k, v, do, causal, mask, s, layout), timeout=120)
    want = golden(q, k, v, do, causal, mask, s)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = assemble([r[i] for r in ranks], world, layout)
        assert torch.allclose(got, want[i], atol=1e-12, rtol=1e-10), (name, (got - want[i]).abs().max())
    if sinks:  # each rank's share (its heads'), summed over the group as for any replicated parameter
        got = sum(r[4] for r in ranks)
        assert torch.allclose(got, want[4], atol=1e-12, rtol=1e-10), (got, want[4])


def test_kv_heads_are_scattered_or_repeated_as_deepspeed_does():
    from attnlab.distributed import kv_heads_for

    assert kv_heads_for(8, 4, 2) == 4  # divisible: scattered as they are
    assert kv_heads_for(8, 2, 4) == 4  # 2 heads over 4 ranks: each repeated twice
    assert kv_heads_for(8, 1, 8) == 8  # MQA: the one head on every rank
    assert kv_heads_for(12, 3, 4) == 12  # 3 -> 6 (4 does not divide) -> 12
    with pytest.raises(ValueError, match="the 6 query heads do not split over 4 ranks"):
        kv_heads_for(6, 2, 4)


def test_bad_calls_are_refused_by_name_on_every_rank():
    from helpers.cp_workers import refusals

    for messages in run_ranks(refusals, 2, timeout=60):
        heads, both, lengths = messages
        assert heads.startswith("ValueError: ulysses_attention: the 3 query heads do not split over 2 ranks"), heads
        assert "pass either is_causal=True or a mask_mod" in both, both
        assert "as many query as key rows" in lengths, lengths


def test_ulysses_needs_an_initialised_process_group():
    from attnlab.distributed import ulysses_attention

    q = torch.randn(1, 2, 4, 4)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ulysses_attention(q, q, q)
