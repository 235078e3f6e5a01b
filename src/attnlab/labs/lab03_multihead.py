"""Lab 03's checks (``labs/track1/03-multi-head``): heads, grouped queries, a KV cache.

Same machinery as lab 01's (:mod:`attnlab.grading.exercise`): seeded, unequal inputs (3 heads
of 4 in a model of 12, 6 query heads over 2 key/value heads, a cache of 4 then 3 new
tokens), a float64 reference computed here (``nn.MultiheadAttention`` itself for the parity
check), and what each common mistake returns, to name it (codes from :mod:`attnlab.mistakes`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from attnlab.functional import scaled_dot_product_attention
from attnlab.grading.exercise import (CallFailed, Exercise, Verdict, doctor_findings, mistake, probe_calls,
                                     tensor_verdict, value)
from attnlab.grading.sandbox import Call
from attnlab.labs import Lab
from attnlab.softmax import stable_softmax

__all__ = ["LAB", "EXERCISES"]

LAB = Lab("03-multi-head", "Multi-head and grouped-query attention, and a KV cache",
          "splitting and merging heads, the output projection, parity with nn.MultiheadAttention, "
          "grouped-query and multi-query attention (which key/value head each query head uses), decoding with "
          "a KV cache that equals the full causal forward", file="multihead.py", module=__name__,
          rule="This lab builds multi-head attention from scratch: reshape, transpose, matmul and your own "
               "softmax (torch's SDPA, softmax and nn.MultiheadAttention are the oracles, not the answer)")

B, L, D, H = 2, 5, 12, 3
E = D // H


def _split(x: Tensor, h: int) -> Tensor:
    b, n, d = x.shape
    return x.view(b, n, h, d // h).transpose(1, 2)  # [B, L, H, E] -> [B, H, L, E]


def _merge(x: Tensor) -> Tensor:
    b, h, n, e = x.shape
    return x.transpose(1, 2).reshape(b, n, h * e)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask=None, scale=None) -> Tensor:
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# --------------------------------------------------------------------------- ex1 - ex2: heads
def _prep_ex1(g):
    x = torch.randn(B, L, D, generator=g)
    return [Call("split_heads", (x, H))], x


def _judge_ex1(x, results, outcome):
    got = value(results, 0)
    xd = x.double()
    mistakes = [
        mistake("heads_mixed", "reshaped straight to [B, H, L, E] without the transpose: each 'head' then mixes "
                               "positions; view as [B, L, H, E], then transpose(1, 2)", xd.reshape(B, H, L, E)),
        mistake("heads_mixed", "head h must get the contiguous features h*E .. (h+1)*E - 1, not every H-th one",
                xd.view(B, L, E, H).permute(0, 3, 1, 2)),
        mistake("heads_mixed", "transposed before the view: [B, D, L] reshaped to [B, H, L, E] mixes positions into "
                               "each head; view as [B, L, H, E] first, then transpose(1, 2)",
                xd.transpose(1, 2).reshape(B, H, L, E)),
    ]
    shape = Verdict(isinstance(got, Tensor) and got.shape == (B, H, L, E),
                    f"split_heads: expected shape [B, H, L, E] = {[B, H, L, E]}, got "
                    f"{list(got.shape) if isinstance(got, Tensor) else type(got).__name__}")
    return {"shape": shape, "values": tensor_verdict(got, _split(xd, H), "split_heads", mistakes)}


def _prep_ex2(g):
    x = torch.randn(B, H, L, E, generator=g)
    return [Call("merge_heads", (x,))], x


def _judge_ex2(x, results, outcome):
    xd = x.double()
    mistakes = [mistake("heads_mixed", "reshaped [B, H, L, E] straight to [B, L, D] without transpose(1, 2) "
                                       "first: positions and heads are mixed", xd.reshape(B, L, D)),
                mistake("heads_mixed", "the heads end up last ([B, L, E, H] flattened), so each head's features are "
                                       "interleaved with the others': transpose(1, 2) gives [B, L, H, E]",
                        xd.permute(0, 2, 3, 1).reshape(B, L, D))]
    return {"values": tensor_verdict(value(results, 0), _merge(xd), "merge_heads", mistakes)}


# --------------------------------------------------------------------------- ex3: the layer
def _prep_ex3(g):
    x = torch.randn(B, L, D, generator=g)
    W = [torch.randn(D, D, generator=g) / math.sqrt(D) for _ in range(4)]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return [Call("multi_head_attention", (x, *W, H)), Call("multi_head_attention", (x, *W, H, causal))], (x, W, causal)


def _attend_rows(q: Tensor, k: Tensor, v: Tensor, mask=None, scale=None, dim: int = -1, how: str = "fill",
                 fill: float = float("-inf")) -> Tensor:
    """Attention as a learner may get it wrong: the softmax along ``dim`` (-2: over the queries);
    the mask applied by ``how``: "fill" (``fill`` where it is False; the scores times the mask give
    the same numbers as a fill of 0) or "after" (the weights zeroed after the softmax)."""
    s = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None and how == "fill":
        s = s.masked_fill(~mask, fill)
    p = stable_softmax(s, dim=dim)
    if mask is not None and how == "after":
        p = p.masked_fill(~mask, 0.0)
    return p @ v


def _strided(t: Tensor, h: int) -> Tensor:
    """Head i as features i, i + H, i + 2H, ... (a stride of H): [B, L, D] -> [B, H, L, E]."""
    return t.view(B, L, -1, h).permute(0, 3, 1, 2)


def _fused_split(t: Tensor, h: int) -> Tensor:
    """``split_heads`` of the fused [B, L, 3D] projection before ``chunk(3)``: each head then takes its
    query, key and value features from one 3E slice (the heads cut across q, k and v)."""
    return t.view(B, L, h, -1).transpose(1, 2)


def _mha(x: Tensor, W: list[Tensor], mask=None, scale=None, out_proj=True, split=_split, order=(0, 1, 2),
         dim: int = -1, how: str = "fill", fused: bool = False, fill: float = float("-inf")) -> Tensor:
    if fused:  # split_heads of x @ [W_Q | W_K | W_V], then chunk(3) along the features
        q, k, v = _fused_split(x @ torch.cat(W[:3], dim=1), H).chunk(3, dim=-1)
    else:
        q, k, v = (split(x @ W[i], H) for i in order)
    plain = dim == -1 and how == "fill" and fill == float("-inf")
    y = _merge(_attend(q, k, v, mask, scale) if plain else _attend_rows(q, k, v, mask, scale, dim, how, fill))
    return y @ W[3] if out_proj else y


def _judge_ex3(ctx, results, outcome):
    x, W, causal = ctx
    xd, Wd = x.double(), [w.double() for w in W]
    out = {}
    for name, i, mask in (("no_mask", 0, None), ("causal_mask", 1, causal)):
        expected = _mha(xd, Wd, mask)
        mistakes = [
            mistake("missing_out_proj", "the output projection is missing: merge the heads, then @ W_O",
                    _mha(xd, Wd, mask, out_proj=False)),
            mistake("wrong_scale", "the scores are scaled by 1/sqrt(D), D the model size; each head's scores "
                                   "need 1/sqrt(E), E = D // H the size of one head",
                    _mha(xd, Wd, mask, scale=1 / math.sqrt(D))),
            mistake("heads_mixed", "the heads are split by a reshape without the transpose, so each head mixes "
                                   "positions", _mha(xd, Wd, mask, split=lambda t, h: t.reshape(B, h, L, D // h))),
            mistake("missing_scale", "the scores are not scaled: divide each head's Q @ K^T by sqrt(E), E = D // H",
                    _mha(xd, Wd, mask, scale=1.0)),
            mistake("order", "the keys and values come from each other's weights: k = x @ W_K, v = x @ W_V",
                    _mha(xd, Wd, mask, order=(0, 2, 1))),
            mistake("value_swapped", "the values are projected with W_K: v = x @ W_V", _mha(xd, Wd, mask, order=(0, 1, 1))),
            mistake("value_swapped", "the values are projected with W_Q: v = x @ W_V", _mha(xd, Wd, mask, order=(0, 1, 0))),
            mistake("softmax_dim", "the softmax runs over the queries: each query's row over the keys must sum to 1",
                    _mha(xd, Wd, mask, dim=-2)),
            mistake("wrong_scale", "the scores are multiplied by sqrt(E): divide them by sqrt(E), E = D // H",
                    _mha(xd, Wd, mask, scale=math.sqrt(E))),
            mistake("wrong_scale", "the scores are scaled by 1/sqrt(H), H the number of heads: each head's "
                                   "scores need 1/sqrt(E), E = D // H the size of one head (q.shape[-1])",
                    _mha(xd, Wd, mask, scale=1 / math.sqrt(H))),
            mistake("wrong_scale", "the scores are divided by E: divide by sqrt(E)", _mha(xd, Wd, mask, scale=1 / E)),
            mistake("heads_mixed", "head h takes every H-th feature (a stride of H): it must take the contiguous "
                                   "features h*E .. (h+1)*E - 1", _mha(xd, Wd, mask, split=_strided)),
            mistake("heads_mixed", "the heads are split before the fused projection is cut into q, k and v: each "
                                   "head then mixes query, key and value features; chunk(3) first, then split each",
                    _mha(xd, Wd, mask, fused=True)),
        ]
        if mask is not None:
            mistakes += [
                mistake("mask_polarity", "the mask is inverted: True = attend, so fill -inf where it is False",
                        _mha(xd, Wd, ~mask)),
                mistake("mask_ignored", "the mask has no effect: fill the scores with -inf where it is False, "
                                        "before the softmax", _mha(xd, Wd, None)),
                # the scores times the mask give the same numbers as a fill of 0: one name for both
                mistake("mask_fill_zero", "the hidden scores are 0 (filled with 0, or multiplied by the mask), which "
                                          "still gets weight: fill -inf where the mask is False",
                        _mha(xd, Wd, mask, fill=0.0)),
                mistake("mask_after_softmax", "the weights are masked after the softmax, so the visible keys' weights "
                                              "no longer sum to 1: mask the scores with -inf before it",
                        _mha(xd, Wd, mask, how="after")),
            ]
        out[name] = tensor_verdict(value(results, i), expected, f"multi_head_attention ({name.replace('_', ' ')})",
                                   mistakes)
    # parity with torch's own layer, weights copied in (torch's weights act on the left: W^T)
    mha = torch.nn.MultiheadAttention(D, H, bias=False, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([w.T for w in Wd[:3]]))
        mha.out_proj.weight.copy_(Wd[3].T)
        theirs, _ = mha(xd, xd, xd, need_weights=False)
    parity = tensor_verdict(value(results, 0), theirs, "multi_head_attention against nn.MultiheadAttention")
    if not parity.passed and out["no_mask"].findings:
        parity = Verdict(False, out["no_mask"].message, out["no_mask"].findings)
    out["matches_nn_multihead"] = parity
    return out


# --------------------------------------------------------------------------- ex4 - ex5: GQA
def _prep_ex4(g):
    kv = torch.randn(2, 2, 5, 4, generator=g)
    return [Call("repeat_kv", (kv, 3))], kv


def _judge_ex4(kv, results, outcome):
    kd = kv.double()
    mistakes = [mistake("gqa_group_mapping", "repeat tiles the heads (0, 1, 0, 1, ...); query head h must use "
                                             "key/value head h // groups (0, 0, 0, 1, 1, 1): repeat_interleave",
                        kd.repeat(1, 3, 1, 1))]
    got, named = _value_or_index_error(results)
    if named is not None:
        return {"values": named}
    return {"values": tensor_verdict(got, kd.repeat_interleave(3, dim=1), "repeat_kv", mistakes)}


def _value_or_index_error(results: list[dict]) -> tuple[object, Optional[Verdict]]:
    """(the first call's value, None), or (None, a verdict naming ``gqa_group_mapping``) where the
    call raised an IndexError out of bounds: in a GQA exercise, the key/value head of a query head
    computed past Hkv - 1 (h // Hkv, or groups taken as Hkv). Any other error propagates."""
    try:
        return value(results, 0), None
    except CallFailed as exc:
        error = exc.result.get("error", "")
        if not (error.startswith("IndexError") and "out of bounds" in error):
            raise
    message = ("an index past the key/value heads: query head h uses key/value head h // groups "
               "(groups = H // Hkv, the query heads per key/value head), so the indices run 0 .. Hkv - 1")
    return None, Verdict(False, f"raised {error}", [{"code": "gqa_group_mapping", "message": message}])


# what gqa_attention(q, k, v) takes of SDPA's signature: L != S, E != Ev, and it always groups the heads
_DOCTOR_CAPABILITIES = frozenset({"rect", "gqa"})


def _prep_ex5(g):
    q = torch.randn(2, 6, 4, 8, generator=g)
    k = torch.randn(2, 2, 7, 8, generator=g)
    v = torch.randn(2, 2, 7, 5, generator=g)
    more, probes = probe_calls("gqa_attention", _DOCTOR_CAPABILITIES, implied=("enable_gqa",))
    return [Call("gqa_attention", (q, k, v)), *more], (q, k, v, probes)


def _judge_ex5(ctx, results, outcome):
    q, k, v = (t.double() for t in ctx[:3])
    expected = _attend(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1))
    mistakes = [
        mistake("gqa_group_mapping", "query head h must use key/value head h // groups (repeat_interleave), not "
                                     "h % Hkv (repeat)", _attend(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1))),
        mistake("missing_scale", "the scores are not divided by sqrt(E)",
                _attend(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), scale=1.0)),
    ]
    got, named = _value_or_index_error(results)
    if named is not None:
        return {"values": named}
    verdict = tensor_verdict(got, expected, "gqa_attention", mistakes)
    if not verdict.passed and not verdict.findings:
        verdict.findings = doctor_findings(ctx[3], results[1:])
    return {"values": verdict}


# --------------------------------------------------------------------------- ex6: the KV cache
# (cached P, new L): each ends at the sequence's 7 tokens. The first (the one whose mistakes are
# named) has L apart from P - 1, P and P + 1, and L > 2 so that tril(P + 1) still hides a key: with
# (4, 3) a mask of tril(diagonal=L) was tril(P - 1) and was called off_by_one ("not P - 1") for a
# learner who had written L (issue 48)
_EX6_CASES = ((2, 5), (0, 7), (6, 1))


def _prep_ex6(g):
    full = [torch.randn(1, 2, 7, 4, generator=g) for _ in range(2)] + [torch.randn(1, 2, 7, 3, generator=g)]
    q, k, v = full
    calls = []
    for P, n in _EX6_CASES:
        end = P + n
        calls.append(Call("decode_step", (q[:, :, P:end], k[:, :, :P], v[:, :, :P], k[:, :, P:end], v[:, :, P:end])))
    return calls, (q, k, v)


def _judge_ex6(ctx, results, outcome):
    q, k, v = (t.double() for t in ctx)
    full = _attend(q, k, v, torch.ones(7, 7, dtype=torch.bool).tril())  # the full causal forward
    got = value(results, 0)
    P, n = _EX6_CASES[0]
    if not (isinstance(got, tuple) and len(got) == 3):
        bad = Verdict(False, f"decode_step must return (output, k_cache, v_cache), got {type(got).__name__}")
        return {"cache": bad, "output": bad, "equals_full_forward": bad}
    out, k_cache, v_cache = got
    cache = tensor_verdict(k_cache, k[:, :, :P + n], "the new k cache", [
        mistake("kv_cache_order", "the new keys go after the cached ones: torch.cat([k_cache, k_new], dim=2)",
                torch.cat([k[:, :, P:P + n], k[:, :, :P]], dim=2)),
        mistake("order", "the caches come back swapped: return (output, k_cache, v_cache), keys first",
                v[:, :, :P + n]),
        mistake("kv_cache_order", "the cache returned is the old one: return the caches with the new keys and "
                                  "values appended (torch.cat([k_cache, k_new], dim=2))", k[:, :, :P])])
    if cache.passed:
        cache = tensor_verdict(v_cache, v[:, :, :P + n], "the new v cache")
    qn, kk, vv = q[:, :, P:P + n], k[:, :, :P + n], v[:, :, :P + n]
    causal = torch.ones(n, P + n, dtype=torch.bool).tril(P)
    mistakes = [
        mistake("causal_alignment", "the causal mask ignores the cache's offset: new query i sits at position "
                                    "P + i and sees keys 0 .. P + i (tril(diagonal=P)), not 0 .. i",
                _attend(qn, kk, vv, torch.ones(n, P + n, dtype=torch.bool).tril())),
        mistake("mask_ignored", "no causal mask among the new tokens: query i must not see the new tokens "
                                "after it (tril(diagonal=P))", _attend(qn, kk, vv)),
        mistake("off_by_one", "the mask's diagonal is off by one: query i sits at position P + i and sees keys "
                              "0 .. P + i (tril(diagonal=P), not P - 1)",
                _attend(qn, kk, vv, torch.ones(n, P + n, dtype=torch.bool).tril(P - 1))),
        mistake("off_by_one", "the mask's diagonal is off by one: query i would see the key after its own "
                              "position (tril(diagonal=P), not P + 1)",
                _attend(qn, kk, vv, torch.ones(n, P + n, dtype=torch.bool).tril(P + 1))),
        mistake("mask_polarity", "the mask is inverted: True = attend",
                _attend(qn, kk, vv, ~torch.ones(n, P + n, dtype=torch.bool).tril(P))),
        mistake("causal_future", "the mask is upper-triangular: query i would see later keys; tril(diagonal=P)",
                _attend(qn, kk, vv, torch.ones(n, P + n, dtype=torch.bool).triu(P))),
        mistake("causal_alignment", "the mask's diagonal is the number of new tokens (L): new query i sits at "
                                    "position P + i, after the P cached ones, so the diagonal is P (tril(diagonal=P))",
                _attend(qn, kk, vv, torch.ones(n, P + n, dtype=torch.bool).tril(n))),
        mistake("missing_scale", "the scores are not divided by sqrt(E)", _attend(qn, kk, vv, causal, scale=1.0)),
        mistake("mask_fill_zero", "the hidden keys' scores are set to 0, which still gets weight: fill -inf",
                _attend_rows(qn, kk, vv, causal, fill=0.0)),
        mistake("softmax_dim", "the softmax runs over the queries: each new query's row over the keys must sum to 1",
                _attend_rows(qn, kk, vv, causal, dim=-2)),
        mistake("value_swapped", "the weights multiply the keys: the output is weights @ values",
                _attend(qn, kk, kk, causal)),
    ]
    output = tensor_verdict(out, full[:, :, P:P + n], f"decode_step output (a cache of {P}, {n} new tokens)", mistakes)
    equal = Verdict(True)
    for i, (P2, n2) in enumerate(_EX6_CASES[1:], start=1):
        r = value(results, i)
        o = r[0] if isinstance(r, tuple) and r else r
        equal = tensor_verdict(o, full[:, :, P2:P2 + n2], f"decode_step with a cache of {P2} and {n2} new token(s)"
                               " against the full causal forward")
        if not equal.passed:
            break
    return {"cache": cache, "output": output, "equals_full_forward": equal}


EXERCISES: list[Exercise] = [
    Exercise("ex1", "split_heads", "splitting into heads", {"shape": 4, "values": 10}, _prep_ex1, _judge_ex1),
    Exercise("ex2", "merge_heads", "merging the heads", {"values": 10}, _prep_ex2, _judge_ex2),
    Exercise("ex3", "multi_head_attention", "the multi-head layer",
             {"no_mask": 12, "causal_mask": 8, "matches_nn_multihead": 6}, _prep_ex3, _judge_ex3),
    Exercise("ex4", "repeat_kv", "sharing key/value heads", {"values": 10}, _prep_ex4, _judge_ex4),
    Exercise("ex5", "gqa_attention", "grouped-query attention", {"values": 14}, _prep_ex5, _judge_ex5),
    Exercise("ex6", "decode_step", "decoding with a KV cache", {"cache": 6, "output": 12, "equals_full_forward": 8},
             _prep_ex6, _judge_ex6),
]
assert sum(ex.max_score for ex in EXERCISES) == 100
