"""The real instruction is the oracle of its emulation (issue 49 item 3).

The avx512-emulated build (``csrc/isa/avx512_emulated.h``) runs the kernels' AVX-512 source on CPUs
without AVX-512. Each instruction it emulates is checked here, bit for bit, over random bits and
the corners where emulations go wrong (denormal inputs and accumulators, products that underflow,
ties, overflow, inf and NaN):

* everywhere: against a model of the instruction written here from Intel's pseudocode, in exact
  rational arithmetic (vdpbf16ps: denormal inputs read as zero, each step one fused
  multiply-add rounded to nearest even, results tiny after rounding flushed to zero);
* on a CPU that has the instruction: against the instruction itself, both built from one harness
  (``isa_harness.cpp``). Where the CPU lacks it the test says which instruction it could not
  check (a skip naming it and the CPU's flags); `attnlab bench --bf16` on such a CPU times it.
"""

from __future__ import annotations

import math
import random
import shutil
import struct
import subprocess
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from attnlab.kernels import native

pytestmark = [pytest.mark.subprocess]

HARNESS = Path(__file__).with_name("isa_harness.cpp")
CSRC = Path(native.__file__).parent / "csrc"
REAL_FLAGS = ["-mavx512f", "-mavx512bf16", "-mavx512vl", "-mavx512vnni"]
# what each instruction needs of the CPU, as /proc/cpuinfo names it
NEEDS = {"dpbf16": {"avx512_bf16", "avx512f"}, "dpbf16y": {"avx512_bf16", "avx512vl"},
         "cvtne2ps": {"avx512_bf16", "avx512f"}, "dpwssd": {"avx512_vnni", "avx512vl"}}
LANES = 4096  # records per instruction (x 8 or 16 lanes), random bits and corners


def _build(tmp: Path, name: str, flags: list[str]) -> Path:
    compiler = shutil.which("g++") or shutil.which("c++")
    assert compiler, "no C++ compiler: the native kernels' build needs one too"
    out = tmp / name
    subprocess.run([compiler, "-O2", "-std=c++17", "-mavx2", "-mfma", *flags, f"-I{CSRC}", str(HARNESS), "-o",
                    str(out)], check=True, capture_output=True, text=True, timeout=180)
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isa")
    return {"emulated": _build(tmp, "emulated", []), "tmp": tmp}


def _run(binary: Path, op: str, data: bytes) -> bytes:
    done = subprocess.run([str(binary), op], input=data, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


# --------------------------------------------------------------------------- inputs
def _bf16_corners() -> list[int]:
    """bf16 bit patterns where emulations differ: zeros, denormals, the smallest and largest
    normals, values whose products underflow or overflow, inf, NaN."""
    return [0x0000, 0x8000, 0x0001, 0x807F, 0x0040, 0x0080, 0x8080, 0x0081, 0x1F80, 0x2000, 0x3F80, 0xBF80, 0x3F81,
            0x7F7F, 0xFF7F, 0x5F80, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x1000, 0x9000, 0x2F80]


def _f32_corners() -> list[int]:
    return [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x80800000, 0x3F800000, 0xBF800000,
            0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x33800000, 0x0C000000, 0x3F808000,
            0x3F818000, 0x3F7FFF80, 0x00400000]


def _inputs(op: str, seed: int = 0) -> tuple[bytes, list]:
    """``LANES`` records for ``op``, half random bits, half drawn from the corners."""
    rng = random.Random(seed)
    width = {"dpbf16": 16, "dpbf16y": 8, "cvtne2ps": 16, "dpwssd": 8}[op]
    records = []
    for i in range(LANES):
        corner = i % 2 == 1
        if op in ("dpbf16", "dpbf16y"):
            src = [rng.choice(_f32_corners()) if corner and rng.random() < 0.5 else rng.getrandbits(32)
                   for _ in range(width)]
            a, b = ([rng.choice(_bf16_corners()) if corner else rng.getrandbits(16) for _ in range(2 * width)]
                    for _ in range(2))
            if corner and i % 4 == 1:  # exponents that put a product at float32's denormal edge
                a = [(rng.getrandbits(1) << 15) | (rng.randrange(1, 70) << 7) | rng.getrandbits(7)
                     for _ in range(2 * width)]
                b = [(rng.getrandbits(1) << 15) | (rng.randrange(1, 70) << 7) | rng.getrandbits(7)
                     for _ in range(2 * width)]
            records.append((src, a, b))
        elif op == "cvtne2ps":
            a, b = ([rng.choice(_f32_corners()) if corner else rng.getrandbits(32) for _ in range(16)]
                    for _ in range(2))
            records.append((a, b))
        else:
            big = [-32768, 32767, -1, 0, 1]
            src = [rng.choice([-2**31, 2**31 - 1, 0, -1]) if corner else rng.getrandbits(32) - 2**31
                   for _ in range(8)]
            a, b = ([rng.choice(big) if corner else rng.getrandbits(16) - 2**15 for _ in range(16)] for _ in range(2))
            records.append((src, a, b))
    data = bytearray()
    for rec in records:
        if op in ("dpbf16", "dpbf16y"):
            src, a, b = rec
            data += struct.pack(f"<{len(src)}I{len(a)}H{len(b)}H", *src, *a, *b)
        elif op == "cvtne2ps":
            data += struct.pack("<32I", *rec[0], *rec[1])
        else:
            data += struct.pack("<8i16h16h", *rec[0], *rec[1], *rec[2])
    return bytes(data), records


# --------------------------------------------------------------------------- the model
def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _daz32(bits: int) -> float:
    """A float32 as the bf16 instructions read it: a denormal is zero of its sign."""
    return math.copysign(0.0, _f32(bits)) if (bits & 0x7F800000) == 0 else _f32(bits)


def _bf16(h: int) -> float:
    return _daz32((h & 0xFFFF) << 16)


def _round_f32(q: Fraction, unbounded: bool = False) -> float:
    """The float32 nearest ``q`` (ties to even, gradual underflow, overflow to inf), as a float;
    ``unbounded``: to 24 significant bits whatever the exponent (no gradual underflow)."""
    if q == 0:
        return 0.0
    sign, a = (-1.0 if q < 0 else 1.0), abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** ((e if unbounded else max(e, -126)) - 23)
    n, rem = divmod(a / quantum, 1)
    n = int(n)
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    value = n * quantum
    if value >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * float(value)


def _fma_step(acc: float, x: float, y: float) -> float:
    """acc + x * y rounded once to float32, flushed to zero of its sign when tiny after rounding
    (below 2^-126 once rounded to 24 bits with an unbounded exponent: x86's rule, which the real
    instruction follows; flushing what rounds to a denormal instead differed in 4 of 65,536 lanes)."""
    if not all(math.isfinite(t) for t in (acc, x, y)):
        with np.errstate(all="ignore"):
            return float(np.float32(np.float64(acc) + np.float64(x) * np.float64(y)))  # inf and NaN's rules
    exact = Fraction(acc) + Fraction(x) * Fraction(y)
    if exact == 0:  # IEEE's sign of an exact zero sum under round-to-nearest
        product_negative_zero = (x * y == 0) and (math.copysign(1, x) * math.copysign(1, y) < 0)
        return -0.0 if (product_negative_zero and math.copysign(1, acc) < 0) else 0.0
    r = _round_f32(exact)
    return math.copysign(0.0, r) if abs(_round_f32(exact, unbounded=True)) < 2.0 ** -126 else r


def _model(op: str, records: list) -> list[int]:
    out = []
    for rec in records:
        if op in ("dpbf16", "dpbf16y"):
            src, a, b = rec
            for j, s in enumerate(src):
                t = _fma_step(_daz32(s), _bf16(a[2 * j + 1]), _bf16(b[2 * j + 1]))
                out.append(_bits(_fma_step(t, _bf16(a[2 * j]), _bf16(b[2 * j]))))
        elif op == "cvtne2ps":
            a, b = rec
            for bits in (*b, *a):  # lanes 0..15 from b, 16..31 from a
                if (bits & 0x7FFFFFFF) > 0x7F800000:
                    out.append(((bits >> 16) | 0x40) & 0xFFFF)  # NaN: quieted
                elif (bits & 0x7F800000) == 0:
                    out.append((bits >> 16) & 0x8000)  # a denormal: zero of its sign
                else:
                    out.append(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)
        else:
            src, a, b = rec
            for j, s in enumerate(src):
                t = s + a[2 * j] * b[2 * j] + a[2 * j + 1] * b[2 * j + 1]
                out.append(((t + 2**31) % 2**32) - 2**31)  # wraps, as vpdpwssd (not the saturating form)
    return out


def _decode(op: str, raw: bytes) -> list[int]:
    if op in ("dpbf16", "dpbf16y"):
        return list(struct.unpack(f"<{len(raw) // 4}I", raw))
    if op == "cvtne2ps":
        return list(struct.unpack(f"<{len(raw) // 2}H", raw))
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def _same(op: str, got: int, want: int) -> bool:
    """Bit for bit; two NaNs of float32 count as one (the model does not fix a payload)."""
    if got == want:
        return True
    if op in ("dpbf16", "dpbf16y"):
        return math.isnan(_f32(got)) and math.isnan(_f32(want))
    return False


@pytest.mark.parametrize("op", ["dpbf16", "dpbf16y", "cvtne2ps", "dpwssd"])
def test_the_emulation_is_the_instruction_s_model_bit_for_bit(builds, op):
    """Over 4,096 records of random bits and corners. vdpbf16ps as the emulation had it before
    (the accumulator's denormals kept, products rounded before the sum, denormal results kept)
    differed from this model in 1,949 of these 65,536 lanes (256-bit: 921 of 32,768)."""
    data, records = _inputs(op)
    got = _decode(op, _run(builds["emulated"], op, data))
    want = _model(op, records)
    assert len(got) == len(want)
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if not _same(op, g, w)]
    assert not wrong, f"{op}: {len(wrong)} of {len(got)} lanes differ, e.g. lane {wrong[0]}: {got[wrong[0]]:#x} " \
                      f"against {want[wrong[0]]:#x}"


def test_the_corners_matter():
    """The inputs reach what an emulation can get wrong: with the accumulator read as it is and a
    product rounded before its sum (vdpbf16ps emulated naively) hundreds of lanes differ."""
    _, records = _inputs("dpbf16")
    naive = []
    for src, a, b in records:
        for j, s in enumerate(src):
            f32 = np.float32
            with np.errstate(all="ignore"):
                t = f32(_f32(s)) + f32(_bf16(a[2 * j + 1])) * f32(_bf16(b[2 * j + 1]))
                naive.append(_bits(float(f32(t + f32(_bf16(a[2 * j])) * f32(_bf16(b[2 * j]))))))
    want = _model("dpbf16", records)
    differ = sum(not _same("dpbf16", g, w) for g, w in zip(naive, want))
    assert differ > 500, differ


def _cpu_flags() -> set[str]:
    return set(native.cpu_features())


@pytest.mark.parametrize("op", ["dpbf16", "dpbf16y", "cvtne2ps", "dpwssd"])
def test_the_emulation_is_the_real_instruction_bit_for_bit(builds, op):
    """On a CPU with the instruction: the emulation against the instruction, bit for bit, NaN
    payloads included. On one without it, this says which instruction it could not check."""
    lacking = NEEDS[op] - _cpu_flags()
    if lacking:
        pytest.skip(f"{op}: this CPU lacks {', '.join(sorted(lacking))}, so the real instruction could not be "
                    f"checked here (its model was: test_the_emulation_is_the_instruction_s_model_bit_for_bit)")
    if "real" not in builds:
        builds["real"] = _build(builds["tmp"], "real", REAL_FLAGS)
    data, _ = _inputs(op, seed=1)
    got, want = (_decode(op, _run(builds[name], op, data)) for name in ("emulated", "real"))
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not wrong, f"{op}: {len(wrong)} of {len(got)} lanes differ from the CPU's, e.g. lane {wrong[0]}: " \
                      f"{got[wrong[0]]:#x} against {want[wrong[0]]:#x}"

