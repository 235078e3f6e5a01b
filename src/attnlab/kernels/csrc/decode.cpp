// attnlab's native decode kernel: a few query rows against a long KV cache (flash-decoding).
//
// Why a third kernel: flash.cpp gives each query head of a GQA group its own task, so at decode
// (L = 1) every K/V head is read r times, and it splits work by query block, so one query row is
// one task on one thread however long the cache is. Decoding is bound by reading K and V once:
//
//   * one task per (key/value head nb, chunk of keys c): the r query heads of the group and
//     their L query rows are the n = r * L rows of one score tile, so K/V rows are read once;
//   * the keys are split into chunks across threads (flash-decoding, Dao et al. 2023); each task
//     leaves a partial (o_c, lse_c) over its chunk, and merge_rows (kernels.h: the log-sum-exp
//     merge the ring uses in Python) joins the chunks exactly;
//   * bf16/fp16 K/V are read as they are stored: each (bk, E) block is widened to float32 in the
//     thread's scratch (it stays in L1/L2) right before its GEMM; the cache is never copied;
//   * K/V come from a dense (Nb, S, E) view, or from pages (a block table into a pool laid out
//     as vLLM's: (num_pages, page_size, Hkv, E)): a block never crosses a page, so both are
//     strided matrices for the GEMM and nothing is gathered.
//
// The online softmax per row is flash.cpp's (m_i, l_i, acc in base 2; row_pass from kernels.h).
//
//     q4      (Nb, r, L, E) float32, contiguous (row a = h * L + i)
//     k, v    dense: (Nb, S, E) / (Nb, S, Ev) views;  paged: (P, page, Hkv, E) / (P, page, Hkv, Ev)
//     table   paged only: (B, max_pages) int64, logical page -> pool page (Nb = B * Hkv)
//     seqlens optional (B,) int64: keys of batch b (default S), as flash_attn_with_kvcache's
//     causal  0: none; 1: top-left (SDPA's is_causal: row i sees keys 0..i);
//             2: bottom-right (row i sees keys 0..S_b - L + i: new tokens after the cache)
// Returns out (Nb, r, L, Ev) float32, lse2 (Nb, r, L) (base 2; -inf where a row saw no key) and a
// bool scalar: true when some score was NaN or inf (the result is then not to be used).
// There is no backward: decoding runs without gradients (attnlab.decoding refuses them).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"

#include <atomic>
#include <optional>
#include <vector>

namespace {

// Where key (or value) row j of head nb lives, and how many rows follow it with one stride.
struct RowSource {
  const char* base = nullptr;
  int64_t elem = 4;              // bytes per element
  at::ScalarType dtype = at::kFloat;
  int64_t s_head = 0, s_row = 0; // dense: head and row strides (elements); paged: head within a page, row
  const int64_t* table = nullptr;
  int64_t table_s0 = 0, page = 0, s_page = 0, Hkv = 1;

  // element offset of row j of head nb, and the rows from j on that share its stride
  int64_t locate(int64_t nb, int64_t j, int64_t* run) const {
    if (table == nullptr) {
      *run = std::numeric_limits<int64_t>::max();
      return nb * s_head + j * s_row;
    }
    const int64_t b = nb / Hkv, g = nb % Hkv;
    const int64_t p = table[b * table_s0 + j / page];
    *run = page - j % page;
    return p * s_page + (j % page) * s_row + g * s_head;
  }

  // n rows of width w starting at row j of head nb, as float32: in place when stored as float32
  // (ld = the row stride), else widened into buf (ld = w)
  const float* rows(int64_t nb, int64_t j, int n, int64_t w, float* buf, int64_t* ld) const {
    int64_t run;
    const int64_t off = locate(nb, j, &run);
    if (dtype == at::kFloat) {
      *ld = n > 1 ? s_row : w;
      return reinterpret_cast<const float*>(base) + off;
    }
    *ld = w;
    const uint16_t* src = reinterpret_cast<const uint16_t*>(base) + off;
    for (int a = 0; a < n; ++a) {
      const uint16_t* in = src + a * s_row;
      float* out = buf + a * w;
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
#if defined(__F16C__)
        for (; c + 8 <= w; c += 8)
          _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + c))));
#endif
        for (; c < w; ++c) out[c] = static_cast<float>(c10::Half(in[c], c10::Half::from_bits()));
      }
    }
    return buf;
  }
};

RowSource make_source(const at::Tensor& t, bool paged, int64_t page, const at::Tensor* table, int64_t Hkv,
                      const char* name) {
  RowSource s;
  s.dtype = t.scalar_type();
  TORCH_CHECK(s.dtype == at::kFloat || s.dtype == at::kBFloat16 || s.dtype == at::kHalf,
              "attnlab native decode: ", name, " must be float32, bfloat16 or float16");
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
    s.page = page, s.Hkv = Hkv;
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_forward(const at::Tensor& q4, const at::Tensor& k, const at::Tensor& v,
                                                  const std::optional<at::Tensor>& table,
                                                  const std::optional<at::Tensor>& seqlens, int64_t Hkv, int64_t S,
                                                  double scale2_d, int64_t causal, int64_t chunk, int64_t block_k) {
  TORCH_CHECK(q4.dim() == 4 && q4.scalar_type() == at::kFloat && q4.is_contiguous() && q4.device().is_cpu(),
              "attnlab native decode: q4 must be a contiguous float32 (Nb, r, L, E) CPU tensor");
  TORCH_CHECK(causal >= 0 && causal <= 2, "attnlab native decode: causal must be 0, 1 or 2");
  const bool paged = table.has_value() && table->defined();
  const int64_t Nb = q4.size(0), r = q4.size(1), L = q4.size(2), E = q4.size(3);
  const int64_t Ev = v.size(-1);
  TORCH_CHECK(k.size(-1) == E && k.scalar_type() == v.scalar_type(), "attnlab native decode: k and v");
  TORCH_CHECK(Hkv >= 1 && Nb % Hkv == 0, "attnlab native decode: Nb must be a multiple of Hkv");
  const int64_t B = Nb / Hkv;
  int64_t page = 0;
  if (paged) {
    TORCH_CHECK(table->scalar_type() == at::kLong && table->dim() == 2 && table->size(0) == B,
                "attnlab native decode: table must be (B, max_pages) int64");
    page = k.size(1);
    TORCH_CHECK(table->size(1) * page >= S, "attnlab native decode: the table covers fewer than S keys");
  } else {
    TORCH_CHECK(k.size(0) == Nb && v.size(0) == Nb && k.size(1) >= S && v.size(1) >= S,
                "attnlab native decode: dense k, v must be (Nb, >= S, E)");
  }
  const int64_t* lengths = nullptr;
  if (seqlens.has_value() && seqlens->defined()) {
    TORCH_CHECK(seqlens->scalar_type() == at::kLong && seqlens->is_contiguous() && seqlens->numel() == B,
                "attnlab native decode: seqlens must be (B,) int64");
    lengths = seqlens->data_ptr<int64_t>();
  }
  const RowSource ks = make_source(k, paged, page, paged ? &*table : nullptr, Hkv, "k");
  const RowSource vs = make_source(v, paged, page, paged ? &*table : nullptr, Hkv, "v");

  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::Tensor out = at::zeros({Nb, r, L, Ev}, q4.options());
  at::Tensor lse2 = at::full({Nb, r, L}, neg_inf, q4.options());
  const int64_t n = r * L;  // rows of one task's tile
  if (Nb == 0 || n == 0 || S == 0 || Ev == 0) {
    return {out, lse2, at::scalar_tensor(false, at::TensorOptions().dtype(at::kBool))};
  }
  TORCH_CHECK(chunk >= 1 && block_k >= 1, "attnlab native decode: chunk and block_k must be positive");
  const int64_t n_chunks = (S + chunk - 1) / chunk;
  const int bk = static_cast<int>(std::min<int64_t>(block_k, chunk));
  // the partial results of every chunk, merged below: (Nb, n_chunks, n, Ev) and (Nb, n_chunks, n)
  std::vector<float> part_o(static_cast<size_t>(Nb * n_chunks * n * Ev));
  std::vector<float> part_l(static_cast<size_t>(Nb * n_chunks * n));
  const float scale2 = static_cast<float>(scale2_d);
  const float* q = q4.data_ptr<float>();

  // per-thread scratch: scores (n, bk), acc (n, Ev), m_i, l_i (n), a widened K and V block
  const int64_t per_thread = n * bk + n * Ev + 2 * n + static_cast<int64_t>(bk) * (E + Ev);
  std::vector<float> scratch(static_cast<size_t>(per_thread * at::get_num_threads()));
  std::atomic<bool> saw_nonfinite{false};
  at::parallel_for(0, Nb * n_chunks, 1, [&](int64_t begin, int64_t end) {
    float* s = scratch.data() + per_thread * at::get_thread_num();
    float* acc = s + n * bk;
    float* m_i = acc + n * Ev;
    float* l_i = m_i + n;
    float* kbuf = l_i + n;
    float* vbuf = kbuf + static_cast<int64_t>(bk) * E;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t nb = task / n_chunks, c = task % n_chunks;
      const int64_t S_b = lengths ? std::min<int64_t>(lengths[nb / Hkv], S) : S;
      // row a = h * L + i sees keys [0, limit(i)): every key, or up to its causal diagonal
      const int64_t shift = causal == 2 ? S_b - L : 0;
      const int64_t j_begin = c * chunk;
      const int64_t j_stop = std::min<int64_t>(S_b, causal ? std::max<int64_t>(0, shift + L) : S_b);
      const int64_t j_end = std::min<int64_t>(j_begin + chunk, j_stop);
      std::fill(m_i, m_i + n, neg_inf);
      std::fill(l_i, l_i + n, 0.0f);
      std::fill(acc, acc + n * Ev, 0.0f);
      for (int64_t j0 = j_begin; j0 < j_end;) {
        int64_t run;
        ks.locate(nb, j0, &run);
        const int nk = static_cast<int>(std::min<int64_t>({static_cast<int64_t>(bk), j_end - j0, run}));
        int64_t k_ld, v_ld;
        const float* k_rows = ks.rows(nb, j0, nk, E, kbuf, &k_ld);
        // S_ij = scale2 * Q K_j^T   (n, nk): the group's heads and rows against one key block
        gemm_rm(false, true, static_cast<int>(n), nk, static_cast<int>(E), scale2, q + nb * n * E,
                static_cast<int>(E), k_rows, static_cast<int>(k_ld), 0.0f, s, nk);
        // a NaN or inf score (from Q or K) would be swallowed by the row pass (its max and 2^x
        // drop NaN): flag it, so the caller redoes the call on the pure path; V's show in the output
        if (!all_finite(s, n * nk)) saw_nonfinite.store(true, std::memory_order_relaxed);
        online_update(s, n, nk, [&](int64_t a, float*) {  // row a = h * L + i: query position i
          const int64_t visible = causal ? shift + a % L + 1 - j0 : nk;
          return static_cast<int>(std::clamp<int64_t>(visible, 0, nk));
        }, m_i, l_i, acc, Ev);
        const float* v_rows = vs.rows(nb, j0, nk, Ev, vbuf, &v_ld);
        // acc += P~ V_j   (n, Ev)
        gemm_rm(false, false, static_cast<int>(n), static_cast<int>(Ev), nk, 1.0f, s, nk, v_rows,
                static_cast<int>(v_ld), 1.0f, acc, static_cast<int>(Ev));
        j0 += nk;
      }
      float* po = part_o.data() + (nb * n_chunks + c) * n * Ev;
      float* pl = part_l.data() + (nb * n_chunks + c) * n;
      finish_rows(acc, m_i, l_i, n, Ev, po, Ev, pl, 1);
    }
  });
  // join the chunks: (o_c, lse_c) over disjoint keys -> (out, lse2), exactly
  float* o = out.data_ptr<float>();
  float* l = lse2.data_ptr<float>();
  at::parallel_for(0, Nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      merge_rows(part_o.data() + nb * n_chunks * n * Ev, part_l.data() + nb * n_chunks * n, n_chunks, n, Ev,
                 o + nb * n * Ev, l + nb * n);
    }
  });
  return {out, lse2, at::scalar_tensor(saw_nonfinite.load(), at::TensorOptions().dtype(at::kBool))};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab_native, m) {
  m.def("decode_forward(Tensor q4, Tensor k, Tensor v, Tensor? table, Tensor? seqlens, int Hkv, int S, float scale2, int causal, int chunk, int block_k) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("decode_forward", &decode_forward);
}
