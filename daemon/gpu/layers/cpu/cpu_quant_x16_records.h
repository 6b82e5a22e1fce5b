// Reading x16 records (cpu_quant_x16_layout.h) for the VNNI product (cpu_quant_x16_vnni.h):
// X16Record<Q> is built on one record (its per-record scales loaded once) and
// `decode(c, s)` gives sub-block c — the 32 columns 32c..32c+31 of the record's block,
// which one block of x's int8 codes multiplies — as a SubBlock:
//   q[k]: 16 lanes, lane l the unsigned codes of row l, columns 4k..4k+3 (the four bytes
//     vpdpbusd multiplies with four codes of x); a weight is, per row,
//     scale[column / 16] * (q - kOffset) + min[...],
//   scale: float32 per row: d, or a K-quant's d times its sub-block scale; kHalves (Q2_K,
//     Q3_K, Q6_K scale each 16 columns): scale[0] for columns 0..15, scale[1] for 16..31,
//     else scale[0] for all 32;
//   min (kMin 1: one per sub-block, Q4_1/Q5_1/Q4_K/Q5_K; kMin 2: one per 16 columns,
//     Q2_K): float32 per row, what x's sum over those columns is multiplied by (the
//     minimum's sign included).
// kSub: sub-blocks per record (1 for the 32-weight types, 8 for the K-quants).
// The K-quants quantized per super-block (super_blocks in cpu_quant_x16_product.h) are
// also read as their parts: `codes(c, q)` (SubBlock::q), `int_scales(c, sc)` (the
// integer sub-scales: sc[0], and sc[1] with kHalves; the weight is d * sc * (q - kOffset)
// [- dmin * m]), `min_pairs` (Q4_K, Q5_K: the integer minimums m, two sub-blocks' per
// int16 pair), and the record's d (and neg_dmin: -dmin) per row.
// The per-row products d * sub-scale are exact in float32 (an 11-bit fp16 mantissa times
// an integer of 4 to 8 bits), as in the dequantization (cpu_quant_formats.h).

#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu_quant_formats.h"
#include "cpu_quant_x16_layout.h"

#define LLMD_X16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))

namespace llmd_x16 {

struct SubBlock {
  __m512i q[8];
  __m512 scale[2];
  __m512 min[2];
};

LLMD_X16_TARGET inline __m512i chunk(const uint8_t* p) { return _mm512_loadu_si512(p); }

LLMD_X16_TARGET inline __m512 halves16(const uint8_t* p) {  // 16 fp16 as float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Bytes of v shifted right by `bits` (within each byte: the mask drops what crossed).
LLMD_X16_TARGET inline __m512i byte_bits(__m512i v, int bits, int mask) {
  return _mm512_and_si512(_mm512_srli_epi16(v, bits), _mm512_set1_epi8(static_cast<char>(mask)));
}

// The same with the shift a constant (none for 0): the sub-block loop is not unrolled
// (cpu_quant_x16_vnni.h's group_tile), so a decoder branches to one of these per shift rather
// than shift by a variable count (a shift by 0 every other sub-block of Q4_K; docs/benchmarks.md).
template <int kBits>
LLMD_X16_TARGET inline __m512i byte_bits(__m512i v, int mask) {
  if constexpr (kBits == 0) return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(mask)));
  return byte_bits(v, kBits, mask);
}

// + `add` to the codes whose bit `bit` is set in the fifth-bit chunks at p (byte l, bit c:
// column l of sub-block c; chunk k: columns 4k..4k+3).
LLMD_X16_TARGET inline void add_high_bits(const uint8_t* p, int bit, int add, __m512i* q) {
  const __m512i probe = _mm512_set1_epi8(static_cast<char>(1 << bit)), high = _mm512_set1_epi8(static_cast<char>(add));
  for (int k = 0; k < 8; ++k) {
    q[k] = _mm512_mask_add_epi8(q[k], _mm512_test_epi8_mask(chunk(p + 64 * k), probe), q[k], high);
  }
}

// Q2_K's and Q3_K's 2-bit codes at bits 2i..2i+1 of the eight chunks at p.
template <int I>
LLMD_X16_TARGET inline void two_bits(const uint8_t* p, __m512i* q) {
  for (int k = 0; k < 8; ++k) q[k] = byte_bits<2 * I>(chunk(p + 64 * k), 3);
}

LLMD_X16_TARGET inline void two_bits(const uint8_t* p, int i, __m512i* q) {
  switch (i) {
    case 0: two_bits<0>(p, q); break;
    case 1: two_bits<1>(p, q); break;
    case 2: two_bits<2>(p, q); break;
    default: two_bits<3>(p, q); break;
  }
}

template <int Q>
struct X16Record;

// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: one 32-weight block per record; codes (nibbles: low
// columns 0..15, high 16..31), Q5's fifth bits (byte t bit k: column 4k + t), d, m.
template <int Q, bool kNibbles, bool kFifth, bool kHasMin, int kOff>
struct BlockRecord {
  static constexpr int kSub = 1, kOffset = kOff, kMin = kHasMin ? 1 : 0;
  static constexpr bool kHalves = false;
  static constexpr int kScaleField = kFifth ? 2 : 1;
  const uint8_t* r;
  LLMD_X16_TARGET explicit BlockRecord(const uint8_t* record) : r(record) {}
  LLMD_X16_TARGET void decode(int, SubBlock& s) const {
    if constexpr (kNibbles) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = chunk(r + 64 * j);
        s.q[j] = byte_bits(v, 0, 0x0F);
        s.q[j + 4] = byte_bits(v, 4, 0x0F);
      }
    } else {
      for (int j = 0; j < 8; ++j) s.q[j] = chunk(r + 64 * j);
    }
    if constexpr (kFifth) {  // bit k of byte t: one probe per chunk
      const __m512i bits = chunk(r + field_at(Q, 1)), sixteen = _mm512_set1_epi8(16);
      for (int k = 0; k < 8; ++k) {
        const __mmask64 set = _mm512_test_epi8_mask(bits, _mm512_set1_epi8(static_cast<char>(1 << k)));
        s.q[k] = _mm512_mask_add_epi8(s.q[k], set, s.q[k], sixteen);
      }
    }
    s.scale[0] = halves16(r + field_at(Q, kScaleField));
    if constexpr (kHasMin) s.min[0] = halves16(r + field_at(Q, kScaleField + 1));
  }
};

template <> struct X16Record<0> : BlockRecord<0, false, false, false, 128> { using BlockRecord::BlockRecord; };
template <> struct X16Record<1> : BlockRecord<1, true, false, false, 8> { using BlockRecord::BlockRecord; };
template <> struct X16Record<2> : BlockRecord<2, true, false, true, 0> { using BlockRecord::BlockRecord; };
template <> struct X16Record<3> : BlockRecord<3, true, true, false, 16> { using BlockRecord::BlockRecord; };
template <> struct X16Record<4> : BlockRecord<4, true, true, true, 0> { using BlockRecord::BlockRecord; };

// IQ4_NL: Q4_0's record (the same layout), each nibble an index into the table of 16
// int8 values (cpu_quant_formats.h), looked up (vpshufb) as the values + 128: unsigned
// codes with Q8_0's offset.
template <>
struct X16Record<10> : X16Record<1> {
  static constexpr int kOffset = 128;
  using X16Record<1>::X16Record;
  LLMD_X16_TARGET void decode(int c, SubBlock& s) const {
    X16Record<1>::decode(c, s);
    const __m512i table = _mm512_xor_si512(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(llmd_quant::kIq4NlValues))),
        _mm512_set1_epi8(static_cast<char>(0x80)));
    for (int k = 0; k < 8; ++k) s.q[k] = _mm512_shuffle_epi8(table, s.q[k]);
  }
};

// Q2_K: 2-bit codes (sub-block c: chunks 8 (c / 4).., bits 2 (c % 4)), a byte per 16
// columns (low nibble scale, high nibble min), d, dmin.
template <>
struct X16Record<5> {
  static constexpr int kSub = 8, kOffset = 0, kMin = 2;
  static constexpr bool kHalves = true;
  const uint8_t* r;
  __m512 d, neg_dmin;
  LLMD_X16_TARGET explicit X16Record(const uint8_t* record)
      : r(record), d(halves16(record + field_at(5, 2))),
        neg_dmin(_mm512_sub_ps(_mm512_setzero_ps(), halves16(record + field_at(5, 3)))) {}
  LLMD_X16_TARGET void decode(int c, SubBlock& s) const {
    const uint8_t* q = r + 64 * 8 * (c / 4);
    two_bits(q, c % 4, s.q);
    for (int h = 0; h < 2; ++h) {
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + field_at(5, 1) + 16 * (2 * c + h))));
      s.scale[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF))));
      s.min[h] = _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
    }
  }
};

// Q3_K: hmask (byte l bit c: + 4 to column l of sub-block c; the weight is
// scale * (q - 4)), 2-bit codes as Q2_K, sixteen 6-bit scales in three words (the low
// four bits of scale i in byte i % 8, nibble i / 8; the high two in byte 8 + i % 4, bits
// 2 (i / 4); minus 32), d.
template <>
struct X16Record<6> {
  static constexpr int kSub = 8, kOffset = 4, kMin = 0;
  static constexpr bool kHalves = true;
  const uint8_t* r;
  __m512 d;
  __m512i words[3];
  LLMD_X16_TARGET explicit X16Record(const uint8_t* record) : r(record), d(halves16(record + field_at(6, 3))) {
    for (int i = 0; i < 3; ++i) words[i] = chunk(record + field_at(6, 2) + 64 * i);
  }
  LLMD_X16_TARGET __m512i scale_of(int i) const {
    const __m512i low = _mm512_and_si512(_mm512_srli_epi32(words[(i % 8) / 4], 8 * (i % 4) + 4 * (i / 8)),
                                         _mm512_set1_epi32(0xF));
    const __m512i high = _mm512_and_si512(_mm512_srli_epi32(words[2], 8 * (i % 4) + 2 * (i / 4)), _mm512_set1_epi32(3));
    return _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
  }
  LLMD_X16_TARGET void codes(int c, __m512i* q) const {
    two_bits(r + field_at(6, 1) + 64 * 8 * (c / 4), c % 4, q);
    add_high_bits(r, c, 4, q);
  }
  LLMD_X16_TARGET void int_scales(int c, __m512i (&sc)[2]) const {
    sc[0] = scale_of(2 * c);
    sc[1] = scale_of(2 * c + 1);
  }
  LLMD_X16_TARGET void decode(int c, SubBlock& s) const {
    codes(c, s.q);
    s.scale[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(scale_of(2 * c)));
    s.scale[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(scale_of(2 * c + 1)));
  }
};

// Q4_K and Q5_K: nibbles (sub-block c: chunks 8 (c / 2).., nibble c % 2), Q5_K's fifth
// bits (byte l bit c), eight 6-bit scales and mins in three words (cpu_quant_formats.h's
// scale_min_k4), d, dmin.
template <int Q, bool kFifth>
struct KNibbleRecord {
  static constexpr int kSub = 8, kOffset = 0, kMin = 1;
  static constexpr bool kHalves = false;
  static constexpr int kScales = kFifth ? 2 : 1;
  const uint8_t* r;
  __m512 d, neg_dmin;
  __m512i words[3];
  LLMD_X16_TARGET explicit KNibbleRecord(const uint8_t* record)
      : r(record), d(halves16(record + field_at(Q, kScales + 1))),
        neg_dmin(_mm512_sub_ps(_mm512_setzero_ps(), halves16(record + field_at(Q, kScales + 2)))) {
    for (int i = 0; i < 3; ++i) words[i] = chunk(record + field_at(Q, kScales) + 64 * i);
  }
  // Scale (m = 0) or min (m = 1) of sub-block c.
  LLMD_X16_TARGET __m512i six_bits(int c, int m) const {
    const __m512i six = _mm512_set1_epi32(63);
    if (c < 4) return _mm512_and_si512(_mm512_srli_epi32(words[m], 8 * c), six);
    const int j = c - 4;
    const __m512i low = _mm512_and_si512(_mm512_srli_epi32(words[2], 8 * j + 4 * m), _mm512_set1_epi32(0xF));
    const __m512i high = _mm512_and_si512(_mm512_srli_epi32(words[m], 8 * j + 2), _mm512_set1_epi32(0x30));
    return _mm512_or_si512(low, high);
  }
  LLMD_X16_TARGET void codes(int c, __m512i* q) const {
    const uint8_t* p = r + 64 * 8 * (c / 2);
    if (c % 2 == 0) {
      for (int k = 0; k < 8; ++k) q[k] = byte_bits<0>(chunk(p + 64 * k), 0x0F);
    } else {
      for (int k = 0; k < 8; ++k) q[k] = byte_bits<4>(chunk(p + 64 * k), 0x0F);
    }
    if constexpr (kFifth) add_high_bits(r + field_at(Q, 1), c, 16, q);
  }
  LLMD_X16_TARGET void int_scales(int c, __m512i (&sc)[2]) const { sc[0] = six_bits(c, 0); }
  // The minimums of sub-blocks 2i and 2i + 1 as int16 pairs (QuantizedRow::pairs' order).
  LLMD_X16_TARGET void min_pairs(__m512i (&pairs)[4]) const {
    for (int i = 0; i < 4; ++i) {
      pairs[i] = _mm512_or_si512(six_bits(2 * i, 1), _mm512_slli_epi32(six_bits(2 * i + 1, 1), 16));
    }
  }
  LLMD_X16_TARGET void decode(int c, SubBlock& s) const {
    codes(c, s.q);
    s.scale[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(six_bits(c, 0)));
    s.min[0] = _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(six_bits(c, 1)));
  }
};

template <> struct X16Record<7> : KNibbleRecord<7, false> { using KNibbleRecord::KNibbleRecord; };
template <> struct X16Record<8> : KNibbleRecord<8, true> { using KNibbleRecord::KNibbleRecord; };

// Q6_K: low nibbles (sub-block c = 4h + j: chunks 16h + 8 (j % 2).., nibble j / 2), high
// two bits (chunks 8h.., bits 2j), sixteen int8 scales (16 bytes each: one per row), d;
// the weight is d * scale * (q - 32).
template <>
struct X16Record<9> {
  static constexpr int kSub = 8, kOffset = 32, kMin = 0;
  static constexpr bool kHalves = true;
  const uint8_t* r;
  __m512 d;
  LLMD_X16_TARGET explicit X16Record(const uint8_t* record) : r(record), d(halves16(record + field_at(9, 3))) {}
  // The codes of sub-block 4h + J: low nibbles J / 2, high bits 2J..2J+1 moved to bits 4..5.
  template <int J>
  LLMD_X16_TARGET static void codes_of(const uint8_t* low, const uint8_t* high, __m512i* q) {
    const __m512i top = _mm512_set1_epi8(0x30);
    for (int k = 0; k < 8; ++k) {
      const __m512i hv = chunk(high + 64 * k);
      const __m512i moved = J <= 2 ? _mm512_slli_epi16(hv, 4 - 2 * J) : _mm512_srli_epi16(hv, 2 * J - 4);
      q[k] = _mm512_or_si512(byte_bits<4 * (J / 2)>(chunk(low + 64 * k), 0x0F), _mm512_and_si512(moved, top));
    }
  }
  LLMD_X16_TARGET void codes(int c, __m512i* q) const {
    const int h = c / 4, j = c % 4;
    const uint8_t* low = r + 64 * (16 * h + 8 * (j % 2));
    const uint8_t* high = r + field_at(9, 1) + 64 * 8 * h;
    switch (j) {  // the shifts constants (byte_bits<>)
      case 0: codes_of<0>(low, high, q); break;
      case 1: codes_of<1>(low, high, q); break;
      case 2: codes_of<2>(low, high, q); break;
      default: codes_of<3>(low, high, q); break;
    }
  }
  LLMD_X16_TARGET void int_scales(int c, __m512i (&sc)[2]) const {
    for (int i = 0; i < 2; ++i) {
      const uint8_t* bytes = r + field_at(9, 2) + 16 * (2 * c + i);
      sc[i] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    }
  }
  LLMD_X16_TARGET void decode(int c, SubBlock& s) const {
    codes(c, s.q);
    __m512i sc[2];
    int_scales(c, sc);
    for (int i = 0; i < 2; ++i) s.scale[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc[i]));
  }
};

}  // namespace llmd_x16

#endif
