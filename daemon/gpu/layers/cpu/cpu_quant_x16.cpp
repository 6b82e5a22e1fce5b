// GGUF weights repacked sixteen rows at a time (every packed type: Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1 and the K-quants Q2_K..Q6_K), and the product of a few rows of x with them
// through AVX-512 VNNI (or AVX2 where a CPU lacks it: cpu_quant_x16_avx2.cpp), as
// llama.cpp multiplies its quantized weights: x is quantized to
// int8 per 32-column block (a scale and the sums of its codes), and each 32 columns of
// sixteen weight rows are one int32 dot product per row, four columns at a time
// (vpdpbusd: sixteen rows x four unsigned weight codes times four signed activation codes
// broadcast), then scaled in float32. llama.cpp stops there, which costs ~0.5% of the
// output's scale (the activation's int8 rounding); here x may be quantized in up to three
// passes, each the one before's rounding error at 1/254 of its scale: 2 passes give about
// 15 bits of x (past bfloat16's 8), 3 about 23 (float32's 24), for more dot products over
// the same weight reads (gguf_quant picks by the model's dtype; docs/benchmarks.md has
// each against the float32 kernel, cpu_quant.cpp).
//
// The K-quants are multiplied as llama.cpp's ggml_vec_dot_q4_K_q8_K and q6_K_q8_K do, with
// x still quantized per 32 columns: each 32-column sub-block of a 256-weight super-block
// is one dot product per row scaled by d times its 6-bit sub-scale, less dmin times its
// min times x's sum there; where a type scales each 16 columns (Q2_K, Q3_K, Q6_K) the two
// halves' dot products are summed apart and scaled each by its own. Every
// code's offset (Q8_0's 128, Q4_0's 8, Q5_0's 16, Q3_K's 4, Q6_K's 32: the codes exceed the
// weights by it) is taken off in int32, as the offset times the sum of x's codes: in
// float32 it would cancel against the offset's share of the dot product, some thousand
// times the result for Q8_0.
//
// Layouts: cpu_quant_x16_layout.h (the same bytes as the GGUF rows, rearranged); reading
// a record for the product: cpu_quant_x16_records.h (and _avx2.h); what both products
// share: cpu_quant_x16_product.h.
//
// gguf_repack_x16(w, quant, cols): the x16 layout of GGUF rows w (N a multiple of 16);
//   gguf_repack_x16_ the same in place.
// gguf_unpack_x16(w, rows, quant, cols): GGUF rows `rows` (int64) of an x16 weight.
// gguf_mm_x16(x [M, cols], w, quant, cols, passes=3, isa="") -> [M, N] in x's dtype: with
//   AVX-512 VNNI (here) or AVX2 + FMA + F16C (cpu_quant_x16_avx2.cpp, the same products
//   to the bit of their int32 sums), `isa` "avx512_vnni" or "avx2", "" the one
//   LLMD_GGUF_X16_ISA names (read once; the A/B switch, and how a CI machine with
//   AVX-512 tests the AVX2 path), else the best this CPU has.
// gguf_mm_x16_into(x, w, quant, cols, passes, isa, out) -> out: the same into a float32
//   [M, N] (x float32): a buffer its caller keeps from step to step (gguf_quant: an LM
//   head's logits, which a new tensor each step would fault in page by page).
// gguf_dequantize_x16(w, quant, cols) -> float32 [N, cols] (for a GEMM over many rows),
//   equal to gguf_dequantize of the GGUF rows (any CPU).
// gguf_x16_supported(): whether this CPU runs gguf_mm_x16 (with the ISA "" picks).
// gguf_x16_isas(): the ISAs this CPU runs it with, best first. Both count only the
//   products this build compiled (cpu_quant_x16_product.h: none in the portable build).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_quant_formats.h"
#include "cpu_quant_x16_layout.h"
#include "cpu_quant_x16_product.h"
#include "cpu_quant_x16_records.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using llmd_quant::dispatch;
using llmd_quant::Format;
using llmd_x16::kGroup;
using llmd_x16::kLayouts;
using llmd_x16::kBlock;
using llmd_x16::kPassScale;
using llmd_x16::first_scaled_pass;
using llmd_x16::joins_passes;
using llmd_x16::QuantizedRow;
using llmd_x16::record_bytes;

// The weight's GGUF blocks per row, once w is checked to be an x16 weight of this type.
int64_t check_layout(const at::Tensor& w, int64_t quant, int64_t cols, const char* op) {
  TORCH_CHECK(quant >= 0 && quant < llmd_x16::kNumLayouts, op, ": quant must be a format code 0..",
              llmd_x16::kNumLayouts - 1, " (gguf_formats.FORMATS), got ", quant);
  int64_t weights = 0;
  dispatch(quant, [&](auto q) { weights = Format<decltype(q)::value>::kWeights; });
  TORCH_CHECK(cols > 0 && cols % weights == 0, op, ": cols must be a multiple of ", weights,
              " (this type's block), got ", cols);
  const int64_t blocks = cols / weights, row_bytes = blocks * kLayouts[quant].block_bytes;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) == row_bytes, op,
              ": contiguous uint8 w [N, ", row_bytes, "] expected");
  TORCH_CHECK(w.size(0) % kGroup == 0, op, ": the x16 layout needs rows in groups of 16, got ", w.size(0));
  return blocks;
}

// GGUF block b of row `lane` of the group whose records start at `records`.
template <int Q>
inline void read_block(const uint8_t* records, int64_t b, int64_t lane, uint8_t* block) {
  llmd_x16::record_to_block<Q>(records + b * record_bytes(Q), lane, block);
}

// In place: each 16-row group's records take the bytes its rows held (the same count),
// written from a copy of those rows (a thread's scratch of one group), so a weight is
// repacked at load without a second copy of it (the load's peak).
at::Tensor& gguf_repack_x16_(at::Tensor& w, int64_t quant, int64_t cols) {
  const int64_t blocks = check_layout(w, quant, cols, "gguf_repack_x16_");
  const int64_t bytes = kLayouts[quant].block_bytes, row_bytes = blocks * bytes;
  uint8_t* data = w.data_ptr<uint8_t>();
  dispatch(quant, [&](auto q) {
    constexpr int Q = decltype(q)::value;
    at::parallel_for(0, w.size(0) / kGroup, 16, [&](int64_t g0, int64_t g1) {
      std::vector<uint8_t> rows(kGroup * row_bytes);
      for (int64_t g = g0; g < g1; ++g) {
        uint8_t* group = data + g * kGroup * row_bytes;
        std::memcpy(rows.data(), group, rows.size());
        for (int64_t b = 0; b < blocks; ++b) {
          for (int64_t lane = 0; lane < kGroup; ++lane) {
            llmd_x16::block_to_record<Q>(rows.data() + lane * row_bytes + b * bytes, lane, group + b * record_bytes(Q));
          }
        }
      }
    });
  });
  return w;
}

at::Tensor gguf_repack_x16(const at::Tensor& w, int64_t quant, int64_t cols) {
  check_layout(w, quant, cols, "gguf_repack_x16");
  at::Tensor out = w.clone();
  return gguf_repack_x16_(out, quant, cols);
}

at::Tensor gguf_unpack_x16(const at::Tensor& w, const at::Tensor& rows, int64_t quant, int64_t cols) {
  const int64_t blocks = check_layout(w, quant, cols, "gguf_unpack_x16");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "gguf_unpack_x16: int64 rows [R] expected");
  const int64_t bytes = kLayouts[quant].block_bytes, row_bytes = blocks * bytes;
  const int64_t n = w.size(0), count = rows.size(0);
  const at::Tensor ids = rows.contiguous();
  const int64_t* idp = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < n, "gguf_unpack_x16: row ", idp[i], " outside [0, ", n, ")");
  }
  at::Tensor out = at::empty({count, row_bytes}, w.options());
  const uint8_t* src = w.const_data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  dispatch(quant, [&](auto q) {
    constexpr int Q = decltype(q)::value;
    at::parallel_for(0, count, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const uint8_t* group = src + idp[i] / kGroup * blocks * record_bytes(Q);
        for (int64_t b = 0; b < blocks; ++b) read_block<Q>(group, b, idp[i] % kGroup, dst + i * row_bytes + b * bytes);
      }
    });
  });
  return out;
}

// What gguf_mm_x16 runs with, best first.
enum class Isa { kAvx512Vnni, kAvx2, kNone };
constexpr Isa kIsas[] = {Isa::kAvx512Vnni, Isa::kAvx2};

const char* isa_name(Isa isa) { return isa == Isa::kAvx512Vnni ? "avx512_vnni" : "avx2"; }

// Whether this build has `isa`'s product (cpu_quant_x16_product.h) and this CPU runs it.
bool cpu_runs(Isa isa) {
#if defined(LLMD_X16_AVX2)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == Isa::kAvx2) return avx2;
#if defined(LLMD_X16_VNNI)
  return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
#endif
#endif
  return false;
}

std::vector<std::string> gguf_x16_isas() {
  std::vector<std::string> names;
  for (Isa isa : kIsas) {
    if (cpu_runs(isa)) names.emplace_back(isa_name(isa));
  }
  return names;
}

// The ISA `name` ("" picks: chosen_isa), refused unless this CPU runs it; `what` names
// where the name came from.
Isa isa_named(const std::string& name, const char* what);

// LLMD_GGUF_X16_ISA's ISA, read once; unset or empty: the best this CPU has (kNone: none).
Isa chosen_isa() {
  static const Isa chosen = [] {
    const char* env = std::getenv("LLMD_GGUF_X16_ISA");
    if (env != nullptr && *env != '\0') return isa_named(env, "LLMD_GGUF_X16_ISA");
    for (Isa isa : kIsas) {
      if (cpu_runs(isa)) return isa;
    }
    return Isa::kNone;
  }();  // (a refused name throws, and the next call reads it again)
  return chosen;
}

Isa isa_named(const std::string& name, const char* what) {
  if (name.empty()) return chosen_isa();
  for (Isa isa : kIsas) {
    if (name != isa_name(isa)) continue;
    std::string runs;
    for (const std::string& n : gguf_x16_isas()) runs += (runs.empty() ? "" : ", ") + n;
    TORCH_CHECK(cpu_runs(isa), what, ": this CPU (or this build of the kernels) lacks ", name, " (it runs: ",
                runs.empty() ? "none" : runs, ")");
    return isa;
  }
  TORCH_CHECK(false, what, " must be avx512_vnni or avx2 (or empty: the best this CPU runs), got '", name, "'");
}

bool gguf_x16_supported() { return chosen_isa() != Isa::kNone; }

// Rows of the group whose records start at `records` as float32 rows [16, cols] at out:
// each row's blocks read back and decoded as GGUF blocks (the same values as gguf_dequantize).
template <int Q>
void dequantize_group(const uint8_t* records, int64_t blocks, int64_t cols, float* out) {
  constexpr int64_t kWeights = Format<Q>::kWeights;
  uint8_t block[Format<Q>::kBytes];
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t lane = 0; lane < kGroup; ++lane) {
      read_block<Q>(records, b, lane, block);
      llmd_quant::dequant_block<Q>(block, out + lane * cols + b * kWeights);
    }
  }
}

#if defined(LLMD_X16_VNNI)
using llmd_x16::kPrefetch;
using llmd_x16::kPrefetchL2;
using llmd_x16::SubBlock;
using llmd_x16::X16Record;

// x's rows quantized (cpu_quant_x16_product.h's QuantizedRow; cpu_quant_x16_avx2.cpp gives
// the same codes). Codes of v / scale to `out` (|v| <= 127 * scale), the sums of each 16
// to sums[0..1]; `v` becomes what they leave.
LLMD_X16_TARGET void store_codes(__m512& lo, __m512& hi, float scale, int8_t* out, int32_t* sums) {
  const __m512 inv = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f), s = _mm512_set1_ps(scale);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  const __m128i clo = _mm512_cvtsepi32_epi8(qlo), chi = _mm512_cvtsepi32_epi8(qhi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), clo);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), chi);
  const __m512i slo = _mm512_cvtepi8_epi32(clo), shi = _mm512_cvtepi8_epi32(chi);  // as stored (saturated)
  lo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(slo), s, lo);
  hi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(shi), s, hi);
  sums[0] = _mm512_reduce_add_epi32(slo);
  sums[1] = _mm512_reduce_add_epi32(shi);
}

LLMD_X16_TARGET void quantize_row(const float* x, int64_t cols, int passes, int8_t* codes, float* d, float* ds,
                                  int32_t* sums) {
  const int64_t blocks = cols / kBlock;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 lo = _mm512_loadu_ps(x + b * kBlock), hi = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    d[b] = amax / 127.0f;
    ds[2 * b] = ds[2 * b + 1] = 0.0f;
    for (int p = 0; p < passes; ++p) {
      const float scale = d[b] * kPassScale[p];
      int32_t* s = sums + p * 2 * blocks + 2 * b;
      store_codes(lo, hi, scale, codes + p * cols + b * kBlock, s);
      ds[2 * b] += scale * static_cast<float>(s[0]);
      ds[2 * b + 1] += scale * static_cast<float>(s[1]);
    }
  }
}

// acc + the dot products of 16 rows' four unsigned codes (q's lanes) with x's four codes
// at `x` (vpdpbusd): x broadcast from memory within the instruction ({1to16}), where
// _mm512_set1_epi32 of it is a load of its own that GCC 12 does not fold (one instruction
// fewer per four columns: 5-12% faster at 32 rows for Q8_0 and Q6_K; docs/benchmarks.md).
LLMD_X16_TARGET inline __m512i dot4(__m512i acc, __m512i q, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*x));
  return acc;
}

// The int32 dot products of sub-block `sb` with pass p of x's block b, the codes' offset
// taken off: columns 0..15 and 16..31 (two chains of four: twice the dot products in
// flight, and each half's own scale where the type has one; where it has not, the two
// are summed, and the offset is taken off the first alone: one broadcast fewer).
// kSplit: four chains of two instead (one row in one pass has no other dot products to
// overlap a chain's latency with: Q6_K / Q8_0 at one row and one pass took longer than at
// two passes).
template <typename R, bool kSplit = false>
LLMD_X16_TARGET inline void sub_block_dots(const SubBlock& sb, const QuantizedRow& x, int p, int64_t b, __m512i& lo,
                                           __m512i& hi) {
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.codes + p * x.cols + b * kBlock);
  const int32_t* sum = x.sums + p * 2 * x.blocks + 2 * b;
  if constexpr (R::kHalves) {
    lo = _mm512_set1_epi32(-R::kOffset * sum[0]);
    hi = _mm512_set1_epi32(-R::kOffset * sum[1]);
  } else {
    lo = R::kOffset ? _mm512_set1_epi32(-R::kOffset * (sum[0] + sum[1])) : _mm512_setzero_si512();
    hi = _mm512_setzero_si512();
  }
  if constexpr (kSplit) {
    __m512i lo2 = _mm512_setzero_si512(), hi2 = _mm512_setzero_si512();
    for (int j = 0; j < 4; j += 2) {
      lo = dot4(lo, sb.q[j], xq + j);
      hi = dot4(hi, sb.q[j + 4], xq + j + 4);
      lo2 = dot4(lo2, sb.q[j + 1], xq + j + 1);
      hi2 = dot4(hi2, sb.q[j + 5], xq + j + 5);
    }
    lo = _mm512_add_epi32(lo, lo2);
    hi = _mm512_add_epi32(hi, hi2);
  } else {
    for (int j = 0; j < 4; ++j) {
      lo = dot4(lo, sb.q[j], xq + j);
      hi = dot4(hi, sb.q[j + 4], xq + j + 4);
    }
  }
}

// 254 * s0 + s1 (exact within int32 for the dot products of two passes' codes).
LLMD_X16_TARGET inline __m512i joined(__m512i s0, __m512i s1) {
  return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(s0, 8), _mm512_slli_epi32(s0, 1)), s1);
}

// out[r][g*16 + lane] for the `T` rows of x and the 16 weight rows of group g: per
// sub-block, its scale times the sum over passes of its dot products times that pass's
// scale of x, plus the minimums times x's sums.
// `stream`: the outputs stored past the caches (mm_x16's kStreamBytes).
template <int Q, int T, int P>
LLMD_X16_TARGET void group_tile(const uint8_t* w, const QuantizedRow* x, float* out, int64_t stride, bool stream) {
  using R = X16Record<Q>;
  constexpr int64_t rec = record_bytes(Q), sub_bytes = rec / R::kSub;
  const int64_t blocks = x[0].blocks;
  __m512 acc[T];
  for (int r = 0; r < T; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < blocks / R::kSub; ++s) {
    const uint8_t* rp = w + s * rec;
    const R record(rp);
    // Not unrolled: with the K-quants' eight sub-blocks unrolled (their shifts constants)
    // the product was as fast with its weight in cache and 1.2-1.5x slower streamed from
    // memory at one row on Zen 4 (the 1B's 763 MiB of Q4_K / Q6_K layers, 2 threads: 33.4
    // / 35.4 ms a token at 1 / 2 passes, not unrolled 21.1 / 22.2; docs/benchmarks.md).
#pragma GCC unroll 1
    for (int c = 0; c < R::kSub; ++c) {
      // The weight streams from memory once per product: ask for what lies kPrefetch
      // sub-blocks ahead (the next group's first records when this group ends: groups are
      // contiguous).
      const char* ahead = reinterpret_cast<const char*>(rp + (c + kPrefetch) * sub_bytes);
      for (int64_t line = 0; line < sub_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      const char* far = reinterpret_cast<const char*>(rp + (c + kPrefetchL2) * sub_bytes);
      for (int64_t line = 0; line < sub_bytes; line += 64) _mm_prefetch(far + line, _MM_HINT_T2);
      SubBlock sb;
      record.decode(c, sb);
      const int64_t b = s * R::kSub + c;
      for (int r = 0; r < T; ++r) {
        __m512i lo[P], hi[P];
        for (int p = 0; p < P; ++p) sub_block_dots<R, T * P == 1>(sb, x[r], p, b, lo[p], hi[p]);
        if constexpr (joins_passes(Q, P)) {  // 254 * pass 0's + pass 1's
          lo[1] = joined(lo[0], lo[1]);
          hi[1] = joined(hi[0], hi[1]);
        }
        __m512 t_lo = _mm512_setzero_ps(), t_hi = _mm512_setzero_ps();
        for (int p = first_scaled_pass(Q, P); p < P; ++p) {
          const __m512 dx = _mm512_set1_ps(x[r].d[b] * kPassScale[p]);
          if constexpr (R::kHalves) {  // each half its scale: in float32 (an int32 multiply is two slow uops)
            t_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[p]), dx, t_lo);
            t_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[p]), dx, t_hi);
          } else {
            t_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo[p], hi[p])), dx, t_lo);
          }
        }
        acc[r] = _mm512_fmadd_ps(sb.scale[0], t_lo, acc[r]);
        if constexpr (R::kHalves) acc[r] = _mm512_fmadd_ps(sb.scale[1], t_hi, acc[r]);
        const float* ds = x[r].ds + 2 * b;
        if constexpr (R::kMin == 1) acc[r] = _mm512_fmadd_ps(sb.min[0], _mm512_set1_ps(ds[0] + ds[1]), acc[r]);
        if constexpr (R::kMin == 2) {
          acc[r] = _mm512_fmadd_ps(sb.min[0], _mm512_set1_ps(ds[0]), acc[r]);
          acc[r] = _mm512_fmadd_ps(sb.min[1], _mm512_set1_ps(ds[1]), acc[r]);
        }
      }
    }
  }
  if (stream) {
    for (int r = 0; r < T; ++r) _mm512_stream_ps(out + r * stride, acc[r]);
  } else {
    for (int r = 0; r < T; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
  }
}

// Rows of x per tile: kWideTile, the codes decoded once per eight rows (32 rows, one thread,
// in cache: Q4_K / Q6_K 1.15-1.2x faster at one pass, 1.05-1.1x at two), but four where
// two passes are joined in int32 (Q8_0, IQ4_NL: eight were 5% slower, their registers full).
constexpr int64_t tile_rows(int quant, int passes) {
  return llmd_x16::joins_passes(quant, passes) ? llmd_x16::kTile : llmd_x16::kWideTile;
}

// Outputs of at least this many bytes are stored past the caches (non-temporal): an LM
// head's logits (Gemma 3's 262,144 columns at 32 rows: 32 MiB) would otherwise be read
// into the cache line by line before each is written, and evict the weights' prefetched
// lines; what the next layer reads at once stays below it (the 1B's widest, 32 rows of
// 16,384: 2 MiB). Q8_0 262144 x 640 at 32 rows, one pass, into a buffer reused from call
// to call (gguf_quant's LM head): 1.2x faster; into new pages, which the kernel has just
// zeroed through the caches, 5% slower (docs/benchmarks.md).
constexpr int64_t kStreamBytes = int64_t{8} << 20;

template <int Q, int P>
void mm_x16(const std::vector<QuantizedRow>& x, const uint8_t* w, int64_t n, int64_t records, float* out) {
  const bool stream = static_cast<int64_t>(x.size()) * n * static_cast<int64_t>(sizeof(float)) >= kStreamBytes &&
                      reinterpret_cast<uintptr_t>(out) % 64 == 0;  // (rows start 64 n bytes apart)
  llmd_x16::for_each_tile<tile_rows(Q, P)>(x, w, n, records * record_bytes(Q), out,
                [n, stream](auto t, const uint8_t* wg, const QuantizedRow* xr, float* o) {
                  group_tile<Q, decltype(t)::value, P>(wg, xr, o, n, stream);
                }, stream);
}

template <int Q>
void mm_x16_passes(const std::vector<QuantizedRow>& x, int passes, const uint8_t* w, int64_t n, int64_t records,
                   float* out) {
  switch (passes) {
    case 1: mm_x16<Q, 1>(x, w, n, records, out); break;
    case 2: mm_x16<Q, 2>(x, w, n, records, out); break;
    default: mm_x16<Q, 3>(x, w, n, records, out); break;
  }
}
#endif

// x's row quantized, and the product, on `isa` (one this build has: isa_named checked).
void quantize_on(Isa isa, const float* x, int64_t cols, int passes, int8_t* codes, float* d, float* ds,
                 int32_t* sums) {
#if defined(LLMD_X16_AVX2)
  if (isa == Isa::kAvx2) return llmd_x16::quantize_row_avx2(x, cols, passes, codes, d, ds, sums);
#endif
#if defined(LLMD_X16_VNNI)
  if (isa == Isa::kAvx512Vnni) return quantize_row(x, cols, passes, codes, d, ds, sums);
#endif
  TORCH_CHECK(false, "gguf_mm_x16: this build has no ", isa_name(isa), " product");
}

void mm_on(Isa isa, int64_t quant, int passes, const std::vector<QuantizedRow>& x, const uint8_t* w, int64_t n,
           int64_t records, float* out) {
#if defined(LLMD_X16_AVX2)
  if (isa == Isa::kAvx2) return llmd_x16::mm_x16_avx2(quant, passes, x, w, n, records, out);
#endif
#if defined(LLMD_X16_VNNI)
  if (isa == Isa::kAvx512Vnni) {
    dispatch(quant, [&](auto q) { mm_x16_passes<decltype(q)::value>(x, passes, w, n, records, out); });
    return;
  }
#endif
  TORCH_CHECK(false, "gguf_mm_x16: this build has no ", isa_name(isa), " product");
}

// The product into `out` (float32 [M, N], contiguous; x float32), or a new tensor when
// `out` is undefined.
at::Tensor mm_x16_into(const at::Tensor& x, const at::Tensor& w, int64_t quant, int64_t cols, int64_t passes,
                       c10::string_view isa_choice, at::Tensor out) {
  const int64_t records = check_layout(w, quant, cols, "gguf_mm_x16");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.is_contiguous(), "gguf_mm_x16: contiguous x [M, cols] expected");
  TORCH_CHECK(passes >= 1 && passes <= 3, "gguf_mm_x16: passes 1, 2 or 3 expected, got ", passes);
  const Isa isa = isa_named(std::string(isa_choice), "gguf_mm_x16's isa");
  TORCH_CHECK(isa != Isa::kNone, "gguf_mm_x16: this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C",
              " (or the kernels are the portable build)");
  const int64_t rows = x.size(0), n = w.size(0), blocks = cols / kBlock;
  if (out.defined()) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                    out.dim() == 2 && out.size(0) == rows && out.size(1) == n,
                "gguf_mm_x16_into: float32 x and a contiguous float32 out [", rows, ", ", n, "] expected");
  } else {
    out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  }
  if (rows == 0) return out.to(x.scalar_type());
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  std::vector<int8_t> codes(rows * passes * cols);
  std::vector<float> scales(3 * rows * blocks);
  std::vector<int32_t> sums(rows * passes * 2 * blocks);
  std::vector<QuantizedRow> quantized(rows);
  const float* xp = xf.const_data_ptr<float>();
  const int p = static_cast<int>(passes);
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* q = codes.data() + r * passes * cols;
    float* d = scales.data() + 3 * r * blocks;
    int32_t* sum = sums.data() + r * passes * 2 * blocks;
    quantize_on(isa, xp + r * cols, cols, p, q, d, d + blocks, sum);
    quantized[r] = {q, d, d + blocks, sum, cols, blocks};
  }
  mm_on(isa, quant, p, quantized, w.const_data_ptr<uint8_t>(), n, records, out.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor gguf_mm_x16(const at::Tensor& x, const at::Tensor& w, int64_t quant, int64_t cols, int64_t passes,
                       c10::string_view isa) {
  return mm_x16_into(x, w, quant, cols, passes, isa, at::Tensor());
}

at::Tensor& gguf_mm_x16_into(const at::Tensor& x, const at::Tensor& w, int64_t quant, int64_t cols, int64_t passes,
                             c10::string_view isa, at::Tensor& out) {
  TORCH_CHECK(out.defined(), "gguf_mm_x16_into: an out tensor expected");
  mm_x16_into(x, w, quant, cols, passes, isa, out);
  return out;
}

at::Tensor gguf_dequantize_x16(const at::Tensor& w, int64_t quant, int64_t cols) {
  const int64_t blocks = check_layout(w, quant, cols, "gguf_dequantize_x16");
  const int64_t n = w.size(0);
  at::Tensor out = at::empty({n, cols}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  dispatch(quant, [&](auto q) {
    constexpr int Q = decltype(q)::value;
    at::parallel_for(0, n / kGroup, 4, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        dequantize_group<Q>(wp + g * blocks * record_bytes(Q), blocks, cols, op + g * kGroup * cols);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmd_cpu, m) {
  m.def("gguf_repack_x16(Tensor w, int quant, int cols) -> Tensor");
  m.def("gguf_repack_x16_(Tensor(a!) w, int quant, int cols) -> Tensor(a!)");
  m.def("gguf_unpack_x16(Tensor w, Tensor rows, int quant, int cols) -> Tensor");
  m.def("gguf_mm_x16(Tensor x, Tensor w, int quant, int cols, int passes=3, str isa=\"\") -> Tensor");
  m.def("gguf_mm_x16_into(Tensor x, Tensor w, int quant, int cols, int passes, str isa, Tensor(a!) out) -> Tensor(a!)");
  m.def("gguf_dequantize_x16(Tensor w, int quant, int cols) -> Tensor");
  m.def("gguf_x16_supported() -> bool");
  m.def("gguf_x16_isas() -> str[]");
}

TORCH_LIBRARY_IMPL(llmd_cpu, CPU, m) {
  m.impl("gguf_repack_x16", &gguf_repack_x16);
  m.impl("gguf_repack_x16_", &gguf_repack_x16_);
  m.impl("gguf_unpack_x16", &gguf_unpack_x16);
  m.impl("gguf_mm_x16", &gguf_mm_x16);
  m.impl("gguf_mm_x16_into", &gguf_mm_x16_into);
  m.impl("gguf_dequantize_x16", &gguf_dequantize_x16);
}

TORCH_LIBRARY_IMPL(llmd_cpu, CatchAll, m) {
  m.impl("gguf_x16_supported", &gguf_x16_supported);
  m.impl("gguf_x16_isas", &gguf_x16_isas);
}
