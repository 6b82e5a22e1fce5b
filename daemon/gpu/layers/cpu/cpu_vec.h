// Vector helpers shared by llmd's CPU kernels (cpu_kernels.cpp, cpu_fused_ops.cpp): rows
// of float32, bfloat16 or float16 widened to float32 and rounded back, a vector at a time.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

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
