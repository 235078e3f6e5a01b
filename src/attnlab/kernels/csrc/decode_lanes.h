// attnlab's decode kernel (decode.cpp), a bf16 cache's scores with the query's rows across the
// lanes of one vector ("rows in lanes"): for the 9-16 rows a task has at a decode step of a GQA
// group (r query heads times L new tokens: 16 at r = 4, L = 4), on 512-bit vdpbf16ps.
//
// Why: the row-major dot products (dots4, bdots2) leave each score as a 16-lane vector to be summed
// across its lanes; on 512 bits those reductions cost more than the products (perf, q (1, 32, 4,
// 128) bf16 against 8 heads of 32768 keys, one thread, 2-core EPYC Zen 5, 2026-12-05: the scores
// took 34% of the samples, the value pass 13, for the same number of vdpbf16ps). Here the query is
// laid out once per call with row a in lane a (qp: (E / 2, 16) bf16 pairs), and each key's pair of
// elements is broadcast into the instruction: key j's 16 scores add up in one register, with no
// reduction; eight keys' registers leave by one 8 x 16 transpose (isa::F16::store_transposed8, two
// shuffles a key). q (1, 32, 4, 128) against 8 heads of S bf16 keys, one thread, CPU time, Zen 5,
// 2026-12-05, alternated with bdots2, three rounds: 13.3-14.2 -> 11.3-11.9 ms at S = 32768,
// 1.24-1.41 -> 1.04-1.11 ms at 4096. The same for float32 (an FMA a key and element, the element
// broadcast) was slower than dots4 there (18.9-19.4 -> 21.0-23.0 ms): 128 broadcasts a key against
// bf16's 64; not kept.
// Where every row sees a whole block and the output is bf16, the scores stay in lanes through the
// online softmax (lane_softmax: the rows' maxima, 2^x and sums lane by lane, no transpose) and P~
// goes to the value pass as bf16 pairs of keys in lanes (decode_bf16.h's PLanes). q (1, 32, 4, 128)
// against 8 heads of 32768 bf16 keys, 2 threads, 2-core EPYC Zen 4, 2026-12-05, alternated with the
// transposing build, three rounds each: median 9.37-9.83 -> 8.55-8.89 ms (4 KiB pages), 8.65-8.75 ->
// 7.63-7.99 ms (the cache on huge pages); S = 4096 and 1024 within the noise; paged within the noise.
// Included by decode.cpp only.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "kernels.h"
#include "bf16_gemm.h"  // round_to_bf16

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Lanes a query vector has: rows a < LANE_ROWS of a head.
constexpr int LANE_ROWS = 16;
// uint32 a head's query takes across lanes: E / 2 pairs of 16 lanes, then (int8) 16 row scales
inline int64_t lane_block(int64_t E) { return (E / 2 + 1) * LANE_ROWS; }

// qp (E / 2, 16) = the n <= 16 bf16 rows of qb (n, E) as pairs across lanes: lane a of pair c / 2
// holds (qb[a, c], qb[a, c + 1]) (the first in the low 16 bits: vdpbf16ps's order); E even
inline void lay_pairs_in_lanes(const c10::BFloat16* qb, int64_t n, int64_t E, uint32_t* qp) {
  std::fill(qp, qp + E / 2 * LANE_ROWS, 0u);
  for (int64_t a = 0; a < n; ++a)
    for (int64_t c = 0; c < E; c += 2)
      qp[c / 2 * LANE_ROWS + a] =
          static_cast<uint32_t>(qb[a * E + c].x) | static_cast<uint32_t>(qb[a * E + c + 1].x) << 16;
}

// qp (E / 2 + 1, 16) = the n <= 16 int16 rows of qi (n, E) as pairs across lanes (as
// lay_pairs_in_lanes), then the rows' scales qs (n) in the last 16 lanes (as float bits); E even
inline void lay_int16_pairs_in_lanes(const int16_t* qi, const float* qs, int64_t n, int64_t E, uint32_t* qp) {
  std::fill(qp, qp + (E / 2 + 1) * LANE_ROWS, 0u);
  for (int64_t a = 0; a < n; ++a) {
    for (int64_t c = 0; c < E; c += 2)
      qp[c / 2 * LANE_ROWS + a] =
          static_cast<uint16_t>(qi[a * E + c]) | static_cast<uint32_t>(static_cast<uint16_t>(qi[a * E + c + 1])) << 16;
    std::memcpy(qp + E / 2 * LANE_ROWS + a, qs + a, 4);
  }
}

// s[a * ld + j0 + j] = f[j] * a_j[a] for rows a < n and keys j < m (m <= 8; a_j for j >= m ignored)
template <class X>
inline void lanes_to_rows(typename X::V a0, typename X::V a1, typename X::V a2, typename X::V a3, typename X::V a4,
                          typename X::V a5, typename X::V a6, typename X::V a7, const float* f, int m, int64_t n,
                          float* s, int ld, int j0) {
  a0 = X::mul(a0, X::set1(f[0])), a1 = X::mul(a1, X::set1(f[1])), a2 = X::mul(a2, X::set1(f[2]));
  a3 = X::mul(a3, X::set1(f[3])), a4 = X::mul(a4, X::set1(f[4])), a5 = X::mul(a5, X::set1(f[5]));
  a6 = X::mul(a6, X::set1(f[6])), a7 = X::mul(a7, X::set1(f[7]));
  if (m == 8) return X::store_transposed8(a0, a1, a2, a3, a4, a5, a6, a7, s + j0, ld, static_cast<int>(n));
  float t[LANE_ROWS * 8];  // a block's last keys: through a buffer, so that no row's store runs past m
  X::store_transposed8(a0, a1, a2, a3, a4, a5, a6, a7, t, 8, static_cast<int>(n));
  for (int64_t a = 0; a < n; ++a) std::memcpy(s + a * ld + j0, t + a * 8, sizeof(float) * m);
}

// out[i] = the 16 lanes' sums over E of qp's pairs times key row r[i]'s pairs (each pair broadcast),
// i < 8: D::dot on every pair, even and odd pairs in two accumulators each (sixteen chains: the
// instruction's latency hidden). E % 4 == 0. D: Bf16Pairs (vdpbf16ps) or IntPairs (vpdpwssd).
// Each iteration also asks for line c / 4 of the step's SpreadLines (decode_dots.h), the rest after.
template <class D, class P, class Lines>
inline void pair_dots8(const uint32_t* __restrict__ qp, int64_t E, const P* const* r, typename D::Acc* out,
                       const Lines& lines) {
  using A = typename D::Acc;
  A a0 = D::zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  A b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
  for (int64_t c = 0; c < E; c += 4) {
    lines(c / 4);
    const typename D::Q qc = D::load(qp + c / 2 * LANE_ROWS), qd = D::load(qp + (c / 2 + 1) * LANE_ROWS);
    a0 = D::dot(a0, qc, D::pair(r[0] + c)), b0 = D::dot(b0, qd, D::pair(r[0] + c + 2));
    a1 = D::dot(a1, qc, D::pair(r[1] + c)), b1 = D::dot(b1, qd, D::pair(r[1] + c + 2));
    a2 = D::dot(a2, qc, D::pair(r[2] + c)), b2 = D::dot(b2, qd, D::pair(r[2] + c + 2));
    a3 = D::dot(a3, qc, D::pair(r[3] + c)), b3 = D::dot(b3, qd, D::pair(r[3] + c + 2));
    a4 = D::dot(a4, qc, D::pair(r[4] + c)), b4 = D::dot(b4, qd, D::pair(r[4] + c + 2));
    a5 = D::dot(a5, qc, D::pair(r[5] + c)), b5 = D::dot(b5, qd, D::pair(r[5] + c + 2));
    a6 = D::dot(a6, qc, D::pair(r[6] + c)), b6 = D::dot(b6, qd, D::pair(r[6] + c + 2));
    a7 = D::dot(a7, qc, D::pair(r[7] + c)), b7 = D::dot(b7, qd, D::pair(r[7] + c + 2));
  }
  lines.rest(E / 4);
  out[0] = D::add(a0, b0), out[1] = D::add(a1, b1), out[2] = D::add(a2, b2), out[3] = D::add(a3, b3);
  out[4] = D::add(a4, b4), out[5] = D::add(a5, b5), out[6] = D::add(a6, b6), out[7] = D::add(a7, b7);
}

// pair_dots8's instructions: bf16 pairs on vdpbf16ps into float32 lanes (B: isa::B32, X: isa::F16)
template <class B, class X>
struct Bf16Pairs {
  using Acc = typename X::V;
  using Q = typename B::V;
  static Acc zero() { return X::zero(); }
  static Q load(const uint32_t* p) { return B::load(reinterpret_cast<const uint16_t*>(p)); }
  static Q pair(const uint16_t* p) { return B::pair(p); }
  static Acc dot(Acc acc, Q q, Q k) { return isa::dpbf16(acc, q, k); }
  static Acc add(Acc a, Acc b) { return X::add(a, b); }
};

// and int16 pairs on vpdpwssd (or vpmaddwd and vpaddd) into int32 lanes, exact (I: isa::I32)
template <class I>
struct IntPairs {
  using Acc = typename I::V;
  using Q = typename I::V;
  static Acc zero() { return I::zero(); }
  static Q load(const uint32_t* p) { return I::load(p); }
  static Q pair(const int16_t* p) { return I::pair(p); }
  static Acc dot(Acc acc, Q q, Q k) { return I::dot_pairs(acc, q, k); }
  static Acc add(Acc a, Acc b) { return I::add(a, b); }
};

// s[a * ld + j0 + j] = f * qb[a] . k_j for m <= 8 bf16 key rows (k_ld apart) on vdpbf16ps against
// the query's bf16 pairs across lanes (qp): one instruction a key and pair of elements, the pair
// broadcast. Keys past m repeat key m - 1 (computed, not stored). E % 4 == 0. B, X: isa::B32, isa::F16.
// kept: the scores stay in lanes instead, key j0 + i's 16 at kept + 16 (j0 + i) (lane_softmax's).
template <class B, class X, class Lines>
inline void lane_bdots8(const uint32_t* __restrict__ qp, int64_t E, const c10::BFloat16* __restrict__ k_, int64_t k_ld,
                        int m, float f, int64_t n, float* __restrict__ s, int ld, int j0, const Lines& lines,
                        float* __restrict__ kept = nullptr) {
  const uint16_t* k = reinterpret_cast<const uint16_t*>(k_);
  const uint16_t* r[8];
  for (int i = 0; i < 8; ++i) r[i] = k + std::min(i, m - 1) * k_ld;
  typename X::V a[8];
  pair_dots8<Bf16Pairs<B, X>>(qp, E, r, a, lines);
  if (kept) {
    for (int i = 0; i < m; ++i) X::store(kept + LANE_ROWS * (j0 + i), X::mul(a[i], X::set1(f)));
    return;
  }
  const float fs[8] = {f, f, f, f, f, f, f, f};
  lanes_to_rows<X>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], fs, m, n, s, ld, j0);
}

// The online-softmax step (kernels.h's online_update) over nk keys' scores kept in lanes (s_l: key
// j's 16 rows at s_l + 16 j, rows a < n real, the other lanes zeros), for a block every row sees
// whole: the rows' maxima, 2^x and sums run across the keys' vectors, lane by lane, with no
// reduction across lanes and no transpose. Then P~ as bf16 pairs of keys in lanes (pp: pair j / 2
// at pp + 16 j, row a's at 2 PLanes::swap23(a), B16::interleave's order; an odd nk's last key
// pairs with 0), bvalues' PLanes. pl: a (16 nk) scratch. X: isa::F16; B: isa::B16.
template <class X, class B>
inline void lane_softmax(float* __restrict__ s_l, int nk, int64_t n, float* m_i, float* l_i, float* acc, int64_t Ev,
                         uint16_t* __restrict__ pl, uint16_t* __restrict__ pp) {
  using V = typename X::V;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  V top = X::set1(neg_inf);
  for (int j = 0; j < nk; ++j) top = X::max(top, X::load(s_l + LANE_ROWS * j));
  const V m_old = X::load_partial(m_i, static_cast<int>(n), neg_inf);
  const V m_new = X::max(m_old, top);  // finite in rows a < n: each sees a key, the scores finite (checked)
  V sum0 = X::zero(), sum1 = X::zero();
  int j = 0;
  for (; j + 2 <= nk; j += 2) {
    const V p0 = X::exp2_nonpos(X::sub(X::load(s_l + LANE_ROWS * j), m_new));
    const V p1 = X::exp2_nonpos(X::sub(X::load(s_l + LANE_ROWS * (j + 1)), m_new));
    X::store(s_l + LANE_ROWS * j, p0), X::store(s_l + LANE_ROWS * (j + 1), p1);
    sum0 = X::add(sum0, p0), sum1 = X::add(sum1, p1);
  }
  if (j < nk) {
    const V p0 = X::exp2_nonpos(X::sub(X::load(s_l + LANE_ROWS * j), m_new));
    X::store(s_l + LANE_ROWS * j, p0);
    sum0 = X::add(sum0, p0);
  }
  // alpha = 2^(m_old - m_new) rescales the old state (m_old = -inf at a task's first block: l_i and
  // acc are 0 then, so alpha's value does not matter)
  alignas(64) float alpha[LANE_ROWS];
  X::store(alpha, X::exp2_nonpos(X::sub(X::max(m_old, X::set1(-1e30f)), m_new)));
  const V l_old = X::load_partial(l_i, static_cast<int>(n), 0.0f);
  X::store_partial(l_i, static_cast<int>(n), X::add(X::mul(X::load(alpha), l_old), X::add(sum0, sum1)));
  X::store_partial(m_i, static_cast<int>(n), m_new);
  for (int64_t a = 0; a < n; ++a)
    if (alpha[a] != 1.0f) {
      float* acc_row = acc + a * Ev;
#pragma omp simd
      for (int64_t c = 0; c < Ev; ++c) acc_row[c] *= alpha[a];
    }
  round_to_bf16(s_l, LANE_ROWS * static_cast<int64_t>(nk), pl);
  for (j = 0; j < nk; j += 2) {
    typename B::V lo, hi;
    B::interleave(pl + LANE_ROWS * j, j + 1 < nk ? pl + LANE_ROWS * (j + 1) : nullptr, &lo, &hi);
    std::memcpy(pp + LANE_ROWS * j, &lo, sizeof lo);
    std::memcpy(pp + LANE_ROWS * j + LANE_ROWS, &hi, sizeof hi);
  }
}

// The thread's scratch for lane_softmax over nk keys of G heads: head g's scores kept in lanes at
// the return + 16 nk g, P~ as bf16 in lanes (*pl, 16 nk, one head's at a time) and head g's pairs
// at *pp + 16 (nk + 1) g
inline float* lane_scratch(int64_t G, int nk, uint16_t** pl, uint16_t** pp) {
  thread_local std::vector<float> kept;
  thread_local std::vector<uint16_t> halves;
  kept.resize(static_cast<size_t>(LANE_ROWS * nk * G));
  halves.resize(static_cast<size_t>(LANE_ROWS * (nk + (nk + 1) * G)));
  *pl = halves.data();
  *pp = halves.data() + static_cast<size_t>(LANE_ROWS) * nk;
  return kept.data();
}

// The same for int8 key rows on integers (the int16 route's idots2, rows across lanes): the query's
// int16 pairs (qp, lay_int16_pairs_in_lanes) against each key row sign-extended to int16 once into
// the thread's buffer (E <= 512, E % 32 == 0), the int32 sums exact as idots2's; s = f[j] *
// (float(sum) * qs[a]), idots2's operations in its order, so the same bits. I, X: isa::I32, isa::F16.
template <class I, class X, class Lines>
inline void lane_idots8(const uint32_t* __restrict__ qp, int64_t E, const int8_t* __restrict__ k, int64_t k_ld, int m,
                        const float* f, int64_t n, float* __restrict__ s, int ld, int j0, const Lines& lines) {
  alignas(64) int16_t wide[8][512];
  for (int i = 0; i < m; ++i)
    for (int64_t c = 0; c < E; c += 32) I::widen_i8x32(k + i * k_ld + c, wide[i] + c);
  const int16_t* r[8];
  for (int i = 0; i < 8; ++i) r[i] = wide[std::min(i, m - 1)];
  typename I::V a[8];
  pair_dots8<IntPairs<I>>(qp, E, r, a, lines);
  const typename X::V qs = X::load(reinterpret_cast<const float*>(qp + E / 2 * LANE_ROWS));
  auto scaled = [&](int i) { return X::mul(I::to_float(a[i]), qs); };
  lanes_to_rows<X>(scaled(0), scaled(1), scaled(2), scaled(3), scaled(4), scaled(5), scaled(6), scaled(7), f, m, n, s,
                   ld, j0);
}

}  // namespace
