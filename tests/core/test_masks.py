import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from attnlab import masks
from attnlab.functional import scaled_dot_product_attention as attnlab_sdpa
from attnlab.testing import assert_close


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("L,S", [(1, 1), (4, 4), (3, 5), (5, 3), (4, 2), (0, 3), (3, 0)])
def test_causal_matches_torch_bias(L, S):
    assert torch.equal(masks.causal(L, S), causal_upper_left(L, S)._materialize())
    assert torch.equal(masks.causal(L, S, align="bottom_right"), causal_lower_right(L, S)._materialize())


def test_causal_docstring_picture():
    # the picture in the docstring, as a test: L=3, S=5
    rows = ["".join("#" if x else "." for x in r) for r in masks.causal(3, 5).tolist()]
    assert rows == ["#....", "##...", "###.."]
    rows = ["".join("#" if x else "." for x in r) for r in masks.causal(3, 5, align="bottom_right").tolist()]
    assert rows == ["###..", "####.", "#####"]


def test_is_causal_equals_the_top_left_mask(gen):
    q, k, v = (torch.randn(2, 6, 4, generator=gen), torch.randn(2, 3, 4, generator=gen),
               torch.randn(2, 3, 5, generator=gen))
    assert_close(attnlab_sdpa(q, k, v, is_causal=True), attnlab_sdpa(q, k, v, attn_mask=masks.causal(6, 3)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="align must be"):
        masks.causal(2, 2, align="top-left")
    with pytest.raises(ValueError, match="L must be an int >= 0"):
        masks.causal(-1, 2)
