// attnlab's decode kernel (decode.cpp), a bfloat16 cache on vdpbf16ps (AVX512_BF16 with AVX512VL;
// the avx512-emulated build runs it on any CPU): the scores (bdots2: the query's bf16 rows against
// each key row as stored) and the value pass (bvalues: P~ rounded to bf16, as torch's bf16 kernel
// rounds P before its P V GEMM, against pairs of value rows). Included by decode.cpp only.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "kernels.h"
#include "decode_dots.h"

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
// s[a * nk + j] (j = j0, j0 + 1) = f_j * qb[a] . k_j: four rows by two keys, as dots2.
// B, X: isa::B16 and F8 (256 bits, E % 16 == 0) or isa::B32 and F16 (512 bits, E % 32 == 0: see bdots).
template <class B, class X>
inline void bdots2_on(const c10::BFloat16* __restrict__ qb_, int64_t n, int64_t E,
                      const c10::BFloat16* __restrict__ k0_, const c10::BFloat16* __restrict__ k1_, float f0, float f1,
                      float* __restrict__ s, int nk, int j0) {
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
    for (int64_t c = 0; c < E; c += 2 * X::W) {
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
    for (int64_t c = 0; c < E; c += 2 * X::W) {
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

// bdots2_on at the widest width E allows: 512-bit vdpbf16ps (isa::B32, 32 elements an instruction,
// where the build has AVX512_BF16: isa::kBf16) for E % 32 == 0, else 256 bits (isa::B16). Zen 5
// runs the 512-bit instruction at full width (7.7 G instructions a second on one core, as many as
// 512-bit FMAs; Zen 4 splits it in two): with bvalues on 512 bits as well, q (1, 32, 4, 128) against
// 8 heads of bf16 keys took 14.1-15.6 -> 12.2-13.5 ms at S = 32768 and 1.70-1.75 -> 1.21-1.52 ms at
// S = 4096 (one thread, CPU time, 2-core EPYC Zen 5, 2026-12-04, old and new builds alternated).
// For 9-16 rows a head the scores take the rows across one zmm's lanes instead (decode_lanes.h).
// Called only where isa::kBf16x8 (a template: the 512-bit branch is not instantiated without it).
template <int = 0>
inline void bdots2(const c10::BFloat16* qb, int64_t n, int64_t E, const c10::BFloat16* k0, const c10::BFloat16* k1,
                   float f0, float f1, float* s, int nk, int j0) {
  if constexpr (isa::kBf16 && isa::kF16)
    if (E % 32 == 0) return bdots2_on<isa::B32, isa::F16>(qb, n, E, k0, k1, f0, f1, s, nk, j0);
  bdots2_on<isa::B16, isa::F8>(qb, n, E, k0, k1, f0, f1, s, nk, j0);
}

// Where bvalue_tile finds P~'s bf16 pair (j, j + 1) of row a (j even), as uint16 offsets from pb:
// PRows, P~ (n, ld) row-major (a ld + j: the pair's two halves adjacent); PLanes, lane_softmax's
// pairs in lanes (16 j + 2 swap23(a): pair j / 2 of the 16 rows as B16::interleave leaves them).
struct PRows {
  const uint16_t* pb;
  int ld;
  static constexpr int kStep = 1;
  int64_t row(int64_t a) const { return a * ld; }
};
struct PLanes {
  const uint16_t* pb;
  static constexpr int kStep = 16;
  // B16::interleave puts lane L's pair at (L & 3) + 8 ((L >> 2) & 1) + 4 ((L >> 3) & 1): bits 2 and 3 swapped
  static int64_t swap23(int64_t a) { return (a & ~int64_t{12}) | ((a & 4) << 1) | ((a & 8) >> 1); }
  int64_t row(int64_t a) const { return 2 * swap23(a); }
};

// acc (n, Ev) += P~ V for nk value rows (v: VStrided, v_ld apart, or VListed, a pointer each) of a
// bf16 cache, P~ as bf16 (pb: n rows, ld apart): vdpbf16ps takes two keys at once, each output lane
// summing P~_j V_j + P~_j+1 V_j+1 (one rounding each step, float32 accumulators). A pair of value
// rows is interleaved once (B::interleave: the columns come out in 128-bit lanes' order, which acc
// keeps: bvalues_finish) and feeds every row's instructions: per pair of keys, 4 loads and 4
// unpacks, then one broadcast and 4 instructions a row for 4 X::W columns (32 on 256 bits, 64 on
// 512); the float32 value pass runs 8 FMAs a row for 32. R rows: 4 R accumulators, 4 value vectors
// and a weight, 29 of AVX-512's 32 registers at R = 6. Needs Ev % (4 X::W) == 0 (bvalues). An odd
// nk's last key pairs with zeros. P: PRows or PLanes, rows a0 .. a0 + R - 1 of it. VListed rows are
// asked for into L1 by the first row tile of the first columns (a0 = 0, c = 0), kAhead keys ahead.
template <int R, class B, class X, class P, class Rows>
inline void bvalue_tile(const P& p, int64_t a0, int nk, const Rows& v, int64_t c, float* __restrict__ acc, int64_t Ev) {
  using V = typename X::V;
  constexpr int W = X::W;
  // row i's pair j: PRows as row a0's base plus i ld + j, the addressing the tile had before PLanes;
  // PLanes through each row's offset (swap23 is not linear in i)
  const uint16_t* p0 = p.pb + p.row(a0);
  int64_t lane_row[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) lane_row[i] = p.row(a0 + i) - p.row(a0);
  auto at = [&](int i, int j) -> const uint16_t* {
    if constexpr (std::is_same_v<P, PRows>) return p0 + i * static_cast<int64_t>(p.ld) + j;
    else return p0 + lane_row[i] + j * P::kStep;
  };
  V r[R][4];  // in registers: every loop over R unrolled (the pragmas; see bf16_gemm.h's micro_bf16)
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {  // acc holds its columns in the interleaved order (bvalues_finish undoes it)
    const float* d = acc + i * Ev + c;
    r[i][0] = X::load(d), r[i][1] = X::load(d + W), r[i][2] = X::load(d + 2 * W), r[i][3] = X::load(d + 3 * W);
  }
  auto step = [&](int j, const uint16_t* v0, const uint16_t* v1, bool pair) {
    typename B::V x0, x1, x2, x3;
    B::interleave(v0, v1, &x0, &x1);
    B::interleave(v0 + 2 * W, v1 ? v1 + 2 * W : nullptr, &x2, &x3);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {  // (P~_j, P~_j+1) of row i in every lane
      uint32_t w;
      if (pair) std::memcpy(&w, at(i, j), 4);
      else w = *at(i, j);
      const typename B::V wv = B::pair(w);
      r[i][0] = isa::dpbf16(r[i][0], wv, x0), r[i][1] = isa::dpbf16(r[i][1], wv, x1);
      r[i][2] = isa::dpbf16(r[i][2], wv, x2), r[i][3] = isa::dpbf16(r[i][3], wv, x3);
    }
  };
  int j = 0;
  for (; j + 2 <= nk; j += 2) {
    if constexpr (Rows::kAsks) {
      if (a0 == 0 && c == 0)  // the rows' first reader
        for (int t = j + Rows::kAhead; t < j + Rows::kAhead + 2; ++t) {
          const char* r = v.ahead(t, j);
          for (int64_t b = 0; b < v.bytes; b += 64) __builtin_prefetch(r + b, 0, 3);
        }
    }
    step(j, v.row(j) + c, v.row(j + 1) + c, true);
  }
  if (j < nk) step(j, v.row(j) + c, nullptr, false);
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    float* d = acc + i * Ev + c;
    X::store(d, r[i][0]), X::store(d + W, r[i][1]), X::store(d + 2 * W, r[i][2]), X::store(d + 3 * W, r[i][3]);
  }
}

// acc (n, Ev) from the interleaved column order bvalue_tile keeps it in back to the columns' own
// (X::undeal on every 2 X::W columns), once, when a task's rows are done: the order is kept across
// a task's blocks because a paged cache's stored-order tiles of 8 keys reloaded acc each tile, and
// dealing it in and out took as long as the tile's vdpbf16ps (perf, q (1, 32, 4, 128) against 8
// heads of 32768 bf16 keys in pages of 16, one thread, Zen 5, 2026-12-05). Zeros and the online
// softmax's per-row rescaling do not see the order.
template <class X>
inline void undeal_rows(float* acc, int64_t n, int64_t Ev) {
  using V = typename X::V;
  constexpr int W = X::W;
  for (int64_t a = 0; a < n; ++a)
    for (int64_t c = 0; c < Ev; c += 2 * W) {
      float* d = acc + a * Ev + c;
      V l0, l1;
      X::undeal(X::load(d), X::load(d + W), &l0, &l1);
      X::store(d, l0), X::store(d + W, l1);
    }
}

// acc (n, Ev) += P~ V: the n rows in tiles of six (then the rest), over Ev in tiles of 4 X::W columns
template <class B, class X, class P, class Rows>
inline void bvalues_on(const P& p, int64_t n, int64_t Ev, const Rows& v, int nk, float* acc) {
  for (int64_t c = 0; c < Ev; c += 4 * X::W) {
    int64_t a = 0;
    for (; a + 6 <= n; a += 6) bvalue_tile<6, B, X>(p, a, nk, v, c, acc + a * Ev, Ev);
    float* d = acc + a * Ev;
    switch (n - a) {
      case 5: bvalue_tile<5, B, X>(p, a, nk, v, c, d, Ev); break;
      case 4: bvalue_tile<4, B, X>(p, a, nk, v, c, d, Ev); break;
      case 3: bvalue_tile<3, B, X>(p, a, nk, v, c, d, Ev); break;
      case 2: bvalue_tile<2, B, X>(p, a, nk, v, c, d, Ev); break;
      case 1: bvalue_tile<1, B, X>(p, a, nk, v, c, d, Ev); break;
      default: break;
    }
  }
}

// bvalues' acc back in column order (undeal_rows at bvalues' width), after a task's last block.
// Called only where isa::kBf16x8.
template <int = 0>
inline void bvalues_finish(float* acc, int64_t n, int64_t Ev) {
  if constexpr (isa::kBf16 && isa::kF16)
    if (Ev % 64 == 0) return undeal_rows<isa::F16>(acc, n, Ev);
  undeal_rows<isa::F8>(acc, n, Ev);
}

// Where bvalue_tile finds value row j: VStrided, rows v_ld apart (a contiguous cache, or one page's
// run); VListed, a pointer per row (a block of a paged cache whose rows span its pages).
struct VStrided {
  static constexpr bool kAsks = false;
  const uint16_t* v;
  int64_t ld;
  const uint16_t* row(int j) const { return v + j * ld; }
};
struct VListed {
  static constexpr bool kAsks = true;  // bvalue_tile asks for row j + kAhead (and one more) into L1
  static constexpr int kAhead = 32;
  const c10::BFloat16* const* rows;  // head 0's rows
  int64_t off, next;                 // this head's offset from them (elements); the next head's, or -1
  int nk;
  int64_t bytes;  // a row's
  const uint16_t* row(int j) const { return reinterpret_cast<const uint16_t*>(rows[j] + off); }
  // the row to ask for at t = j + kAhead..: past the block the next head's first rows (past the last
  // head, row j again: the ask is unconditional). The prefetches are bvalue_tile's own statements:
  // inside a member function GCC 12 deleted them, whole (objdump: no prefetcht0 in the tile).
  const char* ahead(int t, int j) const {
    return reinterpret_cast<const char*>(t < nk ? rows[t] + off : next >= 0 ? rows[t - nk] + next : rows[j] + off);
  }
};

// bvalues_on at the widest width Ev allows: 512 bits (isa::B32, 64 columns a tile) for Ev % 64 == 0
// where the build has it, else 256 (isa::B16, 32 columns; Ev % 32 == 0: decode_forward checks).
// Called only where isa::kBf16x8 (a template: the 512-bit branch is not instantiated without it).
// pb: P~ (n, ld) as bf16, row-major (PRows), or lane_softmax's pairs in lanes (PLanes: ld unused);
// v: the value rows (VStrided or VListed)
template <class P = PRows, class Rows>
inline void bvalues_from(const uint16_t* pb, int ld, int64_t n, int64_t Ev, const Rows& v, int nk, float* acc) {
  P p;
  p.pb = pb;
  if constexpr (std::is_same_v<P, PRows>) p.ld = ld;
  if constexpr (isa::kBf16 && isa::kF16)
    if (Ev % 64 == 0) return bvalues_on<isa::B32, isa::F16>(p, n, Ev, v, nk, acc);
  bvalues_on<isa::B16, isa::F8>(p, n, Ev, v, nk, acc);
}

// bvalues_from over rows v_ld apart (VStrided)
template <class P = PRows>
inline void bvalues(const uint16_t* pb, int ld, int64_t n, int64_t Ev, const c10::BFloat16* v, int64_t v_ld, int nk,
                    float* acc) {
  bvalues_from<P>(pb, ld, n, Ev, VStrided{reinterpret_cast<const uint16_t*>(v), v_ld}, nk, acc);
}

// qb (m, E) = q (m, E) as bf16, when the route gives the float32 route's answers: every element
// is a bf16 value (its low 16 bits zero: a bf16 query widened), none is a denormal (vdpbf16ps
// reads those as zero), and |q| * |scale2| < 2^64, so that the key elements it reads as zero
// (denormals, below 2^-126) move a score by less than E * 2^-62: nothing at float32's precision
// next to the softmax's other scores. False otherwise (the caller takes the float32 route).
inline bool bf16_query_rows(const float* q, int64_t m, int64_t E, float scale2, c10::BFloat16* qb) {
  const float limit = std::ldexp(1.0f, 64) / std::max(std::fabs(scale2), 1e-30f);
  uint16_t* out = reinterpret_cast<uint16_t*>(qb);
  // branch-free, so that GCC vectorises it: a bf16 decode call's fixed cost (q (1, 32, 4, 128)
  // against 16 keys, 2 threads, 2-core EPYC Zen 5, 2026-12-05) spent 17-19 of its 76 us in the branchy
  // loop this replaced (75.6 -> 56.5-58.9 us a call)
  uint32_t bad = 0;
  for (int64_t i = 0; i < m * E; ++i) {
    uint32_t bits;
    std::memcpy(&bits, q + i, 4);
    const uint32_t denormal = (bits & 0x7f800000u) == 0 && (bits & 0x007fffffu) != 0;
    bad |= (bits & 0xffffu) | denormal | static_cast<uint32_t>(!(std::fabs(q[i]) < limit));
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
  return bad == 0;
}

}  // namespace
