"""The bf16 GEMM under the native kernels' bf16 route (``csrc/bf16_gemm.h``), checked exactly.

Its packing (issue 49: two rows interleaved into pairs along k, A^T as rows of pairs, B^T by
transposing 8 x 8 blocks of 32-bit pairs, A read in place when its rows hold whole pairs) has
edges everywhere: odd k (a last pair padded with 0), m off the 6-row tile, n off 16 columns and
off the 8 x 8 transpose blocks. Small-integer operands make every product and every sum exact in
float32, so a misplaced, dropped or repeated term differs from the float64 reference. Both ways
of running it are checked: on the bf16 instructions (a build with AVX512_BF16, or the
avx512-emulated build: tests/kernels/test_avx512_emulated.py runs this file there) and widened to
float32 (``units=False``, every build).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attnlab.kernels import native as _native

SHAPES = [(1, 1, 1), (5, 7, 3), (6, 16, 8), (7, 17, 9), (12, 33, 16), (13, 8, 17), (64, 64, 64), (37, 53, 24),
          (6, 64, 1), (9, 24, 40), (130, 70, 33), (256, 64, 256)]


def ints(*shape, seed):
    """Integers in [-4, 4] as bf16: exact, and so are their products and sums of a few hundred."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def ways() -> list[bool]:
    """units=True where the build has the bf16 instructions (else it widens, as units=False)."""
    ops = _native.ops()
    assert ops is not None, _native.status()
    return [True, False] if ops.bf16_units() else [False]


@pytest.mark.parametrize("units", ways())
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
def test_every_transpose_and_edge_is_exact(units, ta, tb):
    for i, (m, n, k) in enumerate(SHAPES):
        a = ints(*((k, m) if ta else (m, k)), seed=i)
        b = ints(*((n, k) if tb else (k, n)), seed=100 + i)
        c0 = torch.randint(-4, 5, (m, n), generator=torch.Generator().manual_seed(200 + i)).float()
        a64, b64 = a.double(), b.double()
        prod = (a64.t() if ta else a64) @ (b64.t() if tb else b64)
        for alpha, beta in [(1.0, 0.0), (0.5, 1.0), (-2.0, 2.0)]:
            c = c0.clone()
            _native.ops().tile_gemm_bf16_(a, b, c, ta, tb, alpha, beta, units)
            want = alpha * prod + (beta * c0.double() if beta else 0)
            torch.testing.assert_close(c.double(), want, atol=0, rtol=0,
                                       msg=lambda msg: f"units={units} ta={ta} tb={tb} {(m, n, k)} {msg}")


@pytest.mark.parametrize("units", ways())
def test_rows_with_a_leading_dimension_past_their_width(units):
    """Operands that are views with a stride past their width (a tile of a longer row, as the
    kernels' Q, K, V and dO tiles are), and beta = 0 never reading C (NaN there stays unread)."""
    big_a, big_b = ints(40, 70, seed=1), ints(50, 90, seed=2)
    for ta, tb in itertools.product([False, True], repeat=2):
        a = big_a[:11, 3:21] if not ta else big_a[:18, 5:16]  # op(A) (11, 18)
        b = big_b[:18, 7:7 + 29] if not tb else big_b[:29, 7:7 + 18]
        c = torch.full((11, 29), float("nan"))
        _native.ops().tile_gemm_bf16_(a, b, c, ta, tb, 1.0, 0.0, units)
        want = (a.double().t() if ta else a.double()) @ (b.double().t() if tb else b.double())
        torch.testing.assert_close(c.double(), want, atol=0, rtol=0, msg=lambda msg: f"ta={ta} tb={tb} {msg}")
