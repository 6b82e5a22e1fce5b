// The AVX2 x16 product (cpu_quant_x16_avx2_tiles.h): x's quantization, the entry points,
// and the one-pass instances (two and three passes: cpu_quant_x16_avx2_p2.cpp, _p3.cpp).

#include "cpu_quant_x16_avx2_tiles.h"

#if defined(LLMD_X16_AVX2)
namespace llmd_x16 {
namespace {

LLMD_X16_AVX2_TARGET inline int32_t lane_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

LLMD_X16_AVX2_TARGET inline float lane_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Codes of v / scale (32 columns) to `out`, the sums of each 16 to sums[0..1]; v becomes
// what they leave. As the VNNI path's store_codes: cvtps rounds to nearest even, the
// int32 -> int16 -> int8 packs saturate as vpmovsdb does.
LLMD_X16_AVX2_TARGET void store_codes(__m256* v, float scale, int8_t* out, int32_t* sums) {
  const __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f), s = _mm256_set1_ps(scale);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // The packs work per 128-bit lane: dwords come out as q0[0..3] q1[0..3] q2[0..3] q3[0..3]
  // q0[4..7] ...; the permutation puts them in column order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m256i stored[4];  // as stored (saturated)
  for (int i = 0; i < 4; ++i) {
    stored[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(out + 8 * i)));
    v[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(stored[i]), s, v[i]);
  }
  sums[0] = lane_sum(_mm256_add_epi32(stored[0], stored[1]));
  sums[1] = lane_sum(_mm256_add_epi32(stored[2], stored[3]));
}

LLMD_X16_AVX2_TARGET float block_amax(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
  return lane_max(amax);
}

LLMD_X16_AVX2_TARGET void quantize_row(const float* x, int64_t cols, int passes, int64_t span, int8_t* codes,
                                       float* d, float* ds, int32_t* sums) {
  const int64_t blocks = cols / kBlock;
  for (int64_t g = 0; g < blocks / span; ++g) {
    float amax = block_amax(x + g * span * kBlock);  // (as the VNNI path: the same maxima in the same order)
    for (int64_t b = g * span + 1; b < (g + 1) * span; ++b) amax = std::max(amax, block_amax(x + b * kBlock));
    d[g] = amax / 127.0f;
    for (int64_t b = g * span; b < (g + 1) * span; ++b) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      ds[2 * b] = ds[2 * b + 1] = 0.0f;
      for (int p = 0; p < passes; ++p) {
        const float scale = d[g] * kPassScale[p];
        int32_t* s = sums + p * 2 * blocks + 2 * b;
        store_codes(v, scale, codes + p * cols + b * kBlock, s);
        ds[2 * b] += scale * static_cast<float>(s[0]);
        ds[2 * b + 1] += scale * static_cast<float>(s[1]);
      }
    }
  }
}

}  // namespace

template <>
void mm_x16_avx2_passes<1>(int64_t quant, const std::vector<QuantizedRow>& x, const uint8_t* w, int64_t n,
                           int64_t records, float* out) {
  mm_x16_every_type<1>(quant, x, w, n, records, out);
}

// (The entry points carry no target attribute: GCC would take a declaration and a
// definition that differ in it for two versions of one function.)
void quantize_row_avx2(const float* x, int64_t cols, int passes, int64_t span, int8_t* codes, float* d, float* ds,
                       int32_t* sums) {
  quantize_row(x, cols, passes, span, codes, d, ds, sums);
}

void mm_x16_avx2(int64_t quant, int passes, const std::vector<QuantizedRow>& x, const uint8_t* w, int64_t n,
                 int64_t records, float* out) {
  switch (passes) {
    case 1: mm_x16_avx2_passes<1>(quant, x, w, n, records, out); break;
    case 2: mm_x16_avx2_passes<2>(quant, x, w, n, records, out); break;
    default: mm_x16_avx2_passes<3>(quant, x, w, n, records, out); break;
  }
}

}  // namespace llmd_x16

#endif
