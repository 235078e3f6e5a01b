"""SDPA's semantics at the edges, on every attnlab path and dtype: special values, empty
dimensions, extreme masks, odd groupings.

The categories are those of PyTorch's own SDPA tests in ``test/test_transformers.py`` that
apply on the CPU, restated here in attnlab's terms, not copied: NaN and inf propagation;
zero-size inputs; fully masked rows (torch's ``test_fully_masked_out_rows``: they give 0,
not NaN); invalid inputs (torch raises, so attnlab raises its documented
``ValueError``/``TypeError``); causal variants (``test_causal_variants``: upper-left
alignment with ``L != S``); grouped-query attention (``enable_gqa``). Added here: the
float masks real models use (Hugging Face's ``finfo.min`` fill, ``-1e9``, ``-1e4``) and
the inf/NaN values in masks. The oracle is torch's MATH backend (``SDPBackend.MATH``) in
the same dtype: its NaN where it has NaN, its values within attnlab's tolerance elsewhere.
One torch difference, noted where it matters: torch's fused CPU kernel turns a NaN query
row into zeros; attnlab follows MATH (and the float64 math), where NaN propagates.

Paths: the reference (``attnlab.functional``), the tiled path with the native kernels, the
tiled path's pure-PyTorch code, and the tiled path with tiny tiles (2 x 3: every block
boundary is exercised).
"""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch

from attnlab.kernels import dense
from attnlab import tiled
from attnlab.functional import scaled_dot_product_attention as reference
from helpers.semantics import INF, NAN, SPECIAL, close_with_nans, randn, torch_math  # shared with decoding

B, H, L, S, E, Ev = 2, 3, 5, 7, 8, 6
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _tiny(*a, **k):
    return tiled.flash_attention(*a, block_q=2, block_k=3, **k)


PATHS = {"reference": reference, "tiled": tiled.flash_attention, "tiled_pure": tiled.flash_attention,
         "tiled_tiny": _tiny}


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch) -> Callable:
    if request.param == "tiled_pure":
        monkeypatch.setattr(dense, "native_ops", lambda *a: None)
    return PATHS[request.param]


def run_case(path, dtype, q, k, v, mask=None, grads=True, **kw):
    q, k, v = (t.to(dtype) for t in (q, k, v))
    mask = mask.to(dtype) if mask is not None and mask.is_floating_point() else mask
    ours_in = [t.clone().requires_grad_(grads) for t in (q, k, v)]
    torch_in = [t.clone().requires_grad_(grads) for t in (q, k, v)]
    out = path(*ours_in, attn_mask=mask, **kw)
    want = torch_math(*torch_in, attn_mask=mask, **kw)
    close_with_nans(out, want, dtype, "output")
    if grads and want.numel():
        g = torch.randn(want.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        out.backward(g)
        want.backward(g)
        for name, a, b in zip("qkv", ours_in, torch_in):
            # a causal or tiled skip never multiplies 0 x NaN into keys a row cannot see
            close_with_nans(a.grad, b.grad, dtype, f"d{name}", "equal" if name == "q" else "within")
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SPECIAL))
def test_nan_and_inf_propagate_as_in_torch(path, dtype, case):
    q, k, v = SPECIAL[case](randn(B, H, L, E), randn(B, H, S, E, seed=1), randn(B, H, S, Ev, seed=2))
    run_case(path, dtype, q, k, v)


def _float_mask(fill: Callable[[torch.Tensor], None]) -> torch.Tensor:
    m = randn(L, S, seed=5)
    fill(m)
    return m


FMIN = torch.finfo(torch.float32).min
FMAX = torch.finfo(torch.float32).max
MASKS = {
    "nan_entry": _float_mask(lambda m: m.__setitem__((1, 2), NAN)),
    "plus_inf_entry": _float_mask(lambda m: m.__setitem__((3, 0), INF)),
    "minus_inf_row": _float_mask(lambda m: m.__setitem__(2, -INF)),
    "finfo_min_row": _float_mask(lambda m: m.__setitem__(2, FMIN)),  # Hugging Face's fill: uniform
    "finfo_min_some": _float_mask(lambda m: m[1, :4].fill_(FMIN)),
    "finfo_min_everywhere_but_one": _float_mask(lambda m: (m.fill_(FMIN), m[:, 3].fill_(0.0))),
    "two_huge_negatives": _float_mask(lambda m: (m[4].fill_(-3e38), m[4, 1].fill_(-2.5e38))),
    "finfo_max_entry": _float_mask(lambda m: m.__setitem__((0, 6), FMAX)),
    "minus_1e9_row": _float_mask(lambda m: m.__setitem__(3, -1e9)),  # the "large negative" habit
    "minus_1e4_rows": _float_mask(lambda m: (m[0].fill_(-1e4), m[4, 2:].fill_(-1e4))),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(MASKS))
def test_extreme_float_masks(path, dtype, case):
    mask = MASKS[case]
    if dtype == torch.bfloat16:  # the same fills at bfloat16's own extremes
        mask = mask.clamp(torch.finfo(torch.bfloat16).min, torch.finfo(torch.bfloat16).max)
    run_case(path, dtype, randn(B, H, L, E), randn(B, H, S, E, seed=1), randn(B, H, S, Ev, seed=2), mask)


# --------------------------------------------------------------------------- few keys
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["single_key", "one_visible_key_per_row", "fully_masked_rows", "causal_L_gt_S"])
def test_rows_with_one_key_or_none(path, dtype, case):
    q, k, v = randn(B, H, L, E), randn(B, H, S, E, seed=1), randn(B, H, S, Ev, seed=2)
    kw: dict = {}
    mask: Optional[torch.Tensor] = None
    if case == "single_key":
        k, v = k[:, :, :1], v[:, :, :1]
    elif case == "one_visible_key_per_row":
        mask = torch.zeros(L, S, dtype=torch.bool)
        mask[torch.arange(L), torch.arange(L) % S] = True
    elif case == "fully_masked_rows":
        mask = torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(4)) > 0.5
        mask[0, :, 1] = False
        mask[1, :, :] = False
    else:  # top-left causal with more queries than keys: every row sees at least key 0
        q = randn(B, H, 9, E)
        kw["is_causal"] = True
    out = run_case(path, dtype, q, k, v, mask, **kw)
    if case == "fully_masked_rows":
        assert (out[1] == 0).all() and (out[0, :, 1] == 0).all()  # 0, not NaN (torch's fix)


# --------------------------------------------------------------------------- empty dimensions
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("empty", ["B", "H", "L", "S", "E", "Ev"])
def test_zero_size_dimensions(path, dtype, empty):
    sizes = {**dict(B=B, H=H, L=L, S=S, E=E, Ev=Ev), empty: 0}
    q = randn(sizes["B"], sizes["H"], sizes["L"], sizes["E"])
    k = randn(sizes["B"], sizes["H"], sizes["S"], sizes["E"], seed=1)
    v = randn(sizes["B"], sizes["H"], sizes["S"], sizes["Ev"], seed=2)
    out = run_case(path, dtype, q, k, v)
    if empty == "E":  # every score is 0: each query gets the mean of the values (torch's answer)
        close_with_nans(out, v.to(dtype).double().mean(dim=-2, keepdim=True).expand_as(out), dtype, "mean of V")


def test_feature_size_zero_with_a_scale(path):
    q, k, v = randn(B, H, L, 0), randn(B, H, S, 0, seed=1), randn(B, H, S, Ev, seed=2)
    run_case(path, torch.float32, q, k, v, scale=1.0)


# --------------------------------------------------------------------------- grouped heads
@pytest.mark.parametrize("heads", [(6, 6, 3), (6, 3, 6), (6, 2, 3), (6, 1, 1), (4, 2, 2)],
                         ids=lambda h: f"H{h[0]}_Hk{h[1]}_Hv{h[2]}")
def test_gqa_with_any_key_and_value_head_counts(path, heads):
    Hq, Hk, Hv = heads
    run_case(path, torch.float32, randn(B, Hq, L, E), randn(B, Hk, S, E, seed=1), randn(B, Hv, S, Ev, seed=2),
             enable_gqa=True)


# --------------------------------------------------------------------------- causal variants
@pytest.mark.parametrize("lengths", [(1, 7), (5, 7), (7, 7), (9, 4), (1, 1)], ids=lambda x: f"L{x[0]}_S{x[1]}")
def test_causal_is_aligned_top_left(path, lengths):
    Lq, Sk = lengths
    run_case(path, torch.float32, randn(B, H, Lq, E), randn(B, H, Sk, E, seed=1), randn(B, H, Sk, Ev, seed=2),
             is_causal=True)


# --------------------------------------------------------------------------- invalid inputs
INVALID = {
    "feature_sizes_differ": (lambda: (randn(B, H, L, E), randn(B, H, S, E + 1), randn(B, H, S, Ev)), {}),
    "value_rows_differ": (lambda: (randn(B, H, L, E), randn(B, H, S, E), randn(B, H, S + 1, Ev)), {}),
    "mask_and_causal": (lambda: (randn(B, H, L, E), randn(B, H, S, E), randn(B, H, S, Ev)),
                        {"attn_mask": torch.ones(L, S, dtype=torch.bool), "is_causal": True}),
    "mask_not_broadcastable": (lambda: (randn(B, H, L, E), randn(B, H, S, E), randn(B, H, S, Ev)),
                               {"attn_mask": torch.ones(L + 1, S, dtype=torch.bool)}),
    "gqa_heads_do_not_divide": (lambda: (randn(B, 5, L, E), randn(B, 2, S, E), randn(B, 2, S, Ev)),
                                {"enable_gqa": True}),
    "integer_query": (lambda: (torch.ones(B, H, L, E, dtype=torch.int64), torch.ones(B, H, S, E, dtype=torch.int64),
                               torch.ones(B, H, S, Ev, dtype=torch.int64)), {}),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_inputs_raise_where_torch_raises(path, case):
    make, kw = INVALID[case]
    with pytest.raises(Exception):
        torch_math(*make(), **kw)
    with pytest.raises((ValueError, TypeError)) as err:
        path(*make(), **kw)
    assert "expected" in str(err.value) or "must" in str(err.value) or "either" in str(err.value), str(err.value)
