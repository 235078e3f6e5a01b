"""The doctor for backward passes: name what is wrong with an attention kernel's gradients.

:func:`diagnose_backward` calls ``fn`` (torch SDPA's signature, with ``enable_gqa`` and
``sinks`` where it takes them) on designed float32 inputs with a random cotangent, and compares
the gradients of query, key, value (and sinks) with a float64 golden, bounded as
:mod:`attnlab.testing` bounds them (a multiple of torch's own float32 error, plus a floor). When a
gradient is off, the bug models of :mod:`attnlab.bugmodels.sdpa_backward` (the right backward with
one or two choices changed) are tried: the one that reproduces every gradient on every probe
names the mistake. A forward that is already wrong is named by the forward doctor first.

:func:`audit_gradient_test` looks at a gradient *test* instead: whether the loss it reduces the
output with and its tolerance could catch a wrong backward at all (``loss = out.mean()`` over a
large output makes every gradient smaller than ``atol``).
"""

from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import replace
from typing import Callable, Optional

import torch
from torch import Tensor

from attnlab.doctor.analysis import DoctorReport, Finding
from attnlab.bugmodels.sdpa_backward import (CHOICES, MODEL_FINDINGS, BackwardModel, BackwardProbe, model_forward,
                                            model_gradients)
from attnlab.doctor.probes import short_error

__all__ = ["BACKWARD_FEATURES", "backward_capabilities", "build_backward_probes", "diagnose_backward",
           "audit_gradient_test"]

BACKWARD_FEATURES = {"causal": "is_causal", "mask": "bool masks (attn_mask)", "scale": "an explicit scale",
                     "gqa": "enable_gqa (grouped key/value heads)", "sinks": "sinks (a logit per query head)"}
_PRIORITY = ["grad_missing", "gqa_group_mapping", "gqa_grad_sum", "lse_saved", "backward_scale", "softmax_backward",
             "backward_d_term", "backward_mask", "sink_grad", "low_precision", "shape_error", "unknown"]
_EPS32 = torch.finfo(torch.float32).eps
_REFUSALS = ("ValueError", "TypeError", "NotImplementedError")
_GRAD_FACTOR = 3.0  # attnlab.testing.assert_close_to_sdpa's grad_factor
_OUT_FACTOR = 2.0  # and its factor for the output


def backward_capabilities(fn: Callable) -> frozenset[str]:
    """The features ``fn`` is probed with: causal, masks and an explicit scale (SDPA's own
    arguments) always; ``gqa`` where it takes ``enable_gqa`` (or ``**kwargs``), ``sinks`` where
    it names a ``sinks`` argument."""
    caps = {"causal", "mask", "scale"}
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset(caps)
    names = {p.name for p in params}
    if "enable_gqa" in names or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        caps.add("gqa")
    if "sinks" in names:
        caps.add("sinks")
    return frozenset(caps)


def _probe(name: str, description: str, g: torch.Generator, B: int, H: int, Hkv: int, L: int, S: int, E: int,
           Ev: int, *, scale: Optional[float] = None, causal: bool = False, mask: bool = False,
           sinks: bool = False) -> BackwardProbe:
    q = torch.randn(B, H, L, E, generator=g)
    k = torch.randn(B, Hkv, S, E, generator=g)
    v = torch.randn(B, Hkv, S, Ev, generator=g)
    grad_out = torch.randn(B, H, L, Ev, generator=g)
    kwargs: dict = {}
    keep = None
    if scale is not None:
        kwargs["scale"] = scale
    if causal:
        kwargs["is_causal"] = True
        keep = torch.ones(L, S, dtype=torch.bool).tril()
    if mask:
        keep = torch.rand(L, S, generator=g) < 0.6
        keep[torch.arange(L), torch.randint(0, S, (L,), generator=g)] = True  # no row without a key
        kwargs["attn_mask"] = keep.clone()
    if Hkv != H:
        kwargs["enable_gqa"] = True
    sink = None
    if sinks:
        sink = torch.tensor([0.8, -0.5, 1.5, 0.1][:H])
        kwargs["sinks"] = sink
    return BackwardProbe(name, description, q, k, v, grad_out, kwargs, keep,
                         scale if scale is not None else 1 / math.sqrt(E), sink, kwargs.get("attn_mask"))


def build_backward_probes(capabilities: frozenset[str], seed: int = 0) -> list[BackwardProbe]:
    """Small float32 calls, each with its cotangent: L != S and E != Ev throughout, so that a
    transposed or swapped product shows; one probe per feature in ``capabilities``."""
    g = torch.Generator().manual_seed(seed)
    probes = [_probe("basic", "L=5, S=7, E=4, Ev=3", g, 1, 2, 2, 5, 7, 4, 3)]
    if "scale" in capabilities:
        probes.append(_probe("explicit_scale", "scale=0.37", g, 1, 2, 2, 5, 7, 4, 3, scale=0.37))
    if "causal" in capabilities:
        probes.append(_probe("causal", "is_causal, L = S = 6", g, 1, 2, 2, 6, 6, 4, 3, causal=True))
        probes.append(_probe("causal_rect", "is_causal, L=4 < S=7", g, 1, 2, 2, 4, 7, 4, 3, causal=True))
    if "mask" in capabilities:
        probes.append(_probe("bool_mask", "a bool attn_mask (L, S)", g, 1, 2, 2, 5, 7, 4, 3, mask=True))
    if "gqa" in capabilities:
        probes.append(_probe("gqa", "H=4 query heads on Hkv=2", g, 1, 4, 2, 5, 6, 4, 3))
    if "sinks" in capabilities:
        probes.append(_probe("sinks", "sinks (H,) = (0.8, -0.5)", g, 1, 2, 2, 5, 7, 4, 3, sinks=True))
        if "gqa" in capabilities:
            probes.append(_probe("sinks_gqa", "sinks, H=4 on Hkv=2, causal", g, 1, 4, 2, 6, 6, 4, 3, causal=True,
                                 sinks=True))
    return probes


def _wanted(p: BackwardProbe) -> list[str]:
    return ["query", "key", "value"] + (["sinks"] if p.sinks is not None else [])


def _run(fn: Callable, p: BackwardProbe, dtype: torch.dtype = torch.float32):
    """``(out, grads, error)``: ``fn``'s output and the gradients (None where none flowed) for
    the probe's cotangent, or the error it raised as ``"Type: message"``."""
    leaves = {"query": p.query, "key": p.key, "value": p.value}
    if p.sinks is not None:
        leaves["sinks"] = p.sinks
    leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in leaves.items()}
    kwargs = {n: leaves[n] if n == "sinks" else (t.clone() if isinstance(t, Tensor) else t)
              for n, t in p.kwargs.items()}
    try:
        out = fn(leaves["query"], leaves["key"], leaves["value"], **kwargs)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, Tensor) or out.shape != p.grad_out.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            return None, {}, f"the output is {got}, expected {tuple(p.grad_out.shape)}"
        if not out.requires_grad:
            return out.detach(), {n: None for n in leaves}, None
        got = torch.autograd.grad(out, list(leaves.values()), p.grad_out.to(out.dtype), allow_unused=True)
    except Exception as exc:  # the kernel under test may raise anything
        return None, {}, short_error(exc)
    for n, gr in zip(leaves, got):
        if gr is not None and gr.shape != leaves[n].shape:
            return None, {}, f"the gradient of {n} is {tuple(gr.shape)}, expected {tuple(leaves[n].shape)}"
    return out.detach(), {n: (None if gr is None else gr.detach()) for n, gr in zip(leaves, got)}, None


def _torch_errors(p: BackwardProbe, golden_out: Tensor, golden: dict[str, Tensor]) -> dict[str, float]:
    """torch's own float32 errors on the probe (its MATH SDPA; for sinks, the same sums in float32)."""
    from attnlab.testing import max_abs_diff, sdpa_oracle

    def with_sinks(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, sinks=None):
        r = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(r, 1), value.repeat_interleave(r, 1)
        s = (scale if scale is not None else 1 / math.sqrt(query.shape[-1])) * query @ key.transpose(-2, -1)
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril() if is_causal else attn_mask
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:-1], 1)], -1), -1)
        return torch.exp(s - lse[..., None]) @ value

    out, grads, _ = _run(with_sinks if p.sinks is not None else sdpa_oracle, p)
    errs = {n: max_abs_diff(grads[n], golden[n]) for n in golden}
    errs["output"] = max_abs_diff(out, golden_out)
    return errs


def _bound(err: float, factor: float, golden: Tensor) -> float:
    return factor * err + 32 * _EPS32 * max(1.0, golden.abs().max().item() if golden.numel() else 1.0)


class _Case:
    """One probe's run: the function's gradients, the golden ones and the bounds."""

    def __init__(self, fn: Callable, p: BackwardProbe):
        self.probe = p
        self.out, self.grads, self.error = _run(fn, p)
        self.golden_out = model_forward(p)[0]
        self.golden = model_gradients(BackwardModel(), p)
        torch_err = _torch_errors(p, self.golden_out, self.golden)
        self.out_bound = _bound(torch_err["output"], _OUT_FACTOR, self.golden_out)
        self.bounds = {n: _bound(torch_err[n], _GRAD_FACTOR, self.golden[n]) for n in self.golden}

    def present(self) -> list[str]:
        return [n for n in self.golden if self.grads.get(n) is not None and not self._lost(n)]

    def _lost(self, n: str) -> bool:  # all zeros where the golden is not: nothing flowed
        return not self.grads[n].any() and self.golden[n].abs().max().item() > self.bounds[n]

    def err(self, n: str, against: Optional[Tensor] = None) -> float:
        ref = self.golden[n] if against is None else against
        return _max_diff(self.grads[n], ref)

    def out_err(self) -> float:
        return _max_diff(self.out, self.golden_out)


def _max_diff(ours: Tensor, ref: Tensor) -> float:
    """max |ours - ref|; inf where ``ours`` has a NaN or an infinity ``ref`` does not (so it never passes)."""
    d = (ours.double() - ref).abs()
    d = torch.where(torch.isnan(d) | torch.isinf(d), torch.where(ours.double() == ref, 0.0, math.inf), d)
    return d.max().item() if d.numel() else 0.0


def _explains(m: BackwardModel, cases: list[_Case]) -> bool:
    for c in cases:
        model = model_gradients(m, c.probe)
        for n in c.present():
            scale = max(1.0, model[n].abs().max().item())
            if c.err(n, model[n]) > 4 * c.bounds[n] + 1e-5 * scale:
                return False
    return True


def _relevant(field: str, caps: frozenset[str]) -> bool:
    return {"gqa": "gqa" in caps, "sink": "sinks" in caps, "p_bool": "mask" in caps,
            "scale_arg": "scale" in caps}.get(field, True)


def _fit(cases: list[_Case], caps: frozenset[str]) -> list[BackwardModel]:
    singles = [(f, v) for f, values in CHOICES.items() if _relevant(f, caps) for v in values
               if not (f == "lse" and v in ("keys", "keys_p") and "sinks" not in caps)]
    found = [replace(BackwardModel(), **{f: v}) for f, v in singles if _explains(replace(BackwardModel(), **{f: v}),
                                                                                  cases)]
    if found:
        return found
    for (f1, v1), (f2, v2) in itertools.combinations(singles, 2):
        if f1 != f2:
            m = replace(BackwardModel(), **{f1: v1, f2: v2})
            if _explains(m, cases):
                return [m]
    return []


def _precision(cases: list[_Case]) -> Optional[Finding]:
    """``low_precision`` when every gradient is near (under 5% of its size) and the errors are the
    size a TF32 or bfloat16 model's are (within 10x), else None."""
    ours, models = 0.0, {"tf32": 0.0, "bf16": 0.0}
    for c in cases:
        for n in c.present():
            size = max(1e-12, c.golden[n].abs().max().item())
            ours = max(ours, c.err(n) / size)
        for prec in models:
            g = model_gradients(BackwardModel(precision=prec), c.probe)
            models[prec] = max(models[prec], max((g[n] - c.golden[n]).abs().max().item()
                                                 / max(1e-12, c.golden[n].abs().max().item()) for n in g))
    if not 0 < ours < 0.05:
        return None
    best = min(models, key=lambda k: abs(math.log(ours / models[k])))
    if abs(math.log(ours / models[best])) > math.log(10):
        return None
    code, text = MODEL_FINDINGS[("precision", best)]
    return Finding(code, f"{text}: the worst gradient is off by {ours:.1e} of its size, a {best} model's by "
                         f"{models[best]:.1e} (a float32 product's: ~1e-7)")


def _forward_findings(fn: Callable, cases: list[_Case]) -> list[Finding]:
    """The forward is wrong: the forward doctor's findings (or a precision finding)."""
    from attnlab.doctor import diagnose

    worst = max(cases, key=lambda c: c.out_err() / c.out_bound)
    size = max(1e-12, worst.golden_out.abs().max().item())
    lead = (f"the forward is already wrong (probe {worst.probe.name}: off by {worst.out_err():.2e}, bound "
            f"{worst.out_bound:.2e}); fix it first, the gradients follow it")
    if worst.out_err() / size < 0.05:
        return [Finding("low_precision", f"{lead}: its errors ({worst.out_err() / size:.1e} of the output's size) "
                                         f"are those of reduced-precision products")]
    report = diagnose(fn)
    found = [Finding(f.code, f"{lead}: {f.message}") for f in report.findings]
    return found or [Finding("unknown", f"{lead}; the forward doctor finds nothing on SDPA's own probes, so it is "
                                        f"a feature only these probes use ({worst.probe.description})")]


def _sorted(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in sorted(findings, key=lambda f: _PRIORITY.index(f.code) if f.code in _PRIORITY else len(_PRIORITY)):
        if (f.code, f.message) not in seen:
            seen.add((f.code, f.message))
            out.append(f)
    return out


def diagnose_backward(fn: Callable, *, capabilities: Optional[frozenset[str]] = None, seed: int = 0) -> DoctorReport:
    """Run ``fn`` forward and backward on designed probes and name what is wrong with its gradients.

    Args:
        fn: ``fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False, sinks=None)``, with query ``(B, H, L, E)``, key ``(B, Hkv, S, E)``,
            value ``(B, Hkv, S, Ev)``, sinks ``(H,)``, returning ``(B, H, L, Ev)``; called only
            with the keywords a probe needs. Differentiable (autograd, or a custom Function).
        capabilities: the features to probe (:data:`BACKWARD_FEATURES`; default
            :func:`backward_capabilities`).
        seed: the probes' seed.

    Returns:
        A :class:`~attnlab.doctor.DoctorReport`: ``ok`` when the output and every gradient are
        within the bounds on every probe; else ``findings``, most likely first, in the codes of
        :mod:`attnlab.mistakes`. ``max_abs_error`` is the largest gradient error.
    """
    caps = frozenset(capabilities if capabilities is not None else backward_capabilities(fn))
    cases = [_Case(fn, p) for p in build_backward_probes(caps, seed)]
    not_probed = [text for f, text in BACKWARD_FEATURES.items() if f not in caps]
    # a feature the function refuses by name (ValueError, TypeError, NotImplementedError) is not probed;
    # a failure on the plain probe, or any other error, is a finding
    refused = [c for c in cases if c.error and c.probe.name != "basic" and c.error.split(":")[0] in _REFUSALS]
    not_probed += [f"{c.probe.description} (refused: {c.error})" for c in refused]
    findings = [Finding("shape_error", f"probe {c.probe.name} ({c.probe.description}): {c.error}")
                for c in cases if c.error and c not in refused]
    cases = [c for c in cases if not c.error]
    if not cases:
        return DoctorReport(False, math.inf, _sorted(findings), 0, not_probed)
    if any(c.out_err() > c.out_bound for c in cases):
        return DoctorReport(False, max(c.out_err() for c in cases), _sorted(findings + _forward_findings(fn, cases)),
                            len(cases), not_probed)
    lost: dict[str, list[str]] = {}
    for c in cases:
        for n in c.golden:
            if n not in c.present():
                lost.setdefault(n, []).append(f"{c.probe.name}: {'None' if c.grads.get(n) is None else 'zeros'}")
    for n, where in lost.items():
        findings.append(Finding("sink_grad" if n == "sinks" else "grad_missing",
                                f"no gradient reaches {n} (on {len(where)} of {len(cases)} probes; {where[0]})"))
    worst = max(((c.err(n) / c.bounds[n], c, n) for c in cases for n in c.present()), default=(0.0, None, None),
                key=lambda t: t[0])
    max_err = max((c.err(n) for c in cases for n in c.present()), default=0.0)
    if worst[0] > 1.0:
        models = _fit(cases, caps)
        for m in models:
            for (f, v), (code, text) in MODEL_FINDINGS.items():
                if getattr(m, f) == v:
                    findings.append(Finding(code, text))
        if not models:
            prec = _precision(cases)
            _, c, n = worst
            findings.append(prec or Finding("unknown", f"d{n} differs on probe {c.probe.name} "
                                                       f"({c.probe.description}) by {c.err(n):.3g} (bound "
                                                       f"{c.bounds[n]:.2g}) in a way no backward bug model explains"))
    return DoctorReport(not findings, max_err, _sorted(findings), len(cases), not_probed)


def audit_gradient_test(loss: Callable[[Tensor], Tensor], shape: tuple[int, int, int, int], *, atol: float,
                        rtol: float = 0.0, seed: int = 0) -> list[Finding]:
    """Whether a gradient test could fail: its ``loss`` (how it reduces the output to a scalar)
    at its ``shape`` ``(B, H, L, E)`` and its tolerance ``|ours - ref| <= atol + rtol * |ref|``,
    against three wrong backwards (dS without the scale, without the D term, without P).

    Returns:
        ``[]`` when the test catches each of them; else one ``grad_test_blind`` finding naming what
        it would pass, the largest gradient, and the fix (a random cotangent, ``(out * g).sum()``).
    """
    B, H, L, E = shape
    g = torch.Generator().manual_seed(seed)
    p = BackwardProbe("test", "the test's shape", torch.randn(B, H, L, E, generator=g),
                      torch.randn(B, H, L, E, generator=g), torch.randn(B, H, L, E, generator=g),
                      torch.zeros(B, H, L, E), {}, None, 1 / math.sqrt(E))
    out = model_forward(p)[0].requires_grad_()
    (p.grad_out,) = torch.autograd.grad(loss(out), out)  # the cotangent the test's loss gives
    right = model_gradients(BackwardModel(), p)
    planted = {"dS without the scale": BackwardModel(dq_scale="none", dk_scale="none"),
               "dS without the D term": BackwardModel(d_term="none"), "dS without P": BackwardModel(ds_p="no")}
    missed = []
    for name, m in planted.items():
        wrong = model_gradients(m, p)
        if not any(((wrong[n] - right[n]).abs() > atol + rtol * right[n].abs()).any() for n in right):
            missed.append(name)
    if not missed:
        return []
    largest = max(right[n].abs().max().item() for n in right)
    return [Finding("grad_test_blind", f"this test passes a backward with {', '.join(missed)}: at {tuple(shape)} "
                                       f"its loss gives gradients of at most {largest:.2e}, against atol {atol:g}"
                                       f"{f' and rtol {rtol:g}' if rtol else ''}")]
