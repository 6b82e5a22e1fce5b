// GGUF Q8_0 / Q4_0 / Q4_1 weights repacked sixteen rows at a time, and the product of a
// few rows of x with them through AVX-512 VNNI, as llama.cpp multiplies its
// quantized weights: x is quantized to int8 per 32-column block (a scale and the sum of
// its codes), and each block of sixteen weight rows is one int32 dot product per row,
// four columns at a time (vpdpbusd: sixteen rows x four unsigned weight codes times four
// signed activation codes broadcast), then scaled in float32. llama.cpp stops there,
// which costs ~0.5% of the output's scale (the activation's int8 rounding); here x may
// be quantized in up to three passes, each the one before's rounding error at 1/254 of
// its scale: 2 passes give about 15 bits of x (past bfloat16's 8), 3 about 23 (float32's
// 24), for more dot products over the same weight reads (gguf_quant picks by the model's
// dtype; docs/benchmarks.md has each against the float32 kernel, cpu_quant.cpp).
//
// The x16 layout (gguf_quant.py, "x16"): the weight's N rows in groups of 16; per group,
// per 32-column block b, one record of the same bytes the 16 rows' GGUF blocks take:
//   Q8_0: 8 chunks of 64 bytes, chunk j byte 4*lane + t = q[lane][4j + t] + 128; 16 fp16 d.
//   Q4_0/Q4_1: 4 chunks of 64 bytes, chunk j byte 4*lane + t = q[lane][4j + t] (low nibble)
//     | q[lane][4j + 16 + t] << 4; 16 fp16 d (Q4_1: then 16 fp16 m).
// Records are stored group by group, block by block: the tensor keeps its GGUF shape
// [N, row bytes] (so memory accounting and slicing by 16-row groups hold).
//
// gguf_repack_x16(w, quant, cols): the x16 layout of GGUF rows w (N a multiple of 16).
// gguf_unpack_x16(w, rows, quant, cols): GGUF rows `rows` (int64) of an x16 weight.
// gguf_mm_x16(x [M, cols], w, quant, cols, passes=3) -> [M, N] in x's dtype (needs VNNI).
// gguf_dequantize_x16(w, quant, cols) -> float32 [N, cols] (for a GEMM over many rows).
// gguf_x16_supported(): whether this CPU runs gguf_mm_x16 and gguf_dequantize_x16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define LLMD_X16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;  // weight rows per record
constexpr int64_t kTile = 4;    // rows of x per pass over a record
constexpr int64_t kPrefetch = 16;  // records ahead the product asks the memory for (measured: 2-32)

struct Layout {
  int64_t block_bytes;  // one row's GGUF block
  int64_t chunks;       // 64-byte chunks of codes per record
  int64_t scale_at;     // offset of a GGUF block's d (then m for Q4_1)
  int64_t scales;       // fp16 scales per row per block: d, or d and m
  bool nibbles;
  int offset;           // what the unsigned code exceeds the weight's by: d * (code - offset) (+ m)
};

// quant: 0 Q8_0, 1 Q4_0, 2 Q4_1 (gguf_quant.FORMATS codes)
constexpr Layout kLayouts[] = {{34, 8, 0, 1, false, 128}, {18, 4, 0, 1, true, 8}, {20, 4, 0, 2, true, 0}};

int64_t record_bytes(const Layout& f) { return f.chunks * 64 + f.scales * kGroup * 2; }

// Chunk j's 32-bit word `lane` is bytes 4j..4j+3 of that row's GGUF codes: the nibble
// bytes as they are (low nibble column 4j + t, high 4j + 16 + t), Q8_0's int8 codes
// plus 128 (flipping the top bit). Repacking and reading rows back are transposes of
// 32-bit words.
constexpr uint32_t kFlip[] = {0x80808080u, 0, 0};

void check_layout(const at::Tensor& w, int64_t quant, int64_t cols, const char* op) {
  TORCH_CHECK(quant >= 0 && quant <= 2, op, ": quant 0 (Q8_0), 1 (Q4_0) or 2 (Q4_1) expected, got ", quant);
  TORCH_CHECK(cols % kBlock == 0, op, ": cols must be a multiple of 32, got ", cols);
  const int64_t row_bytes = cols / kBlock * kLayouts[quant].block_bytes;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) == row_bytes, op,
              ": contiguous uint8 w [N, ", row_bytes, "] expected");
  TORCH_CHECK(w.size(0) % kGroup == 0, op, ": the x16 layout needs rows in groups of 16, got ", w.size(0));
}

at::Tensor gguf_repack_x16(const at::Tensor& w, int64_t quant, int64_t cols) {
  check_layout(w, quant, cols, "gguf_repack_x16");
  const Layout& f = kLayouts[quant];
  const int64_t blocks = cols / kBlock, row_bytes = blocks * f.block_bytes, rec = record_bytes(f);
  at::Tensor out = at::empty_like(w);
  const uint8_t* src = w.const_data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, w.size(0) / kGroup, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* r = dst + (g * blocks + b) * rec;
        for (int64_t lane = 0; lane < kGroup; ++lane) {
          const uint8_t* blk = src + (g * kGroup + lane) * row_bytes + b * f.block_bytes;
          for (int64_t s = 0; s < f.scales; ++s) {
            std::memcpy(r + f.chunks * 64 + (s * kGroup + lane) * 2, blk + 2 * s, 2);
          }
          for (int64_t j = 0; j < f.chunks; ++j) {
            uint32_t word;
            std::memcpy(&word, blk + 2 * f.scales + 4 * j, 4);
            word ^= kFlip[quant];
            std::memcpy(r + 64 * j + 4 * lane, &word, 4);
          }
        }
      }
    }
  });
  return out;
}

at::Tensor gguf_unpack_x16(const at::Tensor& w, const at::Tensor& rows, int64_t quant, int64_t cols) {
  check_layout(w, quant, cols, "gguf_unpack_x16");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "gguf_unpack_x16: int64 rows [R] expected");
  const Layout& f = kLayouts[quant];
  const int64_t blocks = cols / kBlock, row_bytes = blocks * f.block_bytes, rec = record_bytes(f);
  const int64_t n = w.size(0), count = rows.size(0);
  const at::Tensor ids = rows.contiguous();
  const int64_t* idp = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < n, "gguf_unpack_x16: row ", idp[i], " outside [0, ", n, ")");
  }
  at::Tensor out = at::empty({count, row_bytes}, w.options());
  const uint8_t* src = w.const_data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, count, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = idp[i] / kGroup, lane = idp[i] % kGroup;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* r = src + (g * blocks + b) * rec;
        uint8_t* blk = dst + i * row_bytes + b * f.block_bytes;
        for (int64_t s = 0; s < f.scales; ++s) std::memcpy(blk + 2 * s, r + f.chunks * 64 + (s * kGroup + lane) * 2, 2);
        uint8_t* qs = blk + 2 * f.scales;
        for (int64_t j = 0; j < f.chunks; ++j) {
          uint32_t word;
          std::memcpy(&word, r + 64 * j + 4 * lane, 4);
          word ^= kFlip[quant];
          std::memcpy(qs + 4 * j, &word, 4);
        }
      }
    }
  });
  return out;
}

bool gguf_x16_supported() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#if defined(__x86_64__)
constexpr int kMaxPasses = 3;
constexpr float kPassScale[kMaxPasses] = {1.0f, 1.0f / 254.0f, 1.0f / (254.0f * 254.0f)};

// One row of x quantized per 32-column block in `passes` int8 passes: pass 0 the codes of
// x at the block's scale d = amax / 127, each next pass the codes of what the passes
// before left, at 1/254 of their scale (x = d * (q0 + q1 / 254 + q2 / 254^2) to within
// the last pass's half step: 7, 15 or 23 bits of the block's largest value). `ds` is
// what the weights' minimums multiply: x summed over the block. The weights' offsets
// multiply the codes' sums, subtracted in int32 (exact: in float32 they would cancel
// against the offset's dot product, some thousand times the result for Q8_0's 128).
struct QuantizedRow {
  const int8_t* codes;  // [passes][cols]
  const float* d;       // [blocks]
  const float* ds;      // [blocks]
  const int32_t* sums;  // [passes][blocks]
  int64_t cols, blocks;
};

// Codes of v / scale to `out` (|v| <= 127 * scale), their sum returned; `v` becomes what
// they leave.
LLMD_X16_TARGET int32_t store_codes(__m512& lo, __m512& hi, float scale, int8_t* out) {
  const __m512 inv = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f), s = _mm512_set1_ps(scale);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  const __m128i clo = _mm512_cvtsepi32_epi8(qlo), chi = _mm512_cvtsepi32_epi8(qhi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), clo);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), chi);
  const __m512i slo = _mm512_cvtepi8_epi32(clo), shi = _mm512_cvtepi8_epi32(chi);  // as stored (saturated)
  lo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(slo), s, lo);
  hi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(shi), s, hi);
  return _mm512_reduce_add_epi32(_mm512_add_epi32(slo, shi));
}

LLMD_X16_TARGET void quantize_row(const float* x, int64_t cols, int passes, int8_t* codes, float* d, float* ds,
                                  int32_t* sums) {
  const int64_t blocks = cols / kBlock;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 lo = _mm512_loadu_ps(x + b * kBlock), hi = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    d[b] = amax / 127.0f;
    ds[b] = 0.0f;
    for (int p = 0; p < passes; ++p) {
      const float scale = d[b] * kPassScale[p];
      const int32_t sum = store_codes(lo, hi, scale, codes + p * cols + b * kBlock);
      sums[p * blocks + b] = sum;
      ds[b] += scale * static_cast<float>(sum);
    }
  }
}

// out[r][g*16 + lane] for the `T` rows of x and the 16 weight rows of group g: per pass,
// d * dx * (dot - offset * sum) (the codes exceed the weights by `offset`); Q4_1 adds
// m * (x summed over the block).
template <int Q, int T, int P>
LLMD_X16_TARGET void group_tile(const uint8_t* w, const QuantizedRow* x, float* out, int64_t stride) {
  constexpr Layout f = kLayouts[Q];
  constexpr int64_t rec = f.chunks * 64 + f.scales * kGroup * 2;
  const int64_t blocks = x[0].blocks, cols = x[0].cols;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[T];
  for (int r = 0; r < T; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rp = w + b * rec;
    // The weight streams from memory once per product: ask for a record kPrefetch ahead
    // (the next group's first ones when this group ends: groups are contiguous).
    const char* ahead = reinterpret_cast<const char*>(rp + kPrefetch * rec);
    for (int64_t line = 0; line < rec; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    __m512i codes[8];
    if constexpr (f.nibbles) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(rp + 64 * j);
        codes[j] = _mm512_and_si512(v, low);
        codes[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int j = 0; j < 8; ++j) codes[j] = _mm512_loadu_si512(rp + 64 * j);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp + f.chunks * 64)));
    for (int r = 0; r < T; ++r) {
      __m512 t = _mm512_setzero_ps();
      for (int p = 0; p < P; ++p) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(x[r].codes + p * cols + b * kBlock);
        __m512i dot = _mm512_set1_epi32(-f.offset * x[r].sums[p * blocks + b]);
        for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, codes[j], _mm512_set1_epi32(xq[j]));
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(x[r].d[b] * kPassScale[p]), t);
      }
      acc[r] = _mm512_fmadd_ps(d, t, acc[r]);
      if constexpr (f.scales == 2) {
        const __m512 m = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp + f.chunks * 64 + kGroup * 2)));
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[r].ds[b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < T; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}

template <int Q, int P>
void mm_x16(const std::vector<QuantizedRow>& x, const uint8_t* w, int64_t n, float* out) {
  const int64_t rec = record_bytes(kLayouts[Q]), rows = static_cast<int64_t>(x.size()), blocks = x[0].blocks;
  at::parallel_for(0, n / kGroup, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = w + g * blocks * rec;
      for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
        const QuantizedRow* xr = x.data() + r0;
        float* o = out + r0 * n + g * kGroup;
        switch (std::min(kTile, rows - r0)) {
          case 1: group_tile<Q, 1, P>(wg, xr, o, n); break;
          case 2: group_tile<Q, 2, P>(wg, xr, o, n); break;
          case 3: group_tile<Q, 3, P>(wg, xr, o, n); break;
          default: group_tile<Q, 4, P>(wg, xr, o, n); break;
        }
      }
    }
  });
}

// Rows of group g as float32 rows [16, cols] at out: each row's code words gathered
// from the record's chunks, then decoded as its GGUF block.
template <int Q>
LLMD_X16_TARGET void dequantize_group(const uint8_t* w, int64_t blocks, int64_t cols, float* out) {
  constexpr Layout f = kLayouts[Q];
  constexpr int64_t rec = f.chunks * 64 + f.scales * kGroup * 2;
  const __m128i chunk_offsets = _mm_setr_epi32(0, 64, 128, 192);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* r = w + b * rec;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + f.chunks * 64)));
    alignas(64) float ds[kGroup], ms[kGroup];
    _mm512_store_ps(ds, d);
    if constexpr (f.scales == 2) {
      const __m256i mins = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + f.chunks * 64 + 32));
      _mm512_store_ps(ms, _mm512_cvtph_ps(mins));
    }
    for (int64_t lane = 0; lane < kGroup; ++lane) {
      const int* base = reinterpret_cast<const int*>(r + 4 * lane);
      const __m128i words = _mm_i32gather_epi32(base, chunk_offsets, 1);  // codes 0..15 (Q8_0: 0..15 of 32)
      float* dst = out + lane * cols + b * kBlock;
      const __m512 scale = _mm512_set1_ps(ds[lane]);
      __m512 lo, hi;
      if constexpr (f.nibbles) {
        lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(words, low)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(words, 4), low)));
      } else {
        const __m128i more = _mm_i32gather_epi32(base + 64, chunk_offsets, 1);  // codes 16..31
        lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(words));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(more));
      }
      const __m512 shift = _mm512_set1_ps(static_cast<float>(-f.offset));
      const __m512 add = f.scales == 2 ? _mm512_set1_ps(ms[lane]) : _mm512_setzero_ps();
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_add_ps(lo, shift), scale, add));
      _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(_mm512_add_ps(hi, shift), scale, add));
    }
  }
}

template <int Q>
void dequantize_x16(const uint8_t* w, int64_t n, int64_t cols, float* out) {
  const int64_t blocks = cols / kBlock, rec = record_bytes(kLayouts[Q]);
  at::parallel_for(0, n / kGroup, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) dequantize_group<Q>(w + g * blocks * rec, blocks, cols, out + g * kGroup * cols);
  });
}

template <int Q>
void mm_x16_passes(const std::vector<QuantizedRow>& x, int passes, const uint8_t* w, int64_t n, float* out) {
  switch (passes) {
    case 1: mm_x16<Q, 1>(x, w, n, out); break;
    case 2: mm_x16<Q, 2>(x, w, n, out); break;
    default: mm_x16<Q, 3>(x, w, n, out); break;
  }
}
#endif

at::Tensor gguf_mm_x16(const at::Tensor& x, const at::Tensor& w, int64_t quant, int64_t cols, int64_t passes) {
  check_layout(w, quant, cols, "gguf_mm_x16");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.is_contiguous(), "gguf_mm_x16: contiguous x [M, cols] expected");
  TORCH_CHECK(passes >= 1 && passes <= 3, "gguf_mm_x16: passes 1, 2 or 3 expected, got ", passes);
  TORCH_CHECK(gguf_x16_supported(), "gguf_mm_x16: this CPU lacks AVX-512 VNNI");
  const int64_t rows = x.size(0), n = w.size(0), blocks = cols / kBlock;
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
#if defined(__x86_64__)
  if (rows == 0) return out.to(x.scalar_type());
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  std::vector<int8_t> codes(rows * passes * cols);
  std::vector<float> scales(2 * rows * blocks);
  std::vector<int32_t> sums(rows * passes * blocks);
  std::vector<QuantizedRow> quantized(rows);
  const float* xp = xf.const_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* q = codes.data() + r * passes * cols;
    float* d = scales.data() + 2 * r * blocks;
    int32_t* sum = sums.data() + r * passes * blocks;
    quantize_row(xp + r * cols, cols, static_cast<int>(passes), q, d, d + blocks, sum);
    quantized[r] = {q, d, d + blocks, sum, cols, blocks};
  }
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int p = static_cast<int>(passes);
  switch (quant) {
    case 0: mm_x16_passes<0>(quantized, p, wp, n, op); break;
    case 1: mm_x16_passes<1>(quantized, p, wp, n, op); break;
    default: mm_x16_passes<2>(quantized, p, wp, n, op); break;
  }
#endif
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor gguf_dequantize_x16(const at::Tensor& w, int64_t quant, int64_t cols) {
  check_layout(w, quant, cols, "gguf_dequantize_x16");
  TORCH_CHECK(gguf_x16_supported(), "gguf_dequantize_x16: this CPU lacks AVX-512 VNNI");
  const int64_t n = w.size(0);
  at::Tensor out = at::empty({n, cols}, w.options().dtype(at::kFloat));
#if defined(__x86_64__)
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (quant) {
    case 0: dequantize_x16<0>(wp, n, cols, op); break;
    case 1: dequantize_x16<1>(wp, n, cols, op); break;
    default: dequantize_x16<2>(wp, n, cols, op); break;
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmd_cpu, m) {
  m.def("gguf_repack_x16(Tensor w, int quant, int cols) -> Tensor");
  m.def("gguf_unpack_x16(Tensor w, Tensor rows, int quant, int cols) -> Tensor");
  m.def("gguf_mm_x16(Tensor x, Tensor w, int quant, int cols, int passes=3) -> Tensor");
  m.def("gguf_dequantize_x16(Tensor w, int quant, int cols) -> Tensor");
  m.def("gguf_x16_supported() -> bool");
}

TORCH_LIBRARY_IMPL(llmd_cpu, CPU, m) {
  m.impl("gguf_repack_x16", &gguf_repack_x16);
  m.impl("gguf_unpack_x16", &gguf_unpack_x16);
  m.impl("gguf_mm_x16", &gguf_mm_x16);
  m.impl("gguf_dequantize_x16", &gguf_dequantize_x16);
}

TORCH_LIBRARY_IMPL(llmd_cpu, CatchAll, m) {
  m.impl("gguf_x16_supported", &gguf_x16_supported);
}
