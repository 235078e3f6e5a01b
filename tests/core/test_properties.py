"""Property-based parity: random shapes, broadcasts, masks and options against torch's SDPA."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import parity_stats
from attnlab.functional import attention_weights, scaled_dot_product_attention as attnlab_sdpa
from attnlab.testing import assert_close, assert_close_to_sdpa


@st.composite
def attention_inputs(draw, dtype):
    rank = draw(st.integers(2, 4))
    lead = draw(st.lists(st.integers(1, 3), min_size=rank - 2, max_size=rank - 2))
    L, S = draw(st.integers(0, 6)), draw(st.integers(0, 6))
    E, Ev = draw(st.integers(1, 8)), draw(st.integers(1, 8))

    def maybe_ones(dims):  # each leading dim may broadcast (size 1) independently
        return [d if draw(st.booleans()) else 1 for d in dims]

    q_lead, k_lead = lead, maybe_ones(lead)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale_mag = draw(st.sampled_from([1.0, 3.0, 30.0]))
    q = (torch.randn(*q_lead, L, E, generator=g) * scale_mag).to(dtype)
    k = (torch.randn(*k_lead, S, E, generator=g) * scale_mag).to(dtype)
    v = torch.randn(*k_lead, S, Ev, generator=g).to(dtype)

    kwargs = {}
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "causal"]))
    if mask_kind == "causal":
        kwargs["is_causal"] = True
    elif mask_kind != "none":
        # any shape that broadcasts into (..., L, S) without enlarging it
        full = [*lead, L, S]
        n_dims = draw(st.integers(0, len(full)))
        shape = [d if draw(st.booleans()) else 1 for d in full[len(full) - n_dims:]]
        if mask_kind == "bool":
            kwargs["attn_mask"] = torch.rand(shape, generator=g) < draw(st.sampled_from([0.2, 0.5, 0.9]))
        else:
            m = torch.randn(shape, generator=g)
            m = torch.where(torch.rand(shape, generator=g) < 0.3, torch.full_like(m, float("-inf")), m)
            kwargs["attn_mask"] = m
    kwargs["scale"] = draw(st.sampled_from([None, None, 0.5, 0.0, -1.0]))
    return q, k, v, kwargs


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
