// fp8_mm: x [M, K] times an FP8 weight [N, K] kept as its e4m3 bytes, with float32
// scales [N, G] (one per row and group of K / G columns: quant/fp8.py): out[m, n] =
// sum over groups g of scales[n, g] * sum over the group's columns k of x[m, k] *
// e4m3(w[n, k]). Each row of the weight is read from memory as bytes, once per eight
// rows of x, and widened in registers (AVX-512: an e4m3 byte's bits moved into an fp16's
// exponent and mantissa give the value / 256 exactly, converted sixteen at a time;
// elsewhere a 256-entry table), accumulating in float32. Equal to x @ dequantize(w)^T up
// to float32 summation order.
//
// x: float32, bfloat16 or float16, contiguous; w: uint8 [N, K]; scales: float32 [N, G],
// K / G a multiple of 16. Returns [M, N] in x's dtype.
//
// fp8_dequantize: the float32 [N, K] of w times its scales (for a dense GEMM over many
// rows).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_e4m3.h"
#include "cpu_vec.h"

#include <algorithm>
#include <array>
#include <cmath>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

using llmd_cpu_vec::fVec;
using llmd_cpu_vec::kLanes;
using llmd_cpu_vec::lane_sum;

constexpr int64_t kMaxRows = 8;
constexpr int64_t kStep = 16;  // columns widened at a time

#if defined(CPU_CAPABILITY_AVX512)
using llmd_e4m3::kUnscale;

// out[r * stride] for the T rows of x against one weight row (T a compile-time count:
// the accumulators stay in registers).
template <int T>
inline void dot_tile(const uint8_t* row, const float* scales, int64_t groups, int64_t group, const float* x,
                     int64_t cols, float* out, int64_t stride) {
  __m512 total[T];
#pragma GCC unroll 8
  for (int r = 0; r < T; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[T];
#pragma GCC unroll 8
    for (int r = 0; r < T; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += kStep) {
      const __m512 w = llmd_e4m3::x16(row + k);
#pragma GCC unroll 8
      for (int r = 0; r < T; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * cols + k), acc[r]);
    }
    const __m512 s = _mm512_set1_ps(scales[g] * kUnscale);
#pragma GCC unroll 8
    for (int r = 0; r < T; ++r) total[r] = _mm512_fmadd_ps(s, acc[r], total[r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < T; ++r) out[r * stride] = _mm512_reduce_add_ps(total[r]);
}

// One row of x against two weight rows at once: two independent chains in flight.
inline void dot_pair(const uint8_t* row0, const uint8_t* row1, const float* sc0, const float* sc1, int64_t groups,
                     int64_t group, const float* x, float* out) {
  __m512 total0 = _mm512_setzero_ps(), total1 = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += kStep) {
      const __m512 xv = _mm512_loadu_ps(x + k);
      acc0 = _mm512_fmadd_ps(llmd_e4m3::x16(row0 + k), xv, acc0);
      acc1 = _mm512_fmadd_ps(llmd_e4m3::x16(row1 + k), xv, acc1);
    }
    total0 = _mm512_fmadd_ps(_mm512_set1_ps(sc0[g] * kUnscale), acc0, total0);
    total1 = _mm512_fmadd_ps(_mm512_set1_ps(sc1[g] * kUnscale), acc1, total1);
  }
  out[0] = _mm512_reduce_add_ps(total0);
  out[1] = _mm512_reduce_add_ps(total1);
}

inline void dot_rows(const uint8_t* row, const float* scales, int64_t groups, int64_t group, const float* x,
                     int64_t tile, int64_t cols, float* out, int64_t stride) {
  switch (tile) {
    case 1: dot_tile<1>(row, scales, groups, group, x, cols, out, stride); break;
    case 2: dot_tile<2>(row, scales, groups, group, x, cols, out, stride); break;
    case 3: dot_tile<3>(row, scales, groups, group, x, cols, out, stride); break;
    case 4: dot_tile<4>(row, scales, groups, group, x, cols, out, stride); break;
    case 5: dot_tile<5>(row, scales, groups, group, x, cols, out, stride); break;
    case 6: dot_tile<6>(row, scales, groups, group, x, cols, out, stride); break;
    case 7: dot_tile<7>(row, scales, groups, group, x, cols, out, stride); break;
    default: dot_tile<8>(row, scales, groups, group, x, cols, out, stride); break;
  }
}
#else
// Portable: each group widened into a float32 buffer by table, then multiplied with every row.
inline void dot_rows(const uint8_t* row, const float* scales, int64_t groups, int64_t group, const float* x,
                     int64_t tile, int64_t cols, float* out, int64_t stride) {
  const auto& table = llmd_e4m3::table();
  float wb[kStep];
  float total[kMaxRows] = {};
  for (int64_t g = 0; g < groups; ++g) {
    fVec acc[kMaxRows];
    for (int64_t r = 0; r < tile; ++r) acc[r] = fVec(0.f);
    for (int64_t k = g * group; k < (g + 1) * group; k += kStep) {
      for (int64_t i = 0; i < kStep; ++i) wb[i] = table[row[k + i]];
      for (int64_t i = 0; i < kStep; i += kLanes) {
        const fVec wv = fVec::loadu(wb + i);
        for (int64_t r = 0; r < tile; ++r) acc[r] = at::vec::fmadd(wv, fVec::loadu(x + r * cols + k + i), acc[r]);
      }
    }
    for (int64_t r = 0; r < tile; ++r) total[r] += scales[g] * lane_sum(acc[r]);
  }
  for (int64_t r = 0; r < tile; ++r) out[r * stride] = total[r];
}
#endif

// out[r, j] = x[r] . dequant(w[j]): weight rows split between threads, each read from
// memory once per tile of kMaxRows rows of x.
void fp8_mm_rows(const float* x, int64_t rows, int64_t cols, const uint8_t* w, const float* scales, int64_t groups,
                 int64_t n, float* out) {
  const int64_t group = cols / groups;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int64_t tile = std::min(kMaxRows, rows - r0);
      int64_t j = begin;
#if defined(CPU_CAPABILITY_AVX512)
      if (tile == 1) {
        for (; j + 2 <= end; j += 2) {
          dot_pair(w + j * cols, w + (j + 1) * cols, scales + j * groups, scales + (j + 1) * groups, groups, group,
                   x + r0 * cols, out + r0 * n + j);
        }
      }
#endif
      for (; j < end; ++j) {
        dot_rows(w + j * cols, scales + j * groups, groups, group, x + r0 * cols, tile, cols, out + r0 * n + j, n);
      }
    }
  });
}

void check_weight(const at::Tensor& w, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": contiguous uint8 w [N, K] expected");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.is_contiguous() &&
                  scales.size(0) == w.size(0) && scales.size(1) > 0 && w.size(1) % scales.size(1) == 0 &&
                  (w.size(1) / scales.size(1)) % kStep == 0,
              op, ": contiguous float32 scales [N, G] expected, K / G a multiple of ", kStep);
}

at::Tensor fp8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  check_weight(w, scales, "fp8_mm");
  const int64_t cols = w.size(1), n = w.size(0), rows = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.is_contiguous(), "fp8_mm: contiguous x [M, K] expected");
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  fp8_mm_rows(xf.const_data_ptr<float>(), rows, cols, w.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
              scales.size(1), n, out.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor fp8_dequantize(const at::Tensor& w, const at::Tensor& scales) {
  check_weight(w, scales, "fp8_dequantize");
  const int64_t n = w.size(0), cols = w.size(1), groups = scales.size(1), group = cols / groups;
  at::Tensor out = at::empty({n, cols}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto& table = llmd_e4m3::table();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t k = 0; k < cols; ++k) op[j * cols + k] = table[wp[j * cols + k]] * sp[j * groups + k / group];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmd_cpu, m) {
  m.def("fp8_mm(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("fp8_dequantize(Tensor w, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmd_cpu, CPU, m) {
  m.impl("fp8_mm", &fp8_mm);
  m.impl("fp8_dequantize", &fp8_dequantize);
}
