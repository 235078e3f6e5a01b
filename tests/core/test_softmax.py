import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import stable_softmax
from attnlab.testing import assert_close, max_abs_diff

INF = float("inf")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_matches_torch_softmax_on_ordinary_inputs(dtype, dim, gen):
    x = (torch.randn(5, 7, 3, generator=gen) * 4).to(dtype)
    got = stable_softmax(x, dim=dim)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, torch.softmax(x.float(), dim=dim).to(dtype))
    assert_close(got.float().sum(dim), torch.ones(()).expand_as(got.float().sum(dim)), dtype=dtype)


def test_lesson_large_scores_do_not_overflow():
    x = torch.tensor([1000.0, 1001.0, 999.0, 1002.0])
    naive = torch.exp(x) / torch.exp(x).sum()
    assert torch.isnan(naive).all()  # inf / inf: the failure the lesson warns about
    got = stable_softmax(x)
    assert torch.isfinite(got).all()
    expected = torch.exp(torch.tensor([-2.0, -1.0, -3.0, 0.0], dtype=torch.float64))
    assert_close(got, (expected / expected.sum()).float())


def test_all_minus_inf_slice_gives_zeros_and_zero_grad():
    x = torch.tensor([[-INF, -INF, -INF], [0.5, -INF, 1.5]], dtype=torch.float64, requires_grad=True)
    y = stable_softmax(x)
    assert torch.equal(y[0].detach(), torch.zeros(3, dtype=torch.float64))
    assert_close(y[1].detach(), torch.softmax(x[1].detach(), -1))
    (g,) = torch.autograd.grad((y * torch.arange(6.0, dtype=torch.float64).view(2, 3)).sum(), x)
    assert torch.isfinite(g).all()
    assert torch.equal(g[0], torch.zeros(3, dtype=torch.float64))
    assert g[1, 1] == 0 and g[1, 0] != 0


@pytest.mark.parametrize("row", [[INF, 1.0, 2.0], [float("nan"), 1.0, 2.0], [INF, -INF, 0.0], [INF, INF, 0.0]])
def test_inf_and_nan_propagate_like_torch(row):
    x = torch.tensor(row)
    got, expected = stable_softmax(x), torch.softmax(x, -1)
    assert torch.equal(got.isnan(), expected.isnan())
    assert max_abs_diff(got, expected) == 0.0


def test_gradcheck_and_gradgradcheck_float64(gen):
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64) * 3
    x[1, 2] = -INF  # a masked entry inside an ordinary row
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: stable_softmax(t, dim=-1), (x,))
    assert torch.autograd.gradgradcheck(lambda t: stable_softmax(t, dim=0), (x.detach().clamp_min(-50).requires_grad_(),))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_is_computed_in_float32(dtype):
    # exp of shifted values near -11 underflows in float16 if computed there (min subnormal ~6e-8)
    x = torch.tensor([0.0, -11.0, -11.0, 3.0], dtype=dtype)
    got = stable_softmax(x)
    assert got.dtype == dtype
    assert torch.equal(got, torch.softmax(x.float(), -1).to(dtype))


def test_empty_dimension_and_empty_batch():
    assert stable_softmax(torch.empty(3, 0)).shape == (3, 0)
    assert stable_softmax(torch.empty(0, 4)).shape == (0, 4)


def test_bad_input_errors():
    with pytest.raises(TypeError, match="floating"):
        stable_softmax(torch.arange(4))
    with pytest.raises(TypeError, match="torch.Tensor"):
        stable_softmax([1.0, 2.0])
    with pytest.raises(ValueError, match="dim=2 is out of range for x of shape \\(3, 4\\)"):
        stable_softmax(torch.zeros(3, 4), dim=2)


@given(
    st.lists(st.one_of(st.floats(-1e4, 1e4, width=32), st.just(-INF)), min_size=1, max_size=12),
)
def test_property_rows_sum_to_one_or_are_all_masked(values):
    x = torch.tensor(values, dtype=torch.float32)
    y = stable_softmax(x)
    assert torch.isfinite(y).all() and (y >= 0).all()
    if torch.isinf(x).all():
        assert torch.equal(y, torch.zeros_like(y))
    else:
        assert math.isclose(y.double().sum().item(), 1.0, abs_tol=1e-5)
        assert_close(y, torch.softmax(x.double(), -1).float())
        assert (y[x == -INF] == 0).all()
