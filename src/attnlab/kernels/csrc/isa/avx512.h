// The instruction-set seam (isa/isa.h), AVX-512: isa::F16, sixteen float32 lanes in a zmm with
// masked edges, and (AVX512_BF16) isa::B32, 32 bf16 in a zmm, with vdpbf16ps and vcvtne2ps2bf16.
// Included by isa.h only, when the build has them (or emulates them: avx512_emulated.h).
#pragma once

#include <cstdint>
#include <cstring>

namespace isa {

struct F16 {  // 16 floats
  static constexpr bool real = true;
  static constexpr int W = 16;
  using V = __m512;
  static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1u); }  // lanes [0, n), n <= 16
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V bcast(const float* p) { return _mm512_set1_ps(*p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  // masked: lanes [0, n) from p (the others `fill`, never read), the first n lanes of x to p
  static V load_partial(const float* p, int n, float fill) { return _mm512_mask_loadu_ps(set1(fill), first(n), p); }
  static void store_partial(float* p, int n, V x) { _mm512_mask_storeu_ps(p, first(n), x); }
  static V keep_first(V x, int n) { return _mm512_maskz_mov_ps(first(n), x); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  // 2^x for x <= 0: vroundscaleps gives n, vscalefps multiplies by 2^n (and underflows to 0 by
  // itself), and the polynomial in f is a degree-6 near-minimax fit of 2^f on [-1/2, 1/2]
  // (relative error 1.0e-7 in float32, about torch's own exp); 11 vector ops for 16 values where
  // the portable version needs 18: the row pass is bound by this arithmetic.
  static V exp2_nonpos(V x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));  // keeps x - n finite for x = -inf
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    const __m512 p = exp2_poly<F16>(f);
    return _mm512_scalef_ps(p, n);
  }
  // The decode kernel's streaming loop (decode_dots.h, decode.cpp), as isa::F8's: 16 stored
  // elements widened to float32 (bf16: a shift; fp16: vcvtph2ps; int8 without its scale), keep,
  // and sum4, the four sums of s0..s3 (each folded to 8 lanes, then F8's hadd tree)
  static V load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // F8::keep's reason, for zmm registers ("v"); the emulated build's vectors are not registers
  static void keep(V& x) {
#if defined(ATTNLAB_AVX512F_EMULATED)
    (void)x;
#else
    asm("" : "+v"(x));
#endif
  }
  // lanes i + lanes i + 8, as 8 lanes (vshuff32x4 moves the high 256 bits down)
  static __m256 fold(V x) { return _mm512_castps512_ps256(_mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xEE))); }
  static F4::V sum4(V s0, V s1, V s2, V s3) { return F8::sum4(fold(s0), fold(s1), fold(s2), fold(s3)); }
  // dst[r * ld + k] = a_k[r] for rows r < rows (<= 16) and keys k < 8: eight keys' 16-lane results
  // (one row a lane) as rows of 8 (the decode kernel's scores with its query rows across lanes): an
  // 8 x 16 transpose in 16 shuffles and 16 permutes, 2 a key, where lane-by-lane stores take 16
  static void store_transposed8(V a0, V a1, V a2, V a3, V a4, V a5, V a6, V a7, float* dst, int64_t ld, int rows) {
    // per 128-bit lane L: rows 4L, 4L + 1 (lo) and 4L + 2, 4L + 3 (hi) of two keys, interleaved
    const V t0 = _mm512_unpacklo_ps(a0, a1), t1 = _mm512_unpackhi_ps(a0, a1);
    const V t2 = _mm512_unpacklo_ps(a2, a3), t3 = _mm512_unpackhi_ps(a2, a3);
    const V t4 = _mm512_unpacklo_ps(a4, a5), t5 = _mm512_unpackhi_ps(a4, a5);
    const V t6 = _mm512_unpacklo_ps(a6, a7), t7 = _mm512_unpackhi_ps(a6, a7);
    // u[i] (and u[4 + i]): in lane L, row 4L + i's keys 0-3 (4-7)
    const V u[8] = {_mm512_shuffle_ps(t0, t2, 0x44), _mm512_shuffle_ps(t0, t2, 0xEE), _mm512_shuffle_ps(t1, t3, 0x44),
                    _mm512_shuffle_ps(t1, t3, 0xEE), _mm512_shuffle_ps(t4, t6, 0x44), _mm512_shuffle_ps(t4, t6, 0xEE),
                    _mm512_shuffle_ps(t5, t7, 0x44), _mm512_shuffle_ps(t5, t7, 0xEE)};
    for (int i = 0; i < 4; ++i) {
      V r01, r23;  // rows i, 4 + i: keys 0-7 each; rows 8 + i, 12 + i (undeal's permutes)
      undeal(u[i], u[4 + i], &r01, &r23);
      const V h01 = _mm512_shuffle_f32x4(r01, r01, 0xEE), h23 = _mm512_shuffle_f32x4(r23, r23, 0xEE);
      if (i < rows) F8::store(dst + i * ld, _mm512_castps512_ps256(r01));
      if (4 + i < rows) F8::store(dst + (4 + i) * ld, _mm512_castps512_ps256(h01));
      if (8 + i < rows) F8::store(dst + (8 + i) * ld, _mm512_castps512_ps256(r23));
      if (12 + i < rows) F8::store(dst + (12 + i) * ld, _mm512_castps512_ps256(h23));
    }
  }
  // 32 columns in B32::interleave's order (lo: 0-3, 8-11, 16-19, 24-27; hi: 4-7, 12-15, 20-23,
  // 28-31) back to their own (l0: 0-15, l1: 16-31)
  static void undeal(V lo, V hi, V* l0, V* l1) {
    alignas(64) static const int32_t a[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    alignas(64) static const int32_t b[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    *l0 = _mm512_permutex2var_ps(lo, _mm512_loadu_si512(a), hi);
    *l1 = _mm512_permutex2var_ps(lo, _mm512_loadu_si512(b), hi);
  }
};
constexpr bool kF16 = true;

#if defined(__AVX512BW__) || defined(ATTNLAB_AVX512F_EMULATED)
// 16 int32 lanes of pairs of int16: the int8 decode lane kernel's (decode_lanes.h), vpdpwssd on 512
// bits where the build has AVX512_VNNI (else vpmaddwd and vpaddd: the same wrapping sums)
struct I32 {
  static constexpr bool real = true;
  using V = __m512i;
  static V zero() { return _mm512_setzero_si512(); }
  static V load(const uint32_t* p) { return _mm512_loadu_si512(reinterpret_cast<const void*>(p)); }
  static V pair(const int16_t* p) {  // the pair p[0], p[1] in every 32-bit lane
    int32_t two;
    std::memcpy(&two, p, 4);
    return _mm512_set1_epi32(two);
  }
  static V dot_pairs(V acc, V a, V b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
  }
  static V add(V a, V b) { return _mm512_add_epi32(a, b); }
  static __m512 to_float(V x) { return _mm512_cvtepi32_ps(x); }  // exact below 2^24, rounded above
  // dst[0..32) = p[0..32) sign-extended to int16 (vpmovsxbw)
  static void widen_i8x32(const int8_t* p, int16_t* dst) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    _mm512_storeu_si512(reinterpret_cast<void*>(dst), _mm512_cvtepi8_epi16(b));
  }
};
constexpr bool kI32 = true;
#endif

#if defined(__AVX512BF16__)
struct B32 {  // 32 bf16 (as their bits), the operand of vdpbf16ps
  static constexpr bool real = true;
  using V = __m512bh;
  static V load(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(p))); }
  static V pair(const uint16_t* p) {  // the pair p[0], p[1] in every 32-bit lane
    int32_t two;
    std::memcpy(&two, p, 4);
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(two));
  }
  static V pair(uint32_t two) { return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(two))); }
  // the pairs (r0[j], r1[j]) of 32 columns: *lo holds columns 0-3, 8-11, 16-19, 24-27, *hi the
  // others (vpunpck{l,h}wd keep to 128-bit lanes; F16::undeal takes float32 columns back from it);
  // r1 null: pairs with 0
  static void interleave(const uint16_t* r0, const uint16_t* r1, V* lo, V* hi) {
    const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(r0));
    const __m512i b = r1 ? _mm512_loadu_si512(reinterpret_cast<const void*>(r1)) : _mm512_setzero_si512();
    *lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
    *hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
  }
};
// acc[j] + a[2j] b[2j] + a[2j + 1] b[2j + 1] per float32 lane (vdpbf16ps)
inline __m512 dpbf16(__m512 acc, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(acc, a, b); }
// dst[0..32) = bf16(src[0..32)), to nearest even (vcvtne2ps2bf16: denormals to 0, NaN quiet)
inline void to_bf16_x32(const float* src, uint16_t* dst) {
  const __m512bh two = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
  _mm512_storeu_si512(reinterpret_cast<void*>(dst), reinterpret_cast<__m512i>(two));
}
constexpr bool kBf16 = true;
#endif

#if defined(__AVX512BF16__) && (defined(__AVX512VL__) || defined(ATTNLAB_EMULATE_AVX512))
// 16 bf16 in a ymm: vdpbf16ps on 256 bits (AVX512_BF16 with VL), the decode kernel's where a head
// size is not a multiple of 32 (of 64 for the value pass); else it takes B32 (decode_bf16.h).
struct B16 {
  static constexpr bool real = true;
  using V = __m256bh;
  static V load(const uint16_t* p) { return reinterpret_cast<__m256bh>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V pair(uint32_t two) { return reinterpret_cast<__m256bh>(_mm256_set1_epi32(static_cast<int>(two))); }
  // the pairs (r0[j], r1[j]) of 16 columns: *lo holds columns 0-3 and 8-11, *hi 4-7 and 12-15
  // (vpunpck{l,h}wd keep to 128-bit lanes); r1 null: pairs with 0
  static void interleave(const uint16_t* r0, const uint16_t* r1, V* lo, V* hi) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0));
    const __m256i b = r1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1)) : _mm256_setzero_si256();
    *lo = reinterpret_cast<__m256bh>(_mm256_unpacklo_epi16(a, b));
    *hi = reinterpret_cast<__m256bh>(_mm256_unpackhi_epi16(a, b));
  }
};
// acc[j] + a[2j] b[2j] + a[2j + 1] b[2j + 1] per float32 lane, 8 lanes
inline __m256 dpbf16(__m256 acc, __m256bh a, __m256bh b) { return _mm256_dpbf16_ps(acc, a, b); }
#endif

}  // namespace isa
