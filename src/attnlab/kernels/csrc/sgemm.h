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
//   - op(A) is read in place when not transposed (A(i, p) = a[i * lda + p]); A^T is packed
//     once per call into (k x MR) panels; the last m % MR rows are always packed, zero-padded,
//     so that no load leaves the matrix.
//   - op(B)'s rows must be NR contiguous floats: B itself when not transposed (V, dO, K, Q in
//     the kernels' products), else packed once per call (K^T, V^T: k x NR panels); the last
//     n % NR columns are always packed, zero-padded.
//   - beta = 0 never reads C (the score tile's scratch holds garbage, NaN included), as BLAS.
//
// Routes, chosen in Python (attnlab.kernels.native.sgemm_route, $ATTNLAB_SGEMM):
//   kSgemmBlas        MKL's sgemm (gemm_rm), the route before this file;
//   kSgemmAvx2        8-lane ymm, a 6 x 16 tile: 12 accumulators + 2 loads + 1 broadcast of 16;
//   kSgemmAvx512      16-lane zmm, a 12 x 32 tile: 24 accumulators + 2 + 1 of 32 (AVX-512 builds);
//   kSgemmAvx512Emu   the AVX-512 tile (12 x 32 of 16-lane vectors) with each vector a pair of
//                     ymm: the same code and shape, runnable on an AVX2-only CPU so that the
//                     AVX-512 route's logic (tile walk, edges, packing) is tested there too.
#pragma once

#include <algorithm>
#include <cstdint>
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
  static void store(float* p, V x) {
    H::store(p, x.lo);
    H::store(p + H::W, x.hi);
  }
};

// C[0:MR, 0:NR] = alpha * sum_p A(i, p) B(p, :) + beta * C for one whole micro-tile, with
// A(i, p) = a[i * lda + p] (AT: a[p * lda + i]) and B(p, :) the NR floats at b + p * ldb.
// Edge tiles go through edge_tile, so that nothing here takes the accumulators' address (GCC
// then keeps them in registers; with an edge branch inside, it spilled all 12 every step: 31
// against 120 GFLOP/s).
template <class X, int MR, int NV, bool AT>
inline void micro_tile(int k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha, float beta,
                       float* c, int64_t ldc) {
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
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* out = c + i * ldc + v * W;
      typename X::V r = X::mul(acc[i][v], va);
      if (beta != 0.0f) r = X::fma(X::load(out), X::set1(beta), r);
      X::store(out, r);
    }
}

// An edge tile (mr < MR or nr < NR): the whole tile into a buffer, then rows < mr, cols < nr.
template <class X, int MR, int NV, bool AT>
inline void edge_tile(int k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha, float beta,
                      float* c, int64_t ldc, int mr, int nr) {
  constexpr int NR = NV * X::W;
  alignas(64) float tile[MR * NR];
  micro_tile<X, MR, NV, AT>(k, a, lda, b, ldb, alpha, 0.0f, tile, NR);
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float* out = c + i * ldc + j;
      *out = beta != 0.0f ? tile[i * NR + j] + beta * *out : tile[i * NR + j];
    }
}

// The whole row-major C = alpha * op(A) op(B) + beta * C with MR x (NV * X::W) micro-tiles.
template <class X, int MR, int NV>
inline void sgemm_tiles(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                        int ldb, float beta, float* c, int ldc) {
  constexpr int NR = NV * X::W;
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
      for (int j = 0; j < cols; ++j) {
        const float* src = b + int64_t(j0 + j) * ldb;
        for (int p = 0; p < k; ++p) dst[p * NR + j] = src[p];
      }
    } else {
      for (int p = 0; p < k; ++p) std::copy(b + int64_t(p) * ldb + j0, b + int64_t(p) * ldb + j0 + cols, dst + p * NR);
    }
    if (cols < NR)
      for (int p = 0; p < k; ++p) std::fill(dst + p * NR + cols, dst + (p + 1) * NR, 0.0f);
  }
  // op(A)'s row tiles that need packing, as (k, MR) panels zero-padded past m: all of them when
  // transposed (in place, each step p reads a new row of A^T, L2-bound: 70 against 79 GFLOP/s
  // packed, 256x64x256 TN on the AVX2 EPYC), else only the last m % MR rows
  const int m_tail = m - m_whole;
  const int first_packed_rows = ta ? 0 : m_whole;
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
      const bool a_packed = i0 >= first_packed_rows;
      if (a_packed) {
        const float* ap = a_pack.data() + static_cast<int64_t>((i0 - first_packed_rows) / MR) * k * MR;
        if (mr == MR && nr == NR) micro_tile<X, MR, NV, true>(k, ap, MR, bp, b_ld, alpha, beta, cc, ldc);
        else edge_tile<X, MR, NV, true>(k, ap, MR, bp, b_ld, alpha, beta, cc, ldc, mr, nr);
      } else {
        const float* ai = a + int64_t(i0) * lda;
        if (nr == NR) micro_tile<X, MR, NV, false>(k, ai, lda, bp, b_ld, alpha, beta, cc, ldc);
        else edge_tile<X, MR, NV, false>(k, ai, lda, bp, b_ld, alpha, beta, cc, ldc, MR, nr);
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
// lacks takes BLAS; attnlab.kernels.native never asks for one).
inline void sgemm(int64_t route, bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                  const float* b, int ldb, float beta, float* c, int ldc) {
  if (!sgemm_route_built(route)) route = kSgemmBlas;
  switch (route) {
    case kSgemmAvx512: sgemm_tiles<isa::F16, 12, 2>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); return;
    case kSgemmAvx2: sgemm_tiles<isa::F8, 6, 2>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); return;
    case kSgemmAvx512Emu:
      sgemm_tiles<Pair<isa::F8>, 12, 2>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    default: gemm_rm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); return;
  }
}

}  // namespace
