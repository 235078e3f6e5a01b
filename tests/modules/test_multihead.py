"""MultiHeadAttention, KVCache and the masks toolkit."""

import pytest
import torch
from torch import nn

from attnlab import KVCache, MultiHeadAttention, masks
from attnlab.cli import main
from attnlab.testing import assert_close, sdpa_oracle

E, H = 16, 4


def torch_pair(batch_first=True, bias=True, kdim=None, vdim=None, seed=0):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first, kdim=kdim, vdim=vdim).eval()
    return ref, MultiHeadAttention.from_torch(ref).eval()


def to_layout(t, batch_first):
    return t if batch_first else t.transpose(0, 1).contiguous()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("average", [True, False])
def test_self_attention_matches_torch(batch_first, bias, average, gen):
    ref, ours = torch_pair(batch_first, bias)
    x = to_layout(torch.randn(2, 5, E, generator=gen), batch_first)
    o1, w1 = ref(x, x, x, need_weights=True, average_attn_weights=average)
    o2, w2 = ours(x, need_weights=True, average_attn_weights=average)
    assert_close(o2, o1)
    assert_close(w2, w1)
    o3, none = ours(x)  # the fast path without weights
    assert none is None
    assert_close(o3, o1)


@pytest.mark.parametrize("kdim,vdim", [(None, None), (10, 7)])
def test_cross_attention_with_masks_matches_torch(kdim, vdim, gen):
    ref, ours = torch_pair(kdim=kdim, vdim=vdim)
    q = torch.randn(2, 3, E, generator=gen)
    k = torch.randn(2, 6, kdim or E, generator=gen)
    v = torch.randn(2, 6, vdim or E, generator=gen)
    keep = torch.rand(3, 6, generator=gen) > 0.3
    keep[:, 0] = True
    real = torch.tensor([[True] * 6, [True, True, True, True, False, False]])
    # attnlab: True = attend / real token; torch's module: True = ignore. Hence the ~.
    o1, w1 = ref(q, k, v, attn_mask=~keep, key_padding_mask=~real, need_weights=True)
    o2, w2 = ours(q, k, v, attn_mask=keep, key_padding_mask=real, need_weights=True)
    assert_close(o2, o1)
    assert_close(w2, w1)
    float_mask = torch.randn(3, 6, generator=gen)  # additive in both
    o1, _ = ref(q, k, v, attn_mask=float_mask)
    o2, _ = ours(q, k, v, attn_mask=float_mask)
    assert_close(o2, o1)
    per_head = torch.rand(2 * H, 3, 6, generator=gen) > 0.2
    per_head[..., 0] = True
    assert_close(ours(q, k, v, attn_mask=per_head)[0], ref(q, k, v, attn_mask=~per_head)[0])


def test_mask_polarity_trap_is_pinned(gen):
    """Passing torch's mask unchanged gives a different answer: the docstrings say so."""
    ref, ours = torch_pair()
    x = torch.randn(1, 4, E, generator=gen)
    ignore = torch.tensor([[False, False, True, True]])  # torch: True = ignore
    o_torch, _ = ref(x, x, x, key_padding_mask=ignore)
    assert torch.allclose(ours(x, key_padding_mask=~ignore)[0], o_torch, atol=1e-6)
    assert not torch.allclose(ours(x, key_padding_mask=ignore)[0], o_torch, atol=1e-3)
    assert "True = attend" in MultiHeadAttention.__doc__ and "True = ignore" in MultiHeadAttention.__doc__


def test_gradients_match_torch(gen):
    ref, ours = torch_pair()
    x1 = torch.randn(2, 5, E, generator=gen, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    keep = masks.causal(5, 5)
    ref(x1, x1, x1, attn_mask=~keep)[0].pow(2).sum().backward()
    ours(x2, attn_mask=keep)[0].pow(2).sum().backward()
    assert_close(x2.grad, x1.grad)
    wq, wk, wv = ref.in_proj_weight.grad.chunk(3)
    assert_close(ours.q_proj.weight.grad, wq)
    assert_close(ours.v_proj.weight.grad, wv)
    assert_close(ours.out_proj.weight.grad, ref.out_proj.weight.grad)


@pytest.mark.parametrize("kdim,vdim,batch_first", [(None, None, True), (10, 7, False)])
def test_to_torch_round_trip(kdim, vdim, batch_first, gen):
    ours = MultiHeadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=batch_first).eval()
    ref = ours.to_torch().eval()
    q = to_layout(torch.randn(2, 3, E, generator=gen), batch_first)
    k = to_layout(torch.randn(2, 4, kdim or E, generator=gen), batch_first)
    v = to_layout(torch.randn(2, 4, vdim or E, generator=gen), batch_first)
    assert_close(ours(q, k, v)[0], ref(q, k, v)[0])
    back = MultiHeadAttention.from_torch(ref)
    assert_close(back(q, k, v)[0], ours(q, k, v)[0])


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_gqa_matches_torch_sdpa(num_kv_heads, gen):
    m = MultiHeadAttention(E, H, num_kv_heads=num_kv_heads).eval()
    assert m.k_proj.out_features == num_kv_heads * E // H
    x = torch.randn(2, 5, E, generator=gen)
    hd = E // H
    q = m.q_proj(x).view(2, 5, H, hd).transpose(1, 2)
    k = m.k_proj(x).view(2, 5, num_kv_heads, hd).transpose(1, 2)
    v = m.v_proj(x).view(2, 5, num_kv_heads, hd).transpose(1, 2)
    expected = m.out_proj(sdpa_oracle(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(2, 5, E))
    assert_close(m(x, is_causal=True)[0], expected)
    assert_close(m(x, is_causal=True, need_weights=True)[0], expected)
    with pytest.raises(ValueError, match="no grouped-query heads"):
        m.to_torch()


@pytest.mark.parametrize("num_kv_heads,max_len", [(H, 8), (2, None), (1, 8)])
def test_decoding_token_by_token_equals_the_full_causal_forward(num_kv_heads, max_len, gen):
    m = MultiHeadAttention(E, H, num_kv_heads=num_kv_heads).eval()
    x = torch.randn(2, 7, E, generator=gen)
    full, _ = m(x, is_causal=True)
    cache = KVCache(2, num_kv_heads, E // H, max_len=max_len)
    prompt, _ = m(x[:, :3], is_causal=True, kv_cache=cache)  # a 3-token prompt at once
    steps = [prompt] + [m(x[:, t:t + 1], is_causal=True, kv_cache=cache)[0] for t in range(3, 7)]
    assert_close(torch.cat(steps, dim=1), full)
    assert cache.length == 7 and cache._k.shape[1] == num_kv_heads  # only the key/value heads are kept


def test_a_growing_cache_copies_log_t_times_and_returns_views():
    """Without max_len the cache doubles when full: 1000 one-token appends reallocate 7 times
    (16, 32, ..., 1024), not 1000 (a torch.cat of the whole cache per token); what append
    returns is a view of the cache's storage and equals the tokens appended, in order."""
    g = torch.Generator().manual_seed(3)
    cache = KVCache(2, 3, 4)
    tokens = torch.randn(2, 3, 1000, 4, generator=g)
    storages = set()
    for t in range(1000):
        k, v = cache.append(tokens[:, :, t:t + 1], -tokens[:, :, t:t + 1])
        storages.add(cache._k.data_ptr())  # noqa: SLF001 (the test looks at the storage)
    assert len(storages) == 7 and cache.capacity == 1024
    assert k.data_ptr() == cache._k.data_ptr()  # noqa: SLF001  (a view, not a copy)
    assert torch.equal(k, tokens) and torch.equal(v, -tokens)
    cache.append(torch.zeros(2, 3, 100, 4), torch.zeros(2, 3, 100, 4))  # a long chunk past the capacity
    assert cache.capacity == 2048 and cache.length == 1100
    assert torch.equal(cache.append(tokens[:, :, :1], tokens[:, :, :1])[0][:, :, :1000], tokens)


def test_cache_errors():
    cache = KVCache(1, 2, 4, max_len=2)
    cache.append(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match="the cache is full: 2 \\+ 1 tokens > max_len=2"):
        cache.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(ValueError, match="k must be \\(B=1, Hkv=2, T, head_dim=4\\)"):
        KVCache(1, 2, 4).append(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))


def test_module_errors():
    with pytest.raises(ValueError, match="d_model=10 must be a multiple of num_heads=4"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match="num_heads=4 must be a multiple of num_kv_heads=3"):
        MultiHeadAttention(16, 4, num_kv_heads=3)
    m = MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match="query must be \\(B, L, E\\) with E=16, got \\(2, 5, 8\\)"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="key_padding_mask must be \\(B, S\\) = \\(2, 5\\)"):
        m(torch.randn(2, 5, E), key_padding_mask=torch.ones(2, 4, dtype=torch.bool))


# ------------------------------------------------------------------ masks toolkit
@pytest.mark.parametrize("L,S,window", [(5, 5, 2), (3, 7, 3), (7, 3, 1), (4, 4, 10)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_sliding_window_definition(L, S, window, align):
    off = 0 if align == "top_left" else S - L
    i = torch.arange(L)[:, None] + off
    j = torch.arange(S)[None, :]
    assert torch.equal(masks.sliding_window(L, S, window, align=align), (j <= i) & (j > i - window))


def test_padding_both_either_and_conversions():
    pad = masks.padding(torch.tensor([3, 1]), 4)
    assert pad.shape == (2, 1, 1, 4)
    assert masks.render(pad[:, 0, 0]) == "# # # .\n# . . ."
    combined = masks.both(masks.causal(4, 4), pad)  # (2, 1, 4, 4)
    assert combined.shape == (2, 1, 4, 4) and not combined[1, 0, 3, 1] and combined[0, 0, 3, 2]
    assert torch.equal(masks.either(masks.causal(3, 3), ~masks.causal(3, 3)), torch.ones(3, 3, dtype=torch.bool))
    m = masks.causal(3, 5)
    add = masks.to_additive(m)
    assert torch.equal(add == 0, m) and torch.isneginf(add[~m]).all()
    assert torch.equal(masks.to_bool(add), m)
    q = torch.randn(2, 3, 8)
    k = torch.randn(2, 5, 8)
    assert_close(sdpa_oracle(q, k, k, attn_mask=add), sdpa_oracle(q, k, k, attn_mask=m))
    with pytest.raises(TypeError, match="convert float masks with to_bool"):
        masks.both(m, add)
    with pytest.raises(ValueError, match="every length must be in \\[0, S=4\\]"):
        masks.padding([5], 4)


def test_cli_masks_show(capsys):
    assert main(["masks", "show", "causal", "--L", "4", "--S", "6", "--align", "bottom_right"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["# # # . . .", "# # # # . .", "# # # # # .", "# # # # # #"]
    assert main(["masks", "show", "sliding_window", "--L", "3", "--window", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["# . .", "# # .", ". # #"]
    assert main(["masks", "show", "padding", "--lengths", "2,0", "--S", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["# # .", ". . ."]
