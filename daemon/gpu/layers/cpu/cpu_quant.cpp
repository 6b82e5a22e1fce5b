// gguf_mm: x [M, K] times a GGUF block-quantized weight [N, K] kept packed (gguf_quant.py
// describes the formats). Each row of the weight is read from memory packed, once per
// eight rows of x; each 32-weight block is dequantized in registers (AVX-512; elsewhere
// through a small buffer) and multiplied with those rows, accumulating in float32.
// Equal to x @ dequantize(w)^T up to float32 summation order.
//
// x: float32, bfloat16 or float16, contiguous; w: uint8 [N, K / 32 * block bytes];
// quant: 0 Q8_0, 1 Q4_0, 2 Q4_1; cols = K (a multiple of 32). Returns [M, N] in x's dtype.
//
// gguf_dequantize: the float32 [N, K] of w (for a dense GEMM over many rows).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using llmd_cpu_vec::fVec;
using llmd_cpu_vec::kLanes;
using llmd_cpu_vec::lane_sum;

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 8;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; the portable conversion is a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

template <int Q>
struct Format;

template <>
struct Format<0> {  // Q8_0: fp16 d, 32 int8
  static constexpr int64_t kBytes = 34;
  static inline void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < kBlock; ++i) w[i] = d * static_cast<float>(q[i]);
  }
};

template <>
struct Format<1> {  // Q4_0: fp16 d, 16 bytes of nibbles (low: weight i, high: weight i + 16)
  static constexpr int64_t kBytes = 18;
  static inline void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b);
    const uint8_t* qs = b + 2;
    for (int i = 0; i < kBlock / 2; ++i) {
      w[i] = d * static_cast<float>(static_cast<int>(qs[i] & 0xF) - 8);
      w[i + kBlock / 2] = d * static_cast<float>(static_cast<int>(qs[i] >> 4) - 8);
    }
  }
};

template <>
struct Format<2> {  // Q4_1: fp16 d, fp16 m, 16 bytes of nibbles
  static constexpr int64_t kBytes = 20;
  static inline void dequant(const uint8_t* b, float* w) {
    const float d = half_at(b), m = half_at(b + 2);
    const uint8_t* qs = b + 4;
    for (int i = 0; i < kBlock / 2; ++i) {
      w[i] = d * static_cast<float>(qs[i] & 0xF) + m;
      w[i + kBlock / 2] = d * static_cast<float>(qs[i] >> 4) + m;
    }
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// One block of 32 weights as two float32 vectors (weights 0..15, 16..31), AVX-512.
template <int Q>
inline void block_vectors(const uint8_t* b, __m512& lo, __m512& hi) {
  if constexpr (Q == 0) {
    const __m512 d = _mm512_set1_ps(half_at(b));
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))));
  } else {
    const float df = half_at(b);
    const __m512 d = _mm512_set1_ps(df);
    const __m512 m = _mm512_set1_ps(Q == 1 ? -8.f * df : half_at(b + 2));
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + (Q == 1 ? 2 : 4)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i ql = _mm_and_si128(q, mask), qh = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ql)), m);
    hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qh)), m);
  }
}

// out[r, j] for the T rows of x (T <= kMaxRows, a compile-time count so the accumulators
// stay in registers): each block dequantized in registers and multiplied with every row,
// two accumulators per row (weights 0..15 and 16..31).
template <int Q, int T>
inline void dot_tile(const uint8_t* row, int64_t blocks, const float* x, int64_t cols, float* out, int64_t stride) {
  __m512 acc_lo[T], acc_hi[T];
#pragma GCC unroll 8
  for (int r = 0; r < T; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 lo, hi;
    block_vectors<Q>(row + b * Format<Q>::kBytes, lo, hi);
    const float* xb = x + b * kBlock;
#pragma GCC unroll 8
    for (int r = 0; r < T; ++r) {
      acc_lo[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb + r * cols), acc_lo[r]);
      acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + r * cols + 16), acc_hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < T; ++r) out[r * stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
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
  alignas(64) float wb[kBlock];
  fVec acc[kMaxRows];
  for (int64_t r = 0; r < tile; ++r) acc[r] = fVec(0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    Format<Q>::dequant(row + b * Format<Q>::kBytes, wb);
    const float* xb = x + b * kBlock;
    for (int64_t i = 0; i < kBlock; i += kLanes) {
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
  const int64_t blocks = cols / kBlock, row_bytes = blocks * F::kBytes;
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = w + j * row_bytes;
    float* dst = out + (j - begin) * cols;
    for (int64_t b = 0; b < blocks; ++b) {
#if defined(CPU_CAPABILITY_AVX512)
      __m512 lo, hi;
      block_vectors<Q>(row + b * F::kBytes, lo, hi);
      _mm512_storeu_ps(dst + b * kBlock, lo);
      _mm512_storeu_ps(dst + b * kBlock + 16, hi);
#else
      F::dequant(row + b * F::kBytes, dst + b * kBlock);
#endif
    }
  }
}

// out[r, j] = x[r] . dequant(w[j]): weight rows split between threads, each row read from
// memory once per tile of kMaxRows rows of x.
template <int Q>
void gguf_mm_rows(const float* x, int64_t rows, int64_t cols, const uint8_t* w, int64_t n, float* out) {
  const int64_t blocks = cols / kBlock, row_bytes = blocks * Format<Q>::kBytes;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int64_t tile = std::min(kMaxRows, rows - r0);
      for (int64_t j = begin; j < end; ++j) {
        dot_rows<Q>(w + j * row_bytes, blocks, x + r0 * cols, tile, cols, out + r0 * n + j, n);
      }
    }
  });
}

int64_t check_packed(const at::Tensor& w, int64_t quant, int64_t cols, const char* op) {
  TORCH_CHECK(cols % kBlock == 0, op, ": cols must be a multiple of 32, got ", cols);
  TORCH_CHECK(quant >= 0 && quant <= 2, op, ": quant 0 (Q8_0), 1 (Q4_0) or 2 (Q4_1) expected, got ", quant);
  static constexpr int64_t kBytes[] = {Format<0>::kBytes, Format<1>::kBytes, Format<2>::kBytes};
  const int64_t row_bytes = cols / kBlock * kBytes[quant];
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) == row_bytes, op,
              ": contiguous uint8 w [N, ", row_bytes, "] expected");
  return w.size(0);
}

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t quant, int64_t cols) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.is_contiguous(), "gguf_mm: contiguous x [M, cols] expected");
  const int64_t n = check_packed(w, quant, cols, "gguf_mm");
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.const_data_ptr<float>();
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (quant) {
    case 0: gguf_mm_rows<0>(xp, rows, cols, wp, n, op); break;
    case 1: gguf_mm_rows<1>(xp, rows, cols, wp, n, op); break;
    default: gguf_mm_rows<2>(xp, rows, cols, wp, n, op); break;
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// The float32 weight [N, cols] of packed rows w (what a dense GEMM over many rows reads).
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t quant, int64_t cols) {
  const int64_t n = check_packed(w, quant, cols, "gguf_dequantize");
  at::Tensor out = at::empty({n, cols}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    switch (quant) {
      case 0: dequant_rows<0>(wp, begin, end, cols, op + begin * cols); break;
      case 1: dequant_rows<1>(wp, begin, end, cols, op + begin * cols); break;
      default: dequant_rows<2>(wp, begin, end, cols, op + begin * cols); break;
    }
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
