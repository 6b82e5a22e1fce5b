// Vector helpers shared by llmd's CPU kernels (cpu_kernels.cpp, cpu_fused_ops.cpp): rows
// of float32, bfloat16 or float16 widened to float32 and rounded back, a vector at a time;
// the sums of a vector's lanes, of one vector or of kLanes vectors at once.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace llmd_cpu_vec {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = fVec::size();

// `n` values of T as float32 in dst.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (!std::is_same_v<T, float>) {
    using tVec = at::vec::Vectorized<T>;
    for (; i + tVec::size() <= n; i += tVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(tVec::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + kLanes);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The sum of a vector's lanes.
inline float lane_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

// Keeps v in a register: a vector loaded once and used by several FMAs is otherwise
// folded into each of them as a memory operand, a load each (the L1 cache serves ~1.3
// 64-byte loads a cycle here, fewer than the FMAs that would read them).
inline void keep_in_register(fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 x = v;
  asm("" : "+v"(x));
  v = x;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 x = v;
  asm("" : "+x"(x));
  v = x;
#else
  (void)v;
#endif
}

// The largest of a vector's lanes.
inline float lane_max(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, v);
}

// Lane r of the result is the sum of a[r]'s lanes, for kLanes vectors a: kLanes dot
// products finished in ~3 instructions each (a tree of in-lane shuffles and adds), where
// a lane_sum per vector takes ~10. Always inlined: called, its caller's accumulators
// would go through memory (GCC left it out of line, 13% of the kernel's time).
C10_ALWAYS_INLINE fVec transpose_sum(const fVec* a) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // in each 128-bit lane: a[2i]'s and a[2i+1]'s halves, interleaved
    const __m512 x = a[2 * i], y = a[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {  // in each 128-bit lane: rows 4i..4i+3's partial sums
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], kEven),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], kOdd));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], kEven),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, kEven), _mm512_shuffle_f32x4(lo, hi, kOdd));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 x = a[2 * i], y = a[2 * i + 1];
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(pairs[2 * i]), y = _mm256_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
#else
  float sums[kLanes];
  for (int64_t r = 0; r < kLanes; ++r) sums[r] = lane_sum(a[r]);
  return fVec::loadu(sums);
#endif
}

// `n` float32 values rounded to T in dst.
template <typename T>
inline void narrow(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (!std::is_same_v<T, float>) {
    using tVec = at::vec::Vectorized<T>;
    for (; i + tVec::size() <= n; i += tVec::size()) {
      at::vec::convert_from_float<T>(fVec::loadu(src + i), fVec::loadu(src + i + kLanes)).store(dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

}  // namespace llmd_cpu_vec
