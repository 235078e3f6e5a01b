"""attnlab.flex's native block-sparse kernels (csrc/block_sparse.cpp, attnlab.kernels.block_sparse).

Oracles: attnlab's reference with the mask written out densely (outputs and gradients) and
the pure flex path (the same call with the kernels turned off). Every test here first checks
that the native kernels really ran (a call counter on attnlab.kernels.block_sparse.attention), so a
build failure or a silent fallback fails these tests rather than passing them on the pure path.
"""

from __future__ import annotations

import pytest
import torch

from attnlab import tiled
from attnlab.flex import (BlockMask, alibi, causal_mask, create_block_mask, document_ids, document_mask, flex_attention,
                          prefix_lm, relative_bias, sliding_window, softcap)
from attnlab.flex import block_mask as bm_module
from attnlab.kernels import block_sparse as kernels
from attnlab.functional import scaled_dot_product_attention as reference
from attnlab.testing import assert_close


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def dense(mask_mod, B, H, L, S) -> torch.Tensor:
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q, kv = torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)
    return mask_mod(b, h, q, kv).expand(B, H, L, S)


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the calls that ran the native kernels to the end; fails (never skips) without them."""
    if not tiled.native_status().available:
        pytest.fail(str(tiled.native_status()))
    calls = []
    real = kernels.attention

    def counted(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(kernels, "attention", counted)
    return calls


def pure(fn):
    """fn() with the native kernels turned off: the pure path, the kernels' oracle."""
    real = kernels.covers
    kernels.covers = lambda *a: False
    try:
        return fn()
    finally:
        kernels.covers = real


MASKS = {
    "none": None,
    "causal": causal_mask,
    "sliding_40": sliding_window(40),
    "document": document_mask(document_ids([50, 77, 3, 70])),
    "prefix_30": prefix_lm(30),
    "per_batch_and_head": lambda b, h, q, kv: (kv <= q - 20 * h) | (kv == q + b),  # rows 0..19 of head 1 see no key
}


def check(mask_mod, B=2, H=4, Hkv=4, L=200, S=200, E=16, Ev=8, block=32, mod_B=None, mod_H=None, lse_grad=False):
    """Native flex (float32) against the float32 reference with the dense mask, output and gradients."""
    q = randn(B, H, L, E).requires_grad_()
    k = randn(B, Hkv, S, E, seed=1).requires_grad_()
    v = randn(B, Hkv, S, Ev, seed=2).requires_grad_()
    bm = create_block_mask(mask_mod, mod_B, mod_H, L, S, BLOCK_SIZE=block) if mask_mod else None
    out, lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=Hkv != H, return_lse=True)
    g = randn(*out.shape, seed=3)
    w = randn(*lse.shape, seed=4)
    loss = (out * g).sum() + ((torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * w).sum()
                              if lse_grad else 0)
    loss.backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    mask = dense(mask_mod, mod_B or 1, mod_H or 1, L, S) if mask_mod else None
    ref = reference(q2, k2, v2, attn_mask=mask, enable_gqa=Hkv != H)
    ref_loss = (ref * g).sum()
    if lse_grad:
        s = (q2 @ (k2.repeat_interleave(H // Hkv, 1)).transpose(-2, -1)) / E ** 0.5
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        ref_lse = torch.logsumexp(s, dim=-1)
        assert_close(lse.detach(), ref_lse.detach(), dtype=torch.float32, msg="lse")
        ref_loss = ref_loss + (torch.where(torch.isfinite(ref_lse), ref_lse, torch.zeros_like(ref_lse)) * w).sum()
    ref_loss.backward()
    for a, b_, what in ((out, ref, "output"), (q.grad, q2.grad, "dq"), (k.grad, k2.grad, "dk"),
                        (v.grad, v2.grad, "dv")):
        assert_close(a, b_, dtype=torch.float32, msg=what)
    return out


@pytest.mark.parametrize("name", list(MASKS))
def test_native_matches_the_reference_with_the_dense_mask(name, native_calls):
    per = name == "per_batch_and_head"
    check(MASKS[name], mod_B=2 if per else None, mod_H=4 if per else None)
    assert native_calls == [True]


@pytest.mark.parametrize("Hkv", [2, 1], ids=["gqa", "mqa"])
def test_grouped_heads_share_their_key_value_head(Hkv, native_calls):
    check(sliding_window(50), H=4, Hkv=Hkv, lse_grad=True)
    assert native_calls == [True]


@pytest.mark.parametrize("lengths", [(33, 70), (70, 41), (1, 9), (131, 131), (200, 64)], ids=str)
def test_odd_lengths_and_fully_masked_rows(lengths, native_calls):
    q_len, kv_len = lengths
    out = check(lambda b, h, q, kv: (q < kv_len) & (kv <= q), L=q_len, S=kv_len)
    if q_len > kv_len:
        assert (out[:, :, kv_len:] == 0).all()  # rows that see no key give 0, as SDPA
    assert native_calls == [True]


@pytest.mark.parametrize("block", [8, 64, (16, 48)], ids=str)
def test_block_sizes_and_a_gradient_through_lse(block, native_calls):
    check(causal_mask, L=100, S=100, block=block, lse_grad=True)
    assert native_calls == [True]


def test_the_kernels_follow_the_block_kinds(native_calls):
    """A hand-made BlockMask whose kinds contradict any mask_mod: the kernels must skip EMPTY
    blocks (whatever bits they carry), apply no bits to FULL ones, and read PARTIAL bits.
    ``element_mask`` states that meaning, so the reference with it is the oracle."""
    g = torch.Generator().manual_seed(5)
    Bm, Hm, nq, nk, bq, bk = 2, 1, 5, 4, 16, 24
    L, S = 75, 90  # the last blocks are short
    kinds = torch.randint(0, 3, (Bm, Hm, nq, nk), generator=g, dtype=torch.uint8)
    kinds[0, 0, 2] = bm_module.EMPTY  # a whole row of blocks skipped: its queries give 0
    partial_index = torch.full(kinds.shape, -1, dtype=torch.int64)
    n_partial = int((kinds == bm_module.PARTIAL).sum())
    partial_index[kinds == bm_module.PARTIAL] = torch.arange(n_partial)
    bits = torch.randint(0, 256, (n_partial, bq, bk // 8), generator=g, dtype=torch.uint8)
    bm = BlockMask(kinds, partial_index, bits, L, S, (bq, bk))
    q, k, v = randn(2, 3, L, 8).requires_grad_(), randn(2, 3, S, 8, seed=1).requires_grad_(), randn(2, 3, S, 8, seed=2)
    out = flex_attention(q, k, v, block_mask=bm)
    out.square().sum().backward()
    assert native_calls == [True]
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    ref = reference(q2, k2, v, attn_mask=bm.element_mask())
    ref.square().sum().backward()
    assert (out[0, :, 2 * bq:3 * bq] == 0).all()
    assert_close(out, ref, dtype=torch.float32, msg="output")
    assert_close(q.grad, q2.grad, dtype=torch.float32, msg="dq")
    assert_close(k.grad, k2.grad, dtype=torch.float32, msg="dk")


def test_compressed_rows_list_exactly_the_non_empty_blocks():
    bm = create_block_mask(sliding_window(20), None, 2, 100, 100, BLOCK_SIZE=16)
    row_ptr, cols, bit_idx = bm.compressed_rows()
    nq, nk = bm.kinds.shape[2:]
    for p in range(2):
        for i in range(nq):
            e0, e1 = int(row_ptr[p * nq + i]), int(row_ptr[p * nq + i + 1])
            want = (bm.kinds[0, p, i] != bm_module.EMPTY).nonzero().flatten()
            assert cols[e0:e1].tolist() == want.tolist()
            for e in range(e0, e1):
                j = int(cols[e])
                assert int(bit_idx[e]) == int(bm.partial_index[0, p, i, j])
    assert bm.compressed_rows() is bm.compressed_rows()  # built once


def test_native_equals_the_pure_path_and_is_deterministic_across_threads(native_calls):
    q, k, v = randn(1, 4, 300, 32), randn(1, 4, 300, 32, seed=1), randn(1, 4, 300, 32, seed=2)
    bm = create_block_mask(document_mask(document_ids([10, 250, 40])), None, None, 300, 300, BLOCK_SIZE=32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = flex_attention(q, k, v, block_mask=bm)
        torch.set_num_threads(2)
        two = flex_attention(q, k, v, block_mask=bm)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each query block has one writer, whichever thread takes it
    assert_close(one, pure(lambda: flex_attention(q, k, v, block_mask=bm)), dtype=torch.float32)
    assert native_calls == [True, True]


def test_non_finite_inputs_and_huge_scores_take_the_pure_path(native_calls):
    """NaN propagates as in torch (the native row pass would read it as masked) and scores so
    large that base 2 loses log2(l_i) are redone in natural units: both fall back, same answer."""
    bm = create_block_mask(causal_mask, None, None, 40, 40, BLOCK_SIZE=16)
    q, k, v = randn(1, 2, 40, 8), randn(1, 2, 40, 8, seed=1), randn(1, 2, 40, 8, seed=2)
    q_nan = q.clone()
    q_nan[0, 1, 7, 3] = float("nan")
    out = flex_attention(q_nan, k, v, block_mask=bm)
    assert torch.isnan(out[0, 1, 7]).all() and torch.isfinite(out[0, 0]).all() and torch.isfinite(out[0, 1, 8:]).all()
    assert native_calls == []  # covers() said no: never reached the kernels
    big = flex_attention(q * 3e3, k * 3e3, v, block_mask=bm)
    assert native_calls == [False]  # ran, saw |lse| past the limit, handed over to the pure path
    ref = reference(q.double() * 3e3, k.double() * 3e3, v.double(), attn_mask=dense(causal_mask, 1, 1, 40, 40))
    assert_close(big, ref.float(), dtype=torch.float32)


def test_bfloat16_inputs_run_the_float32_kernels(native_calls):
    q, k, v = (randn(1, 2, 64, 16, seed=s).bfloat16() for s in range(3))
    bm = create_block_mask(sliding_window(10), None, None, 64, 64, BLOCK_SIZE=16)
    out = flex_attention(q, k, v, block_mask=bm)
    assert out.dtype == torch.bfloat16 and native_calls == [True]
    ref = reference(q, k, v, attn_mask=dense(sliding_window(10), 1, 1, 64, 64))
    assert_close(out, ref, dtype=torch.bfloat16)


# --------------------------------------------------------------------------- score mods in the kernels
def scores_oracle(q, k, mod_bias=None, cap=None, mask=None):
    """float64 scores with the mod written out: (B, H, L, S)."""
    E = q.shape[-1]
    s = (q.double() @ k.double().transpose(-2, -1)) / E ** 0.5
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if mod_bias is not None:
        s = s + mod_bias
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def attend(s, v):
    """softmax(s) v with zero rows where everything is masked (the oracle, in the test only)."""
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return w @ v.double()


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "sliding"])
@pytest.mark.parametrize("kind", ["alibi", "softcap", "relative", "relative_shared"])
def test_score_mods_run_natively_with_their_gradients(kind, masked, native_calls):
    """ALiBi, soft-capping and a relative-position table (clamped beyond its n = 40 distances,
    shorter than L) in the kernels: output, q/k/v gradients and the table's gradient against
    float64 autograd through the written-out scores."""
    B, H, L, S, E = 2, 4, 100, 90, 16
    q = (randn(B, H, L, E) * 2).requires_grad_()
    k, v = randn(B, H, S, E, seed=1).requires_grad_(), randn(B, H, S, 8, seed=2).requires_grad_()
    table = (randn(H if kind == "relative" else 1, 79, seed=3) * 0.5).squeeze(0).requires_grad_()
    mod = {"alibi": alibi(H), "softcap": softcap(1.5), "relative": relative_bias(table),
           "relative_shared": relative_bias(table)}[kind]
    bm = create_block_mask(sliding_window(30), None, None, L, S, BLOCK_SIZE=32) if masked else None
    out = flex_attention(q, k, v, score_mod=mod, block_mask=bm)
    g = randn(*out.shape, seed=4)
    (out * g).sum().backward()
    assert native_calls == [True]

    q2, k2, v2, t2 = (t.detach().double().requires_grad_() for t in (q, k, v, table))
    d = torch.arange(L).view(L, 1) - torch.arange(S).view(1, S)  # q_idx - kv_idx
    bias = None
    if kind == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float64)
        bias = -slopes.view(1, H, 1, 1) * d
    elif kind.startswith("relative"):
        idx = d.clamp(-39, 39) + 39
        bias = t2[:, idx].unsqueeze(0) if kind == "relative" else t2[idx]
    mask = dense(sliding_window(30), 1, 1, L, S) if masked else None
    ref = attend(scores_oracle(q2, k2, bias, 1.5 if kind == "softcap" else None, mask), v2)
    (ref * g.double()).sum().backward()
    assert_close(out, ref.float(), dtype=torch.float32, msg="output")
    for a, b_, what in ((q.grad, q2.grad, "dq"), (k.grad, k2.grad, "dk"), (v.grad, v2.grad, "dv")):
        assert_close(a, b_.float(), dtype=torch.float32, msg=what)
    if kind.startswith("relative"):
        assert table.grad is not None and table.grad.abs().sum() > 0
        assert_close(table.grad, t2.grad.float(), dtype=torch.float32, msg="d table")


def test_other_score_mods_take_the_pure_path(native_calls):
    q = randn(1, 2, 40, 8)
    flex_attention(q, q, q, score_mod=lambda s, b, h, qi, kv: s * 0.5)
    assert native_calls == []
