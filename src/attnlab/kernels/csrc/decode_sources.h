// attnlab's decode kernel (decode.cpp), its tile sources: where a key block's K and V rows (and an
// int8 cache's scales) are, in a dense (Nb, S, E) view or in vLLM-style pages through a block
// table, and the divisions that locate them. Included by decode.cpp only (one translation unit).
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

// x / d and x % d (x >= 0) for a divisor fixed per call: a shift and a mask when d is a power of two
// (16-token pages, Hkv = 8), else the division. Paged decoding locates every (page, head) block's
// rows up to four times (keys, values, an int8 cache's scales), each with two divisions by runtime
// values. Paged against contiguous at 4 rows a head (q (1, 32, 1, 128), one thread, CPU time, 2-core
// AVX2 EPYC (Zen 3), 2026-12-03, old and new builds alternated, three rounds): at S = 4096 (the
// cache in L3) bf16 1.18-1.25x -> 1.13-1.15x, int8 1.21-1.28x -> 1.18-1.23x; at S = 32768 within
// this VM's noise.
struct Divisor {
  int64_t d = 1;
  int shift = 0;
  Divisor() = default;
  explicit Divisor(int64_t d_) : d(d_), shift(d_ > 0 && (d_ & (d_ - 1)) == 0 ? __builtin_ctzll(d_) : -1) {}
  int64_t div(int64_t x) const { return shift >= 0 ? x >> shift : x / d; }
  int64_t mod(int64_t x) const { return shift >= 0 ? x & (d - 1) : x % d; }
};

// Where key (or value) row j of head nb lives, and how many rows follow it with one stride.
struct RowSource {
  const char* base = nullptr;
  int64_t elem = 4;              // bytes per element
  at::ScalarType dtype = at::kFloat;
  int64_t s_head = 0, s_row = 0; // dense: head and row strides (elements); paged: head within a page, row
  const int64_t* table = nullptr;
  int64_t table_s0 = 0, s_page = 0;
  Divisor by_page, by_head;  // paged: the page size and Hkv

  // element offset of row j of head nb, and the rows from j on that share its stride
  int64_t locate(int64_t nb, int64_t j, int64_t* run) const {
    if (table == nullptr) {
      *run = std::numeric_limits<int64_t>::max();
      return nb * s_head + j * s_row;
    }
    const int64_t b = by_head.div(nb), g = by_head.mod(nb), i = by_page.mod(j);
    const int64_t p = table[b * table_s0 + by_page.div(j)];
    *run = by_page.d - i;
    return p * s_page + i * s_row + g * s_head;
  }

  // n rows of width w starting at row j of head nb, as float32: in place when stored as float32
  // and the rows share one stride (ld = the row stride), else copied into buf (ld = w): widened,
  // and gathered page by page when they cross pages (the GEMM loop's blocks do: a block of 16
  // keys per page made its GEMMs too small; paged fp32 at Lq = 64 took 1.41x the contiguous time)
  // An int8 cache's rows come out dequantised: scale[a] * row (scale: the rows' scales, read
  // page by page by the caller's `scales(j, m, out)`).
  template <class Scales>
  const float* rows(int64_t nb, int64_t j, int n, int64_t w, float* buf, int64_t* ld, const Scales& scales,
                    float* scale_buf) const {
    int64_t run;
    const int64_t off = locate(nb, j, &run);
    if (dtype == at::kFloat && n <= run) {
      *ld = n > 1 ? s_row : w;
      return reinterpret_cast<const float*>(base) + off;
    }
    *ld = w;
    for (int done = 0; done < n;) {
      const int64_t at_off = locate(nb, j + done, &run);
      const int m = static_cast<int>(std::min<int64_t>(run, n - done));
      if (dtype == at::kChar) scales(j + done, m, scale_buf);
      widen_rows(at_off, m, w, buf + static_cast<int64_t>(done) * w, scale_buf);
      done += m;
    }
    return buf;
  }

  // m rows of width w from element offset off (one stride), as float32 into out (m, w); int8
  // rows times their scales row_scale[0 .. m)
  void widen_rows(int64_t off, int m, int64_t w, float* out_rows, const float* row_scale) const {
    if (dtype == at::kChar) {
      const int8_t* src = reinterpret_cast<const int8_t*>(base) + off;
      for (int a = 0; a < m; ++a) {
        const int8_t* in = src + a * s_row;
        float* out = out_rows + a * w;
        const float f = row_scale[a];
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) out[c] = f * static_cast<float>(in[c]);
      }
      return;
    }
    if (dtype == at::kFloat) {
      const float* src = reinterpret_cast<const float*>(base) + off;
      for (int a = 0; a < m; ++a) std::memcpy(out_rows + a * w, src + a * s_row, static_cast<size_t>(w) * 4);
      return;
    }
    const uint16_t* src = reinterpret_cast<const uint16_t*>(base) + off;
    for (int a = 0; a < m; ++a) {
      const uint16_t* in = src + a * s_row;
      float* out = out_rows + a * w;
      if (dtype == at::kBFloat16) {  // bf16 is the top half of a float32: a shift widens it exactly
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) {
          const uint32_t bits = static_cast<uint32_t>(in[c]) << 16;
          float f;
          std::memcpy(&f, &bits, 4);
          out[c] = f;
        }
      } else {
        int64_t c = 0;
        if constexpr (isa::kF16c)  // 8 at a time (vcvtph2ps)
          for (; c + 8 <= w; c += 8) isa::F8::store(out + c, isa::F8::load_f16(in + c));
        for (; c < w; ++c) out[c] = static_cast<float>(c10::Half(in[c], c10::Half::from_bits()));
      }
    }
  }
};

// A float32 scale per cached row (int8 caches): dense (Nb, S) or paged (P, page, Hkv), the same
// rows as the cache's; where a row's scale lives follows its RowSource's locate.
struct ScaleSource {
  const float* base = nullptr;
  int64_t s_head = 0, s_row = 0, s_page = 0;  // dense: (Nb, S) strides; paged: page, row, head strides
  bool paged = false;
  // the scale of rows j .. j + n - 1 of head nb (one stride: within a page), into out
  void read(const RowSource& src, int64_t nb, int64_t j, int n, float* out) const {
    if (!paged) {
      const float* p = base + nb * s_head + j * s_row;
      for (int a = 0; a < n; ++a) out[a] = p[a * s_row];
      return;
    }
    const int64_t b = src.by_head.div(nb), g = src.by_head.mod(nb);
    const int64_t pg = src.table[b * src.table_s0 + src.by_page.div(j)];
    const float* p = base + pg * s_page + src.by_page.mod(j) * s_row + g * s_head;
    for (int a = 0; a < n; ++a) out[a] = p[a * s_row];
  }
};

ScaleSource make_scales(const at::Tensor& t, bool paged, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), "attnlab native decode: ", name,
              " must be a float32 CPU tensor");
  ScaleSource s;
  s.base = t.data_ptr<float>();
  s.paged = paged;
  if (paged) {
    TORCH_CHECK(t.dim() == 3, "attnlab native decode: paged ", name, " must be (num_pages, page_size, Hkv)");
    s.s_page = t.stride(0), s.s_row = t.stride(1), s.s_head = t.stride(2);
  } else {
    TORCH_CHECK(t.dim() == 2, "attnlab native decode: ", name, " must be (Nb, S)");
    s.s_head = t.stride(0), s.s_row = t.stride(1);
  }
  return s;
}

RowSource make_source(const at::Tensor& t, bool paged, int64_t page, const at::Tensor* table, int64_t Hkv,
                      const char* name) {
  RowSource s;
  s.dtype = t.scalar_type();
  TORCH_CHECK(s.dtype == at::kFloat || s.dtype == at::kBFloat16 || s.dtype == at::kHalf || s.dtype == at::kChar,
              "attnlab native decode: ", name, " must be float32, bfloat16, float16 or int8");
  TORCH_CHECK(t.device().is_cpu() && (t.stride(-1) == 1 || t.size(-1) == 1),
              "attnlab native decode: ", name, " must be on the CPU with a dense last dim");
  s.base = static_cast<const char*>(t.data_ptr());
  s.elem = t.element_size();
  if (paged) {
    TORCH_CHECK(t.dim() == 4 && t.size(1) == page && t.size(2) == Hkv, "attnlab native decode: ", name,
                " pages must be (num_pages, page_size, Hkv, E)");
    s.s_page = t.stride(0), s.s_row = t.stride(1), s.s_head = t.stride(2);
    s.table = table->data_ptr<int64_t>();
    s.table_s0 = table->stride(0);
    s.by_page = Divisor(page), s.by_head = Divisor(Hkv);
  } else {
    TORCH_CHECK(t.dim() == 3, "attnlab native decode: ", name, " must be (Nb, S, E)");
    s.s_head = t.stride(0), s.s_row = t.size(1) > 1 ? t.stride(1) : t.size(2);
  }
  return s;
}

// no NaN or inf among x[0 .. count): the exponent bits are not all ones (vectorises, unlike isfinite)
inline bool all_finite(const float* x, int64_t count) {
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t c = 0; c < count; ++c) {
    uint32_t bits;
    std::memcpy(&bits, x + c, 4);
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

}  // namespace
