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
// the items are split between the threads by their rows; small calls run on one thread.

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

// In place: s[i] = exp(s[i] - max) for i < n (n a multiple of kLanes); returns the sum.
inline float exp_and_sum(float* s, int64_t n) {
  fVec mxv(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += kLanes) mxv = at::vec::maximum(mxv, fVec::loadu(s + i));
  const fVec mx(lane_max(mxv));
  fVec sumv(0.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const fVec e = (fVec::loadu(s + i) - mx).exp_u20();
    e.store(s + i);
    sumv = sumv + e;
  }
  return lane_sum(sumv);
}

struct Shape {
  int64_t heads, kv_heads, group, dim, num_blocks, block_size, max_blocks;
};

// One thread's buffers, kept between calls (no allocation per call once they have grown).
struct Workspace {
  std::vector<float> values;
  float* take(int64_t n) {
    if (static_cast<int64_t>(values.size()) < n) values.resize(n);
    return values.data();
  }
};

// Tiles ahead of the one read whose lines are asked for (TilePrefetcher): 2 to 4 measured
// alike, 1 too late.
constexpr int64_t kPrefetchTiles = 2;
// Multiply-adds of the scores (as many again for the values) below which one thread
// does the call.
constexpr int64_t kMinParallelMacs = 1 << 16;
// Runs of items a call is split into at most (one per thread).
constexpr int64_t kMaxThreads = 256;

// One (request, kv head): its `group` query heads over the request's cached rows (of
// type C: T, or a quantized cache's bytes). `scale` includes k_scale; v_scale
// multiplies the output. `ahead` steps once per tile read.
template <typename T, typename C, typename Ahead>
void attend_one(const Shape& s, const TileMath& math, const T* q, const ItemRows<C>& item, float scale,
                float softcap, float v_scale, T* out, Workspace& work, Ahead& ahead) {
  const int64_t g_n = s.group, d = s.dim, dp = padded_width(d), chunks = dp / kLanes;
  const int64_t n = item.len - item.first;
  // Each tile stores a whole vector of scores from its offset (the lanes past its rows
  // are overwritten by the next tile's, or masked): room for one vector past the last row.
  const int64_t n_pad = (n + 2 * kLanes - 1) / kLanes * kLanes;
  float* qf = work.take(2 * g_n * dp + kLanes * dp + g_n * n_pad + g_n);
  float* acc = qf + g_n * dp;
  float* tile_buf = acc + g_n * dp;
  float* scores = tile_buf + kLanes * dp;  // [g_n, n_pad]
  float* sums = scores + g_n * n_pad;
  for (int64_t g = 0; g < g_n; ++g) {  // zero-padded like the rows: the padding adds 0 * 0
    widen(q + g * d, qf + g * dp, d);
    std::fill(qf + g * dp + d, qf + (g + 1) * dp, 0.f);
  }
  RowTiles<C> keys(item.k, item.table, s.block_size, d, tile_buf);
  keys.seek(item.first);
  for (int64_t i = 0; i < n;) {
    const Tile tile = keys.next(n - i);
    ahead.step();
    (tile.n == kLanes ? math.scores_full : math.scores_part)(qf, g_n, tile, scale, softcap, scores + i, n_pad, chunks);
    i += tile.n;
  }
  const int64_t vec_end = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t g = 0; g < g_n; ++g) {  // lanes past n: -inf, whose exp is 0
    std::fill(scores + g * n_pad + n, scores + g * n_pad + vec_end, -std::numeric_limits<float>::infinity());
    sums[g] = exp_and_sum(scores + g * n_pad, vec_end);
  }
  std::fill(acc, acc + g_n * dp, 0.f);
  RowTiles<C> values(item.v, item.table, s.block_size, d, tile_buf);
  values.seek(item.first);
  for (int64_t i = 0; i < n;) {
    const Tile tile = values.next(n - i);
    ahead.step();
    math.weigh(tile, scores + i, n_pad, acc, g_n, chunks);
    i += tile.n;
  }
  for (int64_t g = 0; g < g_n; ++g) {
    const float factor = v_scale / sums[g];
    for (int64_t j = 0; j < d; ++j) out[g * d + j] = static_cast<T>(acc[g * dp + j] * factor);
  }
}

template <typename T, typename C>
void paged_decode_typed(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& table,
                        const at::Tensor& seq_lens, float scale, float softcap, int64_t window, float v_scale,
                        at::Tensor& out) {
  const Shape s{q.size(1), kv_cache.size(1), q.size(1) / kv_cache.size(1), q.size(2),
                kv_cache.size(2), kv_cache.size(3), table.size(1)};
  const int64_t batch = q.size(0);
  const int64_t head_stride = s.num_blocks * s.block_size * s.dim;
  const T* qp = q.const_data_ptr<T>();
  const C* kp = static_cast<const C*>(kv_cache.const_data_ptr());
  const C* vp = kp + s.kv_heads * head_stride;
  const int64_t* tp = table.const_data_ptr<int64_t>();
  const int64_t* lp = seq_lens.const_data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const TileMath math = tile_math(padded_width(s.dim) / kLanes);
  // Item b * kv_heads + h: request b's kv head h.
  const auto rows_of = [&](int64_t item) {
    const int64_t b = item / s.kv_heads, h = item % s.kv_heads, len = lp[b];
    return ItemRows<C>{kp + h * head_stride, vp + h * head_stride, tp + b * s.max_blocks,
                       window > 0 ? std::max<int64_t>(0, len - window) : 0, len};
  };
  // Each thread takes a run of items of about equal work (rows read, and a tile's worth
  // per item): split by count, a batch of mixed lengths leaves one thread waiting. One
  // thread for a call too small to pay for waking the others (~a few microseconds).
  const int64_t items = batch * s.kv_heads;
  const auto work_of = [&](int64_t item) {
    const ItemRows<C> r = rows_of(item);
    return r.len - r.first + kLanes;
  };
  int64_t total = 0;
  for (int64_t item = 0; item < items; ++item) total += work_of(item);
  const int64_t threads = total * s.group * s.dim < kMinParallelMacs
                              ? 1
                              : std::min<int64_t>({at::get_num_threads(), items, kMaxThreads});
  int64_t bounds[kMaxThreads + 1];
  bounds[0] = 0;
  for (int64_t t = 1, item = 0, done = 0; t <= threads; ++t) {  // the first item past t / threads of the work
    for (; item < items && done * threads < total * t; ++item) done += work_of(item);
    bounds[t] = t == threads ? items : item;
  }
  at::parallel_for(0, threads, 1, [&](int64_t first_run, int64_t end_run) {
    thread_local Workspace work;
    for (int64_t run = first_run; run < end_run; ++run) {
      TilePrefetcher<C, decltype(rows_of)> ahead(rows_of, bounds[run], bounds[run + 1], s.block_size, s.dim,
                                                 kPrefetchTiles);
      for (int64_t item = bounds[run]; item < bounds[run + 1]; ++item) {
        const int64_t offset = (item / s.kv_heads * s.heads + item % s.kv_heads * s.group) * s.dim;
        attend_one<T, C>(s, math, qp + offset, rows_of(item), scale, softcap, v_scale, op + offset, work, ahead);
      }
    }
  });
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
