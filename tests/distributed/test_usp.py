"""USP (context_parallel_attention): Ulysses inside each group of a 2-D mesh, the ring across, over
4 gloo ranks against one process in float64; the degenerate meshes are the two schemes."""

from __future__ import annotations

import pytest
import torch

from attnlab.distributed.testing import run_ranks
from helpers.cp_workers import assemble, assemble_usp, attend, attend_usp, golden, inputs

pytestmark = [pytest.mark.subprocess]

CASES = {  # name: (wr, wu, H, Hkv, causal, mask, sinks, layout)
    "2x2_causal_zigzag_gqa": (2, 2, 4, 2, True, "", False, "zigzag"),
    "2x2_document_sinks": (2, 2, 4, 4, False, "document", True, "contiguous"),
    "2x2_sliding_mqa": (2, 2, 4, 1, False, "sliding", False, "contiguous"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_usp_equals_one_process(case):
    wr, wu, H, Hkv, causal, mask, sinks, layout = CASES[case]
    q, k, v, do, s = inputs(H=H, Hkv=Hkv, L=32, sinks=sinks)
    ranks = run_ranks(attend_usp, wr * wu, args=(wr, wu, q, k, v, do, causal, mask, s, layout), timeout=120)
    want = golden(q, k, v, do, causal, mask, s)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = assemble_usp([r[i] for r in ranks], wr, wu, layout)
        assert torch.allclose(got, want[i], atol=1e-12, rtol=1e-10), (name, (got - want[i]).abs().max())
    if sinks:
        assert torch.allclose(sum(r[4] for r in ranks), want[4], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("mesh", [(1, 2), (2, 1)])
def test_a_degenerate_mesh_is_ulysses_or_the_ring(mesh):
    """(1, W): one ring rank, Ulysses over all; (W, 1): Ulysses groups of one, the ring over all. The
    (W, 1) mesh runs the ring's own code on the same rows, so its answer is the ring's, bit for bit."""
    wr, wu = mesh
    q, k, v, do, _ = inputs(H=4, Hkv=2, L=32)
    usp = run_ranks(attend_usp, 2, args=(wr, wu, q, k, v, do, True, "", None, "zigzag"), timeout=120)
    scheme = "ulysses" if wr == 1 else "ring"
    alone = run_ranks(attend, 2, args=(scheme, q, k, v, do, True, "", None, "zigzag"), timeout=120)
    for i in range(4):
        a, b = assemble_usp([r[i] for r in usp], wr, wu, "zigzag"), assemble([r[i] for r in alone], 2, "zigzag")
        if wu == 1:
            assert torch.equal(a, b), i
        else:
            assert torch.allclose(a, b, atol=1e-13, rtol=0), (i, (a - b).abs().max())
