"""The attention doctor: probe an attention function and name what is wrong with it.

``diagnose(fn)`` calls ``fn`` (torch SDPA's signature) on designed inputs, then
explains each wrong answer with a *bug model*: attention computed with one choice
changed (no 1/sqrt(E), softmax over the query axis, ``Q @ K`` without the
transpose, the mask inverted, ...). A bug model that reproduces the function's
output names the mistake. The core choices (scale, softmax axis, transpose, value
source) are fitted first on plain inputs; masks, causal alignment, fully masked
rows, large scores and dropout are then judged on top of that core, so two bugs
in one function are both named.

The run is split in two so that a grader can run learner code in a sandbox and
judge in its own process::

    probes = build_probes(capabilities)          # designed inputs (deterministic)
    results = run_probes(fn, probes)             # calls fn (learner code)
    report = analyze(probes, results)            # pure tensor maths, no learner code

Finding codes (``CODES`` holds a hint for each; the vocabulary, shared with the grader's
checks, is :mod:`attnlab.mistakes`):
``missing_scale``, ``wrong_scale``, ``unstable_softmax``, ``softmax_dim``,
``wrong_transpose``, ``value_swapped``, ``mask_polarity``, ``mask_after_softmax``,
``causal_alignment``, ``fully_masked_nan``, ``dropout_scale``, ``shape_error``,
``unknown``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from attnlab import masks, mistakes
from attnlab.softmax import stable_softmax
from attnlab.testing import max_abs_diff

__all__ = [
    "CODES",
    "load_function",
    "Finding",
    "DoctorReport",
    "Probe",
    "ProbeResult",
    "build_probes",
    "run_probes",
    "analyze",
    "diagnose",
    "adapt_self_attention",
    "self_attention_calls",
    "self_attention_result",
    "FailedCall",
    "SELF_ATTENTION_CAPABILITIES",
]

# The doctor's codes, from the one vocabulary of named mistakes (attnlab.mistakes).
CODES: dict[str, str] = {code: mistakes.CODES[code] for code in mistakes.DOCTOR_CODES}

# The most likely root causes first: the core choices affect every output.
_PRIORITY = ["wrong_transpose", "value_swapped", "softmax_dim", "missing_scale", "wrong_scale",
             "unstable_softmax", "mask_polarity", "mask_after_softmax", "causal_alignment",
             "fully_masked_nan", "dropout_scale", "shape_error", "unknown"]


# --------------------------------------------------------------------------- #
# Bug models
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class BugModel:
    """Attention with each textbook choice made explicit; the defaults are SDPA."""

    scale: str = "sdpa"  # sdpa | one | inv_E | inv_sqrt_Ev | inv_sqrt_S | ignore_arg | power | rel_power | const
    softmax_dim: int = -1
    scores: str = "q_kT"  # q_kT | q_k (no transpose) | k_qT (scores transposed)
    values: str = "v"  # v | q | k
    mask: str = "before"  # before | inverted | after_softmax | zero_fill | ignored
    causal: str = "top_left"  # top_left | bottom_right | no_diag | plus_one | upper | ignored
    empty_rows: str = "zero"  # zero | nan | uniform
    softmax: str = "stable"  # stable | naive
    # continuous parameters, fitted from the probes when no enumerated choice explains them
    power: float = -0.5  # scale = E ** power ("power"), or SDPA's scale times E ** power ("rel_power")
    factor: float = 1.0  # scale = factor, whatever E (scale == "const")
    diagonal: int = 0  # causal == "diagonal": keep = tril(diagonal)


_SCALE_TEXT = {
    "one": "the scores are not divided by sqrt(d_k)",
    "inv_E": "the scores are divided by d_k instead of sqrt(d_k)",
    "inv_sqrt_Ev": "the scores are divided by sqrt(d_v) instead of sqrt(d_k)",
    "inv_sqrt_S": "the scores are divided by sqrt(S) (the number of keys) instead of sqrt(d_k)",
    "ignore_arg": "the `scale` argument is ignored (1/sqrt(d_k) is always used)",
}

# (field, value) -> (code, message)
_FIELD_FINDINGS: dict[tuple[str, Any], tuple[str, str]] = {
    **{("scale", s): ("missing_scale" if s == "one" else "wrong_scale", t) for s, t in _SCALE_TEXT.items()},
    ("softmax_dim", -2): ("softmax_dim", "softmax runs over the queries (dim=-2) instead of the keys (dim=-1)"),
    ("scores", "q_k"): ("wrong_transpose", "the scores are Q @ K (K not transposed)"),
    ("scores", "k_qT"): ("wrong_transpose", "the scores are transposed (K @ Q^T instead of Q @ K^T)"),
    ("values", "q"): ("value_swapped", "the weights multiply Q instead of V"),
    ("values", "k"): ("value_swapped", "the weights multiply K instead of V"),
    ("mask", "inverted"): ("mask_polarity", "the bool mask is inverted (True was treated as 'masked')"),
    ("mask", "after_softmax"): ("mask_after_softmax",
                                "the mask zeroes weights after softmax, so rows no longer sum to 1"),
    ("mask", "ignored"): ("unknown", "attn_mask has no effect on the output"),
    ("mask", "zero_fill"): ("unknown", "masked scores are set to 0 instead of -inf, so masked keys still get "
                                       "weight after softmax"),
    ("causal", "bottom_right"): ("causal_alignment",
                                 "is_causal is aligned bottom-right (tril(S - L)); SDPA aligns top-left"),
    ("causal", "no_diag"): ("causal_alignment", "the causal mask hides the diagonal (tril(-1)): "
                                                "query i must also see key i"),
    ("causal", "plus_one"): ("causal_alignment", "the causal mask is off by one (tril(1)): query i sees key i+1"),
    ("causal", "upper"): ("causal_alignment", "the causal mask is upper-triangular (triu): "
                                              "query i sees the future, not the past"),
    ("causal", "ignored"): ("causal_alignment", "is_causal=True has no effect"),
    ("empty_rows", "nan"): ("fully_masked_nan", "rows whose keys are all masked come out NaN instead of 0"),
    ("empty_rows", "uniform"): ("fully_masked_nan", "rows whose keys are all masked come out as the average "
                                                    "of V (a finite fill such as -1e9) instead of 0"),
    ("softmax", "naive"): ("unstable_softmax", "the output is NaN/inf for large scores: exp overflows "
                                               "without the row-max shift"),
}


def _model_attention(m: BugModel, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                     is_causal: bool, scale: Optional[float]) -> Optional[Tensor]:
    """The bug model's output in float64, or None where its shapes do not fit."""
    q, k, v = q.double(), k.double(), v.double()
    E, Ev, S = q.shape[-1], v.shape[-1], k.shape[-2]
    factor = {
        "sdpa": 1 / math.sqrt(E) if scale is None else scale,
        "one": 1.0,
        "inv_E": 1 / E,
        "inv_sqrt_Ev": 1 / math.sqrt(Ev),
        "inv_sqrt_S": 1 / math.sqrt(S),
        "ignore_arg": 1 / math.sqrt(E),
        "power": float(E) ** m.power,
        "rel_power": (1 / math.sqrt(E) if scale is None else scale) * float(E) ** m.power,
        "const": m.factor,
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
            keep = {"before": attn_mask, "after_softmax": attn_mask, "inverted": ~attn_mask,
                    "zero_fill": attn_mask, "ignored": None}[m.mask]
        elif attn_mask is not None:
            if m.mask != "ignored":
                s = s + attn_mask.double()

        after = keep is not None and m.mask == "after_softmax" and not is_causal
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
            w = w * keep
        if m.empty_rows == "nan":
            empty = torch.isneginf(s).all(-1, keepdim=True)
            w = torch.where(empty, torch.full_like(w, float("nan")), w)
        src = {"v": v, "q": q, "k": k}[m.values]
        return w @ src
    except RuntimeError:
        return None


# --------------------------------------------------------------------------- #
# Probes
# --------------------------------------------------------------------------- #


@dataclass
class Probe:
    """A designed call: ``fn(query, key, value, **kwargs)``; ``repeats > 1`` averages the output."""

    name: str
    description: str
    query: Tensor
    key: Tensor
    value: Tensor
    kwargs: dict = field(default_factory=dict)
    aspect: str = "core"  # core | scale_fit | rank | large | mask | float_mask | causal | empty | dropout
    repeats: int = 1
    tolerance: float = 1e-4  # relative to the expected output's magnitude

    def call(self, fn: Callable) -> Tensor:
        return fn(self.query, self.key, self.value, **self.kwargs)


@dataclass
class ProbeResult:
    """What the function did on one probe: an output (mean output for repeats) or an error."""

    output: Optional[Tensor] = None
    error: Optional[str] = None  # "ExceptionType: message"
    varied: bool = False  # repeats only: did the outputs differ between calls?


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

    def to_dict(self) -> dict:
        """JSON-ready; ``max_abs_error`` is None when some probe raised or gave NaN (no finite number)."""
        err = self.max_abs_error if math.isfinite(self.max_abs_error) else None
        return {"ok": self.ok, "max_abs_error": err,
                "findings": [f.to_dict() for f in self.findings], "probes_run": self.probes_run}

    def __str__(self) -> str:
        if self.ok:
            return (f"OK: matches SDPA on all {self.probes_run} probes "
                    f"(max |error| {self.max_abs_error:.2e}).")
        lines = [f"{len(self.findings)} problem(s) found (max |error| {self.max_abs_error:.3g}), "
                 f"most likely first:"]
        for i, f in enumerate(self.findings, 1):
            lines.append(f"  {i}. [{f.code}] {f.message}")
            lines.append(f"     hint: {CODES[f.code]}")
        return "\n".join(lines)


_ALL_CAPABILITIES = frozenset({"rect", "scale", "float_mask", "dropout", "rank2", "causal"})


def build_probes(capabilities: frozenset[str] = _ALL_CAPABILITIES, seed: int = 0) -> list[Probe]:
    """The designed inputs, deterministic for a seed.

    ``capabilities`` leaves out what an adapted function cannot take: ``rect``
    (L != S, E != Ev), ``scale`` (an explicit scale), ``float_mask``, ``dropout``,
    ``rank2`` (2-D inputs), ``causal`` (``is_causal``).
    """
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    B, H = 2, 2
    probes: list[Probe] = []
    if "rect" in capabilities:
        L, S, E, Ev = 5, 7, 8, 6
        probes.append(Probe("basic", "B=2, H=2, L=5, S=7, E=8, Ev=6, no mask",
                            rnd(B, H, L, E), rnd(B, H, S, E), rnd(B, H, S, Ev)))
    # square in every size, so Q @ K, weights @ Q and weights @ K all have valid shapes
    T = 8
    probes.append(Probe("square", "B=2, H=2, L=S=E=Ev=8, no mask", rnd(B, H, T, T), rnd(B, H, T, T),
                        rnd(B, H, T, T)))
    probes.append(Probe("square_small", "B=2, H=2, L=S=E=Ev=4, no mask", rnd(B, H, 4, 4), rnd(B, H, 4, 4),
                        rnd(B, H, 4, 4) * 3))
    for E in (4, 8, 16):  # scores of magnitude ~0.01: a scale even E x too large does not saturate the softmax
        probes.append(Probe(f"small_scores_{E}", f"B=2, H=2, L=S=E=Ev={E}, scores of magnitude ~0.01",
                            rnd(B, H, E, E) * 0.1, rnd(B, H, E, E) * 0.1, rnd(B, H, E, E) * 3, aspect="scale_fit"))
    if "scale" in capabilities:
        probes.append(Probe("explicit_scale", "L=S=E=Ev=8, scale=0.3", rnd(B, H, T, T), rnd(B, H, T, T),
                            rnd(B, H, T, T), {"scale": 0.3}))
    if "rank2" in capabilities:
        probes.append(Probe("rank2", "2-D inputs (L, E): L=5, S=5, E=8", rnd(5, 8), rnd(5, 8), rnd(5, 8),
                            aspect="rank"))
    probes.append(Probe("large_scores", "L=S=E=Ev=8 with scores of magnitude ~1e3",
                        rnd(B, H, T, T) * 12, rnd(B, H, T, T) * 12, rnd(B, H, T, T), aspect="large",
                        tolerance=1e-3))
    keep = torch.rand(B, H, T, T, generator=g) < 0.6
    keep[..., 0] = True  # no empty rows here: that is a separate probe
    keep[..., 3, 0] = False
    keep[..., 3, 5] = True
    probes.append(Probe("bool_mask", "L=S=8, random bool mask (True = attend), no fully masked row",
                        rnd(B, H, T, T), rnd(B, H, T, T), rnd(B, H, T, T), {"attn_mask": keep}, aspect="mask"))
    if "float_mask" in capabilities:
        probes.append(Probe("float_mask", "L=S=8, additive float mask", rnd(B, H, T, T), rnd(B, H, T, T),
                            rnd(B, H, T, T), {"attn_mask": rnd(T, T) * 2}, aspect="float_mask"))
    if "causal" in capabilities:
        probes.append(Probe("causal_square", "is_causal=True, L=S=8", rnd(B, H, T, T), rnd(B, H, T, T),
                            rnd(B, H, T, T), {"is_causal": True}, aspect="causal"))
        if "rect" in capabilities:
            probes.append(Probe("causal_L_lt_S", "is_causal=True, L=4 < S=7", rnd(B, H, 4, 8), rnd(B, H, 7, 8),
                                rnd(B, H, 7, 6), {"is_causal": True}, aspect="causal"))
    empty = torch.rand(B, H, T, T, generator=g) < 0.6
    empty[..., 0] = True
    empty[..., 2, :] = False  # query 2 sees no key at all
    empty[..., 6, :] = False
    probes.append(Probe("fully_masked_rows", "L=S=8, bool mask with rows 2 and 6 fully masked",
                        rnd(B, H, T, T), rnd(B, H, T, T), rnd(B, H, T, T) + 2, {"attn_mask": empty},
                        aspect="empty"))
    if "dropout" in capabilities:
        probes.append(Probe("dropout", "dropout_p=0.4, L=S=8, the mean of 200 calls",
                            rnd(1, 1, T, T), rnd(1, 1, T, T), rnd(1, 1, T, T) + 3, {"dropout_p": 0.4},
                            aspect="dropout", repeats=200))
    return probes


def _short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def run_probes(fn: Callable, probes: list[Probe]) -> list[ProbeResult]:
    """Call ``fn`` on every probe. Exceptions are recorded, never raised."""
    results = []
    for p in probes:
        try:
            with torch.no_grad():
                if p.repeats == 1:
                    out = p.call(fn)
                    results.append(ProbeResult(output=_as_tensor(out)))
                else:
                    first = _as_tensor(p.call(fn)).double()
                    total, varied = first.clone(), False
                    for _ in range(p.repeats - 1):
                        o = _as_tensor(p.call(fn)).double()
                        varied = varied or not torch.equal(o, first)
                        total += o
                    results.append(ProbeResult(output=total / p.repeats, varied=varied))
        except Exception as exc:  # the function under test may raise anything
            results.append(ProbeResult(error=_short_error(exc)))
    return results


def _as_tensor(out: Any) -> Tensor:
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        out = out[0]  # (output, weights) from a module-style function
    if not isinstance(out, Tensor):
        raise TypeError(f"expected a Tensor output, got {type(out).__name__}")
    return out.detach()


# --------------------------------------------------------------------------- #
# Analysis
# --------------------------------------------------------------------------- #

_CORE_CHOICES = {
    "scale": ["sdpa", "one", "inv_E", "inv_sqrt_Ev", "inv_sqrt_S", "ignore_arg"],
    "softmax_dim": [-1, -2],
    "scores": ["q_kT", "q_k", "k_qT"],
    "values": ["v", "q", "k"],
}
_ASPECT_FIELD = {
    "large": ("softmax", ["naive"]),
    "mask": ("mask", ["inverted", "after_softmax", "zero_fill", "ignored"]),
    "float_mask": ("mask", ["ignored"]),
    "causal": ("causal", ["bottom_right", "no_diag", "plus_one", "upper", "ignored"]),
    "empty": ("empty_rows", ["nan", "uniform"]),
}


def _expected(m: BugModel, p: Probe) -> Optional[Tensor]:
    kw = p.kwargs
    return _model_attention(m, p.query, p.key, p.value, kw.get("attn_mask"), kw.get("is_causal", False),
                            kw.get("scale"))


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

    # 1. the core: the model that explains the most core probes, closest to SDPA on ties
    core = [(p, r) for p, r in zip(probes, results) if p.aspect == "core"]
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
            if f == "scale" and best.scale in ("power", "rel_power", "const"):
                findings.append(_scale_finding(best))
                continue
            code, msg = _FIELD_FINDINGS[(f, getattr(best, f))]
            findings.append(Finding(code, msg))
    core_explained = True
    for p, r in core:
        if not _matches(best, p, r):
            core_explained = False
            findings.append(_unexplained(p, r, best))

    # 2. each aspect on top of the fitted core. When the core itself is unexplained,
    #    comparisons against it mean nothing: only NaN/inf and exceptions are reported.
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
        if _matches(best, p, r):
            continue
        field_name, alternatives = _ASPECT_FIELD[p.aspect]
        for alt in alternatives:
            m = replace(best, **{field_name: alt})
            if _matches(m, p, r) or (p.aspect == "large" and _non_finite(r)):
                code, msg = _FIELD_FINDINGS[(field_name, alt)]
                findings.append(Finding(code, f"{msg} (probe: {p.description})"))
                break
        else:
            d = _fit_diagonal(best, p, r) if p.aspect == "causal" else None
            if d is not None:
                findings.append(Finding("causal_alignment", _diagonal_text(d, p)))
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
    return DoctorReport(ok=not findings, max_abs_error=max_err, findings=findings, probes_run=len(probes))


def _non_finite(r: ProbeResult) -> bool:
    return r.output is not None and not torch.isfinite(r.output).all().item()


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
        return Finding("unstable_softmax", f"non-finite output (NaN/inf) with {p.description}")
    err = max_abs_diff(r.output, exp) if exp is not None else float("inf")
    return Finding("unknown", f"with {p.description}: output differs from SDPA by up to {err:.3g}")


def _judge_dropout(core: BugModel, p: Probe, r: ProbeResult) -> Optional[Finding]:
    if r.output is None:
        return _unexplained(p, r, core)
    ref = _model_attention(core, p.query, p.key, p.value, None, False, None)
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


def diagnose(fn: Callable, *, capabilities: Optional[frozenset[str]] = None, seed: int = 0) -> DoctorReport:
    """Probe ``fn`` (torch SDPA's signature, or an adapter's) and name what is wrong.

    Args:
        fn: ``fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
            scale=None)``; it is called only with the keyword arguments a probe needs.
            An adapter made by :func:`adapt_self_attention` carries its own capabilities.
        capabilities: which kinds of probe ``fn`` can take (default: all, or the adapter's).
        seed: the probes' seed.

    Returns:
        A :class:`DoctorReport`: ``ok``, ``max_abs_error`` and ``findings``, most likely first.
    """
    caps = capabilities or getattr(fn, "capabilities", _ALL_CAPABILITIES)
    probes = build_probes(frozenset(caps), seed)
    return analyze(probes, run_probes(fn, probes))


# what the lab's self_attention signature can take: square, default scale, bool masks, no dropout
SELF_ATTENTION_CAPABILITIES = frozenset({"causal"})


def self_attention_calls(probe: Probe) -> list[tuple]:
    """The calls of the lab's ``self_attention(X, W_Q, W_K, W_V, mask=None)`` that answer one
    SDPA-style probe (see :func:`adapt_self_attention`): one per ``(b, h)`` slice, with
    ``X = I`` (``T x T``) and the slice's Q, K, V as the weights, repeated ``probe.repeats``
    times. The grader sends these to the sandbox as plain calls, so the doctor itself never
    runs there; :func:`self_attention_result` puts the answers together."""
    query, key, value = probe.query, probe.key, probe.value
    kwargs = probe.kwargs
    lead, T = query.shape[:-2], query.shape[-2]
    q, k, v = (t.reshape(-1, T, t.shape[-1]) for t in (query, key, value))  # (B*H, T, E|Ev)
    mask = None
    if kwargs.get("is_causal"):
        mask = masks.causal(T, T)
    elif kwargs.get("attn_mask") is not None:
        mask = kwargs["attn_mask"].expand(*lead, T, T).reshape(-1, T, T)  # (B*H, T, T)
    eye = torch.eye(T, dtype=query.dtype)[None]  # (1, T, T)
    calls = []
    for i in range(q.shape[0]):
        m = None if mask is None else (mask if mask.dim() == 2 else mask[i])[None]  # (1, T, T)
        calls.append((eye, q[i], k[i], v[i], m) if m is not None else (eye, q[i], k[i], v[i]))
    return calls * probe.repeats


@dataclass(frozen=True)
class FailedCall:
    """A call that raised, as the sandbox reports it: ``"ExceptionType: message"``."""

    error: str


def self_attention_result(probe: Probe, answers: list) -> ProbeResult:
    """The probe's result from the answers to :func:`self_attention_calls`, in order: each a
    value, an ``Exception`` or a :class:`FailedCall` (the first failure is the probe's error)."""
    for a in answers:
        if isinstance(a, BaseException):
            return ProbeResult(error=_short_error(a))
        if isinstance(a, FailedCall):
            first = a.error.strip().splitlines()[0] if a.error.strip() else "the call failed"
            return ProbeResult(error=first[:400])
    try:
        runs = _joined(probe, answers)
    except Exception as exc:  # the learner's values: any shape, any type
        return ProbeResult(error=_short_error(exc))
    if probe.repeats == 1:
        return ProbeResult(output=runs[0])
    varied = any(not torch.equal(r, runs[0]) for r in runs[1:])
    return ProbeResult(output=torch.stack(runs).mean(0), varied=varied)


def _joined(probe: Probe, answers: list) -> list[Tensor]:
    """Each repeat's ``(b, h)`` slices put back as ``(..., T, Ev)`` float64; raises as torch
    does for answers of the wrong shape or type."""
    lead, T, Ev = probe.query.shape[:-2], probe.query.shape[-2], probe.value.shape[-1]
    per_call = len(answers) // probe.repeats
    return [torch.stack([_as_tensor(a)[0] for a in answers[r * per_call:(r + 1) * per_call]])
            .reshape(*lead, T, Ev).double() for r in range(probe.repeats)]  # (B, H, T, Ev) each


def adapt_self_attention(self_attention: Callable) -> Callable:
    """Make the lab's ``self_attention(X, W_Q, W_K, W_V, mask=None) -> (output, weights)``
    answer SDPA-style probes, in this process (the grader uses :func:`self_attention_calls`
    instead, so that the calls run in the sandbox).

    Each ``(b, h)`` slice is run with ``X = I`` (identity, ``T x T``) and the probe's
    Q, K, V as the weights, so ``Q = X @ W_Q`` is exactly the designed query. Only
    square, default-scale, bool-mask probes without dropout fit this signature;
    ``is_causal`` becomes a causal bool mask.
    """

    def sdpa_like(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        kwargs = {"attn_mask": attn_mask, "is_causal": is_causal}
        probe = Probe("adapted", "", query, key, value, kwargs)
        answers = [self_attention(*args) for args in self_attention_calls(probe)]  # raises as the function does
        return _joined(probe, answers)[0].to(query.dtype)  # raises for answers of the wrong shape

    sdpa_like.capabilities = SELF_ATTENTION_CAPABILITIES  # type: ignore[attr-defined]
    return sdpa_like


def load_function(target: str) -> Callable:
    """The function named by ``'pkg.mod:fn'`` or ``'path/to/file.py:fn'`` (imported, so it runs:
    only for code you trust).

    Raises:
        ValueError: the target is malformed, its module cannot be found, or it has no such function.
    """
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    module_name, sep, func_name = target.rpartition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"expected MODULE:FUNCTION (e.g. mypkg.attn:sdpa or attention.py:self_attention), "
                         f"got {target!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"cannot import {module_name}: no such file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # like `python -m`: modules beside you import
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import {module_name}: {exc}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no function {func_name!r}")
    return fn
