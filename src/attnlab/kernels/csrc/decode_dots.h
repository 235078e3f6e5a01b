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

// ask for a row's lines into L1 (Locality 3) or L2 (2)
template <class T, int Locality = 3>
inline void prefetch_row(const T* row, int64_t width) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, Locality);
}

// The cache lines a step of the streaming loop (the lane kernels of decode_lanes.h, dots4) asks
// for, handed out one of each kind per iteration of its dot products' loop (operator()) rather than
// all before it: the next key rows into L1, this step's value rows into L2. A burst of 64
// prefetches (8 bf16 key rows and 8 value rows of E = 128) stalled the loop on full miss buffers;
// spread, q (1, 32, 4, 128) against 8 heads of 32768 keys, 2-core EPYC Zen 4, 2026-12-05, old and
// new builds alternated, three rounds: bf16 23.7-26.7 -> 18.0-18.4 ms on one thread, 11.3-11.8 ->
// 8.5-9.4 ms on two; float32 39.0-40.3 -> 35.8-36.0 and 20.6-21.4 -> 17.4-18.5 ms. Lines past kMax,
// and those left when the loop ends (rest), are asked for at once.
struct SpreadLines {
  static constexpr int kMax = 128;
  const char* k[kMax];
  const char* v[kMax];
  int nk = 0, nv = 0;
  template <class T>
  void add_k(const T* row, int64_t width) { add(k, nk, reinterpret_cast<const char*>(row), width * sizeof(T), 3); }
  template <class T>
  void add_v(const T* row, int64_t width) { add(v, nv, reinterpret_cast<const char*>(row), width * sizeof(T), 2); }
  void operator()(int64_t t) const {
    if (t < nk) __builtin_prefetch(k[t], 0, 3);
    if (t < nv) __builtin_prefetch(v[t], 0, 2);
  }
  void rest(int64_t from) const {
    for (int64_t t = from; t < nk; ++t) __builtin_prefetch(k[t], 0, 3);
    for (int64_t t = from; t < nv; ++t) __builtin_prefetch(v[t], 0, 2);
  }
  void at_once() {  // every line now, none left to spread
    rest(0);
    nk = nv = 0;
  }
  // the key lines [from, to) of another list, as this one's key lines (to spread a list over steps)
  void take_k(const SpreadLines& o, int from, int to) {
    for (int t = from; t < to; ++t) {
      if (nk < kMax) k[nk++] = o.k[t];
      else now<3>(o.k[t]);
    }
  }

 private:
  template <int Locality>
  static void now(const char* p) { __builtin_prefetch(p, 0, Locality); }
  static void add(const char** lines, int& n, const char* row, int64_t bytes, int locality) {
    for (int64_t b = 0; b < bytes; b += 64) {
      if (n < kMax) lines[n++] = row + b;
      else if (locality == 3) now<3>(row + b);
      else now<2>(row + b);
    }
  }
};

// SpreadLines' asks for two runs of lines without its lists: key lines [0, nk) at k + 64 t, value
// lines [0, nv) at v + 64 t (a head-major cache's rows, one after another). Filling the lists took
// 64 stores a step of 8 bf16 keys and a load and compare each for every ask.
struct RunLines {
  const char* k = nullptr;
  const char* v = nullptr;
  int nk = 0, nv = 0;
  void operator()(int64_t t) const {
    if (t < nk) __builtin_prefetch(k + 64 * t, 0, 3);
    if (t < nv) __builtin_prefetch(v + 64 * t, 0, 2);
  }
  void rest(int64_t from) const {
    for (int64_t t = from; t < nk; ++t) __builtin_prefetch(k + 64 * t, 0, 3);
    for (int64_t t = from; t < nv; ++t) __builtin_prefetch(v + 64 * t, 0, 2);
  }
};

// The first of the cache lines that count elements from p touch; *lines = how many
template <class T>
inline const char* line_run(const T* p, int64_t count, int* lines) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), b = a + count * sizeof(T);
  *lines = count > 0 ? static_cast<int>(((b - 1) >> 6) - (a >> 6) + 1) : 0;
  return reinterpret_cast<const char*>(a & ~uintptr_t{63});
}

// X::W stored elements as float32 (int8 without its scale), on the seam's vector X (F8 or F16)
template <class X, class T>
inline typename X::V widen_load(const T* p) {
  if constexpr (std::is_same_v<T, float>) return X::load(p);
  else if constexpr (std::is_same_v<T, c10::BFloat16>) return X::load_bf16(reinterpret_cast<const uint16_t*>(p));
  else if constexpr (std::is_same_v<T, c10::Half>) return X::load_f16(reinterpret_cast<const uint16_t*>(p));
  else return X::load_i8(p);
}

template <class T>
inline float widen(T x) { return static_cast<float>(x); }
template <>
inline float widen<int8_t>(int8_t x) { return static_cast<float>(x); }

// s[a * nk + j] (j = j0, j0 + 1) = f_j * q[a] . k_j for the n query rows (E apart) and two
// key rows k0, k1: each X::W elements of a key are loaded (and widened) once and feed four rows'
// FMA chains; two keys at a time share each load of a query chunk. k1 may be null (one key).
// X: the seam's streaming vector (isa::Stream: 16 lanes with AVX-512, else 8); a build without one
// (X::real false) takes the row loop.
template <class T, class X = isa::Stream>
inline void dots2(const float* __restrict__ q, int64_t n, int64_t E, const T* __restrict__ k0,
                  const T* __restrict__ k1, float f0, float f1, float* __restrict__ s, int nk, int j0) {
  int64_t a = 0;
  if constexpr (X::real) {
    using V = typename X::V;
    const int64_t full = E & ~int64_t(X::W - 1);
    for (; a + 4 <= n; a += 4) {
      const float *q0 = q + a * E, *q1 = q0 + E, *q2 = q1 + E, *q3 = q2 + E;
      V x0 = X::zero(), x1 = x0, x2 = x0, x3 = x0;  // key 0, rows a .. a + 3
      V y0 = x0, y1 = x0, y2 = x0, y3 = x0;         // key 1
      for (int64_t c = 0; c < full; c += X::W) {
        V a0 = X::load(q0 + c), a1 = X::load(q1 + c), a2 = X::load(q2 + c), a3 = X::load(q3 + c);
        X::keep(a0), X::keep(a1), X::keep(a2), X::keep(a3);
        V kc = widen_load<X>(k0 + c);
        X::keep(kc);
        x0 = X::fma(a0, kc, x0), x1 = X::fma(a1, kc, x1), x2 = X::fma(a2, kc, x2), x3 = X::fma(a3, kc, x3);
        if (k1) {
          V kd = widen_load<X>(k1 + c);
          X::keep(kd);
          y0 = X::fma(a0, kd, y0), y1 = X::fma(a1, kd, y1), y2 = X::fma(a2, kd, y2), y3 = X::fma(a3, kd, y3);
        }
      }
      alignas(16) float rx[4], ry[4];
      isa::F4::store(rx, isa::F4::mul(X::sum4(x0, x1, x2, x3), isa::F4::set1(f0)));
      isa::F4::store(ry, isa::F4::mul(X::sum4(y0, y1, y2, y3), isa::F4::set1(f1)));
      for (int64_t c = full; c < E; ++c) {  // the last elements, one at a time
        const float kc = widen<T>(k0[c]), kd = k1 ? widen<T>(k1[c]) : 0.0f;
        for (int i = 0; i < 4; ++i) rx[i] += f0 * q[(a + i) * E + c] * kc, ry[i] += f1 * q[(a + i) * E + c] * kd;
      }
      for (int i = 0; i < 4; ++i) {
        s[(a + i) * nk + j0] = rx[i];
        if (k1) s[(a + i) * nk + j0 + 1] = ry[i];
      }
    }
  }
  for (; a < n; ++a) {  // rows left over (and every row without X)
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

// s[a * nk + j0 .. j0 + 3] = f[0 .. 3] * (q[a] . k_j) for the n query rows (E apart) and four key
// rows (k, k_ld apart): two rows by four keys, eight FMA chains; each X::W elements of a key are
// loaded (and widened) once per two rows, and a row's four sums leave as one 4-wide store. The four rows
// by two keys this replaced left each score as a scalar (eight extracts and stores per tile), and
// its reductions took a quarter of the loop's time (perf, 2026-12-03, 2-core AVX2 EPYC, q (8, 4, 4,
// 128) fp32 against S = 2048, one thread). Needs E % X::W == 0, n even (stream_scores: n >= 8), X real.
// The lines the step asks for (SpreadLines) go out one of each kind per iteration, the rest after.
template <class T, class X = isa::Stream>
inline void dots4(const float* __restrict__ q, int64_t n, int64_t E, const T* __restrict__ k, int64_t k_ld,
                  const float* f, float* __restrict__ s, int nk, int j0, const SpreadLines& lines) {
  using V = typename X::V;
  using F4 = isa::F4;
  const T *k0 = k, *k1 = k0 + k_ld, *k2 = k1 + k_ld, *k3 = k2 + k_ld;
  const typename F4::V fv = F4::load(f);
  int64_t t = 0;
  for (int64_t a = 0; a < n; a += 2) {
    const float *q0 = q + a * E, *q1 = q0 + E;
    V x0 = X::zero(), x1 = x0, x2 = x0, x3 = x0;  // row a, keys 0 .. 3
    V y0 = x0, y1 = x0, y2 = x0, y3 = x0;         // row a + 1
    for (int64_t c = 0; c < E; c += X::W) {
      lines(t++);
      V a0 = X::load(q0 + c), a1 = X::load(q1 + c);
      X::keep(a0), X::keep(a1);
      V kc = widen_load<X>(k0 + c);
      X::keep(kc);
      x0 = X::fma(a0, kc, x0), y0 = X::fma(a1, kc, y0);
      kc = widen_load<X>(k1 + c);
      X::keep(kc);
      x1 = X::fma(a0, kc, x1), y1 = X::fma(a1, kc, y1);
      kc = widen_load<X>(k2 + c);
      X::keep(kc);
      x2 = X::fma(a0, kc, x2), y2 = X::fma(a1, kc, y2);
      kc = widen_load<X>(k3 + c);
      X::keep(kc);
      x3 = X::fma(a0, kc, x3), y3 = X::fma(a1, kc, y3);
    }
    F4::store(s + a * nk + j0, F4::mul(X::sum4(x0, x1, x2, x3), fv));
    F4::store(s + (a + 1) * nk + j0, F4::mul(X::sum4(y0, y1, y2, y3), fv));
  }
  lines.rest(t);
}

// An int8 cache's scores on integer dot products (int8_dot = 1: decode.py's "int16" route): the
// query rows rounded to int16 (qi, one scale per row in qs: quantize_rows), the key rows
// sign-extended to int16, and their pairs' products summed in int32 (isa::I16::dot_pairs: vpmaddwd
// and vpaddd, or one vpdpwssd where the build has AVX512_VNNI with VL: isa::kVnni): exact, as
// |sum| <= 32767 * 128 * E < 2^31 for E <= 512 (every lane and the horizontal sum).
// s[a * nk + j] = f_j * qs[a] * sum_c qi[a, c] * k_j[c]. One vpmovsxbw, four vpmaddwd and four
// vpaddd (or four vpdpwssd) per 16 elements of a key and four rows, where the float32 route takes
// two conversions of two instructions and eight FMAs. Needs E % 16 == 0 (decode_forward checks). The query's rounding
// is at most half of amax / 32767 per element, 1/258 of the int8 keys' own (half of amax / 127).
// With the four-row value tile for int8 (stream_values), old and new builds alternated (q (1, 32,
// Lq, 128) against (1, 8, S, 128), one thread, CPU time, 2-core AVX2 EPYC, 2026-12-03, three rounds):
// int8 / bf16 time at Lq = 1 0.79-0.88x -> 0.64-0.75x (S = 4096 and 32768), at Lq = 4 0.85-0.96x ->
// 0.65-0.92x (one round of 1.03x in this VM's noise). BENCHMARKS.md, "int8 dot products on integers".
template <class I = isa::I16>
inline void idots2(const int16_t* __restrict__ qi, const float* __restrict__ qs, int64_t n, int64_t E,
                   const int8_t* __restrict__ k0, const int8_t* __restrict__ k1, float f0, float f1,
                   float* __restrict__ s, int nk, int j0) {
  int64_t a = 0;
  if constexpr (I::real) {
    using V = typename I::V;
    using F4 = isa::F4;
    for (; a + 4 <= n; a += 4) {
      const int16_t *q0 = qi + a * E, *q1 = q0 + E, *q2 = q1 + E, *q3 = q2 + E;
      V x0 = I::zero(), x1 = x0, x2 = x0, x3 = x0;  // key 0, rows a .. a + 3
      V y0 = x0, y1 = x0, y2 = x0, y3 = x0;         // key 1
      for (int64_t c = 0; c < E; c += 16) {
        V a0 = I::load(q0 + c), a1 = I::load(q1 + c), a2 = I::load(q2 + c), a3 = I::load(q3 + c);
        I::keep(a0), I::keep(a1), I::keep(a2), I::keep(a3);
        V kc = I::widen_i8(k0 + c);
        I::keep(kc);
        x0 = I::dot_pairs(x0, a0, kc), x1 = I::dot_pairs(x1, a1, kc);
        x2 = I::dot_pairs(x2, a2, kc), x3 = I::dot_pairs(x3, a3, kc);
        if (k1) {
          V kd = I::widen_i8(k1 + c);
          I::keep(kd);
          y0 = I::dot_pairs(y0, a0, kd), y1 = I::dot_pairs(y1, a1, kd);
          y2 = I::dot_pairs(y2, a2, kd), y3 = I::dot_pairs(y3, a3, kd);
        }
      }
      const typename F4::V scale = F4::load(qs + a);
      alignas(16) float rx[4], ry[4];
      F4::store(rx, F4::mul(F4::mul(I::sum4(x0, x1, x2, x3), scale), F4::set1(f0)));
      F4::store(ry, F4::mul(F4::mul(I::sum4(y0, y1, y2, y3), scale), F4::set1(f1)));
      for (int i = 0; i < 4; ++i) {
        s[(a + i) * nk + j0] = rx[i];
        if (k1) s[(a + i) * nk + j0 + 1] = ry[i];
      }
    }
  }
  for (; a < n; ++a) {  // rows left over (and every row without I): the same integer sums
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
