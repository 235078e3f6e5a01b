"""Lab 04's checks (``labs/track1/04-flash-attention``): FlashAttention from scratch.

Same machinery as lab 01's (:mod:`attnlab.grading.exercise`): seeded, unequal inputs
(L = 37 queries over S = 45 keys in tiles of 16, a causal 40 x 40 in query tiles of 16 and
key tiles of 8, and for the backward causal 24 x 40 and 40 x 24 too, so no mistake hides behind
square, aligned tiles), a float64 reference
computed here, and what each common mistake returns, to name it (codes from
:mod:`attnlab.mistakes`). The mistakes are simulated by :func:`simulate_forward`, the same loop as the
lab's with one step broken, so what a named mistake returns is what the learner's code does.

ex3 runs the learner's forward at L = S = 4096 under a memory cap of 32 MB above what the
child has mapped (``Exercise.limits``): one float32 [L, S] tensor is 64 MB, so building the
scores fails inside the kernel's own allocator, not by the learner's report.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from attnlab.functional import scaled_dot_product_attention
from attnlab.bugmodels import FlashBackward, FlashCase, flash_gradients
from attnlab.grading.exercise import Exercise, Verdict, explain_backward, mistake, model_mistakes, tensor_verdict, value
from attnlab.grading.sandbox import Call
from attnlab.labs import Lab
from attnlab.testing import tolerance

# the simulators are lab 05's too (the same algorithm in Triton): package-internal, documented here
__all__ = ["LAB", "EXERCISES", "BIG", "MEMORY_MB", "simulate_forward", "simulate_grads", "causal_mask", "tiles_kept",
           "judge_autograd_function"]

LAB = Lab("04-flash-attention", "FlashAttention from scratch: the online softmax, tiles, the backward",
          "the online softmax on a stream (running max and sum), the tiled forward with m_i, l_i, acc and the "
          "saved log-sum-exp, causal tiles skipped and masked, no [L, S] tensor (checked under a memory cap), the "
          "backward that recomputes tiles (the D term), one torch.autograd.Function", file="flash.py",
          module=__name__,
          # the autograd.Function and what the stub's ctx carries
          allowed_names=("autograd", "Function", "apply", "save_for_backward", "saved_tensors", "grad_fn",
                         "is_causal"),
          rule="This lab builds FlashAttention from scratch: tiles, exp, the running max and sum, and matmul "
               "(torch's softmax and SDPA are the oracles, not the answer)")

NEG_INF = float("-inf")
BIG = 4096  # ex3's L = S: a float32 [L, S] tensor is 64 MB
MEMORY_MB = 32  # ex3's cap above the child's start: the tiles (256 x 256) and the output fit many times over


def _safe(m: Tensor) -> Tensor:
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


# --------------------------------------------------------------------------- the mistakes, simulated
def _stream_stats(x: Tensor, block: int, bug: str = "") -> tuple[Tensor, Tensor]:
    """ex1's loop; ``bug``: 'no_rescale' (l_i not rescaled), 'inverted' (exp(m_new - m_old)),
    'unsafe' (exp(-inf - -inf) = NaN on a row that has seen only -inf), 'stale' (m_i never
    updated: each block is summed under its own max, and what came before is dropped), 'block'
    (the max of the whole block, every row's, in place of each row's own)."""
    R, S = x.shape
    m_i = torch.full((R,), NEG_INF, dtype=x.dtype)
    l_i = torch.zeros(R, dtype=x.dtype)
    for s in range(0, S, block):
        chunk = x[:, s:s + block]
        m_new = torch.maximum(m_i, chunk.amax().expand(R) if bug == "block" else chunk.amax(-1))
        m_ref = m_new if bug == "unsafe" else _safe(m_new)
        if bug == "no_rescale":
            alpha = torch.ones_like(m_i)
        elif bug == "inverted":
            alpha = torch.exp(m_ref - m_i)
        else:
            alpha = torch.exp(m_i - m_ref)
        l_i = l_i * alpha + torch.exp(chunk - m_ref[:, None]).sum(-1)
        m_i = m_i if bug == "stale" else m_new
    return m_i, l_i


def simulate_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, bq: int, bk: int,
                     bug: str = "") -> tuple[Tensor, Tensor]:
    """The lab's forward in float64 with one step broken (``bug``): 'acc' (acc not rescaled),
    'l' (l_i not rescaled), 'stale' (P = exp(s - m_old): the tile's weights under the max
    before it), 'diag_unmasked' (causal blocks kept whole), 'diag_skipped' (the diagonal block
    skipped), 'off_by_one' (key j < query i), 'lse_log2' ((m_i + ln l_i) / ln 2), 'lse_log2_sum'
    (m_i + log2 l_i), 'lse_max' (lse = m_i), 'lse_no_max' (lse = ln l_i), 'no_divide' (o = acc, never
    divided by l_i). 'alpha_one': neither l_i nor acc rescaled (alpha taken after m_i = m_new, so
    exp(m_new - m_new) = 1), 'm_stuck': m_i never updated (it stays -inf, so alpha = 0 drops every
    tile but the last). With the running max started from the first tile (no -inf start):
    'm_first' (m_i never updated after it), 'stale_first' (P = exp(s - m_old) from the second
    tile on). 'alpha_inverted' (alpha = exp(m_new - m_old)), 'alpha_log2e' (alpha =
    exp((m_old - m_new) * log2(e)): exp where base-2 code needs exp2)."""
    B, H, L, E = q.shape
    S, Ev = k.shape[-2], v.shape[-1]
    o = torch.empty(B, H, L, Ev, dtype=q.dtype)
    lse = torch.empty(B, H, L, dtype=q.dtype)
    for qs in range(0, L, bq):
        qe = min(qs + bq, L)
        q_i = q[:, :, qs:qe] / math.sqrt(E)
        m_i = torch.full((B, H, qe - qs), NEG_INF, dtype=q.dtype)
        l_i = torch.zeros(B, H, qe - qs, dtype=q.dtype)
        acc = torch.zeros(B, H, qe - qs, Ev, dtype=q.dtype)
        stop = S if not causal else min(S, qs if bug == "diag_skipped" else qe)
        for ks in range(0, stop, bk):
            ke = min(ks + bk, S)
            s = q_i @ k[:, :, ks:ke].transpose(-2, -1)  # [B, H, bq, bk]
            if causal and bug not in ("diag_unmasked", "diag_skipped"):
                rows, cols = torch.arange(qs, qe)[:, None], torch.arange(ks, ke)[None, :]
                s = s.masked_fill(~(cols < rows if bug == "off_by_one" else cols <= rows), NEG_INF)
            m_new = torch.maximum(m_i, s.amax(-1))
            m_safe = _safe(m_new)
            stale = bug == "stale" or (bug == "stale_first" and ks > 0)
            p = torch.exp(s - (_safe(m_i) if stale else m_safe)[..., None])
            alpha = torch.exp({"alpha_inverted": m_safe - m_i, "alpha_log2e": (m_i - m_safe) / math.log(2)}.get(
                bug, m_i - m_safe))
            if bug == "alpha_inverted":  # as code that starts from the first tile's max gets it (nothing to rescale)
                alpha = torch.where(torch.isneginf(m_i), torch.zeros_like(alpha), alpha)
            l_i = (l_i if bug in ("l", "alpha_one") else l_i * alpha) + p.sum(-1)
            acc = (acc if bug in ("acc", "alpha_one") else acc * alpha[..., None]) + p @ v[:, :, ks:ke]
            m_i = m_i if bug == "m_stuck" or (bug == "m_first" and ks > 0) else m_new
        o[:, :, qs:qe] = acc if bug == "no_divide" else acc / l_i[..., None]
        lse[:, :, qs:qe] = {"lse_log2": (m_i + torch.log(l_i)) / math.log(2), "lse_log2_sum": m_i + torch.log2(l_i),
                            "lse_max": m_i, "lse_no_max": torch.log(l_i)}.get(bug, m_i + torch.log(l_i))
    return o, lse


def simulate_grads(q: Tensor, k: Tensor, v: Tensor, do: Tensor, mask: Optional[Tensor], bug: str = "",
                   p_mask: Optional[Tensor] = None, bk: int = 16) -> tuple:
    """dq, dk, dv in float64 from the formulas; ``bug``: 'no_d' (the D term dropped),
    'd_tile' (D = rowsum(P * dP) of each ``bk``-key tile, not of the whole row), 'no_scale' (dq, dk
    without the scale), 'no_scale_dq', 'no_scale_dk' (one of them),
    'p_unscaled' (P rebuilt from unscaled scores), 'no_d_dq' (dQ's dS without the D term
    alone), 'dv_scaled' (dV multiplied by the scale), 'd_no_o' (D = rowsum(dO), the O left out),
    'lse_units' (P = exp(s - lse * ln 2): base-2 scores against a natural lse), 'dq_twice',
    'dk_twice' (the scale applied twice, once more by hand to a q that carries it); ``p_mask``: the mask the backward rebuilds P
    with, where it differs from the forward's ``mask`` (the causal mask forgotten in the
    backward)."""
    scale = 1 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-2, -1)) * scale
    masked = s if mask is None else s.masked_fill(~mask, NEG_INF)
    lse = masked.logsumexp(-1, keepdim=True)  # [B, H, L, 1]
    rebuilt = s / scale if bug == "p_unscaled" else s
    p = torch.exp((masked if p_mask is None and bug != "p_unscaled" else
                   rebuilt.masked_fill(~(mask if p_mask is None else p_mask), NEG_INF) if (
                       p_mask is not None or mask is not None) else rebuilt) - lse)
    o = torch.exp(masked - lse) @ v
    if bug == "lse_units":
        p = torch.exp(masked - lse * math.log(2))
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    D = (do if bug == "d_no_o" else do * o).sum(-1, keepdim=True)
    if bug == "d_tile":  # each key tile's own rowsum(P * dP): the row's D only when one tile holds every key
        D = torch.cat([(p[..., j:j + bk] * dp[..., j:j + bk]).sum(-1, keepdim=True).expand(*p.shape[:-1],
                       min(bk, p.shape[-1] - j)) for j in range(0, p.shape[-1], bk)], dim=-1)
    ds = p * dp if bug == "no_d" else p * (dp - D)
    ds_q = p * dp if bug == "no_d_dq" else ds  # dQ's own dS (its kernel rebuilds it)
    sq = 1.0 if bug in ("no_scale", "no_scale_dq") else scale * (scale if bug == "dq_twice" else 1.0)
    sk = 1.0 if bug in ("no_scale", "no_scale_dk") else scale * (scale if bug == "dk_twice" else 1.0)
    return ds_q @ k * sq, ds.transpose(-2, -1) @ q * sk, dv * scale if bug == "dv_scaled" else dv


def causal_mask(L: int, S: int) -> Tensor:
    return torch.ones(L, S, dtype=torch.bool).tril()


def tiles_kept(L: int, S: int, bq: int, bk: int) -> Tensor:
    """[L, S]: True where the tile holding (query i, key j) is visited under is_causal (not
    wholly after the query block), whole: what a loop that skips tiles but masks none sees."""
    q_end = ((torch.arange(L) // bq + 1) * bq).clamp(max=L)  # [L]: the end of query i's block
    k_start = torch.arange(S) // bk * bk  # [S]
    return k_start[None, :] <= q_end[:, None] - 1


def _inputs(g: torch.Generator, L: int, S: int, B: int = 2, H: int = 2, E: int = 8, Ev: int = 6) -> tuple:
    return (torch.randn(B, H, L, E, generator=g), torch.randn(B, H, S, E, generator=g),
            torch.randn(B, H, S, Ev, generator=g))


def _pair(got, what: str) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Verdict]]:
    if isinstance(got, tuple) and len(got) == 2:
        return got[0], got[1], None
    return None, None, Verdict(False, f"{what} must return a pair (o, lse), got {type(got).__name__}")


# --------------------------------------------------------------------------- ex1: the online softmax
EX1_BLOCK = 8


def _prep_ex1(g):
    x = torch.randn(6, 40, generator=g) * 4
    x[2, :EX1_BLOCK] = NEG_INF  # a row whose first block is all masked
    x[4] = torch.linspace(-3, 9, 40)  # a row whose max grows in every block
    return [Call("online_softmax_stats", (x, EX1_BLOCK))], x


def _judge_ex1(x, results, outcome):
    got = value(results, 0)
    if not (isinstance(got, tuple) and len(got) == 2):
        bad = Verdict(False, f"online_softmax_stats must return (m_i, l_i), got {type(got).__name__}")
        return {"m": bad, "l": bad, "masked_first_block": bad}
    m, l_ = got
    xd = x.double()
    m_ref = xd.amax(-1)
    l_ref = torch.exp(xd - m_ref[:, None]).sum(-1)
    keep = torch.tensor([r != 2 for r in range(x.shape[0])])
    rescale = [
        mistake("online_rescale", "l_i is not rescaled when the running max grows: multiply it by "
                                  "exp(m_old - m_new) before adding the block's sum", _stream_stats(xd, EX1_BLOCK, "no_rescale")[1]),
        mistake("online_rescale", "the rescale factor is upside down: exp(m_old - m_new) (<= 1), not "
                                  "exp(m_new - m_old)", _stream_stats(xd, EX1_BLOCK, "inverted")[1]),
    ]
    stale = _stream_stats(xd, EX1_BLOCK, "stale")
    rescale.append(mistake("online_rescale", "m_i is never updated: after each block the running max must become "
                                             "m_new (m_i = m_new), or the next block's rescale starts from the wrong "
                                             "max", stale[1]))
    block = _stream_stats(xd, EX1_BLOCK, "block")
    block_max = ("the running max is the whole block's (every row's largest score), not each row's own: take the "
                 "max over the keys only, chunk.amax(dim=-1)")
    rescale.append(mistake("block_max", block_max, block[1]))
    out = {"m": tensor_verdict(m, m_ref, "m_i (the running max)", [
        mistake("online_rescale", "m_i is never updated: after each block the running max must become m_new "
                                  "(m_i = m_new)", stale[0]),
        mistake("block_max", block_max, block[0])])}
    if isinstance(l_, Tensor) and l_.shape == l_ref.shape:
        out["l"] = tensor_verdict(l_[keep], l_ref[keep], "l_i (the running sum)", [
            (c, msg, w[keep]) for c, msg, w in rescale])
        out["masked_first_block"] = tensor_verdict(l_[2:3], l_ref[2:3], "l_i of a row whose first block is all "
                                                   "-inf", [
            mistake("online_rescale", "exp(m_i - m_new) is exp(-inf - -inf) = NaN while the row has seen only "
                                      "-inf: use 0 in place of a -inf max (safe_max)",
                    _stream_stats(xd, EX1_BLOCK, "unsafe")[1][2:3])])
    else:
        out["l"] = out["masked_first_block"] = tensor_verdict(l_, l_ref, "l_i (the running sum)")
    return out


# --------------------------------------------------------------------------- ex2: the tiled forward
EX2_CASES = ((37, 45, False, 16, 16), (40, 40, True, 16, 8), (24, 40, True, 8, 8))  # (L, S, causal, bq, bk)
# Whether the tiles wholly after a query block are skipped: the queries 0..31 of a causal L = S = 48 call
# are given alone (L = 32, S = 48), and the values of keys 32.. are NaN: no query sees them. A loop
# that skips their tiles never computes on them; one that computes those tiles anyway (masked to -inf) gets
# 0 x NaN = NaN in P @ V, and one that cleans them first (torch.where, nan_to_num) hands a NaN to a torch
# kernel, which the child counts (Call.watch_nan: a ninth road zeroed the future keys' V and scored the
# skip's points). (32 is a tile boundary of both sizes: the diagonal tiles of queries 0..31 hold no NaN.)
EX2_SKIP = (48, 16, 8, 32)  # (L = S, bq, bk, first NaN value)


def _nan_from(t: Tensor, start: int) -> Tensor:
    """A copy of ``t`` (B, H, S, Ev) whose rows from ``start`` on are NaN. V only: K's NaN would reach a
    forward that builds the whole [L, S] scores first (ex3's mistake) and name it twice."""
    out = t.clone()
    out[:, :, start:] = float("nan")
    return out


def _prep_ex2(g):
    calls, ctx = [], []
    for L, S, causal, bq, bk in EX2_CASES:
        q, k, v = _inputs(g, L, S)
        calls.append(Call("flash_forward", (q, k, v, causal, bq, bk)))
        ctx.append((q, k, v))
    L, bq, bk, nan_from = EX2_SKIP
    q, k, v = _inputs(g, L, L)
    calls.append(Call("flash_forward", (q[:, :, :nan_from], k, _nan_from(v, nan_from), True, bq, bk), watch_nan=True))
    ctx.append((q, k, v))
    # the same call with finite values: a NaN above is the skip's only where this one is finite (an inverted
    # rescale or K read through the wrong strides makes NaN from finite inputs too)
    calls.append(Call("flash_forward", (q, k, v, True, bq, bk)))
    # and one NaN at a key every later query attends to (a secret one): it must reach them. A forward
    # that cleans V (v.nan_to_num(): a seventh attacker's untiled forward took the skip's points) cannot
    # tell the NaN it must drop from the one it must keep; a loop that skips tiles never has to
    v_one = v.clone()
    v_one[:, :, int(torch.randint(1, nan_from, (1,), generator=g)), 0] = float("nan")
    calls.append(Call("flash_forward", (q, k, v_one, True, bq, bk)))
    ctx.append(v_one)
    # rows of very different scale (issue 62: a tile-wide running max scored ex2 whole): every other query
    # ROW_SCALE x longer, so its scores reach ~±500 while its neighbours' stay ~±3; shifted by the tile's largest
    # score, the small rows' exp underflows to 0 (below e^-104 in float32) and l_i = 0, where each row's own max
    # keeps them
    L, S, _, bq, bk = EX2_CASES[0]
    q, k, v = _inputs(g, L, S)
    q[:, :, ::2] *= ROW_SCALE
    calls.append(Call("flash_forward", (q, k, v, False, bq, bk)))
    ctx.append((q, k, v))
    # and the tiles after an *earlier* query block: V NaN from key 16 (L = 32, S = 48), so query block 0
    # sees none of them and block 1 reads them by right; block 0's output must stay finite (a tenth road
    # stopped every block's loop at L, not at its own last query: the NaN of keys 32.. alone never showed it)
    L, bq, bk, nan_from = EX2_SKIP
    q, k, v = _inputs(g, L, L)
    calls.append(Call("flash_forward", (q[:, :, :nan_from], k, _nan_from(v, bq), True, bq, bk)))
    ctx.append((q, k, v))
    return calls, ctx


def _keeps_nan(result, v_one: Tensor) -> bool:
    """Whether the forward on ``v_one`` (one NaN in V's first column at key j) returned NaN in that column
    for every query i >= j, as any attention must (their weight on key j is positive)."""
    o = result[0] if isinstance(result, tuple) and len(result) == 2 else None
    j = int(v_one[0, 0, :, 0].isnan().nonzero()[0])
    return isinstance(o, Tensor) and o.shape[:-1] == v_one.shape[:-1] and bool(o[:, :, j:, 0].isnan().all())


def _judge_skip(ctx, result, finite: object = None, v_one: Optional[Tensor] = None, one: object = None,
                loaded: int = 0) -> Verdict:
    """``result``: the call whose keys past ``nan_from`` are NaN; ``finite``: the same call on finite
    values (what it returned), which decides whether a NaN is the skip's; ``one``: what it returned on
    ``v_one``, whose single NaN must reach every query after it; ``loaded``: the torch kernels that
    received those NaN (the child's count)."""
    L, bq, bk, nan_from = EX2_SKIP
    q, k, v = (t.double() for t in ctx)
    o, _, bad = _pair(result, "flash_forward")
    if bad:
        return bad
    if not (isinstance(o, Tensor) and o.shape[:-2] == q.shape[:-2] and o.shape[-2] == nan_from):
        return tensor_verdict(o, q[:, :, :nan_from, :1].expand(*q.shape[:-2], nan_from, v.shape[-1]),
                              "flash_forward output")
    expected = scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(L, L))[:, :, :nan_from]
    got = o[:, :, :nan_from]
    what = (f"flash_forward with is_causal, L = {nan_from} queries and S = {L} keys (the values of keys {nan_from}.., "
            "seen by no query, NaN)")
    finite_out = finite[0] if isinstance(finite, tuple) and len(finite) == 2 else None
    if got.isnan().any() and not (isinstance(finite_out, Tensor) and bool(finite_out.isfinite().all())):
        return Verdict(False, f"{what}: NaN, and NaN or inf also where every input is finite: look at the rescale "
                              "and the loads first (the other checks name what they find)", [], (got, expected))
    if got.isnan().any():
        msg = (f"{what}: NaN. The tiles wholly after a query block are computed, not skipped: their weights are 0, "
               "but 0 x NaN = NaN in P @ V, and they cost time. Stop each query block's key loop at its last query "
               "(k_stop = min(S, q_end))")
        return Verdict(False, msg, [{"code": "causal_block_skip", "message": msg}], (got, expected))
    verdict = tensor_verdict(got, expected, what)
    if verdict.passed and loaded:
        msg = (f"{what}: {loaded} torch operation{'s' if loaded > 1 else ''} received those NaN values, so the tiles "
               "wholly after a query block are read (and cleaned or masked), not skipped. Stop each query block's key "
               "loop at its last query (k_stop = min(S, q_end)) and leave K and V alone")
        return Verdict(False, msg, [{"code": "causal_block_skip", "message": msg}])
    if verdict.passed and v_one is not None and not _keeps_nan(one, v_one):
        msg = ("with is_causal and one NaN in V at a key the later queries attend to, their outputs were not NaN: "
               "the NaN was cleaned, not the future tiles skipped. Stop each query block's key loop at its last "
               "query (k_stop = min(S, q_end)) and leave V's values alone")
        return Verdict(False, msg, [{"code": "causal_block_skip", "message": msg}])
    return verdict


# every other query this much longer: 40x left a tile-wide max's short rows at e^-100, a denormal, not 0 (so
# finite); and float32's error grows with the scores: at 40x two independent solutions were 1.1e-5 off, and
# at 200x five solutions (the lab's and four independent ones, 20 seeds each) at most 7.7x float32's
# tolerance, which ROW_SCALE / 10 = 20x covers
ROW_SCALE = 200.0


def _judge_row_scales(ctx, result) -> Verdict:
    """The forward on queries whose every other row is ROW_SCALE x longer: right only with each row's own max.
    Judged at float32's tolerance times ROW_SCALE / 10: a right forward's rounding grows with |scores|."""
    q, k, v = (t.double() for t in ctx)
    o, _, bad = _pair(result, "flash_forward")
    if bad:
        return bad
    want = scaled_dot_product_attention(q, k, v)
    what = f"flash_forward output with rows of very different scale (every other query {ROW_SCALE:g}x longer)"
    if not (isinstance(o, Tensor) and o.shape == want.shape):
        return tensor_verdict(o, want, what)
    if not bool(o.isfinite().all()):
        msg = (f"{what}: NaN or inf in the short rows. Their scores (~±3) shifted by a running max taken over the "
               "whole tile (a long row's ~500) underflow to 0, so l_i = 0: the max is each row's own, "
               "s.amax(dim=-1)")
        return Verdict(False, msg, [{"code": "block_max", "message": msg}], (o, want))
    tol, grow = tolerance(torch.float32), ROW_SCALE / 10
    err = (o.double() - want).abs()
    if bool((err <= grow * (tol.atol + tol.rtol * want.abs())).all()):
        return Verdict(True)
    return Verdict(False, f"{what}: values differ from the reference by up to {float(err.max()):.3g}", [], (o, want))


def _judge_ex2(ctx, results, outcome):
    out = {}
    # the plain forward: o and lse
    (L, S, _, bq, bk), (q, k, v) = EX2_CASES[0], [t.double() for t in ctx[0]]
    o, lse, bad = _pair(value(results, 0), "flash_forward")
    if bad:
        return {"output": bad, "lse": bad, "causal": bad, "causal_rectangular": bad, "skips_future_tiles": bad}
    ref_lse = simulate_forward(q, k, v, False, bq, bk)[1]
    out["output"] = tensor_verdict(o, scaled_dot_product_attention(q, k, v), "flash_forward output (L = 37, S = 45)", [
        mistake("online_rescale", "acc is not rescaled when the running max grows: acc * exp(m_old - m_new) before "
                                  "adding P @ V", simulate_forward(q, k, v, False, bq, bk, "acc")[0]),
        mistake("online_rescale", "l_i is not rescaled when the running max grows: l_i * exp(m_old - m_new) before "
                                  "adding the tile's row sums", simulate_forward(q, k, v, False, bq, bk, "l")[0]),
        mistake("online_rescale", "a stale max: the tile's weights are exp(s - m_old), taken before the running max "
                                  "was updated; compute m_new first, then P = exp(s - m_new) and rescale l_i and acc "
                                  "by exp(m_old - m_new)", simulate_forward(q, k, v, False, bq, bk, "stale")[0]),
        mistake("final_divide", "the output is acc, never divided by l_i: o = acc / l_i[..., None] once the last "
                                "key block is in", simulate_forward(q, k, v, False, bq, bk, "no_divide")[0]),
        mistake("online_rescale", "the running max is never updated after the first key tile: m_i = m_new after "
                                  "each tile", simulate_forward(q, k, v, False, bq, bk, "m_first")[0]),
        mistake("online_rescale", "a stale max from the second tile on: the tile's weights are exp(s - m_old); "
                                  "compute m_new first, then P = exp(s - m_new)",
                simulate_forward(q, k, v, False, bq, bk, "stale_first")[0]),
        mistake("online_rescale", "the rescale factor is inverted: alpha = exp(m_old - m_new) <= 1, which shrinks "
                                  "the old sums when the max grows", simulate_forward(q, k, v, False, bq, bk,
                                                                                      "alpha_inverted")[0]),
        mistake("online_rescale", "the rescale factor is exp of a base-2 difference: with log2(e) folded into the "
                                  "scores, alpha = exp2(m_old - m_new)", simulate_forward(q, k, v, False, bq, bk,
                                                                                         "alpha_log2e")[0]),
        mistake("wrong_scale", "the scores are scaled by ln(2) / sqrt(E): with exp2, fold log2(e) into the scale "
                               "(scale * log2(e)), not 1 / sqrt(E) alone",
                scaled_dot_product_attention(q, k, v, scale=math.log(2) / math.sqrt(q.shape[-1]))),
        mistake("missing_scale", "the scores are not scaled: multiply q (or each tile's Q K^T) by 1/sqrt(E)",
                scaled_dot_product_attention(q, k, v, scale=1.0)),
        mistake("wrong_scale", "the scores are divided by E; the scale is 1/sqrt(E)",
                scaled_dot_product_attention(q, k, v, scale=1 / q.shape[-1])),
        mistake("wrong_scale", "the scores are scaled by 1/sqrt(Ev), the value size; the scale is 1/sqrt(E), the "
                               "query/key size", scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(v.shape[-1]))),
        mistake("wrong_scale", "the scores are multiplied by sqrt(E) instead of divided by it",
                scaled_dot_product_attention(q, k, v, scale=math.sqrt(q.shape[-1]))),
    ])
    if out["output"].passed:  # then the rows of very different scale (the last call)
        out["output"] = _judge_row_scales(ctx[5], results[6].get("value"))
    out["lse"] = tensor_verdict(lse, ref_lse, "lse (natural log-sum-exp of each row's scaled scores)", [
        mistake("lse_saved", "lse keeps a trailing dim of 1 ([B, H, L, 1], the column m_i and l_i were kept in): "
                             "return it as [B, H, L], lse.squeeze(-1)", ref_lse[..., None]),
        mistake("lse_saved", "lse is in base 2: use torch.log (natural log), lse = m_i + log(l_i)",
                simulate_forward(q, k, v, False, bq, bk, "lse_log2")[1]),
        mistake("lse_saved", "lse = m_i + log2(l_i) mixes bases: m_i is in natural-log units, so use torch.log",
                simulate_forward(q, k, v, False, bq, bk, "lse_log2_sum")[1]),
        mistake("lse_saved", "lse is m_i alone: add log(l_i), the log of the running sum",
                simulate_forward(q, k, v, False, bq, bk, "lse_max")[1]),
        mistake("lse_saved", "lse is log(l_i) alone: l_i was summed under the running max, so add it back: "
                             "lse = m_i + log(l_i)", simulate_forward(q, k, v, False, bq, bk, "lse_no_max")[1]),
        mistake("lse_saved", "the returned second value is l_i, the sum: lse = m_i + log(l_i)",
                torch.exp(ref_lse - simulate_forward(q, k, v, False, bq, bk, "lse_max")[1])),
    ])
    # causal, square then rectangular (top-left: query i sees keys 0 .. i)
    for name, i in (("causal", 1), ("causal_rectangular", 2)):
        L, S, _, bq, bk = EX2_CASES[i]
        q, k, v = (t.double() for t in ctx[i])
        o_c, _, bad = _pair(value(results, i), "flash_forward")
        if bad:
            out[name] = bad
            continue
        expected = scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(L, S))
        out[name] = tensor_verdict(o_c, expected, f"flash_forward with is_causal (L = {L}, S = {S}, tiles {bq} x {bk})", [
            mistake("causal_block_skip", "the diagonal block is not masked inside: a query sees the keys after it "
                                         "in its own tile (key j > query i needs -inf there)",
                    simulate_forward(q, k, v, True, bq, bk, "diag_unmasked")[0]),
            mistake("causal_block_skip", "the diagonal block is skipped: each query must see the keys of its own "
                                         "tile up to itself", simulate_forward(q, k, v, True, bq, bk, "diag_skipped")[0]),
            mistake("causal_block_skip", "is_causal is ignored: every query sees every key",
                    scaled_dot_product_attention(q, k, v)),
            mistake("off_by_one", "the causal mask hides the diagonal: query i sees keys 0 .. i, itself included "
                                  "(key j <= query i)", simulate_forward(q, k, v, True, bq, bk, "off_by_one")[0]),
            mistake("online_rescale", "acc is not rescaled when the running max grows: acc * exp(m_old - m_new)",
                    simulate_forward(q, k, v, True, bq, bk, "acc")[0]),
            mistake("online_rescale", "l_i is not rescaled when the running max grows: l_i * exp(m_old - m_new)",
                    simulate_forward(q, k, v, True, bq, bk, "l")[0]),
        ])
    out["skips_future_tiles"] = _judge_skip(ctx[3], value(results, 3), results[4].get("value"), ctx[4],
                                            results[5].get("value"), results[3].get("nan_loads", 0))
    if out["skips_future_tiles"].passed:
        out["skips_future_tiles"] = _judge_first_block(ctx[6], results[7].get("value"))
    return out


def _judge_first_block(ctx, result) -> Verdict:
    """Query block 0 of a causal L = 32, S = 48 call whose keys from 16 are NaN: it sees none of them."""
    L, bq, bk, nan_from = EX2_SKIP
    q, k, v = (t.double() for t in ctx)
    o = result[0] if isinstance(result, tuple) and len(result) == 2 else None
    want = scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(L, L))[:, :, :bq]
    what = (f"flash_forward with is_causal, L = {nan_from}, S = {L}, values of keys {bq}.. NaN: queries 0..{bq - 1} "
            "see none of them")
    if not (isinstance(o, Tensor) and o.shape[-2] == nan_from):
        return tensor_verdict(o, want, what)
    if bool(o[:, :, :bq].isnan().any()):
        msg = (f"{what}: NaN in block 0. Its loop visits the key tiles after its own last query (up to L, or S): "
               "stop each query block's key loop at its own last query, k_stop = min(S, q_end)")
        return Verdict(False, msg, [{"code": "causal_block_skip", "message": msg}])
    return tensor_verdict(o[:, :, :bq], want, what)


# --------------------------------------------------------------------------- ex3: no [L, S] tensor
EX3_BLOCK = 256


def _prep_ex3(g):
    q, k, v = _inputs(g, BIG, BIG, B=1, H=1, E=16, Ev=16)
    return [Call("flash_forward", (q, k, v, False, EX3_BLOCK, EX3_BLOCK))], (q, k, v)


def _judge_ex3(ctx, results, outcome):
    r = results[0]
    if "error" in r and r.get("memory"):
        msg = (f"flash_forward at L = S = {BIG} ran out of its {MEMORY_MB} MB: one float32 [L, S] tensor is "
               f"{BIG * BIG * 4 >> 20} MB. Keep one [block_q, block_k] tile of scores at a time")
        return {"no_L_by_S": Verdict(False, msg, [{"code": "scores_materialized", "message": msg}])}
    o, _, bad = _pair(value(results, 0), "flash_forward")
    if bad:
        return {"no_L_by_S": bad}
    if not (isinstance(o, Tensor) and o.shape == ctx[2].shape):
        return {"no_L_by_S": tensor_verdict(o, ctx[2], f"flash_forward at L = S = {BIG}")}
    # the answer is checked on three blocks of rows (ex2 checks every row at small sizes; the float64
    # reference of all 4096 rows took 0.5 s of the grading)
    rows = torch.cat([torch.arange(i, i + 256) for i in (0, BIG // 2 - 128, BIG - 256)])
    q, k, v = (t.double() for t in ctx)
    expected = scaled_dot_product_attention(q[:, :, rows], k, v)
    return {"no_L_by_S": tensor_verdict(o[:, :, rows], expected,
                                        f"flash_forward at L = S = {BIG} (within {MEMORY_MB} MB), rows {rows[0]}..255, "
                                        f"{rows[256]}..{rows[511]}, {rows[512]}..{BIG - 1}")}


# --------------------------------------------------------------------------- ex4: the backward
# causal square, then rectangular both ways (issue 62: a backward whose causal mask was aligned bottom-right
# scored 100 on the square case alone); the causal check is the first of them that fails
EX4_CASES = ((37, 45, False, 16, 16), (40, 40, True, 16, 8), (24, 40, True, 8, 16), (40, 24, True, 16, 8))


def _prep_ex4(g):
    calls, ctx = [], []
    for L, S, causal, bq, bk in EX4_CASES:
        q, k, v = _inputs(g, L, S)
        do = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=g)
        o, lse = simulate_forward(q.double(), k.double(), v.double(), causal, bq, bk)  # the forward's output, exact
        calls.append(Call("flash_backward", (q, k, v, o.float(), lse.float(), do, causal, bq, bk),
                          forbid=AUTOGRAD))
        ctx.append((q, k, v, do))
    return calls, ctx


def _triple(got) -> Optional[tuple]:
    return got if isinstance(got, tuple) and len(got) == 3 else None


# what a hand-written backward may not reach: torch's autograd computing the gradients of a recomputed forward
# (issue 61's sixth attacker: 25/25 in ex4 with torch.autograd.grad over a naive softmax, no dS written)
AUTOGRAD = ("grad", "backward", "vjp", "jvp", "jacobian")


def _judge_ex4(ctx, results, outcome):
    """Each case's gradients against the right backward; where one is off, the shared bug-model
    library (:mod:`attnlab.bugmodels`) is asked which choices, one or two, explain every case."""
    reached = sorted({n for r in results for n in r.get("torch_compute", ())})
    if reached:
        msg = (f"[policy] flash_backward reached torch's autograd ({', '.join(reached[:3])}): this exercise is the "
               "backward written by hand (dV = P^T dO, dS = P * (dP - D), ...), so gradients autograd computes score 0")
        return {name: Verdict(False, msg, [{"code": "policy", "message": msg}]) for name in ("dv", "dq_dk", "causal")}
    cases = [FlashCase(*ctx[i], causal, bq, bk) for i, (L, S, causal, bq, bk) in enumerate(EX4_CASES)]
    raw = [value(results, i) for i in range(len(cases))]
    out = _ex4_verdicts(cases, raw, None)
    if all(v.passed for v in out.values()):
        return out
    explanation = explain_backward(cases, [_triple(r) for r in raw])
    return _ex4_verdicts(cases, raw, explanation) if explanation is not None else out


def _ex4_verdicts(cases, raw, explanation) -> dict[str, Verdict]:
    out = {}
    both = (lambda a, b: torch.cat([a.flatten(), b.flatten()]))  # noqa: E731
    for case, r, (L, S, causal, bq, bk) in zip(cases, raw, EX4_CASES):
        got = _triple(r)
        if got is None:
            bad = Verdict(False, f"flash_backward must return (dq, dk, dv), got {type(r).__name__}")
            out.update({"dv": bad, "dq_dk": bad} if not causal else {"causal": bad} if out.get(
                "causal", Verdict(True)).passed else {})
            continue
        want = flash_gradients(case)
        named = model_mistakes(explanation, case)
        got_qk = both(got[0], got[1]) if all(isinstance(t, Tensor) for t in got[:2]) else None
        qk_named = [(code, message, both(named["dq"][0][2], named["dk"][0][2])) for code, message, _ in named["dq"]]
        where = f"(L = {L}, S = {S}{', is_causal' if causal else ''})"
        qk = tensor_verdict(got_qk, both(want["dq"], want["dk"]), f"dq and dk {where}", qk_named)
        dv_v = tensor_verdict(got[2], want["dv"], f"dv {where}", named["dv"])
        if causal:
            if out.get("causal", Verdict(True)).passed:  # the first causal case that fails stands for the check
                out["causal"] = dv_v if not dv_v.passed else qk
        else:
            out["dv"], out["dq_dk"] = dv_v, qk
    return out


# --------------------------------------------------------------------------- ex5: the autograd Function
EX5_CASES = ((33, 21, False), (32, 32, True))


def _prep_ex5(g):
    calls, ctx = [], []
    for L, S, causal in EX5_CASES:
        q, k, v = _inputs(g, L, S, E=16, Ev=8)
        do = torch.randn(q.shape[:-1] + (8,), generator=g)
        calls.append(Call("TiledAttention", (q, k, v, do, causal), harness="autograd"))
        ctx.append((q, k, v, do))
    return calls, ctx


def judge_autograd_function(ctx, results, cases, *, output_of: str, function: str, causal_fix: str,
                            recompute: str) -> dict[str, Verdict]:
    """The checks of an exercise that runs the learner's Function ``function`` once per case of
    ``cases`` (``(L, S, causal)``, inputs ``ctx[i] = (q, k, v, do)``) through the child's own
    steps (``Call(..., harness="autograd")``: :func:`.grading.sandbox.harness.autograd`), shared by
    lab 04 and lab 05: the output against SDPA, dq/dk/dv through its backward (naming a backward
    that drops the causal mask), and what its node saved (no [L, S] weights).

    ``output_of``: how the output is named; ``causal_fix``: how to keep the causal mask in the
    backward; ``recompute``: where P is recomputed instead of saved."""
    outputs, grads, saved_v = Verdict(True), Verdict(True), Verdict(True)
    flash_cases = []
    for i, (L, S, causal) in enumerate(cases):
        q, k, v, do = (t.double() for t in ctx[i])
        got = value(results, i)
        if not (isinstance(got, tuple) and len(got) == 5):
            bad = Verdict(False, f"{function} gave no output and gradients (got {type(got).__name__})")
            return {"output": bad, "gradients": bad, "saves_lse_not_weights": bad}
        where = f"(L = {L}, S = {S}{', is_causal' if causal else ''})"
        mask = causal_mask(L, S) if causal else None
        if outputs.passed:
            ignored = [mistake("causal_block_skip", "is_causal is ignored: every query sees every key (is it passed "
                                                    "on to the forward?)", scaled_dot_product_attention(q, k, v))]
            outputs = tensor_verdict(got[0], scaled_dot_product_attention(q, k, v, attn_mask=mask),
                                     f"{output_of} {where}", ignored if causal else None)
        unmasked = simulate_grads(q, k, v, do, mask, p_mask=torch.ones(L, S, dtype=torch.bool)) if causal else (None,) * 3
        expected = simulate_grads(q, k, v, do, mask)
        swapped = (None, expected[2], expected[1])  # dK where dV belongs and back (when E = Ev)
        # O and dO handed to flash_backward swapped (the shared bug models; no tile size matters to it)
        o_do = flash_gradients(FlashCase(q, k, v, do, causal, 16, 16), FlashBackward(swap_o_do="yes"))
        for name, g_, e_, u, w in zip(("dq", "dk", "dv"), got[1:4], expected, unmasked, swapped):
            if grads.passed:
                grads = tensor_verdict(g_, e_, f"{name} through {function}.backward {where}", [
                    mistake("causal_block_skip", f"the backward runs without the causal mask: {causal_fix}", u),
                    mistake("order", "dK and dV come back swapped: backward returns the gradients in forward's "
                                     "argument order, (dq, dk, dv, ...)", w),
                    mistake("order", f"{function}.backward hands O and dO to flash_backward swapped: pass them in "
                                     "the order of its signature", o_do.get(name))])
        flash_cases.append((FlashCase(q, k, v, do, causal, 16, 16), got[1:4], where))
        shapes = got[4] if isinstance(got[4], list) else []
        # the [L, S] weights by their size, whatever their shape (a ninth attacker saved p.flatten(-2)): every
        # honest saved tensor (q, k, v, o, lse: at most L or S rows of E) is smaller than B·H·L·S here
        whole = q.shape[0] * q.shape[1] * L * S
        big = [s for s in shapes if isinstance(s, list) and len(s) >= 2 and (s[-2:] == [L, S] or math.prod(s) >= whole)]
        if big and saved_v.passed:
            msg = (f"the forward saves a tensor of shape {big[0]}: the [L, S] weights; save lse ([B, H, L]) and "
                   f"{recompute}")
            saved_v = Verdict(False, msg, [{"code": "scores_materialized", "message": msg}])
        elif not shapes and saved_v.passed:
            saved_v = Verdict(False, "the forward saved no tensors: ctx.save_for_backward(q, k, v, o, lse)")
    if not grads.passed and not grads.findings:  # what the shared bug-model library says of the gradients
        grads = _named_gradients(flash_cases, function) or grads
    return {"output": outputs, "gradients": grads, "saves_lse_not_weights": saved_v}


def _named_gradients(flash_cases: list, function: str) -> Optional[Verdict]:
    """The first failing gradient of ``flash_cases`` (``(FlashCase, (dq, dk, dv), where)``, the labs' 16 x 16
    tiles) named by what :func:`explain_backward` finds to explain every case; None when nothing does."""
    explanation = explain_backward([c for c, _, _ in flash_cases], [list(g) for _, g, _ in flash_cases])
    if explanation is None:
        return None
    for case, got, where in flash_cases:
        want, named = flash_gradients(case), model_mistakes(explanation, case)
        for name, g_ in zip(("dq", "dk", "dv"), got):
            verdict = tensor_verdict(g_, want[name], f"{name} through {function}.backward {where}", named[name])
            if not verdict.passed:
                return verdict if verdict.findings else None
    return None


def _judge_ex5(ctx, results, outcome):
    return judge_autograd_function(ctx, results, EX5_CASES, output_of="tiled_attention output",
                                   function="TiledAttention",
                                   causal_fix="pass is_causal on (keep it on ctx in forward)",
                                   recompute="recompute P tile by tile in the backward")


EXERCISES: list[Exercise] = [
    Exercise("ex1", "online_softmax_stats", "the online softmax on a stream", {"m": 3, "l": 6, "masked_first_block": 3},
             _prep_ex1, _judge_ex1),
    Exercise("ex2", "flash_forward", "the tiled forward",
             {"output": 12, "lse": 8, "causal": 8, "causal_rectangular": 3, "skips_future_tiles": 4},
             _prep_ex2, _judge_ex2),
    Exercise("ex3", "flash_forward", "no [L, S] tensor in the forward", {"no_L_by_S": 15}, _prep_ex3, _judge_ex3,
             limits={"memory_mb": MEMORY_MB, "timeout_s": 20.0}),
    Exercise("ex4", "flash_backward", "the backward, tile by tile", {"dv": 6, "dq_dk": 10, "causal": 9},
             _prep_ex4, _judge_ex4),
    Exercise("ex5", "TiledAttention", "one autograd Function",
             {"output": 3, "gradients": 7, "saves_lse_not_weights": 3}, _prep_ex5, _judge_ex5),
]
assert sum(ex.max_score for ex in EXERCISES) == 100
