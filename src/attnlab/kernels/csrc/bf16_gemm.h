// bf16 x bf16 -> float32 GEMM for the native kernels' bf16 route (issue 24, item 3).
//
// Why our own: torch's bf16 GEMM that writes float32 (at::native::cpublas::gemm's BFloat16 ->
// float overload, oneDNN inside) is not exported by libtorch_cpu; MKL's cblas_gemm_bf16bf16f32
// is, but on this AMD Zen 4 it took 124 us for 256x256x64 where sgemm took 113 us (single
// thread, 2026-12-01): MKL picks its AVX2 code on AMD. at::mm on bf16 writes bf16, which would
// round the scores before the softmax. So the route that uses the CPU's bf16 units is this
// file: operands packed as oneDNN's and torch's own bf16 kernels pack them, a register-blocked
// micro-kernel on vdpbf16ps (AVX512_BF16: two bf16 products summed into each float32 lane),
// float32 accumulation.
//
//   A is packed row by row along k (pairs of k adjacent: a 32-bit broadcast feeds a dpbf16);
//   B is packed in "VNNI" order, Bp[p][j][t] = B(2p + t, j), so one 512-bit load holds the
//   pairs of 16 columns; the micro-kernel keeps an MR x (16 NR) block of C in registers.
//
// Without AVX512_BF16 (compiled for an AVX2-only CPU) the same call widens the operands to
// float32 and runs sgemm: the same products (a bf16 x bf16 product is exact in float32) and
// float32 sums, so the route is correct, and testable, on every CPU; it is fast only where
// the instructions exist (attnlab.kernels.bf16_route chooses it then).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// bf16 bits <-> float32 (a bf16 is the top half of a float32; rounding to nearest even): the seam's
using isa::bf16_to_float;
using isa::float_to_bf16;

// dst[0..count) = bf16(src[0..count)): P and dS before their GEMMs, as torch's kernel rounds them
inline void round_to_bf16(const float* src, int64_t count, uint16_t* dst) {
  int64_t c = 0;
  if constexpr (isa::kBf16)
    for (; c + 32 <= count; c += 32) isa::to_bf16_x32(src + c, dst + c);
  for (; c < count; ++c) dst[c] = float_to_bf16(src[c]);
}

// op(X)(i, kk) of a row-major bf16 matrix with leading dim ld, op = transpose when t
inline uint16_t at_op(const uint16_t* x, int64_t ld, bool t, int64_t i, int64_t kk) {
  return t ? x[kk * ld + i] : x[i * ld + kk];
}

// dst's pairs (dst[2 j], dst[2 j + 1]) = (r0[j], r1[j]) for j < n; r1 null: (r0[j], 0). The
// packing of "VNNI" order: two rows along k become one row of pairs. Sixteen columns a step
// (isa::interleave16: vpunpck{l,h}wd on AVX2).
inline void interleave_rows(const uint16_t* r0, const uint16_t* r1, int64_t n, uint16_t* dst) {
  int64_t j = 0;
  if constexpr (isa::kShuffles16)
    if (r1)
      for (; j + 16 <= n; j += 16) isa::interleave16(r0 + j, r1 + j, dst + 2 * j);
  for (; j < n; ++j) {
    dst[2 * j] = r0[j];
    dst[2 * j + 1] = r1 ? r1[j] : 0;
  }
}

// dst[p * dst_ld + 2 j + t] = x[j * ld + 2 p + t] for j < n and the kp = ceil(k / 2) pairs p of a
// row of k elements (an odd k's last pair is (x[k - 1], 0)): a transpose of 32-bit pairs, K^T and
// V^T packed for the bf16 micro-kernel. Eight by eight pairs a step (isa::transpose_pairs8x8:
// AVX2's 32- and 64-bit unpacks); the scalar gather it replaced took 7% of a bf16 backward's
// samples (issue 49, perf on a Zen 4).
inline void transpose_pairs(const uint16_t* x, int64_t ld, int64_t n, int64_t k, uint16_t* dst, int64_t dst_ld) {
  const int64_t kf = k / 2, kp = (k + 1) / 2;  // whole pairs, all pairs
  int64_t jb = 0, pb = 0;                      // the 8 x 8 blocks cover j < jb, p < pb
  if constexpr (isa::kShuffles16) {
    jb = n / 8 * 8, pb = kf / 8 * 8;
    for (int64_t j0 = 0; j0 < jb; j0 += 8)
      for (int64_t p0 = 0; p0 < pb; p0 += 8)
        isa::transpose_pairs8x8(x + j0 * ld + 2 * p0, ld, dst + p0 * dst_ld + 2 * j0, dst_ld);
  }
  for (int64_t p = 0; p < kp; ++p)
    for (int64_t j = p < pb ? jb : 0; j < n; ++j) {
      uint16_t* d = dst + p * dst_ld + 2 * j;
      d[0] = x[j * ld + 2 * p];
      d[1] = 2 * p + 1 < k ? x[j * ld + 2 * p + 1] : 0;
    }
}

// C[0:MR, 0:16 NR] = alpha * sum_p A_p B_p + beta * C, the last 16 columns cut to `tail`. Row i's
// pair p of A (two bf16 along k) is at ap + i * a_i + p * a_p: A read in place (a_i = lda, a_p = 2)
// or packed as rows of pairs along m (a_i = 2, a_p = 2 m: A^T).
template <int MR, int NR>
inline void micro_bf16(int64_t kp, const uint16_t* ap, int64_t a_i, int64_t a_p, const uint16_t* bp, int64_t b_ld,
                       float alpha, float beta, float* c, int64_t ldc, int tail) {
  using X = isa::F16;
  using B = isa::B32;
  // every loop over MR and NR unrolled (the pragmas), as sgemm.h's micro_tile: then every index of
  // acc is a constant and GCC keeps the 24 accumulators in registers. Without them it kept acc on
  // the stack outside the k loop (24 zmm stores and loads before it, 24 stores and loads after:
  // ~15% of the time of a tile product with 32 pairs of k, S = Q K^T at E = 64)
  X::V acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = X::zero();
  for (int64_t p = 0; p < kp; ++p) {
    typename B::V b[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) b[j] = B::load(bp + p * b_ld + 32 * j);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const typename B::V a = B::pair(ap + i * a_i + p * a_p);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = isa::dpbf16(acc[i][j], a, b[j]);
    }
  }
  const X::V va = X::set1(alpha), vb = X::set1(beta);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      float* out = c + i * ldc + 16 * j;
      const int cols = j == NR - 1 ? tail : 16;
      X::V r = X::mul(acc[i][j], va);
      if (beta != 0.0f) r = X::fma(X::load_partial(out, cols, 0.0f), vb, r);
      X::store_partial(out, cols, r);
    }
  }
}

template <int MR>
inline void micro_rows(int nr, int64_t kp, const uint16_t* ap, int64_t a_i, int64_t a_p, const uint16_t* bp,
                       int64_t b_ld, float alpha, float beta, float* c, int64_t ldc, int tail) {
  switch (nr) {
    case 1: micro_bf16<MR, 1>(kp, ap, a_i, a_p, bp, b_ld, alpha, beta, c, ldc, tail); break;
    case 2: micro_bf16<MR, 2>(kp, ap, a_i, a_p, bp, b_ld, alpha, beta, c, ldc, tail); break;
    case 3: micro_bf16<MR, 3>(kp, ap, a_i, a_p, bp, b_ld, alpha, beta, c, ldc, tail); break;
    default: micro_bf16<MR, 4>(kp, ap, a_i, a_p, bp, b_ld, alpha, beta, c, ldc, tail); break;
  }
}

// Row-major C (m x n, ldc, float32) = alpha * op(A) op(B) + beta * C, with A (m x k) and B
// (k x n) bf16 (op = transpose when ta / tb; lda, ldb are the stored matrices' leading dims).
// units = false widens instead of using the bf16 instructions (the route of CPUs without them,
// forced by ATTNLAB_BF16=bf16-emulated so that it is tested on any machine).
inline void gemm_bf16(bool ta, bool tb, int m, int n, int k, float alpha, const uint16_t* a, int lda,
                      const uint16_t* b, int ldb, float beta, float* c, int ldc, bool units) {
  if (m <= 0 || n <= 0) return;
  if (units && isa::kBf16) {
  const int64_t kp = (k + 1) / 2;         // pairs of k
  const int64_t np = (n + 15) / 16 * 16;  // columns, padded to whole zmm
  thread_local std::vector<uint16_t> a_pack, b_pack;
  // A: read in place when its rows hold whole pairs (Q, P, dS: no copy); else rows padded with a 0
  // (an odd k), or A^T as rows of pairs along m (P^T, dS^T: two rows of the stored A interleaved)
  const uint16_t* ap = a;
  int64_t a_i = lda, a_p = 2;
  if (ta) {
    a_pack.resize(static_cast<size_t>(kp) * 2 * m);
    for (int64_t p = 0; p < kp; ++p)
      interleave_rows(a + 2 * p * lda, 2 * p + 1 < k ? a + (2 * p + 1) * lda : nullptr, m, a_pack.data() + p * 2 * m);
    ap = a_pack.data(), a_i = 2, a_p = 2 * m;
  } else if (k % 2) {
    a_pack.resize(static_cast<size_t>(m) * 2 * kp);
    for (int64_t i = 0; i < m; ++i) {
      uint16_t* row = a_pack.data() + i * 2 * kp;
      std::memcpy(row, a + i * lda, static_cast<size_t>(k) * 2);
      row[k] = 0;
    }
    ap = a_pack.data(), a_i = 2 * kp;
  }
  // B in "VNNI" order, Bp[p][j][t] = B(2p + t, j), padding 0: two rows interleaved (V, dO, K, Q),
  // or pairs transposed (K^T, V^T)
  b_pack.resize(static_cast<size_t>(kp) * np * 2);
  if (!tb) {
    for (int64_t p = 0; p < kp; ++p)
      interleave_rows(b + 2 * p * ldb, 2 * p + 1 < k ? b + (2 * p + 1) * ldb : nullptr, n, b_pack.data() + p * np * 2);
  } else {
    transpose_pairs(b, ldb, n, k, b_pack.data(), 2 * np);
  }
  for (int64_t p = 0; p < kp; ++p) std::fill(b_pack.data() + p * np * 2 + 2 * n, b_pack.data() + (p + 1) * np * 2, uint16_t(0));
  constexpr int MR = 6, NR = 4;  // 24 accumulators + 4 B loads + 1 broadcast of the 32 zmm
  for (int64_t j0 = 0; j0 < n; j0 += 16 * NR) {
    const int cols = static_cast<int>(std::min<int64_t>(16 * NR, n - j0));
    const int nr = (cols + 15) / 16;
    const int tail = cols - 16 * (nr - 1);  // columns of the last 16
    const uint16_t* bp = b_pack.data() + 2 * j0;
    for (int64_t i0 = 0; i0 < m; i0 += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, m - i0));
      const uint16_t* at = ap + i0 * a_i;
      float* cc = c + i0 * ldc + j0;
      switch (rows) {
        case 1: micro_rows<1>(nr, kp, at, a_i, a_p, bp, 2 * np, alpha, beta, cc, ldc, tail); break;
        case 2: micro_rows<2>(nr, kp, at, a_i, a_p, bp, 2 * np, alpha, beta, cc, ldc, tail); break;
        case 3: micro_rows<3>(nr, kp, at, a_i, a_p, bp, 2 * np, alpha, beta, cc, ldc, tail); break;
        case 4: micro_rows<4>(nr, kp, at, a_i, a_p, bp, 2 * np, alpha, beta, cc, ldc, tail); break;
        case 5: micro_rows<5>(nr, kp, at, a_i, a_p, bp, 2 * np, alpha, beta, cc, ldc, tail); break;
        default: micro_rows<6>(nr, kp, at, a_i, a_p, bp, 2 * np, alpha, beta, cc, ldc, tail); break;
      }
    }
  }
  return;
  }
  // no bf16 instructions: widen op(A) and op(B) to float32 and run sgemm (same products, exact)
  thread_local std::vector<float> a32, b32;
  a32.resize(static_cast<size_t>(m) * k);
  b32.resize(static_cast<size_t>(k) * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t kk = 0; kk < k; ++kk) a32[i * k + kk] = bf16_to_float(at_op(a, lda, ta, i, kk));
  for (int64_t kk = 0; kk < k; ++kk)
    for (int64_t j = 0; j < n; ++j) b32[kk * n + j] = bf16_to_float(at_op(b, ldb, tb, kk, j));
  gemm_rm(false, false, m, n, k, alpha, a32.data(), k, b32.data(), n, beta, c, ldc);
}

// Whether gemm_bf16 runs on the CPU's bf16 instructions in this build (else it widens to float32).
inline bool bf16_gemm_native() { return isa::kBf16; }

}  // namespace
