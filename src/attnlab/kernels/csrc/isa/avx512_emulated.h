// The AVX-512 instructions the native kernels use, in portable C++: the "avx512-emulated" build
// (attnlab.kernels.native, ATTNLAB_NATIVE_ISA=avx512-emulated) includes this on a CPU without
// AVX-512, so that the kernels' AVX-512 source (kernels.h's row pass and 2^x, sgemm.h's 6 x 64
// zmm tile, bf16_gemm.h's vdpbf16ps micro-kernel and packing, decode.cpp's bf16 dot products on
// 256-bit vdpbf16ps, and its int8 dot products on 256-bit vpdpwssd) runs, and is tested, on an
// AVX2-only machine. It is a test build: correct, slow.
//
// Why not the real instructions' names from <immintrin.h>: those need a compiler target with
// AVX-512 and a CPU that has it. Here each name the kernels use is a macro for a function below
// on GCC vector types of 64 bytes (16 float32 lanes), written from Intel's pseudocode for the
// instruction, lane by lane; after it, __AVX512F__, __AVX512BF16__ and __AVX512VNNI__ are defined,
// so that the kernels take their AVX-512 branches. Only the instructions the kernels use are here: a new one
// fails to compile in this build, and the build's test (tests/kernels/test_avx512_emulated.py)
// says so.
//
// A build for a CPU with AVX-512F but not AVX512_BF16 (Skylake-X, Ice Lake) emulates the bf16
// instructions only (and vpdpwssd where it lacks AVX512_VNNI); for a CPU with all three this
// header adds nothing.
//
// Exactness, where it matters to the tests: fused multiply-adds round once (std::fma), the
// reductions add in the order GCC's _mm512_reduce_add_ps does, round-to-nearest-even is the
// default rounding mode's, vdpbf16ps and vcvtne2ps2bf16 treat denormal inputs as zero, and
// vdpbf16ps rounds each step once, flushes a result tiny after rounding and picks a NaN as the
// instructions do (checked against a Zen 5's, bit for bit: tests/kernels/test_real_instructions.py).
#pragma once

#if !defined(__AVX512F__) || !defined(__AVX512BF16__) || !defined(__AVX512VNNI__)

#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "portable.h"  // half_bits_to_float

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // 64-byte vectors passed without AVX-512: inline, never across a library ABI

namespace attnlab_avx512_emulated {

typedef float m512 __attribute__((vector_size(64)));
typedef long long m512i __attribute__((vector_size(64)));
typedef short m512bh __attribute__((vector_size(64)));  // 32 bf16, as GCC 12's __m512bh
typedef uint16_t mmask16;

inline m512 loadu_ps(const void* p) {
  m512 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void storeu_ps(void* p, m512 x) { std::memcpy(p, &x, sizeof x); }
inline m512i loadu_si512(const void* p) {
  m512i x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void storeu_si512(void* p, m512i x) { std::memcpy(p, &x, sizeof x); }
inline m512 setzero_ps() { return m512{}; }
inline m512 set1_ps(float a) { return m512{} + a; }
inline m512i set1_epi32(int32_t a) {
  int32_t lanes[16];
  for (int i = 0; i < 16; ++i) lanes[i] = a;
  return loadu_si512(lanes);
}
inline m512 add_ps(m512 a, m512 b) { return a + b; }
inline m512 sub_ps(m512 a, m512 b) { return a - b; }
inline m512 mul_ps(m512 a, m512 b) { return a * b; }
inline m512 fmadd_ps(m512 a, m512 b, m512 c) {  // one rounding, as vfmadd
  m512 r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
}
inline m512 max_ps(m512 a, m512 b) {  // vmaxps: the second operand when either is NaN or both are 0
  m512 r;
  for (int i = 0; i < 16; ++i) r[i] = a[i] > b[i] ? a[i] : b[i];
  return r;
}
// vrndscaleps with scale 0; imm's low bits pick the rounding: the kernels use only to-nearest-even
inline m512 roundscale_ps(m512 a, int imm) {
  m512 r;
  for (int i = 0; i < 16; ++i) {
    switch (imm & 3) {
      case 0: r[i] = std::nearbyint(a[i]); break;  // the default mode: to nearest, ties to even
      case 1: r[i] = std::floor(a[i]); break;
      case 2: r[i] = std::ceil(a[i]); break;
      default: r[i] = std::trunc(a[i]); break;
    }
  }
  return r;
}
// vscalefps: a * 2^floor(b), to 0 on underflow (b finite here: kernels.h clamps it)
inline m512 scalef_ps(m512 a, m512 b) {
  m512 r;
  for (int i = 0; i < 16; ++i) r[i] = std::ldexp(a[i], static_cast<int>(std::floor(b[i])));
  return r;
}
inline m512 mask_loadu_ps(m512 src, mmask16 k, const void* p) {  // unset lanes never touch memory
  const float* f = static_cast<const float*>(p);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) src[i] = f[i];
  return src;
}
inline m512 maskz_loadu_ps(mmask16 k, const void* p) { return mask_loadu_ps(m512{}, k, p); }
inline void mask_storeu_ps(void* p, mmask16 k, m512 x) {
  float* f = static_cast<float*>(p);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) f[i] = x[i];
}
inline m512 maskz_mov_ps(mmask16 k, m512 x) {
  for (int i = 0; i < 16; ++i)
    if (!(k >> i & 1)) x[i] = 0.0f;
  return x;
}
// GCC's _mm512_reduce_{add,max}_ps: the high 256 bits against the low, then 128, then 64, then 32
template <class Op>
inline float reduce(m512 a, Op op) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = op(a[i + 8], a[i]);
  for (int i = 0; i < 4; ++i) t[i] = op(t[i + 4], t[i]);
  for (int i = 0; i < 2; ++i) t[i] = op(t[i], t[i + 2]);
  return op(t[0], t[1]);
}
inline float reduce_add_ps(m512 a) {
  return reduce(a, [](float x, float y) { return x + y; });
}
inline float reduce_max_ps(m512 a) {
  return reduce(a, [](float x, float y) { return x > y ? x : y; });
}

// the decode kernel's widening loads and F16::fold (isa::F16's load_bf16, load_f16, load_i8, fold);
// __m128i, __m256i and __m256 are AVX2's own types here
inline m512 castsi512_ps(m512i x) {
  m512 r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}
inline m512i slli_epi32(m512i x, unsigned int n) {
  uint32_t lanes[16];
  std::memcpy(lanes, &x, sizeof lanes);
  for (auto& l : lanes) l = n > 31 ? 0u : l << n;
  return loadu_si512(lanes);
}
// vpmovzxwd and vpmovsxbd: 16 elements of type From (the low bytes of x) to 16 int32 lanes
template <class From, class In>
inline m512i widen_epi32(In x) {
  From e[16];
  int32_t lanes[16];
  std::memcpy(e, &x, sizeof e);
  for (int i = 0; i < 16; ++i) lanes[i] = e[i];
  return loadu_si512(lanes);
}
inline m512i cvtepu16_epi32(__m256i x) { return widen_epi32<uint16_t>(x); }
inline m512i cvtepi8_epi32(__m128i x) { return widen_epi32<int8_t>(x); }
inline m512 cvtepi32_ps(m512i x) {  // exact for the int8 values the kernels convert
  int32_t lanes[16];
  std::memcpy(lanes, &x, sizeof lanes);
  m512 r;
  for (int i = 0; i < 16; ++i) r[i] = static_cast<float>(lanes[i]);
  return r;
}
inline m512 cvtph_ps(__m256i x) {  // vcvtph2ps: exact (every fp16 value is a float32)
  uint16_t h[16];
  std::memcpy(h, &x, sizeof h);
  m512 r;
  for (int i = 0; i < 16; ++i) r[i] = isa::half_bits_to_float(h[i]);
  return r;
}
// vshuff32x4 (a, b, imm): 128-bit lanes 0, 1 of the result from a, 2, 3 from b, each picked by 2 bits of imm
inline m512 shuffle_f32x4(m512 a, m512 b, int imm) {
  m512 r;
  for (int i = 0; i < 4; ++i) {
    const m512& src = i < 2 ? a : b;
    const int lane = imm >> (2 * i) & 3;
    for (int j = 0; j < 4; ++j) r[4 * i + j] = src[4 * lane + j];
  }
  return r;
}
// vpunpck{l,h}wd: per 128-bit lane, the low (high) four 16-bit elements of a and b, alternating
inline m512i unpack_epi16(m512i a, m512i b, int half) {
  int16_t x[32], y[32], r[32];
  std::memcpy(x, &a, 64), std::memcpy(y, &b, 64);
  for (int lane = 0; lane < 4; ++lane)
    for (int i = 0; i < 4; ++i) {
      r[8 * lane + 2 * i] = x[8 * lane + 4 * half + i];
      r[8 * lane + 2 * i + 1] = y[8 * lane + 4 * half + i];
    }
  return loadu_si512(r);
}
inline m512i unpacklo_epi16(m512i a, m512i b) { return unpack_epi16(a, b, 0); }
inline m512i unpackhi_epi16(m512i a, m512i b) { return unpack_epi16(a, b, 1); }
inline m512i setzero_si512() { return m512i{}; }
inline m512i cvtepi8_epi16(__m256i x) {  // vpmovsxbw: 32 int8 to 32 int16
  int8_t b[32];
  int16_t r[32];
  std::memcpy(b, &x, 32);
  for (int i = 0; i < 32; ++i) r[i] = b[i];
  return loadu_si512(r);
}
// vpdpwssd on 512 bits: each int32 lane of src plus the two products of its int16 pairs, wrapping
// vpdpwssd over Lanes int32 lanes (the same code for 256 and 512 bits): each lane of src plus the
// two products of its int16 pairs, wrapping as the instruction does (not the saturating vpdpwssds)
template <int Lanes, class Vec>
inline Vec dpwssd(Vec src, Vec a, Vec b) {
  static_assert(sizeof(Vec) == 4 * Lanes, "dpwssd: Lanes int32 lanes");
  int32_t s[Lanes];
  int16_t x[2 * Lanes], y[2 * Lanes];
  std::memcpy(s, &src, sizeof s), std::memcpy(x, &a, sizeof x), std::memcpy(y, &b, sizeof y);
  for (int j = 0; j < Lanes; ++j) {
    const int64_t t = int64_t(s[j]) + int32_t(x[2 * j]) * y[2 * j] + int32_t(x[2 * j + 1]) * y[2 * j + 1];
    s[j] = static_cast<int32_t>(static_cast<uint32_t>(t));
  }
  Vec r;
  std::memcpy(&r, s, sizeof r);
  return r;
}
inline m512i dpwssd_epi32_512(m512i src, m512i a, m512i b) { return dpwssd<16>(src, a, b); }
inline m512i add_epi32(m512i a, m512i b) {
  int32_t x[16], y[16];
  std::memcpy(x, &a, 64), std::memcpy(y, &b, 64);
  for (int j = 0; j < 16; ++j) x[j] = static_cast<int32_t>(static_cast<uint32_t>(x[j]) + static_cast<uint32_t>(y[j]));
  return loadu_si512(x);
}
// vunpck{l,h}ps: per 128-bit lane, a[0], b[0], a[1], b[1] (low) or a[2], b[2], a[3], b[3] (high)
inline m512 unpack_ps(m512 a, m512 b, int half) {
  m512 r;
  for (int lane = 0; lane < 4; ++lane)
    for (int i = 0; i < 2; ++i) {
      r[4 * lane + 2 * i] = a[4 * lane + 2 * half + i];
      r[4 * lane + 2 * i + 1] = b[4 * lane + 2 * half + i];
    }
  return r;
}
inline m512 unpacklo_ps(m512 a, m512 b) { return unpack_ps(a, b, 0); }
inline m512 unpackhi_ps(m512 a, m512 b) { return unpack_ps(a, b, 1); }
// vshufps: per 128-bit lane, a[imm 0-1], a[imm 2-3], b[imm 4-5], b[imm 6-7]
inline m512 shuffle_ps(m512 a, m512 b, int imm) {
  m512 r;
  for (int lane = 0; lane < 4; ++lane)
    for (int i = 0; i < 4; ++i) r[4 * lane + i] = (i < 2 ? a : b)[4 * lane + (imm >> (2 * i) & 3)];
  return r;
}
// vpermt2ps: lane i of the result is lane idx[i] % 32 of a's and b's 32 (a first)
inline m512 permutex2var_ps(m512 a, m512i idx, m512 b) {
  int32_t k[16];
  std::memcpy(k, &idx, 64);
  m512 r;
  for (int i = 0; i < 16; ++i) r[i] = (k[i] & 16) ? b[k[i] & 15] : a[k[i] & 15];
  return r;
}
inline __m256 castps512_ps256(m512 x) {
  __m256 r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}

// bf16 <-> float32 as the bf16 instructions see them: denormal inputs are zero
inline float bf16_daz(uint16_t h) {
  const uint32_t bits = (h & 0x7f80u) == 0 ? (static_cast<uint32_t>(h) & 0x8000u) << 16 : static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t to_bf16_rne(float f) {  // vcvtne2ps2bf16: to nearest even, denormals to 0, NaN quiet
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  if ((bits & 0x7f800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
// lanes 0..15 from b, 16..31 from a
inline m512bh cvtne2ps_pbh(m512 a, m512 b) {
  m512bh r;
  for (int i = 0; i < 16; ++i) {
    r[i] = static_cast<short>(to_bf16_rne(b[i]));
    r[i + 16] = static_cast<short>(to_bf16_rne(a[i]));
  }
  return r;
}
// a float32 denormal as zero of its sign (the bf16 instructions' DAZ on inputs, FTZ on results)
inline float flush_denormal(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
// vdpbf16ps over Lanes float32 lanes: src[j] + a[2j + 1] b[2j + 1] + a[2j] b[2j] (Intel's order), as
// the instruction does it (issue 49: against the real one it differed in 1,618 of 800k random-bit
// lanes, most with denormal products or accumulators): denormal inputs, the accumulator's
// included, read as zero; each step one fused multiply-add, rounded once (a product of two bf16
// is exact in float32 only while it stays a normal number); each step's denormal result flushed
// to zero. tests/kernels/test_real_instructions.py holds it to a model of that and, on a CPU with
// AVX512_BF16, to the instruction itself.
// Whether acc + x y is tiny as the instruction sees it: below 2^-126 once rounded to 24 bits with
// an unbounded exponent (tininess after rounding, x86's rule), given r, its float32 rounding with
// gradual underflow. The same Zen 5: -2^-126 + 1.5 * 2^-151 gave -0 (rounded to 24 bits it is
// 2^-150 below the smallest normal), -2^-126 + 2^-219 gave -2^-126. So tiny exactly when |acc + x y|
// < M = 2^-126 - 2^-151, the midpoint below 2^-126 (a tie rounds to 2^-126, the even one), decided
// on acc + x y as an exact double two-sum s + e (x y is exact in double: two 8-bit significands).
inline bool tiny_after_rounding(float x, float y, float acc, float r) {
  const float min_normal = 1.17549435e-38f;  // 2^-126
  if (r == 0.0f || std::fabs(r) > min_normal) return r == 0.0f;
  const double p = double(x) * double(y), s = double(acc) + p, bb = s - acc;
  const double e = (double(acc) - (s - bb)) + (p - bb);  // acc + p = s + e exactly
  const double m = std::ldexp(1.0, -126) - std::ldexp(1.0, -151);
  return (std::fabs(s) - m) + (s > 0 ? e : -e) < 0;
}
// One step's NaN, as the CPU picks it (a 2-core EPYC Zen 5's vdpbf16ps, 2026-12-04, issue 49's real-instruction test): the
// first factor's NaN, quieted, whenever it is one, signalling or not, then the second's, then the
// accumulator's. std::fma follows IEEE's rule instead (a signalling NaN first) and differed in 114
// of 65,536 lanes, a signalling NaN against a quiet one in the two factors.
inline float fma_step(float x, float y, float acc) {
  const auto quiet = [](float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    bits |= 0x00400000u;
    std::memcpy(&v, &bits, 4);
    return v;
  };
  if (std::isnan(x)) return quiet(x);
  if (std::isnan(y)) return quiet(y);
  if (std::isnan(acc)) return quiet(acc);
  const float r = std::fma(x, y, acc);
  return tiny_after_rounding(x, y, acc, r) ? std::copysign(0.0f, r) : r;
}
template <int Lanes, class F, class BH>
inline F dpbf16(F src, BH a, BH b) {
  for (int j = 0; j < Lanes; ++j) {
    const auto at = [](BH x, int i) { return bf16_daz(static_cast<uint16_t>(x[i])); };
    const float t = flush_denormal(fma_step(at(a, 2 * j + 1), at(b, 2 * j + 1), flush_denormal(src[j])));
    src[j] = flush_denormal(fma_step(at(a, 2 * j), at(b, 2 * j), t));
  }
  return src;
}
inline m512 dpbf16_ps(m512 src, m512bh a, m512bh b) { return dpbf16<16>(src, a, b); }
// on 256 bits (AVX512_BF16 with AVX512VL: decode.cpp's bf16 dot products); __m256 is AVX's own
// type here (the emulated build runs on AVX2 CPUs)
typedef short m256bh __attribute__((vector_size(32)));  // 16 bf16, as GCC 12's __m256bh
inline __m256 dpbf16_ps256(__m256 src, m256bh a, m256bh b) { return dpbf16<8>(src, a, b); }

// vpdpwssd on 256 bits (AVX512_VNNI with AVX512VL: decode.cpp's int8 dot products): each int32
// lane of src plus the two products of its int16 pairs, wrapping as the instruction does (not the
// saturating vpdpwssds)
inline __m256i dpwssd_epi32(__m256i src, __m256i a, __m256i b) { return dpwssd<8>(src, a, b); }

}  // namespace attnlab_avx512_emulated

#pragma GCC diagnostic pop

// the names the kernels use, for the functions above; then their AVX-512 branches
#if !defined(__AVX512F__)
#define __m512 attnlab_avx512_emulated::m512
#define __m512i attnlab_avx512_emulated::m512i
#define __mmask16 attnlab_avx512_emulated::mmask16
#define _mm512_loadu_ps attnlab_avx512_emulated::loadu_ps
#define _mm512_storeu_ps attnlab_avx512_emulated::storeu_ps
#define _mm512_loadu_si512 attnlab_avx512_emulated::loadu_si512
#define _mm512_storeu_si512 attnlab_avx512_emulated::storeu_si512
#define _mm512_setzero_ps attnlab_avx512_emulated::setzero_ps
#define _mm512_set1_ps attnlab_avx512_emulated::set1_ps
#define _mm512_set1_epi32 attnlab_avx512_emulated::set1_epi32
#define _mm512_add_ps attnlab_avx512_emulated::add_ps
#define _mm512_sub_ps attnlab_avx512_emulated::sub_ps
#define _mm512_mul_ps attnlab_avx512_emulated::mul_ps
#define _mm512_fmadd_ps attnlab_avx512_emulated::fmadd_ps
#define _mm512_max_ps attnlab_avx512_emulated::max_ps
#define _mm512_roundscale_ps attnlab_avx512_emulated::roundscale_ps
#define _mm512_scalef_ps attnlab_avx512_emulated::scalef_ps
#define _mm512_mask_loadu_ps attnlab_avx512_emulated::mask_loadu_ps
#define _mm512_maskz_loadu_ps attnlab_avx512_emulated::maskz_loadu_ps
#define _mm512_mask_storeu_ps attnlab_avx512_emulated::mask_storeu_ps
#define _mm512_maskz_mov_ps attnlab_avx512_emulated::maskz_mov_ps
#define _mm512_reduce_add_ps attnlab_avx512_emulated::reduce_add_ps
#define _mm512_reduce_max_ps attnlab_avx512_emulated::reduce_max_ps
#define _mm512_castsi512_ps attnlab_avx512_emulated::castsi512_ps
#define _mm512_slli_epi32 attnlab_avx512_emulated::slli_epi32
#define _mm512_cvtepu16_epi32 attnlab_avx512_emulated::cvtepu16_epi32
#define _mm512_cvtepi8_epi32 attnlab_avx512_emulated::cvtepi8_epi32
#define _mm512_cvtepi32_ps attnlab_avx512_emulated::cvtepi32_ps
#define _mm512_cvtph_ps attnlab_avx512_emulated::cvtph_ps
#define _mm512_shuffle_f32x4 attnlab_avx512_emulated::shuffle_f32x4
#define _mm512_castps512_ps256 attnlab_avx512_emulated::castps512_ps256
#define _mm512_unpacklo_epi16 attnlab_avx512_emulated::unpacklo_epi16
#define _mm512_unpackhi_epi16 attnlab_avx512_emulated::unpackhi_epi16
#define _mm512_setzero_si512 attnlab_avx512_emulated::setzero_si512
#define _mm512_cvtepi8_epi16 attnlab_avx512_emulated::cvtepi8_epi16
#define _mm512_add_epi32 attnlab_avx512_emulated::add_epi32
#define _mm512_unpacklo_ps attnlab_avx512_emulated::unpacklo_ps
#define _mm512_unpackhi_ps attnlab_avx512_emulated::unpackhi_ps
#define _mm512_shuffle_ps attnlab_avx512_emulated::shuffle_ps
#define _mm512_permutex2var_ps attnlab_avx512_emulated::permutex2var_ps
#define ATTNLAB_AVX512F_EMULATED 1  // isa::F16::keep: no zmm registers to keep a value in
#define __AVX512F__ 1
#endif  // !__AVX512F__

#if !defined(__AVX512BF16__)
#define __m512bh attnlab_avx512_emulated::m512bh
#define _mm512_cvtne2ps_pbh attnlab_avx512_emulated::cvtne2ps_pbh
#define _mm512_dpbf16_ps attnlab_avx512_emulated::dpbf16_ps
#define __m256bh attnlab_avx512_emulated::m256bh
#define _mm256_dpbf16_ps attnlab_avx512_emulated::dpbf16_ps256
#define __AVX512BF16__ 1
#endif  // !__AVX512BF16__

#if !defined(__AVX512VNNI__)
#define _mm256_dpwssd_epi32 attnlab_avx512_emulated::dpwssd_epi32
#define _mm512_dpwssd_epi32 attnlab_avx512_emulated::dpwssd_epi32_512
#define __AVX512VNNI__ 1
#endif  // !__AVX512VNNI__

#endif  // !__AVX512F__ || !__AVX512BF16__ || !__AVX512VNNI__
