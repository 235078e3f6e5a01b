// The instruction-set seam (isa/isa.h), portable C++: isa::F1 (one float: the scalar tails and
// builds without vector units), isa::exp2_nonpos, and stand-ins for what a build lacks (F8 without
// AVX2, F16 without AVX-512, B32 and vdpbf16ps without AVX512_BF16, the 16-bit shuffles), so that
// every algorithm compiles on every build; isa.h's kF8, kF16, kBf16 say which are the real ones,
// and the kernels never choose a stand-in (they are correct, not fast).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace isa {

// 2^f for f in [-1/2, 1/2] on a vector type X (F8, F16): a degree-6 near-minimax fit (relative
// error 1.0e-7 in float32, about torch's own exp), six FMAs; the one polynomial both vector
// exp2_nonpos (avx2.h, avx512.h) use, each with its own way to 2^n
template <class X>
inline typename X::V exp2_poly(typename X::V f) {
  typename X::V p = X::set1(1.5370704932138324e-4f);
  p = X::fma(p, f, X::set1(1.3399848248809576e-3f));
  p = X::fma(p, f, X::set1(9.618373587727547e-3f));
  p = X::fma(p, f, X::set1(5.550329014658928e-2f));
  p = X::fma(p, f, X::set1(0.24022647738456726f));
  p = X::fma(p, f, X::set1(0.6931471824645996f));
  return X::fma(p, f, X::set1(1.0f));
}

// 2^x for x <= 0, vectorisable: x = n + f with n = round(x), f in [-1/2, 1/2]; 2^f by its degree-7
// Taylor polynomial in f*ln2 (relative error < 1e-8, under float32's half ulp); 2^n by writing
// n + 127 into the exponent bits. x <= -127 gives exactly 0.
inline float exp2_nonpos(float x) {
  x = x < -127.0f ? -127.0f : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const float shifted = x + magic;
  const float n = shifted - magic;
  const float f = (x - n) * 0.6931471805599453f;  // f * ln 2, in [-0.347, 0.347]
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  int32_t shifted_bits, magic_bits;
  std::memcpy(&shifted_bits, &shifted, 4);
  std::memcpy(&magic_bits, &magic, 4);
  const int32_t exponent = (shifted_bits - magic_bits + 127) << 23;  // n = -127 -> 0.0f
  float two_n;
  std::memcpy(&two_n, &exponent, 4);
  return p * two_n;
}

// fp16 bits as float32: exact (every half is a float32), denormals, inf and NaN included
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ffu;
  float f;
  if (exponent == 0x1f) {  // inf or NaN (payload kept)
    const uint32_t bits = sign | 0x7f800000u | (mantissa << 13);
    std::memcpy(&f, &bits, 4);
    return f;
  }
  f = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -24)  // zero or a denormal
                    : std::ldexp(static_cast<float>(mantissa | 0x400u), exponent - 25);
  return sign ? -f : f;
}

// N float lanes in plain C++, the interface of F8 and F16
template <int N>
struct Portable {
  static constexpr bool real = false;  // a stand-in: correct, not fast (decode's kernels skip it)
  static constexpr int W = N;
  struct V {
    float x[N];
  };
  template <class F>
  static V each(F f) {
    V r;
    for (int i = 0; i < N; ++i) r.x[i] = f(i);
    return r;
  }
  static V zero() { return each([](int) { return 0.0f; }); }
  static V set1(float a) { return each([a](int) { return a; }); }
  static V load(const float* p) { return each([p](int i) { return p[i]; }); }
  static V bcast(const float* p) { return set1(*p); }
  static void store(float* p, V a) { std::memcpy(p, a.x, sizeof a.x); }
  static V fma(V a, V b, V c) { return each([&](int i) { return std::fma(a.x[i], b.x[i], c.x[i]); }); }
  static V mul(V a, V b) { return each([&](int i) { return a.x[i] * b.x[i]; }); }
  static V add(V a, V b) { return each([&](int i) { return a.x[i] + b.x[i]; }); }
  static V sub(V a, V b) { return each([&](int i) { return a.x[i] - b.x[i]; }); }
  static V max(V a, V b) { return each([&](int i) { return a.x[i] > b.x[i] ? a.x[i] : b.x[i]; }); }
  static V load_partial(const float* p, int n, float fill) { return each([=](int i) { return i < n ? p[i] : fill; }); }
  static void store_partial(float* p, int n, V a) { std::memcpy(p, a.x, sizeof(float) * n); }
  static V keep_first(V a, int n) { return each([&](int i) { return i < n ? a.x[i] : 0.0f; }); }
  static float reduce_add(V a) {
    float s = 0.0f;
    for (int i = 0; i < N; ++i) s += a.x[i];
    return s;
  }
  static float reduce_max(V a) {
    float m = a.x[0];
    for (int i = 1; i < N; ++i) m = a.x[i] > m ? a.x[i] : m;
    return m;
  }
  static V exp2_nonpos(V a) { return each([&](int i) { return isa::exp2_nonpos(a.x[i]); }); }
  static V load_f16(const uint16_t* p) { return each([p](int i) { return half_bits_to_float(p[i]); }); }
};
using F1 = Portable<1>;

// bf16 bits as float32 (a bf16 is the top half of a float32)
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// a type the build does not have: its kernels' branches are not compiled (if constexpr (X::real))
struct Absent {
  static constexpr bool real = false;
};

// the stand-ins
struct PortableB32 {
  struct V {
    uint16_t h[32];
  };
  static V load(const uint16_t* p) {
    V r;
    std::memcpy(r.h, p, sizeof r.h);
    return r;
  }
  static V pair(const uint16_t* p) {
    V r;
    for (int i = 0; i < 32; ++i) r.h[i] = p[i % 2];
    return r;
  }
};
template <class Acc>
inline Acc portable_dpbf16(Acc acc, PortableB32::V a, PortableB32::V b) {
  float lanes[16];
  std::memcpy(lanes, &acc, sizeof lanes);
  for (int j = 0; j < 16; ++j) {
    lanes[j] = std::fma(bf16_to_float(a.h[2 * j + 1]), bf16_to_float(b.h[2 * j + 1]), lanes[j]);
    lanes[j] = std::fma(bf16_to_float(a.h[2 * j]), bf16_to_float(b.h[2 * j]), lanes[j]);
  }
  std::memcpy(&acc, lanes, sizeof lanes);
  return acc;
}
inline uint16_t float_to_bf16(float f) {  // to nearest even, NaN quiet
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
inline void portable_interleave16(const uint16_t* r0, const uint16_t* r1, uint16_t* dst) {
  for (int j = 0; j < 16; ++j) dst[2 * j] = r0[j], dst[2 * j + 1] = r1[j];
}
inline void portable_transpose_pairs8x8(const uint16_t* x, int64_t ld, uint16_t* dst, int64_t dst_ld) {
  for (int j = 0; j < 8; ++j)
    for (int p = 0; p < 8; ++p) std::memcpy(dst + p * dst_ld + 2 * j, x + j * ld + 2 * p, 4);
}

}  // namespace isa
