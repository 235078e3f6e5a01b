"""How far two correct trainings drift apart: the measurement behind
:func:`attnlab.testing.training_tolerance`.

    python tools/training_spread.py                 # every route this CPU has, 8 seeds, 16 steps
    python tools/training_spread.py --seeds 4 --steps 32

Trains the small GPT of ``tests/modules/test_train_gpt.py`` (examples/train_gpt.py: 2 layers,
2 heads, dim 32, 64 tokens, batch 4, AdamW at lr 3e-3) once with torch's SDPA and once with
each of attnlab's attentions (tiled causal, flex sliding window of 16), for several seeds
(other initial weights and batches) and texts, on each native route this machine can run
(``ATTNLAB_NATIVE=0``: pure PyTorch; the default build; ``ATTNLAB_SGEMM=blas``; the
avx512-emulated build), each in its own process. Every one of those runs is correct: they differ
only in the order of float32 roundings. It prints, per step, the largest relative difference
of the loss from SDPA's over all of them, and the bound of :func:`training_tolerance` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ROUTES = {
    "pure-pytorch": {"ATTNLAB_NATIVE": "0"},
    "native": {},
    "native, sgemm=blas": {"ATTNLAB_SGEMM": "blas"},
    "avx512-emulated": {"ATTNLAB_NATIVE_ISA": "avx512-emulated"},
}

# one process per route: trains every (attention, seed, text) and prints the relative gaps as JSON
CHILD = r"""
import importlib.util, json, sys, torch
torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("train_gpt", sys.argv[1])
m = importlib.util.module_from_spec(spec); sys.modules["train_gpt"] = m; spec.loader.exec_module(m)
seeds, steps = int(sys.argv[2]), int(sys.argv[3])
base = m.corpus()
texts = {"corpus": base, "corpus[1000:]": base[1000:]}
gaps = []
for tname, text in texts.items():
    for seed in range(seeds):
        for attention, window in (("attnlab", None), ("flex", 16)):
            cfg = lambda a: m.Config(a, window, seq_len=64, batch=4, layers=2, heads=2, dim=32, steps=steps,
                                     lr=3e-3, seed=seed)
            ours = m.train(cfg(attention), text, progress=False)["losses"]
            theirs = m.train(cfg("sdpa"), text, progress=False)["losses"]
            gaps.append([abs(a - b) / abs(b) for a, b in zip(ours, theirs)])
print(json.dumps(gaps))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from attnlab.testing import training_tolerance

    worst: list[float] = [0.0] * args.steps
    for route, env in ROUTES.items():
        run = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples" / "train_gpt.py"), str(args.seeds),
                              str(args.steps)], env={**os.environ, **env}, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{route}: failed\n{run.stderr[-2000:]}", file=sys.stderr)
            return 1
        gaps = json.loads(run.stdout.strip().splitlines()[-1])
        per_step = [max(g[i] for g in gaps) for i in range(args.steps)]
        print(f"{route:20s} " + " ".join(f"{x:.1e}" for x in per_step), flush=True)
        worst = [max(a, b) for a, b in zip(worst, per_step)]
    print(f"{'worst':20s} " + " ".join(f"{x:.1e}" for x in worst))
    bound = [training_tolerance(s) for s in range(1, args.steps + 1)]
    print(f"{'bound':20s} " + " ".join(f"{x:.1e}" for x in bound))
    print(f"margin (bound / worst, smallest): {min(b / max(w, 1e-12) for b, w in zip(bound, worst)):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
