"""attnlab's attention math never calls torch's SDPA, softmax or attention helpers.

Two recorders watch every call: a TorchFunctionMode sees the Python-level torch
functions and Tensor methods (any alias: F.softmax, Tensor.softmax, torch.special...),
and a TorchDispatchMode sees the ATen kernels underneath, so a helper that reaches
softmax or SDPA indirectly is caught as well. Each recorder is first shown to catch
torch's own SDPA, so a silent recorder cannot make the test pass.
"""

import pytest
import torch

import attnlab
from attnlab.grading.sandbox.recorder import FunctionRecorder, KernelRecorder, banned as banned_calls
from attnlab.functional import attention_weights, scaled_dot_product_attention as attnlab_sdpa

def run_everything():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 3, 7, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 3, 7, 4, generator=g, requires_grad=True)
    mask = torch.rand(5, 7, generator=g) > 0.3
    outs = [
        attnlab_sdpa(q, k, v, enable_gqa=True),
        attnlab_sdpa(q, k, v, attn_mask=mask, dropout_p=0.2, enable_gqa=True),
        attnlab_sdpa(q, k, v, is_causal=True, scale=-0.3, enable_gqa=True),
        attnlab_sdpa(q.half(), k.half(), v.half(), attn_mask=mask.float(), enable_gqa=True).float(),
        attention_weights(q, k, enable_gqa=True).sum(-1, keepdim=True) * 0,
    ]
    sum(o.sum() for o in outs).backward()  # the backward pass too
    module = attnlab.SelfAttention(8, 4, 6)
    module(torch.randn(2, 5, 8), is_causal=True)[0].sum().backward()
    module.trace(torch.randn(2, 5, 8))
    attnlab.stable_softmax(torch.randn(3, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("Recorder", [FunctionRecorder, KernelRecorder])
def test_recorder_catches_torch_sdpa_and_softmax(Recorder):
    q = torch.randn(1, 2, 3, 4)
    with Recorder() as rec:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert banned_calls(rec.names), rec.names
    with Recorder() as rec:
        q.softmax(-1)
    assert banned_calls(rec.names), rec.names


@pytest.mark.parametrize("Recorder", [FunctionRecorder, KernelRecorder])
def test_attnlab_calls_neither_sdpa_nor_softmax(Recorder):
    with Recorder() as rec:
        run_everything()
    assert len(rec.names) > 50  # it really watched the computation
    assert banned_calls(rec.names) == []
