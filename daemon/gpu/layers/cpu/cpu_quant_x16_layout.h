// The x16 layout of GGUF weights (cpu_quant_x16.cpp multiplies it; gguf_quant.use_x16
// repacks a weight into it at load): the weight's N rows in groups of 16; per group, per
// GGUF block b (32 weights, or a K-quant's 256), one record of exactly the bytes the 16
// rows' blocks take, rearranged so that one 64-byte vector load holds the same field of
// all sixteen rows. Records are stored group by group, block by block: the tensor keeps
// its GGUF shape [N, row bytes] (memory accounting and slicing by 16-row groups hold).
//
// A block is cut into fields (Field: its bytes, its unit). A field of `bytes` bytes in
// units of `unit` bytes takes 16 * bytes in the record, unit u of row `lane` at
//   field start + (u * 16 + lane) * unit,
// so a 4-byte unit makes 64-byte chunks whose 32-bit word `lane` is that row's bytes
// 4u..4u+3 (codes: four columns per row, what vpdpbusd multiplies), a 2-byte unit the 16
// rows' fp16 scales side by side, a 1-byte unit 16 bytes per sub-scale. Two fields are
// transformed on the way, each by a bijection undone when rows are read back:
//   kFlip: Q8_0's int8 codes + 128 (the top bit flipped) — vpdpbusd's codes are unsigned;
//   kBitsByColumn: Q5_0/Q5_1's 32 fifth bits (bit i: column i) rearranged so that bit
//     8t + k holds column 4k + t — byte t, bit k: then one byte-mask test per chunk of
//     codes finds them, as Q5_K's and Q3_K's fifth bits are stored already (byte l, bit c).
// Field order is record order; the kernels' record readers (cpu_quant_x16_records.h)
// take fields by their index here.

#pragma once

#include <cstdint>
#include <cstring>

namespace llmd_x16 {

constexpr int64_t kGroup = 16;  // weight rows per record

enum class Transform : uint8_t { kNone, kFlip, kBitsByColumn };

struct Field {
  int64_t at;     // offset in the GGUF block
  int64_t bytes;  // per row
  int64_t unit;   // 1, 2 or 4
  Transform transform = Transform::kNone;
};

constexpr int kMaxFields = 5;

struct Layout {
  int64_t block_bytes;  // one row's GGUF block
  int fields;
  Field field[kMaxFields];
};

// quant: gguf_formats.FORMATS' code (cpu_quant_formats.h spells out each block).
constexpr Layout kLayouts[] = {
    {34, 2, {{2, 32, 4, Transform::kFlip}, {0, 2, 2}}},                                // Q8_0: q, d
    {18, 2, {{2, 16, 4}, {0, 2, 2}}},                                                   // Q4_0: q, d
    {20, 3, {{4, 16, 4}, {0, 2, 2}, {2, 2, 2}}},                                        // Q4_1: q, d, m
    {22, 3, {{6, 16, 4}, {2, 4, 4, Transform::kBitsByColumn}, {0, 2, 2}}},              // Q5_0: q, qh, d
    {24, 4, {{8, 16, 4}, {4, 4, 4, Transform::kBitsByColumn}, {0, 2, 2}, {2, 2, 2}}},   // Q5_1: q, qh, d, m
    {84, 4, {{16, 64, 4}, {0, 16, 1}, {80, 2, 2}, {82, 2, 2}}},                         // Q2_K: q, scales, d, dmin
    {110, 4, {{0, 32, 4}, {32, 64, 4}, {96, 12, 4}, {108, 2, 2}}},                      // Q3_K: hmask, q, scales, d
    {144, 4, {{16, 128, 4}, {4, 12, 4}, {0, 2, 2}, {2, 2, 2}}},                         // Q4_K: q, scales, d, dmin
    {176, 5, {{48, 128, 4}, {16, 32, 4}, {4, 12, 4}, {0, 2, 2}, {2, 2, 2}}},            // Q5_K: q, qh, scales, d, dmin
    {210, 4, {{0, 128, 4}, {128, 64, 4}, {192, 16, 1}, {208, 2, 2}}},                   // Q6_K: ql, qh, scales, d
    {18, 2, {{2, 16, 4}, {0, 2, 2}}},                                                   // IQ4_NL: q, d (as Q4_0)
};
constexpr int64_t kNumLayouts = sizeof(kLayouts) / sizeof(kLayouts[0]);

constexpr int64_t record_bytes(int64_t quant) { return kGroup * kLayouts[quant].block_bytes; }

// Where field i of type `quant` starts in its record.
constexpr int64_t field_at(int64_t quant, int i) {
  int64_t at = 0;
  for (int f = 0; f < i; ++f) at += kGroup * kLayouts[quant].field[f].bytes;
  return at;
}

// Every layout covers each byte of its block exactly once, in whole units (checked here,
// at compile time).
constexpr bool covers_block(const Layout& l) {
  for (int64_t byte = 0; byte < l.block_bytes; ++byte) {
    int covered = 0;
    for (int f = 0; f < l.fields; ++f) covered += l.field[f].at <= byte && byte < l.field[f].at + l.field[f].bytes;
    if (covered != 1) return false;
  }
  int64_t total = 0;
  for (int f = 0; f < l.fields; ++f) {
    if (l.field[f].bytes % l.field[f].unit != 0) return false;
    total += l.field[f].bytes;
  }
  return total == l.block_bytes;
}
static_assert(covers_block(kLayouts[0]) && covers_block(kLayouts[1]) && covers_block(kLayouts[2]) &&
              covers_block(kLayouts[3]) && covers_block(kLayouts[4]) && covers_block(kLayouts[5]) &&
              covers_block(kLayouts[6]) && covers_block(kLayouts[7]) && covers_block(kLayouts[8]) &&
              covers_block(kLayouts[9]) && covers_block(kLayouts[10]));

// Q5's fifth bits: bit 4k + t (column 4k + t) to bit 8t + k, and back.
inline uint32_t bits_by_column(uint32_t v) {
  uint32_t out = 0;
  for (int k = 0; k < 8; ++k)
    for (int t = 0; t < 4; ++t) out |= ((v >> (4 * k + t)) & 1u) << (8 * t + k);
  return out;
}

inline uint32_t bits_by_index(uint32_t v) {
  uint32_t out = 0;
  for (int k = 0; k < 8; ++k)
    for (int t = 0; t < 4; ++t) out |= ((v >> (8 * t + k)) & 1u) << (4 * k + t);
  return out;
}

template <Transform kT>
inline uint32_t forward(uint32_t v) {
  if constexpr (kT == Transform::kFlip) return v ^ 0x80808080u;
  if constexpr (kT == Transform::kBitsByColumn) return bits_by_column(v);
  return v;
}

template <Transform kT>
inline uint32_t backward(uint32_t v) {
  if constexpr (kT == Transform::kFlip) return v ^ 0x80808080u;
  if constexpr (kT == Transform::kBitsByColumn) return bits_by_index(v);
  return v;
}

// Row `lane`'s GGUF block at `from` into its record at `to` (kToRecord), or its record at
// `from` back into the block at `to`, field I onwards; the layout a compile-time
// constant, so each unit is a fixed-size copy. (The 1- and 2-byte units are copied byte
// by byte: GCC 12.2 at -O3 dropped the whole dequantization of a Q6_K group, the
// caller's stores included, when its 2-byte d went through a memcpy here; found by
// test_gguf_x16, not understood further.)
template <int Q, bool kToRecord, int I = 0>
inline void move_block(const uint8_t* from, int64_t lane, uint8_t* to) {
  if constexpr (I < kLayouts[Q].fields) {
    constexpr Field f = kLayouts[Q].field[I];
    constexpr int64_t start = field_at(Q, I);
    for (int64_t u = 0; u < f.bytes / f.unit; ++u) {
      const int64_t in_record = start + (u * kGroup + lane) * f.unit, in_block = f.at + u * f.unit;
      const uint8_t* src = from + (kToRecord ? in_block : in_record);
      uint8_t* dst = to + (kToRecord ? in_record : in_block);
      if constexpr (f.unit == 4) {
        uint32_t word;
        std::memcpy(&word, src, 4);
        word = kToRecord ? forward<f.transform>(word) : backward<f.transform>(word);
        std::memcpy(dst, &word, 4);
      } else {
        for (int64_t k = 0; k < f.unit; ++k) dst[k] = src[k];
      }
    }
    move_block<Q, kToRecord, I + 1>(from, lane, to);
  }
}

// Row `lane`'s GGUF block `block` into its record `record`.
template <int Q>
inline void block_to_record(const uint8_t* block, int64_t lane, uint8_t* record) {
  move_block<Q, true>(block, lane, record);
}

// Row `lane`'s GGUF block read back from its record.
template <int Q>
inline void record_to_block(const uint8_t* record, int64_t lane, uint8_t* block) {
  move_block<Q, false>(record, lane, block);
}

}  // namespace llmd_x16
