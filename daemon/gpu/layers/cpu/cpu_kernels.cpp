// llmd's CPU kernels, built at start-up by cpu_kernels.py (torch.utils.cpp_extension,
// cached on disk) when the engine runs with compile=True.
//
// paged_decode: attention of one query token per request over its paged K/V cache,
// read in place. The torch reference (attention.py, TorchAttention._decode) gathers
// every request's blocks into one padded buffer and runs two batched GEMMs; this reads
// each cached row once, where it lies, for all the query heads that share its kv head.
// Same contract: query head h reads kv head h / (H / KVH); key positions
// [max(0, len - window), len) are seen (window 0: all); scores are scaled, then
// soft-capped (c * tanh(s / c); softcap 0: none); softmax and sums in float32.
//
// q [B, H, D], kv_cache [2, KVH, num_blocks, block_size, D] (K then V), block_table
// [B, max_blocks] int64, seq_lens [B] int64 (context length including the new token).
// Returns [B, H, D] in q's dtype (float32, bfloat16 or float16).
//
// A quantized cache (kv_quant.py: uint8 holding float8 e4m3fn bytes, or int8) is read in
// place too, each row widened to float32 as it is read; k_scale multiplies the scores
// and v_scale the output (stored * scale is the value: the scales are folded in, not
// applied per element). A cache in q's dtype takes scales of 1.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_e4m3.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#include <type_traits>
#include <vector>

namespace {

using at::vec::Vectorized;
using llmd_cpu_vec::fVec;
using llmd_cpu_vec::kLanes;
using llmd_cpu_vec::lane_sum;
using llmd_cpu_vec::widen;


// n e4m3 bytes as float32: sixteen at a time with AVX-512 (llmd_e4m3::x16), eight with
// AVX2 (the same bit move into fp16s), the rest through the table.
inline void widen_e4m3(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 unit = _mm512_set1_ps(llmd_e4m3::kUnscale);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(llmd_e4m3::x16(src + i), unit));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 unit = _mm256_set1_ps(256.f);
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, magnitude)), unit));
  }
#endif
  const auto& table = llmd_e4m3::table();
  for (; i < n; ++i) dst[i] = table[src[i]];
}

// n int8 as float32 (vector widening where the ISA has it).
inline void widen_int8(const int8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= n; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// `rows` cached rows of width d as float32: in place for float, else widened into buf
// (e4m3 bytes and int8 as their values, before the scales).
template <typename T>
inline const float* float_rows(const T* src, int64_t rows, int64_t d, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    widen_e4m3(src, buf, rows * d);
    return buf;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    widen_int8(src, buf, rows * d);
    return buf;
  } else {
    widen(src, buf, rows * d);
    return buf;
  }
}

inline float dot(const float* a, const float* b, int64_t d) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) acc = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc);
  float sum = lane_sum(acc);
  for (; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

// acc[0:d] += sum over r < rows of p[r] * v[r * d : (r + 1) * d], the accumulator held
// in registers across the rows.
inline void add_weighted_rows(const float* p, const float* v, int64_t rows, int64_t d, float* acc) {
  int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes) {
    fVec a = fVec::loadu(acc + c);
    for (int64_t r = 0; r < rows; ++r) a = at::vec::fmadd(fVec(p[r]), fVec::loadu(v + r * d + c), a);
    a.store(acc + c);
  }
  for (; c < d; ++c) {
    float a = acc[c];
    for (int64_t r = 0; r < rows; ++r) a += p[r] * v[r * d + c];
    acc[c] = a;
  }
}

// In place: s[i] = exp(s[i] - max); returns the sum.
inline float exp_and_sum(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  const fVec mxv(mx);
  fVec sumv(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    fVec e = (fVec::loadu(s + i) - mxv).exp_u20();
    e.store(s + i);
    sumv = sumv + e;
  }
  float sum = lane_sum(sumv);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sum;
}

struct Shape {
  int64_t heads, kv_heads, group, dim, num_blocks, block_size, max_blocks;
};

// One (request, kv head): its `group` query heads over the request's cached rows (of
// type C: T, or a quantized cache's bytes). `scale` includes k_scale; v_scale
// multiplies the output.
template <typename T, typename C>
void attend_one(const Shape& s, const T* q, const C* k_head, const C* v_head, const int64_t* table,
                int64_t len, float scale, float softcap, int64_t window, float v_scale, T* out,
                std::vector<float>& work) {
  const int64_t g_n = s.group, d = s.dim, bs = s.block_size;
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t n = len - first;
  work.resize(2 * g_n * d + bs * d + g_n + g_n * n);
  float* qf = work.data();
  float* acc = qf + g_n * d;
  float* rows_buf = acc + g_n * d;
  float* sums = rows_buf + bs * d;
  float* scores = sums + g_n;
  widen(q, qf, g_n * d);
  std::fill(acc, acc + g_n * d, 0.f);
  for (int64_t pos = first; pos < len;) {  // scores, block by block
    const int64_t stop = std::min(len, (pos / bs + 1) * bs);
    const float* k = float_rows(k_head + (table[pos / bs] * bs + pos % bs) * d, stop - pos, d, rows_buf);
    for (int64_t r = 0; r < stop - pos; ++r) {
      for (int64_t g = 0; g < g_n; ++g) {
        float score = dot(qf + g * d, k + r * d, d) * scale;
        if (softcap > 0.f) score = softcap * std::tanh(score / softcap);
        scores[g * n + pos - first + r] = score;
      }
    }
    pos = stop;
  }
  for (int64_t g = 0; g < g_n; ++g) sums[g] = exp_and_sum(scores + g * n, n);
  for (int64_t pos = first; pos < len;) {  // weighted values, block by block
    const int64_t stop = std::min(len, (pos / bs + 1) * bs);
    const float* v = float_rows(v_head + (table[pos / bs] * bs + pos % bs) * d, stop - pos, d, rows_buf);
    for (int64_t g = 0; g < g_n; ++g) add_weighted_rows(scores + g * n + pos - first, v, stop - pos, d, acc + g * d);
    pos = stop;
  }
  for (int64_t g = 0; g < g_n; ++g) {
    const float inv = v_scale / sums[g];
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<T>(acc[g * d + i] * inv);
  }
}

template <typename T, typename C>
void paged_decode_typed(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& table,
                        const at::Tensor& seq_lens, float scale, float softcap, int64_t window, float v_scale,
                        at::Tensor& out) {
  const Shape s{q.size(1), kv_cache.size(1), q.size(1) / kv_cache.size(1), q.size(2),
                kv_cache.size(2), kv_cache.size(3), table.size(1)};
  const int64_t batch = q.size(0);
  const int64_t head_stride = s.num_blocks * s.block_size * s.dim;
  const T* qp = q.const_data_ptr<T>();
  const C* kp = static_cast<const C*>(kv_cache.const_data_ptr());
  const C* vp = kp + s.kv_heads * head_stride;
  const int64_t* tp = table.const_data_ptr<int64_t>();
  const int64_t* lp = seq_lens.const_data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, batch * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / s.kv_heads, h = item % s.kv_heads;
      const int64_t offset = (b * s.heads + h * s.group) * s.dim;
      attend_one<T, C>(s, qp + offset, kp + h * head_stride, vp + h * head_stride, tp + b * s.max_blocks, lp[b],
                       scale, softcap, window, v_scale, op + offset, work);
    }
  });
}

// The cache's element type C for queries of type T: T itself, or a quantized cache's.
template <typename T>
void paged_decode_cache(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& table,
                        const at::Tensor& seq_lens, float scale, float softcap, int64_t window, float k_scale,
                        float v_scale, at::Tensor& out) {
  switch (kv_cache.scalar_type()) {
    case at::kByte:
      paged_decode_typed<T, uint8_t>(q, kv_cache, table, seq_lens, scale * k_scale, softcap, window, v_scale, out);
      break;
    case at::kChar:
      paged_decode_typed<T, int8_t>(q, kv_cache, table, seq_lens, scale * k_scale, softcap, window, v_scale, out);
      break;
    default:
      TORCH_CHECK(k_scale == 1.f && v_scale == 1.f, "paged_decode: scales are for a quantized cache (uint8, int8)");
      paged_decode_typed<T, T>(q, kv_cache, table, seq_lens, scale, softcap, window, 1.f, out);
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                        const at::Tensor& seq_lens, double scale, double softcap, int64_t window, double k_scale,
                        double v_scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "paged_decode: q [B, H, D] and "
              "kv_cache [2, KVH, blocks, block_size, D] expected");
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(1) % kv_cache.size(1) == 0,
              "paged_decode: head sizes of q and the cache disagree");
  const auto cache_type = kv_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == cache_type || cache_type == at::kByte || cache_type == at::kChar,
              "paged_decode: the cache holds q's dtype, or a quantized cache's uint8 (e4m3) or int8");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              block_table.dim() == 2 && block_table.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "paged_decode: int64 block_table [B, max_blocks] and seq_lens [B] expected");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_table.is_contiguous() &&
              seq_lens.is_contiguous(), "paged_decode: contiguous inputs expected");
  auto out = at::empty_like(q);
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      paged_decode_cache<float>(q, kv_cache, block_table, seq_lens, fscale, fcap, window, ks, vs, out);
      break;
    case at::kBFloat16:
      paged_decode_cache<c10::BFloat16>(q, kv_cache, block_table, seq_lens, fscale, fcap, window, ks, vs, out);
      break;
    case at::kHalf:
      paged_decode_cache<c10::Half>(q, kv_cache, block_table, seq_lens, fscale, fcap, window, ks, vs, out);
      break;
    default: TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16 expected, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(llmd_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float scale, "
        "float softcap, int window, float k_scale=1.0, float v_scale=1.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmd_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
