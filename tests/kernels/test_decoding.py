"""The decode path (attnlab.decoding, csrc/decode.cpp): exact against torch's SDPA for every
input it takes, special values included, on its routes: the native kernel (auto, then each of
its inner loops forced: streaming, streaming with the bf16 route on, and GEMM), the pure PyTorch
code, and the native kernel cut into tiny chunks and blocks (so every chunk boundary and the
log-sum-exp merge of many parts are exercised). Then the caches: a paged cache read
through its block table, KVCache and PagedKVCache decoding through MultiHeadAttention, and the
front door's choice.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab import KVCache, MultiHeadAttention, dispatch, masks
from attnlab.kernels import native as _native
from attnlab.kernels import routes
from attnlab.decoding import PagedKVCache, decode_attention, paged_decode_attention
from attnlab.kernels import decode as kernel
from attnlab.testing import assert_close, assert_close_to_sdpa
from helpers.semantics import INF, NAN, SPECIAL, close_with_nans, randn, torch_math

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture(params=["native", "stream", "stream_bf16", "gemm", "pure", "tiny_chunks"])
def route(force_routes, request, monkeypatch):
    if request.param in ("native", "stream", "stream_bf16", "gemm"):  # auto, then each loop forced (ATTNLAB_DECODE)
        assert _native.ops() is not None, _native.status()  # make demo / make test build it
        if request.param != "native":
            force_routes(decode=request.param.split("_")[0])
        if request.param == "stream_bf16":  # bf16 caches' scores on vdpbf16ps where the build has it (kernel.bf16_dot)
            force_routes(bf16="bf16")
    elif request.param == "pure":
        monkeypatch.setattr(kernel._native, "ops", lambda: None)
    else:  # chunks of 4 keys in blocks of 3: many parts, partial blocks, a merge per row
        monkeypatch.setattr(kernel, "MIN_CHUNK", 4)
        monkeypatch.setattr(kernel, "TASKS_PER_THREAD", 1000)
        monkeypatch.setattr(kernel, "BLOCK_K", 3)
    return request.param


def bottom_right(L: int, S: int):
    return masks.causal(L, S, align="bottom_right")


def decode_as_sdpa(align: str):
    """decode_attention in SDPA's signature; bottom-right causality arrives as the oracle's mask."""
    def impl(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        causal = is_causal or attn_mask is not None
        return decode_attention(query, key, value, causal, scale, enable_gqa=enable_gqa, causal_align=align)
    return impl


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L,S", [(1, 1), (1, 7), (1, 300), (4, 1000), (16, 513), (3, 2)])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_decode_matches_sdpa(route, dtype, L, S, causal):
    q = randn(2, 8, L, 32).to(dtype)
    k, v = randn(2, 2, S, 32, seed=1).to(dtype), randn(2, 2, S, 24, seed=2).to(dtype)
    mask = bottom_right(L, S) if causal == "bottom_right" else None
    assert_close_to_sdpa(decode_as_sdpa("bottom_right" if mask is not None else "top_left"), q, k, v,
                         attn_mask=mask, is_causal=causal == "top_left", enable_gqa=True, check_grads=False)


@pytest.mark.parametrize("shapes", [((5, 9, 16), (5, 300, 16)), ((3, 1, 2, 8), (1, 4, 300, 8))],
                         ids=["3d", "broadcast_batch"])
def test_decode_takes_sdpa_layouts(route, shapes):
    qs, ks = shapes
    q, k, v = randn(*qs), randn(*ks, seed=1), randn(*ks, seed=2)
    assert_close_to_sdpa(decode_as_sdpa("top_left"), q, k, v, scale=0.3, check_grads=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", list(SPECIAL))
def test_nan_and_inf_propagate_as_in_torch(route, dtype, case):
    q, k, v = SPECIAL[case](randn(2, 3, 5, 8), randn(2, 3, 300, 8, seed=1), randn(2, 3, 300, 6, seed=2))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    close_with_nans(decode_attention(q, k, v), torch_math(q, k, v), dtype, "output")


@pytest.mark.parametrize("case", ["nan_key", "inf_key", "nan_query", "nan_value", "inf_value"])
def test_nan_and_inf_in_a_bf16_step_on_the_lane_kernel_propagate_as_in_torch(route, case):
    """A bf16 step with 16 rows a key/value head (4 query heads x 4 tokens) and a bf16 query takes the
    lane kernel where the build has it, its scores kept in lanes through the softmax (lane_softmax):
    a NaN or inf there must still reach the output as torch's does (the kernel flags the call)."""
    q = randn(1, 8, 4, 32).to(torch.bfloat16)
    k, v = randn(1, 2, 300, 32, seed=1).to(torch.bfloat16), randn(1, 2, 300, 32, seed=2).to(torch.bfloat16)
    where = {"nan_key": (k, (0, 1, 100, 3), NAN), "inf_key": (k, (0, 0, 70, 5), INF),
             "nan_query": (q, (0, 5, 2, 7), NAN), "nan_value": (v, (0, 1, 150, 2), NAN),
             "inf_value": (v, (0, 0, 20, 9), INF)}
    t, at, x = where[case]
    t[at] = x
    want = torch_math(q, k, v, attn_mask=bottom_right(4, 300), enable_gqa=True)
    assert bool(want.isnan().any()) or bool(want.isinf().any())
    out = decode_attention(q, k, v, is_causal=True, causal_align="bottom_right", enable_gqa=True)
    close_with_nans(out, want, torch.bfloat16, "output")


def test_an_inf_value_the_causal_rows_never_read_still_gives_torchs_nan(route):
    """Top-left causality with L << S leaves most keys unread; torch multiplies their zero weights,
    so an inf value there makes every row NaN, and the decode path must say so too."""
    q, k, v = randn(1, 2, 2, 8), randn(1, 2, 400, 8, seed=1), randn(1, 2, 400, 8, seed=2)
    v[0, 1, 350, 3] = float("inf")
    want = torch_math(q, k, v, is_causal=True)
    assert bool(want[0, 1].isnan().any())
    close_with_nans(decode_attention(q, k, v, is_causal=True), want, torch.float32, "output")


@pytest.mark.parametrize("empty", ["B", "L", "S", "E", "Ev"])
def test_zero_size_dimensions(route, empty):
    dims = dict(B=2, L=3, S=300, E=8, Ev=6)
    dims[empty] = 0
    q = randn(dims["B"], 4, dims["L"], dims["E"])
    k, v = randn(dims["B"], 4, dims["S"], dims["E"], seed=1), randn(dims["B"], 4, dims["S"], dims["Ev"], seed=2)
    close_with_nans(decode_attention(q, k, v), torch_math(q, k, v), torch.float32, "output")


def test_cache_seqlens_reads_only_each_sequences_keys(route):
    """FlashAttention's cache_seqlens: batch b has its first seqlens[b] keys; rows after them
    are garbage (here NaN) and never read."""
    q, k, v = randn(3, 4, 2, 16), randn(3, 2, 600, 16, seed=1), randn(3, 2, 600, 16, seed=2)
    lengths = torch.tensor([600, 5, 0])
    for b, n in enumerate(lengths.tolist()):
        k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
    out = decode_attention(q, k, v, True, enable_gqa=True, causal_align="bottom_right", cache_seqlens=lengths)
    for b, n in enumerate(lengths.tolist()):
        want = torch_math(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], attn_mask=bottom_right(2, n),
                          enable_gqa=True) if n else torch.zeros(1, 4, 2, 16)
        close_with_nans(out[b:b + 1], want, torch.float32, f"batch {b}")


def test_a_merge_that_drops_a_part_is_caught(monkeypatch):
    """The parity check is not vacuous: a merge that keeps only the newest part fails it."""
    monkeypatch.setattr(kernel._native, "ops", lambda: None)
    monkeypatch.setattr(kernel, "MIN_CHUNK", 4)
    monkeypatch.setattr(kernel, "TASKS_PER_THREAD", 1000)
    monkeypatch.setattr(kernel, "merge_", lambda out, lse2, o, l: (out.copy_(o), lse2.copy_(l)))
    q, k, v = randn(1, 4, 1, 8), randn(1, 2, 64, 8, seed=1), randn(1, 2, 64, 8, seed=2)
    with pytest.raises(AssertionError, match="differs from torch SDPA"):
        assert_close_to_sdpa(decode_as_sdpa("top_left"), q, k, v, enable_gqa=True, check_grads=False)


def test_decoding_refuses_gradients():
    q = randn(1, 2, 1, 8).requires_grad_()
    k, v = randn(1, 2, 300, 8, seed=1), randn(1, 2, 300, 8, seed=2)
    with pytest.raises(ValueError, match="decoding has no backward.*torch.no_grad"):
        decode_attention(q, k, v)
    with torch.no_grad():
        assert decode_attention(q, k, v).shape == (1, 2, 1, 8)
    with pytest.raises(ValueError, match="impl='decode'.*require grad"):
        dispatch.attention(q, k, v, impl="decode")


@pytest.mark.parametrize("bad, match", [
    (dict(causal_align="left"), "causal_align must be 'top_left' or 'bottom_right'"),
    (dict(cache_seqlens=torch.tensor([1.0])), r"cache_seqlens must be a \(B=1,\) integer tensor"),
    (dict(cache_seqlens=torch.tensor([301])), r"cache_seqlens must be in \[0, S=300\]"),
])
def test_bad_arguments_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        decode_attention(randn(1, 2, 1, 8), randn(1, 2, 300, 8), randn(1, 2, 300, 8), **bad)


def test_auto_takes_the_decode_path_for_a_decode_step_it_can_run():
    q, k, v = randn(1, 8, 1, 16), randn(1, 2, 512, 16), randn(1, 2, 512, 16)
    with torch.no_grad():
        assert dispatch.choose_impl(q, k, v, enable_gqa=True) == "decode"
        assert dispatch.choose_impl(q, k, v, attn_mask=torch.ones(1, 512, dtype=torch.bool)) == "tiled"
        assert dispatch.choose_impl(q, k[:, :, :100], v[:, :, :100], enable_gqa=True) == "reference"
    assert dispatch.choose_impl(q.requires_grad_(), k, v, enable_gqa=True) == "tiled"  # training: a backward


@pytest.mark.parametrize("impl", ["reference", "tiled", "decode"])
def test_bottom_right_causality_through_the_front_door(impl):
    q, k, v = randn(1, 4, 3, 8), randn(1, 4, 300, 8, seed=1), randn(1, 4, 300, 8, seed=2)
    with torch.no_grad():
        out = dispatch.attention(q, k, v, is_causal=True, causal_align="bottom_right", impl=impl)
    assert_close(out, torch_math(q, k, v, attn_mask=bottom_right(3, 300)), dtype=torch.float32)


# --------------------------------------------------------------------------- the paged cache
def filled_cache(dtype=torch.float32, page_size=16, steps=(5, 40, 1, 1, 30), **kw):
    cache = PagedKVCache(2, 2, 8, page_size=page_size, dtype=dtype, **kw)
    ks, vs = [], []
    for i, T in enumerate(steps):
        k, v = randn(2, 2, T, 8, seed=10 + i).to(dtype), randn(2, 2, T, 8, seed=50 + i).to(dtype)
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
    return cache, torch.cat(ks, 2), torch.cat(vs, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("L", [3, 8], ids=["page_blocks", "spanning_blocks"])  # 6 / 16 rows a head
def test_a_paged_cache_is_read_through_its_block_table(route, dtype, L):
    cache, k, v = filled_cache(dtype)
    assert cache.length == 77 and cache.block_table.shape == (2, 5)
    assert cache.block_table[0].tolist() == [0, 2, 4, 6, 8]  # sequences' pages interleave in the pool
    dense_k, dense_v = cache.dense()
    assert torch.equal(dense_k, k) and torch.equal(dense_v, v)
    q = randn(2, 4, L, 8).to(dtype)
    out = paged_decode_attention(q, cache, is_causal=True, causal_align="bottom_right")
    close_with_nans(out, torch_math(q, k, v, attn_mask=bottom_right(L, 77), enable_gqa=True), dtype, "output")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("Hkv,page_size", [(3, 5), (2, 16), (5, 1)], ids=["3_heads_pages_of_5", "2_heads_pages_of_16",
                                                                          "5_heads_pages_of_1"])
@pytest.mark.parametrize("L", [1, 8], ids=["page_blocks", "spanning_blocks"])  # 2 / 16 rows a head
def test_pages_and_heads_of_any_count_are_located(route, dtype, Hkv, page_size, L):
    """The native kernel finds a paged row with a shift and a mask when the page size and Hkv are
    powers of two, else by division: both against the cache's own dense contents."""
    cache = PagedKVCache(2, Hkv, 8, page_size=page_size, dtype=dtype,
                         **({"smooth_keys": False} if dtype == torch.int8 else {}))
    for i, T in enumerate((7, 23, 1)):  # sequences' pages interleave; the last page partly filled
        cache.append(randn(2, Hkv, T, 8, seed=10 + i), randn(2, Hkv, T, 8, seed=50 + i))
    k, v = cache.dense()
    q = randn(2, 2 * Hkv, L, 8)
    out = paged_decode_attention(q if dtype == torch.int8 else q.to(dtype), cache, is_causal=True,
                                 causal_align="bottom_right")
    exact = torch_math(q.double(), k.double(), v.double(), attn_mask=bottom_right(L, 31), enable_gqa=True)
    assert_close(out, exact.to(out.dtype), dtype=out.dtype)


@pytest.mark.parametrize("page_size", [5, 8, 16])
def test_a_paged_bf16_step_on_the_lane_kernel_keeps_its_scores_in_lanes_on_any_page(force_routes, page_size):
    """16 rows a key/value head (4 query heads x 4 tokens), a bf16 cache and query: where the build
    has the lane kernel, a block every row sees whole keeps its scores in lanes through the softmax
    and the value pass reads P~'s pairs of keys from there (lane_softmax, PLanes); pages of an odd
    size cut tiles at odd keys, where the pairs would straddle them, and take the rows' layout.
    Against float64 attention over the cache's own contents, the last block's causal cut included."""
    force_routes(decode="stream")
    cache = PagedKVCache(1, 2, 32, page_size=page_size, dtype=torch.bfloat16)
    for i, T in enumerate((180, 23)):
        cache.append(_activations(1, 2, T, 32, seed=20 + i), _activations(1, 2, T, 32, seed=60 + i))
    k, v = cache.dense()
    q = randn(1, 8, 4, 32).to(torch.bfloat16)
    out = paged_decode_attention(q, cache, is_causal=True, causal_align="bottom_right")
    exact = torch_math(q.double(), k.double(), v.double(), attn_mask=bottom_right(4, 203), enable_gqa=True)
    assert_close(out, exact.to(out.dtype), dtype=out.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("page_size", [3, 8, 13, 16])
@pytest.mark.parametrize("L", [1, 4])  # 2 / 8 rows a head
def test_rows_interleaved_by_head_are_read_in_stored_order_tile_by_tile(force_routes, dtype, page_size, L, monkeypatch):
    """The native streaming loop reads a block of a paged cache in stored order: tiles of at most
    8 keys inside one page, every head's tile of those keys in turn, each into that head's own
    scores, scales and acc (decode.cpp's stored_block). Four heads and 203 keys: tiles cut short
    by page ends at every offset, 64-key blocks across pages, a last short tile; int8 rows have a
    scale per token and head. Against float64 attention over the cache's own dense contents."""
    force_routes(decode="stream")
    assert _native.ops() is not None, _native.status()
    int8 = dtype == torch.int8
    cache = PagedKVCache(2, 4, 16, page_size=page_size, dtype=dtype, **({"smooth_keys": False} if int8 else {}))
    for i, T in enumerate((150, 53)):
        cache.append(_activations(2, 4, T, 16, seed=10 + i), _activations(2, 4, T, 16, seed=50 + i))
    k, v = cache.dense()
    q = randn(2, 8, L, 16)
    out = paged_decode_attention(q if int8 else q.to(dtype), cache, is_causal=L > 1, causal_align="bottom_right")
    q_seen = _query_seen(q, 4) if int8 else q.to(dtype).double()
    exact = torch_math(q_seen, k.double(), v.double(), attn_mask=bottom_right(L, 203) if L > 1 else None,
                       enable_gqa=True)
    assert_close(out, exact.to(out.dtype), dtype=out.dtype)


def test_the_pool_grows_without_moving_pages_and_a_fixed_pool_refuses_to_overflow():
    cache, k, v = filled_cache(page_size=4, steps=(3, 30, 10))
    assert cache.k_pages.shape[0] >= cache.pages_used == 2 * 11
    q = randn(2, 2, 1, 8)
    assert_close(paged_decode_attention(q, cache), torch_math(q, k, v, enable_gqa=True), dtype=torch.float32)
    small = PagedKVCache(1, 1, 8, page_size=4, num_pages=2)
    small.append(randn(1, 1, 8, 8), randn(1, 1, 8, 8))
    with pytest.raises(ValueError, match="the pool is full.*num_pages=2"):
        small.append(randn(1, 1, 1, 8), randn(1, 1, 1, 8))


def test_paged_arguments_are_checked():
    cache, _, _ = filled_cache()
    with pytest.raises(ValueError, match=r"query must be \(B=2, H \(a multiple of 2\), L, E=8\)"):
        paged_decode_attention(randn(2, 3, 1, 8), cache)
    with pytest.raises(TypeError, match="cache must be an attnlab.decoding.PagedKVCache"):
        paged_decode_attention(randn(2, 2, 1, 8), object())
    with pytest.raises(ValueError, match=r"PagedKVCache.append: k must be \(B=2, Hkv=2, T, head_dim=8\)"):
        cache.append(randn(2, 3, 1, 8), randn(2, 3, 1, 8))


# --------------------------------------------------------------------------- through the module
@pytest.mark.parametrize("make_cache", [lambda dt: KVCache(2, 2, 4, dtype=dt),
                                        lambda dt: KVCache(2, 2, 4, max_len=400, dtype=dt),
                                        lambda dt: PagedKVCache(2, 2, 4, page_size=16, dtype=dt)],
                         ids=["kv_cache_growing", "kv_cache_preallocated", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_module_decoding_equals_one_causal_pass_and_runs_the_decode_kernel(monkeypatch, make_cache, dtype):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 8, num_kv_heads=2).to(dtype).eval()
    x = torch.randn(2, 300, 32).to(dtype)
    seen = []
    real = kernel.forward

    def spy(q4, k, *a, **kw):
        seen.append(k.dtype)
        return real(q4, k, *a, **kw)

    monkeypatch.setattr(kernel, "forward", spy)
    cache = make_cache(dtype)
    with torch.no_grad():
        full, _ = m(x, is_causal=True)
        steps = [m(x[:, :280], is_causal=True, kv_cache=cache)[0]]
        steps += [m(x[:, t:t + 4], is_causal=True, kv_cache=cache)[0] for t in range(280, 300, 4)]
    assert_close(torch.cat(steps, 1), full, dtype=dtype)
    assert seen == [dtype] * 5  # the five decode steps, each on the cache as stored (no float32 copy)


# --------------------------------------------------------------------------- the streaming loop, the int8 cache
def test_the_loop_switch_chooses_and_names_its_values(force_routes, monkeypatch):
    assert kernel.loop(1) == kernel.loop(kernel.STREAM_MAX_ROWS) == "stream"
    assert kernel.loop(kernel.STREAM_MAX_ROWS + 1) == "gemm"
    force_routes(decode="gemm")
    assert kernel.loop(1) == "gemm"
    monkeypatch.setenv("ATTNLAB_DECODE", "fast")  # read once: a bad value is refused where it is read
    with pytest.raises(ValueError, match="ATTNLAB_DECODE must be one of auto, stream, gemm, got 'fast'"):
        routes.reload()
    assert kernel.loop(1) == "gemm"  # the refused value changed nothing


@pytest.mark.parametrize("loop", ["stream", "gemm"])
@pytest.mark.parametrize("L", [1, 4, 16, 64])
def test_both_loops_up_to_64_rows_bottom_right(force_routes, loop, L, monkeypatch):
    """Chunked prefill and speculative decoding: up to 64 new rows after a cache, each loop forced."""
    force_routes(decode=loop)
    q, k, v = randn(2, 8, L, 64), randn(2, 2, 700, 64, seed=1), randn(2, 2, 700, 48, seed=2)
    out = decode_attention(q, k, v, True, enable_gqa=True, causal_align="bottom_right")
    assert_close(out, torch_math(q, k, v, attn_mask=bottom_right(L, 700), enable_gqa=True), dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7, 8, 10, 14, 16])
@pytest.mark.parametrize("E,Ev", [(64, 40), (32, 64), (20, 13)], ids=["tiled", "wide", "tails"])
def test_the_streaming_loop_takes_every_row_and_column_count(force_routes, rows, E, Ev, dtype, monkeypatch):
    """The streaming loop's register tiles (six- and four-row value tiles of 16 or 8 columns, pairs of
    rows by 32 columns, two rows by four keys for the scores) and what they leave (single rows, odd columns, a block's last
    keys): ``rows`` query heads on one key/value head, 70 keys (a 64-key block and 6 more)."""
    force_routes(decode="stream")
    q = randn(1, rows, 1, E).to(dtype)
    k, v = randn(1, 1, 70, E, seed=1).to(dtype), randn(1, 1, 70, Ev, seed=2).to(dtype)
    assert_close_to_sdpa(decode_as_sdpa("top_left"), q, k, v, enable_gqa=True, check_grads=False)


def test_unequal_cache_lengths_split_into_equal_tasks(monkeypatch):
    """The kernel splits every head's own keys: one long cache among short ones is cut into
    several tasks (checked through the result, exact, at chunk edges of every kind)."""
    q, k, v = randn(4, 4, 1, 32), randn(4, 2, 3000, 32, seed=1), randn(4, 2, 3000, 32, seed=2)
    lengths = torch.tensor([3000, 1, 257, 0])
    out = decode_attention(q, k, v, enable_gqa=True, cache_seqlens=lengths)
    for b, n in enumerate(lengths.tolist()):
        want = torch_math(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], enable_gqa=True) if n else \
            torch.zeros(1, 4, 1, 32)
        assert_close(out[b:b + 1], want, dtype=torch.float32, msg=f"batch {b}")


@pytest.mark.parametrize("dot", ["int16", "float32"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 10, 16])
@pytest.mark.parametrize("E,Ev", [(64, 40), (32, 64), (20, 13)], ids=["tiled", "wide", "tails"])
def test_the_streaming_loop_takes_every_row_and_column_count_of_an_int8_cache(force_routes, rows, E, Ev, dot, monkeypatch):
    """The same counts on an int8 cache, each dot-product route forced: the int16 route's four-row
    integer tiles and the single rows they leave (rows % 4), the value tiles an int8 cache takes, and
    E = 20 (not a multiple of 16: the int16 route gives way to float32 there). Exact against float64
    over the dequantised cache and the query the route's scores see (_query_seen)."""
    from attnlab.decoding import dequantize, quantize

    force_routes(decode="stream")
    force_routes(int8_dot=dot)
    q = randn(1, rows, 1, E)
    (k8, ks), (v8, vs) = quantize(randn(1, 1, 70, E, seed=1)), quantize(randn(1, 1, 70, Ev, seed=2))
    out = decode_attention(q, k8, v8, enable_gqa=True, k_scale=ks, v_scale=vs)
    native_int16 = _native.ops() is not None and dot == "int16" and E % 16 == 0
    assert kernel.int8_dot(E, "stream") == ("int16" if native_int16 else "float32")
    want = torch_math(_query_seen(q, 1), dequantize(k8, ks).double(), dequantize(v8, vs).double(), enable_gqa=True)
    assert_close(out, want.float(), dtype=torch.float32)


@pytest.mark.parametrize("E", [512, 528])
def test_the_int16_route_s_sums_stay_exact_at_its_largest_head_size(force_routes, E, monkeypatch):
    """The int16 route's int32 sums hold 32767 * 128 * E at most: exact up to E = 512, its limit;
    past it (E = 528) the route gives way to float32. Keys at -128 (an int8 row's extreme) against a
    query whose every element rounds to 32767 reach that bound at E = 512; a wrapped sum would turn
    key 0's score from the most negative to the largest."""
    from attnlab.decoding import dequantize

    force_routes(decode="stream")
    force_routes(int8_dot="int16")
    assert kernel.int8_dot(E, "stream") == ("int16" if _native.ops() is not None and E <= 512 else "float32")
    q = torch.ones(1, 4, 1, E)
    k8 = torch.zeros(1, 1, 40, E, dtype=torch.int8)
    k8[:, :, 0] = -128
    k8[:, :, 1:20] = torch.randint(-128, 128, (19, E), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    v8 = torch.randint(-127, 128, (1, 1, 40, 16), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    ks, vs = torch.full((1, 1, 40), 1e-3), torch.full((1, 1, 40), 0.01)
    out = decode_attention(q, k8, v8, enable_gqa=True, k_scale=ks, v_scale=vs)
    want = torch_math(_query_seen(q, 1), dequantize(k8, ks).double(), dequantize(v8, vs).double(), enable_gqa=True)
    assert_close(out, want.float(), dtype=torch.float32)


def _activations(*shape, seed: int) -> torch.Tensor:
    """Real-looking activations: normal rows with a few outlier channels (x8), as LLM keys have."""
    x = randn(*shape, seed=seed)
    x[..., :: max(1, shape[-1] // 4)] *= 8
    return x


def _query_seen(q: torch.Tensor, Hkv: int, lam=None) -> torch.Tensor:
    """The query ``(B, H, L, E)`` an int8 cache's scores see: on the int16 route
    (``kernel.int8_dot``: the native streaming loop) each row of ``q * lambda`` (smoothed keys'
    factors, ``(B, Hkv, E)``) rounded to int16 as the kernel rounds it (``kernel.int16_rounded``),
    divided by lambda again; on the float32 route ``q`` itself. In float64."""
    rows = q.shape[1] // Hkv * q.shape[2]
    if _native.ops() is None or kernel.int8_dot(q.shape[-1], kernel.loop(rows)) != "int16":
        return q.double()
    if lam is None:
        return kernel.int16_rounded(q)
    lam_h = lam.repeat_interleave(q.shape[1] // Hkv, dim=1)[:, :, None, :]  # (B, Hkv, E) -> (B, H, 1, E)
    return kernel.int16_rounded(q * lam_h) / lam_h.double()


@pytest.mark.parametrize("loop,dot", [("stream", "int16"), ("stream", "float32"), ("gemm", "float32")])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("L,causal", [(1, False), (4, True)])
def test_an_int8_cache_is_exact_against_its_own_dequantised_reference(force_routes, paged, L, causal, loop, dot, monkeypatch):
    """The kernel reads int8 rows and their scales (the streaming loop in its dot products, on
    integers or widened to float32; the GEMM loop dequantising each block, across pages); the
    reference is float64 attention over the dequantised cache (and, on the int16 route, the query
    rounded as that route rounds it: kernel.int16_rounded), so the only error allowed is float32's.
    Per-token scales differ (outlier rows), so a scale applied to the wrong row, or the keys' to
    the values, shows; so does a query left unrounded on the int16 route (checked below)."""
    from attnlab.decoding import dequantize, quantize

    force_routes(decode=loop)
    force_routes(int8_dot=dot)
    native = _native.ops() is not None
    assert kernel.int8_dot(64, loop) == (dot if native else "float32")

    q, k, v = randn(2, 8, L, 64), _activations(2, 2, 520, 64, seed=1), _activations(2, 2, 520, 64, seed=2)
    k[:, :, 100:110] *= 3  # tokens larger than the rest: their scales are their own
    q_used = _query_seen(q, 2).float()  # the query the kernel's scores see
    if native and dot == "int16":
        q_err = (q_used.double() - q.double()).abs().max().item()
        assert 0 < q_err <= q.abs().max().item() / 65534 * 1.001  # rounded, by half a step at most
    if paged:
        cache = PagedKVCache(2, 2, 64, dtype=torch.int8)
        cache.append(k[:, :, :300], v[:, :, :300])
        cache.append(k[:, :, 300:], v[:, :, 300:])
        out = paged_decode_attention(q, cache, is_causal=causal, causal_align="bottom_right")
        k_deq, v_deq = cache.dense()
        q_used = _query_seen(q, 2, cache.k_channel_scale).float()  # the cache smooths its keys: q * lambda rounded
    else:
        (k8, ks), (v8, vs) = quantize(k), quantize(v)
        out = decode_attention(q, k8, v8, causal, enable_gqa=True, causal_align="bottom_right", k_scale=ks,
                               v_scale=vs)
        k_deq, v_deq = dequantize(k8, ks), dequantize(v8, vs)
        # the check is sensitive to a misapplied scale: the keys' scales on the values fail it
        swapped = decode_attention(q, k8, v8, causal, enable_gqa=True, causal_align="bottom_right", k_scale=vs,
                                   v_scale=ks)
        with pytest.raises(AssertionError):
            assert_close(swapped, torch_math(q_used.double(), k_deq.double(), v_deq.double(), enable_gqa=True,
                                             attn_mask=bottom_right(L, 520) if causal else None).float(),
                         dtype=torch.float32)
    mask = bottom_right(L, 520) if causal else None

    def on_the_cache(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        return out  # the kernel's answer; torch's runs take the cache's dequantised contents

    # the shared rule: the scores reach a few hundred on these activations, so float32's own error
    # (torch's, measured on the same inputs) sets the bound, not an O(1) tolerance
    assert_close_to_sdpa(on_the_cache, q_used, k_deq, v_deq, attn_mask=mask, enable_gqa=True, check_grads=False)
    if native and dot == "int16":  # the rounding is what the int16 route computes: without it the check fails
        with pytest.raises(AssertionError):
            assert_close(out, torch_math(q.double(), k_deq.double(), v_deq.double(), attn_mask=mask,
                                         enable_gqa=True).float(), dtype=torch.float32)
    # and against the unquantised cache: int8's own error, a few percent of the output's size at most
    # (measured on these activations: BENCHMARKS.md, "int8 KV cache")
    exact = torch_math(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    assert (out.double() - exact).abs().max().item() < 0.05 * exact.abs().max().item()


def _bf16_step(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, Hkv: int, *, L: int = 1, paged: bool = False,
               out_dtype: torch.dtype = torch.float32):
    """``(out, want)``: the decode kernel's float32 output (``kernel.forward``: not rounded to bf16,
    so that float32's tolerance applies) for ``q4 (Nb, r, L, E)`` against bf16 ``k, v (Nb, S, E)``,
    the cache dense or copied into 16-token pages, and float64 attention over the same values."""
    Nb, r, _, E = q4.shape
    S = k.shape[1]
    scale = E ** -0.5
    causal = "bottom_right" if L > 1 else "none"
    if paged:
        cache = PagedKVCache(Nb // Hkv, Hkv, E, dtype=torch.bfloat16)
        cache.append(k.view(Nb // Hkv, Hkv, S, E), v.view(Nb // Hkv, Hkv, S, E))
        out, _, _ = kernel.forward(q4, cache.k_pages, cache.v_pages, Hkv=Hkv, S=S,
                                   scale2=scale * 1.4426950408889634, causal=causal, table=cache.block_table,
                                   out_dtype=out_dtype)
    else:
        out, _, _ = kernel.forward(q4, k, v, Hkv=Hkv, S=S, scale2=scale * 1.4426950408889634, causal=causal,
                                   out_dtype=out_dtype)
    # each head nb as a batch of r query heads on one key/value head: (Nb, r, L, E) against (Nb, 1, S, E)
    want = torch_math(q4.double(), k[:, None].double(), v[:, None].double(), bottom_right(L, S) if L > 1 else None,
                      enable_gqa=True)
    return out, want


def _units() -> bool:
    return _native.ops() is not None and bool(_native.ops().bf16_units())


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("rows,L", [(1, 1), (3, 1), (4, 1), (5, 1), (8, 1), (2, 4)])
@pytest.mark.parametrize("E", [16, 48, 128, 40])
def test_a_bf16_cache_s_scores_on_vdpbf16ps_are_exact_against_float64(force_routes, rows, L, E, paged, monkeypatch):
    """The bf16 route forced (``ATTNLAB_BF16=bf16``): where the build has AVX512_BF16 (the
    avx512-emulated build runs this file on any CPU) a bf16 cache's scores take ``vdpbf16ps``
    (:func:`kernel.bf16_dot`); E = 40 (not a multiple of 16) and builds without the instruction
    take the float32 route. Either way exact against float64 to float32's rounding: the products of
    bf16 values are exact, as the float32 route's FMAs are. And the route really runs: its sums
    round in another order, so its answer differs in the last bits from the float32 route's."""
    force_routes(decode="stream")
    force_routes(bf16="bf16")
    taken = kernel.bf16_dot(E, "stream") == "vdpbf16ps"
    assert taken == (_units() and E % 16 == 0)
    Hkv, S = 2, 203
    q4 = randn(Hkv, rows, L, E).bfloat16().float()  # a bf16 query, widened: the route's input
    k, v = randn(Hkv, S, E, seed=1).bfloat16(), randn(Hkv, S, E, seed=2).bfloat16()
    out, want = _bf16_step(q4, k, v, Hkv, L=L, paged=paged)
    assert_close(out, want.float(), dtype=torch.float32)
    force_routes(bf16="fp32")
    widened, _ = _bf16_step(q4, k, v, Hkv, L=L, paged=paged)
    assert_close(widened, want.float(), dtype=torch.float32)
    assert torch.equal(out, widened) == (not taken)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("rows,L", [(1, 1), (4, 1), (6, 1), (7, 1), (2, 4), (13, 1)])
@pytest.mark.parametrize("Ev", [32, 128, 96, 48])
def test_a_bf16_output_s_value_pass_on_vdpbf16ps_rounds_only_p(force_routes, rows, L, Ev, paged):
    """With a bf16 output (``out_dtype``: a bf16 query) the value pass takes ``vdpbf16ps`` too
    (:func:`kernel.bf16_values`: where the scores do and Ev % 32 == 0; Ev = 48 and builds without the
    instruction keep float32 weights): P~ rounded to bf16, as torch's bf16 kernel rounds P. Its
    float32 output is then within bf16's tolerance of float64 (each weight off by at most 2^-9 of
    itself), on tiles of 1 to 6 rows (13 = 6 + 6 + 1), an odd number of keys (S = 203: a last key
    paired with zeros) and pages; and the route really runs: it differs from the float32 weights'
    answer, which a float32 output keeps."""
    force_routes(decode="stream")
    force_routes(bf16="bf16")
    E = Ev if paged else 64  # a PagedKVCache has one head size
    taken = kernel.plan(rows * L, E, torch.bfloat16, torch.bfloat16, Ev).bf16_values
    assert taken == (_units() and Ev % 32 == 0)
    assert not kernel.plan(rows * L, E, torch.bfloat16, torch.float32, Ev).bf16_values
    Hkv, S = 2, 203
    q4 = randn(Hkv, rows, L, E).bfloat16().float()
    k, v = randn(Hkv, S, E, seed=1).bfloat16(), (3 * randn(Hkv, S, Ev, seed=2)).bfloat16()
    out, want = _bf16_step(q4, k, v, Hkv, L=L, paged=paged, out_dtype=torch.bfloat16)
    assert_close(out, want.float(), dtype=torch.bfloat16)
    float_weights, _ = _bf16_step(q4, k, v, Hkv, L=L, paged=paged, out_dtype=torch.float32)
    assert_close(float_weights, want.float(), dtype=torch.float32)
    assert torch.equal(out, float_weights) == (not taken)


def test_the_status_names_the_decode_loop_s_dot_product_instructions(force_routes, monkeypatch):
    """``decode_dot_instructions``: vdpbf16ps where the build has the bf16 units (AVX512_BF16), vpdpwssd
    where it has AVX512_VNNI with VL (the avx512-emulated build has both, on any CPU); the status
    line says which a bf16 and an int8 cache's dot products take now."""
    bits = int(_native.ops().decode_dot_instructions())
    vnni = _native.build_isa() == "avx512-emulated" or {"avx512_vnni", "avx512vl"} <= _native.cpu_features()
    assert bool(bits & 1) == _units() and bool(bits & 2) == vnni
    # bit 2, the lane kernel's 512-bit vdpbf16ps with AVX-512's float vectors: wherever bit 0 is (a
    # CPU with AVX512_BF16 has AVX-512F; the emulated build has both)
    assert bool(bits & 4) == bool(bits & 1)
    # bit 3, the int8 lane kernel's 512-bit int16 pairs (AVX512BW; the emulated build has it)
    assert bool(bits & 8) == (_native.build_isa() == "avx512-emulated" or "avx512bw" in _native.cpu_features())
    for route in ("bf16", "fp32"):
        force_routes(bf16=route)
        said = _native.decode_dot_products()
        assert ("bf16 caches on vdpbf16ps" in said) == (bool(bits & 1) and route == "bf16"), said
        assert ("vdpbf16ps (512 bits)" in said) == (bool(bits & 4) and route == "bf16"), said
        assert ("int8 caches on vpdpwssd" in said) == bool(bits & 2), said
        assert said in str(_native.status())


def _huge_key_case(q_value: float, k_value: float):
    """One key (key 0) whose first element times the query's first element is the only non-zero
    product of the call: ``q_value * k_value`` moves key 0's score, and with it the output, by a few
    percent; every other score is 0."""
    Hkv, r, S, E = 1, 4, 40, 32
    q4 = torch.zeros(Hkv, r, 1, E)
    q4[..., 0] = q_value
    k = torch.zeros(Hkv, S, E, dtype=torch.bfloat16)
    k[0, 0, 0] = k_value
    v = randn(Hkv, S, E, seed=2).bfloat16()
    return q4, k, v, Hkv


@pytest.mark.parametrize("case", ["float32_query", "denormal_query", "huge_query"])
def test_the_vdpbf16ps_route_leaves_queries_it_would_change_to_the_float32_route(force_routes, case, monkeypatch):
    """vdpbf16ps reads a bf16 query and reads denormals as zero, so the kernel takes it only where that
    changes nothing (``bf16_query_rows`` in csrc/decode.cpp), and each query here needs the float32
    route to be exact: one that is not bf16 (a float32 query, its low bits lost in bf16), a bf16
    denormal query element against a key element of 2^127 (a product of 1/8, read as 0), and a
    query of 2^126 against a denormal key element (|q * scale| past 2^64: the same product, the key
    read as 0). On a build with the instruction each case fails with that check removed."""
    force_routes(decode="stream")
    force_routes(bf16="bf16")
    if case == "float32_query":
        q4, Hkv = randn(2, 4, 1, 64), 2
        k, v = randn(2, 100, 64, seed=1).bfloat16(), randn(2, 100, 64, seed=2).bfloat16()
        assert not torch.equal(q4.bfloat16().float(), q4)
    elif case == "denormal_query":
        q4, k, v, Hkv = _huge_key_case(2.0 ** -130, 2.0 ** 127)  # 2^-130: a bf16 denormal, exactly
    else:
        q4, k, v, Hkv = _huge_key_case(2.0 ** 126, 2.0 ** -129)
    assert torch.equal(q4.bfloat16().float(), q4) == (case != "float32_query")
    out, want = _bf16_step(q4, k, v, Hkv)
    if case != "float32_query":  # the product is large enough to show: key 0's weight is not 1/S
        flushed = torch.einsum("s,se->e", torch.full((k.shape[1],), 1 / k.shape[1], dtype=torch.float64),
                               v[0].double())
        assert (want[0, 0, 0] - flushed).abs().max() > 1e-3
    assert_close(out, want.float(), dtype=torch.float32)


def _smoothing_case(outlier: bool, S: int = 1024):
    q, k, v = randn(1, 8, 1, 64), randn(1, 2, S, 64, seed=1), randn(1, 2, S, 64, seed=2)
    if outlier:
        k[..., [5, 40]] *= 20  # two key channels 20x the rest, as LLM keys have
    return q, k, v


@pytest.mark.parametrize("outlier", [True, False], ids=["outlier_channels", "gaussian"])
def test_smoothed_int8_keys_are_exact_against_their_own_reference_and_cut_the_outlier_error(outlier):
    """Keys divided per channel by channel_smoothing's factors, the query multiplied by them: the
    kernel against float64 attention over the dequantised cache (float32's error only), and a
    query left unscaled fails that check. Against the exact cache, the smoothed error is under a
    quarter of the per-token error with outlier channels, and under a bfloat16 cache's; on
    Gaussian keys it is no worse than per token (BENCHMARKS.md, "int8 KV cache: accuracy")."""
    from attnlab.decoding import channel_smoothing, dequantize, quantize

    q, k, v = _smoothing_case(outlier)
    lam = channel_smoothing(k)  # (1, 2, 64)
    assert lam.shape == (1, 2, 64) and bool((lam >= 1).all())
    assert bool((lam[..., [5, 40]] > 10).all()) == outlier
    (k8, ks), (v8, vs) = quantize(k / lam[..., None, :]), quantize(v)
    out = decode_attention(q, k8, v8, enable_gqa=True, k_scale=ks, v_scale=vs, k_channel_scale=lam)
    k_deq, v_deq = dequantize(k8, ks, lam), dequantize(v8, vs)
    want = torch_math(_query_seen(q, 2, lam), k_deq.double(), v_deq.double(), enable_gqa=True)
    assert_close(out, want.float(), dtype=torch.float32)
    if outlier:  # the factors are what make it exact: without them on the query the check fails
        unscaled = decode_attention(q, k8, v8, enable_gqa=True, k_scale=ks, v_scale=vs)
        with pytest.raises(AssertionError):
            assert_close(unscaled, want.float(), dtype=torch.float32)
    exact = torch_math(q.double(), k.double(), v.double(), enable_gqa=True)
    (k8p, ksp) = quantize(k)
    per_token = decode_attention(q, k8p, v8, enable_gqa=True, k_scale=ksp, v_scale=vs)
    bf16 = decode_attention(q, k.bfloat16().float(), v.bfloat16().float(), enable_gqa=True)
    err = {name: (o.double() - exact).abs().max().item() for name, o in
           (("smoothed", out), ("per_token", per_token), ("bf16", bf16))}
    if outlier:
        assert err["smoothed"] < 0.25 * err["per_token"] and err["smoothed"] < err["bf16"], err
    else:
        assert err["smoothed"] < 1.3 * err["per_token"], err


@pytest.mark.parametrize("kind", ["KVCache", "PagedKVCache"])
def test_int8_caches_smooth_their_keys_from_the_prompt(kind):
    """Calibrated on a first append of at least SMOOTHING_MIN_TOKENS tokens, kept for the tokens
    that follow, cleared by reset; a shorter first append or smooth_keys=False leaves the cache
    per token. The decode step matches float64 attention over the cache's own dequantised
    contents either way."""
    from attnlab.decoding import SMOOTHING_MIN_TOKENS, paged_decode_attention

    q, k, v = _smoothing_case(True, S=300)

    def make(**kw):
        return KVCache(1, 2, 64, dtype=torch.int8, **kw) if kind == "KVCache" else \
            PagedKVCache(1, 2, 64, dtype=torch.int8, **kw)

    def contents(cache):
        if kind == "KVCache":
            from attnlab.decoding import dequantize

            k8, v8, ks, vs = cache.stored()
            return dequantize(k8, ks, cache.k_channel_scale), dequantize(v8, vs)
        return cache.dense()

    def step(cache):
        if kind == "PagedKVCache":
            return paged_decode_attention(q, cache)
        k8, v8, ks, vs = cache.stored()
        return decode_attention(q, k8, v8, enable_gqa=True, k_scale=ks, v_scale=vs,
                                k_channel_scale=cache.k_channel_scale)

    cache = make()
    cache.append(k[:, :, :200], v[:, :, :200])
    cache.append(k[:, :, 200:], v[:, :, 200:])
    lam = cache.k_channel_scale
    assert lam is not None and lam.shape == (1, 2, 64) and bool((lam[..., [5, 40]] > 10).all())
    k_deq, v_deq = contents(cache)
    want = torch_math(_query_seen(q, 2, lam), k_deq.double(), v_deq.double(), enable_gqa=True)
    assert_close(step(cache), want.float(), dtype=torch.float32)
    exact = torch_math(q.double(), k.double(), v.double(), enable_gqa=True)
    channel_err = (k_deq - k).abs().amax(dim=(0, 1, 2))[[5, 40]]  # outlier channels kept within 1% of their size
    assert bool((channel_err < 0.01 * k.abs().amax(dim=(0, 1, 2))[[5, 40]]).all()), channel_err
    smoothed_err = (step(cache).double() - exact).abs().max().item()
    cache.reset()
    assert cache.k_channel_scale is None
    short = make()
    short.append(k[:, :, :SMOOTHING_MIN_TOKENS - 1], v[:, :, :SMOOTHING_MIN_TOKENS - 1])
    short.append(k[:, :, SMOOTHING_MIN_TOKENS - 1:], v[:, :, SMOOTHING_MIN_TOKENS - 1:])
    off = make(smooth_keys=False)
    off.append(k, v)
    for plain in (short, off):
        assert plain.k_channel_scale is None
        k_deq, v_deq = contents(plain)
        want = torch_math(_query_seen(q, 2), k_deq.double(), v_deq.double(), enable_gqa=True)
        assert_close(step(plain), want.float(), dtype=torch.float32)
    per_token_err = (step(off).double() - exact).abs().max().item()
    assert smoothed_err < 0.25 * per_token_err, (smoothed_err, per_token_err)


def test_k_channel_scale_is_checked_at_the_boundary():
    from attnlab.decoding import quantize

    k8, ks = quantize(randn(1, 2, 30, 8))
    q = randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match=r"k_channel_scale must be float32 of shape \(1, 2, 8\) \(one factor per key "
                                         r"channel: attnlab.decoding.channel_smoothing\), got torch.float32 \(1, 2, 30\)"):
        decode_attention(q, k8, k8, k_scale=ks, v_scale=ks, k_channel_scale=ks)
    with pytest.raises(ValueError, match="k_scale, v_scale and k_channel_scale are for an int8 key"):
        decode_attention(q, randn(1, 2, 30, 8), randn(1, 2, 30, 8), k_channel_scale=torch.ones(1, 2, 8))


def test_an_int8_cache_names_what_it_needs():
    from attnlab.decoding import quantize

    k8, ks = quantize(randn(1, 2, 30, 8))
    q = randn(1, 2, 1, 8)
    with pytest.raises(TypeError, match=r"an int8 cache needs v_scale, a float32 tensor of shape \(1, 2, 30\)"):
        decode_attention(q, k8, k8, k_scale=ks)
    with pytest.raises(ValueError, match="k_scale, v_scale and k_channel_scale are for an int8 key and value"):
        decode_attention(q, randn(1, 2, 30, 8), randn(1, 2, 30, 8), k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match=r"k_scale must be float32 of shape \(1, 2, 30\), got torch.float32 "
                                         r"\(1, 2, 29\)"):
        decode_attention(q, k8, k8, k_scale=ks[..., 1:], v_scale=ks)


def _decode_with_an_int8_cache(monkeypatch, mha, prompt: int):
    """A prompt of ``prompt`` tokens, then three decode steps through ``mha`` with a float32 and an
    int8 KVCache; returns ``(int8 cache, decode_attention's keyword arguments per call, worst
    relative difference of a step's output)``."""
    calls = []
    from attnlab import decoding as _decoding

    real = _decoding.decode_attention
    monkeypatch.setattr(_decoding, "decode_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    x = randn(2, prompt, 64)
    worst = 0.0
    with torch.no_grad():
        full, int8 = KVCache(2, 2, 8), KVCache(2, 2, 8, dtype=torch.int8)
        mha(x, x, x, is_causal=True, kv_cache=full)
        mha(x, x, x, is_causal=True, kv_cache=int8)
        for step in range(3):
            y = randn(2, 1, 64, seed=10 + step)
            a, _ = mha(y, y, y, is_causal=True, kv_cache=full)
            b, _ = mha(y, y, y, is_causal=True, kv_cache=int8)
            worst = max(worst, (a - b).abs().max().item() / a.abs().max().item())
    return int8, calls[-3:], worst


def test_an_int8_kvcache_decodes_through_the_module_in_place(monkeypatch):
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 8, num_kv_heads=2, batch_first=True).eval()
    int8, calls, worst = _decode_with_an_int8_cache(monkeypatch, mha, prompt=12)
    assert worst < 0.01  # int8's error (BENCHMARKS.md)
    assert int8.stored()[0].dtype == torch.int8 and all(c["k_scale"] is not None for c in calls)
    # the 12-token prompt is shorter than SMOOTHING_MIN_TOKENS: this cache stays per token
    assert int8.k_channel_scale is None and all(c["k_channel_scale"] is None for c in calls)


def test_a_smoothed_int8_kvcache_decodes_through_the_module_with_its_factors(monkeypatch):
    """A prompt of 40 tokens calibrates the module's int8 cache; each decode step hands the
    factors to decode_attention, and stays as close to the float32 cache as int8 allows."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 8, num_kv_heads=2, batch_first=True).eval()
    with torch.no_grad():
        mha.k_proj.weight[:2] *= 20  # two key channels of head 0 far larger than the rest
    int8, calls, worst = _decode_with_an_int8_cache(monkeypatch, mha, prompt=40)
    assert int8.k_channel_scale is not None and int8.k_channel_scale.shape == (2, 2, 8)
    assert worst < 0.01
    assert all(c["k_channel_scale"] is int8.k_channel_scale for c in calls)


def test_a_smoothed_int8_kvcache_takes_its_factors_on_the_dense_path_too():
    """A step the decode path cannot take (attention weights asked for) reads the int8 cache
    dequantised, factors included: the same output as the decode step, and as close to the
    float32 cache as int8 allows (without the factors the keys' outlier channels would be 20x off)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 8, num_kv_heads=2, batch_first=True).eval()
    with torch.no_grad():
        mha.k_proj.weight[:2] *= 20
    x, y = randn(2, 40, 64), randn(2, 1, 64, seed=10)
    with torch.no_grad():
        full, int8 = KVCache(2, 2, 8), KVCache(2, 2, 8, dtype=torch.int8)
        mha(x, x, x, is_causal=True, kv_cache=full)
        mha(x, x, x, is_causal=True, kv_cache=int8)
        assert int8.k_channel_scale is not None
        want, _ = mha(y, y, y, is_causal=True, kv_cache=full)
        dense_out, weights = mha(y, y, y, is_causal=True, kv_cache=int8, need_weights=True)
        int8.length -= 1  # the same step again, on the decode path this time
        decode_out, _ = mha(y, y, y, is_causal=True, kv_cache=int8)
    assert weights is not None and weights.shape[-1] == 41
    assert_close(dense_out, decode_out, dtype=torch.float32)
    assert (dense_out - want).abs().max().item() < 0.01 * want.abs().max().item()


@pytest.mark.slow
def test_a_long_caches_decode_is_more_accurate_than_torch_because_its_tasks_are_capped():
    """Issue 49: with 8 key/value heads of S = 131072 on 2 threads each head was one task, one
    float32 accumulator over 131072 keys: 9.9e-6 of the output's largest value off float64, as far
    as torch's SDPA (1.1e-5). Tasks of at most MAX_CHUNK keys, merged exactly: 2.7e-6 (the paged
    cache's). The uncapped task (chunk=S, the same kernel) is shown as the control."""
    assert kernel.choose_chunk(131072, 8, 2) == kernel.MAX_CHUNK == 16384
    g = torch.Generator().manual_seed(0)
    S, H, Hkv, E = 131072, 32, 8, 128
    q, k, v = (torch.randn(1, n, s, E, generator=g) for n, s in ((H, 1), (Hkv, S), (Hkv, S)))
    r = H // Hkv
    golden = torch.empty(1, H, 1, E, dtype=torch.float64)
    for h in range(Hkv):  # float64, one key/value head at a time (1 GB of cache in float32 already)
        s = q[0, h * r:(h + 1) * r, 0].double() @ k[0, h].double().T / E ** 0.5
        s = (s - s.amax(-1, keepdim=True)).exp()
        golden[0, h * r:(h + 1) * r, 0] = (s / s.sum(-1, keepdim=True)) @ v[0, h].double()

    def error(out):
        return (out.double() - golden).abs().max().item() / golden.abs().max().item()

    ours = error(decode_attention(q, k, v, enable_gqa=True))
    theirs = error(F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)))
    q4 = q.reshape(Hkv, r, 1, E)  # the kernel's layout: (B * Hkv, r, L, E)
    whole, _, _ = kernel.forward(q4, k.reshape(Hkv, S, E), v.reshape(Hkv, S, E), Hkv=Hkv, S=S,
                                 scale2=E ** -0.5 * 1.4426950408889634, chunk=S)
    uncapped = error(whole.reshape(1, H, 1, E))
    assert ours < 0.5 * theirs, (ours, theirs)  # 2.7e-6 against 1.1e-5 measured
    assert uncapped > 2 * ours, (uncapped, ours)  # 9.9e-6: what the cap buys


def test_the_kernel_takes_its_integers_as_one_named_plan():
    """``decode_forward``'s integers travel as one list, ``plan``, in ``PLAN_FIELDS``' order
    (``DecodePlan.codes``): the front door's call equals one made by hand from named codes, and a
    plan of the wrong length is refused with the fields it needs."""
    ops = _native.ops()
    assert ops is not None, _native.status()  # make demo / make test build it
    q, k, v = randn(1, 8, 3, 64, seed=1), randn(1, 2, 300, 64, seed=2), randn(1, 2, 300, 48, seed=3)
    q4 = q.reshape(2, 4, 3, 64)  # (Nb, r, L, E): 2 key/value heads, 4 query heads each
    route = kernel.plan(12, 64, torch.float32, torch.float32, 48)
    codes = route.codes(Hkv=2, S=300, causal=kernel.CAUSAL["none"], chunk=0, block_k=kernel.STREAM_BLOCK_K,
                        sgemm=_native.sgemm_route().code)
    assert len(codes) == len(kernel.PLAN_FIELDS) == 9
    assert dict(zip(kernel.PLAN_FIELDS, codes))["S"] == 300
    out, lse2, bad = ops.decode_forward(q4, k[0], v[0], None, None, None, None, 0.125 * 1.4426950408889634, codes)
    assert not bool(bad)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
    assert_close(out.reshape(1, 8, 3, 48), expected)
    with pytest.raises(RuntimeError, match=r"plan must hold 9 integers \(Hkv, S, causal.*got 8"):
        ops.decode_forward(q4, k[0], v[0], None, None, None, None, 0.18, codes[:-1])


def test_the_kernel_checks_the_plan_s_dot_products_and_never_second_guesses_them():
    """The C++ runs the dot products the plan names, or refuses a plan its build or the shapes cannot
    run (issue 49 item 1: routes decided once, in Python): int16 dot products for a float cache or
    E = 20, the bf16 value pass without the bf16 scores or with Ev = 48."""
    ops = _native.ops()
    assert ops is not None, _native.status()  # make demo / make test build it
    fields = kernel.PLAN_FIELDS

    def plan(E, **codes):
        named = dict(Hkv=1, S=40, causal=0, chunk=0, block_k=kernel.STREAM_BLOCK_K, mode=1, sgemm=0, int8_dot=0,
                     bf16_dot=0) | codes
        return [named[f] for f in fields]

    q4, k, v = randn(1, 4, 1, 20, seed=1), randn(1, 40, 20, seed=2), randn(1, 40, 20, seed=3)
    ops.decode_forward(q4, k, v, None, None, None, None, 0.3, plan(20))  # the float32 route runs
    with pytest.raises(RuntimeError, match=r"int8_dot = 1 .*needs an int8 cache .*E = 20"):
        ops.decode_forward(q4, k, v, None, None, None, None, 0.3, plan(20, int8_dot=1))
    kb, vb = randn(1, 40, 32, seed=2).bfloat16(), randn(1, 40, 48, seed=3).bfloat16()
    q4 = randn(1, 4, 1, 32, seed=1).bfloat16().float()
    if _native.decode_dot_bits() & 1:  # a build with vdpbf16ps: the value pass's own conditions
        with pytest.raises(RuntimeError, match=r"bf16_dot bit 1 .*needs bit 0"):
            ops.decode_forward(q4, kb, kb, None, None, None, None, 0.3, plan(32, bf16_dot=2))
        with pytest.raises(RuntimeError, match=r"Ev a multiple of 32; got Ev = 48"):
            ops.decode_forward(q4, kb, vb, None, None, None, None, 0.3, plan(32, bf16_dot=3))
    else:  # without it, the plan's vdpbf16ps itself is refused
        with pytest.raises(RuntimeError, match=r"bf16_dot = 1 \(vdpbf16ps\) needs a build with AVX512_BF16"):
            ops.decode_forward(q4, kb, kb, None, None, None, None, 0.3, plan(32, bf16_dot=1))


def test_the_plan_decides_where_a_bf16_step_s_rows_go_across_lanes():
    """``decode.bf16_lanes`` (the plan's bf16_dot bit 2) and ``decode.int8_lanes`` (int8_dot bit 1),
    not the C++, decide the lane kernels: 9-16 rows a head on a build with 512-bit vdpbf16ps (or
    AVX512BW); explain() (the plan's words) names them; the C++ refuses them for 4 rows."""
    wide = bool(_native.decode_dot_bits() & 4)
    with routes.forced(decode="stream"):
        assert kernel.plan(16, 128, torch.bfloat16, torch.bfloat16).bf16_lanes == (
            wide and kernel.bf16_dot(128, "stream") == "vdpbf16ps")
        assert not kernel.plan(4, 128, torch.bfloat16, torch.bfloat16).bf16_lanes
        assert not kernel.plan(17, 128, torch.bfloat16, torch.bfloat16).bf16_lanes
        assert not kernel.plan(16, 128, torch.float32).bf16_lanes
        wide8 = bool(_native.decode_dot_bits() & 8) and kernel.int8_dot(128, "stream") == "int16"
        assert kernel.plan(16, 128, torch.int8).int8_lanes == wide8
        assert not kernel.plan(16, 48, torch.int8).int8_lanes and not kernel.plan(8, 128, torch.int8).int8_lanes
        assert ("the rows across a zmm's lanes" in kernel.plan(16, 128, torch.int8).dots) == wide8
        if kernel.plan(16, 128, torch.bfloat16, torch.bfloat16).bf16_lanes:
            q, k = randn(1, 16, 4, 128).bfloat16(), randn(1, 4, 64, 128).bfloat16()  # 4 heads a group x 4 rows
            assert "rows across a zmm's lanes" in routes.explain(q, k, k, cache=True)
    ops = _native.ops()
    assert ops is not None, _native.status()
    plan = dict(Hkv=1, S=40, causal=0, chunk=0, block_k=kernel.STREAM_BLOCK_K, mode=1, sgemm=0, int8_dot=0, bf16_dot=5)
    kb, q4 = randn(1, 40, 32, seed=2).bfloat16(), randn(1, 4, 1, 32, seed=1).bfloat16().float()
    refused = r"bf16_dot bit 2 .*9 to 16 rows a head; got 4 rows|bf16_dot = 5 \(vdpbf16ps\)"  # the latter: no vdpbf16ps
    with pytest.raises(RuntimeError, match=refused):
        ops.decode_forward(q4, kb, kb, None, None, None, None, 0.3, [plan[f] for f in kernel.PLAN_FIELDS])
    plan.update(bf16_dot=0, int8_dot=3)  # int16 dots across lanes for 4 rows
    k8, scale = randn(1, 40, 32, seed=2).to(torch.int8), torch.ones(1, 40)
    with pytest.raises(RuntimeError, match=r"int8_dot bit 1 .*9 to 16 rows a head .*got 4 rows"):
        ops.decode_forward(q4, k8, k8, None, None, scale, scale, 0.3, [plan[f] for f in kernel.PLAN_FIELDS])
