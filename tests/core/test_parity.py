"""Parity of attnlab.functional.scaled_dot_product_attention with torch's SDPA.

Every case runs three times (float64 golden, torch in the case's dtype, attnlab in
the case's dtype) through attnlab.testing.assert_close_to_sdpa, which checks the
output and the gradients of query, key, value (and of a float mask that requires
grad) with FlashAttention's rule: at most 2x (3x for gradients) torch's own error.
"""

from __future__ import annotations


import pytest
import torch

from attnlab.functional import scaled_dot_product_attention as attnlab_sdpa
from attnlab.testing import assert_close_to_sdpa, max_abs_diff

from helpers import parity_stats
from helpers.parity_cases import CASES, DTYPES, Case, build  # the matrix, shared with the tiled tests


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parity_with_torch_sdpa(case: Case, dtype: torch.dtype):
    q, k, v, mask = build(case, dtype)
    parity_stats.record(assert_close_to_sdpa(attnlab_sdpa, q, k, v, attn_mask=mask, **case.kwargs))


def test_case_matrix_really_covers_what_it_claims():
    # Guards the matrix itself: a case that silently degenerates would test nothing.
    q, k, v, mask = build(next(c for c in CASES if c.id == "large_scores_1e4"), torch.float32)
    assert (q @ k.transpose(-2, -1)).abs().max() > 1e4
    q, k, v, mask = build(next(c for c in CASES if c.id == "fully_masked_rows_bool"), torch.float32)
    assert (~mask).all(-1).any()
    q, *_ = build(next(c for c in CASES if c.id == "non_contiguous"), torch.float32)
    assert not q.is_contiguous()
    out = attnlab_sdpa(*build(next(c for c in CASES if c.id == "fully_masked_batch"), torch.float32)[:3],
                       attn_mask=build(next(c for c in CASES if c.id == "fully_masked_batch"), torch.float32)[3])
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0


def test_dropout_same_seed_drops_the_same_weights_as_torch():
    # with V = I the output is the dropped weights themselves: the zeros must coincide exactly
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 3, 6, 8, generator=g), torch.randn(2, 3, 9, 8, generator=g)
    eye = torch.eye(9).expand(2, 3, 9, 9)
    torch.manual_seed(11)
    ours = attnlab_sdpa(q, k, eye, dropout_p=0.4)
    torch.manual_seed(11)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, eye, dropout_p=0.4)
    assert torch.equal(ours == 0, theirs == 0) and 0 < int((ours == 0).sum()) < ours.numel()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(3))
    torch.manual_seed(11)
    ours = attnlab_sdpa(q, k, v, dropout_p=0.25)
    torch.manual_seed(11)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    assert max_abs_diff(ours, theirs) <= 1e-6
    torch.manual_seed(12)
    other = attnlab_sdpa(q, k, v, dropout_p=0.25)
    assert max_abs_diff(ours, other) > 1e-2  # a different seed drops different weights


def test_output_dtype_and_shape_follow_sdpa():
    for dtype in DTYPES:
        q = torch.randn(2, 1, 3, 4).to(dtype)
        k = torch.randn(1, 5, 6, 4).to(dtype)
        v = torch.randn(6, 7).to(dtype)
        out = attnlab_sdpa(q, k, v, attn_mask=torch.ones(3, 6, dtype=torch.bool))
        assert out.dtype == dtype and out.shape == (2, 5, 3, 7)



def test_the_training_bound_is_tight_first_then_doubles_and_names_each_step_outside_it():
    from attnlab.testing import TRAINING_TIGHT_STEPS, assert_training_close, training_tolerance

    tight = [training_tolerance(s) for s in range(1, TRAINING_TIGHT_STEPS + 1)]
    assert tight == [1e-6] * TRAINING_TIGHT_STEPS
    assert training_tolerance(TRAINING_TIGHT_STEPS + 3) == pytest.approx(8e-6)
    assert_training_close([4.0, 3.9], [4.0 * (1 + 9e-7), 3.9])
    with pytest.raises(AssertionError, match=r"step 2: .*relative 2\.6e-06, allowed 1e-06"):
        assert_training_close([4.0, 3.9], [4.0, 3.89999])
    with pytest.raises(AssertionError, match="step 1"):
        assert_training_close([float("nan")], [4.0])
    with pytest.raises(AssertionError, match="1 and 2 steps"):
        assert_training_close([4.0], [4.0, 3.0])
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        training_tolerance(0)
    with pytest.raises(ValueError, match="no measured bound for dtype torch.float16"):
        training_tolerance(1, torch.float16)
