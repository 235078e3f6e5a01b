"""The doctor's probes for lab 01's ``self_attention(X, W_Q, W_K, W_V, mask=None)``.

Each ``(b, h)`` slice of an SDPA-style probe is one call with ``X = I`` and the slice's
Q, K, V as the weights, so ``Q = X @ W_Q`` is exactly the designed query.
:func:`self_attention_calls` makes the calls (the grader sends them to the sandbox as plain
calls), :func:`self_attention_result` joins the answers back into the probe's result, and
:func:`adapt_self_attention` does both in this process.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from attnlab import masks
from attnlab.doctor.probes import FailedCall, Probe, ProbeResult, as_tensor, short_error

__all__ = ["SELF_ATTENTION_CAPABILITIES", "self_attention_calls", "FailedCall", "self_attention_result",
           "adapt_self_attention"]

# what the lab's self_attention signature can take: square, default scale, bool masks, no dropout
SELF_ATTENTION_CAPABILITIES = frozenset({"causal", "mask"})


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


def self_attention_result(probe: Probe, answers: list) -> ProbeResult:
    """The probe's result from the answers to :func:`self_attention_calls`, in order: each a
    value, an ``Exception`` or a :class:`FailedCall` (the first failure is the probe's error)."""
    for a in answers:
        if isinstance(a, BaseException):
            return ProbeResult(error=short_error(a))
        if isinstance(a, FailedCall):
            first = a.error.strip().splitlines()[0] if a.error.strip() else "the call failed"
            return ProbeResult(error=first[:400])
    try:
        runs = _joined(probe, answers)
    except Exception as exc:  # the learner's values: any shape, any type
        return ProbeResult(error=short_error(exc))
    if probe.repeats == 1:
        return ProbeResult(output=runs[0])
    varied = any(not torch.equal(r, runs[0]) for r in runs[1:])
    return ProbeResult(output=torch.stack(runs).mean(0), varied=varied)


def _joined(probe: Probe, answers: list) -> list[Tensor]:
    """Each repeat's ``(b, h)`` slices put back as ``(..., T, Ev)`` float64; raises as torch
    does for answers of the wrong shape or type."""
    lead, T, Ev = probe.query.shape[:-2], probe.query.shape[-2], probe.value.shape[-1]
    per_call = len(answers) // probe.repeats
    return [torch.stack([as_tensor(a)[0] for a in answers[r * per_call:(r + 1) * per_call]])
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
