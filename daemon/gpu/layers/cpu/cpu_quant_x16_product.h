// What the two x16 products share (cpu_quant_x16_vnni.h: AVX-512 VNNI; cpu_quant_x16_avx2.cpp:
// AVX2): x quantized per 32-column block in int8 passes (or, for the K-quants at one pass,
// per 256-column super-block: super_blocks), and the AVX2 product's entry points (the
// VNNI one is a header of its own, included by the operators).

#pragma once

#include <ATen/Parallel.h>

#if defined(__x86_64__)
#include <immintrin.h>  // _mm_sfence
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_quant_x16_layout.h"

// The x16 products a build compiles (their template instances are most of the kernels'
// compile time): the AVX-512 build both (an AVX-512 CPU runs the AVX2 one too, which is
// how a machine with VNNI tests it: LLMD_GGUF_X16_ISA), the AVX2 build the AVX2 one, the
// portable build (a CPU with neither; ATEN_CPU_CAPABILITY=default) none.
#if defined(__x86_64__) && defined(CPU_CAPABILITY_AVX512)
#define LLMD_X16_VNNI 1
#endif
#if defined(__x86_64__) && (defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2))
#define LLMD_X16_AVX2 1
#endif

namespace llmd_x16 {

constexpr int64_t kBlock = 32;     // columns of x per quantization block (and per sub-block)
constexpr int64_t kPrefetch = 16;  // sub-blocks ahead the product asks the memory for (measured: 2-32)
// Sub-blocks ahead it also asks for into the L2 (prefetcht2), beside kPrefetch's requests:
// measured 6-10% faster streamed from memory at one thread, 96 and 256 alike
// (docs/benchmarks.md, "Batch-1 decode").
constexpr int64_t kPrefetchL2 = 128;

constexpr int kMaxPasses = 3;
constexpr float kPassScale[kMaxPasses] = {1.0f, 1.0f / 254.0f, 1.0f / (254.0f * 254.0f)};

// One row of x quantized per 32-column block (or per super-block of them: super_blocks) in
// `passes` int8 passes: pass 0 the codes of x at the block's scale d = amax / 127, each
// next pass the codes of what the passes before left, at 1/254 of their scale
// (x = d * (q0 + q1 / 254 + q2 / 254^2) to within the last pass's half step: 7, 15 or 23
// bits of the block's largest value). Per 16 columns (a K-quant sub-scale's reach):
// `sums`, the codes' sums (what the weights' offsets multiply), and `ds`, x's sum as the
// passes give it (what the minimums multiply, where x is quantized per 32 columns).
// The codes are within [-127, 127] for finite x (|x| <= amax); only where a pass's
// 1 / scale overflows float32 (a block whose values are all below ~2e-32) may they be
// -128, and that block's products are off by amounts of its size (the AVX2 product reads
// such a -128 against a negative Q8_0 code as if it were +128).
struct QuantizedRow {
  const int8_t* codes;  // [passes][cols]
  const float* d;       // [blocks]; per super-block (super_blocks) [blocks / kSuperBlock]
  const float* ds;      // [2 * blocks]
  const int32_t* sums;  // [passes][2 * blocks]
  int64_t cols, blocks;
  // [cols] passes 0 and 1 joined, 254 * q0 + q1 (within int16 for any codes), each four
  // columns' in the order 0, 2, 1, 3: where the AVX2 product multiplies signed codes
  // (Q8_0, IQ4_NL) by them at once (wide_dots in cpu_quant_x16_avx2_tiles.h); else null.
  const int16_t* wide = nullptr;
  // Quantized per super-block (super_blocks): [blocks / 2] the sums of x's codes over each
  // two 32-column blocks as int16 pairs, block 2i's in the low half, 2i + 1's in the high
  // (what vpdpwssd / vpmaddwd multiply a K-quant's pairs of sub-block minimums by); else null.
  const int32_t* pairs = nullptr;
  // For the VNNI product, where x is quantized per 32 columns: [passes][blocks] d[b] *
  // kPassScale[p], and [blocks] ds[2b] + ds[2b + 1] (what its tiles multiply by, read as
  // they are instead of computed per row and sub-block: the same floats); else null.
  const float* dp = nullptr;
  const float* ds01 = nullptr;
  // For the VNNI product of the weight's type: [passes][2 * blocks] what its dot products
  // start from, -kOffset times `sums` (the codes' offset taken off: per 16 columns where
  // the type has a scale per 16, else both halves' in the first); else null.
  const int32_t* offsets = nullptr;
};

// K-quants whose sub-scales are integers with no minimum per 16 columns (Q3_K, Q4_K,
// Q5_K, Q6_K: types 6-9) at one pass: x is quantized per 256-column super-block, one
// scale d = amax / 127 over the super-block (llama.cpp's Q8_K, what it multiplies these
// types by), so that each sub-block's int32 dot product times its integer sub-scale adds
// up in int32 over the record, and x's scale, the record's d and its minimums take one
// float32 step per super-block instead of one per 32 columns (the float work shares the
// multiply pipes with vpdpbusd: on Zen 4 a tile of eight rows of Q4_K went from 67% of
// the vpdpbusd peak to 76%, Q6_K from 57% to 67%; docs/benchmarks.md). x's codes,
// per-16-column sums and the int32 sums are exact, so both products still give the same
// floats; what changes is x's precision: half a step of 1/127 of the super-block's
// largest value instead of its 32-column block's — llama.cpp's for these types. Two or
// three passes keep 32-column blocks (their bits are what they are for); Q2_K (a
// minimum per 16 columns) keeps them too.
constexpr bool super_blocks(int quant, int passes) { return quant >= 6 && quant <= 9 && passes == 1; }
constexpr int64_t kSuperBlock = 8;  // 32-column blocks of x per super-block

// Q8_0 and IQ4_NL (types 0 and 10: signed codes) with two or three passes: both products
// join passes 0 and 1 in int32 before scaling, 254 * pass 0's dot product + pass 1's
// (exact: below 2^28 in magnitude for any codes), at pass 1's scale, then pass 2's at its
// own — one float32 rounding where the passes took two. The AVX2 product reaches those integers at once (vpmaddwd
// over x's joined codes: QuantizedRow::wide), the VNNI one by joining its two passes', so
// the floats are the same. Other types scale each pass (a join measured 5-15% slower for
// the K-quants on AVX2, whose passes are cheap there).
constexpr bool joins_passes(int quant, int passes) { return (quant == 0 || quant == 10) && passes >= 2; }
constexpr int first_scaled_pass(int quant, int passes) { return joins_passes(quant, passes) ? 1 : 0; }

// Rows of x per pass over a record (with AVX2 their float32 accumulators are two per row,
// one per 8-row half, in sixteen ymm registers beside eight of codes). The VNNI product
// also takes tiles of kWideTile rows where its registers hold them (32 zmm): the weight's
// codes decoded once per eight rows (tile_rows in cpu_quant_x16_vnni.h).
constexpr int64_t kTile = 4;
constexpr int64_t kWideTile = 8;

// Bytes of x's rows a block of them may take while the threads' groups of the weight pass
// over it (row_blocks): half of Zen 4's 1 MiB L2 per core (Intel's AVX-512 cores have
// 1.25-2 MiB), the other half the weight's group (up to 107 KiB: Q6_K over 8,192 columns)
// and the outputs' lines. (An AVX2 core with 256 KiB reads x from the L3 either way.)
constexpr int64_t kRowBlockBytes = int64_t{512} << 10;

// Rows of x per block: every tile reads its rows of x once per 16-row group of the weight,
// so where x outgrows the L2 each group reads it from the L3 again. In blocks of
// kRowBlockBytes x stays in the L2 and the weight streams once per block instead (it
// streams from memory at any size past the L2, and the tiles prefetch it): at 1,024 rows
// on Zen 4, one pass, Q4_K 16384 x 2048 and 2048 x 8192 ran 3% faster, Q6_K 1%
// (docs/benchmarks.md). A multiple of kWideTile; all the rows where they fit (decode
// steps, short prefills).
inline int64_t row_blocks(int64_t rows, int64_t row_bytes) {
  const int64_t fit = std::max<int64_t>(kRowBlockBytes / std::max<int64_t>(row_bytes, 1) / kWideTile, 1) * kWideTile;
  return std::min(rows, fit);
}

// Both products' outer loops: threads over the weight's 16-row groups (`group_bytes`
// each); within a thread, x's rows in blocks of row_blocks (a row of x is `passes` int8
// codes per column: the bytes a tile reads of it, the AVX2 product's passes 0 and 1
// joined in int16 alike), and per block each of the thread's groups in turn over the
// block's rows, in tiles of kMaxTile (kTile or kWideTile) while that many are left, then
// of up to kTile: tile(std::integral_constant<int, T>, group's records, its rows of x,
// their output) (out [rows, n]). `fence`: each thread's stores are fenced (sfence) once
// its share is done: where the tiles store past the caches.
template <int64_t kMaxTile = kTile, typename Tile>
void for_each_tile(const std::vector<QuantizedRow>& x, int passes, const uint8_t* w, int64_t n, int64_t group_bytes,
                   float* out, const Tile& tile, bool fence = false) {
  static_assert(kMaxTile == kTile || kMaxTile == kWideTile);
  const int64_t rows = static_cast<int64_t>(x.size());
  if (rows == 0) return;
  const int64_t block = row_blocks(rows, passes * x[0].cols);
  at::parallel_for(0, n / kGroup, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t b0 = 0; b0 < rows; b0 += block) {
      const int64_t b1 = std::min(rows, b0 + block);
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* wg = w + g * group_bytes;
        int64_t r0 = b0;
        if constexpr (kMaxTile == kWideTile) {
          for (; r0 + kWideTile <= b1; r0 += kWideTile) {
            tile(std::integral_constant<int, kWideTile>{}, wg, x.data() + r0, out + r0 * n + g * kGroup);
          }
        }
        for (; r0 < b1; r0 += kTile) {
          const QuantizedRow* xr = x.data() + r0;
          float* o = out + r0 * n + g * kGroup;
          switch (std::min(kTile, b1 - r0)) {
            case 1: tile(std::integral_constant<int, 1>{}, wg, xr, o); break;
            case 2: tile(std::integral_constant<int, 2>{}, wg, xr, o); break;
            case 3: tile(std::integral_constant<int, 3>{}, wg, xr, o); break;
            default: tile(std::integral_constant<int, 4>{}, wg, xr, o); break;
          }
        }
      }
    }
#if defined(__x86_64__)
    if (fence) _mm_sfence();
#endif
  });
}

// The AVX2 (+FMA, F16C) product (cpu_quant_x16_avx2.cpp), for CPUs without AVX-512 VNNI:
// the same codes, sums and scales as the VNNI path's quantize_row, bit for bit
// (`span`: 32-column blocks per scale, 1 or kSuperBlock) ...
void quantize_row_avx2(const float* x, int64_t cols, int passes, int64_t span, int8_t* codes, float* d, float* ds,
                       int32_t* sums);
// ... and the same int32 dot products, scaled in the same float32 order: out [rows, n]
// for the rows of x and the x16 weight w of type `quant` (`records` per 16-row group).
void mm_x16_avx2(int64_t quant, int passes, const std::vector<QuantizedRow>& x, const uint8_t* w, int64_t n,
                 int64_t records, float* out);
// The same with P passes (P = 1, 2, 3), for every type: each P's template instances are
// compiled in a file of their own (cpu_quant_x16_avx2_tiles.h).
template <int P>
void mm_x16_avx2_passes(int64_t quant, const std::vector<QuantizedRow>& x, const uint8_t* w, int64_t n,
                        int64_t records, float* out);
template <>
void mm_x16_avx2_passes<1>(int64_t, const std::vector<QuantizedRow>&, const uint8_t*, int64_t, int64_t, float*);
template <>
void mm_x16_avx2_passes<2>(int64_t, const std::vector<QuantizedRow>&, const uint8_t*, int64_t, int64_t, float*);
template <>
void mm_x16_avx2_passes<3>(int64_t, const std::vector<QuantizedRow>&, const uint8_t*, int64_t, int64_t, float*);

}  // namespace llmd_x16
