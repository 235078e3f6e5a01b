"""A record of one forward pass, step by step: each step's name, shape and tensor.

Used by ``attnlab example`` and by anything that wants to show or check the
intermediate tensors of attention (the lesson's four panels, a grader).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["TraceStep", "AttentionTrace", "STEP_DESCRIPTIONS"]

STEP_DESCRIPTIONS: dict[str, str] = {
    "X": "input embeddings",
    "Q": "queries  Q = X @ W_Q",
    "K": "keys     K = X @ W_K",
    "V": "values   V = X @ W_V",
    "scores": "scores = Q @ K^T / sqrt(d_k)",
    "masked_scores": "scores with the mask applied (-inf = masked)",
    "scores_shifted": "scores - row max (every exponent <= 0)",
    "weights": "attention weights = stable softmax of the scores (rows sum to 1)",
    "output": "output = weights @ V",
}


@dataclass(frozen=True)
class TraceStep:
    """One step of a traced forward pass."""

    name: str
    tensor: Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def description(self) -> str:
        return STEP_DESCRIPTIONS.get(self.name, self.name)


@dataclass
class AttentionTrace:
    """The ordered steps of a forward pass; index by name: ``trace["weights"]``."""

    steps: list[TraceStep] = field(default_factory=list)

    def record(self, name: str, tensor: Tensor) -> None:
        """Append a step (a detached copy, so later in-place ops cannot change it)."""
        self.steps.append(TraceStep(name, tensor.detach().clone()))

    def names(self) -> list[str]:
        return [s.name for s in self.steps]

    def __getitem__(self, name: str) -> Tensor:
        for step in self.steps:
            if step.name == name:
                return step.tensor
        raise KeyError(f"no step named {name!r}; this trace has {self.names()}")

    def __contains__(self, name: object) -> bool:
        return any(s.name == name for s in self.steps)

    def __iter__(self) -> Iterator[TraceStep]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def to_dict(self) -> dict[str, list]:
        """``{step name: nested lists}``, ready for ``json.dumps`` (-inf becomes ``"-Infinity"``)."""
        return {s.name: _jsonable(s.tensor) for s in self.steps}


def _jsonable(t: Tensor) -> list:
    values = t.to(torch.float64).tolist()

    def fix(v):
        if isinstance(v, list):
            return [fix(x) for x in v]
        if v != v:
            return "NaN"
        if v in (float("inf"), float("-inf")):
            return "Infinity" if v > 0 else "-Infinity"
        return v

    return fix(values)
