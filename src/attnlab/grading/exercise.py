"""The exercise framework every lab's checks are written in; no lab lives here.

An :class:`Exercise` says which learner functions to call (``prepare``: the calls and a
context, from a seeded generator) and how to judge what came back (``judge``: a
:class:`Verdict` per sub-check). :func:`tensor_verdict` compares a returned tensor with the
float64 reference under the shared tolerance (:func:`attnlab.testing.tolerance`) and, on a
mismatch, with what each listed mistake returns on the same inputs: a match names the
mistake (:func:`mistake`, in the vocabulary of :mod:`attnlab.mistakes`).
:func:`judge_outcome` turns one sandboxed child's outcome into those verdicts and never
raises. The labs themselves are :mod:`attnlab.labs`, a module each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from attnlab import mistakes
from attnlab.grading import offsets
from attnlab.grading.sandbox import Call, Outcome, Unsupported
from attnlab.testing import max_abs_diff, tolerance

__all__ = ["Verdict", "Exercise", "CallFailed", "mistake", "value", "describe", "close", "tensor_verdict",
           "explain_backward", "model_mistakes",
           "all_checks", "judge_outcome", "probe_calls", "doctor_findings"]


@dataclass
class Verdict:
    passed: bool
    message: str = ""
    findings: list[dict] = field(default_factory=list)  # {"code", "message"} from the doctor or a check
    arrays: Optional[tuple[Tensor, Tensor]] = None  # (learner's, reference) of a failed numeric check


@dataclass
class Exercise:
    id: str
    function: str
    title: str
    checks: dict[str, float]  # sub-check -> points, in report order
    prepare: Callable[[torch.Generator], tuple[list[Call], Any]]
    judge: Callable[[Any, list[dict], Outcome], dict[str, Verdict]]
    policy: bool = True  # the from-scratch policy applies
    on_error: Optional[Callable[[str, str], list[dict]]] = None  # (error, traceback) -> the mistake behind it
    limits: dict = field(default_factory=dict)  # this exercise's own Limits fields (lab 04's memory cap)
    # the learner's kernels that must have been launched for its answer to count (lab 05: the points
    # are for writing them); an answer without them scores 0 as 'kernel_not_launched'
    kernels: tuple[str, ...] = ()

    @property
    def max_score(self) -> float:
        return sum(self.checks.values())


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


class CallFailed(Exception):
    """A learner call raised; carries the message and trimmed traceback."""

    def __init__(self, result: dict) -> None:
        super().__init__(result.get("error", "failed"))
        self.result = result


def mistake(code: str, message: str, wrong: Optional[Tensor]) -> tuple[str, str, Optional[Tensor]]:
    """One entry of :func:`tensor_verdict`'s ``mistakes``: the code (from :data:`attnlab.mistakes.CODES`:
    a ``KeyError`` here for one outside the vocabulary), what to tell the learner, and what that
    mistake returns on these inputs (None: it cannot be told apart here). Shared by every lab's checks."""
    mistakes.hint(code)
    return code, message, wrong


def value(results: list[dict], i: int) -> Any:
    r = results[i]
    if "error" in r:
        raise CallFailed(r)
    return r["value"]


def describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a tensor of shape {list(x.shape)} and dtype {x.dtype}"
    if isinstance(x, Unsupported):
        return f"an object of type {x.type_name}"
    return f"{type(x).__name__} {x!r}"[:120]


def close(got: Tensor, expected: Tensor) -> bool:
    """Learner float32 vs the float64 reference, with attnlab's float32 tolerance."""
    if not isinstance(got, Tensor) or got.shape != expected.shape:
        return False
    tol = tolerance(torch.float32)
    g, e = got.double(), expected.double()
    finite = torch.isfinite(e)
    # where the reference is +-inf or NaN only the same value will do; elsewhere the tolerance
    near = (g - e).abs() <= tol.atol + tol.rtol * e.abs().where(finite, torch.zeros_like(e))
    ok = torch.where(finite, near & torch.isfinite(g), (g == e) | (g.isnan() & e.isnan()))
    return bool(ok.all())


def _resembles(got: Tensor, wrong: Tensor) -> bool:
    """``got`` is what a mistake returns: within the float32 tolerance element by element, or
    within 1e-4 of the mistake's largest value (a wrong formula can grow values to ~1e4, whose
    float32 rounding then exceeds the elementwise tolerance on its small entries; 1e-4 is the
    doctor's own bar, :class:`attnlab.doctor.Probe`)."""
    if close(got, wrong):
        return True
    w = wrong.double()
    finite = torch.isfinite(w)
    if not bool(finite.all()) or not got.is_floating_point():
        return False
    return max_abs_diff(got, w) <= 1e-4 * max(1.0, float(w.abs().max()) if w.numel() else 1.0)


def _rounded_to_half(got: Tensor, expected: Tensor) -> str:
    """"float16" or "bfloat16" when a float32 answer is made of that dtype's numbers alone, where most of
    the reference's are not, and is within that dtype's tolerance of it (issue 62: dV stored as
    .to(tl.float16) into a float32 tensor); "" otherwise."""
    if got.dtype != torch.float32 or got.shape != expected.shape or got.numel() < 16 or not bool(
            torch.isfinite(got).all()):
        return ""
    for dtype, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
        if not torch.equal(got.to(dtype).float(), got):
            continue
        e = expected.float()
        if float((e.to(dtype).float() != e).float().mean()) < 0.5:  # the reference is such numbers too
            continue
        tol = tolerance(dtype)
        if bool(((got.double() - expected.double()).abs() <= tol.atol + tol.rtol * expected.double().abs()).all()):
            return name
    return ""


def tensor_verdict(got: Any, expected: Tensor, what: str,
                   mistakes: Optional[list[tuple[str, str, Optional[Tensor]]]] = None) -> Verdict:
    """Compare one returned tensor; on a mismatch try to name the mistake.

    ``mistakes``: ``(code, message, what that mistake returns)``; checked in order.
    """
    if not isinstance(got, Tensor):
        return Verdict(False, f"{what}: expected a tensor of shape {list(expected.shape)}, got {describe(got)}")
    if expected.dtype == torch.bool and got.dtype != torch.bool:
        verdict = Verdict(False, f"{what}: expected a bool tensor (True = attend), got dtype {got.dtype}")
        if got.shape == expected.shape and torch.equal(got.bool(), expected):
            verdict.message += " (the values are right: add .bool() or build it with dtype=torch.bool)"
            verdict.findings = [{"code": "mask_dtype", "message": f"the mask has dtype {got.dtype}; masks are bool "
                                                                  "(True = attend)"}]
        return verdict
    for code, message, wrong in mistakes or []:
        if wrong is not None and got.shape == wrong.shape and (
                torch.equal(got, wrong) if wrong.dtype == torch.bool else _resembles(got, wrong)):
            if got.shape == expected.shape and close(got, expected):
                break  # indistinguishable on these inputs: it is right
            return Verdict(False, f"{what}: {message}", [{"code": code, "message": message}], (got, expected))
    if got.shape != expected.shape:
        return Verdict(False, f"{what}: expected shape {list(expected.shape)}, got {list(got.shape)}",
                       arrays=(got, expected))
    if expected.dtype == torch.bool:
        if torch.equal(got, expected):
            return Verdict(True)
        wrong = (got != expected).nonzero()[:3].tolist()
        return Verdict(False, f"{what}: {int((got != expected).sum())} entries differ, e.g. at {wrong}")
    if close(got, expected):
        return Verdict(True)
    rounded = _rounded_to_half(got, expected)
    if rounded:
        message = (f"{what}: every value is a {rounded} number, within {rounded}'s rounding of the reference: it was "
                   f"cast to {rounded} on the way (a store of .to({rounded}), an accumulator or an operand in "
                   f"{rounded}); keep float32 where float32 is asked, and cast once, if at all, at the end")
        return Verdict(False, message, [{"code": "low_precision", "message": message}], (got, expected))
    if not torch.isfinite(got).all() and torch.isfinite(expected).all():
        return Verdict(False, f"{what}: contains NaN/inf where the reference is finite", arrays=(got, expected))
    return Verdict(False, f"{what}: values differ from the reference by up to {max_abs_diff(got, expected):.3g}",
                   arrays=(got, expected))


def explain_backward(cases: list, gots: list) -> Optional[Any]:
    """What the shared bug-model library (:func:`attnlab.bugmodels.explain`) says explains a learner's
    backward on every case of an exercise: ``cases`` are :class:`attnlab.bugmodels.FlashCase`, ``gots``
    the learner's ``(dq, dk, dv)`` per case (a non-tensor or a wrong shape is left out of the comparison);
    an :class:`attnlab.bugmodels.Explanation`, else what :func:`attnlab.bugmodels.fit` finds (a
    :class:`attnlab.bugmodels.Fitted`), or None. The labs' judges ask this; no lab keeps a list."""
    from attnlab import bugmodels

    compared = []
    for case, got in zip(cases, gots):
        want = bugmodels.flash_gradients(case)
        triple = tuple(got) if isinstance(got, (tuple, list)) and len(got) == 3 else (None, None, None)
        compared.append({n: t if isinstance(t, Tensor) and t.shape == want[n].shape and t.is_floating_point() else None
                         for n, t in zip(("dq", "dk", "dv"), triple)})
    if not any(t is not None for c in compared for t in c.values()):
        return None
    return bugmodels.explain(cases, compared, match=_resembles) or bugmodels.fit(cases, compared, match=_resembles)


def model_mistakes(explanation: Optional[Any], case: Any) -> dict[str, list[tuple[str, str, Optional[Tensor]]]]:
    """``explanation``'s gradients on ``case`` as :func:`tensor_verdict` mistakes, per name (``dq``,
    ``dk``, ``dv``); empty lists where there is no explanation."""
    if explanation is None:
        return {"dq": [], "dk": [], "dv": []}
    from attnlab import bugmodels

    grads = bugmodels.gradients_of(explanation, case)
    return {n: [mistake(explanation.code, explanation.message, g)] for n, g in grads.items()}


def probe_calls(function: str, capabilities: frozenset[str], positional: tuple[str, ...] = (),
                implied: tuple[str, ...] = ()) -> tuple[list[Call], list]:
    """The doctor's probes (:func:`attnlab.doctor.build_probes`) as plain calls of the learner's
    SDPA-like ``function``, for an exercise to append to its own calls; ``positional``: the
    keyword arguments the function takes by position after Q, K, V (``("attn_mask",)``);
    ``implied``: those it does not take because it always does that (``gqa_attention`` always
    groups heads: ``("enable_gqa",)``). The sandbox only calls; :func:`doctor_findings` judges
    the answers here."""
    from attnlab import doctor

    probes = doctor.build_probes(capabilities)
    calls = []
    for p in probes:
        args, kwargs = doctor.probe_arguments(p, positional)
        calls.append(Call(function, args, {k: v for k, v in kwargs.items() if k not in implied}))
    return calls, probes


def doctor_findings(probes: list, results: list[dict]) -> list[dict]:
    """What the doctor names from the answers to :func:`probe_calls` (one result per probe)."""
    from attnlab import doctor

    answers = [doctor.probe_result(r["value"] if "value" in r else doctor.FailedCall(r.get("error", "")))
               for r in results]
    report = doctor.analyze(probes, answers)
    return [{"code": f.code, "message": f"{f.message}. Hint: {doctor.CODES[f.code]}"} for f in report.findings]


def all_checks(names, verdict: Verdict) -> dict[str, Verdict]:
    """The same verdict for every sub-check (a call that failed, a stub, a policy finding)."""
    return {n: verdict for n in names}


def judge_outcome(ex: Exercise, ctx: Any, outcome: Outcome, rule: str = "") -> dict[str, Verdict]:
    """Turn one child's outcome into a verdict per sub-check (never raises); ``rule``: the lab's
    from-scratch rule in words (:attr:`attnlab.labs.Lab.rule`), said with a policy finding."""
    if outcome.status != "ok":
        detail = outcome.message + (f"\n{outcome.traceback}" if outcome.traceback else "")
        if outcome.output:
            detail += f"\nit printed:\n{outcome.output}"
        return all_checks(ex.checks, Verdict(False, detail))
    if outcome.violations:
        names = ", ".join(outcome.violations)
        return all_checks(ex.checks, Verdict(False, f"[policy] policy violation in {ex.id} {ex.function}: it reached {names}. "
                                                    f"{rule}", [{"code": "policy", "message": f"called {names}"}]))
    stub = [r for r in outcome.results if r.get("error", "").startswith(NotImplementedError.__name__)]
    if stub:
        todo = stub[0]["error"].split(":", 1)[-1].strip()
        return all_checks(ex.checks, Verdict(False, f"not implemented yet: {todo}", [{"code": "not_implemented",
                                                                                "message": todo}]))
    try:
        verdicts = ex.judge(ctx, outcome.results, outcome)
    except CallFailed as exc:
        r = exc.result
        memory = " (the memory limit was hit: is something huge allocated?)" if r.get("memory") else ""
        hints = [f for f in _offset_findings(outcome) if not f.get("weak")] or (
            ex.on_error(r.get("error", ""), r.get("traceback", "")) if ex.on_error else [])
        if r.get("memory"):  # its own code: not a shape error, whatever else the traceback suggests
            hints = [{"code": "memory_limit", "message": f"{ex.function}() allocated past the exercise's memory "
                                                         "limit"}]
        return all_checks(ex.checks, Verdict(False, f"raised {r.get('error')}{memory}\n{r.get('traceback', '')}".rstrip(),
                                       hints))
    except Exception as exc:  # a return value of a shape the judge did not foresee
        return all_checks(ex.checks, Verdict(False, f"the returned value could not be checked: {type(exc).__name__}: {exc}"))
    verdicts = {name: verdicts.get(name, Verdict(False, "not checked")) for name in ex.checks}
    return _with_mutation(ex, outcome, _with_offsets(outcome, verdicts))


def _offset_findings(outcome: Outcome) -> list[dict]:
    """What the exercise's kernels reached outside the (batch, head) their programs own (lab 05's
    calls carry it: :mod:`.offsets`), once each, over every call."""
    found: list[dict] = []
    seen: set = set()  # one finding per (kernel, argument, load or store) over the exercise's calls
    for r in outcome.results:
        found += offsets.findings(r.get("slices"), seen)
    return sorted(found, key=lambda f: bool(f.get("weak")))[:offsets.MAX_FINDINGS]


def _with_offsets(outcome: Outcome, verdicts: dict[str, Verdict]) -> dict[str, Verdict]:
    """A failed check of an exercise whose kernels read or wrote another (batch, head)'s rows is
    named by that: the addresses are the direct evidence, where a bug model only resembles the
    values (issue 62: lse without its head offset was named a stale tile or a causal skip)."""
    if any(r.get("untouched") for r in outcome.results):  # a tensor of the answer no kernel stored: where the
        return verdicts  # kernels went says nothing of it (a dummy launch: 'kernel_not_launched' names it)
    found = _offset_findings(outcome)
    strong = [{"code": f["code"], "message": f["message"]} for f in found if not f.get("weak")]
    weak = [{"code": f["code"], "message": f["message"]} for f in found if f.get("weak")]
    if strong:
        return {name: v if v.passed else Verdict(False, v.message, list(strong), v.arrays) for name, v in verdicts.items()}
    if weak:  # a last tile read unmasked: the name of a failed check that nothing else named
        return {name: Verdict(False, v.message, list(weak), v.arrays) if not v.passed and not v.findings else v
                for name, v in verdicts.items()}
    return verdicts


def _with_mutation(ex: Exercise, outcome: Outcome, verdicts: dict[str, Verdict]) -> dict[str, Verdict]:
    """An answer that changed the caller's tensors in place is not correct, whatever it returned:
    every check fails with 'mutates_input' (the child compares each tensor argument before and after
    the call: :mod:`.sandbox.server`)."""
    changed = sorted({name for r in outcome.results for name in r.get("mutated", ())})
    if not changed:
        return verdicts
    names = ", ".join(f"`{n}`" for n in changed)
    text = (f"{ex.function} changed its input {names} in place: the caller's tensor is no longer what it passed "
            "(an in-place op such as masked_fill_, -= or [...] = on an argument)")
    finding = {"code": "mutates_input", "message": text}
    return {name: Verdict(False, text if v.passed else f"{text}\n{v.message}", [finding, *v.findings], v.arrays)
            for name, v in verdicts.items()}
