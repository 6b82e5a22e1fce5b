// Reading x16 records (cpu_quant_x16_layout.h) for the AVX2 product (cpu_quant_x16_avx2.cpp),
// as cpu_quant_x16_records.h reads them for the VNNI one, but half a record at a time:
// a 256-bit vector holds eight rows, so each 64-byte chunk is read as its low 32 bytes
// (rows 0..7: half 0) or its high 32 (rows 8..15: half 1); a field of 2-byte units (the
// fp16 scales) holds half h's rows at 16 h, one of 1-byte units (sub-scales) at 8 h.
// X16Half<Q> is built on (record, h) (its per-record scales loaded once); of sub-block c
// of those eight rows `code(c, k)` gives chunk k and `scales(c, s)` the scales:
//   code(c, k): eight lanes, lane l the codes of row 8 h + l, columns 4k..4k+3; a weight
//     is scale[column / 16] * (q - kOffset) + min[...] — with kSigned (Q8_0), q is the
//     signed int8 code itself (the layout's flip undone, kOffset 0), what llama.cpp's
//     sign trick multiplies (cpu_quant_x16_avx2.cpp). One chunk at a time, so that the
//     product holds one in a register, not eight (sixteen ymm registers: the eight codes
//     beside three passes' sums spilled to the stack);
//   scale, min (HalfScales), kHalves, kMin, kSub: as in cpu_quant_x16_records.h; and for
//   the K-quants quantized per super-block, int_scales and min_pairs as there.
// kCodeMax: the largest code (|q| for Q8_0), which bounds how many of vpmaddubsw's int16
// pair sums the product may add before they could saturate.

#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu_quant_formats.h"
#include "cpu_quant_x16_layout.h"

#define LLMD_X16_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

namespace llmd_x16::avx2 {

struct HalfScales {
  __m256 scale[2];
  __m256 min[2];
};

LLMD_X16_AVX2_TARGET inline __m256i chunk(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

LLMD_X16_AVX2_TARGET inline __m256 halves8(const uint8_t* p) {  // 8 fp16 as float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

LLMD_X16_AVX2_TARGET inline __m128i bytes8(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

LLMD_X16_AVX2_TARGET inline __m256 negated(__m256 v) { return _mm256_sub_ps(_mm256_setzero_ps(), v); }

// Bytes of v shifted right by `bits` (within each byte: the mask drops what crossed).
LLMD_X16_AVX2_TARGET inline __m256i byte_bits(__m256i v, int bits, int mask) {
  return _mm256_and_si256(_mm256_srli_epi16(v, bits), _mm256_set1_epi8(static_cast<char>(mask)));
}

// Bits `from`.. of each byte of v moved to bits `to`.. and kept where `mask` says: a
// 16-bit shift by to - from, whose bits crossing into the other byte the mask drops.
LLMD_X16_AVX2_TARGET inline __m256i move_bits(__m256i v, int from, int to, int mask) {
  const __m256i moved = from <= to ? _mm256_slli_epi16(v, to - from) : _mm256_srli_epi16(v, from - to);
  return _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(mask)));
}

// Chunk k's codes q + 2^bit where bit `c` is set in the fifth-bit chunks at p (byte l,
// bit c: column l of sub-block c; chunk k: columns 4k..4k+3); q has that bit clear.
LLMD_X16_AVX2_TARGET inline __m256i with_high_bit(__m256i q, const uint8_t* p, int c, int k, int bit) {
  return _mm256_or_si256(q, move_bits(chunk(p + 64 * k), c, bit, 1 << bit));
}

template <int Q>
struct X16Half;

// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (as BlockRecord in cpu_quant_x16_records.h).
template <int Q, bool kNibbles, bool kFifth, bool kHasMin, int kOff>
struct BlockHalf {
  static constexpr int kSub = 1, kOffset = kNibbles ? kOff : 0, kMin = kHasMin ? 1 : 0;
  static constexpr int kCodeMax = kNibbles ? (kFifth ? 31 : 15) : 128;
  static constexpr bool kHalves = false, kSigned = !kNibbles;
  static constexpr int kScaleField = kFifth ? 2 : 1;
  const uint8_t* r;
  int h;
  LLMD_X16_AVX2_TARGET BlockHalf(const uint8_t* record, int half) : r(record), h(half) {}
  LLMD_X16_AVX2_TARGET __m256i code(int, int k) const {
    __m256i q;
    if constexpr (kNibbles) {  // chunk k % 4's low (k < 4) or high nibbles
      q = byte_bits(chunk(r + 64 * (k % 4) + 32 * h), 4 * (k / 4), 0x0F);
    } else {  // the stored codes are the int8 ones + 128
      q = _mm256_xor_si256(chunk(r + 64 * k + 32 * h), _mm256_set1_epi8(static_cast<char>(0x80)));
    }
    if constexpr (kFifth) q = _mm256_or_si256(q, move_bits(chunk(r + field_at(Q, 1) + 32 * h), k, 4, 0x10));
    return q;  // (kFifth: bit k of byte t is column 4k + t's, to bit 4)
  }
  LLMD_X16_AVX2_TARGET void scales(int, HalfScales& s) const {
    s.scale[0] = halves8(r + field_at(Q, kScaleField) + 16 * h);
    if constexpr (kHasMin) s.min[0] = halves8(r + field_at(Q, kScaleField + 1) + 16 * h);
  }
};

template <> struct X16Half<0> : BlockHalf<0, false, false, false, 128> { using BlockHalf::BlockHalf; };
template <> struct X16Half<1> : BlockHalf<1, true, false, false, 8> { using BlockHalf::BlockHalf; };
template <> struct X16Half<2> : BlockHalf<2, true, false, true, 0> { using BlockHalf::BlockHalf; };
template <> struct X16Half<3> : BlockHalf<3, true, true, false, 16> { using BlockHalf::BlockHalf; };
template <> struct X16Half<4> : BlockHalf<4, true, true, true, 0> { using BlockHalf::BlockHalf; };

// IQ4_NL (as X16Record<10>): Q4_0's record (the same layout), its nibbles looked up
// (vpshufb) in the table of 16 int8 values (cpu_quant_formats.h): signed codes, multiplied
// as Q8_0's.
template <>
struct X16Half<10> : X16Half<1> {
  static constexpr int kOffset = 0, kCodeMax = 128;
  static constexpr bool kSigned = true;
  __m256i table;
  LLMD_X16_AVX2_TARGET X16Half(const uint8_t* record, int half)
      : X16Half<1>(record, half),
        table(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(llmd_quant::kIq4NlValues)))) {}
  LLMD_X16_AVX2_TARGET __m256i code(int c, int k) const { return _mm256_shuffle_epi8(table, X16Half<1>::code(c, k)); }
};

// Q2_K (as X16Record<5>).
template <>
struct X16Half<5> {
  static constexpr int kSub = 8, kOffset = 0, kMin = 2, kCodeMax = 3;
  static constexpr bool kHalves = true, kSigned = false;
  const uint8_t* r;
  int h;
  __m256 d, neg_dmin;
  LLMD_X16_AVX2_TARGET X16Half(const uint8_t* record, int half)
      : r(record), h(half), d(halves8(record + field_at(5, 2) + 16 * half)),
        neg_dmin(negated(halves8(record + field_at(5, 3) + 16 * half))) {}
  LLMD_X16_AVX2_TARGET __m256i code(int c, int k) const {
    return byte_bits(chunk(r + 64 * 8 * (c / 4) + 32 * h + 64 * k), 2 * (c % 4), 3);
  }
  LLMD_X16_AVX2_TARGET void scales(int c, HalfScales& s) const {
    for (int i = 0; i < 2; ++i) {
      const __m256i b = _mm256_cvtepu8_epi32(bytes8(r + field_at(5, 1) + 16 * (2 * c + i) + 8 * h));
      s.scale[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF))));
      s.min[i] = _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
    }
  }
};

// Q3_K (as X16Record<6>): the hmask's + 4 is bit 2 of the 2-bit codes.
template <>
struct X16Half<6> {
  static constexpr int kSub = 8, kOffset = 4, kMin = 0, kCodeMax = 7;
  static constexpr bool kHalves = true, kSigned = false;
  const uint8_t* r;
  int h;
  __m256 d;
  __m256i words[3];
  LLMD_X16_AVX2_TARGET X16Half(const uint8_t* record, int half)
      : r(record), h(half), d(halves8(record + field_at(6, 3) + 16 * half)) {
    for (int i = 0; i < 3; ++i) words[i] = chunk(record + field_at(6, 2) + 64 * i + 32 * half);
  }
  LLMD_X16_AVX2_TARGET __m256i scale_of(int i) const {
    const __m256i low = _mm256_and_si256(_mm256_srli_epi32(words[(i % 8) / 4], 8 * (i % 4) + 4 * (i / 8)),
                                         _mm256_set1_epi32(0xF));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi32(words[2], 8 * (i % 4) + 2 * (i / 4)),
                                          _mm256_set1_epi32(3));
    return _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
  }
  LLMD_X16_AVX2_TARGET __m256i code(int c, int k) const {
    const __m256i q = byte_bits(chunk(r + field_at(6, 1) + 64 * 8 * (c / 4) + 32 * h + 64 * k), 2 * (c % 4), 3);
    return with_high_bit(q, r + 32 * h, c, k, 2);
  }
  LLMD_X16_AVX2_TARGET void int_scales(int c, __m256i (&sc)[2]) const {
    sc[0] = scale_of(2 * c);
    sc[1] = scale_of(2 * c + 1);
  }
  LLMD_X16_AVX2_TARGET void scales(int c, HalfScales& s) const {
    s.scale[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(scale_of(2 * c)));
    s.scale[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(scale_of(2 * c + 1)));
  }
};

// Q4_K and Q5_K (as KNibbleRecord).
template <int Q, bool kFifth>
struct KNibbleHalf {
  static constexpr int kSub = 8, kOffset = 0, kMin = 1, kCodeMax = kFifth ? 31 : 15;
  static constexpr bool kHalves = false, kSigned = false;
  static constexpr int kScales = kFifth ? 2 : 1;
  const uint8_t* r;
  int h;
  __m256 d, neg_dmin;
  __m256i words[3];
  LLMD_X16_AVX2_TARGET KNibbleHalf(const uint8_t* record, int half)
      : r(record), h(half), d(halves8(record + field_at(Q, kScales + 1) + 16 * half)),
        neg_dmin(negated(halves8(record + field_at(Q, kScales + 2) + 16 * half))) {
    for (int i = 0; i < 3; ++i) words[i] = chunk(record + field_at(Q, kScales) + 64 * i + 32 * half);
  }
  // Scale (m = 0) or min (m = 1) of sub-block c.
  LLMD_X16_AVX2_TARGET __m256i six_bits(int c, int m) const {
    const __m256i six = _mm256_set1_epi32(63);
    if (c < 4) return _mm256_and_si256(_mm256_srli_epi32(words[m], 8 * c), six);
    const int j = c - 4;
    const __m256i low = _mm256_and_si256(_mm256_srli_epi32(words[2], 8 * j + 4 * m), _mm256_set1_epi32(0xF));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi32(words[m], 8 * j + 2), _mm256_set1_epi32(0x30));
    return _mm256_or_si256(low, high);
  }
  LLMD_X16_AVX2_TARGET __m256i code(int c, int k) const {
    const __m256i q = byte_bits(chunk(r + 64 * 8 * (c / 2) + 32 * h + 64 * k), 4 * (c % 2), 0x0F);
    if constexpr (kFifth) return with_high_bit(q, r + field_at(Q, 1) + 32 * h, c, k, 4);
    return q;
  }
  LLMD_X16_AVX2_TARGET void int_scales(int c, __m256i (&sc)[2]) const { sc[0] = six_bits(c, 0); }
  LLMD_X16_AVX2_TARGET void min_pairs(__m256i (&pairs)[4]) const {
    for (int i = 0; i < 4; ++i) {
      pairs[i] = _mm256_or_si256(six_bits(2 * i, 1), _mm256_slli_epi32(six_bits(2 * i + 1, 1), 16));
    }
  }
  LLMD_X16_AVX2_TARGET void scales(int c, HalfScales& s) const {
    s.scale[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(six_bits(c, 0)));
    s.min[0] = _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(six_bits(c, 1)));
  }
};

template <> struct X16Half<7> : KNibbleHalf<7, false> { using KNibbleHalf::KNibbleHalf; };
template <> struct X16Half<8> : KNibbleHalf<8, true> { using KNibbleHalf::KNibbleHalf; };

// Q6_K (as X16Record<9>).
template <>
struct X16Half<9> {
  static constexpr int kSub = 8, kOffset = 32, kMin = 0, kCodeMax = 63;
  static constexpr bool kHalves = true, kSigned = false;
  const uint8_t* r;
  int h;
  __m256 d;
  LLMD_X16_AVX2_TARGET X16Half(const uint8_t* record, int half)
      : r(record), h(half), d(halves8(record + field_at(9, 3) + 16 * half)) {}
  LLMD_X16_AVX2_TARGET __m256i code(int c, int k) const {
    const int part = c / 4, j = c % 4;  // 128-column part, and which of its four sub-blocks
    const uint8_t* low = r + 64 * (16 * part + 8 * (j % 2)) + 32 * h;
    const uint8_t* high = r + field_at(9, 1) + 64 * 8 * part + 32 * h;
    return _mm256_or_si256(byte_bits(chunk(low + 64 * k), 4 * (j / 2), 0x0F),  // high bits 2j..2j+1 to 4..5
                           move_bits(chunk(high + 64 * k), 2 * j, 4, 0x30));
  }
  LLMD_X16_AVX2_TARGET void int_scales(int c, __m256i (&sc)[2]) const {
    for (int i = 0; i < 2; ++i) sc[i] = _mm256_cvtepi8_epi32(bytes8(r + field_at(9, 2) + 16 * (2 * c + i) + 8 * h));
  }
  LLMD_X16_AVX2_TARGET void scales(int c, HalfScales& s) const {
    __m256i sc[2];
    int_scales(c, sc);
    for (int i = 0; i < 2; ++i) s.scale[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc[i]));
  }
};

}  // namespace llmd_x16::avx2

#endif
