"""The native kernels' float32 GEMM routes (issue 33, item 3: csrc/sgemm.h), each forced by
ATTNLAB_SGEMM so that every route this build has is tested on the CPU at hand:

* ``avx2``: attnlab's micro-kernel, 6 x 16 tiles of ymm;
* ``avx512``: 6 x 64 tiles of zmm, in an AVX-512 build only (elsewhere forcing it reports
  ``avx512-emulated``, tested below);
* ``avx512-emulated``: the AVX-512 tile walk on pairs of ymm, the same template code and tile
  shape, so that its edges and packing are tested on an AVX2-only CPU;
* ``blas``: MKL's sgemm, the route before.

The tile products are checked exactly: small-integer operands make every product and sum exact
in float32, so any route that drops, repeats or misplaces one term differs from the float64
reference. The attention built on each route is checked against torch by the shared rule.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attnlab import tiled
from attnlab.kernels import native as _native
from attnlab.kernels import routes
from attnlab.testing import assert_close_to_sdpa, tolerance
from helpers.route_cases import CASES, case_inputs, spy_calls

ISA_ROUTES = {"avx2": {"avx2", "fma"}, "avx512-emulated": {"avx2", "fma"}, "avx512": {"avx512f"}, "blas": set()}


def built_routes() -> list[str]:
    ops = _native.ops()
    assert ops is not None, _native.status()
    return [name for name, code in _native.SGEMM_CODES.items() if ops.sgemm_route_built(code)]


ROUTES_HERE = built_routes() if _native.ops() is not None else ["blas"]


@pytest.fixture(params=ROUTES_HERE)
def route(force_routes, request, monkeypatch):
    force_routes(sgemm=request.param)
    assert _native.sgemm_route().name == request.param
    return request.param


def test_the_build_has_the_routes_of_this_cpus_flags():
    """-march=native: the AVX2 routes where the CPU has avx2 + fma, the AVX-512 one where it
    has avx512f (or the build emulates it: ATTNLAB_NATIVE_ISA=avx512-emulated), BLAS always."""
    flags = _native.cpu_features()
    if _native.build_isa() == "avx512-emulated":
        flags = flags | {"avx512f"}
    assert sorted(built_routes()) == sorted(name for name, need in ISA_ROUTES.items() if need <= flags)


def ints(*shape, seed):
    """Integers in [-4, 4] as float32: products and sums of a few hundred stay exact."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).to(torch.float32)


def gemm(route: str, a, b, c, ta, tb, alpha, beta):
    _native.ops().tile_gemm_(a, b, c, ta, tb, alpha, beta, _native.SGEMM_CODES[route])
    return c


def reference(a, b, c0, ta, tb, alpha, beta):
    a64, b64 = a.double(), b.double()
    prod = (a64.t() if ta else a64) @ (b64.t() if tb else b64)
    return alpha * prod + (beta * c0.double() if beta != 0 else 0)


SHAPES = [(1, 1, 1), (5, 7, 3), (6, 16, 8), (7, 17, 9), (12, 32, 5), (13, 33, 64), (11, 31, 2), (37, 53, 24),
          (256, 256, 64), (256, 64, 256), (300, 70, 130), (24, 96, 1)]


@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
def test_each_route_computes_every_tile_exactly(route, ta, tb):
    """Whole tiles, edge rows (m % MR), edge columns (n % NR) and both, for 6 x 16 and 6 x 64
    tiles, every transpose (A^T packed, B^T packed), alpha and beta."""
    for i, (m, n, k) in enumerate(SHAPES):
        a = ints(*((k, m) if ta else (m, k)), seed=i)
        b = ints(*((n, k) if tb else (k, n)), seed=100 + i)
        c0 = ints(m, n, seed=200 + i)
        for alpha, beta in [(1.0, 0.0), (0.5, 1.0), (-2.0, 2.0)]:
            c = gemm(route, a, b, c0.clone(), ta, tb, alpha, beta)
            torch.testing.assert_close(c.double(), reference(a, b, c0, ta, tb, alpha, beta), atol=0, rtol=0,
                                       msg=lambda msg: f"{route} ta={ta} tb={tb} {(m, n, k)} alpha={alpha} "
                                                       f"beta={beta}: {msg}")


def test_leading_dimensions_wider_than_the_rows(route):
    """The kernels pass views into bigger tiles (a head's rows, a block of keys): lda, ldb, ldc
    larger than the columns, C's other columns untouched."""
    big_a, big_b, big_c = ints(40, 90, seed=1), ints(70, 80, seed=2), ints(40, 100, seed=3)
    before = big_c.clone()
    a = big_a[:, 5:5 + 33]  # A (40, 33), lda 90
    b_t = big_b[:29, 20:20 + 33]  # B stored transposed: (n=29, k=33), ldb 80
    c = big_c[:, 7:7 + 29]  # C (40, 29), ldc 100
    gemm(route, a, b_t, c, False, True, 1.0, 1.0)
    expected = reference(a, b_t, before[:, 7:7 + 29], False, True, 1.0, 1.0)
    torch.testing.assert_close(big_c[:, 7:7 + 29].double(), expected, atol=0, rtol=0)
    outside = torch.ones_like(big_c, dtype=torch.bool)
    outside[:, 7:7 + 29] = False
    assert torch.equal(big_c[outside], before[outside])
    a_t = big_a[:33, 10:10 + 37]  # A stored transposed: (k=33, m=37), lda 90
    b = big_b[:33, 3:3 + 29]  # B (33, 29), ldb 80
    c2 = torch.zeros(37, 29)
    gemm(route, a_t, b, c2, True, False, 1.0, 0.0)
    torch.testing.assert_close(c2.double(), reference(a_t, b, c2, True, False, 1.0, 0.0), atol=0, rtol=0)


def test_beta_zero_never_reads_c_and_special_values_propagate(route):
    """beta = 0 overwrites C (the score scratch holds garbage, NaN included), as BLAS does; NaN and
    inf in the operands reach exactly the outputs they reach in float64 (padding never adds any)."""
    a, b = ints(13, 20, seed=4), ints(20, 35, seed=5)
    c = torch.full((13, 35), float("nan"))
    torch.testing.assert_close(gemm(route, a, b, c, False, False, 1.0, 0.0).double(), reference(a, b, c, False, False,
                                                                                                 1.0, 0.0),
                               atol=0, rtol=0)
    a[3, 7], a[12, 0], b[5, 34], b[9, 2] = float("nan"), float("inf"), float("-inf"), float("inf")
    for ta, tb in itertools.product([False, True], repeat=2):
        aa = a.t().contiguous() if ta else a
        bb = b.t().contiguous() if tb else b
        out = gemm(route, aa, bb, torch.zeros(13, 35), ta, tb, 1.0, 0.0)
        torch.testing.assert_close(out.double(), reference(aa, bb, out, ta, tb, 1.0, 0.0), atol=0, rtol=0,
                                   equal_nan=True)
    empty_k = gemm(route, torch.zeros(4, 0), torch.zeros(0, 9), torch.full((4, 9), float("nan")), False, False,
                   1.0, 0.0)
    assert torch.equal(empty_k, torch.zeros(4, 9))


def test_a_route_the_build_lacks_is_refused_by_the_op():
    missing = [code for name, code in _native.SGEMM_CODES.items() if name not in ROUTES_HERE] + [7]
    with pytest.raises(RuntimeError, match="this build has no route"):
        gemm_code(missing[0])


def gemm_code(code: int):
    _native.ops().tile_gemm_(torch.ones(2, 2), torch.ones(2, 2), torch.zeros(2, 2), False, False, 1.0, 0.0, code)


def test_route_choice_default_forced_fallback_and_bad_names(force_routes, monkeypatch):
    force_routes(sgemm="auto")
    widest = "avx512" if "avx512" in ROUTES_HERE else "avx2" if "avx2" in ROUTES_HERE else "blas"
    assert _native.sgemm_route().name == widest
    force_routes(sgemm="avx512")
    expected = "avx512" if "avx512" in ROUTES_HERE else "avx512-emulated" if "avx2" in ROUTES_HERE else "blas"
    assert _native.sgemm_route().name == expected
    if expected == "avx512-emulated":
        assert "this build has no AVX-512" in _native.sgemm_route().reason
    monkeypatch.setenv("ATTNLAB_SGEMM", "mkl")  # read once: a bad value is refused where it is read
    with pytest.raises(ValueError, match="ATTNLAB_SGEMM must be one of auto, avx512, avx2, avx512-emulated, blas, "
                                         "got 'mkl'"):
        routes.reload()
    assert routes.settings().sgemm == "avx512"  # the refused value changed nothing
    with pytest.raises(ValueError, match="ATTNLAB_SGEMM must be one of"):
        force_routes(sgemm="mkl")


def test_native_status_names_the_float32_gemm(route):
    assert f"float32 GEMM: {route} (forced by ATTNLAB_SGEMM={route})" in str(_native.status())


def spy_routes(monkeypatch, op_name: str, at: int = -1) -> list:
    """The sgemm route code (argument ``at``: the last; decode_forward's: its ``plan``'s ``sgemm``)
    of each call of the native ``op_name``."""
    if op_name == "decode_forward":
        from attnlab.kernels.decode import PLAN_FIELDS

        return spy_calls(monkeypatch, op_name, lambda args: args[-1][PLAN_FIELDS.index("sgemm")])
    return spy_calls(monkeypatch, op_name, lambda args: args[at])


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_attention_on_each_route_is_within_the_shared_rule(route, monkeypatch, case):
    c = CASES[case]
    q, k, v, mask = case_inputs(case, torch.float32)
    seen = spy_routes(monkeypatch, "flash_forward")
    assert_close_to_sdpa(tiled.flash_attention, q, k, v, attn_mask=mask, is_causal=c.get("causal", False),
                         enable_gqa=c.get("gqa", False))
    assert seen and set(seen) == {_native.SGEMM_CODES[route]}, seen


def test_the_backward_and_flex_and_decode_take_the_route(force_routes, route, monkeypatch):
    """flash_backward_, the block-sparse kernels and decoding's GEMM blocks get the route too,
    and stay within the shared rule on it."""
    from attnlab import decoding, flex

    code = _native.SGEMM_CODES[route]
    seen = spy_routes(monkeypatch, "flash_backward_")
    q, k, v = randn(1, 2, 130, 48, seed=5), randn(1, 2, 190, 48, seed=6), randn(1, 2, 190, 40, seed=7)
    assert_close_to_sdpa(tiled.flash_attention, q, k, v, is_causal=True)
    assert seen and set(seen) == {code}
    monkeypatch.undo()  # the spies go; the route, forced by the fixture, stays

    L, H = 200, 4
    mask_mod = flex.sliding_window(48)
    bm = flex.create_block_mask(mask_mod, None, None, L, L, BLOCK_SIZE=32)
    dense = flex.create_mask(mask_mod, None, None, L, L)[0, 0]
    seen_f = spy_routes(monkeypatch, "block_sparse_forward")
    seen_b = spy_routes(monkeypatch, "block_sparse_backward_")

    def impl(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        return flex.flex_attention(query, key, value, block_mask=bm, scale=scale)

    assert_close_to_sdpa(impl, randn(1, H, L, 32), randn(1, H, L, 32, seed=1), randn(1, H, L, 32, seed=2),
                         attn_mask=dense)
    assert set(seen_f) == {code} and set(seen_b) == {code}
    monkeypatch.undo()  # the spies go; the route, forced by the fixture, stays

    # decoding with many query rows takes the GEMM blocks (mode "gemm")
    seen_d = spy_routes(monkeypatch, "decode_forward")
    qd, kd, vd = randn(1, 8, 40, 64, seed=8), randn(1, 2, 300, 64, seed=9), randn(1, 2, 300, 64, seed=10)

    def dec(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        return decoding.decode_attention(query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    assert_close_to_sdpa(dec, qd, kd, vd, enable_gqa=True, check_grads=False)
    assert seen_d and set(seen_d) == {code}


@pytest.mark.parametrize("L,S", [(1, 100), (261, 300), (7, 64)])
def test_the_rows_maxima_found_by_the_score_gemm(route, L, S):
    """The forward's score GEMM finds each row's maximum as its tiles leave the registers (the
    row pass then skips its max sweep): every key of the row counts, and nothing else does. Scores
    far below 0 (about -300 in base 2) with key counts off the tiles' 64 (16) columns and query
    rows off their 6: a maximum that took a padded column's 0, or another row's value, would
    make every 2^(s - m) underflow to 0 (an output of zeros) or be off by far more than the rule."""
    g = torch.Generator().manual_seed(L + S)
    direction = torch.randn(32, generator=g)
    direction = direction / direction.norm()
    q = (direction * 30 + 0.1 * torch.randn(1, 2, L, 32, generator=g))
    k = (-direction * 80 + 0.5 * torch.randn(1, 2, S, 32, generator=g))
    v = torch.randn(1, 2, S, 16, generator=g)
    scores = (q @ k.transpose(-1, -2)) / 32 ** 0.5
    assert float(scores.max()) < -300, float(scores.max())  # every score far below 0
    assert_close_to_sdpa(tiled.flash_attention, q, k, v)
    out = tiled.flash_attention(q, k, v)
    assert float(out.abs().amax(dim=-1).min()) > 0.01  # no row of zeros


@pytest.mark.parametrize("how", ["is_causal", "attn_mask", "bottom_right"])
def test_hidden_keys_never_reach_the_rows_maxima(route, how):
    """Only blocks every row sees whole take the GEMM's maxima: a key hidden by causality or by a
    mask must not count. Score (i, j) = a (j - i - off - 1/2): every hidden key (j > i + off) scores
    at least +a/2, every visible one at most -a/2 (a = 600 / sqrt(2)); blocks of 64 put the diagonal
    on block edges, and bottom-right's offset of 62 one key short of a block's last (a block taken
    for whole one key too early fails). A maximum that took a hidden key would underflow each row's
    2^(s - m) to 0; each row's output is the value of its last visible key."""
    L, a = 200, 600.0
    off = 62 if how == "bottom_right" else 0
    i, j = torch.arange(L, dtype=torch.float32), torch.arange(L + off, dtype=torch.float32)
    q = torch.stack([-(i + off + 0.5) * a, torch.full((L,), a)], dim=-1).expand(1, 2, L, 2).contiguous()
    k = torch.stack([torch.ones(L + off), j], dim=-1).expand(1, 2, L + off, 2).contiguous()
    v = randn(1, 2, L + off, 8, seed=11)
    kw = {"attn_mask": torch.ones(L, L, dtype=torch.bool).tril()} if how == "attn_mask" else {"is_causal": True}
    if how == "bottom_right":
        kw["causal_align"] = "bottom_right"
    out = tiled.flash_attention(q, k, v, block_q=64, block_k=64, **kw)
    tol = tolerance(torch.float32)
    torch.testing.assert_close(out, v[:, :, off:], atol=tol.atol, rtol=tol.rtol)  # row i: key i + off
