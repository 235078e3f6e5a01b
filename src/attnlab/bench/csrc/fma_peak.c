/* The CPU's float32 FMA peak, for `attnlab bench --gemm`: independent chains of vector FMAs
 * (zmm where the build has AVX-512, else ymm), more of them (12) than the FMA latency times the
 * number of FMA pipes (4 cycles x 2 pipes on Zen: 8 chains saturate them), each started from
 * its own value so that the compiler cannot merge them (identical chains were merged into one
 * in a first try, which reported 154 GFLOP/s where the pipes give 103). Returns GFLOP/s of one
 * thread. Built with the machine's cc by attnlab.bench.machine, loaded with ctypes. */
#include <immintrin.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

#if defined(__AVX512F__)
#define VEC __m512
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define FIRST(x) _mm512_cvtss_f32(x)
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC __m256
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define FIRST(x) _mm256_cvtss_f32(x)
#endif

#define CHAINS 12 /* with the two constants, 14 of AVX2's 16 ymm */

double fma_gflops(long iters, float* sink) {
#ifdef VEC
  VEC a[CHAINS];
  for (int i = 0; i < CHAINS; ++i) a[i] = SET1(1.0f + 0.001f * i);
  const VEC x = SET1(0.999999f), y = SET1(1e-7f);
  const double t0 = now();
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) a[i] = FMA(a[i], x, y);
  }
  const double t1 = now();
  VEC s = a[0];
  for (int i = 1; i < CHAINS; ++i) s = ADD(s, a[i]);
  *sink = FIRST(s);
  return (double)iters * CHAINS * LANES * 2 / (t1 - t0) / 1e9;
#else
  (void)iters;
  *sink = 0;
  return 0.0;
#endif
}

int fma_lanes(void) {
#ifdef VEC
  return LANES;
#else
  return 0;
#endif
}

/* The bf16 dot-product peak where the CPU has AVX512_BF16 (`attnlab bench --bf16`): independent
 * chains of 512-bit vdpbf16ps, each 32 products and 32 sums a lane pair (64 flops an instruction).
 * 16 chains: more than its latency (6 cycles on Zen 4) times its issue rate (one 512-bit
 * instruction a cycle on Zen 4, two on Zen 5). 0 where the build lacks AVX512_BF16. */
double bf16_gflops(long iters, float* sink) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_ps(0.001f * i);
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80); /* 1.0 in bf16 */
  const __m512bh y = (__m512bh)_mm512_set1_epi16(0x3a83); /* 0.001 in bf16 */
  const double t0 = now();
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
  }
  const double t1 = now();
  __m512 s = a[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, a[i]);
  *sink = _mm512_cvtss_f32(s);
  return (double)iters * 16 * 16 * 4 / (t1 - t0) / 1e9;
#else
  (void)iters;
  *sink = 0;
  return 0.0;
#endif
}
