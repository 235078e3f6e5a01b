"""The doctor's designed inputs and how a function is called on them (package-internal).

:func:`build_probes` makes the inputs (deterministic for a seed) for the features a function
can take (its *capabilities*); :func:`run_probes` calls the function on each and records an
output or an error, never raising.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["Probe", "ProbeResult", "FailedCall", "probe_arguments", "probe_result", "FEATURES", "FEATURE_PROBE", "ALL_CAPABILITIES", "build_probes", "run_probes", "short_error", "as_tensor"]


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


# What a function may be probed with, in words (DoctorReport.not_probed names the ones left out)
FEATURES = {
    "rect": "L != S and E != Ev",
    "mask": "bool masks (attn_mask)",
    "scale": "an explicit scale",
    "float_mask": "additive float masks",
    "dropout": "dropout_p",
    "rank2": "2-D inputs",
    "causal": "is_causal",
    "gqa": "enable_gqa (grouped key/value heads)",
}
# the probe that shows each feature was probed
FEATURE_PROBE = {"rect": "basic", "mask": "bool_mask", "scale": "explicit_scale", "float_mask": "float_mask", "dropout": "dropout",
                 "rank2": "rank2", "causal": "causal_square", "gqa": "gqa"}
# probed by default; "gqa" only where the function takes enable_gqa (attnlab.doctor.capabilities_of)
ALL_CAPABILITIES = frozenset(FEATURES) - {"gqa"}


def build_probes(capabilities: frozenset[str] = ALL_CAPABILITIES, seed: int = 0) -> list[Probe]:
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
    if "gqa" in capabilities:  # 4 query heads on 2 key/value heads: tiled and interleaved heads differ
        probes.append(Probe("gqa", "enable_gqa=True, H=4 query heads, Hkv=2, L=S=E=Ev=8", rnd(B, 4, T, T),
                            rnd(B, 2, T, T), rnd(B, 2, T, T), {"enable_gqa": True}, aspect="gqa"))
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
    masked = Probe("bool_mask", "L=S=8, random bool mask (True = attend), no fully masked row",
                   rnd(B, H, T, T), rnd(B, H, T, T), rnd(B, H, T, T), {"attn_mask": keep}, aspect="mask")
    if "mask" in capabilities:
        probes.append(masked)
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
    empty_rows = Probe("fully_masked_rows", "L=S=8, bool mask with rows 2 and 6 fully masked",
                       rnd(B, H, T, T), rnd(B, H, T, T), rnd(B, H, T, T) + 2, {"attn_mask": empty}, aspect="empty")
    if "mask" in capabilities:
        probes.append(empty_rows)
    if "dropout" in capabilities:
        probes.append(Probe("dropout", "dropout_p=0.4, L=S=8, the mean of 200 calls",
                            rnd(1, 1, T, T), rnd(1, 1, T, T), rnd(1, 1, T, T) + 3, {"dropout_p": 0.4},
                            aspect="dropout", repeats=200))
    return probes


@dataclass(frozen=True)
class FailedCall:
    """A call that raised, as the sandbox reports it: ``"ExceptionType: message"``."""

    error: str


def probe_arguments(probe: Probe, positional: tuple[str, ...] = ()) -> tuple[tuple, dict]:
    """``(args, kwargs)`` that make ``probe``'s call of a function whose signature takes the
    keyword arguments ``positional`` by position after query, key and value (a lab's
    ``masked_attention(Q, K, V, mask)``: ``("attn_mask",)``); the grader sends these to the
    sandbox as a plain call and :func:`probe_result` reads the answer."""
    kwargs = dict(probe.kwargs)
    args = [probe.query, probe.key, probe.value]
    for name in positional:
        if name not in kwargs:
            break
        args.append(kwargs.pop(name))
    return tuple(args), kwargs


def probe_result(answer: Any) -> ProbeResult:
    """One call's answer (a value, an exception or a :class:`FailedCall`) as a probe's result."""
    if isinstance(answer, FailedCall):
        first = answer.error.strip().splitlines()[0] if answer.error.strip() else "the call failed"
        return ProbeResult(error=first[:400])
    if isinstance(answer, BaseException):
        return ProbeResult(error=short_error(answer))
    try:
        return ProbeResult(output=as_tensor(answer))
    except Exception as exc:  # the learner's value: any type
        return ProbeResult(error=short_error(exc))


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def run_probes(fn: Callable, probes: list[Probe]) -> list[ProbeResult]:
    """Call ``fn`` on every probe. Exceptions are recorded, never raised."""
    results = []
    for p in probes:
        try:
            with torch.no_grad():
                if p.repeats == 1:
                    out = p.call(fn)
                    results.append(ProbeResult(output=as_tensor(out)))
                else:
                    first = as_tensor(p.call(fn)).double()
                    total, varied = first.clone(), False
                    for _ in range(p.repeats - 1):
                        o = as_tensor(p.call(fn)).double()
                        varied = varied or not torch.equal(o, first)
                        total += o
                    results.append(ProbeResult(output=total / p.repeats, varied=varied))
        except Exception as exc:  # the function under test may raise anything
            results.append(ProbeResult(error=short_error(exc)))
    return results


def as_tensor(out: Any) -> Tensor:
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        out = out[0]  # (output, weights) from a module-style function
    if not isinstance(out, Tensor):
        raise TypeError(f"expected a Tensor output, got {type(out).__name__}")
    return out.detach()
