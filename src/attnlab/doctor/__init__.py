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

import inspect
from typing import Callable, Optional

from attnlab.doctor.analysis import CODES, DoctorReport, Finding, analyze
from attnlab.doctor.backward import (BACKWARD_FEATURES, audit_gradient_test, backward_capabilities,
                                     diagnose_backward)
from attnlab.doctor.context_parallel import diagnose_context_parallel
from attnlab.doctor.probes import (ALL_CAPABILITIES, FEATURES, FailedCall, Probe, ProbeResult, build_probes,
                                   probe_arguments, probe_result, run_probes)
from attnlab.doctor.self_attention import (SELF_ATTENTION_CAPABILITIES, adapt_self_attention, self_attention_calls,
                                           self_attention_result)

__all__ = [
    "CODES",
    "load_function",
    "Finding",
    "diagnose_context_parallel",
    "DoctorReport",
    "Probe",
    "ProbeResult",
    "build_probes",
    "run_probes",
    "analyze",
    "diagnose",
    "diagnose_backward",
    "audit_gradient_test",
    "backward_capabilities",
    "BACKWARD_FEATURES",
    "adapt_self_attention",
    "self_attention_calls",
    "self_attention_result",
    "FailedCall",
    "SELF_ATTENTION_CAPABILITIES",
    "FEATURES",
    "capabilities_of",
    "probe_arguments",
    "probe_result",
]


def capabilities_of(fn: Callable) -> frozenset[str]:
    """What ``fn`` is probed with by default: every feature of SDPA's signature, and grouped
    heads (``enable_gqa``) too where ``fn`` takes that argument (or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ALL_CAPABILITIES
    gqa = any(p.name == "enable_gqa" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return ALL_CAPABILITIES | {"gqa"} if gqa else ALL_CAPABILITIES


def diagnose(fn: Callable, *, capabilities: Optional[frozenset[str]] = None, seed: int = 0) -> DoctorReport:
    """Probe ``fn`` (torch SDPA's signature, or an adapter's) and name what is wrong.

    Args:
        fn: ``fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
            scale=None)``; it is called only with the keyword arguments a probe needs.
            An adapter made by :func:`adapt_self_attention` carries its own capabilities.
        capabilities: which kinds of probe ``fn`` can take (:data:`FEATURES`; default: the
            adapter's, else :func:`capabilities_of`).
        seed: the probes' seed.

    Returns:
        A :class:`DoctorReport`: ``ok``, ``max_abs_error`` and ``findings``, most likely first,
        and ``not_probed``, the features it left out.
    """
    caps = capabilities or getattr(fn, "capabilities", None) or capabilities_of(fn)
    probes = build_probes(frozenset(caps), seed)
    return analyze(probes, run_probes(fn, probes))


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
