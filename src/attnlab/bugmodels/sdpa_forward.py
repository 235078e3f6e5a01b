"""SDPA's forward with each textbook choice made explicit (package-internal: the doctor fits it to a
function's outputs, :mod:`attnlab.doctor.analysis`, and the labs' SDPA-like exercises ask the doctor).

A :class:`BugModel` is SDPA with one or more choices changed (no 1/sqrt(E), softmax over the
query axis, ``Q @ K`` without the transpose, the mask inverted, ...); :func:`model_attention`
computes its output in float64, and :data:`FIELD_FINDINGS` names the mistake behind each
changed choice in the vocabulary of :mod:`attnlab.mistakes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from attnlab import masks
from attnlab.softmax import stable_softmax

__all__ = ["BugModel", "SCALE_TEXT", "FIELD_FINDINGS", "model_attention"]

@dataclass(frozen=True)
class BugModel:
    """Attention with each textbook choice made explicit; the defaults are SDPA."""

    # sdpa | one | inv_E | inv_sqrt_Ev | inv_sqrt_S | inv_sqrt_L | ignore_arg | power | rel_power | const | rel_const
    scale: str = "sdpa"
    softmax_dim: int = -1
    scores: str = "q_kT"  # q_kT | q_k (no transpose) | k_qT (scores transposed)
    values: str = "v"  # v | q | k
    mask: str = "before"  # before | inverted | after_softmax | after_softmax_inf | zero_fill | ignored
    causal: str = "top_left"  # top_left | bottom_right | no_diag | plus_one | upper | ignored
    empty_rows: str = "zero"  # zero | nan | uniform
    softmax: str = "stable"  # stable | naive
    gqa: str = "interleave"  # interleave (SDPA's: query head h uses key/value head h // r) | tile (h % Hkv)
    # continuous parameters, fitted from the probes when no enumerated choice explains them
    power: float = -0.5  # scale = E ** power ("power"), or SDPA's scale times E ** power ("rel_power")
    factor: float = 1.0  # scale = factor, whatever E ("const"), or SDPA's scale times factor ("rel_const")
    diagonal: int = 0  # causal == "diagonal": keep = tril(diagonal)


SCALE_TEXT = {
    "one": "the scores are not divided by sqrt(d_k)",
    "inv_E": "the scores are divided by d_k instead of sqrt(d_k)",
    "inv_sqrt_Ev": "the scores are divided by sqrt(d_v) instead of sqrt(d_k)",
    "inv_sqrt_S": "the scores are divided by sqrt(S) (the number of keys) instead of sqrt(d_k)",
    "inv_sqrt_L": "the scores are divided by sqrt(L) (the number of queries) instead of sqrt(d_k)",
    "ignore_arg": "the `scale` argument is ignored (1/sqrt(d_k) is always used)",
}

# (field, value) -> (code, message)
FIELD_FINDINGS: dict[tuple[str, Any], tuple[str, str]] = {
    **{("scale", s): ("missing_scale" if s == "one" else "wrong_scale", t) for s, t in SCALE_TEXT.items()},
    ("softmax_dim", -2): ("softmax_dim", "softmax runs over the queries (dim=-2) instead of the keys (dim=-1)"),
    ("scores", "q_k"): ("wrong_transpose", "the scores are Q @ K (K not transposed)"),
    ("scores", "k_qT"): ("wrong_transpose", "the scores are transposed (K @ Q^T instead of Q @ K^T)"),
    ("values", "q"): ("value_swapped", "the weights multiply Q instead of V"),
    ("values", "k"): ("value_swapped", "the weights multiply K instead of V"),
    ("mask", "inverted"): ("mask_polarity", "the bool mask is inverted (True was treated as 'masked')"),
    ("mask", "after_softmax"): ("mask_after_softmax",
                                "the mask zeroes weights after softmax, so rows no longer sum to 1"),
    ("mask", "after_softmax_inf"): ("mask_after_softmax", "the mask fills the weights with -inf after softmax, "
                                                          "so the output is NaN or inf"),
    ("mask", "ignored"): ("mask_ignored", "attn_mask has no effect on the output"),
    ("mask", "zero_fill"): ("mask_fill_zero", "masked scores are set to 0 instead of -inf, so masked keys still get "
                                              "weight after softmax"),
    ("causal", "bottom_right"): ("causal_alignment",
                                 "is_causal is aligned bottom-right (tril(S - L)); SDPA aligns top-left"),
    ("causal", "no_diag"): ("off_by_one", "the causal mask hides the diagonal (tril(-1)): "
                                          "query i must also see key i"),
    ("causal", "plus_one"): ("off_by_one", "the causal mask is off by one (tril(1)): query i sees key i+1"),
    ("causal", "upper"): ("causal_future", "the causal mask is upper-triangular (triu): "
                                           "query i sees the future, not the past"),
    ("causal", "ignored"): ("mask_ignored", "is_causal=True has no effect"),
    ("empty_rows", "nan"): ("fully_masked_nan", "rows whose keys are all masked come out NaN instead of 0"),
    ("empty_rows", "uniform"): ("mask_fill_finite", "rows whose keys are all masked come out as the average "
                                                    "of V (a finite fill such as -1e9) instead of 0"),
    ("gqa", "tile"): ("gqa_group_mapping", "with enable_gqa, query head h reads key/value head h % Hkv (the heads "
                                           "tiled with repeat) instead of h // (H / Hkv) (repeat_interleave)"),
    ("softmax", "naive"): ("unstable_softmax", "the output is NaN/inf for large scores: exp overflows "
                                               "without the row-max shift"),
}


def model_attention(m: BugModel, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                    is_causal: bool, scale: Optional[float], enable_gqa: bool = False) -> Optional[Tensor]:
    """The bug model's output in float64, or None where its shapes do not fit."""
    q, k, v = q.double(), k.double(), v.double()
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        r = q.shape[-3] // k.shape[-3]  # query heads per key/value head
        if m.gqa == "interleave":  # (B, Hkv, S, E) -> (B, H, S, E): head h reads h // r
            k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
        else:  # tiled: head h reads h % Hkv
            k, v = (t.repeat(*([1] * (t.dim() - 3)), r, 1, 1) for t in (k, v))
    E, Ev, S = q.shape[-1], v.shape[-1], k.shape[-2]
    factor = {
        "sdpa": 1 / math.sqrt(E) if scale is None else scale,
        "one": 1.0,
        "inv_E": 1 / E,
        "inv_sqrt_Ev": 1 / math.sqrt(Ev),
        "inv_sqrt_S": 1 / math.sqrt(S),
        "inv_sqrt_L": 1 / math.sqrt(q.shape[-2]),
        "ignore_arg": 1 / math.sqrt(E),
        "power": float(E) ** m.power,
        "rel_power": (1 / math.sqrt(E) if scale is None else scale) * float(E) ** m.power,
        "const": m.factor,
        "rel_const": (1 / math.sqrt(E) if scale is None else scale) * m.factor,
    }[m.scale]
    try:
        if m.scores == "q_kT":
            s = q @ k.transpose(-2, -1)  # (..., L, S)
        elif m.scores == "q_k":
            s = q @ k
        else:
            s = k @ q.transpose(-2, -1)  # (..., S, L): the scores transposed
        s = s * factor
        keep = None  # bool (…, L, S): True = attend
        if is_causal:
            Ls, Ss = s.shape[-2], s.shape[-1]
            keep = {
                "top_left": masks.causal(Ls, Ss),
                "bottom_right": masks.causal(Ls, Ss, align="bottom_right"),
                "no_diag": torch.ones(Ls, Ss, dtype=torch.bool).tril(-1),
                "plus_one": torch.ones(Ls, Ss, dtype=torch.bool).tril(1),
                "upper": torch.ones(Ls, Ss, dtype=torch.bool).triu(),
                "ignored": None,
                "diagonal": torch.ones(Ls, Ss, dtype=torch.bool).tril(m.diagonal),
            }[m.causal]
        elif attn_mask is not None and attn_mask.dtype == torch.bool:
            keep = {"before": attn_mask, "after_softmax": attn_mask, "after_softmax_inf": attn_mask,
                    "inverted": ~attn_mask,
                    "zero_fill": attn_mask, "ignored": None}[m.mask]
        elif attn_mask is not None:
            if m.mask != "ignored":
                s = s + attn_mask.double()

        after = keep is not None and m.mask in ("after_softmax", "after_softmax_inf") and not is_causal
        if keep is not None and not after:
            fill = -1e9 if m.empty_rows == "uniform" else float("-inf")
            if m.mask == "zero_fill" and not is_causal:
                fill = 0.0
            s = s.masked_fill(~keep, fill)
        if m.softmax == "naive":
            e = torch.exp(s)
            w = e / e.sum(m.softmax_dim, keepdim=True)
        else:
            w = stable_softmax(s, dim=m.softmax_dim)
        if after:
            w = w * keep if m.mask == "after_softmax" else w.masked_fill(~keep, float("-inf"))
        if m.empty_rows == "nan":
            empty = torch.isneginf(s).all(-1, keepdim=True)
            w = torch.where(empty, torch.full_like(w, float("nan")), w)
        src = {"v": v, "q": q, "k": k}[m.values]
        return w @ src
    except RuntimeError:
        return None
