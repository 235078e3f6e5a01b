"""attnlab.flex's API against torch's own (torch.nn.attention.flex_attention, 2.13): the same
names with the same meanings. Every BlockMask attribute built by attnlab's create_block_mask
must equal the one torch's create_block_mask builds for the same mask_mod; slicing, _adjust
and from_kv_blocks likewise; create_mask, the mask combinators, BLOCK_SIZE, return_aux,
kernel_options and a key/value batch of 1 against torch's eager flex_attention.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as tf

from attnlab import flex
from attnlab.flex import attention as flex_attention_module
from attnlab.testing import assert_close

ATTRS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
         "full_q_num_blocks", "full_q_indices"]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def doc_mod(b, h, q_idx, kv_idx):  # three documents of a packed sequence of 300, causal within each
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([90, 150, 60]))
    return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)


def head_mod(b, h, q_idx, kv_idx):  # depends on batch and head: each sees a different window
    return (q_idx - kv_idx).abs() <= 16 * (h + 1) + 8 * b


MODS = {"causal": flex.causal_mask, "sliding_100": flex.sliding_window(100), "document": doc_mod,
        "document_own": flex.document_mask(flex.document_ids([90, 150, 60])),
        "prefix_64": flex.prefix_lm(64), "and": flex.and_masks(flex.causal_mask, flex.sliding_window(50)),
        "or": flex.or_masks(flex.prefix_lm(32), flex.sliding_window(20)), "heads": head_mod,
        "noop": flex.noop_mask}
# the same mods without their block_kinds: create_block_mask then evaluates every element
PLAIN = {f"plain_{name}": (lambda b, h, q, k, m=mod: m(b, h, q, k)) for name, mod in MODS.items()
         if getattr(mod, "block_kinds", None)}
assert len(PLAIN) == 7  # attnlab's own mods know their block kinds; doc_mod and head_mod do not
MODS.update(PLAIN)
SIZES = [(300, 300, 128, None, None), (256, 300, 64, 2, 3), (77, 130, (32, 16), 1, 2), (40, 36, 4, None, 2)]


def both(mod, L, S, block, B, H):
    ours = flex.create_block_mask(mod, B, H, L, S, BLOCK_SIZE=block)
    theirs = tf.create_block_mask(mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)
    return ours, theirs


def same_blocks(ours, theirs):
    for name in ATTRS:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(ours.to_dense(), theirs.to_dense()) and ours.to_dense().dtype == theirs.to_dense().dtype
    assert ours.seq_lengths == theirs.seq_lengths and ours.shape == theirs.shape and ours.numel() == theirs.numel()
    assert ours.BLOCK_SIZE == tuple(theirs.BLOCK_SIZE)
    assert ours.sparsity() == pytest.approx(theirs.sparsity())


CASES = [(name, size) for name in MODS for size in SIZES
         if "document" not in name or size[:2] == (300, 300)]  # the document masks are made for 300 positions


@pytest.mark.parametrize("name,size", CASES, ids=[f"{n}-L{s[0]}_S{s[1]}_bs{s[2]}_B{s[3]}_H{s[4]}" for n, s in CASES])
def test_every_attribute_equals_torchs(name, size):
    L, S, block, B, H = size
    ours, theirs = both(MODS[name], L, S, block, B, H)
    same_blocks(ours, theirs)
    assert ours.to_string() == theirs.to_string() and ours.to_string(grid_size=-1) == theirs.to_string(grid_size=-1)
    ours_t, theirs_t = ours.as_tuple(), theirs.as_tuple()
    assert len(ours_t) == len(theirs_t) == 17
    for a, b in zip(ours_t[:-1], theirs_t[:-1]):
        assert (torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b)


def test_block_kinds_decide_without_evaluating_full_and_empty_blocks():
    """attnlab's own mods are called on the edge blocks only (the causal diagonal here)."""
    calls = []

    def counting(b, h, q, kv):
        calls.append(torch.broadcast_shapes(q.shape, kv.shape).numel())
        return flex.causal_mask(b, h, q, kv)

    counting.block_kinds = flex.causal_mask.block_kinds
    bm = flex.create_block_mask(counting, None, None, 1024, 1024, BLOCK_SIZE=128)
    assert sum(calls) == 8 * 128 * 128 and bm.counts() == {"empty": 28, "partial": 8, "full": 28}


def test_wrong_block_kinds_are_caught_by_the_comparison():
    """The comparison with torch is not vacuous for block_kinds either: kinds that call every
    block full give torch's partial diagonal as full."""
    def lying(b, h, q, kv):
        return q >= kv
    lying.block_kinds = lambda bq, bk, nq, nk: torch.full((nq, nk), 2, dtype=torch.uint8)
    ours = flex.create_block_mask(lying, None, None, 256, 256, BLOCK_SIZE=64)
    theirs = tf.create_block_mask(lying, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    assert not torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)


def test_a_broken_attribute_is_caught():
    """The comparison is not vacuous: indices in another order differ from torch's."""
    ours, theirs = both(flex.causal_mask, 300, 300, 64, None, None)
    assert not torch.equal(ours.kv_indices.flip(-1), theirs.kv_indices)
    assert not torch.equal(ours.to_dense().bool(), flex.create_mask(flex.causal_mask, None, None, 300, 300))


@pytest.mark.parametrize("index", [0, (0, 1), (slice(0, 2), slice(1, 2)), (slice(None), slice(None),
                                                                           torch.tensor([1, 3]))],
                         ids=["batch", "batch_head", "slices", "query_blocks"])
def test_indexing_equals_torchs(index):
    ours, theirs = both(head_mod, 256, 256, 32, 2, 3)
    same_blocks(ours[index], theirs[index])
    with pytest.raises(RuntimeError, match="sliced"):
        ours[index].mask_mod(torch.tensor(0), torch.tensor(0), torch.tensor(0), torch.tensor(0))


def test_a_query_block_slice_runs_as_a_decoding_step():
    """torch's decoding recipe: slice the block row of the current position, set seq_lengths and an
    offset mask_mod; attnlab's kernels run the sliced mask (its bits are kept)."""
    L, S, block = 256, 256, 32
    bm = flex.create_block_mask(flex.causal_mask, None, None, L, S, BLOCK_SIZE=block)
    pos = 100
    step = bm[:, :, pos // block]
    step.seq_lengths = (block, S)  # the block's 32 rows; row a is position 96 + a
    q, k, v = randn(1, 2, L, 16), randn(1, 2, S, 16, seed=1), randn(1, 2, S, 16, seed=2)
    block_rows = slice(pos // block * block, pos // block * block + block)
    out = flex.flex_attention(q[:, :, block_rows], k, v, block_mask=step)
    assert_close(out, flex.flex_attention(q, k, v, block_mask=bm)[:, :, block_rows])


def test_adjust_equals_torchs():
    ours, theirs = both(flex.sliding_window(64), 512, 512, 64, None, 2)
    same_blocks(ours._adjust(300, 200), theirs._adjust(300, 200))


def test_from_kv_blocks_rebuilds_torchs_mask_and_runs():
    L = S = 200
    theirs = tf.create_block_mask(flex.sliding_window(48), 1, 2, L, S, device="cpu", BLOCK_SIZE=32)
    ours = flex.BlockMask.from_kv_blocks(theirs.kv_num_blocks, theirs.kv_indices, theirs.full_kv_num_blocks,
                                         theirs.full_kv_indices, BLOCK_SIZE=32, mask_mod=flex.sliding_window(48),
                                         seq_lengths=(L, S))
    same_blocks(ours, theirs)
    q, k, v = randn(1, 2, L, 16), randn(1, 2, S, 16, seed=1), randn(1, 2, S, 16, seed=2)
    assert_close(flex.flex_attention(q, k, v, block_mask=ours), tf.flex_attention(q, k, v, block_mask=theirs))
    with pytest.raises(NotImplementedError, match="dq_write_order"):
        flex.BlockMask.from_kv_blocks(theirs.kv_num_blocks, theirs.kv_indices, dq_write_order=torch.zeros(1))


def test_from_kv_blocks_without_full_blocks_has_none_as_torchs():
    """issue 63: the full-block attributes were zeros where torch's are None; every block given is
    partial, and the mask runs as torch's does."""
    L = S = 128
    theirs_full = tf.create_block_mask(flex.causal_mask, 1, 1, L, S, device="cpu", BLOCK_SIZE=32)
    # the full blocks folded into the partial lists: what a caller without full blocks passes
    dense = theirs_full.to_dense().bool()  # (1, 1, nq, nk): any block that attends
    num = dense.sum(-1).to(torch.int32)
    idx = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    theirs = tf.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=32, mask_mod=flex.causal_mask, seq_lengths=(L, S))
    ours = flex.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=32, mask_mod=flex.causal_mask, seq_lengths=(L, S))
    for name in ("full_kv_num_blocks", "full_kv_indices", "full_q_num_blocks", "full_q_indices"):
        assert getattr(theirs, name) is None and getattr(ours, name) is None, name
    assert torch.equal(ours.kv_num_blocks, theirs.kv_num_blocks)
    assert ours[:, :, :2].full_kv_num_blocks is None and ours._adjust(64, 64).full_kv_indices is None
    q, k, v = randn(1, 1, L, 16), randn(1, 1, S, 16, seed=1), randn(1, 1, S, 16, seed=2)
    assert_close(flex.flex_attention(q, k, v, block_mask=ours), tf.flex_attention(q, k, v, block_mask=theirs))


def test_to_dense_is_the_block_map_and_create_mask_the_elements():
    ours, theirs = both(flex.causal_mask, 256, 256, 128, None, None)
    assert ours.to_dense().shape == (1, 1, 2, 2) and ours.to_dense().dtype == torch.int32
    for mod in (flex.causal_mask, head_mod):
        assert torch.equal(flex.create_mask(mod, 2, 3, 40, 50), tf.create_mask(mod, 2, 3, 40, 50, device="cpu"))

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, float("-inf"))
    assert torch.equal(flex.create_mask(score_mod, 1, 1, 9, 9), tf.create_mask(score_mod, 1, 1, 9, 9, device="cpu"))
    assert torch.equal(ours.element_mask(), flex.create_mask(flex.causal_mask, None, None, 256, 256))


def test_mask_combinators_follow_torch():
    for combine in ("and_masks", "or_masks"):
        ours, theirs = getattr(flex, combine)(), getattr(tf, combine)()
        assert torch.equal(flex.create_mask(ours, 1, 1, 4, 5), tf.create_mask(theirs, 1, 1, 4, 5, device="cpu"))
        with pytest.raises(RuntimeError, match=f"{combine}: every argument must be a callable mask_mod.*argument 1"):
            getattr(flex, combine)(flex.causal_mask, 3)
        with pytest.raises(TypeError):
            getattr(flex, combine)(None)


@pytest.mark.parametrize("native", [True, False])
def test_a_block_size_of_4_works(monkeypatch, native):
    if not native:
        monkeypatch.setattr(flex_attention_module.kernels, "covers", lambda *a: False)
    q, k, v = (randn(1, 2, 37, 8, seed=i).requires_grad_() for i in range(3))
    bm = flex.create_block_mask(flex.sliding_window(9), None, None, 37, 37, BLOCK_SIZE=4)
    assert bm.BLOCK_SIZE == (4, 4) and bm.bits.shape[1:] == (4, 1)
    out = flex.flex_attention(q, k, v, block_mask=bm)
    ref = tf.flex_attention(q.detach(), k.detach(), v.detach(),
                            block_mask=tf.create_block_mask(flex.sliding_window(9), None, None, 37, 37,
                                                            device="cpu", BLOCK_SIZE=4))
    assert_close(out.detach(), ref)
    out.sum().backward()
    assert all(t.grad is not None and bool(t.grad.isfinite().all()) for t in (q, k, v))


def test_return_aux_gives_lse_and_max_scores():
    q, k, v = randn(2, 2, 70, 16), randn(2, 2, 90, 16, seed=1), randn(2, 2, 90, 16, seed=2)
    mod = flex.sliding_window(20)
    bm = flex.create_block_mask(mod, None, None, 70, 90, BLOCK_SIZE=32)

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (h + 1)

    for score_mod in (None, bias):
        out, aux = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                       return_aux=flex.AuxRequest(lse=True, max_scores=True))
        t_out, t_aux = tf.flex_attention(q, k, v, score_mod=score_mod,
                                         block_mask=tf.create_block_mask(mod, None, None, 70, 90, device="cpu",
                                                                         BLOCK_SIZE=32),
                                         return_aux=tf.AuxRequest(lse=True))
        assert_close(out, t_out)
        assert_close(aux.lse, t_aux.lse)
        scores = (q @ k.transpose(-2, -1)) / 4.0  # scale 1/sqrt(16)
        if score_mod is not None:
            scores = scores + 0.1 * (torch.arange(2).view(1, 2, 1, 1) + 1)
        scores = scores.masked_fill(~flex.create_mask(mod, None, None, 70, 90), float("-inf"))
        assert_close(aux.max_scores, scores.amax(-1))
    _, only_lse = flex.flex_attention(q, k, v, return_aux=flex.AuxRequest(lse=True))
    assert only_lse.max_scores is None and only_lse.lse.shape == (2, 2, 70)
    with pytest.raises(ValueError, match="return_lse or return_aux, not both"):
        flex.flex_attention(q, k, v, return_lse=True, return_aux=flex.AuxRequest(lse=True))


def test_kernel_options_set_the_tile_and_note_the_rest(monkeypatch):
    monkeypatch.setattr(flex_attention_module, "_noted", set())
    q, k, v = randn(1, 2, 100, 16), randn(1, 2, 100, 16, seed=1), randn(1, 2, 100, 16, seed=2)
    want = tf.flex_attention(q, k, v)
    assert_close(flex.flex_attention(q, k, v, kernel_options={"BLOCK_M": 32, "BLOCK_N": 16}), want)
    with pytest.warns(UserWarning, match=r"kernel_options\['num_warps'\] tunes torch's Triton kernels"):
        assert_close(flex.flex_attention(q, k, v, kernel_options={"num_warps": 4}), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second call is quiet
        flex.flex_attention(q, k, v, kernel_options={"num_warps": 4})
    with pytest.raises(ValueError, match=r"kernel_options\['BLOCK_M'\] must be a positive int"):
        flex.flex_attention(q, k, v, kernel_options={"BLOCK_M": 0})


@pytest.mark.parametrize("Hkv", [1, 2])
def test_a_key_value_batch_of_one_broadcasts(Hkv):
    q = randn(3, 4, 50, 8).requires_grad_()
    k, v = randn(1, Hkv, 60, 8, seed=1).requires_grad_(), randn(1, Hkv, 60, 8, seed=2).requires_grad_()
    # torch wants the block mask's batch to be the query's when the key/value batch is 1
    bm = flex.create_block_mask(flex.causal_mask, 3, None, 50, 60, BLOCK_SIZE=16)
    out = flex.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    want = tf.flex_attention(q.detach(), k.detach(), v.detach(), enable_gqa=True,
                             block_mask=tf.create_block_mask(flex.causal_mask, 3, None, 50, 60, device="cpu",
                                                             BLOCK_SIZE=16))
    assert_close(out.detach(), want)
    out.sum().backward()
    assert k.grad.shape == (1, Hkv, 60, 8)
    k2, v2 = (t.detach().expand(3, -1, -1, -1).clone().requires_grad_() for t in (k, v))
    flex.flex_attention(q.detach(), k2, v2, block_mask=bm, enable_gqa=True).sum().backward()
    assert_close(k.grad, k2.grad.sum(0, keepdim=True))


def test_block_masks_stay_on_the_cpu():
    bm = flex.create_block_mask(flex.causal_mask, None, None, 64, 64)
    assert bm.to("cpu") is bm
    with pytest.raises(NotImplementedError, match="CPU only"):
        bm.to("cuda")
    with pytest.raises(NotImplementedError, match="compute_dq_write_order"):
        flex.create_block_mask(flex.causal_mask, None, None, 64, 64, compute_dq_write_order=True)


@pytest.mark.subprocess
def test_building_a_mask_keeps_its_peak_memory_bounded_by_the_chunk():
    """A plain sliding-window mask_mod at L = 32768, measured in a fresh process with
    attnlab.bench's peak_rss_growth: it must stay within 256 MiB (54 MiB here). Shown to fail:
    with chunks of 64 Mi elements instead of 1 Mi the peak grew by 747 MiB."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "attnlab.bench", "--block-mask-child", "plain", "sliding", "32768"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < result["peak"] < 256 * 2**20, result
    assert result["blocks"] == [480, 7440]  # as torch classifies them (test_every_attribute_equals_torchs)
