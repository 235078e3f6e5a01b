"""The special-purpose suites of ``attnlab bench``: block-mask density, whole transformers
models, decoding, bf16, block-mask construction, and the ring (with and without masks)."""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import torch

from attnlab.bench.machine import compute_peak, fma_peak, read_bandwidth
from attnlab.bench.memory import peak_rss_growth
from attnlab.bench.tables import MASK_BUILDERS, MASK_KINDS
from attnlab.bench.timing import Config, impl_function, interleaved_medians, make_inputs, measure_peak_memory, run_step

__all__ = [
    "block_mask_child",  # package-internal: the child process of block_mask_benchmark
    "DENSITIES", "density_sweep", "HF_CASES", "transformers_benchmark", "decode_benchmark",
    "BF16_SHAPES", "bf16_benchmark", "block_mask_benchmark", "ring_masks_benchmark",
    "ring_benchmark", "gemm_benchmark",
]

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
        q, k, v, grad = make_inputs(c, mode == "fwd+bwd")
        fns = {"full": lambda q, k, v, causal, mask: flex_attention(q, k, v)}
        for name, bm in masks.items():
            fns[name] = lambda q, k, v, causal, mask, bm=bm: flex_attention(q, k, v, block_mask=bm)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for fn in fns.values():
            run_step(fn, c, q, k, v, grad)  # warm-up
        for rep in range(repeats):
            for name, fn in fns.items():  # interleaved, as run_benchmarks
                t0 = time.perf_counter()
                run_step(fn, c, q, k, v, grad)
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


COMPILE_LENS = (1024, 4096)


def compile_benchmark(seq_lens=COMPILE_LENS, *, B: int = 1, d_model: int = 512, heads: int = 8, kv_heads: int = 4,
                      layers: int = 2, repeats: int = 3,
                      progress: Optional[Callable[[int, int, str], None]] = None) -> list[dict]:
    """One training step (forward and backward) of a small pre-norm decoder, eager against
    ``torch.compile`` (Inductor, default mode), both through attnlab's front door.

    The model: ``layers`` blocks of LayerNorm, :class:`attnlab.modules.MultiHeadAttention`
    (``heads`` query heads, ``kv_heads`` key/value heads, causal) and an MLP of 4 x ``d_model``,
    with residuals. The compiled model's first step (its compilation) is reported apart
    (``compile_s``); then the two are timed in interleaved rounds after one untimed step each.
    Returns dicts ``L, eager_ms, compiled_ms, ratio, compile_s``."""
    from torch import nn

    from attnlab.modules import MultiHeadAttention

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.attn = MultiHeadAttention(d_model, heads, num_kv_heads=kv_heads)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

        def forward(self, x):  # x: (B, L, d_model)
            x = x + self.attn(self.n1(x), is_causal=True)[0]
            return x + self.mlp(self.n2(x))

    rows, steps, done = [], len(seq_lens) * (repeats + 1), 0
    for L in seq_lens:
        torch.manual_seed(0)
        model = nn.Sequential(*(Block() for _ in range(layers)))
        x = torch.randn(B, L, d_model, generator=torch.Generator().manual_seed(L))
        compiled = torch.compile(model)

        def step(m) -> float:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            m(x).square().mean().backward()
            return time.perf_counter() - t0

        compile_s = step(compiled)  # the first call compiles (forward and backward graphs)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for rep in range(repeats + 1):
            for name, m in (("eager", model), ("compiled", compiled)):
                t = step(m)
                if rep:  # the first round warms up
                    times[name].append(t)
            done += 1
            if progress:
                progress(done, steps, f"compile L={L}")
        eager_ms, compiled_ms = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
        rows.append({"L": L, "eager_ms": eager_ms, "compiled_ms": compiled_ms, "ratio": compiled_ms / eager_ms,
                     "compile_s": compile_s})
    return rows


def _forced(fn: Callable, **switches: str) -> Callable:
    """``fn`` run with some route switches forced (:func:`attnlab.kernels.routes.forced`)."""
    from attnlab.kernels import routes

    def run():
        with routes.forced(**switches):
            return fn()
    return run


def _bf16_scores_on_vdpbf16ps(E: int) -> bool:
    """Whether a bf16 cache's scores take ``vdpbf16ps`` here (:func:`attnlab.kernels.decode.bf16_dot`):
    the decode bench then adds a row with them widened."""
    from attnlab.kernels import decode as kernel_decode

    return kernel_decode.bf16_dot(E, "stream") == "vdpbf16ps"


def decode_benchmark(seq_lens: list[int], *, dtypes=("float32", "bfloat16"), B: int = 1, H: int = 32, Hkv: int = 8,
                     E: int = 128, L: int = 1, repeats: int = 10, page_size: int = 16,
                     progress: Optional[Callable[[int, int, str], None]] = None) -> list[dict]:
    """Median time of one decode step per implementation, interleaved run by run
    (:func:`~attnlab.bench.timing.interleaved_medians`), with the
    achieved bandwidth in unique K/V bytes (scales included for int8) and its share of this
    machine's read bandwidth (:func:`read_bandwidth`, measured in the same run).

    The implementations: attnlab's front door (``auto``: the decode path), its decode kernel
    with each inner loop forced (``ATTNLAB_DECODE=stream`` / ``gemm``), a
    :class:`~attnlab.decoding.PagedKVCache` of ``page_size``-token pages, the int8 caches (dense
    and paged; dense also with the key dot products widened to float32, ``ATTNLAB_INT8_DOT``,
    against the default integer ones), the decode kernel on a copy of the cache on huge pages where
    Linux offers them and the cache fills one (:mod:`attnlab.kernels.memory`: where attnlab's own
    caches are), on a CPU whose bf16 route takes ``vdpbf16ps`` for a bf16
    cache's dot products (:func:`attnlab.kernels.decode.bf16_dot`) the streaming loop with them
    widened to float32 as well (``ATTNLAB_BF16=fp32``), its tiled path, and torch's SDPA, as called
    and with the GQA group folded into the query rows (``(B, Hkv, r * L, E)``: one K/V read per
    group, torch's best form). ``L > 1`` is a causal chunk (speculative decoding, chunked
    prefill): bottom-right aligned, given to torch as ``masks.causal(..., align="bottom_right")``
    (SDPA's ``is_causal`` is top-left)."""
    import torch.nn.functional as F

    from attnlab import decoding, dispatch, masks
    from attnlab.kernels import memory as cache_memory
    from attnlab.kernels import routes

    rows, done, total = [], 0, len(seq_lens) * len(dtypes)
    peak = read_bandwidth()
    r = H // Hkv
    for S in seq_lens:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            g = torch.Generator().manual_seed(S)
            q = torch.randn(B, H, L, E, generator=g).to(dtype)
            k = torch.randn(B, Hkv, S, E, generator=g).to(dtype)
            v = torch.randn(B, Hkv, S, E, generator=g).to(dtype)
            mask = masks.causal(L, S, align="bottom_right") if L > 1 else None
            folded = q.view(B, Hkv, r * L, E) if L == 1 else None  # (B, Hkv, r, E): the group as rows
            paged = decoding.PagedKVCache(B, Hkv, E, page_size=page_size, dtype=dtype)
            paged.append(k, v)
            paged8 = decoding.PagedKVCache(B, Hkv, E, page_size=page_size, dtype=torch.int8)
            paged8.append(k, v)
            (k8, ks), (v8, vs) = decoding.quantize(k), decoding.quantize(v)
            # the same cache where attnlab's own caches put it: on huge pages (attnlab.kernels.memory),
            # where the kernel offers them and the cache fills one
            huge = (cache_memory.huge_pages_offered() is not None and routes.settings().huge_pages != "off"
                    and k.nbytes >= cache_memory.HUGE_PAGE)
            kh, vh = (cache_memory.cache_empty(t.shape, t.dtype).copy_(t) for t in (k, v)) if huge else (k, v)
            step = {"is_causal": L > 1, "causal_align": "bottom_right"}

            def decode(k_=k, v_=v, **kw):
                return decoding.decode_attention(q, k_, v_, enable_gqa=True, **step, **kw)

            fns = {"attnlab (auto: decode)": lambda: dispatch.attention(q, k, v, enable_gqa=True, **step),
                   "attnlab decode: stream": _forced(decode, decode="stream"),
                   # the same with a bf16 cache's dot products widened, where they take vdpbf16ps
                   **({"attnlab decode: stream, float32 dots": _forced(
                       decode, bf16="fp32", decode="stream")}
                      if dtype == torch.bfloat16 and _bf16_scores_on_vdpbf16ps(E) else {}),
                   **({"attnlab decode: cache on huge pages": lambda: decode(kh, vh)} if huge else {}),
                   "attnlab decode: gemm": _forced(decode, decode="gemm"),
                   f"attnlab paged ({page_size})": lambda: decoding.paged_decode_attention(q, paged, **step),
                   "attnlab int8": lambda: decode(k8, v8, k_scale=ks, v_scale=vs),
                   "attnlab int8: float32 dots": _forced(
                       lambda: decode(k8, v8, k_scale=ks, v_scale=vs), int8_dot="float32"),
                   f"attnlab int8 paged ({page_size})": lambda: decoding.paged_decode_attention(q.float(), paged8,
                                                                                                **step),
                   "attnlab tiled": lambda: dispatch.attention(q, k, v, mask, enable_gqa=True, impl="tiled"),
                   "torch SDPA": lambda: F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)}
            if folded is not None:
                fns["torch SDPA (GQA folded)"] = lambda: F.scaled_dot_product_attention(folded, k, v)
            if S <= 32768:  # the reference materialises repeated K and V: minutes past that
                fns["attnlab reference"] = lambda: dispatch.attention(q, k, v, mask, enable_gqa=True,
                                                                      impl="reference")
            with torch.no_grad():
                medians = interleaved_medians(fns, repeats)
            kv_bytes = 2 * B * Hkv * S * E * torch.finfo(dtype).bits // 8
            int8_bytes = 2 * B * Hkv * S * (E + 4)  # int8 rows and a float32 scale per row
            torch_ms = medians["torch SDPA"] * 1e3
            for name, seconds in medians.items():
                ms = seconds * 1e3
                gb_s = (int8_bytes if "int8" in name else kv_bytes) / (ms / 1e3) / 1e9
                rows.append({"S": S, "dtype": dtype_name, "impl": name, "ms": ms, "ratio": ms / torch_ms,
                             "gb_s": gb_s, "peak_share": gb_s / peak, "peak_gb_s": peak})
            done += 1
            if progress:
                progress(done, total, f"S={S} {dtype_name}")
    return rows


# issue 24's bf16 shapes: (B, H, Hkv, L, E); the last one grouped (GQA)
BF16_SHAPES = ((1, 8, 8, 4096, 64), (2, 16, 16, 2048, 128), (1, 32, 8, 4096, 128))


def bf16_benchmark(shapes=BF16_SHAPES, *, modes=("fwd", "fwd+bwd"), repeats: int = 3, causals=(True,),
                   progress: Optional[Callable[[int, int, str], None]] = None) -> list[dict]:
    """Median time per (shape, causal, mode) of ``attnlab.flash_attention`` on bfloat16 inputs with
    ``ATTNLAB_BF16=bf16`` and ``=fp32``, and of torch's SDPA, interleaved run by run, each with its
    GFLOP/s (the GEMMs' flops) and their share of this machine's bf16 peak on torch's threads
    (:func:`~attnlab.bench.machine.compute_peak`, measured in the same run)."""
    import torch.nn.functional as F

    from attnlab import tiled

    def with_route(route: str, fn: Callable) -> Callable:
        return _forced(fn, bf16=route)

    rows, done, total = [], 0, len(shapes) * len(modes) * len(causals)
    peak_name, peak = compute_peak(torch.bfloat16)  # one thread's, measured in this run
    threads = torch.get_num_threads()
    for (B, H, Hkv, L, E), causal in itertools.product(shapes, causals):
        g = torch.Generator().manual_seed(L)
        q = torch.randn(B, H, L, E, generator=g).to(torch.bfloat16)
        k, v = (torch.randn(B, Hkv, L, E, generator=g).to(torch.bfloat16) for _ in range(2))
        grad = torch.randn(B, H, L, E, generator=g).to(torch.bfloat16)
        for mode in modes:
            backward = mode == "fwd+bwd"
            ins = [t.clone().requires_grad_(backward) for t in (q, k, v)]

            def step(attn):
                out = attn(*ins, is_causal=causal, enable_gqa=Hkv != H)
                if backward:
                    out.backward(grad)

            fns = {"attnlab bf16 route": with_route("bf16", lambda: step(tiled.flash_attention)),
                   "attnlab fp32 route": with_route("fp32", lambda: step(tiled.flash_attention)),
                   "torch SDPA": lambda: step(F.scaled_dot_product_attention)}
            with torch.set_grad_enabled(backward):
                medians = interleaved_medians(fns, repeats)
            torch_ms = medians["torch SDPA"] * 1e3
            # the GEMMs' flops: S = Q K^T and P V forward; the backward recomputes S and adds dV, dP,
            # dQ and dK (7 GEMMs in all, 3.5x the forward's); causal half of each
            flops = 4 * B * H * L * L * E * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
            for name, sec in medians.items():
                ms = sec * 1e3
                gflops = flops / sec / 1e9
                rows.append({"shape": (B, H, Hkv, L, E), "causal": causal, "mode": mode, "impl": name, "ms": ms,
                             "ratio": ms / torch_ms, "gflops": gflops, "peak_name": peak_name, "peak": peak,
                             "threads": threads, "peak_share": gflops / (peak * threads) if peak else None})
            done += 1
            if progress:
                progress(done, total, f"{(B, H, Hkv, L, E)} {'causal' if causal else 'full'} {mode}")
    return rows


def _gemm_products(E: int, block: int = 256) -> list[tuple[str, bool, bool, int, int, int]]:
    """The tile products of the native kernels at the default tiles (dense.DEFAULT_BLOCK_Q/K):
    (name, A transposed, B transposed, m, n, k)."""
    return [("S = Q K^T, dP = dO V^T", False, True, block, block, E),
            ("acc += P V, dQ += dS K", False, False, block, E, block),
            ("dV += P^T dO, dK += dS^T Q", True, False, block, E, block)]


def gemm_benchmark(*, E: int = 64, L: int = 4096, H: int = 8, repeats: int = 5,
                   progress: Optional[Callable[[int, int, str], None]] = None) -> dict:
    """The float32 GEMM routes (``ATTNLAB_SGEMM``, csrc/sgemm.h) against the FMA peak, same run.

    ``tiles``: GFLOP/s of each tile product on one thread, each route this build has, interleaved
    (the median of ``repeats`` rounds of ~20 ms each). ``attention``: the causal and full float32
    forward and forward+backward at ``(1, H, L, E)`` on each route and torch's SDPA, interleaved,
    on torch's threads. ``peak``: one thread's FMA peak (:func:`fma_peak`) and the thread count.
    """
    import torch.nn.functional as F

    from attnlab import tiled
    from attnlab.kernels import native as _native

    ops = _native.ops()
    if ops is None:
        raise RuntimeError(f"the native kernels are not in use: {_native.status()}")
    routes = _native.sgemm_routes_built()
    routes = [r for r in routes if r != "avx512-emulated"]  # a test route: correct, slow by design
    threads = torch.get_num_threads()
    products = _gemm_products(E)
    total, done = len(products) + 4, 0
    tiles = []
    torch.set_num_threads(1)  # one task's product runs on one thread; MKL would spread a lone call
    try:
        for name, ta, tb, m, n, k in products:
            g = torch.Generator().manual_seed(m + n + k)
            a = torch.randn(*((k, m) if ta else (m, k)), generator=g)
            b = torch.randn(*((n, k) if tb else (k, n)), generator=g)
            c = torch.zeros(m, n)
            calls = max(1, int(0.02 / (2 * m * n * k / 60e9)))  # ~20 ms a round at 60 GFLOP/s

            def run(code: int) -> float:
                t0 = time.perf_counter()
                for _ in range(calls):
                    ops.tile_gemm_(a, b, c, ta, tb, 1.0, 0.0, code)
                return time.perf_counter() - t0

            times: dict[str, list[float]] = {r: [] for r in routes}
            for r in routes:
                run(_native.SGEMM_CODES[r])  # warm-up
            for _ in range(repeats):
                for r in routes:
                    times[r].append(run(_native.SGEMM_CODES[r]))
            for r in routes:
                sec = statistics.median(times[r]) / calls
                tiles.append({"product": name, "mnk": (m, n, k), "route": r, "us": sec * 1e6,
                              "gflops": 2 * m * n * k / sec / 1e9})
            done += 1
            if progress:
                progress(done, total, name)
        peak = fma_peak()
    finally:
        torch.set_num_threads(threads)
    attention = []
    g = torch.Generator().manual_seed(L)
    q, k_, v = (torch.randn(1, H, L, E, generator=g) for _ in range(3))
    grad = torch.randn(1, H, L, E, generator=g)
    for causal in (False, True):
        for mode in ("fwd", "fwd+bwd"):
            backward = mode == "fwd+bwd"
            ins = [t.clone().requires_grad_(backward) for t in (q, k_, v)]

            def step(attn, causal=causal, backward=backward, ins=ins):
                with torch.set_grad_enabled(backward):
                    out = attn(*ins, is_causal=causal)
                    if backward:
                        out.backward(grad)

            fns = {f"attnlab, {r}": _forced(lambda: step(tiled.flash_attention), sgemm=r) for r in routes}
            fns["torch SDPA"] = lambda: step(F.scaled_dot_product_attention)
            medians = interleaved_medians(fns, repeats)
            torch_ms = medians["torch SDPA"] * 1e3
            flops = 4 * L * L * E * H * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
            for name, sec in medians.items():
                ms = sec * 1e3
                attention.append({"shape": (1, H, L, E), "causal": causal, "mode": mode, "impl": name, "ms": ms,
                                  "ratio": ms / torch_ms, "gflops": flops / ms / 1e6})
            done += 1
            if progress:
                progress(done, total, f"attention {'causal' if causal else 'full'} {mode}")
    return {"tiles": tiles, "attention": attention, "peak": peak, "threads": threads}


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


def block_mask_child(argv: list[str]) -> None:
    """Entry point of the fresh process :func:`block_mask_benchmark` starts (``python -m attnlab.bench
    --block-mask-child BUILDER KIND L``): builds one block mask from cold and prints its time and peak."""
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


def ring_masks_benchmark(L: int, masks=("causal", "sliding", "document"), *, B: int = 1, H: int = 8, E: int = 64,
                         layout: str = "zigzag", world: int = 2) -> list[dict]:
    """Seconds and per-rank peak memory of the ring's forward+backward for each mask at length
    ``L`` (after a warm-up run), with the time as a share of the causal ring's in the same run."""
    from attnlab.bench.ranks import run_ring

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


def ring_benchmark(seq_lens: list[int], *, B: int = 1, H: int = 8, E: int = 64, causal: bool = False,
                   layout: str = "contiguous", world: int = 2) -> list[dict]:
    """``world`` ranks x 1 thread (ring attention, gloo on 127.0.0.1) against one process x
    ``world`` threads (the tiled path), forward+backward, float32, one run each after the
    ranks' own warm-up. Peak memory: each side's growth over its inputs, in fresh processes."""
    from attnlab.bench.ranks import run_ring

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
            q, k, v, grad = make_inputs(single, True)
            fn = impl_function("tiled")
            run_step(fn, Config("tiled", 64, "fwd+bwd", causal, "float32", B, H, E), *make_inputs(
                Config("tiled", 64, "fwd+bwd", causal, "float32", B, H, E), True))
            t0 = time.perf_counter()
            run_step(fn, single, q, k, v, grad)
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
