"""attnlab.flex: block masks, flex_attention forward and backward, the mods, varlen.

The oracle for every variant is attnlab's reference with the same mask materialised (the
mods written out densely), outputs and gradients; torch's own flex_attention (eager, the
forward: it has no CPU backward) is checked too where it runs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from attnlab.flex import (BlockMask, alibi, and_masks, causal_mask, create_block_mask, document_ids, document_mask,
                          flex_attention, noop_mask, or_masks, prefix_lm, relative_bias, sliding_window, softcap,
                          varlen_attention)
from attnlab.flex import block_mask as bm_module
from attnlab.functional import scaled_dot_product_attention as reference
from attnlab.testing import assert_close, tolerance


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def dense(mask_mod, B, H, L, S) -> torch.Tensor:
    """The mask_mod written out: (B, H, L, S) bool (small sizes only)."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(L).view(1, 1, L, 1)
    kv = torch.arange(S).view(1, 1, 1, S)
    return mask_mod(b, h, q, kv).expand(B, H, L, S)


def dense_scores_mod(score_mod, B, H, L, S, dtype=torch.float64):
    """score_mod applied to zero scores: the additive bias it makes (for linear mods)."""
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q, kv = torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)
    return score_mod(torch.zeros(B, H, L, S, dtype=dtype), b, h, q, kv)


B, H, L, S, E, Ev = 2, 4, 70, 70, 16, 8
MASKS = {
    "causal": causal_mask,
    "sliding_16": sliding_window(16),
    "document": document_mask(document_ids([20, 33, 17])),
    "prefix_25": prefix_lm(25),
    "causal_or_first": or_masks(causal_mask, lambda b, h, q, kv: kv < 3),
    "sliding_and_even_heads": and_masks(sliding_window(30), lambda b, h, q, kv: (h % 2 == 0) | (q >= kv)),
}


# --------------------------------------------------------------------------- block masks
@pytest.mark.parametrize("name", list(MASKS))
def test_block_mask_classifies_every_block_as_the_dense_mask_says(name):
    mod = MASKS[name]
    bm = create_block_mask(mod, None, H, L, S, BLOCK_SIZE=16)
    want = dense(mod, 1, H, L, S)
    assert torch.equal(bm.element_mask(), want)
    counts = bm.counts()
    assert counts["empty"] + counts["partial"] + counts["full"] == bm.kinds.numel()
    for h in range(H):
        for i in range(bm.kinds.shape[2]):
            for j in range(bm.kinds.shape[3]):
                block = want[0, h, i * 16:(i + 1) * 16, j * 16:(j + 1) * 16]
                kind = int(bm.kinds[0, h, i, j])
                assert kind == (bm_module.EMPTY if not block.any() else
                                bm_module.FULL if block.all() and block.shape == (16, 16) else bm_module.PARTIAL)


def test_block_mask_prints_a_picture_and_its_density():
    bm = create_block_mask(causal_mask, None, None, 64, 64, BLOCK_SIZE=16)
    text = str(bm)
    assert "density=0.625" in text and "6 full, 4 partial, 6 empty" in text
    assert "+..." in text and "#+.." in text and "##+." in text and "###+" in text
    assert bm.density() == pytest.approx(10 / 16)


def test_building_a_block_mask_never_evaluates_an_L_by_S_tensor():
    calls = []

    def recording(b, h, q, kv):
        calls.append(torch.broadcast_shapes(q.shape, kv.shape).numel())
        return sliding_window(256)(b, h, q, kv)

    L_big = 32768
    bm = create_block_mask(recording, None, None, L_big, L_big, BLOCK_SIZE=128)
    assert max(calls) <= bm_module.CHUNK_ELEMENTS < L_big * L_big // 200
    assert bm.density() < 0.02 and bm.counts()["full"] > 0


def test_block_mask_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"BLOCK_SIZE\[1\] must be a positive int, got 0"):
        create_block_mask(causal_mask, None, None, 8, 8, BLOCK_SIZE=(4, 0))  # any positive size, as torch's
    with pytest.raises(TypeError, match="mask_mod must be callable"):
        create_block_mask(None, None, None, 8, 8)
    with pytest.raises(ValueError, match=r"made for \(Q_LEN, KV_LEN\) = \(8, 8\)"):
        flex_attention(randn(1, 1, 9, 4), randn(1, 1, 9, 4), randn(1, 1, 9, 4),
                       block_mask=create_block_mask(causal_mask, None, None, 8, 8, BLOCK_SIZE=8))


# --------------------------------------------------------------------------- flex_attention
def run_both(mask_mod=None, score_mod=None, bias=None, q_len=L, kv_len=S, Hkv=H, block=16, dtype=torch.float64,
             mod_B=None, mod_H=H):
    q = randn(B, H, q_len, E).to(dtype).requires_grad_()
    k = randn(B, Hkv, kv_len, E, seed=1).to(dtype).requires_grad_()
    v = randn(B, Hkv, kv_len, Ev, seed=2).to(dtype).requires_grad_()
    bm = create_block_mask(mask_mod, mod_B, mod_H, q_len, kv_len, BLOCK_SIZE=block) if mask_mod else None
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=Hkv != H)
    g = randn(*out.shape, seed=3).to(dtype)
    out.backward(g)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    mask = None
    if mask_mod is not None:
        mask = dense(mask_mod, mod_B or 1, mod_H or 1, q_len, kv_len)
    if bias is not None:
        fmask = bias() if mask is None else bias().masked_fill(~mask, float("-inf"))
        mask = fmask
    ref = reference(q2, k2, v2, attn_mask=mask, enable_gqa=Hkv != H)
    ref.backward(g)
    for a, b_, what in ((out, ref, "output"), (q.grad, q2.grad, "dq"), (k.grad, k2.grad, "dk"), (v.grad, v2.grad, "dv")):
        assert_close(a, b_, dtype=dtype, msg=what)
    return out, ref


@pytest.mark.parametrize("name", list(MASKS))
def test_flex_matches_the_reference_with_the_dense_mask(name):
    run_both(MASKS[name])


@pytest.mark.parametrize("lengths", [(33, 70), (70, 41), (1, 9), (13, 13)], ids=str)
def test_odd_lengths_and_fully_masked_rows(lengths):
    # a document mask over the keys only: queries past the keys' documents see nothing
    q_len, kv_len = lengths
    out, _ = run_both(lambda b, h, q, kv: (q < kv_len) & (kv <= q), None, q_len=q_len, kv_len=kv_len, mod_H=None)
    if q_len > kv_len:
        assert (out[:, :, kv_len:] == 0).all()


def test_gqa_without_repeating_the_caller_tensors():
    run_both(causal_mask, Hkv=2)


def test_score_mods_alibi_and_softcap():
    run_both(causal_mask, alibi(H), bias=lambda: dense_scores_mod(alibi(H), B, H, L, S))
    # softcap is not additive: compare with the mod applied to the reference's own scores
    q, k, v = randn(B, H, L, E, seed=4), randn(B, H, S, E, seed=5), randn(B, H, S, Ev, seed=6)
    cap = softcap(2.0)
    out = flex_attention(q * 3, k * 3, v, score_mod=cap)
    s = (q * 3) @ (k * 3).transpose(-2, -1) / E ** 0.5
    w = torch.softmax(cap(s, None, None, None, None), dim=-1)  # the oracle, in the test only
    assert_close(out, w @ v, dtype=torch.float32)


def test_relative_bias_table_gets_its_gradient():
    n = max(L, S)
    table = (randn(H, 2 * n - 1, seed=7) * 0.5).double().requires_grad_()
    mod = relative_bias(table)
    q = randn(B, H, L, E).double().requires_grad_()
    out = flex_attention(q, q.detach(), randn(B, H, S, Ev, seed=2).double(), score_mod=mod,
                         block_mask=create_block_mask(causal_mask, None, None, L, S, BLOCK_SIZE=16))
    out.square().sum().backward()
    grad_flex = table.grad.clone()
    table.grad = None
    bias = dense_scores_mod(mod, 1, H, L, S).masked_fill(~dense(causal_mask, 1, 1, L, S), float("-inf"))
    ref = reference(q.detach(), q.detach(), randn(B, H, S, Ev, seed=2).double(), attn_mask=bias)
    ref.square().sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    assert_close(grad_flex, table.grad, dtype=torch.float64)


def test_return_lse_matches_the_log_sum_exp():
    q, k, v = randn(1, 2, 20, E), randn(1, 2, 24, E, seed=1), randn(1, 2, 24, Ev, seed=2)
    bm = create_block_mask(sliding_window(5), None, None, 20, 24, BLOCK_SIZE=8)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    s = (q @ k.transpose(-2, -1) / E ** 0.5).masked_fill(~dense(sliding_window(5), 1, 1, 20, 24), float("-inf"))
    assert_close(lse, torch.logsumexp(s, dim=-1), dtype=torch.float32)


@pytest.mark.parametrize("path", ["native", "pure"])
@pytest.mark.parametrize("name", ["causal", "sliding_16", "document", "prefix_25"])
def test_forward_matches_torch_flex_attention(name, path, monkeypatch):
    from torch.nn.attention import flex_attention as torch_flex

    from attnlab.kernels import block_sparse as kernels

    calls = []
    if path == "pure":
        monkeypatch.setattr(kernels, "covers", lambda *a: False)
    else:
        real = kernels.attention
        monkeypatch.setattr(kernels, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = randn(B, H, 64, E), randn(B, H, 64, E, seed=1), randn(B, H, 64, Ev, seed=2)
    mod = MASKS[name]
    ours = flex_attention(q, k, v, score_mod=alibi(H), block_mask=create_block_mask(mod, None, None, 64, 64,
                                                                                   BLOCK_SIZE=16))
    assert calls == ([1] if path == "native" else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that eager flex_attention is unfused
        torch_bm = torch_flex.create_block_mask(mod, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
        theirs = torch_flex.flex_attention(q, k, v, score_mod=alibi(H), block_mask=torch_bm)
    assert_close(ours, theirs, dtype=torch.float32)


def test_empty_blocks_are_skipped():
    # a mask_mod that sees nothing but the diagonal block: the other blocks never reach a matmul
    bm = create_block_mask(lambda b, h, q, kv: (q // 16) == (kv // 16), None, None, 64, 64, BLOCK_SIZE=16)
    assert bm.counts() == {"empty": 12, "partial": 0, "full": 4}
    seen = []

    def spy(score, b, h, q_idx, kv_idx):
        seen.append((int(q_idx.min()) // 16, int(kv_idx.min()) // 16))
        return score

    flex_attention(randn(1, 1, 64, 8), randn(1, 1, 64, 8), randn(1, 1, 64, 8), score_mod=spy, block_mask=bm)
    assert sorted(seen) == [(0, 0), (1, 1), (2, 2), (3, 3)]


# --------------------------------------------------------------------------- varlen
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_each_sequence_alone(causal):
    lq, lk = [5, 17, 1, 9], [5, 20, 3, 9]
    cq, ck = torch.tensor([0, *torch.tensor(lq).cumsum(0)]), torch.tensor([0, *torch.tensor(lk).cumsum(0)])
    q = randn(sum(lq), 4, E).requires_grad_()
    k = randn(sum(lk), 2, E, seed=1).requires_grad_()
    v = randn(sum(lk), 2, Ev, seed=2).requires_grad_()
    out = varlen_attention(q, k, v, cq, ck, is_causal=causal, block_size=8)
    out.sum().backward()
    for i in range(len(lq)):
        qi, ki, vi = (t.detach()[c[i]:c[i + 1]].transpose(0, 1) for t, c in ((q, cq), (k, ck), (v, ck)))
        mask = None
        if causal:  # bottom-right, as FlashAttention-2
            mask = torch.ones(lq[i], lk[i], dtype=torch.bool).tril(lk[i] - lq[i])
        ref = reference(qi, ki, vi, attn_mask=mask, enable_gqa=True).transpose(0, 1)
        assert_close(out[cq[i]:cq[i + 1]], ref, dtype=torch.float32)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_varlen_errors_name_the_argument():
    q = randn(10, 2, 4)
    with pytest.raises(ValueError, match="end at 9"):
        varlen_attention(q, q, q, torch.tensor([0, 4, 9]), torch.tensor([0, 4, 10]))


def test_masked_backward_passes_gradcheck_through_output_and_lse():
    """The mask-only path has its own backward (FlashAttention-2's, tiles recomputed from lse):
    float64 gradcheck, with a fully masked row, a skipped block and a gradient through lse."""
    bm = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q != 3) & (kv < 20), None, None, 24, 24, BLOCK_SIZE=8)
    assert bm.counts()["empty"] > 0
    q, k, v = (randn(1, 2, 24, 4, seed=s).double().requires_grad_() for s in (0, 1, 2))

    def f(q, k, v):
        out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_the_front_door_runs_flex_for_a_block_mask_or_a_score_mod():
    """dispatch.attention knows flex: a BlockMask or a score_mod runs it (auto or impl='flex'),
    with flex's answer; the other implementations refuse them, and flex refuses what it
    cannot take (a tensor mask, is_causal, dropout), each naming the argument."""
    from attnlab import dispatch, flex as fx

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    bm = fx.create_block_mask(fx.causal_mask, None, None, 40, 40, BLOCK_SIZE=16)
    assert dispatch.choose_impl(q, k, v, bm) == "flex"
    assert torch.equal(dispatch.attention(q, k, v, bm), fx.flex_attention(q, k, v, block_mask=bm))
    mod = fx.softcap(5.0)
    assert torch.equal(dispatch.attention(q, k, v, score_mod=mod), fx.flex_attention(q, k, v, score_mod=mod))
    assert dispatch.choose_impl(q, k, v, impl="flex") == "flex"
    with pytest.raises(ValueError, match="impl='tiled' cannot take a BlockMask"):
        dispatch.attention(q, k, v, bm, impl="tiled")
    with pytest.raises(ValueError, match="flex cannot run is_causal=True"):
        dispatch.attention(q, k, v, bm, is_causal=True)
    with pytest.raises(ValueError, match="flex cannot run a tensor attn_mask"):
        dispatch.attention(q, k, v, torch.ones(40, 40, dtype=torch.bool), impl="flex")
    with pytest.raises(ValueError, match="flex cannot run dropout_p=0.1"):
        dispatch.attention(q, k, v, bm, dropout_p=0.1)
    assert dispatch.choose_impl(q, k, v) == "reference"  # a small plain call: unchanged


@pytest.mark.parametrize("L, S", [(40, 40), (24, 40), (40, 24)])
def test_is_causal_runs_on_the_flex_route_as_its_mask_mod(L, S):
    """issue 63: impl='flex' refused is_causal=True (SDPA's arguments should work on every route that
    can run them); it runs the causal mask_mod, aligned as asked, and with a score_mod on 'auto'."""
    from attnlab import dispatch, flex as fx, functional

    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(1, 2, L, 8, generator=g), torch.randn(1, 2, S, 8, generator=g), torch.randn(1, 2, S, 8,
                                                                                                     generator=g)
    assert_close(dispatch.attention(q, k, v, is_causal=True, impl="flex"),
                 functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert_close(dispatch.attention(q, k, v, is_causal=True, impl="flex", causal_align="bottom_right"),
                 dispatch.attention(q, k, v, is_causal=True, impl="reference", causal_align="bottom_right"))
    mod = fx.softcap(5.0)
    bm = fx.create_block_mask(fx.causal_mask, None, None, L, S)
    assert_close(dispatch.attention(q, k, v, is_causal=True, score_mod=mod),
                 fx.flex_attention(q, k, v, score_mod=mod, block_mask=bm))
