"""Attention sinks (issue 50 item 1): a logit per query head in each row's softmax denominator,
without a value, with a gradient; on the reference, the tiled path (native float32, pure float64,
bfloat16), flex (native and pure, with a score_mod), the front door and torch.compile.

The golden is written here in float64 with torch's softmax (an oracle, in a test only): the
scores with one more column, the sink's logit, whose weight is dropped before the values.
"""

from __future__ import annotations

import pytest
import torch

from attnlab import dispatch, flex, functional, tiled
from attnlab.testing import assert_close


def golden(q, k, v, sinks, keep=None, causal=False):
    """``(B, H, L, Ev)`` float64: softmax over [scores, sink] without the sink's column, @ v."""
    q, k, v, sinks = (t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v, sinks))
    H, Hkv = q.shape[1], k.shape[1]
    kk, vv = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = q @ kk.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, L, S)
    L, S = s.shape[-2:]
    if causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    column = sinks[:, None, None].expand(*s.shape[:-1], 1)  # (B, H, L, 1)
    p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    return p @ vv, (q, k, v, sinks)


def inputs(dtype, H=4, Hkv=2, L=33, S=70, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, L, E, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, Hkv, S, E, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, Hkv, S, E, generator=g).to(dtype).requires_grad_()
    sinks = (torch.randn(H, generator=g) * 2).to(dtype).requires_grad_()  # of either sign, not small
    return q, k, v, sinks


def check(out, q, k, v, sinks, dtype, keep=None, causal=False):
    """Output and the four gradients against the float64 golden, at ``dtype``'s tolerance."""
    want, leaves = golden(q, k, v, sinks, keep, causal)
    do = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    assert_close(out.double(), want, dtype=dtype, msg="output")
    got = torch.autograd.grad(out, (q, k, v, sinks), do.to(out.dtype))
    ref = torch.autograd.grad(want, leaves, do)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, ref):
        assert_close(a.double(), b, dtype=dtype, msg=name)


def random_keep(L, S, seed=1):
    keep = torch.rand(2, 1, L, S, generator=torch.Generator().manual_seed(seed)) > 0.5
    keep[:, :, 3] = False  # a fully masked row: output 0, the sink's weight 1
    return keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "causal", "mask"])
def test_tiled_sinks_forward_and_backward_equal_the_float64_golden(dtype, case):
    """Native float32 and bfloat16 kernels and the pure float64 path, GQA (4 query heads on 2),
    tiles that do not divide the lengths, a fully masked row."""
    q, k, v, sinks = inputs(dtype)
    keep = random_keep(33, 70) if case == "mask" else None
    out = tiled.flash_attention(q, k, v, keep, case == "causal", enable_gqa=True, sinks=sinks, block_q=16, block_k=16)
    if keep is not None:
        assert out[:, :, 3].abs().max() == 0  # a row with no key: zeros, as the softmax over the sink alone gives
    check(out, q, k, v, sinks, dtype, keep, case == "causal")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_sinks_equal_the_float64_golden(dtype):
    q, k, v, sinks = inputs(dtype)
    keep = random_keep(33, 70)
    out = functional.scaled_dot_product_attention(q, k, v, keep, enable_gqa=True, sinks=sinks)
    check(out, q, k, v, sinks, dtype, keep)
    weights = functional.attention_weights(q, k, keep, enable_gqa=True, sinks=sinks)
    assert (weights.sum(-1) < 1).all()  # the sink took part of every row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("softcap", [False, True])
def test_flex_sinks_with_a_sliding_window_equal_the_float64_golden(dtype, softcap):
    """gpt-oss's layers: a sliding-window block mask (native kernels) or with a score_mod (the pure
    path); the lse returned includes the sink."""
    q, k, v, sinks = inputs(dtype, L=40, S=40)

    def window(b, h, qi, ki):
        return (ki <= qi) & (qi - ki < 8) & (qi != 5)  # row 5 sees nothing

    bm = flex.create_block_mask(window, None, None, 40, 40, BLOCK_SIZE=16)
    keep = torch.tensor([[bool(window(0, 0, i, j)) for j in range(40)] for i in range(40)])
    mod = (lambda s, b, h, qi, ki: s) if softcap else None  # any score_mod takes the pure path
    out, lse = flex.flex_attention(q, k, v, mod, bm, enable_gqa=True, sinks=sinks, return_lse=True)
    assert torch.allclose(lse[:, :, 5].double(), sinks.detach().double().expand(2, 4))  # only the sink: lse = s
    check(out, q, k, v, sinks, dtype, keep)


def test_the_front_door_takes_sinks_on_every_path_that_has_them_and_refuses_the_others():
    q, k, v, sinks = inputs(torch.float32, L=1, S=300)  # a decode step: "auto" would take the decode kernels
    frozen = [t.detach() for t in (q, k, v)]  # no gradient asked: what the decode kernels take
    assert dispatch.choose_impl(*frozen, enable_gqa=True, sinks=sinks) == "decode"
    for impl in ("auto", "reference", "tiled"):
        out = dispatch.attention(q, k, v, enable_gqa=True, impl=impl, sinks=sinks)
        check(out, q, k, v, sinks, torch.float32)
    with torch.no_grad():
        out = dispatch.attention(*frozen, enable_gqa=True, impl="decode", sinks=sinks)
    assert_close(out.double(), golden(*frozen, sinks.detach())[0].detach(), dtype=torch.float32)
    with pytest.raises(ValueError, match="impl='triton' .* cannot run sinks"):
        dispatch.attention(q, k, v, enable_gqa=True, impl="triton", sinks=sinks)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8", "paged"])
@pytest.mark.parametrize("L, causal", [(1, False), (4, True)])
def test_decode_sinks_equal_the_float64_golden(cache, L, causal):
    """The decode kernels (streaming loop, GQA, a cache of each kind) with the sink folded into
    their (out, lse); bottom-right causal rows for L = 4, and a short sequence in the batch."""
    from attnlab import decoding

    g = torch.Generator().manual_seed(5)
    B, H, Hkv, S, E = 2, 8, 2, 300, 64
    q = torch.randn(B, H, L, E, generator=g)
    k, v = torch.randn(B, Hkv, S, E, generator=g), torch.randn(B, Hkv, S, E, generator=g)
    sinks = torch.randn(H, generator=g) * 2
    keep = torch.ones(B, 1, L, S, dtype=torch.bool)
    if causal:
        keep &= torch.ones(L, S, dtype=torch.bool).tril(S - L)
    dtype = torch.float32
    if cache == "paged":
        pc = decoding.PagedKVCache(B, Hkv, E, page_size=16)
        pc.append(k, v)
        out = decoding.paged_decode_attention(q, pc, is_causal=causal, causal_align="bottom_right", sinks=sinks)
    elif cache == "int8":
        (k8, ks), (v8, vs) = decoding.quantize(k), decoding.quantize(v)
        out = decoding.decode_attention(q, k8, v8, causal, enable_gqa=True, causal_align="bottom_right",
                                        k_scale=ks, v_scale=vs, sinks=sinks)
        k, v = k8.float() * ks[..., None], v8.float() * vs[..., None]  # what the cache holds
        from attnlab.kernels import decode as kernel
        from attnlab.kernels import native

        if native.ops() is not None and kernel.int8_dot(E, kernel.loop(H // Hkv * L)) == "int16":
            q = kernel.int16_rounded(q)  # the query the integer dot products see (tests/kernels/test_decoding.py)
    else:
        dtype = getattr(torch, cache)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        out = decoding.decode_attention(q, k, v, causal, enable_gqa=True, causal_align="bottom_right", sinks=sinks)
    want = golden(q, k, v, sinks, keep)[0].detach()
    assert_close(out.double(), want, dtype=dtype)
    without = decoding.decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal, enable_gqa=True,
                                        causal_align="bottom_right")
    assert (out.double() - without.double()).abs().max() > 10 * (out.double() - want).abs().max()  # it mattered


@pytest.mark.parametrize("bad, error, words", [
    (torch.zeros(3), ValueError, r"sinks must have shape \(H,\) = \(4,\).*got \(3,\)"),
    (torch.zeros(4, dtype=torch.long), TypeError, "sinks must be a floating-point tensor, got torch.int64"),
    ([0.0] * 4, TypeError, "sinks must be a tensor of shape"),
])
def test_bad_sinks_are_refused_by_name_with_expected_and_actual(bad, error, words):
    q, k, v, _ = inputs(torch.float32)
    for fn in (lambda s: tiled.flash_attention(q, k, v, enable_gqa=True, sinks=s),
               lambda s: functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, sinks=s),
               lambda s: flex.flex_attention(q, k, v, enable_gqa=True, sinks=s),
               lambda s: dispatch.attention(q, k, v, enable_gqa=True, sinks=s)):
        with pytest.raises(error, match=words):
            fn(bad)


def test_sinks_through_torch_compile_fullgraph_equal_eager():
    """The tiled path's custom op carries the sinks and their gradient (0 graph breaks)."""
    torch._dynamo.reset()
    q, k, v, sinks = inputs(torch.float32, L=40, S=40)

    def fn(q, k, v, sinks):
        return tiled.flash_attention(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, sinks)
    check(out, q, k, v, sinks, torch.float32, causal=True)


def test_varlen_sinks_equal_the_golden_of_each_sequence():
    """FlashAttention's varlen layout (sequences packed one after another), causal, GQA: each
    sequence's rows see its sink; the softmax_lse returned includes it."""
    from attnlab.flex import varlen_attention

    g = torch.Generator().manual_seed(7)
    q = torch.randn(33, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(33, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(33, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = (torch.randn(4, generator=g, dtype=torch.float64) * 2).requires_grad_()
    cu = torch.tensor([0, 10, 33], dtype=torch.int32)
    out, lse, _ = varlen_attention(q, k, v, cu, cu, is_causal=True, sinks=sinks, return_attn_probs=True)
    wants, lses = [], []
    for a, b in ((0, 10), (10, 33)):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (heads, n, E)
        ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)  # (H, n, E): GQA
        x = (qs @ ks.transpose(-2, -1) / 4).masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(),
                                                        float("-inf"))  # (H, n, n)
        x = torch.cat([x, sinks[:, None, None].expand(4, b - a, 1)], -1)
        wants.append((torch.softmax(x, -1)[..., :-1] @ vs).transpose(0, 1))  # (n, H, Ev)
        lses.append(torch.logsumexp(x, -1))  # (H, n): with the sink's column
    want = torch.cat(wants)  # (total, H, Ev)
    assert_close(out, want.detach(), dtype=torch.float64)
    assert_close(lse.double(), torch.cat(lses, 1).detach(), dtype=torch.float32)  # returned in float32
    do = torch.randn(want.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, sinks), do, retain_graph=True)
    ref = torch.autograd.grad(want, (q, k, v, sinks), do)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, ref):
        assert_close(a, b, dtype=torch.float64, msg=name)


@pytest.mark.parametrize("cache", ["dense", "paged", "int8"])
def test_a_module_with_sinks_decodes_token_by_token_as_it_runs_the_whole_sequence(cache):
    """MultiHeadAttention(sinks=True): the sinks are a parameter with a gradient, the whole causal
    sequence equals the golden, and decoding one token at a time through a KV cache (the decode
    kernels, with the sinks) gives the same rows."""
    from attnlab import decoding
    from attnlab.modules import KVCache, MultiHeadAttention

    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, sinks=True)
    with torch.no_grad():
        m.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0]))
    x = torch.randn(2, 9, 32)
    full, _ = m(x, is_causal=True)
    full.square().sum().backward()
    assert m.sinks.grad is not None and m.sinks.grad.abs().min() > 0
    q = m.q_proj(x).view(2, 9, 4, 8).transpose(1, 2)
    k = m.k_proj(x).view(2, 9, 2, 8).transpose(1, 2)
    v = m.v_proj(x).view(2, 9, 2, 8).transpose(1, 2)
    want = golden(q, k, v, m.sinks, causal=True)[0].transpose(1, 2).reshape(2, 9, 32).float()
    assert_close(full, m.out_proj(want), dtype=torch.float32)
    if cache == "paged":
        kv = decoding.PagedKVCache(2, 2, 8, page_size=4)
    else:
        kv = KVCache(2, 2, 8, max_len=16, **({"dtype": torch.int8} if cache == "int8" else {}))
    rows = []
    with torch.no_grad():
        for t in range(9):
            out, _ = m(x[:, t:t + 1], kv_cache=kv, is_causal=True)
            rows.append(out)
    steps = torch.cat(rows, 1)
    if cache == "int8":  # the cache rounds K and V to int8: a step is as close as that rounding allows
        assert (steps - full.detach()).abs().max() < 0.05
    else:
        assert_close(steps, full.detach(), dtype=torch.float32)


@pytest.mark.parametrize("fill", ["finfo.min", "-1e9"])
def test_tiled_sinks_with_masks_too_large_for_base_2(fill):
    """Hugging Face's additive masks (0 and finfo.min) and rows masked with -1e9 run the pure path
    in natural units, (m_i, l_i) kept apart: the sink is folded into those. A row masked whole keeps
    torch's meaning (its scores all equal: uniform weights over the keys, beside the sink)."""
    q, k, v, sinks = inputs(torch.float32)
    keep = random_keep(33, 70)
    value = torch.finfo(torch.float32).min if fill == "finfo.min" else -1e9
    additive = torch.zeros(keep.shape).masked_fill(~keep, value)
    out = tiled.flash_attention(q, k, v, additive, enable_gqa=True, sinks=sinks, block_q=16, block_k=16)
    # the golden: the same additive mask on float64 scores (a row masked whole: equal scores)
    q64, k64, v64, s64 = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    kk, vv = k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1)
    x = q64 @ kk.transpose(-2, -1) / 4 + additive.double()
    if fill == "finfo.min":
        x = torch.maximum(x, torch.tensor(torch.finfo(torch.float32).min, dtype=torch.float64))  # float32's rounding
    p = torch.softmax(torch.cat([x, s64[:, None, None].expand(2, 4, 33, 1)], -1), -1)[..., :-1]
    want = p @ vv
    assert_close(out.double(), want.detach(), dtype=torch.float32)
    do = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, sinks), do.float())
    ref = torch.autograd.grad(want, (q64, k64, v64, s64), do)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, ref):
        assert_close(a.double(), b, dtype=torch.float32, msg=name)
