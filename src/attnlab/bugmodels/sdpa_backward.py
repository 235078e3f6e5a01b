"""SDPA's backward as a bug model, whole matrices: the one the backward doctor fits
(:mod:`attnlab.doctor.backward`), with sinks, bool masks and precision.

A :class:`BackwardModel` is the right backward with one or two choices changed (the scale left
out of dS, the D term missing, the mask left out when P is recomputed, GQA gradients not summed
over the group, a wrong sink gradient, ...); :func:`model_gradients` computes its gradients in
float64 for one probe, and :data:`MODEL_FINDINGS` names the mistake behind each changed choice
in the vocabulary of :mod:`attnlab.mistakes`. The right backward, for one query head::

    S = scale * Q K^T (masked: -inf)       lse = log(sum_j exp(S) [+ exp(sink)])
    P = exp(S - lse)                      O = P V
    dV = P^T dO      dP = dO V^T          D = rowsum(dO * O)
    dS = P * (dP - D)                      dQ = scale * dS K      dK = scale * dS^T Q
    d sink = -sum_i p_sink_i * D_i, p_sink = exp(sink - lse)

with dK and dV summed over the query heads of each key/value head's group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["BackwardModel", "BackwardProbe", "CHOICES", "MODEL_FINDINGS", "model_forward", "model_gradients",
           "round_mantissa"]


@dataclass(frozen=True)
class BackwardModel:
    """The backward with each choice explicit; the defaults are the right backward."""

    p_scale: str = "yes"  # yes | no: P recomputed from Q K^T without the scale
    scale_arg: str = "honoured"  # honoured | default: the backward uses 1/sqrt(E) where the forward took scale=
    p_bool: str = "yes"  # yes | no: P recomputed without the bool attn_mask
    p_causal: str = "top_left"  # top_left | none: without the causal mask | bottom_right | always: also when not asked
    # natural | log2: the saved lse in base 2 | max: only the row max | keys: without the sink | keys_p: P from
    # the keys' lse, the sink's gradient from the full one
    lse: str = "natural"
    d_term: str = "do_o"  # do_o | none: dS = P * dP | do: D = rowsum(dO)
    ds_p: str = "yes"  # yes | no: dS = dP - D (masked keys zeroed) | raw: dS = dP - D, masked keys too
    dq_scale: str = "once"  # once | none | twice
    dk_scale: str = "once"  # once | none | twice
    dv_scale: str = "none"  # none | once: a scale on dV
    # sum | first | mean | tile: query head h -> key/value head h % Hkv in the backward | fold_tile: P read
    # the right heads, but dK and dV are folded as if head h were h % Hkv's (``repeat``'s layout)
    gqa: str = "sum"
    sink: str = "right"  # right | zero | sign | no_p: -sum D | mean: over rows
    precision: str = "exact"  # exact | tf32 | bf16: the backward's products on rounded operands


# the choices the doctor tries, field by field (the first value of each is the right one)
CHOICES: dict[str, list[str]] = {
    "p_scale": ["no"], "scale_arg": ["default"], "p_bool": ["no"], "p_causal": ["none", "bottom_right", "always"],
    "lse": ["log2", "max", "keys", "keys_p"], "d_term": ["none", "do"], "ds_p": ["no", "raw"],
    "dq_scale": ["none", "twice"], "dk_scale": ["none", "twice"], "dv_scale": ["once"],
    "gqa": ["first", "mean", "tile", "fold_tile"], "sink": ["zero", "sign", "no_p", "mean"],
}

# (field, value) -> (code, message)
MODEL_FINDINGS: dict[tuple[str, Any], tuple[str, str]] = {
    ("p_scale", "no"): ("backward_scale", "the backward recomputes P from Q K^T without the scale"),
    ("scale_arg", "default"): ("backward_scale", "the backward recomputes 1/sqrt(E) where the forward took the "
                                                 "caller's scale="),
    ("p_bool", "no"): ("backward_mask", "the backward recomputes P without the bool attn_mask (the forward applied "
                                        "it)"),
    ("p_causal", "none"): ("backward_mask", "the backward recomputes P without the causal mask (the forward "
                                            "applied it)"),
    ("p_causal", "bottom_right"): ("backward_mask", "the backward's causal mask is aligned bottom-right (keys "
                                                    "j <= i + S - L), the forward's top-left"),
    ("p_causal", "always"): ("backward_mask", "the backward applies a causal mask also where is_causal is False"),
    ("lse", "log2"): ("lse_saved", "the backward takes a base-2 log-sum-exp as the natural one: P = exp(S - lse2)"),
    ("lse", "max"): ("lse_saved", "the backward rebuilds P from the row max alone (lse = m, without log l)"),
    ("lse", "keys"): ("sink_grad", "the backward's lse leaves the sink out (the forward's includes it)"),
    ("lse", "keys_p"): ("sink_grad", "the backward's P comes from an lse over the keys alone (the sink left out), "
                                     "while the sinks' gradient uses the full one"),
    ("d_term", "none"): ("backward_d_term", "dS = P * dP: the D term is missing"),
    ("d_term", "do"): ("backward_d_term", "D = rowsum(dO), without O (D = rowsum(dO * O))"),
    ("ds_p", "no"): ("softmax_backward", "dS = dP - D, not multiplied by P"),
    ("ds_p", "raw"): ("softmax_backward", "dS = dP - D, not multiplied by the saved P, so masked keys get a "
                                          "gradient too"),
    ("dq_scale", "none"): ("backward_scale", "dQ lacks the scale (dQ = dS K)"),
    ("dq_scale", "twice"): ("backward_scale", "dQ has the scale twice"),
    ("dk_scale", "none"): ("backward_scale", "dK lacks the scale (dK = dS^T Q)"),
    ("dk_scale", "twice"): ("backward_scale", "dK has the scale twice"),
    ("dv_scale", "once"): ("backward_scale", "dV is multiplied by the scale (dV = P^T dO has none)"),
    ("gqa", "first"): ("gqa_grad_sum", "dK and dV of a key/value head come from the first query head of its "
                                       "group only, not summed over the group"),
    ("gqa", "mean"): ("gqa_grad_sum", "dK and dV are averaged over the group's query heads, not summed"),
    ("gqa", "tile"): ("gqa_group_mapping", "the backward maps query head h to key/value head h % Hkv (the "
                                           "forward's h // (H / Hkv))"),
    ("gqa", "fold_tile"): ("gqa_group_mapping", "dK and dV are folded over the group with repeat's layout (query "
                                                "head h -> h % Hkv) where the forward used repeat_interleave's "
                                                "(h // (H / Hkv))"),
    ("sink", "zero"): ("sink_grad", "no gradient reaches the sinks"),
    ("sink", "sign"): ("sink_grad", "the sinks' gradient has the wrong sign (+sum p_sink * D)"),
    ("sink", "no_p"): ("sink_grad", "the sinks' gradient lacks p_sink (-sum D)"),
    ("sink", "mean"): ("sink_grad", "the sinks' gradient is a mean over the rows, not a sum"),
    ("precision", "tf32"): ("low_precision", "the gradients' errors are those of TF32 products (10-bit mantissa)"),
    ("precision", "bf16"): ("low_precision", "the gradients' errors are those of bfloat16 products (8-bit mantissa)"),
}


@dataclass
class BackwardProbe:
    """One designed call and its cotangent, in float32 (what the function gets) and as its
    float64 copies (what the models use).

    Shapes: query (B, H, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev), grad_out (B, H, L, Ev),
    keep (L, S) bool or None (the mask and causality together), sinks (H,) or None; ``mask`` the
    bool attn_mask alone (L, S) or None.
    """

    name: str
    description: str
    query: Tensor
    key: Tensor
    value: Tensor
    grad_out: Tensor
    kwargs: dict
    keep: Optional[Tensor]
    scale: float
    sinks: Optional[Tensor] = None
    mask: Optional[Tensor] = None


def round_mantissa(x: Tensor, bits: int) -> Tensor:
    """``x`` (float64) with its float32 mantissa rounded to ``bits`` bits (10: TF32; 7: bfloat16's
    stored bits), to nearest, back in float64."""
    f = x.to(torch.float32).contiguous()
    drop = 23 - bits
    i = f.view(torch.int32)
    i = (i + (1 << (drop - 1))) & ~((1 << drop) - 1)
    return i.view(torch.float32).to(torch.float64)


def _mm(a: Tensor, b: Tensor, precision: str) -> Tensor:
    if precision == "tf32":
        a, b = round_mantissa(a, 10), round_mantissa(b, 10)
    elif precision == "bf16":
        a, b = a.to(torch.bfloat16).double(), b.to(torch.bfloat16).double()
    return a @ b


def _heads(x: Tensor, H: int, mapping: str) -> Tensor:
    """(B, Hkv, S, F) -> (B, H, S, F): query head h reads h // (H // Hkv), or h % Hkv ("tile")."""
    Hkv = x.shape[1]
    idx = torch.arange(H) // (H // Hkv) if mapping != "tile" else torch.arange(H) % Hkv
    return x[:, idx]


def _group(g: Tensor, Hkv: int, how: str) -> Tensor:
    """(B, H, S, F) per query head -> (B, Hkv, S, F) per key/value head."""
    B, H, S, F = g.shape
    r = H // Hkv
    if how == "tile":  # head h went to h % Hkv: sum those
        return g.reshape(B, r, Hkv, S, F).sum(1)
    g = g.reshape(B, Hkv, r, S, F)  # (B, Hkv, r, S, F): the group's heads side by side
    return {"sum": g.sum(2), "first": g[:, :, 0], "mean": g.mean(2)}[how]


def _scores(p: BackwardProbe, scale: float, mapping: str) -> tuple[Tensor, Tensor, Tensor]:
    q, H = p.query.double(), p.query.shape[1]
    k, v = _heads(p.key.double(), H, mapping), _heads(p.value.double(), H, mapping)
    return scale * q @ k.transpose(-2, -1), k, v  # (B, H, L, S)


def _lse(s: Tensor, sinks: Optional[Tensor]) -> Tensor:
    """(B, H, L): the natural log-sum-exp of each row's masked scores, the sink's logit with them."""
    if sinks is not None:
        sink = sinks.double()[None, :, None, None].expand(*s.shape[:-1], 1)  # (B, H, L, 1)
        s = torch.cat([s, sink], dim=-1)
    return torch.logsumexp(s, dim=-1)


def model_forward(p: BackwardProbe) -> tuple[Tensor, Tensor, Tensor]:
    """The right forward in float64: ``(out (B, H, L, Ev), P (B, H, L, S), lse (B, H, L))``."""
    s, _, v = _scores(p, p.scale, "interleave")
    if p.keep is not None:
        s = s.masked_fill(~p.keep, float("-inf"))
    lse = _lse(s, p.sinks)
    P = torch.exp(s - lse[..., None])
    return P @ v, P, lse


def _backward_keep(m: BackwardModel, p: BackwardProbe) -> Optional[Tensor]:
    """(L, S) bool or None: where the backward's P is kept, with ``m``'s mask choices."""
    L, S = p.query.shape[2], p.key.shape[2]
    keep = p.mask if m.p_bool == "yes" else None
    causal = bool(p.kwargs.get("is_causal"))
    tri = {"top_left": 0 if causal else None, "none": None, "bottom_right": S - L if causal else None,
           "always": 0}[m.p_causal]
    if tri is not None:
        t = torch.ones(L, S, dtype=torch.bool).tril(tri)
        keep = t if keep is None else keep & t
    return keep


def model_gradients(m: BackwardModel, p: BackwardProbe) -> dict[str, Tensor]:
    """The gradients ``m`` gives on ``p`` with ``p.grad_out`` as dO, in float64: ``query``,
    ``key``, ``value`` and, where the probe has sinks, ``sinks``."""
    out, _, lse = model_forward(p)
    do = p.grad_out.double()  # (B, H, L, Ev)
    H, Hkv = p.query.shape[1], p.key.shape[1]
    mapping = "tile" if m.gqa == "tile" else "interleave"
    fold = "tile" if m.gqa in ("tile", "fold_tile") else m.gqa
    scale = p.scale if m.scale_arg == "honoured" else 1 / math.sqrt(p.query.shape[-1])
    s, k, v = _scores(p, scale if m.p_scale == "yes" else 1.0, mapping)
    keep = _backward_keep(m, p)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if m.lse == "max":  # the running max alone, which starts at the sink's logit where there is one
        used = s.amax(-1) if p.sinks is None else torch.maximum(s.amax(-1), p.sinks.double()[None, :, None])
    else:
        used = {"natural": lse, "log2": lse / math.log(2.0)}[m.lse] if m.lse in ("natural", "log2") \
            else _lse(s, None)  # keys, keys_p: the log-sum-exp over the keys alone
    P = torch.exp(s - used[..., None])  # (B, H, L, S)
    dv = _mm(P.transpose(-2, -1), do, m.precision) * (scale if m.dv_scale == "once" else 1.0)
    dP = _mm(do, v.transpose(-2, -1), m.precision)
    D = {"do_o": (do * out).sum(-1), "none": torch.zeros_like(lse), "do": do.sum(-1)}[m.d_term]  # (B, H, L)
    dS = dP - D[..., None]
    if m.ds_p == "yes":
        dS = P * dS
    elif keep is not None and m.ds_p == "no":
        dS = dS.masked_fill(~keep, 0.0)
    times = {"once": scale, "none": 1.0, "twice": scale * scale}
    dq = _mm(dS, k, m.precision) * times[m.dq_scale]
    dk = _mm(dS.transpose(-2, -1), p.query.double(), m.precision) * times[m.dk_scale]
    grads = {"query": dq, "key": _group(dk, Hkv, fold), "value": _group(dv, Hkv, fold)}
    if p.sinks is not None:  # from the backward's own D and lse, as a kernel computes it
        if m.d_term == "none":  # dS lacks D, the sink's gradient still needs it (a zero one is a second bug)
            D = (do * out).sum(-1)
        p_sink = torch.exp(p.sinks.double()[None, :, None] - (lse if m.lse == "keys_p" else used))  # (B, H, L)
        per_row = {"right": -p_sink * D, "zero": torch.zeros_like(lse), "sign": p_sink * D,
                   "no_p": -D, "mean": -p_sink * D / lse.shape[-1]}[m.sink]
        grads["sinks"] = per_row.sum(dim=(0, 2))  # (H,)
    return grads
