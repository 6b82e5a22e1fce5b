// Reading one (request, kv head)'s rows of the paged KV cache as float32, a tile of kLanes
// positions at a time, for cpu_kernels.cpp's paged_decode: where the rows lie (a walk of
// the block table, no division per row), read in place when the cache holds float32 rows
// of whole vectors, else widened once into a small buffer that stays in L1 (bfloat16 /
// float16, a quantized cache's e4m3 bytes or int8 as their values before the scale; rows
// padded with zeros to whole vectors).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include "cpu_e4m3.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace llmd_kv_rows {

using llmd_cpu_vec::fVec;
using llmd_cpu_vec::kLanes;

// n e4m3 bytes as float32: sixteen at a time with AVX-512 (llmd_e4m3::x16), eight with
// AVX2 (the same bit move into fp16s), the rest through the table.
inline void widen_e4m3(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 unit = _mm512_set1_ps(llmd_e4m3::kUnscale);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(llmd_e4m3::x16(src + i), unit));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 unit = _mm256_set1_ps(256.f);
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    const __m128i half = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(half), unit));
  }
#endif
  const auto& table = llmd_e4m3::table();
  for (; i < n; ++i) dst[i] = table[src[i]];
}

// n int8 as float32 (vector widening where the ISA has it).
inline void widen_int8(const int8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= n; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// n cached elements of type C as float32 values (a quantized cache's before its scale).
template <typename C>
inline void widen_cached(const C* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<C, uint8_t>) {
    widen_e4m3(src, dst, n);
  } else if constexpr (std::is_same_v<C, int8_t>) {
    widen_int8(src, dst, n);
  } else if constexpr (std::is_same_v<C, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    llmd_cpu_vec::widen(src, dst, n);
  }
}

// `d` rounded up to whole vectors: the width of a row as the kernel reads it.
inline int64_t padded_width(int64_t d) { return (d + kLanes - 1) / kLanes * kLanes; }

// Up to kLanes rows of padded_width(d) float32 values, one after another.
struct Tile {
  const float* rows;
  int64_t n;
};

// The rows of one kv head of one request, a tile at a time from a position on. `head`:
// the kv head's rows, [num_blocks * block_size, d]; `table`: the request's block ids.
// A tile holds kLanes consecutive positions, fewer at the end and where a block ends
// (its rows lie one after another), unless blocks are shorter than a tile: then its rows
// are gathered from several. Float32 rows of whole vectors are read in place; other rows
// are widened (and zero-padded) into `buf` (kLanes * padded_width(d) floats), as are
// gathered ones.
template <typename C>
class RowTiles {
 public:
  RowTiles(const C* head, const int64_t* table, int64_t block_size, int64_t d, float* buf)
      : head_(head), table_(table), block_size_(block_size), d_(d), padded_(padded_width(d)), buf_(buf) {}

  // Position `pos` is the next tile's first row.
  void seek(int64_t pos) {
    block_ = pos / block_size_;
    offset_ = pos % block_size_;
  }

  // The rows the next tile of at most `left` rows takes.
  int64_t tile_rows(int64_t left) const {
    return std::min(std::min(kLanes, left), block_size_ < kLanes ? kLanes : block_size_ - offset_);
  }

  // The next tile, of at most `left` rows. Rows in the buffer stay until the next call.
  Tile next(int64_t left) {
    const bool gather = block_size_ < kLanes;
    const int64_t n = tile_rows(left);
    if constexpr (std::is_same_v<C, float>) {
      if (!gather && d_ == padded_) {
        const Tile tile{row(), n};
        advance(n);
        return tile;
      }
    }
    for (int64_t r = 0; r < n;) {
      const int64_t run = std::min(n - r, block_size_ - offset_);
      const C* src = row();
      float* dst = buf_ + r * padded_;
      if (d_ == padded_) {
        widen_cached(src, dst, run * d_);
      } else {
        for (int64_t j = 0; j < run; ++j) {
          widen_cached(src + j * d_, dst + j * padded_, d_);
          std::fill(dst + j * padded_ + d_, dst + (j + 1) * padded_, 0.f);
        }
      }
      advance(run);
      r += run;
    }
    return {buf_, n};
  }

  // Where the next tile of at most `left` rows starts; moves past it without reading it.
  const C* skip(int64_t left) {
    const C* start = row();
    for (int64_t n = tile_rows(left); n > 0;) {
      const int64_t run = std::min(n, block_size_ - offset_);
      advance(run);
      n -= run;
    }
    return start;
  }

 private:
  const C* row() const { return head_ + (table_[block_] * block_size_ + offset_) * d_; }

  void advance(int64_t run) {  // within the current block, at most to its end
    offset_ += run;
    if (offset_ == block_size_) {
      offset_ = 0;
      ++block_;
    }
  }

  const C* head_;
  const int64_t* table_;
  int64_t block_size_, d_, padded_;
  float* buf_;
  int64_t block_ = 0, offset_ = 0;
};

// Where one (request, kv head)'s rows lie: its kv head's K and V rows, its block table,
// the positions [first, len) it reads.
template <typename C>
struct ItemRows {
  const C* k;
  const C* v;
  const int64_t* table;
  int64_t first, len;
};

// Asks for the cache lines of the tile `distance` tiles ahead of the one being read, in
// the order a thread reads them: an item's K tiles, its V tiles, then the next item's.
// The hardware prefetcher cannot guess where the next block lies: a tile read from a
// cold block waits a memory latency for its first lines, and a short block (1 KiB of
// int8 rows) ends before the prefetcher has caught up. Measured on 30 layers' caches in
// turn (32 x 100 tokens, SmolLM2's heads): 13% off a float32 call, 25% off an int8 or
// e4m3 one, against asking for the first two lines only; ~10% more on a float32 cache
// small enough to stay in L2 (the lines are there already). The lines are asked into the
// L2, not the L1: two tiles of float32 rows (8 KiB at 64 columns) are more misses than the
// L1 tracks at once, and its prefetches past that wait or are dropped. Zen 4, a cache that
// weights streamed through since (docs/benchmarks.md, "Paged decode: the KV rows into the
// L2"): blocks scattered over the cache 1.4-1.6x faster, in order ~1.0-1.2x.
// `rows(item)` is item's ItemRows.
template <typename C, typename Rows>
class TilePrefetcher {
 public:
  TilePrefetcher(const Rows& rows, int64_t begin, int64_t end, int64_t block_size, int64_t d, int64_t distance)
      : rows_(rows), end_(end), block_size_(block_size), d_(d), item_(begin) {
    load_item();
    for (int64_t i = 0; i < distance; ++i) step();
  }

  // One tile was read: ask for the one `distance` tiles after it.
  void step() {
    if (item_ >= end_) return;
    const int64_t n = cursor_.tile_rows(span_.len - pos_);
    const char* start = reinterpret_cast<const char*>(cursor_.skip(span_.len - pos_));
    pos_ += n;
    for (int64_t byte = 0; byte < n * d_ * static_cast<int64_t>(sizeof(C)); byte += 64) prefetch(start + byte);
    if (pos_ < span_.len) return;
    if (!on_values_) {
      on_values_ = true;
      cursor_ = RowTiles<C>(span_.v, span_.table, block_size_, d_, nullptr);
      pos_ = span_.first;
      cursor_.seek(pos_);
    } else {
      ++item_;
      load_item();
    }
  }

 private:
  static void prefetch(const char* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    _mm_prefetch(p, _MM_HINT_T1);
#else
    __builtin_prefetch(p, 0, 2);
#endif
  }

  void load_item() {  // the next item with rows to read, from item_ on
    for (; item_ < end_; ++item_) {
      span_ = rows_(item_);
      if (span_.first < span_.len) break;
    }
    if (item_ >= end_) return;
    on_values_ = false;
    cursor_ = RowTiles<C>(span_.k, span_.table, block_size_, d_, nullptr);
    pos_ = span_.first;
    cursor_.seek(pos_);
  }

  const Rows& rows_;
  int64_t end_, block_size_, d_, item_;
  ItemRows<C> span_{};
  RowTiles<C> cursor_{nullptr, nullptr, 1, 1, nullptr};
  int64_t pos_ = 0;
  bool on_values_ = false;
};

}  // namespace llmd_kv_rows
