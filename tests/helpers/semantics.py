"""SDPA's edge semantics as data and helpers, shared by the semantics tests of every path: the
special values, torch's MATH backend as the oracle, NaN-aware closeness."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnlab.testing import tolerance

NAN, INF = float("nan"), float("inf")


def torch_math(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def close_with_nans(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str, nans: str = "equal"):
    """NaN exactly where torch has NaN (``nans='equal'``) or only there (``'within'``), the same
    infinities, and the finite values within the dtype's tolerance."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    g, w = got.double(), want.double()
    if nans == "equal":
        assert torch.equal(g.isnan(), w.isnan()), f"{what}: NaN at {g.isnan().nonzero()[:4].tolist()} vs torch " \
                                                 f"{w.isnan().nonzero()[:4].tolist()}"
    else:
        assert bool((g.isnan() <= w.isnan()).all()), f"{what}: NaN where torch has none"
    both = ~g.isnan() & ~w.isnan()
    assert torch.equal(g.isinf() & both, w.isinf() & both) and torch.equal(g[g.isinf() & both], w[w.isinf() & both])
    fin = both & w.isfinite()
    tol = tolerance(dtype)
    err = (g - w)[fin].abs()
    bound = (tol.atol + tol.rtol * w[fin].abs())
    assert bool((err <= bound).all()), f"{what}: max error {float(err.max()):.3g}"


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- NaN and inf


def _put(t, index, value):
    t = t.clone()
    t[index] = value
    return t


SPECIAL = {
    "nan_query_row": lambda q, k, v: (_put(q, (0, 1, 2), NAN), k, v),
    "nan_query_element": lambda q, k, v: (_put(q, (1, 0, 3, 4), NAN), k, v),
    "nan_key_element": lambda q, k, v: (q, _put(k, (0, 2, 4, 1), NAN), v),
    "nan_value_element": lambda q, k, v: (q, k, _put(v, (1, 1, 0, 2), NAN)),
    "inf_query": lambda q, k, v: (_put(q, (0, 0, 1, 2), INF), k, v),
    "minus_inf_query": lambda q, k, v: (_put(q, (0, 0, 1, 2), -INF), k, v),
    "inf_key": lambda q, k, v: (q, _put(k, (1, 2, 3, 0), INF), v),
    "inf_value": lambda q, k, v: (q, k, _put(v, (0, 1, 4, 5), INF)),
}
