// gguf_mm: x [M, K] times a GGUF block-quantized weight [N, K] kept packed (gguf_formats.py
// describes the formats, cpu_quant_formats.h decodes them). Each row of the weight is read
// from memory packed, once per eight rows of x; each block is dequantized in registers
// (AVX-512: 32 weights at a time, two weight rows at once for a single row of x;
// elsewhere a whole block into a small buffer) and multiplied with those rows,
// accumulating in float32. Equal to x @ dequantize(w)^T up to float32 summation order.
//
// x: float32, bfloat16 or float16, contiguous; w: uint8 [N, K / block weights * block
// bytes]; quant: gguf_formats.FORMATS' code (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1, 5 Q2_K,
// 6 Q3_K, 7 Q4_K, 8 Q5_K, 9 Q6_K, 10 IQ4_NL); cols = K, a multiple of the type's block (32,
// or 256 for the K-quants). Returns [M, N] in x's dtype.
//
// gguf_dequantize: the float32 [N, K] of w (for a dense GEMM over many rows), equal to
// the gguf package's dequantization bit for bit.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_quant_formats.h"
#include "cpu_vec.h"

#include <algorithm>

namespace {

using llmd_cpu_vec::fVec;
using llmd_cpu_vec::kLanes;
using llmd_cpu_vec::lane_sum;
using llmd_quant::dequant_block;
using llmd_quant::dispatch;
using llmd_quant::kNumFormats;
using llmd_quant::Format;

constexpr int64_t kMaxRows = 8;

#if defined(CPU_CAPABILITY_AVX512)
using llmd_quant::Decoder;

// out[r, j] for the T rows of x (T <= kMaxRows, a compile-time count so the accumulators
// stay in registers): each 32-weight chunk dequantized in registers and multiplied with
// every row, two accumulators per row (the chunk's weights 0..15 and 16..31).
template <int Q, int T>
inline void dot_tile(const uint8_t* row, int64_t blocks, const float* x, int64_t cols, float* out, int64_t stride) {
  using F = Format<Q>;
  __m512 acc_lo[T], acc_hi[T];
#pragma GCC unroll 8
  for (int r = 0; r < T; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const Decoder<Q> block(row + b * F::kBytes);
    const float* xb = x + b * F::kWeights;
#pragma GCC unroll 8
    for (int c = 0; c < F::kWeights / 32; ++c) {
      __m512 lo, hi;
      block.chunk(c, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < T; ++r) {
        acc_lo[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb + r * cols + 32 * c), acc_lo[r]);
        acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + r * cols + 32 * c + 16), acc_hi[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < T; ++r) out[r * stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
}

// One row of x against two weight rows at once: two independent chains of decode and
// multiply-add in flight.
template <int Q>
inline void dot_pair(const uint8_t* row0, const uint8_t* row1, int64_t blocks, const float* x, float* out) {
  using F = Format<Q>;
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    const Decoder<Q> b0(row0 + b * F::kBytes), b1(row1 + b * F::kBytes);
    const float* xb = x + b * F::kWeights;
#pragma GCC unroll 8
    for (int c = 0; c < F::kWeights / 32; ++c) {
      __m512 lo0, hi0, lo1, hi1;
      b0.chunk(c, lo0, hi0);
      b1.chunk(c, lo1, hi1);
      const __m512 xl = _mm512_loadu_ps(xb + 32 * c), xh = _mm512_loadu_ps(xb + 32 * c + 16);
      acc[0] = _mm512_fmadd_ps(lo0, xl, acc[0]);
      acc[1] = _mm512_fmadd_ps(hi0, xh, acc[1]);
      acc[2] = _mm512_fmadd_ps(lo1, xl, acc[2]);
      acc[3] = _mm512_fmadd_ps(hi1, xh, acc[3]);
    }
  }
  out[0] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
  out[1] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2], acc[3]));
}

template <int Q>
inline void dot_rows(const uint8_t* row, int64_t blocks, const float* x, int64_t tile, int64_t cols,
                     float* out, int64_t stride) {
  switch (tile) {
    case 1: dot_tile<Q, 1>(row, blocks, x, cols, out, stride); break;
    case 2: dot_tile<Q, 2>(row, blocks, x, cols, out, stride); break;
    case 3: dot_tile<Q, 3>(row, blocks, x, cols, out, stride); break;
    case 4: dot_tile<Q, 4>(row, blocks, x, cols, out, stride); break;
    case 5: dot_tile<Q, 5>(row, blocks, x, cols, out, stride); break;
    case 6: dot_tile<Q, 6>(row, blocks, x, cols, out, stride); break;
    case 7: dot_tile<Q, 7>(row, blocks, x, cols, out, stride); break;
    default: dot_tile<Q, 8>(row, blocks, x, cols, out, stride); break;
  }
}

#else
// Portable: each block dequantized into a float32 buffer, then multiplied with every row.
template <int Q>
inline void dot_rows(const uint8_t* row, int64_t blocks, const float* x, int64_t tile, int64_t cols,
                     float* out, int64_t stride) {
  using F = Format<Q>;
  alignas(64) float wb[F::kWeights];
  fVec acc[kMaxRows];
  for (int64_t r = 0; r < tile; ++r) acc[r] = fVec(0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    F::dequant(row + b * F::kBytes, wb);
    const float* xb = x + b * F::kWeights;
    for (int64_t i = 0; i < F::kWeights; i += kLanes) {
      const fVec wv = fVec::loadu(wb + i);
      for (int64_t r = 0; r < tile; ++r) acc[r] = at::vec::fmadd(wv, fVec::loadu(xb + r * cols + i), acc[r]);
    }
  }
  for (int64_t r = 0; r < tile; ++r) out[r * stride] = lane_sum(acc[r]);
}

#endif

// Rows [begin, end) of packed w as float32 rows at out.
template <int Q>
void dequant_rows(const uint8_t* w, int64_t begin, int64_t end, int64_t cols, float* out) {
  using F = Format<Q>;
  const int64_t blocks = cols / F::kWeights, row_bytes = blocks * F::kBytes;
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = w + j * row_bytes;
    float* dst = out + (j - begin) * cols;
    for (int64_t b = 0; b < blocks; ++b) dequant_block<Q>(row + b * F::kBytes, dst + b * F::kWeights);
  }
}

// out[r, j] = x[r] . dequant(w[j]): weight rows split between threads, each row read from
// memory once per tile of kMaxRows rows of x.
template <int Q>
void gguf_mm_rows(const float* x, int64_t rows, int64_t cols, const uint8_t* w, int64_t n, float* out) {
  using F = Format<Q>;
  const int64_t blocks = cols / F::kWeights, row_bytes = blocks * F::kBytes;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int64_t tile = std::min(kMaxRows, rows - r0);
      int64_t j = begin;
#if defined(CPU_CAPABILITY_AVX512)
      if (tile == 1) {
        for (; j + 2 <= end; j += 2) dot_pair<Q>(w + j * row_bytes, w + (j + 1) * row_bytes, blocks, x + r0 * cols,
                                                 out + r0 * n + j);
      }
#endif
      for (; j < end; ++j) {
        dot_rows<Q>(w + j * row_bytes, blocks, x + r0 * cols, tile, cols, out + r0 * n + j, n);
      }
    }
  });
}

int64_t check_packed(const at::Tensor& w, int64_t quant, int64_t cols, const char* op) {
  TORCH_CHECK(quant >= 0 && quant < kNumFormats, op, ": quant must be a format code 0..", kNumFormats - 1,
              " (gguf_formats.FORMATS), got ", quant);
  int64_t weights = 0, bytes = 0;
  dispatch(quant, [&](auto q) {
    weights = Format<decltype(q)::value>::kWeights;
    bytes = Format<decltype(q)::value>::kBytes;
  });
  TORCH_CHECK(cols > 0 && cols % weights == 0, op, ": cols must be a multiple of ", weights,
              " (this type's block), got ", cols);
  const int64_t row_bytes = cols / weights * bytes;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) == row_bytes, op,
              ": contiguous uint8 w [N, ", row_bytes, "] expected");
  return w.size(0);
}

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t quant, int64_t cols) {
  const int64_t n = check_packed(w, quant, cols, "gguf_mm");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.is_contiguous(), "gguf_mm: contiguous x [M, cols] expected");
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.const_data_ptr<float>();
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  dispatch(quant, [&](auto q) { gguf_mm_rows<decltype(q)::value>(xp, rows, cols, wp, n, op); });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// The float32 weight [N, cols] of packed rows w (what a dense GEMM over many rows reads).
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t quant, int64_t cols) {
  const int64_t n = check_packed(w, quant, cols, "gguf_dequantize");
  at::Tensor out = at::empty({n, cols}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    dispatch(quant, [&](auto q) { dequant_rows<decltype(q)::value>(wp, begin, end, cols, op + begin * cols); });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmd_cpu, m) {
  m.def("gguf_mm(Tensor x, Tensor w, int quant, int cols) -> Tensor");
  m.def("gguf_dequantize(Tensor w, int quant, int cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmd_cpu, CPU, m) {
  m.impl("gguf_mm", &gguf_mm);
  m.impl("gguf_dequantize", &gguf_dequantize);
}
