// llmd's fused layer ops for CPU, built with cpu_kernels.cpp into one extension
// (cpu_kernels.py). The CPU counterparts of fused_ops_triton: each replaces a chain of
// small torch operators, and at decode sizes a layer's chains cost more in per-operator
// overhead (~5-15 us each, ~30 a layer) than in arithmetic.
//
// Each computes what its reference in fused_ops.LayerOps computes, rounding where the
// reference rounds: the reference runs in the activations' dtype, so in bfloat16/float16
// every intermediate it materialises is rounded to that dtype here too (the float32
// path rounds nothing). Reductions are summed in float32 in another order than torch's,
// so float32 results agree to a few ulps, not bit for bit.
//
// rms_norm(x [T, N], w [N], eps, gemma) -> [T, N]
//   Llama: w * (x * rsqrt(mean(x^2) + eps)).to(dtype); gemma: (x * rsqrt(..) * (1 + w)).to(dtype).
// add_rms_norm_(x [T, N], residual [T, N], w, eps, gemma) -> [T, N]
//   x becomes x + residual (the new residual; x is the caller's fresh projection output),
//   returns its norm.
// act_and_mul(gate_up [T, 2I], act) -> [T, I]: act(gate) * up; act 0 silu, 1 gelu (erf),
//   2 gelu (tanh approximation).
// qk_rope_cache_(qkv [T, (H + 2 KVH) D], heads, kv_heads, cos [T, R], sin [T, R], kv_cache
//   [2, KVH, blocks, block_size, D], slot_mapping [T], q_norm_w, k_norm_w, eps, gemma):
//   in place, q and k of each token normed per head (when norm weights are given) and
//   rotated neox-style over their first R dimensions; then k and v written to the cache
//   at the token's slot (a negative slot is skipped). A quantized cache (uint8 holding
//   float8 e4m3fn bytes, or int8: kv_quant.py) stores k * k_inv_scale and v * v_inv_scale
//   (float32 products) rounded to its format, as kv_quant.quantize does.
// moe_route(x [T, N], router [E, N], top_k, renormalize) -> (weights float32 [T, top_k],
//   ids int64 [T, top_k]): fused_ops.select_experts(F.linear(x, router)) — the logits in
//   float32 rounded to x's dtype (F.linear's output), softmax over the E in float32, the
//   top_k largest (ties: the lower expert first), rescaled to sum to 1 if renormalize. A
//   MoE layer's router at decode was six torch operators (docs/benchmarks.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <c10/util/Optional.h>

#include "cpu_e4m3.h"
#include "cpu_vec.h"

#include <algorithm>

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using at::vec::Vectorized;
using llmd_cpu_vec::fVec;
using llmd_cpu_vec::kLanes;

template <typename T>
constexpr bool kFloat = std::is_same_v<T, float>;

// In place: buf rounded to T and back (what materialising it in the reference's dtype does).
template <typename T>
inline void round_row(float* buf, int64_t n, std::vector<T>& tmp) {
  if constexpr (!kFloat<T>) {
    tmp.resize(n);
    llmd_cpu_vec::narrow<T>(buf, tmp.data(), n);
    llmd_cpu_vec::widen<T>(tmp.data(), buf, n);
  }
}

inline float sum_of_squares(const float* x, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    fVec v = fVec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// Scratch of one thread: float rows and a T row for rounding.
template <typename T>
struct Scratch {
  std::vector<float> a, b;
  std::vector<T> t;
};

// In place on buf (a row as float32): RMSNorm with weight wf (as float32), the result
// rounded as the reference rounds it; out gets it in T.
template <typename T>
inline void norm_in_place(float* buf, const float* wf, int64_t n, float eps, bool gemma, std::vector<T>& tmp) {
  const float r = 1.f / std::sqrt(sum_of_squares(buf, n) / static_cast<float>(n) + eps);
  if (gemma) {
    for (int64_t i = 0; i < n; ++i) buf[i] = buf[i] * r * (1.f + wf[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] *= r;
    round_row<T>(buf, n, tmp);  // .to(dtype) before the weight
    for (int64_t i = 0; i < n; ++i) buf[i] *= wf[i];
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1), op,
              ": contiguous x [T, N] and weight [N] expected");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), op, ": x and weight differ in dtype");
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w, float eps, bool gemma,
               at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  std::vector<float> wf(n);
  llmd_cpu_vec::widen<T>(w.const_data_ptr<T>(), wf.data(), n);
  T* xp = residual ? x.data_ptr<T>() : nullptr;
  const T* xin = x.const_data_ptr<T>();
  const T* rp = residual ? residual->const_data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t begin, int64_t end) {
    Scratch<T> s;
    s.a.resize(n);
    s.b.resize(n);
    for (int64_t row = begin; row < end; ++row) {
      llmd_cpu_vec::widen<T>(xin + row * n, s.a.data(), n);
      if (rp) {  // x + residual, rounded to T: the new residual, and what is normed
        llmd_cpu_vec::widen<T>(rp + row * n, s.b.data(), n);
        for (int64_t i = 0; i < n; ++i) s.a[i] += s.b[i];
        llmd_cpu_vec::narrow<T>(s.a.data(), xp + row * n, n);
        round_row<T>(s.a.data(), n, s.t);
      }
      norm_in_place<T>(s.a.data(), wf.data(), n, eps, gemma, s.t);
      llmd_cpu_vec::narrow<T>(s.a.data(), op + row * n, n);
    }
  });
}

template <typename F>
void dispatch_float_types(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16 expected, got ", type);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
  check_rows(x, w, "rms_norm");
  auto out = at::empty_like(x);
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto tag) {
    norm_rows<decltype(tag)>(x, nullptr, w, static_cast<float>(eps), gemma, out);
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, double eps, bool gemma) {
  check_rows(x, w, "add_rms_norm_");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: residual must be contiguous, of x's shape and dtype");
  auto out = at::empty_like(x);
  dispatch_float_types(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    norm_rows<decltype(tag)>(x, &residual, w, static_cast<float>(eps), gemma, out);
  });
  return out;
}

// gelu's tanh approximation, 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3),
// in float32 taken as g / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh(u)) is the
// logistic of 2u): an exp in place of a tanh, silu's cost (Gemma 3 270M's 32 rows of 2,048
// on 2 Zen 4 threads: 58 -> 19 us), within 1e-5 of the float64 value where torch's
// 1 + tanh(u) cancels (percents off, then 0, as tanh(u) nears -1). `as_torch`: torch's own
// formula, for 16-bit types, whose rounding to the dtype then gives the reference's bits.
constexpr float kGeluU = 0.7978845608028654f, kGeluTwoU = 2.0f * kGeluU, kGeluTwoU3 = kGeluTwoU * 0.044715f;

// act(g) for a vector of gates: 0 silu, 1 gelu (erf), 2 gelu (tanh).
inline fVec activate(const fVec& g, int64_t act, bool as_torch) {
  if (act == 0) return g / (fVec(1.f) + g.neg().exp());
  if (act == 1) return g * fVec(0.5f) * (fVec(1.f) + (g * fVec(static_cast<float>(M_SQRT1_2))).erf());
  if (as_torch) return fVec(0.5f) * g * (fVec(1.f) + (fVec(kGeluU) * (g + fVec(0.044715f) * g * g * g)).tanh());
  return g / (fVec(1.f) + (g * (fVec(kGeluTwoU) + fVec(kGeluTwoU3) * g * g)).neg().exp());
}

inline float activate(float g, int64_t act, bool as_torch) {
  if (act == 0) return g / (1.f + std::exp(-g));
  if (act == 1) return g * 0.5f * (1.f + std::erf(g * static_cast<float>(M_SQRT1_2)));
  if (as_torch) return 0.5f * g * (1.f + std::tanh(kGeluU * (g + 0.044715f * g * g * g)));
  return g / (1.f + std::exp(-g * (kGeluTwoU + kGeluTwoU3 * g * g)));
}

// One row: out = act(g) * u, act(g) rounded to T first (the reference materialises it),
// a vector at a time straight from the inputs.
template <typename T>
inline void act_mul_row(const T* g, const T* u, T* out, int64_t n, int64_t act) {
  int64_t i = 0;
  if constexpr (kFloat<T>) {
    for (; i + kLanes <= n; i += kLanes) (activate(fVec::loadu(g + i), act, false) * fVec::loadu(u + i)).store(out + i);
  } else {
    using tVec = Vectorized<T>;
    for (; i + tVec::size() <= n; i += tVec::size()) {
      auto [g0, g1] = at::vec::convert_to_float<T>(tVec::loadu(g + i));
      auto [u0, u1] = at::vec::convert_to_float<T>(tVec::loadu(u + i));
      auto [a0, a1] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(activate(g0, act, true), activate(g1, act, true)));
      at::vec::convert_from_float<T>(a0 * u0, a1 * u1).store(out + i);
    }
  }
  for (; i < n; ++i) {
    const float a = static_cast<float>(static_cast<T>(activate(static_cast<float>(g[i]), act, !kFloat<T>)));
    out[i] = static_cast<T>(a * static_cast<float>(u[i]));
  }
}

template <typename T>
void act_rows(const at::Tensor& gate_up, int64_t act, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  const T* in = gate_up.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / inter), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      act_mul_row<T>(in + row * 2 * inter, in + row * 2 * inter + inter, op + row * inter, inter, act);
    }
  });
}

at::Tensor act_and_mul(const at::Tensor& gate_up, int64_t act) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "act_and_mul: contiguous gate_up [T, 2I] expected");
  TORCH_CHECK(act >= 0 && act <= 2, "act_and_mul: act must be 0 (silu), 1 (gelu) or 2 (gelu tanh)");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_float_types(gate_up.scalar_type(), "act_and_mul", [&](auto tag) {
    act_rows<decltype(tag)>(gate_up, act, out);
  });
  return out;
}

// One head's n values of T into a cache row of C: copied (C is T), rounded to the nearest
// 16-bit float (C float16 / bfloat16 for float32 T, as torch's conversion), or quantized
// with `inv` (kv_quant.quantize: the float32 product, to the nearest e4m3 or int8 in range).
template <typename T, typename C>
inline void store_row(const T* src, C* dst, int64_t n, float inv) {
  if constexpr (std::is_same_v<C, T>) {
    std::copy(src, src + n, dst);
  } else if constexpr (std::is_same_v<C, c10::Half> || std::is_same_v<C, c10::BFloat16>) {
    static_assert(std::is_same_v<T, float>);
    llmd_cpu_vec::narrow<C>(src, dst, n);
  } else if constexpr (std::is_same_v<C, uint8_t>) {
    for (int64_t i = 0; i < n; ++i) dst[i] = llmd_e4m3::encode(static_cast<float>(src[i]) * inv);
  } else {
    static_assert(std::is_same_v<C, int8_t>);
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(src[i]) * inv), -127.f, 127.f));
    }
  }
}

struct RopeShape {
  int64_t heads, kv_heads, dim, rot, slots;
};

// One head row in place: normed (when wf is given), then rotated over its first rot
// dimensions with the token's cos/sin (as T, rounded as the reference's x * cos +
// rotate_half(x) * sin in T).
template <typename T>
inline void rope_head(T* x, const float* wf, float eps, bool gemma, const float* cos, const float* sin,
                      const RopeShape& s, Scratch<T>& sc) {
  float* a = sc.a.data();
  float* b = sc.b.data();
  llmd_cpu_vec::widen<T>(x, a, s.dim);
  if (wf) {
    norm_in_place<T>(a, wf, s.dim, eps, gemma, sc.t);
    round_row<T>(a, s.dim, sc.t);
  }
  const int64_t half = s.rot / 2;
  for (int64_t i = 0; i < s.rot; ++i) b[i] = (i < half ? -a[i + half] : a[i - half]) * sin[i];
  for (int64_t i = 0; i < s.rot; ++i) a[i] *= cos[i];
  round_row<T>(a, s.rot, sc.t);
  round_row<T>(b, s.rot, sc.t);
  for (int64_t i = 0; i < s.rot; ++i) a[i] += b[i];
  llmd_cpu_vec::narrow<T>(a, x, s.dim);
}

template <typename T, typename C>
void rope_rows(at::Tensor& qkv, const RopeShape& s, const at::Tensor& cos, const at::Tensor& sin,
               at::Tensor& kv_cache, const at::Tensor& slots, const at::Tensor* qw, const at::Tensor* kw, float eps,
               bool gemma, float k_inv, float v_inv) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), d = s.dim;
  std::vector<float> qwf(qw ? d : 0), kwf(kw ? d : 0);
  if (qw) llmd_cpu_vec::widen<T>(qw->const_data_ptr<T>(), qwf.data(), d);
  if (kw) llmd_cpu_vec::widen<T>(kw->const_data_ptr<T>(), kwf.data(), d);
  T* base = qkv.data_ptr<T>();
  C* kc = static_cast<C*>(kv_cache.data_ptr());
  C* vc = kc + s.kv_heads * s.slots * d;
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / width), [&](int64_t begin, int64_t end) {
    Scratch<T> sc;
    sc.a.resize(d);
    sc.b.resize(d);
    std::vector<float> c(s.rot), sn(s.rot);
    for (int64_t row = begin; row < end; ++row) {
      llmd_cpu_vec::widen<T>(cp + row * s.rot, c.data(), s.rot);
      llmd_cpu_vec::widen<T>(sp + row * s.rot, sn.data(), s.rot);
      T* q = base + row * width;
      T* k = q + s.heads * d;
      const T* v = k + s.kv_heads * d;
      for (int64_t h = 0; h < s.heads; ++h) rope_head<T>(q + h * d, qw ? qwf.data() : nullptr, eps, gemma,
                                                          c.data(), sn.data(), s, sc);
      for (int64_t h = 0; h < s.kv_heads; ++h) rope_head<T>(k + h * d, kw ? kwf.data() : nullptr, eps, gemma,
                                                             c.data(), sn.data(), s, sc);
      if (slot[row] < 0) continue;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        store_row<T, C>(k + h * d, kc + (h * s.slots + slot[row]) * d, d, k_inv);
        store_row<T, C>(v + h * d, vc + (h * s.slots + slot[row]) * d, d, v_inv);
      }
    }
  });
}

void qk_rope_cache_(at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& kv_cache, const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& q_norm_w,
                    const c10::optional<at::Tensor>& k_norm_w, double eps, bool gemma, double k_inv_scale,
                    double v_inv_scale) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(1) == kv_heads &&
              kv_cache.is_contiguous(), "qk_rope_cache_: contiguous kv_cache [2, KVH, blocks, block_size, D] expected");
  const int64_t d = kv_cache.size(4), rows = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "qk_rope_cache_: contiguous qkv [T, (H + 2 KVH) D] expected");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == sin.numel() && cos.size(0) == rows &&
              cos.numel() % std::max<int64_t>(rows, 1) == 0, "qk_rope_cache_: contiguous cos, sin [T, R] expected");
  const int64_t rot = rows ? cos.numel() / rows : 0;
  TORCH_CHECK(rot <= d && rot % 2 == 0, "qk_rope_cache_: rotary width must be even and at most the head size");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == rows && slot_mapping.is_contiguous(),
              "qk_rope_cache_: int64 slot_mapping [T] expected");
  const auto type = qkv.scalar_type();
  const auto cache_type = kv_cache.scalar_type();
  const bool narrower = type == at::kFloat && (cache_type == at::kHalf || cache_type == at::kBFloat16);
  TORCH_CHECK(cos.scalar_type() == type && sin.scalar_type() == type &&
              (cache_type == type || cache_type == at::kByte || cache_type == at::kChar || narrower),
              "qk_rope_cache_: qkv, cos and sin differ in dtype, or the cache holds neither theirs, a quantized "
              "cache's uint8 (e4m3) or int8, nor float16 / bfloat16 for float32 qkv");
  TORCH_CHECK(cache_type != type || (k_inv_scale == 1.0 && v_inv_scale == 1.0),
              "qk_rope_cache_: scales are for a quantized cache (uint8, int8)");
  TORCH_CHECK(q_norm_w.has_value() == k_norm_w.has_value(), "qk_rope_cache_: q and k norms come together");
  for (const auto* w : {&q_norm_w, &k_norm_w}) {
    TORCH_CHECK(!w->has_value() || ((*w)->numel() == d && (*w)->is_contiguous() && (*w)->scalar_type() == type),
                "qk_rope_cache_: q/k norm weights [D] of qkv's dtype expected");
  }
  const RopeShape s{heads, kv_heads, d, rot, kv_cache.size(2) * kv_cache.size(3)};
  const at::Tensor* qw = q_norm_w ? &*q_norm_w : nullptr;
  const at::Tensor* kw = k_norm_w ? &*k_norm_w : nullptr;
  const float k_inv = static_cast<float>(k_inv_scale), v_inv = static_cast<float>(v_inv_scale);
  dispatch_float_types(type, "qk_rope_cache_", [&](auto tag) {
    using T = decltype(tag);
    if (cache_type == at::kByte) {
      rope_rows<T, uint8_t>(qkv, s, cos, sin, kv_cache, slot_mapping, qw, kw, static_cast<float>(eps), gemma, k_inv, v_inv);
    } else if (cache_type == at::kChar) {
      rope_rows<T, int8_t>(qkv, s, cos, sin, kv_cache, slot_mapping, qw, kw, static_cast<float>(eps), gemma, k_inv, v_inv);
    } else if constexpr (std::is_same_v<T, float>) {
      if (cache_type == at::kHalf) {
        rope_rows<T, c10::Half>(qkv, s, cos, sin, kv_cache, slot_mapping, qw, kw, static_cast<float>(eps), gemma, 1.f, 1.f);
      } else if (cache_type == at::kBFloat16) {
        rope_rows<T, c10::BFloat16>(qkv, s, cos, sin, kv_cache, slot_mapping, qw, kw, static_cast<float>(eps), gemma, 1.f,
                                    1.f);
      } else {
        rope_rows<T, T>(qkv, s, cos, sin, kv_cache, slot_mapping, qw, kw, static_cast<float>(eps), gemma, 1.f, 1.f);
      }
    } else {
      rope_rows<T, T>(qkv, s, cos, sin, kv_cache, slot_mapping, qw, kw, static_cast<float>(eps), gemma, 1.f, 1.f);
    }
  });
}

inline float dot_row(const float* a, const float* b, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc);
  float dot = llmd_cpu_vec::lane_sum(acc);
  for (; i < n; ++i) dot += a[i] * b[i];
  return dot;
}

// One row's probabilities p [E] (its logits, in float32, as they come in) -> its top_k.
template <typename T>
void route_row(float* p, int64_t experts, int64_t top_k, bool renormalize, std::vector<T>& tmp,
               std::vector<int64_t>& order, float* weights, int64_t* ids) {
  round_row<T>(p, experts, tmp);  // F.linear's logits are x's dtype
  const float top = *std::max_element(p, p + experts);
  float sum = 0.f;
  for (int64_t e = 0; e < experts; ++e) sum += (p[e] = std::exp(p[e] - top));
  for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
  order.resize(experts);
  for (int64_t e = 0; e < experts; ++e) order[e] = e;
  // larger first, ties by the lower expert; a NaN (a broken row's) first, as torch.topk puts it:
  // a strict weak order whatever the values, which std::partial_sort needs
  std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
    const bool na = std::isnan(p[a]), nb = std::isnan(p[b]);
    if (na != nb) return na;
    if (!na && p[a] != p[b]) return p[a] > p[b];
    return a < b;
  });
  float kept = 0.f;
  for (int64_t j = 0; j < top_k; ++j) kept += p[order[j]];
  for (int64_t j = 0; j < top_k; ++j) {
    ids[j] = order[j];
    weights[j] = renormalize ? p[order[j]] / kept : p[order[j]];
  }
}

template <typename T>
void route_rows(const at::Tensor& x, const at::Tensor& router, int64_t top_k, bool renormalize, float* weights,
                int64_t* ids) {
  const int64_t rows = x.size(0), n = x.size(1), experts = router.size(0);
  const T* xp = x.const_data_ptr<T>();
  const T* rp = router.const_data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const int64_t m = end - begin;
    std::vector<float> xf(m * n), wrow(kFloat<T> ? 0 : n), p(m * experts);
    std::vector<T> tmp;
    std::vector<int64_t> order;
    for (int64_t r = 0; r < m; ++r) llmd_cpu_vec::widen<T>(xp + (begin + r) * n, &xf[r * n], n);
    for (int64_t e = 0; e < experts; ++e) {  // an expert's row widened once for the chunk's rows
      const float* w;
      if constexpr (kFloat<T>) {
        w = rp + e * n;
      } else {
        llmd_cpu_vec::widen<T>(rp + e * n, wrow.data(), n);
        w = wrow.data();
      }
      for (int64_t r = 0; r < m; ++r) p[r * experts + e] = dot_row(&xf[r * n], w, n);
    }
    for (int64_t r = 0; r < m; ++r)
      route_row<T>(&p[r * experts], experts, top_k, renormalize, tmp, order, weights + (begin + r) * top_k,
                   ids + (begin + r) * top_k);
  });
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& router, int64_t top_k,
                                             bool renormalize) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && router.dim() == 2 && router.is_contiguous() &&
                  router.size(1) == x.size(1),
              "moe_route: contiguous x [T, N] and router [E, N] expected");
  TORCH_CHECK(x.scalar_type() == router.scalar_type(), "moe_route: x and router differ in dtype");
  TORCH_CHECK(top_k >= 1 && top_k <= router.size(0), "moe_route: top_k in 1..", router.size(0), " expected");
  at::Tensor weights = at::empty({x.size(0), top_k}, x.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({x.size(0), top_k}, x.options().dtype(at::kLong));
  dispatch_float_types(x.scalar_type(), "moe_route", [&](auto t) {
    route_rows<decltype(t)>(x, router, top_k, renormalize, weights.data_ptr<float>(), ids.data_ptr<int64_t>());
  });
  return {weights, ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmd_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool gemma) -> Tensor");
  m.def("moe_route(Tensor x, Tensor router, int top_k, bool renormalize) -> (Tensor, Tensor)");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor residual, Tensor w, float eps, bool gemma) -> Tensor");
  m.def("act_and_mul(Tensor gate_up, int act) -> Tensor");
  m.def("qk_rope_cache_(Tensor(a!) qkv, int heads, int kv_heads, Tensor cos, Tensor sin, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, Tensor? q_norm_w, Tensor? k_norm_w, float eps, bool gemma, float k_inv_scale=1.0, "
        "float v_inv_scale=1.0) -> ()");
}

TORCH_LIBRARY_IMPL(llmd_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("act_and_mul", &act_and_mul);
  m.impl("qk_rope_cache_", &qk_rope_cache_);
  m.impl("moe_route", &moe_route);
}
