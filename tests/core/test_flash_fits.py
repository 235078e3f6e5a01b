"""What no enumerated bug model reproduces, named by what its gradients are made of
(attnlab.bugmodels.flash_fits): the tile pairs each kernel added, a D or a normaliser per query row.

The learner's backwards here are written out, tile by tile, in the way a learner writes them (a
loop bound, an einsum, a lse line), independent of the library's own formulas; the fits must name
each and nothing else, say nothing of the right backward or of noise, and never raise."""

from __future__ import annotations

import math
from typing import Callable, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import mistakes
from attnlab.bugmodels import FlashCase, Fitted, explain, fit, flash_gradients, gradients_of
from attnlab.bugmodels.flash_fits import ROUND
from attnlab.testing import tolerance


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    tol = tolerance(torch.float32)
    return bool(((got.double() - want).abs() <= tol.atol + tol.rtol * want.abs()).all())


def _case(g, B=2, H=4, Hkv=2, L=37, S=45, E=16, Ev=8, causal=False, b=16) -> FlashCase:
    q, k = torch.randn(B, H, L, E, generator=g), torch.randn(B, Hkv, S, E, generator=g)
    v, do = torch.randn(B, Hkv, S, Ev, generator=g), torch.randn(B, H, L, Ev, generator=g)
    return FlashCase(q, k, v, do, causal, b, b)


def _cases(causal_only: bool = False) -> list[FlashCase]:
    g = torch.Generator().manual_seed(7)
    cases = [_case(g, causal=True, L=24, S=40), _case(g, causal=True, L=40, S=40)]
    return cases if causal_only else [_case(g)] + cases


def _learner(case: FlashCase, visit: Callable = lambda qs, qe, ks, ke, case: True, d_row: Optional[Callable] = None,
             lse_rows: Optional[Callable] = None) -> dict[str, torch.Tensor]:
    """A query-outer tiled backward in float32, as lab 04's learner writes it: ``visit(qs, qe, ks, ke,
    case)`` the tile pairs its loops reach, ``d_row(do, o)`` its D, ``lse_rows(lse)`` the lse its P reads."""
    B, H, Hkv, L, S = case.shape
    r, idx = H // Hkv, case.heads("group")
    o, lse = case.forward()
    k, v = case.k[:, idx], case.v[:, idx]
    D = (case.do * o).sum(-1) if d_row is None else d_row(case.do, o)
    lse = lse if lse_rows is None else lse_rows(lse)
    dq, dk, dv = torch.zeros_like(case.q), torch.zeros(B, H, S, k.shape[-1]), torch.zeros(B, H, S, v.shape[-1])
    dk, dv = dk.double(), dv.double()
    for qs in range(0, L, case.bq):
        qe = min(qs + case.bq, L)
        for ks in range(0, S, case.bk):
            ke = min(ks + case.bk, S)
            if not visit(qs, qe, ks, ke, case):
                continue
            s = case.scale * case.q[:, :, qs:qe] @ k[:, :, ks:ke].transpose(-2, -1)
            if case.causal:
                s = s.masked_fill(torch.arange(qs, qe)[:, None] < torch.arange(ks, ke)[None], float("-inf"))
            p = torch.exp(s - lse[:, :, qs:qe, None])
            ds = p * (case.do[:, :, qs:qe] @ v[:, :, ks:ke].transpose(-2, -1) - D[:, :, qs:qe, None])
            dq[:, :, qs:qe] += case.scale * ds @ k[:, :, ks:ke]
            dk[:, :, ks:ke] += case.scale * ds.transpose(-2, -1) @ case.q[:, :, qs:qe]
            dv[:, :, ks:ke] += p.transpose(-2, -1) @ case.do[:, :, qs:qe]
    fold = (lambda x: x.reshape(B, Hkv, r, S, -1).sum(2))  # noqa: E731
    return {"dq": dq.float(), "dk": fold(dk).float(), "dv": fold(dv).float()}


def _named(cases: list[FlashCase], modelled: bool = False, **learner) -> Optional[Fitted]:
    got = [_learner(c, **learner) for c in cases]
    assert modelled or explain(cases, got, _close, pairs=False) is None  # no single enumerated model says it
    return fit(cases, got, _close)


def _codes(found: Optional[Fitted]) -> list[str]:
    return [code for code, _ in found.findings] if found is not None else []


def test_the_learners_right_backward_is_the_right_one_and_no_fit_names_it():
    cases = _cases()
    got = [_learner(c) for c in cases]
    for c, mine in zip(cases, got):
        want = flash_gradients(c)
        assert all(_close(mine[n], want[n]) for n in mine)
    assert fit(cases, got, _close) is None


@pytest.mark.parametrize("name, learner, code", [
    # the key loop stops a tile short where it ends past S: `range(0, k_stop - block_k + 1, block_k)`
    ("key_loop_short_of_the_end", dict(visit=lambda qs, qe, ks, ke, c: ke - ks == c.bk and ke <= (
        min(qe, c.shape[4]) if c.causal else c.shape[4])), "dropped_tile"),
    ("query_loop_floor", dict(visit=lambda qs, qe, ks, ke, c: qe - qs == 16), "dropped_tile"),
    ("D_einsum_typo", dict(d_row=lambda do, o: torch.einsum("bhld,bhmd->bhl", do, o)), "backward_d_term"),
    ("D_of_the_next_row", dict(d_row=lambda do, o: (do * o).sum(-1).roll(-1, dims=-1)), "backward_d_term"),
    ("lse_of_the_previous_row", dict(lse_rows=lambda lse: lse.roll(1, dims=-1)), "backward_p"),
    ("lse_in_base_2", dict(lse_rows=lambda lse: lse / math.log(2.0)), "backward_p"),
])
def test_each_family_is_named_by_its_code(name, learner, code):
    cases = _cases()
    found = _named(cases, **learner)
    assert _codes(found) == [code], name
    assert code in mistakes.CODES
    for case in cases:  # the fitted gradients are the learner's own, case by case
        mine, fitted = _learner(case, **learner), gradients_of(found, case)
        assert all(_close(mine[n], fitted[n]) for n in ("dq", "dk", "dv"))


def test_the_cases_fitted_are_the_ones_it_answers_for_and_others_get_the_right_gradients():
    cases = _cases()
    found = _named(cases, d_row=lambda do, o: 2.0 * (do * o).sum(-1))
    assert _codes(found) == ["backward_d_term"]
    for case in cases:
        assert all(_close(_learner(case, d_row=lambda do, o: 2.0 * (do * o).sum(-1))[n], found.gradients(case)[n])
                   for n in ("dq", "dk", "dv"))
    other = _cases()[0]
    assert all(torch.equal(found.gradients(other)[n], flash_gradients(other)[n]) for n in ("dq", "dk", "dv"))


def test_skipping_the_diagonal_tiles_under_is_causal_is_a_block_skip():
    # the model skip_diag says it first (explain); the fit alone says the same
    diagonal = (lambda qs, qe, ks, ke, c: not (ks < qe and ke > qs and ks >= qs))  # noqa: E731
    assert _codes(_named(_cases(causal_only=True), modelled=True, visit=diagonal)) == ["causal_block_skip"]


def test_a_mistake_in_one_kernel_says_which():
    cases = _cases()
    got = [_learner(c) for c in cases]
    for c, mine in zip(cases, got):  # dQ's D from another row, dK/dV's right
        mine["dq"] = _learner(c, d_row=lambda do, o: (do * o).sum(-1).roll(1, dims=-1))["dq"]
    found = fit(cases, got, _close)
    assert _codes(found) == ["backward_d_term"] and "for dQ" in found.message


def test_noise_a_tile_counted_one_and_a_half_times_and_too_narrow_rows_are_not_named():
    cases = _cases()
    g = torch.Generator().manual_seed(3)
    noise = [{n: t.float() + 1e-2 * torch.randn(t.shape, generator=g) for n, t in flash_gradients(c).items()}
             for c in cases]
    assert fit(cases, noise, _close) is None
    half = [_learner(c) for c in cases]
    for c, mine in zip(cases, half):  # the first key tile's share added one and a half times: no count, no P
        once = _learner(c, visit=lambda qs, qe, ks, ke, c: ks == 0)
        mine["dq"] = mine["dq"] + 0.5 * once["dq"]
    assert fit(cases, half, _close) is None
    g = torch.Generator().manual_seed(4)
    narrow = [_case(g, E=2, Ev=2)]
    assert fit(narrow, [_learner(narrow[0], d_row=lambda do, o: 3.0 * (do * o).sum(-1))], _close) is None
    assert 0 < ROUND < 0.5


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2)]), st.integers(1, 20), st.integers(1, 20),
       st.integers(1, 6), st.booleans(), st.sampled_from([1, 4, 8]),
       st.sampled_from(["randn", "nan", "inf", "zeros", "huge", "none"]), st.integers(0, 2**16))
def test_any_gradients_of_any_shape_are_fitted_without_raising(B, heads, L, S, E, causal, b, fill, seed):
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    case = _case(g, B=B, H=H, Hkv=Hkv, L=L, S=S, E=E, Ev=E, causal=causal, b=b)
    want = flash_gradients(case)
    make = {"randn": lambda t: torch.randn(t.shape, generator=g), "nan": lambda t: torch.full_like(t, float("nan")),
            "inf": lambda t: torch.full_like(t, float("inf")), "zeros": torch.zeros_like,
            "huge": lambda t: torch.full_like(t, 3e38), "none": lambda t: None}[fill]
    got = [{n: (make(t) if make(t) is None else make(t).float()) for n, t in want.items()}]
    found = fit([case], got, _close)
    assert found is None or all(code in mistakes.CODES for code, _ in found.findings)


def test_a_constant_factor_on_one_gradient_is_its_scale_and_on_all_three_p():
    cases = _cases()
    got = [_learner(c) for c in cases]
    for mine in got:
        mine["dk"] = mine["dk"] * 0.5  # dK halved: no enumerated scale mistake gives 1/2
    found = fit(cases, got, _close)
    assert _codes(found) == ["backward_scale"] and "dK is 0.5 times the right one" in found.message
    everything = [{n: t * 1.25 for n, t in _learner(c).items()} for c in cases]
    assert _codes(fit(cases, everything, _close)) == ["backward_p"]


def test_p_renormalised_in_each_key_tile_is_named_by_its_weights_per_row_and_tile():
    cases = _cases()
    got = []
    for c in cases:  # P / rowsum(P) over each key tile: a tile's own softmax, dS and dV scaled with it
        B, H, Hkv, L, S = c.shape
        want = {"dq": torch.zeros_like(c.q), "dk": torch.zeros(B, H, S, c.k.shape[-1], dtype=torch.float64),
                "dv": torch.zeros(B, H, S, c.v.shape[-1], dtype=torch.float64)}
        o, lse = c.forward()
        idx = c.heads("group")
        k, v = c.k[:, idx], c.v[:, idx]
        D = (c.do * o).sum(-1)
        for ks in range(0, S, c.bk):
            ke = min(ks + c.bk, S)
            s = c.scale * c.q @ k[:, :, ks:ke].transpose(-2, -1)
            if c.causal:
                s = s.masked_fill(torch.arange(L)[:, None] < torch.arange(ks, ke)[None], float("-inf"))
            p = torch.exp(s - lse[..., None])
            p = p / p.sum(-1, keepdim=True).where(p.sum(-1, keepdim=True) > 0, torch.ones(()))
            ds = p * (c.do @ v[:, :, ks:ke].transpose(-2, -1) - D[..., None])
            want["dq"] += c.scale * ds @ k[:, :, ks:ke]
            want["dk"][:, :, ks:ke] += c.scale * ds.transpose(-2, -1) @ c.q
            want["dv"][:, :, ks:ke] += p.transpose(-2, -1) @ c.do
        fold = (lambda x: x.reshape(B, Hkv, H // Hkv, S, -1).sum(2))  # noqa: E731
        got.append({"dq": want["dq"].float(), "dk": fold(want["dk"]).float(), "dv": fold(want["dv"]).float()})
    assert _codes(fit(cases, got, _close)) == ["backward_p"]


def test_a_case_with_nan_is_left_out_of_the_fit_and_keeps_the_right_gradients():
    cases = _cases()
    got = [_learner(c, d_row=lambda do, o: torch.einsum("bhld,bhmd->bhl", do, o)) for c in cases]
    got[1]["dq"] = got[1]["dq"].clone()
    got[1]["dq"][0, 0, 0, 0] = float("nan")  # this case cannot be fitted; the other two name it
    found = fit(cases, got, _close)
    assert _codes(found) == ["backward_d_term"]
    assert all(torch.equal(found.gradients(cases[1])[n], flash_gradients(cases[1])[n]) for n in ("dq", "dk", "dv"))
    got = [{n: torch.full_like(t, float("nan")) for n, t in g.items()} for g in got]
    assert fit(cases, got, _close) is None


def test_the_attackers_misleading_names_first_tile_zeros_and_a_negative_factor():
    cases = _cases()
    # the key loop from block_k on: the first key tile is left out, which is no partial tile
    first = _named(cases, visit=lambda qs, qe, ks, ke, c: ks > 0)
    assert _codes(first) == ["dropped_tile"] and "partial" not in first.message
    # a gradient never accumulated is all zeros: grad_missing, not a scale of 0 or a dropped tile
    got = [_learner(c) for c in cases]
    for mine in got:
        mine["dk"] = torch.zeros_like(mine["dk"])
    zeros = fit(cases, got, _close)
    assert _codes(zeros) == ["grad_missing"] and "dK is all zeros" in zeros.message
    # dO negated: all three gradients -1 times, which no P gives
    negated = [{n: -t for n, t in _learner(c).items()} for c in cases]
    assert _codes(fit(cases, negated, _close)) == ["backward_scale"]


def test_a_loop_that_steps_by_less_than_its_tiles_adds_keys_twice_and_is_a_tile_bound_not_p():
    # the fifth corpus's key loop stepping by block_q = 8 over tiles of block_k = 16: every key past the first 8
    # is added twice (the per-tile weights named it backward_p before)
    g = torch.Generator().manual_seed(11)
    cases = []
    for L, S, causal in ((37, 45, False), (40, 40, True)):
        c = _case(g, causal=causal, L=L, S=S)
        cases.append(FlashCase(c.q, c.k, c.v, c.do, causal, 8, 16))
    got = []
    for c in cases:
        B, H, Hkv, L, S = c.shape
        count = torch.ones(S, dtype=torch.float64)
        count[8:] = 2.0  # tiles [0, 16), [8, 24), [16, 32), ...: each key past 8 in two of them
        o, lse = c.forward()
        k, v = c.k[:, c.heads("group")], c.v[:, c.heads("group")]
        s = c.scale * c.q @ k.transpose(-2, -1)
        if c.causal:
            s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).tril().logical_not(), float("-inf"))
        p = torch.exp(s - lse[..., None])
        ds = p * (c.do @ v.transpose(-2, -1) - (c.do * o).sum(-1)[..., None])
        fold = (lambda x: x.reshape(B, Hkv, H // Hkv, S, -1).sum(2))  # noqa: E731
        got.append({"dq": (c.scale * (ds * count) @ k).float(),
                    "dk": fold(c.scale * (ds * count).transpose(-2, -1) @ c.q).float(),
                    "dv": fold((p * count).transpose(-2, -1) @ c.do).float()})
    found = fit(cases, got, _close)
    assert _codes(found) == ["dropped_tile"] and "twice" in found.message
