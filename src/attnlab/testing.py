"""Parity helpers: check any attention implementation against torch's SDPA.

Importable by other projects::

    from attnlab.testing import assert_close_to_sdpa
    report = assert_close_to_sdpa(my_attention, q, k, v, is_causal=True)
    print(report)

The tolerance rule is FlashAttention's: an implementation may be off from a
float64 golden by at most ``2x`` the error that torch's own SDPA (MATH backend,
same inputs, same dtype) makes against that golden, and ``3x`` for gradients,
plus a floor of a few ulps (scaled by the scores' magnitude) for the cases
where torch happens to be exact.
So the bound adapts to the dtype, the sizes and the magnitudes of each case,
instead of being a hand-picked constant.

For comparisons that have no golden (two tensors that should simply agree),
:func:`tolerance` is the one table of per-dtype tolerances, and
:func:`assert_close` applies it.

This module (and only it) calls ``torch.nn.functional.scaled_dot_product_attention``:
it is the oracle, never part of attnlab's own math.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from attnlab._validation import compute_dtype, default_scale

__all__ = [
    "Tolerance",
    "tolerance",
    "max_abs_diff",
    "assert_close",
    "training_tolerance",
    "assert_training_close",
    "sdpa_oracle",
    "ParityReport",
    "assert_close_to_sdpa",
]

AttentionFn = Callable[..., Tensor]


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|``, elementwise."""

    atol: float
    rtol: float


# torch.testing's defaults, except float32's atol: attention sums many products,
# so 1e-5 absolute on O(1) outputs is the honest single-precision floor.
_TOLERANCES = {
    torch.float64: Tolerance(atol=1e-7, rtol=1e-7),
    torch.float32: Tolerance(atol=1e-5, rtol=1.3e-6),
    torch.float16: Tolerance(atol=1e-3, rtol=1e-3),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),
}


# A whole model (logits, parameter gradients) with one attention swapped for another: the
# difference passes through every layer's projections, norms and MLPs, so it is allowed 1e-4
# in float32 (the integration issue's target; measured ~1e-6 on the tiny test models).
_MODEL_TOLERANCES = {torch.float32: Tolerance(atol=1e-4, rtol=1e-4), torch.float64: Tolerance(atol=1e-9, rtol=1e-9)}


def tolerance(dtype: torch.dtype, scope: str = "attention") -> Tolerance:
    """The per-dtype tolerance for two results that should agree (no golden available).

    ``scope="attention"``: one attention call. ``scope="model"``: a whole model's logits or
    parameter gradients with its attention implementation swapped (float32 and float64).
    """
    table = {"attention": _TOLERANCES, "model": _MODEL_TOLERANCES}.get(scope)
    if table is None:
        raise ValueError(f"tolerance: scope must be 'attention' or 'model', got {scope!r}")
    try:
        return table[dtype]
    except KeyError:
        raise ValueError(f"tolerance: no {scope} tolerance for dtype {dtype}; expected one of "
                         f"{sorted(str(d) for d in table)}") from None


def max_abs_diff(actual: Tensor, expected: Tensor) -> float:
    """``max |actual - expected|`` in float64; NaN in the same places counts as equal,
    NaN in only one of them counts as ``inf``. Empty tensors give 0."""
    if actual.shape != expected.shape:
        raise ValueError(f"max_abs_diff: shapes differ: actual {tuple(actual.shape)}, "
                         f"expected {tuple(expected.shape)}")
    a, e = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    if a.numel() == 0:
        return 0.0
    both_nan = a.isnan() & e.isnan()
    same_inf = (a == e) & a.isinf()
    diff = (a - e).abs()
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    diff = torch.where(diff.isnan(), torch.full_like(diff, float("inf")), diff)
    return diff.max().item()


def assert_close(actual: Tensor, expected: Tensor, *, dtype: Optional[torch.dtype] = None, msg: str = "",
                 scope: str = "attention") -> None:
    """``torch.testing.assert_close`` with attnlab's per-dtype :func:`tolerance` (``scope`` as there)."""
    tol = tolerance(dtype or expected.dtype, scope)
    torch.testing.assert_close(actual, expected, atol=tol.atol, rtol=tol.rtol, equal_nan=True,
                               check_dtype=False, msg=(lambda m: f"{msg}\n{m}") if msg else None)


# A training run with its attention swapped for another (same seed, data, model and optimiser),
# compared loss by loss. The first losses differ only by the attention's float32 rounding: over
# 16 runs of tests/modules/test_train_gpt.py's GPT (tiled causal and flex sliding, 4 seeds, 2 texts)
# on each of four routes (pure PyTorch, native, native with BLAS tiles, the avx512-emulated build;
# AMD EPYC Zen 3, 2026-12-04, tools/training_spread.py) the largest relative gap was 1.3e-7 up to
# step 12. Later, AdamW amplifies those ulps chaotically: 2.1e-6 at step 15 and 1.7e-5 at step 24
# there, and 1.9e-4 at step 16 on an AVX-512 Zen 4 (issue 46). A wrong backward shows by step 3:
# dK dropped 1.5e-5 to 1.9e-5, dQ and dK swapped 5.2e-6 to 7.1e-5, the D term missing 1.5e-5, all
# under the flat model tolerance (1e-4 + 1e-4 relative) and all over this bound.
_TRAINING_RTOL = {torch.float32: 1e-6}  # 8x the measured 1.3e-7 of the first steps
TRAINING_TIGHT_STEPS = 6  # steps held to the first bound (the gap stays at 1.3e-7 to step 12)
TRAINING_GROWTH = 2.0  # the bound doubles per step after those: 1e-3 at step 16, 5x the Zen 4 gap


def training_tolerance(step: int, dtype: torch.dtype = torch.float32) -> float:
    """The relative bound on ``|loss_a - loss_b| / |loss_b|`` at training ``step`` (1-based) for
    two trainings that differ only in a correct attention implementation: tight while rounding is
    all that differs, then growing by :data:`TRAINING_GROWTH` a step as the optimiser amplifies it
    (the measurements are in this module's source).

    Raises:
        ValueError: ``step`` below 1, or a ``dtype`` with no measured bound (float32 only).
    """
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"training_tolerance: step must be an int >= 1, got {step!r}")
    if dtype not in _TRAINING_RTOL:
        raise ValueError(f"training_tolerance: no measured bound for dtype {dtype}; expected torch.float32")
    return _TRAINING_RTOL[dtype] * TRAINING_GROWTH ** max(0, step - TRAINING_TIGHT_STEPS)


def assert_training_close(actual: "list[float] | Tensor", expected: "list[float] | Tensor", *,
                          dtype: torch.dtype = torch.float32, msg: str = "") -> None:
    """Two loss curves (one loss per step, step 1 first) agree step by step within
    :func:`training_tolerance`; the error names every step outside it and the bound there.

    Raises:
        AssertionError: a step outside its bound (or a NaN in only one curve), or curves of
            different lengths.
    """
    a = [float(x) for x in (actual.tolist() if isinstance(actual, Tensor) else actual)]
    e = [float(x) for x in (expected.tolist() if isinstance(expected, Tensor) else expected)]
    if len(a) != len(e):
        raise AssertionError(f"{msg + ': ' if msg else ''}loss curves of {len(a)} and {len(e)} steps")
    bad = []
    for step, (x, y) in enumerate(zip(a, e), start=1):
        gap = abs(x - y) / max(abs(y), 1e-30)
        bound = training_tolerance(step, dtype)
        if not gap <= bound:  # NaN fails too
            bad.append(f"step {step}: {x:.7g} vs {y:.7g} (relative {gap:.2g}, allowed {bound:.2g})")
    if bad:
        raise AssertionError(f"{msg + ': ' if msg else ''}the loss curves part beyond rounding at "
                             f"{len(bad)} of {len(a)} steps:\n  " + "\n  ".join(bad[:8]))


def sdpa_oracle(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    enable_gqa: bool = False,
) -> Tensor:
    """torch's own SDPA, pinned to the MATH backend (deterministic and defined for
    every input on the CPU): the oracle attnlab is measured against."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    with sdpa_kernel(backends=[SDPBackend.MATH]):
        return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


@dataclass
class ParityReport:
    """What :func:`assert_close_to_sdpa` measured. Errors are max-abs against the float64 golden."""

    dtype: torch.dtype
    output_error: float
    torch_output_error: float
    output_bound: float
    grad_errors: dict[str, float] = field(default_factory=dict)
    torch_grad_errors: dict[str, float] = field(default_factory=dict)
    grad_bounds: dict[str, float] = field(default_factory=dict)

    def ok(self) -> bool:
        return self.output_error <= self.output_bound and all(
            self.grad_errors[n] <= self.grad_bounds[n] for n in self.grad_errors)

    def __str__(self) -> str:
        lines = [f"{self.dtype}: output err {self.output_error:.3g} (torch {self.torch_output_error:.3g}, "
                 f"bound {self.output_bound:.3g})"]
        for n in self.grad_errors:
            lines.append(f"  d{n} err {self.grad_errors[n]:.3g} (torch {self.torch_grad_errors[n]:.3g}, "
                         f"bound {self.grad_bounds[n]:.3g})")
        return "\n".join(lines)


def _floor(dtype: torch.dtype, golden: Tensor, score_bound: float) -> float:
    """The slack added to ``factor * err(torch)``, for cases where torch happens to be exact.

    4 ulps of the compute dtype (float32 for float16/bfloat16, which SDPA computes
    in float32; their final rounding is part of torch's own error) at the golden's
    magnitude, times the scores' magnitude: ``exp(s)`` turns an absolute rounding
    error ``eps * |s|`` in a score into that relative error in its weight, so no
    implementation can do better than this on ill-conditioned (large) scores.
    """
    compute = compute_dtype(dtype)
    magnitude = golden.abs().max().item() if golden.numel() else 0.0
    return 4 * torch.finfo(compute).eps * max(1.0, magnitude) * max(1.0, score_bound)


def _score_bound(query: Tensor, key: Tensor, scale: Optional[float]) -> float:
    """``|scale| * max ||q_i|| * max ||k_j||``: an upper bound on every ``|score|`` (Cauchy-Schwarz)."""
    if query.numel() == 0 or key.numel() == 0:
        return 0.0
    s = abs(default_scale(scale, query.shape[-1]))
    q_norm = query.detach().double().norm(dim=-1).max().item()
    k_norm = key.detach().double().norm(dim=-1).max().item()
    return s * q_norm * k_norm


def _run(fn: AttentionFn, inputs: dict[str, Optional[Tensor]], kwargs: dict, grad_names: list[str],
         seed: int, dtype: torch.dtype) -> tuple[Tensor, dict[str, Tensor]]:
    """Run ``fn`` on fresh leaf copies of ``inputs`` cast to ``dtype``; return output and grads.

    A float mask keeps its own dtype where SDPA accepts it (float32, or the run's
    dtype); in the float64 golden run it is float64. The output gradient is a seeded ``randn`` of the output's
    shape, the same numbers in every run.
    """
    leaves: dict[str, Optional[Tensor]] = {}
    for name, t in inputs.items():
        if t is None:
            leaves[name] = None
            continue
        keep_mask_dtype = name == "attn_mask" and dtype != torch.float64 and t.dtype in (torch.float32, dtype)
        cast = t.is_floating_point() and not keep_mask_dtype
        c = t.detach().to(dtype) if cast else t.detach().clone()
        leaves[name] = c.requires_grad_(name in grad_names)
    torch.manual_seed(seed)  # dropout draws the same numbers in every run
    extra = {"attn_mask": leaves["attn_mask"], **kwargs} if kwargs.pop("_with_mask", True) else dict(kwargs)
    out = fn(leaves["query"], leaves["key"], leaves["value"], **extra)
    grads: dict[str, Tensor] = {}
    if grad_names and out.numel() > 0:
        targets = [leaves[n] for n in grad_names]
        gen = torch.Generator().manual_seed(seed)
        grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=out.device, dtype=out.dtype)
        got = torch.autograd.grad(out, targets, grad_outputs=grad_out, allow_unused=True)
        grads = {n: (g if g is not None else torch.zeros_like(leaves[n])) for n, g in zip(grad_names, got)}
    return out.detach(), grads


def _keywords_for(impl: AttentionFn, keywords: dict) -> dict:
    """The keywords of SDPA's call that ``impl`` accepts: all of them when it takes ``**kwargs``,
    else those its signature names. One it lacks is left out while it has SDPA's default
    (``attn_mask=None``, ``enable_gqa=False``, ...); asked for with another value it is an error."""
    import inspect

    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    try:
        params = inspect.signature(impl).parameters
    except (TypeError, ValueError):  # a builtin without a signature: call it as SDPA
        return {k: v for k, v in keywords.items() if k != "attn_mask"}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in keywords.items() if k != "attn_mask"}
    out = {"_with_mask": "attn_mask" in params}
    for name, value in keywords.items():
        if name in params:
            if name != "attn_mask":
                out[name] = value
        elif not (value is defaults.get(name) or value == defaults.get(name)):
            raise TypeError(f"assert_close_to_sdpa: {name}={value!r} was asked, but {getattr(impl, '__name__', impl)}"
                            f"{inspect.signature(impl)} takes no {name!r}; add it to the function, or leave "
                            f"{name} at its default")
    return out


def _worst_line(name: str, ours: Tensor, golden: Tensor, err: float, bound: float) -> str:
    """Where ``ours`` is farthest from ``golden``: the index, both values, and the error against the bound."""
    if ours.numel() == 0 or ours.shape != golden.shape:
        return ""
    diff = (ours.double() - golden.double()).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    ratio = f"{err / bound:.3g}x the tolerance" if bound > 0 else "the tolerance is 0"
    return (f"  worst {name} at index {list(index)}: yours {ours[index].item():.6g}, float64 reference "
            f"{golden[index].item():.6g} (|diff| {err:.3g} > tolerance {bound:.3g}: {ratio})")


def _doctor_command(impl: AttentionFn) -> str:
    module, name = getattr(impl, "__module__", None), getattr(impl, "__qualname__", None)
    if module and name and "<" not in name and module != "__main__":
        return f"attnlab doctor {module}:{name}"
    return "attnlab doctor MODULE:FUNCTION (or path/to/file.py:FUNCTION)"


def assert_close_to_sdpa(
    impl: AttentionFn,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    enable_gqa: bool = False,
    check_grads: bool = True,
    seed: int = 0,
    factor: float = 2.0,
    grad_factor: float = 3.0,
) -> ParityReport:
    """Assert that ``impl`` (SDPA's signature) matches torch's SDPA on these inputs.

    Three runs on copies of the same inputs: a float64 golden (torch MATH), torch
    MATH in the inputs' dtype, and ``impl`` in the inputs' dtype. Passes when::

        err(impl)      <= factor      * err(torch)      + floor    (output)
        err(impl.grad) <= grad_factor * err(torch.grad) + floor    (each gradient)

    where ``err`` is the max-abs difference to the golden and ``floor`` is 4 ulps
    of the compute dtype at the golden's magnitude, times the largest possible
    ``|score|`` (see ``_floor``). For float64 inputs, where torch's run
    is the golden itself, ``err(torch)`` is torch's float32 error times
    ``eps(float64) / eps(float32)``. With ``dropout_p > 0`` every run is
    seeded with ``seed``, so all three drop the same weights.

    Args:
        impl: the attention function under test, called as
            ``impl(query, key, value, attn_mask=..., dropout_p=..., is_causal=...,
            scale=..., enable_gqa=...)`` with the keywords its signature accepts (all of
            them when it takes ``**kwargs``); a keyword it lacks must be at SDPA's default.
        query: as SDPA.
        key: as in SDPA.
        value: as in SDPA.
        attn_mask: as in SDPA.
        dropout_p: as in SDPA.
        is_causal: as in SDPA.
        scale: as in SDPA.
        enable_gqa: as in SDPA.
        check_grads: also compare gradients for query, key, value, and for a float
            ``attn_mask`` that has ``requires_grad=True``.
        seed: the seed for dropout and for the random output gradient.
        factor: the multiple of torch's own error allowed for the output.
        grad_factor: the multiple allowed for the gradients.

    Returns:
        The :class:`ParityReport` (also when it passes, so callers can log the numbers).

    Raises:
        AssertionError: with the report, when a bound is exceeded or shapes differ: the
            worst index, both values, the tolerance, and the doctor command to run next.
        TypeError: ``impl`` lacks a keyword that was asked with a non-default value.
    """
    dtype = query.dtype
    inputs = {"query": query, "key": key, "value": value, "attn_mask": attn_mask}
    kwargs = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    grad_names: list[str] = []
    if check_grads:
        grad_names = ["query", "key", "value"]
        if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad:
            grad_names.append("attn_mask")

    golden, golden_grads = _run(sdpa_oracle, inputs, kwargs, grad_names, seed, torch.float64)
    # In float64 torch's run *is* the golden, so its error would read 0. Its float32
    # error, rescaled by the ratio of the two machine epsilons, stands in for it.
    torch_dtype = torch.float32 if dtype == torch.float64 else dtype
    rescale = torch.finfo(dtype).eps / torch.finfo(torch_dtype).eps
    theirs, their_grads = _run(sdpa_oracle, inputs, kwargs, grad_names, seed, torch_dtype)
    ours, our_grads = _run(impl, inputs, _keywords_for(impl, {"attn_mask": attn_mask, **kwargs}), grad_names, seed,
                           dtype)

    if ours.shape != golden.shape or ours.dtype != dtype:
        raise AssertionError(f"assert_close_to_sdpa: expected output of shape {tuple(golden.shape)} and dtype "
                             f"{dtype}, got {tuple(ours.shape)} and {ours.dtype}")
    report = ParityReport(
        dtype=dtype,
        output_error=max_abs_diff(ours, golden),
        torch_output_error=max_abs_diff(theirs, golden) * rescale,
        output_bound=0.0,
    )
    score_bound = _score_bound(query, key, scale)
    report.output_bound = factor * report.torch_output_error + _floor(dtype, golden, score_bound)
    for n in our_grads:
        report.grad_errors[n] = max_abs_diff(our_grads[n], golden_grads[n])
        report.torch_grad_errors[n] = max_abs_diff(their_grads[n], golden_grads[n]) * rescale
        report.grad_bounds[n] = grad_factor * report.torch_grad_errors[n] + _floor(dtype, golden_grads[n], score_bound)
    if not report.ok():
        worst = ([_worst_line("output", ours, golden, report.output_error, report.output_bound)]
                 if report.output_error > report.output_bound else [])
        worst += [_worst_line(f"d{n}", our_grads[n], golden_grads[n], report.grad_errors[n], report.grad_bounds[n])
                  for n in our_grads if report.grad_errors[n] > report.grad_bounds[n]]
        raise AssertionError(f"attention differs from torch SDPA by more than the bound:\n{report}\n"
                             + "\n".join(w for w in worst if w) + f"\nto name the mistake, run: {_doctor_command(impl)}")
    return report
