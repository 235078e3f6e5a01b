// attnlab's decode kernel (decode.cpp), its streaming loop's value pass: acc += P~ V for a key
// block, each value row read once as stored (float32, bf16, fp16, int8 with its scales folded into
// P~) into register tiles of a few rows by a few vectors, on the seam's streaming vector
// (isa::Stream). A bf16 cache's value pass on vdpbf16ps is decode_bf16.h's bvalues. Included by
// decode.cpp only.
#pragma once

#include <ATen/ATen.h>

#include "kernels.h"
#include "decode_dots.h"  // widen_load, widen, prefetch_row

#include <cstdint>
#include <type_traits>

namespace {

// acc += P~ V for the block, P~ in s (n, nk) (an int8 cache's value scales already folded in: see
// run_block), each V row read once from memory as stored. Register-blocked: four or six rows'
// accumulators for 16 columns stay in registers while the block's nk value rows stream past
// (each converted once), so acc is loaded and stored once per block, not once per key (the AXPY
// form's store port bound it). At most twelve accumulators: with two value vectors and a weight
// that is 15 of AVX2's 16 ymm registers. Four rows by 32 columns (sixteen) spilled to the stack,
// and every key's FMAs then waited on stores and reloads; so did an array of accumulators GCC
// would not keep in registers (2026-12-03, 2-core AVX2 EPYC, q (8, 4, 4, 128) against S = 2048 on
// one thread: perf put most of the kernel's samples on those stores).
// acc rows a .. a + R - 1, columns [c, c + W * U) (R = 4 or 6, U = 1 or 2) += P~ rows a ..
// a + R - 1 (p0, ld apart) times V's columns. Six rows (twelve accumulators, the two value vectors,
// one weight at a time: 15 registers) let each value vector feed six FMAs, not four: at 16 rows a
// head (q (1, 32, 4, 128) fp32 against S = 32768, 2 threads, 2-core AVX2 EPYC, 2026-12-03) they
// took the step from 24.7 to 21.0 ms.
// X: the seam's streaming vector, W = X::W lanes: 16 (a zmm) where the build has AVX-512, else 8.
// Written for AVX2 first; on 512 bits the same tiles (and dots4's) took the fp32 step at q (1, 32,
// 4, 128) against (1, 8, S, 128) from 31.2-32.1 to 22.2-22.9 ms at S = 32768 and from 3.4-3.6 to
// 2.4-2.5 ms at S = 4096 (one thread, CPU time, 2-core EPYC Zen 5, 2026-12-04, old and new builds
// alternated, three rounds; Lq = 1: 12.3-13.8 -> 11.4-11.6 ms at S = 32768).
template <class T, int R, int U, class X = isa::Stream>
inline void value_tile(const float* __restrict__ p0, int ld, int nk, const T* __restrict__ v, int64_t v_ld,
                       int64_t c, float* __restrict__ acc, int64_t Ev) {
  static_assert((R == 4 || R == 6) && (U == 1 || U == 2), "value_tile: 4 or 6 rows, one or two vectors");
  using V = typename X::V;
  float* d = acc + c;
  V r00 = X::load(d), r10 = X::load(d + Ev), r20 = X::load(d + 2 * Ev);
  V r30 = X::load(d + 3 * Ev), r40 = r00, r50 = r00;
  if constexpr (R == 6) r40 = X::load(d + 4 * Ev), r50 = X::load(d + 5 * Ev);
  V r01 = r00, r11 = r00, r21 = r00, r31 = r00, r41 = r00, r51 = r00;
  constexpr int W = X::W;
  if constexpr (U == 2) {
    r01 = X::load(d + W), r11 = X::load(d + Ev + W), r21 = X::load(d + 2 * Ev + W);
    r31 = X::load(d + 3 * Ev + W);
    if constexpr (R == 6) r41 = X::load(d + 4 * Ev + W), r51 = X::load(d + 5 * Ev + W);
  }
  for (int j = 0; j < nk; ++j) {
    const T* row = v + j * v_ld + c;
    V x0 = widen_load<X>(row), x1 = x0;
    X::keep(x0);
    if constexpr (U == 2) x1 = widen_load<X>(row + W), X::keep(x1);
    // one row's weight times the value vectors
    auto row_fma = [&](int i, V& ra, V& rb) {
      const V w = X::bcast(p0 + i * ld + j);
      ra = X::fma(w, x0, ra);
      if constexpr (U == 2) rb = X::fma(w, x1, rb);
    };
    row_fma(0, r00, r01), row_fma(1, r10, r11), row_fma(2, r20, r21), row_fma(3, r30, r31);
    if constexpr (R == 6) row_fma(4, r40, r41), row_fma(5, r50, r51);
  }
  X::store(d, r00), X::store(d + Ev, r10), X::store(d + 2 * Ev, r20);
  X::store(d + 3 * Ev, r30);
  if constexpr (R == 6) X::store(d + 4 * Ev, r40), X::store(d + 5 * Ev, r50);
  if constexpr (U == 2) {
    X::store(d + W, r01), X::store(d + Ev + W, r11), X::store(d + 2 * Ev + W, r21);
    X::store(d + 3 * Ev + W, r31);
    if constexpr (R == 6) X::store(d + 4 * Ev + W, r41), X::store(d + 5 * Ev + W, r51);
  }
}

// acc rows a, a + 1, columns [c, c + 4 W) += P~ rows a, a + 1 times V's columns: eight accumulators,
// four value vectors, two weights. For the 2 or 4 rows of a decode step: a pass over the block reads
// two lines of each value row, not one, and float32 at 4 rows (q (1, 32, 1, 128) against S = 32768,
// 2 threads, AVX2 EPYC, 2026-12-03) took 13.3-14.3 ms this way against 14.2-16.1 ms with the
// four-row 16-column tile (the same as before the tiles: a four-row 32-column tile that spilled).
template <class T, class X = isa::Stream>
inline void value_pair(const float* __restrict__ p0, int ld, int nk, const T* __restrict__ v, int64_t v_ld,
                       int64_t c, float* __restrict__ acc, int64_t Ev) {
  using V = typename X::V;
  constexpr int W = X::W;
  const float* p1 = p0 + ld;
  float *d0 = acc + c, *d1 = d0 + Ev;
  V r00 = X::load(d0), r01 = X::load(d0 + W), r02 = X::load(d0 + 2 * W);
  V r03 = X::load(d0 + 3 * W), r10 = X::load(d1), r11 = X::load(d1 + W);
  V r12 = X::load(d1 + 2 * W), r13 = X::load(d1 + 3 * W);
  for (int j = 0; j < nk; ++j) {
    const T* row = v + j * v_ld + c;
    V x0 = widen_load<X>(row), x1 = widen_load<X>(row + W), x2 = widen_load<X>(row + 2 * W);
    V x3 = widen_load<X>(row + 3 * W);
    X::keep(x0), X::keep(x1), X::keep(x2), X::keep(x3);
    const V w0 = X::bcast(p0 + j), w1 = X::bcast(p1 + j);
    r00 = X::fma(w0, x0, r00), r01 = X::fma(w0, x1, r01);
    r02 = X::fma(w0, x2, r02), r03 = X::fma(w0, x3, r03);
    r10 = X::fma(w1, x0, r10), r11 = X::fma(w1, x1, r11);
    r12 = X::fma(w1, x2, r12), r13 = X::fma(w1, x3, r13);
  }
  X::store(d0, r00), X::store(d0 + W, r01), X::store(d0 + 2 * W, r02);
  X::store(d0 + 3 * W, r03), X::store(d1, r10), X::store(d1 + W, r11);
  X::store(d1 + 2 * W, r12), X::store(d1 + 3 * W, r13);
}

template <class T>
inline void stream_values(const float* __restrict__ s, int64_t n, int64_t Ev, const T* __restrict__ v, int64_t v_ld,
                          int nk, int ld, float* __restrict__ acc, bool own_prefetch = true) {
  if (own_prefetch)
    for (int j = 0; j < nk; ++j) prefetch_row(v + j * v_ld, Ev);  // the block's V rows, while the first are used
  int64_t done = 0;  // rows [0, done) are taken by the register tiles (on the seam's streaming vector)
  using X = isa::Stream;
  constexpr int W = X::W;
  if constexpr (X::real) {
    // a decode step's few rows: pairs of rows by 4 W columns. Not for int8 rows: each pair of rows
    // converts every value element again (vpmovsxbd, vcvtdq2ps), so 4 rows take the four-row tile
    // below, which converts it once. int8 at 4 rows a head, with the int16 dot products (q (1, 32, 1,
    // 128) against (1, 8, S, 128), one thread, CPU time, 2-core AVX2 EPYC, 2026-12-03): 0.72-0.87x
    // bf16's time with the pairs, 0.69-0.72x with the four-row tile (three rounds each, S = 4096 and 32768).
    if (n < 6 && n % 2 == 0 && Ev % (4 * W) == 0 && !std::is_same_v<T, int8_t>) {
      for (int64_t c = 0; c < Ev; c += 4 * W)
        for (int64_t a = 0; a < n; a += 2) value_pair<T>(s + a * ld, ld, nk, v, v_ld, c, acc + a * Ev, Ev);
      return;
    }
    // six-row tiles, then four-row ones: as many six-row tiles as cover the most rows
    int64_t sixes = 0;
    done = n & ~int64_t(3);
    for (int64_t t = 1; 6 * t <= n; ++t)
      if (6 * t + ((n - 6 * t) & ~int64_t(3)) >= done) sixes = t, done = 6 * t + ((n - 6 * t) & ~int64_t(3));
    const int64_t wide = Ev & ~int64_t(2 * W - 1), full = Ev & ~int64_t(W - 1);
    // columns outer, row tiles inner: a column block's value lines are read from L1 by every tile
    int64_t c = 0;
    for (; c < wide; c += 2 * W) {
      int64_t a = 0;
      for (; a < 6 * sixes; a += 6) value_tile<T, 6, 2>(s + a * ld, ld, nk, v, v_ld, c, acc + a * Ev, Ev);
      for (; a < done; a += 4) value_tile<T, 4, 2>(s + a * ld, ld, nk, v, v_ld, c, acc + a * Ev, Ev);
    }
    for (; c < full; c += W) {
      int64_t a = 0;
      for (; a < 6 * sixes; a += 6) value_tile<T, 6, 1>(s + a * ld, ld, nk, v, v_ld, c, acc + a * Ev, Ev);
      for (; a < done; a += 4) value_tile<T, 4, 1>(s + a * ld, ld, nk, v, v_ld, c, acc + a * Ev, Ev);
    }
    for (int64_t a = 0; a < done; ++a) {  // the last columns, one at a time
      const float* pa = s + a * ld;
      for (int64_t c = full; c < Ev; ++c) {
        float t = 0.0f;
        for (int j = 0; j < nk; ++j) t += pa[j] * widen<T>(v[j * v_ld + c]);
        acc[a * Ev + c] += t;
      }
    }
  }
  for (int64_t a = done; a < n; ++a) {  // rows left over (and every row without a vector type): one row at a time
    const float* pa = s + a * ld;
    float* dst = acc + a * Ev;
    for (int j = 0; j < nk; ++j) {
      const float w = pa[j];
      if (w == 0.0f) continue;
      const T* row = v + j * v_ld;
#pragma omp simd
      for (int64_t c = 0; c < Ev; ++c) dst[c] += w * widen<T>(row[c]);
    }
  }
}

}  // namespace
