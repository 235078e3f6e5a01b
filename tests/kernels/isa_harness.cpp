// The AVX-512 instructions the native kernels use, one at a time over records read from stdin, for
// tests/kernels/test_real_instructions.py. Built twice from this one source: without AVX-512 flags
// it runs avx512_emulated.h's functions (the names below are its macros), with -mavx512f
// -mavx512bf16 -mavx512vl -mavx512vnni the CPU's own instructions. Records (little-endian):
//   dpbf16:   src 16 x u32, a 32 x u16, b 32 x u16  ->  16 x u32   (_mm512_dpbf16_ps)
//   dpbf16y:  src 8 x u32, a 16 x u16, b 16 x u16   ->  8 x u32    (_mm256_dpbf16_ps)
//   cvtne2ps: a 16 x u32, b 16 x u32                ->  32 x u16   (_mm512_cvtne2ps_pbh)
//   dpwssd:   src 8 x i32, a 16 x i16, b 16 x i16   ->  8 x i32    (_mm256_dpwssd_epi32)
#include <immintrin.h>

#include "isa/avx512_emulated.h"

#include <cstdio>
#include <cstring>
#include <string>

static bool read(void* p, size_t n) { return std::fread(p, 1, n, stdin) == n; }
static void write(const void* p, size_t n) { std::fwrite(p, 1, n, stdout); }

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string op = argv[1];
  unsigned char in[192];
  if (op == "dpbf16") {
    while (read(in, 64 + 64 + 64)) {
      __m512 src;
      __m512bh a, b;
      std::memcpy(&src, in, 64), std::memcpy(&a, in + 64, 64), std::memcpy(&b, in + 128, 64);
      const __m512 r = _mm512_dpbf16_ps(src, a, b);
      write(&r, 64);
    }
  } else if (op == "dpbf16y") {
    while (read(in, 32 + 32 + 32)) {
      __m256 src;
      __m256bh a, b;
      std::memcpy(&src, in, 32), std::memcpy(&a, in + 32, 32), std::memcpy(&b, in + 64, 32);
      const __m256 r = _mm256_dpbf16_ps(src, a, b);
      write(&r, 32);
    }
  } else if (op == "cvtne2ps") {
    while (read(in, 64 + 64)) {
      __m512 a, b;
      std::memcpy(&a, in, 64), std::memcpy(&b, in + 64, 64);
      const __m512bh r = _mm512_cvtne2ps_pbh(a, b);
      write(&r, 64);
    }
  } else if (op == "dpwssd") {
    while (read(in, 32 + 32 + 32)) {
      __m256i src, a, b;
      std::memcpy(&src, in, 32), std::memcpy(&a, in + 32, 32), std::memcpy(&b, in + 64, 32);
      const __m256i r = _mm256_dpwssd_epi32(src, a, b);
      write(&r, 32);
    }
  } else {
    return 2;
  }
  return 0;
}
