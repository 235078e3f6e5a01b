"""``tiled.flash_attention`` and ``decoding.decode_attention`` inside ``torch.compile`` and
``torch.export`` (issue 50, item 3). flash_attention:
under tracing it is one custom op (``attnlab::flash_attention``, its backward the op
``attnlab::flash_attention_backward``), so Dynamo sees no graph break (4 before, on the
kernels' data-dependent ``Tensor.item()``), ``fullgraph=True`` compiles forward and backward
with the eager values, ``torch.export`` keeps the op, and ``torch.library.opcheck`` passes on
both ops. decode_attention is one op too (``attnlab::decode_attention``, no backward, as eager
has none): 0 graph breaks (5 before) and the eager values, int8 caches included."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from attnlab import tiled
from attnlab.decoding import decode_attention, quantize
from attnlab.testing import assert_close

pytestmark = pytest.mark.subprocess  # Inductor compiles C++ on this CPU: seconds, not milliseconds


def _inputs(seed: int = 0):
    """q (2, 4, 33, 16), k and v (2, 2, 40, 16) (GQA: 2 query heads per key/value head), a bool mask."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 33, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 40, 16, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v, torch.rand(33, 40, generator=g) > 0.3


CASES = {"causal": dict(is_causal=True), "mask_gqa": dict(enable_gqa=True),
         "bottom_right": dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)}


@pytest.mark.parametrize("case", CASES)
def test_flash_attention_compiles_with_no_graph_break_forward_and_backward(case):
    q, k, v, mask = _inputs()
    kwargs = dict(CASES[case])
    if case == "mask_gqa":
        kwargs["attn_mask"] = mask
    if not kwargs.get("enable_gqa"):
        k, v = (t.detach().repeat_interleave(2, dim=1).requires_grad_() for t in (k, v))

    def f(q, k, v):
        return tiled.flash_attention(q, k, v, **kwargs)

    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    eager = f(q, k, v)
    eager_grads = torch.autograd.grad(eager.square().sum(), (q, k, v))
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    compiled_grads = torch.autograd.grad(compiled.square().sum(), (q, k, v))
    assert_close(compiled, eager)
    for name, c, e in zip(("dq", "dk", "dv"), compiled_grads, eager_grads):
        assert_close(c, e, msg=name)


def test_export_keeps_the_op():
    q, k, v, mask = _inputs()

    class Layer(torch.nn.Module):
        def forward(self, q, k, v):
            return tiled.flash_attention(q, k, v, mask, enable_gqa=True)

    program = torch.export.export(Layer(), (q, k, v))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert [t for t in targets if "getitem" not in t] == ["attnlab.flash_attention.default"], targets
    assert_close(program.module()(q, k, v), Layer()(q, k, v))


def test_opcheck_passes_on_the_forward_and_backward_ops():
    q, k, v, mask = _inputs()
    sinks = torch.randn(q.shape[1], requires_grad=True)
    for s in (None, sinks):  # without and with attention sinks
        args = (mask, False, None, True, 256, 256, 0)
        saved = [t.detach() for t in torch.ops.attnlab.flash_attention(q, k, v, *args, s)[1:]]  # out4, lse2, flags
        for op, inputs in ((torch.ops.attnlab.flash_attention.default, (q, k, v, *args, s)),
                           (torch.ops.attnlab.flash_attention_backward.default,
                            (torch.randn(2, 4, 33, 16), q.detach(), k.detach(), v.detach(), *args,
                             None if s is None else s.detach(), *saved))):
            result = opcheck(op, inputs)
            assert set(result.values()) == {"SUCCESS"}, (op, result)


@pytest.mark.parametrize("cache", ["float32", "int8"])
def test_decode_attention_compiles_with_no_graph_break(cache):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = (torch.randn(2, 2, 300, 16, generator=g) for _ in range(2))
    kwargs = {}
    if cache == "int8":
        (k, kwargs["k_scale"]), (v, kwargs["v_scale"]) = quantize(k), quantize(v)

    def f(q, k, v):
        return decode_attention(q, k, v, enable_gqa=True, **kwargs)

    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


def _compiled_equals_eager(f, *inputs):
    """f compiled with fullgraph=True: no graph break, and its output and input gradients equal eager's."""
    explained = torch._dynamo.explain(f)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    leaves = [t for t in inputs if t.requires_grad]
    eager = f(*inputs)
    eager_grads = torch.autograd.grad(eager.square().sum(), leaves)
    compiled = torch.compile(f, fullgraph=True)(*inputs)
    compiled_grads = torch.autograd.grad(compiled.square().sum(), leaves)
    assert_close(compiled, eager)
    for c, e in zip(compiled_grads, eager_grads):
        assert_close(c, e)


def test_the_front_door_compiles_with_fullgraph():
    """dispatch.attention read its default implementation from a context variable, which Dynamo
    cannot trace ("fails on a ContextVar.get", issue 50): now a constant at trace time."""
    from attnlab import dispatch

    q, k, v, mask = _inputs()
    _compiled_equals_eager(lambda q, k, v: dispatch.attention(q, k, v, mask, enable_gqa=True), q, k, v)


def test_multi_head_attention_compiles_with_fullgraph():
    from attnlab.modules import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(64, 4, num_kv_heads=2)
    x = torch.randn(2, 33, 64, requires_grad=True)
    _compiled_equals_eager(lambda x: layer(x, is_causal=True)[0], x)  # (output, weights=None)


@pytest.mark.parametrize("case", ["float32", "bfloat16", "finfo_min_mask", "sinks"])
def test_the_compiled_backward_runs_no_forward_and_equals_eager(case, monkeypatch):
    """The op's backward takes the forward's saved (out4, lse2) and route, as eager's does: during
    a compiled backward no forward kernel runs (before: one, under autograd), and the gradients
    equal eager's, on the bf16 route, on the natural-units path (a Hugging Face finfo.min mask) and
    with sinks."""
    from attnlab.kernels import dense

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    q, k, v = (torch.randn(1, 4, 40, 16, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = None
    if case == "finfo_min_mask":
        keep = torch.rand(1, 1, 40, 40, generator=g) > 0.4
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    sinks = torch.randn(4, generator=g).requires_grad_() if case == "sinks" else None

    def loss(q, k, v, sinks):
        out = tiled.flash_attention(q, k, v, mask, is_causal=mask is None, sinks=sinks)
        return (out.float() * torch.linspace(-1, 1, 16)).sum()

    leaves = (q, k, v) + ((sinks,) if sinks is not None else ())
    eager = torch.autograd.grad(loss(q, k, v, sinks), leaves)
    compiled_loss = torch.compile(loss, fullgraph=True)(q, k, v, sinks)
    calls = []
    for name in ("forward", "forward_eager"):
        original = getattr(dense, name)
        monkeypatch.setattr(dense, name, lambda *a, _f=original, **kw: calls.append(1) or _f(*a, **kw))
    compiled = torch.autograd.grad(compiled_loss, leaves)
    assert calls == [], f"the compiled backward ran {len(calls)} forward(s)"
    for e, c in zip(eager, compiled):
        assert_close(c.float(), e.float(), dtype=dtype)
