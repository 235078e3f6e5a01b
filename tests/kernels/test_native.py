"""The tiled path's native C++ forward: built here, the same results as the pure-PyTorch forward
and as torch, on views and odd shapes; switched off or broken, the pure path takes over and says so."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import parity_stats
from attnlab.kernels import dense
from attnlab import kernels, tiled
from attnlab.kernels import native as _native
from attnlab.testing import assert_close, assert_close_to_sdpa


@pytest.fixture
def native_ops():
    """The compiled ops; a test that needs them fails (never skips) when they are missing."""
    if not tiled.native_status().available:
        pytest.fail(str(tiled.native_status()))
    return _native.ops()


def test_native_kernel_is_in_use_here():
    status = tiled.native_status()
    if os.environ.get("ATTNLAB_NATIVE", "1") == "0":
        assert not status.available and "ATTNLAB_NATIVE=0" in str(status)
    else:
        # this machine has gcc: a missing kernel here is a bug (the 1.1x forward target rests on it)
        assert status.available, str(status)
        assert "native C++ forward and backward" in str(status)


def _inputs(gen, Nb, r, L, S, E, Ev):
    q4 = torch.randn(Nb, r, L, E, generator=gen)
    k3 = torch.randn(Nb, S, E, generator=gen)
    v3 = torch.randn(Nb, S, Ev, generator=gen)
    return q4, k3, v3


def _golden(q4, k3, v3, is_causal, scale):
    """float64 SDPA on the (Nb, r, L, E) layout: key/value head nb serves query heads nb*r .. nb*r + r-1."""
    r = q4.shape[1]
    k = k3.double()[:, None].expand(-1, r, -1, -1)
    v = v3.double()[:, None].expand(-1, r, -1, -1)
    return torch.nn.functional.scaled_dot_product_attention(q4.double(), k, v, is_causal=is_causal, scale=scale)


SHAPES = [  # (Nb, r, L, S, E, Ev, block_q, block_k)
    (2, 1, 100, 77, 16, 8, 256, 256),
    (1, 3, 37, 53, 8, 12, 5, 7),  # GQA-style groups, blocks that do not divide
    (1, 1, 1, 1, 4, 4, 256, 256),
    (1, 2, 1, 300, 16, 16, 1, 64),
    (1, 2, 300, 1, 16, 16, 64, 1),
    (2, 2, 65, 65, 1, 1, 16, 16),  # E = Ev = 1: the last dim carries any stride
    (1, 1, 513, 1000, 64, 64, 256, 256),
    (1, 1, 1000, 513, 64, 32, 256, 512),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_native_matches_the_pure_forward_and_torch(shape, causal, gen, native_ops):
    Nb, r, L, S, E, Ev, bq, bk = shape
    q4, k3, v3 = _inputs(gen, Nb, r, L, S, E, Ev)
    scale = 1 / math.sqrt(E)
    scale2 = scale * dense.LOG2E
    layout = None  # no mask: the layout is only used to cut mask tiles
    out_n, lse_n = dense.forward(q4, k3, v3, layout, None, causal, scale2, bq, bk)
    out_e, lse_e = dense.forward_eager(q4, k3, v3, layout, None, causal, scale2, bq, bk)
    golden = _golden(q4, k3, v3, causal, scale)
    # both against the float64 golden with the shared tolerance, then against each other
    assert_close(out_n, golden, dtype=torch.float32, msg="native vs float64 SDPA")
    assert_close(out_e, golden, dtype=torch.float32, msg="pure vs float64 SDPA")
    assert_close(out_n, out_e, msg="native vs pure output")
    assert_close(lse_n, lse_e, msg="native vs pure log-sum-exp")
    assert torch.isfinite(lse_n).all()  # no mask: every row sees a key


def test_native_reads_views_without_copying(gen, native_ops):
    """The ring passes slices of (Nb, r, L, E) along L and of (Nb, S, E) along S."""
    q_full, k_full, v_full = _inputs(gen, 2, 2, 96, 80, 16, 16)
    q4, k3, v3 = q_full[:, :, 32:64], k_full[:, 16:48], v_full[:, 16:48]
    assert not q4.is_contiguous() and kernels.dense_rows(q4) is q4
    scale2 = 0.25 * dense.LOG2E
    out_n, lse_n = dense.forward(q4, k3, v3, None, None, True, scale2, 8, 8)
    out_e, lse_e = dense.forward_eager(q4.contiguous(), k3.contiguous(), v3.contiguous(), None, None, True, scale2, 8, 8)
    assert_close(out_n, out_e, msg="native on views vs pure on copies")
    assert_close(lse_n, lse_e)


def test_native_covers_the_public_function_with_grads(gen, native_ops):
    """float32 and bfloat16 through flash_attention, forward (native) and backward (pure), vs torch."""
    q = torch.randn(2, 4, 70, 32, generator=gen)
    k = torch.randn(2, 2, 90, 32, generator=gen)
    v = torch.randn(2, 2, 90, 16, generator=gen)

    def impl(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return tiled.flash_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa=enable_gqa, block_q=32, block_k=32)

    for dtype in (torch.float32, torch.bfloat16):
        for causal in (False, True):
            parity_stats.record(assert_close_to_sdpa(impl, q.to(dtype), k.to(dtype), v.to(dtype), is_causal=causal,
                                                     enable_gqa=True), "tiled (native kernels)")


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


CHECK_RESULT = """
    import math, warnings, torch
    from attnlab import tiled
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 50, 8) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tiled.flash_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    print("STATUS", tiled.native_status())
    print("WARNINGS", len(caught), " | ".join(str(w.message) for w in caught))
    print("ERROR", (out.double() - ref).abs().max().item())
"""


@pytest.mark.subprocess
def test_turned_off_by_the_environment():
    run = _run_python(CHECK_RESULT, ATTNLAB_NATIVE="0")
    assert run.returncode == 0, run.stderr
    assert "pure-PyTorch forward and backward (turned off by ATTNLAB_NATIVE=0)" in run.stdout
    assert "WARNINGS 0" in run.stdout  # asked for: no warning
    assert float(run.stdout.split("ERROR")[1]) < 1e-5


@pytest.mark.subprocess
def test_a_failed_build_warns_once_and_falls_back(tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    code = textwrap.dedent(f"""
        from attnlab.kernels import native as _native
        from pathlib import Path
        _native._SOURCES = (Path({str(broken)!r}),)
    """) + textwrap.dedent(CHECK_RESULT)
    run = _run_python(code, ATTNLAB_CACHE_DIR=str(tmp_path / "cache"), ATTNLAB_NATIVE="1")
    assert run.returncode == 0, run.stderr
    assert "pure-PyTorch forward and backward (build or load failed" in run.stdout
    assert "WARNINGS 1 attnlab: the native tiled kernel is not available" in run.stdout
    assert "building the native tiled kernel" in run.stderr  # the progress line came first
    assert float(run.stdout.split("ERROR")[1]) < 1e-5


def test_cache_key_changes_with_the_cpu_and_a_build_for_another_cpu_is_not_loaded(tmp_path, monkeypatch):
    """A cache shared by machines with different CPUs (-march=native): one build per CPU kind,
    and a library recording instructions this CPU lacks is never loaded (it would SIGILL)."""
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    here = _native.cpu_features()
    first = _native._cache_dir()
    monkeypatch.setattr(_native, "cpu_features", lambda: frozenset({"sse2", "avx2"}))  # another CPU
    assert _native._cache_dir() != first
    build = tmp_path / "build"
    build.mkdir()
    (build / "cpu-features.txt").write_text(" ".join(sorted(here | {"avx512f", "amx_tile"})))
    monkeypatch.setattr(_native, "cpu_features", lambda: here)
    assert not _native._built_for_this_cpu(build)  # recorded flags this CPU lacks
    (build / "cpu-features.txt").write_text("sse2")
    assert _native._built_for_this_cpu(build)
    (build / "cpu-features.txt").unlink()
    assert not _native._built_for_this_cpu(build)  # no record: rebuilt, not trusted


@pytest.mark.parametrize("which", ["_SOURCES", "_HEADERS"])
def test_cache_key_changes_with_any_source_or_header(which, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    first = _native._cache_dir()
    files = getattr(_native, which)
    other = tmp_path / files[-1].name
    other.write_text(files[-1].read_text() + "\n// changed\n")
    monkeypatch.setattr(_native, which, (*files[:-1], other))
    assert _native._cache_dir() != first and _native._cache_dir().parent == first.parent == tmp_path


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "pure"])
def test_forward_into_continues_a_saved_state(use_native, gen, monkeypatch, request):
    """Three key blocks folded one by one into (out, lse2) equal one pass over all keys: the ring's merge."""
    if use_native:
        request.getfixturevalue("native_ops")  # fails when the kernel is missing
    else:
        monkeypatch.setattr(dense, "native_ops", lambda *a: None)
    q4, k3, v3 = _inputs(gen, 2, 2, 50, 90, 16, 8)
    scale2 = 0.25 * dense.LOG2E
    out = torch.zeros(2, 2, 50, 8)
    lse2 = torch.full((2, 2, 50), float("-inf"))
    for j0, j1, causal in [(40, 90, False), (0, 20, False), (20, 40, True)]:
        # views, as the ring passes them: rows 10.. only for the diagonal block
        rows = slice(0, 50) if not causal else slice(20, 40)
        dense.forward_into(q4[:, :, rows], k3[:, j0:j1], v3[:, j0:j1], out[:, :, rows], lse2[:, :, rows], causal,
                            scale2, 16, 16)
    # expected: rows 0-19 and 40-49 see every key except 20-39; rows 20-39 see the causal diagonal too
    mask = torch.ones(50, 90, dtype=torch.bool)
    mask[:, 20:40] = False
    mask[20:40, 20:40] = torch.ones(20, 20, dtype=torch.bool).tril()
    r = 2
    golden = torch.nn.functional.scaled_dot_product_attention(
        q4.double(), k3.double()[:, None].expand(-1, r, -1, -1), v3.double()[:, None].expand(-1, r, -1, -1),
        attn_mask=mask, scale=0.25)
    assert_close(out, golden, dtype=torch.float32, msg="folded blocks vs one pass")
    scores = (q4.double() @ k3.double()[:, None].transpose(-1, -2)) * 0.25
    expected_lse2 = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1) / math.log(2)
    assert_close(lse2, expected_lse2, dtype=torch.float32, msg="log-sum-exp")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_native_backward_matches_the_pure_backward(shape, causal, gen, native_ops):
    Nb, r, L, S, E, Ev, bq, bk = shape
    q4, k3, v3 = _inputs(gen, Nb, r, L, S, E, Ev)
    dout = torch.randn(Nb, r, L, Ev, generator=gen)
    scale = 1 / math.sqrt(E)
    out, lse2 = dense.forward_eager(q4, k3, v3, None, None, causal, scale * dense.LOG2E, bq, bk)
    native = [torch.zeros_like(t) for t in (q4, k3, v3)]
    native_ops.flash_backward_(dout, q4, k3, v3, lse2, (dout * out).sum(-1), *native, None, None, scale, causal, 0, bq, bk)
    eager = dense.backward_eager(dout, q4, k3, v3, out, lse2, None, None, causal, scale, bq, bk)
    # and against autograd through float64 SDPA
    qd, kd, vd = (t.double().requires_grad_(True) for t in (q4, k3, v3))
    golden = torch.nn.functional.scaled_dot_product_attention(
        qd, kd[:, None].expand(-1, r, -1, -1), vd[:, None].expand(-1, r, -1, -1), is_causal=causal)
    golden.backward(dout.double())
    for name, n, e, g in zip(("dq", "dk", "dv"), native, eager, (qd.grad, kd.grad, vd.grad)):
        assert_close(n, g, dtype=torch.float32, msg=f"native {name} vs float64 autograd")
        assert_close(n, e, msg=f"native {name} vs pure {name}")


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("offset", [0, 20, -7], ids=["top_left", "bottom_right", "negative"])
@pytest.mark.parametrize("Nb", [1, 3])
def test_the_backward_cut_over_keys_matches_on_any_thread_count(Nb, threads, offset, gen, native_ops):
    """Key/value heads that do not share out evenly over the threads (one head; three on two
    threads): the keys are cut into chunks so every thread works, each thread past the first adds
    its dQ into a copy of its own, summed at the end. The gradients match float64 autograd (causal
    at any offset, a group of 3 query heads) and the same call on one thread."""
    r, L, S, E, Ev, bq, bk = 3, 70, 90, 8, 12, 16, 8
    q4, k3, v3 = _inputs(gen, Nb, r, L, S, E, Ev)
    dout = torch.randn(Nb, r, L, Ev, generator=gen)
    scale = 1 / math.sqrt(E)
    out, lse2 = dense.forward_eager(q4, k3, v3, None, None, True, scale * dense.LOG2E, bq, bk, offset=offset)
    delta = (dout * out).sum(-1)
    before = torch.get_num_threads()

    def grads(n_threads):
        torch.set_num_threads(n_threads)
        try:
            got = [torch.zeros_like(t) for t in (q4, k3, v3)]
            native_ops.flash_backward_(dout, q4, k3, v3, lse2, delta, *got, None, None, scale, True, offset, bq, bk)
            return got
        finally:
            torch.set_num_threads(before)

    qd, kd, vd = (t.double().requires_grad_(True) for t in (q4, k3, v3))
    visible = torch.ones(L, S, dtype=torch.bool).tril(offset)
    golden = torch.nn.functional.scaled_dot_product_attention(
        qd, kd[:, None].expand(-1, r, -1, -1), vd[:, None].expand(-1, r, -1, -1), attn_mask=visible)
    golden = torch.where(visible.any(-1)[:, None], golden, 0.0)  # rows that see no key: no gradient
    golden.backward(dout.double())
    one = grads(1)
    for name, n, o, g in zip(("dq", "dk", "dv"), grads(threads), one, (qd.grad, kd.grad, vd.grad)):
        assert_close(n, g, dtype=torch.float32, msg=f"{name} on {threads} threads vs float64 autograd")
        assert_close(n, o, msg=f"{name} on {threads} threads vs one thread")


@pytest.mark.parametrize("offset", [0, 30, -9], ids=["top_left", "bottom_right", "negative"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_forward_s_task_order_and_walks_give_one_answer_on_any_thread_count(causal, offset, gen, native_ops):
    """The forward hands out a head's tasks together, costliest first, and under causality every
    other task walks its key blocks backwards (for L2): each task's direction comes from its place
    in that order, so the output is the same to the bit on 1, 2 and 3 threads, and matches float64
    SDPA (3 key/value heads of 2 query heads, 6 query tiles against 7 key blocks, causal at any
    offset, and not)."""
    Nb, r, L, S, E, Ev, bq, bk = 3, 2, 90, 100, 16, 8, 16, 16
    q4, k3, v3 = _inputs(gen, Nb, r, L, S, E, Ev)
    scale = 1 / math.sqrt(E)
    before = torch.get_num_threads()

    def forward(n_threads):
        torch.set_num_threads(n_threads)
        try:
            return native_ops.flash_forward(q4, k3, v3, None, None, scale * dense.LOG2E, causal, offset, bq, bk, False,
                                            _native.sgemm_route().code)
        finally:
            torch.set_num_threads(before)

    visible = torch.ones(L, S, dtype=torch.bool).tril(offset) if causal else torch.ones(L, S, dtype=torch.bool)
    golden = torch.nn.functional.scaled_dot_product_attention(
        q4.double(), k3.double()[:, None].expand(-1, r, -1, -1), v3.double()[:, None].expand(-1, r, -1, -1),
        attn_mask=visible)
    golden = torch.where(visible.any(-1)[:, None], golden, 0.0)  # rows that see no key: 0, as SDPA's is_causal
    one, _ = forward(1)
    assert_close(one, golden, dtype=torch.float32, msg="one thread vs float64 SDPA")
    for threads in (2, 3):
        out, _ = forward(threads)
        assert torch.equal(out, one), f"{threads} threads differ from one: {(out - one).abs().max()}"


def test_native_backward_adds_into_views(gen, native_ops):
    """accumulate_into with views of bigger tensors, as the ring's backward does."""
    q4, k3, v3 = _inputs(gen, 2, 1, 40, 40, 8, 8)
    dout = torch.randn(2, 1, 40, 8, generator=gen)
    out, lse2 = dense.forward_eager(q4, k3, v3, None, None, True, 0.3 * dense.LOG2E, 16, 16)
    big = [torch.ones(2, 1, 60, 8), torch.ones(2, 70, 8), torch.ones(2, 70, 8)]
    views = (big[0][:, :, 10:50], big[1][:, 20:60], big[2][:, 20:60])
    dense.backward(dout, q4, k3, v3, out, lse2, None, None, True, 0.3, 16, 16, accumulate_into=views)
    eager = dense.backward_eager(dout, q4, k3, v3, out, lse2, None, None, True, 0.3, 16, 16)
    for view, e in zip(views, eager):
        assert_close(view - 1, e, msg="added into the view")
    assert (big[1][:, :20] == 1).all() and (big[1][:, 60:] == 1).all()  # nothing outside the view


def _masks(gen, B, H, L, S):
    """Masks in the shapes and layouts the kernels must read in place."""
    full = torch.rand(B, H, L, S, generator=gen) > 0.3
    full[0, 0, 3] = False  # an empty row
    full[1, :, 10:20] = False  # a block of empty rows in every head
    return {
        "bool_LS": torch.rand(L, S, generator=gen) > 0.5,
        "bool_B1LS": torch.rand(B, 1, L, S, generator=gen) > 0.5,
        "bool_1HLS": torch.rand(1, H, L, S, generator=gen) > 0.5,
        "bool_BHLS_empty_rows": full,
        "bool_transposed": (torch.rand(S, L, generator=gen) > 0.5).t(),  # stride along S is L, not 1
        "bool_L1": torch.rand(L, 1, generator=gen) > 0.2,  # broadcast along S: stride 0
        "float_LS": torch.randn(L, S, generator=gen),
        "float_B1LS_neginf": torch.randn(B, 1, L, S, generator=gen).masked_fill(torch.rand(B, 1, L, S, generator=gen) > 0.7,
                                                                             float("-inf")),
    }


MASK_NAMES = list(_masks(torch.Generator().manual_seed(0), 2, 4, 30, 40))


@pytest.mark.parametrize("name", MASK_NAMES)
def test_native_masks_match_the_pure_code(name, gen, monkeypatch, native_ops):
    """Bool and float masks, broadcast and strided, read in place by both native kernels."""
    B, H, Hkv, L, S = 2, 4, 2, 30, 40
    mask = _masks(gen, B, H, L, S)[name]
    q = torch.randn(B, H, L, 16, generator=gen)
    k = torch.randn(B, Hkv, S, 16, generator=gen)
    v = torch.randn(B, Hkv, S, 8, generator=gen)
    dout = torch.randn(B, H, L, 8, generator=gen)

    def run():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = tiled.flash_attention(*leaves, mask, enable_gqa=True, block_q=8, block_k=16)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    native = run()
    with monkeypatch.context() as m:
        m.setattr(dense, "native_ops", lambda *a: None)
        pure = run()
    for what, a, b in zip(("output", "dq", "dk", "dv"), native, pure):
        assert torch.isfinite(a).all(), what
        assert_close(a, b, msg=f"{name}: native {what} vs pure {what}")
    if name == "bool_BHLS_empty_rows":
        assert (native[0][0, 0, 3] == 0).all() and (native[0][1, :, 10:20] == 0).all()  # empty rows give 0


_PORTABLE_CHECK = textwrap.dedent("""
    import torch
    from attnlab.kernels import native as _native
    _native._CFLAGS = _native._CFLAGS + EXTRA_CFLAGS
    print("LIBRARY", _native._cache_dir())
    from attnlab import tiled
    from attnlab.decoding import decode_attention
    from attnlab.testing import assert_close
    assert tiled.native_status().available, str(tiled.native_status())
    g = torch.Generator().manual_seed(0)
    for causal, use_mask in [(False, False), (True, False), (False, True)]:
        q = torch.randn(2, 4, 70, 32, generator=g, requires_grad=True)
        k = torch.randn(2, 2, 90, 32, generator=g, requires_grad=True)
        v = torch.randn(2, 2, 90, 16, generator=g, requires_grad=True)
        mask = torch.rand(2, 1, 70, 90, generator=g) > 0.4 if use_mask else None
        out = tiled.flash_attention(q, k, v, mask, is_causal=causal, enable_gqa=True, block_q=32, block_k=48)
        go = torch.randn_like(out)
        out.backward(go)
        qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, mask, is_causal=causal, enable_gqa=True)
        ref.backward(go.double())
        assert_close(out, ref, dtype=torch.float32, msg="portable output")
        for a, b in zip((q, k, v), (qd, kd, vd)):
            assert_close(a.grad, b.grad, dtype=torch.float32, msg="portable gradient")
    for dtype in (torch.float32, torch.bfloat16):  # decoding, and the bf16 GEMMs widened
        q, k, v = (torch.randn(1, 8, n, 64, generator=g).to(dtype) for n in (1, 300, 300))
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
        assert_close(decode_attention(q, k[:, :2], v[:, :2], enable_gqa=True).double(),
                     torch.nn.functional.scaled_dot_product_attention(q.double(), k[:, :2].double(),
                                                                      v[:, :2].double(), enable_gqa=True),
                     dtype=dtype, msg="portable decode")
        assert_close(tiled.flash_attention(q, k, v).double(), ref, dtype=dtype, msg="portable tiled")
    print("PORTABLE OK")
""")


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("build", ["without_avx512", "without_vector_units"])
def test_the_portable_kernel(tmp_path, build):
    """The builds the seam's stand-ins serve (csrc/isa/): a CPU without AVX-512 (isa::F8's row pass
    and 2^x) and one without AVX at all (isa::F1, the portable F8 and F16, no vector unit: the build
    of a CPU with none of x86's, as an aarch64 one), outputs, gradients, decoding and the bf16 route
    against float64 torch, and no zmm (no ymm) register in the library. Built here with
    -mno-avx512f or -mno-avx into a scratch cache; on a CPU without AVX-512 the first is the build
    every other test uses, and it is the one checked (not a second, 25 s build)."""
    avx512 = "avx512f" in _native.cpu_features()
    scratch = avx512 or build == "without_vector_units"
    flags = (["-mno-avx512f"] if avx512 else []) if build == "without_avx512" else ["-mno-avx", "-mno-fma", "-mno-f16c"]
    code = _PORTABLE_CHECK.replace("EXTRA_CFLAGS", repr(flags))
    env = {"ATTNLAB_CACHE_DIR": str(tmp_path / "cache")} if scratch else {}
    run = _run_python(code, ATTNLAB_NATIVE="1", **env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "PORTABLE OK" in run.stdout
    library = Path(run.stdout.split("LIBRARY ", 1)[1].split()[0]) / "attnlab_native.so"
    assert library.is_file() and (library.parent.parent == tmp_path / "cache") == scratch
    banned = b"zmm" if build == "without_avx512" else b"ymm"
    assert banned not in _disassembly(library)
    # the check is not vacuous: the same detector finds AVX code where there is some, also on a
    # machine without it (the compiler emits it when told to; nothing runs it)
    width, flag = ("512", "-mavx512f") if banned == b"zmm" else ("256", "-mavx")
    probe = tmp_path / "wide.c"
    probe.write_text(f"#include <immintrin.h>\n__m{width} twice(__m{width} x) {{ return _mm{width}_add_ps(x, x); }}\n")
    subprocess.run(["gcc", "-O2", flag, "-c", str(probe), "-o", str(tmp_path / "wide.o")], check=True)
    assert banned in _disassembly(tmp_path / "wide.o")


def _disassembly(path) -> bytes:
    return subprocess.run(["objdump", "-d", str(path)], capture_output=True, check=True).stdout


def test_one_predicate_answers_for_every_caller(force_routes, native_ops, monkeypatch):
    """native.can_run is the only "can the native kernels take this?": tiled, flex, the ring and
    decoding ask it (they gave four different answers: the ring took float32 only, flex bf16 too)."""
    from attnlab.kernels import native

    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    assert native.can_run(q, k, v)
    assert native.can_run(q, k, v, torch.ones(8, 8, dtype=torch.bool))
    assert not native.can_run(q, k, v, torch.ones(8, 8, dtype=torch.int64))  # an int mask: the pure path
    assert not native.can_run(q.double(), k.double(), v.double())
    nan = q.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert not native.can_run(nan, k, v)  # NaN propagates on the pure path, as in torch
    assert native.can_run(nan, k.bfloat16(), v.bfloat16(), cache=True)  # decoding flags them itself
    assert not native.can_run(q[..., :0], k[..., :0], v)  # E = 0
    assert not native.can_run(q, k.half(), v.half())  # mixed dtypes: only a cache is read as stored
    force_routes(bf16="fp32")
    assert not native.can_run(q.bfloat16(), k.bfloat16(), v.bfloat16())
    force_routes(bf16="bf16-emulated")
    assert native.can_run(q.bfloat16(), k.bfloat16(), v.bfloat16())
    from attnlab import distributed, tiled
    from attnlab.kernels import block_sparse
    import inspect

    for module in (tiled, dense, block_sparse, distributed, native):  # nobody else writes the dtype rules out
        assert "torch.float32, torch.bfloat16)" not in inspect.getsource(module).replace(
            inspect.getsource(native.can_run), ""), module.__name__
