// The GGUF block formats cpu_quant.cpp reads (gguf_formats.py has the table; llama.cpp's
// ggml-common.h the structs): how one block's bytes become its weights.
//
// Format<Q> (Q: gguf_formats.FORMATS' code): kWeights per block (32, or 256 for a K-quant
// super-block), kBytes, and dequant(block, w), the portable decoding of a whole block.
// With AVX-512, Decoder<Q> is built on one block (a K-quant's scales unpacked once) and
// `chunk(c, lo, hi)` gives its weights 32c..32c+15 and 32c+16..32c+31 as two float32
// vectors, so a kernel multiplies a block without writing it to memory. dequant_block<Q>
// writes a block's weights out through whichever of the two this build has.
//
// Every weight is d' * q - m' with q a small integer and d', m' products of an fp16 scale
// and a 6- or 8-bit sub-scale: such products are exact in float32, so the one rounding
// is the final add, and both paths equal the gguf package's dequantization bit for bit
// (a fused multiply-add included).

#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace llmd_quant {

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; the portable conversion is a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Q4_K / Q5_K: eight 6-bit scales and mins in 12 bytes (llama.cpp's get_scale_min_k4):
// bytes 0-3 hold scales 0-3 (low six bits) and the top two bits of scales 4-7, bytes 4-7
// the mins likewise, bytes 8-11 the low four bits of scale j + 4 (low nibble) and min j + 4.
inline void scale_min_k4(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Q3_K: sixteen 6-bit signed scales in 12 bytes: the low four bits of scale i in byte i % 8
// (low nibble for i < 8), its high two bits in byte 8 + i % 4 at bit 2 * (i / 4); minus 32.
inline void scales_q3k(const uint8_t* s, int* sc) {
  for (int i = 0; i < 16; ++i) {
    const int low = (s[i % 8] >> (4 * (i / 8))) & 0xF;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    sc[i] = (low | (high << 4)) - 32;
  }
}

template <int Q>
struct Format;

constexpr int64_t kNumFormats = 11;

// fn(std::integral_constant<int, Q>{}) for the format of code `quant` (checked before).
template <typename Fn>
void dispatch(int64_t quant, Fn&& fn) {
  switch (quant) {
    case 0: fn(std::integral_constant<int, 0>{}); break;
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    case 9: fn(std::integral_constant<int, 9>{}); break;
    default: fn(std::integral_constant<int, 10>{}); break;
  }
}

template <>
struct Format<0> {  // Q8_0: fp16 d, 32 int8 q; d * q
  static constexpr int64_t kWeights = 32, kBytes = 34;
  static void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; ++i) w[i] = d * static_cast<float>(q[i]);
  }
};

template <>
struct Format<1> {  // Q4_0: fp16 d, 16 bytes of nibbles (low: weight i, high: i + 16); d * (q - 8)
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b);
    for (int i = 0; i < 16; ++i) {
      w[i] = d * static_cast<float>((b[2 + i] & 0xF) - 8);
      w[i + 16] = d * static_cast<float>((b[2 + i] >> 4) - 8);
    }
  }
};

template <>
struct Format<2> {  // Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; d * q + m
  static constexpr int64_t kWeights = 32, kBytes = 20;
  static void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b), m = half_at(b + 2);
    for (int i = 0; i < 16; ++i) {
      w[i] = d * static_cast<float>(b[4 + i] & 0xF) + m;
      w[i + 16] = d * static_cast<float>(b[4 + i] >> 4) + m;
    }
  }
};

template <>
struct Format<3> {  // Q5_0: fp16 d, u32 qh (bit i: bit 4 of weight i), nibbles as Q4_0; d * (q - 16)
  static constexpr int64_t kWeights = 32, kBytes = 22;
  static void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b);
    const uint32_t qh = u32_at(b + 2);
    for (int i = 0; i < 16; ++i) {
      const int lo = (b[6 + i] & 0xF) | (((qh >> i) & 1) << 4);
      const int hi = (b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      w[i] = d * static_cast<float>(lo - 16);
      w[i + 16] = d * static_cast<float>(hi - 16);
    }
  }
};

template <>
struct Format<4> {  // Q5_1: fp16 d, fp16 m, u32 qh, nibbles; d * q + m
  static constexpr int64_t kWeights = 32, kBytes = 24;
  static void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b), m = half_at(b + 2);
    const uint32_t qh = u32_at(b + 4);
    for (int i = 0; i < 16; ++i) {
      const int lo = (b[8 + i] & 0xF) | (((qh >> i) & 1) << 4);
      const int hi = (b[8 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      w[i] = d * static_cast<float>(lo) + m;
      w[i + 16] = d * static_cast<float>(hi) + m;
    }
  }
};

// The K-quants: 256 weights, eight chunks of 32 (c); a chunk's weights 32c + l.

template <>
struct Format<5> {  // Q2_K: 16 bytes of (min << 4 | scale) per 16 weights, 64 bytes of 2-bit q
                    // (chunk c: byte 32 (c / 4) + l, bits 2 (c % 4)), fp16 d, fp16 dmin;
                    // d * scale * q - dmin * min
  static constexpr int64_t kWeights = 256, kBytes = 84;
  static void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int c = 0; c < 8; ++c) {
      const uint8_t* q = b + 16 + 32 * (c / 4);
      for (int l = 0; l < 32; ++l) {
        const int s = b[2 * c + l / 16];
        w[32 * c + l] = d * static_cast<float>(s & 0xF) * static_cast<float>((q[l] >> (2 * (c % 4))) & 3) -
                        dmin * static_cast<float>(s >> 4);
      }
    }
  }
};

template <>
struct Format<6> {  // Q3_K: 32 bytes hmask (chunk c: bit c of byte l), 64 bytes of 2-bit q as
                    // Q2_K, 12 bytes of scales (scales_q3k), fp16 d; d * scale * (q - 4 unless
                    // the hmask bit is set)
  static constexpr int64_t kWeights = 256, kBytes = 110;
  static void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b + 108);
    int sc[16];
    scales_q3k(b + 96, sc);
    for (int c = 0; c < 8; ++c) {
      const uint8_t* q = b + 32 + 32 * (c / 4);
      for (int l = 0; l < 32; ++l) {
        const int v = ((q[l] >> (2 * (c % 4))) & 3) - (((b[l] >> c) & 1) ? 0 : 4);
        w[32 * c + l] = d * static_cast<float>(sc[2 * c + l / 16]) * static_cast<float>(v);
      }
    }
  }
};

// Q4_K and Q5_K (qh: Q5_K's 32 bytes of fifth bits, chunk c: bit c of byte l; null for
// Q4_K): d * scale * q - dmin * min over the nibbles at qs.
inline void dequant_k4(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* w) {
  const float d = half_at(b), dmin = half_at(b + 2);
  int sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  for (int c = 0; c < 8; ++c) {
    const float ds = d * static_cast<float>(sc[c]), dm = dmin * static_cast<float>(mn[c]);
    const uint8_t* q = qs + 32 * (c / 2);
    for (int l = 0; l < 32; ++l) {
      const int fifth = qh != nullptr ? ((qh[l] >> c) & 1) << 4 : 0;
      w[32 * c + l] = ds * static_cast<float>(((q[l] >> (4 * (c % 2))) & 0xF) | fifth) - dm;
    }
  }
}

template <>
struct Format<7> {  // Q4_K: fp16 d, fp16 dmin, 12 bytes of scales and mins (scale_min_k4),
                    // 128 bytes of nibbles (chunk c: byte 32 (c / 2) + l, nibble c % 2);
                    // d * scale * q - dmin * min
  static constexpr int64_t kWeights = 256, kBytes = 144;
  static void dequant(const uint8_t* b, float* w) { dequant_k4(b, nullptr, b + 16, w); }
};

template <>
struct Format<8> {  // Q5_K: Q4_K's header, 32 bytes qh (chunk c: bit c of byte l is bit 4 of
                    // q), 128 bytes of nibbles as Q4_K
  static constexpr int64_t kWeights = 256, kBytes = 176;
  static void dequant(const uint8_t* b, float* w) { dequant_k4(b, b + 16, b + 48, w); }
};

template <>
struct Format<9> {  // Q6_K: 128 bytes ql (low four bits; chunk c = 4h + k: byte 64h + 32 (k % 2)
                    // + l, nibble k / 2), 64 bytes qh (two high bits: byte 32h + l, bits 2k),
                    // 16 int8 scales (one per 16 weights), fp16 d; d * scale * (q - 32)
  static constexpr int64_t kWeights = 256, kBytes = 210;
  static void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int c = 0; c < 8; ++c) {
      const int h = c / 4, k = c % 4;
      const uint8_t* ql = b + 64 * h + 32 * (k % 2);
      const uint8_t* qh = b + 128 + 32 * h;
      for (int half = 0; half < 2; ++half) {  // (d * scale) * v as before, the scale hoisted: the loop vectorizes
        const float s = d * static_cast<float>(sc[2 * c + half]);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int v = (((ql[l] >> (4 * (k / 2))) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
          w[32 * c + l] = s * static_cast<float>(v);
        }
      }
    }
  }
};

// IQ4_NL's table: a weight is d * kIq4NlValues[its 4-bit index] (llama.cpp's kvalues_iq4nl).
constexpr int8_t kIq4NlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

template <>
struct Format<10> {  // IQ4_NL: fp16 d, 16 bytes of nibbles as Q4_0's (indices into the table)
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b);
#if defined(__AVX2__)  // the lookup in registers (vpshufb): the scalar one does not vectorize
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), mask = _mm_set1_epi8(0x0F);
    const __m128i values[2] = {_mm_shuffle_epi8(table, _mm_and_si128(q, mask)),
                               _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), mask))};
    const __m256 dv = _mm256_set1_ps(d);
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_ps(w + 16 * h, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values[h]))));
      _mm256_storeu_ps(w + 16 * h + 8,
                       _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(values[h], 8)))));
    }
#else
    for (int i = 0; i < 16; ++i) {
      w[i] = d * static_cast<float>(kIq4NlValues[b[2 + i] & 0xF]);
      w[i + 16] = d * static_cast<float>(kIq4NlValues[b[2 + i] >> 4]);
    }
#endif
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// 16 bytes as float32 (unsigned).
inline __m512 widen_u8(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }

inline __m256i shift_right_16(__m256i v, int bits) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits)); }

// a * q + b for both halves of 32 bytes of q (q: 0..255 as bytes), one (a, b) per half.
inline void affine_halves(__m256i q, float a_lo, float b_lo, float a_hi, float b_hi, __m512& lo, __m512& hi) {
  lo = _mm512_fmadd_ps(_mm512_set1_ps(a_lo), widen_u8(_mm256_castsi256_si128(q)), _mm512_set1_ps(b_lo));
  hi = _mm512_fmadd_ps(_mm512_set1_ps(a_hi), widen_u8(_mm256_extracti128_si256(q, 1)), _mm512_set1_ps(b_hi));
}

template <int Q>
struct Decoder;

template <>
struct Decoder<0> {
  const uint8_t* b;
  explicit Decoder(const uint8_t* block) : b(block) {}
  void chunk(int, __m512& lo, __m512& hi) const {
    const __m512 d = _mm512_set1_ps(half_at(b));
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))));
  }
};

// Q4_0, Q4_1, Q5_0, Q5_1: nibbles at `qs`, a fifth bit from u32 qh at `qh` (kQh), d * q + m.
template <int64_t kQs, int64_t kQh, bool kMin, int kOffset>
struct NibbleDecoder {
  const uint8_t* b;
  explicit NibbleDecoder(const uint8_t* block) : b(block) {}
  void chunk(int, __m512& lo, __m512& hi) const {
    const float df = half_at(b);
    const __m512 d = _mm512_set1_ps(df);
    const __m512 m = _mm512_set1_ps(kMin ? half_at(b + 2) : -static_cast<float>(kOffset) * df);
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + kQs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m512i ql = _mm512_cvtepu8_epi32(_mm_and_si128(q, mask));
    __m512i qh = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask));
    if constexpr (kQh > 0) {
      const uint32_t bits = u32_at(b + kQh);
      const __m512i sixteen = _mm512_set1_epi32(16);
      ql = _mm512_mask_or_epi32(ql, static_cast<__mmask16>(bits & 0xFFFF), ql, sixteen);
      qh = _mm512_mask_or_epi32(qh, static_cast<__mmask16>(bits >> 16), qh, sixteen);
    }
    lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(ql), m);
    hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(qh), m);
  }
};

template <> struct Decoder<1> : NibbleDecoder<2, 0, false, 8> { using NibbleDecoder::NibbleDecoder; };
template <> struct Decoder<2> : NibbleDecoder<4, 0, true, 0> { using NibbleDecoder::NibbleDecoder; };
template <> struct Decoder<3> : NibbleDecoder<6, 2, false, 16> { using NibbleDecoder::NibbleDecoder; };
template <> struct Decoder<4> : NibbleDecoder<8, 4, true, 0> { using NibbleDecoder::NibbleDecoder; };

template <>
struct Decoder<10> {  // IQ4_NL: the table's values looked up as float32 (vpermps)
  const uint8_t* b;
  explicit Decoder(const uint8_t* block) : b(block) {}
  void chunk(int, __m512& lo, __m512& hi) const {
    const __m512 d = _mm512_set1_ps(half_at(b));
    const __m512 table = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)kIq4NlValues)));
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm512_mul_ps(d, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)), table));
    hi = _mm512_mul_ps(d, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)), table));
  }
};

template <>
struct Decoder<5> {  // Q2_K
  const uint8_t* b;
  float scale[16], min[16];
  explicit Decoder(const uint8_t* block) : b(block) {
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int i = 0; i < 16; ++i) {
      scale[i] = d * static_cast<float>(b[i] & 0xF);
      min[i] = -dmin * static_cast<float>(b[i] >> 4);
    }
  }
  void chunk(int c, __m512& lo, __m512& hi) const {
    const __m256i q = _mm256_and_si256(shift_right_16(_mm256_loadu_si256((const __m256i*)(b + 16 + 32 * (c / 4))),
                                                      2 * (c % 4)), _mm256_set1_epi8(3));
    affine_halves(q, scale[2 * c], min[2 * c], scale[2 * c + 1], min[2 * c + 1], lo, hi);
  }
};

template <>
struct Decoder<6> {  // Q3_K: q + 4 * hmask bit, then scale * q - 4 * scale
  const uint8_t* b;
  float scale[16], offset[16];
  explicit Decoder(const uint8_t* block) : b(block) {
    const float d = half_at(b + 108);
    int sc[16];
    scales_q3k(b + 96, sc);
    for (int i = 0; i < 16; ++i) {
      scale[i] = d * static_cast<float>(sc[i]);
      offset[i] = -4.f * scale[i];
    }
  }
  void chunk(int c, __m512& lo, __m512& hi) const {
    __m256i q = _mm256_and_si256(shift_right_16(_mm256_loadu_si256((const __m256i*)(b + 32 + 32 * (c / 4))),
                                                2 * (c % 4)), _mm256_set1_epi8(3));
    const __mmask32 high = _mm256_test_epi8_mask(_mm256_loadu_si256((const __m256i*)b),
                                                 _mm256_set1_epi8(static_cast<char>(1 << c)));
    q = _mm256_mask_add_epi8(q, high, q, _mm256_set1_epi8(4));  // bit 2 is clear: + is |
    affine_halves(q, scale[2 * c], offset[2 * c], scale[2 * c + 1], offset[2 * c + 1], lo, hi);
  }
};

// Q4_K and Q5_K: one scale and min per chunk; Q5_K adds bit 4 from qh.
template <bool kFifthBit>
struct KNibbleDecoder {
  static constexpr int64_t kQs = kFifthBit ? 48 : 16;
  const uint8_t* b;
  float scale[8], min[8];
  explicit KNibbleDecoder(const uint8_t* block) : b(block) {
    const float d = half_at(b), dmin = half_at(b + 2);
    int sc[8], mn[8];
    scale_min_k4(b + 4, sc, mn);
    for (int j = 0; j < 8; ++j) {
      scale[j] = d * static_cast<float>(sc[j]);
      min[j] = -dmin * static_cast<float>(mn[j]);
    }
  }
  void chunk(int c, __m512& lo, __m512& hi) const {
    __m256i q = _mm256_and_si256(shift_right_16(_mm256_loadu_si256((const __m256i*)(b + kQs + 32 * (c / 2))),
                                                4 * (c % 2)), _mm256_set1_epi8(0x0F));
    if constexpr (kFifthBit) {
      const __mmask32 high = _mm256_test_epi8_mask(_mm256_loadu_si256((const __m256i*)(b + 16)),
                                                   _mm256_set1_epi8(static_cast<char>(1 << c)));
      q = _mm256_mask_add_epi8(q, high, q, _mm256_set1_epi8(16));  // bit 4 is clear: + is |
    }
    affine_halves(q, scale[c], min[c], scale[c], min[c], lo, hi);
  }
};

template <> struct Decoder<7> : KNibbleDecoder<false> { using KNibbleDecoder::KNibbleDecoder; };
template <> struct Decoder<8> : KNibbleDecoder<true> { using KNibbleDecoder::KNibbleDecoder; };

template <>
struct Decoder<9> {  // Q6_K: scale * q - 32 * scale
  const uint8_t* b;
  float scale[16], offset[16];
  explicit Decoder(const uint8_t* block) : b(block) {
    const float d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int i = 0; i < 16; ++i) {
      scale[i] = d * static_cast<float>(sc[i]);
      offset[i] = -32.f * scale[i];
    }
  }
  void chunk(int c, __m512& lo, __m512& hi) const {
    const int h = c / 4, k = c % 4;
    const __m256i ql = _mm256_and_si256(
        shift_right_16(_mm256_loadu_si256((const __m256i*)(b + 64 * h + 32 * (k % 2))), 4 * (k / 2)),
        _mm256_set1_epi8(0x0F));
    const __m256i qh = _mm256_and_si256(shift_right_16(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)), 2 * k),
                                        _mm256_set1_epi8(3));
    const __m256i q = _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4));  // 0..63: no bit crosses a byte
    affine_halves(q, scale[2 * c], offset[2 * c], scale[2 * c + 1], offset[2 * c + 1], lo, hi);
  }
};
#endif

// One block's weights into w: in registers a chunk at a time with AVX-512, else the
// portable decoding (the same values either way).
template <int Q>
inline void dequant_block(const uint8_t* b, float* w) {
#if defined(CPU_CAPABILITY_AVX512)
  const Decoder<Q> block(b);
#pragma GCC unroll 8
  for (int c = 0; c < Format<Q>::kWeights / 32; ++c) {
    __m512 lo, hi;
    block.chunk(c, lo, hi);
    _mm512_storeu_ps(w + 32 * c, lo);
    _mm512_storeu_ps(w + 32 * c + 16, hi);
  }
#else
  Format<Q>::dequant(b, w);
#endif
}

}  // namespace llmd_quant
