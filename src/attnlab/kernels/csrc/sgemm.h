// attnlab's own float32 GEMM for the native kernels' tiles (issue 33, item 3).
//
// Why our own: on the 2-core AVX2 AMD EPYC of 2026-12-03, MKL's sgemm (torch's BLAS) ran the
// attention tile shapes (256x256x64 NT, 256x64x256 NN, single thread) at 85-88 GFLOP/s, while a
// loop of independent vfmadd231ps chains reached 154 GFLOP/s per core: 56% of the FMA peak (the
// issue measured 55-63% on an AVX-512 Zen 4). MKL takes its generic code on AMD CPUs. The tiles
// here are small (m, n <= 256, k <= 256) and sit in L2, so a register-blocked micro-kernel with
// no packing of what is already laid out right gets closer to the peak.
//
// The scheme (BLIS's, reduced to what fits in cache):
//
//   C (m x n) = alpha * op(A) op(B) + beta * C, row-major, cut into MR x NR micro-tiles:
//
//        NR = NV vectors of W floats
//       +------------+
//    MR | acc[MR][NV]|   kept in registers over all k: per p, NV loads of op(B)(p, j0:j0+NR),
//       +------------+   MR broadcasts of op(A)(i, p), MR * NV FMAs
//
//   - op(A) is read in place when not transposed (A(i, p) = a[i * lda + p]); A^T too on 16-lane
//     vectors (A^T(i, p) = a[p * lda + i]: MR neighbours in one row), elsewhere packed once per
//     call into (k x MR) panels; the last m % MR rows are always packed, zero-padded, so that no
//     load leaves the matrix, and run in tiles of 4 rows.
//   - op(B)'s rows must be NR contiguous floats: B itself when not transposed (V, dO, K, Q in
//     the kernels' products), else packed once per call (K^T, V^T: k x NR panels); the last
//     n % NR columns are always packed, zero-padded.
//   - beta = 0 never reads C (the score tile's scratch holds garbage, NaN included), as BLAS.
//
// Routes, chosen in Python (attnlab.kernels.native.sgemm_route, $ATTNLAB_SGEMM):
//   kSgemmBlas        MKL's sgemm (gemm_rm), the route before this file;
//   kSgemmAvx2        8-lane ymm, a 6 x 16 tile: 12 accumulators + 2 loads + 1 broadcast of 16;
//   kSgemmAvx512      16-lane zmm, a 6 x 64 tile: 24 accumulators + 4 loads + 1 broadcast of 64
//                     (AVX-512 builds). One thread on the Zen 5 of 2026-12-05 (`attnlab bench
//                     --gemm`'s products): 12 x 32 ran S = Q K^T at 77-81%, P V 86-88% of the FMA
//                     peak; 6 x 64 82-85% and 85-88% (a B row is one 64-column panel of V);
//                     14 x 32 81% / 85%; 8 x 48 73% / 58% (64 columns are not whole panels);
//   kSgemmAvx512Emu   the AVX-512 tile (6 x 64 of 16-lane vectors) with each vector a pair of
//                     ymm: the same code and shape, runnable on an AVX2-only CPU so that the
//                     AVX-512 route's logic (tile walk, edges, packing) is tested there too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

enum SgemmRoute : int64_t { kSgemmBlas = 0, kSgemmAvx2 = 1, kSgemmAvx512 = 2, kSgemmAvx512Emu = 3 };

// The vectors are the seam's (isa/isa.h): isa::F8 (ymm), isa::F16 (zmm), and a pair of narrow ones
// standing for one wide one (the AVX-512 tile on AVX2).
template <class H>
struct Pair {
  static constexpr int W = 2 * H::W;
  struct V {
    typename H::V lo, hi;
  };
  static V zero() { return {H::zero(), H::zero()}; }
  static V set1(float x) { return {H::set1(x), H::set1(x)}; }
  static V load(const float* p) { return {H::load(p), H::load(p + H::W)}; }
  static V bcast(const float* p) {
    const typename H::V x = H::bcast(p);
    return {x, x};
  }
  static V fma(V a, V b, V c) { return {H::fma(a.lo, b.lo, c.lo), H::fma(a.hi, b.hi, c.hi)}; }
  static V mul(V a, V b) { return {H::mul(a.lo, b.lo), H::mul(a.hi, b.hi)}; }
  static V max(V a, V b) { return {H::max(a.lo, b.lo), H::max(a.hi, b.hi)}; }
  static void store(float* p, V x) {
    H::store(p, x.lo);
    H::store(p + H::W, x.hi);
  }
};

// The row maxima sgemm finds on the way (rmax): kRowMaxLanes floats a row, each the maximum of the
// columns one vector lane saw; the row's maximum is their maximum (a route with fewer lanes leaves
// the rest as the caller set them, -inf).
constexpr int kRowMaxLanes = 16;

// C[0:MR, 0:NR] = alpha * sum_p A(i, p) B(p, :) + beta * C for one whole micro-tile, with
// A(i, p) = a[i * lda + p] (AT: a[p * lda + i]) and B(p, :) the NR floats at b + p * ldb.
// Edge tiles go through edge_tile, so that nothing here takes the accumulators' address (GCC
// then keeps them in registers; with an edge branch inside, it spilled all 12 every step: 31
// against 120 GFLOP/s).
template <class X, int MR, int NV, bool AT>
inline void micro_tile(int k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha, float beta,
                       float* c, int64_t ldc, float* rmax = nullptr) {
  constexpr int W = X::W;
  typename X::V acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = X::zero();
  for (int p = 0; p < k; ++p) {
    typename X::V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = X::load(b + p * ldb + v * W);
    const float* ap = AT ? a + p * lda : a + p;
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const typename X::V av = X::bcast(AT ? ap + i : ap + i * lda);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = X::fma(av, bv[v], acc[i][v]);
    }
  }
  const typename X::V va = X::set1(alpha);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    typename X::V r[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* out = c + i * ldc + v * W;
      r[v] = X::mul(acc[i][v], va);
      if (beta != 0.0f) r[v] = X::fma(X::load(out), X::set1(beta), r[v]);
      X::store(out, r[v]);
    }
    if (rmax != nullptr) {  // the row's running maximum, lane-wise (kRowMaxLanes a row)
      typename X::V mx = r[0];
#pragma GCC unroll 4
      for (int v = 1; v < NV; ++v) mx = X::max(mx, r[v]);
      X::store(rmax + i * kRowMaxLanes, X::max(X::load(rmax + i * kRowMaxLanes), mx));
    }
  }
}

// An edge tile (mr < MR or nr < NR): the whole tile into a buffer, then rows < mr, cols < nr.
template <class X, int MR, int NV, bool AT>
inline void edge_tile(int k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha, float beta,
                      float* c, int64_t ldc, int mr, int nr, float* rmax = nullptr) {
  constexpr int NR = NV * X::W;
  alignas(64) float tile[MR * NR];
  micro_tile<X, MR, NV, AT>(k, a, lda, b, ldb, alpha, 0.0f, tile, NR);
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float* out = c + i * ldc + j;
      *out = beta != 0.0f ? tile[i * NR + j] + beta * *out : tile[i * NR + j];
      if (rmax != nullptr) rmax[i * kRowMaxLanes] = std::max(rmax[i * kRowMaxLanes], *out);  // columns < nr only
    }
}

// dst[p * dst_ld + j] = src[j * ld + p] for j < cols, p < k: B^T's panel from B's rows (K's rows
// into a panel of K^T). On AVX-512 builds 8 rows x 16 columns a step through one 8 x 16 transpose
// (isa::F16::store_transposed8); one element at a time, this packing took 7% of a float32
// forward's samples at (1, 8, 4096, 64) on the Zen 5 (perf, 2026-12-05), the S = Q K^T product
// 77% of the FMA peak against 88% for P V, which reads its B in place.
template <class X>
inline void pack_transposed(const float* src, int64_t ld, int cols, int k, float* dst, int64_t dst_ld) {
  int j = 0;
  if constexpr (std::is_same<X, isa::F16>::value && isa::kF16) {
    using F = X;  // dependent: a build without AVX-512 never instantiates this branch
    const int k16 = k / 16 * 16;
    for (; j + 8 <= cols; j += 8) {
      const float* r = src + int64_t(j) * ld;
      for (int p = 0; p < k16; p += 16)
        F::store_transposed8(F::load(r + p), F::load(r + ld + p), F::load(r + 2 * ld + p), F::load(r + 3 * ld + p),
                             F::load(r + 4 * ld + p), F::load(r + 5 * ld + p), F::load(r + 6 * ld + p),
                             F::load(r + 7 * ld + p), dst + p * dst_ld + j, dst_ld, 16);
      for (int jj = j; jj < j + 8; ++jj)
        for (int p = k16; p < k; ++p) dst[p * dst_ld + jj] = src[int64_t(jj) * ld + p];
    }
  }
  for (; j < cols; ++j) {
    const float* row = src + int64_t(j) * ld;
    for (int p = 0; p < k; ++p) dst[p * dst_ld + j] = row[p];
  }
}

// The whole row-major C = alpha * op(A) op(B) + beta * C with MR x (NV * X::W) micro-tiles.
template <class X, int MR, int NV>
inline void sgemm_tiles(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                        int ldb, float beta, float* c, int ldc, float* rmax = nullptr) {
  constexpr int NR = NV * X::W;
  constexpr int TAIL_MR = MR > 4 ? 4 : MR;  // the row tail's tile height
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // C = beta * C (beta = 0: zeros, C never read)
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) c[int64_t(i) * ldc + j] = beta != 0.0f ? beta * c[int64_t(i) * ldc + j] : 0.0f;
    return;
  }
  const int n_panels = (n + NR - 1) / NR, n_whole = n / NR;
  const int m_whole = m / MR * MR;
  // op(B) panels that need packing: all of them when transposed, else only the last partial one
  thread_local std::vector<float> b_pack, a_pack;
  const int first_packed = tb ? 0 : n_whole;
  b_pack.resize(static_cast<size_t>(n_panels - first_packed) * k * NR);
  for (int jp = first_packed; jp < n_panels; ++jp) {
    float* dst = b_pack.data() + static_cast<int64_t>(jp - first_packed) * k * NR;  // (k, NR)
    const int j0 = jp * NR, cols = std::min(NR, n - j0);
    if (tb) {  // op(B)(p, j) = b[j * ldb + p]: each row of B becomes a column of the panel
      pack_transposed<X>(b + int64_t(j0) * ldb, ldb, cols, k, dst, NR);
    } else {
      for (int p = 0; p < k; ++p) std::copy(b + int64_t(p) * ldb + j0, b + int64_t(p) * ldb + j0 + cols, dst + p * NR);
    }
    if (cols < NR)
      for (int p = 0; p < k; ++p) std::fill(dst + p * NR + cols, dst + (p + 1) * NR, 0.0f);
  }
  // op(A)'s row tiles that need packing, as (k, MR) panels zero-padded past m: all of them when
  // transposed on 8 lanes (in place, each step p reads a new row of A^T, L2-bound: 70 against 79
  // GFLOP/s packed, 256x64x256 TN on the AVX2 EPYC), else only the last m % MR rows. On 16 lanes
  // A^T is read in place: packed, the copy took a third of dV += P^T dO's time (256x64x256 TN
  // on the Zen 5: 66-69% of the FMA peak packed, 85-86% in place, the 6 x 64 tile both times)
  const int m_tail = m - m_whole;
  const bool at_in_place = ta && X::W == 16;
  const int first_packed_rows = ta && !at_in_place ? 0 : m_whole;
  const int packed_tiles = (m - first_packed_rows + MR - 1) / MR;
  if (packed_tiles) {
    a_pack.resize(static_cast<size_t>(packed_tiles) * k * MR);
    for (int t = 0; t < packed_tiles; ++t) {
      float* dst = a_pack.data() + static_cast<int64_t>(t) * k * MR;
      const int i0 = first_packed_rows + t * MR, rows = std::min(MR, m - i0);
      if (rows == MR && ta) {  // the common case, MR a constant: a vectorised copy per step
        for (int p = 0; p < k; ++p)
#pragma GCC unroll 16
          for (int i = 0; i < MR; ++i) dst[p * MR + i] = a[int64_t(p) * lda + i0 + i];
        continue;
      }
      for (int p = 0; p < k; ++p)
        for (int i = 0; i < MR; ++i)
          dst[p * MR + i] = i >= rows ? 0.0f : ta ? a[int64_t(p) * lda + i0 + i] : a[int64_t(i0 + i) * lda + p];
    }
  }
  for (int jp = 0; jp < n_panels; ++jp) {  // a B panel (k x NR, in L1) against every row tile
    const int j0 = jp * NR, nr = std::min(NR, n - j0);
    const bool packed = jp >= first_packed;
    const float* bp = packed ? b_pack.data() + static_cast<int64_t>(jp - first_packed) * k * NR : b + j0;
    const int64_t b_ld = packed ? NR : ldb;
    for (int i0 = 0; i0 < m; i0 += MR) {
      float* cc = c + int64_t(i0) * ldc + j0;
      const int mr = std::min(MR, m - i0);
      float* rm = rmax != nullptr ? rmax + int64_t(i0) * kRowMaxLanes : nullptr;
      const bool a_packed = i0 >= first_packed_rows;
      if (a_packed) {
        const float* ap = a_pack.data() + static_cast<int64_t>((i0 - first_packed_rows) / MR) * k * MR;
        if (mr == MR && nr == NR) {
          micro_tile<X, MR, NV, true>(k, ap, MR, bp, b_ld, alpha, beta, cc, ldc, rm);
          continue;
        }
        // the last m % MR rows in tiles of TAIL_MR: a full MR-row edge tile would do MR rows' work
        // (256 = 21 x 12 + 4 rows: 8 of the 22nd tile's 12 rows wasted, 4% of the products)
        for (int r0 = 0; r0 < mr; r0 += TAIL_MR) {
          const int rows = std::min(TAIL_MR, mr - r0);
          if (rows == TAIL_MR && nr == NR)
            micro_tile<X, TAIL_MR, NV, true>(k, ap + r0, MR, bp, b_ld, alpha, beta, cc + int64_t(r0) * ldc, ldc,
                                             rm ? rm + r0 * kRowMaxLanes : nullptr);
          else
            edge_tile<X, TAIL_MR, NV, true>(k, ap + r0, MR, bp, b_ld, alpha, beta, cc + int64_t(r0) * ldc, ldc, rows, nr,
                                            rm ? rm + r0 * kRowMaxLanes : nullptr);
        }
      } else {
        if (ta) {
          if (nr == NR) micro_tile<X, MR, NV, true>(k, a + i0, lda, bp, b_ld, alpha, beta, cc, ldc, rm);
          else edge_tile<X, MR, NV, true>(k, a + i0, lda, bp, b_ld, alpha, beta, cc, ldc, MR, nr, rm);
          continue;
        }
        const float* ai = a + int64_t(i0) * lda;
        if (nr == NR) micro_tile<X, MR, NV, false>(k, ai, lda, bp, b_ld, alpha, beta, cc, ldc, rm);
        else edge_tile<X, MR, NV, false>(k, ai, lda, bp, b_ld, alpha, beta, cc, ldc, MR, nr, rm);
      }
    }
  }
}

// Which own routes this build has: kSgemmAvx512 needs an AVX-512 build, the others AVX2 + FMA.
inline bool sgemm_route_built(int64_t route) {
  switch (route) {
    case kSgemmBlas: return true;
    case kSgemmAvx2:
    case kSgemmAvx512Emu: return isa::kF8;
    case kSgemmAvx512: return isa::kF16;
    default: return false;
  }
}

// Row-major C (m x n, ldc) = alpha * op(A) op(B) + beta * C on `route` (a route this build
// lacks takes BLAS; attnlab.kernels.native never asks for one). With rmax (m x kRowMaxLanes,
// set by the caller) and beta = 0, attnlab's own routes also fold C's rows into their running
// maxima as each tile leaves its registers, and say so by returning true; BLAS returns false.
inline bool sgemm(int64_t route, bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                  const float* b, int ldb, float beta, float* c, int ldc, float* rmax = nullptr) {
  if (!sgemm_route_built(route)) route = kSgemmBlas;
  if (beta != 0.0f || k <= 0) rmax = nullptr;
  switch (route) {
    case kSgemmAvx512:
      sgemm_tiles<isa::F16, 6, 4>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, rmax);
      return rmax != nullptr;
    case kSgemmAvx2:
      sgemm_tiles<isa::F8, 6, 2>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, rmax);
      return rmax != nullptr;
    case kSgemmAvx512Emu:
      sgemm_tiles<Pair<isa::F8>, 6, 4>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, rmax);
      return rmax != nullptr;
    default: gemm_rm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); return false;
  }
}

}  // namespace
