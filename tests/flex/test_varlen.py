"""FlashAttention-2's varlen interface on attnlab's kernels (attnlab.flex.varlen): outputs and
gradients against each sequence computed alone in float64 by the oracle below (written from
FlashAttention's documented semantics: bottom-right alignment, window_size (left, right) with
-1 unbounded, softcap before ALiBi), the packed forms, return_attn_probs, and
unpad_input/pad_input with FlashAttention's signatures and return values."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import flex
from attnlab.testing import assert_close

LENGTHS_Q = [5, 1, 37, 0, 20]
LENGTHS_K = [5, 9, 37, 4, 33]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def oracle_one(q, k, v, causal, window, softcap, slopes, scale):
    """One sequence: q (Lq, H, E), k, v (Lk, Hkv, E): FlashAttention's semantics, float64."""
    Lq, H, E = q.shape
    Lk = k.shape[0]
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    s = torch.einsum("qhe,khe->hqk", q.double(), k.double()) * (scale if scale is not None else 1 / math.sqrt(E))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    d = (torch.arange(Lq)[:, None] + Lk - Lq) - torch.arange(Lk)[None, :]  # i + Lk - Lq - j
    if slopes is not None:
        s = s - slopes.double()[:, None, None] * d.abs()
    left, right = window
    keep = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        right = 0 if right == -1 else min(right, 0)
    if right != -1:
        keep &= d >= -right
    if left != -1:
        keep &= d <= left
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no key: 0, as FlashAttention gives
    return torch.einsum("hqk,khe->qhe", p, v.double())


def oracle(q, k, v, lq, lk, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None):
    outs, cq, ck = [], cu(lq), cu(lk)
    for b in range(len(lq)):
        s = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        outs.append(oracle_one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], causal, window, softcap,
                               s, scale))
    return torch.cat(outs)


def inputs(H=4, Hkv=2, E=16, Ev=16, grad=True):
    q = randn(sum(LENGTHS_Q), H, E).requires_grad_(grad)
    k = randn(sum(LENGTHS_K), Hkv, E, seed=1).requires_grad_(grad)
    v = randn(sum(LENGTHS_K), Hkv, Ev, seed=2).requires_grad_(grad)
    return q, k, v


CASES = {
    "plain": {}, "causal": dict(causal=True), "window_8_8": dict(window=(8, 8)), "window_4_0": dict(window=(4, 0)),
    "causal_window_6": dict(causal=True, window=(6, -1)), "right_only": dict(window=(-1, 3)),
    "softcap": dict(softcap=2.0), "alibi": dict(slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "alibi_per_batch": dict(slopes=torch.rand(5, 4, generator=torch.Generator().manual_seed(9))),
    "everything": dict(causal=True, window=(10, -1), softcap=3.0, slopes=torch.tensor([0.3, 0.2, 0.1, 0.05]),
                       scale=0.2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flash_attn_varlen_func_matches_each_sequence_alone(case):
    c = CASES[case]
    q, k, v = inputs()
    out = flex.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K),
                                      softmax_scale=c.get("scale"), causal=c.get("causal", False),
                                      window_size=c.get("window", (-1, -1)), softcap=c.get("softcap", 0.0),
                                      alibi_slopes=c.get("slopes"))
    q2, k2, v2 = (t.detach().clone().double().requires_grad_() for t in (q, k, v))
    want = oracle(q2, k2, v2, LENGTHS_Q, LENGTHS_K, c.get("causal", False), c.get("window", (-1, -1)),
                  c.get("softcap", 0.0), c.get("slopes"), c.get("scale"))
    assert_close(out, want.float(), dtype=torch.float32, msg="output")
    g = randn(*out.shape, seed=3)
    out.backward(g)
    want.backward(g.double())
    for name, a, b in (("dq", q, q2), ("dk", k, k2), ("dv", v, v2)):
        assert_close(a.grad, b.grad.float(), dtype=torch.float32, msg=name)


def test_a_wrong_alignment_is_caught():
    """The comparison is not vacuous: top-left causality (SDPA's, not FlashAttention's) differs
    from the output wherever a sequence has Lq != Lk."""
    q, k, v = inputs(grad=False)
    out = flex.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), 37, 37, causal=True)
    cq, ck = cu(LENGTHS_Q), cu(LENGTHS_K)
    b = 1  # Lq = 1, Lk = 9: bottom-right sees all 9 keys, top-left only key 0
    qi, ki, vi = q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
    top_left = vi[:1].repeat_interleave(2, dim=1)  # (1, H, E): the value of key 0 alone
    assert not torch.allclose(out[cq[b]:cq[b + 1]], top_left, atol=1e-3)
    assert_close(out[cq[b]:cq[b + 1]], oracle_one(qi, ki, vi, True, (-1, -1), 0.0, None, None).float(),
                 dtype=torch.float32)


def test_packed_forms_equal_the_unpacked_call():
    q, k, v = inputs(H=2, Hkv=2, grad=False)
    lengths = LENGTHS_K
    qkv = torch.stack([randn(sum(lengths), 2, 16, seed=i) for i in range(3)], dim=1)  # (total, 3, H, E)
    want = flex.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu(lengths), cu(lengths), 37, 37, causal=True)
    assert torch.equal(flex.flash_attn_varlen_qkvpacked_func(qkv, cu(lengths), 37, causal=True), want)
    kv = torch.stack([k, v], dim=1)  # (total_k, 2, Hkv, E)
    assert torch.equal(flex.flash_attn_varlen_kvpacked_func(q, kv, cu(LENGTHS_Q), cu(LENGTHS_K), 37, 37),
                       flex.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), 37, 37))


def test_return_attn_probs_gives_lse_and_probabilities():
    q, k, v = inputs(grad=False)
    out, lse, probs = flex.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), 37, 37, causal=True,
                                                  window_size=(3, -1), return_attn_probs=True)
    assert lse.shape == (4, sum(LENGTHS_Q)) and lse.dtype == torch.float32
    assert probs.shape == (5, 4, 37, 37)
    cq, ck = cu(LENGTHS_Q), cu(LENGTHS_K)
    for b in range(5):
        Lq, Lk = LENGTHS_Q[b], LENGTHS_K[b]
        p = probs[b, :, :Lq, :Lk]  # (H, Lq, Lk)
        vb = v[ck[b]:ck[b + 1]].repeat_interleave(2, dim=1)  # (Lk, H, E)
        assert_close(torch.einsum("hqk,khe->qhe", p, vb), out[cq[b]:cq[b + 1]], dtype=torch.float32)
        assert torch.equal(probs[b, :, Lq:], torch.zeros_like(probs[b, :, Lq:]))
    # rows that see no key (4 queries, 2 keys, causal bottom-right: queries 0 and 1): output 0,
    # lse +inf as FlashAttention's
    out, lse, _ = flex.flash_attn_varlen_func(q[:4], k[:2], v[:2], torch.tensor([0, 4]), torch.tensor([0, 2]), 4, 2,
                                              causal=True, return_attn_probs=True)
    assert bool(torch.isposinf(lse[:, :2]).all()) and bool(torch.isfinite(lse[:, 2:]).all())
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))


def test_unpad_and_pad_input_round_trip_with_flash_attentions_values():
    x = randn(3, 6, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    packed, indices, cu_seqlens, max_seqlen, used = flex.unpad_input(x, mask)
    assert packed.shape == (10, 4) and torch.equal(packed, x[mask])
    assert indices.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 11, 12]
    assert cu_seqlens.tolist() == [0, 3, 9, 10] and cu_seqlens.dtype == torch.int32
    assert max_seqlen == 6 and used.tolist() == [3, 6, 1] and used.dtype == torch.int32
    back = flex.pad_input(packed, indices, 3, 6)
    assert torch.equal(back, x * mask[..., None])
    unused = torch.zeros_like(mask)
    unused[0, 3] = True
    _, idx2, cu2, _, used2 = flex.unpad_input(x, mask, unused)
    assert cu2.tolist() == [0, 4, 10, 11] and used2.tolist() == [3, 6, 1] and 3 in idx2.tolist()


def test_padded_batch_through_unpad_equals_per_sequence_attention():
    """The usual recipe: unpad a padded batch, varlen attention, pad back."""
    B, S, H, E = 3, 12, 2, 8
    x = randn(B, S, 3, H, E)
    mask = torch.arange(S)[None, :] < torch.tensor([12, 7, 3])[:, None]
    packed, indices, cu_seqlens, max_seqlen, _ = flex.unpad_input(x, mask)
    out = flex.flash_attn_varlen_qkvpacked_func(packed, cu_seqlens, max_seqlen, causal=True)
    padded = flex.pad_input(out, indices, B, S)  # (B, S, H, E)
    for b, n in enumerate([12, 7, 3]):
        want = oracle_one(x[b, :n, 0], x[b, :n, 1], x[b, :n, 2], True, (-1, -1), 0.0, None, None)
        assert_close(padded[b, :n], want.float(), dtype=torch.float32)
        assert torch.equal(padded[b, n:], torch.zeros_like(padded[b, n:]))


@pytest.mark.parametrize("bad, error, match", [
    (dict(dropout_p=0.1), NotImplementedError, "dropout_p=0.1: attnlab's attention has no dropout"),
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), NotImplementedError, "block_table"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size must be \(left, right\)"),
    (dict(softcap=-1.0), ValueError, "softcap must be a float >= 0"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must be \(nheads,\)"),
])
def test_what_attnlab_cannot_honour_is_named(bad, error, match):
    q, k, v = inputs(grad=False)
    with pytest.raises(error, match=match):
        flex.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), 37, 37, **bad)
