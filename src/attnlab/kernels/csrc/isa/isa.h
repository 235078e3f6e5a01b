// The native kernels' one instruction-set seam (issue 49 item 2). Intrinsics and the build's
// instruction-set #ifs live only in this folder; the kernels (kernels.h's row pass, sgemm.h's
// micro-kernel, bf16_gemm.h's, and the decode kernel's dot products and value tiles in
// decode_dots.h, decode_bf16.h, decode.cpp, decode_sources.h) are written once over its types:
//
//   isa::F16   16 float32 lanes: AVX-512 (avx512.h; the avx512-emulated build: avx512_emulated.h)
//   isa::F8     8 float32 lanes: AVX2 + FMA (avx2.h)
//   isa::F1     one float32: portable (portable.h), the tails and builds without vector units
//   isa::Wide  the widest of them this build has
//   isa::B32   32 bf16 for vdpbf16ps (AVX512_BF16), with isa::dpbf16 and isa::to_bf16_x32
//   isa::B16   16 bf16 for 256-bit vdpbf16ps (AVX512_BF16 with VL): the decode kernel's
//   isa::F4, isa::I16  4 floats (a row's four scores) and 16 int16 (int8 dot products, AVX2;
//              vpdpwssd where AVX512_VNNI with VL: kVnni)
//   isa::I32   16 int32 lanes of int16 pairs (AVX512BW; vpdpwssd with AVX512_VNNI): kI32
//   isa::interleave16, isa::transpose_pairs8x8: the bf16 GEMM's packing shuffles (AVX2)
//
// Each float type has the same static functions (zero, set1, load, bcast, store, fma, mul, add,
// sub, max, load_partial, store_partial, keep_first, reduce_add, reduce_max, exp2_nonpos; F16 and
// F8 also the decode kernel's widening loads, keep, sum4; F8 join_lo/hi). What a build lacks is a portable
// stand-in (portable.h) whose flag here is false (kF8, kF16, kBf16, kShuffles16, kBf16x8), or
// isa::Absent (real = false) where only a kernel templated on the type uses it, under
// `if constexpr (X::real)`: a kernel asks the flag, never the compiler's macros.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(ATTNLAB_EMULATE_AVX512)  // the avx512-emulated test build (attnlab.kernels.native)
#include "avx512_emulated.h"
#endif

#include <type_traits>

#include "portable.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "avx2.h"
#endif
#if defined(__AVX512F__)
#include "avx512.h"
#endif

namespace isa {

#if !(defined(__AVX2__) && defined(__FMA__))
using F8 = Portable<8>;
using F4 = Portable<4>;
using I16 = Absent;
constexpr bool kF8 = false;
constexpr bool kVnni = false;
constexpr bool kF16c = false;
inline void interleave16(const uint16_t* r0, const uint16_t* r1, uint16_t* dst) { portable_interleave16(r0, r1, dst); }
inline void transpose_pairs8x8(const uint16_t* x, int64_t ld, uint16_t* dst, int64_t dst_ld) {
  portable_transpose_pairs8x8(x, ld, dst, dst_ld);
}
constexpr bool kShuffles16 = false;
#endif
#if !defined(__AVX512F__)
using F16 = Portable<16>;
constexpr bool kF16 = false;
#endif
#if !(defined(__AVX512BW__) || defined(ATTNLAB_AVX512F_EMULATED))
using I32 = Absent;
constexpr bool kI32 = false;  // the int8 decode lane kernel's 512-bit integer pairs
#endif
#if !defined(__AVX512BF16__)
using B32 = PortableB32;
template <class Acc>
inline Acc dpbf16(Acc acc, B32::V a, B32::V b) { return portable_dpbf16(acc, a, b); }
inline void to_bf16_x32(const float* src, uint16_t* dst) {
  for (int i = 0; i < 32; ++i) dst[i] = float_to_bf16(src[i]);
}
constexpr bool kBf16 = false;
#endif

#if !(defined(__AVX512BF16__) && (defined(__AVX512VL__) || defined(ATTNLAB_EMULATE_AVX512)))
using B16 = Absent;
#endif
constexpr bool kBf16x8 = B16::real;  // the decode kernel's 256-bit vdpbf16ps

// the widest float32 vector of this build: the row pass's
using Wide = std::conditional_t<kF16, F16, std::conditional_t<kF8, F8, F1>>;
// the decode kernel's streaming loop's (its widening loads, keep, sum4): F16 where the build has
// AVX-512, else F8 (Portable<8>, real = false, without vector units)
using Stream = std::conditional_t<kF16, F16, F8>;

}  // namespace isa
