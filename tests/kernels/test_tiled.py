"""attnlab.tiled.flash_attention: the same results as the reference and torch, in O(L·E) memory."""

import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import parity_stats
from attnlab.kernels import dense
from attnlab.dispatch import attention, choose_impl, use_impl
from attnlab.functional import scaled_dot_product_attention as reference
from attnlab.testing import assert_close, assert_close_to_sdpa, max_abs_diff
from attnlab import masks, tiled
from attnlab.tiled import flash_attention
from helpers.parity_cases import CASES, DTYPES, build

NOT_TILED = {"dropout_0.2", "dropout_0.5_mask", "dropout_causal", "dropout_1", "float_mask_requires_grad",
             "gqa_k2_v3"}  # what the tiled path refuses, tested below


def tiled_impl(bq, bk):
    def impl(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert dropout_p == 0.0
        return flash_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa=enable_gqa, block_q=bq, block_k=bk)
    return impl


@pytest.mark.parametrize("blocks", [(2, 3), (256, 512)], ids=["tiny_blocks", "default_blocks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", [c for c in CASES if c.id not in NOT_TILED], ids=lambda c: c.id)
def test_parity_matrix(case, dtype, blocks):
    q, k, v, mask = build(case, dtype)
    parity_stats.record(assert_close_to_sdpa(tiled_impl(*blocks), q, k, v, attn_mask=mask, **case.kwargs), "tiled")


@pytest.mark.parametrize("L,S", [(1, 1), (113, 113), (1023, 1025), (1025, 1023), (7, 300), (300, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_lengths(L, S, causal, gen):
    q = torch.randn(1, 2, L, 16, generator=gen)
    k = torch.randn(1, 2, S, 16, generator=gen)
    v = torch.randn(1, 2, S, 8, generator=gen)
    parity_stats.record(assert_close_to_sdpa(tiled_impl(64, 128), q, k, v, is_causal=causal), "tiled")


def test_block_size_invariance(gen):
    q, k, v = (torch.randn(2, 3, 37, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(37, 37, generator=gen) > 0.3
    outs = [flash_attention(q, k, v, mask, block_q=bq, block_k=bk)
            for bq, bk in [(1, 1), (5, 7), (16, 16), (37, 37), (64, 512)]]
    for o in outs[1:]:
        assert max_abs_diff(o, outs[0]) < 1e-13


def test_fully_masked_rows_and_blocks_give_zero_with_finite_grads(gen):
    q = torch.randn(1, 2, 40, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 50, 8, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, 50, 8, generator=gen, requires_grad=True)
    mask = torch.rand(40, 50, generator=gen) > 0.5
    mask[3] = False  # an empty row
    mask[16:32, :] = False  # a whole block of empty rows (blocks of 16)
    mask[:, 32:48] = False  # a whole key block masked for every query
    out = flash_attention(q, k, v, mask, block_q=16, block_k=16)
    assert torch.equal(out[..., 3, :], torch.zeros(1, 2, 8))
    assert torch.equal(out[..., 16:32, :], torch.zeros(1, 2, 16, 8))
    assert_close(out, reference(q, k, v, mask))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(k.grad[..., 32:48, :], torch.zeros(1, 2, 16, 8))


def test_gradcheck_float64_small(gen):
    q = torch.randn(1, 2, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 6, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(5, 6, generator=gen) > 0.3
    for kwargs in ({"attn_mask": mask}, {"is_causal": True}):
        assert torch.autograd.gradcheck(
            lambda q, k, v: flash_attention(q, k, v, enable_gqa=True, block_q=2, block_k=4, **kwargs), (q, k, v))


def test_gqa_does_not_repeat_kv(gen):
    q = torch.randn(1, 8, 16, 4, generator=gen)
    k = torch.randn(1, 2, 16, 4, generator=gen)
    v = torch.randn(1, 2, 16, 4, generator=gen)
    out = flash_attention(q, k, v, enable_gqa=True, block_q=4, block_k=4)
    assert_close(out, reference(q, k, v, enable_gqa=True))


def test_refusals_are_clear():
    q = torch.randn(1, 6, 4, 8)
    with pytest.raises(ValueError, match="float attn_mask are not supported"):
        flash_attention(q, q, q, attn_mask=torch.zeros(4, 4, requires_grad=True))
    with pytest.raises(ValueError, match="block_q must be a positive int, got 0"):
        flash_attention(q, q, q, block_q=0)
    with pytest.raises(ValueError, match="flash_attention: key's last dim"):
        flash_attention(q, torch.randn(1, 6, 5, 3), torch.randn(1, 6, 5, 3))


def test_dispatch_explicit_choice_never_falls_back():
    q = torch.randn(1, 2, 600, 8)
    assert choose_impl(q, q, q) == "tiled"  # large: auto picks the tiled path
    assert choose_impl(q[..., :10, :], q[..., :10, :], q[..., :10, :]) == "reference"
    assert choose_impl(q, q, q, dropout_p=0.1) == "reference"  # auto: the tiled path has no dropout
    one = torch.randn(1, 4, 1, 8)  # a decode step: one query against a KV cache
    cache = torch.randn(1, 4, 300, 8)
    assert choose_impl(one, cache, cache) == "decode"  # no gradient asked for: the decode path
    assert choose_impl(one.requires_grad_(), cache, cache) == "tiled"  # a decode shape in training: tiled
    assert choose_impl(one, cache[:, :, :200], cache[:, :, :200]) == "reference"  # a short cache
    assert choose_impl(torch.randn(1, 4, 64, 8), cache, cache) == "decode"  # chunked prefill: up to 64 rows
    assert choose_impl(torch.randn(1, 4, 65, 8), cache, cache) == "reference"  # 65 x 300 scores: small
    with pytest.raises(ValueError, match="impl='tiled' was requested but it cannot run dropout_p=0.1"):
        attention(q, q, q, dropout_p=0.1, impl="tiled")
    with use_impl("tiled"):
        with pytest.raises(ValueError, match="impl='tiled' was requested"):
            attention(q, q, q, dropout_p=0.1)
        assert choose_impl(q[..., :10, :], q[..., :10, :], q[..., :10, :]) == "tiled"
    with use_impl("reference"):
        assert choose_impl(q, q, q) == "reference"
    with pytest.raises(ValueError, match="impl must be one of"):
        attention(q, q, q, impl="fast")
    assert_close(attention(q, q, q, is_causal=True), reference(q, q, q, is_causal=True))


MEMORY_SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    impl, L = sys.argv[1], int(sys.argv[2])
    from attnlab.bench import peak_rss_growth
    from attnlab.functional import scaled_dot_product_attention as reference
    from attnlab.tiled import flash_attention
    q, k, v = (torch.randn(1, 1, L, 64, requires_grad=True) for _ in range(3))
    fn = flash_attention if impl == "tiled" else reference
    fn(q[..., :8, :], k[..., :8, :], v[..., :8, :]).sum().backward()  # warm up allocators
    print(peak_rss_growth(lambda: fn(q, k, v, is_causal=True).sum().backward()))
""")


@pytest.mark.subprocess
@pytest.mark.slow
def test_tiled_never_allocates_an_L_by_S_tensor():
    """Peak memory of a subprocess at L = S = 8192 (an (L, S) float32 tensor is 256 MiB)."""
    L = 8192
    scores_bytes = L * L * 4

    def peak_growth(impl):
        out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, impl, str(L)], capture_output=True, text=True,
                             timeout=300, check=True)
        return int(out.stdout.strip())

    tiled_growth = peak_growth("tiled")
    assert tiled_growth < scores_bytes / 4, f"tiled forward+backward grew the peak by {tiled_growth / 2**20:.0f} MiB"
    # the check can fail: the reference, which builds (L, S) tensors, does not pass it
    assert peak_growth("reference") > scores_bytes


def _bottom_right(**fixed):
    """SDPA's signature; the oracle gets masks.causal(align='bottom_right'), attnlab the offset."""
    def run(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return tiled.flash_attention(q, k, v, None, True, scale, enable_gqa=enable_gqa, causal_align="bottom_right",
                                     **fixed)
    return run


@pytest.mark.parametrize("L,S", [(3, 8), (8, 3), (37, 300), (300, 37), (1, 9), (9, 1)])
@pytest.mark.parametrize("blocks", [(2, 3), (16, 7), (256, 256)])
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "pure"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_bottom_right_causal_is_an_offset_not_a_mask(L, S, blocks, use_native, dtype, gen, monkeypatch):
    """Rows with no key (L > S: the first L - S queries) are 0, as torch gives with the mask."""
    if not use_native:
        monkeypatch.setattr(dense, "native_ops", lambda *a: None)
    q = torch.randn(2, 4, L, 16, generator=gen, dtype=dtype)
    k, v = torch.randn(2, 2, S, 16, generator=gen, dtype=dtype), torch.randn(2, 2, S, 8, generator=gen, dtype=dtype)
    mask = masks.causal(L, S, align="bottom_right")
    assert_close_to_sdpa(_bottom_right(block_q=blocks[0], block_k=blocks[1]), q, k, v, mask, enable_gqa=True)


def test_the_front_door_passes_bottom_right_as_an_offset(gen, monkeypatch):
    from attnlab import dispatch

    q, k, v = torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 70, 8, generator=gen), \
        torch.randn(1, 2, 70, 8, generator=gen)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, masks.causal(40, 70, align="bottom_right"))

    def no_dense_mask(*a, **kw):
        raise AssertionError("the tiled path got a dense (L, S) causal mask")

    monkeypatch.setattr(masks, "causal", no_dense_mask)
    got = dispatch.attention(q, k, v, is_causal=True, causal_align="bottom_right", impl="tiled")
    assert_close(got, expected, dtype=torch.float32)
