"""``attnlab bench``: attnlab's attention against torch's, timed in the same run.

Four implementations: attnlab's reference (``reference``), attnlab's tiled path
(``tiled``), and torch SDPA pinned to its MATH (``math``) and FLASH_ATTENTION
(``flash``) backends. For each configuration (length, forward or forward+backward,
causal or not, dtype) every implementation is warmed up, then timed in interleaved
rounds (reference, tiled, math, flash, reference, ...) so that a noisy neighbour
slows all of them alike; the median is reported with GFLOP/s and the ratio to
torch's fastest backend *in the same run*. Peak memory is measured separately,
each configuration in a fresh process: how far one step raises the peak resident
memory (``VmHWM``) above the process's size after a small warm-up run and the
inputs ("peak +MiB").

Configurations whose O(L^2) score tensors would not fit the memory budget are
skipped and say so.
"""

from __future__ import annotations

import csv
import itertools
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

__all__ = ["Config", "Result", "run_benchmarks", "write_csv", "plot", "markdown_table", "IMPLS"]

IMPLS = ("reference", "tiled", "math", "flash")
TORCH_IMPLS = ("math", "flash", "torchflex")  # "x torch best": against the fastest of these in the run
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class Config:
    impl: str
    L: int
    mode: str  # "fwd" | "fwd+bwd"
    causal: bool
    dtype: str
    B: int = 1
    H: int = 8
    E: int = 64
    mask: str = "none"  # "none" | "padding": a (B, 1, 1, L) bool key-padding mask hiding the last L/4 keys

    def flops(self) -> float:
        """Matmul FLOPs: forward 2 matmuls of 2*L*L*E each; backward 5 more (FlashAttention's count)."""
        fwd = 4.0 * self.B * self.H * self.L * self.L * self.E
        if self.causal:
            fwd /= 2
        return fwd * (3.5 if self.mode == "fwd+bwd" else 1.0)

    def scores_bytes(self) -> int:
        """Size of one (B, H, L, L) float32 tensor: what the O(L^2) implementations materialise."""
        return self.B * self.H * self.L * self.L * 4

    def estimated_peak_bytes(self) -> int:
        if self.impl in ("tiled", "flash"):
            return 16 * self.B * self.H * self.L * self.E * 4
        if self.impl in ("flex", "torchflex"):  # one query block's (128, L) tiles at a time, copies in the backward
            return 16 * self.B * self.H * self.L * self.E * 4 + 8 * self.B * self.H * 128 * self.L * 4
        copies = 3 if self.mode == "fwd" else 6  # scores, weights, masked/dropout temporaries, grads
        return copies * self.scores_bytes()


@dataclass
class Result:
    config: Config
    times_s: list[float] = field(default_factory=list)
    status: str = "ok"  # ok | skipped: ... | error: ...
    peak_mem_bytes: Optional[int] = None
    ratio_vs_torch_best: Optional[float] = None
    compile_s: Optional[float] = None  # torchflex: its first call (torch.compile), not in the median

    @property
    def median_s(self) -> Optional[float]:
        return statistics.median(self.times_s) if self.times_s else None

    @property
    def gflops(self) -> Optional[float]:
        m = self.median_s
        return self.config.flops() / m / 1e9 if m else None

    def row(self) -> dict:
        c = asdict(self.config)
        return {**c, "median_ms": _fmt(self.median_s and self.median_s * 1e3), "gflops": _fmt(self.gflops),
                "ratio_vs_torch_best": _fmt(self.ratio_vs_torch_best, 3),
                "peak_mem_mib": _fmt(self.peak_mem_bytes and self.peak_mem_bytes / 2**20),
                "repeats": len(self.times_s), "status": self.status, "compile_s": _fmt(self.compile_s)}


def _fmt(x: Optional[float], digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _function(impl: str, c: Optional["Config"] = None) -> Callable:
    if impl == "torchflex":  # torch's own flex_attention, compiled (its eager CPU forward is ~50x slower)
        import warnings

        from torch.nn.attention import flex_attention as torch_flex

        mod = _mask_mod(c) if c is not None else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            block_mask = (torch_flex.create_block_mask(mod, None, None, c.L, c.L, device="cpu")
                          if mod is not None else None)
        compiled = torch.compile(torch_flex.flex_attention)

        def run_torch_flex(q, k, v, causal, mask):
            return compiled(q, k, v, block_mask=block_mask)

        return run_torch_flex
    if impl == "flex":
        from attnlab.flex import flex_attention

        block_mask = _block_mask(c) if c is not None else None  # built once, as create_block_mask is

        def run_flex(q, k, v, causal, mask):
            return flex_attention(q, k, v, block_mask=block_mask)

        return run_flex
    if impl == "reference":
        from attnlab.functional import scaled_dot_product_attention

        return lambda q, k, v, causal, mask: scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
    if impl == "tiled":
        from attnlab.tiled import flash_attention

        return lambda q, k, v, causal, mask: flash_attention(q, k, v, mask, is_causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as torch_sdpa

    backend = SDPBackend.MATH if impl == "math" else SDPBackend.FLASH_ATTENTION

    def run(q, k, v, causal, mask):
        with sdpa_kernel(backends=[backend]):  # exactly this backend: an error, never a fallback
            return torch_sdpa(q, k, v, attn_mask=mask, is_causal=causal)

    return run


def _inputs(c: Config, requires_grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(c.B, c.H, c.L, c.E, generator=g).to(DTYPES[c.dtype]).requires_grad_(requires_grad)
               for _ in range(3))
    grad = torch.randn(c.B, c.H, c.L, c.E, generator=g).to(DTYPES[c.dtype])
    return q, k, v, grad


MASKS = ("none", "padding")
VARIANTS = ("sliding", "document", "prefix", "causal")  # --mask sliding:W | document:N | prefix:P | causal


def parse_mask(text: str) -> str:
    """Check a --mask value: none, padding, causal, sliding:W, document:N (N documents of
    equal length), prefix:P. Returns it; raises ValueError naming the accepted forms."""
    kind, _, arg = text.partition(":")
    if text in MASKS or text == "causal":
        return text
    if kind in ("sliding", "document", "prefix") and arg.isdigit() and int(arg) > 0:
        return text
    raise ValueError(f"--mask: expected none, padding, causal, sliding:W, document:N or prefix:P "
                     f"(W, N, P positive ints), got {text!r}")


def _mask_mod(c: "Config"):
    """The attention variant of ``c.mask`` as an attnlab.flex mask_mod, or None."""
    from attnlab.flex import mods

    kind, _, arg = c.mask.partition(":")
    if kind == "sliding":
        return mods.sliding_window(int(arg))
    if kind == "document":
        n = int(arg)
        return mods.document_mask_from_lengths([c.L // n + (i < c.L % n) for i in range(n)])
    if kind == "prefix":
        return mods.prefix_lm(int(arg))
    if kind == "causal":
        return mods.causal_mask
    return None


_BLOCK_MASKS: dict = {}


def _block_mask(c: "Config"):
    mod = _mask_mod(c)
    if mod is None:
        return None
    key = (c.mask, c.L)
    if key not in _BLOCK_MASKS:
        from attnlab.flex import create_block_mask

        _BLOCK_MASKS.clear()
        _BLOCK_MASKS[key] = create_block_mask(mod, None, None, c.L, c.L)
    return _BLOCK_MASKS[key]


_DENSE: dict = {}


def _mask(c: Config) -> Optional[torch.Tensor]:
    """The configuration's attn_mask (True = attend): None; a padding mask whose last L/4 keys
    are hidden; or an attention variant written out as the dense ``(L, L)`` bool mask that
    torch's SDPA (and attnlab's dense paths) need for it."""
    if c.mask == "none":
        return None
    if c.mask == "padding":
        keep = torch.ones(c.B, 1, 1, c.L, dtype=torch.bool)
        keep[..., c.L - c.L // 4:] = False
        return keep
    key = (c.mask, c.L)
    if key not in _DENSE:
        mod = _mask_mod(c)
        idx = torch.arange(c.L)
        _DENSE.clear()
        _DENSE[key] = mod(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                          idx[:, None], idx[None, :]).expand(c.L, c.L).contiguous()
    return _DENSE[key]


def _step(fn: Callable, c: Config, q, k, v, grad) -> None:
    out = fn(q, k, v, c.causal, None if c.impl in ("flex", "torchflex") else _mask(c))  # those have block masks
    if c.mode == "fwd+bwd":
        q.grad = k.grad = v.grad = None
        out.backward(grad)


def run_benchmarks(seq_lens: list[int], impls: list[str], modes: list[str], causals: list[bool], dtypes: list[str],
                   *, B: int = 1, H: int = 8, E: int = 64, repeats: int = 5, warmup: int = 1, memory: bool = True,
                   max_memory_gb: float = 8.0, progress: Optional[Callable[[int, int, str], None]] = None,
                   mask: str = "none") -> list[Result]:
    """Time every configuration; implementations of one configuration are interleaved.

    ``mask="padding"`` passes a key-padding ``attn_mask`` to every implementation; SDPA does
    not take a mask together with ``is_causal``, so those configurations are skipped. An
    attention variant (``"sliding:W"``, ``"document:N"``, ``"prefix:P"``, ``"causal"``) gives
    ``flex`` its block mask (built once, outside the timing, as torch's create_block_mask)
    and every other implementation the same mask written out densely."""
    parse_mask(mask)
    groups = list(itertools.product(dtypes, modes, causals, seq_lens))
    total = len(groups) * len(impls) * (2 if memory else 1)
    done = 0
    results: list[Result] = []
    for dtype, mode, causal, L in groups:
        group = [Result(Config(impl, L, mode, causal, dtype, B, H, E, mask)) for impl in impls]
        live = []
        for r in group:
            need = r.config.estimated_peak_bytes()
            if mask != "none" and causal:
                r.status = "skipped: a mask and is_causal together (SDPA takes one or the other)"
            elif need > max_memory_gb * 2**30:
                r.status = f"skipped: needs ~{need / 2**30:.0f} GiB (> --max-memory-gb {max_memory_gb:g})"
            else:
                live.append(r)
        q, k, v, grad = _inputs(group[0].config, mode == "fwd+bwd")
        fns = {}
        for r in live:
            if progress:
                progress(done, total, f"warm-up {r.config.impl} L={L} {mode} {'causal' if causal else ''} {dtype}")
            try:
                fns[r.config.impl] = _function(r.config.impl, r.config)
                if r.config.impl == "torchflex":  # the first call compiles: timed apart, never in the median
                    t0 = time.perf_counter()
                    _step(fns[r.config.impl], r.config, q, k, v, grad)
                    r.compile_s = time.perf_counter() - t0
                for _ in range(warmup):
                    _step(fns[r.config.impl], r.config, q, k, v, grad)
            except Exception as exc:  # e.g. a backend that does not support this dtype
                r.status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        live = [r for r in live if r.status == "ok"]
        for rep in range(repeats):
            for r in live:  # interleaved: each round times every implementation once
                t0 = time.perf_counter()
                _step(fns[r.config.impl], r.config, q, k, v, grad)
                r.times_s.append(time.perf_counter() - t0)
        for r in group:
            done += 1
            if progress:
                progress(done, total, f"{r.config.impl} L={L} {mode} {'causal' if causal else ''} {dtype}")
        torch_best = [r.median_s for r in group if r.config.impl in TORCH_IMPLS and r.median_s]
        for r in group:
            if r.median_s and torch_best:
                r.ratio_vs_torch_best = r.median_s / min(torch_best)
        if memory:
            for r in group:
                if r.status == "ok" and r.config.impl != "torchflex":  # a child would compile it all again
                    r.peak_mem_bytes = measure_peak_memory(r.config)
                done += 1
                if progress:
                    progress(done, total, f"memory {r.config.impl} L={L} {mode} {dtype}")
        results += group
    return results


# Rough throughputs on 2 cores for the estimate only (BENCHMARKS.md, "The targets, L = 4096",
# an AMD EPYC: tiled/flash ~160 GFLOP/s, reference/math 33-77 GFLOP/s; bf16/fp16 and the
# reference's backward are slower, so the estimate errs long); a fresh memory process ~3 s.
_EST_GFLOPS = {"tiled": 120.0, "flash": 120.0, "flex": 100.0, "torchflex": 100.0, "reference": 25.0, "math": 25.0}
_EST_MEMORY_RUN_S = 3.0


def estimate_seconds(seq_lens: list[int], impls: list[str], modes: list[str], causals: list[bool],
                     dtypes: list[str], *, B: int = 1, H: int = 8, E: int = 64, repeats: int = 5, warmup: int = 1,
                     memory: bool = True, max_memory_gb: float = 8.0, mask: str = "none") -> float:
    """A rough duration of :func:`run_benchmarks` with the same arguments, from each
    configuration's FLOPs at the throughputs above (printed before a long run)."""
    total = 0.0
    for dtype, mode, causal, L in itertools.product(dtypes, modes, causals, seq_lens):
        for impl in impls:
            c = Config(impl, L, mode, causal, dtype, B, H, E, mask)
            if c.estimated_peak_bytes() > max_memory_gb * 2**30 or (mask != "none" and causal):
                continue
            slow = 1.0 if dtype in ("float32", "float64") else 2.0
            per_call = c.flops() / (_EST_GFLOPS.get(impl, 25.0) * 1e9) * slow
            total += per_call * (repeats + warmup) + (per_call + _EST_MEMORY_RUN_S if memory else 0.0)
    return total


def format_duration(seconds: float) -> str:
    """``75`` -> ``'1 min 15 s'``; ``3900`` -> ``'1 h 5 min'``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {(s % 3600) // 60} min"


def ring_table(rows: list[dict], causal: bool) -> list[str]:
    """Markdown rows of :func:`ring_benchmark` (the header is :data:`RING_HEADER`)."""
    return [f"| {r['L']} | {'yes' if causal else 'no'} | {r['layout']} | {r['ring_s']:.2f} | {r['single_s']:.2f} | "
            f"{r['ratio']:.2f} | {r['ring_peak_mib']:.1f} | {r['single_peak_mib']:.1f} | "
            f"{r['sent_mib_per_rank']:.1f} | {100 * r['comm_wait_share']:.1f}% |"
            + (f" errors: {r['errors']}" if r["errors"] else "") for r in rows]


RING_HEADER = ("| L | causal | layout | 2 ranks x 1 thread s | 1 process x 2 threads s | ratio | ring peak +MiB/rank "
               "| one process peak +MiB | sent MiB/rank | waiting on messages |\n|---|---|---|---|---|---|---|---|---|---|")


def transformers_table(rows: list[dict]) -> str:
    """Markdown table of :func:`transformers_benchmark`."""
    lines = ["| model | L | sliding window | sdpa ms | attnlab ms | x sdpa |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['L']} | {r['window'] or '-'} | {r['sdpa_ms']:.0f} | {r['attnlab_ms']:.0f} "
              f"| {r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def density_table(rows: list[dict], L: int, B: int, H: int, E: int) -> str:
    """Markdown table of :func:`density_sweep`, with the line that says what its ratio means."""
    lines = [f"attnlab.flex, L={L}, B={B}, H={H}, E={E}, float32; ratio = time / (density x time of full attention); "
             f"1.0 = proportional to the blocks visited", "",
             "| mask | density | full blocks | partial blocks | mode | median ms | full attention ms | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mask']} | {r['density']:.3f} | {r['full']} | {r['partial']} | {r['mode']} | {r['ms']:.1f} "
              f"| {r['full_ms']:.1f} | {r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Peak memory, one fresh process per configuration
# --------------------------------------------------------------------------- #


def measure_peak_memory(c: Config) -> Optional[int]:
    """Peak RSS growth of one step of ``c`` over a warmed-up baseline, in a fresh process."""
    args = [sys.executable, "-m", "attnlab.bench", "--peak-memory-child", c.impl, str(c.L), c.mode,
            str(int(c.causal)), c.dtype, str(c.B), str(c.H), str(c.E), c.mask]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=1800, env=env, check=True)
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def _proc_status_bytes(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field_name} in /proc/self/status")


def _release_freed_heap() -> None:
    """Hand memory that was freed but kept by glibc's allocator back to the system, so the
    baseline is what is live: otherwise a step that reuses temporaries freed before it (a
    block mask's construction, say) reads as needing almost nothing (0.1 MiB measured for a
    forward+backward that allocates ~200 MiB)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the measurement is an upper bound on reuse, as before


def peak_rss_growth(step: Callable[[], object]) -> int:
    """How far ``step()`` raises this process's peak resident memory above its current one, in bytes.

    Uses the peak of *this* address space (``VmHWM``, reset through ``/proc/self/clear_refs``)
    rather than ``ru_maxrss``, which Linux carries over from the parent across fork and
    exec, so a child of a big process would read that parent's size as its own.
    """
    _release_freed_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    baseline = _proc_status_bytes("VmRSS")
    step()
    return max(0, _proc_status_bytes("VmHWM") - baseline)


def _peak_memory_child(argv: list[str]) -> None:
    impl, L, mode, causal, dtype, B, H, E, mask = argv
    c = Config(impl, int(L), mode, bool(int(causal)), dtype, int(B), int(H), int(E), mask)
    small = Config(impl, 16, mode, c.causal, dtype, c.B, c.H, c.E, mask)
    _step(_function(impl, small), small, *_inputs(small, mode == "fwd+bwd"))  # allocators and kernels warmed up
    fn = _function(impl, c)  # a block mask is built here, before the baseline, as the timed runs do
    q, k, v, grad = _inputs(c, mode == "fwd+bwd")
    if impl != "flex":  # the dense mask is an input of the other calls, not part of their peak
        _mask(c)
    print(peak_rss_growth(lambda: _step(fn, c, q, k, v, grad)))


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def write_csv(results: list[Result], path: str) -> None:
    rows = [r.row() for r in results]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(results: list[Result]) -> str:
    head = "| impl | L | mode | causal | dtype | median ms | GFLOP/s | x torch best | peak +MiB | note |"
    lines = [head, "|" + "---|" * 10]
    for r in results:
        c, row = r.config, r.row()
        note = ("" if r.status == "ok" else r.status) or (f"{c.mask} mask" if c.mask != "none" else "")
        if r.compile_s is not None:
            note = f"{note}; compile {r.compile_s:.1f} s (not in the median)".lstrip("; ")
        lines.append(f"| {c.impl} | {c.L} | {c.mode} | {'yes' if c.causal else 'no'} | {c.dtype} | {row['median_ms']} "
                     f"| {row['gflops']} | {row['ratio_vs_torch_best']} | {row['peak_mem_mib']} | {note} |")
    return "\n".join(lines)


def plot(results: list[Result], path: str) -> None:
    """GFLOP/s against L, one panel per (mode, causal), one line per implementation and dtype."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("attnlab bench --plot needs matplotlib: pip install 'attnlab[bench]'") from None
    panels = sorted({(r.config.mode, r.config.causal) for r in results if r.gflops})  # skipped ones: no panel
    if not panels:
        raise RuntimeError("attnlab bench --plot: no configuration produced a time to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    styles = {"float32": "-", "bfloat16": "--", "float16": ":", "float64": "-."}
    for ax, (mode, causal) in zip(axes[0], panels):
        for impl, dtype in sorted({(r.config.impl, r.config.dtype) for r in results}):
            pts = sorted((r.config.L, r.gflops) for r in results if r.config.impl == impl and r.config.dtype == dtype
                         and r.config.mode == mode and r.config.causal == causal and r.gflops)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(dtype, "-"), marker="o",
                        label=f"{impl} {dtype}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("GFLOP/s")
        masked = any(r.config.mask == "padding" for r in results)
        ax.set_title(f"{mode}, {'causal' if causal else 'padding mask' if masked else 'not causal'}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    c = results[0].config
    fig.suptitle(f"attention, B={c.B} H={c.H} E={c.E}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- #
# attnlab.flex: time against block-mask density
# --------------------------------------------------------------------------- #

DENSITIES = (0.5, 0.25, 0.1, 0.05)


def density_sweep(L: int, *, B: int = 1, H: int = 8, E: int = 64, densities=DENSITIES, repeats: int = 3,
                  modes=("fwd", "fwd+bwd"), progress: Optional[Callable[[int, int, str], None]] = None) -> list[dict]:
    """attnlab.flex's time at block-mask density ``d`` against ``d`` x its time on full attention.

    Two masks per density, timed in interleaved rounds with full attention (flex without a
    block mask, the same kernels): a *band* of whole blocks (block ``(i, j)`` kept when
    ``(i - j) mod nq < d * nq``; every block full, every row the same work: the cost of skipping
    alone) and a causal *sliding window* of ``d * L`` keys (its diagonal blocks are partial: the
    cost of reading mask bits). Returns one dict per (mask, mode): ``mask, density, full,
    partial, mode, ms, full_ms, ratio`` where ``ratio = ms / (density * full_ms)`` (1.0 = time
    exactly proportional to the blocks visited) and ``density`` is the block mask's own.
    """
    from attnlab.flex import create_block_mask, flex_attention, mods

    block = 128
    nq = -(-L // block)
    masks = {}
    for d in densities:
        w = max(1, round(d * nq))
        masks[f"band {d:g}"] = create_block_mask(
            lambda b, h, q, kv, w=w: torch.remainder(q // block - kv // block, nq) < w, None, None, L, L)
        masks[f"sliding {d:g}"] = create_block_mask(mods.sliding_window(max(1, round(d * L))), None, None, L, L)
    rows = []
    steps = len(modes) * repeats
    for m, mode in enumerate(modes):
        c = Config("flex", L, mode, False, "float32", B, H, E)
        q, k, v, grad = _inputs(c, mode == "fwd+bwd")
        fns = {"full": lambda q, k, v, causal, mask: flex_attention(q, k, v)}
        for name, bm in masks.items():
            fns[name] = lambda q, k, v, causal, mask, bm=bm: flex_attention(q, k, v, block_mask=bm)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for fn in fns.values():
            _step(fn, c, q, k, v, grad)  # warm-up
        for rep in range(repeats):
            for name, fn in fns.items():  # interleaved, as run_benchmarks
                t0 = time.perf_counter()
                _step(fn, c, q, k, v, grad)
                times[name].append(time.perf_counter() - t0)
            if progress:
                progress(m * repeats + rep + 1, steps, f"density sweep L={L} {mode}")
        full_ms = statistics.median(times["full"]) * 1e3
        for name, bm in masks.items():
            ms = statistics.median(times[name]) * 1e3
            counts = bm.counts()
            rows.append({"mask": name.split()[0], "density": bm.density(), "full": counts["full"],
                         "partial": counts["partial"], "mode": mode, "ms": ms, "full_ms": full_ms,
                         "ratio": ms / (bm.density() * full_ms)})
    return rows


# --------------------------------------------------------------------------- #
# Whole models: Hugging Face transformers with attn_implementation="attnlab"
# --------------------------------------------------------------------------- #

HF_CASES = (("llama", 1024, None), ("mistral", 4096, 1024))  # (family, L, sliding window)


def transformers_benchmark(cases=HF_CASES, *, B: int = 1, layers: int = 4, repeats: int = 3,
                           progress: Optional[Callable[[int, int, str], None]] = None) -> list[dict]:
    """Forward+backward of a small randomly initialised model, ``"sdpa"`` against ``"attnlab"``.

    Llama-style (GQA: 8 query heads, 4 key/value heads of 64, hidden 512, ``layers`` layers) for
    ``"llama"``; the same as Mistral with a sliding window for ``"mistral"``. The two
    implementations are timed in interleaved rounds on one model (``set_attn_implementation``),
    after one untimed step each. Returns dicts ``family, L, window, sdpa_ms, attnlab_ms, ratio``.
    """
    import transformers

    import attnlab.integrations.transformers  # noqa: F401  registers "attnlab"

    rows = []
    steps = len(cases) * (repeats + 1)
    done = 0
    for family, L, window in cases:
        common = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=L)
        cfg = (transformers.MistralConfig(sliding_window=window, **common) if family == "mistral"
               else transformers.LlamaConfig(**common))
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        ids = torch.randint(0, 1024, (B, L), generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {"sdpa": [], "attnlab": []}
        for rep in range(repeats + 1):
            for impl in times:
                model.set_attn_implementation(impl)
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                if rep:  # the first round warms up
                    times[impl].append(time.perf_counter() - t0)
            done += 1
            if progress:
                progress(done, steps, f"transformers {family} L={L}")
        sdpa_ms, ours_ms = (statistics.median(times[k]) * 1e3 for k in ("sdpa", "attnlab"))
        rows.append({"family": family, "L": L, "window": window, "sdpa_ms": sdpa_ms, "attnlab_ms": ours_ms,
                     "ratio": ours_ms / sdpa_ms})
    return rows


DECODE_HEADER = ("Decoding: one step, q (B, H, L, E) against a cache k, v (B, Hkv, S, E); GB/s counts the "
                 "cache's unique K and V bytes once (what a step must read)")


def decode_benchmark(seq_lens: list[int], *, dtypes=("float32", "bfloat16"), B: int = 1, H: int = 32, Hkv: int = 8,
                     E: int = 128, L: int = 1, repeats: int = 10,
                     progress: Optional[Callable[[int, int, str], None]] = None) -> list[dict]:
    """Median time of one decode step per implementation (attnlab's ``dispatch.attention`` on
    ``auto``, which takes the decode path, its tiled and reference paths, torch's SDPA),
    interleaved run by run, with the achieved bandwidth in unique K/V bytes and its share of
    this machine's read bandwidth (:func:`read_bandwidth`, measured in the same run). ``L > 1``
    is a causal chunk (speculative decoding, chunked prefill): bottom-right aligned, given to
    torch as ``masks.causal(..., align="bottom_right")`` (SDPA's ``is_causal`` is top-left)."""
    import torch.nn.functional as F

    from attnlab import dispatch, masks

    rows, done, total = [], 0, len(seq_lens) * len(dtypes)
    peak = read_bandwidth()
    for S in seq_lens:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            g = torch.Generator().manual_seed(S)
            q = torch.randn(B, H, L, E, generator=g).to(dtype)
            k = torch.randn(B, Hkv, S, E, generator=g).to(dtype)
            v = torch.randn(B, Hkv, S, E, generator=g).to(dtype)
            mask = masks.causal(L, S, align="bottom_right") if L > 1 else None
            fns = {"attnlab (auto: decode)": lambda: dispatch.attention(q, k, v, is_causal=L > 1, enable_gqa=True,
                                                                        causal_align="bottom_right"),
                   "attnlab tiled": lambda: dispatch.attention(q, k, v, mask, enable_gqa=True, impl="tiled"),
                   "torch SDPA": lambda: F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)}
            if S <= 32768:  # the reference materialises repeated K and V: minutes past that
                fns["attnlab reference"] = lambda: dispatch.attention(q, k, v, mask, enable_gqa=True,
                                                                      impl="reference")
            times: dict[str, list[float]] = {name: [] for name in fns}
            with torch.no_grad():
                for fn in fns.values():
                    fn()  # warm-up: the native kernels, torch's thread pool
                for _ in range(repeats):
                    for name, fn in fns.items():
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
            kv_bytes = 2 * B * Hkv * S * E * torch.finfo(dtype).bits // 8
            torch_ms = statistics.median(times["torch SDPA"]) * 1e3
            for name, ts in times.items():
                ms = statistics.median(ts) * 1e3
                gb_s = kv_bytes / (ms / 1e3) / 1e9
                rows.append({"S": S, "dtype": dtype_name, "impl": name, "ms": ms, "ratio": ms / torch_ms,
                             "gb_s": gb_s, "peak_share": gb_s / peak})
            done += 1
            if progress:
                progress(done, total, f"S={S} {dtype_name}")
    return rows


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """GB/s at which torch's threads read a ``mib`` MiB float32 tensor (``sum``, median of
    ``repeats``): the ceiling a decode step that reads its cache once can reach here."""
    t = torch.ones(mib * 2**20 // 4)
    t.sum()  # pages faulted in, threads started
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - t0)
    return t.numel() * 4 / statistics.median(times) / 1e9


def decode_table(rows: list[dict]) -> str:
    lines = ["| S | dtype | implementation | ms | x torch | GB/s (unique K/V) | share of read peak |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['S']} | {r['dtype']} | {r['impl']} | {r['ms']:.2f} | {r['ratio']:.2f}x | "
                     f"{r['gb_s']:.1f} | {100 * r['peak_share']:.0f}% |")
    return "\n".join(lines)


# issue 24's bf16 shapes: (B, H, Hkv, L, E); the last one grouped (GQA)
BF16_SHAPES = ((1, 8, 8, 4096, 64), (2, 16, 16, 2048, 128), (1, 32, 8, 4096, 128))
BF16_HEADER = ("bfloat16: attnlab's tiled path on its bf16 route (bf16 GEMMs, csrc/bf16_gemm.h) and on its fp32 "
               "route (inputs converted to float32), against torch's SDPA in bfloat16, causal, same run")


def bf16_benchmark(shapes=BF16_SHAPES, *, modes=("fwd", "fwd+bwd"), repeats: int = 3,
                   progress: Optional[Callable[[int, int, str], None]] = None) -> list[dict]:
    """Median time per (shape, mode) of ``attnlab.flash_attention`` on bfloat16 inputs with
    ``ATTNLAB_BF16=bf16`` and ``=fp32``, and of torch's SDPA, interleaved run by run."""
    import torch.nn.functional as F

    from attnlab import tiled

    def with_route(route: str, fn: Callable) -> Callable:
        def run():
            before = os.environ.get("ATTNLAB_BF16")
            os.environ["ATTNLAB_BF16"] = route
            try:
                return fn()
            finally:
                if before is None:
                    del os.environ["ATTNLAB_BF16"]
                else:
                    os.environ["ATTNLAB_BF16"] = before
        return run

    rows, done, total = [], 0, len(shapes) * len(modes)
    for B, H, Hkv, L, E in shapes:
        g = torch.Generator().manual_seed(L)
        q = torch.randn(B, H, L, E, generator=g).to(torch.bfloat16)
        k, v = (torch.randn(B, Hkv, L, E, generator=g).to(torch.bfloat16) for _ in range(2))
        grad = torch.randn(B, H, L, E, generator=g).to(torch.bfloat16)
        for mode in modes:
            backward = mode == "fwd+bwd"
            ins = [t.clone().requires_grad_(backward) for t in (q, k, v)]

            def step(attn):
                out = attn(*ins, is_causal=True, enable_gqa=Hkv != H)
                if backward:
                    out.backward(grad)

            fns = {"attnlab bf16 route": with_route("bf16", lambda: step(tiled.flash_attention)),
                   "attnlab fp32 route": with_route("fp32", lambda: step(tiled.flash_attention)),
                   "torch SDPA": lambda: step(F.scaled_dot_product_attention)}
            times: dict[str, list[float]] = {name: [] for name in fns}
            with torch.set_grad_enabled(backward):
                for fn in fns.values():
                    fn()  # warm-up
                for _ in range(repeats):
                    for name, fn in fns.items():
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
            torch_ms = statistics.median(times["torch SDPA"]) * 1e3
            for name, ts in times.items():
                ms = statistics.median(ts) * 1e3
                rows.append({"shape": (B, H, Hkv, L, E), "mode": mode, "impl": name, "ms": ms, "ratio": ms / torch_ms})
            done += 1
            if progress:
                progress(done, total, f"{(B, H, Hkv, L, E)} {mode}")
    return rows


def bf16_table(rows: list[dict]) -> str:
    lines = ["| (B, H, Hkv, L, E) | mode | implementation | ms | x torch bf16 |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['mode']} | {r['impl']} | {r['ms']:.1f} | {r['ratio']:.2f}x |")
    return "\n".join(lines)


def machine_line() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from attnlab.kernels import native as _native

    # the flags that choose code paths (attnlab's row passes, torch's and oneDNN's GEMMs)
    flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in _native.cpu_features()]
    return (f"{cpu} ({' '.join(flags) or 'no AVX2'}), {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, Python {sys.version.split()[0]}; {_native.status()}")


# --------------------------------------------------------------------------- #
# Building block masks (attnlab bench --block-mask)
# --------------------------------------------------------------------------- #

MASK_KINDS = ("causal", "sliding", "document", "prefix")
MASK_BUILDERS = ("attnlab, its own mod", "attnlab, a plain Python mod", "torch, compiled")
BLOCK_MASK_HEADER = ("Building a block mask (BLOCK_SIZE 128): attnlab's create_block_mask with its own mod "
                     "(block kinds from coordinates) and with the same mask as a plain Python mask_mod (every "
                     "element evaluated), against torch's create_block_mask(_compile=True), compile included (a fresh "
                     "inductor cache); each in a fresh process; sliding window L/8, documents of L/4, L/2, L/4, "
                     "prefix L/4")


def _mask_mods(kind: str, L: int):
    """(attnlab's own mod, the same as a plain Python mask_mod) for ``kind`` at length ``L``."""
    from attnlab import flex

    doc = flex.document_ids([L // 4, L // 2, L // 4])
    own = {"causal": flex.causal_mask, "sliding": flex.sliding_window(L // 8),
           "document": flex.document_mask(doc), "prefix": flex.prefix_lm(L // 4)}[kind]
    plain = {"causal": lambda b, h, q, k: q >= k,
             "sliding": lambda b, h, q, k: (q >= k) & (q - k < L // 8),
             "document": lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k),
             "prefix": lambda b, h, q, k: (k < L // 4) | (q >= k)}[kind]
    return own, plain


def _block_mask_child(argv: list[str]) -> None:
    import json

    builder, kind, L = argv[0], argv[1], int(argv[2])
    own, plain = _mask_mods(kind, L)
    if builder == "torch":
        from torch.nn.attention import flex_attention as torch_flex

        def build():
            return torch_flex.create_block_mask(plain, None, None, L, L, device="cpu", _compile=True)
    else:
        from attnlab import flex

        def build():
            return flex.create_block_mask(own if builder == "own" else plain, None, None, L, L)
    out = {}

    def timed():
        t0 = time.perf_counter()
        bm = build()
        out["seconds"] = time.perf_counter() - t0
        out["blocks"] = [int(bm.kv_num_blocks.sum()), int(bm.full_kv_num_blocks.sum())]
    out["peak"] = peak_rss_growth(timed)
    print(json.dumps(out))


def block_mask_benchmark(L: int, kinds=MASK_KINDS, progress: Optional[Callable[[int, int, str], None]] = None,
                         timeout_s: float = 900.0) -> list[dict]:
    """Seconds and peak memory growth of building each kind's block mask at length ``L``, per
    builder, each in a fresh process (so torch's compile and every allocation are counted)."""
    import json
    import tempfile

    rows, done = [], 0
    for kind in kinds:
        for name, builder in zip(MASK_BUILDERS, ("own", "plain", "torch")):
            with tempfile.TemporaryDirectory(prefix="attnlab-inductor-") as cache:
                # a fresh compile cache: torch compiles as on a first call (a warm cache measured
                # 5-6 s at L = 65536 against 10-14 s cold, 2026-12-01)
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                proc = subprocess.run([sys.executable, "-m", "attnlab.bench", "--block-mask-child", builder, kind,
                                       str(L)], capture_output=True, text=True, timeout=timeout_s, env=env)
            lines = proc.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
            rows.append({"L": L, "mask": kind, "builder": name, "seconds": result and result["seconds"],
                         "peak": result and result["peak"], "blocks": result and result["blocks"],
                         "error": None if result else (proc.stderr.strip().splitlines() or ["failed"])[-1]})
            done += 1
            if progress:
                progress(done, len(kinds) * len(MASK_BUILDERS), f"{kind} {builder}")
    return rows


def block_mask_table(rows: list[dict]) -> str:
    lines = ["| L | mask | builder | seconds | x torch compiled | peak +MiB | partial, full blocks |",
             "|---|---|---|---|---|---|---|"]
    torch_s = {r["mask"]: r["seconds"] for r in rows if r["builder"] == MASK_BUILDERS[2]}
    for r in rows:
        if r["seconds"] is None:
            lines.append(f"| {r['L']} | {r['mask']} | {r['builder']} | failed: {r['error']} | | | |")
            continue
        ratio = f"{r['seconds'] / torch_s[r['mask']]:.2f}x" if torch_s.get(r["mask"]) else ""
        lines.append(f"| {r['L']} | {r['mask']} | {r['builder']} | {r['seconds']:.2f} | {ratio} | "
                     f"{r['peak'] / 2**20:.0f} | {r['blocks'][0]}, {r['blocks'][1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peak-memory-child":
        _peak_memory_child(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--block-mask-child":
        _block_mask_child(sys.argv[2:])
    else:
        print("use `attnlab bench` (see `attnlab bench --help`)", file=sys.stderr)
        sys.exit(2)


RING_MASK_HEADER = ("Ring attention with masks: 2 ranks x 1 thread (gloo, 127.0.0.1), forward+backward, float32, "
                    "B = 1; causal is is_causal=True, the others a mask_mod over absolute positions (sliding: a "
                    "window of L/8; document: packed documents of L/4, L/2 - 3, L/4 + 3); fresh processes")


def ring_masks_benchmark(L: int, masks=("causal", "sliding", "document"), *, B: int = 1, H: int = 8, E: int = 64,
                         layout: str = "zigzag", world: int = 2) -> list[dict]:
    """Seconds and per-rank peak memory of the ring's forward+backward for each mask at length
    ``L`` (after a warm-up run), with the time as a share of the causal ring's in the same run."""
    from attnlab.cli.ring_ranks import run_ring

    rows = []
    for mask in masks:
        cfg = dict(B=B, H=H, L=L, E=E, causal=mask == "causal", layout=layout, threads=1, check=False, timeout=1800,
                   mask=None if mask == "causal" else mask)
        run_ring(world, {**cfg, "L": 2 * world * 64}, fresh=True)  # warm-up: spawn, gloo, kernels
        ring = run_ring(world, cfg, timeout_s=3600, fresh=True)
        errors = [r["error"] for r in ring if "error" in r]
        kv_mib = 2 * B * H * (L // world) * E * 4 / 2**20  # this rank's K and V
        rows.append({"L": L, "mask": mask, "layout": layout, "errors": errors,
                     "ring_s": max(r.get("time_s", float("nan")) for r in ring),
                     "ring_peak_mib": max(r.get("peak_extra_bytes", 0) for r in ring) / 2**20, "kv_mib": kv_mib})
    causal_s = next((r["ring_s"] for r in rows if r["mask"] == "causal"), None)
    for r in rows:
        r["x_causal"] = r["ring_s"] / causal_s if causal_s else float("nan")
    return rows


def ring_masks_table(rows: list[dict]) -> str:
    lines = ["| L | mask | layout | forward+backward s | x causal ring | peak +MiB per rank | its K, V MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["errors"]:
            lines.append(f"| {r['L']} | {r['mask']} | {r['layout']} | failed: {r['errors'][0]} | | | |")
            continue
        lines.append(f"| {r['L']} | {r['mask']} | {r['layout']} | {r['ring_s']:.2f} | {r['x_causal']:.2f}x | "
                     f"{r['ring_peak_mib']:.1f} | {r['kv_mib']:.1f} |")
    return "\n".join(lines)


def ring_benchmark(seq_lens: list[int], *, B: int = 1, H: int = 8, E: int = 64, causal: bool = False,
                   layout: str = "contiguous", world: int = 2) -> list[dict]:
    """``world`` ranks x 1 thread (ring attention, gloo on 127.0.0.1) against one process x
    ``world`` threads (the tiled path), forward+backward, float32, one run each after the
    ranks' own warm-up. Peak memory: each side's growth over its inputs, in fresh processes."""
    from attnlab.cli.ring_ranks import run_ring

    rows = []
    for L in seq_lens:
        cfg = dict(B=B, H=H, L=L, E=E, causal=causal, layout=layout, threads=1, check=False, timeout=1800)
        run_ring(world, {**cfg, "L": 2 * world * 8}, fresh=True)  # warm-up: spawn, gloo, kernels
        ring = run_ring(world, cfg, timeout_s=3600, fresh=True)  # fresh processes: their peak memory is the ring's
        errors = [r["error"] for r in ring if "error" in r]
        single = Config("tiled", L, "fwd+bwd", causal, "float32", B, H, E)
        previous = torch.get_num_threads()
        torch.set_num_threads(world)
        try:
            q, k, v, grad = _inputs(single, True)
            fn = _function("tiled")
            _step(fn, Config("tiled", 64, "fwd+bwd", causal, "float32", B, H, E), *_inputs(
                Config("tiled", 64, "fwd+bwd", causal, "float32", B, H, E), True))
            t0 = time.perf_counter()
            _step(fn, single, q, k, v, grad)
            single_s = time.perf_counter() - t0
        finally:
            torch.set_num_threads(previous)
        single_mem = measure_peak_memory(single)
        ring_s = max(r.get("time_s", float("nan")) for r in ring)
        rows.append({"L": L, "world": world, "layout": layout, "causal": causal, "ring_s": ring_s,
                     "single_s": single_s, "ratio": ring_s / single_s,
                     "ring_peak_mib": max(r.get("peak_extra_bytes", 0) for r in ring) / 2**20,
                     "single_peak_mib": (single_mem or 0) / 2**20,
                     "sent_mib_per_rank": max(r.get("bytes_sent", 0) for r in ring) / 2**20,
                     # the share of a rank's time spent blocked on messages (what compute did not hide)
                     "comm_wait_share": max(r.get("comm_wait_s", 0.0) / r["time_s"] for r in ring if "time_s" in r)
                     if not errors else float("nan"),
                     "errors": errors})
    return rows
