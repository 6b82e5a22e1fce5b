// The x16 product (cpu_quant_x16.cpp) on CPUs with AVX2, FMA and F16C but no AVX-512 VNNI
// (AMD Zen 2/3, Intel servers before Ice Lake, Intel clients since Alder Lake), as
// llama.cpp multiplies int8 there: over the same x16 weight bytes and the same int8
// passes over x, with vpmaddubsw (unsigned weight codes times signed x codes, adjacent
// pairs summed to int16) and vpmaddwd by ones (pairs of those to int32) in place of
// vpdpbusd. A 256-bit vector holds eight rows, so each 16-row group is read as two halves
// (cpu_quant_x16_records_avx2.h).
//
// vpmaddubsw saturates an int16 past 32767: with x's codes within [-128, 127], a pair of
// products is at most 2 * 128 * kCodeMax, so the small codes add that many pair sums in
// int16 before one vpmaddwd (8 for 4-bit codes: 8 * 2 * 128 * 15 = 30720; 4 for 5-bit,
// 2 for Q6_K's 6). Q8_0's codes (0..255 with the offset) would saturate a single pair:
// llama.cpp's sign trick multiplies |w| (at most 128) by x with w's sign, at most
// 2 * 128 * 127 = 32512, and no offset is taken off. The int32 dot products are then
// exactly the VNNI path's, and are scaled in float32 in the same order.
//
// This header holds the product's templates; each number of passes over x has its
// instances compiled in its own file (cpu_quant_x16_avx2.cpp: one pass, with x's
// quantization and the entry points; cpu_quant_x16_avx2_p2.cpp, _p3.cpp), so that a
// fresh build compiles them side by side (in one file they were 127 of the build's 160 s
// on two cores).

#pragma once

#include "cpu_quant_x16_product.h"

#if defined(LLMD_X16_AVX2)
#include <ATen/Parallel.h>

#include "cpu_quant_formats.h"
#include "cpu_quant_x16_records_avx2.h"

#include <algorithm>

namespace llmd_x16 {
namespace {

using avx2::HalfScales;
using avx2::X16Half;

// The largest power of two up to `cap` of vpmaddubsw results that add in int16 without
// saturating, for codes up to `code_max` and x's codes up to 128 in magnitude.
constexpr int int16_sums(int code_max, int cap) {
  int n = cap;
  while (n > 1 && n * 2 * 128 * code_max > 32767) n /= 2;
  return n;
}

// |q| for signed codes (Q8_0, IQ4_NL: llama.cpp's sign trick), else the codes themselves.
template <typename R>
LLMD_X16_AVX2_TARGET inline __m256i magnitude_of(__m256i q) {
  return R::kSigned ? _mm256_abs_epi8(q) : q;
}

// vpmaddubsw of a chunk's codes (as magnitude_of gives them) with x's four codes `x`
// broadcast, carrying q's signs over to x for signed codes.
template <typename R>
LLMD_X16_AVX2_TARGET inline __m256i code_product(__m256i q, __m256i magnitude, int32_t x) {
  const __m256i xk = _mm256_set1_epi32(x);
  return _mm256_maddubs_epi16(magnitude, R::kSigned ? _mm256_sign_epi8(xk, q) : xk);
}

// The int32 dot products of chunks [kFirst, kFirst + kCount) of one half's codes with the
// codes of x's T rows in each of P passes, added to sums[r][p] (which start at the
// offset's term); kSums chunks' products add in int16 before one vpmaddwd. The chunks
// are decoded first and each (row, pass)'s products taken in turn (the loads issued
// together: chunk by chunk measured 10-15% slower with one pass), unless there are
// several passes over few rows (kByChunk): then chunk by chunk, each chunk decoded once
// and used by every (row, pass) while it is in a register (the eight chunks held beside
// three passes' sums spilled to the stack: with this order the 1B Q4_K_M's batch-1
// float32 decode 8.9 -> 9.3-10.6 tok/s).
template <typename R, int T, int P, int kFirst, int kCount>
LLMD_X16_AVX2_TARGET inline void dots(const R& record, int c, const int32_t* const (&xq)[T][P],
                                      __m256i (&sums)[T][P]) {
  constexpr int kSums = R::kSigned ? 1 : int16_sums(R::kCodeMax, kCount);
  constexpr bool kByChunk = P > 1 && T * P <= 4;  // the (row, pass) sums it holds fit beside a chunk
  static_assert(kCount % kSums == 0);
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (!kByChunk) {
    __m256i q[kCount];
    for (int k = 0; k < kCount; ++k) q[k] = record.code(c, kFirst + k);
    for (int r = 0; r < T; ++r) {
      for (int p = 0; p < P; ++p) {
        for (int g = 0; g < kCount; g += kSums) {
          __m256i pairs = code_product<R>(q[g], magnitude_of<R>(q[g]), xq[r][p][kFirst + g]);
          for (int k = g + 1; k < g + kSums; ++k)
            pairs = _mm256_add_epi16(pairs, code_product<R>(q[k], magnitude_of<R>(q[k]), xq[r][p][kFirst + k]));
          sums[r][p] = _mm256_add_epi32(sums[r][p], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
  } else {
    for (int g = kFirst; g < kFirst + kCount; g += kSums) {
      __m256i pairs[T][P];
      for (int k = g; k < g + kSums; ++k) {
        const __m256i q = record.code(c, k);
        const __m256i magnitude = magnitude_of<R>(q);
        for (int r = 0; r < T; ++r) {
          for (int p = 0; p < P; ++p) {
            const __m256i pk = code_product<R>(q, magnitude, xq[r][p][k]);
            pairs[r][p] = k == g ? pk : _mm256_add_epi16(pairs[r][p], pk);
          }
        }
      }
      for (int r = 0; r < T; ++r)
        for (int p = 0; p < P; ++p) sums[r][p] = _mm256_add_epi32(sums[r][p], _mm256_madd_epi16(pairs[r][p], ones));
    }
  }
}

// Signed codes' (Q8_0, IQ4_NL) int32 dot products with x's passes 0 and 1 joined
// (QuantizedRow::wide: 254 q0 + q1 in int16) added to joined[r], and with pass 2 (P = 3)
// to third[r]: vpmaddwd multiplies the codes sign-extended to int16 (a lane's columns 0,
// 2 and 1, 3) by x's joined codes at once, where two passes of the sign trick would take
// twice the instructions. The integers are the joined passes' (joins_passes), exactly.
template <typename R, int T, int P>
LLMD_X16_AVX2_TARGET inline void wide_dots(const R& record, int c, const int32_t* const (&wide)[T],
                                           const int32_t* const (&third)[T], __m256i (&joined_sums)[T],
                                           __m256i (&third_sums)[T]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int k = 0; k < 8; ++k) {
    const __m256i q = record.code(c, k);
    const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(q, 8), 8), odd = _mm256_srai_epi16(q, 8);
    for (int r = 0; r < T; ++r) {
      const __m256i e = _mm256_madd_epi16(even, _mm256_set1_epi32(wide[r][2 * k]));
      const __m256i o = _mm256_madd_epi16(odd, _mm256_set1_epi32(wide[r][2 * k + 1]));
      joined_sums[r] = _mm256_add_epi32(joined_sums[r], _mm256_add_epi32(e, o));
      if constexpr (P == 3) {
        const __m256i pairs = code_product<R>(q, magnitude_of<R>(q), third[r][k]);
        third_sums[r] = _mm256_add_epi32(third_sums[r], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
}

// The int32 dot products of sub-block c of the half `record` (of the record at rp, the s-th
// of its group) with x's T rows in P passes: lo[r][p] (and hi with kHalves: columns 0..15
// and 16..31 apart), the offset's term included: -kOffset * the sum of x's codes; for
// signed codes with two or three passes, passes 0 and 1 joined in lo[r][1] (joins_passes).
template <int Q, int T, int P>
LLMD_X16_AVX2_TARGET __attribute__((always_inline)) inline void sub_block_sums(const X16Half<Q>& record,
                                                                               const uint8_t* rp, int h, int64_t s,
                                                                               int c, const QuantizedRow* x,
                                                                               __m256i (&lo)[T][P],
                                                                               __m256i (&hi)[T][P]) {
  using R = X16Half<Q>;
  constexpr int64_t sub_bytes = record_bytes(Q) / R::kSub;
  constexpr bool kWide = joins_passes(Q, P);  // through wide_dots
  static_assert(kWide == (R::kSigned && P >= 2));  // joins_passes names exactly the signed-code types
  if (h == 0) {  // as the VNNI path asks, once per sub-block
    const char* ahead = reinterpret_cast<const char*>(rp + (c + kPrefetch) * sub_bytes);
    for (int64_t line = 0; line < sub_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    const char* far = reinterpret_cast<const char*>(rp + (c + kPrefetchL2) * sub_bytes);
    for (int64_t line = 0; line < sub_bytes; line += 64) _mm_prefetch(far + line, _MM_HINT_T2);
  }
  const int64_t b = s * R::kSub + c;
  if constexpr (kWide) {  // (signed codes: no offset, no halves)
    const int32_t* wide[T];
    const int32_t* third[T];
    __m256i joined_sums[T], third_sums[T];
    for (int r = 0; r < T; ++r) {
      wide[r] = reinterpret_cast<const int32_t*>(x[r].wide + b * kBlock);
      third[r] = P == 3 ? reinterpret_cast<const int32_t*>(x[r].codes + 2 * x[r].cols + b * kBlock) : nullptr;
      joined_sums[r] = third_sums[r] = _mm256_setzero_si256();
    }
    wide_dots<R, T, P>(record, c, wide, third, joined_sums, third_sums);
    for (int r = 0; r < T; ++r) {
      lo[r][1] = joined_sums[r];
      if constexpr (P == 3) lo[r][2] = third_sums[r];
    }
  } else {
    const int32_t* xq[T][P];
    for (int r = 0; r < T; ++r)
      for (int p = 0; p < P; ++p) xq[r][p] = reinterpret_cast<const int32_t*>(x[r].codes + p * x[r].cols + b * kBlock);
    for (int r = 0; r < T; ++r) {
      for (int p = 0; p < P; ++p) {
        const int32_t* sum = x[r].sums + p * 2 * x[r].blocks + 2 * b;
        lo[r][p] = _mm256_set1_epi32(-R::kOffset * (R::kHalves ? sum[0] : sum[0] + sum[1]));
        if constexpr (R::kHalves) hi[r][p] = _mm256_set1_epi32(-R::kOffset * sum[1]);
      }
    }
    if constexpr (R::kHalves) {
      dots<R, T, P, 0, 4>(record, c, xq, lo);
      dots<R, T, P, 4, 4>(record, c, xq, hi);
    } else {
      dots<R, T, P, 0, 8>(record, c, xq, lo);
    }
  }
}

// Sub-block c of the half `record` into acc[h]: sub_block_sums, scaled.
template <int Q, int T, int P>
LLMD_X16_AVX2_TARGET __attribute__((always_inline)) inline void sub_block_tile(const X16Half<Q>& record,
                                                                               const uint8_t* rp, int h, int64_t s,
                                                                               int c, const QuantizedRow* x,
                                                                               __m256 (&acc)[2][T]) {
  using R = X16Half<Q>;
  const int64_t b = s * R::kSub + c;
  __m256i lo[T][P], hi[T][P];
  sub_block_sums<Q, T, P>(record, rp, h, s, c, x, lo, hi);
  HalfScales sc;
  record.scales(c, sc);
  for (int r = 0; r < T; ++r) {
    __m256 t_lo = _mm256_setzero_ps(), t_hi = _mm256_setzero_ps();
    for (int p = first_scaled_pass(Q, P); p < P; ++p) {
      const __m256 dx = _mm256_set1_ps(x[r].d[b] * kPassScale[p]);
      t_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r][p]), dx, t_lo);
      if constexpr (R::kHalves) t_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r][p]), dx, t_hi);
    }
    __m256& a = acc[h][r];
    a = _mm256_fmadd_ps(sc.scale[0], t_lo, a);
    if constexpr (R::kHalves) a = _mm256_fmadd_ps(sc.scale[1], t_hi, a);
    const float* ds = x[r].ds + 2 * b;
    if constexpr (R::kMin == 1) a = _mm256_fmadd_ps(sc.min[0], _mm256_set1_ps(ds[0] + ds[1]), a);
    if constexpr (R::kMin == 2) {
      a = _mm256_fmadd_ps(sc.min[0], _mm256_set1_ps(ds[0]), a);
      a = _mm256_fmadd_ps(sc.min[1], _mm256_set1_ps(ds[1]), a);
    }
  }
}

// out[r][g*16 + lane] for the `T` rows of x and the 16 weight rows of group g, half by
// half within each record: what the VNNI path's group_tile computes, in the same order.
// (Taking half 0 of every record, then half 1, to hold T accumulators instead of 2T:
// measured no faster, 2026-11-29.)
template <int Q, int T, int P>
LLMD_X16_AVX2_TARGET void group_tile(const uint8_t* w, const QuantizedRow* x, float* out, int64_t stride) {
  using R = X16Half<Q>;
  constexpr int64_t rec = record_bytes(Q);
  const int64_t blocks = x[0].blocks;
  __m256 acc[2][T];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < T; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < blocks / R::kSub; ++s) {
    const uint8_t* rp = w + s * rec;
    for (int h = 0; h < 2; ++h) {
      const R record(rp, h);
      // One row's sub-blocks unrolled (their shifts constants: 5-15% faster for the
      // K-quants at one row); several rows' not (unrolled, their tiles ran 1.2-2x slower:
      // docs/benchmarks.md, "The x16 product's sub-block loop on AVX2").
      if constexpr (T == 1) {
#pragma GCC unroll 8
        for (int c = 0; c < R::kSub; ++c) sub_block_tile<Q, T, P>(record, rp, h, s, c, x, acc);
      } else {
#pragma GCC unroll 1
        for (int c = 0; c < R::kSub; ++c) sub_block_tile<Q, T, P>(record, rp, h, s, c, x, acc);
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < T; ++r) _mm256_storeu_ps(out + r * stride + 8 * h, acc[h][r]);
}

// group_tile's product where x is quantized per super-block (super_blocks: one pass, a
// K-quant), half by half: what the VNNI path's super_tile computes, in the same order.
template <int Q, int T>
LLMD_X16_AVX2_TARGET void super_tile(const uint8_t* w, const QuantizedRow* x, float* out, int64_t stride) {
  using R = X16Half<Q>;
  static_assert(R::kSub == kSuperBlock && R::kMin <= 1);
  constexpr int64_t rec = record_bytes(Q);
  const int64_t supers = x[0].blocks / kSuperBlock;
  __m256 acc[2][T];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < T; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* rp = w + s * rec;
    for (int h = 0; h < 2; ++h) {
      const R record(rp, h);
      __m256i isum[T];
      for (int r = 0; r < T; ++r) isum[r] = _mm256_setzero_si256();
      const auto sub_block = [&](int c) __attribute__((always_inline)) {
        __m256i lo[T][1], hi[T][1], sc[2];
        sub_block_sums<Q, T, 1>(record, rp, h, s, c, x, lo, hi);
        record.int_scales(c, sc);
        for (int r = 0; r < T; ++r) {
          if constexpr (R::kHalves) {
            isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_mullo_epi32(lo[r][0], sc[0]),
                                                                 _mm256_mullo_epi32(hi[r][0], sc[1])));
          } else {
            isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(lo[r][0], sc[0]));
          }
        }
      };
      if constexpr (T == 1) {  // as group_tile: one row's sub-blocks unrolled, several rows' not
#pragma GCC unroll 8
        for (int c = 0; c < R::kSub; ++c) sub_block(c);
      } else {
#pragma GCC unroll 1
        for (int c = 0; c < R::kSub; ++c) sub_block(c);
      }
      __m256i min_pairs[kSuperBlock / 2];
      if constexpr (R::kMin == 1) record.min_pairs(min_pairs);
      for (int r = 0; r < T; ++r) {
        const __m256 dx = _mm256_set1_ps(x[r].d[s]);
        __m256& a = acc[h][r];
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(record.d, dx), a);
        if constexpr (R::kMin == 1) {
          const int32_t* pairs = x[r].pairs + s * (kSuperBlock / 2);
          __m256i m = _mm256_setzero_si256();
          for (int i = 0; i < kSuperBlock / 2; ++i)
            m = _mm256_add_epi32(m, _mm256_madd_epi16(min_pairs[i], _mm256_set1_epi32(pairs[i])));
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(record.neg_dmin, dx), a);
        }
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < T; ++r) _mm256_storeu_ps(out + r * stride + 8 * h, acc[h][r]);
}

// The tile the product takes for (Q, P): super_tile where x is quantized per super-block.
template <int Q, int T, int P>
LLMD_X16_AVX2_TARGET void any_tile(const uint8_t* w, const QuantizedRow* x, float* out, int64_t stride) {
  if constexpr (super_blocks(Q, P)) {
    super_tile<Q, T>(w, x, out, stride);
  } else {
    group_tile<Q, T, P>(w, x, out, stride);
  }
}

// x's passes 0 and 1 joined for wide_dots (QuantizedRow::wide): 254 q0 + q1, each four
// columns' in the order 0, 2, 1, 3 (a 32-bit broadcast then holds the two columns that
// vpmaddwd multiplies by one lane's even, or odd, weight codes).
LLMD_X16_AVX2_TARGET inline void join_passes(const QuantizedRow& x, int16_t* wide) {
  const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,  //
                                         0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  const __m256i step = _mm256_set1_epi16(254);
  for (int64_t i = 0; i < x.cols; i += 16) {
    const __m256i q0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x.codes + i)));
    const __m256i q1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x.codes + x.cols + i)));
    const __m256i v = _mm256_add_epi16(_mm256_mullo_epi16(q0, step), q1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide + i), _mm256_shuffle_epi8(v, order));
  }
}

template <int Q, int P>
void mm_x16(const std::vector<QuantizedRow>& rows, const uint8_t* w, int64_t n, int64_t records, float* out) {
  std::vector<QuantizedRow> joined_rows;
  std::vector<int16_t> wide;
  if constexpr (joins_passes(Q, P)) {
    const int64_t cols = rows[0].cols;
    joined_rows = rows;
    wide.resize(rows.size() * cols);
    for (size_t r = 0; r < rows.size(); ++r) {
      join_passes(rows[r], wide.data() + r * cols);
      joined_rows[r].wide = wide.data() + r * cols;
    }
  }
  const std::vector<QuantizedRow>& x = wide.empty() ? rows : joined_rows;
  for_each_tile(x, P, w, n, records * record_bytes(Q), out,
                [n](auto t, const uint8_t* wg, const QuantizedRow* xr, float* o) {
                  any_tile<Q, decltype(t)::value, P>(wg, xr, o, n);
                });
}

// The product with P passes over x, for every type.
template <int P>
void mm_x16_every_type(int64_t quant, const std::vector<QuantizedRow>& x, const uint8_t* w, int64_t n,
                       int64_t records, float* out) {
  llmd_quant::dispatch(quant, [&](auto q) { mm_x16<decltype(q)::value, P>(x, w, n, records, out); });
}

}  // namespace
}  // namespace llmd_x16

#endif
