"""Property-based parity: random shapes, broadcasts, masks and options against torch's SDPA."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import parity_stats
from attnlab.functional import attention_weights, scaled_dot_product_attention as attnlab_sdpa
from attnlab.testing import assert_close, assert_close_to_sdpa
from helpers.strategies import attention_inputs  # shared with the large matrices


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@given(data=st.data())
def test_property_parity_with_sdpa(dtype, data):
    q, k, v, kwargs = data.draw(attention_inputs(dtype))
    parity_stats.record(assert_close_to_sdpa(attnlab_sdpa, q, k, v, **kwargs))


@given(data=st.data())
def test_property_weights_are_a_distribution_and_reproduce_the_output(data):
    q, k, v, kwargs = data.draw(attention_inputs(torch.float64))
    w = attention_weights(q, k, **kwargs)  # (..., L, S)
    out = attnlab_sdpa(q, k, v, **kwargs)
    assert (w >= 0).all()
    sums = w.sum(-1)
    # each row is a distribution, except the rows whose every key is masked: exactly those are all 0
    L, S = q.shape[-2], k.shape[-2]
    keep = torch.ones(L, S, dtype=torch.bool)
    if kwargs.get("is_causal"):
        keep = keep.tril()
    mask = kwargs.get("attn_mask")
    if mask is not None:
        keep = keep & (mask if mask.dtype == torch.bool else ~torch.isneginf(mask))
    empty = (~keep.any(-1)).expand(sums.shape) if sums.numel() else torch.zeros_like(sums, dtype=torch.bool)
    assert torch.equal(sums == 0, empty)
    assert bool(((sums - 1).abs() < 1e-9)[~empty].all())
    assert_close(w @ v, out)
