"""Largest parity errors seen in this test session, per dtype; printed in pytest's summary."""

import torch

from attnlab.testing import ParityReport

WORST: dict[str, float] = {}
COUNT = {"cases": 0}


def record(report: ParityReport) -> None:
    name = str(report.dtype).replace("torch.", "")
    COUNT["cases"] += 1
    WORST[f"{name} output"] = max(WORST.get(f"{name} output", 0.0), report.output_error)
    for err in report.grad_errors.values():
        WORST[f"{name} grad"] = max(WORST.get(f"{name} grad", 0.0), err)


def summary() -> str:
    order = [str(d).replace("torch.", "") for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)]
    parts = [f"{d}: output {WORST[d + ' output']:.2e}, grad {WORST.get(d + ' grad', 0.0):.2e}"
             for d in order if d + " output" in WORST]
    return f"{COUNT['cases']} parity checks against torch SDPA; largest error vs float64 golden: " + "; ".join(parts)
