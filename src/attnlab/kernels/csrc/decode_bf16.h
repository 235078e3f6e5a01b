// attnlab's decode kernel (decode.cpp), a bfloat16 cache on vdpbf16ps (AVX512_BF16 with AVX512VL;
// the avx512-emulated build runs it on any CPU): the scores (bdots2: the query's bf16 rows against
// each key row as stored) and the value pass (bvalues: P~ rounded to bf16, as torch's bf16 kernel
// rounds P before its P V GEMM, against pairs of value rows). Included by decode.cpp only.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "kernels.h"
#include "decode_dots.h"  // sum8x4

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// The thread's copy of count floats of P~ as bf16 (round to nearest even), for bvalues.
inline uint16_t* p_as_bf16(const float* p, int64_t count) {
  thread_local std::vector<uint16_t> buf;
  buf.resize(static_cast<size_t>(count));
  round_to_bf16(p, count, buf.data());
  return buf.data();
}

// A bfloat16 cache's scores on vdpbf16ps (bf16_dot = 1: decode.py's "vdpbf16ps" route, AVX512_BF16
// with AVX512VL; the avx512-emulated build runs it on any CPU): the query rows as bf16 (qb) against
// each key row as stored, 16 elements a 256-bit instruction, each pair's products exact in float32
// and summed into the lane (one rounding each, as an FMA's). The float32 route loads and widens
// every 8 key elements (two instructions) and runs an FMA per row; here a load and one instruction a
// row per 16. 256 bits, not 512: Zen 4 runs a 512-bit vdpbf16ps as two halves anyway, and 8-lane
// sums reuse sum8x4's tree.
// NOT MEASURED: no AVX512_BF16 CPU in the session that wrote it (2026-12-03, 2-core AVX2 EPYC);
// on a CPU that takes it `attnlab bench --decode` adds a row "stream, float32 dots" (the same loop
// without it), so the first run there measures it.
// Same answers as the float32 route to float32's rounding, given bf16_query_rows' conditions.
#if defined(__AVX512BF16__) && (defined(__AVX512VL__) || defined(ATTNLAB_EMULATE_AVX512))
#define ATTNLAB_DECODE_BF16_DOTS 1
// s[a * nk + j] (j = j0, j0 + 1) = f_j * qb[a] . k_j: four rows by two keys, as dots2. E % 16 == 0.
inline void bdots2(const c10::BFloat16* __restrict__ qb, int64_t n, int64_t E, const c10::BFloat16* __restrict__ k0,
                   const c10::BFloat16* __restrict__ k1, float f0, float f1, float* __restrict__ s, int nk, int j0) {
  auto load = [](const c10::BFloat16* p) {
    return reinterpret_cast<__m256bh>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  int64_t a = 0;
  for (; a + 4 <= n; a += 4) {
    const c10::BFloat16 *q0 = qb + a * E, *q1 = q0 + E, *q2 = q1 + E, *q3 = q2 + E;
    __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0;  // key 0, rows a .. a + 3
    __m256 y0 = x0, y1 = x0, y2 = x0, y3 = x0;                    // key 1
    for (int64_t c = 0; c < E; c += 16) {
      const __m256bh a0 = load(q0 + c), a1 = load(q1 + c), a2 = load(q2 + c), a3 = load(q3 + c);
      const __m256bh kc = load(k0 + c);
      x0 = _mm256_dpbf16_ps(x0, a0, kc), x1 = _mm256_dpbf16_ps(x1, a1, kc);
      x2 = _mm256_dpbf16_ps(x2, a2, kc), x3 = _mm256_dpbf16_ps(x3, a3, kc);
      if (k1) {
        const __m256bh kd = load(k1 + c);
        y0 = _mm256_dpbf16_ps(y0, a0, kd), y1 = _mm256_dpbf16_ps(y1, a1, kd);
        y2 = _mm256_dpbf16_ps(y2, a2, kd), y3 = _mm256_dpbf16_ps(y3, a3, kd);
      }
    }
    alignas(16) float rx[4], ry[4];
    _mm_store_ps(rx, _mm_mul_ps(sum8x4(x0, x1, x2, x3), _mm_set1_ps(f0)));
    _mm_store_ps(ry, _mm_mul_ps(sum8x4(y0, y1, y2, y3), _mm_set1_ps(f1)));
    for (int i = 0; i < 4; ++i) {
      s[(a + i) * nk + j0] = rx[i];
      if (k1) s[(a + i) * nk + j0 + 1] = ry[i];
    }
  }
  for (; a < n; ++a) {  // rows left over, one at a time
    __m256 x = _mm256_setzero_ps(), y = x;
    for (int64_t c = 0; c < E; c += 16) {
      const __m256bh qa = load(qb + a * E + c);
      x = _mm256_dpbf16_ps(x, qa, load(k0 + c));
      if (k1) y = _mm256_dpbf16_ps(y, qa, load(k1 + c));
    }
    alignas(16) float r[4];
    _mm_store_ps(r, sum8x4(x, y, _mm256_setzero_ps(), _mm256_setzero_ps()));
    s[a * nk + j0] = f0 * r[0];
    if (k1) s[a * nk + j0 + 1] = f1 * r[1];
  }
}

// acc (n, Ev) += P~ V for nk value rows (v_ld apart) of a bf16 cache, P~ as bf16 (pb: n rows, ld
// apart): vdpbf16ps takes two keys at once, each output lane summing P~_j V_j + P~_j+1 V_j+1 (one
// rounding each step, float32 accumulators). A pair of value rows is interleaved once (vpunpcklwd,
// vpunpckhwd: the columns come out as 0-3, 8-11 | 4-7, 12-15 of each 16, undone when acc is stored)
// and feeds every row's instructions: per pair of keys, 4 loads and 4 unpacks, then one broadcast and
// 4 instructions a row for 32 columns; the float32 value pass runs 8 FMAs a row for the same. R rows
// by 32 columns: 4 R accumulators, 4 value vectors and a weight, 29 of AVX-512's 32 ymm at R = 6.
// Needs Ev % 32 == 0 (decode_forward checks). An odd nk's last key pairs with zeros.
template <int R>
inline void bvalue_tile(const uint16_t* __restrict__ pb, int ld, int nk, const c10::BFloat16* __restrict__ v,
                        int64_t v_ld, int64_t c, float* __restrict__ acc, int64_t Ev) {
  __m256 r[R][4];
  for (int i = 0; i < R; ++i) {  // acc's columns in the interleaved order
    const float* d = acc + i * Ev + c;
    const __m256 l0 = _mm256_loadu_ps(d), l1 = _mm256_loadu_ps(d + 8);
    const __m256 l2 = _mm256_loadu_ps(d + 16), l3 = _mm256_loadu_ps(d + 24);
    r[i][0] = _mm256_permute2f128_ps(l0, l1, 0x20), r[i][1] = _mm256_permute2f128_ps(l0, l1, 0x31);
    r[i][2] = _mm256_permute2f128_ps(l2, l3, 0x20), r[i][3] = _mm256_permute2f128_ps(l2, l3, 0x31);
  }
  auto load = [](const c10::BFloat16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  auto step = [&](int j, const __m256i a0, const __m256i a1, const __m256i b0, const __m256i b1, bool pair) {
    const __m256bh x0 = reinterpret_cast<__m256bh>(_mm256_unpacklo_epi16(a0, b0));
    const __m256bh x1 = reinterpret_cast<__m256bh>(_mm256_unpackhi_epi16(a0, b0));
    const __m256bh x2 = reinterpret_cast<__m256bh>(_mm256_unpacklo_epi16(a1, b1));
    const __m256bh x3 = reinterpret_cast<__m256bh>(_mm256_unpackhi_epi16(a1, b1));
    for (int i = 0; i < R; ++i) {  // (P~_j, P~_j+1) of row i in every lane
      uint32_t w;
      if (pair) std::memcpy(&w, pb + i * ld + j, 4);
      else w = pb[i * ld + j];
      const __m256bh wv = reinterpret_cast<__m256bh>(_mm256_set1_epi32(static_cast<int>(w)));
      r[i][0] = _mm256_dpbf16_ps(r[i][0], wv, x0), r[i][1] = _mm256_dpbf16_ps(r[i][1], wv, x1);
      r[i][2] = _mm256_dpbf16_ps(r[i][2], wv, x2), r[i][3] = _mm256_dpbf16_ps(r[i][3], wv, x3);
    }
  };
  int j = 0;
  for (; j + 2 <= nk; j += 2) {
    const c10::BFloat16 *v0 = v + j * v_ld + c, *v1 = v0 + v_ld;
    step(j, load(v0), load(v0 + 16), load(v1), load(v1 + 16), true);
  }
  if (j < nk) {
    const c10::BFloat16* v0 = v + j * v_ld + c;
    step(j, load(v0), load(v0 + 16), _mm256_setzero_si256(), _mm256_setzero_si256(), false);
  }
  for (int i = 0; i < R; ++i) {
    float* d = acc + i * Ev + c;
    _mm256_storeu_ps(d, _mm256_permute2f128_ps(r[i][0], r[i][1], 0x20));
    _mm256_storeu_ps(d + 8, _mm256_permute2f128_ps(r[i][0], r[i][1], 0x31));
    _mm256_storeu_ps(d + 16, _mm256_permute2f128_ps(r[i][2], r[i][3], 0x20));
    _mm256_storeu_ps(d + 24, _mm256_permute2f128_ps(r[i][2], r[i][3], 0x31));
  }
}

// acc (n, Ev) += P~ V: the n rows in tiles of six (then the rest), each over Ev in 32 columns.
inline void bvalues(const uint16_t* pb, int ld, int64_t n, int64_t Ev, const c10::BFloat16* v, int64_t v_ld, int nk,
                    float* acc) {
  for (int64_t c = 0; c < Ev; c += 32) {
    int64_t a = 0;
    for (; a + 6 <= n; a += 6) bvalue_tile<6>(pb + a * ld, ld, nk, v, v_ld, c, acc + a * Ev, Ev);
    const uint16_t* p = pb + a * ld;
    float* d = acc + a * Ev;
    switch (n - a) {
      case 5: bvalue_tile<5>(p, ld, nk, v, v_ld, c, d, Ev); break;
      case 4: bvalue_tile<4>(p, ld, nk, v, v_ld, c, d, Ev); break;
      case 3: bvalue_tile<3>(p, ld, nk, v, v_ld, c, d, Ev); break;
      case 2: bvalue_tile<2>(p, ld, nk, v, v_ld, c, d, Ev); break;
      case 1: bvalue_tile<1>(p, ld, nk, v, v_ld, c, d, Ev); break;
      default: break;
    }
  }
}
#endif

// qb (m, E) = q (m, E) as bf16, when the route gives the float32 route's answers: every element
// is a bf16 value (its low 16 bits zero: a bf16 query widened), none is a denormal (vdpbf16ps
// reads those as zero), and |q| * |scale2| < 2^64, so that the key elements it reads as zero
// (denormals, below 2^-126) move a score by less than E * 2^-62: nothing at float32's precision
// next to the softmax's other scores. False otherwise (the caller takes the float32 route).
inline bool bf16_query_rows(const float* q, int64_t m, int64_t E, float scale2, c10::BFloat16* qb) {
  const float limit = std::ldexp(1.0f, 64) / std::max(std::fabs(scale2), 1e-30f);
  for (int64_t i = 0; i < m * E; ++i) {
    uint32_t bits;
    std::memcpy(&bits, q + i, 4);
    const bool denormal = (bits & 0x7f800000u) == 0 && (bits & 0x007fffffu) != 0;
    if ((bits & 0xffffu) != 0 || denormal || !(std::fabs(q[i]) < limit)) return false;
    qb[i] = c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
  }
  return true;
}

}  // namespace
