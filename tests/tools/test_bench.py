"""attnlab bench on tiny sizes: every implementation runs, the numbers are consistent, files are written."""

import csv

import pytest
import torch

from attnlab import bench
from attnlab.bench import timing
from attnlab.cli import main

pytestmark = [pytest.mark.subprocess]


def test_run_small_matrix(tmp_path):
    results = bench.run_benchmarks([32, 48], list(bench.IMPLS), ["fwd", "fwd+bwd"], [False, True], ["float32"],
                                   B=1, H=2, E=16, repeats=2, warmup=1, memory=False)
    assert len(results) == 2 * 2 * 2 * 4
    for r in results:
        assert r.status == "ok", r.status
        assert len(r.times_s) == 2 and r.median_s > 0 and r.gflops > 0
    for key in {(r.config.L, r.config.mode, r.config.causal) for r in results}:
        group = [r for r in results if (r.config.L, r.config.mode, r.config.causal) == key]
        torch_best = min(r.ratio_vs_torch_best for r in group if r.config.impl in bench.TORCH_IMPLS)
        assert torch_best == pytest.approx(1.0)
    path = tmp_path / "b.csv"
    bench.write_csv(results, str(path))
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(results) and {"impl", "median_ms", "gflops", "ratio_vs_torch_best"} <= set(rows[0])
    table = bench.markdown_table(results)
    assert table.count("\n") == len(results) + 1


def test_flops_and_memory_budget():
    c = bench.Config("tiled", 4096, "fwd", False, "float32")
    assert c.flops() == 4 * 8 * 4096 * 4096 * 64
    assert bench.Config("tiled", 4096, "fwd+bwd", True, "float32").flops() == c.flops() / 2 * 3.5
    results = bench.run_benchmarks([16384], ["reference"], ["fwd"], [False], ["float32"], repeats=1, memory=False,
                                   max_memory_gb=1)
    assert results[0].status.startswith("skipped: needs ~") and not results[0].times_s


def test_peak_memory_child_reports_growth():
    small = bench.measure_peak_memory(bench.Config("reference", 1024, "fwd", False, "float32", 1, 4, 32))
    assert small is not None and small > 3 * 4 * 1024 * 1024 * 4 / 2  # it materialises (H, L, L) scores
    tiled = bench.measure_peak_memory(bench.Config("tiled", 1024, "fwd", False, "float32", 1, 4, 32))
    assert tiled is not None and tiled < small / 4


def test_cli_writes_csv_and_plot(tmp_path, capsys):
    png = tmp_path / "b.png"
    code = main(["bench", "--seq-lens", "32,64", "--impls", "tiled,flash", "--modes", "fwd", "--causal", "no",
                 "--dtypes", "float32", "--heads", "2", "--dim", "16", "--repeats", "1", "--no-memory",
                 "--csv", str(tmp_path / "b.csv"), "--plot", str(png)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| tiled | 32 | fwd | no | float32 |" in out and "machine:" in out
    assert png.stat().st_size > 10_000
    import matplotlib.image

    pixels = torch.tensor(matplotlib.image.imread(str(png)))
    assert pixels.std() > 0.01  # not a blank image


def test_cli_rejects_bad_lists():
    assert main(["bench", "--impls", "tiled,turbo"]) == 2  # argparse's error: main returns its status
    assert main(["bench", "--seq-lens", "0"]) == 2


def test_ring_benchmark_tiny():
    rows = bench.ring_benchmark([64], B=1, H=2, E=8, causal=True, layout="zigzag")
    assert len(rows) == 1 and rows[0]["errors"] == []
    row = rows[0]
    assert row["ring_s"] > 0 and row["single_s"] > 0 and row["ratio"] == pytest.approx(row["ring_s"] / row["single_s"])
    assert row["sent_mib_per_rank"] > 0
    assert 0 <= row["comm_wait_share"] < 1  # a share of the rank's time, measured in the rank


def test_padding_mask_reaches_every_implementation(tmp_path, capsys):
    """--mask padding: every implementation gets the same key-padding mask; causal ones are skipped."""
    results = bench.run_benchmarks([32], list(bench.IMPLS), ["fwd+bwd"], [False, True], ["float32"], B=2, H=2, E=8,
                                   repeats=1, memory=False, mask="padding")
    masked = [r for r in results if not r.config.causal]
    assert all(r.status == "ok" and r.config.mask == "padding" for r in masked)
    assert all(r.status.startswith("skipped: a mask and is_causal") for r in results if r.config.causal)
    c = masked[0].config
    mask = timing._mask(c)
    assert mask.shape == (2, 1, 1, 32) and mask[..., :24].all() and not mask[..., 24:].any()
    # the mask changes the result: outputs with and without it differ, and match across impls
    q, k, v, _ = timing.make_inputs(c, False)
    outs = {impl: timing.impl_function(impl)(q, k, v, False, mask) for impl in bench.IMPLS}
    assert (outs["tiled"] - timing.impl_function("tiled")(q, k, v, False, None)).abs().max() > 1e-3
    for impl in ("reference", "math", "flash"):
        assert (outs["tiled"] - outs[impl]).abs().max() < 1e-5, impl
    assert "padding mask" in bench.markdown_table(results)
    with pytest.raises(ValueError, match="expected none, padding, causal, sliding:W"):
        bench.run_benchmarks([32], ["tiled"], ["fwd"], [False], ["float32"], memory=False, mask="sliding")
    assert main(["bench", "--seq-lens", "32", "--impls", "tiled,flash", "--causal", "no", "--mask", "padding",
                 "--dtypes", "float32", "--heads", "2", "--dim", "8", "--repeats", "1", "--no-memory"]) == 0
    assert "| tiled | 32 | fwd | no | float32 |" in capsys.readouterr().out


def test_bench_attention_variants_give_flex_its_block_mask_and_the_others_the_dense_mask():
    from attnlab import bench

    results = bench.run_benchmarks([512], ["flex", "reference", "math"], ["fwd"], [False], ["float64"], B=1, H=2,
                                   E=8, repeats=1, memory=False, mask="sliding:16")
    assert [r.status for r in results] == ["ok", "ok", "ok"]
    c = results[0].config
    dense = timing._mask(c)
    assert dense.shape == (512, 512) and int(dense.sum()) == sum(min(i + 1, 16) for i in range(512))
    assert timing._block_mask(c).density() < 0.7
    with pytest.raises(ValueError, match="sliding:W"):
        bench.parse_mask("sliding:0")


def test_torch_compiled_flex_is_timed_apart_from_its_compilation_and_has_no_cpu_backward():
    from attnlab import bench

    results = bench.run_benchmarks([128], ["flex", "torchflex"], ["fwd", "fwd+bwd"], [False], ["float32"], B=1, H=2,
                                   E=16, repeats=1, memory=False, mask="sliding:32")
    fwd = {r.config.impl: r for r in results if r.config.mode == "fwd"}
    assert fwd["torchflex"].status == "ok" and fwd["torchflex"].compile_s > 0 and len(fwd["torchflex"].times_s) == 1
    assert fwd["flex"].compile_s is None
    assert fwd["flex"].ratio_vs_torch_best == pytest.approx(fwd["flex"].median_s / fwd["torchflex"].median_s)
    assert "compile" in bench.markdown_table(results)
    back = {r.config.impl: r for r in results if r.config.mode == "fwd+bwd"}
    assert back["flex"].status == "ok"
    assert back["torchflex"].status.startswith("error") and "backward" in back["torchflex"].status


def test_density_sweep_reports_time_against_density(capsys):
    from attnlab import bench

    rows = bench.density_sweep(512, H=2, E=16, densities=(0.5, 0.25), repeats=1, modes=("fwd",))
    assert [(r["mask"], r["mode"]) for r in rows] == [("band", "fwd"), ("sliding", "fwd"), ("band", "fwd"),
                                                    ("sliding", "fwd")]
    band_half, _, band_quarter, sliding_quarter = rows
    assert band_half["density"] == 0.5 and band_half["partial"] == 0 and band_quarter["density"] == 0.25
    assert sliding_quarter["partial"] > 0  # the window's diagonal blocks
    for r in rows:
        assert r["ratio"] == pytest.approx(r["ms"] / (r["density"] * r["full_ms"]))
    assert main(["bench", "--density", "--seq-lens", "256", "--heads", "1", "--dim", "8", "--repeats", "1",
                     "--modes", "fwd"]) == 0
    out = capsys.readouterr().out
    assert "| band | 0.500 | 2 | 0 | fwd |" in out and "ratio = time / (density x time of full attention)" in out


def test_decode_benchmark_times_each_implementation_against_torch(capsys):
    """--decode: one row per implementation, torch's SDPA at 1.00x, GB/s from the cache's bytes;
    a causal chunk (L > 1) runs too."""
    from attnlab import bench

    rows = bench.decode_benchmark([64], dtypes=("float32",), H=4, Hkv=2, E=8, repeats=2)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"attnlab (auto: decode)", "attnlab decode: stream", "attnlab decode: gemm", "attnlab paged (16)",
                       "attnlab int8", "attnlab int8: float32 dots", "attnlab int8 paged (16)",
                       "attnlab tiled", "attnlab reference", "torch SDPA",
                       "torch SDPA (GQA folded)"}
    assert by["torch SDPA"]["ratio"] == 1.0
    for r in rows:  # int8 rows count their int8 bytes and one float32 scale per row
        nbytes = 2 * 2 * 64 * (8 + 4) if "int8" in r["impl"] else 2 * 2 * 64 * 8 * 4
        assert r["ms"] > 0 and r["gb_s"] == nbytes / (r["ms"] / 1e3) / 1e9, r["impl"]
    peak = by["torch SDPA"]["gb_s"] / by["torch SDPA"]["peak_share"]  # one read peak, measured once per run
    assert all(r["peak_share"] > 0 and r["peak_share"] == pytest.approx(r["gb_s"] / peak, rel=1e-9) for r in rows)
    chunk = bench.decode_benchmark([300], dtypes=("bfloat16",), H=4, Hkv=2, E=8, L=3, repeats=1)
    # a chunk has no folded torch row (the group cannot fold into L > 1 rows under a causal mask)
    assert len(chunk) == 10 and "torch SDPA (GQA folded)" not in {r["impl"] for r in chunk}
    assert "| 300 | bfloat16 | attnlab tiled |" in bench.decode_table(chunk)
    from attnlab.cli import main

    assert main(["bench", "--decode", "--seq-lens", "128", "--dtypes", "float32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "machine:" in out and "| 128 | float32 | torch SDPA |" in out and "GB/s" in out


def test_decode_benchmark_adds_a_huge_pages_row_where_the_kernel_offers_them(force_routes, monkeypatch):
    """--decode also times the decode kernel on a copy of the cache on huge pages (attnlab's own
    caches' storage) where Linux offers them and a cache fills one (2 MiB), after the stream
    row; not below that, nor with ATTNLAB_HUGE_PAGES=off. The kernel's mode is faked here: the
    question is the bench's."""
    from attnlab.kernels import memory

    name = "attnlab decode: cache on huge pages"
    monkeypatch.setattr(memory, "huge_pages_offered", lambda: "madvise")
    advised = []
    monkeypatch.setattr(memory, "_advise", lambda address, length: advised.append(length) or True)
    small = bench.decode_benchmark([64], dtypes=("float32",), H=4, Hkv=2, E=8, repeats=1)
    assert name not in {r["impl"] for r in small} and advised == []
    rows = bench.decode_benchmark([4096], dtypes=("float32",), H=4, Hkv=2, E=64, repeats=1)  # 2 MiB each
    impls = [r["impl"] for r in rows]
    # the paged cache's pools (attnlab's own: on huge pages too) and the row's copies of k and v
    assert impls.index(name) == impls.index("attnlab decode: stream") + 1 and advised == [2 << 20] * 4
    force_routes(huge_pages="off")
    off = bench.decode_benchmark([4096], dtypes=("float32",), H=4, Hkv=2, E=64, repeats=1)
    assert name not in {r["impl"] for r in off} and len(advised) == 4


def test_decode_benchmark_adds_a_float32_dots_row_where_bf16_caches_take_vdpbf16ps(force_routes, monkeypatch):
    """On a CPU whose bf16 route takes vdpbf16ps for a bf16 cache's scores (faked here, for the
    bench's question only: no CPU of ours need have it, and the kernel refuses a plan its build
    cannot run), --decode also times the streaming loop with them widened, right after the stream
    row, run with ATTNLAB_BF16=fp32; float32 caches, and CPUs without it, have no such row."""
    from attnlab.bench import suites
    from attnlab.kernels import decode as kernel_decode
    from attnlab.kernels import routes

    force_routes(bf16="auto")
    asked = []
    real = kernel_decode.plan

    def spy(*args, **kwargs):  # the route each decode call plans under
        asked.append(routes.settings().bf16)
        return real(*args, **kwargs)

    name = "attnlab decode: stream, float32 dots"
    assert name not in {r["impl"] for r in bench.decode_benchmark([64], dtypes=("bfloat16",), H=4, Hkv=2, E=8,
                                                                    repeats=1)}
    monkeypatch.setattr(kernel_decode, "plan", spy)
    monkeypatch.setattr(suites, "_bf16_scores_on_vdpbf16ps", lambda E: True)
    impls = [r["impl"] for r in bench.decode_benchmark([64], dtypes=("bfloat16",), H=4, Hkv=2, E=8, repeats=1)]
    assert impls.index(name) == impls.index("attnlab decode: stream") + 1
    assert "fp32" in asked and "auto" in asked  # the row forces the float32 route; the others leave it alone
    assert name not in {r["impl"] for r in bench.decode_benchmark([64], dtypes=("float32",), H=4, Hkv=2, E=8,
                                                                    repeats=1)}


def test_gemm_benchmark_rates_each_route_against_the_fma_peak(capsys):
    """--gemm: each tile product on each fast route this build has (not the emulated test route),
    GFLOP/s from the product's own FLOPs, the FMA peak measured in the run, attention rows per
    route with torch at 1.00x."""
    from attnlab.kernels import native as _native

    result = bench.gemm_benchmark(E=16, L=64, H=2, repeats=1)
    routes = set(_native.sgemm_routes_built())
    routes.discard("avx512-emulated")
    assert {r["route"] for r in result["tiles"]} == routes and "blas" in routes
    assert len(result["tiles"]) == 3 * len(routes)
    for r in result["tiles"]:
        m, n, k = r["mnk"]
        assert r["gflops"] == pytest.approx(2 * m * n * k / (r["us"] / 1e6) / 1e9)
    flags = _native.cpu_features()
    if {"avx2", "fma"} <= flags:  # the peak is measured wherever the FMA loop builds
        assert result["peak"] > 1.0
    torch_rows = [r for r in result["attention"] if r["impl"] == "torch SDPA"]
    assert len(torch_rows) == 4 and all(r["ratio"] == 1.0 for r in torch_rows)
    assert {r["impl"] for r in result["attention"]} == {f"attnlab, {r}" for r in routes} | {"torch SDPA"}
    assert torch.get_num_threads() == result["threads"]  # restored after the one-thread tile runs
    table = bench.gemm_table(result)
    assert "share of FMA peak" in table and "| S = Q K^T, dP = dO V^T | (256, 256, 16) | blas |" in table
    assert main(["bench", "--gemm", "--seq-lens", "64", "--heads", "1", "--dim", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "machine:" in out and "FMA peak, measured in this run:" in out and "| attnlab, blas |" in out


def test_peers_benchmark_times_each_installed_peer_and_checks_its_output(capsys):
    """--peers: a row per implementation for each L and mask, torch at 1.00x, each output within
    float32's tolerance of a float64 SDPA (so the rows time the same attention). The dev
    environment installs the peers (attnlab[peers]), so all three run here."""
    from attnlab.testing import tolerance

    result = bench.peers_benchmark([48], H=2, E=16, repeats=1)
    assert result["missing"] == {}, result["missing"]
    impls = {"torch SDPA", "attnlab tiled", *bench.PEERS}
    for causal in (False, True):
        rows = {r["impl"]: r for r in result["rows"] if r["causal"] == causal}
        assert set(rows) == impls
        assert rows["torch SDPA"]["ratio"] == 1.0
        for r in rows.values():
            assert r["ms"] > 0 and r["max_err"] < tolerance(torch.float32).atol, r
            assert r["gflops"] == pytest.approx(4 * 2 * 48 * 48 * 16 * (0.5 if causal else 1) / r["ms"] / 1e6)
    assert main(["bench", "--peers", "--seq-lens", "32", "--heads", "1", "--dim", "8", "--repeats", "1",
                 "--causal", "yes"]) == 0
    out = capsys.readouterr().out
    assert "| (1, 1, 32, 8) | causal | OpenVINO SDPA |" in out and "not installed" not in out


def test_peers_that_are_not_installed_are_named_with_their_install_line(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    assert bench.missing_peers() == {"OpenVINO SDPA": "pip install 'attnlab[peers]' (or: pip install openvino)"}
    result = bench.peers_benchmark([16], H=1, E=8, repeats=1, causals=(False,))
    assert "OpenVINO SDPA" not in {r["impl"] for r in result["rows"]}
    assert "not installed, so not timed: OpenVINO SDPA (pip install 'attnlab[peers]'" in bench.peers_table(result)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("openvino", "onnxruntime") else real(name, *a))
    assert main(["bench", "--peers"]) == 2
    err = capsys.readouterr().err
    assert "--peers needs OpenVINO or ONNX Runtime" in err and "pip install 'attnlab[peers]'" in err
    assert "Traceback" not in err


def test_a_compiled_models_step_is_timed_against_eager_with_its_compilation_apart(capsys):
    """issue 50's benchmark row: a decoder's training step, eager against torch.compile."""
    rows = bench.compile_benchmark([64], d_model=32, heads=4, kv_heads=2, layers=1, repeats=1)
    assert [r["L"] for r in rows] == [64]
    r = rows[0]
    assert r["eager_ms"] > 0 and r["compiled_ms"] > 0 and r["compile_s"] > 0
    assert r["ratio"] == pytest.approx(r["compiled_ms"] / r["eager_ms"])
    table = bench.compile_table(rows)
    assert "| 64 |" in table and "compilation s" in table
    assert main(["bench", "--help"]) == 0
    assert "--compile" in capsys.readouterr().out


def test_interleaved_medians_call_each_function_once_a_round_in_orders_that_vary():
    """Every round calls each function once (after one warm-up call each), and the rounds' orders
    differ: no function always runs right after the same one (the decode bench's first row always
    followed the reference's gigabyte of temporaries, and measured slower than the same kernel)."""
    calls: list[str] = []
    names = ["reference", "auto", "stream", "paged", "torch"]
    fns = {name: (lambda name=name: calls.append(name)) for name in names}
    medians = timing.interleaved_medians(fns, repeats=8)
    assert set(medians) == set(names) and all(m >= 0 for m in medians.values())
    assert calls[:5] == names  # the warm-up, in the given order
    rounds = [calls[5 + 5 * i:10 + 5 * i] for i in range(8)]
    assert all(sorted(r) == sorted(names) for r in rounds)
    after_reference = {r[r.index("reference") + 1] for r in rounds if r[-1] != "reference"}
    assert len(after_reference) >= 2, rounds
    assert len({tuple(r) for r in rounds}) >= 4, rounds
    # seeded: the same orders again
    calls.clear()
    timing.interleaved_medians(fns, repeats=8)
    assert [calls[5 + 5 * i:10 + 5 * i] for i in range(8)] == rounds


def test_the_bf16_bench_rates_each_row_against_the_bf16_peak_of_the_run():
    """--bf16: each row's GFLOP/s from its GEMMs' flops (3.5x the forward's with the backward, half
    under causality) and its share of the bf16 peak measured in the run (vdpbf16ps where the CPU
    has avx512_bf16, else the FMA peak) on the run's threads."""
    from attnlab.kernels import native as _native

    rows = bench.bf16_benchmark(shapes=((1, 2, 2, 64, 16),), repeats=1, causals=(True, False))
    assert len(rows) == 12
    for r in rows:
        B, H, _, L, E = r["shape"]
        flops = 4 * B * H * L * L * E * (0.5 if r["causal"] else 1) * (3.5 if r["mode"] == "fwd+bwd" else 1)
        assert r["gflops"] == pytest.approx(flops / (r["ms"] / 1e3) / 1e9)
        assert r["threads"] == torch.get_num_threads()
        if r["peak"] is not None:
            assert r["peak_share"] == pytest.approx(r["gflops"] / (r["peak"] * r["threads"]))
    flags = _native.cpu_features()
    if "avx512_bf16" in flags:
        assert rows[0]["peak_name"] == "vdpbf16ps peak" and rows[0]["peak"] > 1.0
    elif {"avx2", "fma"} <= flags:
        assert rows[0]["peak_name"] == "FMA peak" and rows[0]["peak"] > 1.0
    table = bench.bf16_table(rows)
    assert "| GFLOP/s | share of peak |" in table
    if rows[0]["peak"] is not None:  # measured wherever the loop builds (every CPU with AVX2 + FMA)
        assert "measured in this run" in table and f"{100 * rows[0]['peak_share']:.0f}% |" in table.splitlines()[4]


def test_compute_peak_names_the_peak_each_dtype_is_bounded_by(monkeypatch):
    """bf16 on vdpbf16ps where it measures, else the FMA peak (bf16 computed in float32); float64
    half the FMA peak (half the lanes); float32 and float16 the FMA peak."""
    from attnlab.bench import machine

    monkeypatch.setattr(machine, "fma_peak", lambda: 100.0)
    monkeypatch.setattr(machine, "bf16_peak", lambda: 200.0)
    assert machine.compute_peak(torch.bfloat16) == ("vdpbf16ps peak", 200.0)
    assert machine.compute_peak(torch.float32) == ("FMA peak", 100.0)
    assert machine.compute_peak(torch.float16) == ("FMA peak", 100.0)
    assert machine.compute_peak(torch.float64) == ("float64 FMA peak", 50.0)
    assert machine.peaks_for(["float32", "bfloat16", "float32"]) == {"float32": ("FMA peak", 100.0),
                                                                     "bfloat16": ("vdpbf16ps peak", 200.0)}
    monkeypatch.setattr(machine, "bf16_peak", lambda: None)  # no avx512_bf16
    assert machine.compute_peak(torch.bfloat16) == ("FMA peak", 100.0)
    monkeypatch.setattr(machine, "fma_peak", lambda: None)  # no compiler
    assert machine.compute_peak(torch.float64) == ("float64 FMA peak", None)


def test_bf16_peak_is_measured_where_the_cpu_has_the_instruction():
    """The vdpbf16ps loop builds and runs where the CPU has avx512_bf16, and says None elsewhere."""
    from attnlab.bench import machine
    from attnlab.kernels import native as _native

    peak = machine.bf16_peak(seconds=0.02, repeats=1)
    if "avx512_bf16" in _native.cpu_features():
        assert peak is not None and peak > 1.0
    else:
        assert peak is None


def test_the_main_bench_table_gives_each_row_its_share_of_its_dtype_peak():
    """Each row's GFLOP/s over its dtype's peak times the threads; '-' where no peak was measured."""
    from attnlab.bench.timing import Config, Result

    c32 = Config(impl="tiled", L=64, mode="fwd", causal=False, dtype="float32", B=1, H=1, E=16)
    c16 = Config(impl="tiled", L=64, mode="fwd", causal=False, dtype="bfloat16", B=1, H=1, E=16)
    rows = [Result(c32, times_s=[c32.flops() / 50e9]), Result(c16, times_s=[c16.flops() / 50e9])]
    table = bench.markdown_table(rows, {"float32": ("FMA peak", 100.0), "bfloat16": ("vdpbf16ps peak", None)},
                                 threads=2)
    lines = table.splitlines()
    assert lines[0] == "peaks measured in this run: FMA peak 100.0 GFLOP/s a thread (float32); shares on 2 thread(s)"
    assert "| 50.00 | 25% |" in lines[4] and "| float32 |" in lines[4]
    assert "| 50.00 | - |" in lines[5] and "| bfloat16 |" in lines[5]
    bare = bench.markdown_table(rows).splitlines()  # no peaks given: no line, no shares
    assert bare[0].startswith("| impl |") and "| 50.00 | - |" in bare[2] and "| 50.00 | - |" in bare[3]
