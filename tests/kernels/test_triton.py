"""attnlab's Triton kernels (issue 34, item 3) under Triton's CPU interpreter.

Every kernel runs here on the CPU with ``TRITON_INTERPRET=1`` (set by tests/conftest.py before
triton is imported): forward and backward against torch's SDPA with the shared rule
(:func:`attnlab.testing.assert_close_to_sdpa`), causal, GQA, sizes off the tile, special values,
the decode kernel, the front door's ``impl="triton"`` and the errors. Each family is shown to fail
on a kernel with one planted mistake (the source edited, the module loaded from a temp file), so
a passing suite means the kernels are right, not that the checks are blind.

On a GPU the same kernels compile for real; no test here claims a GPU result.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="make test installs triton (the dev extra); see pyproject.toml")

import attnlab.triton as at  # noqa: E402
from attnlab import dispatch, masks  # noqa: E402
from attnlab.functional import scaled_dot_product_attention as reference  # noqa: E402
from attnlab.testing import assert_close, assert_close_to_sdpa  # noqa: E402


@pytest.fixture(autouse=True)
def interpreter():
    assert at.interpreted(), "tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported"


@pytest.fixture(scope="module", autouse=True)
def no_dead_overflow_checks():
    """The interpreter as the grader's sandbox runs it: without the overflow checks it builds and
    drops (test_the_interpreter_s_overflow_checks_change_nothing_without_debug); put back after."""
    from triton.runtime import interpreter

    from attnlab.grading.sandbox.interpreter import drop_dead_overflow_checks

    before = interpreter.interpreter_builder.options
    drop_dead_overflow_checks()
    yield
    interpreter.interpreter_builder.options = before


def qkv(B, H, Hkv, L, S, E, Ev, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, E, generator=g).to(dtype), torch.randn(B, Hkv, S, E, generator=g).to(dtype),
            torch.randn(B, Hkv, S, Ev, generator=g).to(dtype))


# (B, H, Hkv, L, S, E, Ev): a tile exactly, sizes off the tile both ways, L > S and L < S, E not a
# power of two, Ev != E, grouped heads (r = 2 and MQA)
SHAPES = [
    (1, 1, 1, 16, 16, 16, 16),
    (1, 2, 2, 37, 45, 16, 16),
    (2, 4, 2, 33, 20, 24, 20),
    (1, 4, 1, 9, 70, 8, 12),
    (1, 2, 2, 1, 1, 4, 4),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_match_sdpa_fp32(shape, causal):
    q, k, v = qkv(*shape)
    gqa = shape[1] != shape[2]
    assert_close_to_sdpa(at.flash_attention, q, k, v, is_causal=causal, enable_gqa=gqa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_half_dtypes_match_sdpa(dtype, causal):
    # the interpreter widens the dots (UPCAST): checked here against torch's own half error
    q, k, v = qkv(1, 4, 2, 40, 33, 16, 16, dtype=dtype, seed=1)
    assert_close_to_sdpa(at.flash_attention, q, k, v, is_causal=causal, enable_gqa=True)


def test_scale_and_a_large_head():
    q, k, v = qkv(1, 1, 1, 20, 24, 64, 64, seed=2)
    assert_close_to_sdpa(at.flash_attention, q, k, v, scale=0.3)


def test_empty_cache_gives_zeros_as_sdpa():
    q, k, v = qkv(1, 2, 2, 5, 0, 8, 8)
    for causal in (False, True):
        out = at.flash_attention(q, k, v, is_causal=causal)
        assert out.shape == (1, 2, 5, 8)
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's, inside the interpreter, on the NaNs
@pytest.mark.parametrize("where", ["nan_query_row", "inf_key", "nan_value"])
def test_special_values_propagate_as_in_sdpa(where):
    q, k, v = qkv(1, 1, 1, 18, 20, 8, 8, seed=3)
    if where == "nan_query_row":
        q[0, 0, 3] = float("nan")
    elif where == "inf_key":
        k[0, 0, 17, 2] = float("inf")
    else:
        v[0, 0, 5, 1] = float("nan")
    ours = at.flash_attention(q, k, v)
    theirs = reference(q, k, v)
    assert torch.equal(ours.isnan(), theirs.isnan()), "NaN in the same places as SDPA"
    finite = ~theirs.isnan()
    assert_close(ours[finite], theirs[finite])


def test_gradients_flow_to_the_inputs_only_when_asked():
    q, k, v = qkv(1, 2, 2, 17, 17, 8, 8)
    q.requires_grad_()
    out = at.flash_attention(q, k, v, is_causal=True)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape and k.grad is None


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L", [1, 4, 16])
def test_decode_kernel_matches_the_reference(L, align):
    # two batches of a GQA group of 2, three chunks of 64 keys (the last 22: a block cut short), E != Ev
    # and neither a power of two: 24 programs, each simulated by Triton's interpreter on the CPU (300
    # keys and 8 heads made it 80, and these six cases took 118 s of the suite, 2026-12-03)
    q, k, v = qkv(2, 4, 2, L, 150, 32, 24, seed=4)
    with torch.no_grad():
        for causal in (False, True):
            ours = at.decode_attention(q, k, v, causal, enable_gqa=True, causal_align=align, chunk=64)
            mask = masks.causal(L, 150, align=align) if causal else None
            theirs = reference(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
            assert_close(ours, theirs.float())


def test_decode_kernel_half_and_empty():
    q, k, v = qkv(1, 4, 4, 2, 100, 16, 16, dtype=torch.bfloat16, seed=5)
    with torch.no_grad():
        ours = at.decode_attention(q, k, v, chunk=32)
        assert ours.dtype == torch.bfloat16
        assert_close(ours, reference(q.float(), k.float(), v.float()).bfloat16())
        empty = at.decode_attention(q, k[:, :, :0], v[:, :, :0])
        assert torch.equal(empty, torch.zeros_like(empty))


def test_front_door_takes_the_route_when_forced():
    q, k, v = qkv(1, 4, 2, 20, 30, 16, 16, seed=6)
    assert dispatch.choose_impl(q, k, v, impl="triton", enable_gqa=True) == "triton"
    assert dispatch.choose_impl(q, k, v, enable_gqa=True) != "triton"  # CPU tensors: never chosen by auto
    assert_close(dispatch.attention(q, k, v, is_causal=True, enable_gqa=True, impl="triton"),
                 reference(q, k, v, is_causal=True, enable_gqa=True))
    # bottom-right causality is an offset in the same kernel
    out = dispatch.attention(q, k, v, is_causal=True, enable_gqa=True, causal_align="bottom_right", impl="triton")
    assert_close(out, reference(q, k, v, attn_mask=masks.causal(20, 30, align="bottom_right"), enable_gqa=True))
    with pytest.raises(ValueError, match="impl='triton' was requested but it cannot run a tensor mask"):
        dispatch.attention(q, k, v, attn_mask=torch.ones(20, 30, dtype=torch.bool), enable_gqa=True, impl="triton")
    # issue 63: a score_mod ran silently dropped (52% off softcap's answer); now it is refused by name
    from attnlab import flex

    with pytest.raises(ValueError, match="impl='triton' was requested but it cannot run a score_mod"):
        dispatch.attention(q, k, v, score_mod=flex.softcap(5.0), enable_gqa=True, impl="triton")


def test_bad_input_is_named():
    q, k, v = qkv(1, 2, 2, 20, 30, 16, 16)
    with pytest.raises(ValueError, match="at most 16 query rows, got L=20"):
        with torch.no_grad():
            at.decode_attention(q, k, v)
    with pytest.raises(ValueError, match="4-D"):
        at.flash_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="causal_align"):
        with torch.no_grad():
            at.decode_attention(q[:, :, :2], k, v, causal_align="left")
    with pytest.raises(ValueError, match="no backward"):
        at.decode_attention(q[:, :, :2].requires_grad_(), k, v)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 1, 4, 4)
    assert "TRITON_INTERPRET=1" in at.why_unavailable(q)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        at.flash_attention(q, q, q)


# --- the checks are not blind: one planted mistake per family, each caught ----------------------

SOURCE = Path(at.__file__).with_name("kernels.py")
MUTANTS = {
    # the online softmax's stale max: acc summed under an old max, never rescaled
    "stale_max": ("acc = acc * alpha[:, None] + _dot(", "acc = acc + _dot("),
    "l_not_rescaled": ("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)"),
    "causal_diagonal": ("cols[None, :] <= rows[:, None] + offset", "cols[None, :] < rows[:, None] + offset"),
    "wrong_D": ("ds = p * (dp - d[:, None])", "ds = p * dp"),
    "dS_without_scale": ("dk += _dot(tl.trans(ds), q, UPCAST) * scale", "dk += _dot(tl.trans(ds), q, UPCAST)"),
    "gqa_heads": ("hk = h // (H // Hkv)  # the group's key/value head", "hk = h % Hkv"),
}


@pytest.fixture
def mutant(request, monkeypatch, tmp_path):
    before, after = MUTANTS[request.param]
    text = SOURCE.read_text()
    assert before in text, f"the mutation {request.param!r} no longer applies to kernels.py"
    path = tmp_path / f"mutant_{request.param}.py"
    path.write_text(text.replace(before, after))
    spec = importlib.util.spec_from_file_location(f"attnlab_triton_mutant_{request.param}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "attnlab.triton.kernels", module)
    monkeypatch.setattr(at, "kernels", module, raising=False)
    return request.param


@pytest.mark.parametrize("mutant", sorted(MUTANTS), indirect=True)
def test_a_broken_kernel_fails_the_checks(mutant):
    # GQA, causal and sizes off the tile in one case, so every planted mistake shows
    q, k, v = qkv(1, 4, 2, 37, 45, 16, 16, seed=7)
    with pytest.raises(AssertionError):
        assert_close_to_sdpa(at.flash_attention, q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("L,S", [(20, 30), (30, 20)])
def test_bottom_right_causality_matches_the_tiled_kernel(L, S):
    # L > S: the first L - S rows see no key and give 0, as attnlab's other paths do
    q, k, v = qkv(1, 2, 1, L, S, 16, 8, seed=8)
    q.requires_grad_()
    ours = at.flash_attention(q, k, v, True, enable_gqa=True, causal_align="bottom_right")
    theirs = dispatch.attention(q, k, v, is_causal=True, enable_gqa=True, causal_align="bottom_right", impl="tiled")
    assert_close(ours, theirs)
    g_ours, = torch.autograd.grad(ours.sum(), q)
    g_theirs, = torch.autograd.grad(theirs.sum(), q)
    assert_close(g_ours, g_theirs)


def test_the_interpreter_s_overflow_checks_change_nothing_without_debug(monkeypatch):
    """Triton's interpreter builds an int64 overflow check for each integer +, -, * when
    ``sanitize_overflow`` is set, but asserts it only under ``debug``, which the interpreter never
    sets: an int32 sum that wraps gives the same answer, and no error, with the checks and without
    them (which is why the grader's sandbox drops them: interpreter.drop_dead_overflow_checks). The
    check is live only with ``debug``: then the same kernel fails (so this test can see one)."""
    import dataclasses

    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def wrap(X, a):
        tl.store(X + tl.arange(0, 2), a + 1 + tl.arange(0, 2))

    builder = interpreter.interpreter_builder
    assert builder.options.debug is False
    answers = {}
    for sanitize in (True, False):
        monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=sanitize))
        out = torch.zeros(2, dtype=torch.int32)
        wrap[(1,)](out, 2**31 - 1)
        answers[sanitize] = out.tolist()
    assert answers[True] == answers[False] == [-(2**31), -(2**31) + 1], answers
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=True, debug=True))
    with pytest.raises(Exception, match="overflow"):
        wrap[(1,)](torch.zeros(2, dtype=torch.int32), 2**31 - 1)


@pytest.mark.parametrize("tile", sorted(set(at.GPU_TILES.values())), ids=lambda t: f"{t.BQ}x{t.BK}w{t.num_warps}")
def test_the_gpu_tiles_are_right_off_the_tile(monkeypatch, tile):
    # the GPU's tiles (BQ != BK, several key tiles a query tile) run here under the interpreter,
    # on lengths that are no multiple of either and GQA, so a GPU result is only a speed question
    monkeypatch.setattr(at, "tiles", lambda q, v, stage: tile)
    L, S = 2 * tile.BQ + 5, tile.BK + 3 * 16 + 7
    q, k, v = qkv(1, 4, 2, L, S, 16, 24, seed=9)
    for causal in (False, True):
        assert_close_to_sdpa(at.flash_attention, q, k, v, is_causal=causal, enable_gqa=True)
    # bottom-right causality (keys S - L + i and before), against the tiled kernel
    q.requires_grad_()
    ours = at.flash_attention(q, k, v, True, enable_gqa=True, causal_align="bottom_right")
    theirs = dispatch.attention(q, k, v, is_causal=True, enable_gqa=True, causal_align="bottom_right", impl="tiled")
    assert_close(ours, theirs)
    assert_close(torch.autograd.grad(ours.sum(), q)[0], torch.autograd.grad(theirs.sum(), q)[0])


def test_tiles_by_device_and_class(monkeypatch):
    q, v = torch.zeros(1, 1, 4, 64), torch.zeros(1, 1, 4, 64)
    assert at.tiles(q, v, "fwd") == at.INTERPRETED_TILES  # the CPU: the interpreter's
    monkeypatch.setattr(at, "interpreted", lambda: False)
    on_gpu = [(torch.bfloat16, 64, "half64"), (torch.float16, 80, "half128"), (torch.float16, 128, "half128"),
              (torch.bfloat16, 200, "half256"), (torch.bfloat16, 512, "huge"), (torch.float32, 64, "wide"),
              (torch.float32, 256, "wide256"), (torch.float32, 257, "huge")]
    for dtype, E, klass in on_gpu:
        q = torch.zeros(1, 1, 4, E, dtype=dtype, device="meta")
        for stage in ("fwd", "bwd"):
            with monkeypatch.context() as m:
                m.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
                assert at.tiles(q, q, stage) == at.GPU_TILES[(klass, stage)], (dtype, E, stage)


def test_the_graders_element_types_are_the_interpreters():
    """The grader's guards (``attnlab.grading.sandbox.interpreter``) size each load and store by the
    element type's numpy dtype from a map of their own, not the interpreter's private
    ``_get_np_dtype``; here the two agree on every type Triton has (a Triton upgrade that stores a type
    differently fails here, not in a learner's grade)."""
    import triton.language as tl
    from triton.runtime import interpreter

    from attnlab.grading.sandbox.interpreter import _np_dtype

    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
               tl.float8e4b8, tl.float8e4b15]
    types = scalars + [tl.pointer_type(t) for t in scalars] + [tl.block_type(t, [4]) for t in scalars] + \
        [tl.block_type(tl.pointer_type(t), [4]) for t in scalars]
    for t in types:
        assert _np_dtype(t) == interpreter._get_np_dtype(t), t  # noqa: SLF001 (the oracle, in a test only)
