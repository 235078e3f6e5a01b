// attnlab's decode kernel (decode.cpp), its streaming loop: the constants that say how far ahead it
// asks for rows, and stream_scores, one key block's scores with each K row read once as stored (its
// dot products: decode_dots.h, decode_bf16.h, decode_lanes.h). Included by decode.cpp only.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "kernels.h"
#include "decode_dots.h"   // SpreadLines, RunLines, line_run, dots2, dots4, idots2, prefetch_row
#include "decode_bf16.h"   // bdots2
#include "decode_lanes.h"  // lane_bdots8, lane_idots8

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

// ---------------------------------------------------------------------------------------------
// The streaming loop (its dot products: decode_dots.h): one key block, each K and V row read once
// ---------------------------------------------------------------------------------------------

// The scores of nk key rows of one stride (inside a page): s (n, nk), rows ld apart, = scale2 * Q K^T
// by dot products, each K row read once as stored (k_scale: the int8 rows' scales, else nullptr);
// v: the same keys' value rows (v_ld apart, Ev wide), asked for into L2 as their keys are used, or
// nullptr
// Paged rows sit Hkv * E apart (vLLM's (page, Hkv, E) pages), each in its own 4 KiB stretch, where
// the hardware prefetcher (which stays inside a 4 KiB page) does not follow: ask for the rows
// PREFETCH_ROWS ahead ourselves. Measured on the 2-core AVX2 EPYC (S=131072, Hkv=8, E=128, fp32):
// head by head 154 -> 145 ms with it; reading a head group's rows together (decode_forward's G)
// did the rest (71 ms, dense 80 ms). Dense head-major rows are asked for the same way: the
// hardware prefetcher did not keep up with them either (2026-12-03, same machine, old against new
// build alternated, q (1,32,1,128) against (1,8,S,128)): fp32 15.7 -> 13.5 ms at S = 32k and
// 62 -> 54 ms at 131k; bf16 10.9 -> 9.2 ms and 34.9 -> 32.5 ms.
constexpr int PREFETCH_ROWS = 4;
//
// A head-major (contiguous) cache's value rows are also asked for into L2 while the same keys'
// scores are computed (stream_scores' v): the value pass asked for a 64-key block's rows only as it
// began (512 prefetches at once in fp32), and perf put most of stream_values' samples on that burst
// and on the first value loads waiting behind it. q (1, 32, Lq, 128) against (1, 8, 32768, 128), one
// thread, CPU time, 2-core AVX2 EPYC (Zen 3), 2026-12-03, old and new builds alternated, three
// rounds: Lq = 1 fp32 33.8-35.7 -> 26.5-29.0 ms, bf16 21.2-23.7 -> 15.7-17.3, int8 14.7-19.4 ->
// 12.2-17.9; Lq = 4 fp32 52.1-55.2 -> 47.6-51.2, bf16 47.1-51.5 -> 44.0-50.8, int8 39.9-43.6 ->
// 37.5-39.4. Paged caches (rows Hkv * E apart) are left out: there the extra prefetches made the
// step slower (bf16 at Lq = 1 22.9-28.5 -> 24.6-29.6 ms), as did the next page's bytes in stored
// order, spread over the scores (no change).
//
// A run of at most this many rows (a 16-token page of a paged cache, one head's rows 1 KiB or more
// apart) is asked for whole at its start, as stream_values asks for its value rows: four rows ahead
// left the dot products waiting on each page's first key rows (perf: most of the scores' samples
// on the loads after vpmovsxbd). Paged against contiguous, q (1, 32, 1, 128) against S = 32768,
// one thread, CPU time, 2-core AVX2 EPYC, 2026-12-03, old and new builds alternated, three rounds:
// int8 1.45-1.48x -> 1.32-1.33x, bf16 1.18-1.23x -> 1.06-1.11x, fp32 1.08-1.14x -> 1.00-1.05x; at
// Lq = 4 (blocks span pages) within the noise. Longer (dense) runs keep 4 ahead: dense times did not
// move. Also tried there: asking for the next head's rows one head ahead (all of them, or the first
// 2-8): the prefetches then stalled on full miss buffers, no better in int8 and worse in bf16.
// (Measured when paged rows were read head by head; since stored_block they serve a cache whose
// rows a page holds for one head only, Hkv = 1.)
constexpr int PREFETCH_RUN_ROWS = 16;
// Rows the lane kernel (decode_lanes.h, eight keys a step) asks for ahead of the keys it uses: two
// steps (8, 16 and 24 measured within the noise of each other, Zen 5, 2026-12-05).
constexpr int LANE_AHEAD = 16;
// Whether this build has the lane kernels (decode_lanes.h): bf16 on 512-bit vdpbf16ps with AVX-512's
// float vectors, int8 on 512-bit int16 pairs (isa::I32). decode_dot_instructions' bits 2 and 3; the
// plan's checks in decode_forward and stream_scores ask these, not the ISA flags again.
constexpr bool kLaneBf16 = isa::kBf16x8 && isa::kF16 && isa::kBf16;
constexpr bool kLaneInt8 = isa::kF16 && isa::kI32;
// From this many rows a head the streaming loop's blocks span pages: one online-softmax step and one
// acc load and store per tile for up to STREAM_BLOCK_K keys, not per 16-key page. Paged against
// contiguous at Lq = 4 (16 rows; q (1, 32, 4, 128) against S = 32768, 2 threads, AVX2 EPYC,
// 2026-12-03, old and new builds alternated): fp32 1.08-1.10x -> 1.04-1.07x, bf16 1.13-1.15x ->
// 1.05-1.12x, int8 1.18-1.25x -> 1.13-1.18x. At 4 rows spanning made paged decoding slower (fp32
// 0.95x -> 1.05-1.08x): a page's rows for every head of the task are then no longer read together.
// (Measured head by head as well; rows interleaved by head now take stored_block, whose blocks span
// pages at every row count.)
constexpr int SPAN_MIN_ROWS = 16;

// A contiguous cache's key rows as one stream across a task's blocks: rows [nk, readable) follow
// the call's rows at its stride and are the caller's next block's (asked for as this call's last
// steps run, so that the next block does not start on rows nobody asked for), and asked: this
// call's first rows were asked for by the previous call.
struct Stream {
  int readable = 0;
  bool asked = false;
};

template <class T>
inline void stream_scores(const float* q, int64_t n, int64_t E, const T* k, int64_t k_ld, const float* k_scale,
                          int nk, int ld, float scale2, float* s, const T* v = nullptr, int64_t v_ld = 0, int64_t Ev = 0,
                          const int16_t* qi = nullptr, const float* qs = nullptr, bool own_prefetch = true,
                          const c10::BFloat16* qb = nullptr, const void* lanes = nullptr,
                          const SpreadLines* ahead = nullptr, const Stream& stream = {},
                          const RunLines* given = nullptr, float* kept = nullptr) {
  constexpr bool lane_bf16 = kLaneBf16 && std::is_same_v<T, c10::BFloat16>;
  constexpr bool lane_int8 = kLaneInt8 && std::is_same_v<T, int8_t>;
  // ahead: key lines of the caller's next tile (stored_block), spread over the lane kernel's steps
  // or, on the other loops, asked for now
  if (ahead != nullptr && !((lane_bf16 || lane_int8) && lanes != nullptr)) ahead->rest(0);
  // rows asked for here; the loops ask for the rest (none when the caller asks for them: own_prefetch false)
  const int first = !own_prefetch || nk <= PREFETCH_RUN_ROWS ? nk : stream.asked ? 0 : PREFETCH_ROWS;
  const int readable = std::max(nk, stream.readable);  // the rows the loops may ask for
  if (own_prefetch)
    for (int j = 0; j < first; ++j) prefetch_row(k + j * k_ld, E);
  int j = 0;
  // a bf16 or int16 query's rows across lanes (decode_lanes.h; decode_forward lays them out where the
  // plan asks): eight keys a step, the key rows asked for LANE_AHEAD rows ahead
  if constexpr (lane_bf16 || lane_int8) {
    if (lanes) {
      if (own_prefetch && !stream.asked)
        for (int i = first; i < std::min(LANE_AHEAD, nk); ++i) prefetch_row(k + i * k_ld, E);
      // rows one after another (a head-major cache's, none of a next tile to add): bf16's lines as
      // two runs (RunLines), not lists
      const bool runs = lane_bf16 && ahead == nullptr && k_ld == E && (v == nullptr || v_ld == Ev);
      for (; j < nk; j += 8) {
        const int m = std::min(8, nk - j);
        if constexpr (lane_bf16) {
          if (given) {  // the caller's lines (stored_block's runs), this step's share of each
            const int steps = (nk + 7) / 8, st = j / 8;
            const int k0 = st * given->nk / steps, v0 = st * given->nv / steps;
            const RunLines lines{given->k + 64 * k0, given->v + 64 * v0, (st + 1) * given->nk / steps - k0,
                                 (st + 1) * given->nv / steps - v0};
            lane_bdots8<isa::B32, isa::F16>(static_cast<const uint32_t*>(lanes), E, k + j * k_ld, k_ld, m, scale2, n, s,
                                            ld, j, lines, kept);
            continue;
          }
          if (runs) {
            const int r0 = std::max(j + LANE_AHEAD, first), r1 = std::min(j + LANE_AHEAD + 8, readable);
            RunLines lines;
            if (r1 > r0) lines.k = line_run(k + r0 * k_ld, (r1 - r0) * E, &lines.nk);
            if (v) lines.v = line_run(v + j * v_ld, m * Ev, &lines.nv);
            lane_bdots8<isa::B32, isa::F16>(static_cast<const uint32_t*>(lanes), E, k + j * k_ld, k_ld, m, scale2, n, s,
                                            ld, j, lines, kept);
            continue;
          }
        }
        // bf16: the lines asked for as the step's dot products run (decode_dots.h); int8 asks for
        // them at once (spread, its step took 23.2-23.7 -> 24.0-24.7 ms at S = 32768, one thread, Zen 4)
        SpreadLines lines;
        for (int i = LANE_AHEAD; i < LANE_AHEAD + 8; ++i)
          if (j + i >= first && j + i < readable) lines.add_k(k + (j + i) * k_ld, E);
        if (v)
          for (int i = 0; i < m; ++i) lines.add_v(v + (j + i) * v_ld, Ev);
        if (ahead) {  // this step's share of the next tile's lines
          const int steps = (nk + 7) / 8, st = j / 8;
          lines.take_k(*ahead, st * ahead->nk / steps, (st + 1) * ahead->nk / steps);
        }
        if constexpr (!lane_bf16) lines.at_once();
        if constexpr (lane_bf16) {
          lane_bdots8<isa::B32, isa::F16>(static_cast<const uint32_t*>(lanes), E, k + j * k_ld, k_ld, m, scale2, n, s,
                                          ld, j, lines, kept);
        } else {
          float f[8];
          for (int i = 0; i < 8; ++i) f[i] = scale2 * k_scale[j + std::min(i, m - 1)];
          lane_idots8<isa::I32, isa::F16>(static_cast<const uint32_t*>(lanes), E, k + j * k_ld, k_ld, m, f, n, s, ld, j,
                                          lines);
        }
      }
      return;
    }
  }
  using X = isa::Stream;
  if constexpr (X::real)
  // two rows by four keys from 8 rows on; at 4 rows (a decode step of one GQA group) dots2's four
  // rows by two keys read each key once, not twice: 3-5% faster there in fp32 and bf16 (q (1, 32, 1,
  // 128) against S = 32768, 2 threads, AVX2 EPYC, 2026-12-03; int8 2% slower, within the noise)
  if (E % X::W == 0 && n % 2 == 0 && n >= 8 && qi == nullptr && qb == nullptr)
    for (; j + 4 <= nk; j += 4) {
      SpreadLines lines;  // asked for as the dot products run (decode_dots.h)
      for (int i = PREFETCH_ROWS; i < PREFETCH_ROWS + 4; ++i)
        if (j + i >= first && j + i < readable) lines.add_k(k + (j + i) * k_ld, E);
      if (v)
        for (int i = 0; i < 4; ++i) lines.add_v(v + (j + i) * v_ld, Ev);
      float f[4];
      for (int i = 0; i < 4; ++i) f[i] = k_scale ? scale2 * k_scale[j + i] : scale2;
      dots4<T>(q, n, E, k + j * k_ld, k_ld, f, s, ld, j, lines);
    }
  for (; j < nk; j += 2) {
    if (j + PREFETCH_ROWS >= first && j + PREFETCH_ROWS < readable) prefetch_row(k + (j + PREFETCH_ROWS) * k_ld, E);
    if (v) {
      prefetch_row<T, 2>(v + j * v_ld, Ev);
      if (j + 1 < nk) prefetch_row<T, 2>(v + (j + 1) * v_ld, Ev);
    }
    if (j + 1 + PREFETCH_ROWS >= first && j + 1 + PREFETCH_ROWS < readable)
      prefetch_row(k + (j + 1 + PREFETCH_ROWS) * k_ld, E);
    const bool two = j + 1 < nk;
    const float f0 = k_scale ? scale2 * k_scale[j] : scale2;
    const float f1 = two ? (k_scale ? scale2 * k_scale[j + 1] : scale2) : 0.0f;
    if constexpr (std::is_same_v<T, int8_t>) {
      if (qi) {
        idots2(qi, qs, n, E, k + j * k_ld, two ? k + (j + 1) * k_ld : nullptr, f0, f1, s, ld, j);
        continue;
      }
    }
    if constexpr (std::is_same_v<T, c10::BFloat16> && isa::kBf16x8) {
      if (qb) {
        bdots2(qb, n, E, k + j * k_ld, two ? k + (j + 1) * k_ld : nullptr, f0, f1, s, ld, j);
        continue;
      }
    }
    dots2<T>(q, n, E, k + j * k_ld, two ? k + (j + 1) * k_ld : nullptr, f0, f1, s, ld, j);
  }
}

}  // namespace
