// Shared pieces of attnlab's native kernels (flash.cpp: dense and masked tiles;
// block_sparse.cpp: the block masks of attnlab.flex; decode.cpp: a few rows against a KV cache):
// the row-major GEMM through BLAS, the vectorised 2^x, the online-softmax row pass, its end
// (finish_rows), the log-sum-exp merge (merge_rows) and the tile backward. Each kernel file includes it; everything
// here is inline, in an unnamed namespace, so each translation unit has its own copy.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include "isa/isa.h"  // the one instruction-set seam: every intrinsic and ISA #if of the kernels below
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>
#include <type_traits>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

// log2(e): scores are kept in base 2 (exp2 is cheaper than exp), with this folded into the
// query scale; the one copy in C++ (attnlab.kernels.numerics.LOG2E is Python's)
constexpr float kLog2e = 1.4426950408889634f;

// Row-major C (m x n, ldc) = alpha * op(A) (m x k) * op(B) (k x n) + beta * C, through
// column-major sgemm: a row-major matrix is the column-major transpose, so C^T = op(B)^T op(A)^T.
inline void gemm_rm(bool a_transposed, bool b_transposed, int m, int n, int k, float alpha, const float* a, int lda,
             const float* b, int ldb, float beta, float* c, int ldc) {
  const char tb = b_transposed ? 'T' : 'N';
  const char ta = a_transposed ? 'T' : 'N';
  sgemm_(&tb, &ta, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

}  // namespace

#include "sgemm.h"
#include "bf16_gemm.h"

namespace {

// The GEMM of one operand type, so that a kernel is written once for both routes:
//   Gemm32:   float32 operands through sgemm (sgemm.h: BLAS or attnlab's micro-kernel; the float32 route);
//   GemmBf16: bf16 operands through gemm_bf16 (bf16_gemm.h), float32 results (the bf16 route).
// operand(x, count, buf) gives a float32 tile (P, dS) in the operand type: itself, or rounded
// to bf16 into buf, as torch's kernel rounds them before their GEMMs.
struct Gemm32 {
  using T = float;
  int64_t route;  // SgemmRoute (sgemm.h): BLAS or attnlab's micro-kernel of one ISA
  void operator()(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
                  float beta, float* c, int ldc) const {
    sgemm(route, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  const float* operand(const float* x, int64_t, float*) const { return x; }
  // operand() one row at a time (online_update's done), and the rows it made
  void row_operand(const float*, int64_t, float*) const {}
  const float* rows_operand(const float* x, const float*) const { return x; }
  // The forward's S = alpha A B^T (beta = 0), with its rows' maxima (m x kRowMaxLanes, set to -inf
  // by the caller) found on the way where the route can: returns whether it did (sgemm.h).
  bool scores(int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb, float* c, int ldc,
              float* rmax) const {
    return sgemm(route, false, true, m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc, rmax);
  }
};

struct GemmBf16 {
  using T = uint16_t;
  bool units;  // the CPU's bf16 instructions, or widened to float32 (bf16_gemm.h)
  void operator()(bool ta, bool tb, int m, int n, int k, float alpha, const uint16_t* a, int lda, const uint16_t* b,
                  int ldb, float beta, float* c, int ldc) const {
    gemm_bf16(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, units);
  }
  const uint16_t* operand(const float* x, int64_t count, uint16_t* buf) const {
    round_to_bf16(x, count, buf);
    return buf;
  }
  void row_operand(const float* row, int64_t count, uint16_t* buf_row) const { round_to_bf16(row, count, buf_row); }
  const uint16_t* rows_operand(const float*, const uint16_t* buf) const { return buf; }
  bool scores(int m, int n, int k, float alpha, const uint16_t* a, int lda, const uint16_t* b, int ldb, float* c,
              int ldc, float*) const {
    (*this)(false, true, m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc);
    return false;
  }
};

using isa::exp2_nonpos;  // 2^x for x <= 0, one float (isa/portable.h)

// The row pass, written once over the build's widest vector (isa::Wide: 16 lanes on AVX-512, 8 on
// AVX2, 1 portable), each ISA's 2^x its own (isa::F16::exp2_nonpos: vroundscaleps and vscalefps;
// F8's: the exponent bits). The last valid % W values take one masked step (AVX-512's masks;
// AVX2 through a buffer).
//
// row_max: max(row[0:valid]) (-inf for valid = 0), on two chains: vmaxps latency would otherwise bind.
template <class X = isa::Wide>
inline float row_max(const float* row, int valid) {
  using V = typename X::V;
  constexpr int W = X::W;
  const int full = valid / W * W, tail = valid - full;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  V mx0 = X::set1(neg_inf), mx1 = mx0;
  int c = 0;
  for (; c + 2 * W <= full; c += 2 * W) {
    mx0 = X::max(mx0, X::load(row + c));
    mx1 = X::max(mx1, X::load(row + c + W));
  }
  for (; c < full; c += W) mx0 = X::max(mx0, X::load(row + c));
  if (tail) mx1 = X::max(mx1, X::load_partial(row + full, tail, neg_inf));
  return X::reduce_max(X::max(mx0, mx1));
}

// row_exp: row[0:valid] = 2^(row - m_new) (m_new finite, at least their max), row[valid:nk] = 0;
// returns the sum of the new values (two chains).
template <class X = isa::Wide>
inline float row_exp(float* row, int valid, int nk, float m_new) {
  using V = typename X::V;
  constexpr int W = X::W;
  const int full = valid / W * W, tail = valid - full;
  const V shift = X::set1(m_new);
  V sum0 = X::zero(), sum1 = X::zero();
  int c = 0;
  for (; c + 2 * W <= full; c += 2 * W) {
    const V p0 = X::exp2_nonpos(X::sub(X::load(row + c), shift));
    const V p1 = X::exp2_nonpos(X::sub(X::load(row + c + W), shift));
    X::store(row + c, p0);
    X::store(row + c + W, p1);
    sum0 = X::add(sum0, p0);
    sum1 = X::add(sum1, p1);
  }
  for (; c < full; c += W) {
    const V p0 = X::exp2_nonpos(X::sub(X::load(row + c), shift));
    X::store(row + c, p0);
    sum0 = X::add(sum0, p0);
  }
  if (tail) {
    const V p0 = X::keep_first(X::exp2_nonpos(X::sub(X::load_partial(row + full, tail, m_new), shift)), tail);
    X::store_partial(row + full, tail, p0);
    sum1 = X::add(sum1, p0);
  }
  for (c = valid; c < nk; ++c) row[c] = 0.0f;
  return X::reduce_add(X::add(sum0, sum1));
}

// row[0:valid] = 2^(row - shift): the backward's P from the saved log-sum-exp
template <class X = isa::Wide>
inline void exp2_shifted(float* row, int valid, float shift) {
  constexpr int W = X::W;
  const int full = valid / W * W;
  const typename X::V sh = X::set1(shift);
  int c = 0;
  for (; c < full; c += W) X::store(row + c, X::exp2_nonpos(X::sub(X::load(row + c), sh)));
  if (c < valid)
    X::store_partial(row + c, valid - c, X::exp2_nonpos(X::sub(X::load_partial(row + c, valid - c, shift), sh)));
}

// One key block into the online-softmax state of n rows (FlashAttention-2's inner step, the
// one place it is written in C++). s (n, nk) holds the block's base-2 scores; visible(a, row)
// returns how many leading keys row a sees (0..nk), after hiding any masked ones in row as
// -inf. Afterwards s holds P~ = 2^(s - m_new) (0 where hidden), and
//     m_new = max(m_i, rowmax),  l_i = 2^(m_i - m_new) l_i + rowsum(P~),  acc = 2^(m_i - m_new) acc;
// the caller adds P~ V_j into acc with one GEMM.
//
// rmax (optional): each row's maximum, as kRowMaxLanes lanes (sgemm's, when every key of the block
// is visible to every row and nothing is masked): the row pass then skips its max sweep.
// done(a, row) is called once row a holds its P~, while it is in L1 (the bf16 route rounds it to
// its GEMM operand there: Gemm::row_operand).
struct NoRowDone {
  void operator()(int64_t, const float*) const {}
};
template <class Visible, class RowDone = NoRowDone>
inline void online_update(float* s, int64_t n, int nk, Visible visible, float* m_i, float* l_i, float* acc, int64_t Ev,
                          const float* rmax = nullptr, const RowDone& done = RowDone()) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // GROUP rows' maxima are found before any of their 2^x: one row's max, its reduction and the
  // broadcast of m_new are a chain the next sweep waits on; over a group the rows' chains overlap.
  // One thread on the Zen 5 (2026-12-05, 256-key rows): 7.9 -> 6.5 cycles per 16 scores in L1,
  // 7.9 -> 7.2 in L2, against 4.8 for the 2^x sweep alone.
  constexpr int64_t GROUP = 8;
  int valid[GROUP];
  float m_new[GROUP];
  for (int64_t a0 = 0; a0 < n; a0 += GROUP) {
    const int64_t g = std::min(GROUP, n - a0);
    for (int64_t a = 0; a < g; ++a) {
      float* row = s + (a0 + a) * nk;
      valid[a] = visible(a0 + a, row);
      const float top = rmax != nullptr ? row_max(rmax + (a0 + a) * kRowMaxLanes, kRowMaxLanes) : row_max(row, valid[a]);
      m_new[a] = valid[a] == 0 ? neg_inf : std::max(m_i[a0 + a], top);
    }
    for (int64_t a = 0; a < g; ++a) {
      float* row = s + (a0 + a) * nk;
      if (valid[a] == 0) {  // nothing to add for this row in this block
        std::fill(row, row + nk, 0.0f);
        done(a0 + a, row);
        continue;
      }
      float row_sum = 0.0f;
      if (m_new[a] == neg_inf) std::fill(row, row + nk, 0.0f);  // every key so far masked: nothing to add
      else row_sum = row_exp(row, valid[a], nk, m_new[a]);
      done(a0 + a, row);
      const float m_old = m_i[a0 + a];
      // alpha = 2^(m_old - m_new) rescales the old state; the first visit (m_old = -inf) gives 0
      const float alpha = m_old == neg_inf ? 0.0f : exp2_nonpos(m_old - m_new[a]);
      l_i[a0 + a] = alpha * l_i[a0 + a] + row_sum;
      m_i[a0 + a] = m_new[a];
      if (alpha != 1.0f) {
        float* acc_row = acc + (a0 + a) * Ev;
#pragma omp simd
        for (int64_t c = 0; c < Ev; ++c) acc_row[c] *= alpha;
      }
    }
  }
}

// The end of the online softmax for n rows: O = acc / l_i (0 where a row saw no key, as SDPA
// gives) and lse2 = m_i + log2(l_i) (-inf there). o rows are o_ld apart, lse entries lse_stride.
inline void finish_rows(const float* acc, const float* m_i, const float* l_i, int64_t n, int64_t Ev, float* o,
                        int64_t o_ld, float* lse, int64_t lse_stride) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t a = 0; a < n; ++a) {
    const float* acc_row = acc + a * Ev;
    float* o_row = o + a * o_ld;
    const float inv = l_i[a] == 0.0f ? 0.0f : 1.0f / l_i[a];
#pragma omp simd
    for (int64_t c = 0; c < Ev; ++c) o_row[c] = acc_row[c] * inv;
    lse[a * lse_stride] = l_i[a] == 0.0f ? neg_inf : m_i[a] + std::log2(l_i[a]);
  }
}

// The log-sum-exp merge (attnlab.kernels.merge_ in Python): parts partial results over disjoint
// keys, part c of row a at o_parts[(c * n + a) * Ev] and lse_parts[c * n + a] (base 2, -inf =
// no key), joined into o (n, Ev) and lse (n,):  M = max_c lse_c,  w_c = 2^(lse_c - M),
// o = sum_c w_c o_c / sum_c w_c,  lse = M + log2(sum_c w_c).
inline void merge_rows(const float* o_parts, const float* lse_parts, int64_t parts, int64_t n, int64_t Ev, float* o,
                       float* lse) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t a = 0; a < n; ++a) {
    float M = neg_inf;
    for (int64_t c = 0; c < parts; ++c) M = std::max(M, lse_parts[c * n + a]);
    float* o_row = o + a * Ev;
    std::fill(o_row, o_row + Ev, 0.0f);
    if (M == neg_inf) {  // no part saw a key
      lse[a] = neg_inf;
      continue;
    }
    float total = 0.0f;
    for (int64_t c = 0; c < parts; ++c) {
      const float l_c = lse_parts[c * n + a];
      if (l_c == neg_inf) continue;
      const float w = exp2_nonpos(l_c - M);
      total += w;
      const float* part = o_parts + (c * n + a) * Ev;
#pragma omp simd
      for (int64_t e = 0; e < Ev; ++e) o_row[e] += w * part[e];
    }
    const float inv = 1.0f / total;  // total >= 1: the largest part has w = 1
#pragma omp simd
    for (int64_t e = 0; e < Ev; ++e) o_row[e] *= inv;
    lse[a] = M + std::log2(total);
  }
}

// FlashAttention-2's backward on one (query block i, key block j) tile, in two halves so a
// caller can work on dS in between (block_sparse.cpp adds a bias gradient and the soft-cap's
// derivative there). p holds P (n x nk, row-major, float32); dp is scratch of the same size;
// buf (n x nk operands) holds P, then dS, in the GEMMs' operand type when that is not float32.
//
// First half:  dV_j += P^T dO_i;  dP = dO_i V_j^T;  dS = P * (dP - D_i), left in dp.
template <class G>
inline void tile_dv_ds(const G& gemm, const float* p, typename G::T* buf, float* dp, int n, int nk, int Ev,
                       const typename G::T* do_tile, int do_ld, const typename G::T* v_rows, int v_ld, float* dv_rows,
                       int dv_ld, const float* d_rows, int64_t d_stride) {
  const typename G::T* p_op = gemm.operand(p, static_cast<int64_t>(n) * nk, buf);
  gemm(true, false, nk, Ev, n, 1.0f, p_op, nk, do_tile, do_ld, 1.0f, dv_rows, dv_ld);  // dV_j += P^T dO_i
  gemm(false, true, n, nk, Ev, 1.0f, do_tile, do_ld, v_rows, v_ld, 0.0f, dp, nk);      // dP = dO_i V_j^T
  for (int a = 0; a < n; ++a) {  // dS = P * (dP - D_i), over dP
    const float d = d_rows[a * d_stride];
    const float* p_row = p + static_cast<int64_t>(a) * nk;
    float* ds_row = dp + static_cast<int64_t>(a) * nk;
#pragma omp simd
    for (int c = 0; c < nk; ++c) ds_row[c] = p_row[c] * (ds_row[c] - d);
  }
}

// Second half:  dQ_i += scale dS K_j;  dK_j += scale dS^T Q_i.
template <class G>
inline void tile_dq_dk(const G& gemm, const float* ds, typename G::T* buf, int n, int nk, int E, float scale,
                       const typename G::T* k_rows, int k_ld, float* dq_tile, int dq_ld, const typename G::T* q_tile,
                       int q_ld, float* dk_rows, int dk_ld) {
  const typename G::T* ds_op = gemm.operand(ds, static_cast<int64_t>(n) * nk, buf);
  gemm(false, false, n, E, nk, scale, ds_op, nk, k_rows, k_ld, 1.0f, dq_tile, dq_ld);  // dQ_i += scale dS K_j
  gemm(true, false, nk, E, n, scale, ds_op, nk, q_tile, q_ld, 1.0f, dk_rows, dk_ld);   // dK_j += scale dS^T Q_i
}

// Runs fn(task) for every task in `order`, handed out one at a time to the threads from an
// atomic counter (tasks of unequal cost, as causal tiles are, end together instead of in the
// 1:3 split two equal contiguous ranges of a causal triangle give).
template <typename F>
inline void for_each_dynamic(const std::vector<int64_t>& order, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) fn(order[t]);
  });
}

// Task ids 0..costs.size()-1, the costliest first (ties keep their order): with for_each_dynamic,
// the longest-processing-time-first rule, within 4/3 of the best split.
inline std::vector<int64_t> largest_first(const std::vector<int64_t>& costs) {
  std::vector<int64_t> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  return order;
}

// The backward's set-up, shared by flash.cpp and block_sparse.cpp: the checks, the shapes
// (q4 (Nb, r, L, E), k3 (Nb, S, E), v3 (Nb, S, Ev), lse2 and delta (Nb, r, L)), the row strides,
// and the tasks. A task is a key/value head and a chunk of its key blocks, with all r query
// heads of the group: one writer per dK/dV row, and no copy of dK/dV per query head.
// When the key/value heads share out evenly over the threads (or there are many), a chunk is
// all S keys. Otherwise (one head, MQA, GQA at small batch, 3 heads on 2 threads) the keys are
// cut into chunks (KEY_CHUNKS_PER_THREAD per thread, handed out costliest first), so every
// thread works to the end; the chunks of one head then
// share its dQ rows, so each thread past the first adds its dQ into a private copy
// (dq_parts: threads - 1 copies of dq, not r of dK and dV), summed into dq by finish().
template <class T = float>
struct BackwardSetup {
  // chunks per thread when the keys are cut: enough for the largest-first rule to even out a
  // causal triangle's unequal chunks (2 threads, 8 chunks of a triangle: 16 / 16 of 32)
  static constexpr int64_t KEY_CHUNKS_PER_THREAD = 4;
  int64_t Nb, r, L, E, S, Ev;
  int64_t q_ld, do_ld, dq_ld, k_ld, v_ld, dk_ld, dv_ld;
  int bk;                    // key rows per block (the caller's key tile; chunks are whole blocks)
  bool split;                // keys cut into chunks (the heads do not share out evenly)
  int64_t chunks;            // chunks per key/value head (1 unless split)
  int64_t blocks_per_chunk;  // key blocks per chunk
  int64_t n_tasks;           // Nb * chunks
  at::Tensor dq_parts;       // (threads - 1, Nb, r, L, E) float32 when split
  const T *q, *k, *v, *gout;  // q4, k3, v3, dout: float32, or bf16 on the bf16 route
  const float *lse, *dlt;     // lse2, delta
  float* gq;                                   // dq
  float* dk_base;
  float* dv_base;
  int64_t k_head_stride, v_head_stride, dk_head_stride, dv_head_stride;
  int64_t q_s[2], do_s[2], dq_s[2], lse_s[3], d_s[3];  // head strides (and row strides of lse2, delta)

  static int64_t lead(const at::Tensor& t, int64_t width) { return t.size(-2) > 1 ? t.stride(-2) : width; }

  BackwardSetup(const at::Tensor& dout, const at::Tensor& q4, const at::Tensor& k3, const at::Tensor& v3,
                const at::Tensor& lse2, const at::Tensor& delta, const at::Tensor& dq, const at::Tensor& dk,
                const at::Tensor& dv, int64_t block_k, const char* what) {
    const at::ScalarType operands = std::is_same<T, float>::value ? at::kFloat : at::kBFloat16;
    for (const at::Tensor* t : {&dout, &q4, &k3, &v3, &lse2, &delta, &dq, &dk, &dv}) {
      const bool operand = t == &dout || t == &q4 || t == &k3 || t == &v3;
      TORCH_CHECK(t->scalar_type() == (operand ? operands : at::kFloat) && t->device().is_cpu(), what,
                  ": dout, q4, k3, v3 must be ", operand ? c10::toString(operands) : "float32",
                  " and the rest float32, on the CPU");
      TORCH_CHECK(t->stride(-1) == 1 || t->size(-1) == 1, what, ": the last dim must be dense");
    }
    TORCH_CHECK(q4.dim() == 4 && dout.dim() == 4 && dq.dim() == 4 && k3.dim() == 3 && v3.dim() == 3 &&
                    dk.dim() == 3 && dv.dim() == 3 && lse2.dim() == 3 && delta.dim() == 3,
                what, ": bad ranks");
    Nb = q4.size(0), r = q4.size(1), L = q4.size(2), E = q4.size(3);
    S = k3.size(1), Ev = v3.size(2);
    TORCH_CHECK(dq.sizes() == q4.sizes() && dk.sizes() == k3.sizes() && dv.sizes() == v3.sizes() &&
                    dout.sizes() == at::IntArrayRef({Nb, r, L, Ev}) && lse2.sizes() == at::IntArrayRef({Nb, r, L}) &&
                    delta.sizes() == lse2.sizes() && k3.size(0) == Nb && v3.size(0) == Nb && v3.size(1) == S &&
                    k3.size(2) == E,
                what, ": shapes");
    TORCH_CHECK(block_k > 0, what, ": block_k must be positive");
    q_ld = lead(q4, E), do_ld = lead(dout, Ev), dq_ld = lead(dq, E);
    k_ld = lead(k3, E), v_ld = lead(v3, Ev), dk_ld = lead(dk, E), dv_ld = lead(dv, Ev);
    TORCH_CHECK(q_ld >= E && do_ld >= Ev && dq_ld >= E && k_ld >= E && v_ld >= Ev && dk_ld >= E && dv_ld >= Ev,
                what, ": rows must not overlap");
    bk = static_cast<int>(block_k);
    const int64_t n_threads = at::get_num_threads();
    const int64_t n_blocks = (S + bk - 1) / bk;
    chunks = 1;
    // cut when the heads do not share out evenly (fewer than threads, or 3 on 2 threads: one
    // thread would do 2 heads while the other idles half the time), up to KEY_CHUNKS_PER_THREAD
    // heads per thread, past which whole heads balance within 1 / KEY_CHUNKS_PER_THREAD
    if (Nb % n_threads != 0 && Nb < KEY_CHUNKS_PER_THREAD * n_threads && n_blocks > 1) {
      const int64_t wanted = (KEY_CHUNKS_PER_THREAD * n_threads + Nb - 1) / Nb;
      blocks_per_chunk = (n_blocks + std::min(wanted, n_blocks) - 1) / std::min(wanted, n_blocks);
      chunks = (n_blocks + blocks_per_chunk - 1) / blocks_per_chunk;
    }
    if (chunks == 1) blocks_per_chunk = std::max<int64_t>(n_blocks, 1);
    split = chunks > 1;
    if (split && !empty()) dq_parts = at::zeros({n_threads - 1, Nb, r, L, E}, dq.options());
    n_tasks = Nb * chunks;
    q = static_cast<const T*>(q4.data_ptr()), k = static_cast<const T*>(k3.data_ptr());
    v = static_cast<const T*>(v3.data_ptr()), gout = static_cast<const T*>(dout.data_ptr());
    lse = lse2.data_ptr<float>(), dlt = delta.data_ptr<float>();
    gq = dq.data_ptr<float>();
    dk_base = dk.data_ptr<float>(), dv_base = dv.data_ptr<float>();
    k_head_stride = k3.stride(0), v_head_stride = v3.stride(0);
    dk_head_stride = dk.stride(0), dv_head_stride = dv.stride(0);
    for (int d = 0; d < 2; ++d) q_s[d] = q4.stride(d), do_s[d] = dout.stride(d), dq_s[d] = dq.stride(d);
    for (int d = 0; d < 3; ++d) lse_s[d] = lse2.stride(d), d_s[d] = delta.stride(d);
  }

  // Query head h of key/value head nb, from query row i0, for the thread `thread`: where its Q,
  // dO rows and its lse2 and D entries start (entry a of lse / d is a * lse_stride / d_stride
  // further), and the dQ rows it adds into (dq, or the thread's copy when the keys are split).
  struct Rows {
    const T* q;
    const T* dout;
    float* dq;
    const float* lse;
    const float* d;
    int64_t lse_stride, d_stride, dq_ld;
  };

  Rows rows(int64_t nb, int64_t h, int64_t i0, int thread) const {
    float* dq_rows = gq + nb * dq_s[0] + h * dq_s[1] + i0 * dq_ld;
    int64_t ld = dq_ld;
    if (split && thread > 0) {  // (thread - 1, nb, h, i0, :) of the contiguous copies
      dq_rows = dq_parts.data_ptr<float>() + (((thread - 1) * Nb + nb) * r + h) * L * E + i0 * E;
      ld = E;
    }
    return {q + nb * q_s[0] + h * q_s[1] + i0 * q_ld, gout + nb * do_s[0] + h * do_s[1] + i0 * do_ld, dq_rows,
            lse + nb * lse_s[0] + h * lse_s[1] + i0 * lse_s[2], dlt + nb * d_s[0] + h * d_s[1] + i0 * d_s[2],
            lse_s[2], d_s[2], ld};
  }

  bool empty() const { return Nb == 0 || r == 0 || L == 0 || S == 0 || E == 0 || Ev == 0; }

  // Task t: its key/value head (and its K, V, dK, dV rows) and its keys [j_begin, j_end), a
  // whole number of blocks of bk from j_begin.
  struct Task {
    int64_t nb, j_begin, j_end;
    const T* k_head;
    const T* v_head;
    float* dk_head;
    float* dv_head;
  };

  Task task(int64_t t) const {
    Task w;
    w.nb = t / chunks;
    const int64_t c = t % chunks;
    w.j_begin = std::min<int64_t>(c * blocks_per_chunk * bk, S);
    w.j_end = std::min<int64_t>((c + 1) * blocks_per_chunk * bk, S);
    w.k_head = k + w.nb * k_head_stride;
    w.v_head = v + w.nb * v_head_stride;
    w.dk_head = dk_base + w.nb * dk_head_stride;
    w.dv_head = dv_base + w.nb * dv_head_stride;
    return w;
  }

  // The threads' dQ copies added into dq.
  void finish(const at::Tensor& dq) const {
    if (split && !empty() && dq_parts.size(0) > 0) dq.add_(dq_parts.sum(0));
  }
};

}  // namespace
