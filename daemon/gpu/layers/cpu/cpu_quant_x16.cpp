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
// a record for the product: cpu_quant_x16_records.h (and _avx2.h); the VNNI product:
// cpu_quant_x16_vnni.h; what both products share: cpu_quant_x16_product.h.
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
// gguf_mm_x16_grouped(x, ws, starts, quant, cols, passes, isa, out, col0): rows [starts[j],
//   starts[j + 1]) of x times ws[j], for every j, into those rows of a float32 out at
//   column col0, in one parallel region (a MoE layer's experts at once). x of one row
//   where out has more: every job's rows are that row (one token's chosen experts: the
//   row quantized once, not once a job).
// gguf_x16_argmax_refine_(x, w, quant, cols, passes, isa, logits, norms, limit, tokens, cap) -> int:
//   rows of x whose logits (float32 [R, N]) the caller took at one pass over x, and that
//   need only their argmax over [0, limit) (a greedy LM head: greedy_head.GreedyHead):
//   each logit's distance from its `passes`-pass value is bounded (norms [N]: the
//   weight's rows' L2 norms), and the 16-row groups holding any logit that bound does not
//   rule out as the argmax are multiplied again at `passes` passes, in place — the same
//   bits the full product gives them, so the row's argmax is the full product's: into
//   tokens (int64 [R]; the first of equal maxima, as numpy's argmax). Returns the groups
//   multiplied again. With `cap` > 0 the caller soft-caps the logits after (Gemma 2:
//   cap tanh(z / cap) in float32, which can round two logits to one value): a group is
//   ruled out only where its capped values lie below the best's however each is rounded
//   (soft_capped_bar), and tokens are then the uncapped argmax (the caller's argmax of the
//   capped logits is the full product's).
// gguf_x16_row_norms(w, quant, cols) -> float32 [N]: each row's L2 norm, rounded up.
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
#include "cpu_quant_x16_vnni.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using llmd_quant::dispatch;
using llmd_quant::Format;
using llmd_x16::kGroup;
using llmd_x16::kLayouts;
using llmd_x16::kBlock;
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
using llmd_x16::mm_x16_passes;
using llmd_x16::quantize_row;
#endif

// x's row quantized, and the product, on `isa` (one this build has: isa_named checked).
void quantize_on(Isa isa, const float* x, int64_t cols, int passes, int64_t span, int8_t* codes, float* d, float* ds,
                 int32_t* sums) {
#if defined(LLMD_X16_AVX2)
  if (isa == Isa::kAvx2) return llmd_x16::quantize_row_avx2(x, cols, passes, span, codes, d, ds, sums);
#endif
#if defined(LLMD_X16_VNNI)
  if (isa == Isa::kAvx512Vnni) return quantize_row(x, cols, passes, span, codes, d, ds, sums);
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

// QuantizedRow::offsets from a row's `sums` ([pairs] of them: passes times blocks) for
// the VNNI product of type `quant`.
inline void code_offsets(int64_t quant, const int32_t* sums, int64_t pairs, int32_t* out) {
#if defined(LLMD_X16_VNNI)
  dispatch(quant, [&](auto q) {
    using R = llmd_x16::X16Record<decltype(q)::value>;
    for (int64_t i = 0; i < pairs; ++i) {
      const int32_t a = sums[2 * i], b = sums[2 * i + 1];
      out[2 * i] = R::kHalves ? -R::kOffset * a : -R::kOffset * (a + b);
      out[2 * i + 1] = R::kHalves ? -R::kOffset * b : 0;
    }
  });
#else
  (void)quant, (void)sums, (void)pairs, (void)out;
#endif
}

// Rows of x a thread quantizes at least (fewer: one thread; a decode step's 32 rows split).
constexpr int64_t kQuantizeGrain = 8;

// x's rows quantized for the product: the codes, scales and sums they point into.
struct QuantizedX {
  std::vector<int8_t> codes;
  std::vector<float> scales, pass_scales;
  std::vector<int32_t> sums, pairs, offsets;
  std::vector<QuantizedRow> rows;

  QuantizedX(Isa isa, const float* x, int64_t count, int64_t cols, int64_t quant, int p)
      : codes(count * p * cols), scales(3 * count * (cols / kBlock)), sums(count * p * 2 * (cols / kBlock)),
        rows(count) {
    const int64_t blocks = cols / kBlock;
    const bool super = llmd_x16::super_blocks(static_cast<int>(quant), p);  // (K-quants: blocks a multiple of 8)
    pairs.resize(super ? count * blocks / 2 : 0);
    const bool vnni = isa == Isa::kAvx512Vnni;  // (QuantizedRow's dp, ds01, offsets: only its product reads them)
    pass_scales.resize(vnni && !super ? count * (p + 1) * blocks : 0);
    offsets.resize(vnni ? count * p * 2 * blocks : 0);
    // the rows split between the threads (each row's codes its own): 32 rows of 640 columns
    // at two passes took ~20 us on one thread, a Gemma 3 270M decode step ~3 ms in all
    at::parallel_for(0, count, kQuantizeGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        int8_t* q = codes.data() + r * p * cols;
        float* d = scales.data() + 3 * r * blocks;
        int32_t* sum = sums.data() + r * p * 2 * blocks;
        quantize_on(isa, x + r * cols, cols, p, super ? llmd_x16::kSuperBlock : 1, q, d, d + blocks, sum);
        rows[r] = {q, d, d + blocks, sum, cols, blocks};
        if (!pass_scales.empty()) {  // QuantizedRow::dp, ds01
          float* dp = pass_scales.data() + r * (p + 1) * blocks;
          for (int pass = 0; pass < p; ++pass)
            for (int64_t b = 0; b < blocks; ++b) dp[pass * blocks + b] = d[b] * llmd_x16::kPassScale[pass];
          for (int64_t b = 0; b < blocks; ++b) dp[p * blocks + b] = d[blocks + 2 * b] + d[blocks + 2 * b + 1];
          rows[r].dp = dp;
          rows[r].ds01 = dp + p * blocks;
        }
        if (!offsets.empty()) {
          rows[r].offsets = offsets.data() + r * p * 2 * blocks;
          code_offsets(quant, sum, p * blocks, offsets.data() + r * p * 2 * blocks);
        }
        if (super) {  // each two blocks' code sums as int16 pairs (within +-32 * 128)
          int32_t* pair = pairs.data() + r * blocks / 2;
          for (int64_t i = 0; i < blocks / 2; ++i) {
            const int32_t even = sum[4 * i] + sum[4 * i + 1], odd = sum[4 * i + 2] + sum[4 * i + 3];
            pair[i] = static_cast<int32_t>((static_cast<uint32_t>(even) & 0xFFFFu) | (static_cast<uint32_t>(odd) << 16));
          }
          rows[r].pairs = pair;
        }
      }
    });
  }
};

Isa checked_isa(c10::string_view isa_choice, int64_t passes, const char* op) {
  TORCH_CHECK(passes >= 1 && passes <= 3, op, ": passes 1, 2 or 3 expected, got ", passes);
  const Isa isa = isa_named(std::string(isa_choice), "gguf_mm_x16's isa");
  TORCH_CHECK(isa != Isa::kNone, op, ": this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C",
              " (or the kernels are the portable build)");
  return isa;
}

// The product into `out` (float32 [M, N], contiguous; x float32), or a new tensor when
// `out` is undefined.
at::Tensor mm_x16_into(const at::Tensor& x, const at::Tensor& w, int64_t quant, int64_t cols, int64_t passes,
                       c10::string_view isa_choice, at::Tensor out) {
  const int64_t records = check_layout(w, quant, cols, "gguf_mm_x16");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.is_contiguous(), "gguf_mm_x16: contiguous x [M, cols] expected");
  const Isa isa = checked_isa(isa_choice, passes, "gguf_mm_x16");
  const int64_t rows = x.size(0), n = w.size(0);
  if (out.defined()) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                    out.dim() == 2 && out.size(0) == rows && out.size(1) == n,
                "gguf_mm_x16_into: float32 x and a contiguous float32 out [", rows, ", ", n, "] expected");
  } else {
    out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  }
  if (rows == 0) return out.to(x.scalar_type());
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const int p = static_cast<int>(passes);
  const QuantizedX quantized(isa, xf.const_data_ptr<float>(), rows, cols, quant, p);
  mm_on(isa, quant, p, quantized.rows, w.const_data_ptr<uint8_t>(), n, records, out.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// Weight bytes' worth of one 16-row group, in rows of x: what a group costs beside its
// rows' dot products when the grouped product shares the work out (a 1,024 x 1,024 Q4_K
// expert on Zen 4: ~26 us to stream its weight, ~2.6 us more a row of x).
constexpr int64_t kGroupCost = 10;

// Jobs j = 0..J-1: rows [starts[j], starts[j + 1]) of x times ws[j] (each an x16 weight of
// `quant` with `cols` columns) into those rows of out (float32 [R, ld]), columns [col0,
// col0 + N_j). One parallel region for them all, the threads splitting the jobs' 16-row
// groups by cost (kGroupCost + rows), x quantized once: a MoE layer's experts in one call
// (cpu_decode_layers' MoeExperts), each row's product the one gguf_mm_x16 gives it. x of
// one row where out has R > 1: every row of every job is x's row (DecoderLayers' batch-1
// experts).
void gguf_mm_x16_grouped(const at::Tensor& x, at::TensorList ws, at::IntArrayRef starts, int64_t quant, int64_t cols,
                         int64_t passes, c10::string_view isa_choice, at::Tensor& out, int64_t col0) {
  const char* op = "gguf_mm_x16_grouped";
  const int64_t jobs = static_cast<int64_t>(ws.size());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.is_contiguous(), op, ": contiguous x [R, cols] expected");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous() &&
                  (out.size(0) == x.size(0) || x.size(0) == 1),
              op, ": a contiguous float32 out [R, ld] expected, R x's rows (or x one row)");
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == jobs + 1 && starts[0] >= 0 && starts[jobs] <= out.size(0), op,
              ": starts must hold one more entry than ws, within out's rows");
  const bool shared = x.size(0) == 1 && out.size(0) > 1;  // every job's rows are x's one row
  const Isa isa = checked_isa(isa_choice, passes, op);
  std::vector<int64_t> records(jobs), first_cost(jobs + 1, 0);
  for (int64_t j = 0; j < jobs; ++j) {
    records[j] = check_layout(ws[j], quant, cols, op);
    const int64_t rows = starts[j + 1] - starts[j];
    TORCH_CHECK(rows >= 0 && col0 >= 0 && col0 + ws[j].size(0) <= out.size(1), op, ": job ", j,
                " has rows or columns outside out");
    first_cost[j + 1] = first_cost[j] + (rows > 0 ? ws[j].size(0) / kGroup * (kGroupCost + rows) : 0);
  }
  if (first_cost[jobs] == 0) return;
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const int p = static_cast<int>(passes);
  const QuantizedX quantized(isa, xf.const_data_ptr<float>(), x.size(0), cols, quant, p);
  const int64_t shares = std::max<int64_t>(1, at::get_num_threads()), total = first_cost[jobs], ld = out.size(1);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    const int64_t c0 = total * s0 / shares, c1 = total * s1 / shares;  // this thread's cost range
    std::vector<float> tmp;
    for (int64_t j = 0; j < jobs; ++j) {
      const int64_t rows = starts[j + 1] - starts[j], per_group = kGroupCost + rows;
      if (rows == 0 || first_cost[j + 1] <= c0 || first_cost[j] >= c1) continue;
      // the groups whose cost starts in [c0, c1): each group goes to exactly one thread
      const int64_t g0 = std::max<int64_t>(0, (c0 - first_cost[j] + per_group - 1) / per_group);
      const int64_t g1 = std::min(ws[j].size(0) / kGroup, (c1 - first_cost[j] + per_group - 1) / per_group);
      if (g0 >= g1) continue;
      const int64_t n = (g1 - g0) * kGroup;
      const std::vector<QuantizedRow> xr =
          shared ? std::vector<QuantizedRow>(rows, quantized.rows[0])
                 : std::vector<QuantizedRow>(quantized.rows.begin() + starts[j], quantized.rows.begin() + starts[j + 1]);
      tmp.resize(rows * n);
      // in this parallel region the product's own parallel_for runs on this thread alone
      mm_on(isa, quant, p, xr, ws[j].const_data_ptr<uint8_t>() + g0 * kGroup * ws[j].size(1), n, records[j],
            tmp.data());
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(o + (starts[j] + r) * ld + col0 + g0 * kGroup, tmp.data() + r * n, n * sizeof(float));
      }
    }
  });
}

// How far a logit taken at one pass over x may lie from its value at `fine`'s passes,
// per unit of its weight row's L2 norm: ||x_fine - x_one||_2 (Cauchy-Schwarz: |w . (x_fine
// - x_one)| <= ||w|| ||x_fine - x_one||, the two x's as their codes and scales give them),
// plus 1e-3 ||x_fine|| for the float32 roundings of both products (each at most ~(blocks +
// 16) * 2^-24 of the sum of its terms' magnitudes, ~1e-5 of ||w|| ||x|| at 8,192 columns).
// Infinite where x is not finite (the whole row is then multiplied again: a NaN is read as
// a code, and the AVX2 product reads Q8_0's code -128 as +128 against negative weights).
double refine_reach(const float* x, const QuantizedRow& fine, int passes, const QuantizedRow& one, bool super) {
  double diff = 0.0, size = 0.0;
  for (int64_t j = 0; j < fine.cols; ++j) {
    if (!std::isfinite(x[j])) return std::numeric_limits<double>::infinity();
    const int64_t b = j / kBlock;
    double xf = 0.0;
    for (int p = 0; p < passes; ++p) {
      xf += static_cast<double>(fine.codes[p * fine.cols + j]) * static_cast<double>(fine.d[b] * llmd_x16::kPassScale[p]);
    }
    const double x1 = static_cast<double>(one.codes[j]) * static_cast<double>(one.d[super ? b / llmd_x16::kSuperBlock : b]);
    diff += (xf - x1) * (xf - x1);
    size += xf * xf;
  }
  return (std::sqrt(diff) + 1e-3 * std::sqrt(size)) * (1.0 + 1e-6);
}

#if defined(LLMD_X16_VNNI)
// refine_scan's loop over whole 16-logit groups (AVX-512).
LLMD_X16_TARGET float scan_avx512(const float* l, const float* norms, float reach, int64_t groups, float* peak,
                                  bool& nan) {
  const __m512 r = _mm512_set1_ps(reach);
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 unordered = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 v = _mm512_loadu_ps(l + g * kGroup), n = _mm512_loadu_ps(norms + g * kGroup);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, _mm512_fnmadd_ps(n, r, v));
    peak[g] = _mm512_reduce_max_ps(_mm512_fmadd_ps(n, r, v));
  }
  nan = unordered != 0;
  return _mm512_reduce_max_ps(m);
}
#endif

// One pass over a row's logits l[0, limit): returns its floor, the largest l[i] - norms[i] *
// reach (no logit's refined value lies below it: the row's argmax refined is at least
// that), or NaN where a logit is NaN; and peak[g], group g's largest l[i] + norms[i] *
// reach (above any of its refined values): group g may hold the argmax only if its peak
// reaches the floor. (One pass over the logits and norms, not one for the floor and one
// for the groups: 2.2 -> 1.3 ms for Gemma 3's 32 rows of 262,144, Zen 4, 2 threads.)
float refine_scan(const float* l, const float* norms, float reach, int64_t limit, Isa isa, float* peak) {
  int64_t g = 0;
  float floor = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(LLMD_X16_VNNI)
  if (isa == Isa::kAvx512Vnni) {
    g = limit / kGroup;
    floor = scan_avx512(l, norms, reach, g, peak, nan);
  }
#endif
  for (; g * kGroup < limit; ++g) {
    peak[g] = -std::numeric_limits<float>::infinity();
    for (int64_t i = g * kGroup; i < std::min(limit, (g + 1) * kGroup); ++i) {
      nan = nan || std::isnan(l[i]);
      floor = std::max(floor, l[i] - norms[i] * reach);
      peak[g] = std::max(peak[g], l[i] + norms[i] * reach);
    }
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : floor;
}

// Under a final soft-cap c(z) = cap tanh(z / cap): the bar below which a logit's capped
// value, rounded in float32 (a division, a tanh within 1 ulp, a product: ~3 ulps of cap),
// lies below the capped value, rounded alike, of any logit at or above `floor` (the refined
// best is). c is increasing, so a bar of c^-1(c(floor) - 2 slack), each slack 8 ulps of cap
// or more, rounded down, will do; -inf where there is none (nothing ruled out).
float soft_capped_bar(float floor, double cap) {
  const double slack = 16.0 * cap * std::ldexp(1.0, -24);
  const double t = std::tanh(static_cast<double>(floor) / cap) - 2.0 * slack / cap;
  const float inf = std::numeric_limits<float>::infinity();
  if (!(t > -1.0)) return -inf;
  return std::nextafter(static_cast<float>(cap * std::atanh(t)), -inf);
}

// The first index of a row's largest value over [0, limit), a NaN counting as the largest
// (numpy's and torch's argmax).
int64_t first_argmax(const float* l, int64_t limit) {
  int64_t best = 0;
  for (int64_t i = 0; i < limit; ++i) {
    if (std::isnan(l[i])) return i;
    if (l[i] > l[best]) best = i;
  }
  return best;
}

int64_t gguf_x16_argmax_refine_(const at::Tensor& x, const at::Tensor& w, int64_t quant, int64_t cols, int64_t passes,
                                c10::string_view isa_choice, at::Tensor& logits, const at::Tensor& norms,
                                int64_t limit, at::Tensor& tokens, double cap) {
  const char* op = "gguf_x16_argmax_refine_";
  const int64_t records = check_layout(w, quant, cols, op);
  const int64_t rows = x.size(0), n = w.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == cols && x.is_contiguous(), op,
              ": contiguous float32 x [R, cols] expected");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.size(0) == rows && logits.size(1) == n,
              op, ": contiguous float32 logits [", rows, ", ", n, "] expected");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.dim() == 1 && norms.is_contiguous() && norms.size(0) == n, op,
              ": contiguous float32 norms [", n, "] expected");
  TORCH_CHECK(limit > 0 && limit <= n, op, ": limit must be in [1, ", n, "], got ", limit);
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.is_contiguous() &&
                  tokens.size(0) == rows,
              op, ": contiguous int64 tokens [", rows, "] expected");
  TORCH_CHECK(passes >= 2, op, ": the refined logits take 2 or 3 passes, got ", passes);
  TORCH_CHECK(cap >= 0.0 && std::isfinite(cap), op, ": cap must be finite and >= 0 (0: none), got ", cap);
  const Isa isa = checked_isa(isa_choice, passes, op);
  if (rows == 0) return 0;
  const int p = static_cast<int>(passes);
  const float* xp = x.const_data_ptr<float>();
  const QuantizedX fine(isa, xp, rows, cols, quant, p), one(isa, xp, rows, cols, quant, 1);
  const bool super = llmd_x16::super_blocks(static_cast<int>(quant), 1);
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  const float* np = norms.const_data_ptr<float>();
  float* lp = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  const int64_t group_bytes = kGroup * w.size(1), groups = (limit + kGroup - 1) / kGroup;
  std::vector<int64_t> refined(rows, 0);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> peak(groups);
    for (int64_t r = r0; r < r1; ++r) {
      const std::vector<QuantizedRow> xr(1, fine.rows[r]);
      float* l = lp + r * n;
      const float reach = static_cast<float>(refine_reach(xp + r * cols, fine.rows[r], p, one.rows[r], super));
      const float floor = std::isfinite(reach) ? refine_scan(l, np, reach, limit, isa, peak.data()) : NAN;
      const bool whole = !std::isfinite(floor);  // NaN or inf: the whole row again
      const float bar = cap > 0.0 && !whole ? soft_capped_bar(floor, cap) : floor;
      int64_t best = -1;  // the first largest refined logit (the others lie below the floor)
      for (int64_t g = 0; g < groups;) {
        if (!whole && !(peak[g] >= bar)) {
          ++g;
          continue;
        }
        int64_t g1 = g + 1;  // a run of groups in one call
        while (g1 < groups && (whole || peak[g1] >= bar)) ++g1;
        // in this parallel region the product's own parallel_for runs on this thread alone
        mm_on(isa, quant, p, xr, wp + g * group_bytes, (g1 - g) * kGroup, records, l + g * kGroup);
        for (int64_t i = g * kGroup; i < std::min(limit, g1 * kGroup); ++i) {
          if (best < 0 || l[i] > l[best]) best = i;
        }
        refined[r] += g1 - g;
        g = g1;
      }
      tp[r] = whole ? first_argmax(l, limit) : best;
    }
  });
  int64_t total = 0;
  for (int64_t count : refined) total += count;
  return total;
}

at::Tensor gguf_mm_x16(const at::Tensor& x, const at::Tensor& w, int64_t quant, int64_t cols, int64_t passes,
                       c10::string_view isa) {
  return mm_x16_into(x, w, quant, cols, passes, isa, at::Tensor());
}

at::Tensor& gguf_mm_x16_into(const at::Tensor& x, const at::Tensor& w, int64_t quant, int64_t cols, int64_t passes,
                             c10::string_view isa, at::Tensor& out) {
  mm_x16_into(x, w, quant, cols, passes, isa, out);
  return out;
}

// Each row's L2 norm: its dequantized values (as gguf_dequantize_x16's) squared and summed
// in float64, rounded up to a float32 (so never below the norm: gguf_x16_argmax_refine_'s
// bound), 16 rows at a time in a scratch of the thread's (no allocation a row).
at::Tensor gguf_x16_row_norms(const at::Tensor& w, int64_t quant, int64_t cols) {
  const int64_t blocks = check_layout(w, quant, cols, "gguf_x16_row_norms");
  const int64_t n = w.size(0);
  at::Tensor out = at::empty({n}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  dispatch(quant, [&](auto q) {
    constexpr int Q = decltype(q)::value;
    at::parallel_for(0, n / kGroup, 16, [&](int64_t g0, int64_t g1) {
      std::vector<float> rows(kGroup * cols);
      for (int64_t g = g0; g < g1; ++g) {
        dequantize_group<Q>(wp + g * blocks * record_bytes(Q), blocks, cols, rows.data());
        for (int64_t lane = 0; lane < kGroup; ++lane) {
          double sum = 0.0;
          for (int64_t j = 0; j < cols; ++j) sum += static_cast<double>(rows[lane * cols + j]) * rows[lane * cols + j];
          op[g * kGroup + lane] = std::nextafter(static_cast<float>(std::sqrt(sum)), std::numeric_limits<float>::infinity());
        }
      }
    });
  });
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
  m.def("gguf_mm_x16_grouped(Tensor x, Tensor[] ws, int[] starts, int quant, int cols, int passes, str isa, "
        "Tensor(a!) out, int col0) -> ()");
  m.def("gguf_x16_argmax_refine_(Tensor x, Tensor w, int quant, int cols, int passes, str isa, Tensor(a!) logits, "
        "Tensor norms, int limit, Tensor(b!) tokens, float cap=0.0) -> int");
  m.def("gguf_dequantize_x16(Tensor w, int quant, int cols) -> Tensor");
  m.def("gguf_x16_row_norms(Tensor w, int quant, int cols) -> Tensor");
  m.def("gguf_x16_supported() -> bool");
  m.def("gguf_x16_isas() -> str[]");
}

TORCH_LIBRARY_IMPL(llmd_cpu, CPU, m) {
  m.impl("gguf_repack_x16", &gguf_repack_x16);
  m.impl("gguf_repack_x16_", &gguf_repack_x16_);
  m.impl("gguf_unpack_x16", &gguf_unpack_x16);
  m.impl("gguf_mm_x16", &gguf_mm_x16);
  m.impl("gguf_mm_x16_into", &gguf_mm_x16_into);
  m.impl("gguf_mm_x16_grouped", &gguf_mm_x16_grouped);
  m.impl("gguf_x16_argmax_refine_", &gguf_x16_argmax_refine_);
  m.impl("gguf_dequantize_x16", &gguf_dequantize_x16);
  m.impl("gguf_x16_row_norms", &gguf_x16_row_norms);
}

TORCH_LIBRARY_IMPL(llmd_cpu, CatchAll, m) {
  m.impl("gguf_x16_supported", &gguf_x16_supported);
  m.impl("gguf_x16_isas", &gguf_x16_isas);
}
