// attnlab's native tiled kernels: the same online-softmax forward as attnlab/tiled.py's
// _forward_eager, one task per (key/value head, query head of its group, query block), each
// on a tile that stays in cache; and the same FlashAttention-2 backward as _backward_eager
// (flash_backward_, at the end of this file).
//
// Why this exists: the pure-PyTorch loop runs the row passes (scale, row max, exp2, row sum,
// rescale) as separate eager ops over batched (Nb, r*bq, bk) tiles of ~2 MiB, which stream
// out of cache and cost ~30% on top of the two matmuls. Here each task does
//
//     S   = scale2 * Q_i K_j^T          (sgemm.h, (n, nk))
//     row pass, one sweep per row:      m_new = max(m_i, rowmax S)
//                                       P~    = 2^(S - m_new), l_i = 2^(m_i - m_new) l_i + rowsum P~
//                                       acc   = 2^(m_i - m_new) acc
//     acc += P~ V_j                     (sgemm.h, (n, Ev))
//
// on a (bq, bk) tile that is still in L2 when the row pass reads it, as torch's own CPU
// flash kernel does. The math is the online softmax of FlashAttention-2 (Dao 2023), in
// base 2 (log2(e) is folded into scale2 by the caller). No softmax or SDPA from torch is
// called: the only library routine is the matrix product (MKL's sgemm, which torch links, or
// attnlab's own micro-kernel in sgemm.h, by the route attnlab.kernels.native.sgemm_route picks).
//
// Layout (views are fine as long as the last dim is dense):
//     q4   (Nb, r, L, E)   r query heads share key/value head nb (GQA without repeating K, V)
//     k3   (Nb, S, E)
//     v3   (Nb, S, Ev)
// An optional bool or float attn_mask is read in place, one tile row at a time (MaskView).
// flash_forward returns out (Nb, r, L, Ev) and lse2 (Nb, r, L), the base-2 log-sum-exp (-inf on
// rows that saw no key; their output is 0, as SDPA's); flash_forward_ continues a saved state.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <optional>
#include <type_traits>
#include <vector>

namespace {

// attn_mask, read in place from the user's (broadcast) tensor: the (L, S) plane of query head
// p = nb * r + h starts offsets[p] elements after the data pointer; (i, j) is i * s_L + j * s_S
// further (a stride may be 0 where the mask broadcasts). Bool: false = masked (score -inf);
// float: added to the score (natural-log units, so times log2(e) in base 2).
struct MaskView {
  const bool* b = nullptr;
  const float* f = nullptr;
  const int64_t* offsets = nullptr;
  int64_t s_L = 0, s_S = 0;

  bool present() const { return b != nullptr || f != nullptr; }

  // row holds base-2 scores of query i against keys j0 .. j0 + n - 1
  void apply(float* row, int64_t plane, int64_t i, int64_t j0, int n) const {
    const int64_t start = offsets[plane] + i * s_L + j0 * s_S;
    const int64_t step = s_S;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    if (b != nullptr && step == 1) {  // the usual layout: contiguous keys, a plain vector loop
      const bool* m = b + start;
#pragma omp simd
      for (int c = 0; c < n; ++c) row[c] = m[c] ? row[c] : neg_inf;
    } else if (b != nullptr) {
      const bool* m = b + start;
      for (int c = 0; c < n; ++c) row[c] = m[c * step] ? row[c] : neg_inf;
    } else if (step == 1) {
      const float* m = f + start;
#pragma omp simd
      for (int c = 0; c < n; ++c) row[c] += kLog2e * m[c];
    } else {
      const float* m = f + start;
      for (int c = 0; c < n; ++c) row[c] += kLog2e * m[c * step];
    }
  }
};

MaskView make_mask(const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& offsets, int64_t planes,
                   int64_t L, int64_t S) {
  MaskView view;
  if (!mask.has_value() || !mask->defined()) return view;
  TORCH_CHECK(offsets.has_value() && offsets->defined() && offsets->scalar_type() == at::kLong &&
                  offsets->is_contiguous() && offsets->numel() == planes,
              "attnlab native: mask_offsets must be int64 with one entry per query head");
  TORCH_CHECK(mask->dim() >= 2 && mask->size(-2) == L && mask->size(-1) == S, "attnlab native: mask must end in (L, S)");
  TORCH_CHECK(mask->scalar_type() == at::kBool || mask->scalar_type() == at::kFloat, "attnlab native: bool or float32 mask");
  if (mask->scalar_type() == at::kBool) {
    view.b = mask->data_ptr<bool>();
  } else {
    view.f = mask->data_ptr<float>();
  }
  view.offsets = offsets->data_ptr<int64_t>();
  view.s_L = mask->stride(-2);
  view.s_S = mask->stride(-1);
  return view;
}

// The online softmax continued from a saved state, in place: on entry (out, lse2) hold the
// result over the keys seen so far (out normalised, lse2 = -inf on rows that saw none; out is
// then ignored), on exit the result over those keys and k3/v3's. The state maps onto the
// running quantities as m_i = lse2, l_i = 1, acc = out: the ring merges blocks this way with
// no partial output tensor. A fresh forward starts from lse2 = -inf.
//
// The bf16 route: q4, k3, v3 in bfloat16, the GEMMs on bf16 operands with float32 results
// (GemmBf16, bf16_gemm.h), P rounded to bf16 for P V; scores, the row pass, m_i, l_i, acc and
// lse2 stay float32, and out is float32. bf16_emulated widens the GEMMs' operands instead of
// using the CPU's bf16 instructions.
// Rows per group on a causal tile the diagonal crosses: each group computes only the keys its last
// row sees (at 256 x 256, groups of 64 compute 10 of the tile's 16 sub-blocks instead of all 16).
// One thread, (1, 8, 4096, 64) causal forward on the Zen 5, alternated: 78.8-84.4 ms whole tiles,
// 76.5-76.8 ms in groups of 64 (32 and 128 within the noise of 64).
constexpr int kDiagonalRows = 64;

// The keys the n query rows from i0 reach: all S, or under causality up to the last row's
// diagonal (query i sees keys 0..i + causal_offset; 0: top-left, S - L: bottom-right), so key
// blocks from i0 + n + causal_offset on are skipped.
inline int64_t causal_keys_seen(bool is_causal, int64_t causal_offset, int64_t S, int64_t i0, int n) {
  return is_causal ? std::clamp<int64_t>(i0 + n + causal_offset, 0, S) : S;
}

// fn(a0, rows, seen) for the parts of the query rows i0 .. i0 + n - 1 against the key block j0 ..
// j0 + nk - 1 that see any of its keys: all n rows and nk keys when every row sees every key, else
// (a causal tile the diagonal crosses) groups of kDiagonalRows rows, each with the keys its last
// row sees; a group that sees none is skipped.
template <class F>
inline void causal_parts(bool is_causal, int64_t causal_offset, int64_t S, int64_t i0, int n, int64_t j0, int nk,
                         const F& fn) {
  if (!is_causal || i0 + causal_offset >= j0 + nk - 1) return fn(0, n, nk);
  for (int a0 = 0; a0 < n; a0 += kDiagonalRows) {
    const int rows = std::min(kDiagonalRows, n - a0);
    const int64_t seen = causal_keys_seen(is_causal, causal_offset, S, i0 + a0, rows) - j0;
    if (seen > 0) fn(a0, rows, static_cast<int>(std::min<int64_t>(seen, nk)));
  }
}

template <class G>
void forward_tiles(const G& gemm, const at::Tensor& q4, const at::Tensor& k3, const at::Tensor& v3,
                   const at::Tensor& out, const at::Tensor& lse2, const std::optional<at::Tensor>& mask,
                   const std::optional<at::Tensor>& mask_offsets, double scale2_d, bool is_causal, int64_t causal_offset, int64_t block_q,
                   int64_t block_k) {
  using T = typename G::T;
  TORCH_CHECK((q4.stride(3) == 1 || q4.size(3) == 1) && (k3.stride(2) == 1 || k3.size(2) == 1) &&
                  (v3.stride(2) == 1 || v3.size(2) == 1) && (out.stride(3) == 1 || out.size(3) == 1),
              "attnlab native forward: the last dim must be dense");
  const int64_t Nb = q4.size(0), r = q4.size(1), L = q4.size(2), E = q4.size(3);
  const int64_t S = k3.size(1), Ev = v3.size(2);
  TORCH_CHECK(k3.size(0) == Nb && v3.size(0) == Nb && k3.size(2) == E && v3.size(1) == S &&
                  out.sizes() == at::IntArrayRef({Nb, r, L, Ev}) && lse2.sizes() == at::IntArrayRef({Nb, r, L}),
              "attnlab native forward: shapes");
  if (Nb == 0 || r == 0 || L == 0 || S == 0) return;
  const MaskView mv = make_mask(mask, mask_offsets, Nb * r, L, S);
  const int bq = static_cast<int>(std::min<int64_t>(block_q, L));
  const int bk = static_cast<int>(std::min<int64_t>(block_k, S));
  const float scale2 = static_cast<float>(scale2_d);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  const T* q = static_cast<const T*>(q4.data_ptr());
  const T* k = static_cast<const T*>(k3.data_ptr());
  const T* v = static_cast<const T*>(v3.data_ptr());
  float* o = out.data_ptr<float>();
  float* lse = lse2.data_ptr<float>();

  // views work (the ring passes slices): only the last dim must be dense
  // (a dim of size 1 may carry any stride; BLAS wants a leading dim >= the row length)
  const int64_t q_s0 = q4.stride(0), q_s1 = q4.stride(1), q_s2 = L > 1 ? q4.stride(2) : E;
  const int64_t k_s0 = k3.stride(0), k_s1 = S > 1 ? k3.stride(1) : E;
  const int64_t v_s0 = v3.stride(0), v_s1 = S > 1 ? v3.stride(1) : Ev;
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1), o_s2 = out.stride(2);
  const int64_t l_s0 = lse2.stride(0), l_s1 = lse2.stride(1), l_s2 = lse2.stride(2);
  TORCH_CHECK(q_s2 >= E && k_s1 >= E && v_s1 >= Ev, "attnlab native forward: rows must not overlap");
  const int64_t n_qblocks = (L + bq - 1) / bq;
  const int64_t n_tasks = Nb * r * n_qblocks;
  // per-thread scratch: the score tile, the accumulator and the row state, reused by every task
  // (and P as a GEMM operand on the bf16 route)
  const int64_t per_thread = static_cast<int64_t>(bq) * bk + static_cast<int64_t>(bq) * Ev + 2 * bq +
                             static_cast<int64_t>(bq) * kRowMaxLanes;
  const int n_threads = at::get_num_threads();
  std::vector<float> scratch(static_cast<size_t>(per_thread * n_threads));
  const bool rounds = !std::is_same<T, float>::value;
  std::vector<T> p_ops(rounds ? static_cast<size_t>(bq) * bk * n_threads : 0);

  auto keys_seen = [&](int64_t i0, int n) { return causal_keys_seen(is_causal, causal_offset, S, i0, n); };
  std::vector<int64_t> costs(static_cast<size_t>(n_tasks));  // a task's key blocks
  for (int64_t task = 0; task < n_tasks; ++task) {
    const int64_t i0 = (task % n_qblocks) * bq;
    costs[task] = (keys_seen(i0, static_cast<int>(std::min<int64_t>(bq, L - i0))) + bk - 1) / bk;
  }
  // The order the tasks are handed out in (one at a time): a key/value head's tasks together,
  // costliest first (a causal triangle's last query tiles visit the most key blocks; the run ends
  // on the last head's cheapest, so the threads finish together). Under causality successive tasks
  // walk their key blocks in alternate directions, so that a task starts on the blocks the one
  // before it read last, still in L2 (a head's K and V at S = 4096, E = 64 are 2 MiB; L2 holds
  // half). A task's direction is fixed by its place in the order: results do not depend on the
  // threads. Zen 4, 2026-12-05, against the tasks costliest first over all heads, every walk
  // forwards: (1, 8, 4096, 64) causal, float32, one thread 181.7-187.1 -> 177.0-179.6 ms, two
  // 92.1-93.6 -> 90.0-91.2 ms; bf16, one thread, 105.5-107.5 -> 102.2-103.0 ms, (1, 16, 2048, 128)
  // 104.7-105.6 -> 99.0-100.8 ms. Without causality (every task reads all its head's blocks) the
  // alternate walks were no help (float32 172.0-172.5 ms both ways on two threads; bf16 GQA
  // (1, 32 on 8, 4096, 128), one thread, 1460-1477 -> 1481-1495 ms): every walk goes forwards there.
  // The backward's query tiles walking alternate ways measured within the noise (float32 causal
  // fwd+bwd, one thread: 612.9-633.6 against 617.0-620.3 ms).
  std::vector<int64_t> order(static_cast<size_t>(n_tasks));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t head_a = a / n_qblocks / r, head_b = b / n_qblocks / r;  // key/value heads nb
    return head_a != head_b ? head_a < head_b : costs[a] > costs[b];
  });
  std::vector<char> walks_back(static_cast<size_t>(n_tasks));
  for (int64_t place = 0; is_causal && place < n_tasks; ++place) walks_back[order[place]] = place % 2;
  for_each_dynamic(order, [&](int64_t task) {
    float* s = scratch.data() + per_thread * at::get_thread_num();
    float* acc = s + static_cast<int64_t>(bq) * bk;
    float* m_i = acc + static_cast<int64_t>(bq) * Ev;
    float* l_i = m_i + bq;
    float* rmax = l_i + bq;  // (bq, kRowMaxLanes): the rows' maxima, from the score GEMM
    T* p_buf = rounds ? p_ops.data() + static_cast<int64_t>(bq) * bk * at::get_thread_num() : nullptr;
    const int64_t qblock = task % n_qblocks;
    const int64_t head = task / n_qblocks;  // nb * r + h
    const int64_t nb = head / r, h = head % r;
    const int64_t i0 = qblock * bq;
    const int n = static_cast<int>(std::min<int64_t>(bq, L - i0));
    const T* q_tile = q + nb * q_s0 + h * q_s1 + i0 * q_s2;
    const T* k_head = k + nb * k_s0;
    const T* v_head = v + nb * v_s0;
    float* o_tile = o + nb * o_s0 + h * o_s1 + i0 * o_s2;
    float* lse_tile = lse + nb * l_s0 + h * l_s1 + i0 * l_s2;
    // the saved state: m_i = lse, l_i = 1, acc = out; a row with lse = -inf has seen no key yet
    for (int a = 0; a < n; ++a) {
      const float m = lse_tile[a * l_s2];
      float* acc_row = acc + static_cast<int64_t>(a) * Ev;
      m_i[a] = m;
      l_i[a] = m == neg_inf ? 0.0f : 1.0f;
      if (m == neg_inf) {
        std::fill(acc_row, acc_row + Ev, 0.0f);
      } else {
        std::copy(o_tile + a * o_s2, o_tile + a * o_s2 + Ev, acc_row);
      }
    }
    // rows a0 .. a0 + rows - 1 of the tile against keys j0 .. j0 + nk - 1 (their scores in s, (rows, nk))
    auto block = [&](int a0, int rows, int64_t j0, int nk) {
      // S = scale2 * Q K_j^T   (rows, nk); with the rows' maxima where every row sees every key
      // (the max sweep took a third of the row pass: 7.2 -> 4.8 cycles per 16 scores without it)
      const bool whole = !mv.present() && (!is_causal || i0 + a0 + causal_offset >= j0 + nk - 1);
      if (whole) std::fill(rmax, rmax + static_cast<int64_t>(rows) * kRowMaxLanes, neg_inf);
      const bool maxed = gemm.scores(rows, nk, static_cast<int>(E), scale2, q_tile + a0 * q_s2, static_cast<int>(q_s2),
                                     k_head + j0 * k_s1, static_cast<int>(k_s1), s, nk, whole ? rmax : nullptr);
      // keys j0 + c with c < valid are visible to row a (causal), minus the masked ones
      online_update(s, rows, nk, [&](int64_t a, float* row) {
        const int64_t visible = is_causal ? (i0 + a0 + a + causal_offset) - j0 + 1 : nk;
        const int valid = static_cast<int>(std::clamp<int64_t>(visible, 0, nk));
        if (mv.present() && valid > 0) mv.apply(row, head, i0 + a0 + a, j0, valid);
        return valid;
      }, m_i + a0, l_i + a0, acc + a0 * Ev, Ev, maxed ? rmax : nullptr,
         [&](int64_t a, const float* row) {  // P~ as the GEMM operand, row by row
           if (rounds) gemm.row_operand(row, nk, p_buf + a * nk);
         });
      // acc += P~ V_j   (rows, Ev)
      gemm(false, false, rows, static_cast<int>(Ev), nk, 1.0f, gemm.rows_operand(s, p_buf), nk, v_head + j0 * v_s1,
           static_cast<int>(v_s1), 1.0f, acc + a0 * Ev, static_cast<int>(Ev));
    };
    const int64_t j_end = keys_seen(i0, n);
    const int64_t blocks = (j_end + bk - 1) / bk;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t j0 = (walks_back[task] ? blocks - 1 - b : b) * bk;
      const int nk = static_cast<int>(std::min<int64_t>(bk, S - j0));
      causal_parts(is_causal, causal_offset, S, i0, n, j0, nk,  // rows that see none keep their state
                   [&](int a0, int rows, int seen) { block(a0, rows, j0, seen); });
    }
    finish_rows(acc, m_i, l_i, n, Ev, o_tile, o_s2, lse_tile, l_s2);  // O_i = acc / l_i, lse2_i
  });
}

void flash_forward_(const at::Tensor& q4, const at::Tensor& k3, const at::Tensor& v3, const at::Tensor& out,
                    const at::Tensor& lse2, const std::optional<at::Tensor>& mask,
                    const std::optional<at::Tensor>& mask_offsets, double scale2, bool is_causal, int64_t causal_offset, int64_t block_q,
                    int64_t block_k, bool bf16_emulated, int64_t sgemm_route) {
  TORCH_CHECK(q4.dim() == 4 && k3.dim() == 3 && v3.dim() == 3 && out.dim() == 4 && lse2.dim() == 3,
              "attnlab native forward: bad ranks");
  const at::ScalarType operands = q4.scalar_type();
  TORCH_CHECK(operands == at::kFloat || operands == at::kBFloat16,
              "attnlab native forward: q4, k3, v3 must be float32 or bfloat16");
  for (const at::Tensor* t : {&q4, &k3, &v3, &out, &lse2}) {
    const bool operand = t == &q4 || t == &k3 || t == &v3;
    TORCH_CHECK(t->scalar_type() == (operand ? operands : at::kFloat) && t->device().is_cpu(),
                "attnlab native forward: q4, k3, v3 of one dtype, out and lse2 float32, on the CPU");
  }
  if (operands == at::kBFloat16) {
    forward_tiles(GemmBf16{!bf16_emulated}, q4, k3, v3, out, lse2, mask, mask_offsets, scale2, is_causal, causal_offset,
                  block_q, block_k);
  } else {
    forward_tiles(Gemm32{sgemm_route}, q4, k3, v3, out, lse2, mask, mask_offsets, scale2, is_causal, causal_offset, block_q,
                  block_k);
  }
}

// A fresh forward: out (Nb, r, L, Ev) and lse2 (Nb, r, L) from an empty state.
std::tuple<at::Tensor, at::Tensor> flash_forward(const at::Tensor& q4, const at::Tensor& k3, const at::Tensor& v3,
                                                 const std::optional<at::Tensor>& mask,
                                                 const std::optional<at::Tensor>& mask_offsets, double scale2,
                                                 bool is_causal, int64_t causal_offset, int64_t block_q, int64_t block_k,
                                                 bool bf16_emulated, int64_t sgemm_route) {
  TORCH_CHECK(q4.dim() == 4 && v3.dim() == 3, "attnlab native forward: bad ranks");
  const at::TensorOptions f32 = q4.options().dtype(at::kFloat);
  at::Tensor out = at::empty({q4.size(0), q4.size(1), q4.size(2), v3.size(2)}, f32);
  at::Tensor lse2 = at::full({q4.size(0), q4.size(1), q4.size(2)}, -std::numeric_limits<float>::infinity(), f32);
  flash_forward_(q4, k3, v3, out, lse2, mask, mask_offsets, scale2, is_causal, causal_offset, block_q, block_k,
                 bf16_emulated, sgemm_route);
  // rows that never saw a key (S = 0) still hold uninitialised memory: SDPA gives 0 there
  if (k3.size(1) == 0) out.zero_();
  return {out, lse2};
}

// FlashAttention-2's backward (Dao 2023, Algorithm 2), one task per key/value head nb and chunk
// of its keys (its r query heads run in the task, so dK, dV have a single writer; the chunks,
// BackwardSetup, keep every thread busy with fewer heads than threads), tiles recomputed from lse:
//
//     P    = 2^(scale2 * Q_i K_j^T - lse2_i)    (0 above the causal diagonal and on empty rows)
//     dV_j += P^T dO_i
//     dP   = dO_i V_j^T
//     dS   = P * (dP - D_i)                      D_i = rowsum(dO_i * O_i), passed in as delta
//     dQ_i += scale * dS K_j
//     dK_j += scale * dS^T Q_i
//
// The gradients are added into dq (Nb, r, L, E), dk (Nb, S, E), dv (Nb, S, Ev) (views work).
// On the bf16 route dout, q4, k3, v3 are bfloat16 and P, dS are rounded to bf16 for their GEMMs;
// lse2, delta and the gradients dq, dk, dv are float32.
template <class G>
void backward_tiles(const G& gemm, const at::Tensor& dout, const at::Tensor& q4, const at::Tensor& k3,
                    const at::Tensor& v3, const at::Tensor& lse2, const at::Tensor& delta, const at::Tensor& dq,
                    const at::Tensor& dk, const at::Tensor& dv, const std::optional<at::Tensor>& mask,
                    const std::optional<at::Tensor>& mask_offsets, double scale_d, bool is_causal, int64_t causal_offset, int64_t block_q,
                    int64_t block_k) {
  using T = typename G::T;
  const BackwardSetup<T> setup(dout, q4, k3, v3, lse2, delta, dq, dk, dv, block_k, "attnlab native backward");
  if (setup.empty()) return;
  const int64_t Nb = setup.Nb, r = setup.r, L = setup.L, E = setup.E, S = setup.S, Ev = setup.Ev;
  const MaskView mv = make_mask(mask, mask_offsets, Nb * r, L, S);
  const int bq = static_cast<int>(std::min<int64_t>(block_q, L));
  const int bk = static_cast<int>(std::min<int64_t>(block_k, S));  // setup.bk unless one block holds every key
  const float scale = static_cast<float>(scale_d);
  const float scale2 = scale * kLog2e;  // the forward's base-2 scores
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t q_ld = setup.q_ld, do_ld = setup.do_ld, k_ld = setup.k_ld, v_ld = setup.v_ld;
  const int64_t dk_ld = setup.dk_ld, dv_ld = setup.dv_ld;
  auto keys_seen = [&](int64_t i0, int n) { return causal_keys_seen(is_causal, causal_offset, S, i0, n); };

  // a task's cost: the key blocks its query tiles visit, over its keys
  std::vector<int64_t> costs(static_cast<size_t>(setup.n_tasks), 0);
  for (int64_t t = 0; t < setup.n_tasks; ++t) {
    const auto w = setup.task(t);
    for (int64_t i0 = 0; i0 < L; i0 += bq) {
      const int64_t seen = std::min<int64_t>(keys_seen(i0, static_cast<int>(std::min<int64_t>(bq, L - i0))), w.j_end);
      if (seen > w.j_begin) costs[t] += (seen - w.j_begin + bk - 1) / bk;
    }
  }
  const int64_t tile = static_cast<int64_t>(bq) * bk;
  const int n_threads = at::get_num_threads();
  std::vector<float> scratch(static_cast<size_t>(2 * tile * n_threads));
  const bool rounds = !std::is_same<T, float>::value;
  std::vector<T> ops_buf(rounds ? static_cast<size_t>(tile) * n_threads : 0);  // P, then dS, as operands
  for_each_dynamic(largest_first(costs), [&](int64_t task) {
    const int thread = at::get_thread_num();
    float* p = scratch.data() + 2 * tile * thread;
    float* dp = p + tile;
    T* buf = rounds ? ops_buf.data() + tile * thread : nullptr;
    const typename BackwardSetup<T>::Task w = setup.task(task);
    const int64_t nb = w.nb;
    const T *k_head = w.k_head, *v_head = w.v_head;
    float *dk_head = w.dk_head, *dv_head = w.dv_head;
    for (int64_t h = 0; h < r; ++h) {
      for (int64_t i0 = 0; i0 < L; i0 += bq) {
        const int n = static_cast<int>(std::min<int64_t>(bq, L - i0));
        const int64_t j_end = std::min<int64_t>(keys_seen(i0, n), w.j_end);
        if (j_end <= w.j_begin) continue;
        const auto rw = setup.rows(nb, h, i0, thread);
        const T *q_tile = rw.q, *do_tile = rw.dout;
        float* dq_tile = rw.dq;
        // rows a0 .. a0 + rows - 1 of the query tile against keys j0 .. j0 + nk - 1
        auto tile = [&](int a0, int rows, int64_t j0, int nk) {
          const T* q_rows = q_tile + a0 * q_ld;
          const float* lse_rows = rw.lse + a0 * rw.lse_stride;
          // P = 2^(scale2 * Q_i K_j^T - lse2_i)
          gemm(false, true, rows, nk, static_cast<int>(E), scale2, q_rows, static_cast<int>(q_ld), k_head + j0 * k_ld,
               static_cast<int>(k_ld), 0.0f, p, nk);
          for (int a = 0; a < rows; ++a) {
            float* row = p + static_cast<int64_t>(a) * nk;
            const float m = lse_rows[a * rw.lse_stride];
            const int64_t visible = is_causal ? (i0 + a0 + a + causal_offset) - j0 + 1 : nk;
            const int valid = m == neg_inf ? 0 : static_cast<int>(std::clamp<int64_t>(visible, 0, nk));
            if (mv.present() && valid > 0) mv.apply(row, nb * r + h, i0 + a0 + a, j0, valid);  // masked: 2^-inf = 0
            exp2_shifted(row, valid, m);
            for (int c = valid; c < nk; ++c) row[c] = 0.0f;
          }
          tile_dv_ds(gemm, p, buf, dp, rows, nk, static_cast<int>(Ev), do_tile + a0 * do_ld, static_cast<int>(do_ld),
                     v_head + j0 * v_ld, static_cast<int>(v_ld), dv_head + j0 * dv_ld, static_cast<int>(dv_ld),
                     rw.d + a0 * rw.d_stride, rw.d_stride);
          tile_dq_dk(gemm, dp, buf, rows, nk, static_cast<int>(E), scale, k_head + j0 * k_ld, static_cast<int>(k_ld),
                     dq_tile + a0 * rw.dq_ld, static_cast<int>(rw.dq_ld), q_rows, static_cast<int>(q_ld),
                     dk_head + j0 * dk_ld, static_cast<int>(dk_ld));
        };
        for (int64_t j0 = w.j_begin; j0 < j_end; j0 += bk) {
          const int nk = static_cast<int>(std::min<int64_t>(bk, S - j0));
          causal_parts(is_causal, causal_offset, S, i0, n, j0, nk,  // rows that see none add no gradient
                       [&](int a0, int rows, int seen) { tile(a0, rows, j0, seen); });
        }
      }
    }
  });
  setup.finish(dq);
}

void flash_backward_(const at::Tensor& dout, const at::Tensor& q4, const at::Tensor& k3, const at::Tensor& v3,
                     const at::Tensor& lse2, const at::Tensor& delta, const at::Tensor& dq, const at::Tensor& dk,
                     const at::Tensor& dv, const std::optional<at::Tensor>& mask,
                     const std::optional<at::Tensor>& mask_offsets, double scale, bool is_causal, int64_t causal_offset, int64_t block_q,
                     int64_t block_k, bool bf16_emulated, int64_t sgemm_route) {
  if (q4.scalar_type() == at::kBFloat16) {
    backward_tiles(GemmBf16{!bf16_emulated}, dout, q4, k3, v3, lse2, delta, dq, dk, dv, mask, mask_offsets, scale,
                   is_causal, causal_offset, block_q, block_k);
  } else {
    backward_tiles(Gemm32{sgemm_route}, dout, q4, k3, v3, lse2, delta, dq, dk, dv, mask, mask_offsets, scale, is_causal,
                   causal_offset, block_q, block_k);
  }
}

// Whether this build's bf16 GEMM runs on the CPU's bf16 instructions (compiled with AVX512_BF16).
bool bf16_units() { return bf16_gemm_native(); }

// Whether this build has the float32 GEMM route `route` (SgemmRoute, sgemm.h).
bool sgemm_route_built_op(int64_t route) { return sgemm_route_built(route); }

// c = alpha * op(a) op(b) + beta * c on one float32 GEMM route, single-threaded: the product
// each tile of the kernels runs, exposed for its parity tests and `attnlab bench --gemm`.
// a, b, c are 2-D float32 CPU tensors with unit column stride; op = transpose when ta / tb.
void tile_gemm_(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, bool ta, bool tb, double alpha,
                double beta, int64_t route) {
  for (const at::Tensor* t : {&a, &b, &c})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(1) == 1,
                "attnlab tile_gemm_: a, b, c must be 2-D float32 CPU tensors with unit column stride");
  const int64_t m = ta ? a.size(1) : a.size(0), k = ta ? a.size(0) : a.size(1);
  const int64_t n = tb ? b.size(0) : b.size(1), kb = tb ? b.size(1) : b.size(0);
  TORCH_CHECK(kb == k && c.size(0) == m && c.size(1) == n, "attnlab tile_gemm_: shapes do not chain");
  TORCH_CHECK(sgemm_route_built(route), "attnlab tile_gemm_: this build has no route ", route);
  auto ld = [](const at::Tensor& t) { return static_cast<int>(std::max<int64_t>(t.stride(0), std::max<int64_t>(t.size(1), 1))); };
  sgemm(route, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), static_cast<float>(alpha),
        a.data_ptr<float>(), ld(a), b.data_ptr<float>(), ld(b), static_cast<float>(beta), c.data_ptr<float>(), ld(c));
}

// c = alpha * op(a) op(b) + beta * c on the bf16 GEMM (bf16_gemm.h), single-threaded, a and b
// bf16, c float32: on the bf16 instructions (units, in a build that has them) or widened to float32;
// exposed for its parity test (tests/kernels/test_bf16_gemm.py). Strides as tile_gemm_'s.
void tile_gemm_bf16_(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, bool ta, bool tb, double alpha,
                     double beta, bool units) {
  for (const at::Tensor* t : {&a, &b, &c})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == (t == &c ? at::kFloat : at::kBFloat16) && t->device().is_cpu() &&
                    t->stride(1) == 1,
                "attnlab tile_gemm_bf16_: a, b must be 2-D bf16 and c 2-D float32 CPU tensors, unit column stride");
  const int64_t m = ta ? a.size(1) : a.size(0), k = ta ? a.size(0) : a.size(1);
  const int64_t n = tb ? b.size(0) : b.size(1), kb = tb ? b.size(1) : b.size(0);
  TORCH_CHECK(kb == k && c.size(0) == m && c.size(1) == n, "attnlab tile_gemm_bf16_: shapes do not chain");
  auto ld = [](const at::Tensor& t) { return static_cast<int>(std::max<int64_t>(t.stride(0), std::max<int64_t>(t.size(1), 1))); };
  gemm_bf16(ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), static_cast<float>(alpha),
            static_cast<const uint16_t*>(a.data_ptr()), ld(a), static_cast<const uint16_t*>(b.data_ptr()), ld(b),
            static_cast<float>(beta), c.data_ptr<float>(), ld(c), units);
}

}  // namespace

TORCH_LIBRARY(attnlab_native, m) {
  m.def("flash_forward(Tensor q4, Tensor k3, Tensor v3, Tensor? mask, Tensor? mask_offsets, float scale2, bool is_causal, int causal_offset, int block_q, int block_k, bool bf16_emulated=False, int sgemm=0) -> (Tensor, Tensor)");
  m.def("flash_backward_(Tensor dout, Tensor q4, Tensor k3, Tensor v3, Tensor lse2, Tensor delta, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor? mask, Tensor? mask_offsets, float scale, bool is_causal, int causal_offset, int block_q, int block_k, bool bf16_emulated=False, int sgemm=0) -> ()");
  m.def("flash_forward_(Tensor q4, Tensor k3, Tensor v3, Tensor(a!) out, Tensor(b!) lse2, Tensor? mask, Tensor? mask_offsets, float scale2, bool is_causal, int causal_offset, int block_q, int block_k, bool bf16_emulated=False, int sgemm=0) -> ()");
  m.def("bf16_units() -> bool");
  m.def("sgemm_route_built(int route) -> bool");
  m.def("tile_gemm_(Tensor a, Tensor b, Tensor(a!) c, bool ta, bool tb, float alpha, float beta, int route) -> ()");
  m.def("tile_gemm_bf16_(Tensor a, Tensor b, Tensor(a!) c, bool ta, bool tb, float alpha, float beta, bool units) -> ()");
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("flash_forward", &flash_forward);
  m.impl("flash_forward_", &flash_forward_);
  m.impl("flash_backward_", &flash_backward_);
  m.impl("tile_gemm_", &tile_gemm_);
  m.impl("tile_gemm_bf16_", &tile_gemm_bf16_);
}

TORCH_LIBRARY_IMPL(attnlab_native, CompositeExplicitAutograd, m) {
  m.impl("bf16_units", &bf16_units);
  m.impl("sgemm_route_built", &sgemm_route_built_op);
}
