"""The shared bug-model library (attnlab.bugmodels): the right tiled backward is torch's, every
choice is named in the vocabulary, and each single choice is found again from its own gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attnlab import mistakes
from attnlab.bugmodels import FLASH_FINDINGS, FlashBackward, FlashCase, explain, flash_gradients, moves
from attnlab.testing import assert_close, tolerance


def _case(g, B, H, Hkv, L, S, E, Ev, causal, bq, bk) -> FlashCase:
    q, k, v = torch.randn(B, H, L, E, generator=g), torch.randn(B, Hkv, S, E, generator=g), torch.randn(B, Hkv, S, Ev, generator=g)
    return FlashCase(q, k, v, torch.randn(B, H, L, Ev, generator=g), causal, bq, bk)


# lab 04's ex4 cases (rectangular causal both ways, partial tiles) and lab 05's grouped heads
SHAPES = [(2, 2, 2, 37, 45, 8, 6, False, 16, 16), (2, 2, 2, 40, 40, 8, 6, True, 16, 8),
          (2, 2, 2, 24, 40, 8, 6, True, 8, 16), (2, 4, 2, 33, 40, 16, 16, True, 16, 16)]


def _cases(seed: int = 0) -> list[FlashCase]:
    g = torch.Generator().manual_seed(seed)
    return [_case(g, *s) for s in SHAPES]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    tol = tolerance(torch.float32)
    near = (got.double() - want).abs() <= tol.atol + tol.rtol * want.abs()
    return bool((near | got.isnan() & want.isnan()).all())  # NaN where the model has NaN (tile_max_nan)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_right_model_is_torchs_backward(shape):
    case = _cases()[SHAPES.index(shape)]
    q, k, v = (t.clone().requires_grad_() for t in (case.q, case.k, case.v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=True)
    want = torch.autograd.grad(out, (q, k, v), case.do)
    got = flash_gradients(case)
    for name, w in zip(("dq", "dk", "dv"), want):
        assert_close(got[name], w, msg=name)


def test_every_choice_is_named_in_the_one_vocabulary():
    for (field, value), (code, message) in FLASH_FINDINGS.items():
        assert code in mistakes.CODES, (field, value, code)
        assert message and "{who}" not in message
        assert hasattr(FlashBackward(), field) and getattr(FlashBackward(), field) != value
    changed = {f for move in moves() for f in move}
    assert changed == {f for f, _ in FLASH_FINDINGS}  # every choice is tried, and nothing else


def _makes(case: FlashCase, model: FlashBackward) -> bool:
    try:
        flash_gradients(case, model)
    except RuntimeError:
        return False
    return True


def test_each_choice_is_found_again_from_its_own_gradients():
    """A model's own float32 gradients are explained by that model's codes (the first move that fits
    may be another spelling of the same mistake, never another mistake)."""
    missed = []
    for move in moves():
        model = replace(FlashBackward(), **move)
        cases = [c for c in _cases(1) if _makes(c, model)]  # dQ = dS V needs E = Ev: the GQA case has it
        assert cases, move
        gots = [{n: t.float() for n, t in flash_gradients(c, model).items()} for c in cases]
        found = explain(cases, gots, _close, pairs=False)
        want = {FLASH_FINDINGS[(f, v)][0] for f, v in move.items()}
        if found is None or {code for code, _ in found.findings} != want:
            missed.append((move, found and found.findings))
    assert not missed, missed


def test_two_choices_at_once_are_found_and_right_gradients_explain_nothing():
    cases = _cases(2)
    model = replace(FlashBackward(), kv_d="tile", dq_scale="twice")
    gots = [{n: t.float() for n, t in flash_gradients(c, model).items()} for c in cases]
    found = explain(cases, gots, _close)
    assert found is not None and [c for c, _ in found.findings] == ["backward_d_term", "backward_scale"]
    right = [{n: t.float() for n, t in flash_gradients(c).items()} for c in cases]
    assert explain(cases, right, _close) is None
    noise = [{n: t + 0.1 for n, t in r.items()} for r in right]  # no model of this library: nothing named
    assert explain(cases, noise, _close) is None
