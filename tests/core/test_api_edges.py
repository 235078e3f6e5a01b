"""The engineer's API at its edges (issue 32 item 6): meta tensors on every path (shapes
only, as torch's SDPA gives them), NumPy input named with the conversion, a score_mod or
mask_mod of the wrong arity and a non-bool mask_mod refused with the signature they need."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab import decoding, dispatch, flex, functional, modules, tiled
from attnlab.flex import varlen


def _meta(*shape):
    return torch.empty(*shape, device="meta")


PATHS = {
    "functional": lambda q, k, v: functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    "dispatch-reference": lambda q, k, v: dispatch.attention(q, k, v, impl="reference"),
    "dispatch-tiled": lambda q, k, v: dispatch.attention(q, k, v, impl="tiled"),
    "dispatch-auto": lambda q, k, v: dispatch.attention(q, k, v, is_causal=True, causal_align="bottom_right"),
    "flash_attention": lambda q, k, v: tiled.flash_attention(q, k, v, is_causal=True),
    "flash_attention-bottom-right": lambda q, k, v: tiled.flash_attention(q, k, v, is_causal=True,
                                                                          causal_align="bottom_right"),
    "flex": lambda q, k, v: flex.flex_attention(q, k, v),
    "decode": lambda q, k, v: decoding.decode_attention(q, k, v),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_meta_tensors_give_sdpas_shape_on_every_path(path):
    q, k, v = _meta(2, 4, 3, 8), _meta(2, 4, 16, 8), _meta(2, 4, 16, 6)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = PATHS[path](q, k, v)
    assert out.is_meta and out.shape == want.shape == (2, 4, 3, 6) and out.dtype == want.dtype


def test_meta_tensors_through_the_modules_and_varlen():
    out, _ = modules.MultiHeadAttention(16, 4).to("meta")(_meta(2, 5, 16))
    assert out.is_meta and out.shape == (2, 5, 16)
    q = _meta(7, 2, 8)
    got = varlen.varlen_attention(q, q, _meta(7, 2, 5), torch.tensor([0, 3, 7]), torch.tensor([0, 3, 7]))
    assert got.is_meta and got.shape == (7, 2, 5)


@pytest.mark.parametrize("call", [
    lambda x: functional.scaled_dot_product_attention(x, x, x),
    lambda x: dispatch.attention(x, x, x),
    lambda x: tiled.flash_attention(x, x, x),
    lambda x: flex.flex_attention(x, x, x),
    lambda x: decoding.decode_attention(x, x, x),
])
def test_numpy_input_is_named_with_the_conversion(call):
    x = np.zeros((1, 1, 4, 8), dtype=np.float32)
    with pytest.raises(TypeError, match=r"query must be a torch.Tensor, got numpy.ndarray: convert it with "
                                        r"torch.from_numpy\(x\)"):
        call(x)


def test_a_score_mod_of_the_wrong_arity_is_refused_with_the_signature():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(TypeError, match=r"score_mod must take five arguments, score_mod\(score, b, h, q_idx, "
                                        r"kv_idx\).*got <lambda>\(s, b\)"):
        flex.flex_attention(q, q, q, score_mod=lambda s, b: s)
    flex.flex_attention(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: score)  # the right one runs


def test_a_mask_mod_must_take_four_indices_and_return_bools():
    with pytest.raises(TypeError, match=r"mask_mod must take four arguments.*got <lambda>\(q, kv\)"):
        flex.create_block_mask(lambda q, kv: q >= kv, None, None, 4, 4)
    with pytest.raises(TypeError, match=r"mask_mod must return a bool tensor \(True = attend\), got dtype "
                                        r"torch.float32"):
        flex.create_block_mask(lambda b, h, q, kv: (q >= kv).float(), None, None, 4, 4)
    bm = flex.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 4, 4, BLOCK_SIZE=2)
    assert bm.counts()["empty"] == 1
