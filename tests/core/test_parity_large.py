"""Very large parity matrices: realistic sizes, many seeds, every dtype.

Not run by `make test` (marker `large`); run with `make test-large`.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import parity_stats
from attnlab.functional import scaled_dot_product_attention as attnlab_sdpa
from attnlab.testing import assert_close_to_sdpa
from helpers.strategies import attention_inputs

pytestmark = pytest.mark.large

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
SIZES = [(1, 8, 128, 128, 64), (2, 4, 257, 63, 64), (1, 8, 64, 512, 128)]
OPTIONS = [{}, {"is_causal": True}, {"mask": "bool"}, {"mask": "float"}, {"enable_gqa": True}, {"dropout_p": 0.1}]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size,options,seed", list(itertools.product(SIZES, OPTIONS, range(3))))
def test_parity_at_realistic_sizes(size, options, seed, dtype):
    B, H, L, S, E = size
    g = torch.Generator().manual_seed(seed)
    Hkv = H // 2 if options.get("enable_gqa") else H
    q = torch.randn(B, H, L, E, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, E, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, E, generator=g).to(dtype)
    kwargs = {k_: v_ for k_, v_ in options.items() if k_ != "mask"}
    if options.get("mask") == "bool":
        kwargs["attn_mask"] = torch.rand(B, 1, L, S, generator=g) > 0.5
    elif options.get("mask") == "float":
        kwargs["attn_mask"] = torch.randn(1, H, L, S, generator=g)
    parity_stats.record(assert_close_to_sdpa(attnlab_sdpa, q, k, v, seed=seed, **kwargs))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=500)
@given(data=st.data())
def test_property_parity_many_examples(dtype, data):
    q, k, v, kwargs = data.draw(attention_inputs(dtype))
    parity_stats.record(assert_close_to_sdpa(attnlab_sdpa, q, k, v, **kwargs))
