"""The native ops as torch ops that tracing understands (issue 50, item 3): each has a fake
kernel (``attnlab.kernels.fake``), ``torch.library.opcheck`` passes on it with the arguments
attnlab's own paths pass, and ``torch.compile(fullgraph=True)`` of a function that calls one
has no graph break and gives the eager values. Without the fakes, Dynamo stops at every op
("no fake impl"). ``flash_forward`` is differentiable as an op (``attnlab.kernels.op_autograd``):
its gradients, through out and lse2, against float64, eager and compiled (without the
registration those three tests fail: "does not require grad")."""

from __future__ import annotations

import math

import pytest
import torch
from torch.library import opcheck

from attnlab import tiled
from attnlab.decoding import decode_attention
from attnlab.flex import create_block_mask, flex_attention
from attnlab.kernels import dense, fake
from attnlab.kernels import native as _native
from attnlab.testing import assert_close

pytestmark = pytest.mark.subprocess  # compiles (Inductor's C++ on this CPU): seconds, not milliseconds


@pytest.fixture
def captured(monkeypatch):
    """{op name: the first arguments attnlab's own code called it with}, recorded through a
    stand-in for the ops namespace; a test that needs the native ops fails (never skips)."""
    if not tiled.native_status().available:
        pytest.fail(str(tiled.native_status()))
    real, status = _native._get()
    calls: dict[str, tuple] = {}

    class Recorder:
        def __getattr__(self, name):
            op = getattr(real, name)

            def call(*args):
                calls.setdefault(name, tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
                return op(*args)
            return call

    monkeypatch.setattr(_native, "_state", (Recorder(), status))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 33, 16, generator=g, requires_grad=True) for _ in range(3))
    tiled.flash_attention(q, k, v, is_causal=True).sum().backward()
    q4, k3, v3 = q.detach()[0][:, None], k.detach()[0], v.detach()[0]  # (Nb=2, r=1, L, E), (Nb, S, E)
    out, lse2 = torch.zeros(2, 1, 33, 16), torch.full((2, 1, 33), float("-inf"))
    dense.forward_into(q4.contiguous(), k3.contiguous(), v3.contiguous(), out, lse2, False, 1 / 4 / math.log(2), 64, 64)
    mask = create_block_mask(lambda b, h, i, j: (i - j).abs() <= 40, None, None, 160, 160, BLOCK_SIZE=32)
    qf, kf, vf = (torch.randn(1, 2, 160, 16, generator=g, requires_grad=True) for _ in range(3))
    flex_attention(qf, kf, vf, block_mask=mask).sum().backward()
    decode_attention(torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 300, 16, generator=g),
                     torch.randn(1, 2, 300, 16, generator=g), enable_gqa=True)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
    Recorder().tile_gemm_(a, b, torch.zeros(8, 8), False, False, 1.0, 0.0, 0)
    Recorder().tile_gemm_bf16_(a.bfloat16(), b.bfloat16(), torch.zeros(8, 8), False, False, 1.0, 0.0,
                               bool(real.bf16_units()))
    return calls


def test_every_op_with_tensors_has_a_fake_and_attnlab_calls_each(captured):
    assert set(captured) == set(fake.FAKED), sorted(captured)


@pytest.mark.parametrize("name", fake.FAKED)
def test_opcheck_passes_on_each_native_op(captured, name):
    """Schema (what it mutates), fake tensor (the fake's shapes and dtypes equal the real op's),
    autograd registration and AOT dispatch, on the arguments attnlab's own path passed."""
    op = getattr(torch.ops.attnlab_native, name).default
    result = opcheck(op, captured[name])
    assert set(result.values()) == {"SUCCESS"}, result


def test_a_compiled_function_of_the_native_forward_has_no_graph_break(captured):
    q4, k3, v3, *rest = captured["flash_forward"]

    def f(q4, k3, v3):
        out, lse2 = torch.ops.attnlab_native.flash_forward(q4, k3, v3, *rest)
        return out * 2.0, lse2 - 1.0

    eager = f(q4, k3, v3)
    explained = torch._dynamo.explain(f)(q4, k3, v3)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(f, fullgraph=True)(q4, k3, v3)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


# --------------------------------------------------------------------------- the op's autograd
def _op_inputs(g, Nb=2, r=2, L=37, S=45, E=16, Ev=8):
    return (torch.randn(Nb, r, L, E, generator=g, requires_grad=True), torch.randn(Nb, S, E, generator=g,
            requires_grad=True), torch.randn(Nb, S, Ev, generator=g, requires_grad=True))


def _reference(q4, k3, v3, scale, causal):
    """float64 (out, lse2) by autograd-able formulas: the golden for the op's gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q4, k3, v3))
    s = torch.einsum("nrle,nse->nrls", q, k) * scale  # (Nb, r, L, S)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return (q, k, v), torch.softmax(s, dim=-1) @ v.unsqueeze(1), torch.logsumexp(s, dim=-1) / math.log(2)


@pytest.mark.parametrize("causal", [False, True])
def test_the_native_forward_op_is_differentiable_through_out_and_lse(causal, captured):
    """Gradients of a loss on out and on lse2 (base 2) against float64 autograd of the formulas."""
    g = torch.Generator().manual_seed(1)
    q4, k3, v3 = _op_inputs(g)
    scale = 1 / math.sqrt(q4.shape[-1])
    out, lse2 = torch.ops.attnlab_native.flash_forward(q4, k3, v3, None, None, scale / math.log(2), causal, 0, 16, 16)
    w, u = torch.randn(out.shape, generator=g), torch.randn(lse2.shape, generator=g)
    got = torch.autograd.grad((out * w).sum() + (lse2 * u).sum(), (q4, k3, v3))
    leaves, o, l2 = _reference(q4, k3, v3, scale, causal)
    expected = torch.autograd.grad((o * w.double()).sum() + (l2 * u.double()).sum(), leaves)
    for name, a, e in zip(("dq", "dk", "dv"), got, expected):
        assert_close(a, e, dtype=torch.float32, msg=name)


def test_a_compiled_forward_and_backward_through_the_op_equal_eager(captured):
    g = torch.Generator().manual_seed(2)
    q4, k3, v3 = _op_inputs(g)

    def loss(q4, k3, v3):
        out, lse2 = torch.ops.attnlab_native.flash_forward(q4, k3, v3, None, None, 0.5, True, 0, 16, 16)
        return (out * out).sum() + lse2.sum()

    eager = torch.autograd.grad(loss(q4, k3, v3), (q4, k3, v3))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q4, k3, v3), (q4, k3, v3))
    for e, c in zip(eager, compiled):
        assert_close(c, e, dtype=torch.float32)


def test_the_block_sparse_op_is_differentiable_through_out_and_lse(captured):
    """``block_sparse_forward`` (flex's native kernels) as an op: the gradients of a loss on out and
    on lse2 against float64 autograd of the formulas under the same element mask (without its
    registration: "does not require grad")."""
    q4, k3, v3, *plan_and_rest = captured["block_sparse_forward"]
    q4, k3, v3 = (t.detach().clone().requires_grad_() for t in (q4, k3, v3))
    scale2 = plan_and_rest[8]  # after the plan (5), the table, row_of_head and cap
    out, lse2 = torch.ops.attnlab_native.block_sparse_forward(q4, k3, v3, *plan_and_rest)
    g = torch.Generator().manual_seed(3)
    w, u = torch.randn(out.shape, generator=g), torch.randn(lse2.shape, generator=g)
    got = torch.autograd.grad((out * w).sum() + (lse2 * u).sum(), (q4, k3, v3))
    i = torch.arange(q4.shape[2])
    keep = (i[:, None] - i[None, :]).abs() <= 40  # the captured call's mask_mod
    q, k, v = (t.detach().double().requires_grad_() for t in (q4, k3, v3))
    s = (torch.einsum("nrle,nse->nrls", q, k) * (scale2 * math.log(2))).masked_fill(~keep, float("-inf"))
    o, l2 = torch.softmax(s, dim=-1) @ v.unsqueeze(1), torch.logsumexp(s, dim=-1) / math.log(2)
    expected = torch.autograd.grad((o * w.double()).sum() + (l2 * u.double()).sum(), (q, k, v))
    for name, a, e in zip(("dq", "dk", "dv"), got, expected):
        assert_close(a, e, dtype=torch.float32, msg=name)


def test_the_decode_op_refuses_a_backward_by_name(captured):
    q4, k, v, *rest = captured["decode_forward"]
    q4 = q4.detach().clone().requires_grad_()
    out, lse2, _ = torch.ops.attnlab_native.decode_forward(q4, k, v, *rest)
    with pytest.raises(RuntimeError, match="decode_forward has no backward.*attnlab.tiled.flash_attention"):
        out.sum().backward()
