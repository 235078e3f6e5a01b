"""The native kernels' bfloat16 routes (issue 24, item 3), each forced by ATTNLAB_BF16 so every
route is tested on any CPU:

* ``bf16``: bf16 operands on the CPU's bf16 instructions (csrc/bf16_gemm.h's micro-kernel
  where the build has AVX512_BF16; a build without it reports ``bf16-emulated`` instead);
* ``bf16-emulated``: the same operands and roundings, GEMMs widened to float32 (the route a
  CPU without the instructions runs when forced);
* ``fp32``: the inputs converted to float32 (what ``auto`` takes on CPUs without avx512_bf16).

Each must stay within the shared rule against torch's own bf16 error (2x for outputs, 3x for
gradients: attnlab.testing.assert_close_to_sdpa's defaults), forward and backward, with GQA,
masks and tile edges; and the route must really be the one that runs.
"""

from __future__ import annotations

import pytest
import torch

from attnlab import tiled
from attnlab.kernels import native as _native
from attnlab.kernels import routes
from attnlab.testing import assert_close_to_sdpa
from helpers.route_cases import CASES, case_inputs, spy_calls

ROUTES = ["bf16", "bf16-emulated", "fp32"]


@pytest.fixture(params=ROUTES)
def route(force_routes, request, monkeypatch):
    assert _native.ops() is not None, _native.status()
    force_routes(bf16=request.param)
    return request.param


def expected_name(route: str) -> str:
    if route == "bf16" and not _native.ops().bf16_units():
        return "bf16-emulated"  # a build without AVX512_BF16 says so
    return route


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def spy_operands(monkeypatch, forward_op: str = "flash_forward") -> list:
    """``(q4 dtype, bf16_emulated)`` of each call of the native ``forward_op``: bfloat16 on the
    bf16 routes, float32 on fp32 (``bf16_emulated`` is the argument before the sgemm route)."""
    return spy_calls(monkeypatch, forward_op, lambda args: (args[0].dtype, args[-2]))


@pytest.mark.parametrize("case", list(CASES))
def test_each_route_is_within_the_shared_rule_forward_and_backward(route, monkeypatch, case):
    c = CASES[case]
    q, k, v, mask = case_inputs(case, torch.bfloat16)
    seen = spy_operands(monkeypatch)
    assert_close_to_sdpa(tiled.flash_attention, q, k, v, attn_mask=mask, is_causal=c.get("causal", False),
                         enable_gqa=c.get("gqa", False))
    operands = torch.float32 if route == "fp32" else torch.bfloat16
    assert seen and all(dtype == operands for dtype, _ in seen), seen
    assert all(emulated == (expected_name(route) == "bf16-emulated") for _, emulated in seen), seen


def test_native_status_names_the_route_and_why(route):
    status = _native.status()
    assert status.bf16.name == expected_name(route)
    assert f"bfloat16 route: {expected_name(route)}" in str(status) and "ATTNLAB_BF16" in str(status)


def test_auto_follows_the_cpus_flags(force_routes, monkeypatch):
    force_routes(bf16="auto")
    has = "avx512_bf16" in _native.cpu_features() and _native.ops().bf16_units()
    assert _native.bf16_route().name == ("bf16" if has else "fp32")
    monkeypatch.setattr(_native, "cpu_features", lambda: frozenset({"avx2", "fma"}))
    assert _native.bf16_route() == _native.Bf16Route(
        "fp32", "this CPU has no avx512_bf16, so float32 GEMMs are the faster route")


def test_a_bad_route_name_is_refused(force_routes, monkeypatch):
    monkeypatch.setenv("ATTNLAB_BF16", "fast")  # read once: a bad value is refused where it is read
    with pytest.raises(ValueError, match="ATTNLAB_BF16 must be one of auto, bf16, bf16-emulated, fp32, got 'fast'"):
        routes.reload()
    with pytest.raises(ValueError, match="ATTNLAB_BF16 must be one of"):
        force_routes(bf16="fast")


@pytest.mark.parametrize("mod", ["sliding_window", "alibi"])
def test_flex_block_sparse_kernels_take_the_route_too(route, monkeypatch, mod):
    """attnlab.flex's native block-sparse kernels (csrc/block_sparse.cpp) run the same routes."""
    from attnlab import flex

    L, H = 200, 4
    mask_mod = flex.sliding_window(48)
    bm = flex.create_block_mask(mask_mod, None, None, L, L, BLOCK_SIZE=32)
    dense = flex.create_mask(mask_mod, None, None, L, L)[0, 0]
    score_mod = flex.alibi(H) if mod == "alibi" else None
    seen = spy_operands(monkeypatch, "block_sparse_forward")

    def impl(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        return flex.flex_attention(query, key, value, score_mod=score_mod, block_mask=bm, scale=scale)

    q, k, v = randn(1, H, L, 32), randn(1, H, L, 32, seed=1), randn(1, H, L, 32, seed=2)
    if score_mod is None:
        assert_close_to_sdpa(impl, q, k, v, attn_mask=dense)
    else:  # ALiBi as an additive mask for torch: -slope_h * (i - j), hidden keys -inf
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)])
        rel = torch.arange(L)[None, :] - torch.arange(L)[:, None]
        bias = (slopes[:, None, None] * rel).masked_fill(~dense, float("-inf"))[None].to(torch.bfloat16)
        assert_close_to_sdpa(impl, q, k, v, attn_mask=bias)
    operands = torch.float32 if route == "fp32" else torch.bfloat16
    assert seen and all(dtype == operands for dtype, _ in seen), seen
    assert all(emulated == (expected_name(route) == "bf16-emulated") for _, emulated in seen), seen
