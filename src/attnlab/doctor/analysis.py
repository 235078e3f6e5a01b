"""The doctor's judgement: fit the bug model that explains a function's recorded outputs
(package-internal; pure tensor maths, no learner code runs here).

The core choices (scale, softmax axis, transpose, value source) are fitted first on plain
inputs; masks, causal alignment, fully masked rows, large scores and dropout are then judged
on top of that core, so two bugs in one function are both named. A scale that no enumerated
choice explains is fitted as a number (``E ** power``, SDPA's scale times ``E ** power``, or a
constant) and named with it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import Tensor

from attnlab import mistakes
from attnlab.bugmodels.sdpa_forward import FIELD_FINDINGS, BugModel, model_attention
from attnlab.doctor.probes import FEATURE_PROBE, FEATURES, Probe, ProbeResult
from attnlab.testing import max_abs_diff

# The doctor's codes, from the one vocabulary of named mistakes (attnlab.mistakes).
CODES: dict[str, str] = {code: mistakes.CODES[code]
                         for code in mistakes.DOCTOR_CODES + mistakes.BACKWARD_CODES + mistakes.CP_CODES}

__all__ = ["Finding", "DoctorReport", "analyze"]

# The most likely root causes first: the core choices affect every output.
_PRIORITY = ["wrong_transpose", "value_swapped", "gqa_group_mapping", "softmax_dim", "missing_scale", "wrong_scale",
             "unstable_softmax", "mask_polarity", "mask_after_softmax", "mask_fill_zero", "mask_fill_finite",
             "mask_ignored", "causal_future", "causal_alignment", "off_by_one", "fully_masked_nan", "dropout_scale",
             "shape_error", "unknown"]

@dataclass
class Finding:
    code: str
    message: str

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "hint": CODES[self.code]}


@dataclass
class DoctorReport:
    ok: bool
    max_abs_error: float
    findings: list[Finding]
    probes_run: int
    not_probed: list[str] = field(default_factory=list)  # features left out, in words (FEATURES)

    def to_dict(self) -> dict:
        """JSON-ready; ``max_abs_error`` is None when some probe raised or gave NaN (no finite number)."""
        err = self.max_abs_error if math.isfinite(self.max_abs_error) else None
        return {"ok": self.ok, "max_abs_error": err,
                "findings": [f.to_dict() for f in self.findings], "probes_run": self.probes_run,
                "not_probed": list(self.not_probed)}

    def __str__(self) -> str:
        unprobed = f"\nNot probed: {'; '.join(self.not_probed)}." if self.not_probed else ""
        if self.ok:
            return (f"OK: matches SDPA on all {self.probes_run} probes "
                    f"(max |error| {self.max_abs_error:.2e}).{unprobed}")
        lines = [f"{len(self.findings)} problem(s) found (max |error| {self.max_abs_error:.3g}), "
                 f"most likely first:"]
        for i, f in enumerate(self.findings, 1):
            lines.append(f"  {i}. [{f.code}] {f.message}")
            lines.append(f"     hint: {CODES[f.code]}")
        return "\n".join(lines) + unprobed


_CORE_CHOICES = {
    "scale": ["sdpa", "one", "inv_E", "inv_sqrt_Ev", "inv_sqrt_S", "inv_sqrt_L", "ignore_arg"],
    "softmax_dim": [-1, -2],
    "scores": ["q_kT", "q_k", "k_qT"],
    "values": ["v", "q", "k"],
}
_ASPECT_FIELD = {
    "large": ("softmax", ["naive"]),
    "mask": ("mask", ["inverted", "after_softmax", "after_softmax_inf", "zero_fill", "ignored"]),
    "float_mask": ("mask", ["ignored"]),
    "causal": ("causal", ["bottom_right", "no_diag", "plus_one", "upper", "ignored"]),
    "empty": ("empty_rows", ["nan", "uniform"]),
    "gqa": ("gqa", ["tile"]),
}


def _expected(m: BugModel, p: Probe) -> Optional[Tensor]:
    kw = p.kwargs
    return model_attention(m, p.query, p.key, p.value, kw.get("attn_mask"), kw.get("is_causal", False),
                           kw.get("scale"), kw.get("enable_gqa", False))


def _matches(m: BugModel, p: Probe, r: ProbeResult) -> bool:
    if r.output is None:
        return False
    exp = _expected(m, p)
    if exp is None or exp.shape != r.output.shape:
        return False
    finite = exp[torch.isfinite(exp)]
    magnitude = finite.abs().max().item() if finite.numel() else 1.0
    return max_abs_diff(r.output, exp) <= p.tolerance * max(1.0, magnitude)


def _distance_from_sdpa(m: BugModel) -> int:
    return sum(getattr(m, f) != getattr(BugModel(), f) for f in _CORE_CHOICES)


def analyze(probes: list[Probe], results: list[ProbeResult]) -> DoctorReport:
    """Judge the recorded outputs: fit the core bug model, then each aspect on top of it."""
    findings: list[Finding] = []
    sdpa = BugModel()
    max_err = 0.0
    for p, r in zip(probes, results):
        exp = _expected(sdpa, p)
        if r.output is not None and exp is not None and r.output.shape == exp.shape and p.aspect != "dropout":
            max_err = max(max_err, max_abs_diff(r.output, exp))
        elif r.output is None or (exp is not None and r.output.shape != exp.shape):
            max_err = float("inf")

    names = {p.name for p in probes}
    not_probed = [FEATURES[f] for f, probe in FEATURE_PROBE.items() if probe not in names]
    core = [(p, r) for p, r in zip(probes, results) if p.aspect == "core"]
    hidden = _everything_hidden(probes, results, core)
    if hidden is not None:
        return DoctorReport(ok=False, max_abs_error=max_err, findings=[hidden], probes_run=len(probes),
                            not_probed=not_probed)

    # 1. the core: the model that explains the most core probes, closest to SDPA on ties
    best, best_hits = sdpa, -1
    for values in itertools.product(*_CORE_CHOICES.values()):
        m = BugModel(**dict(zip(_CORE_CHOICES, values)))
        hits = sum(_matches(m, p, r) for p, r in core)
        if hits > best_hits or (hits == best_hits and _distance_from_sdpa(m) < _distance_from_sdpa(best)):
            best, best_hits = m, hits
    if best_hits == 0:
        best = sdpa
    if best_hits < len(core):  # no enumerated choice explains them all: fit the scale
        fitted = _fit_scale(core, best, [(p, r) for p, r in zip(probes, results) if p.aspect == "scale_fit"])
        if fitted is not None:
            best, best_hits = fitted, len(core)
    for f in _CORE_CHOICES:
        if getattr(best, f) != getattr(sdpa, f):
            if f == "scale" and best.scale in ("power", "rel_power", "const", "rel_const"):
                findings.append(_scale_finding(best))
                continue
            code, msg = FIELD_FINDINGS[(f, getattr(best, f))]
            findings.append(Finding(code, msg))
    core_explained = True
    for p, r in core:
        if not _matches(best, p, r):
            core_explained = False
            findings.append(_unexplained(p, r, best))

    # 2. each aspect on top of the fitted core. When the core itself is unexplained,
    #    comparisons against it mean nothing: only NaN/inf and exceptions are reported.
    found: dict[str, object] = {}  # field -> the alternative an aspect's probe found
    for p, r in zip(probes, results):
        if p.aspect == "core":
            continue
        if not core_explained:
            f = _unexplained(p, r, best)
            if f.code != "unknown":
                findings.append(f)
            continue
        if p.aspect == "scale_fit":  # like a core probe, at small scores
            if not _matches(best, p, r):
                findings.append(_unexplained(p, r, best))
            continue
        if p.aspect == "dropout":
            f = _judge_dropout(best, p, r)
            if f:
                findings.append(f)
            continue
        if p.aspect == "rank":
            if r.output is None or not _matches(best, p, r):
                f = _unexplained(p, r, best)
                core_ok = best_hits == len(core) and all(_matches(best, *pr) for pr in core)
                if f.code == "shape_error" and core_ok:
                    f = Finding("shape_error", f"with {p.description}: {f.message.split(': ', 1)[-1]}")
                findings.append(f)
            continue
        if _matches(best, p, r) or (found and _matches(replace(best, **found), p, r)):
            continue  # (a mistake an earlier aspect found explains this probe too: no second name)
        field_name, alternatives = _ASPECT_FIELD[p.aspect]
        for alt in alternatives:
            m = replace(best, **{field_name: alt})
            if _matches(m, p, r) or (p.aspect == "large" and _non_finite(r)):
                code, msg = FIELD_FINDINGS[(field_name, alt)]
                findings.append(Finding(code, f"{msg} (probe: {p.description})"))
                found[field_name] = alt
                break
        else:
            d = _fit_diagonal(best, p, r) if p.aspect == "causal" else None
            if d is not None:
                L, S = p.query.shape[-2], p.key.shape[-2]
                findings.append(Finding("causal_alignment" if d == S - L else "off_by_one", _diagonal_text(d, p)))
            else:
                findings.append(_unexplained(p, r, best))

    findings = _dedupe(findings)
    # K.T on an N-D tensor: fails on 3-D/4-D but right on 2-D inputs
    rank_ok = any(p.aspect == "rank" and _matches(best, p, r) for p, r in zip(probes, results))
    core_failed = [r for _, r in core if r.output is None]
    if rank_ok and core_failed and len(core_failed) == len(core):
        findings.insert(0, Finding("wrong_transpose", "correct on 2-D inputs but fails on 4-D ones "
                                   f"({core_failed[0].error}): K.T reverses all dims, use "
                                   "K.transpose(-2, -1)"))
        findings = _dedupe(findings)
    findings.sort(key=lambda f: _PRIORITY.index(f.code))
    return DoctorReport(ok=not findings, max_abs_error=max_err, findings=findings, probes_run=len(probes),
                        not_probed=not_probed)


def _everything_hidden(probes: list[Probe], results: list[ProbeResult],
                       core: list[tuple[Probe, ProbeResult]]) -> Optional[Finding]:
    """Every output without a mask is exactly 0: every key is hidden even when no mask is given,
    which is what an inverted mask does to a default all-True one. Named when the masked probes
    match the inverted mask (the core probes alone cannot tell the rest apart)."""
    if not core or not all(r.output is not None and r.output.numel() and bool((r.output == 0).all()) for _, r in core):
        return None
    masked = [(p, r) for p, r in zip(probes, results) if p.aspect == "mask"]
    if masked and all(_matches(BugModel(mask="inverted"), p, r) for p, r in masked):
        return Finding("mask_polarity", "the mask is inverted: with no mask every output is 0, because the default "
                                        "all-True mask is inverted too (every key hidden), and a given mask hides "
                                        "exactly the keys it should show")
    return None


def _non_finite(r: ProbeResult) -> bool:
    return r.output is not None and not torch.isfinite(r.output).all().item()


# exp overflows float32 past 88.7; a naive softmax also sums S such terms: below 60 no softmax of
# these scores overflows for any S up to e^28
_OVERFLOW_SCORE = 60.0


def _may_overflow(p: Probe) -> bool:
    """Whether any score of the probe can reach exp's overflow: |q . k| <= |q| |k|, times the scale
    (an upper bound that needs no head mapping)."""
    q, k = p.query.double(), p.key.double()
    if not q.numel() or not k.numel():
        return False
    scale = p.kwargs.get("scale") or 1 / math.sqrt(q.shape[-1])
    bound = float(q.norm(dim=-1).max()) * float(k.norm(dim=-1).max()) * abs(scale)
    # the doctor's models may also drop the scale (missing_scale): the bound without it
    return max(bound, bound / abs(scale)) >= _OVERFLOW_SCORE


def _unexplained(p: Probe, r: ProbeResult, model: BugModel) -> Finding:
    exp = _expected(model, p)
    if r.output is None:
        if r.error and r.error.startswith("TypeError") and "argument" in r.error:
            return Finding("unknown", f"it does not take SDPA's arguments (query, key, value, attn_mask=None, "
                                      f"dropout_p=0.0, is_causal=False, scale=None): {r.error}")
        return Finding("shape_error", f"with {p.description}: raised {r.error}")
    if exp is not None and r.output.shape != exp.shape:
        return Finding("shape_error", f"with {p.description}: returned shape {tuple(r.output.shape)}, "
                                      f"expected {tuple(exp.shape)}")
    if _non_finite(r) and exp is not None and torch.isfinite(exp).all():
        if p.aspect == "empty":
            return Finding("fully_masked_nan", f"non-finite output with {p.description}")
        if _may_overflow(p):
            return Finding("unstable_softmax", f"non-finite output (NaN/inf) with {p.description}")
        return Finding("unknown", f"non-finite output (NaN/inf) with {p.description}, though no score there is "
                                  "large enough to overflow exp: a NaN from 0 * inf or inf - inf (a mask built by "
                                  "multiplying with -inf?)")
    err = max_abs_diff(r.output, exp) if exp is not None else float("inf")
    return Finding("unknown", f"with {p.description}: output differs from SDPA by up to {err:.3g}")


def _judge_dropout(core: BugModel, p: Probe, r: ProbeResult) -> Optional[Finding]:
    if r.output is None:
        return _unexplained(p, r, core)
    ref = model_attention(core, p.query, p.key, p.value, None, False, None)
    if ref is None or ref.shape != r.output.shape:
        return _unexplained(p, r, core)
    if not r.varied:
        return Finding("dropout_scale", f"dropout_p={p.kwargs['dropout_p']} had no effect: every call "
                                        "returned the same output")
    ratio = (r.output * ref).sum().item() / max((ref * ref).sum().item(), 1e-12)
    keep = 1 - p.kwargs["dropout_p"]
    if abs(ratio - 1) < 0.08:
        return None
    if abs(ratio - keep) < 0.08:
        return Finding("dropout_scale", f"the mean output is {ratio:.2f}x the expected one (~1-p = {keep:.2f}): "
                                        "kept weights are not scaled by 1/(1-p)")
    return Finding("dropout_scale", f"the mean output over {p.repeats} calls is {ratio:.2f}x the expected one "
                                    "(should be 1.00)")


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        key = f.code if f.code != "unknown" else (f.code, f.message)
        if key not in seen:
            seen.add(key)
            out.append(f)
    # 'unknown' and 'shape_error' are symptoms; drop them when a named cause explains the rest
    named = [f for f in out if f.code not in ("unknown", "shape_error")]
    return named if named else out


# --------------------------------------------------------------------------- #
# Continuous parameters: fitted, then named with the number found
# --------------------------------------------------------------------------- #


def _fit_one_scale(m: BugModel, p: Probe, r: ProbeResult) -> Optional[float]:
    """The scale factor that makes ``m`` reproduce one probe (searched over 1e-4..1e4 on a log
    grid, then refined by golden section), or None when no factor does."""
    if r.output is None or not torch.isfinite(r.output).all():
        return None

    def err(log_s: float) -> float:
        out = _expected(replace(m, scale="const", factor=10.0 ** log_s), p)
        if out is None or out.shape != r.output.shape:
            return float("inf")
        return max_abs_diff(r.output, out)

    grid = [i / 20 for i in range(-80, 81)]  # 0.05 decades
    errors = [err(x) for x in grid]
    i = min(range(len(grid)), key=errors.__getitem__)
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if err(a) <= err(b):
            hi = b
        else:
            lo = a
    best = (lo + hi) / 2
    fitted = replace(m, scale="const", factor=10.0 ** best)
    return 10.0 ** best if _matches(fitted, p, r) else None


def _scale_candidates(probes: list[tuple[Probe, ProbeResult]], base: BugModel) -> list[BugModel]:
    """The scale models that ``probes`` point to: ``E ** power`` when every probe's fitted factor
    gives the same power, a constant when every factor is the same."""
    fits = []
    for p, r in probes:
        factor = _fit_one_scale(base, p, r)
        if factor is None or factor <= 0:
            return []
        fits.append((p.query.shape[-1], factor))
    out = []
    powers = [math.log(f) / math.log(E) for E, f in fits if E > 1]
    if powers and max(powers) - min(powers) < 0.02:
        power = sum(powers) / len(powers)
        nearest = round(power * 2) / 2
        out.append(replace(base, scale="power", power=nearest if abs(power - nearest) < 0.02 else power))
    # the right scale (an explicit `scale` honoured) times a wrong power of E: `scale * sqrt(d_k)`
    sdpa_scales = [p.kwargs.get("scale") or 1 / math.sqrt(p.query.shape[-1]) for p, _ in probes]
    relative = [math.log(f / s0) / math.log(E) for (E, f), s0 in zip(fits, sdpa_scales) if E > 1]
    if relative and max(relative) - min(relative) < 0.02:
        rel = sum(relative) / len(relative)
        nearest = round(rel * 2) / 2
        out.append(replace(base, scale="rel_power", power=nearest if abs(rel - nearest) < 0.02 else rel))
    factors = [f for _, f in fits]
    if factors and max(factors) / min(factors) < 1.02:
        out.append(replace(base, scale="const", factor=sum(factors) / len(factors)))
    # the right scale times a constant: ln 2 (exp2 without log2(e) in the scale), log2(e), ...
    ratios = [f / s0 for (_, f), s0 in zip(fits, sdpa_scales)]
    if ratios and max(ratios) / min(ratios) < 1.02:
        out.append(replace(base, scale="rel_const", factor=sum(ratios) / len(ratios)))
    return out


def _fit_scale(core: list[tuple[Probe, ProbeResult]], base: BugModel,
               precise: list[tuple[Probe, ProbeResult]] = ()) -> Optional[BugModel]:
    """The scale as ``E ** power`` (the same power for every probe: multiplied by sqrt(E), by E,
    ...) or as a constant (``/ 8`` written for d_k = 64), when one of them explains every core
    probe; the other core choices stay those of ``base``.

    A scale many times too large saturates the softmax on the core probes (each row's weights
    become one-hot), so a range of factors fits each of them and their powers disagree; the
    ``precise`` probes (scores of magnitude ~0.01 at E = 4, 8, 16) stay far from saturation
    and pin the exponent, which must then explain the core probes too."""
    precise = list(precise)
    for fitted_on in (core, precise):
        for m in _scale_candidates(fitted_on, base) if fitted_on else []:
            if all(_matches(m, p, r) for p, r in [*core, *precise]):
                return m
    return None


def _scale_finding(m: BugModel) -> Finding:
    if m.scale == "rel_const":
        why = {math.log(2): ": ln 2, as exp2 gives without log2(e) folded into the scale",
               1 / math.log(2): ": log2(e), as exp gives with log2(e) folded into the scale"}
        named = next((text for c, text in why.items() if abs(m.factor / c - 1) < 0.01), "")
        return Finding("wrong_scale", f"your scale is {m.factor:.4g} times the right one, whatever d_k{named}")
    if m.scale == "const":
        return Finding("wrong_scale", f"the scores are multiplied by the constant {m.factor:.4g} whatever d_k; "
                                      f"1/sqrt(d_k) equals it only when d_k = {1 / m.factor ** 2:.3g}: "
                                      "compute it from the query's last dim")
    if m.scale == "rel_power":
        return Finding("wrong_scale", f"your scale (an explicit `scale` included) is multiplied by d_k^{m.power:.3g}"
                                      + (": you multiplied it by sqrt(d_k) where 1/sqrt(d_k) is already the scale"
                                         if abs(m.power - 0.5) < 1e-9 else "")
                                      + f" (e.g. {64 ** m.power:.3g}x too large for d_k = 64)")
    ratio = m.power + 0.5  # the scores are d_k ** ratio times the reference's
    if abs(ratio - 1.0) < 1e-9:
        return Finding("wrong_scale", "your scores are d_k times the reference's: you multiplied by sqrt(d_k) "
                                      "instead of dividing (e.g. 64x too large for d_k = 64)")
    if abs(ratio - 1.5) < 1e-9:
        return Finding("wrong_scale", "your scores are d_k^1.5 times the reference's: you multiplied by d_k "
                                      "where you should divide by sqrt(d_k)")
    return Finding("wrong_scale", f"the scores are scaled by d_k^{m.power:.3g} instead of d_k^-0.5 "
                                  f"(d_k^{ratio:.3g} times the reference's)")


def _fit_diagonal(core: BugModel, p: Probe, r: ProbeResult) -> Optional[int]:
    """The causal mask's diagonal offset ``d`` (keep = tril(d)) that reproduces the probe."""
    L, S = p.query.shape[-2], p.key.shape[-2]
    for d in sorted(range(-L, S + 1), key=abs):
        if d != 0 and _matches(replace(core, causal="diagonal", diagonal=d), p, r):
            return d
    return None


def _diagonal_text(d: int, p: Probe) -> str:
    L, S = p.query.shape[-2], p.key.shape[-2]
    if d == S - L and L != S:
        return f"is_causal is aligned bottom-right (tril({d})); SDPA aligns top-left (probe: {p.description})"
    see = f"i+{d}" if d > 0 else f"i{d}"
    return (f"the causal mask's diagonal is off by {d:+d}: query i sees keys up to {see} instead of i "
            f"(tril({d}) where tril() is right; probe: {p.description})")
