"""Lab 02's checks (``labs/track1/02-masks``): masks, as SDPA reads them.

Same machinery as lab 01's (:mod:`attnlab.grading.exercise`): each exercise calls the
learner's functions on seeded, deliberately unequal inputs (L != S, a padded batch, a
fully masked row), compares with a float64 reference computed here, and compares a wrong
answer with what each common mistake returns, to name it (codes from :mod:`attnlab.mistakes`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.functional import scaled_dot_product_attention
from attnlab.grading.exercise import (CallFailed, Exercise, Verdict, doctor_findings, mistake, probe_calls,
                                     tensor_verdict, value)
from attnlab.grading.sandbox import Call
from attnlab.labs import Lab

__all__ = ["LAB", "EXERCISES"]

LAB = Lab("02-masks", "Attention masks, as SDPA reads them",
          "causal masks aligned top-left and bottom-right (L != S, a KV cache), padding masks from lengths, "
          "combining masks, -inf before softmax and zeros (not NaN) for fully masked rows, SDPA's True = attend "
          "against nn.MultiheadAttention's True = ignore, parity with SDPA", file="masks.py", module=__name__,
          rule="This lab builds masks and masked attention from scratch: comparisons, tril/triu, masked_fill, "
               "exp, sum and matmul (torch's softmax and SDPA are the oracles, not the answer)")

NEG_INF = float("-inf")


def _ones(L: int, S: int) -> Tensor:
    return torch.ones(L, S, dtype=torch.bool)


# --------------------------------------------------------------------------- ex1: causal, top-left
_EX1_SHAPES = ((5, 5), (6, 4), (3, 7))


def _prep_ex1(g):
    return [Call("causal_mask", shape) for shape in _EX1_SHAPES], None


def _causal_mistakes(L: int, S: int, expected: Tensor) -> list:
    return [
        mistake("mask_polarity", "True marks the hidden keys here; in SDPA True = attend (j <= i)", ~expected),
        mistake("causal_future", "the mask is upper-triangular: query i would see the future; use .tril()",
                _ones(L, S).triu()),
        mistake("off_by_one", "the diagonal is hidden: query i must see key i too (tril(), not tril(-1))",
                _ones(L, S).tril(-1)),
        mistake("off_by_one", "query i sees key i+1: the diagonal is off by one (tril(), not tril(1))",
                _ones(L, S).tril(1)),
        mistake("causal_alignment", "this is aligned bottom-right (a KV cache's mask); is_causal is top-left: "
                                    "query i sees keys 0..i whatever L and S are", _ones(L, S).tril(S - L)),
    ]


def _judge_ex1(ctx, results, outcome):
    verdicts = []
    for i, (L, S) in enumerate(_EX1_SHAPES):
        expected = _ones(L, S).tril()
        verdicts.append(tensor_verdict(value(results, i), expected, f"causal_mask({L}, {S})",
                                       _causal_mistakes(L, S, expected)))
    got = value(results, 0)
    dtype = Verdict(isinstance(got, Tensor) and got.dtype == torch.bool,
                    "causal_mask must return a bool tensor (True = attend), got "
                    + (str(got.dtype) if isinstance(got, Tensor) else type(got).__name__))
    tall_wide = verdicts[1] if not verdicts[1].passed else verdicts[2]
    return {"square": verdicts[0], "tall_and_wide": tall_wide, "dtype": dtype}


# --------------------------------------------------------------------------- ex2: decoding, bottom-right
_EX2_SHAPES = ((3, 7), (1, 6), (5, 5))


def _prep_ex2(g):
    return [Call("decoding_mask", shape) for shape in _EX2_SHAPES], None


def _judge_ex2(ctx, results, outcome):
    out = []
    for i, (L, S) in enumerate(_EX2_SHAPES):
        expected = _ones(L, S).tril(S - L)
        mistakes = [
            mistake("causal_alignment", "this is aligned top-left (is_causal's): with a cache the new queries are "
                                        "the last L positions, so query i sees keys 0..i + (S - L); use "
                                        "tril(diagonal=S - L)", _ones(L, S).tril()),
            mistake("off_by_one", "the diagonal is off by one: query i sits at position i + S - L and sees "
                                  "exactly that many + 1 keys (tril(S - L))", _ones(L, S).tril(S - L - 1)),
            mistake("off_by_one", "the diagonal is off by one: query i would see one key past its own position "
                                  "(tril(S - L), not tril(S - L + 1))", _ones(L, S).tril(S - L + 1)),
            mistake("mask_polarity", "True marks the hidden keys here; True = attend", ~expected),
            mistake("causal_alignment", "the offset is L - S: the S - L cached keys come *before* the new queries, "
                                        "so query i sees keys 0..i + (S - L): tril(diagonal=S - L)",
                    _ones(L, S).tril(L - S)),
            mistake("causal_future", "the mask is upper-triangular: query i would see later keys; use "
                                     "tril(diagonal=S - L)", _ones(L, S).triu(S - L)),
        ]
        out.append(tensor_verdict(value(results, i), expected, f"decoding_mask({L}, {S})", mistakes))
    values = next((v for v in out[:2] if not v.passed), out[0])
    return {"values": values, "square_equals_causal": out[2]}


# --------------------------------------------------------------------------- ex3: padding
def _prep_ex3(g):
    lengths = torch.tensor([5, 2, 7])
    return [Call("padding_mask", (lengths, 7))], lengths


def _judge_ex3(lengths, results, outcome):
    got = value(results, 0)
    keep = torch.arange(7) < lengths[:, None]  # (B, S)
    expected = keep[:, None, None, :]  # (B, 1, 1, S)
    query_side = keep[:, None, :, None]  # (B, 1, L=S, 1): hides padded *queries*
    mistakes = [
        mistake("mask_polarity", "True marks the padding here; True must mean a real key (j < length)", ~expected),
        mistake("off_by_one", "one key too many is kept: a sequence of length n has real tokens 0..n-1 "
                              "(use <, not <=)", (torch.arange(7) <= lengths[:, None])[:, None, None, :]),
        mistake("off_by_one", "each sequence's last real key is masked: a sequence of length n has real tokens "
                              "0..n-1, all n of them kept (positions from 0, j < n)",
                (torch.arange(7) < lengths[:, None] - 1)[:, None, None, :]),
        mistake("padding_query_side", "the mask hides padded *queries* (shape [B, 1, S, 1]); padding hides keys: "
                                      "[B, 1, 1, S], so no real query attends to a padding token",
                query_side),
    ]
    shape_ok = isinstance(got, Tensor) and got.shape == (3, 1, 1, 7)
    shape = Verdict(shape_ok, f"expected shape [B, 1, 1, S] = [3, 1, 1, 7], got "
                              f"{list(got.shape) if isinstance(got, Tensor) else type(got).__name__}")
    if isinstance(got, Tensor) and got.shape == (3, 7):
        shape.message += ": add the head and query dims with [:, None, None, :]"
    return {"shape": shape, "values": tensor_verdict(got, expected, "padding_mask([5, 2, 7], 7)", mistakes)}


# --------------------------------------------------------------------------- ex4: combining
def _prep_ex4(g):
    a = torch.rand(2, 1, 4, 6, generator=g) > 0.3
    b = torch.rand(1, 3, 1, 6, generator=g) > 0.3
    return [Call("combine_masks", (a, b))], (a, b)


def _judge_ex4(ctx, results, outcome):
    a, b = ctx
    expected = a & b
    mistakes = [mistake("mask_combined_or", "the masks are combined with |: a key is visible only where *every* "
                                            "mask allows it, so use &", a | b)]
    try:
        got = value(results, 0)
    except CallFailed as exc:
        error = exc.result.get("error", "")
        if "doesn't match the broadcast shape" in error:  # torch's words for an in-place op that must grow
            message = ("an in-place & (a &= b) writes into the caller's mask, and cannot grow it to the broadcast "
                       "shape: return a new tensor, a & b")
            return {"values": Verdict(False, f"raised {error}", [{"code": "mutates_input", "message": message}])}
        raise
    return {"values": tensor_verdict(got, expected, "combine_masks", mistakes)}


# --------------------------------------------------------------------------- ex5: masked softmax
def _softmax(s: Tensor) -> Tensor:
    """The float64 reference: a stable softmax with zero rows where every key is masked."""
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def _prep_ex5(g):
    scores = torch.randn(2, 5, 6, generator=g) * 2
    mask = torch.rand(2, 5, 6, generator=g) > 0.4
    mask[:, :, 0] = True
    mask[1, 3, :] = False  # a row with no visible key
    big = torch.randn(2, 5, 6, generator=g) * 400  # exp overflows unless the max is subtracted
    return [Call("masked_softmax", (scores, mask)), Call("masked_softmax", (big, mask))], (scores, mask, big)


def _sum_over_queries(s: Tensor) -> Tensor:
    """A softmax shifted by each row's max but summed over the queries (0 where that sum is 0)."""
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isneginf(m), torch.zeros_like(m), m))
    total = e.sum(dim=-2, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def _ex5_mistakes(s: Tensor, mask: Tensor) -> list:
    naive = torch.exp(s.masked_fill(~mask, NEG_INF))
    return [
        mistake("mask_after_softmax", "the mask is applied after the softmax: the visible keys then do not sum to 1; "
                                      "fill the scores with -inf before it", _softmax(s) * mask),
        mistake("mask_after_softmax", "the mask is applied after the softmax (and the row renormalised is not the "
                                      "same thing for an empty row); mask the scores first",
                torch.where(mask, _softmax(s), torch.zeros_like(s))),
        mistake("mask_fill_zero", "masked scores are set to 0 (filled with 0, or multiplied by the mask), which "
                                  "still gets weight; use -inf", _softmax(s.masked_fill(~mask, 0.0))),
        mistake("mask_ignored", "the mask has no effect: the scores reach the softmax unmasked (a bias of 0 "
                                "everywhere?); -inf where the mask is False", _softmax(s)),
        mistake("softmax_dim", "the softmax runs over the queries (dim=-2): each query's row over the keys "
                               "(dim=-1) must sum to 1", _softmax(s.masked_fill(~mask, NEG_INF).transpose(-2, -1))
                .transpose(-2, -1)),
        mistake("softmax_dim", "the sum runs over the queries (dim=-2): each row's max and sum are over the keys "
                               "(dim=-1)", _sum_over_queries(s.masked_fill(~mask, NEG_INF))),
        mistake("mask_polarity", "-inf is placed where the mask is True; True = attend", _softmax(s.masked_fill(mask, NEG_INF))),
        mistake("fully_masked_nan", "a row whose keys are all masked gives NaN: 0/0. Return zeros there (divide "
                                    "by 1 where the sum is 0)", naive / naive.sum(-1, keepdim=True)),
        mistake("mask_fill_finite", "masked scores are set to a large finite number (-1e9): a row whose keys are all "
                                    "masked then averages them instead of giving 0; fill with float('-inf')",
                _softmax(s.masked_fill(~mask, -1e9))),
    ]


def _judge_ex5(ctx, results, outcome):
    scores, mask, big = ctx
    s = scores.double()
    got = value(results, 0)
    expected = _softmax(s.masked_fill(~mask, NEG_INF))
    values = tensor_verdict(got, expected, "masked_softmax", _ex5_mistakes(s, mask))
    seen = mask.any(-1)  # rows with a visible key: a mistake shows there whatever the empty rows give
    if not values.passed and not values.findings and isinstance(got, Tensor) and got.shape == mask.shape:
        rows = tensor_verdict(got[seen], expected[seen], "masked_softmax (rows with a visible key)",
                              [mistake(c, m, w[seen]) for c, m, w in _ex5_mistakes(s, mask) if w is not None])
        if rows.findings:
            values = rows
    if not values.passed and not values.findings and isinstance(got, Tensor) and got.shape == mask.shape:
        # each mistake on the rows both it and the reference compute as usual (finite, some key weighed): the
        # empty rows of either (an inverted mask's rows of all True, the mask's rows of all False) are where
        # a learner's empty-row handling, keyed on their own mask, may differ from ours
        for c, m, w in _ex5_mistakes(s, mask):
            if w is None:
                continue
            own = seen & w.isfinite().all(-1) & (w != 0).any(-1)
            if own.any():
                rows = tensor_verdict(got[own], expected[own], "masked_softmax (the rows the mistake computes)",
                                      [mistake(c, m, w[own])])
                if rows.findings:
                    values = rows
                    break
    ok = isinstance(got, Tensor) and got.shape == mask.shape
    empty_ok = ok and bool(torch.isfinite(got[1, 3]).all() and (got[1, 3] == 0).all())
    empty = Verdict(empty_ok, "masked_softmax: a row whose keys are all masked must give zeros, not NaN")
    if not empty_ok and ok and not bool(torch.isfinite(got[1, 3]).all()):
        empty.findings = [{"code": "fully_masked_nan", "message": "a fully masked row gives NaN (0/0): return "
                                                                  "zeros there"}]
    got_big = value(results, 1)
    bd = big.double()
    # in float32, as the learner computes it: the visible keys underflow there, not in float64
    before = torch.exp(big.masked_fill(~mask, NEG_INF) - big.amax(dim=-1, keepdim=True)).double()
    total = before.sum(dim=-1, keepdim=True)
    large = tensor_verdict(got_big, _softmax(bd.masked_fill(~mask, NEG_INF)), "masked_softmax on scores of size ~1000",
                           [mistake("unstable_softmax", "the row max is taken before masking: a masked key's large "
                                    "score then makes every visible key underflow to 0; take the max of the masked "
                                    "scores", before / torch.where(total == 0, torch.ones_like(total), total))])
    # NaN with ordinary scores too is no overflow (a bias of 0 * -inf is NaN, say): not named unstable
    ordinary_finite = isinstance(got, Tensor) and got.shape == mask.shape and bool(torch.isfinite(got[seen]).all())
    # and a mistake named on the ordinary scores explains the large ones too: one name, not two
    if not large.passed and not large.findings and not values.findings and ordinary_finite and \
            isinstance(got_big, Tensor) and \
            got_big.shape == mask.shape and not torch.isfinite(got_big[mask.any(-1)]).all():
        message = "scores of size ~1000 overflow exp(): subtract each row's maximum before exp"
        large = Verdict(False, message, [{"code": "unstable_softmax", "message": message}])
    if not large.passed and values.findings:  # the mistake the ordinary scores name explains the large ones:
        large.findings = values.findings  # (a mask applied after the softmax underflows there like a max taken
    return {"values": values, "fully_masked_rows": empty, "large_scores": large}  # before the mask would)


# --------------------------------------------------------------------------- ex6: MHA's polarity
def _prep_ex6(g):
    kpm = torch.rand(3, 6, generator=g) > 0.6  # True = ignore (nn.MultiheadAttention)
    return [Call("from_key_padding_mask", (kpm,))], kpm


def _judge_ex6(kpm, results, outcome):
    expected = (~kpm)[:, None, None, :]
    mistakes = [mistake("mask_polarity", "nn.MultiheadAttention's key_padding_mask is True where a key is "
                                         "*ignored*; SDPA's mask is True where it is *attended*: invert it (~)",
                        kpm[:, None, None, :]),
                mistake("padding_query_side", "the mask has shape [B, 1, S, 1], so it hides padded *queries*; padding "
                                              "hides keys: [B, 1, 1, S] ([:, None, None, :])", (~kpm)[:, None, :, None])]
    got = value(results, 0)
    if isinstance(got, Tensor) and got.shape == (3, 6):
        return {"values": Verdict(False, "from_key_padding_mask: expected shape [B, 1, 1, S] = [3, 1, 1, 6], got "
                                         "[3, 6]: add the head and query dims with [:, None, None, :]")}
    return {"values": tensor_verdict(got, expected, "from_key_padding_mask", mistakes)}


# --------------------------------------------------------------------------- ex7: the attention
def _prep_ex7(g):
    Q = torch.randn(2, 2, 4, 5, generator=g)
    K = torch.randn(2, 2, 6, 5, generator=g)
    V = torch.randn(2, 2, 6, 3, generator=g)
    pad = (torch.arange(6) < torch.tensor([6, 3])[:, None])[:, None, None, :]
    both = pad & torch.ones(4, 6, dtype=torch.bool).tril(2)  # bottom-right causal (a cache of 2) and padding
    empty = torch.ones(2, 2, 4, 6, dtype=torch.bool)
    empty[:, :, 1] = False  # query 1 sees nothing
    calls = [Call("masked_attention", (Q, K, V)), Call("masked_attention", (Q, K, V, both)),
             Call("masked_attention", (Q, K, V, empty))]
    # then the doctor's probes, as plain calls (judged here if a check fails)
    more, probes = probe_calls("masked_attention", _DOCTOR_CAPABILITIES, positional=("attn_mask",))
    return calls + more, (Q, K, V, both, empty, probes)


# what masked_attention(Q, K, V, mask) takes of SDPA's signature: L != S, E != Ev, bool masks
_DOCTOR_CAPABILITIES = frozenset({"rect", "mask"})


def _judge_ex7(ctx, results, outcome):
    Q, K, V, both, empty = (t.double() if t.is_floating_point() else t for t in ctx[:5])
    probes = ctx[5]
    out = {}
    for name, i, mask in (("no_mask", 0, None), ("padding_and_causal", 1, both), ("fully_masked_row", 2, empty)):
        expected = scaled_dot_product_attention(Q, K, V, attn_mask=mask)
        mistakes = []
        if mask is not None:
            mistakes.append(mistake("mask_polarity", "the mask is inverted: True = attend",
                                    scaled_dot_product_attention(Q, K, V, attn_mask=~mask)))
        mistakes.append(mistake("missing_scale", "the scores are not divided by sqrt(E)",
                                scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=1.0)))
        try:
            out[name] = tensor_verdict(value(results, i), expected, f"masked_attention ({name.replace('_', ' ')})",
                                       mistakes)
        except CallFailed as exc:
            out[name] = Verdict(False, f"raised {exc.result['error']}\n{exc.result.get('traceback', '')}")
    got = out["fully_masked_row"]
    if not got.passed and not got.findings:
        try:
            row = value(results, 2)
            if isinstance(row, Tensor) and not torch.isfinite(row[:, :, 1]).all():
                message = "a query whose keys are all masked gives NaN: its output must be 0 (as SDPA's)"
                out["fully_masked_row"] = Verdict(False, message, [{"code": "fully_masked_nan", "message": message}])
        except CallFailed:
            pass
    if any(not v.passed and not v.findings for v in out.values()):
        findings = doctor_findings(probes, results[3:])
        for v in out.values():
            if not v.passed and not v.findings:
                v.findings = findings
    return out


EXERCISES: list[Exercise] = [
    Exercise("ex1", "causal_mask", "causal mask, top-left", {"square": 4, "tall_and_wide": 8, "dtype": 3},
             _prep_ex1, _judge_ex1),
    Exercise("ex2", "decoding_mask", "a KV cache's mask, bottom-right", {"values": 12, "square_equals_causal": 3},
             _prep_ex2, _judge_ex2),
    Exercise("ex3", "padding_mask", "padding mask on the keys", {"shape": 4, "values": 8}, _prep_ex3, _judge_ex3),
    Exercise("ex4", "combine_masks", "combining masks", {"values": 6}, _prep_ex4, _judge_ex4),
    Exercise("ex5", "masked_softmax", "masked softmax",
             {"values": 14, "fully_masked_rows": 6, "large_scores": 4},
             _prep_ex5, _judge_ex5),
    Exercise("ex6", "from_key_padding_mask", "nn.MultiheadAttention's True = ignore", {"values": 8},
             _prep_ex6, _judge_ex6),
    Exercise("ex7", "masked_attention", "attention with a mask, as SDPA",
             {"no_mask": 4, "padding_and_causal": 8, "fully_masked_row": 8}, _prep_ex7, _judge_ex7),
]
assert sum(ex.max_score for ex in EXERCISES) == 100
