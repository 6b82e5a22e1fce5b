// float8 e4m3fn bytes on CPU, shared by cpu_fp8.cpp (FP8 weights) and the quantized KV
// cache (cpu_kernels.cpp reads it, cpu_fused_ops.cpp writes it).
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace llmd_e4m3 {

// The value of each e4m3 byte: sign, four exponent bits biased by 7 (0: subnormal), three
// mantissa bits; 0x7F / 0xFF are NaN.
inline std::array<float, 256> make_table() {
  std::array<float, 256> table{};
  for (int b = 0; b < 256; ++b) {
    const int exponent = (b >> 3) & 0xF, mantissa = b & 7;
    float v = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6) : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    if ((b & 0x7F) == 0x7F) v = NAN;
    table[b] = (b & 0x80) ? -v : v;
  }
  return table;
}

inline const std::array<float, 256>& table() {
  static const std::array<float, 256> values = make_table();
  return values;
}

// The e4m3 byte nearest x (ties to even), x clamped to e4m3's finite range first (c10's
// conversion, torch's own, makes an overflow NaN).
inline uint8_t encode(float x) {
  return c10::Float8_e4m3fn(std::clamp(x, -448.f, 448.f)).x;
}

#if defined(CPU_CAPABILITY_AVX512)
// Sixteen e4m3 bytes as float32 values / 256: the byte's exponent and mantissa shifted
// into an fp16's (fp16's exponent bias is 8 more than e4m3's: the factor 2^-8, exact
// for subnormals too), its sign into the fp16's sign. The byte sign-extended to 16 bits
// and shifted left by 7 holds the sign in bits 15 and 14 and the rest in bits 13..7:
// clearing bit 14 leaves the fp16 (one AND where masking sign and magnitude apart and
// joining them takes four operations).
inline __m512 x16(const uint8_t* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBF80))));
}

constexpr float kUnscale = 256.0f;  // what x16's values are short of
#endif

}  // namespace llmd_e4m3
