"""Ring attention with any mask_mod over absolute positions (issue 25 item 4): packed documents
and sliding windows, GQA, both layouts, outputs and gradients against one process's
flex_attention with the same mask; float64 runs the pure path (the kernel layer's online
softmax over each pair's element mask), float32 the native block-sparse kernels. (Shown to fail:
with the pair's mask built from local instead of absolute positions, 9 of these 10 fail.)"""

import pytest
import torch

from attnlab.bench.ranks import run_ring
from attnlab.testing import tolerance

pytestmark = [pytest.mark.subprocess]


@pytest.mark.parametrize("mask", ["document", "sliding"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_ring_with_a_mask_matches_one_process(mask, layout, dtype):
    cfg = dict(B=1, H=4, Hkv=2, L=64 * 4, E=8, causal=False, layout=layout, dtype=dtype, timeout=60, mask=mask)
    reports = run_ring(2, cfg, timeout_s=180)
    assert all("error" not in r for r in reports), reports
    diffs = reports[0]["max_abs_diff"]
    bound = 1e-12 if dtype == "float64" else 10 * tolerance(torch.float32).atol
    assert set(diffs) == {"output", "dq", "dk", "dv"} and max(diffs.values()) < bound, diffs


def test_four_ranks_and_many_head_groups():
    cfg = dict(B=2, H=4, Hkv=2, L=64 * 8, E=8, causal=False, layout="zigzag", dtype="float32", timeout=60,
               mask="document", message_bytes=1)
    reports = run_ring(4, cfg, timeout_s=180)
    assert all("error" not in r for r in reports), reports
    assert max(reports[0]["max_abs_diff"].values()) < 10 * tolerance(torch.float32).atol


def test_ring_mask_arguments_are_checked():
    from attnlab.distributed import ring_attention

    with pytest.raises(RuntimeError, match="not initialised"):
        ring_attention(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), mask_mod=lambda *a: a)
