"""The lesson's four failure modes, shown and caught.

Each buggy implementation below makes one of the lesson's mistakes. The tests show
the symptom the lesson describes, and that attnlab's parity harness catches it
(so the harness's tolerance is not vacuous).
"""

import math

import pytest
import torch

from attnlab import stable_softmax
from attnlab.functional import attention_weights, scaled_dot_product_attention as attnlab_sdpa
from attnlab.testing import assert_close_to_sdpa


def _inputs(gen, B=2, L=6, S=6, E=64, Ev=64, dtype=torch.float32):
    q = torch.randn(B, L, E, generator=gen, dtype=dtype)
    k = torch.randn(B, S, E, generator=gen, dtype=dtype)
    v = torch.randn(B, S, Ev, generator=gen, dtype=dtype)
    return q, k, v


def missing_scale(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return stable_softmax(q @ k.transpose(-2, -1), -1) @ v


def wrong_transpose(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return stable_softmax(q @ k / math.sqrt(q.shape[-1]), -1) @ v  # Q @ K, not Q @ K^T


def queries_as_values(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return stable_softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ q


def softmax_over_queries(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return stable_softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -2) @ v


def test_missing_scale_saturates_the_weights(gen):
    q, k, v = _inputs(gen)  # d_k = 64: unscaled dot products have std ~8
    unscaled = stable_softmax(q @ k.transpose(-2, -1), -1)
    scaled = attention_weights(q, k)
    # without 1/sqrt(d_k) one weight per row dominates (~1), as the lesson warns
    assert unscaled.amax(-1).mean() > 0.9
    assert scaled.amax(-1).mean() < 0.75
    assert (q @ k.transpose(-2, -1)).abs().max() > 10  # the lesson's check: scores >> 10
    with pytest.raises(AssertionError, match="more than the bound"):
        assert_close_to_sdpa(missing_scale, q, k, v)


def test_naive_softmax_overflows_where_stable_does_not():
    scores = torch.tensor([1000.0, 1001.0, 999.0, 1002.0])
    naive = torch.exp(scores) / torch.exp(scores).sum()
    assert torch.isnan(naive).all()
    stable = stable_softmax(scores)
    assert torch.isfinite(stable).all() and abs(stable.sum().item() - 1) < 1e-6
    assert stable.argmax().item() == 3


def test_lesson_exercise_2_dk_64_unscaled_max_500():
    # unscaled scores with max magnitude 500: exp(500) overflows float32 (max ~3.4e38)
    scores = torch.tensor([500.0, 480.0, -500.0, 0.0])
    assert torch.isinf(torch.exp(scores)).any()
    naive = torch.exp(scores) / torch.exp(scores).sum()
    assert torch.isnan(naive).any()
    stable = stable_softmax(scores)
    # stable softmax is finite: the max entry gets 1/(1 + e^-20 + ...) ~ 1 - 2e-9, the rest ~0
    assert torch.isfinite(stable).all()
    assert stable[0].item() == pytest.approx(1.0, abs=1e-6)
    assert stable[1].item() == pytest.approx(math.exp(-20), rel=1e-3)
    # scaled by 1/sqrt(64) = 1/8 the max is 62.5: exp(62.5) ~ 1.4e27, finite even naively
    scaled = scores / math.sqrt(64)
    assert torch.isfinite(torch.exp(scaled)).all()
    assert torch.allclose(stable_softmax(scaled), torch.exp(scaled) / torch.exp(scaled).sum())


def test_wrong_transpose_is_caught(gen):
    # with L != d_k the shapes do not even fit
    q, k, v = _inputs(gen, L=5, S=7, E=8, Ev=8)
    with pytest.raises(RuntimeError):
        wrong_transpose(q, k, v)
    # the silent case: everything square (S == E), so Q @ K runs and is wrong
    q, k, v = _inputs(gen, L=8, S=8, E=8, Ev=8)
    assert wrong_transpose(q, k, v).shape == attnlab_sdpa(q, k, v).shape
    with pytest.raises(AssertionError, match="more than the bound"):
        assert_close_to_sdpa(wrong_transpose, q, k, v)
    # K.T on a 3-D tensor reverses *all* dims: (B, S, E) -> (E, S, B)
    assert k.mT.shape == (2, 8, 8) and tuple(k.permute(2, 1, 0).shape) == (8, 8, 2)


def test_queries_used_as_values_is_caught(gen):
    q, k, v = _inputs(gen, E=8, Ev=5)  # d_k != d_v: the output has the wrong width
    with pytest.raises(AssertionError, match="shape"):
        assert_close_to_sdpa(queries_as_values, q, k, v)
    q, k, v = _inputs(gen, E=8, Ev=8)  # same width: only the values give it away
    with pytest.raises(AssertionError, match="more than the bound"):
        assert_close_to_sdpa(queries_as_values, q, k, v)


def test_softmax_over_the_wrong_axis_is_caught(gen):
    q, k, v = _inputs(gen, L=6, S=6, E=8, Ev=8)
    with pytest.raises(AssertionError, match="more than the bound"):
        assert_close_to_sdpa(softmax_over_queries, q, k, v)


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_harness_rejects_small_perturbations(gen, dtype, rel):
    """A relative error a few times above the dtype's noise is caught: the bound is not vacuous."""
    q, k, v = _inputs(gen, L=6, S=9, E=16, Ev=16, dtype=dtype)

    def perturbed(*args, **kwargs):
        return attnlab_sdpa(*args, **kwargs) * (1 + rel)

    assert_close_to_sdpa(attnlab_sdpa, q, k, v)
    with pytest.raises(AssertionError, match="more than the bound"):
        assert_close_to_sdpa(perturbed, q, k, v, check_grads=False)
