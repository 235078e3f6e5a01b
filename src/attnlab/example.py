"""The lesson's worked example (seed 42, B=1, T=4, d=8, d_k=d_v=4), computed and printed.

The random draws happen in the lesson's order and in float32 (the lesson sets
float32 as the default dtype): ``X (B, T, d)``, then ``W_Q``, ``W_K``, ``W_V``.
With another ``dtype`` the same float32 draws are cast, so the numbers stay
comparable across dtypes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from attnlab.modules import SelfAttention
from attnlab.testing import max_abs_diff, sdpa_oracle, tolerance
from attnlab.trace import AttentionTrace

__all__ = ["ExampleConfig", "WorkedExample", "run_example", "format_example", "DTYPES"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ExampleConfig:
    seed: int = 42
    batch: int = 1
    seq_len: int = 4
    d_model: int = 8
    d_k: int = 4
    d_v: int = 4
    causal: bool = False
    dtype: str = "float32"


@dataclass
class WorkedExample:
    config: ExampleConfig
    trace: AttentionTrace
    max_abs_diff_vs_sdpa: float

    def to_dict(self) -> dict:
        """JSON-ready: every step as nested lists, the config, and the parity figure."""
        return {**self.trace.to_dict(), "config": asdict(self.config),
                "max_abs_diff_vs_sdpa": self.max_abs_diff_vs_sdpa}


def run_example(config: ExampleConfig = ExampleConfig()) -> WorkedExample:
    """Draw the inputs, trace attnlab's self-attention, and check it against torch's SDPA (MATH)."""
    for name in ("batch", "seq_len", "d_model", "d_k", "d_v"):
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"run_example: {name} must be >= 1, got {value}")
    if config.dtype not in DTYPES:
        raise ValueError(f"run_example: dtype must be one of {list(DTYPES)}, got {config.dtype!r}")
    dtype = DTYPES[config.dtype]
    gen = torch.Generator().manual_seed(config.seed)
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)  # noqa: E731
    X = draw(config.batch, config.seq_len, config.d_model)  # (B, T, d)
    W_Q = draw(config.d_model, config.d_k)  # (d, d_k)
    W_K = draw(config.d_model, config.d_k)  # (d, d_k)
    W_V = draw(config.d_model, config.d_v)  # (d, d_v)

    module = SelfAttention.from_weights(W_Q, W_K, W_V)
    with torch.no_grad():
        trace = module.trace(X, is_causal=config.causal)
        expected = sdpa_oracle(trace["Q"], trace["K"], trace["V"], is_causal=config.causal,
                               scale=1.0 / math.sqrt(config.d_k))  # (B, T, d_v)
    return WorkedExample(config, trace, max_abs_diff(trace["output"], expected))


# --------------------------------------------------------------------------- #
# Text layout
# --------------------------------------------------------------------------- #

_SECTIONS = [
    ("Step 1 - Projections", ["X", "Q", "K", "V"]),
    ("Step 2 - Scores  Q @ K^T / sqrt(d_k)", ["scores", "masked_scores"]),
    ("Step 3 - Stable softmax, row by row", ["scores_shifted", "weights"]),
    ("Step 4 - Output  weights @ V", ["output"]),
]


def format_matrix(t: Tensor, spec: str = ".4f") -> str:
    """Nested-bracket layout with aligned columns, e.g. ``[[[ -0.7142, 10.7618], ...]]]``."""
    values = t.detach().to(torch.float64)

    def cell(v: float) -> str:
        if math.isinf(v):
            return "-inf" if v < 0 else "inf"
        return "nan" if math.isnan(v) else format(v, spec)

    flat = [cell(v) for v in values.flatten().tolist()]
    width = max((len(s) for s in flat), default=1)
    rank = values.dim()
    if rank == 0:
        return flat[0]
    it = iter(flat)

    def render(shape: tuple[int, ...], depth: int) -> str:
        if len(shape) == 1:
            return "[" + ", ".join(next(it).rjust(width) for _ in range(shape[0])) + "]"
        inner = [render(shape[1:], depth + 1) for _ in range(shape[0])]
        sep = "," + "\n" * (len(shape) - 1) + " " * (depth + 1)
        return "[" + sep.join(inner) + "]"

    return render(tuple(values.shape), 0)


def format_example(result: WorkedExample) -> str:
    """The worked example as text, laid out like the lesson: step, name, shape, matrix."""
    c = result.config
    lines = [
        "attnlab worked example: single-head self-attention",
        f"seed={c.seed}  B={c.batch}  T={c.seq_len}  d={c.d_model}  d_k={c.d_k}  d_v={c.d_v}  "
        f"dtype={c.dtype}  causal={c.causal}",
        "",
    ]
    for title, names in _SECTIONS:
        present = [n for n in names if n in result.trace]
        if not present:
            continue
        lines += [title, "-" * len(title)]
        for name in present:
            step = next(s for s in result.trace if s.name == name)
            spec = ".2e" if name == "weights" else ".4f"
            lines.append(f"{name} {list(step.shape)}: {step.description}")
            body = format_matrix(step.tensor, spec)
            lines += ["  " + line for line in body.splitlines()]
            lines.append("")
        if title.startswith("Step 3"):
            sums = result.trace["weights"].to(torch.float64).sum(-1)
            lines.append(f"row sums of weights: {format_matrix(sums, '.6f')}")
            lines.append("")
    tol = tolerance(DTYPES[c.dtype]).atol
    verdict = f"OK, within {tol:g}" if result.max_abs_diff_vs_sdpa <= tol else f"MISMATCH, above {tol:g}"
    lines.append(f"Parity: max |attnlab - torch SDPA (MATH backend)| = {result.max_abs_diff_vs_sdpa:.3e}  ({verdict})")
    return "\n".join(lines)
