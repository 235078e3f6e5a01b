"""Lab 01 (``labs/track1/01-attention``), one unit: its description, allowed names and rule
(:data:`LAB`), and its checks (:data:`EXERCISES`): inputs, a float64 reference computed on the
fly, and named mistakes.

Each exercise (:class:`attnlab.grading.exercise.Exercise`) says which learner functions to
call and how to judge what came back. Inputs are seeded and deliberately unequal
(B = 3, T = 5 queries, S = 7 keys, d = 6, d_k = 4, d_v = 3) so that a swapped or
missing transpose cannot hide. A wrong answer is compared with the answers that
common mistakes produce; a match names the mistake.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import torch
from torch import Tensor

from attnlab import doctor, masks
from attnlab.functional import attention_weights, scaled_dot_product_attention
from attnlab.grading.exercise import CallFailed, Exercise, Verdict, all_checks, close, describe, tensor_verdict, value
from attnlab.grading.sandbox import Call
from attnlab.labs import Lab
from attnlab.softmax import stable_softmax
from attnlab.testing import max_abs_diff

__all__ = ["LAB", "EXERCISES"]

LAB = Lab("01-attention", "Self-attention from queries, keys and values",
          "projections, scaled scores, a stable softmax, masks (causal, padding), the weighted sum, "
          "parity with torch's SDPA; the lesson's worked example",
          module=__name__,
          allowed_names=("nn", "functional"),  # compare_with_sdpa calls torch.nn.functional's SDPA
          rule="This lab builds attention from scratch: use exp, sum and matmul (torch's softmax/SDPA are "
               "allowed only in compare_with_sdpa)")

B, T, S, D, DK, DV = 3, 5, 7, 6, 4, 3
NEG_INF = float("-inf")


# a matmul's shape errors (K.T on a 3-D K gives a batch-broadcast error); a transpose on the learner's
# failing line must be seen too
_SHAPE_ERRORS = ("must match the size", "cannot be multiplied", "Expected size for first two dimensions", "size mismatch", "shape mismatch")


def _transpose_hint(error: str, traceback: str = "") -> list[dict]:
    """A matmul that fails on shapes in the scores is almost always the wrong transpose of K on a
    3-D tensor; the learner's own line (in the traceback) says which one it was."""
    if not any(s in error for s in _SHAPE_ERRORS):
        return []
    if re.search(r"\.transpose\(\s*0\s*,\s*1\s*\)|\.transpose\(\s*1\s*,\s*0\s*\)", traceback):
        wrong = "K.transpose(0, 1) swaps the batch and position dims ([S, B, d_k])"
    elif re.search(r"\.T\b|\.t\(\)", traceback) or not traceback:
        wrong = "K.T reverses all three dims ([d_k, S, B])"
    else:
        return []  # a shape error elsewhere: no transpose on the learner's lines to blame
    return [{"code": "wrong_transpose",
             "message": f"a shape mismatch in Q @ K^T: on a [B, S, d_k] tensor {wrong}; use K.transpose(-2, -1) "
                        f"to get [B, d_k, S]"}]


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #


def _layer_inputs(g: torch.Generator, T_: int = T) -> dict[str, Tensor]:
    return {
        "X": torch.randn(B, T_, D, generator=g),
        "W_Q": torch.randn(D, DK, generator=g) * 0.7,
        "W_K": torch.randn(D, DK, generator=g) * 0.7,
        "W_V": torch.randn(D, DV, generator=g),
    }


def _args(inp: dict[str, Tensor]) -> tuple:
    return inp["X"], inp["W_Q"], inp["W_K"], inp["W_V"]


def _reference_layer(inp: dict[str, Tensor], mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """float64: (Q, K, V, output, weights) from attnlab's reference."""
    X, W_Q, W_K, W_V = (t.double() for t in _args(inp))
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    w = attention_weights(Q, K, attn_mask=mask)
    return Q, K, V, w @ V, w


# --------------------------------------------------------------------------- #
# ex1 - ex4
# --------------------------------------------------------------------------- #


def _prep_ex1(g):
    inp = _layer_inputs(g)
    return [Call("project_qkv", _args(inp))], inp


def _judge_ex1(inp, results, outcome):
    got = value(results, 0)
    X, W_Q, W_K, W_V = (t.double() for t in _args(inp))
    expected = (X @ W_Q, X @ W_K, X @ W_V)
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        bad = Verdict(False, f"expected a tuple (Q, K, V), got {describe(got)}")
        return {"shapes": bad, "values": bad}
    shapes_ok = all(isinstance(a, Tensor) and a.shape == e.shape for a, e in zip(got, expected))
    shape_msg = "" if shapes_ok else (
        f"expected shapes Q {list(expected[0].shape)}, K {list(expected[1].shape)}, V {list(expected[2].shape)}; got "
        + ", ".join(list(a.shape).__repr__() if isinstance(a, Tensor) else describe(a) for a in got))
    names = ("Q", "K", "V")
    verdicts = [tensor_verdict(a, e, n, [("order", f"this is X @ W_{o}: return them in the order (Q, K, V)", x)
                                         for o, x in zip(names, expected) if o != n])
                for a, e, n in zip(got, expected, names)]
    failed = [v for v in verdicts if not v.passed]
    values = Verdict(not failed, "; ".join(v.message for v in failed), [f for v in failed for f in v.findings])
    return {"shapes": Verdict(shapes_ok, shape_msg), "values": values}


def _prep_ex2(g):
    Q = torch.randn(B, T, DK, generator=g) * 1.5
    K = torch.randn(B, S, DK, generator=g) * 1.5
    return [Call("attention_scores", (Q, K))], (Q, K)


def _judge_ex2(ctx, results, outcome):
    Q, K = (t.double() for t in ctx)
    got = value(results, 0)
    raw = Q @ K.transpose(-2, -1)  # (B, T, S)
    expected = raw / math.sqrt(DK)
    mistakes = [
        ("missing_scale", f"you forgot the 1/sqrt(d_k) scale: these are Q @ K^T, {math.sqrt(DK):g}x too large "
                          "(d_k = 4); divide by math.sqrt(Q.shape[-1])", raw),
        ("wrong_scale", "the scores are divided by d_k; divide by sqrt(d_k) instead", raw / DK),
        ("wrong_transpose", "the scores are transposed: [B, S, T] = K @ Q^T; compute Q @ K^T to get [B, T, S]",
         expected.transpose(-2, -1)),
    ]
    shape = Verdict(isinstance(got, Tensor) and got.shape == expected.shape,
                    f"expected shape [B, T, S] = {list(expected.shape)}, got "
                    f"{list(got.shape) if isinstance(got, Tensor) else describe(got)}")
    if isinstance(got, Tensor) and got.shape == (B, T, T) and T != S:
        shape.message += " (did you transpose K over the wrong dims? K.transpose(-2, -1) gives [B, d_k, S])"
    values = tensor_verdict(got, expected, "scores", mistakes)
    if not values.passed and not values.findings:
        values = _fitted_scale(got, expected) or values
    return {"shape": shape, "values": values}


def _fitted_scale(got: Any, expected: Tensor) -> Optional[Verdict]:
    """Scores that are the reference's times one factor: name the factor (fitted, least squares)."""
    if not isinstance(got, Tensor) or got.shape != expected.shape or not torch.isfinite(got).all():
        return None
    g = got.double()
    c = float((g * expected).sum() / (expected * expected).sum())
    if c <= 0 or not close(got, expected * c):
        return None
    if abs(c - DK) < 1e-3 * DK:
        message = (f"your scores are d_k = {DK} times the reference's: you multiplied by sqrt(d_k) instead of "
                   "dividing; use Q @ K.transpose(-2, -1) / math.sqrt(d_k)")
    else:
        message = (f"your scores are {c:.4g} times the reference's: the scale is wrong; divide Q @ K^T by "
                   f"sqrt(d_k) = {math.sqrt(DK):g}, with d_k = Q.shape[-1]")
    return Verdict(False, f"scores: {message}", [{"code": "wrong_scale", "message": message}], (got, expected))


def _prep_ex3(g):
    ordinary = torch.randn(B, T, S, generator=g) * 3
    # the third row spans 110 > 88 (exp's float32 range): shifting by the row's min instead of its max
    # overflowed nowhere in the first two and scored full marks (issue 48's third solutions)
    large = torch.tensor([[1000.0, 1001.0, 999.0, 1002.0], [-1000.0, -1003.0, -999.5, -1001.0],
                          [-50.0, 60.0, 0.0, 10.0]])
    masked = torch.randn(T, S, generator=g)
    masked[1, :] = NEG_INF
    masked[3, ::2] = NEG_INF
    by_dim = torch.randn(4, 6, generator=g)
    calls = [Call("stable_softmax", (ordinary,)), Call("stable_softmax", (large,)),
             Call("stable_softmax", (masked,)), Call("stable_softmax", (by_dim,), {"dim": 0})]
    return calls, (ordinary, large, masked, by_dim)


def _judge_ex3(ctx, results, outcome):
    ordinary, large, masked, by_dim = (t.double() for t in ctx)
    out: dict[str, Verdict] = {}

    def run(name, i, expected, mistakes):
        try:
            out[name] = tensor_verdict(value(results, i), expected, name.replace("_", " "), mistakes)
        except CallFailed as exc:
            out[name] = Verdict(False, f"raised {exc.result['error']}\n{exc.result.get('traceback', '')}")

    shifted = torch.exp(ordinary - ordinary.amax(dim=-1, keepdim=True))
    run("ordinary_scores", 0, stable_softmax(ordinary), [
        ("softmax_dim", "the rows do not sum to 1 over the keys: normalise over dim (-1 by default), "
                        "not over the queries", stable_softmax(ordinary, dim=-2)),
        ("softmax_dim", "the sum runs over the whole tensor, so no row sums to 1: sum along dim, "
                        "e.sum(dim=dim, keepdim=True)", shifted / shifted.sum()),
        ("unstable_softmax", "the log-sum-exp is of the unshifted scores while the max is subtracted too, so no row "
                             "sums to 1 (and exp overflows on large scores): log(sum(exp(x - max))) of the shifted "
                             "scores", shifted / torch.exp(ordinary).sum(dim=-1, keepdim=True)),
        ("softmax_dim", "the sum runs over the whole tensor, so no row sums to 1: sum along dim, "
                        "e.sum(dim=dim, keepdim=True)", torch.exp(ordinary - ordinary.max()) / torch.exp(
                            ordinary - ordinary.max()).sum())])
    got_large = results[1].get("value")
    # the whole tensor's max subtracted, in float32 as the learner computes: the row near -1000 underflows
    # to 0 (then 0/0, or 0 behind an empty-row guard); it scored 96 as "values differ" (issue 48)
    x = large.float()
    e = torch.exp(x - x.amax())
    total = e.sum(dim=-1, keepdim=True)
    large_mistakes = [("unstable_softmax", "the max subtracted is the whole tensor's, not each row's: a row far below "
                       "it underflows to 0; subtract each row's max (x - x.amax(dim, keepdim=True))",
                       (e / torch.where(total == 0, torch.ones_like(total), total)).double())]
    if isinstance(got_large, Tensor) and not torch.isfinite(got_large).all():
        large_mistakes = [("unstable_softmax", "exp overflows on scores near 1000 and gives NaN: subtract each "
                           "row's max (x - x.amax(dim, keepdim=True)) before exp", got_large)]
    run("large_scores", 1, stable_softmax(large), large_mistakes)
    masked_expected = stable_softmax(masked)
    got_masked = results[2].get("value")
    masked_mistakes = []
    if isinstance(got_masked, Tensor) and got_masked.shape == masked_expected.shape and got_masked[1].isnan().any():
        masked_mistakes = [("fully_masked_nan", "a row of all -inf gives NaN (-inf - (-inf) = NaN): where the row max "
                            "is -inf, shift by 0 instead, and divide by 1 where the sum is 0", got_masked)]
    run("fully_masked_row", 2, masked_expected, masked_mistakes)
    half = torch.exp(by_dim - by_dim.amax(dim=0, keepdim=True))
    run("dim_argument", 3, stable_softmax(by_dim, dim=0), [
        ("softmax_dim", "the dim argument is ignored: normalise along the dim you are given",
         stable_softmax(by_dim, dim=-1)),
        ("softmax_dim", "the max is taken along dim but the sum along the last axis: take both along dim",
         half / half.sum(dim=-1, keepdim=True))])
    return out


def _prep_ex4(g):
    w = stable_softmax(torch.randn(B, T, S, generator=g))
    V = torch.randn(B, S, DV, generator=g)
    return [Call("attend", (w, V))], (w, V)


def _judge_ex4(ctx, results, outcome):
    w, V = (t.double() for t in ctx)
    return {"values": tensor_verdict(value(results, 0), w @ V, "output")}


# --------------------------------------------------------------------------- #
# ex5 - ex7: masks
# --------------------------------------------------------------------------- #


def _prep_ex5(g):
    return [Call("causal_mask", (6,)), Call("causal_mask", (1,))], None


def _judge_ex5(ctx, results, outcome):
    expected = masks.causal(6, 6)
    got = value(results, 0)
    mistakes = [
        ("causal_future", "the mask is upper-triangular: position i would see the future (j > i); "
                          "use .tril(), True on and below the diagonal", torch.ones(6, 6, dtype=torch.bool).triu()),
        ("off_by_one", "the diagonal is False: position i must also attend to itself (j <= i, tril())",
         torch.ones(6, 6, dtype=torch.bool).tril(-1)),
        ("mask_polarity", "True marks the *masked* positions here (~tril(), the same as triu(1)); in attnlab (and "
                          "SDPA) True = attend", ~expected),
        ("off_by_one", "the last row is all False: position 5 attends to nothing; the rows run 0 .. T-1 "
                       "(range(T), not range(T - 1))", expected & (torch.arange(6) < 5)[:, None]),
    ]
    shape = Verdict(isinstance(got, Tensor) and got.shape == (6, 6) and got.dtype == torch.bool,
                    f"causal_mask(6): expected a [6, 6] bool tensor, got {describe(got)}")
    values = tensor_verdict(got, expected, "causal_mask(6)", mistakes)
    if not values.passed and not values.findings:
        values = _fitted_diagonal(got) or values
    if values.passed:
        values = tensor_verdict(value(results, 1), masks.causal(1, 1), "causal_mask(1)")
    return {"shape_and_dtype": shape, "values": values}


def _fitted_diagonal(got: Any) -> Optional[Verdict]:
    """A lower-triangular mask with its diagonal moved (tril(d), d != 0): name the offset."""
    if not isinstance(got, Tensor) or got.shape != (6, 6) or got.dtype != torch.bool:
        return None
    for d in (1, -1, 2, -2, 3, -3, 4, -4, 5, -5):
        if torch.equal(got, torch.ones(6, 6, dtype=torch.bool).tril(d)):
            if d > 0:
                message = (f"your mask lets position i see i+{d} (the future): the diagonal is off by {d}; "
                           "use .tril() with no offset")
            else:
                message = (f"your mask hides position i's last {-d} key(s), itself included: the diagonal is off "
                           f"by {d}; use .tril() with no offset")
            return Verdict(False, f"causal_mask(6): {message}", [{"code": "off_by_one", "message": message}])
    return None


def _prep_ex6(g):
    lengths = torch.tensor([5, 2, 7])
    return [Call("padding_mask", (lengths, 7))], lengths


def _judge_ex6(lengths, results, outcome):
    got = value(results, 0)
    keep = torch.arange(7) < lengths[:, None]  # (B, S)
    expected_b1t = keep[:, None, :]  # (B, 1, S)
    expected = expected_b1t
    if isinstance(got, Tensor) and got.shape == (3, 7, 7):  # the documented [B, T, T] alternative
        expected = keep[:, None, :].expand(3, 7, 7)
    mistakes = [
        ("mask_polarity", "True marks the padding here; True must mean a real token (j < length)",
         ~expected),
        ("off_by_one", "one position too many is kept: a sequence of length n has real tokens 0..n-1 "
                       "(use <, not <=)", (torch.arange(7) <= lengths[:, None])[:, None, :].expand_as(expected)),
        ("off_by_one", "the last real token is masked: a sequence of length n has real tokens 0..n-1, all n of "
                       "them kept (j < n)", (torch.arange(7) < lengths[:, None] - 1)[:, None, :].expand_as(expected)),
    ]
    shape = Verdict(isinstance(got, Tensor) and got.shape in ((3, 1, 7), (3, 7, 7)),
                    f"expected shape [B, 1, T] = [3, 1, 7] (or [B, T, T]), got "
                    f"{list(got.shape) if isinstance(got, Tensor) else describe(got)}")
    if isinstance(got, Tensor) and got.shape == (3, 7):
        shape.message += ": add the query dim with [:, None, :] so it broadcasts over [B, T, T] scores"
        got = got[:, None, :]
    if isinstance(got, Tensor) and got.shape == (3, 7, 1):  # [B, T, 1]: it hides padded *queries*
        message = ("the mask has shape [B, T, 1], so it hides padded queries (rows); padding hides keys "
                   "(columns): shape [B, 1, T], built with [:, None, :]")
        finding = [{"code": "padding_query_side", "message": message}]
        return {"shape": Verdict(False, f"padding_mask: {message}", finding),
                "values": Verdict(False, f"padding_mask: {message}", finding)}
    return {"shape": shape, "values": tensor_verdict(got, expected, "padding_mask", mistakes)}


def _prep_ex7(g):
    scores = torch.randn(B, T, S, generator=g)
    m2 = torch.rand(T, S, generator=g) > 0.4
    m2[:, 0] = True
    m3 = (torch.arange(S) < torch.tensor([7, 3, 5])[:, None])[:, None, :]  # (B, 1, S)
    return [Call("apply_mask", (scores, m2)), Call("apply_mask", (scores, m3))], (scores, m2, m3)


def _judge_ex7(ctx, results, outcome):
    scores, m2, m3 = ctx
    s = scores.double()
    out = {}
    for name, i, m in (("mask_T_S", 0, m2), ("mask_B_1_S", 1, m3)):
        expected = s.masked_fill(~m, NEG_INF)
        mistakes = [
            ("mask_polarity", "-inf is placed where the mask is True; True = attend, so fill where it is False "
                              "(scores.masked_fill(~mask, float('-inf')))", s.masked_fill(m, NEG_INF)),
            ("mask_fill_zero", "masked scores are set to 0, which still gets weight after softmax; use -inf",
             s.masked_fill(~m, 0.0)),
            ("mask_fill_finite", "masked scores use a large finite number; use float('-inf'), so masked keys get "
                                 "exactly 0 weight and fully masked rows can be detected",
             s.masked_fill(~m, -1e9)),
            ("mask_multiplied", "the scores are multiplied by the mask; masking means -inf, not 0",
             s * m),
        ]
        try:
            got = value(results, i)
            out[name] = _fill_verdict(got, s, m) or tensor_verdict(got, expected, f"apply_mask with a {list(m.shape)} "
                                                                                  f"mask", mistakes)
        except CallFailed as exc:
            out[name] = Verdict(False, f"raised {exc.result['error']}\n{exc.result.get('traceback', '')}")
    return out


def _fill_verdict(got: Any, s: Tensor, keep: Tensor) -> Optional[Verdict]:
    """Two fills that the reference's mistake models cannot tell apart by value alone: any large
    finite number (-1e9, finfo.min, -10000) at the masked places, and ``scores * mask``, whose
    zeros carry the sign of the score (IEEE: -2.0 * 0 = -0.0) where masked_fill(~mask, 0) writes
    +0.0."""
    if not isinstance(got, Tensor) or not got.is_floating_point():
        return None
    try:
        keep = keep.expand(s.shape)
    except RuntimeError:
        return None
    if got.shape != s.shape or not close(got.where(keep, torch.zeros_like(got)), s.where(keep, torch.zeros_like(s))):
        return None
    masked = got[~keep].double()
    if masked.numel() and torch.isfinite(masked).all() and bool((masked <= -1e4).all()):
        message = (f"masked scores are set to a large finite number ({float(masked.max()):.3g}); use float('-inf'), "
                   "so masked keys get exactly 0 weight and fully masked rows can be detected")
        return Verdict(False, f"apply_mask: {message}", [{"code": "mask_fill_finite", "message": message}])
    negative = (~keep) & (s < 0)
    if masked.numel() and bool((masked == 0).all()) and bool(negative.any()) and bool(
            torch.signbit(got[negative]).all()):
        message = ("the scores are multiplied by the mask (a masked score becomes 0, or -0.0 where it was negative), "
                   "which still gets weight after softmax; masking means -inf where the mask is False: "
                   "scores.masked_fill(~mask, float('-inf'))")
        return Verdict(False, f"apply_mask: {message}", [{"code": "mask_multiplied", "message": message}])
    return None


# --------------------------------------------------------------------------- #
# ex8 - ex9: the whole layer
# --------------------------------------------------------------------------- #


def _prep_ex8(g):
    inp = _layer_inputs(g)
    pad = (torch.arange(T) < torch.tensor([5, 3, 4])[:, None])[:, None, :]  # (B, 1, T)
    empty = torch.ones(B, T, T, dtype=torch.bool)
    empty[:, 2, :] = False  # query 2 sees nothing
    calls = [Call("self_attention", _args(inp)),
             Call("self_attention", (*_args(inp), pad)),
             Call("self_attention", (*_args(inp), masks.causal(T, T))),
             Call("self_attention", (*_args(inp), empty))]
    # then the doctor's probes, as plain calls of the same function (the sandbox only calls;
    # the doctor reads the answers here, in the grader): [(probe, how many calls it made)]
    probes = []
    for probe in doctor.build_probes(doctor.SELF_ATTENTION_CAPABILITIES):
        args = doctor.self_attention_calls(probe)
        calls += [Call("self_attention", a) for a in args]
        probes.append((probe, len(args)))
    return calls, (inp, pad, empty, probes)


def _probe_results(results: list[dict], probes: list) -> list["doctor.ProbeResult"]:
    """The doctor's reading of the probe calls' answers (``results`` past the exercise's own four)."""
    answers, made, at = results[4:], [], 0
    for probe, n in probes:
        mine = [r["value"] if "value" in r else doctor.FailedCall(r.get("error", "")) for r in answers[at:at + n]]
        at += n
        made.append(doctor.self_attention_result(probe, mine))
    return made


def _after_softmax(w: Tensor, V: Tensor, mask: Tensor) -> list:
    """What a layer returns that masks the weights (``w``: unmasked, float64) after the softmax,
    with -inf or with 0: the -inf one gives NaN and inf, which the doctor's probes called
    ``unstable_softmax`` (issue 48's third solutions)."""
    message = ("the mask is applied to the weights after softmax: mask the scores (-inf where the mask is "
               "False) before it, so each row's weights sum to 1 over the keys it may see")
    return [("mask_after_softmax", message, w.masked_fill(~mask, float("-inf")) @ V),
            ("mask_after_softmax", message, w.masked_fill(~mask, 0.0) @ V)]


_EX8_CHECKS = {"output_shape": 2, "weights_shape": 2, "output_values": 5, "weights_values": 3, "padding_mask": 4,
               "causal_mask": 2, "fully_masked_row": 2}


def _judge_ex8(ctx, results, outcome):
    inp, pad, empty, probes = ctx
    out: dict[str, Verdict] = {}
    _, _, _, ref_out, ref_w = _reference_layer(inp)

    def pair(i):
        got = value(results, i)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CallFailed({"error": f"expected a tuple (output, weights), got {describe(got)}"})
        return got

    try:
        o, w = pair(0)
        if (isinstance(o, Tensor) and isinstance(w, Tensor) and o.shape == ref_w.shape and w.shape == ref_out.shape
                and close(o, ref_w) and close(w, ref_out)):
            message = "it returns (weights, output); the signature says (output, weights)"
            v = Verdict(False, message, [{"code": "order", "message": message}])
            return all_checks(_EX8_CHECKS, v)
        out["output_shape"] = Verdict(isinstance(o, Tensor) and o.shape == ref_out.shape,
                                      f"output: expected [B, T, d_v] = {list(ref_out.shape)}, got {describe(o)}")
        out["weights_shape"] = Verdict(isinstance(w, Tensor) and w.shape == ref_w.shape,
                                       f"weights: expected [B, T, T] = {list(ref_w.shape)}, got {describe(w)}")
        out["output_values"] = tensor_verdict(o, ref_out, "output")
        out["weights_values"] = tensor_verdict(w, ref_w, "weights")
    except CallFailed as exc:
        v = Verdict(False, f"raised {exc.result['error']}\n{exc.result.get('traceback', '')}",
                    _transpose_hint(exc.result["error"], exc.result.get("traceback", "")))
        out.update(all_checks(["output_shape", "weights_shape", "output_values", "weights_values"], v))

    for name, i, mask in (("padding_mask", 1, pad), ("causal_mask", 2, masks.causal(T, T)),
                          ("fully_masked_row", 3, empty)):
        _, _, V, m_out, _ = _reference_layer(inp, mask)
        try:
            o, _ = pair(i)
            out[name] = tensor_verdict(o, m_out, f"output with the {name.replace('_', ' ')}",
                                       _after_softmax(ref_w, V, mask))
            if out[name].findings:
                continue
            if name == "fully_masked_row" and isinstance(o, Tensor) and o.shape == m_out.shape and o[:, 2].isnan().any():
                out[name] = Verdict(False, "query 2 has every key masked and its output is NaN; it must be 0",
                                    [{"code": "fully_masked_nan", "message": "fully masked rows give NaN"}])
        except CallFailed as exc:
            out[name] = Verdict(False, f"raised {exc.result['error']}\n{exc.result.get('traceback', '')}",
                                _transpose_hint(exc.result["error"], exc.result.get("traceback", "")))

    # Explain failures with the doctor, from the probes the child ran on this function.
    if any(not v.passed for v in out.values()) and len(results) > 4:
        report = doctor.analyze([p for p, _ in probes], _probe_results(results, probes))
        findings = [{"code": f.code, "message": f"{f.message}. Hint: {doctor.CODES[f.code]}"} for f in report.findings]
        for v in out.values():
            if not v.passed and not v.findings:
                v.findings = findings
    return out


def _prep_ex9(g):
    inp = _layer_inputs(g)
    pad = (torch.arange(T) < torch.tensor([5, 2, 4])[:, None])[:, None, :]
    # A third call measures a self_attention that is off by a secret amount at a secret place: a
    # constant near the true, tiny difference (a seventh attacker's 0.0) cannot find it, a measurement does
    delta, delta_sdpa = torch.zeros(B, T, DV), torch.zeros(B, T, DV)
    at = [int(torch.randint(n, (1,), generator=g)) for n in (B, T, DV)]
    # and SDPA's answer moved at the same place, the other way (an eighth attacker measured self_attention
    # against the file's own second attention): the number is |both| only where both were measured
    delta[at[0], at[1], at[2]] = float(0.1 + 0.4 * torch.rand(1, generator=g))
    delta_sdpa[at[0], at[1], at[2]] = -float(0.1 + 0.4 * torch.rand(1, generator=g))
    # self_attention first: once compare_with_sdpa has run, the child holds SDPA's output, which a
    # module-level list could hand the later call to measure SDPA against itself (issue 61's attacker)
    calls = [Call("self_attention", (*_args(inp), pad)), Call("compare_with_sdpa", (*_args(inp), pad)),
             Call("compare_with_sdpa", (*_args(inp), pad), plant=("self_attention", delta, delta_sdpa))]
    return calls, (inp, pad, delta, delta_sdpa)


def _judge_ex9(ctx, results, outcome):
    inp, pad, delta, delta_sdpa = ctx
    got = value(results, 1)
    if isinstance(got, Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return {"returns_max_diff": Verdict(False, f"expected a float, got {describe(got)}")}
    # what the learner's own self_attention is off by, measured here in float64
    Q, K, V, _, _ = _reference_layer(inp)
    sdpa_out = scaled_dot_product_attention(Q, K, V, attn_mask=pad)
    try:
        own = value(results, 0)[0]
        expected = max_abs_diff(own, sdpa_out) if isinstance(own, Tensor) and own.shape == sdpa_out.shape else None
    except (CallFailed, TypeError, IndexError, KeyError):
        expected = None
    if not math.isfinite(got) or got < 0:
        return {"returns_max_diff": Verdict(False, f"returned {got}: a max |difference| is finite and >= 0")}
    if expected is None:  # nothing to compare the claim with: no points for an unverifiable number
        return {"returns_max_diff": Verdict(False, f"returned {got:.3g}, but your self_attention could not be "
                                                   "measured on these inputs (it raised or returned the wrong shape): "
                                                   "fix ex8 first")}
    if not math.isfinite(expected):  # a NaN/inf self_attention: no claim about it can be checked ('inf > inf')
        return {"returns_max_diff": Verdict(False, f"returned {got:.3g}, but your self_attention returns NaN or inf "
                                                   "on these inputs, so no difference can be checked: fix ex8 first")}
    if abs(got - expected) > 1e-4 + 1e-3 * expected:
        text = (f"returned {got:.3g}, but your self_attention differs from SDPA by {expected:.3g} on these inputs "
                "(with the padding mask)")
        unmasked = max_abs_diff(own, scaled_dot_product_attention(Q, K, V))  # the mask left out of one side
        if abs(got - unmasked) <= 1e-4 + 1e-3 * unmasked:
            return {"returns_max_diff": Verdict(False, text, [{"code": "mask_ignored", "message": (
                f"{got:.3g} is your output's difference from SDPA called without the mask: pass it on, "
                "scaled_dot_product_attention(Q, K, V, attn_mask=mask)")}])}
        return {"returns_max_diff": Verdict(False, text)}
    return {"returns_max_diff": _judge_planted(results, own.double() + delta, sdpa_out + delta_sdpa, got)}


def _judge_planted(results, planted: Tensor, sdpa_out: Tensor, got: float) -> Verdict:
    """The third call: compare_with_sdpa while self_attention answers ``planted`` (its own output plus a
    secret difference) and SDPA ``sdpa_out`` (its answer moved the other way at the same place); the
    float returned must be the difference of the two."""
    try:
        claim = value(results, 2)
    except CallFailed as exc:
        return Verdict(False, f"compare_with_sdpa raised {exc.result['error']} when self_attention's output changed")
    if isinstance(claim, Tensor) and claim.numel() == 1:
        claim = claim.item()
    expected = max_abs_diff(planted, sdpa_out)
    if isinstance(claim, bool) or not isinstance(claim, (int, float)) or not abs(claim - expected) <= 1e-4 + 1e-3 * expected:
        shown = f"{claim:.3g}" if isinstance(claim, (int, float)) else describe(claim)
        return Verdict(False, f"when self_attention's and SDPA's outputs were moved {expected:.3g} apart, "
                              f"compare_with_sdpa returned {shown}: measure your self_attention (call it by name) "
                              "against torch's scaled_dot_product_attention, do not return a fixed number")
    return Verdict(True, f"max |diff| = {got:.2e}; a planted difference of {expected:.3g} measured")


# --------------------------------------------------------------------------- #
# The lesson's exercises
# --------------------------------------------------------------------------- #

_EX10_EXPECTED = {"Q": (1, 3, 2), "K": (1, 3, 2), "V": (1, 3, 2), "scores": (1, 3, 3),
                  "attn_weights": (1, 3, 3), "output": (1, 3, 2)}


def _prep_ex10(g):
    return [Call("exercise_1_shapes")], None


def _judge_ex10(ctx, results, outcome):
    got = value(results, 0)
    out = {}
    for key, shape in _EX10_EXPECTED.items():
        # the expected shapes are derived: X [1, 3, 6] @ W [6, 2] -> [1, 3, 2]; Q @ K^T -> [1, 3, 3]
        if not isinstance(got, dict) or key not in got:
            out[key] = Verdict(False, f"expected a dict with the key {key!r}, got {describe(got)}")
            continue
        g_shape = got[key]
        g_shape = tuple(g_shape) if isinstance(g_shape, (tuple, list)) else g_shape
        ok = g_shape == shape
        hint = ""
        if not ok and key == "scores":
            hint = " (scores compare every position with every position: [B, T, T])"
        elif not ok and key in ("Q", "K", "V", "output"):
            hint = " (X [1, 3, 6] @ W [6, 2] keeps B and T and replaces d by 2)"
        out[key] = Verdict(ok, "" if ok else f"{key}: {g_shape!r} is not right{hint}")
    return out


def _prep_ex11(g):
    unscaled = torch.tensor([[500.0, 480.0, -500.0, 0.0, 250.0], [-20.0, 499.0, 500.0, 3.0, -480.0]])
    return [Call("exercise_2", (unscaled,), {"d_k": 64}), Call("EXERCISE_2_ANSWER")], unscaled


def _judge_ex11(unscaled, results, outcome):
    got = value(results, 0)
    u = unscaled.double()
    out = {}
    if not isinstance(got, dict):
        bad = Verdict(False, f"expected a dict with 'naive', 'stable', 'scaled', got {describe(got)}")
        out.update(all_checks(["naive_overflows", "stable", "scaled"], bad))
    else:
        naive = got.get("naive")
        nan_ok = isinstance(naive, Tensor) and bool(torch.isnan(naive).any())
        out["naive_overflows"] = Verdict(nan_ok, "naive softmax of these scores should contain NaN (exp(500) = inf "
                                                 "in float32, inf/inf = NaN): use naive_softmax as given")
        x = unscaled.float()
        out["stable"] = tensor_verdict(got.get("stable"), stable_softmax(u), "stable", [
            ("unstable_softmax", ("this is a softmax without the max shift (exp(500) overflows): subtract each row's "
                                 "max before exp, as stable_softmax does"),
             torch.exp(x) / torch.exp(x).sum(dim=-1, keepdim=True))])
        out["scaled"] = tensor_verdict(got.get("scaled"), stable_softmax(u / 8), "scaled", [
            ("missing_scale", "these are the unscaled scores: divide by sqrt(d_k) = 8 first", stable_softmax(u)),
            ("wrong_scale", "divided by d_k = 64: divide by sqrt(d_k) = 8", stable_softmax(u / 64)),
            ("wrong_scale", "multiplied by sqrt(d_k): divide by sqrt(d_k) = 8", stable_softmax(u * 8))])
    answer = results[1].get("value")
    out["answer"] = Verdict(answer == "B", f"EXERCISE_2_ANSWER is {answer!r}: think about exp(500) in float32 "
                                           "(max ~3.4e38), and about what subtracting the max does")
    return out


def _prep_ex12(g):
    inp = _layer_inputs(g)
    return [Call("exercise_3_first_row", _args(inp)), Call("EXERCISE_3_ANSWER")], inp


def _judge_ex12(inp, results, outcome):
    _, _, _, _, w = _reference_layer(inp)
    got = value(results, 0)
    row = tensor_verdict(got, w[:, 0, :], "row 0", [
        ("wrong_axis", "this is column 0 (how much each position attends to position 0): take weights[:, 0, :]",
         w[:, :, 0]),
        ("batch_only", "this is batch element 0's full matrix: take row 0 of every batch element, weights[:, 0, :]",
         w[0]),
        ("wrong_axis", "this is the last row (the last query's weights): row 0 is weights[:, 0, :]", w[:, -1, :])])
    answer = results[1].get("value")
    return {"row_0": row,
            "answer": Verdict(answer == "A", f"EXERCISE_3_ANSWER is {answer!r}: row i of the weights belongs to "
                                             "query i, and each row sums to 1")}


EXERCISES: list[Exercise] = [
    Exercise("ex1", "project_qkv", "Q/K/V projections", {"shapes": 3, "values": 5}, _prep_ex1, _judge_ex1),
    Exercise("ex2", "attention_scores", "scaled scores", {"shape": 3, "values": 7}, _prep_ex2, _judge_ex2,
             on_error=_transpose_hint),
    Exercise("ex3", "stable_softmax", "stable softmax",
             {"ordinary_scores": 4, "large_scores": 4, "fully_masked_row": 2, "dim_argument": 2},
             _prep_ex3, _judge_ex3),
    Exercise("ex4", "attend", "weighted sum of values", {"values": 5}, _prep_ex4, _judge_ex4),
    Exercise("ex5", "causal_mask", "causal mask", {"shape_and_dtype": 2, "values": 4}, _prep_ex5, _judge_ex5),
    Exercise("ex6", "padding_mask", "padding mask", {"shape": 2, "values": 4}, _prep_ex6, _judge_ex6),
    Exercise("ex7", "apply_mask", "applying a mask", {"mask_T_S": 3, "mask_B_1_S": 3}, _prep_ex7, _judge_ex7),
    Exercise("ex8", "self_attention", "the whole layer", _EX8_CHECKS, _prep_ex8, _judge_ex8,
             on_error=_transpose_hint),
    Exercise("ex9", "compare_with_sdpa", "parity with torch's SDPA", {"returns_max_diff": 5}, _prep_ex9, _judge_ex9,
             policy=False),
    Exercise("ex10", "exercise_1_shapes", "lesson exercise 1: shapes",
             {k: 1 for k in _EX10_EXPECTED}, _prep_ex10, _judge_ex10),
    Exercise("ex11", "exercise_2", "lesson exercise 2: naive vs stable softmax",
             {"naive_overflows": 2, "stable": 2, "scaled": 2, "answer": 2}, _prep_ex11, _judge_ex11),
    Exercise("ex12", "exercise_3_first_row", "lesson exercise 3: row 0 of the weights",
             {"row_0": 5, "answer": 3}, _prep_ex12, _judge_ex12),
]


