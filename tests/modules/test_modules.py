import math

import pytest
import torch

from attnlab import SelfAttention
from attnlab.functional import scaled_dot_product_attention as attnlab_sdpa
from attnlab.testing import assert_close, sdpa_oracle


def test_shapes_and_parameters(gen):
    m = SelfAttention(d_model=8, d_k=4, d_v=6)
    assert m.W_Q.shape == (8, 4) and m.W_K.shape == (8, 4) and m.W_V.shape == (8, 6)
    assert m.b_Q is None and len(list(m.parameters())) == 3
    out, w = m(torch.randn(3, 5, 8, generator=gen))
    assert out.shape == (3, 5, 6) and w.shape == (3, 5, 5)
    assert_close(w.sum(-1), torch.ones(3, 5))
    assert "d_model=8, d_k=4, d_v=6, bias=False" in repr(m)


def test_from_weights_matches_the_formula_and_sdpa(gen):
    X = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    W_Q, W_K, W_V = (torch.randn(8, n, generator=gen, dtype=torch.float64) for n in (4, 4, 3))
    m = SelfAttention.from_weights(W_Q, W_K, W_V)
    assert m.W_Q.dtype == torch.float64
    out, w = m(X)
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    expected_w = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(4), -1)  # oracle, test only
    assert_close(w, expected_w)
    assert_close(out, sdpa_oracle(Q, K, V))
    # the copies are independent of the caller's tensors
    W_Q.zero_()
    assert m.W_Q.abs().sum() > 0


def test_bias(gen):
    W = [torch.randn(6, n, generator=gen) for n in (4, 4, 5)]
    b = [torch.randn(n, generator=gen) for n in (4, 4, 5)]
    m = SelfAttention.from_weights(*W, *b)
    X = torch.randn(2, 3, 6, generator=gen)
    out, _ = m(X)
    assert_close(out, sdpa_oracle(X @ W[0] + b[0], X @ W[1] + b[1], X @ W[2] + b[2]))
    assert len(list(SelfAttention(6, 4, 5, bias=True).parameters())) == 6


def test_masks_and_causal(gen):
    m = SelfAttention(8, 4, 4)
    X = torch.randn(2, 5, 8, generator=gen)
    out, w = m(X, is_causal=True)
    assert torch.equal(w[0].triu(1), torch.zeros(5, 5))
    Q, K, V = m.project(X)
    assert_close(out, attnlab_sdpa(Q, K, V, is_causal=True))
    pad = torch.tensor([[True] * 5, [True, True, True, False, False]]).view(2, 1, 5)  # (B, 1, T)
    out, w = m(X, attn_mask=pad)
    assert torch.equal(w[1, :, 3:], torch.zeros(5, 2))
    assert_close(out, sdpa_oracle(Q, K, V, attn_mask=pad))


def test_gradients_reach_the_weights(gen):
    m = SelfAttention(8, 4, 4, bias=True)
    out, _ = m(torch.randn(2, 5, 8, generator=gen))
    out.pow(2).sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_trace_records_every_step_consistently(gen):
    m = SelfAttention(8, 4, 3)
    X = torch.randn(1, 4, 8, generator=gen)
    trace = m.trace(X)
    assert trace.names() == ["X", "Q", "K", "V", "scores", "scores_shifted", "weights", "output"]
    assert [s.shape for s in trace] == [(1, 4, 8), (1, 4, 4), (1, 4, 4), (1, 4, 3), (1, 4, 4), (1, 4, 4),
                                        (1, 4, 4), (1, 4, 3)]
    assert_close(trace["scores"], trace["Q"] @ trace["K"].transpose(-2, -1) / 2)
    assert torch.equal(trace["scores_shifted"].amax(-1), torch.zeros(1, 4))
    assert_close(trace["output"], trace["weights"] @ trace["V"])
    out, w = m(X)
    assert torch.equal(out, trace["output"]) and torch.equal(w, trace["weights"])
    assert not trace["Q"].requires_grad
    causal = m.trace(X, is_causal=True)
    assert "masked_scores" in causal and torch.isinf(causal["masked_scores"][0, 0, 1:]).all()
    with pytest.raises(KeyError, match="no step named 'nope'"):
        trace["nope"]


def test_bad_inputs():
    m = SelfAttention(8, 4, 4)
    with pytest.raises(ValueError, match=r"x must be \(B, T, d_model=8\), got shape \(2, 5, 7\)"):
        m(torch.randn(2, 5, 7))
    with pytest.raises(TypeError, match="float64"):
        m(torch.randn(2, 5, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="d_k must be a positive int"):
        SelfAttention(8, 0, 4)
    with pytest.raises(ValueError, match=r"W_K must have W_Q's shape \(8, 4\), got \(8, 3\)"):
        SelfAttention.from_weights(torch.randn(8, 4), torch.randn(8, 3), torch.randn(8, 4))
    with pytest.raises(ValueError, match="all three biases"):
        SelfAttention.from_weights(torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4), b_Q=torch.zeros(4))
    with pytest.raises(ValueError, match="SelfAttention.forward: attn_mask"):
        m(torch.randn(2, 5, 8), attn_mask=torch.ones(4, 4, dtype=torch.bool))
