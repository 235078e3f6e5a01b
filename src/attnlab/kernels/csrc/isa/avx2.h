// The instruction-set seam (isa/isa.h), AVX2 + FMA: isa::F8, eight float32 lanes in a ymm, and
// the 16-bit shuffles of the bf16 GEMM's packing. Included by isa.h only, when the build has them.
#pragma once

#include <immintrin.h>

#include "portable.h"  // half_bits_to_float

#include <cstdint>
#include <cstring>

namespace isa {

struct F4 {  // 4 floats: a row's four scores
  using V = __m128;
  static V set1(float x) { return _mm_set1_ps(x); }
  static V load(const float* p) { return _mm_loadu_ps(p); }
  static void store(float* p, V x) { _mm_storeu_ps(p, x); }
  static V mul(V a, V b) { return _mm_mul_ps(a, b); }
};

struct F8 {  // 8 floats
  static constexpr bool real = true;
  static constexpr int W = 8;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  // lanes [0, n) from p, the rest `fill`; the first n lanes of x to p (n < W): through a buffer
  static V load_partial(const float* p, int n, float fill) {
    alignas(32) float b[8] = {fill, fill, fill, fill, fill, fill, fill, fill};
    std::memcpy(b, p, sizeof(float) * n);
    return _mm256_load_ps(b);
  }
  static void store_partial(float* p, int n, V x) {
    alignas(32) float b[8];
    _mm256_store_ps(b, x);
    std::memcpy(p, b, sizeof(float) * n);
  }
  static V keep_first(V x, int n) {  // lanes n.. set to 0
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane)));
  }
  static float reduce_add(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  // 8 stored elements widened to float32: bf16 (the top half of a float32: a shift), fp16 (F16C's
  // vcvtph2ps), int8 (without its scale)
  static V load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load_f16(const uint16_t* p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float b[8];
    for (int i = 0; i < 8; ++i) b[i] = half_bits_to_float(p[i]);
    return _mm256_load_ps(b);
#endif
  }
  static V load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // Keep x in a register: without this GCC folds a float32 load into each FMA that uses it, so a
  // key's 8 elements were loaded four times (once per query row) and the decode loop was bound by
  // the load ports (two 256-bit loads a cycle on Zen 3), not the FMAs.
  static void keep(V& x) { asm("" : "+x"(x)); }
  // the four sums of s0..s3, as one vector (a hadd tree: cheaper than four horizontal sums)
  static F4::V sum4(V s0, V s1, V s2, V s3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
  // (a's low 128 bits, b's low) and (a's high, b's high)
  static V join_lo(V a, V b) { return _mm256_permute2f128_ps(a, b, 0x20); }
  static V join_hi(V a, V b) { return _mm256_permute2f128_ps(a, b, 0x31); }
  // 16 columns in B16::interleave's order (lo: 0-3, 8-11; hi: 4-7, 12-15) back to their own
  // (l0: 0-7, l1: 8-15)
  static void undeal(V lo, V hi, V* l0, V* l1) { *l0 = join_lo(lo, hi), *l1 = join_hi(lo, hi); }
  // 2^x for x <= 0: n = round(x), 2^f (f = x - n in [-1/2, 1/2]) by a degree-6 near-minimax
  // polynomial (relative error 1.0e-7), 2^n written into the exponent bits; x <= -127 gives 0.
  // GCC does not vectorise the portable loop (objdump of the build on an AVX2-only EPYC: 4 ymm FMAs
  // in the whole library, 60 scalar ones), so this is written out.
  static V exp2_nonpos(V x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));  // also keeps x - n finite for x = -inf
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    const __m256 p = exp2_poly<F8>(f);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
};
constexpr bool kF8 = true;

// 16 int16 lanes: the int8 cache's integer dot products (the query rounded to int16, the keys
// sign-extended), summed in pairs into 8 int32 lanes
struct I16 {
  static constexpr bool real = true;
  using V = __m256i;
  static V zero() { return _mm256_setzero_si256(); }
  static V load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V widen_i8(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void keep(V& x) { asm("" : "+x"(x)); }
  // acc + the sums of a's and b's int16 pairs, per int32 lane: one vpdpwssd where the build has
  // AVX512_VNNI with VL (the avx512-emulated build has it everywhere), else vpmaddwd and vpaddd.
  // The same wrapping int32 sums either way, so the two give the same bits.
  static V dot_pairs(V acc, V a, V b) {
#if defined(__AVX512VNNI__) && (defined(__AVX512VL__) || defined(ATTNLAB_EMULATE_AVX512))
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
  }
  // the four sums of the int32 lanes of s0..s3, as floats (sum4's tree on integers: exact)
  static F4::V sum4(V s0, V s1, V s2, V s3) {
    const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
    return _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
  }
};
#if defined(__AVX512VNNI__) && (defined(__AVX512VL__) || defined(ATTNLAB_EMULATE_AVX512))
constexpr bool kVnni = true;  // I16::dot_pairs is one vpdpwssd
#else
constexpr bool kVnni = false;
#endif
#if defined(__F16C__)
constexpr bool kF16c = true;  // F8::load_f16 (vcvtph2ps)
#else
constexpr bool kF16c = false;
#endif

// dst's 16 pairs (dst[2 j], dst[2 j + 1]) = (r0[j], r1[j]), j < 16: vpunpck{l,h}wd, then
// vperm2i128 to undo their 128-bit lanes
inline void interleave16(const uint16_t* r0, const uint16_t* r1, uint16_t* dst) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1));
  const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);  // cols 0-3, 8-11 | 4-7, 12-15
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(lo, hi, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
}

// dst[p * dst_ld + 2 j + t] = x[j * ld + 2 p + t] for j, p < 8: an 8 x 8 transpose of 32-bit pairs
inline void transpose_pairs8x8(const uint16_t* x, int64_t ld, uint16_t* dst, int64_t dst_ld) {
  __m256i r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * ld));
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // rows i and i + 4 of the transpose: low and high 128-bit halves
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * dst_ld), _mm256_permute2x128_si256(r[i], r[i + 4], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (i + 4) * dst_ld),
                        _mm256_permute2x128_si256(r[i], r[i + 4], 0x31));
  }
}
constexpr bool kShuffles16 = true;

}  // namespace isa
