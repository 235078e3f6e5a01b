"""The hypothesis strategies the property tests share: attention inputs of random shapes and masks."""

import torch
from hypothesis import strategies as st


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
