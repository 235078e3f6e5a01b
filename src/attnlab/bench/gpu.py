"""``attnlab bench --device cuda``: attnlab's Triton kernels (:mod:`attnlab.triton`) against
torch's SDPA on its FLASH_ATTENTION backend and ``torch.compile``-d flex_attention, timed in
the same run on one GPU.

Each configuration (length, forward or forward+backward, causal or not, dtype) warms every
implementation up (compiling it), then times interleaved rounds with CUDA events (attnlab,
torch flash, torch flex, attnlab, ...) and reports the median, TFLOP/s and the ratio to
torch's flash backend. Nothing here runs without a CUDA device: on a CPU the kernels are tested
under Triton's interpreter (tests/kernels/test_triton.py), which says nothing about speed.
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

import torch

__all__ = ["GPU_IMPLS", "GPU_HEADER", "why_no_gpu", "gpu_benchmark", "gpu_table"]

GPU_IMPLS = ("attnlab-triton", "torch-flash", "torch-flex")
GPU_HEADER = ("attnlab.triton against torch SDPA (FLASH_ATTENTION backend) and compiled flex_attention, "
              "q, k, v (B, H, L, E); median of interleaved rounds timed with CUDA events; x flash: time "
              "against torch's flash backend in the same run (below 1: attnlab is faster)")


def why_no_gpu() -> Optional[str]:
    """Why the GPU suite cannot run here (None when it can)."""
    if not torch.cuda.is_available():
        return ("no CUDA device here (torch.cuda.is_available() is False): the GPU suite needs one; on a CPU, "
                "attnlab.triton is tested under TRITON_INTERPRET=1 and timed by nothing")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: pip install 'attnlab[triton]'"
    return None


def _impl(name: str, causal: bool) -> Callable:
    if name == "attnlab-triton":
        from attnlab import triton as at

        return lambda q, k, v: at.flash_attention(q, k, v, is_causal=causal)
    if name == "torch-flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        def flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return sdpa(q, k, v, is_causal=causal)

        return flash
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    masks: dict = {}

    def flex(q, k, v):
        if not causal:
            return compiled(q, k, v)
        key = (q.shape[-2], k.shape[-2])
        if key not in masks:
            masks[key] = create_block_mask(lambda b, h, i, j: j <= i, None, None, *key, device=q.device)
        return compiled(q, k, v, block_mask=masks[key])

    return flex


def _time_ms(fn: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def gpu_benchmark(seq_lens: list[int], *, dtypes=("bfloat16", "float16"), modes=("fwd", "fwd+bwd"),
                  causals=(False, True), B: int = 4, H: int = 16, E: int = 64, repeats: int = 10,
                  impls=GPU_IMPLS, progress: Optional[Callable[[int, int, str], None]] = None) -> list[dict]:
    """One row per (L, mode, causal, dtype, implementation): ``ms`` (median), ``tflops``,
    ``x_flash`` (against torch-flash's median in the same configuration).

    Raises:
        RuntimeError: no CUDA device, or triton missing (:func:`why_no_gpu` says which).
    """
    why = why_no_gpu()
    if why:
        raise RuntimeError(f"attnlab bench --device cuda: {why}")
    rows = []
    configs = [(L, m, c, d) for L in seq_lens for m in modes for c in causals for d in dtypes]
    for n, (L, mode, causal, dtype) in enumerate(configs):
        if progress:
            progress(n, len(configs), f"L={L} {mode} causal={causal} {dtype}")
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (B, H, L, E)
        q, k, v = (torch.randn(shape, generator=g, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
        grad = torch.randn_like(q)
        backward = mode == "fwd+bwd"
        for t in (q, k, v):
            t.requires_grad_(backward)
        fns = {name: _impl(name, causal) for name in impls}

        def step(fn):
            def run():
                out = fn(q, k, v)
                if backward:
                    torch.autograd.grad(out, (q, k, v), grad)
            return run

        times: dict[str, list[float]] = {name: [] for name in impls}
        for name, fn in fns.items():  # warm-up: compiles and autotunes
            for _ in range(2):
                step(fn)()
        torch.cuda.synchronize()
        for _ in range(repeats):
            for name, fn in fns.items():
                times[name].append(_time_ms(step(fn)))
        # the forward's two GEMMs are 2 * 2 * L * L * E flops per head (half of it causal); the
        # backward's five are 2.5 times the forward's: FlashAttention-2's own count
        flops = 4 * B * H * L * L * E * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
        flash = statistics.median(times["torch-flash"]) if "torch-flash" in times else None
        for name in impls:
            ms = statistics.median(times[name])
            rows.append({"L": L, "mode": mode, "causal": causal, "dtype": dtype, "impl": name, "ms": ms,
                         "tflops": flops / ms / 1e9, "x_flash": ms / flash if flash else None})
    if progress:
        progress(len(configs), len(configs), "done")
    return rows


def gpu_table(rows: list[dict], device: str = "") -> str:
    """The rows as a Markdown table, the GPU named in the first line."""
    lines = [f"GPU: {device}", "", "| L | mode | causal | dtype | impl | ms | TFLOP/s | x flash |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x = f"{r['x_flash']:.2f}" if r.get("x_flash") is not None else "-"
        lines.append(f"| {r['L']} | {r['mode']} | {'yes' if r['causal'] else 'no'} | {r['dtype']} | {r['impl']} | "
                     f"{r['ms']:.3f} | {r['tflops']:.1f} | {x} |")
    return "\n".join(lines)
