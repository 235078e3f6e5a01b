"""Largest parity errors seen in this test session, per path and dtype; printed in pytest's summary."""

import torch

from attnlab.testing import ParityReport

WORST: dict[tuple[str, str, str], float] = {}  # (path, dtype, "output" | "grad") -> largest error
COUNT = {"cases": 0}


def record(report: ParityReport, path: str = "reference") -> None:
    """Keep the largest output and gradient errors of ``report`` for ``path`` (e.g. 'tiled')."""
    name = str(report.dtype).replace("torch.", "")
    COUNT["cases"] += 1
    key = (path, name)
    WORST[(*key, "output")] = max(WORST.get((*key, "output"), 0.0), report.output_error)
    for err in report.grad_errors.values():
        WORST[(*key, "grad")] = max(WORST.get((*key, "grad"), 0.0), err)


def summary() -> str:
    order = [str(d).replace("torch.", "") for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)]
    lines = [f"{COUNT['cases']} parity checks against torch SDPA; largest error vs float64 golden:"]
    for path in sorted({p for p, _, _ in WORST}):
        parts = [f"{d}: output {WORST[(path, d, 'output')]:.2e}, grad {WORST.get((path, d, 'grad'), 0.0):.2e}"
                 for d in order if (path, d, "output") in WORST]
        lines.append(f"  {path}: " + "; ".join(parts))
    return "\n".join(lines)


def export() -> dict:
    """This process's statistics as plain data (a pytest-xdist worker hands them to the controller)."""
    return {"cases": COUNT["cases"], "worst": [[*key, err] for key, err in WORST.items()]}


def merge(data: dict) -> None:
    """Add a worker's :func:`export` to this process's statistics."""
    COUNT["cases"] += data["cases"]
    for path, dtype, kind, err in data["worst"]:
        WORST[(path, dtype, kind)] = max(WORST.get((path, dtype, kind), 0.0), err)
