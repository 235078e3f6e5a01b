"""Bad input gets a clear TypeError/ValueError naming the argument, expected vs actual."""

import re

import pytest
import torch

from attnlab.functional import attention_weights, scaled_dot_product_attention as sdpa

q3 = torch.randn(2, 3, 4)
k3 = torch.randn(2, 5, 4)
v3 = torch.randn(2, 5, 6)
q4 = torch.randn(2, 6, 3, 4)


def raises(exc, *fragments):
    """pytest.raises that also checks every fragment occurs in the message."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def test_rank_below_two():
    with raises(ValueError, "query", "at least 2-D", "(4,)"):
        sdpa(torch.randn(4), torch.randn(5, 4), torch.randn(5, 4))
    with raises(ValueError, "value", "at least 2-D", "(5,)"):
        sdpa(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5))


def test_feature_size_of_key_differs_from_query():
    with raises(ValueError, "key", "E=4", "(..., S, 4)", "(2, 5, 3)"):
        sdpa(q3, torch.randn(2, 5, 3), v3)


def test_value_rows_differ_from_key_rows():
    with raises(ValueError, "value", "S=5", "(..., 5, Ev)", "(2, 4, 6)"):
        sdpa(q3, k3, torch.randn(2, 4, 6))


def test_dtypes_differ():
    with raises(TypeError, "key.dtype", "torch.float32", "torch.float64"):
        sdpa(q3, k3.double(), v3)
    with raises(TypeError, "value.dtype", "torch.float32", "torch.float16"):
        sdpa(q3, k3, v3.half())


def test_non_floating_and_non_tensor_inputs():
    with raises(TypeError, "query", "floating", "torch.int64"):
        sdpa(q3.long(), k3.long(), v3.long())
    with raises(TypeError, "key", "torch.Tensor", "list"):
        sdpa(q3, [[1.0]], v3)


@pytest.mark.parametrize("mask_dtype", [torch.int32, torch.float64, torch.float16, torch.uint8])
def test_mask_dtype_not_bool_or_float(mask_dtype):
    with raises(TypeError, "attn_mask", "bool", "float32", str(mask_dtype)):
        sdpa(q3, k3, v3, attn_mask=torch.zeros(3, 5).to(mask_dtype))


def test_float32_mask_is_accepted_with_any_query_dtype():
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        out = sdpa(q3.to(dtype), k3.to(dtype), v3.to(dtype), attn_mask=torch.zeros(3, 5))
        assert out.dtype == dtype


@pytest.mark.parametrize("shape", [(3, 4), (2, 4, 5), (7, 2, 3, 5), (3, 5, 1)])
def test_mask_not_broadcastable_or_enlarging(shape):
    with raises(ValueError, "attn_mask", "(2, 3, 5)", str(shape)):
        sdpa(q3, k3, v3, attn_mask=torch.ones(shape, dtype=torch.bool))


def test_is_causal_with_mask():
    with raises(ValueError, "attn_mask", "is_causal"):
        sdpa(q3, k3, v3, attn_mask=torch.ones(3, 5, dtype=torch.bool), is_causal=True)


def test_gqa_heads_do_not_divide():
    with raises(ValueError, "enable_gqa", "H=6", "key", "Hkv=4", "(2, 4, 5, 4)"):
        sdpa(q4, torch.randn(2, 4, 5, 4), torch.randn(2, 4, 5, 4), enable_gqa=True)
    with raises(ValueError, "enable_gqa", "value", "Hkv=5"):
        sdpa(q4, torch.randn(2, 2, 5, 4), torch.randn(2, 5, 5, 4), enable_gqa=True)


def test_gqa_needs_a_head_dimension():
    with raises(ValueError, "enable_gqa", "at least 3-D", "(3, 4)"):
        sdpa(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 4), enable_gqa=True)


def test_different_head_counts_without_gqa_suggest_enable_gqa():
    with raises(ValueError, "broadcast", "(2, 6, 3, 4)", "(2, 2, 5, 4)", "enable_gqa=True"):
        sdpa(q4, torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_dropout_out_of_range(p):
    with raises(ValueError, "dropout_p", "[0, 1]", str(p)):
        sdpa(q3, k3, v3, dropout_p=p)


def test_option_types():
    with raises(TypeError, "scale", "str"):
        sdpa(q3, k3, v3, scale="0.5")
    with raises(TypeError, "is_causal", "int"):
        sdpa(q3, k3, v3, is_causal=1)
    with raises(TypeError, "attn_mask", "list"):
        sdpa(q3, k3, v3, attn_mask=[[True]])


def test_attention_weights_validates_too():
    with raises(ValueError, "attention_weights", "key", "E=4"):
        attention_weights(q3, torch.randn(2, 5, 3))
    with raises(ValueError, "attention_weights", "attn_mask", "(2, 3, 5)"):
        attention_weights(q3, k3, attn_mask=torch.ones(4, 5, dtype=torch.bool))


@pytest.mark.subprocess
def test_shape_broadcasting_agrees_with_torch_and_does_not_import_sympy():
    """The validation broadcasts shapes itself: torch.broadcast_shapes imports sympy on first use
    (~1 s of CPU in every grading process and sandbox child)."""
    import itertools
    import subprocess
    import sys

    from attnlab._validation import broadcast_shapes

    dims = [(), (0,), (1,), (2,), (3,)]
    for a, b, c in itertools.product([x + y for x in dims for y in dims], repeat=3):
        try:
            expected = torch.broadcast_shapes(a, b, c)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                broadcast_shapes(a, b, c)
        else:
            assert broadcast_shapes(a, b, c) == expected, (a, b, c)
    code = ("import sys, torch\nfrom attnlab.functional import scaled_dot_product_attention as f\n"
            "q = torch.randn(2, 3, 5, 4)\nf(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool))\n"
            "print('sympy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
