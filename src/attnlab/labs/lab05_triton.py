"""Lab 05's checks (``labs/track1/05-triton-flash``): FlashAttention in Triton, graded on a CPU.

The learner's kernels run in the sandbox under Triton's interpreter (``TRITON_INTERPRET=1``, set
by the sandbox for every lab: :mod:`attnlab.grading.sandbox.bwrap`), which executes a
``@triton.jit`` kernel with NumPy, program by program: exact, and slow enough that every case
is small (L, S <= 64, tiles of 16; the solution takes under 1 s of CPU per exercise, the budget
is :data:`CPU_S`).

The same machinery as lab 04's (:mod:`attnlab.grading.exercise`), and the same float64
simulators of each mistake (:func:`attnlab.labs.lab04_flash.simulate_forward`,
:func:`~attnlab.labs.lab04_flash.simulate_grads`: the algorithm is the same, only the language
changes). What is new is what a GPU kernel gets wrong:

* loads and stores past the end of a tensor (``load_mask``): every float argument reaches the
  learner inside a buffer whose tail is NaN (the sandbox's server guards every argument so), so
  a tile that reads past the last key reads NaN, the same on every run; and a masked load without
  ``other=`` reads NaN in its masked-off lanes (``attnlab.grading.sandbox.interpreter.poison_masked_loads``:
  the interpreter would give 0.0, a GPU whatever its registers held);
* accumulators in the inputs' dtype (``accumulate_dtype``): a float16 case whose dV is past
  float16's largest value (65504), which a float32 accumulator holds and a float16 one turns
  into inf;
* grouped heads by index arithmetic (``gqa_group_mapping``): query head ``h`` reads key/value
  head ``h // (H // Hkv)``, and dK/dV sum over the whole group.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from attnlab.functional import scaled_dot_product_attention
from attnlab.bugmodels import FlashCase, flash_gradients
from attnlab.grading.exercise import (Exercise, Verdict, explain_backward, mistake, model_mistakes, tensor_verdict,
                                     value)
from attnlab.grading.sandbox import Call
from attnlab.labs import Lab
from attnlab.labs.lab04_flash import (causal_mask, judge_autograd_function, simulate_forward, simulate_grads,
                                      tiles_kept)
from attnlab.testing import max_abs_diff, tolerance

__all__ = ["LAB", "EXERCISES", "BLOCK", "CPU_S", "TRITON_NAMES"]

# What a FlashAttention kernel needs from Triton, and nothing else (the static check's allow-list
# for lab 05, deny by default): no atomics (the backward is written without them), no inline
# assembly, extern libraries, compiler, cache, autotuner or launcher (attnlab.grading.static's
# REACH_OUTSIDE says why each of those is refused).
TRITON_NAMES = (
    ("triton", ("jit", "cdiv", "next_power_of_2", "language")),
    ("triton.language", (
        "program_id", "num_programs", "arange", "load", "store", "dot", "trans", "zeros", "full", "where",
        "maximum", "minimum", "max", "min", "sum", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "abs", "cdiv",
        "constexpr", "float32", "float16", "bfloat16", "int32", "int64", "static_range", "range", "cast",
        "reshape", "broadcast_to", "expand_dims", "fma", "zeros_like", "full_like", "multiple_of", "max_contiguous",
    )),
)

LAB = Lab("05-triton-flash", "FlashAttention in Triton, graded on a CPU",
          "the forward kernel (one program per query tile and head, the online softmax over key tiles, O and lse "
          "stored), causal tiles skipped and the diagonal masked, masked loads and stores at ragged edges, the "
          "backward's D preprocess, dK/dV and dQ kernels without atomics, the autograd.Function, grouped heads by "
          "index arithmetic; run by Triton's interpreter, so no GPU is needed", file="flash_triton.py",
          module=__name__, needs=("triton",), extra="triton", modules=TRITON_NAMES, decorators=("triton.jit",),
          # the autograd.Function, its ctx, and a pointer's element type (O.dtype.element_ty)
          allowed_names=("autograd", "Function", "apply", "save_for_backward", "saved_tensors", "grad_fn",
                         "is_causal", "element_ty"),
          rule="This lab writes FlashAttention as Triton kernels from tl.load, tl.dot, tl.exp and tl.store "
               "(torch's softmax and SDPA are the oracles, not the answer; Triton's own softmax and anything that "
               "leaves the interpreter are refused)")

BLOCK = 16  # BLOCK_Q = BLOCK_K in the stub (given): tl.dot's smallest tile
CPU_S = 10.0  # each exercise's CPU budget: the solution used 0.03-0.9 s per exercise, 3.0 s in all (2-core AVX2 EPYC)
E = 16  # the head size of every case (a power of two: tl.arange needs one)
NEG_INF = float("-inf")


def _inputs(g: torch.Generator, L: int, S: int, H: int = 2, Hkv: Optional[int] = None,
            dtype: torch.dtype = torch.float32, B: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    Hkv = H if Hkv is None else Hkv
    return (torch.randn(B, H, L, E, generator=g).to(dtype), torch.randn(B, Hkv, S, E, generator=g).to(dtype),
            torch.randn(B, Hkv, S, E, generator=g).to(dtype))


def _pair(got, what: str) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Verdict]]:
    if isinstance(got, tuple) and len(got) == 2:
        return got[0], got[1], None
    return None, None, Verdict(False, f"{what} must return a pair (o, lse), got {type(got).__name__}")


def _triple(got, what: str) -> tuple[Optional[tuple], Optional[Verdict]]:
    if isinstance(got, tuple) and len(got) == 3:
        return got, None
    return None, Verdict(False, f"{what} must return (dq, dk, dv), got {type(got).__name__}")


def _forward(q, k, v, causal: bool, bug: str = "") -> tuple[Tensor, Tensor]:
    """The tiled forward in float64 (lab 04's simulator, tiles of BLOCK), one step broken by ``bug``."""
    return simulate_forward(q.double(), k.double(), v.double(), causal, BLOCK, BLOCK, bug)


def _nan_past_first_tile(o: Tensor) -> Tensor:
    """``o`` [B, H, L, Ev] with every row past the first query tile NaN: what a forward gives whose
    rows meet a wholly masked key tile before any visible key (no guard for an all -inf max)."""
    o = o.clone()
    o[..., BLOCK:, :] = float("nan")
    return o


def _naming_loads(got: Tensor, expected: Tensor, what: str) -> Optional[Verdict]:
    """NaN where the reference is finite: the NaN past the end of a guarded argument was read. Not
    where every row has NaN: that is the arithmetic's (exp of +inf from an inverted rescale, say),
    which no edge explains (it was named load_mask: issue 48's fourth lab 05 solution)."""
    if isinstance(got, Tensor) and got.shape == expected.shape and got.numel() and bool(
            (got.isnan() & expected.isfinite()).any()) and not bool(got.isnan().any(-1).all()):
        msg = (f"{what}: NaN where the answer is finite. The last tile reads past the end of the tensor, or a masked "
               "load has no other= (the grader puts NaN in both places, as a GPU leaves garbage there): load with "
               "mask= and other=0.0 (rows < L, keys < S)")
        return Verdict(False, msg, [{"code": "load_mask", "message": msg}], (got, expected))
    return None


def _transposed_rows(t: Tensor) -> Tensor:
    """What a kernel reads from each contiguous (S, E) head of ``t`` when it takes the pointer of
    (row j, column e) as ``j + e * S``: the head's memory seen as (E, S), transposed."""
    *lead, S, n = t.shape
    return t.reshape(*lead, n, S).transpose(-2, -1)


def _masked_or_zero(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA under ``mask`` with a row that sees no key giving 0 (as a kernel that guards l_i = 0
    does), not SDPA's NaN."""
    return scaled_dot_product_attention(q, k, v, attn_mask=mask).nan_to_num(0.0)


def _tile_masks(L: int, S: int) -> dict[str, Tensor]:
    """[L, S] masks of what a causal kernel with BLOCK tiles, skipping the tiles wholly after the
    query tile, lets each query see: 'reversed' (keys j >= i), 'local' (tile-local indices compared:
    j % BLOCK <= i % BLOCK in every visited tile)."""
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    kept = tiles_kept(L, S, BLOCK, BLOCK)
    diagonal = (j // BLOCK) == (i // BLOCK)
    return {"reversed": kept & (j >= i), "local": kept & (j % BLOCK <= i % BLOCK),
            # the rows' tile-local index against the keys' global one, in every visited tile, or only in the
            # diagonal tile (a kernel that masks that tile alone)
            "local_rows": kept & (j <= i % BLOCK), "local_rows_diagonal": (j // BLOCK < i // BLOCK) |
            (diagonal & (j <= i % BLOCK))}


# --------------------------------------------------------------------------- ex1: the forward kernel
EX1 = (32, 32)  # L, S: whole tiles


def _prep_ex1(g):
    q, k, v = _inputs(g, *EX1)
    return [Call("flash_forward", (q, k, v, False))], (q, k, v)


def _judge_ex1(ctx, results, outcome):
    q, k, v = (t.double() for t in ctx)
    o, lse, bad = _pair(value(results, 0), "flash_forward")
    if bad:
        return {"output": bad, "lse": bad}
    fwd = {bug: _forward(q, k, v, False, bug) for bug in ("", "acc", "l", "stale", "alpha_one", "m_stuck",
                                                           "no_divide", "lse_log2", "lse_log2_sum", "lse_max",
                                                           "lse_no_max")}
    out = {"output": tensor_verdict(o, scaled_dot_product_attention(q, k, v), "flash_forward's O (L = S = 32)", [
        mistake("online_rescale", "acc is not rescaled when the running max grows: acc = acc * alpha[:, None] + "
                                  "tl.dot(p, v) with alpha = tl.exp(m_i - m_new)", fwd["acc"][0]),
        mistake("online_rescale", "l_i is not rescaled when the running max grows: l_i = l_i * alpha + "
                                  "tl.sum(p, 1)", fwd["l"][0]),
        mistake("online_rescale", "a stale max: p = tl.exp(s - m_i) uses the max before this tile; compute m_new "
                                  "first, then p = tl.exp(s - m_new[:, None])", fwd["stale"][0]),
        mistake("online_rescale", "alpha is taken after m_i = m_new, so it is tl.exp(m_new - m_new) = 1 and nothing "
                                  "is rescaled: compute alpha = tl.exp(m_i - m_new) first, update m_i last",
                fwd["alpha_one"][0]),
        mistake("online_rescale", "m_i is never updated: it stays -inf, so alpha = exp(m_i - m_new) is 0 and every "
                                  "tile but the last is dropped; end each step with m_i = m_new", fwd["m_stuck"][0]),
        mistake("final_divide", "O is acc without the final divide by the running sum: o = acc / l_i[:, None]",
                fwd["no_divide"][0]),
        mistake("wrong_strides", "K and V are read with the strides of their transposes (key j, column e at "
                                 "j + e * S): in a contiguous (S, E) head, key j's column e is at j * E + e",
                scaled_dot_product_attention(q, _transposed_rows(k), _transposed_rows(v))),
        mistake("wrong_scale", "the scores are scaled twice (q * scale and the dot's result * scale): scale once, "
                               "1/sqrt(E)", scaled_dot_product_attention(q, k, v, scale=1.0 / E)),
        mistake("wrong_strides", "K is read with the strides of its transpose (key j, column e at j + e * S): in a "
                                 "contiguous (S, E) head, key j's column e is at j * E + e",
                scaled_dot_product_attention(q, _transposed_rows(k), v)),
        mistake("wrong_strides", "V is read with the strides of its transpose (key j, column e at j + e * S): in a "
                                 "contiguous (S, E) head, key j's column e is at j * E + e",
                scaled_dot_product_attention(q, k, _transposed_rows(v))),
        mistake("missing_scale", "the scores are not scaled: multiply tl.dot(q, tl.trans(k)) by scale "
                                 "(1/sqrt(E), passed to the kernel)", scaled_dot_product_attention(q, k, v, scale=1.0)),
        # the bases mixed: tl.exp2 of natural-log scores (log2(e) forgotten), or tl.exp of base-2 ones
        mistake("wrong_scale", "tl.exp2 of natural-log scores: in base 2 the scores are scale * log2(e) * q.k "
                               "(1.4426950408889634), or use tl.exp", scaled_dot_product_attention(
                                   q, k, v, scale=math.log(2) / math.sqrt(E))),
        mistake("wrong_scale", "tl.exp of base-2 scores: scores multiplied by scale * log2(e) need tl.exp2, "
                               "or multiply by scale alone", scaled_dot_product_attention(
                                   q, k, v, scale=1 / (math.log(2) * math.sqrt(E)))),
    ])}
    out["lse"] = tensor_verdict(lse, fwd[""][1], "flash_forward's lse (natural log-sum-exp of each row)", [
        mistake("lse_saved", "lse is in base 2: tl.log, not tl.log2 (or divide by ln 2 nowhere)", fwd["lse_log2"][1]),
        mistake("lse_saved", "lse = m_i + log2(l_i) mixes bases: m_i is in natural-log units, use tl.log",
                fwd["lse_log2_sum"][1]),
        mistake("lse_saved", "lse is m_i alone: store m_i + tl.log(l_i)", fwd["lse_max"][1]),
        mistake("lse_saved", "lse is log(l_i) alone: l_i was summed under the running max, so store "
                             "m_i + tl.log(l_i)", fwd["lse_no_max"][1]),
        mistake("lse_saved", "lse was never stored: tl.store(LSE + ..., m_i + tl.log(l_i), mask=rows < L)",
                torch.zeros_like(fwd[""][1])),
    ])
    return out


# --------------------------------------------------------------------------- ex2: causal
EX2 = 48  # L = S: three tiles
# the skip check: L = 32 queries, S = 48 keys under is_causal (top-left), K and V NaN from key 16. Query tile 1
# sees keys 16..31 and loads each of them once; query tile 0 sees none of them, and keys 32.. are seen by no
# query. So a kernel that skips the tiles wholly after each query tile loads each NaN of keys 16..31 once and
# no other (the child counts the NaN its kernels' tl.load returns); one that visits a tile it should skip loads
# more, whatever it does with them after (a ninth road masked the loads of V and dropped K's NaN scores with
# tl.where; a tenth stopped every tile's loop at L, not at its own last query). Queries 0..15 are judged.
EX2_NAN_FROM = 16
EX2_SKIP = (32, EX2)


def _prep_ex2(g):
    q, k, v = _inputs(g, EX2, EX2)
    q2, k2, v2 = _inputs(g, *EX2_SKIP)
    k_nan, v_nan = k2.clone(), v2.clone()
    k_nan[:, :, EX2_NAN_FROM:] = float("nan")
    v_nan[:, :, EX2_NAN_FROM:] = float("nan")
    return [Call("flash_forward", (q, k, v, True)), Call("flash_forward", (q2, k_nan, v_nan, True))], \
        ((q, k, v), (q2, k2, v2))


def _judge_ex2(ctx, results, outcome):
    q, k, v = (t.double() for t in ctx[0])
    o, _, bad = _pair(value(results, 0), "flash_forward")
    if bad:
        return {"causal": bad, "skips_future_tiles": bad}
    expected = scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(EX2, EX2))
    out = {"causal": tensor_verdict(o, expected, f"flash_forward with is_causal (L = S = {EX2}, tiles {BLOCK})", [
        mistake("causal_block_skip", "the diagonal tile is not masked inside: tl.where(keys[None, :] <= "
                                     "rows[:, None], s, float('-inf'))", _forward(q, k, v, True, "diag_unmasked")[0]),
        mistake("causal_block_skip", "the diagonal tile is skipped: the key loop must run up to and including the "
                                     "query tile's own keys (stop = (pid_q + 1) * BQ)",
                _forward(q, k, v, True, "diag_skipped")[0]),
        mistake("causal_block_skip", "the diagonal tile is skipped: the key loop must run up to and including the "
                                     "query tile's own keys (stop = (pid_q + 1) * BQ)",
                _forward(q, k, v, True, "diag_skipped")[0].nan_to_num(0.0)),
        mistake("causal_block_skip", "CAUSAL is ignored: every query sees every key",
                scaled_dot_product_attention(q, k, v)),
        mistake("off_by_one", "the causal mask hides the diagonal: query i sees keys 0 .. i, itself included "
                              "(keys <= rows, not <)", _forward(q, k, v, True, "off_by_one")[0]),
        mistake("off_by_one", "the causal mask hides the diagonal: query i sees keys 0 .. i, itself included "
                              "(keys <= rows, not <)", _forward(q, k, v, True, "off_by_one")[0].nan_to_num(0.0)),
        mistake("causal_future", "the causal mask is reversed: query i sees keys j <= i, tl.where(keys[None, :] <= "
                                 "rows[:, None], s, float('-inf')), not the keys after it",
                scaled_dot_product_attention(q, k, v, attn_mask=_tile_masks(EX2, EX2)["reversed"])),
        mistake("causal_future", "the causal mask is reversed (keys >= rows): every key tile before a query's own "
                                 "is then wholly masked, and exp(-inf - (-inf)) made its rows NaN; query i sees keys "
                                 "j <= i, tl.where(keys[None, :] <= rows[:, None], s, float('-inf'))",
                _nan_past_first_tile(scaled_dot_product_attention(q, k, v,
                                                                  attn_mask=_tile_masks(EX2, EX2)["reversed"]))),
        mistake("tile_local_index", "the causal mask compares positions inside the tile (tl.arange(0, BK) <= "
                                    "tl.arange(0, BQ)): compare the global ones, keys = start + tl.arange(0, BK) and "
                                    "rows = pid_q * BQ + tl.arange(0, BQ)",
                scaled_dot_product_attention(q, k, v, attn_mask=_tile_masks(EX2, EX2)["local"])),
    ] + [mistake("tile_local_index", "the causal mask compares the rows' position inside the tile (tl.arange(0, BQ)) "
                                     "with the keys' global one: rows = pid_q * BQ + tl.arange(0, BQ)",
                 _masked_or_zero(q, k, v, _tile_masks(EX2, EX2)[name])) for name in ("local_rows",
                                                                                    "local_rows_diagonal")])}
    o2, _, bad = _pair(value(results, 1), "flash_forward")
    if bad:
        out["skips_future_tiles"] = bad
        return out
    q2, k2, v2 = (t.double() for t in ctx[1])
    rows = slice(0, EX2_NAN_FROM)
    want = scaled_dot_product_attention(q2, k2, v2, attn_mask=causal_mask(*EX2_SKIP))[:, :, rows]
    what = (f"flash_forward with is_causal, L = {EX2_SKIP[0]} and S = {EX2_SKIP[1]}, K and V NaN from key "
            f"{EX2_NAN_FROM}: queries 0..{EX2_NAN_FROM - 1} see none of them")
    loaded = results[1].get("nan_loads", 0)
    B, H, L2, _ = q2.shape
    seen_once = 2 * B * k2.shape[1] * (L2 - EX2_NAN_FROM) * k2.shape[-1]  # K and V of keys 16..31, once each
    # the NaN says 'tiles loaded, not skipped' only of a kernel whose causal output is right: a wrong one
    # (transposed loads, a missing diagonal) can carry the NaN values anywhere
    if loaded > seen_once and out["causal"].passed:
        msg = (f"{what}: your kernels loaded {loaded} of those NaN values, where skipping loads {seen_once} (the keys "
               f"{EX2_NAN_FROM}..{L2 - 1} of query tile 1, once each): they visit key tiles wholly after a query tile "
               "(masking them after the load changes nothing: they are read, and cost time). Stop the key loop at the "
               "tile's own last query: range(0, tl.minimum(S, (pid_q + 1) * BQ), BK)")
        out["skips_future_tiles"] = Verdict(False, msg, [{"code": "causal_block_skip", "message": msg}])
    elif isinstance(o2, Tensor) and o2.shape[:-1] == q2.shape[:-1] and bool(o2[:, :, rows].isnan().any()) \
            and out["causal"].passed:
        msg = (f"{what}: NaN. The key tiles wholly after a query tile are loaded, not skipped: their weights are 0 "
               "but 0 x NaN = NaN in tl.dot(p, v), and they cost time. Stop the key loop at the tile's last query: "
               "range(0, tl.minimum(S, (pid_q + 1) * BQ), BK)")
        out["skips_future_tiles"] = Verdict(False, msg, [{"code": "causal_block_skip", "message": msg}])
    else:
        out["skips_future_tiles"] = tensor_verdict(o2[:, :, rows] if isinstance(o2, Tensor) else o2, want, what)
    return out


# --------------------------------------------------------------------------- ex3: ragged edges
EX3 = (37, 45, 3)  # L, S, H: neither a multiple of 16


def _prep_ex3(g):
    L, S, H = EX3
    q, k, v = _inputs(g, L, S, H=H)
    return [Call("flash_forward", (q, k, v, False)), Call("flash_forward", (q, k, v, True))], (q, k, v)


def _beyond(k: Tensor, pad: int) -> Tensor:
    """What an unmasked load reads past each head's last key: the next head's first rows (the
    tensors are contiguous), NaN past the last head (the grader's guard)."""
    flat = torch.cat([k.reshape(-1, k.shape[-1]), torch.full((pad, k.shape[-1]), float("nan"), dtype=k.dtype)])
    S = k.shape[-2]
    heads = [flat[h * S:h * S + S + pad] for h in range(k.shape[0] * k.shape[1])]
    return torch.stack(heads).reshape(*k.shape[:2], S + pad, k.shape[-1])


def _judge_ex3(ctx, results, outcome):
    L, S, H = EX3
    q, k, v = (t.double() for t in ctx)
    pad = -S % BLOCK
    whole = S // BLOCK * BLOCK  # the keys of the whole tiles
    zeros = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], pad, E)], dim=2)  # noqa: E731
    out = {}
    for name, i, causal in (("ragged_edges", 0, False), ("ragged_causal", 1, True)):
        o, _, bad = _pair(value(results, i), "flash_forward")
        if bad:
            out[name] = bad
            continue
        mask = causal_mask(L, S) if causal else None
        expected = scaled_dot_product_attention(q, k, v, attn_mask=mask)
        what = f"flash_forward (L = {L}, S = {S}: the last tiles are partial{', is_causal' if causal else ''})"
        # a load past the end shows in both calls; NaN in the causal one alone is a causal mistake (a row
        # left with no key), judged by value below
        loads_ok = causal and out.get("ragged_edges") is not None and out["ragged_edges"].passed
        verdict = None if loads_ok else _naming_loads(o, expected, what)
        if verdict is None:
            first = slice(0, H - 1)  # the last head reads the guard's NaN instead of a next head's rows
            m_more = None if mask is None else torch.cat([mask, torch.ones(L, 1, dtype=torch.bool)], dim=1)
            unmasked = (torch.ones(L, S + pad, dtype=torch.bool) if mask is None else
                        torch.cat([mask, torch.ones(L, pad, dtype=torch.bool)], dim=1))
            got = o[:, first] if isinstance(o, Tensor) and o.shape == expected.shape else o
            verdict = tensor_verdict(got, expected[:, first], what, [
                mistake("load_mask", "keys past S are not masked in the scores: loaded as 0.0 they score 0 and still "
                                     "get weight; tl.where(keys[None, :] < S, s, float('-inf'))",
                        scaled_dot_product_attention(q, zeros(k), zeros(v), attn_mask=unmasked)[:, first]),
                mistake("load_mask", "keys past S are neither masked in the loads nor in the scores: the last tile "
                                     "reads the next head's rows",
                        scaled_dot_product_attention(q, _beyond(k, pad), _beyond(v, pad),
                                                     attn_mask=unmasked)[:, first]),
                mistake("off_by_one", "the key mask lets key S in (keys <= S): keys are 0 .. S - 1",
                        scaled_dot_product_attention(q, _beyond(k, 1), _beyond(v, 1),
                                                     attn_mask=m_more)[:, first]),
                mistake("off_by_one", "the key mask drops the last key (keys < S - 1): keys are 0 .. S - 1",
                        scaled_dot_product_attention(q, k[:, :, :-1], v[:, :, :-1],
                                                     attn_mask=None if mask is None else mask[:, :-1])[:, first]),
                mistake("dropped_tile", f"the keys of the last, partial tile (from {S // BLOCK * BLOCK}) are never "
                                        "visited: the key loop stops at S // BK * BK; run it to S, range(0, S, BK), "
                                        "and mask the partial tile",
                        scaled_dot_product_attention(q, k[:, :, :whole], v[:, :, :whole],
                                                     attn_mask=None if mask is None else mask[:, :whole])[:, first]),
            ])
            if verdict.passed and isinstance(o, Tensor):  # and the last head, which would have read the guard
                verdict = tensor_verdict(o, expected, what)
        out[name] = verdict
    return out


# --------------------------------------------------------------------------- ex4: D
EX4 = (37, 2)  # L, H


def _prep_ex4(g):
    L, H = EX4
    o = torch.randn(1, H, L, E, generator=g)
    do = torch.randn(1, H, L, E, generator=g)
    return [Call("backward_preprocess", (o, do))], (o, do)


def _judge_ex4(ctx, results, outcome):
    o, do = (t.double() for t in ctx)
    got = value(results, 0)
    expected = (do * o).sum(-1)
    verdict = _naming_loads(got, expected, "D")
    return {"d": verdict or tensor_verdict(got, expected, f"D = rowsum(dO * O), shape [1, {EX4[1]}, {EX4[0]}]", [
        mistake("backward_d_term", "D is rowsum(dO) alone: it is rowsum(dO * O), one number per query row",
                do.sum(-1)),
        mistake("backward_d_term", "D is rowsum(O) alone: it is rowsum(dO * O), one number per query row", o.sum(-1)),
        mistake("backward_d_term", "D is rowsum(O * O): it is rowsum(dO * O), one number per query row",
                (o * o).sum(-1)),
        mistake("backward_d_term", "D is rowsum(dO * dO): it is rowsum(dO * O), one number per query row",
                (do * do).sum(-1)),
        mistake("backward_d_term", "D is dO * O without the row sum: tl.sum(o * do, 1)", None),
        mistake("backward_d_term", "D sums over the tile's rows (tl.sum(o * do, 0)), not over each row's E columns: "
                                   "tl.sum(o * do, 1)", _d_over_rows(o, do)),
    ])}


def _d_over_rows(o: Tensor, do: Tensor) -> Tensor:
    """D summed over axis 0 of each BLOCK-row tile (E = BLOCK, so it still fits): row r of a tile
    gets column r's sum over the tile's rows (rows past L loaded as 0)."""
    prod = do * o  # [1, H, L, E]
    L = prod.shape[-2]
    pad = torch.cat([prod, prod.new_zeros(*prod.shape[:-2], -L % BLOCK, E)], dim=-2)
    tiles = pad.reshape(*prod.shape[:-2], -1, BLOCK, E).sum(-2)  # [1, H, tiles, E]
    return tiles[..., :BLOCK].reshape(*prod.shape[:-2], -1)[..., :L]


# --------------------------------------------------------------------------- ex5: dK, dV, dQ
# L, S, causal; rectangular causal both ways (issue 62: a backward whose mask was aligned bottom-right scored 100)
EX5 = ((37, 45, False), (40, 40, True), (24, 40, True), (40, 24, True))
EX5_B = (2, 1, 1, 1)  # the batch of each case: one with B = 2, so a batch offset left out of a kernel shows
EX5_HALF = (64, 16)  # the float16 case: L, S; dV of key 0 is about 64 x 1500 = 96000 > 65504


def _backward_call(g, L, S, causal, H=2, Hkv=None, B=1):
    q, k, v = _inputs(g, L, S, H=H, Hkv=Hkv, B=B)
    do = torch.randn(q.shape, generator=g)
    r = H // (Hkv or H)
    o, lse = _forward(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), causal)  # exact, as lab 04 gives
    return Call("flash_backward", (q, k, v, o.float(), lse.float(), do, causal)), (q, k, v, do)


def _half_case(g):
    """Every query puts its weight on key 0 (score 16 against ~N(0, 4)), dO ~ 1500: dV of key 0 is
    ~96000, past float16's 65504, while every input and every product fits in float16."""
    L, S = EX5_HALF
    q = torch.full((1, 1, L, E), 2.0)
    k = torch.randn(1, 1, S, E, generator=g) * 0.5
    k[:, :, 0] = 2.0
    v = torch.randn(1, 1, S, E, generator=g) * 0.01
    do = 1500 + 100 * torch.randn(1, 1, L, E, generator=g)
    q, k, v, do = (t.half() for t in (q, k, v, do))
    o, lse = _forward(q, k, v, False)
    return Call("flash_backward", (q, k, v, o.half(), lse.float(), do, False)), (q, k, v, do)


def _prep_ex5(g):
    calls, ctx = [], []
    for (L, S, causal), B in zip(EX5, EX5_B):
        call, c = _backward_call(g, L, S, causal, B=B)
        calls.append(call)
        ctx.append(c)
    call, c = _half_case(g)
    skip_call, skip_ctx, one_call = _skip_case(g)
    return calls + [call, skip_call, one_call], ctx + [c, skip_ctx]


EX5_SKIP = (32, 48)  # L, S under is_causal: keys 32.. are seen by no query, their K and V are NaN


def _skip_case(g):
    """Keys no query sees under is_causal (top-left: query i sees keys 0..i < 32) hold NaN: kernels
    that skip the tiles wholly on the far side of the diagonal never read them (dQ stops at its
    query tile's diagonal, dK/dV start at the query tile holding the key tile's first key)."""
    L, S = EX5_SKIP
    q, k, v = _inputs(g, L, S)
    do = torch.randn(q.shape, generator=g)
    o, lse = _forward(q, k, v, True)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, L:] = float("nan")
    v_nan[:, :, L:] = float("nan")
    # and one NaN in V at a key the later queries attend to (a secret one): through dP it must reach their
    # dq. Kernels that clean V (tl.where(v == v, v, 0)) cannot keep this NaN and drop the others
    v_one = v.clone()
    v_one[:, :, int(torch.randint(1, L, (1,), generator=g)), 0] = float("nan")
    return (Call("flash_backward", (q, k_nan, v_nan, o.float(), lse.float(), do, True)), (q, k, v, do, v_one),
            Call("flash_backward", (q, k, v_one, o.float(), lse.float(), do, True)))


def _keeps_nan(result, v_one: Tensor) -> bool:
    """Whether dq on ``v_one`` (one NaN in V at key j) is NaN in every row i >= j, as the backward of any
    attention is (dP[i, j] = dO[i] . v_j is NaN, and P[i, j] > 0)."""
    dq = result[0] if isinstance(result, tuple) and len(result) == 3 else None
    j = int(v_one[0, 0, :, 0].isnan().nonzero()[0])
    return isinstance(dq, Tensor) and dq.shape[-2] == EX5_SKIP[0] and bool(dq[:, :, j:].isnan().all())


def _judge_skip(ctx, result, one: object = None, loaded: int = 0) -> Verdict:
    q, k, v, do = (t.double() for t in ctx[:4])
    got, bad = _triple(result, "flash_backward")
    if bad:
        return bad
    L, S = EX5_SKIP
    want = simulate_grads(q, k, v, do, causal_mask(L, S))
    what = (f"flash_backward with is_causal (L = {L}, S = {S}; K and V of keys {L}.., which no query sees, are NaN)")
    shaped = all(isinstance(t, Tensor) and t.shape == w.shape for t, w in zip(got, want))
    if shaped and bool(got[0].isnan().any()):
        msg = (f"{what}: dq is NaN. The dQ kernel visits the key tiles wholly after its query tile: their weights "
               "are 0 but 0 x NaN = NaN, and they cost time. Stop its key loop at the diagonal, as the forward's: "
               "range(0, tl.minimum(S, (pid_q + 1) * BQ), BK)")
        return Verdict(False, msg, [{"code": "causal_block_skip", "message": msg}])
    if shaped and bool(got[1].isnan().any() or got[2].isnan().any()):
        msg = (f"{what}: dk or dv is NaN. The dK/dV kernel visits the query tiles wholly before its key tile: start "
               "its query loop at the tile that holds its first key, (pid_k * BK) // BQ * BQ")
        return Verdict(False, msg, [{"code": "causal_block_skip", "message": msg}])
    flat = (lambda t: torch.cat([x.flatten() for x in t]))  # noqa: E731
    verdict = tensor_verdict(flat(got) if shaped else got[0], flat(want) if shaped else want[0], what)
    once = 2 * k.shape[0] * k.shape[1] * (S - L) * k.shape[-1]  # the NaN K and V, each by its own dK/dV program
    if verdict.passed and loaded > once:  # a ninth road visited every tile and masked what it read
        msg = (f"{what}: your kernels loaded {loaded} of those NaN values, where skipping loads {once} (each key's K "
               "and V once, by its own dK/dV program, which then finds no query tile): the dQ kernel visits key tiles "
               "past its diagonal, or the dK/dV kernel query tiles before its first key, and masks what it read")
        return Verdict(False, msg, [{"code": "causal_block_skip", "message": msg}])
    if verdict.passed and not _keeps_nan(one, ctx[4]):
        msg = ("with is_causal and one NaN in V at a key the later queries attend to, their dq was not NaN: the NaN "
               "was cleaned, not the tiles skipped. Stop the dQ kernel's key loop at the diagonal and the dK/dV "
               "kernel's query loop at its first key's tile, and leave the values alone")
        return Verdict(False, msg, [{"code": "causal_block_skip", "message": msg}])
    return verdict


def _judge_grads(got, case: FlashCase, where: str, explanation) -> tuple[Verdict, Verdict]:
    """(dv, dq and dk) of one case against the right backward; ``explanation``: what the shared
    bug-model library (:mod:`attnlab.bugmodels`) found to explain every case, or None."""
    want = flash_gradients(case)
    named = model_mistakes(explanation, case)
    both = (lambda a, b: torch.cat([a.flatten(), b.flatten()]))  # noqa: E731
    got_qk = both(got[0], got[1]) if all(isinstance(t, Tensor) and t.shape == want[n].shape
                                         for t, n in zip(got[:2], ("dq", "dk"))) else None
    loads = _naming_loads(got_qk, both(want["dq"], want["dk"]), f"dq and dk {where}") if got_qk is not None else None
    qk_named = [(code, message, both(named["dq"][0][2], named["dk"][0][2])) for code, message, _ in named["dq"]]
    qk = loads or tensor_verdict(got_qk if got_qk is not None else got[0],
                                 both(want["dq"], want["dk"]) if got_qk is not None else want["dq"],
                                 f"dq and dk {where}", qk_named if got_qk is not None else named["dq"])
    dv_v = _naming_loads(got[2], want["dv"], f"dv {where}") or tensor_verdict(got[2], want["dv"], f"dv {where}",
                                                                               named["dv"])
    return dv_v, qk


def _judge_half(ctx, result, dv_right: bool = True) -> Verdict:
    """``dv_right``: the float32 case's dV passed; an inf in the float16 one is then the
    accumulator's (otherwise the float32 mistake explains it: no accumulate_dtype)."""
    q, k, v, do = (t.double() for t in ctx)
    got, bad = _triple(result, "flash_backward")
    if bad:
        return bad
    dv = simulate_grads(q, k, v, do, None)[2]
    what = (f"dv with float16 inputs (L = {EX5_HALF[0]}: every query weighs key 0, dO ~ 1500; dv of key 0 is "
            f"{float(dv[0, 0, 0].abs().max()):.0f}, past float16's 65504)")
    d = got[2]
    if not dv_right and isinstance(d, Tensor) and d.shape == dv.shape and bool((~d.isfinite() & dv.isfinite()).any()):
        return Verdict(False, f"{what}: inf or NaN; fix dv with float32 inputs first")
    if isinstance(d, Tensor) and d.shape == dv.shape and bool((~d.isfinite() & dv.isfinite()).any()):
        msg = (f"{what}: inf. dV was accumulated in float16 (the inputs' dtype), which overflows: accumulate in "
               "tl.zeros([BK, E], tl.float32) and store that")
        return Verdict(False, msg, [{"code": "accumulate_dtype", "message": msg}], (d, dv))
    if isinstance(d, Tensor) and d.shape == dv.shape and d.is_floating_point():
        tol = tolerance(torch.float16)  # P or dO rounded to float16 for the dot is fine: the accumulator is not
        # P cast to dO's float16 for dV += P^T dO with a float32 accumulator (Triton's fused-attention
        # tutorial, FlashAttention-2) is right: judged against a reference with that same rounding of P,
        # so that only an error beyond it fails (it lost 4 points against the unrounded one: issue 48)
        p = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)  # (1, 1, L, S)
        dv_p16 = p.half().double().transpose(-2, -1) @ do
        if any(bool(((d.double() - ref).abs() <= tol.atol + tol.rtol * ref.abs()).all()) for ref in (dv, dv_p16)):
            return Verdict(True)
        return Verdict(False, f"{what}: differs from the reference by up to {max_abs_diff(d, dv):.3g} (more than "
                              f"float16's rounding)", arrays=(d, dv))
    return tensor_verdict(d, dv, what)


def _judge_ex5(ctx, results, outcome):
    cases = [FlashCase(*ctx[i], causal, BLOCK, BLOCK) for i, (L, S, causal) in enumerate(EX5)]
    raw = [value(results, i) for i in range(len(EX5))]
    out = _ex5_verdicts(cases, raw, None)
    if not all(v.passed for v in out.values()):  # asked once, over both cases: which choices explain them
        explanation = explain_backward(cases, [r if _triple(r, "")[1] is None else None for r in raw])
        if explanation is not None:
            out = _ex5_verdicts(cases, raw, explanation)
    n = len(EX5)  # then the float16 case and the skip case
    out["fp32_accumulators"] = _judge_half(ctx[n], value(results, n), out.get("dv", Verdict(False)).passed)
    out["skips_masked_tiles"] = _judge_skip(ctx[n + 1], value(results, n + 1), results[n + 2].get("value"),
                                            results[n + 1].get("nan_loads", 0))
    return out


def _ex5_verdicts(cases, raw, explanation) -> dict[str, Verdict]:
    out = {}
    for case, r, (L, S, causal) in zip(cases, raw, EX5):
        got, bad = _triple(r, "flash_backward")
        where = f"(L = {L}, S = {S}{', is_causal' if causal else ''})"
        if bad:
            out.update({"causal": bad} if causal else {"dv": bad, "dq_dk": bad})
            continue
        dv_v, qk = _judge_grads(got, case, where, explanation)
        if causal:
            out["causal"] = dv_v if not dv_v.passed else qk
        else:
            out["dv"], out["dq_dk"] = dv_v, qk
    return out


# --------------------------------------------------------------------------- ex6: the autograd Function
EX6 = ((33, 21, False), (32, 32, True))


def _prep_ex6(g):
    calls, ctx = [], []
    for L, S, causal in EX6:
        q, k, v = _inputs(g, L, S)
        do = torch.randn(q.shape, generator=g)
        calls.append(Call("TritonAttention", (q, k, v, do, causal), harness="autograd"))
        ctx.append((q, k, v, do))
    return calls, ctx


def _judge_ex6(ctx, results, outcome):
    return judge_autograd_function(ctx, results, EX6, output_of="triton_attention's output", function="TritonAttention",
                                   causal_fix="keep is_causal on ctx in forward and pass it to flash_backward",
                                   recompute="let the backward's kernels recompute P tile by tile")


# --------------------------------------------------------------------------- ex7: grouped heads
# L, S, H, Hkv, and a batch of 2: B * H and B * Hkv offsets differ only past batch 0, so a key/value offset
# or a dK/dV grid counted in H instead of Hkv shows only there (issue 62: every case was batch 1)
EX7 = (33, 40, 4, 2)
EX7_B = 2


def _prep_ex7(g):
    L, S, H, Hkv = EX7
    q, k, v = _inputs(g, L, S, H=H, Hkv=Hkv, B=EX7_B)
    back, bctx = _backward_call(g, L, S, True, H=H, Hkv=Hkv, B=EX7_B)
    return [Call("flash_forward", (q, k, v, True)), back], ((q, k, v), bctx)


def _heads(H: int, Hkv: int, how: str) -> list[int]:
    r = H // Hkv
    return [h % Hkv for h in range(H)] if how == "modulo" else [h // r for h in range(H)]


def _judge_ex7(ctx, results, outcome):
    L, S, H, Hkv = EX7
    mask = causal_mask(L, S)
    q, k, v = (t.double() for t in ctx[0])
    modulo = _heads(H, Hkv, "modulo")
    o, _, bad = _pair(value(results, 0), "flash_forward")
    if bad:
        out = {"forward": bad}
    else:
        out = {"forward": tensor_verdict(o, scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                                         f"flash_forward with H = {H} query heads over Hkv = {Hkv} (is_causal)", [
            mistake("gqa_group_mapping", "query head h reads key/value head h % Hkv: it is h // (H // Hkv), so the "
                                         "r = H // Hkv heads of a group are neighbours",
                    scaled_dot_product_attention(q, k[:, modulo], v[:, modulo], attn_mask=mask)),
            mistake("gqa_group_mapping", "every query head reads key/value head h with Hkv < H: index K and V by "
                                         "b * Hkv + h // (H // Hkv)", None),
        ])}
    case = FlashCase(*ctx[1], True, BLOCK, BLOCK)
    got, bad = _triple(value(results, 1), "flash_backward")
    if bad:
        out["backward"] = bad
        return out
    want = flash_gradients(case)
    if not all(isinstance(t, Tensor) and t.shape == want[n].shape for t, n in zip(got, ("dq", "dk", "dv"))):
        out["backward"] = Verdict(False, f"flash_backward with grouped heads must return dq {list(want['dq'].shape)}, "
                                         f"dk and dv {list(want['dk'].shape)} (one per key/value head), got "
                                         + ", ".join(str(list(t.shape)) if isinstance(t, Tensor) else
                                                     type(t).__name__ for t in got))
        return out
    verdict = _grouped_backward(got, case, None)
    if not verdict.passed:  # the shared bug-model library: which choices (a head map, a fold) explain it
        explanation = explain_backward([case], [got])
        if explanation is not None:
            verdict = _grouped_backward(got, case, explanation)
    out["backward"] = verdict
    return out


def _grouped_backward(got, case: FlashCase, explanation) -> Verdict:
    L, S, H, Hkv = EX7
    want, named = flash_gradients(case), model_mistakes(explanation, case)
    where = f"with H = {H} over Hkv = {Hkv} (is_causal)"
    verdict = tensor_verdict(got[0], want["dq"], f"dq {where}", named["dq"])
    if verdict.passed:
        both = (lambda a, b: torch.cat([a.flatten(), b.flatten()]))  # noqa: E731
        verdict = tensor_verdict(both(got[1], got[2]), both(want["dk"], want["dv"]), f"dk and dv {where}",
                                 [(c, m, both(named["dk"][0][2], named["dv"][0][2])) for c, m, _ in named["dk"]])
    return verdict


def _limits() -> dict:
    return {"timeout_s": CPU_S}


def _out_of_bounds(error: str, traceback: str) -> list[dict]:
    """A kernel's load or store outside every tensor passed to it, stopped in the child before it
    happened (``attnlab.grading.sandbox.interpreter.guard_pointers``): named, with the kernel's line
    in the traceback the learner reads."""
    if "OutOfBounds:" not in error.split("\n", 1)[0]:
        return []
    where = error.split(":", 1)[-1].strip()
    return [{"code": "store_mask" if "tl.store" in error else "load_mask", "message": where}]


FORWARD = ("attn_fwd_kernel",)  # the kernels each exercise's answer must come from (Exercise.kernels)
BACKWARD = ("bwd_dkdv_kernel", "bwd_dq_kernel")

EXERCISES: list[Exercise] = [
    Exercise("ex1", "flash_forward", "the forward kernel", {"output": 8, "lse": 6}, _prep_ex1, _judge_ex1,
             limits=_limits(), on_error=_out_of_bounds, kernels=FORWARD),
    Exercise("ex2", "flash_forward", "causal: skip the tiles above the diagonal, mask the diagonal tile",
             {"causal": 10, "skips_future_tiles": 4}, _prep_ex2, _judge_ex2, limits=_limits(), on_error=_out_of_bounds, kernels=FORWARD),
    Exercise("ex3", "flash_forward", "ragged edges: L and S not multiples of the tile",
             {"ragged_edges": 8, "ragged_causal": 6}, _prep_ex3, _judge_ex3, limits=_limits(), on_error=_out_of_bounds, kernels=FORWARD),
    Exercise("ex4", "backward_preprocess", "the backward's preprocess: D = rowsum(dO * O)", {"d": 8},
             _prep_ex4, _judge_ex4, limits=_limits(), on_error=_out_of_bounds, kernels=("bwd_preprocess_kernel",)),
    Exercise("ex5", "flash_backward", "dK/dV per key tile and dQ per query tile, no atomics",
             {"dv": 6, "dq_dk": 6, "causal": 6, "skips_masked_tiles": 2, "fp32_accumulators": 4}, _prep_ex5, _judge_ex5, limits=_limits(), on_error=_out_of_bounds,
             kernels=BACKWARD),
    Exercise("ex6", "TritonAttention", "one autograd Function",
             {"output": 3, "gradients": 6, "saves_lse_not_weights": 3}, _prep_ex6, _judge_ex6, limits=_limits(), on_error=_out_of_bounds,
             kernels=FORWARD + BACKWARD),
    Exercise("ex7", "flash_forward", "grouped heads by index arithmetic (GQA), forward and backward",
             {"forward": 7, "backward": 7}, _prep_ex7, _judge_ex7, limits=_limits(), on_error=_out_of_bounds, kernels=FORWARD + BACKWARD),
]
assert sum(ex.max_score for ex in EXERCISES) == 100
