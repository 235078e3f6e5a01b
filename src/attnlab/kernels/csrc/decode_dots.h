// attnlab's decode kernel (decode.cpp), its dot products: the streaming loop's scores of a few
// query rows against K rows read as stored (float32, bf16, fp16; int8 on integers against the query
// rounded to int16; bf16 on vdpbf16ps where the build has it). Included by decode.cpp only.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// ---------------------------------------------------------------------------------------------
// The streaming loop: one key block, each K and V row read once in its stored dtype
// ---------------------------------------------------------------------------------------------

// 8 stored elements as float32 (int8 without its scale)
#if defined(__AVX2__) && defined(__FMA__)
inline float sum8(__m256 v) {  // kernels.h's hsum8 lives on its AVX2-only branch; this one on both ISAs
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

template <class T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <>
inline __m256 load8<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
inline __m256 load8<int8_t>(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

template <class T>
inline float widen(T x) { return static_cast<float>(x); }
template <>
inline float widen<int8_t>(int8_t x) { return static_cast<float>(x); }

#if defined(__AVX2__) && defined(__FMA__)
// Keep x in a register: without this GCC folds a float32 load into each FMA that uses it, so a
// key's 8 elements were loaded four times (once per query row) and the loop was bound by the load
// ports (two 256-bit loads a cycle on Zen 3), not the FMAs.
inline void in_register(__m256& x) { asm("" : "+x"(x)); }

// the four sums of s0..s3, as one vector (a hadd tree: cheaper than four horizontal sums)
inline __m128 sum8x4(__m256 s0, __m256 s1, __m256 s2, __m256 s3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
#endif

// s[a * nk + j] (j = j0, j0 + 1) = f_j * q[a] . k_j for the n query rows (E apart) and two
// key rows k0, k1: each 8 elements of a key are loaded (and widened) once and feed four rows'
// FMA chains; two keys at a time share each load of a query chunk. k1 may be null (one key).
template <class T>
inline void dots2(const float* __restrict__ q, int64_t n, int64_t E, const T* __restrict__ k0,
                  const T* __restrict__ k1, float f0, float f1, float* __restrict__ s, int nk, int j0) {
  int64_t a = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t full = E & ~int64_t(7);
  for (; a + 4 <= n; a += 4) {
    const float *q0 = q + a * E, *q1 = q0 + E, *q2 = q1 + E, *q3 = q2 + E;
    __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0;  // key 0, rows a .. a + 3
    __m256 y0 = x0, y1 = x0, y2 = x0, y3 = x0;                    // key 1
    for (int64_t c = 0; c < full; c += 8) {
      __m256 a0 = _mm256_loadu_ps(q0 + c), a1 = _mm256_loadu_ps(q1 + c);
      __m256 a2 = _mm256_loadu_ps(q2 + c), a3 = _mm256_loadu_ps(q3 + c);
      in_register(a0), in_register(a1), in_register(a2), in_register(a3);
      __m256 kc = load8<T>(k0 + c);
      in_register(kc);
      x0 = _mm256_fmadd_ps(a0, kc, x0), x1 = _mm256_fmadd_ps(a1, kc, x1);
      x2 = _mm256_fmadd_ps(a2, kc, x2), x3 = _mm256_fmadd_ps(a3, kc, x3);
      if (k1) {
        __m256 kd = load8<T>(k1 + c);
        in_register(kd);
        y0 = _mm256_fmadd_ps(a0, kd, y0), y1 = _mm256_fmadd_ps(a1, kd, y1);
        y2 = _mm256_fmadd_ps(a2, kd, y2), y3 = _mm256_fmadd_ps(a3, kd, y3);
      }
    }
    alignas(16) float rx[4], ry[4];
    _mm_store_ps(rx, _mm_mul_ps(sum8x4(x0, x1, x2, x3), _mm_set1_ps(f0)));
    _mm_store_ps(ry, _mm_mul_ps(sum8x4(y0, y1, y2, y3), _mm_set1_ps(f1)));
    for (int64_t c = full; c < E; ++c) {  // the last elements, one at a time
      const float kc = widen<T>(k0[c]), kd = k1 ? widen<T>(k1[c]) : 0.0f;
      for (int i = 0; i < 4; ++i) rx[i] += f0 * q[(a + i) * E + c] * kc, ry[i] += f1 * q[(a + i) * E + c] * kd;
    }
    for (int i = 0; i < 4; ++i) {
      s[(a + i) * nk + j0] = rx[i];
      if (k1) s[(a + i) * nk + j0 + 1] = ry[i];
    }
  }
#endif
  for (; a < n; ++a) {  // rows left over (and every row without AVX2)
    const float* qa = q + a * E;
    float r0 = 0.0f, r1 = 0.0f;
#pragma omp simd reduction(+ : r0, r1)
    for (int64_t c = 0; c < E; ++c) {
      r0 += qa[c] * widen<T>(k0[c]);
      r1 += k1 ? qa[c] * widen<T>(k1[c]) : 0.0f;
    }
    s[a * nk + j0] = f0 * r0;
    if (k1) s[a * nk + j0 + 1] = f1 * r1;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// s[a * nk + j0 .. j0 + 3] = f[0 .. 3] * (q[a] . k_j) for the n query rows (E apart) and four key
// rows (k, k_ld apart): two rows by four keys, eight FMA chains; each 8 elements of a key are loaded
// (and widened) once per two rows, and a row's four sums leave as one 4-wide store. The four rows
// by two keys this replaced left each score as a scalar (eight extracts and stores per tile), and
// its reductions took a quarter of the loop's time (perf, 2026-12-03, 2-core AVX2 EPYC, q (8, 4, 4,
// 128) fp32 against S = 2048, one thread). Needs E % 8 == 0 and n even (stream_scores: n >= 8).
template <class T>
inline void dots4(const float* __restrict__ q, int64_t n, int64_t E, const T* __restrict__ k, int64_t k_ld,
                  const float* f, float* __restrict__ s, int nk, int j0) {
  const T *k0 = k, *k1 = k0 + k_ld, *k2 = k1 + k_ld, *k3 = k2 + k_ld;
  const __m128 fv = _mm_loadu_ps(f);
  for (int64_t a = 0; a < n; a += 2) {
    const float *q0 = q + a * E, *q1 = q0 + E;
    __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0;  // row a, keys 0 .. 3
    __m256 y0 = x0, y1 = x0, y2 = x0, y3 = x0;                    // row a + 1
    for (int64_t c = 0; c < E; c += 8) {
      __m256 a0 = _mm256_loadu_ps(q0 + c), a1 = _mm256_loadu_ps(q1 + c);
      in_register(a0), in_register(a1);
      __m256 kc = load8<T>(k0 + c);
      in_register(kc);
      x0 = _mm256_fmadd_ps(a0, kc, x0), y0 = _mm256_fmadd_ps(a1, kc, y0);
      kc = load8<T>(k1 + c);
      in_register(kc);
      x1 = _mm256_fmadd_ps(a0, kc, x1), y1 = _mm256_fmadd_ps(a1, kc, y1);
      kc = load8<T>(k2 + c);
      in_register(kc);
      x2 = _mm256_fmadd_ps(a0, kc, x2), y2 = _mm256_fmadd_ps(a1, kc, y2);
      kc = load8<T>(k3 + c);
      in_register(kc);
      x3 = _mm256_fmadd_ps(a0, kc, x3), y3 = _mm256_fmadd_ps(a1, kc, y3);
    }
    _mm_storeu_ps(s + a * nk + j0, _mm_mul_ps(sum8x4(x0, x1, x2, x3), fv));
    _mm_storeu_ps(s + (a + 1) * nk + j0, _mm_mul_ps(sum8x4(y0, y1, y2, y3), fv));
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline void in_register(__m256i& x) { asm("" : "+x"(x)); }

// the four sums of the int32 lanes of s0..s3, as floats (sum8x4's tree on integers: exact)
inline __m128 isum8x4(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
  const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
  return _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
}

// acc + the sums of a's and b's int16 pairs, per int32 lane: one vpdpwssd where the build has
// AVX512_VNNI (with AVX512VL; the avx512-emulated build has it everywhere), else vpmaddwd and vpaddd.
// The same wrapping int32 sums either way, so the two give the same bits. Half the instructions
// of idots2's inner loop on a CPU with it (Zen 4, Ice Lake and later). NOT MEASURED: no such CPU in
// the session that wrote it (2026-12-03, 2-core AVX2 EPYC); `attnlab bench --decode`'s "int8" rows
// measure it on the first.
#if defined(__AVX512VNNI__) && (defined(__AVX512VL__) || defined(ATTNLAB_EMULATE_AVX512))
#define ATTNLAB_DECODE_VNNI_DOTS 1
#endif
inline __m256i dot_pairs(__m256i acc, __m256i a, __m256i b) {
#if defined(ATTNLAB_DECODE_VNNI_DOTS)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif

// An int8 cache's scores on integer dot products (int8_dot = 1: decode.py's "int16" route): the
// query rows rounded to int16 (qi, one scale per row in qs: quantize_rows), the key rows
// sign-extended to int16, and their pairs' products summed in int32 (dot_pairs: vpmaddwd and
// vpaddd, or vpdpwssd): exact, as |sum| <= 32767 * 128 * E < 2^31 for E <= 512 (every lane and the
// horizontal sum).
// s[a * nk + j] = f_j * qs[a] * sum_c qi[a, c] * k_j[c]. One vpmovsxbw, four vpmaddwd and four
// vpaddd (or four vpdpwssd) per 16 elements of a key and four rows, where the float32 route takes
// two conversions of two instructions and eight FMAs. Needs E % 16 == 0 (decode_forward checks). The query's rounding
// is at most half of amax / 32767 per element, 1/258 of the int8 keys' own (half of amax / 127).
// With the four-row value tile for int8 (stream_values), old and new builds alternated (q (1, 32,
// Lq, 128) against (1, 8, S, 128), one thread, CPU time, 2-core AVX2 EPYC, 2026-12-03, three rounds):
// int8 / bf16 time at Lq = 1 0.79-0.88x -> 0.64-0.75x (S = 4096 and 32768), at Lq = 4 0.85-0.96x ->
// 0.65-0.92x (one round of 1.03x in this VM's noise). BENCHMARKS.md, "int8 dot products on integers".
inline void idots2(const int16_t* __restrict__ qi, const float* __restrict__ qs, int64_t n, int64_t E,
                   const int8_t* __restrict__ k0, const int8_t* __restrict__ k1, float f0, float f1,
                   float* __restrict__ s, int nk, int j0) {
  int64_t a = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; a + 4 <= n; a += 4) {
    const int16_t *q0 = qi + a * E, *q1 = q0 + E, *q2 = q1 + E, *q3 = q2 + E;
    __m256i x0 = _mm256_setzero_si256(), x1 = x0, x2 = x0, x3 = x0;  // key 0, rows a .. a + 3
    __m256i y0 = x0, y1 = x0, y2 = x0, y3 = x0;                       // key 1
    for (int64_t c = 0; c < E; c += 16) {
      __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + c));
      __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q1 + c));
      __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q2 + c));
      __m256i a3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q3 + c));
      in_register(a0), in_register(a1), in_register(a2), in_register(a3);
      __m256i kc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k0 + c)));
      in_register(kc);
      x0 = dot_pairs(x0, a0, kc), x1 = dot_pairs(x1, a1, kc), x2 = dot_pairs(x2, a2, kc), x3 = dot_pairs(x3, a3, kc);
      if (k1) {
        __m256i kd = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k1 + c)));
        in_register(kd);
        y0 = dot_pairs(y0, a0, kd), y1 = dot_pairs(y1, a1, kd), y2 = dot_pairs(y2, a2, kd), y3 = dot_pairs(y3, a3, kd);
      }
    }
    const __m128 scale = _mm_loadu_ps(qs + a);
    alignas(16) float rx[4], ry[4];
    _mm_store_ps(rx, _mm_mul_ps(_mm_mul_ps(isum8x4(x0, x1, x2, x3), scale), _mm_set1_ps(f0)));
    _mm_store_ps(ry, _mm_mul_ps(_mm_mul_ps(isum8x4(y0, y1, y2, y3), scale), _mm_set1_ps(f1)));
    for (int i = 0; i < 4; ++i) {
      s[(a + i) * nk + j0] = rx[i];
      if (k1) s[(a + i) * nk + j0 + 1] = ry[i];
    }
  }
#endif
  for (; a < n; ++a) {  // rows left over (and every row without AVX2): the same integer sums
    const int16_t* qa = qi + a * E;
    int32_t r0 = 0, r1 = 0;
    for (int64_t c = 0; c < E; ++c) {
      r0 += static_cast<int32_t>(qa[c]) * k0[c];
      if (k1) r1 += static_cast<int32_t>(qa[c]) * k1[c];
    }
    s[a * nk + j0] = static_cast<float>(r0) * qs[a] * f0;
    if (k1) s[a * nk + j0 + 1] = static_cast<float>(r1) * qs[a] * f1;
  }
}

// qi (m, E) = the rows of q (m, E) rounded to int16 on a scale of their own, qs (m) = amax / 32767
// (round half to even, as torch.round: the reference rounds them the same way, attnlab.decoding).
// False when a row holds NaN or inf (the caller then redoes the call on the pure path).
inline bool quantize_rows(const float* q, int64_t m, int64_t E, int16_t* qi, float* qs) {
  for (int64_t a = 0; a < m; ++a) {
    const float* row = q + a * E;
    float amax = 0.0f;
    for (int64_t c = 0; c < E; ++c) amax = std::max(amax, std::fabs(row[c]));
    if (!std::isfinite(amax)) return false;
    if (amax == 0.0f) {
      std::fill(qi + a * E, qi + (a + 1) * E, int16_t(0));
      qs[a] = 0.0f;
      continue;
    }
    const float inv = 32767.0f / amax;
    for (int64_t c = 0; c < E; ++c)
      qi[a * E + c] = static_cast<int16_t>(std::clamp(std::nearbyint(row[c] * inv), -32767.0f, 32767.0f));
    qs[a] = amax / 32767.0f;
  }
  return true;
}

}  // namespace
