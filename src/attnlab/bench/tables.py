"""What ``attnlab bench`` prints and writes: Markdown tables, CSV, the plot, and the headers that
say what each table measured."""

from __future__ import annotations

import csv
from typing import Optional

import torch

from attnlab.bench.timing import Result

__all__ = [
    "ring_table", "RING_HEADER", "transformers_table", "density_table", "write_csv",
    "markdown_table", "plot", "DECODE_HEADER", "decode_table", "BF16_HEADER", "bf16_table",
    "MASK_KINDS", "MASK_BUILDERS", "BLOCK_MASK_HEADER", "block_mask_table", "RING_MASK_HEADER",
    "ring_masks_table",
]


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


COMPILE_HEADER = ("One training step (forward and backward) of a 2-block pre-norm decoder (d_model 512, 8 query "
                  "heads over 4 key/value heads, causal, MLP 4x) through attnlab's front door, eager against "
                  "torch.compile (Inductor, default mode); medians of interleaved rounds, the compilation apart.")


def compile_table(rows: list[dict]) -> str:
    """Markdown table of :func:`compile_benchmark`."""
    lines = ["| L | eager ms | compiled ms | x eager | compilation s |", "|---|---|---|---|---|"]
    lines += [f"| {r['L']} | {r['eager_ms']:.0f} | {r['compiled_ms']:.0f} | {r['ratio']:.2f} | {r['compile_s']:.1f} |"
              for r in rows]
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


def write_csv(results: list[Result], path: str) -> None:
    rows = [r.row() for r in results]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(results: list[Result], peaks: Optional[dict[str, tuple[str, Optional[float]]]] = None,
                   threads: int = 1) -> str:
    """The main bench's rows; with ``peaks`` (dtype name -> ``(name, GFLOP/s a thread)``, e.g.
    :func:`~attnlab.bench.machine.peaks_for`) each row's share of its dtype's peak on ``threads``
    threads, after a line naming the peaks."""
    peaks = peaks or {}
    lines = []
    measured = [f"{name} {value:.1f} GFLOP/s a thread ({dtype})" for dtype, (name, value) in peaks.items() if value]
    if measured:
        lines += [f"peaks measured in this run: {'; '.join(measured)}; shares on {threads} thread(s)", ""]
    head = ("| impl | L | mode | causal | dtype | median ms | GFLOP/s | share of peak | x torch best | peak +MiB "
            "| note |")
    lines += [head, "|" + "---|" * 11]
    for r in results:
        c, row = r.config, r.row()
        note = ("" if r.status == "ok" else r.status) or (f"{c.mask} mask" if c.mask != "none" else "")
        if r.compile_s is not None:
            note = f"{note}; compile {r.compile_s:.1f} s (not in the median)".lstrip("; ")
        peak = peaks.get(c.dtype, ("", None))[1]
        share = f"{100 * r.gflops / (peak * threads):.0f}%" if peak and r.gflops else "-"
        lines.append(f"| {c.impl} | {c.L} | {c.mode} | {'yes' if c.causal else 'no'} | {c.dtype} | {row['median_ms']} "
                     f"| {row['gflops']} | {share} | {row['ratio_vs_torch_best']} | {row['peak_mem_mib']} | {note} |")
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


DECODE_HEADER = ("Decoding: one step, q (B, H, L, E) against a cache k, v (B, Hkv, S, E); GB/s counts the "
                 "cache's unique K and V bytes once (what a step must read; int8: the rows and their float32 "
                 "scales), the share is of this machine's read bandwidth measured in the same run")


def decode_table(rows: list[dict]) -> str:
    peak = rows[0].get("peak_gb_s") if rows else None
    lines = ([f"read bandwidth, measured in this run: {peak:.1f} GB/s", ""] if peak else []) + [
        "| S | dtype | implementation | ms | x torch | GB/s (unique K/V) | share of read peak |",
        "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['S']} | {r['dtype']} | {r['impl']} | {r['ms']:.2f} | {r['ratio']:.2f}x | "
                     f"{r['gb_s']:.1f} | {100 * r['peak_share']:.0f}% |")
    return "\n".join(lines)


GEMM_HEADER = ("float32 GEMM routes (ATTNLAB_SGEMM, csrc/sgemm.h): the native kernels' tile products on one "
               "thread against the FMA peak of one thread, and the float32 attention on each route against "
               "torch's SDPA, same run")


def gemm_table(result: dict) -> str:
    peak = result["peak"]
    lines = [f"FMA peak, measured in this run: {peak:.1f} GFLOP/s per thread" if peak else
             "FMA peak: not measured (no C compiler, or no AVX2 + FMA)", "",
             "| product | (m, n, k) | route | us | GFLOP/s | share of FMA peak |", "|---|---|---|---|---|---|"]
    for r in result["tiles"]:
        share = f"{100 * r['gflops'] / peak:.0f}%" if peak else "-"
        lines.append(f"| {r['product']} | {r['mnk']} | {r['route']} | {r['us']:.1f} | {r['gflops']:.1f} | {share} |")
    threads = result["threads"]
    lines += ["", f"| (B, H, L, E) | mask | mode | implementation | ms | x torch | GFLOP/s | share of FMA peak "
                  f"x {threads} threads |", "|---|---|---|---|---|---|---|---|"]
    for r in result["attention"]:
        share = f"{100 * r['gflops'] / (peak * threads):.0f}%" if peak else "-"
        lines.append(f"| {r['shape']} | {'causal' if r['causal'] else 'none'} | {r['mode']} | {r['impl']} | "
                     f"{r['ms']:.1f} | {r['ratio']:.2f}x | {r['gflops']:.0f} | {share} |")
    return "\n".join(lines)


PEERS_HEADER = ("Peers: float32 forward of torch's SDPA, attnlab's tiled path, OpenVINO's ScaledDotProductAttention "
                "and ONNX Runtime's Attention (opset 23) and MultiHeadAttention (com.microsoft, inputs laid out "
                "(B, L, H*E) before the timing), on torch's threads, interleaved in one run; 'max err' is each "
                "output's distance to a float64 SDPA")


def peers_table(result: dict) -> str:
    peak, threads = result.get("peak"), result.get("threads", 1)
    lines = ([f"FMA peak, measured in this run: {peak:.1f} GFLOP/s a thread; shares on {threads} thread(s)", ""]
             if peak else [])
    lines += ["| (B, H, L, E) | mask | implementation | ms | x torch | GFLOP/s | share of FMA peak | max err |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        share = f"{100 * r['gflops'] / (peak * threads):.0f}%" if peak else "-"
        lines.append(f"| {r['shape']} | {'causal' if r['causal'] else 'none'} | {r['impl']} | {r['ms']:.1f} | "
                     f"{r['ratio']:.2f}x | {r['gflops']:.0f} | {share} | {r['max_err']:.1e} |")
    for name, how in result["missing"].items():
        lines.append(f"\nnot installed, so not timed: {name} ({how})")
    return "\n".join(lines)


BF16_HEADER = ("bfloat16: attnlab's tiled path on its bf16 route (bf16 GEMMs, csrc/bf16_gemm.h) and on its fp32 "
               "route (inputs converted to float32), against torch's SDPA in bfloat16, same run")


def bf16_table(rows: list[dict]) -> str:
    lines = []
    if rows and rows[0].get("peak_share") is not None:
        r = rows[0]
        lines += [f"{r['peak_name']}, measured in this run: {r['peak']:.1f} GFLOP/s a thread; shares on "
                  f"{r['threads']} thread(s)", ""]
    lines += ["| (B, H, Hkv, L, E) | causal | mode | implementation | ms | x torch bf16 | GFLOP/s | share of peak |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        causal = "yes" if r.get("causal", True) else "no"
        share = f"{100 * r['peak_share']:.0f}%" if r.get("peak_share") is not None else "-"
        lines.append(f"| {r['shape']} | {causal} | {r['mode']} | {r['impl']} | {r['ms']:.1f} | {r['ratio']:.2f}x | "
                     f"{r['gflops']:.0f} | {share} |")
    return "\n".join(lines)


MASK_KINDS = ("causal", "sliding", "document", "prefix")

MASK_BUILDERS = ("attnlab, its own mod", "attnlab, a plain Python mod", "torch, compiled")

BLOCK_MASK_HEADER = ("Building a block mask (BLOCK_SIZE 128): attnlab's create_block_mask with its own mod "
                     "(block kinds from coordinates) and with the same mask as a plain Python mask_mod (every "
                     "element evaluated), against torch's create_block_mask(_compile=True), compile included (a fresh "
                     "inductor cache); each in a fresh process; sliding window L/8, documents of L/4, L/2, L/4, "
                     "prefix L/4")


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


RING_MASK_HEADER = ("Ring attention with masks: 2 ranks x 1 thread (gloo, 127.0.0.1), forward+backward, float32, "
                    "B = 1; causal is is_causal=True, the others a mask_mod over absolute positions (sliding: a "
                    "window of L/8; document: packed documents of L/4, L/2 - 3, L/4 + 3); fresh processes")


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
