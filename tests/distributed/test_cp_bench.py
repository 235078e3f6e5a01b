"""attnlab bench --cp's bytes per rank: the formulas against a hand count, and USP's degenerate meshes
are the two schemes' volumes."""

from __future__ import annotations

import pytest

from attnlab.bench.cp import bytes_per_rank


def test_the_ring_and_ulysses_volumes_by_hand():
    # W = 4, B = 1, H = Hkv = 8, L = 1024, E = 64, float32: a rank holds n = 256 rows
    n, e, b = 256, 64, 4
    ring = 3 * 3 * 2 * 8 * n * e * b  # 3 steps of K, V forward; K, V, dK, dV backward
    assert bytes_per_rank("ring", 4, 1, 8, 8, 1024, 64) == ring
    ulysses = 2 * 3 / 4 * n * (2 * 8 * e + 2 * 8 * e) * b  # 3/4 of q, k, v, o; the same for the gradients
    assert bytes_per_rank("ulysses", 4, 1, 8, 8, 1024, 64) == int(ulysses)
    # grouped heads: Hkv = 2 over W = 4 is repeated to 4 for Ulysses (kv_heads_for), kept at 2 by the ring
    assert bytes_per_rank("ulysses", 4, 1, 8, 2, 1024, 64) == int(2 * 3 / 4 * n * (2 * 8 * e + 2 * 4 * e) * b)
    assert bytes_per_rank("ring", 4, 1, 8, 2, 1024, 64) == 3 * 3 * 2 * 2 * n * e * b


@pytest.mark.parametrize("W", [2, 4, 8])
def test_usp_on_a_degenerate_mesh_sends_what_the_scheme_sends(W):
    assert bytes_per_rank("usp", W, 1, 8, 8, 4096, 64, mesh=(W, 1)) == bytes_per_rank("ring", W, 1, 8, 8, 4096, 64)
    assert bytes_per_rank("usp", W, 1, 8, 8, 4096, 64, mesh=(1, W)) == bytes_per_rank("ulysses", W, 1, 8, 8, 4096, 64)
