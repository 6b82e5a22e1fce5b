// llmd's CPU kernels, built at start-up by cpu_kernels.py (torch.utils.cpp_extension,
// cached on disk) when the engine runs with compile=True.
//
// paged_decode: attention of one query token per request over its paged K/V cache,
// read in place. The torch reference (attention.py, TorchAttention._decode) gathers
// every request's blocks into one padded buffer and runs two batched GEMMs; this reads
// each cached row once, where it lies, for all the query heads that share its kv head.
// Same contract: query head h reads kv head h / (H / KVH); key positions
// [max(0, len - window), len) are seen (window 0: all); scores are scaled, then
// soft-capped (c * tanh(s / c); softcap 0: none); softmax and sums in float32.
//
// q [B, H, D], kv_cache [2, KVH, num_blocks, block_size, D] (K then V), block_table
// [B, max_blocks] int64, seq_lens [B] int64 (context length including the new token).
// Returns [B, H, D] in q's dtype (float32, bfloat16 or float16).
//
// A quantized cache (kv_quant.py: uint8 holding float8 e4m3fn bytes, or int8) is read in
// place too, each row widened to float32 as it is read; k_scale multiplies the scores
// and v_scale the output (stored * scale is the value: the scales are folded in, not
// applied per element). A cache in q's dtype takes scales of 1.
//
// How it is fast (issue 27; docs/benchmarks.md, "Paged decode at batch 32 on the CPU"):
// per (request, kv head) the rows are read a tile of kLanes positions at a time
// (cpu_kv_rows.h: in place, or widened once into a buffer that stays in L1). Scores: for
// each of the group's query heads, the tile's kLanes dot products accumulate in kLanes
// independent vectors, finished together by one transpose_sum (~3 instructions a score
// where a lane sum each takes ~10). Values: each V row, loaded once, is weighed into the
// accumulators of up to four query heads x 64 columns held in registers (weigh_rows).
// The tile math is compiled for the common row widths (the row addresses constants off
// one register). A thread asks for the lines of the tile it reads two tiles from now
// (TilePrefetcher), across blocks, passes and items: the hardware prefetcher cannot guess
// where the next block lies. No allocation per call once a thread's buffers have grown;
// the items' rows are softmaxed in chunks of 256, joined in order (the same bits however
// the call is split), and the chunks split between the threads by their rows, an item
// shared by several where the batch has fewer items than threads; small calls run on
// one thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_kv_rows.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using llmd_cpu_vec::fVec;
using llmd_cpu_vec::keep_in_register;
using llmd_cpu_vec::kLanes;
using llmd_cpu_vec::lane_max;
using llmd_cpu_vec::lane_sum;
using llmd_cpu_vec::transpose_sum;
using llmd_cpu_vec::widen;
using llmd_kv_rows::ItemRows;
using llmd_kv_rows::padded_width;
using llmd_kv_rows::RowTiles;
using llmd_kv_rows::Tile;
using llmd_kv_rows::TilePrefetcher;

// The tile math works on float32 rows of `chunks` vectors. Its functions take the count
// as a template argument NC where it is one of the common ones (the row addresses are
// then constants off one register, the loops unrolled), 0 for any other (`nc`).
template <int NC>
constexpr int64_t chunks_of(int64_t nc) {
  return NC > 0 ? NC : nc;
}

// out[g * out_stride + r] = the score of query head g (q + g * padded) on row r of the
// tile: (q . row) * scale, soft-capped. Each head's kLanes dot products accumulate in
// kLanes vectors finished by one transpose_sum. The store is a whole vector: lanes past
// the tile's n rows (rows read again, for no use) are overwritten or masked later.
template <int NC, bool FULL>
void tile_scores(const float* q, int64_t heads, const Tile& tile, float scale, float softcap, float* out,
                 int64_t out_stride, int64_t nc) {
  const int64_t chunks = chunks_of<NC>(nc), stride = chunks * kLanes;
  const int64_t last = FULL ? kLanes - 1 : tile.n - 1;
  const fVec scale_v(scale), cap(softcap);
  for (int64_t g = 0; g < heads; ++g) {
    const float* qg = q + g * stride;
    fVec acc[kLanes];
    const fVec q0 = fVec::loadu(qg);
    for (int64_t r = 0; r < kLanes; ++r) acc[r] = q0 * fVec::loadu(tile.rows + std::min(r, last) * stride);
    for (int64_t c = 1; c < chunks; ++c) {
      const fVec qc = fVec::loadu(qg + c * kLanes);
      for (int64_t r = 0; r < kLanes; ++r)
        acc[r] = at::vec::fmadd(qc, fVec::loadu(tile.rows + std::min(r, last) * stride + c * kLanes), acc[r]);
    }
    fVec score = transpose_sum(acc) * scale_v;
    if (softcap > 0.f) score = cap * (score / cap).tanh();
    score.store(out + g * out_stride);
  }
}

// acc[h * acc_stride + j] += sum over r < n of p[h * p_stride + r] * rows[r * stride + j]
// for HEADS heads and CHUNKS vectors of columns j: each row's vectors loaded once for all
// the heads, the HEADS x CHUNKS accumulators in registers across the rows.
template <int HEADS, int CHUNKS>
inline void weigh_rows(const float* rows, int64_t stride, int64_t n, const float* p, int64_t p_stride, float* acc,
                       int64_t acc_stride) {
  fVec a[HEADS][CHUNKS];
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < CHUNKS; ++c) a[h][c] = fVec::loadu(acc + h * acc_stride + c * kLanes);
  for (int64_t r = 0; r < n; ++r) {
    fVec v[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) {
      v[c] = fVec::loadu(rows + r * stride + c * kLanes);
      if constexpr (HEADS > 1) keep_in_register(v[c]);
    }
    for (int h = 0; h < HEADS; ++h) {
      const fVec w(p[h * p_stride + r]);
      for (int c = 0; c < CHUNKS; ++c) a[h][c] = at::vec::fmadd(w, v[c], a[h][c]);
    }
  }
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < CHUNKS; ++c) a[h][c].store(acc + h * acc_stride + c * kLanes);
}

// Accumulators held in registers: 16 of AVX-512's 32 vector registers, 8 of AVX2's 16.
constexpr int kMaxAccumulators = kLanes >= 16 ? 16 : 8;

// weigh_rows over every head for CHUNKS vectors of columns (rows and acc point at the
// first), in blocks of as many heads as the registers hold.
template <int CHUNKS>
inline void weigh_heads(const float* rows, int64_t stride, int64_t n, const float* p, int64_t p_stride, float* acc,
                        int64_t acc_stride, int64_t heads) {
  constexpr int kHeads = std::max(1, std::min(4, kMaxAccumulators / CHUNKS));
  for (int64_t h = 0; h < heads;) {
    const int64_t take = std::min<int64_t>(kHeads, heads - h);
    const float* ph = p + h * p_stride;
    float* ah = acc + h * acc_stride;
    switch (take) {
      case 1: weigh_rows<1, CHUNKS>(rows, stride, n, ph, p_stride, ah, acc_stride); break;
      case 2: weigh_rows<std::min(2, kHeads), CHUNKS>(rows, stride, n, ph, p_stride, ah, acc_stride); break;
      case 3: weigh_rows<std::min(3, kHeads), CHUNKS>(rows, stride, n, ph, p_stride, ah, acc_stride); break;
      default: weigh_rows<kHeads, CHUNKS>(rows, stride, n, ph, p_stride, ah, acc_stride);
    }
    h += take;
  }
}

// acc[g] += sum over the tile's rows r of p[g * p_stride + r] * row r, for every head g
// (accumulators of the padded row width, one after another), in column blocks of four
// vectors (then two, one).
template <int NC>
void weigh_tile(const Tile& tile, const float* p, int64_t p_stride, float* acc, int64_t heads, int64_t nc) {
  const int64_t chunks = chunks_of<NC>(nc), stride = chunks * kLanes;
  int64_t c = 0;
  for (; c + 4 <= chunks; c += 4)
    weigh_heads<4>(tile.rows + c * kLanes, stride, tile.n, p, p_stride, acc + c * kLanes, stride, heads);
  if (c + 2 <= chunks) {
    weigh_heads<2>(tile.rows + c * kLanes, stride, tile.n, p, p_stride, acc + c * kLanes, stride, heads);
    c += 2;
  }
  if (c < chunks) weigh_heads<1>(tile.rows + c * kLanes, stride, tile.n, p, p_stride, acc + c * kLanes, stride, heads);
}

// The tile math for one row width.
struct TileMath {
  void (*scores_full)(const float*, int64_t, const Tile&, float, float, float*, int64_t, int64_t);
  void (*scores_part)(const float*, int64_t, const Tile&, float, float, float*, int64_t, int64_t);
  void (*weigh)(const Tile&, const float*, int64_t, float*, int64_t, int64_t);
};

template <int NC>
constexpr TileMath tile_math_for() {
  return {&tile_scores<NC, true>, &tile_scores<NC, false>, &weigh_tile<NC>};
}

// Head sizes 16 to 128 (and 256) with AVX-512's 16 lanes, up to 64 (and 128) with AVX2's 8.
inline TileMath tile_math(int64_t chunks) {
  switch (chunks) {
    case 1: return tile_math_for<1>();
    case 2: return tile_math_for<2>();
    case 3: return tile_math_for<3>();
    case 4: return tile_math_for<4>();
    case 5: return tile_math_for<5>();
    case 6: return tile_math_for<6>();
    case 7: return tile_math_for<7>();
    case 8: return tile_math_for<8>();
    case 16: return tile_math_for<16>();
    default: return tile_math_for<0>();
  }
}

// In place: s[i] = exp(s[i] - max) for i < n (n a multiple of kLanes); the max to *max,
// the sum to *sum.
inline void exp_and_sum(float* s, int64_t n, float* max, float* sum) {
  fVec mxv(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += kLanes) mxv = at::vec::maximum(mxv, fVec::loadu(s + i));
  *max = lane_max(mxv);
  const fVec mx(*max);
  fVec sumv(0.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const fVec e = (fVec::loadu(s + i) - mx).exp_u20();
    e.store(s + i);
    sumv = sumv + e;
  }
  *sum = lane_sum(sumv);
}

struct Shape {
  int64_t heads, kv_heads, group, dim, num_blocks, block_size, max_blocks;
};

// One thread's buffers, kept between calls (no allocation per call once they have grown),
// from a cache line's start.
struct Workspace {
  std::vector<float> values;
  float* take(int64_t n) {
    if (static_cast<int64_t>(values.size()) < n + kLanes) values.resize(n + kLanes);
    const auto at = reinterpret_cast<uintptr_t>(values.data());
    return values.data() + (64 - at % 64) % 64 / sizeof(float);
  }
};

// Tiles ahead of the one read whose lines are asked for (TilePrefetcher): 2 to 4 measured
// alike, 1 too late.
constexpr int64_t kPrefetchTiles = 2;
// Multiply-adds of the scores (as many again for the values) below which one thread
// does the call.
constexpr int64_t kMinParallelMacs = 1 << 16;
// Runs of chunks a call is split into at most (one per thread).
constexpr int64_t kMaxThreads = 256;

// An item's rows are softmaxed in chunks of kChunkRows from its first: each chunk's part
// (per query head its largest score, the sum of exp(score - that) and the V rows weighed
// by them) is computed apart, and the parts are joined in order (join_chunks) — whether
// one thread reads the whole item or several threads read its chunks. So an item's
// output is the same bits alone or in any batch and at any thread count, and a long
// context can be shared by threads its batch would leave idle (at batch 1 Gemma 3's one
// kv head read on one of two threads; docs/benchmarks.md, "Long contexts at batch 1").
constexpr int64_t kChunkRows = 256;

inline int64_t chunks_in(int64_t rows) { return (rows + kChunkRows - 1) / kChunkRows; }

// Floats of one chunk's part: `group` x dp weighed rows, then `group` maxima and `group`
// sums, in whole vectors (the rows of every part start a vector).
inline int64_t part_floats(int64_t group, int64_t dp) {
  return group * dp + (2 * group + kLanes - 1) / kLanes * kLanes;
}

// One (request, kv head)'s rows [piece.first, piece.len), whole chunks of the item but
// for its last: the chunks' parts (part_floats each) of its `group` query heads into
// `parts`. Rows are of type C (T, or a quantized cache's bytes); `scale` includes
// k_scale. `ahead` steps once per tile read.
template <typename T, typename C, typename Ahead>
void attend_chunks(const Shape& s, const TileMath& math, const T* q, const ItemRows<C>& piece, float scale,
                   float softcap, float* parts, Workspace& work, Ahead& ahead) {
  const int64_t g_n = s.group, d = s.dim, dp = padded_width(d), chunks = dp / kLanes;
  const int64_t n = piece.len - piece.first;
  // Each tile stores a whole vector of scores from its offset (the lanes past its rows
  // are overwritten by the next tile's, or masked): room for one vector past the last row.
  const int64_t n_pad = (n + 2 * kLanes - 1) / kLanes * kLanes;
  float* qf = work.take(g_n * dp + kLanes * dp + g_n * n_pad);
  float* tile_buf = qf + g_n * dp;
  float* scores = tile_buf + kLanes * dp;  // [g_n, n_pad]
  for (int64_t g = 0; g < g_n; ++g) {  // zero-padded like the rows: the padding adds 0 * 0
    widen(q + g * d, qf + g * dp, d);
    std::fill(qf + g * dp + d, qf + (g + 1) * dp, 0.f);
  }
  RowTiles<C> keys(piece.k, piece.table, s.block_size, d, tile_buf);
  keys.seek(piece.first);
  for (int64_t i = 0; i < n;) {
    const Tile tile = keys.next(n - i);
    ahead.step();
    (tile.n == kLanes ? math.scores_full : math.scores_part)(qf, g_n, tile, scale, softcap, scores + i, n_pad, chunks);
    i += tile.n;
  }
  const int64_t vec_end = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t g = 0; g < g_n; ++g)  // lanes past n: -inf, whose exp is 0
    std::fill(scores + g * n_pad + n, scores + g * n_pad + vec_end, -std::numeric_limits<float>::infinity());
  RowTiles<C> values(piece.v, piece.table, s.block_size, d, tile_buf);
  values.seek(piece.first);
  const int64_t stride = part_floats(g_n, dp);
  for (int64_t c0 = 0, c = 0; c0 < n; c0 += kChunkRows, ++c) {
    float* maxima = parts + c * stride + g_n * dp;
    for (int64_t g = 0; g < g_n; ++g)
      exp_and_sum(scores + g * n_pad + c0, std::min(c0 + kChunkRows, vec_end) - c0, maxima + g, maxima + g_n + g);
    std::fill(parts + c * stride, parts + c * stride + g_n * dp, 0.f);
  }
  for (int64_t c0 = 0; c0 < n; c0 += kChunkRows, parts += stride) {
    const int64_t c1 = std::min(n, c0 + kChunkRows);
    float* acc = parts;
    for (int64_t i = c0; i < c1;) {
      const Tile tile = values.next(c1 - i);
      ahead.step();
      math.weigh(tile, scores + i, n_pad, acc, g_n, chunks);
      i += tile.n;
    }
  }
}

// An item's output (`group` query heads x d, in T) from its `count` chunk parts, joined in
// order: each part weighed by exp(its max - the largest), v_scale over the weighed sums.
// One part: the part's rows times v_scale / its sum (its weight exp(0) = 1).
template <typename T>
void join_chunks(const float* parts, int64_t count, int64_t g_n, int64_t d, float v_scale, float* acc, T* out) {
  const int64_t dp = padded_width(d), stride = part_floats(g_n, dp);
  for (int64_t g = 0; g < g_n; ++g) {
    const float* maxima = parts + g_n * dp;  // then the sums
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < count; ++c) mx = std::max(mx, maxima[c * stride + g]);
    float sum = 0.f;
    std::fill(acc, acc + dp, 0.f);
    for (int64_t c = 0; c < count; ++c) {
      const float w = std::exp(maxima[c * stride + g] - mx);
      sum += w * maxima[c * stride + g_n + g];
      const fVec wv(w);
      const float* rows = parts + c * stride + g * dp;
      for (int64_t j = 0; j < dp; j += kLanes) (fVec::loadu(acc + j) + wv * fVec::loadu(rows + j)).store(acc + j);
    }
    const float factor = v_scale / sum;
    for (int64_t j = 0; j < d; ++j) out[g * d + j] = static_cast<T>(acc[j] * factor);
  }
}

// A call's items cut in chunks: item i's chunks are [start[i], start[i + 1]) of the
// call's; a run of the call's chunks covers whole items and, at its ends, pieces.
struct ChunkRuns {
  std::vector<int64_t> start;  // [items + 1]
  int64_t bounds[kMaxThreads + 1];  // thread t reads chunks [bounds[t], bounds[t + 1])
  // The items a run cuts (read by two or more threads), each with its parts' offset in a
  // buffer the caller keeps: (item, offset).
  std::vector<std::pair<int64_t, int64_t>> cut;
  int64_t cut_floats = 0;

  int64_t item_of(int64_t chunk) const {  // the item holding the call's chunk
    return std::upper_bound(start.begin(), start.end(), chunk) - start.begin() - 1;
  }
  // Where item's parts go when it is cut: their offset, or -1 (one thread reads it all).
  int64_t cut_offset(int64_t item) const {
    for (const auto& [i, offset] : cut)
      if (i == item) return offset;
    return -1;
  }
};

template <typename T, typename C>
void paged_decode_typed(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& table,
                        const at::Tensor& seq_lens, float scale, float softcap, int64_t window, float v_scale,
                        at::Tensor& out) {
  const Shape s{q.size(1), kv_cache.size(1), q.size(1) / kv_cache.size(1), q.size(2),
                kv_cache.size(2), kv_cache.size(3), table.size(1)};
  const int64_t batch = q.size(0), dp = padded_width(s.dim), stride = part_floats(s.group, dp);
  const int64_t head_stride = s.num_blocks * s.block_size * s.dim;
  const T* qp = q.const_data_ptr<T>();
  const C* kp = static_cast<const C*>(kv_cache.const_data_ptr());
  const C* vp = kp + s.kv_heads * head_stride;
  const int64_t* tp = table.const_data_ptr<int64_t>();
  const int64_t* lp = seq_lens.const_data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const TileMath math = tile_math(dp / kLanes);
  // Item b * kv_heads + h: request b's kv head h.
  const auto rows_of = [&](int64_t item) {
    const int64_t b = item / s.kv_heads, h = item % s.kv_heads, len = lp[b];
    return ItemRows<C>{kp + h * head_stride, vp + h * head_stride, tp + b * s.max_blocks,
                       window > 0 ? std::max<int64_t>(0, len - window) : 0, len};
  };
  const auto offset_of = [&](int64_t item) {  // where item's query heads (and output rows) start
    return (item / s.kv_heads * s.heads + item % s.kv_heads * s.group) * s.dim;
  };
  // The caller's (no allocation per call once grown), by reference: a thread_local named in
  // the threads' lambda would be each thread's own.
  thread_local ChunkRuns caller_runs;
  ChunkRuns& runs = caller_runs;
  const int64_t items = batch * s.kv_heads;
  runs.start.resize(items + 1);
  runs.start[0] = 0;
  int64_t total = 0;
  for (int64_t item = 0; item < items; ++item) {
    const ItemRows<C> r = rows_of(item);
    const int64_t count = chunks_in(r.len - r.first);
    runs.start[item + 1] = runs.start[item] + count;
    total += r.len - r.first + count * kLanes;
  }
  const int64_t num_chunks = runs.start[items];
  // Each thread takes a run of chunks of about equal work (rows read, and a tile's worth
  // per chunk): a batch of mixed lengths, or fewer items than threads, leaves none
  // waiting. One thread for a call too small to pay for waking the others (~a few µs).
  const int64_t threads = total * s.group * s.dim < kMinParallelMacs
                              ? 1
                              : std::min<int64_t>({at::get_num_threads(), num_chunks, kMaxThreads});
  runs.bounds[0] = 0;
  runs.cut.clear();
  runs.cut_floats = 0;
  // The first chunk past t / threads of the work, the chunks walked in order (item's c-th).
  for (int64_t t = 1, chunk = 0, done = 0, item = 0, c = 0; t <= threads; ++t) {
    for (; chunk < num_chunks && done * threads < total * t; ++chunk) {
      const ItemRows<C> r = rows_of(item);
      done += std::min(kChunkRows, r.len - r.first - c * kChunkRows) + kLanes;
      if (++c == runs.start[item + 1] - runs.start[item]) ++item, c = 0;
    }
    runs.bounds[t] = t == threads ? num_chunks : chunk;
    if (t < threads && c > 0 && runs.cut_offset(item) < 0) {  // the bound falls inside item
      runs.cut.emplace_back(item, runs.cut_floats);
      runs.cut_floats += (runs.start[item + 1] - runs.start[item]) * stride;
    }
  }
  thread_local Workspace cut_parts;
  float* shared = cut_parts.take(runs.cut_floats + dp);
  at::parallel_for(0, threads, 1, [&](int64_t first_run, int64_t end_run) {
    thread_local Workspace work, whole;
    thread_local std::vector<ItemRows<C>> pieces;
    for (int64_t run = first_run; run < end_run; ++run) {
      const int64_t c_begin = runs.bounds[run], c_end = runs.bounds[run + 1];
      if (c_begin == c_end) continue;
      // This run's rows of each item it reads: the item's chunks in [c_begin, c_end).
      const int64_t i_begin = runs.item_of(c_begin), i_end = runs.item_of(c_end - 1) + 1;
      pieces.resize(i_end - i_begin);
      for (int64_t item = i_begin; item < i_end; ++item) {
        ItemRows<C> r = rows_of(item);
        const int64_t lo = std::max(c_begin, runs.start[item]) - runs.start[item];
        const int64_t hi = std::min(c_end, runs.start[item + 1]) - runs.start[item];
        r.len = std::min(r.len, r.first + hi * kChunkRows);
        r.first += lo * kChunkRows;
        pieces[item - i_begin] = r;
      }
      // (from a table: the prefetcher computing them in its walk made a 32 x 2,048 call
      // 5-15% slower on one thread)
      const auto piece_of = [&](int64_t item) { return pieces[item - i_begin]; };
      TilePrefetcher<C, decltype(piece_of)> ahead(piece_of, i_begin, i_end, s.block_size, s.dim, kPrefetchTiles);
      for (int64_t item = i_begin; item < i_end; ++item) {
        const int64_t offset = offset_of(item), cut = runs.cut_offset(item);
        if (cut >= 0) {  // its parts beside the other runs', joined after
          const int64_t first_chunk = std::max(c_begin, runs.start[item]) - runs.start[item];
          attend_chunks<T, C>(s, math, qp + offset, piece_of(item), scale, softcap,
                              shared + cut + first_chunk * stride, work, ahead);
          continue;
        }
        const int64_t count = runs.start[item + 1] - runs.start[item];
        float* parts = whole.take(count * stride + dp);
        attend_chunks<T, C>(s, math, qp + offset, piece_of(item), scale, softcap, parts, work, ahead);
        join_chunks<T>(parts, count, s.group, s.dim, v_scale, parts + count * stride, op + offset);
      }
    }
  });
  for (const auto& [item, cut] : runs.cut)
    join_chunks<T>(shared + cut, runs.start[item + 1] - runs.start[item], s.group, s.dim, v_scale,
                   shared + runs.cut_floats, op + offset_of(item));
}

// The cache's element type C for queries of type T: T itself, a quantized cache's, or a
// 16-bit float cache of float32 queries (kv_cache_dtype float16 / bfloat16).
template <typename T>
void paged_decode_cache(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& table,
                        const at::Tensor& seq_lens, float scale, float softcap, int64_t window, float k_scale,
                        float v_scale, at::Tensor& out) {
  const auto cache_type = kv_cache.scalar_type();
  if (cache_type == at::kByte) {
    paged_decode_typed<T, uint8_t>(q, kv_cache, table, seq_lens, scale * k_scale, softcap, window, v_scale, out);
    return;
  }
  if (cache_type == at::kChar) {
    paged_decode_typed<T, int8_t>(q, kv_cache, table, seq_lens, scale * k_scale, softcap, window, v_scale, out);
    return;
  }
  TORCH_CHECK(k_scale == 1.f && v_scale == 1.f, "paged_decode: scales are for a quantized cache (uint8, int8)");
  if constexpr (std::is_same_v<T, float>) {
    if (cache_type == at::kHalf) {
      paged_decode_typed<T, c10::Half>(q, kv_cache, table, seq_lens, scale, softcap, window, 1.f, out);
      return;
    }
    if (cache_type == at::kBFloat16) {
      paged_decode_typed<T, c10::BFloat16>(q, kv_cache, table, seq_lens, scale, softcap, window, 1.f, out);
      return;
    }
  }
  paged_decode_typed<T, T>(q, kv_cache, table, seq_lens, scale, softcap, window, 1.f, out);
}

// Every request's context fits its table and names blocks of the cache: the kernel reads
// where they point.
void check_rows(const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t num_blocks, int64_t block_size) {
  const int64_t batch = seq_lens.numel(), max_blocks = block_table.size(1);
  const int64_t* tp = block_table.const_data_ptr<int64_t>();
  const int64_t* lp = seq_lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * block_size, "paged_decode: seq_lens[", b, "] = ", lp[b],
                " is outside [1, ", max_blocks * block_size, "] (block_table's columns x block_size)");
    for (int64_t j = 0; j < (lp[b] + block_size - 1) / block_size; ++j) {
      const int64_t id = tp[b * max_blocks + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode: block_table[", b, ", ", j, "] = ", id,
                  " is not a block of the cache (", num_blocks, " blocks)");
    }
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                        const at::Tensor& seq_lens, double scale, double softcap, int64_t window, double k_scale,
                        double v_scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "paged_decode: q [B, H, D] and "
              "kv_cache [2, KVH, blocks, block_size, D] expected");
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(1) % kv_cache.size(1) == 0,
              "paged_decode: head sizes of q and the cache disagree");
  const auto cache_type = kv_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == cache_type || cache_type == at::kByte || cache_type == at::kChar ||
                  (q.scalar_type() == at::kFloat && (cache_type == at::kHalf || cache_type == at::kBFloat16)),
              "paged_decode: the cache holds q's dtype, a quantized cache's uint8 (e4m3) or int8, or float16 / "
              "bfloat16 for float32 q");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              block_table.dim() == 2 && block_table.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "paged_decode: int64 block_table [B, max_blocks] and seq_lens [B] expected");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_table.is_contiguous() &&
              seq_lens.is_contiguous(), "paged_decode: contiguous inputs expected");
  check_rows(block_table, seq_lens, kv_cache.size(2), kv_cache.size(3));
  auto out = at::empty_like(q);
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      paged_decode_cache<float>(q, kv_cache, block_table, seq_lens, fscale, fcap, window, ks, vs, out);
      break;
    case at::kBFloat16:
      paged_decode_cache<c10::BFloat16>(q, kv_cache, block_table, seq_lens, fscale, fcap, window, ks, vs, out);
      break;
    case at::kHalf:
      paged_decode_cache<c10::Half>(q, kv_cache, block_table, seq_lens, fscale, fcap, window, ks, vs, out);
      break;
    default: TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16 expected, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(llmd_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float scale, "
        "float softcap, int window, float k_scale=1.0, float v_scale=1.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmd_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
