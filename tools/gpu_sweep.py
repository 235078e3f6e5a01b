"""One prepared run on a lent GPU: pick attnlab.triton's tiles, check them, time them.

    PYTHONPATH=src python3 tools/gpu_sweep.py --out DIR [--budget-s 420]

1. **Sweep.** For each operand class of :data:`attnlab.triton.GPU_TILES` ("half64": bf16 E = 64,
   "half128": bf16 E = 128, "wide": float32 E = 64) and each stage (the forward alone; then the
   backward, timed as forward + backward with the forward's winner), every candidate tile shape
   at (B, H, L, E) = (4, 16, 4096, E), not causal, median of CUDA-event rounds. A candidate Triton
   cannot fit (shared memory, registers) is listed as such.
2. **Check.** The winners, on shapes off the tile (GQA, E not a power of two, L != S, causal and
   not), in bf16, fp16 and float32, against the float64 golden with torch's own error as the bound
   (:func:`attnlab.testing.assert_close_to_sdpa`, gradients included).
3. **Time.** ``attnlab bench --device cuda``'s suite (:func:`attnlab.bench.gpu.gpu_benchmark`)
   with the winners, against torch's flash backend and compiled flex_attention.

Everything is appended to ``DIR/gpu.md`` as it comes, so a run stopped at its limit still returns
what it measured. Benchmark plumbing: it patches ``GPU_TILES``, which the library reads per call.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from pathlib import Path

import torch

import attnlab.triton as at
from attnlab.bench import gpu
from attnlab.testing import assert_close_to_sdpa

Tiles = at.Tiles
FWD = [Tiles(16, 16, 4, 2), Tiles(64, 32, 4, 3), Tiles(64, 64, 4, 3), Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 3),
       Tiles(128, 128, 8, 2)]
BWD = [Tiles(16, 16, 4, 2), Tiles(32, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 64, 4, 2), Tiles(64, 128, 8, 2),
       Tiles(128, 64, 8, 2)]
CLASSES = {"half64": (torch.bfloat16, 64), "half128": (torch.bfloat16, 128), "half256": (torch.bfloat16, 256),
           "wide": (torch.float32, 64), "wide256": (torch.float32, 256)}


class Log:
    def __init__(self, path: Path):
        self.path = path
        path.write_text("")

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def time_ms(fn, rounds: int = 10) -> float:
    fn()
    fn()  # compiles, then warms
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step(q, k, v, grad, backward: bool):
    def run():
        out = at.flash_attention(q, k, v)
        if backward:
            torch.autograd.grad(out, (q, k, v), grad)
    return run


def sweep(log: Log, klass: str, chosen: dict) -> None:
    dtype, E = CLASSES[klass]
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, L = 4, 16, 4096
    q, k, v = (torch.randn(B, H, L, E, generator=g, device="cuda", dtype=dtype) for _ in range(3))
    grad = torch.randn_like(q)
    for stage, candidates in (("fwd", FWD), ("bwd", BWD)):
        backward = stage == "bwd"
        for t in (q, k, v):
            t.requires_grad_(backward)
        flops = 4 * B * H * L * L * E * (3.5 if backward else 1.0)
        best = None
        for t in candidates:
            at.GPU_TILES[(klass, stage)] = t
            try:
                ms = time_ms(step(q, k, v, grad, backward))
            except Exception as e:  # noqa: BLE001 - a tile Triton cannot fit is a row, not the end
                log(f"| {klass} | {stage} | {t.BQ}x{t.BK} w{t.num_warps} s{t.num_stages} | - | - | "
                    f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''} |")
                continue
            log(f"| {klass} | {stage} | {t.BQ}x{t.BK} w{t.num_warps} s{t.num_stages} | {ms:.3f} | "
                f"{flops / ms / 1e9:.1f} | |")
            if best is None or ms < best[0]:
                best = (ms, t)
        chosen[(klass, stage)] = best[1] if best else at.GPU_TILES[(klass, stage)]
        at.GPU_TILES[(klass, stage)] = chosen[(klass, stage)]
        log(f"| {klass} | {stage} | **chosen {chosen[(klass, stage)]}** | | | |")


SHAPES = [(1, 8, 2, 257, 513, 64, 64), (1, 4, 4, 513, 129, 128, 128), (1, 4, 1, 1000, 1000, 80, 48),
          (1, 2, 2, 64, 3000, 256, 256), (1, 4, 2, 300, 200, 200, 136), (1, 2, 1, 100, 150, 512, 320)]


def check(log: Log, heads: set) -> int:
    failures = 0
    shapes = [s for s in SHAPES if s[5] in heads]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for B, H, Hkv, L, S, E, Ev in shapes:
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(L + S + E)
                q = torch.randn(B, H, L, E, generator=g, device="cuda").to(dtype)
                k = torch.randn(B, Hkv, S, E, generator=g, device="cuda").to(dtype)
                v = torch.randn(B, Hkv, S, Ev, generator=g, device="cuda").to(dtype)
                name = f"{dtype} ({B},{H}/{Hkv},{L},{S},{E},{Ev}) causal={causal}"
                try:
                    r = assert_close_to_sdpa(at.flash_attention, q, k, v, is_causal=causal, enable_gqa=H != Hkv)
                    log(f"ok   {name}: out {r.output_error:.2e} (torch {r.torch_output_error:.2e}), "
                        + ", ".join(f"d{n} {r.grad_errors[n]:.2e} (torch {r.torch_grad_errors[n]:.2e})"
                                    for n in r.grad_errors))
                except Exception as e:  # noqa: BLE001 - report every case
                    failures += 1
                    log(f"FAIL {name}: {type(e).__name__}: {str(e)[:600]}")
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the later stages past this many seconds")
    p.add_argument("--lens", default="1024,4096,16384")
    p.add_argument("--classes", default=",".join(CLASSES), help="the operand classes to sweep")
    p.add_argument("--heads", default="64,128,80,256,200,512", help="check the shapes with these E")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "gpu.md")
    t0 = time.monotonic()
    import triton
    log(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    log("\n## Sweep: (4, 16, 4096, E), not causal; fwd+bwd rows use the fwd winner\n")
    log("| class | stage | tiles | ms | TFLOP/s | note |\n|---|---|---|---|---|---|")
    chosen: dict = {}
    for klass in args.classes.split(","):
        try:
            sweep(log, klass, chosen)
        except Exception:  # noqa: BLE001
            log("sweep failed:\n" + traceback.format_exc())
    log("\nGPU_TILES = {" + ", ".join(f"{k!r}: {v!r}" for k, v in at.GPU_TILES.items()) + "}")
    log(f"\n## Check against the float64 golden ({time.monotonic() - t0:.0f} s in)\n")
    failures = check(log, {int(h) for h in args.heads.split(",")})
    log(f"\n{failures} failed")
    if time.monotonic() - t0 > args.budget_s:
        log("budget spent: no timing table")
        return
    log(f"\n## attnlab bench --device cuda's suite, with the chosen tiles ({time.monotonic() - t0:.0f} s in)\n")
    rows = []
    for L in [int(x) for x in args.lens.split(",")]:
        if time.monotonic() - t0 > args.budget_s:
            log(f"budget spent before L={L}")
            break
        rows += gpu.gpu_benchmark([L], dtypes=("bfloat16",), B=4, H=16, E=64, repeats=10)
        log(gpu.gpu_table(rows, torch.cuda.get_device_name()))
    log(f"\ndone in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
