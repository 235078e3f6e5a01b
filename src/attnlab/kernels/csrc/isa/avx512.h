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
    __m512 p = _mm512_set1_ps(1.5370704932138324e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3399848248809576e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618373587727547e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550329014658928e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022647738456726f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471824645996f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
  }
};
constexpr bool kF16 = true;

#if defined(__AVX512BF16__)
struct B32 {  // 32 bf16 (as their bits), the operand of vdpbf16ps
  using V = __m512bh;
  static V load(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(p))); }
  static V pair(const uint16_t* p) {  // the pair p[0], p[1] in every 32-bit lane
    int32_t two;
    std::memcpy(&two, p, 4);
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(two));
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
// 16 bf16 in a ymm: vdpbf16ps on 256 bits (AVX512_BF16 with VL), the decode kernel's. 256 bits,
// not 512: Zen 4 runs a 512-bit vdpbf16ps as two halves anyway, and 8-lane sums reuse F8::sum4.
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
