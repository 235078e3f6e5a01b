// attnlab's decode kernel (decode.cpp), a bfloat16 cache on vdpbf16ps (AVX512_BF16 with AVX512VL;
// the avx512-emulated build runs it on any CPU): the scores (bdots2: the query's bf16 rows against
// each key row as stored) and the value pass (bvalues: P~ rounded to bf16, as torch's bf16 kernel
// rounds P before its P V GEMM, against pairs of value rows). Included by decode.cpp only.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "kernels.h"
#include "decode_dots.h"  // load8

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

// A bfloat16 cache's scores on vdpbf16ps (bf16_dot bit 0: decode.py's "vdpbf16ps" route, AVX512_BF16
// with AVX512VL: isa::B16; the avx512-emulated build runs it on any CPU): the query rows as bf16
// (qb) against each key row as stored, 16 elements a 256-bit instruction, each pair's products
// exact in float32 and summed into the lane (one rounding each, as an FMA's). The float32 route
// loads and widens every 8 key elements (two instructions) and runs an FMA per row; here a load and
// one instruction a row per 16. On a 2-core Zen 5 (2026-12-04, q (1, 32, 4, 128) against 8 heads of
// 32768 bf16 keys) 10.5 ms against the widening's 14.0 (BENCHMARKS.md).
// Same answers as the float32 route to float32's rounding, given bf16_query_rows' conditions.
// s[a * nk + j] (j = j0, j0 + 1) = f_j * qb[a] . k_j: four rows by two keys, as dots2. E % 16 == 0.
// Called only where B is real (isa::kBf16x8).
template <class B = isa::B16, class X = isa::F8>
inline void bdots2(const c10::BFloat16* __restrict__ qb_, int64_t n, int64_t E, const c10::BFloat16* __restrict__ k0_,
                   const c10::BFloat16* __restrict__ k1_, float f0, float f1, float* __restrict__ s, int nk, int j0) {
  using V = typename X::V;
  using F4 = isa::F4;
  const uint16_t* qb = reinterpret_cast<const uint16_t*>(qb_);
  const uint16_t* k0 = reinterpret_cast<const uint16_t*>(k0_);
  const uint16_t* k1 = reinterpret_cast<const uint16_t*>(k1_);
  int64_t a = 0;
  for (; a + 4 <= n; a += 4) {
    const uint16_t *q0 = qb + a * E, *q1 = q0 + E, *q2 = q1 + E, *q3 = q2 + E;
    V x0 = X::zero(), x1 = x0, x2 = x0, x3 = x0;  // key 0, rows a .. a + 3
    V y0 = x0, y1 = x0, y2 = x0, y3 = x0;         // key 1
    for (int64_t c = 0; c < E; c += 16) {
      const typename B::V a0 = B::load(q0 + c), a1 = B::load(q1 + c), a2 = B::load(q2 + c), a3 = B::load(q3 + c);
      const typename B::V kc = B::load(k0 + c);
      x0 = isa::dpbf16(x0, a0, kc), x1 = isa::dpbf16(x1, a1, kc);
      x2 = isa::dpbf16(x2, a2, kc), x3 = isa::dpbf16(x3, a3, kc);
      if (k1) {
        const typename B::V kd = B::load(k1 + c);
        y0 = isa::dpbf16(y0, a0, kd), y1 = isa::dpbf16(y1, a1, kd);
        y2 = isa::dpbf16(y2, a2, kd), y3 = isa::dpbf16(y3, a3, kd);
      }
    }
    alignas(16) float rx[4], ry[4];
    F4::store(rx, F4::mul(X::sum4(x0, x1, x2, x3), F4::set1(f0)));
    F4::store(ry, F4::mul(X::sum4(y0, y1, y2, y3), F4::set1(f1)));
    for (int i = 0; i < 4; ++i) {
      s[(a + i) * nk + j0] = rx[i];
      if (k1) s[(a + i) * nk + j0 + 1] = ry[i];
    }
  }
  for (; a < n; ++a) {  // rows left over, one at a time
    V x = X::zero(), y = x;
    for (int64_t c = 0; c < E; c += 16) {
      const typename B::V qa = B::load(qb + a * E + c);
      x = isa::dpbf16(x, qa, B::load(k0 + c));
      if (k1) y = isa::dpbf16(y, qa, B::load(k1 + c));
    }
    alignas(16) float r[4];
    F4::store(r, X::sum4(x, y, X::zero(), X::zero()));
    s[a * nk + j0] = f0 * r[0];
    if (k1) s[a * nk + j0 + 1] = f1 * r[1];
  }
}

// acc (n, Ev) += P~ V for nk value rows (v_ld apart) of a bf16 cache, P~ as bf16 (pb: n rows, ld
// apart): vdpbf16ps takes two keys at once, each output lane summing P~_j V_j + P~_j+1 V_j+1 (one
// rounding each step, float32 accumulators). A pair of value rows is interleaved once (B::interleave:
// the columns come out as 0-3, 8-11 | 4-7, 12-15 of each 16, undone when acc is stored) and feeds
// every row's instructions: per pair of keys, 4 loads and 4 unpacks, then one broadcast and 4
// instructions a row for 32 columns; the float32 value pass runs 8 FMAs a row for the same. R rows
// by 32 columns: 4 R accumulators, 4 value vectors and a weight, 29 of AVX-512's 32 ymm at R = 6.
// Needs Ev % 32 == 0 (decode_forward checks). An odd nk's last key pairs with zeros.
template <int R, class B = isa::B16, class X = isa::F8>
inline void bvalue_tile(const uint16_t* __restrict__ pb, int ld, int nk, const c10::BFloat16* __restrict__ v_,
                        int64_t v_ld, int64_t c, float* __restrict__ acc, int64_t Ev) {
  using V = typename X::V;
  const uint16_t* v = reinterpret_cast<const uint16_t*>(v_);
  V r[R][4];
  for (int i = 0; i < R; ++i) {  // acc's columns in the interleaved order
    const float* d = acc + i * Ev + c;
    const V l0 = X::load(d), l1 = X::load(d + 8), l2 = X::load(d + 16), l3 = X::load(d + 24);
    r[i][0] = X::join_lo(l0, l1), r[i][1] = X::join_hi(l0, l1);
    r[i][2] = X::join_lo(l2, l3), r[i][3] = X::join_hi(l2, l3);
  }
  auto step = [&](int j, const uint16_t* v0, const uint16_t* v1, bool pair) {
    typename B::V x0, x1, x2, x3;
    B::interleave(v0, v1, &x0, &x1);
    B::interleave(v0 + 16, v1 ? v1 + 16 : nullptr, &x2, &x3);
    for (int i = 0; i < R; ++i) {  // (P~_j, P~_j+1) of row i in every lane
      uint32_t w;
      if (pair) std::memcpy(&w, pb + i * ld + j, 4);
      else w = pb[i * ld + j];
      const typename B::V wv = B::pair(w);
      r[i][0] = isa::dpbf16(r[i][0], wv, x0), r[i][1] = isa::dpbf16(r[i][1], wv, x1);
      r[i][2] = isa::dpbf16(r[i][2], wv, x2), r[i][3] = isa::dpbf16(r[i][3], wv, x3);
    }
  };
  int j = 0;
  for (; j + 2 <= nk; j += 2) step(j, v + j * v_ld + c, v + (j + 1) * v_ld + c, true);
  if (j < nk) step(j, v + j * v_ld + c, nullptr, false);
  for (int i = 0; i < R; ++i) {
    float* d = acc + i * Ev + c;
    X::store(d, X::join_lo(r[i][0], r[i][1]));
    X::store(d + 8, X::join_hi(r[i][0], r[i][1]));
    X::store(d + 16, X::join_lo(r[i][2], r[i][3]));
    X::store(d + 24, X::join_hi(r[i][2], r[i][3]));
  }
}

// acc (n, Ev) += P~ V: the n rows in tiles of six (then the rest), each over Ev in 32 columns.
template <class B = isa::B16>
inline void bvalues(const uint16_t* pb, int ld, int64_t n, int64_t Ev, const c10::BFloat16* v, int64_t v_ld, int nk,
                    float* acc) {
  for (int64_t c = 0; c < Ev; c += 32) {
    int64_t a = 0;
    for (; a + 6 <= n; a += 6) bvalue_tile<6, B>(pb + a * ld, ld, nk, v, v_ld, c, acc + a * Ev, Ev);
    const uint16_t* p = pb + a * ld;
    float* d = acc + a * Ev;
    switch (n - a) {
      case 5: bvalue_tile<5, B>(p, ld, nk, v, v_ld, c, d, Ev); break;
      case 4: bvalue_tile<4, B>(p, ld, nk, v, v_ld, c, d, Ev); break;
      case 3: bvalue_tile<3, B>(p, ld, nk, v, v_ld, c, d, Ev); break;
      case 2: bvalue_tile<2, B>(p, ld, nk, v, v_ld, c, d, Ev); break;
      case 1: bvalue_tile<1, B>(p, ld, nk, v, v_ld, c, d, Ev); break;
      default: break;
    }
  }
}

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
