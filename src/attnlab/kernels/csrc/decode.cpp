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
//     as vLLM's: (num_pages, page_size, Hkv, E)): the streaming loop reads each page's rows in
//     place, one run of one stride at a time; the GEMM loop gathers a block's rows across pages.
//
// Two inner loops over a key block (mode): the GEMM loop widens the block into scratch and runs
// two BLAS GEMMs (for many rows: chunked prefill, speculative decoding); the streaming loop (for
// the few rows of a decode step) reads each K and V row once, in its stored dtype, straight into
// the n rows' dot products and AXPYs: no scratch copy of the block, no GEMM that packs it again
// (decode_stream.h: how far ahead it asks for rows, and one block's scores).
// int8 caches (a float32 scale per token and head, as ONNX Runtime's and vLLM's): the streaming
// loop takes the dot product on the int8 row and scales it once (in integers against the query
// rounded to int16 when int8_dot = 1: idots2), and scales P by the value row's scale before its
// AXPY; the GEMM loop dequantises the block into its scratch (many rows share it).
//
// Work is split into tasks of about `chunk` keys of one head, over the keys each head really
// has (seqlens, the causal stop), so unequal caches give equal tasks.
//
// The online softmax per row is flash.cpp's (m_i, l_i, acc in base 2; row_max and row_exp from kernels.h).
//
//     q4      (Nb, r, L, E) float32, contiguous (row a = h * L + i)
//     k, v    dense: (Nb, S, E) / (Nb, S, Ev) views;  paged: (P, page, Hkv, E) / (P, page, Hkv, Ev)
//     table   paged only: (B, max_pages) int64, logical page -> pool page (Nb = B * Hkv)
//     seqlens optional (B,) int64: keys of batch b (default S), as flash_attn_with_kvcache's
//     k_scale, v_scale  int8 caches only: float32 (Nb, S) (dense) or (P, page, Hkv) (paged)
//     scale2  the softmax scale times log2(e)
//     plan    the call's integers, in this order (decode.py's PLAN_FIELDS: DecodePlan.codes):
//             Hkv, S (keys of the longest sequence), causal, chunk (keys a task; 0: the kernel's
//             choice), block_k (keys a block), mode (0: the GEMM loop, 1: streaming), sgemm (the
//             float32 GEMM route's code), int8_dot, bf16_dot, as below
//     causal  0: none; 1: top-left (SDPA's is_causal: row i sees keys 0..i);
//             2: bottom-right (row i sees keys 0..S_b - L + i: new tokens after the cache)
//     int8_dot  int8 caches on the streaming loop: 0 each element widened to float32; 1 integer dot
//             products against the query rounded to int16 per row (E % 16 == 0, E <= 512); 3 the
//             same with 9-16 rows across a zmm's lanes (decode_lanes.h, E % 32 == 0)
//     bf16_dot  bf16 caches on the streaming loop, on vdpbf16ps where the build has AVX512_BF16 (else
//             each element widened to float32): bit 0 the scores, against the query's bf16 rows
//             (E % 16 == 0, a query that is bf16 already: bf16_query_rows); bit 1 the value pass,
//             P~ rounded to bf16 (Ev % 32 == 0: bvalues); bit 2 the scores with 9-16 rows across a
//             zmm's lanes (decode_lanes.h)
// Returns out (Nb, r, L, Ev) float32, lse2 (Nb, r, L) (base 2; -inf where a row saw no key) and a
// bool scalar: true when some score or output was NaN or inf, or some lse2 NaN or +inf (the result
// is then not to be used).
// There is no backward: decoding runs without gradients (attnlab.decoding refuses them).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"
#include "decode_sources.h"  // where a block's rows are: dense views or pages
#include "decode_dots.h"  // the streaming loop's dot products
#include "decode_bf16.h"  // a bf16 cache's scores and values on vdpbf16ps
#include "decode_lanes.h"  // a bf16 decode step's 9-16 rows a head across one vector's lanes
#include "decode_values.h"  // the streaming loop's value pass (register tiles)
#include "decode_stream.h"  // the streaming loop: how far ahead it asks, and one block's scores

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// f(T{}) for the cache's stored element type T
template <class F>
inline void with_row_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: f(int8_t{}); break;
  }
}

// the keys row a of head nb sees end at limit(a); the head's last key (seqlens, the causal stop)
struct Span {
  int64_t nb, j_begin, j_end;
};

// Keys per tile of the stored-order block (stored_block): a tile is this many rows of one head, the
// G heads' tiles of the same keys in turn. Paged against contiguous, q (1, 32, 1, 128) against (1, 8,
// S, 128), one thread, CPU time, 2-core AVX2 EPYC (Zen 3), 2026-12-03, the orders alternated in one
// process (S = 32768, nine rounds): 8 keys 1.16-1.33x (fp32 / bf16 / int8), 4 keys 1.21-1.49x, 16
// keys 1.43-1.52x; the head-by-head order before it 1.61-1.84x.
// On a 2-core EPYC Zen 5 (2026-12-05, q (1, 32, Lq, 128) against (1, 8, 32768, 128) in pages of 16,
// one thread, CPU time, 8 and 16 keys alternated, three or four rounds) the best tile was one of the
// same bytes, not keys: fp32 8 keys 0.99-1.09x (Lq = 4) and 1.26-1.36x (Lq = 1) against 16 keys'
// 1.12-1.19x and 1.47-1.63x; bf16 16 keys 1.17-1.37x and 1.31-1.33x against 8 keys' 1.32-1.50x and
// 1.40-1.52x; int8 16 keys (its pages' run) 1.04-1.11x and 0.97-1.10x against 8 keys' 1.16-1.24x and
// 0.97-1.02x. So a tile is STORED_TILE_BYTES of a head's rows (8 float32 rows of 128, 16 bf16, 32
// int8), at least 4 and at most 32 keys (a page's run caps it too).
constexpr int64_t STORED_TILE_BYTES = 4096;
inline int64_t stored_keys(int64_t row_bytes) {
  return std::clamp<int64_t>(STORED_TILE_BYTES / std::max<int64_t>(row_bytes, 1), 4, 32);
}

// One block of nk keys (from j0) of a task's G heads whose rows are interleaved by head (vLLM's
// (page, Hkv, E) pages): scores, the online-softmax step, and acc += P~ V, each head's into its own
// scores (s + g * n * bk) and state (states + g * state). Head by head, each head's run of a page read
// one 512-byte piece of every 4 KiB of the page, which neither the hardware prefetcher nor the
// explicit one-run-at-a-time prefetches kept fed: a paged decode step took 1.5-1.8x the contiguous
// cache's (the numbers above). Here the block is read in stored order, a tile of keys at a time,
// every head's tile of those keys in turn, so each 4 KiB is read whole before the next; while a tile
// is used, the same head's next tile is asked for (its K rows in the score pass, its V rows in the
// value pass), one round of G tiles ahead. q (1, 32, 1, 128), one thread, as above, the old and new
// builds in turn: the paged step then takes 1.16-1.22x the contiguous one at S = 32768 (was
// 1.58-1.92x) and 1.06-1.27x at 4096 (was 1.26-1.65x); at S = 1024 (in L3) 0.80-0.94x. Also
// tried, within the noise or worse: the V rows asked for into L2 during the score pass, the next
// block's K rows during the value pass, a tile two or three ahead, 16- and 32-key blocks, and the
// value pass head by head over those L2 rows (1.28-1.42x against 1.11-1.27x).
template <class T, class Visible>
void stored_block(const RowSource& ks, const RowSource& vs, const ScaleSource& kss, const ScaleSource& vss, bool int8,
                  const Span& task, int64_t j0, int nk, int64_t G, int64_t n, int64_t E, int64_t Ev, float scale2,
                  const float* q, const int16_t* q_int16, const float* q_scale, const c10::BFloat16* q_bf16,
                  const void* q_lanes, bool bf16_values, float* s, int bk, float* kscale, float* vscale, float* states,
                  int64_t state, const Visible& visible, bool sees_all, std::atomic<bool>& saw_nonfinite) {
  const T* kb = reinterpret_cast<const T*>(ks.base);
  const T* vb = reinterpret_cast<const T*>(vs.base);
  // a tile: m <= tile_keys keys from key j (one stride: inside a page); head g's rows at + g * s_head
  const int64_t tile_keys = stored_keys(E * static_cast<int64_t>(sizeof(T)));
  auto tile = [&](const RowSource& src, int j, int64_t* off) {
    int64_t run;
    *off = src.locate(task.nb, j0 + j, &run);
    return static_cast<int>(std::min<int64_t>({run, tile_keys, static_cast<int64_t>(nk - j)}));
  };
  auto next = [&](const RowSource& src, int j, int m, int64_t* off) -> int {  // the tile after, or 0 rows
    if (j0 + j + m >= task.j_end) return 0;
    int64_t run;
    *off = src.locate(task.nb, j0 + j + m, &run);
    return static_cast<int>(std::min<int64_t>(run, m));
  };
  const bool v_early = q_lanes != nullptr && !int8;  // bf16's lane steps ask for the value rows into L2
  const bool v_l2 = !v_early && bf16_values;  // and so do its other steps, at once (below)
  // a tile's rows of the G heads one after another (pages (page, Hkv, E) read for all their heads):
  // bf16's lane steps then ask for the next tile's K and this tile's V as runs of lines, head g
  // for its share of each (RunLines), not head g's rows by lists
  const bool runs = v_early && ks.s_head == E && ks.s_row == G * E && vs.s_head == Ev && vs.s_row == G * Ev;
  // and, for a bf16 output and a block every row sees whole (sees_all), the scores kept in lanes
  // (lane_softmax; its pairs of keys need every tile to start on an even key)
  const bool whole = sees_all && runs && bf16_values && tile_keys % 2 == 0 &&
                     (ks.table == nullptr || ks.by_page.d % 2 == 0);
  uint16_t *pl = nullptr, *pp = nullptr;
  float* kept = whole ? lane_scratch(G, nk, &pl, &pp) : nullptr;
  for (int j = 0, m; j < nk; j += m) {  // S_j = scale2 * Q K_j^T, tile by tile in stored order
    int64_t off, noff = 0, voff = 0;
    m = tile(ks, j, &off);
    const int ahead = next(ks, j, m, &noff);
    if (v_early || v_l2) tile(vs, j, &voff);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t nb = task.nb + g;
      float* kscale_g = kscale + g * bk;
      if (int8) kss.read(ks, nb, j0 + j, m, kscale_g + j);
      // the head's next tile: the lane kernels ask for it as this tile's dot products run (a share
      // each step: paged bf16 at Lq = 4, q (1, 32, 4, 128) against 8 heads of 32768 keys in pages
      // of 16, one thread, Zen 4, 2026-12-05, alternated: 24.6-26.0 -> 21.5-22.8 ms), with this
      // tile's value rows into L2 (perf had the value pass waiting on them: 23.4-24.6 -> 19.5-21.2
      // ms, seven rounds; int8's 25.7-25.9 -> 26.2-27.2, not taken); the other loops at once, before
      // it (spread through stream_scores, float32 measured 37-39 -> 40-48 ms; value rows during the
      // scores were no better there, 2026-12-03). On those loops the next tile's key rows, and a bf16
      // cache's value rows of this tile, go into L2 (prefetcht1), not L1: a burst of 64 prefetcht0
      // per head filled L1's miss buffers and the score loop stalled on its key loads (perf: 60% of
      // its samples on them, against the contiguous loop's 31%). Paged / contiguous, both on huge
      // pages, q (1, 32, Lq, 128) against 8 heads of 32768 keys in pages of 16, 2 threads, Zen 4,
      // 2026-12-05, alternated with the build before, three rounds: bf16 Lq = 1 1.42-1.47x ->
      // 0.93-1.00x (without the value rows 1.24-1.29x), float32 Lq = 1 1.06-1.12x -> 0.90-1.00x,
      // Lq = 4 1.13-1.20x -> 1.07-1.09x; spreading the L1 asks over the bf16 two-key steps instead
      // was slower (1.63-1.68x). int8's key rows stay on L1: into L2 its Lq = 1 step in that loop
      // went 1.32-1.39x -> 1.07-1.08x, but a step right after other work (the reference attention's
      // freed temporaries) took 1.34-1.40 -> 2.2-2.3 ms at S = 4096, 7.3-7.4 -> 8.2-8.4 ms at 32768
      if (runs) {
        RunLines all, share;  // the G heads' lines; head g's share of them
        if (ahead > 0) all.k = line_run(kb + noff, ahead * G * E, &all.nk);
        all.v = line_run(vb + voff, m * G * Ev, &all.nv);
        const int k0 = static_cast<int>(g * all.nk / G), v0 = static_cast<int>(g * all.nv / G);
        share = RunLines{all.k + 64 * k0, all.v + 64 * v0, static_cast<int>((g + 1) * all.nk / G) - k0,
                         static_cast<int>((g + 1) * all.nv / G) - v0};
        stream_scores<T>(q + nb * n * E, n, E, kb + off + g * ks.s_head, ks.s_row, nullptr, m, nk, scale2,
                         s + g * n * bk + j, nullptr, 0, Ev, nullptr, nullptr, /*own_prefetch=*/false,
                         q_bf16 ? q_bf16 + nb * n * E : nullptr,
                         static_cast<const uint32_t*>(q_lanes) + nb * lane_block(E), nullptr, Stream{}, &share,
                         kept ? kept + LANE_ROWS * (nk * g + j) : nullptr);
        continue;
      }
      SpreadLines next_rows;
      if (q_lanes == nullptr) {
        constexpr int key_level = std::is_same_v<T, int8_t> ? 3 : 2;  // int8's into L1 (above), others' L2
        for (int i = 0; i < ahead; ++i) prefetch_row<T, key_level>(kb + noff + g * ks.s_head + i * ks.s_row, E);
        if (v_l2)
          for (int i = 0; i < m; ++i) prefetch_row<T, 2>(vb + voff + g * vs.s_head + i * vs.s_row, Ev);
      } else {
        for (int i = 0; i < ahead; ++i) next_rows.add_k(kb + noff + g * ks.s_head + i * ks.s_row, E);
      }
      const T* vrows = v_early ? vb + voff + g * vs.s_head : nullptr;
      stream_scores<T>(q + nb * n * E, n, E, kb + off + g * ks.s_head, ks.s_row, int8 ? kscale_g + j : nullptr, m, nk,
                       scale2, s + g * n * bk + j, vrows, vs.s_row, Ev, q_int16 ? q_int16 + nb * n * E : nullptr,
                       q_scale ? q_scale + nb * n : nullptr, /*own_prefetch=*/false,
                       q_bf16 ? q_bf16 + nb * n * E : nullptr,
                       q_lanes ? static_cast<const uint32_t*>(q_lanes) + nb * lane_block(E) : nullptr, &next_rows);
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // each head's online-softmax step over the block
    float* acc = states + g * state;
    float* sg = s + g * n * bk;
    if constexpr (std::is_same_v<T, c10::BFloat16> && kLaneBf16) {
      if (kept) {  // in lanes, head g's pairs of P~ at pp + 16 (nk + 1) g
        if (!all_finite(kept + LANE_ROWS * nk * g, LANE_ROWS * nk)) saw_nonfinite.store(true, std::memory_order_relaxed);
        lane_softmax<isa::F16, isa::B16>(kept + LANE_ROWS * nk * g, nk, n, acc + n * Ev, acc + n * Ev + n, acc, Ev, pl,
                                         pp + LANE_ROWS * (nk + 1) * g);
        continue;
      }
    }
    // a NaN or inf score would be swallowed by the row pass: flagged, as in the head-by-head loop
    if (!all_finite(sg, n * nk)) saw_nonfinite.store(true, std::memory_order_relaxed);
    online_update(sg, n, nk, visible, acc + n * Ev, acc + n * Ev + n, acc, Ev);
  }
  if constexpr (std::is_same_v<T, c10::BFloat16> && kLaneBf16) {
    // acc += P~ V head by head over the whole block (its rows through a pointer each: VListed), in
    // place of a tile at a time: a tile's pass loaded and stored acc (16 rows of 128: 256 of its
    // instructions) for every 16 keys, and its value rows are in L2 already (v_early). Each head's
    // first reader asks for its rows into L1, 32 keys ahead, and past the block for the next head's
    // first rows. Paged against contiguous, both on huge pages, q (1, 32, 4, 128) against 8 heads
    // of 32768 bf16 keys in pages of 16, Zen 4, 2026-12-05, alternated in one process: 2 threads
    // 1.13-1.15x -> 1.02-1.07x (1.09-1.11x without the asks), 1 thread 1.21-1.23x -> 1.06-1.11x.
    if (kept) {
      thread_local std::vector<const T*> rows;  // head 0's
      rows.resize(static_cast<size_t>(nk));
      for (int j = 0, m; j < nk; j += m) {
        int64_t off;
        m = tile(vs, j, &off);
        for (int i = 0; i < m; ++i) rows[j + i] = vb + off + i * vs.s_row;
      }
      for (int64_t g = 0; g < G; ++g)
        bvalues_from<PLanes>(pp + LANE_ROWS * (nk + 1) * g, 0, n, Ev,
                             VListed{rows.data(), g * vs.s_head, g + 1 < G ? (g + 1) * vs.s_head : -1, nk, Ev * 2},
                             nk, states + g * state);
      return;
    }
  }
  // each head's P~ (n, nk) as bf16, n * bk apart (scores kept in lanes took the whole-block pass above)
  uint16_t* pb = bf16_values ? p_as_bf16(s, G * n * bk) : nullptr;
  for (int j = 0, m; j < nk; j += m) {  // acc += P~ V_j, tile by tile in stored order
    int64_t off, noff = 0;
    m = tile(vs, j, &off);
    const int ahead = next(vs, j, m, &noff);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t nb = task.nb + g;
      float* sg = s + g * n * bk;
      if (int8) {  // P~ times the value rows' scales (l_i has taken P~ already)
        vss.read(vs, nb, j0 + j, m, vscale);
        for (int64_t a = 0; a < n; ++a)
          for (int i = 0; i < m; ++i) sg[a * nk + j + i] *= vscale[i];
      }
      for (int i = 0; i < ahead; ++i) prefetch_row(vb + noff + g * vs.s_head + i * vs.s_row, Ev);
      if constexpr (std::is_same_v<T, c10::BFloat16> && isa::kBf16x8) {
        if (pb) {
          bvalues(pb + g * n * bk + j, nk, n, Ev, vb + off + g * vs.s_head, vs.s_row, m, states + g * state);
          continue;
        }
      }
      stream_values<T>(sg + j, n, Ev, vb + off + g * vs.s_head, vs.s_row, m, nk, states + g * state,
                       /*own_prefetch=*/false);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_forward(const at::Tensor& q4, const at::Tensor& k, const at::Tensor& v,
                                                  const std::optional<at::Tensor>& table,
                                                  const std::optional<at::Tensor>& seqlens,
                                                  const std::optional<at::Tensor>& k_scale,
                                                  const std::optional<at::Tensor>& v_scale, double scale2_d,
                                                  at::IntArrayRef plan) {
  // the call's integers, named (decode.py's PLAN_FIELDS, in this order)
  TORCH_CHECK(plan.size() == 9, "attnlab native decode: plan must hold 9 integers (Hkv, S, causal, chunk, block_k, "
              "mode, sgemm, int8_dot, bf16_dot), got ", plan.size());
  const int64_t Hkv = plan[0], S = plan[1], causal = plan[2];
  int64_t chunk = plan[3];
  const int64_t block_k = plan[4], mode = plan[5], sgemm_route = plan[6], int8_dot = plan[7], bf16_dot = plan[8];
  TORCH_CHECK(q4.dim() == 4 && q4.scalar_type() == at::kFloat && q4.is_contiguous() && q4.device().is_cpu(),
              "attnlab native decode: q4 must be a contiguous float32 (Nb, r, L, E) CPU tensor");
  TORCH_CHECK(causal >= 0 && causal <= 2, "attnlab native decode: causal must be 0, 1 or 2");
  TORCH_CHECK(mode == 0 || mode == 1, "attnlab native decode: mode must be 0 (GEMM) or 1 (streaming)");
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
  const bool int8 = ks.dtype == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && k_scale->defined()) && int8 == (v_scale.has_value() && v_scale->defined()),
              "attnlab native decode: an int8 cache needs k_scale and v_scale, and only an int8 cache takes them");
  ScaleSource kss, vss;
  if (int8) {
    kss = make_scales(*k_scale, paged, "k_scale");
    vss = make_scales(*v_scale, paged, "v_scale");
  }

  const float neg_inf = -std::numeric_limits<float>::infinity();
  // out and lse2 are written whole by the merge below (a head with no key included), the parts by
  // their tasks: nothing is filled first (q (1, 32, 4, 128) against 16 keys, 2 threads, Zen 4,
  // 2026-12-05, alternated: a call 68.6-70.8 -> 63.0-63.8 us float32, 91.1-94.0 -> 88.8-90.0 bf16)
  at::Tensor out = at::empty({Nb, r, L, Ev}, q4.options());
  at::Tensor lse2 = at::empty({Nb, r, L}, q4.options());
  const int64_t n = r * L;  // rows of one task's tile
  if (Nb == 0 || n == 0 || S == 0 || Ev == 0) {
    out.zero_(), lse2.fill_(neg_inf);
    return {out, lse2, at::scalar_tensor(false, at::TensorOptions().dtype(at::kBool))};
  }
  TORCH_CHECK(block_k >= 1, "attnlab native decode: block_k must be positive");

  // A task reads G heads' keys together: G = 1 for head-major caches (each head's rows are one
  // stretch), G = Hkv when rows are interleaved by head (vLLM's (page, Hkv, E) pages): one head alone
  // would read one 512-byte piece of every 4 KiB, which the hardware prefetcher cannot follow (paged
  // fp32 measured 2x the dense time, and so did a dense (S, Hkv, E) view); the G heads together read
  // the block's bytes in order.
  const int64_t G = (ks.s_row != E || vs.s_row != Ev) ? Hkv : 1;
  const int64_t groups = Nb / G;
  // the keys each head really has (its seqlen, its causal stop: the same for a group's heads, one
  // sequence), and tasks of about `chunk` of them: unequal caches give equal tasks
  std::vector<int64_t> stop(static_cast<size_t>(groups));
  int64_t total = 0;
  for (int64_t gr = 0; gr < groups; ++gr) {
    const int64_t nb = gr * G;
    const int64_t S_b = lengths ? std::clamp<int64_t>(lengths[nb / Hkv], 0, S) : S;
    const int64_t shift = causal == 2 ? S_b - L : 0;
    stop[gr] = std::min<int64_t>(S_b, causal ? std::max<int64_t>(0, shift + L) : S_b);
    total += stop[gr];
  }
  if (chunk <= 0) {  // about 4 tasks per thread over every group's keys, at least 256 keys (decode.py's MIN_CHUNK)
    const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
    chunk = std::max<int64_t>(256, (total + want - 1) / std::max<int64_t>(want, 1));
    // and at most 16384 (decode.py's MAX_CHUNK): one fp32 accumulator over a whole head's 131072
    // keys was 1e-5 off float64, as far as torch's own SDPA; 16384-key tasks merged in float32 are not
    chunk = std::min<int64_t>(chunk, 16384);
    if (paged) chunk = (chunk + page - 1) / page * page;
  }
  // task (group, c) covers keys [c * chunk, ...) of the group's G heads; head nb's partial
  // results are parts first_part[nb] .. first_part[nb + 1] - 1, one per chunk
  std::vector<Span> tasks;
  std::vector<int64_t> first_part(static_cast<size_t>(Nb + 1), 0);
  int64_t n_parts = 0;
  for (int64_t gr = 0; gr < groups; ++gr) {
    const int64_t chunks = (stop[gr] + chunk - 1) / chunk;
    for (int64_t g = 0; g < G; ++g) first_part[gr * G + g] = n_parts, n_parts += chunks;
    for (int64_t j = 0; j < stop[gr]; j += chunk) tasks.push_back({gr * G, j, std::min(stop[gr], j + chunk)});
  }
  first_part[Nb] = n_parts;
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  const int bk = static_cast<int>(std::min<int64_t>(block_k, chunk));
  // the partial results of every head's chunks, merged per head below: (n_parts, n, Ev) and (n_parts, n)
  std::unique_ptr<float[]> part_o(new float[static_cast<size_t>(n_parts * n * Ev)]);
  std::unique_ptr<float[]> part_l(new float[static_cast<size_t>(n_parts * n)]);
  const float scale2 = static_cast<float>(scale2_d);
  const float* q = q4.data_ptr<float>();
  // The plan's dot products (decode.py's plan made them, from the same conditions) are checked
  // here, never second-guessed: a plan this build or these shapes cannot run is an error, so that
  // routes.explain() and the status name what a call takes. The one choice left to the kernel is
  // data-dependent: a query that is not bf16 already takes the float32 scores (bf16_query_rows).
  const bool bf16 = ks.dtype == at::kBFloat16;
  TORCH_CHECK(int8_dot == 0 || ((int8_dot == 1 || int8_dot == 3) && int8 && mode == 1 && E % 16 == 0 && E <= 512),
              "attnlab native decode: plan's int8_dot = ", int8_dot, " (1: int16 dot products) needs an int8 cache on ",
              "the streaming loop (mode 1) and E a multiple of 16 up to 512; got mode ", mode, ", E = ", E);
  TORCH_CHECK(!(int8_dot & 2) || (kLaneInt8 && n > 8 && n <= LANE_ROWS && E % 32 == 0),
              "attnlab native decode: plan's int8_dot bit 1 (the rows across a zmm's lanes) needs a build with ",
              "AVX512BW, 9 to 16 rows a head and E a multiple of 32; got ", n, " rows, E = ", E);
  TORCH_CHECK((bf16_dot & ~int64_t(7)) == 0 && (bf16_dot == 0 || (isa::kBf16x8 && bf16 && mode == 1 && E % 16 == 0)),
              "attnlab native decode: plan's bf16_dot = ", bf16_dot, " (vdpbf16ps) needs a build with AVX512_BF16 ",
              "(this one: ", isa::kBf16x8 ? "yes" : "no",
              "), a bf16 cache on the streaming loop and E a multiple of 16");
  TORCH_CHECK(!(bf16_dot & 2) || ((bf16_dot & 1) && Ev % 32 == 0),
              "attnlab native decode: plan's bf16_dot bit 1 (the value pass on vdpbf16ps) needs bit 0 and Ev a "
              "multiple of 32; got Ev = ", Ev);
  TORCH_CHECK(!(bf16_dot & 4) || ((bf16_dot & 1) && kLaneBf16 && n > 8 && n <= LANE_ROWS && E % 4 == 0),
              "attnlab native decode: plan's bf16_dot bit 2 (the rows across a zmm's lanes) needs bit 0, a build with "
              "512-bit vdpbf16ps and 9 to 16 rows a head; got ", n, " rows");
  // an int8 cache with int8_dot = 1: the query rows rounded to int16 once (idots2); E a multiple of
  // 16 (vpmaddwd's 16 lanes), E <= 512 (its int32 sums stay exact)
  const bool int16_dots = (int8_dot & 1) != 0;
  std::vector<int16_t> q_int16(int16_dots ? static_cast<size_t>(Nb * n * E) : 0);
  std::vector<float> q_scale(int16_dots ? static_cast<size_t>(Nb * n) : 0);
  if (int16_dots && !quantize_rows(q, Nb * n, E, q_int16.data(), q_scale.data()))
    return {out.zero_(), lse2.fill_(neg_inf), at::scalar_tensor(true, at::TensorOptions().dtype(at::kBool))};  // NaN or inf in q
  // a bf16 cache with bf16_dot bit 0: the query rows as bf16 once (bdots2), when that changes no
  // answer (bf16_query_rows), else the float32 route
  bool bf16_dots = (bf16_dot & 1) != 0;
  // and bit 1, the value pass on it (decode.py asks for it when the output is bf16, as P~ is
  // rounded to bf16 for it), 32 or 64 columns at a time
  const bool bf16_values = (bf16_dot & 2) != 0;
  std::vector<c10::BFloat16> q_bf16(bf16_dots ? static_cast<size_t>(Nb * n * E) : 0);
  if (bf16_dots) bf16_dots = bf16_query_rows(q, Nb * n, E, scale2, q_bf16.data());
  // bf16_dot bit 2: the scores on vdpbf16ps with a head's 9-16 rows across one zmm's lanes
  // (decode_lanes.h; decode.bf16_lanes asks for it, where the build has 512-bit vdpbf16ps; below 9
  // rows bdots2 wastes fewer lanes). Per head E / 2 * 16 bf16 pairs.
  // int8_dot bit 1: the same for an int8 cache's int16 dot products (lane_idots8), the rows' scales
  // after the pairs. Per head lane_block(E) uint32.
  const bool lanes = (bf16_dots && (bf16_dot & 4)) || (int16_dots && (int8_dot & 2));
  std::vector<uint32_t> q_lanes(lanes ? static_cast<size_t>(Nb * lane_block(E)) : 0);
  for (int64_t nb = 0; lanes && nb < Nb; ++nb) {
    uint32_t* dst = q_lanes.data() + nb * lane_block(E);
    if (int8) lay_int16_pairs_in_lanes(q_int16.data() + nb * n * E, q_scale.data() + nb * n, n, E, dst);
    else lay_pairs_in_lanes(q_bf16.data() + nb * n * E, n, E, dst);
  }
  auto lanes_of = [&](int64_t nb) -> const void* { return lanes ? q_lanes.data() + nb * lane_block(E) : nullptr; };

  // the streaming loop over rows interleaved by head (G > 1) reads each block in stored order
  const bool stored_order = mode == 1 && G > 1;
  // per-thread scratch: scores (n, bk), G heads' acc (n, Ev), m_i, l_i (n), key and value scales
  // (bk each), and (GEMM loop) a widened K and V block; in stored order scores and key scales per head
  const int64_t per_head = stored_order ? G : 1;
  const int64_t state = n * Ev + 2 * n;
  const int64_t per_thread = per_head * n * bk + G * state + (per_head + 1) * bk +
                             (mode == 0 ? static_cast<int64_t>(bk) * (E + Ev) : 0);
  std::vector<float> scratch(static_cast<size_t>(per_thread * at::get_num_threads()));
  std::atomic<bool> saw_nonfinite{false};
  at::parallel_for(0, n_tasks, 1, [&](int64_t begin, int64_t end) {
    float* s = scratch.data() + per_thread * at::get_thread_num();
    float* states = s + per_head * n * bk;  // head g: acc, m_i, l_i at states + g * state
    float* kscale = states + G * state;
    float* vscale = kscale + per_head * bk;
    float* kbuf = vscale + bk;
    float* vbuf = kbuf + static_cast<int64_t>(bk) * E;
    for (int64_t t = begin; t < end; ++t) {
      const Span& task = tasks[t];
      const int64_t S_b = lengths ? std::clamp<int64_t>(lengths[task.nb / Hkv], 0, S) : S;
      // row a = h * L + i sees keys [0, limit(i)): every key, or up to its causal diagonal
      const int64_t shift = causal == 2 ? S_b - L : 0;
      for (int64_t g = 0; g < G; ++g) {
        float* acc = states + g * state;
        std::fill(acc, acc + n * Ev, 0.0f);
        std::fill(acc + n * Ev, acc + n * Ev + n, neg_inf);
        std::fill(acc + n * Ev + n, acc + state, 0.0f);
      }
      for (int64_t j0 = task.j_begin; j0 < task.j_end;) {
        // the GEMM loop's block crosses pages (rows gathered into its scratch block); the streaming
        // loop's stays inside a page below SPAN_MIN_ROWS rows of head-major pages (Hkv = 1), and
        // spans pages above it and in stored order (read page by page, one online-softmax step)
        int64_t run = std::numeric_limits<int64_t>::max();
        if (mode == 1 && n < SPAN_MIN_ROWS && !stored_order) ks.locate(task.nb, j0, &run);
        const int nk = static_cast<int>(std::min<int64_t>({static_cast<int64_t>(bk), task.j_end - j0, run}));
        auto visible = [&](int64_t a, float*) {  // row a = h * L + i: query position i
          const int64_t seen = causal ? shift + a % L + 1 - j0 : nk;
          return static_cast<int>(std::clamp<int64_t>(seen, 0, nk));
        };
        // every row sees every key of the block (visible's least, at a % L = 0, is nk): where the
        // bf16 lane steps may keep the scores in lanes (lane_softmax)
        const bool sees_all = !causal || shift + 1 - j0 >= nk;
        if (stored_order) {  // rows interleaved by head: the block read in stored order (stored_block)
          with_row_type(ks.dtype, [&](auto tag) {
            stored_block<decltype(tag)>(ks, vs, kss, vss, int8, task, j0, nk, G, n, E, Ev, scale2, q,
                                        int16_dots ? q_int16.data() : nullptr, int16_dots ? q_scale.data() : nullptr,
                                        bf16_dots ? q_bf16.data() : nullptr, lanes_of(0), bf16_values, s, bk, kscale,
                                        vscale, states, state, visible, sees_all, saw_nonfinite);
          });
          j0 += nk;
          continue;
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t nb = task.nb + g;
          float* acc = states + g * state;
          float* m_i = acc + n * Ev;
          float* l_i = m_i + n;
          const float* qn = q + nb * n * E;
          if (mode == 1) {  // streaming: each row read once, as stored
            const bool dense = ks.table == nullptr;  // head-major rows: one stride through the task
            auto run_block = [&](auto tag) {
              using T = decltype(tag);
              const T* kb = reinterpret_cast<const T*>(ks.base);
              const T* vb = reinterpret_cast<const T*>(vs.base);
              if constexpr (std::is_same_v<T, c10::BFloat16> && kLaneBf16) {
                // a contiguous bf16 block on the lane kernel that every row sees whole: its scores
                // stay in lanes through the online softmax into the value pass (lane_softmax). A call
                // of its own: folded into the loop below, GCC stopped inlining lane_bdots8 there
                // (S = 32768, 2 threads, 8.62-8.79 -> 9.26-9.64 ms)
                if (lanes && bf16_values && dense && sees_all) {
                  uint16_t *pl, *pp;
                  float* kept = lane_scratch(1, nk, &pl, &pp);
                  int64_t run, vrun;
                  const int64_t off = ks.locate(nb, j0, &run), voff = vs.locate(nb, j0, &vrun);
                  stream_scores<T>(qn, n, E, kb + off, ks.s_row, nullptr, nk, nk, scale2, s, vb + voff, vs.s_row, Ev,
                                   nullptr, nullptr, /*own_prefetch=*/true, q_bf16.data() + nb * n * E, lanes_of(nb),
                                   nullptr, Stream{static_cast<int>(task.j_end - j0), j0 > task.j_begin}, nullptr,
                                   kept);
                  if (!all_finite(kept, LANE_ROWS * nk)) saw_nonfinite.store(true, std::memory_order_relaxed);
                  lane_softmax<isa::F16, isa::B16>(kept, nk, n, m_i, l_i, acc, Ev, pl, pp);
                  bvalues<PLanes>(pp, 0, n, Ev, vb + voff, vs.s_row, nk, acc);
                  return;
                }
              }
              // the block's runs of rows with one stride (one run, or a page each when it spans pages)
              for (int j = 0, m; j < nk; j += m) {
                int64_t run;
                const int64_t off = ks.locate(nb, j0 + j, &run);
                m = static_cast<int>(std::min<int64_t>(run, nk - j));
                if (int8) kss.read(ks, nb, j0 + j, m, kscale + j);
                int64_t vrun;  // head-major rows (G = 1 here): the same keys' value rows, asked for into L2 as the scores go
                const T* vrows = vb + vs.locate(nb, j0 + j, &vrun);
                stream_scores<T>(qn, n, E, kb + off, ks.s_row, int8 ? kscale + j : nullptr, m, nk, scale2, s + j,
                                 vrows, vs.s_row, Ev, int16_dots ? q_int16.data() + nb * n * E : nullptr,
                                 int16_dots ? q_scale.data() + nb * n : nullptr, /*own_prefetch=*/true,
                                 bf16_dots ? q_bf16.data() + nb * n * E : nullptr, lanes_of(nb), nullptr,
                                 dense ? Stream{static_cast<int>(task.j_end - j0 - j), j0 > task.j_begin} : Stream{});
              }
              // a NaN or inf score (from Q or K) would be swallowed by the row pass (its max and 2^x drop
              // NaN): flag it, so the caller redoes the call on the pure path; V's show in the output.
              // The check reads the scores in cache, never the K/V rows again.
              if (!all_finite(s, n * nk)) saw_nonfinite.store(true, std::memory_order_relaxed);
              online_update(s, n, nk, visible, m_i, l_i, acc, Ev);
              const uint16_t* pb = bf16_values ? p_as_bf16(s, n * nk) : nullptr;  // P~ (n, nk) as bf16
              for (int j = 0, m; j < nk; j += m) {
                int64_t run;
                const int64_t off = vs.locate(nb, j0 + j, &run);
                m = static_cast<int>(std::min<int64_t>(run, nk - j));
                if (int8) {  // P~ times the value rows' scales (l_i has taken P~ already)
                  vss.read(vs, nb, j0 + j, m, vscale);
                  for (int64_t a = 0; a < n; ++a)
                    for (int i = 0; i < m; ++i) s[a * nk + j + i] *= vscale[i];
                }
                if constexpr (std::is_same_v<T, c10::BFloat16> && isa::kBf16x8) {
                  if (pb) {
                    bvalues(pb + j, nk, n, Ev, vb + off, vs.s_row, m, acc);
                    continue;
                  }
                }
                stream_values<T>(s + j, n, Ev, vb + off, vs.s_row, m, nk, acc);
              }
            };
            with_row_type(ks.dtype, run_block);
          } else {  // GEMM: the block widened into scratch, two BLAS GEMMs (many rows)
            int64_t k_ld, v_ld;
            auto k_scales = [&](int64_t j, int m, float* out) { kss.read(ks, nb, j, m, out); };
            auto v_scales = [&](int64_t j, int m, float* out) { vss.read(vs, nb, j, m, out); };
            const float* k_rows = ks.rows(nb, j0, nk, E, kbuf, &k_ld, k_scales, kscale);
            // S_ij = scale2 * Q K_j^T   (n, nk): the group's heads and rows against one key block
            sgemm(sgemm_route, false, true, static_cast<int>(n), nk, static_cast<int>(E), scale2, qn, static_cast<int>(E),
                    k_rows, static_cast<int>(k_ld), 0.0f, s, nk);
            if (!all_finite(s, n * nk)) saw_nonfinite.store(true, std::memory_order_relaxed);
            online_update(s, n, nk, visible, m_i, l_i, acc, Ev);
            const float* v_rows = vs.rows(nb, j0, nk, Ev, vbuf, &v_ld, v_scales, vscale);
            // acc += P~ V_j   (n, Ev)
            sgemm(sgemm_route, false, false, static_cast<int>(n), static_cast<int>(Ev), nk, 1.0f, s, nk, v_rows,
                    static_cast<int>(v_ld), 1.0f, acc, static_cast<int>(Ev));
          }
        }
        j0 += nk;
      }
      const int64_t c = task.j_begin / chunk;  // the chunk's index among the group's
      for (int64_t g = 0; g < G; ++g) {
        float* acc = states + g * state;
        if constexpr (isa::kBf16x8)
          if (bf16_values) bvalues_finish(acc, n, Ev);  // acc's columns back in order (bvalue_tile's)
        const int64_t part = first_part[task.nb + g] + c;
        finish_rows(acc, acc + n * Ev, acc + n * Ev + n, n, Ev, part_o.get() + part * n * Ev, Ev,
                    part_l.get() + part * n, 1);
      }
    }
  });
  // join each head's parts: (o_c, lse_c) over disjoint keys -> (out, lse2), exactly
  float* o = out.data_ptr<float>();
  float* l = lse2.data_ptr<float>();
  at::parallel_for(0, Nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t parts = first_part[nb + 1] - first_part[nb];
      if (parts == 0) {  // no key: out 0, lse2 -inf, as SDPA's rows that see none
        std::fill(o + nb * n * Ev, o + (nb + 1) * n * Ev, 0.0f);
        std::fill(l + nb * n, l + (nb + 1) * n, neg_inf);
        continue;
      }
      merge_rows(part_o.get() + first_part[nb] * n * Ev, part_l.get() + first_part[nb] * n, parts, n, Ev,
                 o + nb * n * Ev, l + nb * n);
      // the output's NaN or inf (from V), and lse2's NaN or +inf (-inf: a row that saw no key), flagged
      // here so that the caller need not read the output again (torch.isfinite took 30 of a small
      // call's 130 us: q (1, 32, 4, 128) against 16 keys, 2 threads, 2-core EPYC Zen 5, 2026-12-04)
      bool bad = !all_finite(o + nb * n * Ev, n * Ev);
      for (int64_t a = 0; a < n; ++a) bad |= std::isnan(l[nb * n + a]) || l[nb * n + a] == -neg_inf;
      if (bad) saw_nonfinite.store(true, std::memory_order_relaxed);
    }
  });
  return {out, lse2, at::scalar_tensor(saw_nonfinite.load(), at::TensorOptions().dtype(at::kBool))};
}

// The dot-product instructions this build's streaming decode loop has (attnlab.kernels.native's
// status names them): bit 0 vdpbf16ps for bf16 caches (bdots2), bit 1 vpdpwssd for int8 caches
// (dot_pairs), bit 2 512-bit vdpbf16ps with AVX-512's float vectors (the lane kernel, decode_lanes.h),
// bit 3 512-bit int16 pairs (isa::I32: the int8 lane kernel).
// Without them: bf16 widened to float32, int8 on vpmaddwd and vpaddd.
int64_t decode_dot_instructions() {
  return (isa::kBf16x8 ? 1 : 0) | (isa::kVnni ? 2 : 0) | (kLaneBf16 ? 4 : 0) | (kLaneInt8 ? 8 : 0);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab_native, m) {
  m.def("decode_dot_instructions() -> int");
  m.def("decode_forward(Tensor q4, Tensor k, Tensor v, Tensor? table, Tensor? seqlens, Tensor? k_scale, "
        "Tensor? v_scale, float scale2, int[] plan) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("decode_forward", &decode_forward);
}

TORCH_LIBRARY_IMPL(attnlab_native, CompositeExplicitAutograd, m) {
  m.impl("decode_dot_instructions", &decode_dot_instructions);
}
