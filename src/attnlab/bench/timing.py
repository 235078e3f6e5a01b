"""The timed runs of ``attnlab bench``: configurations, the implementations they call, their
inputs and masks, and :func:`run_benchmarks`, which interleaves implementations so a noisy
neighbour slows all of them alike (the package's docstring says how)."""

from __future__ import annotations

import itertools
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from attnlab.bench.memory import peak_rss_growth

__all__ = [
    "IMPLS", "TORCH_IMPLS", "DTYPES", "Config", "Result", "MASKS", "VARIANTS", "parse_mask",
    "run_benchmarks", "estimate_seconds", "format_duration", "measure_peak_memory",
    # package-internal, for the suites and the child processes
    "impl_function", "make_inputs", "run_step", "peak_memory_child", "interleaved_medians",
]

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
        if self.impl in ("tiled", "sinks", "flash"):
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


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each of ``fns``: one warm-up call each, then ``repeats`` rounds that call
    them in turn, so that a noisy neighbour slows all of them alike (the suites' one timing loop).
    Each round takes its own order (shuffled, seeded by the round): in one fixed order a function
    always ran after the same one, and the decode bench's first row, always after the reference's
    gigabyte of temporaries (the cache's page tables cold), measured 5-15% slower than another row
    running the same kernel (Zen 4, 2026-12-05)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats):
        for name in random.Random(round_).sample(list(fns), len(fns)):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _fmt(x: Optional[float], digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def impl_function(impl: str, c: Optional["Config"] = None) -> Callable:
    """``fn(q, k, v, causal, mask)`` running implementation ``impl`` (``c``: its block mask, if any)."""
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
    if impl == "sinks":  # the tiled path with attention sinks (gradient included): their cost beside "tiled"
        from attnlab.tiled import flash_attention

        def run_sinks(q, k, v, causal, mask):
            sinks = torch.zeros(q.shape[1], dtype=q.dtype, requires_grad=q.requires_grad)  # (H,)
            return flash_attention(q, k, v, mask, is_causal=causal, sinks=sinks)

        return run_sinks
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as torch_sdpa

    backend = SDPBackend.MATH if impl == "math" else SDPBackend.FLASH_ATTENTION

    def run(q, k, v, causal, mask):
        with sdpa_kernel(backends=[backend]):  # exactly this backend: an error, never a fallback
            return torch_sdpa(q, k, v, attn_mask=mask, is_causal=causal)

    return run


def make_inputs(c: Config, requires_grad: bool, seed: int = 0):
    """Seeded ``q, k, v (B, H, L, E)`` and the output gradient for ``c``, in its dtype."""
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


def run_step(fn: Callable, c: Config, q, k, v, grad) -> None:
    """One timed step: the forward, and the backward for ``fwd+bwd``."""
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
        q, k, v, grad = make_inputs(group[0].config, mode == "fwd+bwd")
        fns = {}
        for r in live:
            if progress:
                progress(done, total, f"warm-up {r.config.impl} L={L} {mode} {'causal' if causal else ''} {dtype}")
            try:
                fns[r.config.impl] = impl_function(r.config.impl, r.config)
                if r.config.impl == "torchflex":  # the first call compiles: timed apart, never in the median
                    t0 = time.perf_counter()
                    run_step(fns[r.config.impl], r.config, q, k, v, grad)
                    r.compile_s = time.perf_counter() - t0
                for _ in range(warmup):
                    run_step(fns[r.config.impl], r.config, q, k, v, grad)
            except Exception as exc:  # e.g. a backend that does not support this dtype
                r.status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        live = [r for r in live if r.status == "ok"]
        for rep in range(repeats):
            for r in live:  # interleaved: each round times every implementation once
                t0 = time.perf_counter()
                run_step(fns[r.config.impl], r.config, q, k, v, grad)
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
_EST_GFLOPS = {"tiled": 120.0, "sinks": 120.0, "flash": 120.0, "flex": 100.0, "torchflex": 100.0, "reference": 25.0, "math": 25.0}

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


def peak_memory_child(argv: list[str]) -> None:
    """Entry point of the fresh process :func:`measure_peak_memory` starts (``python -m attnlab.bench
    --peak-memory-child IMPL L MODE CAUSAL DTYPE B H E MASK``): prints one step's peak RSS growth."""
    impl, L, mode, causal, dtype, B, H, E, mask = argv
    c = Config(impl, int(L), mode, bool(int(causal)), dtype, int(B), int(H), int(E), mask)
    small = Config(impl, 16, mode, c.causal, dtype, c.B, c.H, c.E, mask)
    run_step(impl_function(impl, small), small, *make_inputs(small, mode == "fwd+bwd"))  # allocators and kernels warmed up
    fn = impl_function(impl, c)  # a block mask is built here, before the baseline, as the timed runs do
    q, k, v, grad = make_inputs(c, mode == "fwd+bwd")
    if impl != "flex":  # the dense mask is an input of the other calls, not part of their peak
        _mask(c)
    print(peak_rss_growth(lambda: run_step(fn, c, q, k, v, grad)))
