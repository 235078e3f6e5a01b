// attnlab's native block-sparse kernels: the forward and FlashAttention-2 backward of
// flash.cpp, visiting only the (query block, key block) tiles an attnlab.flex BlockMask keeps.
//
// Why a second kernel: flash.cpp walks every key block of a row (or stops at the causal
// diagonal) and reads a dense (L, S) mask; a sliding window of 1024 at L = 16384 would do 16x
// the work and read 256 MiB of mask. Here each query block i has a list of key blocks j
// (compressed rows, built once from the BlockMask by attnlab.kernels.block_sparse):
//
//     full    block: S_ij = scale2 * Q_i K_j^T, no mask work at all
//     partial block: the same, then the packed bits (bit c % 8 of byte c / 8 of the tile's row a;
//                    1 = attend) set the hidden scores to -inf before the row pass
//     empty   block: not in the list, never touched
//
// The online softmax per row is flash.cpp's (m_i, l_i, acc in base 2; row_max and row_exp from kernels.h).
// The common score mods run here too (ScoreMod: ALiBi and relative-position bias tables, with
// the table's gradient, and tanh soft-capping); any other score_mod runs attnlab.flex's pure path.
//
// Layout (as flash.cpp; only the last dim must be dense):
//     q4 (Nb, r, L, E)   k3 (Nb, S, E)   v3 (Nb, S, Ev)     r query heads per key/value head
//     row_ptr (P * nq + 1) int64: the entries of plane p's query block i are
//                                 row_ptr[p * nq + i] .. row_ptr[p * nq + i + 1]
//     cols    (nnz) int64: key block index of each entry, ascending within a row
//     bit_idx (nnz) int64: the entry's tile in bits, or -1 for a full block
//     bits    (n_partial, bq, ceil(bk / 8)) uint8 (any block size: a row's last byte is padded)
//     plane_of_head (Nb * r) int64: the mask plane of query head nb * r + h (planes broadcast
//                                   over batch or heads, as the BlockMask's B / H = None)
//
// Work balance: rows of a causal or document mask have very different numbers of blocks, so
// tasks are sorted by their block count (largest first) and handed out one at a time from an
// atomic counter, rather than split into equal contiguous ranges.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <atomic>
#include <numeric>
#include <type_traits>
#include <optional>
#include <vector>

namespace {

struct BlockPlan {
  const int64_t* row_ptr;
  const int64_t* cols;
  const int64_t* bit_idx;
  const uint8_t* bits;
  const int64_t* plane_of_head;
  int64_t nq;
  int bq, bk;

  int64_t begin(int64_t head, int64_t i) const { return row_ptr[plane_of_head[head] * nq + i]; }
  int64_t end(int64_t head, int64_t i) const { return row_ptr[plane_of_head[head] * nq + i + 1]; }

  // the hidden scores of a partial tile's rows 0..n-1 (nk keys) become -inf
  void apply(float* tile, int64_t entry, int n, int nk) const {
    const int64_t idx = bit_idx[entry];
    if (idx < 0) return;  // full block: nothing to hide
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int bytes = (bk + 7) / 8;
    for (int a = 0; a < n; ++a) {
      const uint8_t* packed = bits + (idx * bq + a) * bytes;
      float* row = tile + static_cast<int64_t>(a) * nk;
      // a byte at a time: masks are runs (a window's edge, a document's end), so most bytes
      // are all-attend (nothing to do) or all-hidden (eight -inf); only edge bytes go bit by bit
      for (int c0 = 0; c0 < nk; c0 += 8) {
        const uint8_t byte = packed[c0 >> 3];
        if (byte == 0xFF) continue;
        const int width = std::min(8, nk - c0);
        if (byte == 0) {
          std::fill(row + c0, row + c0 + width, neg_inf);
          continue;
        }
        for (int c = 0; c < width; ++c) {
          if (!((byte >> c) & 1)) row[c0 + c] = neg_inf;
        }
      }
    }
  }
};

BlockPlan make_plan(const at::Tensor& row_ptr, const at::Tensor& cols, const at::Tensor& bit_idx,
                    const at::Tensor& bits, const at::Tensor& plane_of_head, int64_t heads, int64_t L,
                    int64_t block_q, int64_t block_k) {
  for (const at::Tensor* t : {&row_ptr, &cols, &bit_idx, &plane_of_head}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "attnlab block-sparse: row_ptr, cols, bit_idx, plane_of_head must be contiguous 1-D int64");
  }
  TORCH_CHECK(bits.scalar_type() == at::kByte && bits.is_contiguous() && bits.dim() == 3,
              "attnlab block-sparse: bits must be contiguous (n_partial, bq, ceil(bk / 8)) uint8");
  TORCH_CHECK(block_q > 0 && block_k > 0, "attnlab block-sparse: block sizes");
  TORCH_CHECK(bits.size(0) == 0 || (bits.size(1) == block_q && bits.size(2) == (block_k + 7) / 8),
              "attnlab block-sparse: bits tiles must be (block_q, ceil(block_k / 8))");
  TORCH_CHECK(plane_of_head.numel() == heads, "attnlab block-sparse: one plane per query head");
  TORCH_CHECK(cols.numel() == bit_idx.numel(), "attnlab block-sparse: cols and bit_idx differ in length");
  const int64_t nq = (L + block_q - 1) / block_q;
  TORCH_CHECK(nq == 0 || (row_ptr.numel() - 1) % nq == 0, "attnlab block-sparse: row_ptr length");
  BlockPlan plan{row_ptr.data_ptr<int64_t>(), cols.data_ptr<int64_t>(), bit_idx.data_ptr<int64_t>(),
                 bits.data_ptr<uint8_t>(), plane_of_head.data_ptr<int64_t>(), nq, static_cast<int>(block_q),
                 static_cast<int>(block_k)};
  return plan;
}

// The score mods the kernels run natively (attnlab.flex.mods: alibi, relative_bias, softcap),
// applied to the natural-log scores s = scale * q.k of a tile, in torch's order:
//     s = cap * tanh(s / cap)                       if cap > 0          (tanh soft-capping)
//     s = s + table[row_of_head[head], clamp(i - j, -(n-1), n-1) + n - 1]   if a table is given
// (ALiBi is the table -slope_h * (i - j), built by the caller), then times log2(e) for the
// base-2 row pass. The backward needs d s_mod / d s = 1 - tanh^2 (kept in `deriv`) and adds
// the bias gradient dS into dtable.
struct ScoreMod {
  const float* table = nullptr;
  const int64_t* row_of_head = nullptr;
  int64_t width = 0, n = 0;  // width = 2n - 1
  float cap = 0.0f;

  bool present() const { return table != nullptr || cap > 0.0f; }

  // tile (rows x nk) natural scores of query head `head`, queries i0.., keys j0..: mod, then base 2
  void apply(float* tile, float* deriv, int64_t head, int64_t i0, int64_t j0, int rows, int nk) const {
    const float* t_row = table != nullptr ? table + row_of_head[head] * width : nullptr;
    for (int a = 0; a < rows; ++a) {
      float* row = tile + static_cast<int64_t>(a) * nk;
      if (cap > 0.0f) {
        float* d_row = deriv != nullptr ? deriv + static_cast<int64_t>(a) * nk : nullptr;
        const float inv = 1.0f / cap;
        for (int c = 0; c < nk; ++c) {
          const float t = std::tanh(row[c] * inv);
          row[c] = cap * t;
          if (d_row != nullptr) d_row[c] = 1.0f - t * t;
        }
      }
      if (t_row != nullptr) {
        const int64_t d0 = i0 + a - j0;  // i - j at c = 0; it falls by one per key
        if (d0 <= n - 1 && d0 - (nk - 1) >= -(n - 1)) {  // no clamping on this row
          const float* base = t_row + d0 + n - 1;
          for (int c = 0; c < nk; ++c) row[c] += base[-c];
        } else {
          for (int c = 0; c < nk; ++c) row[c] += t_row[std::clamp<int64_t>(d0 - c, -(n - 1), n - 1) + n - 1];
        }
      }
#pragma omp simd
      for (int c = 0; c < nk; ++c) row[c] *= kLog2e;
    }
  }

  // dtable[row_of_head[head], clamp(i - j) + n - 1] += dS  (ds: rows x nk, natural units)
  void add_grad(float* dtable, const float* ds, int64_t head, int64_t i0, int64_t j0, int rows, int nk) const {
    float* g_row = dtable + row_of_head[head] * width;
    for (int a = 0; a < rows; ++a) {
      const float* ds_row = ds + static_cast<int64_t>(a) * nk;
      const int64_t d0 = i0 + a - j0;
      for (int c = 0; c < nk; ++c) g_row[std::clamp<int64_t>(d0 - c, -(n - 1), n - 1) + n - 1] += ds_row[c];
    }
  }
};

ScoreMod make_mod(const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& row_of_head, double cap,
                  int64_t heads) {
  ScoreMod mod;
  TORCH_CHECK(cap >= 0.0, "attnlab block-sparse: softcap must be >= 0 (0 = none)");
  mod.cap = static_cast<float>(cap);
  if (!table.has_value() || !table->defined()) return mod;
  TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 2 &&
                  table->size(1) % 2 == 1,
              "attnlab block-sparse: bias table must be contiguous float32 (rows, 2n - 1)");
  TORCH_CHECK(row_of_head.has_value() && row_of_head->scalar_type() == at::kLong && row_of_head->is_contiguous() &&
                  row_of_head->numel() == heads,
              "attnlab block-sparse: row_of_head must be int64 with one entry per query head");
  mod.table = table->data_ptr<float>();
  mod.row_of_head = row_of_head->data_ptr<int64_t>();
  mod.width = table->size(1);
  mod.n = (mod.width + 1) / 2;
  return mod;
}

void check_inputs(const at::Tensor& q4, const at::Tensor& k3, const at::Tensor& v3, const char* what) {
  TORCH_CHECK(q4.dim() == 4 && k3.dim() == 3 && v3.dim() == 3, what, ": bad ranks");
  TORCH_CHECK(q4.scalar_type() == at::kFloat || q4.scalar_type() == at::kBFloat16, what,
              ": float32 or bfloat16 (the bf16 route) only");
  for (const at::Tensor* t : {&q4, &k3, &v3}) {
    TORCH_CHECK(t->scalar_type() == q4.scalar_type() && t->device().is_cpu(), what, ": one dtype, on the CPU");
    TORCH_CHECK(t->stride(-1) == 1 || t->size(-1) == 1, what, ": the last dim must be dense");
  }
  TORCH_CHECK(k3.size(0) == q4.size(0) && v3.size(0) == q4.size(0) && k3.size(2) == q4.size(3) &&
                  v3.size(1) == k3.size(1),
              what, ": shapes");
}

int64_t lead(const at::Tensor& t, int64_t width) { return t.size(-2) > 1 ? t.stride(-2) : width; }

// out (Nb, r, L, Ev), lse2 (Nb, r, L) base 2 (-inf and output 0 on rows that see no key), float32.
// The bf16 route (q4, k3, v3 bfloat16): the GEMMs on bf16 operands (GemmBf16), P rounded to bf16
// for P V; the scores, the mods, the row pass and the state stay float32, as in flash.cpp.
template <class G>
void forward_blocks(const G& gemm, const at::Tensor& q4, const at::Tensor& k3, const at::Tensor& v3,
                    const at::Tensor& out, const at::Tensor& lse2, const at::Tensor& row_ptr, const at::Tensor& cols,
                    const at::Tensor& bit_idx, const at::Tensor& bits, const at::Tensor& plane_of_head,
                    const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& row_of_head, double cap,
                    double scale2_d, int64_t block_q, int64_t block_k) {
  using T = typename G::T;
  const int64_t Nb = q4.size(0), r = q4.size(1), L = q4.size(2), E = q4.size(3);
  const int64_t S = k3.size(1), Ev = v3.size(2);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const BlockPlan plan = make_plan(row_ptr, cols, bit_idx, bits, plane_of_head, Nb * r, L, block_q, block_k);
  const ScoreMod mod = make_mod(table, row_of_head, cap, Nb * r);
  const int bq = plan.bq, bk = plan.bk;
  const float scale2 = static_cast<float>(scale2_d);
  // with a score mod the GEMM gives natural-log scores, the mod works on those, then base 2
  const float gemm_scale = mod.present() ? scale2 / kLog2e : scale2;
  const T* q = static_cast<const T*>(q4.data_ptr());
  const T* k = static_cast<const T*>(k3.data_ptr());
  const T* v = static_cast<const T*>(v3.data_ptr());
  float* o = out.data_ptr<float>();
  float* lse = lse2.data_ptr<float>();
  const int64_t q_ld = lead(q4, E), k_ld = lead(k3, E), v_ld = lead(v3, Ev);
  TORCH_CHECK(q_ld >= E && k_ld >= E && v_ld >= Ev, "attnlab block-sparse forward: rows must not overlap");

  const int64_t nq = plan.nq;
  std::vector<int64_t> costs(static_cast<size_t>(Nb * r * nq));
  for (int64_t t = 0; t < Nb * r * nq; ++t) costs[t] = plan.end(t / nq, t % nq) - plan.begin(t / nq, t % nq);
  const std::vector<int64_t> order = largest_first(costs);

  const int64_t per_thread = static_cast<int64_t>(bq) * bk + static_cast<int64_t>(bq) * Ev + 2 * bq;
  std::vector<float> scratch(static_cast<size_t>(per_thread * at::get_num_threads()));
  const bool rounds = !std::is_same<T, float>::value;
  std::vector<T> p_ops(rounds ? static_cast<size_t>(bq) * bk * at::get_num_threads() : 0);  // P as an operand
  for_each_dynamic(order, [&](int64_t task) {
    float* s = scratch.data() + per_thread * at::get_thread_num();
    T* p_buf = rounds ? p_ops.data() + static_cast<int64_t>(bq) * bk * at::get_thread_num() : nullptr;
    float* acc = s + static_cast<int64_t>(bq) * bk;
    float* m_i = acc + static_cast<int64_t>(bq) * Ev;
    float* l_i = m_i + bq;
    const int64_t head = task / nq, i = task % nq;  // head = nb * r + h
    const int64_t nb = head / r, h = head % r;
    const int64_t i0 = i * bq;
    const int n = static_cast<int>(std::min<int64_t>(bq, L - i0));
    const int64_t e0 = plan.begin(head, i), e1 = plan.end(head, i);
    if (e0 == e1) return;  // no visible key: out stays 0, lse2 -inf
    const T* q_tile = q + nb * q4.stride(0) + h * q4.stride(1) + i0 * q_ld;
    const T* k_head = k + nb * k3.stride(0);
    const T* v_head = v + nb * v3.stride(0);
    std::fill(m_i, m_i + n, neg_inf);
    std::fill(l_i, l_i + n, 0.0f);
    std::fill(acc, acc + static_cast<int64_t>(n) * Ev, 0.0f);
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t j0 = plan.cols[e] * bk;
      const int nk = static_cast<int>(std::min<int64_t>(bk, S - j0));
      // S_ij = scale2 * Q_i K_j^T   (n, nk), or the score mod of scale * Q_i K_j^T
      gemm(false, true, n, nk, static_cast<int>(E), gemm_scale, q_tile, static_cast<int>(q_ld), k_head + j0 * k_ld,
           static_cast<int>(k_ld), 0.0f, s, nk);
      if (mod.present()) mod.apply(s, nullptr, head, i0, j0, n, nk);
      plan.apply(s, e, n, nk);
      online_update(s, n, nk, [nk](int64_t, float*) { return nk; }, m_i, l_i, acc, Ev);  // hidden: -inf
      // acc += P~ V_j   (n, Ev)
      gemm(false, false, n, static_cast<int>(Ev), nk, 1.0f, gemm.operand(s, static_cast<int64_t>(n) * nk, p_buf), nk,
           v_head + j0 * v_ld, static_cast<int>(v_ld), 1.0f, acc, static_cast<int>(Ev));
    }
    float* o_tile = o + (head * L + i0) * Ev;
    float* lse_tile = lse + head * L + i0;
    finish_rows(acc, m_i, l_i, n, Ev, o_tile, Ev, lse_tile, 1);  // O_i = acc / l_i, lse2_i
  });
}

std::tuple<at::Tensor, at::Tensor> block_sparse_forward(const at::Tensor& q4, const at::Tensor& k3,
                                                        const at::Tensor& v3, const at::Tensor& row_ptr,
                                                        const at::Tensor& cols, const at::Tensor& bit_idx,
                                                        const at::Tensor& bits, const at::Tensor& plane_of_head,
                                                        const std::optional<at::Tensor>& table,
                                                        const std::optional<at::Tensor>& row_of_head, double cap,
                                                        double scale2, int64_t block_q, int64_t block_k,
                                                        bool bf16_emulated, int64_t sgemm_route) {
  check_inputs(q4, k3, v3, "attnlab block-sparse forward");
  const int64_t Nb = q4.size(0), r = q4.size(1), L = q4.size(2);
  const at::TensorOptions f32 = q4.options().dtype(at::kFloat);
  at::Tensor out = at::zeros({Nb, r, L, v3.size(2)}, f32);
  at::Tensor lse2 = at::full({Nb, r, L}, -std::numeric_limits<float>::infinity(), f32);
  if (Nb == 0 || r == 0 || L == 0 || k3.size(1) == 0) return {out, lse2};
  if (q4.scalar_type() == at::kBFloat16) {
    forward_blocks(GemmBf16{!bf16_emulated}, q4, k3, v3, out, lse2, row_ptr, cols, bit_idx, bits, plane_of_head,
                   table, row_of_head, cap, scale2, block_q, block_k);
  } else {
    forward_blocks(Gemm32{sgemm_route}, q4, k3, v3, out, lse2, row_ptr, cols, bit_idx, bits, plane_of_head, table, row_of_head,
                   cap, scale2, block_q, block_k);
  }
  return {out, lse2};
}

// FlashAttention-2's backward over the visited tiles (flash.cpp's flash_backward_, same
// formulas), adding into dq (Nb, r, L, E), dk (Nb, S, E), dv (Nb, S, Ev). delta (Nb, r, L) is
// D_i = rowsum(dO_i * O_i) minus the gradient reaching lse (d lse / d s = P), so one formula
// covers both. One task per key/value head and chunk of its key blocks (BackwardSetup: single
// writer of its dK, dV rows; with fewer heads than threads the chunks keep every thread busy).
template <class G>
void backward_blocks(const G& gemm, const at::Tensor& dout, const at::Tensor& q4, const at::Tensor& k3,
                     const at::Tensor& v3, const at::Tensor& lse2, const at::Tensor& delta, const at::Tensor& dq,
                     const at::Tensor& dk, const at::Tensor& dv, const at::Tensor& row_ptr, const at::Tensor& cols,
                     const at::Tensor& bit_idx, const at::Tensor& bits, const at::Tensor& plane_of_head,
                     const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& row_of_head,
                     double cap, const std::optional<at::Tensor>& dtable, double scale_d, int64_t block_q,
                     int64_t block_k) {
  using T = typename G::T;
  const BackwardSetup<T> setup(dout, q4, k3, v3, lse2, delta, dq, dk, dv, block_k, "attnlab block-sparse backward");
  if (setup.empty()) return;
  const int64_t Nb = setup.Nb, r = setup.r, L = setup.L, E = setup.E, S = setup.S, Ev = setup.Ev;
  const BlockPlan plan = make_plan(row_ptr, cols, bit_idx, bits, plane_of_head, Nb * r, L, block_q, block_k);
  const ScoreMod mod = make_mod(table, row_of_head, cap, Nb * r);
  const bool table_grad = dtable.has_value() && dtable->defined();
  TORCH_CHECK(!table_grad || (mod.table != nullptr && dtable->sizes() == table->sizes() &&
                              dtable->scalar_type() == at::kFloat && dtable->is_contiguous()),
              "attnlab block-sparse backward: dtable must be a contiguous float32 tensor shaped like table");
  const int bq = plan.bq, bk = plan.bk;
  const int64_t nq = plan.nq;
  const float scale = static_cast<float>(scale_d);
  const float scale2 = scale * kLog2e;  // the forward's base-2 scores
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t q_ld = setup.q_ld, do_ld = setup.do_ld, k_ld = setup.k_ld, v_ld = setup.v_ld;
  const int64_t dk_ld = setup.dk_ld, dv_ld = setup.dv_ld;

  const int n_threads = at::get_num_threads();
  const int64_t n_tasks = setup.n_tasks;
  // a task's cost: its visited blocks (entries of the plan whose key block is in its chunk)
  auto in_task = [&](const typename BackwardSetup<T>::Task& w, int64_t e) {
    const int64_t j0 = plan.cols[e] * bk;
    return j0 >= w.j_begin && j0 < w.j_end;
  };
  std::vector<int64_t> costs(static_cast<size_t>(n_tasks), 0);
  for (int64_t t = 0; t < n_tasks; ++t) {
    const auto w = setup.task(t);
    for (int64_t h = 0; h < r; ++h)
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t e = plan.begin(w.nb * r + h, i); e < plan.end(w.nb * r + h, i); ++e) costs[t] += in_task(w, e);
  }
  const std::vector<int64_t> order = largest_first(costs);
  const int64_t tile = static_cast<int64_t>(bq) * bk;
  std::vector<float> scratch(static_cast<size_t>(3 * tile * n_threads));
  const bool rounds = !std::is_same<T, float>::value;
  std::vector<T> ops_buf(rounds ? static_cast<size_t>(tile) * n_threads : 0);  // P, then dS, as operands
  // the bias gradient: one private copy of the table per thread (tasks of different batches
  // share table rows), summed at the end
  at::Tensor dtable_parts;
  if (table_grad) dtable_parts = at::zeros({n_threads, dtable->size(0), dtable->size(1)}, dtable->options());
  const float gemm_scale = mod.present() ? scale : scale2;
  for_each_dynamic(order, [&](int64_t task) {
    const int thread = at::get_thread_num();
    float* p = scratch.data() + 3 * tile * thread;
    float* dp = p + tile;
    float* deriv = dp + tile;  // d s_mod / d s, with softcap
    T* buf = rounds ? ops_buf.data() + tile * thread : nullptr;
    float* dtable_task = table_grad ? dtable_parts.data_ptr<float>() + thread * dtable->numel() : nullptr;
    const typename BackwardSetup<T>::Task w = setup.task(task);
    const int64_t nb = w.nb;
    const T *k_head = w.k_head, *v_head = w.v_head;
    float *dk_head = w.dk_head, *dv_head = w.dv_head;
    for (int64_t h = 0; h < r; ++h) {
      const int64_t head = nb * r + h;
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t i0 = i * bq;
        const int n = static_cast<int>(std::min<int64_t>(bq, L - i0));
        const auto rw = setup.rows(nb, h, i0, thread);
        const T *q_tile = rw.q, *do_tile = rw.dout;
        float* dq_tile = rw.dq;
        for (int64_t e = plan.begin(head, i); e < plan.end(head, i); ++e) {
          if (!in_task(w, e)) continue;
          const int64_t j0 = plan.cols[e] * bk;
          const int nk = static_cast<int>(std::min<int64_t>(bk, S - j0));
          // P = 2^(scale2 * Q_i K_j^T - lse2_i) (or of the score mod), hidden scores -inf first (2^-inf = 0)
          gemm(false, true, n, nk, static_cast<int>(E), gemm_scale, q_tile, static_cast<int>(q_ld), k_head + j0 * k_ld,
               static_cast<int>(k_ld), 0.0f, p, nk);
          if (mod.present()) mod.apply(p, deriv, head, i0, j0, n, nk);
          plan.apply(p, e, n, nk);
          for (int a = 0; a < n; ++a) {
            float* row = p + static_cast<int64_t>(a) * nk;
            const float m = rw.lse[a * rw.lse_stride];
            if (m == neg_inf) {  // a row that saw no key has no gradient
              std::fill(row, row + nk, 0.0f);
            } else {
              exp2_shifted(row, nk, m);
            }
          }
          tile_dv_ds(gemm, p, buf, dp, n, nk, static_cast<int>(Ev), do_tile, static_cast<int>(do_ld), v_head + j0 * v_ld,
                     static_cast<int>(v_ld), dv_head + j0 * dv_ld, static_cast<int>(dv_ld), rw.d,
                     rw.d_stride);
          if (dtable_task != nullptr) mod.add_grad(dtable_task, dp, head, i0, j0, n, nk);  // d bias = dS
          if (mod.cap > 0.0f) {  // through the soft-cap: dS_raw = dS * (1 - tanh^2)
            for (int64_t c = 0; c < static_cast<int64_t>(n) * nk; ++c) dp[c] *= deriv[c];
          }
          tile_dq_dk(gemm, dp, buf, n, nk, static_cast<int>(E), scale, k_head + j0 * k_ld, static_cast<int>(k_ld), dq_tile,
                     static_cast<int>(rw.dq_ld), q_tile, static_cast<int>(q_ld), dk_head + j0 * dk_ld,
                     static_cast<int>(dk_ld));
        }
      }
    }
  });
  setup.finish(dq);
  if (table_grad) dtable->add_(dtable_parts.sum(0));
}

void block_sparse_backward_(const at::Tensor& dout, const at::Tensor& q4, const at::Tensor& k3, const at::Tensor& v3,
                            const at::Tensor& lse2, const at::Tensor& delta, const at::Tensor& dq, const at::Tensor& dk,
                            const at::Tensor& dv, const at::Tensor& row_ptr, const at::Tensor& cols,
                            const at::Tensor& bit_idx, const at::Tensor& bits, const at::Tensor& plane_of_head,
                            const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& row_of_head,
                            double cap, const std::optional<at::Tensor>& dtable, double scale, int64_t block_q,
                            int64_t block_k, bool bf16_emulated, int64_t sgemm_route) {
  if (q4.scalar_type() == at::kBFloat16) {
    backward_blocks(GemmBf16{!bf16_emulated}, dout, q4, k3, v3, lse2, delta, dq, dk, dv, row_ptr, cols, bit_idx, bits,
                    plane_of_head, table, row_of_head, cap, dtable, scale, block_q, block_k);
  } else {
    backward_blocks(Gemm32{sgemm_route}, dout, q4, k3, v3, lse2, delta, dq, dk, dv, row_ptr, cols, bit_idx, bits, plane_of_head,
                    table, row_of_head, cap, dtable, scale, block_q, block_k);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab_native, m) {
  m.def("block_sparse_forward(Tensor q4, Tensor k3, Tensor v3, Tensor row_ptr, Tensor cols, Tensor bit_idx, Tensor bits, Tensor plane_of_head, Tensor? table, Tensor? row_of_head, float cap, float scale2, int block_q, int block_k, bool bf16_emulated=False, int sgemm=0) -> (Tensor, Tensor)");
  m.def("block_sparse_backward_(Tensor dout, Tensor q4, Tensor k3, Tensor v3, Tensor lse2, Tensor delta, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor row_ptr, Tensor cols, Tensor bit_idx, Tensor bits, Tensor plane_of_head, Tensor? table, Tensor? row_of_head, float cap, Tensor(d!)? dtable, float scale, int block_q, int block_k, bool bf16_emulated=False, int sgemm=0) -> ()");
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("block_sparse_forward", &block_sparse_forward);
  m.impl("block_sparse_backward_", &block_sparse_backward_);
}
