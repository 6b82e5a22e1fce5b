// A decoder's layers for a decode step (one token of each of B requests), run from C++:
// the same operators the Python layers call at that step (cpu_fused_ops.cpp's norms,
// rotary + cache write and activation, cpu_kernels.cpp's paged_decode, cpu_quant_x16.cpp's
// packed products), in the same order on the same tensors, with nothing between them. At
// batch 1 a small model's step is ~10 operators a layer of a few to a hundred microseconds
// each, and the Python that chains them (module calls, checks, views, slicing) cost as
// much again (docs/benchmarks.md, "batch-1 decode"); here a layer costs its operators and
// a dispatcher call each (~1 us). At 32 rows the Python cost about the same time (Gemma 3
// 270M: ~3 ms of a ~50 ms step).
//
// cpu_decode_layers.py builds a DecoderLayers once the model is loaded (only from layers it
// can run: every projection packed in the x16 layout or a dense weight in oneDNN's, the
// fused CPU ops, the paged decode kernel) and the model's forward hands it the steps it
// takes: decode rows alone, as many as every projection's x16 product takes (with a
// mixture of experts, as many as its MoeExperts take: every (row, expert) pair within the
// x16 product's rows) and a gated MLP multiplies at once.
//
// Layer i, as models/decoder.py's DecoderLayer (residual undefined before layer 0):
//   h = residual undefined ? (residual = hidden, norm(hidden)) : add_norm(hidden, residual)
//   qkv = h W_qkv^T (+ b): q/k normed per head (when given), rotated, k/v written to the cache
//   a = paged_decode(q) W_o^T (+ b)
//   Llama: h, residual = add_norm(a, residual); hidden = mlp(h) (Granite: a and mlp(h)
//          times its residual scale first)
//   sandwich (Gemma): h, residual = add_norm(post_attention_norm(a), residual);
//                     hidden = post_feedforward_norm(mlp(h))
//   mlp(h) = act(gate) * up of h W_gate_up^T (+ b), times W_down^T (+ b)
//   or a mixture of experts (mlp.SparseMoeBlock with packed experts): probs =
//   softmax(router(h)) in float32, the top_k (renormalised or not; a dense router's
//   through cpu_fused_ops.cpp's moe_route, as the Python layers' CpuFusedLayerOps.route);
//   each row's chosen experts' mlp(h), in the top-k order, cast to h's dtype and scaled by
//   its weight, summed over the k (MoeExperts below; one row as fused_moe.moe_reference
//   does it, the same result); Qwen2-MoE adds sigmoid(shared_gate(h)) * shared mlp(h).
//   A router or shared gate is an x16 projection or a dense weight (at::linear, as
//   F.linear: cpu_linear leaves such layers unpacked).
// forward returns (hidden, residual) after the last layer; the final norm is the model's.
//
// MoeExperts: a MoE layer's packed experts for any number of rows (a prefill's, a batch's),
// fused_moe.moe_reference's packed branch in C++ — the (row, expert) pairs sorted by expert
// (stable), each expert that got rows running its products over them, the rows scaled by
// their routing weights and summed back per row — the same products of each row, so its
// output is the Python loop's bit for bit, without the Python per expert; every expert's
// gate/up part in one gguf_mm_x16_grouped call (one parallel region, the threads streaming
// from one expert's weight into the next), act * up once over all the rows, then down
// alike. Every expert's rows must be few enough for the x16 product (mlp.SparseMoeBlock
// checks).

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros_like.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

// The operators a layer calls, found once (all registered by this library's other files).
using MmX16 = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, c10::string_view);
using MmX16Grouped = void(const at::Tensor&, at::TensorList, at::IntArrayRef, int64_t, int64_t, int64_t,
                          c10::string_view, at::Tensor&, int64_t);
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double, bool);
using AddRmsNorm = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool);
using ActAndMul = at::Tensor(const at::Tensor&, int64_t);
using QkRopeCache = void(at::Tensor&, int64_t, int64_t, const at::Tensor&, const at::Tensor&, at::Tensor&,
                         const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                         double, bool, double, double);
using PagedDecode = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                               double, int64_t, double, double);
using MoeRoute = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t, bool);
// The cache these layers write and read holds floats (DecodeLayers.takes declines a
// quantized one): the K/V scales of the two operators stay 1.
constexpr double kUnitScale = 1.0;
constexpr c10::string_view kChosenIsa = "";  // gguf_mm_x16's own choice (LLMD_GGUF_X16_ISA or the best)

template <typename F>
c10::TypedOperatorHandle<F> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

struct Ops {
  c10::TypedOperatorHandle<MmX16> mm_x16 = find_op<MmX16>("llmd_cpu::gguf_mm_x16");
  c10::TypedOperatorHandle<MmX16Grouped> mm_x16_grouped = find_op<MmX16Grouped>("llmd_cpu::gguf_mm_x16_grouped");
  c10::TypedOperatorHandle<RmsNorm> rms_norm = find_op<RmsNorm>("llmd_cpu::rms_norm");
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm = find_op<AddRmsNorm>("llmd_cpu::add_rms_norm_");
  c10::TypedOperatorHandle<ActAndMul> act_and_mul = find_op<ActAndMul>("llmd_cpu::act_and_mul");
  c10::TypedOperatorHandle<QkRopeCache> qk_rope_cache = find_op<QkRopeCache>("llmd_cpu::qk_rope_cache_");
  c10::TypedOperatorHandle<PagedDecode> paged_decode = find_op<PagedDecode>("llmd_cpu::paged_decode");
  c10::TypedOperatorHandle<MoeRoute> moe_route = find_op<MoeRoute>("llmd_cpu::moe_route");

  static const Ops& get() {
    static const Ops ops;
    return ops;
  }
};

// Rows [start, end) of a packed projection, in one type, in the x16 layout (gguf_quant's
// PackedPart after use_x16): multiplied in `passes` int8 passes over x.
struct Part {
  at::Tensor weight;
  int64_t quant, cols, passes;
};

// oneDNN's linear (torch.ops.mkldnn._linear_pointwise), as cpu_linear.PackedLinearForward
// calls it for a dense layer on one rank: x contiguous, the weight in oneDNN's blocked
// layout, the bias added by oneDNN. Found at the first such call (a torch built without
// oneDNN has no such layer: cpu_linear packs none).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                     c10::string_view, c10::List<std::optional<at::Scalar>>,
                                     std::optional<c10::string_view>);
  static const auto op = find_op<LinearPointwise>("mkldnn::_linear_pointwise");
  return op.call(x.contiguous(), weight, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// A projection: its parts' outputs side by side, then the bias if any; or a dense weight
// in oneDNN's layout (`onednn`), its bias given to oneDNN.
struct Projection {
  std::vector<Part> parts;
  std::optional<at::Tensor> bias, onednn;

  at::Tensor operator()(const Ops& ops, const at::Tensor& x) const {
    if (onednn) return onednn_linear(x, *onednn, bias);
    TORCH_CHECK(!parts.empty(), "DecoderLayers: a projection without parts");
    at::Tensor out;
    if (parts.size() == 1) {
      out = ops.mm_x16.call(x, parts[0].weight, parts[0].quant, parts[0].cols, parts[0].passes, kChosenIsa);
    } else {
      std::vector<at::Tensor> outs;
      outs.reserve(parts.size());
      for (const Part& p : parts) outs.push_back(ops.mm_x16.call(x, p.weight, p.quant, p.cols, p.passes, kChosenIsa));
      out = at::cat(outs, -1);
    }
    return bias ? at::add(out, *bias) : out;
  }
};

// What add_part takes: packed rows in the x16 layout and 1..3 passes over x.
void check_part(const char* method, const at::Tensor& weight, int64_t passes) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(), method,
              ": packed rows (contiguous uint8 [N, row bytes]) expected");
  TORCH_CHECK(passes >= 1 && passes <= 3, method, ": passes 1..3 expected, got ", passes);
}

// A linear that is either an x16 projection or a dense weight (F.linear's at::linear).
struct Linear {
  Projection packed;
  std::optional<at::Tensor> dense;

  at::Tensor operator()(const Ops& ops, const at::Tensor& x) const {
    return dense ? at::linear(x, *dense, packed.bias) : packed(ops, x);
  }
};

// Rows [starts[i], starts[i + 1]) of x times the projection of expert used[i], for every
// i, each part in one gguf_mm_x16_grouped call over all of them (the parts side by side:
// a Projection's cat), in x's dtype: each row what the expert's own product gives it. x of
// one row: every job's rows are that row (gguf_mm_x16_grouped quantizes it once).
at::Tensor experts_product(const Ops& ops, const std::vector<Projection>& projections,
                           const std::vector<int64_t>& used, const std::vector<int64_t>& starts, const at::Tensor& x) {
  const std::vector<Part>& first = projections[used[0]].parts;
  int64_t width = 0;
  for (const Part& p : first) width += p.weight.size(0);
  at::Tensor out = at::empty({starts.back(), width}, x.options().dtype(at::kFloat));
  const at::Tensor xc = x.contiguous();
  int64_t col0 = 0;
  for (size_t i = 0; i < first.size(); ++i) {
    std::vector<at::Tensor> ws;
    ws.reserve(used.size());
    for (int64_t e : used) {
      const std::vector<Part>& parts = projections[e].parts;
      TORCH_CHECK(parts.size() == first.size() && parts[i].quant == first[i].quant && parts[i].cols == first[i].cols &&
                      parts[i].passes == first[i].passes && parts[i].weight.size(0) == first[i].weight.size(0) &&
                      !projections[e].bias,
                  "experts_product: expert ", e, "'s parts differ from expert ", used[0], "'s (or it has a bias)");
      ws.push_back(parts[i].weight);
    }
    ops.mm_x16_grouped.call(xc, ws, starts, first[i].quant, first[i].cols, first[i].passes, kChosenIsa, out, col0);
    col0 += first[i].weight.size(0);
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// out[i] = sum over j < k of rows[j][i] * weights[j], as fused_moe.moe_reference takes it
// (the rows times their weights rounded to T, in T; then summed over the k in order in
// torch.sum's accumulator, float32 for every T) in one pass instead of three operators.
// No multiply-add may be fused across a product's rounding: GCC fuses `p = a * b; s += p`
// at -O3 with FMA whatever the -std, hence fp-contract off here (clang: off by the pragma).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
template <typename T>
void weighted_sum(const T* rows, const float* weights, int64_t k, int64_t n, T* out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  std::vector<float> acc(n, 0.f);
  for (int64_t j = 0; j < k; ++j) {
    const T w = static_cast<T>(weights[j]);
    const T* row = rows + j * n;
    for (int64_t i = 0; i < n; ++i) {
      const T product = static_cast<T>(row[i] * w);
      acc[i] += static_cast<float>(product);
    }
  }
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(acc[i]);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// The experts' output for rows x [M, N] routed to topk_ids with topk_weights [M, k]
// (MoeExperts.forward; module doc): the (row, expert) pairs sorted by expert (stable), each
// used expert's products over its rows, the rows scaled by their weights in x's dtype and
// summed over the k per row.
at::Tensor experts_forward(const Ops& ops, const std::vector<Projection>& gate_up, const std::vector<Projection>& down,
                           const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                           int64_t act) {
  const int64_t k = topk_ids.size(1), n = x.size(1), experts = static_cast<int64_t>(gate_up.size());
  const at::Tensor flat = topk_ids.reshape({-1});
  const at::Tensor order = at::argsort(flat, /*stable=*/true);
  const at::Tensor counts = at::bincount(flat, {}, experts);
  TORCH_CHECK(counts.size(0) == experts, "MoeExperts.forward: an expert id past the ", experts, " experts");
  const at::Tensor rows = x.index_select(0, at::floor_divide(order, k));  // x[order // k]: the same gather
  const int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int64_t> used, starts{0};  // the experts that got rows; where their rows start
  for (int64_t e = 0; e < experts; ++e) {
    if (count[e] == 0) continue;
    used.push_back(e);
    starts.push_back(starts.back() + count[e]);
  }
  if (used.empty()) return at::zeros_like(x);  // no rows
  const at::Tensor hidden = ops.act_and_mul.call(experts_product(ops, gate_up, used, starts, rows), act);
  at::Tensor out_rows = experts_product(ops, down, used, starts, hidden);
  out_rows.mul_(topk_weights.reshape({-1}).index_select(0, order).unsqueeze(-1).to(x.scalar_type()));
  return at::sum(out_rows.index_select(0, at::argsort(order)).view({-1, k, n}), {1});
}

// A mixture-of-experts feed-forward (module doc); top_k 0: the layer's is a gated MLP.
struct Moe {
  int64_t top_k = 0;
  bool renormalize = false, shared = false;
  Linear router, shared_gate;
  std::vector<Projection> gate_up, down;  // per expert
  Projection shared_gate_up, shared_down;
};

struct Norm {
  std::optional<at::Tensor> weight;  // none: the layer has no such norm
  double eps = 1e-6;
  bool gemma = false;
};

struct Layer {
  int64_t heads, kv_heads, head_dim, window, rope, act;
  double scale, softcap;
  bool sandwich;
  double residual_scale;  // Granite's residual_multiplier: each block's output times it
  Norm input, post_attention, pre_feedforward, post_feedforward, q_norm, k_norm;
  Projection qkv, o, gate_up, down;
  Moe moe;
};

class DecoderLayers : public torch::CustomClassHolder {
 public:
  // A layer (module doc); its norms and projections are set next, by name.
  void add_layer(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double softcap, int64_t window,
                 int64_t rope, int64_t act, bool sandwich, double residual_scale) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0,
                "DecoderLayers.add_layer: heads a multiple of kv_heads > 0, head_dim > 0 expected");
    TORCH_CHECK(rope >= 0 && window >= 0 && act >= 0, "DecoderLayers.add_layer: rope, window, act >= 0 expected");
    TORCH_CHECK(!sandwich || residual_scale == 1.0, "DecoderLayers.add_layer: a residual scale with sandwich norms");
    layers_.push_back(Layer{heads, kv_heads, head_dim, window, rope, act, scale, softcap, sandwich, residual_scale});
  }

  // which: input, post_attention, pre_feedforward, post_feedforward, q_norm, k_norm.
  void set_norm(const std::string& which, const at::Tensor& weight, double eps, bool gemma) {
    Norm& norm = *norm_of(last("set_norm"), which);
    norm.weight = weight.contiguous();
    norm.eps = eps;
    norm.gemma = gemma;
  }

  // which: qkv, o, gate_up, down; parts in row order.
  void add_part(const std::string& which, const at::Tensor& weight, int64_t quant, int64_t cols, int64_t passes) {
    check_part("DecoderLayers.add_part", weight, passes);
    Projection* p = projection_of(last("add_part"), which);
    TORCH_CHECK(!p->onednn, "DecoderLayers.add_part: ", which, " is a dense weight");
    p->parts.push_back(Part{weight, quant, cols, passes});
  }

  void set_bias(const std::string& which, const at::Tensor& bias) {
    projection_of(last("set_bias"), which)->bias = bias;
  }

  // which: qkv, o, gate_up, down: a dense weight in oneDNN's layout (cpu_linear), its bias.
  void set_onednn(const std::string& which, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    Projection* p = projection_of(last("set_onednn"), which);
    TORCH_CHECK(p->parts.empty() && !p->onednn, "DecoderLayers.set_onednn: ", which, " is set already");
    p->onednn = weight;
    p->bias = bias;
  }

  // The last layer's feed-forward is a mixture of `experts` experts, `top_k` per token;
  // `shared`: with a shared expert. Its parts come next (add_expert_part, add_part and
  // set_dense for router, shared_gate, shared_gate_up, shared_down).
  void set_moe(int64_t experts, int64_t top_k, bool renormalize, bool shared) {
    TORCH_CHECK(experts > 0 && top_k > 0 && top_k <= experts,
                "DecoderLayers.set_moe: 0 < top_k <= experts expected");
    Moe& m = last("set_moe").moe;
    m.top_k = top_k;
    m.renormalize = renormalize;
    m.shared = shared;
    m.gate_up.assign(experts, Projection{});
    m.down.assign(experts, Projection{});
  }

  // which: gate_up, down, of expert `expert`; parts in row order.
  void add_expert_part(const std::string& which, int64_t expert, const at::Tensor& weight, int64_t quant,
                       int64_t cols, int64_t passes) {
    Moe& m = last("add_expert_part").moe;
    TORCH_CHECK(expert >= 0 && expert < static_cast<int64_t>(m.gate_up.size()),
                "DecoderLayers.add_expert_part: no expert ", expert, " (set_moe first)");
    TORCH_CHECK(which == "gate_up" || which == "down", "DecoderLayers.add_expert_part: no projection named ", which);
    check_part("DecoderLayers.add_expert_part", weight, passes);
    (which == "gate_up" ? m.gate_up : m.down)[expert].parts.push_back(Part{weight, quant, cols, passes});
  }

  // which: router, shared_gate; a dense weight [out, in] (and its bias, if any).
  void set_dense(const std::string& which, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    Linear& linear = linear_of(last("set_dense"), which);
    linear.dense = weight;
    linear.packed.bias = bias;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [B, N] after the embedding (B decode rows); cos[r], sin[r]: the step's rotary
  // table of rope key r (a row each); kv_caches[i]: layer i's cache; block_table [B,
  // max_blocks], seq_lens [B], slot_mapping [B] as AttentionMetadata holds them for the
  // decode rows.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& hidden_in, const std::vector<at::Tensor>& cos,
                                             const std::vector<at::Tensor>& sin,
                                             const std::vector<at::Tensor>& kv_caches, const at::Tensor& block_table,
                                             const at::Tensor& seq_lens, const at::Tensor& slot_mapping) const {
    TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.size(0) >= 1 && hidden_in.is_contiguous(),
                "DecoderLayers.forward: contiguous rows of hidden state [B, N] expected");
    const int64_t rows = hidden_in.size(0);
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), "DecoderLayers.forward: ", num_layers(),
                " kv caches expected, got ", kv_caches.size());
    TORCH_CHECK(cos.size() == sin.size(), "DecoderLayers.forward: as many cos as sin tables expected");
    const Ops& ops = Ops::get();
    at::Tensor hidden = hidden_in, residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()), "DecoderLayers.forward: no rotary table ", l.rope);
      at::Tensor h;
      if (!residual.defined()) {
        residual = hidden;
        h = norm(ops, l.input, hidden);
      } else {
        h = add_norm(ops, l.input, hidden, residual);
      }
      at::Tensor qkv = l.qkv(ops, h);
      at::Tensor kv_cache = kv_caches[i];
      ops.qk_rope_cache.call(qkv, l.heads, l.kv_heads, cos[l.rope], sin[l.rope], kv_cache, slot_mapping,
                             l.q_norm.weight, l.k_norm.weight, l.q_norm.weight ? l.q_norm.eps : 1e-6,
                             l.q_norm.gemma, kUnitScale, kUnitScale);
      // (as TorchAttention: the decode rows' q made contiguous, a copy from B = 2 on)
      const at::Tensor q = qkv.narrow(1, 0, l.heads * l.head_dim).contiguous().view({rows, l.heads, l.head_dim});
      const at::Tensor attended =
          ops.paged_decode.call(q, kv_cache, block_table, seq_lens, l.scale, l.softcap, l.window, kUnitScale,
                                kUnitScale);
      at::Tensor a = l.o(ops, attended.view({rows, l.heads * l.head_dim}));
      if (l.sandwich) a = norm(ops, l.post_attention, a);
      if (l.residual_scale != 1.0) a = at::mul(a, l.residual_scale);
      h = add_norm(ops, l.sandwich ? l.pre_feedforward : l.post_attention, a, residual);
      hidden = l.moe.top_k ? moe(ops, l, h) : l.down(ops, ops.act_and_mul.call(l.gate_up(ops, h), l.act));
      if (l.sandwich) hidden = norm(ops, l.post_feedforward, hidden);
      if (l.residual_scale != 1.0) hidden = at::mul(hidden, l.residual_scale);
    }
    return {hidden, residual};
  }

 private:
  std::vector<Layer> layers_;

  Layer& last(const char* method) {
    TORCH_CHECK(!layers_.empty(), "DecoderLayers.", method, ": add_layer first");
    return layers_.back();
  }

  static Norm* norm_of(Layer& l, const std::string& which) {
    if (which == "input") return &l.input;
    if (which == "post_attention") return &l.post_attention;
    if (which == "pre_feedforward") return &l.pre_feedforward;
    if (which == "post_feedforward") return &l.post_feedforward;
    if (which == "q_norm") return &l.q_norm;
    if (which == "k_norm") return &l.k_norm;
    TORCH_CHECK(false, "DecoderLayers.set_norm: no norm named ", which);
  }

  static Projection* projection_of(Layer& l, const std::string& which) {
    if (which == "qkv") return &l.qkv;
    if (which == "o") return &l.o;
    if (which == "gate_up") return &l.gate_up;
    if (which == "down") return &l.down;
    if (which == "shared_gate_up") return &l.moe.shared_gate_up;
    if (which == "shared_down") return &l.moe.shared_down;
    if (which == "router" || which == "shared_gate") return &linear_of(l, which).packed;
    TORCH_CHECK(false, "DecoderLayers: no projection named ", which);
  }

  static Linear& linear_of(Layer& l, const std::string& which) {
    if (which == "router") return l.moe.router;
    if (which == "shared_gate") return l.moe.shared_gate;
    TORCH_CHECK(false, "DecoderLayers: no router or gate named ", which);
  }

  // The experts of rows h [B, N] (module doc), as mlp.SparseMoeBlock computes them: B
  // rows through its CppExperts (MoeExperts.forward's experts_forward), one row as
  // fused_moe.moe_reference does (the same result: weighted_sum).
  static at::Tensor moe(const Ops& ops, const Layer& l, const at::Tensor& h) {
    const Moe& m = l.moe;
    at::Tensor weights, ids;
    if (m.router.dense && !m.router.packed.bias && m.router.dense->scalar_type() == h.scalar_type()) {
      // as CpuFusedLayerOps.route: one operator
      std::tie(weights, ids) = ops.moe_route.call(h, *m.router.dense, m.top_k, m.renormalize);
    } else {
      std::tie(weights, ids) = at::topk(at::softmax(m.router(ops, h), -1, at::kFloat), m.top_k, -1);
      if (m.renormalize) weights = at::div(weights, at::sum(weights, {-1}, true));
    }
    at::Tensor out = h.size(0) > 1 ? experts_forward(ops, m.gate_up, m.down, h, weights, ids, l.act)
                                   : one_row_experts(ops, l, h, weights, ids);
    if (!m.shared) return out;
    const at::Tensor shared = m.shared_down(ops, ops.act_and_mul.call(m.shared_gate_up(ops, h), l.act));
    return at::add(out, at::mul(at::sigmoid(m.shared_gate(ops, h)), shared));
  }

  // The chosen experts of one row h [1, N]: each expert's product over the one row
  // (gguf_mm_x16_grouped quantizes it once), the rows summed by weighted_sum.
  static at::Tensor one_row_experts(const Ops& ops, const Layer& l, const at::Tensor& h, const at::Tensor& weights,
                                    const at::Tensor& ids) {
    const Moe& m = l.moe;
    const int64_t n = h.size(1), experts = static_cast<int64_t>(m.gate_up.size());
    const at::Tensor chosen = ids.contiguous();
    const int64_t* id = chosen.data_ptr<int64_t>();
    std::vector<int64_t> used(id, id + m.top_k), starts(m.top_k + 1);
    for (int64_t i = 0; i < m.top_k; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < experts, "DecoderLayers.forward: the router chose expert ", id[i]);
      starts[i + 1] = i + 1;  // row i: h, through the i-th chosen expert
    }
    const at::Tensor rows = experts_product(
        ops, m.down, used, starts, ops.act_and_mul.call(experts_product(ops, m.gate_up, used, starts, h), l.act));
    at::Tensor out = at::empty({1, n}, h.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "DecoderLayers.moe", [&] {
      weighted_sum<scalar_t>(rows.const_data_ptr<scalar_t>(), weights.contiguous().const_data_ptr<float>(), m.top_k, n,
                             out.data_ptr<scalar_t>());
    });
    return out;
  }

  static const at::Tensor& weight_of(const Norm& n) {
    TORCH_CHECK(n.weight.has_value(), "DecoderLayers.forward: a layer's norm was not set");
    return *n.weight;
  }

  static at::Tensor norm(const Ops& ops, const Norm& n, const at::Tensor& x) {
    return ops.rms_norm.call(x, weight_of(n), n.eps, n.gemma);
  }

  // norm(x + residual); x becomes the sum and `residual` that tensor (the new residual).
  static at::Tensor add_norm(const Ops& ops, const Norm& n, at::Tensor& x, at::Tensor& residual) {
    at::Tensor out = ops.add_rms_norm.call(x, residual, weight_of(n), n.eps, n.gemma);
    residual = x;
    return out;
  }
};

class MoeExperts : public torch::CustomClassHolder {
 public:
  explicit MoeExperts(int64_t experts) : gate_up_(experts), down_(experts) {
    TORCH_CHECK(experts > 0, "MoeExperts: experts > 0 expected");
  }

  // which: gate_up, down, of expert `expert`; parts in row order.
  void add_part(const std::string& which, int64_t expert, const at::Tensor& weight, int64_t quant, int64_t cols,
                int64_t passes) {
    TORCH_CHECK(expert >= 0 && expert < static_cast<int64_t>(gate_up_.size()), "MoeExperts.add_part: no expert ",
                expert);
    TORCH_CHECK(which == "gate_up" || which == "down", "MoeExperts.add_part: no projection named ", which);
    check_part("MoeExperts.add_part", weight, passes);
    (which == "gate_up" ? gate_up_ : down_)[expert].parts.push_back(Part{weight, quant, cols, passes});
  }

  // x [M, N]; topk_weights float32 [M, k], topk_ids int64 [M, k]; act an ACT_CODES code.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                     int64_t act) const {
    TORCH_CHECK(x.dim() == 2 && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                    topk_weights.sizes() == topk_ids.sizes() && topk_ids.scalar_type() == at::kLong,
                "MoeExperts.forward: x [M, N], topk_weights and int64 topk_ids [M, k] expected");
    return experts_forward(Ops::get(), gate_up_, down_, x, topk_weights, topk_ids, act);
  }

 private:
  std::vector<Projection> gate_up_, down_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmd_cpu, m) {
  m.class_<MoeExperts>("MoeExperts")
      .def(torch::init<int64_t>())
      .def("add_part", &MoeExperts::add_part)
      .def("forward", &MoeExperts::forward);
  m.class_<DecoderLayers>("DecoderLayers")
      .def(torch::init<>())
      .def("add_layer", &DecoderLayers::add_layer)
      .def("set_norm", &DecoderLayers::set_norm)
      .def("add_part", &DecoderLayers::add_part)
      .def("set_bias", &DecoderLayers::set_bias)
      .def("set_onednn", &DecoderLayers::set_onednn)
      .def("set_moe", &DecoderLayers::set_moe)
      .def("add_expert_part", &DecoderLayers::add_expert_part)
      .def("set_dense", &DecoderLayers::set_dense)
      .def("num_layers", &DecoderLayers::num_layers)
      .def("forward", &DecoderLayers::forward);
}
