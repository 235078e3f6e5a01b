"""Make a class folder for grading benchmarks: ``python tests/helpers/make_class.py DIR --size 100``.

A mix like a real class: 40% solutions, 20% untouched stubs, 35% buggy variants (one named
mistake each), 5% hostile files from tests/hostile (a neighbour overwriter, a folder
rewriter, a fork bomb, an output flood, a hang). Both layouts (``DIR/<learner>.py`` and
``DIR/<learner>/attention.py``). Used for the throughput measured in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAB = HERE.parents[1] / "labs/track1/01-attention"
STUB = (LAB / "attention.py").read_text()
SOLUTION = (LAB / "solutions/attention.py").read_text()
SCORES_LINE = "return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])"
BUGS = [
    (SCORES_LINE, "return Q @ K.transpose(-2, -1)"),
    (SCORES_LINE, "return Q @ K.transpose(-2, -1) / Q.shape[-1]"),
    ("return scores.masked_fill(~mask, NEG_INF)", "return scores.masked_fill(mask, NEG_INF)"),
    ("return scores.masked_fill(~mask, NEG_INF)", "return scores.masked_fill(~mask, 0.0)"),
    ("return torch.ones(T, T, dtype=torch.bool).tril()", "return torch.ones(T, T, dtype=torch.bool).triu()"),
    ("return (torch.arange(T) < lengths[:, None])[:, None, :]",
     "return (torch.arange(T) <= lengths[:, None])[:, None, :]"),
    ("return weights[:, 0, :]", "return weights[:, :, 0]"),
]
HOSTILE = ["fp_neighbour", "write_own_folder", "fork_bomb", "flood_output", "hang_every_exercise"]


def hostile(name: str, folder: Path, neighbour: Path) -> str:
    text = (HERE.parent / "hostile" / f"{name}.py").read_text()
    base = "stub" if "# base: stub" in text else "solution"
    for key, value in {"@NEIGHBOUR@": str(neighbour), "@SELF_DIR@": str(folder), "@TOKEN@": "classtoken"}.items():
        text = text.replace(key, value)
    return {"stub": STUB, "solution": SOLUTION}[base] + "\n\n# ---- hostile part ----\n" + text


def make_class(folder: Path, size: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    n_hostile = max(1, size * 5 // 100)
    n_bug = size * 35 // 100
    n_stub = size * 20 // 100
    for i in range(size):
        learner = f"learner{i:03d}"
        nested = i % 2 == 0
        path = folder / learner / "attention.py" if nested else folder / f"{learner}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        if i < n_hostile:
            text = hostile(HOSTILE[i % len(HOSTILE)], path.parent, folder / "learner099" / "attention.py")
        elif i < n_hostile + n_bug:
            old, new = BUGS[i % len(BUGS)]
            text = SOLUTION.replace(old, new)
        elif i < n_hostile + n_bug + n_stub:
            text = STUB
        else:
            text = SOLUTION
        path.write_text(text)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--size", type=int, default=100)
    a = p.parse_args()
    make_class(a.folder, a.size)
    print(f"wrote {a.size} submissions into {a.folder}", file=sys.stderr)
