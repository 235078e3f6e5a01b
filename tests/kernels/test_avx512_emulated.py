"""The native kernels' AVX-512 source, run on any CPU (issue 33: every route tested on any
machine).

``ATTNLAB_NATIVE_ISA=avx512-emulated`` builds the kernels with each AVX-512 instruction they use
written out in portable C++ (``csrc/isa/avx512_emulated.h``), so the AVX-512 branches (kernels.h's row
pass and 2^x, the 6 x 64 zmm GEMM tile of the ``avx512`` float32 route, the ``vdpbf16ps`` bf16
GEMM and its packing) run on an AVX2-only CPU. Here that build runs the kernels' own parity
suites in a child process: the same checks, against torch and float64, that the native build
passes. On a CPU with AVX-512F only the bf16 instructions are emulated; on one with AVX512_BF16
too the header does nothing and the child runs the native code again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnlab.kernels import native as _native
from attnlab.kernels import routes

TESTS = Path(__file__).parent.parent
# the suites that reach the AVX-512 branches: the GEMM routes (avx512 forced, bf16 forced onto its
# units), the flash kernels' row pass (tiled, native), decoding's over every cache kind, and the
# block-sparse kernels' (flex): about 1500 cases, 50 s on the 2-core AVX2 EPYC once built
SUITES = ["kernels/test_sgemm.py", "kernels/test_bf16_route.py", "kernels/test_bf16_gemm.py", "kernels/test_native.py", "kernels/test_tiled.py",
          "kernels/test_kernels.py", "kernels/test_decoding.py", "flex"]
# in-process checks only: the children's children would build yet more libraries
SELECT = "not (subprocess or slow or large)"


def _child(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "ATTNLAB_NATIVE_ISA": "avx512-emulated", "ATTNLAB_NATIVE": "1"}
    env.pop("ATTNLAB_SGEMM", None), env.pop("ATTNLAB_BF16", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=TESTS.parent)


def test_an_unknown_isa_is_refused_with_the_choices(force_routes, monkeypatch):
    monkeypatch.setenv("ATTNLAB_NATIVE_ISA", "avx1024")
    with pytest.raises(ValueError, match=r"ATTNLAB_NATIVE_ISA must be one of native, avx512-emulated, got 'avx1024'"):
        routes.reload()
    with pytest.raises(ValueError, match=r"ATTNLAB_NATIVE_ISA must be one of"):
        force_routes(isa="avx1024")


def test_the_emulated_build_has_its_own_cache_folder(force_routes, monkeypatch):
    force_routes(isa="native")
    native = _native._cache_dir()
    force_routes(isa="avx512-emulated")
    assert _native._cache_dir() != native


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_avx512_source_passes_the_kernel_suites_on_emulated_instructions():
    # the build first (minutes on 2 cores, once per source hash): it must take the AVX-512 branches
    probe = _child(["-c", textwrap.dedent("""
        from attnlab.kernels import native
        print(native.status())
        print("UNITS", bool(native.ops().bf16_units()), "DECODE", int(native.ops().decode_dot_instructions()),
              "ROUTES", *native.sgemm_routes_built())
    """)], timeout=900)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert "avx512-emulated test build" in probe.stdout or "avx512f" in _native.cpu_features(), probe.stdout
    assert "float32 GEMM: avx512" in probe.stdout, probe.stdout
    assert "UNITS True" in probe.stdout and " avx512 " in probe.stdout.split("ROUTES", 1)[1] + " ", probe.stdout
    # decoding's vdpbf16ps and vpdpwssd branches too, and the 512-bit lane kernels (bits 2 and 3)
    assert "DECODE 15 " in probe.stdout, probe.stdout

    run = _child(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", SELECT, "-o", "addopts=",
                  *(str(TESTS / s) for s in SUITES)], timeout=1500)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    counts = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", run.stdout))
    assert counts.get("failed", 0) == 0 and counts.get("skipped", 0) == 0, tail
    assert counts.get("passed", 0) >= 1400, tail  # every suite ran, not a collection that found little


def test_the_bench_says_when_its_times_are_of_the_emulated_build(force_routes, monkeypatch):
    from attnlab.bench.machine import machine_line

    force_routes(isa="native")
    assert "avx512-emulated" not in machine_line()
    force_routes(isa="avx512-emulated")
    assert "attnlab's times below are of a test build, not this CPU's speed" in machine_line()
