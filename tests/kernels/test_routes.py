"""The native layer's switches read once, forced by a context manager, and explained per call
(issue 49, item 1)."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.kernels import decode as kernel_decode
from attnlab.kernels import native as _native
from attnlab.kernels import routes


def test_the_environment_is_read_once(monkeypatch):
    before = routes.settings()
    monkeypatch.setenv("ATTNLAB_DECODE", "gemm")
    assert routes.settings() is before  # a later change of the environment changes nothing...
    assert kernel_decode.loop(1) == ("stream" if before.decode == "auto" else before.decode)
    try:
        assert routes.reload().decode == "gemm"  # ...until the program asks for it again
        assert kernel_decode.loop(1) == "gemm"
    finally:
        monkeypatch.delenv("ATTNLAB_DECODE")
        routes.reload()
    assert routes.settings().decode == "auto"


def test_forced_changes_a_block_and_restores_what_was_before():
    before = routes.settings()
    with routes.forced(decode="gemm", int8_dot="float32") as now:
        assert routes.settings() is now and (now.decode, now.int8_dot) == ("gemm", "float32")
        assert kernel_decode.loop(1) == "gemm"
        with routes.forced(decode="stream"):
            assert kernel_decode.loop(10_000) == "stream" and routes.settings().int8_dot == "float32"
        assert routes.settings().decode == "gemm"
    assert routes.settings() is before
    with pytest.raises(ValueError, match="ATTNLAB_DECODE must be one of auto, stream, gemm, got 'fast'"):
        with routes.forced(decode="fast"):
            pass
    with pytest.raises(ValueError, match="the switches are native, isa, bf16, sgemm, decode, int8_dot, huge_pages, got speed"):
        with routes.forced(speed="max"):
            pass
    assert routes.settings() is before


def test_a_decode_call_is_planned_once_and_the_kernel_gets_the_plan(force_routes, monkeypatch):
    """(The pure path plans its call too: this holds with ATTNLAB_NATIVE=0.)"""
    force_routes(decode="stream", int8_dot="float32")
    plans = []
    real = kernel_decode.plan
    monkeypatch.setattr(kernel_decode, "plan", lambda *a: plans.append(real(*a)) or plans[-1])
    from attnlab.decoding import decode_attention, quantize

    (k8, ks), (v8, vs) = quantize(torch.randn(1, 2, 40, 16)), quantize(torch.randn(1, 2, 40, 16))
    decode_attention(torch.randn(1, 4, 1, 16), k8, v8, enable_gqa=True, k_scale=ks, v_scale=vs)
    assert [(p.rows, p.loop, p.int8_dot) for p in plans] == [(2, "stream", "float32")]
    assert plans[0].dots == "int8 widened to float32 FMAs"


def test_explain_names_a_bf16_cache_s_instructions_and_the_value_pass(force_routes):
    """A bf16 query against a bf16 cache (decoding widens the query, and its bf16 output lets the
    value pass round P): vdpbf16ps for the scores and the values where the build has the bf16
    units and the bf16 route is on, else widened FMAs; a float32 output would keep float32 weights."""
    if _native.ops() is None:
        assert routes.explain(torch.randn(1, 8, 1, 64), torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64),
                              cache=True).startswith("the pure-PyTorch path")
        return
    q, k = torch.randn(1, 8, 1, 64).bfloat16(), torch.randn(1, 2, 512, 64).bfloat16()
    force_routes(decode="stream", bf16="bf16")
    units = bool(_native.ops().bf16_units())
    text = routes.explain(q, k, k, cache=True)
    assert ("dot products: vdpbf16ps on the stored bf16, values on vdpbf16ps (P rounded to bf16)" in text) == units, text
    assert ("dot products: bf16 widened to float32 FMAs" in text) == (not units), text
    force_routes(bf16="fp32")
    assert "dot products: bf16 widened to float32 FMAs" in routes.explain(q, k, k, cache=True)


def test_explain_names_the_route_of_a_call(force_routes):
    q, k = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 512, 64)
    text = routes.explain(q, k, k, cache=True)
    if _native.ops() is None:
        assert text.startswith("the pure-PyTorch path")
        return
    assert text.startswith("native kernels; float32 GEMM: ")
    assert "decode: stream loop (4 rows per key/value head), dot products: float32 FMAs" in text
    force_routes(decode="gemm")
    assert "decode: gemm loop (4 rows per key/value head)" in routes.explain(q, k, k, cache=True)
    force_routes(bf16="fp32")  # bf16 inputs widened to float32 for the same kernels
    assert "bfloat16 route: fp32 (forced by ATTNLAB_BF16=fp32)" in routes.explain(q.bfloat16(), k.bfloat16(),
                                                                                  k.bfloat16())
    assert routes.explain(q.double(), k.double(), k.double()) == \
        "the pure-PyTorch path (the native kernels do not take these operands)"
    force_routes(bf16="bf16-emulated")
    assert "bfloat16 route: bf16-emulated (forced by ATTNLAB_BF16=bf16-emulated" in routes.explain(
        q.bfloat16(), k.bfloat16(), k.bfloat16())


def test_a_plan_and_the_routes_are_decided_once_per_setting(force_routes, monkeypatch):
    """A call's fixed cost (issue 49, item 5): the same shape under the same settings gets the same
    plan without asking the library again; other settings get their own."""
    force_routes(decode="auto", bf16="auto")
    first = kernel_decode.plan(16, 128, torch.bfloat16, torch.bfloat16)
    asked = []
    monkeypatch.setattr(kernel_decode, "bf16_dot", lambda *a: asked.append(a) or "float32")
    assert kernel_decode.plan(16, 128, torch.bfloat16, torch.bfloat16) is first and asked == []
    assert _native.bf16_route() is _native.bf16_route() and _native.sgemm_route() is _native.sgemm_route()
    monkeypatch.undo()
    force_routes(bf16="fp32")
    assert kernel_decode.plan(16, 128, torch.bfloat16, torch.bfloat16).bf16_dot == "float32"
    assert _native.bf16_route().name == "fp32"
    force_routes(bf16="auto")
    assert kernel_decode.plan(16, 128, torch.bfloat16, torch.bfloat16) == first


def test_the_decode_kernel_without_gradients_skips_autograd_and_with_them_refuses_a_backward():
    """kernel.forward calls the op below its autograd layer when no gradient is asked for; an input
    that requires one still meets the op's refusal by name (decoding has no backward)."""
    from attnlab.kernels.decode import forward
    from attnlab.testing import assert_close

    g = torch.Generator().manual_seed(4)
    q4 = torch.randn(2, 2, 1, 16, generator=g, requires_grad=True)  # (Nb, r, L, E)
    k, v = torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g)  # (Nb, S, E)
    with torch.no_grad():
        out, lse2, _ = forward(q4, k, v, Hkv=2, S=40, scale2=0.3)
    assert out.grad_fn is None and not out.requires_grad
    scores = q4.detach().double() @ k.double().unsqueeze(1).transpose(-1, -2) * (0.3 * math.log(2))  # (Nb, r, 1, S)
    assert_close(out, torch.softmax(scores, dim=-1) @ v.double().unsqueeze(1), dtype=torch.float32)
    if _native.ops() is None:
        return  # the pure path: no op to refuse
    real, below = _native.ops(), []

    class Spy:  # the op as kernel.forward calls it, and whether autograd's keys were off then
        def __getattr__(self, name):
            return getattr(real, name)

        def decode_forward(self, *args):
            below.append(torch._C._dispatch_tls_local_exclude_set().has(torch._C.DispatchKey.AutogradOther))
            return real.decode_forward(*args)

    spy = Spy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "ops", lambda: spy)
        forward(q4.detach(), k, v, Hkv=2, S=40, scale2=0.3)  # no input wants a gradient
        with torch.no_grad():
            forward(q4, k, v, Hkv=2, S=40, scale2=0.3)  # none is asked for
        out, lse2, _ = forward(q4, k, v, Hkv=2, S=40, scale2=0.3)  # q4 wants one: through autograd
    assert below == [True, True, False]
    assert out.grad_fn is not None
    with pytest.raises(RuntimeError, match="decode_forward has no backward"):
        out.sum().backward()
