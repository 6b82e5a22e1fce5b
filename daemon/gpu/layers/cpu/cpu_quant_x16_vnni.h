// The AVX-512 VNNI x16 product (cpu_quant_x16.cpp's gguf_mm_x16 runs it where the CPU has
// VNNI; the AVX2 one is cpu_quant_x16_avx2_tiles.h): x's rows quantized in int8 passes
// (quantize_row), and each 16-row group of the weight's records times a tile of x's rows
// (group_tile), threads over the groups (mm_x16). What the two products share is
// cpu_quant_x16_product.h; the records are read by cpu_quant_x16_records.h.

#pragma once

#include "cpu_quant_x16_product.h"

#if defined(LLMD_X16_VNNI)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_quant_x16_records.h"

namespace llmd_x16 {

// x's rows quantized (cpu_quant_x16_product.h's QuantizedRow; cpu_quant_x16_avx2.cpp gives
// the same codes). Codes of v / scale to `out` (|v| <= 127 * scale), the sums of each 16
// to sums[0..1]; `v` becomes what they leave.
LLMD_X16_TARGET inline void store_codes(__m512& lo, __m512& hi, float scale, int8_t* out, int32_t* sums) {
  const __m512 inv = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f), s = _mm512_set1_ps(scale);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  const __m128i clo = _mm512_cvtsepi32_epi8(qlo), chi = _mm512_cvtsepi32_epi8(qhi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), clo);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), chi);
  const __m512i slo = _mm512_cvtepi8_epi32(clo), shi = _mm512_cvtepi8_epi32(chi);  // as stored (saturated)
  lo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(slo), s, lo);
  hi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(shi), s, hi);
  sums[0] = _mm512_reduce_add_epi32(slo);
  sums[1] = _mm512_reduce_add_epi32(shi);
}

LLMD_X16_TARGET inline float block_amax(const float* x) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(x)),
                                            _mm512_andnot_ps(sign, _mm512_loadu_ps(x + 16))));
}

// `span`: 32-column blocks per scale d (1, or kSuperBlock: one pass).
LLMD_X16_TARGET inline void quantize_row(const float* x, int64_t cols, int passes, int64_t span, int8_t* codes,
                                         float* d, float* ds, int32_t* sums) {
  const int64_t blocks = cols / kBlock;
  for (int64_t g = 0; g < blocks / span; ++g) {
    float amax = block_amax(x + g * span * kBlock);  // (the AVX2 product takes the same maxima in the same order)
    for (int64_t b = g * span + 1; b < (g + 1) * span; ++b) amax = std::max(amax, block_amax(x + b * kBlock));
    d[g] = amax / 127.0f;
    for (int64_t b = g * span; b < (g + 1) * span; ++b) {
      __m512 lo = _mm512_loadu_ps(x + b * kBlock), hi = _mm512_loadu_ps(x + b * kBlock + 16);
      ds[2 * b] = ds[2 * b + 1] = 0.0f;
      for (int p = 0; p < passes; ++p) {
        const float scale = d[g] * kPassScale[p];
        int32_t* s = sums + p * 2 * blocks + 2 * b;
        store_codes(lo, hi, scale, codes + p * cols + b * kBlock, s);
        ds[2 * b] += scale * static_cast<float>(s[0]);
        ds[2 * b + 1] += scale * static_cast<float>(s[1]);
      }
    }
  }
}

// acc + the dot products of 16 rows' four unsigned codes (q's lanes) with x's four codes
// at `x` (vpdpbusd): x broadcast from memory within the instruction ({1to16}), where
// _mm512_set1_epi32 of it is a load of its own that GCC 12 does not fold (one instruction
// fewer per four columns: 5-12% faster at 32 rows for Q8_0 and Q6_K; docs/benchmarks.md).
LLMD_X16_TARGET inline __m512i dot4(__m512i acc, __m512i q, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*x));
  return acc;
}

// The int32 dot products of sub-block `sb` with pass p of x's block b, the codes' offset
// taken off: columns 0..15 and 16..31 (two chains of four: twice the dot products in
// flight, and each half's own scale where the type has one; where it has not, the two
// are summed, and the offset is taken off the first alone: one broadcast fewer).
// kSplit: four chains of two instead (one row in one pass has no other dot products to
// overlap a chain's latency with: Q6_K / Q8_0 at one row and one pass took longer than at
// two passes).
template <typename R, bool kSplit = false>
LLMD_X16_TARGET inline void sub_block_dots(const SubBlock& sb, const QuantizedRow& x, int p, int64_t b, __m512i& lo,
                                           __m512i& hi) {
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.codes + p * x.cols + b * kBlock);
  const int32_t* offset = x.offsets + p * 2 * x.blocks + 2 * b;  // (broadcast from memory: no multiply here)
  if constexpr (R::kHalves) {
    lo = _mm512_set1_epi32(offset[0]);
    hi = _mm512_set1_epi32(offset[1]);
  } else {
    lo = R::kOffset ? _mm512_set1_epi32(offset[0]) : _mm512_setzero_si512();
    hi = _mm512_setzero_si512();
  }
  if constexpr (kSplit) {
    __m512i lo2 = _mm512_setzero_si512(), hi2 = _mm512_setzero_si512();
    for (int j = 0; j < 4; j += 2) {
      lo = dot4(lo, sb.q[j], xq + j);
      hi = dot4(hi, sb.q[j + 4], xq + j + 4);
      lo2 = dot4(lo2, sb.q[j + 1], xq + j + 1);
      hi2 = dot4(hi2, sb.q[j + 5], xq + j + 5);
    }
    lo = _mm512_add_epi32(lo, lo2);
    hi = _mm512_add_epi32(hi, hi2);
  } else {
    for (int j = 0; j < 4; ++j) {
      lo = dot4(lo, sb.q[j], xq + j);
      hi = dot4(hi, sb.q[j + 4], xq + j + 4);
    }
  }
}

// 254 * s0 + s1 (exact within int32 for the dot products of two passes' codes).
LLMD_X16_TARGET inline __m512i joined(__m512i s0, __m512i s1) {
  return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(s0, 8), _mm512_slli_epi32(s0, 1)), s1);
}

// The weight streams from memory once per product: ask, at sub-block c of the record at
// rp, for what lies kPrefetch sub-blocks ahead (the next group's first records when this
// group ends: groups are contiguous), and kPrefetchL2 ahead into the L2.
template <int64_t kSubBytes>
LLMD_X16_TARGET inline void prefetch_ahead(const uint8_t* rp, int c) {
  const char* ahead = reinterpret_cast<const char*>(rp + (c + kPrefetch) * kSubBytes);
  for (int64_t line = 0; line < kSubBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  const char* far = reinterpret_cast<const char*>(rp + (c + kPrefetchL2) * kSubBytes);
  for (int64_t line = 0; line < kSubBytes; line += 64) _mm_prefetch(far + line, _MM_HINT_T2);
}

template <int T>
LLMD_X16_TARGET inline void store_tile(const __m512 (&acc)[T], float* out, int64_t stride, bool stream) {
  if (stream) {
    for (int r = 0; r < T; ++r) _mm512_stream_ps(out + r * stride, acc[r]);
  } else {
    for (int r = 0; r < T; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
  }
}

// out[r][g*16 + lane] for the `T` rows of x and the 16 weight rows of group g: per
// sub-block, its scale times the sum over passes of its dot products times that pass's
// scale of x, plus the minimums times x's sums.
// `stream`: the outputs stored past the caches (mm_x16's kStreamBytes).
template <int Q, int T, int P>
LLMD_X16_TARGET void group_tile(const uint8_t* w, const QuantizedRow* x, float* out, int64_t stride, bool stream) {
  using R = X16Record<Q>;
  constexpr int64_t rec = record_bytes(Q), sub_bytes = rec / R::kSub;
  const int64_t blocks = x[0].blocks;
  __m512 acc[T];
  for (int r = 0; r < T; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < blocks / R::kSub; ++s) {
    const uint8_t* rp = w + s * rec;
    const R record(rp);
    // Not unrolled: with the K-quants' eight sub-blocks unrolled (their shifts constants)
    // the product was as fast with its weight in cache and 1.2-1.5x slower streamed from
    // memory at one row on Zen 4 (the 1B's 763 MiB of Q4_K / Q6_K layers, 2 threads: 33.4
    // / 35.4 ms a token at 1 / 2 passes, not unrolled 21.1 / 22.2; docs/benchmarks.md).
#pragma GCC unroll 1
    for (int c = 0; c < R::kSub; ++c) {
      prefetch_ahead<sub_bytes>(rp, c);
      SubBlock sb;
      record.decode(c, sb);
      const int64_t b = s * R::kSub + c;
      for (int r = 0; r < T; ++r) {
        __m512i lo[P], hi[P];
        for (int p = 0; p < P; ++p) sub_block_dots<R, T * P == 1>(sb, x[r], p, b, lo[p], hi[p]);
        if constexpr (joins_passes(Q, P)) {  // 254 * pass 0's + pass 1's
          lo[1] = joined(lo[0], lo[1]);
          hi[1] = joined(hi[0], hi[1]);
        }
        __m512 t_lo = _mm512_setzero_ps(), t_hi = _mm512_setzero_ps();
        for (int p = first_scaled_pass(Q, P); p < P; ++p) {
          const __m512 dx = _mm512_set1_ps(x[r].dp[p * blocks + b]);
          if constexpr (R::kHalves) {  // each half its scale: in float32 (an int32 multiply is two slow uops)
            t_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[p]), dx, t_lo);
            t_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[p]), dx, t_hi);
          } else {
            t_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo[p], hi[p])), dx, t_lo);
          }
        }
        acc[r] = _mm512_fmadd_ps(sb.scale[0], t_lo, acc[r]);
        if constexpr (R::kHalves) acc[r] = _mm512_fmadd_ps(sb.scale[1], t_hi, acc[r]);
        const float* ds = x[r].ds + 2 * b;
        if constexpr (R::kMin == 1) acc[r] = _mm512_fmadd_ps(sb.min[0], _mm512_set1_ps(x[r].ds01[b]), acc[r]);
        if constexpr (R::kMin == 2) {
          acc[r] = _mm512_fmadd_ps(sb.min[0], _mm512_set1_ps(ds[0]), acc[r]);
          acc[r] = _mm512_fmadd_ps(sb.min[1], _mm512_set1_ps(ds[1]), acc[r]);
        }
      }
    }
  }
  store_tile<T>(acc, out, stride, stream);
}

// group_tile's product where x is quantized per super-block (super_blocks: one pass, a
// K-quant): per row, each sub-block's dot products times its integer sub-scale added in
// int32 over the record, then scaled once by the record's d and x's d; the minimums
// (Q4_K, Q5_K) times x's sums likewise, two sub-blocks per vpdpwssd.
template <int Q, int T>
LLMD_X16_TARGET void super_tile(const uint8_t* w, const QuantizedRow* x, float* out, int64_t stride, bool stream) {
  using R = X16Record<Q>;
  static_assert(R::kSub == kSuperBlock && R::kMin <= 1);
  constexpr int64_t rec = record_bytes(Q), sub_bytes = rec / R::kSub;
  const int64_t supers = x[0].blocks / kSuperBlock;
  __m512 acc[T];
  for (int r = 0; r < T; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* rp = w + s * rec;
    const R record(rp);
    __m512i isum[T];
    for (int r = 0; r < T; ++r) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int c = 0; c < R::kSub; ++c) {
      prefetch_ahead<sub_bytes>(rp, c);
      SubBlock sb;
      __m512i sc[2];
      record.codes(c, sb.q);
      record.int_scales(c, sc);
      for (int r = 0; r < T; ++r) {
        __m512i lo, hi;
        sub_block_dots<R, T == 1>(sb, x[r], 0, s * kSuperBlock + c, lo, hi);
        if constexpr (R::kHalves) {
          const __m512i scaled = _mm512_add_epi32(_mm512_mullo_epi32(lo, sc[0]), _mm512_mullo_epi32(hi, sc[1]));
          isum[r] = _mm512_add_epi32(isum[r], scaled);
        } else {
          isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(_mm512_add_epi32(lo, hi), sc[0]));
        }
      }
    }
    __m512i min_pairs[kSuperBlock / 2];
    if constexpr (R::kMin == 1) record.min_pairs(min_pairs);
    for (int r = 0; r < T; ++r) {
      const __m512 dx = _mm512_set1_ps(x[r].d[s]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(record.d, dx), acc[r]);
      if constexpr (R::kMin == 1) {
        const int32_t* pairs = x[r].pairs + s * (kSuperBlock / 2);
        __m512i m = _mm512_setzero_si512();
        for (int i = 0; i < kSuperBlock / 2; ++i) {
          m = _mm512_dpwssd_epi32(m, min_pairs[i], _mm512_set1_epi32(pairs[i]));
        }
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(record.neg_dmin, dx), acc[r]);
      }
    }
  }
  store_tile<T>(acc, out, stride, stream);
}

// Rows of x per tile: kWideTile, the codes decoded once per eight rows (32 rows, one thread,
// in cache: Q4_K / Q6_K 1.15-1.2x faster at one pass, 1.05-1.1x at two), but four where
// two passes are joined in int32 (Q8_0, IQ4_NL: eight were 5% slower, their registers full).
constexpr int64_t tile_rows(int quant, int passes) {
  return llmd_x16::joins_passes(quant, passes) ? llmd_x16::kTile : llmd_x16::kWideTile;
}

// Outputs of at least this many bytes are stored past the caches (non-temporal): an LM
// head's logits (Gemma 3's 262,144 columns at 32 rows: 32 MiB) would otherwise be read
// into the cache line by line before each is written, and evict the weights' prefetched
// lines; what the next layer reads at once stays below it (the 1B's widest, 32 rows of
// 16,384: 2 MiB). Q8_0 262144 x 640 at 32 rows, one pass, into a buffer reused from call
// to call (gguf_quant's LM head): 1.2x faster; into new pages, which the kernel has just
// zeroed through the caches, 5% slower (docs/benchmarks.md).
constexpr int64_t kStreamBytes = int64_t{8} << 20;

template <int Q, int P>
void mm_x16(const std::vector<QuantizedRow>& x, const uint8_t* w, int64_t n, int64_t records, float* out) {
  const bool stream = static_cast<int64_t>(x.size()) * n * static_cast<int64_t>(sizeof(float)) >= kStreamBytes &&
                      reinterpret_cast<uintptr_t>(out) % 64 == 0;  // (rows 4n bytes apart: n a multiple of 16)
  llmd_x16::for_each_tile<tile_rows(Q, P)>(x, P, w, n, records * record_bytes(Q), out,
                [n, stream](auto t, const uint8_t* wg, const QuantizedRow* xr, float* o) {
                  if constexpr (super_blocks(Q, P)) {
                    super_tile<Q, decltype(t)::value>(wg, xr, o, n, stream);
                  } else {
                    group_tile<Q, decltype(t)::value, P>(wg, xr, o, n, stream);
                  }
                }, stream);
}

template <int Q>
void mm_x16_passes(const std::vector<QuantizedRow>& x, int passes, const uint8_t* w, int64_t n, int64_t records,
                   float* out) {
  switch (passes) {
    case 1: mm_x16<Q, 1>(x, w, n, records, out); break;
    case 2: mm_x16<Q, 2>(x, w, n, records, out); break;
    default: mm_x16<Q, 3>(x, w, n, records, out); break;
  }
}

}  // namespace llmd_x16

#endif
